"""Reading small leaves from their packs: one zarr v3 array per stored dtype.

A leaf of at most `_records.PACK_BYTES` stored bytes does not get a folder of
its own: its elements (C order) are placed in the one-dimensional array
`packed.<dtype>/` of the data root, at an offset the manifest records, each
leaf starting on a 64-byte boundary (a save's packing plan:
`_records.assign`). The pack is an ordinary zarr v3 array (chunks of at most
`_records.PACK_CHUNK_BYTES`, each with its crc32c; the manifest records their
length, which readers take from it), so any zarr v3 reader gets
a leaf back as `pack[offset : offset + size].reshape(shape)`; eqx_ckpt
addresses it by its dotted path everywhere, as any other leaf.

Why: a folder, a `zarr.json`, a chunk file and a TensorStore open per leaf cost
far more than the bytes of a small leaf (ten thousand 4 kB leaves took seconds
to save and load, against a fraction of a second for one file). Leaves are
packed in the tree's flattening order, so a sub-tree (`model`, say) is one
contiguous run of the pack and a partial load reads only the chunks it covers.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .._base import _faults
from .._base._location import Location
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from .._store import _storage, _window
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

    Runs are at most the read budget long (`_window`), and started ahead of
    their use within it. With `cached`, for leaves read a few at a time (a
    lazy leaf), every pack is read through this process's cached open of it
    (`_storage.open_pack`), whose chunk cache serves the next reads of its
    neighbours, instead of each read checking and reading whole chunk files."""
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
    # Each run read by the location's reader of pack runs: on a local disk by
    # eqx_ckpt itself (each chunk file checked before it is read), else through
    # TensorStore, with one open (and one check of its files) per pack, not per run.
    reader = _storage.chunk_files(loc).pack_runs(cached=cached)

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


def read_alone(loc: Location, record: LeafRecord) -> np.ndarray:
    """The elements of one packed leaf (its stored shape), read as a run of
    its own (`pack.read_run`) by the location's reader of pack runs, through
    this process's cached open of its pack (`pack_runs(cached=True)`): how a
    reader whose run failed finds which of its leaves is damaged. A failure
    to read is raised as storage raised it (one to open the pack, as the
    leaf's)."""
    pack = record.pack
    assert pack is not None
    _faults.fire("pack.read_run", loc, pack, [record.path])
    runs = _storage.chunk_files(loc).pack_runs(cached=True)
    return runs.start(pack, record.offset, record.offset + record.size, record)().reshape(record.stored_shape)


def read_chunks(
    loc: Location, pack: PackRecord, records: Sequence[LeafRecord], *, max_reads: int
) -> Iterator[tuple[int, Callable[[], np.ndarray]]]:
    """Every chunk of `pack`, in order, each read as a run of its own
    (`pack.read_run`, naming those of its leaves `records` that the chunk
    holds) through TensorStore, at most `max_reads` at once within the read
    budget (`_window`): `(chunk index, finish)`, where `finish()` waits and
    returns the chunk's elements, or raises a failure as storage raised it.
    For `verify`, which names the leaves of each damaged chunk; the pack is
    opened as `verify` opens it (its files checked, its chunks not cached)."""
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
    """The pack as the record of one array (what a read of its regions is said to read)."""
    shape = (pack.size,)
    return LeafRecord(pack.name, [], "numpy", shape, pack.dtype, shape, pack.dtype, "plain", (pack.chunk,))
