"""What is at a local path: the one place that lists a local folder, looks at
a local path (`stat`, links, real paths), or opens a local file to read.

Only a regular file is ever read: a FIFO, a socket or a device is told apart
(`special`), and every open is made without waiting and checked before a
read (docs/format.md). Every other module asks this one, or `_storage`.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from typing import NamedTuple

# The flags a local file is opened with to read. Without `O_NONBLOCK`, opening
# a FIFO waits for a writer forever; a regular file reads the same with it.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)

_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words, where it is neither a
    regular file nor a folder ("a socket"...); else `""`."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return ""
    return next((said for test, said in _SPECIAL if test(mode)), "a file of an unknown kind")


def local_names(path: str) -> list[str]:
    """The entries of the local folder `path`, sorted (`OSError` where it is no folder)."""
    return sorted(os.listdir(path))


class LocalEntry(NamedTuple):
    """What a local path is, read with one `lstat` (and one `stat` for a link).
    `found` (a broken link too) and `link` are of the path itself; `folder`,
    `file`, `size`, `identity` (device and inode, `None` where absent) and
    `special` (`special`'s words, else `""`) of what it leads to, a link
    followed, as `os.path`'s functions of the same names tell."""

    found: bool
    link: bool
    folder: bool
    file: bool
    size: int
    identity: tuple[int, int] | None
    special: str = ""

    @property
    def exists(self) -> bool:
        """Something is there, a link followed (`os.path.exists`)."""
        return self.identity is not None


_NOTHING = LocalEntry(False, False, False, False, 0, None)


def local_entry(path: str) -> LocalEntry:
    """What the local `path` is (see `LocalEntry`)."""
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
    return LocalEntry(True, link, folder, file, info.st_size, (info.st_dev, info.st_ino), special(info.st_mode))


class SpecialFileError(OSError):
    """`local_open` found no regular file at `path`, but `kind` (`special`)."""

    def __init__(self, path: str, kind: str):
        super().__init__(f"{path!r} is {kind}, not a regular file")
        self.path, self.kind = path, kind


def local_open(path: str) -> io.BufferedReader:
    """The regular local file `path` (a link followed), opened to read; anything
    else `special` is a `SpecialFileError`, raised without waiting. Other
    failures are `open`'s `OSError`s."""
    try:
        f = open(path, "rb", opener=lambda path, flags: os.open(path, flags | READ_FLAGS))
    except OSError:
        found = _special_at(path)  # a socket cannot be opened at all (ENXIO)
        if found:
            raise SpecialFileError(path, found) from None
        raise
    try:
        found = special(os.fstat(f.fileno()).st_mode)
    except BaseException:
        f.close()
        raise
    if found:
        f.close()
        raise SpecialFileError(path, found)
    return f


def _special_at(path: str) -> str:
    """`special` of what is at `path` (a link followed); `""` where nothing is."""
    try:
        return special(os.stat(path).st_mode)
    except (OSError, ValueError):
        return ""


def local_stat(target: str | int, *, follow: bool = True) -> os.stat_result:
    """The `stat` of the local path (or open fd) `target`, for what `local_entry`
    does not hold; `OSError` where there is nothing."""
    if isinstance(target, int):
        return os.fstat(target)
    return os.stat(target, follow_symlinks=follow)


def local_walk(
    path: str, *, bottom_up: bool = False, strict: bool = False
) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk` of the local folder `path`: links to folders are listed, never
    walked into. A folder that cannot be listed is passed over; with `strict`,
    that is an error unless the folder is gone already."""
    return os.walk(path, topdown=not bottom_up, onerror=_unless_missing if strict else None)


def _unless_missing(error: OSError) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


def local_link(path: str) -> str:
    """Where the symbolic link `path` points (`os.readlink`)."""
    return os.readlink(path)


def local_real_path(path: str) -> str:
    """`path` with every symbolic link in it resolved (`os.path.realpath`)."""
    return os.path.realpath(path)
