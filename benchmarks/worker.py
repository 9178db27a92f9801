"""One measurement in a fresh process: `python -m benchmarks.worker '<json>'`.

The JSON names the contender, the operation, the workload sizes, the checkpoint
path and the page-cache state; the result is printed as one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import time
from typing import Any

import equinox as eqx
import jax
import psutil

from . import contenders, workload

DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def set_cache(path: str, cache: str) -> None:
    """Make the page cache cold (drop it) or warm (read every file once)."""
    if cache == "cold":
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3")
    elif cache == "warm":
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
    sizes = workload.Sizes(**job["sizes"])
    contender = contenders.CONTENDERS[job["contender"]]()
    path, op = job["path"], job["op"]
    if op == "save":
        state = workload.concrete(sizes)
        jax.block_until_ready(state)
        if os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        gc.collect()
        start = time.perf_counter()
        contender.save(path, state)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, **disk_usage(path)}
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


def main() -> None:
    job = json.loads(sys.argv[1])
    result = {**measure(job), "loadavg": os.getloadavg()[0]}
    print("RESULT " + json.dumps({**job, **result}), flush=True)


if __name__ == "__main__":
    main()
