"""A save's stages with several JAX processes: what each process does, and
where they all meet.

Every process runs the same save (`_serialise`) with the same tree, in the
same order, and writes the pieces it holds (`_multihost.writes`, `_sharding`);
process 0 alone runs the transaction, creates the arrays and writes the
manifest. They meet at six barriers (`_multihost.Group.sync`), each of which
carries any process's error to all:

1. `prepared`: every process has planned, and all planned the same save
   (`_multihost.differing`);
2. `begin`: process 0 has begun the transaction...
3. `joined`: ...and every other process has joined it;
4. `created`: process 0 has created the arrays; the others open them;
5. `written`: every process has written and synced its pieces; process 0
   commits...
6. `committed`: ...and, once every process knows it did, cleans up.

A save of one process is a group of one: each stage is only the step it
wraps. Only such a save (`Stages.alone`) packs small leaves, plans in the
background, shares chunk files with an earlier save, writes chunk files
itself, or uses the OCDBT layout (one database has a single writer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .._base._errors import CheckpointValueError
from .._base._location import Location
from .._hosts import _multihost
from .._store import _transaction
from ._staging import Batch


class Stages:
    """The processes saving one checkpoint (`_multihost.Group`), and the
    stages at which they meet."""

    def __init__(self) -> None:
        self._group = _multihost.Group("save")

    @property
    def alone(self) -> bool:
        """Whether this is a save of one process (see the module docstring)."""
        return self._group.count == 1

    @property
    def processes(self) -> int:
        return self._group.count

    def prepared(self, error: BaseException | None, planned: Any, *, layout: str, loc: Location) -> None:
        """Stage 1 (`planned`: a `Batch`, or held leaves planned later; `error`:
        this process's failure to plan): raises the first error of any process,
        or says that they planned different saves."""
        if error is None and layout == "ocdbt" and not self.alone:
            error = CheckpointValueError(
                f"`layout='ocdbt'` is not supported with {self._group.count} JAX processes: one "
                f"OCDBT database has a single writer. Save with `layout='directories'`.",
                path=loc.display,
            )
        plan = _plan_digest(planned) if not self.alone and isinstance(planned, Batch) else None
        error = self._group.sync("prepared", error, plan)
        if error is not None:
            raise error

    def begin(
        self, begin: Callable[[], _transaction.Transaction], join: Callable[[], _transaction.Transaction]
    ) -> _transaction.Transaction:
        """Stages 2 and 3: the transaction, begun by process 0 (`begin`), joined
        by the others (`join`); aborted once one has failed to join."""
        group = self._group
        if group.primary:
            try:
                tx = begin()
            except BaseException as e:
                group.sync("begin", e)
                raise
            group.sync("begin", None)  # only this process can fail at `begin`, and it did not
            error = group.sync("joined", None)
            if error is not None:
                tx.abort()
                raise error
            return tx
        error = group.sync("begin", None)
        if error is not None:
            raise error
        try:
            tx = join()
        except BaseException as e:
            group.sync("joined", e)
            raise
        error = group.sync("joined", None)
        if error is not None:
            raise error
        return tx

    def create(
        self,
        create: Callable[[], tuple[list[Any], BaseException | None]],
        open_arrays: Callable[[], list[Any]],
    ) -> list[Any]:
        """Stage 4: the futures of the opened arrays, created by process 0
        (`create`: the futures and the first error), opened by the others once
        they exist (`open_arrays`)."""
        opens: list[Any] = []
        error: BaseException | None = None
        if self._group.primary:
            try:
                opens, error = create()
            except BaseException as e:  # the others wait for it at `created`
                self._group.sync("created", e)
                raise
        error = self._group.sync("created", error)
        if error is not None:
            raise error
        return opens if self._group.primary else open_arrays()

    def by_committer(self, run: Callable[[], BaseException | None]) -> BaseException | None:
        """Run `run` in the process that commits (process 0), and nowhere
        else (while the others write: encoding the manifest); its error."""
        return run() if self._group.primary else None

    def commit(
        self,
        error: BaseException | None,
        commit: Callable[[], BaseException | None],
        clean: Callable[[], None],
    ) -> BaseException | None:
        """Stages 5 and 6: process 0 commits once every process has written
        (`error`: this one's failure), and cleans up once every process knows it
        did; the first error of any process."""
        group = self._group
        error = group.sync("written", error)
        if error is None and group.primary:
            error = commit()
        error = group.sync("committed", error)
        if error is None and group.primary:
            # Inside the caller's `try`: an interrupt from here on still leaves the
            # checkpoint whole and hands the lease back (`stop`).
            clean()
        return error

    def stop(self, stop: Callable[[], None]) -> None:
        """After a failure, or once the save is over: process 0 ends the
        transaction (`stop`: undoes what was not committed, or leaves what was)."""
        if self._group.primary:
            stop()


def _plan_digest(batch: Batch) -> str:
    """What a save planned, in a few bytes: every record's path, stored shape,
    dtype and chunk grid, in order."""
    digest = hashlib.sha256()
    for p in batch.pending:
        r = p.record
        digest.update(repr((r.path, r.stored_shape, r.stored_dtype, tuple(r.chunks))).encode())
    return digest.hexdigest()
