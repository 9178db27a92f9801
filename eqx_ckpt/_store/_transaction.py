"""The save transaction: begun, written, committed, cleaned.

A checkpoint exists only once its `manifest.json` does. Its arrays live under
its *data root*: the checkpoint directory for a first save into an empty
directory, else a new folder `gen.<commit>`, so that a save never writes
into a name it did not create.

- BEGUN: the save holds the directory's lease (`_lease`, `saving.json`),
  which is also its journal: the names it will create and, once committed,
  those it will delete. A dead save's leftovers are cleared here.
- WRITTEN: the caller has written and synced every array.
- COMMITTED: the new manifest replaced the old one in one conditional write,
  made only if it is still the one the save began from. Nothing undoes the
  save from here: `abort()` is refused, and a failed clean-up leaves the
  checkpoint whole for the next save to finish.
- CLEANED: the old arrays and the journal are gone.
- ABORTED (only from BEGUN or WRITTEN): what this save wrote is deleted.

A save deletes only names its journal or an earlier manifest records, and
in the arrays it replaced only files saves write. docs/format.md, "Atomic
commit and overwrite", tells the whole story.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Sequence
from typing import Any

from .._base import _faults, _interrupts, _keypath
from .._base._errors import CheckpointError, CheckpointExistsError, CheckpointReplacedError
from .._base._location import Location
from .._ondisk import _format, _layout, _manifest
from .._ondisk._format import MANIFEST, MAX_MANIFEST_BYTES, SAVING, is_data_root
from .._ondisk._manifest import Manifest, parse
from . import _durable, _lease, _storage, _storage_errors
from ._local_paths import local_link


class State(enum.Enum):
    BEGUN = "begun"
    WRITTEN = "written"
    COMMITTED = "committed"
    CLEANED = "cleaned"
    ABORTED = "aborted"


def top_names(paths: Sequence[str], layout: str, packs: Sequence[str] = ()) -> tuple[str, ...]:
    """The top-level entries of a data root holding the arrays of leaves at dotted `paths`, and `packs`."""
    if layout == "ocdbt":
        return (_format.OCDBT_FOLDER,)
    names = {_format.ZARR_JSON, *packs}
    for path in paths:
        # A root leaf is an array at the data root itself: its chunks are `c`.
        names.add(_keypath.split_dotted(path)[0] if path else _format.CHUNKS)
    return tuple(sorted(names))


def area(manifest: Manifest) -> tuple[str, ...]:
    """The top-level entries a committed checkpoint's arrays occupy."""
    if manifest.data_root:
        return (manifest.data_root,)
    paths = [leaf.path for leaf in manifest.leaves if leaf.pack is None]
    return top_names(paths, manifest.layout, [pack.name for pack in manifest.packs])


class Transaction:
    """One save in progress; see the module docstring for its states."""

    def __init__(self, loc: Location, old: Manifest | None, target: str, layout: str, commit_id: str):
        self.loc, self.old, self.target, self.layout, self.commit_id = loc, old, target, layout, commit_id
        # The manifest's generation when the save began (absent for a first save).
        self.expected = _storage.ABSENT
        self.state = State.BEGUN
        self.lease: _lease.Lease | None = None
        self.names: tuple[str, ...] = ()

    @property
    def data(self) -> Location:
        return _layout.data_location(self.loc, self.target, self.layout)

    def written(self) -> None:
        self._require(State.BEGUN)
        self.state = State.WRITTEN

    def commit(self, data: bytes) -> None:
        """Replace the manifest with `data`, if it is still the one this save
        began from. An interrupt during the write is raised once it is done."""
        _faults.fire("transaction.commit", self.loc)
        self._require(State.WRITTEN)
        if self.lease is not None:
            self.lease.check()
        outcome: list[tuple[BaseException | None, BaseException | None]] = []

        def write() -> None:
            written, error, interrupt = _storage.write_conditional(self.loc, MANIFEST, data, self.expected)
            _faults.fire("commit.manifest_written", self.loc, written)
            # Recorded here, where signals never reach: an interrupt between the
            # write and this line would make the save look uncommitted, and its
            # abort delete the arrays it had just committed.
            if written or _live_commit(self.loc) == self.commit_id:  # (a write that failed part way)
                self.state = State.COMMITTED
            outcome.append((error, interrupt))

        try:
            # In a helper thread: the write's future cannot be lost to an interrupt.
            _interrupts.uninterrupted(write)
            error, interrupt = outcome[0]
        except BaseException as e:
            if not outcome:
                raise  # the write never started (or failed unexpectedly): nothing to record
            (error, _), interrupt = outcome[0], e
        if interrupt is not None:
            raise interrupt
        if self.state is not State.COMMITTED:
            if error is not None:
                unchanged = "nothing was committed and any checkpoint there before is unchanged"
                raise _storage_errors.write_error(self.loc, MANIFEST, error, unchanged) from error
            raise CheckpointExistsError(
                f"Another save committed {self.loc.display!r} while this one was writing, so this one was not "
                f"committed (its arrays were deleted; the other save's checkpoint is whole). Only one writer "
                f"should save to a checkpoint at a time.",
                path=self.loc.display,
            )
        if error is not None:
            _warn(
                f"Checkpoint {self.loc.display!r} was committed (its manifest is this save's), but writing or "
                f"syncing the manifest then reported an error, so the commit may not survive a power loss: "
                f"{_storage_errors.explain(error)}"
            )

    def clean(self) -> None:
        """After the commit: delete the old arrays and the journal. A failure is
        a warning (the checkpoint is whole); an interrupt propagates."""
        self._require(State.COMMITTED)
        stale = [n for n in (area(self.old) if self.old is not None else ()) if n not in self.names]
        try:
            # No key maps to a `gen.<commit>` folder, and this save holds the lease:
            # one the new manifest does not use is a failed save's leftover.
            stale += [n for n in _storage.list_names(self.loc) if _format.is_generation(n) and n != self.target]
            # Only the files saves write: a user's file in an old leaf's folder stays.
            _storage.remove_written(self.loc, sorted(set(stale)))
            self._release()
        except Exception as e:
            self.leave()
            _warn(
                f"Checkpoint {self.loc.display!r} was committed, but tidying up after it failed ({e}): the "
                f"arrays of the checkpoint it replaced, or its {SAVING}, may be left; the next save deletes them."
            )
            return
        self.state = State.CLEANED

    def abort(self) -> None:
        """Before the commit: delete what this save wrote; the old checkpoint stays.
        If that is cut short, the journal stays behind for the next save."""
        if self.state in (State.COMMITTED, State.CLEANED):
            raise CheckpointError(
                f"Internal error: the save of {self.loc.display!r} was asked to abort after it committed; "
                f"the committed checkpoint was kept.",
                path=self.loc.display,
            )
        if self.state is State.ABORTED:
            return
        try:
            live = _live_commit(self.loc) if self.state is State.WRITTEN else ""
            if live is None or live == self.commit_id:
                # The live manifest may be this save's own (or cannot be read to
                # tell): what it uses stays, and the journal is left for the next save.
                if live == self.commit_id:
                    self.state = State.COMMITTED
                self.leave()
                return
            self.state = State.ABORTED
            if self.lease is None or _owns_lease(self.lease):
                _storage.remove(self.loc, self.names)
        except BaseException as e:
            self.leave()
            if not isinstance(e, Exception):
                raise
            return  # the original error matters more
        try:
            self._release()
        except Exception:
            pass  # the original error matters more; a stale lease is taken over by the next save

    def leave(self) -> None:
        """Stop without aborting (after the commit, or when interrupted): the
        journal stays, and the next save finishes the clean-up."""
        if self.lease is not None:
            with contextlib.suppress(Exception):  # keeping the file does no I/O
                self.lease.release(keep_file=True)

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def _require(self, state: State) -> None:
        if self.state is not state:
            raise CheckpointError(
                f"Internal error: the save of {self.loc.display!r} is {self.state.value}, not {state.value}.",
                path=self.loc.display,
            )


def _owns_lease(lease: _lease.Lease) -> bool:
    try:
        lease.check()
    except CheckpointExistsError:
        return False
    return True


def _live_commit(loc: Location) -> str | None:
    """The commit of the manifest at `loc`: "" when there is none (or it has no
    commit), `None` when it cannot be read to tell."""
    try:
        current = read_manifest(loc)
    except Exception:
        return None
    return "" if current is None else current.commit


def begin(
    loc: Location,
    *,
    overwrite: bool,
    layout: str = "directories",
    paths: Sequence[str] = (),
    packs: Sequence[str] = (),
) -> Transaction:
    """Take the directory's lease, clear a dead save's leftovers, and choose
    where this save writes the leaves at dotted `paths` and the `packs`."""
    _faults.fire("transaction.begin", loc)
    entry = _storage.local_entry(loc.local) if loc.local is not None else None
    if loc.local is not None and entry is not None and entry.link and not entry.exists:
        raise CheckpointExistsError(
            f"{loc.display!r} is a broken symbolic link (to {local_link(loc.local)!r}, which does not exist), "
            f"so nothing was written. Save to the directory it should point to, or remove the link.",
            path=loc.display,
        )
    if entry is not None and entry.found and not entry.folder:
        raise CheckpointExistsError(
            f"{loc.display!r} is a file, not a directory. eqx_ckpt saves a checkpoint "
            f"as a directory; choose another path.",
            path=loc.display,
        )
    _durable.ensure_directory(loc)
    lease, stale = _lease.acquire(loc, SAVING, what="save")
    try:
        tx = _begin(loc, lease, stale, overwrite=overwrite, layout=layout, paths=paths, packs=packs)
    except BaseException:
        with contextlib.suppress(Exception):  # the original error matters more
            lease.release()
        raise
    tx.lease = lease
    return tx


def _begin(
    loc: Location,
    lease: _lease.Lease,
    stale: dict[str, Any] | None,
    *,
    overwrite: bool,
    layout: str,
    paths: Sequence[str],
    packs: Sequence[str],
) -> Transaction:
    data, generation = _storage.read_file_generation(loc, MANIFEST, limit=MAX_MANIFEST_BYTES)
    old = None if data is None else parse(data, where=loc.display)
    if stale:
        _finish_dead_save(loc, stale, old)
    # TensorStore writes `<name>.__lock` and renames it into place: one of ours
    # left by a killed write (we hold the lease, so its writer is gone) goes.
    _storage.remove(loc, [n for n in _storage.list_names(loc) if _format.is_save_temporary(n)])
    names = [n for n in _storage.list_names(loc) if n != SAVING]
    if old is None and names:
        raise CheckpointExistsError(
            f"{loc.display!r} is not empty and is not an eqx_ckpt checkpoint, so "
            f"nothing was written into it. Save into a new or empty directory.",
            path=loc.display,
        )
    if old is not None and not overwrite:
        raise CheckpointExistsError(
            f"A checkpoint already exists at {loc.display!r} and `overwrite=False`. "
            f"Pass `overwrite=True` to replace it, or choose another path.",
            path=loc.display,
        )
    commit_id = lease.token
    target = "" if old is None else _format.data_root_name(commit_id)
    tx = Transaction(loc, old, target, layout, commit_id)
    tx.expected = generation
    tx.names = top_names(paths, layout, packs) if target == "" else (target,)
    journal = {"target": target, "layout": layout, "names": list(tx.names), "state": State.BEGUN.value}
    journal["old_names"] = list(area(old)) if old is not None else []
    lease.update(journal)
    return tx


def _finish_dead_save(loc: Location, journal: dict[str, Any], current: Manifest | None) -> None:
    """Delete what a save that died left: its own arrays if it never committed,
    or the arrays it replaced if it did. Never what the live manifest uses."""
    committed = current is not None and (
        current.commit == journal.get("token") if current.commit else current.data_root == journal.get("target")
    )
    live = set(area(current)) if current is not None else set()
    listed = journal.get("old_names" if committed else "names", [])
    if not isinstance(listed, list):
        return
    doomed = [
        n for n in listed if isinstance(n, str) and _format.is_top_level_name(n) and n not in live and n != MANIFEST
    ]
    # The arrays a committed save replaced may hold a user's files, which stay;
    # what an uncommitted save created is its own, and goes whole.
    (_storage.remove_written if committed else _storage.remove)(loc, doomed)


def join(loc: Location) -> Transaction:
    """The transaction another process began at `loc` (read from its journal)."""
    _faults.fire("transaction.join", loc)
    data = _storage.read_file(loc, SAVING, limit=_lease.MAX_LEASE_BYTES)
    try:
        journal = _manifest.loads_file(data or b"null")
        target, layout, token = journal["target"], journal["layout"], journal["token"]
    except (ValueError, TypeError, KeyError):
        target = layout = token = None
    if not isinstance(target, str) or not (target == "" or is_data_root(target)) or not isinstance(token, str):
        raise CheckpointError(
            f"Process 0 began saving {loc.display!r}, but this process cannot read its "
            f"{SAVING} there. Every process must save to the same shared storage (a "
            f"shared file system or an object store), not to a local disk each.",
            path=loc.display,
        )
    return Transaction(loc, None, target, str(layout), token)


def _warn(message: str) -> None:
    warnings.warn(message, CommitWarning, stacklevel=4)


class CommitWarning(UserWarning):
    """A save committed, but could not tidy up after itself (delete the arrays of
    the checkpoint it replaced, or the steps a manager's retention drops). The
    new checkpoint is whole; the next save to the same place finishes the job.

    !!! example

        ```python
        import warnings
        import eqx_ckpt

        # Make a clean-up failure an error, as for any warning:
        warnings.simplefilter("error", eqx_ckpt.CommitWarning)
        ```
    """


CommitWarning.__module__ = "eqx_ckpt"


# -- The manifest committed at a location ------------------------------------------------------------


def read_manifest(loc: Location) -> Manifest | None:
    """The manifest committed at `loc`, parsed and checked as untrusted input, or `None`."""
    data, stamp = _storage.read_file_stamped(loc, MANIFEST, limit=MAX_MANIFEST_BYTES)
    return None if data is None else parse(data, where=loc.display, stamp=stamp)


def check_unchanged(loc: Location, manifest: Manifest) -> None:
    """Raise if the checkpoint at `loc` was replaced or deleted since `manifest`
    was read (after reading arrays: an overwrite deletes them after its commit)."""
    if not _storage.file_changed(loc, MANIFEST, manifest.stamp):
        return
    if not _storage.file_exists(loc, MANIFEST):
        raise CheckpointReplacedError(
            f"Checkpoint {loc.display!r} was deleted after it was opened (by hand, by `delete_steps_after`, or "
            f"by the retention of a CheckpointManager in another process: a manager keeps a step while lazy "
            f"leaves of its own process read from it), so what was read from it was discarded. Load a checkpoint "
            f"that exists, and keep this one while lazy leaves read from it.",
            path=loc.display,
        )
    raise CheckpointReplacedError(
        f"Checkpoint {loc.display!r} was replaced by a newer save after it was opened, so what was read "
        f"from it may belong to either save and was discarded. Open or load it again to read the new one.",
        path=loc.display,
    )
