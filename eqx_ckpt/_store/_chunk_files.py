"""A location's chunk files: read and written by eqx_ckpt itself on a local
disk, else through TensorStore.

`chunk_files(loc)` makes that choice, once per location and nowhere else. Its
`ChunkFiles` is the one interface a save and a load use: `LocalFiles`
(`_local_read`, `_local_write`, shared by `_share`) or `TensorStoreFiles`. A
save hands every write to its `Writer`, a load every pack run to its
`PackRuns`. A leaf the local files cannot lay out goes through TensorStore
inside them (`LocalFiles.writes_leaf`, `reads`), not by a second choice.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import crc32c
import numpy as np

from .._base import _faults, _interrupts, _location
from .._base._location import Location
from .._base._progress import Tracker
from .._ondisk import _format, _manifest
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from . import _local_read, _local_write, _memory, _share, _storage
from ._storage import Future, Mapped, Transaction
from ._storage_errors import leaf_io_error

# What the local path needs of the host: little-endian bytes (zarr's chunks are
# little-endian), `preadv` and `O_NOFOLLOW` for the checked reads, a hardware crc32c.
LOCAL_PATH_SUPPORTED = (
    sys.byteorder == "little" and hasattr(os, "preadv") and hasattr(os, "O_NOFOLLOW") and crc32c.hardware_based
)

Read = Callable[[], np.ndarray]
# A leaf's host pieces: (the index of the array it fills, its data).
Pieces = Sequence[tuple[tuple[slice, ...], Any]]
# What `_staging.Writing.follow` reports as each future of a write finishes, in order:
# bytes done within a leaf, and the sizes of the leaves done (`Tracker.count_leaves`).
Steps = list[tuple[int, list[int]]]


def chunk_files(loc: Location) -> ChunkFiles:
    """`LocalFiles` on a local disk (`file` driver) of a host that supports it
    (`LOCAL_PATH_SUPPORTED`), else `TensorStoreFiles`."""
    if LOCAL_PATH_SUPPORTED and _location.on_local_disk(loc) and loc.local is not None:
        return LocalFiles(loc, loc.local)
    return TensorStoreFiles(loc)


def read_local_range(
    path: str, start: int, end: int, filled: Callable[[np.ndarray, int], None] | None = None
) -> np.ndarray | None:
    """Bytes `start` to `end` of another program's local file (`_local_read.read_range`)."""
    return _local_read.read_range(path, start, end, filled)


def read_alone(loc: Location, record: LeafRecord) -> np.ndarray:
    """The elements of one packed leaf (its stored shape), read as a run of its
    own: how a reader whose run failed finds the damaged leaf, and how a
    fine-tune reads a leaf it takes from a packed base. A failure is raised
    as storage raised it."""
    pack = record.pack
    assert pack is not None
    _faults.fire("pack.read_run", loc, pack, [record.path])
    runs = chunk_files(loc).pack_runs(cached=True)
    return runs.start(pack, record.offset, record.offset + record.size, record)().reshape(record.stored_shape)


def compressing_bytes() -> int:
    """The most host memory a compressed save holds beyond its staged pieces:
    a compressed chunk (and an edge chunk's padded copy) in each writing thread."""
    return 2 * _local_write.THREADS * _format.COMPRESSED_CHUNK_BYTES


def stored_bytes(data: Location, manifest: _manifest.Manifest) -> int | None:
    """The bytes the chunk files of `manifest`'s arrays take under `data`, on a
    local disk in the "directories" layout; else `None` (no sizes are listed)."""
    if data.local is None or manifest.layout != "directories":
        return None
    arrays = [(r.directory, r.stored_shape, r.chunks) for r in manifest.leaves if r.pack is None]
    arrays += [(p.name, (p.size,), (p.chunk,)) for p in manifest.packs]
    total = 0
    for directory, shape, chunks in arrays:
        for key in _format.chunk_keys(shape, chunks):
            entry = _storage.local_entry(os.path.join(data.local, directory, *key.split("/")))
            total += entry.size if entry.file else 0
    return total


class Save(NamedTuple):
    """How a save writes a location's chunk files: by `processes` processes,
    in `layout`. Chunk files equal to `base`'s are shared; with `remember`,
    the digest of each written is recorded (`_share`)."""

    processes: int
    layout: str
    base: _share.Base | None = None
    remember: bool = False


class ChunkFiles(Protocol):
    """How the chunk files of one location are read and written (`chunk_files`).
    `start_read` returns `None` where `reads` is false: the load then reads
    the leaf's `_storage.Array`."""

    def reads(self, record: LeafRecord) -> bool:
        """Whether `start_read` reads this leaf, stored in an array of its own."""

    def start_read(self, record: LeafRecord, *, on_bytes: Callable[[int], None] | None = None) -> Read | None:
        """Start reading a whole leaf into one aligned buffer; a function that waits and returns it."""

    def start_chunks(self, record: LeafRecord, first: int, count: int, out: memoryview) -> Callable[[], None]:
        """Start reading chunks `[first, first + count)` of a leaf that `reads` into `out`."""

    def pack_runs(self, *, cached: bool) -> PackRuns:
        """The reader of the runs of the packs here, for one load."""

    def writer(self, out: list[Any], tracker: Tracker | None, save: Save) -> Writer:
        """A save's writer, which puts in `out` every future of data written."""

    def base(self, opened: Callable[[], tuple[Location, _manifest.Manifest] | None]) -> _share.Base | None:
        """The checkpoint here (`opened()`: its data root and manifest) as the
        base of an incremental save, or `None` where it cannot be shared."""

    def forget_damaged(self, error: BaseException, record: LeafRecord) -> None:
        """`forget` the array of `record` where `error` says it is damaged."""

    def forget(self, directory: str) -> None:
        """Forget what `_share` verified or wrote of the array folder `directory`."""


class LocalFiles:
    """Chunk files on a local disk, read and written by eqx_ckpt itself where
    `reads` and `writes_leaf` say so; any other leaf goes through TensorStore."""

    def __init__(self, loc: Location, root: str):
        self.loc, self.root = loc, root

    def reads(self, record: LeafRecord) -> bool:
        """A large leaf whose chunks split only its first axis (each chunk's
        bytes contiguous in the array), not packed, in a codec read as stored."""
        return (
            record.encoding in _format.ENCODINGS
            and tuple(record.chunks[1:]) == tuple(record.stored_shape[1:])
            and record.pack is None
            and record.nbytes >= max(_local_read.MIN_BYTES, 1)
        )

    def start_read(self, record: LeafRecord, *, on_bytes: Callable[[int], None] | None = None) -> Read | None:
        return _local_read.start_read(self.loc, record, on_bytes=on_bytes) if self.reads(record) else None

    def start_chunks(self, record: LeafRecord, first: int, count: int, out: memoryview) -> Callable[[], None]:
        return _local_read.start_chunks(self.loc, record, first, count, out)

    def pack_runs(self, *, cached: bool) -> PackRuns:
        """Read by eqx_ckpt itself, except in a load of a few leaves at a time (`cached`)."""
        return PackRuns(self.loc, local=not cached, cached=cached)

    def writes(self, *, processes: int, layout: str) -> bool:
        """Whether eqx_ckpt writes chunk files itself in this save: one process
        (the single writer of the fresh data root), the "directories" layout."""
        return processes == 1 and layout == "directories"

    def writes_leaf(self, record: LeafRecord, pieces: Pieces) -> bool:
        """Whether, in a save it `writes`, eqx_ckpt writes this leaf itself: one
        host piece of the whole array, chunks that split only its first axis
        (every pack's are)."""
        return (
            record.pack is None
            and len(pieces) == 1
            and not pieces[0][0]
            and tuple(record.chunks[1:]) == tuple(record.stored_shape[1:])
        )

    def writer(self, out: list[Any], tracker: Tracker | None, save: Save) -> Writer:
        """A `LocalWriter` in a save it `writes`, else the plain `Writer`."""
        if not self.writes(processes=save.processes, layout=save.layout):
            return Writer(out, tracker)
        return LocalWriter(self, out, tracker, save)

    def base(self, opened: Callable[[], tuple[Location, _manifest.Manifest] | None]) -> _share.Base | None:
        """Shared where the checkpoint has the "directories" layout and its data root is on this disk."""
        found = opened()
        if found is None or found[1].layout != "directories" or found[0].local is None:
            return None
        return _share.Base(found[0].local, found[1])

    def forget_damaged(self, error: BaseException, record: LeafRecord) -> None:
        _share.forget_damaged(error, self.root, record)

    def forget(self, directory: str) -> None:
        _share.forget(self.root, directory)


class TensorStoreFiles:
    """Chunk files reached through TensorStore; nothing is shared."""

    def __init__(self, loc: Location):
        self.loc = loc

    def reads(self, record: LeafRecord) -> bool:
        return False

    def start_chunks(self, record: LeafRecord, first: int, count: int, out: memoryview) -> Callable[[], None]:
        raise NotImplementedError("no leaf here is read by eqx_ckpt itself (`reads` is false)")

    def start_read(self, record: LeafRecord, *, on_bytes: Callable[[int], None] | None = None) -> Read | None:
        return None

    def pack_runs(self, *, cached: bool) -> PackRuns:
        return PackRuns(self.loc, local=False, cached=cached)

    def writer(self, out: list[Any], tracker: Tracker | None, save: Save) -> Writer:
        return Writer(out, tracker)

    def base(self, opened: Callable[[], tuple[Location, _manifest.Manifest] | None]) -> _share.Base | None:
        return None

    def forget_damaged(self, error: BaseException, record: LeafRecord) -> None:
        """Nothing was verified or written by `_share` here."""

    def forget(self, directory: str) -> None:
        """Nothing was verified or written by `_share` here."""


# -- A save's writes -------------------------------------------------------------------------------


class Write:
    """One write of a save, admitted whole within the staging budget: `datas`
    (a leaf's pieces, a pack's members) of `nbytes`. `start(hosts)` returns its
    futures and their progress steps. `local`: started where interrupts never reach."""

    __slots__ = ("datas", "local", "nbytes", "start")

    def __init__(self, datas: list[Any], nbytes: int, start: Callable[[list[np.ndarray]], Any], local: bool):
        self.datas, self.nbytes, self.start, self.local = datas, nbytes, start, local


class Writer:
    """A save's writes through TensorStore, staged in a transaction and written
    out by its commit once every write has started (`commit`), or earlier when
    the staging window waits for their bytes (`_Commit.result`). Each commit's
    future goes in `out`. (Staged writes reference sources that never change.)"""

    def __init__(self, out: list[Any], tracker: Tracker | None):
        self._out, self._tracker = out, tracker
        self._transaction: Transaction | None = None
        self._commit: _Commit | None = None

    def leaf(self, record: LeafRecord, pieces: Pieces, nbytes: int, opened: Mapped) -> list[Write]:
        """The writes of a leaf with an array of its own (`opened`; `nbytes`
        stored bytes), a piece at a time; none where another process writes it."""
        datas = [piece for _, piece in pieces]
        if not datas:  # another process writes it
            return [Write([], 0, _written_elsewhere, False)]
        return [
            Write(
                [piece],
                _memory.nbytes(piece) if len(datas) > 1 else nbytes,
                functools.partial(self._piece, opened, index, i == len(datas) - 1),
                False,
            )
            for i, (index, piece) in enumerate(pieces)
        ]

    def pack(
        self, pack: PackRecord, records: list[LeafRecord], datas: list[Any], nbytes: int, run: range, opened: Mapped
    ) -> Write:
        """The write of the chunk files `run` of `pack` (`opened`) from its
        members `records` (pieces `datas`); the run's new contents count as staged."""
        contents = min(run.stop * pack.chunk, pack.size) - run.start * pack.chunk
        start = functools.partial(self._pack, opened, pack, records, run)
        return Write(datas, nbytes + contents * dtype_from_name(pack.dtype).itemsize, start, False)

    def _piece(self, opened: Mapped, index: Any, last: bool, hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
        """Stage the write of a leaf's piece (`last`: its last piece)."""
        store = opened.result()
        return self._stage([store[index] if index else store], hosts, [(hosts[0].nbytes, [0] if last else [])])

    def _pack(
        self, opened: Mapped, pack: PackRecord, records: list[LeafRecord], files: range, hosts: list[np.ndarray]
    ) -> tuple[list[Any], Steps]:
        """Stage the write of the chunk files `files` of `pack`."""
        starts, stops = _local_write.member_bounds(records)
        contents, lo = _pack_contents(pack, starts, stops, hosts, files)
        steps = pack_steps(pack, stops, [host.nbytes for host in hosts], files)
        store = opened.result()
        return self._stage([store[lo : lo + contents.size]], [contents], [(0, [s for _, done in steps for s in done])])

    def _stage(self, targets: list[Any], hosts: list[np.ndarray], steps: Steps) -> tuple[list[Any], Steps]:
        """Stage writes of `hosts` into `targets` in the open transaction,
        waited in order, so that progress is reported from this thread."""
        if self._transaction is None:
            self._transaction, self._commit = _storage.transaction(), _Commit(self)
        writes = []
        try:
            for target, host in zip(targets, hosts, strict=True):
                writes.append(target.write(host, self._transaction))
            for write, (nbytes, leaves) in zip(writes, steps):
                error = _interrupts.attempt(write.result)
                if error is not None:
                    raise error
                if self._tracker is not None:
                    self._tracker.advance(nbytes=nbytes)
                    self._tracker.count_leaves(leaves)
        except BaseException:
            self.abort()  # nothing staged was written out
            _interrupts.settle(writes)
            raise
        assert self._commit is not None
        return [self._commit], []

    def commit(self) -> None:
        """Every write has started: commit the open transaction, if any."""
        transaction, commit = self._transaction, self._commit
        if transaction is None or commit is None:
            return
        self._transaction = self._commit = None

        def start() -> None:
            commit.future = transaction.commit()
            self._out.append(commit.future)

        _interrupts.uninterrupted(start)

    def abort(self) -> None:
        """Start nothing more: what the open transaction staged is dropped."""
        if self._transaction is not None:
            self._transaction.abort()
        self._transaction = self._commit = None


class LocalWriter(Writer):
    """A save's writes by eqx_ckpt's own threads (`_local_write`): every pack,
    and each leaf `LocalFiles.writes_leaf`; any other as `Writer` writes it."""

    def __init__(self, files: LocalFiles, out: list[Any], tracker: Tracker | None, save: Save):
        super().__init__(out, tracker)
        self.files, self.base, self.remember = files, save.base, save.remember

    def leaf(self, record: LeafRecord, pieces: Pieces, nbytes: int, opened: Mapped) -> list[Write]:
        if not self.files.writes_leaf(record, pieces):
            return super().leaf(record, pieces, nbytes, opened)
        folder = self.base.leaf_folder(record) if self.base is not None else None
        return [Write([pieces[0][1]], nbytes, functools.partial(self._local_leaf, record, folder), True)]

    def pack(
        self, pack: PackRecord, records: list[LeafRecord], datas: list[Any], nbytes: int, run: range, opened: Mapped
    ) -> Write:
        folder = self.base.pack_folder(pack) if self.base is not None else None
        return Write(datas, nbytes, functools.partial(self._local_pack, pack, records, folder, run), True)

    def _local_leaf(self, record: LeafRecord, folder: str | None, hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
        futures = _local_write.start_write(self.files.loc, record, hosts[0], folder, remember=self.remember)
        return futures, leaf_steps(record.nbytes, len(futures))

    def _local_pack(
        self, pack: PackRecord, records: list[LeafRecord], folder: str | None, run: range, hosts: list[np.ndarray]
    ) -> tuple[list[Any], Steps]:
        loc, remember = self.files.loc, self.remember
        bounds = _local_write.member_bounds(records)
        futures = _local_write.start_pack(
            loc, pack, records, hosts, folder, remember=remember, files=run, bounds=bounds
        )
        return futures, pack_steps(pack, bounds[1], [host.nbytes for host in hosts], run)


def _written_elsewhere(hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
    return [], [(0, [0])]


class _Commit:
    """A `Writer` transaction's commit; waiting for it commits if still open."""

    __slots__ = ("future", "owner")

    def __init__(self, owner: Writer):
        self.owner = owner
        self.future: Future | None = None

    def result(self) -> None:
        if self.future is None and self.owner._commit is self:
            self.owner.commit()
        if self.future is not None:
            self.future.result()


def leaf_steps(nbytes: int, files: int) -> Steps:
    """A leaf written in `files` chunk files: equal shares of its bytes, done with the last."""
    n = max(files, 1)
    return [(nbytes * (k + 1) // n - nbytes * k // n, [0] if k == n - 1 else []) for k in range(n)]


def pack_steps(pack: PackRecord, ends: np.ndarray, sizes: list[int], files: range) -> Steps:
    """The chunk files `files` of a pack, written in order: each member (of
    `sizes` bytes, ending at `ends`) done with the file holding its last
    element (counted in the run of files that holds it)."""
    n = max(len(files), 1)
    total = max(-(-pack.size // pack.chunk), 1)
    last = np.minimum(np.maximum(ends - 1, 0) // pack.chunk, total - 1) - files.start
    kept = np.flatnonzero((last >= 0) & (last < max(len(files), 1)))
    # Members are in offset order, so the members each file completes are a run.
    stops = np.searchsorted(last[kept], np.arange(n), "right").tolist()
    done = [sizes[i] for i in kept.tolist()]
    return [(0, done[start:stop]) for start, stop in zip([0, *stops[:-1]], stops)]


def _pack_contents(
    pack: PackRecord, starts: np.ndarray, stops: np.ndarray, pieces: Sequence[np.ndarray], files: range
) -> tuple[np.ndarray, int]:
    """The contents of the chunk files `files` of `pack` (members at `[starts,
    stops)`, zeros between), and the offset they start at."""
    lo, hi = files.start * pack.chunk, min(files.stop * pack.chunk, pack.size)
    out = np.zeros(max(hi - lo, 0), dtype_from_name(pack.dtype))
    for offset, end, piece in zip(starts.tolist(), stops.tolist(), pieces, strict=True):
        start, stop = max(offset, lo), min(end, hi)
        if start < stop:
            flat = np.asarray(piece).reshape(-1)
            out[start - lo : stop - lo] = flat[start - offset : stop - offset]
    return out, lo


# -- A load's runs of packs ------------------------------------------------------------------------


class PackRuns:
    """The runs of packs in `loc` read by one load: with `local`, by eqx_ckpt
    itself, else through TensorStore's array of the pack, opened once per
    load (`cached`: shared, keeping decoded chunks for lazy leaves)."""

    def __init__(self, loc: Location, *, local: bool, cached: bool) -> None:
        self._loc, self._local, self._cached = loc, local, cached
        self._stores: dict[str, Mapped] = {}

    def start(self, pack: PackRecord, start: int, stop: int, leaf: LeafRecord) -> Read:
        """Start reading elements `[start, stop)` of `pack` for `leaf`, its first
        member read: a failure to open is `leaf`'s, raised now; a read's, when waited for."""
        if self._local and start < stop:  # (an empty run holds no chunk to read)
            return _deferred(self._loc, pack, start, stop)
        if pack.name not in self._stores:
            self._stores[pack.name] = _storage.open_pack(self._loc, pack, cached=self._cached, leaf=leaf.path)
        try:
            store = self._stores[pack.name].result()
        except Exception as e:
            raise leaf_io_error(e, leaf, self._loc, "open") from e
        return store[start:stop].read().result


def _deferred(loc: Location, pack: PackRecord, start: int, stop: int) -> Any:
    """`_local_read.start_pack_run`, its failure raised when waited for (where the caller knows the leaf)."""
    try:
        return _local_read.start_pack_run(loc, pack, start, stop)
    except Exception as e:
        error = e

        def failed() -> Any:
            raise error

        return failed
