"""A state held on the accelerator: eqx_ckpt against orbax-checkpoint and the raw floor (issue 50).

`python -m benchmarks.gpu [--gib 4] [--dtypes float32,bfloat16] [--reps 1] [--dir DIR] [--json FILE]
[--staging-mib MIB] [--compression NAME] [--contenders NAMES] [--processes] [--pool COUNTxMIB]
[--read-threads N] [--set MODULE.NAME=VALUE]`

For each dtype, a state of `--gib` GiB is made on the default JAX device with
`jax.random` (a dict of about 28 arrays of 64, 128 and 256 MiB; smaller ones
below 4 GiB, so a CPU check keeps the same count), then, side by side in this
one process, each into a fresh directory under `--dir`:

- `eqx_ckpt` `save`: `tree_serialise_leaves`, blocking (durable when it returns),
  with `staging_bytes` of `--staging-mib` where given (the peak RSS added
  of a save stays within it: docs/scaling.md, "Host memory of a save")
  and `compression` of `--compression` where given (its chunks compressed by
  eqx_ckpt's writing threads, and decompressed into the load pool's buffers);
  `save_async`: `blocking=False`, the time the caller is `blocked` (until the
  call returns) and `seconds` until `wait()` returns (committed, durable);
  `save_again`: a later blocking save, into another fresh directory;
  `load`: `tree_deserialise_leaves` into an abstract `like` carrying each
  array's sharding, so the arrays come back onto the device (`load_cold`:
  the same from a dropped page cache, where this machine allows dropping it);
  With its defaults, which on a GPU load through a pool of reused host
  buffers (`_memory.PINNED_LOAD_POOL`, `--pool` to set it) and copy a blocking
  save's pieces through pinned host memory (`_memory.PINNED_SAVE_COPIES`);
  `--read-threads` sets its threads that read local files, and `--set` any
  other knob of `_memory` or `_window` (`--set _memory.POOL_HUGE_PAGES=False`);
- `eqx_ckpt_unpinned`: the same with those two off (as before issue 74);
- `orbax`: `StandardCheckpointer` `save` (`save` + `wait_until_finished` + an
  fsync of every file, as `benchmarks/contenders.py` measures it), its
  asynchronous `save_async` (`blocked` in `save`, `seconds` until that end
  point) and `load` (`restore` into the same abstract tree);
- `numpy`, the raw floor: `np.save` of `jax.device_get` of each array, then an
  fsync of every file; `to_host`: `jax.device_get` alone (the bus's speed),
  of copies of the state made on the device before it is timed (the state's
  own arrays keep the host copy `device_get` made of them);
  `load`: `np.load` + `jax.device_put` of each.

Each operation is timed once per `--reps`; a load's files are read once before
it (page cache warm, `benchmarks/worker.py:set_cache`) and what it returns is
compared, bit for bit and on the device, with the state saved. Every figure
has its wall seconds, GB/s (10^9 bytes of the state a second) and the peak
resident memory of this process during the operation over what it held
before (psutil, sampled every 10 ms in a thread); an eqx_ckpt save's, the
bytes its chunk files take (`stored_bytes`). Prints a table; `--json`
writes the device's name, the versions and every figure, rewritten after each
measurement so a run stopped midway keeps what it measured; a contender that
fails is recorded with its error and the others go on. `--contenders` picks
some; `--processes` runs each in a process of its own (no allocation, pinned
memory or cache of one reaches the next), its rows gathered here. docs/benchmarks.md
("GPU: a 4 GiB state on the device") says how to run it and what it showed.
"""

from __future__ import annotations

import argparse
import ast
import functools
import gc
import glob
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psutil

import eqx_ckpt

from . import contenders, report, run, worker

LEAF_MIB = (64, 128, 256)  # at 4 GiB: 28 arrays; below it, as many, each smaller
FULL_GIB = 4.0
COLUMNS = 1024
SAMPLE_SECONDS = 0.01
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
CONTENDERS = ("eqx_ckpt", "eqx_ckpt_unpinned", "orbax", "numpy")
OPS = ("save", "save_again", "save_async", "to_host", "load", "load_cold")


def leaf_rows(gib: float, itemsize: int) -> list[int]:
    """The rows of each `(rows, COLUMNS)` leaf of a `gib` GiB state: `LEAF_MIB`
    in turn, scaled down below `FULL_GIB` (the last one what is left)."""
    total, row = int(gib * 2**30), COLUMNS * itemsize
    scale = min(1.0, gib / FULL_GIB)
    rows: list[int] = []
    while sum(rows) * row < total:
        wanted = min(int(LEAF_MIB[len(rows) % len(LEAF_MIB)] * 2**20 * scale), total - sum(rows) * row)
        rows.append(max(1, wanted // row))
    return rows


def make_state(gib: float, dtype: Any, seed: int = 0) -> dict[str, jax.Array]:
    """`gib` GiB of normal samples made on the default device (`leaf_rows`)."""
    key = jax.random.key(seed)
    rows = leaf_rows(gib, jnp.dtype(dtype).itemsize)
    state = {
        f"w{i:03d}": jax.random.normal(jax.random.fold_in(key, i), (n, COLUMNS), dtype) for i, n in enumerate(rows)
    }
    return jax.block_until_ready(state)


# eqx_ckpt's staging budget, in bytes (`--staging-mib`): the most host memory
# its saves stage at a time; `None` passes none (the library's default).
STAGING_BYTES: int | None = None
# eqx_ckpt's saves' `compression` (`--compression`); `None` passes none (no compression).
COMPRESSION: str | None = None


def abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in state.items()}


class PeakRSS:
    """The peak resident memory of this process during a `with` block, over what
    it held on entering (`added`), sampled every `SAMPLE_SECONDS` in a thread."""

    def __enter__(self) -> PeakRSS:
        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.before


def timed(operation: Callable[[], Any], nbytes: int) -> tuple[Any, dict[str, Any]]:
    """Run `operation` (after `gc.collect`) until the arrays it returns are
    ready, returning its value and its wall seconds, GB/s and peak RSS
    added. An `operation` that returns a pair `(value, blocked)` has its
    `blocked` seconds recorded too."""
    gc.collect()
    with PeakRSS() as rss:
        start = time.perf_counter()
        value = jax.block_until_ready(operation())
        seconds = time.perf_counter() - start
    figures = {"seconds": seconds, "gb_per_s": nbytes / 1e9 / seconds, "rss_added": rss.added}
    if isinstance(value, tuple):
        value, figures["blocked"] = value
    return value, figures


def eqx_ckpt_save_async(eqx: contenders.EqxCkpt, path: str, state: Any) -> tuple[None, float]:
    start = time.perf_counter()
    pending = eqx.save_async(path, state)
    blocked = time.perf_counter() - start
    pending.wait()
    return None, blocked


def orbax_save_async(path: str, state: Any) -> tuple[None, float]:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        start = time.perf_counter()
        ckptr.save(os.path.abspath(path), state)
        blocked = time.perf_counter() - start
        ckptr.wait_until_finished()
    contenders.fsync_tree(path)
    return None, blocked


def numpy_save(path: str, state: dict[str, jax.Array]) -> None:
    os.makedirs(path)
    for name, x in state.items():
        np.save(os.path.join(path, name + ".npy"), jax.device_get(x))
    contenders.fsync_tree(path)


def numpy_load(path: str, like: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    # `np.save` writes bfloat16 as raw 2-byte records (`|V2`): viewed back as the dtype.
    hosts = {k: np.load(os.path.join(path, k + ".npy")).view(x.dtype) for k, x in like.items()}
    return {k: jax.device_put(host, like[k].sharding) for k, host in hosts.items()}


def to_host(path: str, state: dict[str, jax.Array]) -> None:
    """The copy to the host alone (`jax.device_get`), at the bus's speed: with
    the write floor (`numpy` `save`), what a blocking save is measured against.
    `state` is fresh copies (`bench_contender`): `device_get` keeps the host
    copy it makes on the array, so a second one of the same array is free."""
    jax.device_get(state)


def unpinned(operation: Callable[..., Any]) -> Callable[..., Any]:
    """`operation` with eqx_ckpt's pinned load pool, pinned blocking-save
    copies and an asynchronous save's first copies on the device switched off
    (`_memory.PINNED_LOAD_POOL`, `PINNED_SAVE_COPIES`, `DEVICE_HOLD_FRACTION`)."""
    from eqx_ckpt._store import _memory

    @functools.wraps(operation)
    def switched(*args: Any) -> Any:
        before = _memory.PINNED_LOAD_POOL, _memory.PINNED_SAVE_COPIES, _memory.DEVICE_HOLD_FRACTION
        _memory.PINNED_LOAD_POOL, _memory.PINNED_SAVE_COPIES, _memory.DEVICE_HOLD_FRACTION = None, False, 0
        try:
            return operation(*args)
        finally:
            _memory.PINNED_LOAD_POOL, _memory.PINNED_SAVE_COPIES, _memory.DEVICE_HOLD_FRACTION = before

    return switched


def operations(name: str) -> dict[str, Callable[[str, Any], Any]]:
    """`name`'s save, asynchronous save and load, each `(path, state or like)`
    (eqx_ckpt's a second blocking save too, `save_again`)."""
    if name.startswith("eqx_ckpt"):
        eqx = contenders.EqxCkpt(STAGING_BYTES, COMPRESSION)
        save_async = functools.partial(eqx_ckpt_save_async, eqx)
        ops = {"save": eqx.save, "save_again": eqx.save, "save_async": save_async, "load": eqx.load}
        return {op: unpinned(f) for op, f in ops.items()} if name == "eqx_ckpt_unpinned" else ops
    if name == "orbax":
        orbax = contenders.Orbax()
        return {"save": orbax.save, "save_async": orbax_save_async, "load": orbax.load}
    return {"save": numpy_save, "to_host": to_host, "load": numpy_load}


@jax.jit
def same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize]
    return jnp.array_equal(jax.lax.bitcast_convert_type(a, bits), jax.lax.bitcast_convert_type(b, bits))


def verified(out: dict[str, Any], state: dict[str, jax.Array]) -> bool:
    """Every loaded array is on its original's device(s), with the same bits
    (compared there: cheap on an accelerator, and no copy to the host)."""
    return out.keys() == state.keys() and all(
        isinstance(out[k], jax.Array)
        and out[k].sharding.device_set == x.sharding.device_set
        and out[k].dtype == x.dtype
        and bool(same_bits(out[k], x))
        for k, x in state.items()
    )


def bench_state(state: dict[str, jax.Array], root: str, rep: int, record: Callable[[dict[str, Any]], None]) -> None:
    """Each contender's saves and load of `state` (`bench_contender`). A
    contender that fails is recorded with an `error` and the run goes on: on
    a lent accelerator there may be no time for a second run."""
    for name in CONTENDERS:
        base = {"dtype": state_dtype(state), "contender": name, "rep": rep}
        try:
            for row in bench_contender(name, state, root):
                record({**base, **row})
        except Exception as e:
            record({**base, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]})
        finally:
            for path in glob.glob(os.path.join(root, f"{base['dtype']}-{name}-*")):
                run.remove(path)


def bench_contender(name: str, state: dict[str, jax.Array], root: str) -> Iterator[dict[str, Any]]:
    """`name`'s save, asynchronous save (where it has one) and load of the
    first save's checkpoint, each save into a fresh directory under `root`."""
    nbytes = sum(x.nbytes for x in state.values())
    ops = operations(name)
    saves = ("save", "save_again", "save_async", "to_host")
    paths = {op: os.path.join(root, f"{state_dtype(state)}-{name}-{op}") for op in saves}
    for op in saves:
        if op in ops:
            # What earlier saves left unwritten is written now, not during this one's syncs.
            os.sync()
            given = jax.block_until_ready({k: x.copy() for k, x in state.items()}) if op == "to_host" else state
            _, figures = timed(functools.partial(ops[op], paths[op], given), nbytes)
            del given
            if name.startswith("eqx_ckpt"):
                figures["stored_bytes"] = eqx_ckpt.Checkpoint(paths[op]).stored_bytes  # compressed, where it is
            yield {"op": op, **figures}
            if op != "save":
                run.remove(paths[op])
    # Cold (where this machine lets the page cache be dropped), then warm.
    for op, cache in [("load_cold", "cold")] * worker.can_drop_caches() + [("load", "warm")]:
        worker.set_cache(paths["save"], cache)
        out, figures = timed(functools.partial(ops["load"], paths["save"], abstract(state)), nbytes)
        yield {"op": op, **figures, "verified": verified(out, state)}
        del out


def state_dtype(state: dict[str, jax.Array]) -> str:
    return str(next(iter(state.values())).dtype)


def warm_up(root: str) -> None:
    """Every contender saves and loads a small state once, untimed: imports,
    TensorStore's and orbax's start-up and the comparison's compilation."""
    state = {"w": jax.random.normal(jax.random.key(1), (8, COLUMNS))}
    for name in CONTENDERS:
        path = os.path.join(root, f"warm-up-{name}")
        try:
            ops = operations(name)
            ops["save"](path, state)
            verified(ops["load"](path, abstract(state)), state)
        except Exception as e:
            # Its measurements fail the same way and are recorded with the error.
            print(f"warm-up of {name} failed: {type(e).__name__}: {e}", flush=True)
        run.remove(path)


def versions() -> dict[str, str]:
    found = {"eqx_ckpt": eqx_ckpt.__version__, "jax": jax.__version__}
    for package in ("jaxlib", "orbax-checkpoint", "tensorstore", "equinox", "numpy"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def header(args: argparse.Namespace, root: str) -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "command": "python -m benchmarks.gpu " + " ".join(args.argv),
        "device": device.device_kind,
        "platform": device.platform,
        "versions": versions(),
        "host": report.machine(root),
        "filesystem": report.filesystem(root),
        "gib": args.gib,
        "reps": args.reps,
        "staging_bytes": STAGING_BYTES,
        "compression": COMPRESSION,
        "rows": [],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'dtype':9s} {'contender':15s} {'operation':10s} {'seconds':>8s} {'GB/s':>7s} "
        f"{'blocked s':>9s} {'peak RSS added':>14s} {'bits equal':>10s}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['dtype']:9s} {r['contender']:15s} FAILED: {r['error']}")
            continue
        blocked = f"{r['blocked']:9.3f}" if "blocked" in r else f"{'-':>9s}"
        same = "-" if "verified" not in r else "yes" if r["verified"] else "NO"
        lines.append(
            f"{r['dtype']:9s} {r['contender']:15s} {r['op']:10s} {r['seconds']:8.3f} {r['gb_per_s']:7.2f} "
            f"{blocked} {r['rss_added'] / 2**20:10.0f} MiB {same:>10s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=FULL_GIB, help="GiB of the state, for each dtype")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, from " + ", ".join(DTYPES))
    parser.add_argument("--reps", type=int, default=1, help="runs of each operation")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write the device, versions and every figure here")
    parser.add_argument("--staging-mib", type=float, default=None, help="eqx_ckpt's staging budget (default: its own)")
    parser.add_argument("--compression", default=None, help="eqx_ckpt's saves' compression (default: none)")
    names = ", ".join(CONTENDERS)
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, from " + names)
    parser.add_argument("--processes", action="store_true", help="each contender in a process of its own")
    parser.add_argument("--pool", default=None, help="eqx_ckpt's pool of load buffers, COUNTxMIB, or 'off'")
    parser.add_argument("--read-threads", type=int, default=None, help="eqx_ckpt's threads reading local files")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a knob of eqx_ckpt's `_memory` or `_window` (a Python literal): _memory.POOL_HUGE_PAGES=False",
    )
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    dtypes = [d for d in args.dtypes.split(",") if d]
    if unknown := [d for d in dtypes if d not in DTYPES]:
        parser.error(f"unknown dtypes {unknown}; choose from {list(DTYPES)}")
    if unknown := [c for c in args.contenders.split(",") if c not in CONTENDERS]:
        parser.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    configure(args)
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="eqx_ckpt_gpu_", dir=args.dir)
    result = header(args, root)
    print(f"device: {result['device']} ({result['platform']}), checkpoints on {result['filesystem']}", flush=True)
    print("\n".join([*result["host"], f"- {result['versions']}"]), flush=True)
    try:
        if args.processes:
            measure_apart(args, root, result)
        else:
            measure_all(args, dtypes, root, result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["run_seconds"] = time.perf_counter() - started
    write_json(result, args.json)
    print(f"\n{table(result['rows'])}\nwhole run: {result['run_seconds']:.0f} s", flush=True)
    return result


def configure(args: argparse.Namespace) -> None:
    """This process's contenders and eqx_ckpt's settings, from the arguments."""
    from eqx_ckpt._store import _memory, _window

    global STAGING_BYTES, COMPRESSION, CONTENDERS
    STAGING_BYTES = None if args.staging_mib is None else int(args.staging_mib * 2**20)
    COMPRESSION = args.compression
    CONTENDERS = tuple(args.contenders.split(","))
    if args.pool is not None:
        count, _, mib = args.pool.partition("x")
        _memory.PINNED_LOAD_POOL = None if args.pool == "off" else (int(count), int(float(mib) * 2**20))
    if args.read_threads is not None:
        _window.READ_THREADS = args.read_threads
    for setting in args.set:
        name, _, value = setting.partition("=")
        module, _, knob = name.partition(".")
        target = {"_memory": _memory, "_window": _window}.get(module)
        if target is None or not hasattr(target, knob) or not knob.isupper():
            raise SystemExit(f"--set {setting}: no knob {name} (a NAME in capitals of _memory or _window)")
        setattr(target, knob, ast.literal_eval(value))


def measure_apart(args: argparse.Namespace, root: str, result: dict[str, Any]) -> None:
    """Each contender measured by this script in a process of its own (the
    same arguments), its rows added to `result` (and written to `--json`)."""
    passed = [a for a in args.argv if a != "--processes"]
    for name in CONTENDERS:
        rows = os.path.join(root, f"rows-{name}.json")
        command = [sys.executable, "-m", "benchmarks.gpu", *passed, "--contenders", name, "--json", rows]
        subprocess.run([*command, "--dir", root], check=True)
        measured = json.loads(pathlib.Path(rows).read_text())
        result["rows"] += measured["rows"]
        result.update({k: v for k, v in measured.items() if k.startswith(("leaves_", "bytes_"))})
        write_json(result, args.json)


def measure_all(args: argparse.Namespace, dtypes: list[str], root: str, result: dict[str, Any]) -> None:
    """Every measurement of every dtype, each row added to `result` (and
    written to `--json`) as soon as it is taken."""

    def record(row: dict[str, Any]) -> None:
        row["loadavg"] = os.getloadavg()[0]
        result["rows"].append(row)
        print(table([row]).splitlines()[1], flush=True)
        write_json(result, args.json)

    # Two checkpoints of the state at once (a save and the asynchronous one beside it), and 1 GB to spare.
    run.check_disk(root, int(2.2 * args.gib * 2**30) + 10**9)
    warm_up(root)
    print(table([]), flush=True)
    for dtype in dtypes:
        state = make_state(args.gib, DTYPES[dtype])
        result[f"leaves_{dtype}"] = len(state)
        result[f"bytes_{dtype}"] = sum(x.nbytes for x in state.values())
        for rep in range(args.reps):
            bench_state(state, root, rep, record)
        del state


def write_json(result: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
