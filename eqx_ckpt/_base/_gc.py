"""Pausing Python's cyclic garbage collector while a save or load makes many
small, acyclic objects (leaf records, a manifest's parsed items).

Its collections, triggered by the count of new objects, took a third of the
time of parsing a manifest of ten thousand leaves. Reference counting still
frees memory meanwhile. A pause is per call and may be handed to a background
thread (an asynchronous save). The collector is off while any pause is
active, and back as it was once none is.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import types
from collections.abc import Iterator

from . import _state

# The `GcPause`s begun and not yet resumed: id -> (thread ident, the frame the
# pause belongs to), or None while it waits for a background thread to adopt it.
# Its lock is reentrant: freeing an object inside it (a dropped pause's frame)
# or a collection started by an allocation there may run a finalizer in the
# same thread. The finalizer of a `gc_paused` left suspended by an interrupt
# resumes its pause. With a plain lock that thread waited on itself for ever.
# (A forked child has none: the threads that would resume them are not in it.)
_active: _state.Table[int, tuple[int, types.FrameType] | None] = _state.table("gc.active", None, "live", fork="empty")


_restore: bool | None = None  # the collector's state before the first of them


class GcPause:
    """Python's cyclic garbage collector paused from `begin()` to `resume()`.
    Pauses nest, also across threads: the last to resume restores what the
    first found. An asynchronous save's caller pauses the collector for the
    background part, so that no collection of the objects it just made falls
    between the two.

    Safe against an interrupt at any line. A signal's exception is raised
    between any two lines, also on entering the `resume()` of a `finally`.
    So a pause belongs to the frame it was begun for. A pause whose frame has
    left its thread's stack without resuming it is dropped by the next pause
    or resume in that thread. That call also finishes a change of the
    collector's state that an interrupt cut short. A pause begun for no frame,
    to be adopted by a background thread, must be ended explicitly."""

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
    """Drop this thread's pauses whose frame has returned. Then the collector
    is off while any pause is active, and back as it was once none is.

    Each line can be repeated, so a call cut short is finished by the next. A
    whole `begin` or `resume` may run inside it (a finalizer, see `_active`).
    So it reads a copy of `_active`, copied without allocating per item, so
    that no finalizer runs midway. It decides the collector's state last,
    after the lines that allocate or free."""
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
    """Pause Python's cyclic garbage collector while a block makes many small,
    acyclic objects (see the module docstring, and `GcPause`)."""
    pause = GcPause()
    try:
        pause.begin(sys._getframe(2))  # the frame of the `with` (past `__enter__`)
        yield
    finally:
        pause.resume()
