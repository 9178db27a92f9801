"""Making what a save wrote to a local disk durable: fsync, syncfs, and
directories created so that a crash cannot lose them."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import TYPE_CHECKING

from .._base import _faults, _location, _state, _threads
from .._base._errors import CheckpointError
from .._ondisk import _format
from . import _storage_errors
from ._local_paths import local_entry, local_walk

if TYPE_CHECKING:
    from .._base._location import Location


def flush(loc: Location) -> None:
    """Make everything written under `loc` without fsync durable, before a
    commit: each file and directory fsynced, many at once, or, for many files
    on ext4, XFS or Btrfs, one `syncfs` (elsewhere it may not reach the server;
    docs/benchmarks.md). Other processes' temporary files are skipped, and a
    file that vanishes is no error: each process flushes what it wrote."""
    _faults.fire("sync.flush", loc)
    local = loc.local if _location.on_local_disk(loc) else None
    if local is None:
        return
    paths = [local]
    for root, dirs, files in local_walk(local):
        paths.extend(os.path.join(root, name) for name in [*dirs, *files] if not name.endswith(_format.TEMPORARY))
    if len(paths) >= SYNCFS_FROM and _syncfs_is_complete(local):
        _syncfs(local)
        return
    sync = functools.partial(fsync, missing_ok=True)
    try:
        # The process's pool, kept from save to save: starting 32 threads for
        # every save cost several milliseconds of a small one.
        for _ in _threads.pool("eqx_ckpt-sync", 32).map(sync, paths):
            pass
    except RuntimeError:  # at interpreter exit no thread pool starts: one at a time, then
        for path in paths:
            sync(path)


# From how many files and directories a flush syncs the whole file system.
SYNCFS_FROM = 256


# `statfs` magic numbers of the local file systems whose `syncfs` writes back every
# file and commits the journal: ext2/3/4, XFS, Btrfs.
_SYNCFS_FILE_SYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E})


def fsync(path: str, *, missing_ok: bool = False) -> None:
    _faults.fire("sync.file", path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@_state.memo(1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def file_system_type(path: str) -> int | None:
    """The `statfs` magic number of the file system holding `path` (64-bit Linux), else `None`."""
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes; f_type comes first
    if _libc().statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value


def _syncfs_is_complete(path: str) -> bool:
    return file_system_type(path) in _SYNCFS_FILE_SYSTEMS


def _syncfs(path: str) -> None:
    _faults.fire("sync.file_system", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs failed: {os.strerror(error)}", path)
    finally:
        os.close(fd)


def sync_directory(path: str) -> None:
    """Make the entries of a local directory (created, renamed, deleted) durable."""
    _faults.fire("sync.directory", path)
    fsync(path)


def ensure_directory(loc: Location) -> None:
    """Create a local directory and its parents, each entry synced in its
    parent, so a crash cannot lose a committed checkpoint's folder."""
    _faults.fire("sync.create_directory", loc)
    if loc.local is None:
        return
    missing, path = [], os.path.abspath(loc.local)
    while not local_entry(path).folder and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(loc.local, exist_ok=True)
        for created in reversed(missing):
            fsync(os.path.dirname(created))
    except OSError as e:
        # A file where a folder of the path should be (`notes.txt/ckpt`) is named as the cause.
        blocker = next((p for p in reversed(missing) if local_entry(p).found and not local_entry(p).folder), None)
        if blocker is not None:
            raise CheckpointError(
                f"Cannot create the checkpoint directory {loc.display!r}: {blocker!r} is a file, not a folder, "
                f"so nothing was written. Save to another path, or move that file.",
                path=loc.display,
            ) from e
        raise _storage_errors.write_error(loc, ".", e, "nothing was written") from e
