"""Writing a save's arrays: create them, write them (on a local disk by
eqx_ckpt's own threads, `_local_write`; else through TensorStore), and wait for
the writes, or let them settle before an abort deletes what they wrote.

What is written comes planned (`_records`): a `Batch` of leaves, each with its
record and host pieces, sorted by where they go."""

from __future__ import annotations

import concurrent.futures
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
    _memory,
    _multihost,
    _share,
    _storage,
    _transaction,
)
from ._format import LeafRecord, PackRecord, dtype_from_name
from ._location import Location
from ._progress import Tracker
from ._records import Pending


class Batch:
    """A save's pending leaves (records final, packs assigned), sorted once by
    where they are written: `own`, the leaves with an array of their own, and
    `packs`, each pack with its members, by name; `nbytes`, their host bytes."""

    def __init__(self, pending: list[Pending], *, made: list[Any] | None = None, structure: Any = None):
        self.pending = pending
        # The tree's structure record, for the manifest (`_structure`).
        self.structure = structure
        # Other lists the save made along with `pending` (its flattened tree):
        # freed with it, by `free`.
        self.made = made if made is not None else []
        self.freed = False
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
            for _, piece in p.pieces:
                nbytes += piece.nbytes
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


# (leaves, bytes, futures) of the writes `start_writes` leaves running, in order.
# What `follow` reports as each future of a write finishes, in order: bytes
# done within a leaf, and the sizes of the leaves done (`Tracker.count_leaves`).
Steps = list[tuple[int, list[int]]]
Writing = list[tuple[list[Any], Steps]]


def start_writes(
    tx: _transaction.Transaction,
    batch: Batch,
    group: _multihost.Group,
    *,
    tracker: Tracker | None = None,
    out: list[Any],
    base: _share.Base | None = None,
    remember: bool = False,
) -> Writing:
    """Create every array, then start writing them: on a local disk by
    eqx_ckpt's own threads, else staged in one TensorStore transaction whose
    commit writes them out. Puts in `out` every future that finishes when data
    is written (not yet durable): an interrupt after one started still leaves
    it there, so an abort waits for it before deleting anything. Returns what
    `follow` reports the progress of; the caller may work while the data is
    written. Chunk files equal to `base`'s are shared; with `remember`, the
    digest of every chunk file written is recorded (`_share.written`).
    """
    _faults.fire("save.start_writes", tx.loc)
    data = tx.data
    opens = _create(data, batch, group)
    local = _local_write.chosen(data, processes=group.count, layout=tx.layout)
    fast = {i for i, p in enumerate(batch.own) if local and _local_write.eligible(p.record, p.pieces)}
    writing = _start_local(data, batch, fast, local, out, base if local else None, remember)
    _start_tensorstore(batch, opens, fast, local, tracker, out)
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


def _start_local(
    data: Location,
    batch: Batch,
    fast: set[int],
    packs: bool,
    out: list[Any],
    base: _share.Base | None,
    remember: bool,
) -> Writing:
    """Start writing, by eqx_ckpt's own threads (`_local_write`), the chunk
    files of the leaves `fast` (indices into `batch.own`) and, with `packs`,
    of every pack, each file's writeback started at once (or shared with
    `base`'s, `_share`; recorded with its digest where `remember`)."""
    own, direct = batch.own, []

    def start() -> None:
        # In a helper thread too: every future started is kept in `out`.
        for i in sorted(fast):
            folder = base.leaf_folder(own[i].record) if base is not None else None
            futures = _local_write.start_write(data, own[i].record, own[i].pieces[0][1], folder, remember=remember)
            out.extend(futures)
            direct.append((futures, _leaf_steps(own[i].record.nbytes, len(futures))))
        for pack, members in batch.packs if packs else []:
            views = [p.pieces[0][1] for p in members]
            folder = base.pack_folder(pack) if base is not None else None
            futures = _local_write.start_pack(data, pack, [p.record for p in members], views, folder, remember=remember)
            out.extend(futures)
            steps = _pack_steps(pack, [p.record for p in members], [view.nbytes for view in views], len(futures))
            direct.append((futures, steps))

    if fast or (packs and batch.packs):
        _interrupts.uninterrupted(start)
    return direct


def _leaf_steps(nbytes: int, files: int) -> Steps:
    """A leaf written in `files` chunk files: its bytes in equal shares as
    each lands, the leaf done with the last."""
    n = max(files, 1)
    return [(nbytes * (k + 1) // n - nbytes * k // n, [0] if k == n - 1 else []) for k in range(n)]


def _pack_steps(pack: PackRecord, records: Sequence[LeafRecord], sizes: list[int], files: int) -> Steps:
    """A pack written in `files` chunk files, in order: each member (of
    `sizes` bytes) done once the file holding its last element has landed."""
    n = max(files, 1)
    ends = np.fromiter((r.offset + r.size for r in records), np.int64, len(records))
    # Members are in offset order, so the members each file completes are a run.
    last = np.minimum(np.maximum(ends - 1, 0) // pack.chunk, n - 1)
    stops = np.searchsorted(last, np.arange(n), "right").tolist()
    return [(0, sizes[start:stop]) for start, stop in zip([0, *stops[:-1]], stops)]


def _start_tensorstore(
    batch: Batch, opens: list[Any], skip: set[int], local_packs: bool, tracker: Tracker | None, out: list[Any]
) -> None:
    """Write through TensorStore the leaves of `batch.own` not in `skip` and,
    unless they went the local way (`local_packs`), the packs: every write
    staged in one transaction (progress reported as each is staged), whose
    commit then starts writing them out; its future goes in `out`."""
    # Staged in one transaction, every write only references its source until
    # the background commit. (The host data of a jax.Array never changes: a view
    # of it keeps its buffer alive through `delete()` and donation; the caller's
    # NumPy arrays were copied before an asynchronous save returned.)
    own = batch.own
    transaction, writes, steps = _storage.transaction(), [], []
    try:
        for n, (p, opened) in enumerate(zip(own, opens[: len(own)], strict=True)):
            if n in skip:
                continue
            store = opened.result().with_transaction(transaction)
            for i, (index, piece) in enumerate(p.pieces):
                target = store[index] if index else store
                writes.append(target.write(piece, can_reference_source_data_indefinitely=True))
                steps.append((piece.nbytes, [0] if i == len(p.pieces) - 1 else []))
        for (pack, members), opened in zip(batch.packs if not local_packs else [], opens[len(own) :]):
            views = [p.pieces[0][1] for p in members]
            contents = _pack_contents(pack, [p.record for p in members], views)
            store = opened.result().with_transaction(transaction)
            writes.append(store.write(contents, can_reference_source_data_indefinitely=True))
            steps.append((0, [view.nbytes for view in views]))
        # Waited in order, so that progress is reported from this thread as writes complete.
        if tracker is not None:
            tracker.count_leaves([0 for p in own if not p.pieces])
        staged = None
        for write, (nbytes, leaves) in zip(writes, steps):
            staged = staged or attempt(write.result)
            if staged is None and tracker is not None:
                tracker.advance(nbytes=nbytes)
                tracker.count_leaves(leaves)
    except BaseException:
        transaction.abort()  # nothing staged was written out
        settle([*opens, *writes])
        raise
    if staged is not None:
        transaction.abort()  # nothing was written out
        raise staged
    _interrupts.uninterrupted(lambda: out.append(transaction.commit_async()))


def _pack_contents(pack: PackRecord, records: Sequence[LeafRecord], pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The contents of `pack`: each leaf's bytes at its offset (zeros between)."""
    out = np.zeros(pack.size, dtype_from_name(pack.dtype))
    for record, piece in zip(records, pieces, strict=True):
        out[record.offset : record.offset + record.size] = np.asarray(piece).reshape(-1)
    return out


def follow(writing: Writing, tracker: Tracker) -> None:
    """Report the progress of `writing` as it finishes: bytes as each chunk
    file is written (a large leaf moves in steps), its leaves with the last.
    A failed write is reported by the caller's wait for `start_writes`'s
    futures; here only progress."""
    for futures, steps in writing:
        for k, (nbytes, leaves) in enumerate(steps):
            if k < len(futures) and attempt(futures[k].result) is not None:
                break
            tracker.advance(nbytes=nbytes)
            tracker.count_leaves(leaves)


def copy_numpy_leaves(pending: list[Pending]) -> None:
    """Copy the host data of NumPy leaves, which the caller may change once an
    asynchronous save has returned (a jax.Array's host data never changes)."""
    mine = [p for p in pending if p.record.type == "numpy"]
    copies = iter(_memory.private_copies([piece for p in mine for _, piece in p.pieces]))
    for p in mine:
        p.pieces = [(index, next(copies)) for index, _ in p.pieces]
    _faults.fire("save.copied", pending)


def _group_writes(data: Location, records: list[LeafRecord]) -> list[Any]:
    """Zarr v3 group metadata for every folder above a leaf (and for the data
    root: see `_layout.groups`), so zarr tools can walk the tree."""
    store = _storage.kvstore(data, synced=False)
    return [store.write(_format.metadata_key(g), _format.GROUP_JSON) for g in _layout.groups(records)]


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
