"""An asynchronous save: what the caller holds before it returns (`hold_tree`),
the thread that finishes the save (`start`, `PendingSave`, `Handoff`), and the
wait at exit for the saves still in flight. The thread commits the save, or
removes what it wrote, and holds the destination's claim until then; until it
claims the save, the caller's `Handoff.take_back` undoes it instead.
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._base import _gc, _state, _threads, _tree
from .._store import _lease, _memory
from . import _records

# The leaves of an asynchronous save held by the caller (`hold_tree`): a
# function the background calls for them and their names.
HeldLeaves = Callable[[], tuple[list[Any], _tree.Names]]


def hold_tree(pytree: Any) -> HeldLeaves | None:
    """Hold every leaf's host data for an asynchronous save (default filter
    spec, no `is_leaf`); what the background calls for the leaves and their
    names (rebuilt from the structure unless a custom node's constructor would
    run on arrays the caller may have deleted), or `None` to raise a leaf's error at once."""
    leaves, treedef = jax.tree_util.tree_flatten(pytree)
    keypaths = None
    if not _tree.rebuilds_plainly(treedef):
        keypaths = [keypath for keypath, _ in _tree.flatten(pytree, None)[0]]
    taken = _hold(leaves)
    if taken is None:
        return None
    held, viewed = taken

    def flat() -> tuple[list[Any], _tree.Names]:
        nonlocal held
        held = _memory.off_device(held)  # (copies made on their devices: to pinned memory now)
        if keypaths is not None:
            names = _tree.names_from_keypaths(keypaths, treedef)
        else:
            names = _tree.names_from_structure(treedef)
        out, make = list(held), _records.Held
        for i in viewed:
            x = leaves[i]
            out[i] = make(x, x, [((), held[i])])
        return out, names

    return flat


# A leaf's sharding and dtype, read for every leaf without a step of Python's own.
_SHARDING = operator.attrgetter("sharding")
_DTYPE = operator.attrgetter("dtype")


def _hold(leaves: list[Any]) -> tuple[list[Any], Sequence[int]] | None:
    """Every leaf's host data held (a `jax.Array` on one device by its host
    view, any other by its host pieces, NumPy arrays copied), and the indices
    of the views; `None` when a leaf's error is for the caller's thread. A tree
    of `jax.Array`s on one device takes no step of Python's per leaf."""
    kinds = _records.array_kind
    try:
        if all(kinds(cls) == "jax" for cls in set(map(type, leaves))) and set(map(type, map(_SHARDING, leaves))) == {
            jax.sharding.SingleDeviceSharding
        }:
            try:
                return _memory.held(leaves), range(len(leaves))
            except TypeError:
                return _keys_apart(leaves)  # (a PRNG key array has no view)
    except Exception:
        return None  # a deleted array: the caller's thread names it
    return _leaf_by_leaf(leaves)


def _keys_apart(leaves: list[jax.Array]) -> tuple[list[Any], list[int]] | None:
    """`_hold` of `jax.Array`s on one device, some of them PRNG keys (held by their key data)."""
    dtypes = list(map(_DTYPE, leaves))
    keys = {dtype for dtype in set(dtypes) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)}
    if not keys:
        return None  # not a key that had no view: the caller's thread names the leaf
    held: list[Any] = list(leaves)
    viewed = [i for i, dtype in enumerate(dtypes) if dtype not in keys]
    for i, view in zip(viewed, _memory.held([leaves[i] for i in viewed]), strict=True):
        held[i] = view
    for i, dtype in enumerate(dtypes):
        if dtype in keys:
            held[i] = _records.hold(leaves[i], True)
    return held, viewed


def _leaf_by_leaf(leaves: list[Any]) -> tuple[list[Any], list[int]] | None:
    """`_hold` of any other tree, leaf by leaf."""
    held: list[Any] = []
    viewed: list[int] = []  # `jax.Array`s on one device, held by their views
    copied: list[int] = []  # NumPy leaves, copied once all are found
    kinds, one_device = _records.array_kind, jax.sharding.SingleDeviceSharding
    try:
        for x in leaves:
            kind = kinds(type(x))
            if kind == "jax":
                if type(x.sharding) is one_device:
                    try:
                        held.append(_memory.host(x))
                        viewed.append(len(held) - 1)
                        continue
                    except TypeError:
                        pass  # a PRNG key array, whose key data is held below
                x = _records.hold(x, True)
            elif kind == "numpy" or (kind == "ndarray" and not isinstance(x, np.ma.MaskedArray)):
                copied.append(len(held))
            elif kind in ("ndarray", "abstract"):  # a masked array's error is raised at once
                return None
            held.append(x)
        for i, copy in zip(copied, _memory.private_copies([held[i] for i in copied]), strict=True):
            held[i] = copy
    except Exception:
        return None  # a leaf that cannot be held (a deleted array): the caller's thread names it
    return held, viewed


class PendingSave:
    """A save still being written. Returned by `tree_serialise_leaves(...,
    blocking=False)` once every array is safe on the host.

    Call `wait()` to block until the checkpoint is committed; it raises any error
    the background writes hit (and then nothing was committed). A later save to
    the same path waits for this one to finish before it starts. A program that
    ends with saves in flight waits for them before it exits (and says so on
    stderr), so a script's last checkpoint is never lost.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        pending = eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(1000)}, blocking=False)
        # ... training goes on while the arrays are written ...
        pending.wait()                      # committed (or the save's error is raised)
        assert pending.done()
        ```
    """

    def __init__(self, run: Callable[[], None], *, wraps: PendingSave | None = None):
        # `wraps`: a save this one waits for and finishes (a manager's retention
        # after its step's save): the two are one save to the user.
        self._error: BaseException | None = None
        self._outer: PendingSave | None = None
        # Not a daemon: the interpreter waits for it at exit (`_wait_at_exit`),
        # while TensorStore can still finish the writes.
        self._thread = _threads.thread("eqx_ckpt-save", self._run, run, daemon=False)
        # The thread waits until `start` has returned here: running at once, it
        # would hold the GIL, and the caller would wait a switch interval (5 ms)
        # to get it back.
        self._started = threading.Event()
        # Set when the save has finished. Waited on, never `Thread.join`: an
        # interrupted join in Python 3.11 can mark the running thread as
        # finished, and every later wait (the exit's too) returned at once.
        self._finished = threading.Event()
        try:
            with _PENDING.lock:
                _PENDING[self] = None
                if wraps is not None:
                    wraps._outer = self
            self._thread.start()
        except BaseException:
            if self._thread.ident is None:  # interrupted before the thread began
                with _PENDING.lock:
                    _PENDING.pop(self, None)
            raise
        finally:
            self._started.set()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            self._started.wait(timeout=1.0)  # bounded: an interrupt could come between
            run()
        except BaseException as e:  # re-raised by `wait`
            self._error = e
        finally:
            with _PENDING.lock:
                _PENDING.pop(self, None)
            self._finished.set()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._finished.is_set()

    def wait(self) -> None:
        """Block until committed; raise the save's error if it failed."""
        # In slices: CPython acts on a signal that lands just as a blocking wait
        # begins only when the wait ends, so a Ctrl-C was held until the save
        # had committed (seen as a flaky test); the end of a slice raises it.
        while not self._finished.wait(_WAIT_SLICE):
            pass
        if self._error is not None:
            raise self._error


# The longest a Ctrl-C during `PendingSave.wait` can be held, in seconds.
_WAIT_SLICE = 0.05

# The saves in flight (a forked child has none: their threads are the parent's).
_PENDING: _state.Table[PendingSave, None] = _state.table("background.pending", None, "live", fork="empty")


def _wait_at_exit() -> None:
    """Finish the saves still in flight, and say so: a script whose last line
    starts an asynchronous save must not lose it."""
    with _PENDING.lock:
        # A save wrapped by another (a manager's) is waited for through it.
        pending = [save for save in _PENDING if save._outer is None or save._outer not in _PENDING]
    if not pending:
        return
    print(f"eqx_ckpt: waiting for {len(pending)} checkpoint save(s) to commit before exiting.", file=sys.stderr)
    for save in pending:
        save._finished.wait()
        if save._error is not None:
            print(f"eqx_ckpt: a checkpoint save failed: {save._error}", file=sys.stderr)


# The first thing the exit does, before eqx_ckpt's workers stop (`_threads`).
_threads.at_exit(_wait_at_exit)


class Handoff:
    """Who finishes an asynchronous save: the background thread, once it
    begins, or the caller, if it is interrupted before then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = ""
        self.begun = False  # whether a background thread was (about to be) started

    def claim(self) -> bool:
        with self._lock:
            self._owner = self._owner or "background"
            return self._owner == "background"

    def take_back(self) -> bool:
        with self._lock:
            self._owner = self._owner or "caller"
            return self._owner == "caller"

    def in_background(self) -> bool:
        """Whether, once `save` has returned or raised, its background thread owns
        the save (or will when it starts): then nothing else may undo it."""
        with self._lock:
            return self.begun and self._owner != "caller"


def start(run: Callable[[], None], exclusive: _lease.Claim, handoff: Handoff) -> PendingSave:
    """Run `run` in a new thread, which owns the save once it claims `handoff`;
    until then, the caller's `handoff.take_back()` undoes it instead."""
    # The collector stays paused until the background thread adopts the pause or
    # either side ends it: enabled in between, it would walk the objects just
    # made before the caller gets its thread back (docs/benchmarks.md).
    pause = _gc.GcPause()
    try:
        pause.begin(None)
        exclusive.hand_over()
        handoff.begun = True
        return PendingSave(functools.partial(_in_background, run, exclusive, handoff, pause))
    except BaseException:
        if handoff.take_back():
            pause.resume()
        raise


def _in_background(run: Callable[[], None], exclusive: _lease.Claim, handoff: Handoff, pause: _gc.GcPause) -> None:
    if not handoff.claim():
        pause.resume()
        return  # the caller took the save back before this thread began
    try:
        pause.adopt()
        run()
    finally:
        exclusive.release()
        pause.resume()
