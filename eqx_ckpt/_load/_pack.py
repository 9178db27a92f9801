"""Reading small leaves from their packs: one zarr v3 array per stored dtype.

A leaf of at most `_records.PACK_BYTES` stored bytes has no folder of its own:
its elements (C order) sit in the one-dimensional array `packed.<dtype>/` of
the data root, at a 64-byte aligned offset the manifest records (a save's
packing plan, `_records.assign`). Any zarr v3 reader gets it back as
`pack[offset : offset + size].reshape(shape)`.

Why: a folder, a `zarr.json`, a chunk file and an open per leaf cost far more
than a small leaf's bytes. Leaves are packed in flattening order, so a
sub-tree is one contiguous run and a partial load reads only the chunks it covers.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .._base import _faults
from .._base._location import Location
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from .._store import _chunk_files, _storage, _window
from . import _read


def by_pack(records: Sequence[LeafRecord]) -> dict[str, list[int]]:
    """The indices of the packed `records`, by the name of their pack."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, record in enumerate(records):
        if record.pack is not None:
            groups[record.pack.name].append(i)
    return groups


def read_leaves(
    loc: Location, records: Sequence[LeafRecord], *, cached: bool = False
) -> Iterator[tuple[list[int], int, Callable[[], np.ndarray]]]:
    """Read packed leaves in a few large reads: for each run of a pack that
    covers some of them, `(indices into records, start, finish)`, where
    `finish()` waits and returns the run's elements from offset `start` on.
    Runs are at most the read budget long (`_window`). `cached`, for leaves
    read a few at a time (a lazy leaf): through this process's cached open of
    the pack, whose chunk cache serves its neighbours' next reads."""
    groups = by_pack(records)
    assert sum(map(len, groups.values())) == len(records), "every record must be packed"
    runs: list[tuple[PackRecord, int, int, list[int]]] = []
    for indices in groups.values():
        pack = records[indices[0]].pack
        assert pack is not None
        itemsize = dtype_from_name(pack.dtype).itemsize
        indices.sort(key=lambda i: records[i].offset)
        spans = [(records[i].offset * itemsize, (records[i].offset + records[i].size) * itemsize, i) for i in indices]
        most = max(_window.READ_BUDGET // itemsize, pack.chunk) * itemsize
        for lo, hi, members in _window.runs(spans, most):
            runs.append((pack, lo // itemsize, hi // itemsize, members))
    reader = _chunk_files.chunk_files(loc).pack_runs(cached=cached)

    def start_run(pack: PackRecord, start: int, stop: int, members: list[int]) -> Callable[[], np.ndarray]:
        _faults.fire("pack.read_run", loc, pack, [records[m].path for m in members])
        # A failed run is raised as storage raised it: the caller reads its leaves one by one to name the damaged one.
        return reader.start(pack, start, stop, records[members[0]])

    jobs = (
        (
            (members, start),
            (stop - start) * dtype_from_name(pack.dtype).itemsize,
            functools.partial(start_run, pack, start, stop, members),
        )
        for pack, start, stop, members in runs
    )
    for (members, first), _, finish in _window.windowed(jobs):
        yield members, first, finish


def read_chunks(
    loc: Location, pack: PackRecord, records: Sequence[LeafRecord], *, max_reads: int
) -> Iterator[tuple[int, Callable[[], np.ndarray]]]:
    """Every chunk of `pack`, in order, as `(chunk index, finish)`, for `verify`,
    which names the leaves (of `records`) of each damaged chunk. `finish()`
    returns the chunk's elements, or raises as storage raised it. At most
    `max_reads` run at once, within the read budget (`_window`)."""
    store = _storage.open_pack(loc, pack, cached=False).result()
    whole = _whole(pack)
    held: dict[int, list[str]] = collections.defaultdict(list)
    for record in records:
        for k in range(record.offset // pack.chunk, -(-(record.offset + record.size) // pack.chunk)):
            held[k].append(record.path)

    def start(k: int, lo: int, hi: int) -> Callable[[], np.ndarray]:
        _faults.fire("pack.read_run", loc, pack, held.get(k, []))
        return _read.start_region(store, loc, whole, (slice(lo, hi),), raw=True)

    itemsize = dtype_from_name(pack.dtype).itemsize
    bounds = ((k, k * pack.chunk, min((k + 1) * pack.chunk, pack.size)) for k in range(-(-pack.size // pack.chunk)))
    jobs = ((k, (hi - lo) * itemsize, functools.partial(start, k, lo, hi)) for k, lo, hi in bounds)
    for k, _, finish in _window.windowed(jobs, max_reads=max_reads):
        yield k, finish


def _whole(pack: PackRecord) -> LeafRecord:
    """The pack as the record of one array (what a read of its regions reads)."""
    shape = (pack.size,)
    return LeafRecord(pack.name, [], "numpy", shape, pack.dtype, shape, pack.dtype, "plain", (pack.chunk,))
