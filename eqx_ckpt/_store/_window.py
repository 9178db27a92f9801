"""One host-memory budget for every reader of a checkpoint.

Every reader (load, `materialise`, `verify`, `diff`) starts its reads through
`windowed`: as many at once as fit in `READ_BUDGET` bytes (all at once would
hold every leaf twice; one at a time would leave the disk idle). Every window
of bytes in flight, a save's staging too, admits work by one rule, `Budget`.
Local files are read on one shared pool (`read_pool`); small leaves side by
side are read in runs (`runs`).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from .._base import _faults, _threads

# Bytes of reads in flight at once, for every reader. (A read larger than the
# budget runs alone.)
READ_BUDGET = 128 * 2**20
# Threads that read local files (`read_pool`), and that open local leaves.
READ_THREADS = 4
# Threads that read and decompress a compressed leaf's chunk files, and that
# compress a save's (`codec_pool`): that work is the CPU's, so one thread a
# core, from `READ_THREADS` up to 16 (docs/benchmarks.md, "GPU").
CODEC_THREADS = max(READ_THREADS, min(os.cpu_count() or 1, 16))

# Two wanted leaves of one file (or pack) closer than this are read in one
# run, the bytes between them read and dropped.
RUN_GAP_BYTES = 256 << 10

K = TypeVar("K")
F = TypeVar("F")


class Budget:
    """Bytes in flight against a budget of `limit` bytes: the next job starts
    while it fits in what is left, or alone, when nothing else runs."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def fits(self, nbytes: int, *, alone: bool) -> bool:
        """Whether a job of `nbytes` may start now; `alone`: nothing else runs."""
        return alone or self.held + nbytes <= self.limit

    def take(self, nbytes: int) -> None:
        self.held += nbytes

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


def windowed(
    jobs: Iterable[tuple[K, int, Callable[[], F]]], *, max_reads: int | None = None
) -> Iterator[tuple[K, int, F]]:
    """Start each job `(key, size in bytes, start)` while they fit in
    `READ_BUDGET` bytes (and `max_reads` reads); yield `(key, size, start())`
    of each, oldest first, when the next needs room. Jobs are taken only as
    they start (a lazy iterable may decide then what comes next); the caller
    finishes each yielded read before asking for the next, freeing its bytes."""
    _faults.fire("window.open")
    flight: collections.deque[tuple[K, int, F]] = collections.deque()
    budget = Budget(READ_BUDGET)
    for key, size, start in jobs:
        while flight and (not budget.fits(size, alone=False) or (max_reads is not None and len(flight) >= max_reads)):
            done = flight.popleft()
            budget.give(done[1])
            yield done
        _faults.fire("window.start", len(flight) + 1)
        flight.append((key, size, start()))
        budget.take(size)
    while flight:
        yield flight.popleft()


def read_pool() -> _threads.Pool:
    """The process's pool of threads that read local files, for every reader."""
    return _threads.pool("eqx_ckpt-read", READ_THREADS)


def codec_pool() -> _threads.Pool:
    """The process's pool of threads that compress and decompress chunks (`CODEC_THREADS`)."""
    return _threads.pool("eqx_ckpt-codec", CODEC_THREADS)


def runs(
    spans: Iterable[tuple[int, int, K]], most: int, alone: Callable[[int], bool] | None = None
) -> list[tuple[int, int, list[K]]]:
    """Wanted leaves of one file (`spans`: `(start, end, key)` in bytes, sorted),
    grouped into runs of one read each. A leaf starts a new run past a gap of
    `RUN_GAP_BYTES`, past `most` bytes, or where it or the run's last is `alone`."""
    out: list[tuple[int, int, list[K]]] = []
    members: list[K] = []
    lo = hi = 0
    last_alone = False
    for start, end, key in spans:
        this_alone = alone is not None and alone(end - start)
        if members and (this_alone or last_alone or start > hi + RUN_GAP_BYTES or end - lo > most):
            out.append((lo, hi, members))
            members = []
        if not members:
            lo = hi = start
        hi = max(hi, end)
        members.append(key)
        last_alone = this_alone
    if members:
        out.append((lo, hi, members))
    return out
