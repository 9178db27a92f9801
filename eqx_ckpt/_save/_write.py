"""Writes through TensorStore, and the futures of a save's writes.

A save's writes are started in order within its staging budget by
`_staging.start_writes`, which hands each to its writer: eqx_ckpt's own
threads on a local disk (`_local_write`), else `TensorStore` here, which
stages them in a TensorStore transaction whose commit writes them out.
Either writer's futures report progress in `Steps` (`leaf_steps`,
`pack_steps`); the save waits for them (`wait_all`), or lets them settle
before an abort deletes what they wrote (`settle`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._base import _interrupts
from .._base._progress import Tracker
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from .._store import _storage

# What `_staging.Writing.follow` reports as each future of a write finishes, in order:
# bytes done within a leaf, and the sizes of the leaves done (`Tracker.count_leaves`).
Steps = list[tuple[int, list[int]]]


class TensorStore:
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
        steps = pack_steps(pack, records, [host.nbytes for host in hosts], files)
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
    """The commit of a transaction of `TensorStore`, its writes' future:
    waiting for it commits the transaction if it is still open."""

    __slots__ = ("future", "owner")

    def __init__(self, owner: TensorStore):
        self.owner, self.future = owner, None

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
