"""What is at a local path: the one place that lists a local folder or looks
at a local path (`stat`, links, real paths).

It sits below `_storage`, which passes `local_names` and `local_entry` on to
the rest of the package, so that the modules `_storage` is built on
(`_durable`, `_untrusted`) ask it too. Every other module asks one of the two
(tests/test_architecture.py checks).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import NamedTuple


def local_names(path: str) -> list[str]:
    """The entries of the local folder `path`, sorted. Raises `OSError` where
    it is no folder: check with `local_entry` first."""
    return sorted(os.listdir(path))


class LocalEntry(NamedTuple):
    """What a local path is, read with one `lstat` (and one `stat` for a link).

    - `found`: something is there, a broken link too (`os.path.lexists`).
    - `link`: a symbolic link, never followed (`os.path.islink`).
    - `folder`, `file`: what it leads to, a link followed (`os.path.isdir`,
      `os.path.isfile`).
    - `size`: its bytes, a link followed (`os.path.getsize`); 0 where absent.
    - `identity`: its device and inode, a link followed (one file under
      several names), or `None` where absent.
    """

    found: bool
    link: bool
    folder: bool
    file: bool
    size: int
    identity: tuple[int, int] | None

    @property
    def exists(self) -> bool:
        """Something is there, a link followed (`os.path.exists`)."""
        return self.identity is not None


_NOTHING = LocalEntry(False, False, False, False, 0, None)


def local_entry(path: str) -> LocalEntry:
    """What the local `path` is (see `LocalEntry`). A user's path, an orbax
    step and a manager's step folder are told apart alike."""
    try:
        info = os.lstat(path)
    except (OSError, ValueError):  # as `os.path.lexists`: a name that cannot be there is absent
        return _NOTHING
    link = stat.S_ISLNK(info.st_mode)
    if link:
        try:
            info = os.stat(path)
        except (OSError, ValueError):  # a broken link, or a loop of links
            return LocalEntry(True, True, False, False, 0, None)
    folder, file = stat.S_ISDIR(info.st_mode), stat.S_ISREG(info.st_mode)
    return LocalEntry(True, link, folder, file, info.st_size, (info.st_dev, info.st_ino))


def local_stat(target: str | int, *, follow: bool = True) -> os.stat_result:
    """The `stat` of the local path `target` (a link followed unless not
    `follow`), or of the open file descriptor `target`. Raises `OSError`
    where there is nothing: for what `local_entry` does not hold (an inode's
    link count, its modification time, the stamp of a file read)."""
    if isinstance(target, int):
        return os.fstat(target)
    return os.stat(target, follow_symlinks=follow)


def local_walk(
    path: str, *, bottom_up: bool = False, strict: bool = False
) -> Iterator[tuple[str, list[str], list[str]]]:
    """Every folder below the local folder `path` (itself included), as
    `os.walk` gives it: its path, its folders' names and its files' names.
    Links to folders are listed with the folders and never walked into.

    A folder that cannot be listed is passed over; with `strict`, that is an
    error unless the folder is gone already."""
    return os.walk(path, topdown=not bottom_up, onerror=_unless_missing if strict else None)


def _unless_missing(error: OSError) -> None:
    """Raise `error`, unless it says a file is gone already."""
    if not isinstance(error, FileNotFoundError):
        raise error


def local_link(path: str) -> str:
    """Where the symbolic link `path` points (`os.readlink`)."""
    return os.readlink(path)


def local_real_path(path: str) -> str:
    """`path` with every symbolic link in it resolved (`os.path.realpath`)."""
    return os.path.realpath(path)
