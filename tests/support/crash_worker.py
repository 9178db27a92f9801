"""A process that saves checkpoints on command, to be killed mid-save by
tests/interrupts/test_crash.py or to race another by tests/store/test_concurrency.py; and
`Worker`, the parent's handle on one.

It reads commands from stdin, one per line: `MODE PATH GENERATION`, saves
`tree(GENERATION)` to `PATH` the way `MODE` says, and prints `done` when the
save has returned (`error CLASS: MESSAGE` if it raised an eqx_ckpt error). It
prints `ready` once imported, so the parent can start the clock only when the
save itself starts.

Modes: `save` (blocking `tree_serialise_leaves`), `big` (the same, with a tree
of about 1,500 leaves), `async` (`blocking=False`, then `wait()`), `manager`
(`CheckpointManager(PATH, max_to_keep=2).save`, the generation being the step).

Like a preemptible training job, the worker exits on SIGTERM through a handler
calling `sys.exit(143)`; SIGINT raises KeyboardInterrupt as Python does.
"""

import faulthandler
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import jax
import numpy as np

import eqx_ckpt

LAYERS = 40
BIG_LAYERS = 750
SCRIPT = pathlib.Path(__file__)


def tree(generation: int, layers: int = LAYERS) -> dict:
    """Many small leaves (so a kill lands between them), every value depending
    on the generation (so a mix of two generations is visible)."""
    return {
        f"layer{i:03d}": {
            "w": np.full((8, 8), generation * 1000 + i, np.float32),
            "b": np.arange(8, dtype=np.int64) + generation,
        }
        for i in range(layers)
    } | {"step": generation}


def save(mode: str, path: str, generation: int) -> None:
    if mode == "save":
        eqx_ckpt.tree_serialise_leaves(path, tree(generation))
    elif mode == "big":
        eqx_ckpt.tree_serialise_leaves(path, tree(generation, BIG_LAYERS))
    elif mode == "async":
        pending = eqx_ckpt.tree_serialise_leaves(path, tree(generation), blocking=False)
        assert pending is not None
        pending.wait()
    elif mode == "manager":
        eqx_ckpt.CheckpointManager(path, max_to_keep=2).save(generation, tree(generation))
    else:
        raise ValueError(mode)


class Worker:
    """The parent's side: a worker process, started at once, importing in the background."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ready = False
        self.last = ""
        self.resent = False

    def start(self, mode: str, path: pathlib.Path, generation: int) -> None:
        if not self.ready:
            assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"
            self.ready = True
        assert self.process.stdin is not None
        self.process.stdin.write(f"{mode} {path} {generation}\n")
        self.process.stdin.flush()

    def finished_within(self, seconds: float) -> bool:
        """Whether the save returned within `seconds` (the worker then lives on)."""
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], seconds)
        if not readable:
            return False
        self.last = self.process.stdout.readline().strip()
        assert self.last == "done" or self.last.startswith("error "), f"worker failed: {self.last!r}"
        return True

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send `sig` and wait for the process to end (a SIGINT or SIGTERM lets
        it run its handlers, and wait for an asynchronous save); its exit code."""
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # Python drops an exception raised while it runs a garbage
                # collector callback ("Exception ignored in: _xla_gc_callback",
                # JAX's): a signal that lands then is lost, as a Ctrl-C can be.
                # Sent once more, as a user would press Ctrl-C again; counted.
                self.resent = True
                os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                signals = _signal_state(self.process.pid)
                os.kill(self.process.pid, signal.SIGUSR1)  # its threads' stacks, on stderr
                time.sleep(2)
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
                printed = self.process.stdout.read() if self.process.stdout is not None else ""
                raise AssertionError(
                    f"the worker did not exit within 120 s of signal {sig} (its threads' stacks are "
                    f"in the captured stderr); it printed {printed!r}; its signal masks: {signals}"
                ) from None
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        return self.process.returncode

    def close(self) -> None:
        self.kill()


def _signal_state(pid: int) -> str:
    """The kernel's view of a process's signals: pending for the process and for
    each thread, blocked, caught (hexadecimal masks; SIGINT is bit 1, 0x2)."""
    fields = ("SigPnd", "ShdPnd", "SigBlk", "SigCgt", "SigIgn")

    def masks(status: pathlib.Path) -> str:
        try:
            lines = status.read_text().splitlines()
        except OSError as e:
            return repr(e)
        return " ".join(line.replace("\t", "") for line in lines if line.startswith(fields))

    tasks = sorted(pathlib.Path(f"/proc/{pid}/task").glob("*"))
    return "; ".join(f"thread {task.name}: {masks(task / 'status')}" for task in tasks)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *args: sys.exit(143))
    # Python installs its Ctrl-C handler only where SIGINT is not ignored
    # already, and a job a non-interactive shell starts in the background (`&`,
    # as some CI runners do) inherits SIGINT ignored: the worker then went on
    # after every SIGINT, and the campaign waited for it in vain. A training job
    # in a terminal has Python's handler; so does the worker, whatever started it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The parent asks for every thread's stack (on stderr) before it kills a
    # worker that did not exit: a hang is then reported with where it waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # As in a training job, JAX's backend is up before any save. (An interrupt
    # while XLA starts its thread pools can make the process abort at exit: a
    # JAX matter, which the saves of this worker need not exercise.)
    jax.devices()
    print("ready", flush=True)
    while True:
        # Wait for the next command in short steps: a signal the kernel hands to
        # another thread (TensorStore's, XLA's) does not interrupt a blocking read
        # of the main thread, whose Python handler would then never run.
        while not select.select([sys.stdin], [], [], 0.1)[0]:
            pass
        line = sys.stdin.readline()
        if not line:
            return
        mode, path, generation = line.split()
        try:
            save(mode, path, int(generation))
        except eqx_ckpt.CheckpointError as e:
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        else:
            print("done", flush=True)


if __name__ == "__main__":
    main()
