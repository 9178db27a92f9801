"""A process that runs one eqx_ckpt operation and is stopped by a signal, for
tests/interrupts/test_threads.py (not a test module).

Run as `python exit_worker.py COMMANDS` (the test forks it from `prefork`'s
template, to exit as a new interpreter does: `finalize=True`). It prints
`ready` once JAX is up, then waits for a line `KIND PATH GENERATION` in the
file `COMMANDS` (the parent appends it), runs that operation on `PATH` and
prints `done SECONDS`. Then it waits. The parent signals it at a moment of its
choosing: before, during or after the operation.

Kinds: `save` (a blocking save, a first save or an overwrite), `async`
(`blocking=False`, then `wait()`), `manager` (a `CheckpointManager` step,
`max_to_keep=2`), `load` (`tree_deserialise_leaves`). The tree is the one of
issue 69: four 8 MiB `int32` arrays, 1,500 small `int64` leaves and an `int`,
every value depending on a generation (the step), so a mix shows.

As a preemptible training job does, SIGTERM runs a handler that calls
`sys.exit(143)`; SIGINT raises `KeyboardInterrupt`. The worker prints
`exiting` when the interpreter begins to exit (before it joins its threads),
so the parent tells a process that hangs at exit from one whose signal was
lost. SIGUSR1 prints every thread's stack on stderr.

With `--stop-first-start PREFIX` after `COMMANDS`, the first thread whose name starts with
`PREFIX` is started and then `Thread.start` raises `SystemExit(143)`, as a
SIGTERM handler's `sys.exit` does when the signal lands while `start` waits
for the new thread to begin.
"""

import faulthandler
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

import eqx_ckpt

BIG = 4
SMALL = 1500


def tree(generation: int) -> dict:
    big = {f"big{i}": np.full((2**21,), generation * 10 + i, np.int32) for i in range(BIG)}
    small = {f"small{i:04d}": np.arange(3, dtype=np.int64) + generation * 100_000 + i for i in range(SMALL)}
    return {**big, **small, "step": generation}


def run(kind: str, path: str, generation: int) -> None:
    if kind == "save":
        eqx_ckpt.tree_serialise_leaves(path, tree(generation), overwrite=True)
    elif kind == "async":
        pending = eqx_ckpt.tree_serialise_leaves(path, tree(generation), overwrite=True, blocking=False)
        assert pending is not None
        pending.wait()
    elif kind == "manager":
        with eqx_ckpt.CheckpointManager(path, max_to_keep=2) as manager:
            manager.save(generation, tree(generation))
    elif kind == "load":
        eqx_ckpt.tree_deserialise_leaves(path, tree(0))
    else:
        raise ValueError(kind)


def _stop_first_start(prefix: str) -> None:
    """Make the first `Thread.start` of a thread named `PREFIX...` raise
    `SystemExit` once the thread runs (see the module docstring)."""
    start = threading.Thread.start
    armed = [True]

    def interrupted_start(self: threading.Thread) -> None:
        start(self)
        if armed[0] and self.name.startswith(prefix):
            armed[0] = False
            print(f"interrupted the start of {self.name}", flush=True)
            raise SystemExit(143)

    threading.Thread.start = interrupted_start  # type: ignore[method-assign]


def _say(line: str) -> None:
    print(line, flush=True)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *args: sys.exit(143))
    # Python installs its Ctrl-C handler only where SIGINT is not ignored, and
    # a job started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Registered after eqx_ckpt's own hooks, so it runs before them: the
    # parent learns that the interpreter has begun to exit.
    threading._register_atexit(_say, "exiting")  # type: ignore[attr-defined]
    if len(sys.argv) == 4 and sys.argv[2] == "--stop-first-start":
        _stop_first_start(sys.argv[3])
    jax.devices()  # as in a training job, JAX's backend is up before any save
    _say("ready")
    # Short sleeps: a signal handed to another thread (TensorStore's, XLA's)
    # does not interrupt a blocking wait of the main thread.
    parent = os.getppid()
    with open(sys.argv[1]) as commands:
        line = commands.readline()
        while not line.endswith("\n"):
            if os.getppid() != parent:  # the parent is gone
                return
            time.sleep(0.01)
            line += commands.readline()
    kind, path, generation = line.split()
    start = time.perf_counter()
    run(kind, path, int(generation))
    _say(f"done {time.perf_counter() - start:.3f}")
    while os.getppid() == parent:  # until the signal, or the parent is gone
        time.sleep(0.01)


if __name__ == "__main__":
    main()
