"""One save at a time into a local checkpoint directory.

Two processes saving to the same path would otherwise clear each other's arrays
(each takes the other's files for leftovers of an interrupted save), and one
could commit a manifest whose arrays the other deleted. A save therefore holds an
exclusive `flock` on the checkpoint directory itself, from the moment it looks at
the destination until it has committed or aborted. The kernel drops the lock
when the process dies, so a killed save never leaves a stale lock, and no lock
file is ever written. A second save into the same directory meanwhile fails at
once with a `CheckpointExistsError`; loads take no lock.

File systems without `flock` (some network ones) and object stores are not
locked: one writer at a time per path is then the caller's to ensure.
"""

from __future__ import annotations

import fcntl
import os

from ._errors import CheckpointExistsError
from ._spec import Location


class Lock:
    """The held lock of one save; `release()` may be called more than once."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # A save dropped without commit or abort (as by a test) must not hold the
    # directory for the rest of the process.
    __del__ = release


def acquire(loc: Location) -> Lock | None:
    """Lock a local checkpoint directory (which must exist) for one save, or
    return `None` where nothing can be locked."""
    if loc.local is None:
        return None
    fd = os.open(loc.local, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointExistsError(
            f"Another save into {loc.display!r} is in progress (in this or another process), so this one "
            f"did not start. Wait for it to finish (`wait()` on an asynchronous save), or save elsewhere.",
            path=loc.display,
        ) from None
    except OSError:
        os.close(fd)
        return None
    return Lock(fd)


def release(lock: Lock | None) -> None:
    if lock is not None:
        lock.release()
