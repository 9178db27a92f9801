"""Who may write a checkpoint, or a manager's directory, and for how long.

In this process, one save per destination at a time (`acquire_exclusive`, a
`Claim`). Across processes, a *lease*: a small JSON file (`saving.json` for a
save, `manager.json` for a manager) created by a conditional write that
succeeds only where it is absent. A lease whose holder died is stale: at once
on a local disk, where the holder also holds an `flock` on the directory;
elsewhere once it went `STALE_SECONDS` without the holder's heartbeat. It is
taken over by another conditional write, on the generation seen. The holder
checks it still holds the lease (`Lease.check`) before each step that cannot
be undone.

The lease file is also the save's journal (`_transaction`). docs/format.md,
"Who may write: leases", tells the whole story.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from .._base import _faults, _state, _threads
from .._base._errors import CheckpointError, CheckpointExistsError, CheckpointStorageError
from .._base._location import Location
from .._ondisk import _manifest
from . import _storage, _storage_errors

HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 20.0
# A lease file is small; a larger one is not ours, and is not parsed.
MAX_LEASE_BYTES = 2**20
# The generation of a file that is not there (`_storage.ABSENT`).
ABSENT = _storage.ABSENT

# Each destination's claims in this process, while a save holds or waits for it.
_places: _state.WeakTable[str, _Place] = _state.weak_table("lease.places", fork="empty")
# Leases this process holds, so a second writer here is refused at once instead
# of waiting `STALE_SECONDS` to learn that the holder is alive.
_held: _state.WeakTable[str, Lease] = _state.weak_table("lease.held", fork="empty")


def destination(loc: Location) -> str:
    return json.dumps(loc.kvstore, sort_keys=True)


def acquire_exclusive(loc: Location) -> Claim:
    """This process's claim on `loc`, once no other save holds it. A claim
    still recorded for the calling thread is taken over at once (an interrupt
    skipped its release; a nested save is refused by the lease). Only a claim
    handed to a background thread (`hand_over`) makes a later save wait."""
    with _places.lock:
        place = _places.setdefault(destination(loc), _Place())
    me = threading.get_ident()
    with place.changed:
        while place.holder is not None and place.holder.thread != me:
            place.changed.wait()
        place.holder = Claim(place, me)
        return place.holder


class _Place:
    """One destination's claims: who holds it, and a condition to wait on."""

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())
        self.holder: Claim | None = None


class Claim:
    """One save's hold on its destination in this process (`acquire_exclusive`)."""

    def __init__(self, place: _Place, thread: int | None):
        self._place = place
        # The thread whose next save may take this claim over; `None` once a
        # background thread carries the save on.
        self.thread = thread

    def hand_over(self) -> None:
        """The save goes on in a background thread: every later save waits for its release."""
        self.thread = None

    def release(self) -> None:
        """Give the claim up, unless a later save has taken it over. Idempotent."""
        with self._place.changed:
            if self._place.holder is self:
                self._place.holder = None
                self._place.changed.notify_all()


def holder(loc: Location) -> Claim | None:
    """The claim on `loc` in this process, if any."""
    place = _places.get(destination(loc))
    return None if place is None else place.holder


class Lease:
    """A held lease on one directory; see the module docstring."""

    def __init__(self, loc: Location, name: str, body: dict[str, Any], generation: bytes, fd: int | None):
        self.loc, self.name, self.body = loc, name, body
        self.token: str = body["token"]
        self._generation = generation
        self._fd = fd
        self._mutex = threading.Lock()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if fd is None:
            self._thread = _threads.thread("eqx_ckpt-lease", self._beat, stop=self._stop.set)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self.update({})
            except Exception:  # a failed heartbeat is retried; `check()` reports a lost lease
                pass

    def update(self, changes: dict[str, Any]) -> None:
        """Rewrite the lease with `changes`, if this process still holds it."""
        with self._mutex:
            if self._lost is not None or self._generation == ABSENT:
                return
            body = {**self.body, **changes, "renewed": _now()}
            written = _conditional_write(self.loc, self.name, body, self._generation)
            if written is None:
                self._lost = "another writer took it over"
                return
            self.body, self._generation = body, written

    def check(self) -> None:
        """Raise if another writer has taken this lease over."""
        if self._lost is None and self._generation == ABSENT and self._fd is not None:
            return  # the directory's lock alone is the lease, and it cannot be taken
        if self._lost is None:
            current = _read(self.loc, self.name)
            if current is None or current[0].get("token") != self.token:
                self._lost = "it was removed or taken over by another writer"
        if self._lost is not None:
            raise CheckpointExistsError(
                f"This process no longer holds the lock on {self.loc.display!r} ({self._lost}): another "
                f"process is writing there, so this one stopped without touching what that one wrote.",
                path=self.loc.display,
            )

    def release(self, *, keep_file: bool = False) -> None:
        """Give the lease up: delete its file if it is still ours, or, with
        `keep_file=True`, leave it as the journal of an unfinished save for the
        next writer. Idempotent."""
        self._stop.set()
        try:
            with self._mutex:
                generation, self._generation = self._generation, ABSENT
                if generation != ABSENT and self._lost is None and not keep_file:
                    _storage.write_if(self.loc, self.name, None, generation)
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
            key = _held_key(self.loc, self.name)
            if _held.get(key) is self:
                del _held[key]

    def __del__(self) -> None:
        # A lease dropped without release must not hold the directory for the
        # rest of the process (its file goes stale). Nothing here may raise: at
        # interpreter exit, what it uses may be torn down.
        try:
            self._stop.set()
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
        except Exception:
            pass


def acquire(loc: Location, name: str, *, what: str, journal: bool = True) -> tuple[Lease, dict[str, Any] | None]:
    """Take the lease `name` in the existing directory `loc`: the lease, and the
    body of a stale lease it replaced (a dead writer's journal), or `None`. A
    live holder is a `CheckpointExistsError` (`what` names it). Without
    `journal`, a directory that can be locked gets no lease file."""
    _faults.fire("lease.acquire", loc, name)
    key = _held_key(loc, name)
    if key in _held:
        raise _busy(loc, what, "in this process")
    fd = _flock(loc, what)
    body = {"token": secrets.token_hex(8), "pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
    if fd is not None and not journal:
        lease = Lease(loc, name, body, ABSENT, fd)
        _held[key] = lease
        return lease, None
    try:
        stale = None
        generation = _conditional_write(loc, name, body, ABSENT)
        if generation is None:
            stale, seen = _wait_until_stale(loc, name, fd, what)
            generation = _conditional_write(loc, name, body, seen)
            if generation is None:
                if _read(loc, name) is None:
                    # Refused twice, and no lease there: the storage will not
                    # create it (as a missing S3 bucket answers).
                    raise _not_created(loc, name, what)
                raise _busy(loc, what, "in another process, which took the stale lock over first")
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    lease = Lease(loc, name, body, generation, fd)
    _held[key] = lease
    return lease, stale


def _wait_until_stale(loc: Location, name: str, fd: int | None, what: str) -> tuple[dict[str, Any], bytes]:
    """The body and generation of a lease left by a dead writer; raise if it is alive."""
    current = _read(loc, name)
    if current is None:
        return {}, ABSENT
    if fd is not None:  # we hold the directory's flock, so its holder is gone
        return current
    deadline = time.monotonic() + STALE_SECONDS
    while time.monotonic() < deadline:
        time.sleep(min(0.5, STALE_SECONDS / 10))
        latest = _read(loc, name)
        if latest is None or latest[1] != current[1]:
            raise _busy(loc, what, "in another process (its lock file is being renewed)")
    return current


def _busy(loc: Location, what: str, where: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"Another {what} is writing to {loc.display!r} ({where}), so this one did not start and nothing was "
        f"changed. Two writers on one directory would delete each other's files: wait for the other to finish, "
        f"or write elsewhere.",
        path=loc.display,
    )


def _not_created(loc: Location, name: str, what: str) -> CheckpointStorageError:
    """The error for a store that would not create the lease file though none is there."""
    try:
        _storage.list_keys(loc)
        why = "no lease is there, yet its conditional write was refused twice"
    except CheckpointError as e:
        why = _storage_errors.brief(e.__cause__ or e)
    return CheckpointStorageError(
        f"The storage would not create {name!r} in {loc.display!r}, so this {what} did not start and nothing "
        f"was written ({why}). Check that the bucket exists and that these credentials may write to it.",
        path=loc.display,
    )


def _held_key(loc: Location, name: str) -> str:
    return destination(loc) + "\0" + name


def _flock(loc: Location, what: str) -> int | None:
    """An fd holding an exclusive `flock` on a local directory, or `None` where
    nothing can be locked; a live holder is an error."""
    if loc.local is None or loc.kvstore.get("driver") != "file":
        return None
    fd = os.open(loc.local, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(loc, what, "in this or another process") from None
    except OSError:
        os.close(fd)
        return None
    return fd


def _read(loc: Location, name: str) -> tuple[dict[str, Any], bytes] | None:
    data, generation = _storage.read_generation(loc, name)
    if data is None:
        return None
    try:
        body = _manifest.loads_file(data[:MAX_LEASE_BYTES])
    except ValueError:
        body = {}
    return (body if isinstance(body, dict) else {}), generation


def _conditional_write(loc: Location, name: str, body: dict[str, Any], if_equal: bytes) -> bytes | None:
    """`_storage.write_if` of `body`: the new generation, or `None`."""
    return _storage.write_if(loc, name, json.dumps(body).encode(), if_equal)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
