"""What a warm load pays for fresh memory, after the warm-up of one checkpoint or another.

`python -m benchmarks.warm_memory [--workload large] [--rounds 3] [--dir DIR]`

Saves the workload's state with eqx_ckpt and with raw (each in a fresh process,
as `benchmarks.run` does), then, round after round, runs each of these in a
fresh process after the harness's warm protocol (`worker.set_cache(path,
"warm")`: the page cache dropped where that is allowed, then every file of
that one checkpoint read):

- `load`: the contender's own full load of its checkpoint (the harness's
  `load_warm`);
- `read`: the checkpoint's files read as they are into fresh anonymous `mmap`
  buffers, 4 threads of `preadv` in 16 MiB pieces (the raw contender's way of
  reading, applied to either checkpoint's files);
- `touch`: a fresh anonymous shared mapping the size of the state, one byte
  written per page (no reading at all).

Each measurement prints its seconds and the process's system time; the medians
follow. `read` and `touch` do the same work after either warm-up, so a
difference between the two checkpoints there is the memory's state, not
eqx_ckpt's code (docs/benchmarks.md, "Where eqx_ckpt stands").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from . import contenders, run, worker, workload

KINDS = ("load", "read", "touch")
NAMES = ("eqx_ckpt", "raw")
READ_THREADS = 4
PIECE = 16 * 2**20
PAGE = mmap.PAGESIZE


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    sizes = workload.Sizes(**job["sizes"])
    path, kind = job["path"], job["kind"]
    like = workload.skeleton(sizes)
    worker.set_cache(path, "warm")
    gc.collect()
    before, start = os.times(), time.perf_counter()
    if kind == "load":
        jax.block_until_ready(contenders.CONTENDERS[job["contender"]]().load(path, like))
    elif kind == "read":
        read_files(worker.disk_files(path))
    elif kind == "touch":
        touch(workload.state_bytes(like))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    seconds, after = time.perf_counter() - start, os.times()
    return {"seconds": seconds, "system": after.system - before.system}


def read_files(names: list[str]) -> list[mmap.mmap]:
    """Every file in `names` read into a fresh anonymous mapping of its size."""
    sizes = [os.path.getsize(name) for name in names]
    buffers = [mmap.mmap(-1, max(size, 1), flags=workload.PRIVATE) for size in sizes]
    pieces = [
        (name, memoryview(buffer)[offset : min(offset + PIECE, size)], offset)
        for name, buffer, size in zip(names, buffers, sizes, strict=True)
        for offset in range(0, size, PIECE)
    ]

    def read(piece: tuple[str, memoryview, int]) -> None:
        name, view, offset = piece
        fd = os.open(name, os.O_RDONLY)
        try:
            contenders._pread_all(fd, view, offset)
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        list(pool.map(read, pieces))
    return buffers


def touch(nbytes: int) -> mmap.mmap:
    """A fresh private anonymous mapping of `nbytes`, every page written once."""
    memory = mmap.mmap(-1, nbytes, flags=workload.PRIVATE)
    np.frombuffer(memory, np.uint8)[::PAGE] = 1
    return memory


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.warm_memory", "--child", json.dumps(job)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=run.JOB_TIMEOUT, cwd=os.path.dirname(run.HERE)
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**job, **json.loads(line[len("RESULT ") :])}
    raise RuntimeError(f"measurement exited with status {done.returncode} and no result:\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="large", choices=sorted(workload.PRESETS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary folder by default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(measure(json.loads(args.child))), flush=True)
        return []

    sizes = workload.PRESETS[args.workload]
    base = {"workload": args.workload, "sizes": sizes.__dict__, "verify": False}
    directory = tempfile.mkdtemp(prefix="warm_memory-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        paths = {}
        for name in NAMES:
            paths[name] = os.path.join(directory, name + contenders.CONTENDERS[name].suffix)
            saved = run.run_job(
                {**base, "contender": name, "op": "save", "cache": None, "path": paths[name], "rep": 0},
                timeout=run.JOB_TIMEOUT,
            )
            if "error" in saved:
                raise RuntimeError(f"{name} could not save the {args.workload} workload: {saved['error']}")
        for round_ in range(args.rounds):
            for kind in KINDS:
                for name in run.rotated(list(NAMES), round_):
                    row = run_child({**base, "contender": name, "path": paths[name], "kind": kind, "round": round_})
                    rows.append(row)
                    seconds, system = row["seconds"], row["system"]
                    line = f"round {round_}  {kind:5s} after {name:8s} warm-up: {seconds:.3f} s (system {system:.2f} s)"
                    print(line, flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("\nmedians (s):")
    for kind in KINDS:
        cells = []
        for name in NAMES:
            seconds = [r["seconds"] for r in rows if r["kind"] == kind and r["contender"] == name]
            cells.append(f"after {name} {statistics.median(seconds):.3f}")
        print(f"  {kind:5s}  " + "   ".join(cells))
    return rows


if __name__ == "__main__":
    main()
