"""How a large read's fresh memory is best obtained: 4 KiB pages or huge pages.

`python -m benchmarks.page_sizes [--gib 3] [--rounds 5] [--cache warm,cold] [--dir DIR]`

Writes one file of `--gib` GiB, then, round after round, reads it whole in a
fresh process per measurement, 4 threads of `preadv` in 16 MiB pieces into
buffers of `BUFFER_BYTES` (a large leaf's), each buffer obtained one way:

- `4k`: a private anonymous `mmap`, faulted in 4 KiB pages as the reads touch
  it (what `eqx_ckpt/_store/_memory.py:fresh_bytes` and the harness's raw contender use);
- `huge`: the same mapping with `madvise(MADV_HUGEPAGE)`: faulted in 2 MiB pages;
- `numpy`: `np.empty`, for which NumPy itself asks for huge pages (every array
  of 4 MiB or more), as a hand-written reader gets them;
- `populate`: the `4k` mapping, each reading thread first faulting its piece in
  with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14), then reading into it;
- `reused`: `4k` buffers already faulted in by a read before the clock starts,
  what a pool of buffers kept across loads in one process would give at best
  (no fresh memory at all).

With the page cache `warm` (dropped, then the file read once) or `cold`
(dropped). Prints, for each way and cache state, the median and worst seconds
of the rounds and the median system time. The page cache can only be dropped
as root; without that, `cold` is refused and `warm` reads a file that may
already be cached.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

import numpy as np

from . import contenders, run, worker

WAYS = ("4k", "huge", "numpy", "populate", "reused")
BUFFER_BYTES = 32 * 2**20
READ_THREADS, PIECE = 4, 16 * 2**20
MADV_POPULATE_WRITE = 23  # Linux's value; `mmap` has no name for it before Python 3.13


def fresh(way: str, nbytes: int) -> Any:
    if way == "numpy":
        base = np.empty(nbytes + mmap.PAGESIZE, np.uint8)  # page-aligned inside, as the others
        skip = -base.ctypes.data % mmap.PAGESIZE
        return base[skip : skip + nbytes]
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if way == "huge":
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def read(path: str, way: str, buffers: list[Any] | None = None) -> list[Any]:
    """The file read into `buffers`, or into new buffers of `BUFFER_BYTES` obtained `way`."""
    size = os.path.getsize(path)
    if buffers is None:
        fresh_way = "4k" if way == "reused" else way
        buffers = [fresh(fresh_way, min(BUFFER_BYTES, size - start)) for start in range(0, size, BUFFER_BYTES)]
    pieces = [
        (start + offset, memoryview(buffer)[offset : offset + PIECE])
        for start, buffer in zip(range(0, size, BUFFER_BYTES), buffers, strict=True)
        for offset in range(0, len(memoryview(buffer)), PIECE)
    ]
    fd = os.open(path, os.O_RDONLY)

    def one(piece: tuple[int, memoryview]) -> None:
        offset, view = piece
        if way == "populate":
            address = np.frombuffer(view, np.uint8).ctypes.data
            _madvise(address, len(view), MADV_POPULATE_WRITE)
        contenders._pread_all(fd, view, offset)

    try:
        with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(one, pieces))
    finally:
        os.close(fd)
    return buffers


def _madvise(address: int, length: int, advice: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = address - address % page
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + address - start), advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")


def measure(path: str, way: str, cache: str) -> dict[str, float]:
    reused = read(path, way) if way == "reused" else None
    worker.set_cache(path, cache)
    before, start = os.times(), time.perf_counter()
    read(path, way, reused)
    seconds, after = time.perf_counter() - start, os.times()
    return {"seconds": seconds, "system": after.system - before.system}


def write_file(path: str, nbytes: int) -> None:
    """`nbytes` of varied bytes (ext4 neither compresses nor deduplicates them)."""
    block = np.random.default_rng(0).integers(0, 256, 64 * 2**20, dtype=np.uint8)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(memoryview(block)[: min(len(block), nbytes - start)])
        os.fsync(f.fileno())


def in_fresh_process(path: str, way: str, cache: str) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.page_sizes", "--child", json.dumps([path, way, cache])]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=run.JOB_TIMEOUT, cwd=os.path.dirname(run.HERE)
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, float] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(f"measurement exited with status {done.returncode} and no result:\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="size of the file read")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", default="warm,cold", help="comma-separated: warm, cold")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    parser.add_argument("--dir", default=None, help="where the file goes (a temporary folder by default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(measure(*json.loads(args.child))), flush=True)
        return {}
    caches = [c for c in args.cache.split(",") if c]
    ways = [w for w in args.ways.split(",") if w]
    if "cold" in caches and not worker.can_drop_caches():
        parser.error("a cold read needs the page cache dropped, which needs root here; pass --cache warm")
    directory = tempfile.mkdtemp(prefix="page_sizes-", dir=args.dir)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {(w, c): [] for c in caches for w in ways}
    try:
        path = os.path.join(directory, "data.bin")
        write_file(path, int(args.gib * 2**30))
        for round_ in range(args.rounds):
            for cache in caches:
                for way in run.rotated(ways, round_):
                    row = in_fresh_process(path, way, cache)
                    rows[way, cache].append(row)
                    print(f"round {round_}  {cache}  {way:8s} {row['seconds']:.3f} s (system {row['system']:.2f} s)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{args.gib:g} GiB, {args.rounds} rounds: median (worst) seconds, median system seconds")
    for (way, cache), runs in rows.items():
        seconds = [r["seconds"] for r in runs]
        system = statistics.median(r["system"] for r in runs)
        print(f"  {cache}  {way:8s} {statistics.median(seconds):.3f} ({max(seconds):.3f})  system {system:.2f}")
    return rows


if __name__ == "__main__":
    main()
