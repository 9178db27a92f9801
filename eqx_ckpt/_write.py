"""Writing a save's arrays: create them, write them (on a local disk by
eqx_ckpt's own threads, `_local_write`; else through TensorStore), and wait for
the writes, or let them settle before an abort deletes what they wrote.

What is written comes planned (`_records`): a `Batch` of leaves, each with its
record and pieces, sorted by where they go. Their host data is made as the
writes reach them, within the save's staging budget (`_staging`)."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import (
    _durable,
    _faults,
    _format,
    _interrupts,
    _layout,
    _local_write,
    _multihost,
    _share,
    _staging,
    _storage,
    _transaction,
)
from ._errors import IntegrityError
from ._format import LeafRecord, PackRecord, dtype_from_name
from ._location import Location
from ._progress import Tracker
from ._records import Pending


class Batch:
    """A save's pending leaves (records final, packs assigned), sorted once by
    where they are written: `own`, the leaves with an array of their own, and
    `packs`, each pack with its members, by name; `nbytes`, their stored bytes."""

    def __init__(self, pending: list[Pending], *, made: list[Any] | None = None, structure: Any = None):
        self.pending = pending
        # The tree's structure record, for the manifest (`_structure`).
        self.structure = structure
        # Other lists the save made along with `pending` (its flattened tree):
        # freed with it, by `free`.
        self.made = made if made is not None else []
        self.freed = False
        # How an `IntegrityError` met while writing is said (a partial save's
        # refusal to keep a damaged leaf: `_partial.Partial.kept_damaged`).
        self.refused: Callable[[IntegrityError], IntegrityError] | None = None
        self.own: list[Pending] = []
        members: dict[str, tuple[PackRecord, list[Pending]]] = {}
        nbytes = 0
        for p in pending:
            pack = p.record.pack
            if pack is None:
                self.own.append(p)
            elif pack.name in members:
                members[pack.name][1].append(p)
            else:
                members[pack.name] = (pack, [p])
            nbytes += p.nbytes
        self.packs = [members[name] for name in sorted(members)]
        self.nbytes = nbytes

    def records(self) -> list[LeafRecord]:
        if self.freed:
            raise RuntimeError("Internal error: the records of a save were asked for after they were freed.")
        return [p.record for p in self.pending]

    def free(self) -> None:
        """Empty this batch, freeing its records and host views (the writes keep
        references of their own to the data): called once the records are
        encoded, while the writes are in flight: freeing ten thousand leaves'
        records, views and key paths is measurable (docs/benchmarks.md), and
        the end of a save waited for it; freed here, it overlaps the writes. A few hundred at a
        time, so that the writer threads get the GIL between them."""
        self.freed = True
        lists: list[list[Any]] = [self.pending, self.own, *(members for _, members in self.packs)]
        for items in [*lists, self.packs, self.made]:
            while items:
                del items[-_FREE_STEP:]
        _faults.fire("save.records_freed")


_FREE_STEP = 256


# What `Writing.follow` reports as each future of a write finishes, in order:
# bytes done within a leaf, and the sizes of the leaves done (`Tracker.count_leaves`).
Steps = list[tuple[int, list[int]]]


def start_writes(
    tx: _transaction.Transaction,
    batch: Batch,
    group: _multihost.Group,
    *,
    budget: int,
    tracker: Tracker | None = None,
    out: list[Any],
    base: _share.Base | None = None,
    remember: bool = False,
) -> Writing:
    """Create every array, then start writing them, in order, as many as the
    staging budget (`budget` bytes of host data staged and not yet written:
    `_staging`) admits: on a local disk by eqx_ckpt's own threads, else
    through TensorStore, staged in a transaction whose commit writes them
    out. Puts in `out` every future that finishes when data is written (not
    yet durable): an interrupt after one started still leaves it there, so
    an abort waits for it before deleting anything. Returns the `Writing`,
    whose `follow` starts the rest as room frees; the caller may work first.
    Chunk files equal to `base`'s are shared; with `remember`, the digest of
    every chunk file written is recorded (`_share.written`).
    """
    _faults.fire("save.start_writes", tx.loc)
    data = tx.data
    opens = _create(data, batch, group)
    local = _local_write.chosen(data, processes=group.count, layout=tx.layout)
    tensorstore = _TensorStore(out, tracker)
    units = _units(data, batch, opens, local, base if local else None, remember, tensorstore, budget)
    writing = Writing(units, budget, out, tensorstore)
    try:
        writing.fill()
    except BaseException:
        tensorstore.abort()
        settle(opens)
        raise
    return writing


def _create(data: Location, batch: Batch, group: _multihost.Group) -> list[Any]:
    """Create the arrays: process 0 creates their metadata (and the groups'),
    the other processes open them once it has (a store cannot be written
    before its metadata exists). The futures of the opened arrays:
    `batch.own`'s, then (in process 0) the packs'."""
    opens: list[Any] = []
    created: BaseException | None = None
    if group.primary:
        groups: list[Any] = []

        def create() -> None:
            # In a helper thread, which keeps every future it starts (see
            # `_interrupts.uninterrupted`): a creation landing after an abort would leave
            # a file the next save refuses to write beside.
            _durable.ensure_directory(data)
            for p in batch.own:
                opens.append(_storage.create_array(data, p.record, synced=False))
            for pack, _ in batch.packs:
                opens.append(_storage.create_spec(_storage.pack_spec(data, pack), data, synced=False))
            groups.extend(_group_writes(data, batch.records()))

        try:
            _interrupts.uninterrupted(create)
        except BaseException:
            # What was started must finish before an abort deletes it.
            settle([*opens, *groups])
            raise
        # Every future, not just up to the first failure: an abort must find every file.
        try:
            created = wait_all([*opens, *groups], None)
        except BaseException:  # an interrupt: nothing may be left running
            settle([*opens, *groups])
            raise
    error = group.sync("created", created)
    if error is not None:
        raise error
    if not group.primary:
        try:
            for p in batch.own:
                opens.append(_storage.open_to_write(data, p.record))
        except BaseException:
            settle(opens)
            raise
    return opens


class _Unit:
    """One write of a save, admitted whole within the staging budget: a
    leaf's pieces, or a pack's members (`datas`, made host when staged),
    `nbytes` of host data held while it is staged and written. `start(hosts)`
    starts it from their host data and returns its futures (finished when
    written) and the progress steps they report (`Writing.follow`); `local`:
    started in the helper thread that interrupts never reach."""

    __slots__ = ("datas", "local", "nbytes", "start")

    def __init__(self, datas: list[Any], nbytes: int, start: Callable[[list[np.ndarray]], Any], local: bool):
        self.datas, self.nbytes, self.start, self.local = datas, nbytes, start, local


def _units(
    data: Location,
    batch: Batch,
    opens: list[Any],
    local: bool,
    base: _share.Base | None,
    remember: bool,
    tensorstore: _TensorStore,
    budget: int,
) -> list[_Unit]:
    """The save's writes, in order: each leaf with an array of its own (on a
    local disk, by eqx_ckpt's threads where `_local_write.eligible`), then each
    pack, a run of its chunk files at a time, runs of about a quarter of the
    `budget` (by eqx_ckpt's threads with `local`; else the run's contents, a
    new array, are counted as staged too)."""
    units = []
    for n, p in enumerate(batch.own):
        datas, nbytes = [piece for _, piece in p.pieces], p.nbytes
        if local and _local_write.eligible(p.record, p.pieces):
            folder = base.leaf_folder(p.record) if base is not None else None
            units.append(_Unit(datas, nbytes, functools.partial(_start_leaf, data, p.record, folder, remember), True))
        elif not datas:  # another process writes it
            units.append(_Unit([], 0, _written_elsewhere, False))
        else:
            # A piece at a time (a sharded leaf's shards, or its slices).
            for i, (index, piece) in enumerate(p.pieces):
                start = functools.partial(tensorstore.piece, opens[n], index, i == len(datas) - 1)
                units.append(_Unit([piece], _staging.nbytes(piece) if len(datas) > 1 else nbytes, start, False))
    for k, (pack, members) in enumerate(batch.packs):
        folder = base.pack_folder(pack) if base is not None and local else None
        itemsize = dtype_from_name(pack.dtype).itemsize
        for files, part in _pack_parts(pack, members, max(1, budget // 4)):
            datas, records = [p.pieces[0][1] for p in part], [p.record for p in part]
            nbytes = sum(p.nbytes for p in part)
            if local:
                start = functools.partial(_start_pack, data, pack, records, folder, remember, files)
                units.append(_Unit(datas, nbytes, start, True))
            else:
                start = functools.partial(tensorstore.pack, opens[len(batch.own) + k], pack, records, files)
                size = min(files.stop * pack.chunk, pack.size) - files.start * pack.chunk
                units.append(_Unit(datas, nbytes + size * itemsize, start, False))
    return units


def _pack_parts(pack: PackRecord, members: list[Pending], limit: int) -> list[tuple[range, list[Pending]]]:
    """A pack's chunk files in runs (at least one file each) whose members
    hold about `limit` bytes, each with the members it needs (in offset
    order): a pack is staged a run at a time. A member across the edge of two
    runs is in both."""
    total = -(-pack.size // pack.chunk)
    parts: list[tuple[range, list[Pending]]] = []
    part: list[Pending] = []
    first, nbytes = 0, 0
    for p in members:
        start = p.record.offset // pack.chunk
        if part and start > first and nbytes >= limit:
            parts.append((range(first, start), part))
            part = [q for q in part if _last_file(pack, q.record) >= start]
            first, nbytes = start, sum(q.nbytes for q in part)
        part.append(p)
        nbytes += p.nbytes
    parts.append((range(first, total), part))
    return parts


def _last_file(pack: PackRecord, record: LeafRecord) -> int:
    """The chunk file of `pack` holding `record`'s last element (its first, if it has none)."""
    return max(record.offset + record.size - 1, record.offset) // pack.chunk


def _written_elsewhere(hosts: list[np.ndarray]) -> tuple[list[Any], Steps]:
    return [], [(0, [0])]


def _start_leaf(
    data: Location, record: LeafRecord, folder: str | None, remember: bool, hosts: list[np.ndarray]
) -> tuple[list[Any], Steps]:
    futures = _local_write.start_write(data, record, hosts[0], folder, remember=remember)
    return futures, _leaf_steps(record.nbytes, len(futures))


def _start_pack(
    data: Location,
    pack: PackRecord,
    records: list[LeafRecord],
    folder: str | None,
    remember: bool,
    files: range,
    hosts: list[np.ndarray],
) -> tuple[list[Any], Steps]:
    futures = _local_write.start_pack(data, pack, records, hosts, folder, remember=remember, files=files)
    return futures, _pack_steps(pack, records, [host.nbytes for host in hosts], files)


class Writing:
    """A save's writes: started in order as the staging budget admits them
    (`_staging.Window`: `fill`), and followed to their end, each one's host
    data released as it is written (`follow`)."""

    def __init__(self, units: list[_Unit], budget: int, out: list[Any], tensorstore: _TensorStore):
        self._window = _staging.Window(units, budget)
        self._started: collections.deque[tuple[_Unit, list[Any], Steps]] = collections.deque()
        self._out, self._tensorstore = out, tensorstore

    def fill(self) -> None:
        """Stage and start the next writes that fit, without waiting for any
        write; once every write has started, commit what TensorStore staged."""
        batch: list[tuple[_Unit, list[np.ndarray]]] = []
        size = 0
        for unit in self._window.admit():
            batch.append((unit, [_staging.host(piece) for piece in unit.datas]))
            size += unit.nbytes
            if size >= _START_BYTES:
                self._start(batch)
                batch, size = [], 0
        self._start(batch)
        if not self._window.waiting:
            self._tensorstore.commit()

    def _start(self, batch: list[tuple[_Unit, list[np.ndarray]]]) -> None:
        started: list[tuple[_Unit, list[Any], Steps]] = []

        def start_local() -> None:
            # In a helper thread: every future started is kept in `out`.
            for unit, hosts in batch:
                if unit.local:
                    futures, steps = unit.start(hosts)
                    self._out.extend(futures)
                    started.append((unit, futures, steps))

        if any(unit.local for unit, _ in batch):
            _interrupts.uninterrupted(start_local)
        for unit, hosts in batch:
            if not unit.local:
                started.append((unit, *unit.start(hosts)))
        batch.clear()  # the host data is the writes' now
        self._started.extend(started)

    def stop(self) -> None:
        """Start nothing more (the save has failed); what TensorStore staged is dropped."""
        self._window.drop()
        self._tensorstore.abort()

    def follow(self, tracker: Tracker) -> BaseException | None:
        """Report progress as the writes finish, oldest first (bytes as each
        chunk file is written, so a large leaf moves in steps; its leaves with
        the last), releasing each one's staged bytes and starting the next
        that fit. A failed write stops the rest (its error is the caller's to
        wait for, in `out`); returns the error of staging or starting one."""
        error = None
        while self._started:
            unit, futures, steps = self._started.popleft()
            failed = False
            for k, (nbytes, leaves) in enumerate(steps):
                if k < len(futures) and attempt(futures[k].result) is not None:
                    failed = True
                    break
                tracker.advance(nbytes=nbytes)
                tracker.count_leaves(leaves)
            for future in futures[len(steps) :] if not failed else []:
                failed = attempt(future.result) is not None or failed
            self._window.release(unit)
            if failed:
                self.stop()
            elif self._window.waiting and error is None:
                error = attempt(self.fill)
                if error is not None:
                    self.stop()
        return error


# Staged writes are started in groups of about this many bytes: one handoff
# to the helper thread (`_interrupts`) for each group, not for each leaf.
_START_BYTES = 16 << 20


class _TensorStore:
    """Writes through TensorStore: staged in a transaction (progress reported
    as each is staged), whose commit writes them out; committed once every
    write has started (`commit`), or earlier when the staging window waits
    for their bytes (`_Commit.result`). Each commit's future goes in `out`.

    Staged in a transaction, a write only references its source until the
    commit: the host data of a jax.Array never changes (a view of it keeps
    its buffer alive through `delete()` and donation), and the caller's NumPy
    arrays were copied before an asynchronous save returned."""

    def __init__(self, out: list[Any], tracker: Tracker | None):
        self._out, self._tracker = out, tracker
        self._transaction: Any = None
        self._commit: _Commit | None = None

    def piece(
        self, opened: _storage.Mapped, index: Any, last: bool, hosts: list[np.ndarray]
    ) -> tuple[list[Any], Steps]:
        """Stage the write of a leaf's piece (`last`: its last piece)."""
        store = opened.result()
        return self._stage([store[index] if index else store], hosts, [(hosts[0].nbytes, [0] if last else [])])

    def pack(
        self,
        opened: _storage.Mapped,
        pack: PackRecord,
        records: list[LeafRecord],
        files: range,
        hosts: list[np.ndarray],
    ) -> tuple[list[Any], Steps]:
        """Stage the write of the chunk files `files` of `pack`."""
        contents, lo = _pack_contents(pack, records, hosts, files)
        steps = _pack_steps(pack, records, [host.nbytes for host in hosts], files)
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
                error = attempt(write.result)
                if error is not None:
                    raise error
                if self._tracker is not None:
                    self._tracker.advance(nbytes=nbytes)
                    self._tracker.count_leaves(leaves)
        except BaseException:
            self.abort()  # nothing staged was written out
            settle(writes)
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
    """The commit of a transaction of `_TensorStore`, its writes' future:
    waiting for it commits the transaction if it is still open."""

    __slots__ = ("future", "owner")

    def __init__(self, owner: _TensorStore):
        self.owner, self.future = owner, None

    def result(self) -> None:
        if self.future is None and self.owner._commit is self:
            self.owner.commit()
        if self.future is not None:
            self.future.result()


def _leaf_steps(nbytes: int, files: int) -> Steps:
    """A leaf written in `files` chunk files: its bytes in equal shares as
    each lands, the leaf done with the last."""
    n = max(files, 1)
    return [(nbytes * (k + 1) // n - nbytes * k // n, [0] if k == n - 1 else []) for k in range(n)]


def _pack_steps(pack: PackRecord, records: Sequence[LeafRecord], sizes: list[int], files: range) -> Steps:
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


def protect(pending: list[Pending]) -> None:
    """Make the pieces of `pending` safe from the caller, who may change or
    delete its arrays once an asynchronous save has returned: a `jax.Array`'s
    by its host data (which never changes), a NumPy leaf's by a private copy
    (`_staging.protected`; a cast of either stays deferred)."""
    for p in pending:
        copy = p.record.type == "numpy"
        p.pieces = [(index, _staging.protected(piece, copy)) for index, piece in p.pieces]
    _faults.fire("save.copied", pending)


def _group_writes(data: Location, records: list[LeafRecord]) -> list[Any]:
    """Zarr v3 group metadata for every folder above a leaf (and for the data
    root: see `_layout.groups`), so zarr tools can walk the tree."""
    groups = {_format.metadata_key(g): _format.GROUP_JSON for g in _layout.groups(records)}
    return _storage.start_writes(data, groups, synced=False)


def attempt(run: Callable[[], Any]) -> BaseException | None:
    """Run `run`; its error, or `None`. Interrupts (KeyboardInterrupt,
    SystemExit) are not errors of the save: they propagate as themselves."""
    try:
        run()
    except Exception as e:  # returned, and raised by the caller
        return e
    return None


def wait_all(futures: list[Any], error: BaseException | None) -> BaseException | None:
    """Wait for every future; the first error (or `error`, if given)."""
    for future in futures:
        error = error or attempt(future.result)
    return error


def _stored(future: Any) -> BaseException | None:
    """The exception a finished `concurrent.futures.Future` holds (TensorStore's
    futures never hold an interrupt)."""
    if isinstance(future, concurrent.futures.Future) and future.done() and not future.cancelled():
        return future.exception()
    return None


def settle(futures: list[Any]) -> None:
    """Wait until no write of `futures` is still running, so that deleting what
    they wrote cannot race them. Errors are ignored (the save has failed
    already); a further interrupt is raised once all have settled."""
    interrupt: BaseException | None = None
    for future in futures:
        while True:
            try:
                future.result()
                break
            except Exception:
                break
            except BaseException as e:  # raised below, once every write has stopped
                if _stored(future) is e:
                    break  # the write's own outcome (raised in a writer thread), not an interrupt of the wait
                interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
