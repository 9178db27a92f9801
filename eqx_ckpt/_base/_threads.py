"""Every thread and pool eqx_ckpt starts, and how each ends.

- `pool`: the process's pool of threads of a name, made on first use.
- `thread`: a thread of its own (a heartbeat, a watcher, a save's thread).
- `at_exit`: work that must end before the workers stop (the asynchronous
  saves still in flight).

Every worker is recorded here before it starts, and every worker but a
save's is a daemon thread. So an interrupt that lands inside `Thread.start`
never leaves a thread the exit waits for forever (as `ThreadPoolExecutor`'s
did: it recorded a worker only once `start` had returned).

At interpreter exit, before Python joins its threads:

1. the `at_exit` functions run, in order: pending saves commit or are
   removed;
2. every pool refuses new work and cancels its queued work, and every thread
   is asked to stop;
3. each is waited for, `STOP_SECONDS` at most in all. A daemon still running
   then is named on stderr, and left to the interpreter.

After an interrupt that does not end the process (a Ctrl-C in a notebook),
the workers stay, idle, for the next call.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _state

# How long the exit waits, in all, for the workers once they are asked to stop.
STOP_SECONDS = 30.0

# A queued call: its future, function and arguments.
_Work = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class Pool(concurrent.futures.Executor):
    """Up to `threads` daemon threads named `name_0`, `name_1`..., started when
    work comes and none is idle, with `ThreadPoolExecutor`'s interface."""

    def __init__(self, name: str, threads: int):
        self.name, self.threads = name, threads
        self.workers: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"eqx_ckpt's pool {self.name!r} takes no new work: the interpreter is exiting.")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self.workers) < self.threads:
                worker = threading.Thread(target=self._serve, name=f"{self.name}_{len(self.workers)}", daemon=True)
                self.workers.append(worker)
                try:
                    worker.start()
                except BaseException:
                    if worker.ident is None:  # it never began: the pool keeps its place for another
                        self.workers.remove(worker)
                    raise
        return future

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            _run(*work)
            del work  # (its arguments, freed before the worker idles)
            self._idle.release()
        self._queue.put(None)  # the next worker stops too

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            while cancel_futures:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
            self._queue.put(None)
        if wait:
            for worker in self.workers:
                if worker.is_alive():  # (not if an interrupt cut its start short)
                    worker.join()


def _run(future: concurrent.futures.Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    if future.set_running_or_notify_cancel():  # (not if it was cancelled)
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the future's outcome, raised by whoever waits for it
            future.set_exception(e)


# (A forked child starts with none: the parent's workers are not in it.)
_POOLS: _state.Table[str, Pool] = _state.table("threads.pools", 16, "refuse", fork="empty")
# Threads made by `thread` and still running, each with what asks it to stop.
_THREADS: _state.Table[threading.Thread, Callable[[], None] | None] = _state.table(
    "threads.threads", None, "live", fork="empty"
)
_AT_EXIT: _state.Table[Callable[[], None], None] = _state.table("threads.at_exit", 4, "refuse")


def pool(name: str, threads: int) -> Pool:
    """The process's pool named `name`, made on first use."""
    with _POOLS.lock:
        made = _POOLS.get(name)
        return made if made is not None else _POOLS.put(name, Pool(name, threads))


def thread(
    name: str, target: Callable[..., Any], *args: Any, stop: Callable[[], None] | None = None, daemon: bool = True
) -> threading.Thread:
    """A thread running `target(*args)`, recorded here; the caller starts it. The
    exit calls `stop` (which asks `target` to return) and waits for it.
    `daemon=False` only for a save's thread, which an `at_exit` function waits for."""

    def run() -> None:
        try:
            target(*args)
        finally:
            with _THREADS.lock:
                _THREADS.pop(made, None)

    made = threading.Thread(target=run, name=name, daemon=daemon)
    with _THREADS.lock:
        _THREADS[made] = stop
    return made


def at_exit(fn: Callable[[], None]) -> None:
    """Run `fn` at interpreter exit, before the workers stop."""
    _AT_EXIT.put(fn, None)


def run_exit() -> None:
    """What the interpreter's exit runs of eqx_ckpt's, now, for a program
    about to end without that exit (`os._exit`)."""
    _exit()


def _exit() -> None:
    """Stop everything, in the order the module docstring gives."""
    for fn in list(_AT_EXIT):
        fn()
    with _POOLS.lock, _THREADS.lock:
        pools, threads = list(_POOLS.values()), list(_THREADS.items())
    for made in pools:
        made.shutdown(wait=False, cancel_futures=True)
    for _, stop in threads:
        if stop is not None:
            stop()
    deadline = time.monotonic() + STOP_SECONDS
    workers = [worker for made in pools for worker in made.workers] + [started for started, _ in threads]
    for worker in workers:
        if worker.is_alive() and worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()))
    running = sorted(worker.name for worker in workers if worker.is_alive())
    if running:
        print(f"eqx_ckpt: {len(running)} thread(s) still running at exit: {', '.join(running)}.", file=sys.stderr)


# Python runs these hooks when the interpreter begins to exit (the last
# registered first), before it joins its non-daemon threads and before any
# `atexit` function (JAX's, which shuts `jax.distributed` down, among them).
threading._register_atexit(_exit)  # type: ignore[attr-defined]
