"""Preemption: a SIGTERM handler that only raises a flag, and the one step at
which every process of a job stops (`CheckpointManager.reached_preemption`).

Several `jax.distributed` processes drift apart, and a barrier at every step
would cost every step a round trip. So each runs a watcher thread, as JAX's
own preemption sync manager does: the signalled process publishes a request
in the coordination service's key-value store; every watcher sees it within
`_POLL` seconds and publishes the last step its loop reported; at one barrier
they take the first step after the highest, which no process has passed.
Meanwhile a main thread that calls again waits, so that its step does not
move past the one its watcher published.
"""

from __future__ import annotations

import itertools
import signal
import threading
from typing import Any

import jax

from .._base import _threads
from .._base._errors import CheckpointError
from .._hosts import _multihost

# How often a watcher looks for another process's request, in seconds.
_POLL = 0.05

# Managers that follow preemption are numbered in the order each process asks,
# which is the same in every process, so their keys match across processes.
_numbers = itertools.count()


class Preemption:
    """One manager's SIGTERM handler and stop step."""

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._installed = False
        self._previous: Any = None
        self._cond = threading.Condition()
        self._last = -1  # the step of the loop's last call (-1: none yet)
        self._agreeing = False
        self._stop_after: int | None = None  # the loop stops at the first step after this
        self._error: BaseException | None = None
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()

    def reached(self, step: int) -> bool:
        """Whether the loop, at `step`, stops (see `CheckpointManager.reached_preemption`)."""
        if not self._installed:
            self._install()
        if jax.process_count() == 1:
            if self._stop_after is None and self._signalled.is_set():
                self._stop_after = step - 1
            return self._stop_after is not None and step > self._stop_after
        if self._watcher is None:
            self._start_watcher()
        with self._cond:
            while self._agreeing:
                self._cond.wait()
            if self._error is not None:
                raise CheckpointError(
                    f"The processes could not agree on the step at which to stop after a preemption: "
                    f"{_multihost._describe(self._error)}"
                ) from self._error
            self._last = step
            return self._stop_after is not None and step > self._stop_after

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "The first call of `reached_preemption` installs a SIGTERM handler, which Python allows only "
                "in the main thread: call it first from the main thread (the training loop's)."
            )
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        """Only raise the flag (and run a previous Python handler): the loop
        saves and exits at the agreed step."""
        self._signalled.set()
        if callable(self._previous):
            self._previous(signum, frame)

    def _start_watcher(self) -> None:
        client = _multihost._client()
        self._closing.clear()  # a manager closed and used again
        prefix = f"eqx_ckpt/preemption/{next(_numbers)}"
        # Stopped at exit before JAX shuts its distributed client down (`_threads`).
        self._watcher = _threads.thread("eqx_ckpt-preemption", self._watch, client, prefix, stop=self._closing.set)
        self._watcher.start()

    def _watch(self, client: Any, prefix: str) -> None:
        """Wait for a request (this process's signal, or another's key), then agree."""
        index = jax.process_index()
        try:
            while not self._closing.is_set():
                if self._signalled.is_set():
                    client.key_value_set(f"{prefix}/request/{index}", "SIGTERM", allow_overwrite=True)
                if client.key_value_dir_get(f"{prefix}/request/"):
                    break
                self._signalled.wait(_POLL)
            else:
                return
            with self._cond:
                self._agreeing = True
                last = self._last
            client.key_value_set(f"{prefix}/step/{index}", str(last))
            client.wait_at_barrier(f"{prefix}/agree", _multihost.TIMEOUT_MS)
            steps = [int(value) for _, value in client.key_value_dir_get(f"{prefix}/step/")]
            with self._cond:
                self._stop_after = max(steps)
        except Exception as e:  # raised by the loop's next call
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._agreeing = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the watcher; put the previous SIGTERM handler back."""
        self._closing.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        if not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "`close()` puts back the SIGTERM handler `reached_preemption` replaced, which Python allows "
                "only in the main thread: close the manager from the main thread."
            )
        if signal.getsignal(signal.SIGTERM) == self._handle:  # not if someone installed another since
            # `None`: a handler not installed from Python, which Python cannot put back.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        self._installed = False
