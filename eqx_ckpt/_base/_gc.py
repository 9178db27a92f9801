"""Pausing Python's cyclic garbage collector while a save or load makes many
small, acyclic objects (leaf records, a manifest's parsed items).

Collections triggered by the count of new objects took a third of the time of
parsing a manifest of ten thousand leaves; reference counting still frees
memory meanwhile. The collector is off while any pause is active, and back as
it was once none is.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import types
from collections.abc import Iterator

from . import _state

# The `GcPause`s begun and not yet resumed: id -> (thread ident, the pause's
# frame), or None until a background thread adopts it. Its lock is reentrant:
# an object freed inside it may run a finalizer in the same thread (that of a
# `gc_paused` an interrupt left suspended resumes its pause), which with a
# plain lock waited on itself for ever. (A forked child has no pauses.)
_active: _state.Table[int, tuple[int, types.FrameType] | None] = _state.table("gc.active", None, "live", fork="empty")


_restore: bool | None = None  # the collector's state before the first of them


class GcPause:
    """Python's cyclic garbage collector paused from `begin()` to `resume()`.
    Pauses nest, also across threads: the last to resume restores what the
    first found. (An asynchronous save hands its pause to its background part.)

    Safe against an interrupt at any line, even on entering a `finally`'s
    `resume()`: a pause belongs to a frame, and one whose frame has left the
    stack unresumed is dropped by the thread's next `begin` or `resume`, which
    also finishes a change of state an interrupt cut short. A pause begun for
    no frame, to be adopted, must be ended explicitly."""

    def begin(self, frame: types.FrameType | None) -> None:
        """Pause for as long as `frame` runs (or, with `None`, until `adopt`)."""
        owner = None if frame is None else (threading.get_ident(), frame)
        with _active.lock:
            _active[id(self)] = owner
            _settle()

    def adopt(self) -> None:
        """The calling thread takes the pause over, for its caller's frame."""
        with _active.lock:
            if id(self) in _active:
                _active[id(self)] = (threading.get_ident(), sys._getframe(1))

    def resume(self) -> None:
        """End this pause. Idempotent."""
        with _active.lock:
            _active.pop(id(self), None)
            _settle()


def _settle() -> None:
    """Drop this thread's pauses whose frame has returned, then set the
    collector off while any pause is active, back once none is.

    Each line can be repeated, so a call cut short is finished by the next. A
    finalizer may run a whole `begin` or `resume` inside it (see `_active`):
    so it reads a copy of `_active` (made without allocating per item) and
    sets the collector's state last, after the lines that allocate or free."""
    global _restore
    me = threading.get_ident()
    mine = [(key, owner[1]) for key, owner in _active.copy().items() if owner is not None and owner[0] == me]
    if mine:
        running = {id(frame) for frame in _stack(sys._getframe(1))}
        for key, frame in mine:
            if id(frame) not in running:
                _active.pop(key, None)
        del mine, frame  # the last references to returned frames go here, not below
    if _active:
        if _restore is None:
            _restore = gc.isenabled()
        gc.disable()
    elif _restore is not None:
        if _restore:
            gc.enable()
        _restore = None


def _stack(frame: types.FrameType | None) -> Iterator[types.FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (see `GcPause`)."""
    pause = GcPause()
    try:
        pause.begin(sys._getframe(2))  # the frame of the `with` (past `__enter__`)
        yield
    finally:
        pause.resume()
