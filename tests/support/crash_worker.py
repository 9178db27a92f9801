"""A process that saves checkpoints on command, to be killed mid-save by
tests/interrupts/test_crash.py or to race another by tests/store/test_concurrency.py; and
`Worker`, the parent's handle on one.

Run as `python crash_worker.py COMMANDS`. It reads commands from the file
`COMMANDS` as the parent appends them, one per line: `MODE PATH GENERATION`,
saves `tree(GENERATION)` to `PATH` the way `MODE` says, and prints `done` when
the save has returned (`error CLASS: MESSAGE` if it raised an eqx_ckpt error).
It prints `ready` once imported, so the parent can start the clock only when
the save itself starts.

Modes: `save` (blocking `tree_serialise_leaves`), `big` (the same, with a tree
of about 1,500 leaves), `async` (`blocking=False`, then `wait()`), `manager`
(`CheckpointManager(PATH, max_to_keep=2).save`, the generation being the step).

Like a preemptible training job, the worker exits on SIGTERM through a handler
calling `sys.exit(143)`; SIGINT raises KeyboardInterrupt as Python does.
"""

import faulthandler
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import prefork

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
    """The parent's side: a worker process, started at once, importing in the
    background; what it prints (stdout and stderr) goes to a file.

    `fresh`: a new interpreter (`python crash_worker.py`), for what the new
    process inherits (a signal's disposition). Otherwise the worker is forked
    from `prefork`'s template, which has JAX imported (about two seconds
    less): for SIGKILL, which runs nothing of the worker's, and for workers
    that only save; with `finalize`, for a signal that runs Python code in the
    worker, its exit included (SIGINT, SIGTERM): its exit is then the
    interpreter's whole finalization, as a new interpreter's."""

    def __init__(self, *, fresh: bool = False, finalize: bool = False) -> None:
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="crash_worker_"))
        self.commands, self.output = self.directory / "commands", self.directory / "output"
        self.commands.touch()
        args = [str(SCRIPT), str(self.commands)]
        self.process: subprocess.Popen | prefork.Process
        if fresh:
            with self.output.open("wb") as out:
                self.process = subprocess.Popen(
                    [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
                )
        else:
            self.process = prefork.spawn(args, env=dict(os.environ), output=self.output, finalize=finalize)
        self.seen = 0  # the lines `ready`, `done`, `error ...` read so far
        self.ready = False
        self.last = ""
        self.resent = False

    def said(self) -> str:
        """What the worker printed so far."""
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def _next(self, seconds: float) -> str | None:
        """The next line of the protocol the worker prints within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            lines = [line for line in self.said().splitlines(keepends=True) if line.startswith(_PROTOCOL)]
            complete = [line.strip() for line in lines if line.endswith("\n")]
            if len(complete) > self.seen:
                self.seen += 1
                return complete[self.seen - 1]
            if self.process.poll() is not None:
                raise AssertionError(f"the worker exited ({self.process.returncode}): {self.said()[-3000:]}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def start(self, mode: str, path: pathlib.Path, generation: int) -> None:
        if not self.ready:
            line = self._next(120)
            assert line == "ready", f"the worker did not start: {self.said()[-3000:]}"
            self.ready = True
        with self.commands.open("a") as commands:
            commands.write(f"{mode} {path} {generation}\n")

    def finished_within(self, seconds: float) -> bool:
        """Whether the save returned within `seconds` (the worker then lives on)."""
        line = self._next(seconds)
        if line is None:
            return False
        self.last = line
        assert self.last == "done" or self.last.startswith("error "), f"worker failed: {self.said()[-3000:]}"
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
                os.kill(self.process.pid, signal.SIGUSR1)  # its threads' stacks, in its output
                time.sleep(2)
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
                raise AssertionError(
                    f"the worker did not exit within 120 s of signal {sig}; its signal masks: {signals}; "
                    f"it printed (its threads' stacks last):\n{self.said()[-6000:]}"
                ) from None
        return self.process.returncode

    def close(self) -> None:
        """Kill the process if it runs; remove its files."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


# What the worker prints for its parent (anything else is a diagnostic).
_PROTOCOL = ("ready", "done", "error ")


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
    parent = os.getppid()
    with open(sys.argv[1]) as commands:
        pending = ""
        while True:
            # Wait for the next command in short sleeps: a signal the kernel hands
            # to another thread (TensorStore's, XLA's) does not interrupt a
            # blocking wait of the main thread, whose Python handler would then
            # never run.
            pending += commands.readline()
            if not pending.endswith("\n"):
                if os.getppid() != parent:  # the parent is gone
                    return
                time.sleep(0.01)
                continue
            mode, path, generation = pending.split()
            pending = ""
            try:
                save(mode, path, int(generation))
            except eqx_ckpt.CheckpointError as e:
                print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            else:
                print("done", flush=True)


if __name__ == "__main__":
    main()
