"""Tiered checkpoints (docs/manager.md, "Tiers"): what a save blocks for, and
what a restore takes, with a local tier beside an object store.

`python -m benchmarks.tiers [--mib 256] [--leaves 8] [--mbps 200] [--reps 3] [--local DIR] [--processes 1]
[--timeout 1800] [--json FILE]`

By default one process, one CPU device. The state is `--leaves` float32 JAX
arrays of `--mib` MiB in all (random values: no contender compresses). The
persistent tier is moto's S3 server on 127.0.0.1 in this process, behind a
TCP proxy that limits each direction to `--mbps` MB/s (10**6 bytes) in total
(`benchmarks.compression.object_store`, as the compression benchmark limits
it). The local tier is a fresh folder in `--local` (default `/dev/shm`, a RAM
disk, where there is one).

Each round (`--reps`, the contenders' order rotating) saves the state once
with each contender, into a fresh place, after one untimed warm-up save of a
small tree with the same manager options:

- `persistent`: `CheckpointManager(bucket)`, a blocking save: what a save
  blocks for without tiers.
- `persistent-async`: the same with `blocking=False`: `save` returns once the
  arrays are on the host, and the upload goes on (the save after waits).
- `tiered`: `CheckpointManager(bucket, local=DIR, persistent_every=1)`: `save`
  returns once the local step is committed; the copy to the bucket goes on.
- `tiered-async`: the same with `blocking=False`: the local write goes on in
  the background too.

Timed for each: `save` (what training blocks for), and `done`, the time until
`wait_until_finished()` returns (the step is in the bucket). Then, from the
tiered run's step: a restore from the bucket (a manager without `local=`) and
one from the local tier (the tiered manager), each into an abstract `like`
with the state's shardings, compared bit for bit with the saved state. Prints
a Markdown table of medians and the targets of "Checkpoints in tiers":
blocking time of a tiered save <= 0.2x a persistent-only (blocking) save, and
a restore from the local tier <= 0.2x one from the bucket. A restore from the
local tier that warned with an `IntegrityWarning` read the bucket instead: its
row keeps the warnings (`restore_local_fell_back`), and the report counts them.
`--json` writes every figure.

`--peers K` (with `--processes`) gives the tiered managers `peers=K`, and
times a third restore, once process 1's local tier is emptied (its part then
comes from its peer): target <= 1.5x the restore from the local tier.

`--processes N` (N > 1) runs the rounds in N worker processes instead, a
`jax.distributed` job on 127.0.0.1 with one CPU device each (this module run
as `--worker I JOB`), the server and the link staying in this process. Each
leaf is then sharded by rows over the processes; each process makes its own
rows (from a seed and its index) and has its own local tier, a folder
`local_<i>` of a fresh folder in `--local` (as each host its own RAM disk).
Every process saves and restores through its own managers, each timed phase
starting at a barrier; each process compares the shards it holds. The workers
write their figures to a JSON file each; a row's figure is the slowest
process's (the job waits for it), and the row keeps every process's under
`processes`. A worker that fails, or a job past `--timeout` seconds, ends
every worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .compression import aws_environment, delete_objects, object_store, rotated, s3_spec
from .gpu import PeakRSS

CONTENDERS = ["persistent", "persistent-async", "tiered", "tiered-async"]
COLUMNS = 1024  # of each leaf, with several processes
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state_of(mib: int, leaves: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    size = mib * 2**20 // 4 // leaves
    return {f"layer{i}": jnp.asarray(rng.standard_normal(size, dtype=np.float32)) for i in range(leaves)}


def manager_of(contender: str, where: dict[str, Any], local: str, peers: int = 0) -> Any:
    import eqx_ckpt

    if contender == "persistent":
        return eqx_ckpt.CheckpointManager(where)
    if contender == "persistent-async":
        return eqx_ckpt.CheckpointManager(where, blocking=False)
    blocking = contender == "tiered"
    return eqx_ckpt.CheckpointManager(where, local=local, persistent_every=1, blocking=blocking, peers=peers)


def alone(name: str) -> None:
    """The barrier of one process: none."""


def one_save(
    contender: str,
    state: Any,
    where: dict[str, Any],
    local: str,
    warm: Any,
    sync: Callable[[str], None] = alone,
    peers: int = 0,
) -> dict[str, float]:
    manager = manager_of(contender, where, local, peers)
    manager.save(0, warm)  # imports, thread pools, the first request
    manager.wait_until_finished()
    sync(f"save {where['path']}")
    with PeakRSS() as rss:  # (what the save, its copies and its moves hold at once)
        start = time.perf_counter()
        manager.save(1, state)
        saved = time.perf_counter() - start
        manager.wait_until_finished()
        done = time.perf_counter() - start
    manager.close()
    return {"save_s": saved, "done_s": done, "rss_added_mib": rss.added / 2**20}


def restores(
    state: Any, where: dict[str, Any], local: str, sync: Callable[[str], None] = alone, peers: int = 0
) -> dict[str, Any]:
    """Restore the tiered run's step from the bucket, from the local tier and,
    with `peers`, once process 1's local tier is emptied (its part then
    comes from its peer); each timed, each compared bit for bit."""
    import eqx_ckpt

    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    out: dict[str, Any] = {}
    kinds = ["restore_persistent_s", "restore_local_s"] + (["restore_peer_s"] if peers else [])
    for name in kinds:
        if name == "restore_peer_s" and jax.process_index() == 1:
            shutil.rmtree(local)  # its host replaced by an empty one
        sync(f"{name} {where['path']}")
        tiers = {} if name == "restore_persistent_s" else {"local": local, "persistent_every": 1, "peers": peers}
        manager = eqx_ckpt.CheckpointManager(where, **tiers)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", eqx_ckpt.IntegrityWarning)
            start = time.perf_counter()
            loaded = manager.restore(like, step=1)
            jax.block_until_ready(loaded)
            out[name] = time.perf_counter() - start
        manager.close()
        fell_back = [str(w.message) for w in caught if issubclass(w.category, eqx_ckpt.IntegrityWarning)]
        if fell_back:
            out.setdefault("restore_local_fell_back", []).extend(fell_back)  # the bucket's step was read
        if not same_bits(loaded, state):
            raise AssertionError(f"{name}: the state process {jax.process_index()} restored differs from the saved one")
    return out


def same_bits(loaded: Any, state: Any) -> bool:
    """Whether every shard this process holds of `loaded` has the bytes of
    `state`'s shard on the same device, at the same place."""
    paths = [[path for path, _ in jax.tree_util.tree_leaves_with_path(tree)] for tree in (loaded, state)]
    if paths[0] != paths[1]:
        return False
    for got, saved in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
        shards = {shard.device: shard for shard in got.addressable_shards}
        for shard in saved.addressable_shards:
            other = shards.get(shard.device)
            if other is None or other.index != shard.index:
                return False
            if np.asarray(other.data).tobytes() != np.asarray(shard.data).tobytes():
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(int(argv[1]), json.loads(argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--mbps", type=float, default=200.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--local", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--peers", type=int, default=0, help="with --processes: each part's copies on other processes")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the worker processes may take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.peers and args.processes < 2:
        parser.error("--peers needs --processes 2 or more: a part's copies are held by other processes")
    if args.processes > 1 and args.mib * 2**20 // 4 // args.leaves // args.processes < COLUMNS:
        parser.error(f"--mib {args.mib} gives a process less than a row of {COLUMNS} floats of each leaf")
    with aws_environment() as env, object_store(args.mbps) as (server, link):
        rows = one_process(args, server, link) if args.processes == 1 else several(args, server, link, env)
    print(report(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


def one_process(args: argparse.Namespace, server: Any, link: Any) -> list[dict[str, Any]]:
    """Every round, in this process."""
    from .replicas import BUCKET

    state, warm = state_of(args.mib, args.leaves), {"warm": jnp.ones(1024)}
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for contender in rotated(CONTENDERS, rep):
            where = s3_spec(link.endpoint if args.mbps else server.endpoint, BUCKET, f"{contender}-{rep}/")
            local = tempfile.mkdtemp(prefix="eqx_ckpt-tiers-", dir=args.local)
            try:
                row = {"contender": contender, "rep": rep, **one_save(contender, state, where, local, warm)}
                if contender == "tiered":
                    row.update(restores(state, where, local))
            finally:
                shutil.rmtree(local, ignore_errors=True)
                delete_objects({**where, "endpoint": server.endpoint})
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


# -- Several processes -----------------------------------------------------------------------------


def several(args: argparse.Namespace, server: Any, link: Any, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every round, in `args.processes` worker processes; a row for each
    round and contender, its figures the slowest process's."""
    scratch = tempfile.mkdtemp(prefix="eqx_ckpt-tiers-", dir=args.local)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {"count": args.processes, "port": port, "scratch": scratch, "server": server.endpoint}
    job.update(endpoint=link.endpoint if args.mbps else server.endpoint, mib=args.mib, leaves=args.leaves)
    job.update(reps=args.reps, peers=args.peers)
    env = {**env, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "benchmarks.tiers", "--worker"]
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(args.processes):
            workers.append(subprocess.Popen([*command, str(i), json.dumps(job)], env=env, cwd=ROOT))
        wait_all(workers, args.timeout)
        parts = []
        for i in range(args.processes):
            with open(os.path.join(scratch, f"process_{i}.json")) as f:
                parts.append(json.load(f)["rows"])
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
            process.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = slowest(parts)
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    return rows


def wait_all(workers: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every worker has ended well; raise once one has failed, or
    after `timeout` seconds (the caller ends those still running)."""
    end = time.monotonic() + timeout
    while True:
        codes = [process.poll() for process in workers]
        if any(codes):
            raise RuntimeError(f"a worker process failed (exit statuses so far: {codes})")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > end:
            raise TimeoutError(f"the {len(workers)} worker processes took more than {timeout:g} s")
        time.sleep(0.1)


def slowest(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The processes' rows merged, round by round: each figure the slowest
    process's, and every process's figures under `processes`."""
    rows = []
    for group in zip(*parts):
        if len({(row["contender"], row["rep"]) for row in group}) != 1:
            raise AssertionError(f"the processes' rounds differ: {group}")
        figures = [key for key in group[0] if key.endswith(("_s", "_mib"))]
        row: dict[str, Any] = {"contender": group[0]["contender"], "rep": group[0]["rep"]}
        row.update({key: max(part[key] for part in group) for key in figures})
        row["processes"] = [{k: v for k, v in part.items() if k not in ("contender", "rep")} for part in group]
        rows.append(row)
    return rows


def worker(index: int, job: dict[str, Any]) -> int:
    """Process `index` of the job: every round; its rows to
    `<scratch>/process_<index>.json`. An error ends it at once, with status 1
    (not through `jax.distributed`'s exit, which would wait for the others)."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 1)
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{job['port']}",
            num_processes=job["count"],
            process_id=index,
            initialization_timeout=60,
        )
        rows = worker_rounds(index, job)
        with open(os.path.join(job["scratch"], f"process_{index}.json"), "w") as f:
            json.dump({"process": index, "rows": rows}, f)
        jax.distributed.shutdown()  # a barrier: process 0 runs the coordination service
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


def worker_rounds(index: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round of one worker process: its own figures."""
    from jax.experimental import multihost_utils

    from .replicas import BUCKET

    sync = multihost_utils.sync_global_devices
    rows_of = job["mib"] * 2**20 // 4 // job["leaves"] // job["count"] // COLUMNS
    rng = np.random.default_rng([0, index])
    state = {f"layer{i}": sharded_rows((rows_of, COLUMNS), rng) for i in range(job["leaves"])}
    warm = {"warm": sharded_rows((1, COLUMNS), None)}
    out: list[dict[str, Any]] = []
    for rep in range(job["reps"]):
        for contender in rotated(CONTENDERS, rep):
            where = s3_spec(job["endpoint"], BUCKET, f"{contender}-{rep}/")
            local = os.path.join(job["scratch"], f"local_{index}", f"{contender}-{rep}")
            peers = job["peers"]
            row = {"contender": contender, "rep": rep, **one_save(contender, state, where, local, warm, sync, peers)}
            if contender == "tiered":
                row.update(restores(state, where, local, sync, peers))
            shutil.rmtree(local, ignore_errors=True)
            sync(f"done {contender}-{rep}")
            if index == 0:
                delete_objects({**where, "endpoint": job["server"]})
            out.append(row)
    return out


def sharded_rows(shape: tuple[int, int], rng: np.random.Generator | None) -> jax.Array:
    """A global array of `shape[0]` rows a process (random ones from `rng`, or
    ones), sharded by rows over the processes: this process's rows on its device."""
    part = np.ones(shape, np.float32) if rng is None else rng.standard_normal(shape, dtype=np.float32)
    mesh = jax.make_mesh((jax.process_count(),), ("p",), devices=jax.devices())
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    shape = (jax.process_count() * shape[0], shape[1])
    return jax.make_array_from_single_device_arrays(shape, sharding, [jax.device_put(part, jax.local_devices()[0])])


# -- The report ------------------------------------------------------------------------------------


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def median(contender: str, key: str) -> float:
        return statistics.median(row[key] for row in rows if row["contender"] == contender)

    who = "one process" if args.processes == 1 else f"{args.processes} processes (the slowest process's times)"
    lines = [
        f"{args.mib} MiB in {args.leaves} float32 leaves; {who}; the bucket behind a link of {args.mbps:g} MB/s; "
        f"the local tier in {args.local}; medians of {args.reps} rounds",
        "",
        "| contender | save blocks (s) | in the bucket after (s) |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {median(c, 'save_s'):.3f} | {median(c, 'done_s'):.3f} |" for c in CONTENDERS]
    local, remote = median("tiered", "restore_local_s"), median("tiered", "restore_persistent_s")
    lines += ["", "| restore from | time (s) |", "|---|---|", f"| the bucket | {remote:.3f} |"]
    lines += [f"| the local tier | {local:.3f} |"]
    peer = median("tiered", "restore_peer_s") if args.processes > 1 and args.peers else None
    if peer is not None:
        lines += [f"| the local tier, process 1's part from its peer | {peer:.3f} |"]
    lines.append("")
    blocking = median("tiered", "save_s") / median("persistent", "save_s")
    lines.append(
        f"- tiered save blocks {blocking:.3f}x a persistent-only save (target <= 0.2x): "
        f"{'met' if blocking <= 0.2 else 'not met'}"
    )
    lines.append(
        f"- restore from the local tier {local / remote:.3f}x one from the bucket (target <= 0.2x): "
        f"{'met' if local / remote <= 0.2 else 'not met'}"
    )
    from eqx_ckpt._save import _staging

    added, budget = median("tiered", "rss_added_mib"), _staging.budget(None) / 2**20
    lines.append(
        f"- peak memory a tiered save, its copy and its moves add: {added:.0f} MiB (the staging budget: "
        f"{budget:.0f} MiB): {'within' if added <= budget else 'over'}"
    )
    if peer is not None:
        lines.append(
            f"- restore with a host's part from its peer {peer / local:.3f}x one from the local tier (target <= "
            f"1.5x): {'met' if peer / local <= 1.5 else 'not met'}"
        )
    parts = [part for row in rows for part in row.get("processes", [row])]  # each process's row
    fell_back = sum(len(part.get("restore_local_fell_back", [])) for part in parts)
    if fell_back:
        lines.append(f"- {fell_back} restores from the local tier read the bucket instead (an IntegrityWarning each)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
