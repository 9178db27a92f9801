"""A save's writes: its leaves sorted by where they are written (`Batch`), the
arrays created (`create`), then the writes started in order within the save's
staging budget (`start_writes`), each made by the location's writer.

A piece's host data (a `jax.Array`, a NumPy array, or a `_memory.Deferred`
cast, slice or PRNG key's data) is made as its write is admitted (`Window`)
and released once written. Every piece admitted counts at its stored size,
whether staging copies it or not (docs/scaling.md, "Host memory of a save").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import _faults, _interrupts
from .._base._errors import CheckpointTypeError, CheckpointValueError, IntegrityError
from .._base._interrupts import attempt, settle, wait_all
from .._base._location import Location
from .._base._progress import Tracker
from .._ondisk import _format, _layout
from .._ondisk._format import LeafRecord, PackRecord
from .._store import _chunk_files, _durable, _memory, _storage, _window
from .._store._chunk_files import Steps, Write, Writer

if TYPE_CHECKING:
    from ._records import Pending


# The default staging budget, as a fraction of this machine's physical memory
# (`staging_bytes=None`), and its floor: a machine whose memory cannot be
# read gets the floor.
STAGING_FRACTION = 0.25
STAGING_MIN_BYTES = 64 << 20
# On an accelerator every piece staged is a copy to the host, and a save
# there is fastest with about this much in flight (docs/benchmarks.md,
# "Measurements behind the design"): its default budget is at most this.
ACCELERATOR_STAGING_BYTES = 1 << 30


def budget(staging_bytes: Any) -> int:
    """The staging budget of a save, in bytes: `staging_bytes` checked, or by
    default `STAGING_FRACTION` of physical memory (at least `STAGING_MIN_BYTES`;
    in a process with an accelerator, at most `ACCELERATOR_STAGING_BYTES`)."""
    if staging_bytes is None:
        memory = _memory.physical_memory()
        default = max(STAGING_MIN_BYTES, int((memory or 0) * STAGING_FRACTION))
        return default if _memory.only_cpus() else min(default, ACCELERATOR_STAGING_BYTES)
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, (int, np.integer)):
        raise CheckpointTypeError(
            f"`staging_bytes` must be a positive int (the host bytes a save stages at a time) or `None` "
            f"(a {STAGING_FRACTION:g} of this machine's memory); not {staging_bytes!r}."
        )
    if staging_bytes <= 0:
        raise CheckpointValueError(
            f"`staging_bytes` must be a positive int (the host bytes a save stages at a time); not {staging_bytes}."
        )
    return int(staging_bytes)


class Batch:
    """A save's pending leaves (records final, packs assigned), sorted once by
    where they are written: `own`, the leaves with an array of their own, and
    `packs`, each pack with its members, by name; `nbytes`, their stored bytes.

    `structure`: the tree's structure record; `plan`: the `_records.Plan` these
    records are kept in; `made`: other lists made with `pending` (the flattened
    tree), freed with it; `refused`: how an `IntegrityError` met while writing
    is said (a partial save's `_partial.Partial.kept_damaged`)."""

    def __init__(
        self, pending: list[Pending], *, made: list[Any] | None = None, structure: Any = None, plan: Any = None
    ):
        self.pending = pending
        self.structure = structure
        self.plan = plan
        self.made = made if made is not None else []
        self.freed = False
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
        """Empty this batch once the records are encoded (the writes keep their
        own references to the data), so that freeing many records overlaps the
        writes (docs/benchmarks.md); a few hundred at a time, so that the writer
        threads get the GIL between them."""
        self.freed = True
        lists: list[list[Any]] = [self.pending, self.own, *(members for _, members in self.packs)]
        for items in [*lists, self.packs, self.made]:
            while items:
                del items[-_FREE_STEP:]
        _faults.fire("save.records_freed")


_FREE_STEP = 256


def create(data: Location, batch: Batch) -> tuple[list[Any], BaseException | None]:
    """Create the arrays' metadata (and the groups'), in process 0; the others
    open them once it has (`open_arrays`). The futures of the opened arrays
    (`batch.own`'s, then the packs'), and the first error, for the caller to
    raise once every process knows it."""
    opens: list[Any] = []
    groups: list[Any] = []

    def start() -> None:
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
        _interrupts.uninterrupted(start)
        # Every future, not just up to the first failure: an abort must find every file.
        return opens, wait_all([*opens, *groups], None)
    except BaseException:
        # A failure or an interrupt: what was started must finish before an abort deletes it.
        settle([*opens, *groups])
        raise


def open_arrays(data: Location, batch: Batch) -> list[Any]:
    """The futures of `batch.own`'s arrays opened to write, in a process other
    than 0, once process 0 has created them."""
    opens: list[Any] = []
    try:
        for p in batch.own:
            opens.append(_storage.open_to_write(data, p.record))
    except BaseException:
        settle(opens)
        raise
    return opens


def _group_writes(data: Location, records: list[LeafRecord]) -> list[Any]:
    """Zarr v3 group metadata for every folder above a leaf (and for the data
    root: see `_layout.groups`), so zarr tools can walk the tree."""
    groups = {_format.metadata_key(g): _format.GROUP_JSON for g in _layout.groups(records)}
    return _storage.start_writes(data, groups, synced=False)


def start_writes(
    data: Location,
    batch: Batch,
    opens: list[Any],
    save: _chunk_files.Save,
    *,
    budget: int,
    tracker: Tracker | None = None,
    out: list[Any],
) -> Writing:
    """Start writing the arrays of `batch` (`opens`: their futures) into `data`,
    in order, as many as `budget` staged bytes admit; the `Writing`, whose
    `follow` starts the rest. `out` gets every future that finishes when data
    is written, even after an interrupt: an abort waits for them before deleting."""
    writer = _chunk_files.chunk_files(data).writer(out, tracker, save)
    writing = Writing(_writes(writer, batch, opens, budget), budget, out, writer)
    try:
        writing.fill()
    except BaseException:
        writer.abort()
        settle(opens)
        raise
    return writing


def _writes(writer: Writer, batch: Batch, opens: list[Any], budget: int) -> list[Write]:
    """The save's writes, in order, each made by the location's `writer`:
    each leaf with an array of its own, then each pack, a run of its chunk
    files at a time, runs of about a quarter of the `budget`."""
    writes = []
    for n, p in enumerate(batch.own):
        writes.extend(writer.leaf(p.record, p.pieces, p.nbytes, opens[n]))
    for k, (pack, members) in enumerate(batch.packs):
        for run, part in _pack_parts(pack, members, max(1, budget // 4)):
            datas, records = [p.pieces[0][1] for p in part], [p.record for p in part]
            size = sum(p.nbytes for p in part)
            writes.append(writer.pack(pack, records, datas, size, run, opens[len(batch.own) + k]))
    return writes


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
            # Kept: the members whose last element (their first, if none) is in file `start` or later.
            part = [q for q in part if max(q.record.offset + q.record.size - 1, q.record.offset) // pack.chunk >= start]
            first, nbytes = start, sum(q.nbytes for q in part)
        part.append(p)
        nbytes += p.nbytes
    parts.append((range(first, total), part))
    return parts


class Writing:
    """A save's writes: started in order as the staging budget admits them
    (`Window`: `fill`), and followed to their end, each one's host
    data released as it is written (`follow`)."""

    def __init__(self, units: list[Write], budget: int, out: list[Any], writer: Writer):
        self._window = Window(units, budget)
        self._started: collections.deque[tuple[Write, list[Any], Steps]] = collections.deque()
        self._out, self._writer = out, writer

    def fill(self) -> None:
        """Stage and start the next writes that fit, without waiting for any
        write; once every write has started, commit what TensorStore staged."""
        batch: list[tuple[Write, list[np.ndarray]]] = []
        size = 0
        for unit in self._window.admit():
            batch.append((unit, _memory.hosts(unit.datas)))
            size += unit.nbytes
            if size >= _START_BYTES:
                self._start(batch)
                batch, size = [], 0
        self._start(batch)
        if not self._window.waiting:
            self._writer.commit()

    def _start(self, batch: list[tuple[Write, list[np.ndarray]]]) -> None:
        started: list[tuple[Write, list[Any], Steps]] = []

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
        self._writer.abort()

    def follow(self, tracker: Tracker) -> BaseException | None:
        """Report progress as the writes finish, oldest first (bytes as each
        chunk file is written), releasing each one's staged bytes and starting
        the next that fit. A failed write stops the rest (its error is the
        caller's to wait for, in `out`); returns the error of starting one."""
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


class Window:
    """The admission of a save's writes within `budget` staged bytes, in order,
    by the one rule of every window (`_window.Budget`). `units`: objects with
    `nbytes` (what staging them holds) and `datas` (their pieces, whose copies
    to the host `admit` starts). The fault point `save.staged` reports the
    bytes staged each time they change."""

    def __init__(self, units: Iterable[Any], budget: int):
        self._todo: collections.deque[Any] = collections.deque(units)
        self._budget = _window.Budget(budget)

    @property
    def staged(self) -> int:
        return self._budget.held

    @property
    def budget(self) -> int:
        return self._budget.limit

    def admit(self) -> list[Any]:
        """The next units that fit, counted as staged, their copies to the host begun."""
        out = []
        todo = self._todo
        while todo and self._budget.fits(todo[0].nbytes, alone=self.staged == 0):
            unit = todo.popleft()
            if unit.nbytes:
                self._budget.take(unit.nbytes)
                _faults.fire("save.staged", self.staged, self.budget)
            out.append(unit)
        # (On a CPU, host data is a view: nothing to start, unless copies through
        # pinned memory are on for CPU devices, `_memory.starts_copies`.)
        if _memory.starts_copies():
            for unit in out:
                unit.datas = [_memory.ahead(data) for data in unit.datas]
        return out

    def release(self, unit: Any) -> None:
        """`unit` was written: its bytes are no longer staged."""
        if unit.nbytes:
            self._budget.give(unit.nbytes)
            _faults.fire("save.staged", self.staged, self.budget)

    @property
    def waiting(self) -> bool:
        return bool(self._todo)

    def drop(self) -> None:
        """Admit nothing more (the save has failed)."""
        self._todo.clear()


def protect(pending: list[Pending]) -> None:
    """Make the pieces of `pending` safe from an asynchronous save's caller, who
    may change or delete its arrays once the save returns."""
    for p in pending:
        copy = p.record.type == "numpy"
        p.pieces = [(index, _memory.protected(piece, copy)) for index, piece in p.pieces]
    _faults.fire("save.copied", pending)
