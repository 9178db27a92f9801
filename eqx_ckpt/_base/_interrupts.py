"""Running I/O to its end however the main thread is interrupted (Ctrl-C,
`sys.exit` from a signal handler), and waiting for what it started: a save
must know what it started before it undoes anything.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import _faults, _threads


def uninterrupted(fn: Callable[[], Any]) -> None:
    """Run `fn` to its end, however the caller is interrupted.

    An interrupt lands in the main thread between any two bytecodes, also
    between a call that starts an operation and the line that keeps its
    future. (A manifest write that landed after the abort deleted the arrays
    committed a checkpoint without its data.) So in the main thread `fn` runs
    in a helper thread that signals never reach, storing its results in
    objects the caller holds; an interrupt of the wait is raised once `fn` has
    finished. Elsewhere `fn` just runs. `fn`'s own error is raised as it is.

    (Not `Thread.join`: an interrupted join in Python 3.11 can mark a running
    thread as finished, and the next join returns at once.)
    """
    if threading.current_thread() is not threading.main_thread():
        fn()
        return
    _ensure_helper()  # an interrupt here has started nothing
    job = _Job(fn)
    interrupt: BaseException | None = None
    while True:
        # An interrupt may land before or after the job is queued: it is queued
        # again, and runs once. (Once, it landed in the wait loop's condition,
        # outside any `try`: the save aborted while the queued manifest write
        # went on, and committed a checkpoint whose arrays the abort deleted.)
        try:
            _faults.fire("interrupts.queue", job)
            _JOBS.put(job)
            _faults.fire("interrupts.queued", job)
            break
        except BaseException as e:
            interrupt = interrupt or e
    while True:
        try:
            if job.done.wait(0.05):
                break
        except BaseException as e:
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
    if job.error is not None:
        raise job.error


class _Job:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._claim = threading.Lock()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # queued twice (see `uninterrupted`): it runs once
        try:
            self.fn()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


# `None` stops one helper (at exit).
_JOBS: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()


# The helper last started (`_threads` records every one, and stops it at exit).
_helper: threading.Thread | None = None


def _serve() -> None:
    while (job := _JOBS.get()) is not None:
        job.run()


def _ensure_helper() -> None:
    """Start the helper thread of `uninterrupted` unless one runs. A race may
    start two, which is harmless: each job is taken once. (No lock: one an
    interrupt left held would stop every later save.)"""
    global _helper
    helper = _helper
    if helper is None or not helper.is_alive():
        _helper = helper = _threads.thread("eqx_ckpt-io", _serve, stop=functools.partial(_JOBS.put, None))
        helper.start()


def attempt(run: Callable[[], Any]) -> BaseException | None:
    """Run `run`; its error, or `None`. Interrupts propagate."""
    try:
        run()
    except Exception as e:  # returned, and raised by the caller
        return e
    return None


def _stored(future: Any) -> BaseException | None:
    """The exception a finished `concurrent.futures.Future` holds (TensorStore's
    futures never hold an interrupt)."""
    if isinstance(future, concurrent.futures.Future) and future.done() and not future.cancelled():
        return future.exception()
    return None


def outcome(future: Any) -> tuple[Any, BaseException | None, BaseException | None]:
    """Wait for `future` to finish, whatever interrupts the caller: an
    operation left running at exit aborts the process, and a save must know
    whether a write happened before it decides what to undo.

    **Returns:**

    `(value, error, interrupt)`: the result (`None` where it failed), the
    error, and the wait's first interrupt, for the caller to raise once the
    outcome is recorded. The one loop that waits through interrupts
    (tests/package/test_architecture.py checks no other module has one).
    """
    interrupt: BaseException | None = None
    while True:
        try:
            return future.result(), None, interrupt
        except Exception as e:
            return None, e, interrupt
        except BaseException as e:  # raised by the caller, once the future has finished
            if _stored(future) is e:
                return None, e, interrupt  # the future's own outcome (raised in its thread), not an interrupt
            interrupt = interrupt or e


def finish(future: Any) -> Any:
    """`future.result()`, an interrupt raised only once it has finished."""
    value, error, interrupt = outcome(future)
    if interrupt is not None:
        raise interrupt
    if error is not None:
        raise error
    return value


def settle(futures: list[Any]) -> None:
    """Wait until no write of `futures` runs, so that deleting what they wrote
    cannot race them. Errors are ignored (the save has failed already); an
    interrupt is raised once all have settled."""
    interrupt: BaseException | None = None
    for future in futures:
        interrupt = interrupt or outcome(future)[2]
    if interrupt is not None:
        raise interrupt


def stop(futures: Sequence[concurrent.futures.Future[Any]]) -> None:
    """Cancel the `futures` not started and wait for the others, dropping
    interrupts (the caller raises its own): no thread may write into a buffer
    once the caller has it back."""
    for future in futures:
        future.cancel()
    for future in futures:
        outcome(future)


def wait_all(futures: list[Any], error: BaseException | None) -> BaseException | None:
    """Wait for every future; `error`, or else the first one's."""
    for future in futures:
        error = error or attempt(future.result)
    return error
