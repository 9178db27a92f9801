"""Tiered checkpoints (docs/manager.md, "Tiers"): what a save blocks for, and
what a restore takes, with a local tier beside an object store.

`python -m benchmarks.tiers [--mib 256] [--leaves 8] [--mbps 200] [--reps 3] [--local DIR] [--json FILE]`

One process, one CPU device. The state is `--leaves` float32 JAX arrays of
`--mib` MiB in all (random values: no contender compresses). The persistent
tier is moto's S3 server on 127.0.0.1 in this process, behind a TCP proxy
that limits each direction to `--mbps` MB/s (10**6 bytes) in total
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
one from the local tier (the tiered manager), each into an abstract `like`,
compared bit for bit with the saved state. Prints a Markdown table of
medians and the targets of "Checkpoints in tiers": blocking time of a tiered
save <= 0.2x a persistent-only (blocking) save, and a restore from the local
tier <= 0.2x one from the bucket. `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .compression import aws_environment, delete_objects, object_store, rotated, s3_spec

CONTENDERS = ["persistent", "persistent-async", "tiered", "tiered-async"]


def state_of(mib: int, leaves: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    size = mib * 2**20 // 4 // leaves
    return {f"layer{i}": jnp.asarray(rng.standard_normal(size, dtype=np.float32)) for i in range(leaves)}


def manager_of(contender: str, where: dict[str, Any], local: str) -> Any:
    import eqx_ckpt

    if contender == "persistent":
        return eqx_ckpt.CheckpointManager(where)
    if contender == "persistent-async":
        return eqx_ckpt.CheckpointManager(where, blocking=False)
    return eqx_ckpt.CheckpointManager(where, local=local, persistent_every=1, blocking=contender == "tiered")


def one_save(contender: str, state: Any, where: dict[str, Any], local: str) -> dict[str, float]:
    manager = manager_of(contender, where, local)
    manager.save(0, {"warm": jnp.ones(1024)})  # imports, thread pools, the first request
    manager.wait_until_finished()
    start = time.perf_counter()
    manager.save(1, state)
    saved = time.perf_counter() - start
    manager.wait_until_finished()
    done = time.perf_counter() - start
    manager.close()
    return {"save_s": saved, "done_s": done}


def restores(state: Any, where: dict[str, Any], local: str) -> dict[str, float]:
    import eqx_ckpt

    like = eqx.filter_eval_shape(lambda: state)
    out: dict[str, float] = {}
    for name, manager in (
        ("restore_persistent_s", eqx_ckpt.CheckpointManager(where)),
        ("restore_local_s", eqx_ckpt.CheckpointManager(where, local=local, persistent_every=1)),
    ):
        start = time.perf_counter()
        loaded = manager.restore(like, step=1)
        jax.block_until_ready(loaded)
        out[name] = time.perf_counter() - start
        if not eqx.tree_equal(loaded, state):
            raise AssertionError(f"{name}: the restored state differs from the saved one")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--mbps", type=float, default=200.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--local", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from .replicas import BUCKET

    state = state_of(args.mib, args.leaves)
    rows: list[dict[str, Any]] = []
    with aws_environment(), object_store(args.mbps) as (server, link):
        for rep in range(args.reps):
            for contender in rotated(CONTENDERS, rep):
                where = s3_spec(link.endpoint if args.mbps else server.endpoint, BUCKET, f"{contender}-{rep}/")
                local = tempfile.mkdtemp(prefix="eqx_ckpt-tiers-", dir=args.local)
                try:
                    row = {"contender": contender, "rep": rep, **one_save(contender, state, where, local)}
                    if contender == "tiered":
                        row.update(restores(state, where, local))
                finally:
                    shutil.rmtree(local, ignore_errors=True)
                    delete_objects({**where, "endpoint": server.endpoint})
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    print(report(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def median(contender: str, key: str) -> float:
        return statistics.median(row[key] for row in rows if row["contender"] == contender)

    lines = [
        f"{args.mib} MiB in {args.leaves} float32 leaves; the bucket behind a link of {args.mbps:g} MB/s; "
        f"the local tier in {args.local}; medians of {args.reps} rounds",
        "",
        "| contender | save blocks (s) | in the bucket after (s) |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {median(c, 'save_s'):.3f} | {median(c, 'done_s'):.3f} |" for c in CONTENDERS]
    local, remote = median("tiered", "restore_local_s"), median("tiered", "restore_persistent_s")
    lines += ["", "| restore from | time (s) |", "|---|---|", f"| the bucket | {remote:.3f} |"]
    lines += [f"| the local tier | {local:.3f} |", ""]
    blocking = median("tiered", "save_s") / median("persistent", "save_s")
    lines.append(
        f"- tiered save blocks {blocking:.3f}x a persistent-only save (target <= 0.2x): "
        f"{'met' if blocking <= 0.2 else 'not met'}"
    )
    lines.append(
        f"- restore from the local tier {local / remote:.3f}x one from the bucket (target <= 0.2x): "
        f"{'met' if local / remote <= 0.2 else 'not met'}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
