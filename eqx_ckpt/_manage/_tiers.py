"""Tiers: a manager's steps saved to a local directory first and, every
`persistent_every` steps, copied from there to the manager's own directory.

The local tier is an ordinary manager directory (`local`: a RAM disk such as
`/dev/shm`, or a local disk), saved to as any step is. The persistent copy
never reads the devices again: a background thread copies the committed local
step's files, the manifest last, so the persistent step is committed only once
every file is there (docs/manager.md, "Tiers").

With several JAX processes, each process's local tier holds its own part of
each step: every leaf, and every region of a sharded one it addresses (a
save of its own, `SaveOptions.part`). A step is whole in the local tier where
every process committed its part: the processes agree on which steps are
(`agree`), and copy their parts to the shared persistent directory together
(`copy_parts`), each file once, process 0 writing the manifest last.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._base import _faults
from .._base._errors import (
    CheckpointError,
    CheckpointStorageError,
    CheckpointValueError,
)
from .._base._location import Location, location
from .._hosts import _multihost
from .._ondisk._format import MANIFEST, TEMPORARY, step_name
from .._store import _durable, _share, _storage, _storage_errors
from .._store._local_paths import local_real_path

# How many bytes of files a copy reads ahead of the writes that finished.
COPY_WINDOW = 256 * 2**20

# How often a file's write is tried before the copy fails, and the pause
# before each retry, in seconds.
ATTEMPTS = 3
PAUSES = (0.2, 1.0)

# The local tier keeps this many steps, by default (besides one still being
# copied to the persistent tier).
LOCAL_KEEP = 2

# How long the processes of a tiered manager wait for each other to agree on
# the local steps that are whole, in seconds (a process killed outright is
# named sooner: `_multihost.SILENT_SECONDS`).
AGREE_SECONDS = 300.0


def check_local(local: Any, persistent: Location) -> None:
    """Check that `local` is a directory on this host, neither the persistent
    directory nor inside it (nor it inside the local one)."""
    loc = location(local)
    if loc.local is None:
        raise CheckpointValueError(
            f"`local` must be a directory on this host (a RAM disk such as /dev/shm, or a local disk), not "
            f"{loc.display!r}: the persistent tier is the manager's `directory`.",
            path=loc.display,
        )
    if persistent.local is not None:
        mine, theirs = local_real_path(loc.local), local_real_path(persistent.local)
        if mine == theirs or _inside(mine, theirs) or _inside(theirs, mine):
            raise CheckpointValueError(
                f"The local tier {loc.display!r} and the persistent directory {persistent.display!r} must be "
                f"two separate directories, neither inside the other: each holds steps of its own.",
                path=loc.display,
            )


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def copy_step(source: Location, target: Location, step: int, previous: Location | None = None) -> None:
    """Copy the committed step folder `source` (local) to `target`: every
    file, the manifest last, so `target` is committed only once it is whole.
    Each write is tried `ATTEMPTS` times; then the error names the file. With
    `previous` (the newest committed step of a local `target`'s directory),
    a chunk file equal to its file of the same name is shared (a hard link),
    as a manager's incremental saves share them."""
    manifest = _committed_manifest(source, step)
    names = step_files(source)
    _copy_files(source, target, step, previous, names)
    _write(target, MANIFEST, manifest, _start(target, MANIFEST, manifest, step, now=True), step)


def step_files(source: Location) -> list[str]:
    """The files of a committed local step but its manifest, sorted: not a
    file TensorStore is still renaming into place (`TEMPORARY`), seen once
    beside a committed step."""
    return sorted(n for n in _storage.list_files(source) if n != MANIFEST and not n.endswith(TEMPORARY))


def _committed_manifest(source: Location, step: int) -> bytes:
    """The manifest of the local step `source`, which must still be committed."""
    manifest = _read_local(source, MANIFEST, step)
    if manifest is None:
        raise CheckpointError(
            f"Step {step} is no longer committed in the local tier ({source.display!r}), so it was not copied "
            f"to the persistent tier.",
            path=source.display,
        )
    return manifest


def _copy_files(source: Location, target: Location, step: int, previous: Location | None, names: list[str]) -> None:
    """Copy the files `names` of `source` to `target`, at most `COPY_WINDOW` bytes ahead of the writes."""
    writing: list[tuple[str, bytes, Any]] = []
    linked: set[str] = set()  # the folders a link was made in
    try:
        _copy_into(source, target, step, previous, names, writing, linked)
    except BaseException:
        _settle(writing)  # no write may land after the failed copy's folder is removed
        raise
    for folder in sorted(linked):
        _durable.fsync(folder)  # the links' names, before the manifest commits the step


def _copy_into(
    source: Location,
    target: Location,
    step: int,
    previous: Location | None,
    names: list[str],
    writing: list[tuple[str, bytes, Any]],
    linked: set[str],
) -> None:
    """`_copy_files`' loop: `writing` holds the writes in flight, `linked` the folders linked in."""
    ahead = 0
    for name in names:
        data = _read_local(source, name, step)
        if data is None:
            raise CheckpointError(
                f"{name!r} of step {step} went from the local tier ({source.display!r}) while it was copied to "
                f"the persistent tier, so the step was not copied.",
                path=source.display,
            )
        if _shared(previous, target, name, data):
            linked.add(os.path.dirname(os.path.join(target.local or "", *name.split("/"))))
            continue
        writing.append((name, data, _start(target, name, data, step)))
        ahead += len(data)
        if ahead >= COPY_WINDOW:
            _finish(target, writing, step)
            writing.clear()
            ahead = 0
    _finish(target, writing, step)
    writing.clear()


def copy_parts(
    source: Location, target: Location, step: int, previous: Location | None, group: _multihost.Group
) -> None:
    """`copy_step` of every process's part of `step` (`source`: this
    process's) to the shared `target`, together: each file is copied by the
    first process whose part holds it, and process 0 writes its manifest
    (every part's lists every process's state) once every process's files
    are there. The first error of any process is every process's."""
    error: BaseException | None = None
    manifest, names = b"", []
    try:
        manifest = _committed_manifest(source, step)
        names = step_files(source)
    except Exception as e:
        error = e
    error = group.sync("listed", error, shared="\n".join(names))
    if error is not None:
        raise error
    held = group.gathered("listed", "\n".join(names))
    first = {}
    for index in sorted(held, reverse=True):
        first.update(dict.fromkeys(held[index].split("\n"), index))
    try:
        _copy_files(source, target, step, previous, [name for name in names if first.get(name) == group.index])
    except Exception as e:
        error = e
    error = group.sync("copied", error)
    if error is None and group.primary:
        try:
            _write(target, MANIFEST, manifest, _start(target, MANIFEST, manifest, step, now=True), step)
        except Exception as e:
            error = e
    error = group.sync("committed", error)
    if error is not None:
        raise error


def agree(steps: list[int], persistent: Location) -> set[int]:
    """The local steps whole across every process's tier: those each process
    (`steps`: this one's) has committed. Every process calls it; one that
    does not within `AGREE_SECONDS` is named."""
    group = _multihost.Group("tiers", timeout=AGREE_SECONDS)
    own = ",".join(map(str, steps))
    error = group.sync("listed", None, shared=own)
    if error is not None:
        raise error
    whole = set(steps)
    for index, text in group.gathered("listed", own).items():
        whole &= _steps_of(text, index, persistent)
    return whole


def _steps_of(text: str, index: int, persistent: Location) -> set[int]:
    """The steps process `index` listed (`agree`), checked."""
    try:
        return {int(word) for word in text.split(",") if word}
    except ValueError:
        raise CheckpointError(
            f"Process {index} listed its local steps of the run in {persistent.display!r} as {text[:200]!r}, not "
            f"as step numbers: is it running another version of eqx_ckpt?",
            path=persistent.display,
        ) from None


def _shared(previous: Location | None, target: Location, name: str, data: bytes) -> bool:
    """Whether the chunk file `name` was shared with `previous`'s (a hard link)."""
    if previous is None or previous.local is None or target.local is None or "c" not in name.split("/")[:-1]:
        return False
    parts = name.split("/")
    return _share.link_if_equal(os.path.join(previous.local, *parts), os.path.join(target.local, *parts), data)


def _read_local(source: Location, name: str, step: int) -> bytes | None:
    """A file of the local step (through the storage seam), or `None` if it is gone."""
    return _storage.read_file(source, name, limit=_WHOLE)


# No bound on the size of a local step's file (a chunk holds up to a leaf's bytes).
_WHOLE = 2**62


def _start(target: Location, name: str, data: bytes, step: int, *, now: bool = False) -> Any:
    """The first attempt at writing `name`: its future (finished, with `now`), or the exception it raised."""
    try:
        _faults.fire("tiers.copy_file", step, name)
        if now:
            _storage.write_file(target, name, data)
            return None
        return _storage.start_writes(target, {name: data})[0]
    except Exception as e:
        return e


def _finish(target: Location, writing: list[tuple[str, bytes, Any]], step: int) -> None:
    for name, data, first in writing:
        _write(target, name, data, first, step)


def _settle(writing: list[tuple[str, bytes, Any]]) -> None:
    """Wait for every write still in flight, whatever its outcome."""
    for _, _, first in writing:
        if first is not None and not isinstance(first, Exception):
            try:
                _storage.result(first)
            except Exception:
                pass  # (the copy fails with the first error)


def _write(target: Location, name: str, data: bytes, first: Any, step: int) -> None:
    """Finish the first attempt at writing `name` (`_start`'s answer); if it
    failed, write it again, up to `ATTEMPTS` attempts in all."""
    for attempt in range(ATTEMPTS):
        try:
            if attempt == 0:
                if isinstance(first, Exception):
                    raise first
                if first is not None:
                    try:
                        _storage.result(first)
                    except Exception as e:
                        raise _storage_errors.write_error(target, name, e) from e
            else:
                time.sleep(PAUSES[min(attempt - 1, len(PAUSES) - 1)])
                _faults.fire("tiers.copy_file", step, name)
                _storage.write_file(target, name, data)
            return
        except Exception as e:
            if attempt == ATTEMPTS - 1:
                if isinstance(e, CheckpointError):
                    raise
                raise _storage_errors.write_error(target, name, e) from e


def upload_error(step: int, local: Location, persistent: Location, error: Exception) -> CheckpointError:
    """What a failed persistent copy of `step` raises: a `CheckpointStorageError`
    (or its subclass) where the storage refused or failed."""
    kind = type(error) if isinstance(error, CheckpointStorageError) else CheckpointError
    what = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return kind(
        f"Step {step} was saved to the local tier ({local.joined(step_name(step)).display!r}), but its copy to "
        f"the persistent tier ({persistent.display!r}) failed: {what.rstrip('.')}. Nothing of it is committed "
        f"there, and the local tier keeps it until a later step's copy succeeds.",
        path=persistent.display,
    )
