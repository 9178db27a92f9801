"""Reading every chunk of many leaves with bounded memory, for `verify` and `diff`.

A leaf is read chunk by chunk, never whole, within the read budget of every
reader (`_window`) and at most `MAX_READS` chunks at once. A hostile manifest
may claim billions of chunks. So chunk indices are generated lazily and a leaf
stops at its first failure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

from .._base._progress import Tracker
from .._ondisk._format import LeafRecord, dtype_from_name
from .._store import _window

# How many chunk reads may be in flight at once (chunks of a few bytes would
# otherwise start thousands of reads within the budget).
MAX_READS = 64


def chunk_indices(record: LeafRecord, *, stop: Callable[[], bool]) -> Iterator[tuple[slice, ...]]:
    """The index of every chunk of a leaf, lazily and until `stop()`: a hostile
    shape may claim billions of chunks, and the first missing one ends the leaf."""
    counts = [-(-n // c) for n, c in zip(record.stored_shape, record.chunks)]
    for position in _positions(counts):
        if stop():
            return
        yield tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(position, record.chunks, record.stored_shape))


def _positions(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Every position in a grid, lazily (`itertools.product` would first build
    each axis's full range)."""
    if not counts:
        yield ()
        return
    for i in range(counts[0]):
        for rest in _positions(counts[1:]):
            yield (i, *rest)


def _chunk_bytes(record: LeafRecord, index: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in index) * dtype_from_name(record.stored_dtype).itemsize


def read_chunks(
    jobs: Iterator[tuple[LeafRecord, Any, tuple[slice, ...]]],
    *,
    skip: Callable[[LeafRecord], bool],
    failed: Callable[[LeafRecord, BaseException], None],
    read: Callable[[LeafRecord, Any, tuple[slice, ...]], Callable[[], Any]],
) -> Iterator[tuple[LeafRecord, Any, int]]:
    """Run chunk reads with a bounded number of bytes in flight; yield each
    `(record, value, bytes)` that read cleanly, and report the others.
    `read(record, store, index)` starts reading one chunk and returns what
    waits for its value (`_read.start_region`, or a function of such reads)."""
    # `skip` is asked as each chunk is about to start: a leaf stops at its first failure.
    starts = (
        (record, _chunk_bytes(record, index), functools.partial(read, record, store, index))
        for record, store, index in jobs
        if not skip(record)
    )
    for record, size, finish in _window.windowed(starts, max_reads=MAX_READS):
        try:
            value = finish()
        except Exception as e:
            failed(record, e)
            continue
        yield record, value, size


class LeafCounter:
    """Turns the chunks `windowed` yields into progress: bytes at every chunk, a
    leaf once its last chunk is done (a leaf with no bytes is done at once)."""

    def __init__(self, records: list[LeafRecord], tracker: Tracker):
        self._left = {r.path: r.nbytes for r in records}
        self._tracker = tracker
        tracker.advance(leaves=sum(1 for r in records if r.nbytes == 0))

    def __call__(self, record: LeafRecord, size: int) -> None:
        self._left[record.path] -= size
        self._tracker.advance(leaves=int(self._left[record.path] == 0), nbytes=size)
