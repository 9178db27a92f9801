"""A save's writer of one location's chunk files, made by the location's
`_storage.ChunkFiles` (`writer`): the save hands it every write (a leaf's
pieces, a run of a pack's chunk files) and it never declines one.

Each is written one of two ways, chosen here from what the location's
chunk files take (`_storage.LocalFiles.writes` and `writes_leaf`): by
eqx_ckpt's own threads on a local disk (`LocalFiles.start_write` and
`start_pack`, `_local_write`), else through TensorStore (`TensorStore`),
which stages the writes in a `_storage.Transaction` whose commit writes
them out. The save admits each `Write` within its staging budget and
starts it (`_staging`); either way its futures report progress in `Steps`
(`leaf_steps`, `pack_steps`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._base import _interrupts
from .._base._progress import Tracker
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from . import _memory, _share

if TYPE_CHECKING:
    from ._storage import Future, Mapped, Pieces, Transaction, Writes

# What `_staging.Writing.follow` reports as each future of a write finishes, in order:
# bytes done within a leaf, and the sizes of the leaves done (`Tracker.count_leaves`).
Steps = list[tuple[int, list[int]]]


class Write:
    """One write of a save, admitted whole within the staging budget: a
    leaf's pieces, or a pack's members (`datas`, made host when staged),
    `nbytes` of host data held while it is staged and written. `start(hosts)`
    starts it from their host data and returns its futures (finished when
    written) and the progress steps they report (`_staging.Writing.follow`);
    `local`: started in the helper thread that interrupts never reach."""

    __slots__ = ("datas", "local", "nbytes", "start")

    def __init__(self, datas: list[Any], nbytes: int, start: Callable[[list[np.ndarray]], Any], local: bool):
        self.datas, self.nbytes, self.start, self.local = datas, nbytes, start, local


class OwnFiles(Protocol):
    """Chunk files that eqx_ckpt writes itself (`_storage.LocalFiles`)."""

    def writes_leaf(self, record: LeafRecord, pieces: Pieces) -> bool: ...

    def start_write(self, record: LeafRecord, piece: Any, base: str | None, *, remember: bool) -> Writes: ...

    def start_pack(
        self,
        pack: PackRecord,
        records: Sequence[LeafRecord],
        pieces: Sequence[Any],
        base: str | None,
        *,
        remember: bool,
        files: range,
    ) -> Writes: ...


class Writer:
    """A save's writes of the chunk files of one location: by eqx_ckpt's
    threads where `local` (the location's own files, `_storage.LocalFiles`,
    in a save it `writes`) takes them (every pack, each leaf it `writes_leaf`; chunk files
    equal to `base`'s shared, and with `remember` the digest of each written
    recorded, `_share`), else through `tensorstore`."""

    def __init__(self, local: OwnFiles | None, tensorstore: TensorStore, base: _share.Base | None, remember: bool):
        self.local, self.tensorstore, self.base, self.remember = local, tensorstore, base, remember

    def leaf(self, record: LeafRecord, pieces: Pieces, nbytes: int, opened: Mapped) -> list[Write]:
        """The writes of a leaf with an array of its own (`opened`, its array
        opened to write; `nbytes`, its stored bytes): whole, by eqx_ckpt's
        threads, or a piece at a time through TensorStore (a sharded leaf's
        shards, or its slices); none where another process writes it."""
        datas = [piece for _, piece in pieces]
        if self.local is not None and self.local.writes_leaf(record, pieces):
            folder = self.base.leaf_folder(record) if self.base is not None else None
            return [Write(datas, nbytes, functools.partial(self._local_leaf, record, folder), True)]
        if not datas:  # another process writes it
            return [Write([], 0, _written_elsewhere, False)]
        return [
            Write(
                [piece],
                _memory.nbytes(piece) if len(datas) > 1 else nbytes,
                functools.partial(self.tensorstore.piece, opened, index, i == len(datas) - 1),
                False,
            )
            for i, (index, piece) in enumerate(pieces)
        ]

    def pack(
        self, pack: PackRecord, records: list[LeafRecord], datas: list[Any], nbytes: int, run: range, opened: Mapped
    ) -> Write:
        """The write of the chunk files `run` of `pack` (`opened`, its array
        opened to write), from its members `records` (their pieces `datas`,
        `nbytes` stored bytes): by eqx_ckpt's threads, or through TensorStore,
        whose write of the run's contents, a new array, is counted as staged too."""
        if self.local is not None:
            folder = self.base.pack_folder(pack) if self.base is not None else None
            return Write(datas, nbytes, functools.partial(self._local_pack, pack, records, folder, run), True)
        contents = min(run.stop * pack.chunk, pack.size) - run.start * pack.chunk
        start = functools.partial(self.tensorstore.pack, opened, pack, records, run)
        return Write(datas, nbytes + contents * dtype_from_name(pack.dtype).itemsize, start, False)

    def commit(self) -> None:
        """Every write has started: commit what TensorStore staged."""
        self.tensorstore.commit()

    def abort(self) -> None:
        """Start nothing more through TensorStore: what it staged is dropped."""
        self.tensorstore.abort()

    def _local_leaf(self, record: LeafRecord, folder: str | None, hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
        assert self.local is not None
        futures = self.local.start_write(record, hosts[0], folder, remember=self.remember)
        return futures, leaf_steps(record.nbytes, len(futures))

    def _local_pack(
        self, pack: PackRecord, records: list[LeafRecord], folder: str | None, run: range, hosts: list[np.ndarray]
    ) -> tuple[list[Any], Steps]:
        assert self.local is not None
        futures = self.local.start_pack(pack, records, hosts, folder, remember=self.remember, files=run)
        return futures, pack_steps(pack, records, [host.nbytes for host in hosts], run)


def _written_elsewhere(hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
    return [], [(0, [0])]


class TensorStore:
    """Writes through TensorStore: staged in a transaction (`begin()` starts
    one: `_storage.transaction`), progress reported as each is staged, whose
    commit writes them out; committed once every write has started
    (`commit`), or earlier when the staging window waits for their bytes
    (`_Commit.result`). Each commit's future goes in `out`.

    Staged in a transaction, a write only references its source until the
    commit: the host data of a jax.Array never changes (a view of it keeps
    its buffer alive through `delete()` and donation), and the caller's NumPy
    arrays were copied before an asynchronous save returned."""

    def __init__(self, out: list[Any], tracker: Tracker | None, begin: Callable[[], Transaction]):
        self._out, self._tracker, self._begin = out, tracker, begin
        self._transaction: Transaction | None = None
        self._commit: _Commit | None = None

    def piece(self, opened: Mapped, index: Any, last: bool, hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
        """Stage the write of a leaf's piece (`last`: its last piece)."""
        store = opened.result()
        return self._stage([store[index] if index else store], hosts, [(hosts[0].nbytes, [0] if last else [])])

    def pack(
        self,
        opened: Mapped,
        pack: PackRecord,
        records: list[LeafRecord],
        files: range,
        hosts: list[np.ndarray],
    ) -> tuple[list[Any], Steps]:
        """Stage the write of the chunk files `files` of `pack`."""
        contents, lo = _pack_contents(pack, records, hosts, files)
        steps = pack_steps(pack, records, [host.nbytes for host in hosts], files)
        store = opened.result()
        return self._stage([store[lo : lo + contents.size]], [contents], [(0, [s for _, done in steps for s in done])])

    def _stage(self, targets: list[Any], hosts: list[np.ndarray], steps: Steps) -> tuple[list[Any], Steps]:
        """Stage writes of `hosts` into `targets` in the open transaction,
        waited in order, so that progress is reported from this thread."""
        if self._transaction is None:
            self._transaction, self._commit = self._begin(), _Commit(self)
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
        """Commit the open transaction, if any: its writes are written out."""
        transaction, commit = self._transaction, self._commit
        if transaction is None or commit is None:
            return
        self._transaction = self._commit = None

        def start() -> None:
            commit.future = transaction.commit()
            self._out.append(commit.future)

        _interrupts.uninterrupted(start)

    def abort(self) -> None:
        """Drop the open transaction: nothing it staged is written out."""
        if self._transaction is not None:
            self._transaction.abort()
        self._transaction = self._commit = None


class _Commit:
    """The commit of a transaction of `TensorStore`, its writes' future:
    waiting for it commits the transaction if it is still open."""

    __slots__ = ("future", "owner")

    def __init__(self, owner: TensorStore):
        self.owner = owner
        self.future: Future | None = None

    def result(self) -> None:
        if self.future is None and self.owner._commit is self:
            self.owner.commit()
        if self.future is not None:
            self.future.result()


def leaf_steps(nbytes: int, files: int) -> Steps:
    """A leaf written in `files` chunk files: its bytes in equal shares as
    each lands, the leaf done with the last."""
    n = max(files, 1)
    return [(nbytes * (k + 1) // n - nbytes * k // n, [0] if k == n - 1 else []) for k in range(n)]


def pack_steps(pack: PackRecord, records: Sequence[LeafRecord], sizes: list[int], files: range) -> Steps:
    """The chunk files `files` of a pack, written in order: each member (of
    `sizes` bytes) done once the file holding its last element has landed
    (a member whose last element is in another run of files is counted there)."""
    n = max(len(files), 1)
    total = max(-(-pack.size // pack.chunk), 1)
    ends = np.fromiter((r.offset + r.size for r in records), np.int64, len(records))
    last = np.minimum(np.maximum(ends - 1, 0) // pack.chunk, total - 1) - files.start
    kept = np.flatnonzero((last >= 0) & (last < max(len(files), 1)))
    # Members are in offset order, so the members each file completes are a run.
    stops = np.searchsorted(last[kept], np.arange(n), "right").tolist()
    done = [sizes[i] for i in kept.tolist()]
    return [(0, done[start:stop]) for start, stop in zip([0, *stops[:-1]], stops)]


def _pack_contents(
    pack: PackRecord, records: Sequence[LeafRecord], pieces: Sequence[np.ndarray], files: range
) -> tuple[np.ndarray, int]:
    """The contents of the chunk files `files` of `pack` (each leaf's bytes at
    its offset, zeros between), and the offset they start at."""
    lo, hi = files.start * pack.chunk, min(files.stop * pack.chunk, pack.size)
    out = np.zeros(max(hi - lo, 0), dtype_from_name(pack.dtype))
    for record, piece in zip(records, pieces, strict=True):
        start, stop = max(record.offset, lo), min(record.offset + record.size, hi)
        if start < stop:
            flat = np.asarray(piece).reshape(-1)
            out[start - lo : stop - lo] = flat[start - record.offset : stop - record.offset]
    return out, lo
