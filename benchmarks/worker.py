"""One measurement in a fresh process: `python -m benchmarks.worker '<json>'`.

The JSON names the contender, the operation, the workload sizes, the checkpoint
path and the page-cache state; the result is printed as one JSON line. A job
of the `foreign` workload names one of `benchmarks/foreign.py`'s ways of
loading as its contender and the file (or directory) as its case (`op`).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import sys
import time
import traceback
from typing import Any

import equinox as eqx
import jax
import numpy as np
import psutil

from . import contenders, foreign, workload

# The kernel's switch that drops the page cache (where this process may write
# it: as root). `EQX_CKPT_BENCH_DROP_CACHES` names another file to write
# instead: the harness's tests (tests/bench/) take every step of a cold
# measurement without emptying the page cache of everything else on the machine.
DROP_CACHES = os.environ.get("EQX_CKPT_BENCH_DROP_CACHES", "/proc/sys/vm/drop_caches")


def can_drop_caches() -> bool:
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def set_cache(path: str, cache: str) -> None:
    """Make the page cache cold (drop it) or warm: dropped too where that is
    allowed, then every file of this checkpoint read once, so that no other
    contender's files are cached. (With the other checkpoints still cached,
    15 GB for `large`, the kernel had to reclaim memory for the load's buffers,
    and warm loads of one checkpoint took 1.4-5.9 s in one run, some slower
    than its cold loads.)"""
    if cache == "cold" or (cache == "warm" and can_drop_caches()):
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3")
    if cache == "warm":
        for name in disk_files(path):
            with open(name, "rb", buffering=0) as f:
                while f.read(16 * 2**20):
                    pass


def disk_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]


def disk_usage(path: str) -> dict[str, int]:
    files = disk_files(path)
    return {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files)}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(job: dict[str, Any]) -> dict[str, Any]:
    if job["workload"] == "foreign":
        # The files were read once before the runs (`foreign.bench`): warm.
        return {"seconds": foreign.measure(job["contender"], job["path"]), **disk_usage(job["path"])}
    sizes = workload.Sizes(**job["sizes"])
    contender = contenders.CONTENDERS[job["contender"]]()
    path, op = job["path"], job["op"]
    if op in ("save", "save_async"):
        state = workload.concrete(sizes)
        jax.block_until_ready(state)
        if os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        # Data other processes left unwritten (a contender that does not sync
        # every file, the checkpoint just deleted) is written out now, not
        # during this save's own syncs (on ext4 a sync commits the journal,
        # which waits for the data of every file in it). It did not remove the
        # slow first save of a workload (docs/benchmarks.md at 864f6a6, "The run
        # before: the manifest encoded by orjson, while the arrays are written"),
        # which is not this.
        os.sync()
        gc.collect()
        if op == "save":
            start = time.perf_counter()
            contender.save(path, state)
            seconds = time.perf_counter() - start
            return {"seconds": seconds, **disk_usage(path)}
        return {**save_async(contender, path, state), **disk_usage(path), **verify(job, path, sizes)}
    like = workload.skeleton(sizes)
    set_cache(path, job["cache"])
    gc.collect()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if op == "load":
        out = jax.block_until_ready(contender.load(path, like))
    elif op == "params":
        out = jax.block_until_ready(contender.load_params(path, like))
    elif op == "open":
        out = contender.open_lazy(path)
    else:
        raise ValueError(f"unknown operation {op!r}")
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "rss_added": peak_rss() - before}
    if job.get("verify") and op in ("load", "params"):
        expected = workload.concrete(sizes)
        result["verified"] = bool(eqx.tree_equal(out, expected if op == "load" else expected["model"], typematch=True))
    return result


def save_async(contender: Any, path: str, state: Any) -> dict[str, float]:
    """`blocked`: how long the `blocking=False` call held the caller; `committed`:
    until `wait()` returned; `seconds`: that plus an `fsync` of every file and
    directory the save wrote, the end point every contender's save reaches (the
    library's commit has already made them durable, so it writes nothing);
    `floor`: what any such call must do in the caller's thread (`hold_floor`),
    measured after the save, so nothing of it was done for the timed call."""
    start = time.perf_counter()
    pending = contender.save_async(path, state)
    blocked = time.perf_counter() - start
    pending.wait()
    committed = time.perf_counter() - start
    contenders.fsync_tree(path)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "blocked": blocked, "committed": committed, "floor": hold_floor(state)}


def hold_floor(state: Any) -> float:
    """The least an asynchronous save can block its caller: flattening the tree
    and one host (NumPy) view of each array leaf, which is what
    `eqx_ckpt/_save/_background.py:hold_tree` does before the call returns (the
    view is what keeps a later donation or change from reaching the save).

    Timed on twins of `state`, fresh copies whose arrays were never converted:
    `np.asarray` of a CPU `jax.Array` caches its NumPy value, so on `state`
    itself (which the save just viewed) the views would cost less than they
    did in the call. The
    median of 3 twins, or 1 for a state of 1 GB or more (a twin is a second
    copy of it in memory)."""
    leaves = jax.tree_util.tree_leaves(state)
    nbytes = sum(x.nbytes for x in leaves if isinstance(x, jax.Array))
    times = []
    for _ in range(3 if nbytes < 10**9 else 1):
        twin = jax.block_until_ready(jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state))
        gc.collect()
        start = time.perf_counter()
        for x in jax.tree_util.tree_flatten(twin)[0]:
            if isinstance(x, jax.Array):
                np.asarray(x)
        times.append(time.perf_counter() - start)
        del twin
    return statistics.median(times)


def verify(job: dict[str, Any], path: str, sizes: workload.Sizes) -> dict[str, bool]:
    """On a verifying (tiny) run, that the asynchronous save wrote the state."""
    if not job.get("verify"):
        return {}
    import eqx_ckpt

    out = eqx_ckpt.tree_deserialise_leaves(path, workload.skeleton(sizes))
    return {"verified": bool(eqx.tree_equal(out, workload.concrete(sizes), typematch=True))}


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        result = measure(job)
    except Exception as e:
        # Reported as a result, so the run records the failure and goes on.
        tail = "".join(traceback.format_exception(e))[-4000:]
        result = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": tail}
    print("RESULT " + json.dumps({**job, **result, "loadavg": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
