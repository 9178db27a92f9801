"""Preemption and following a run: `CheckpointManager.reached_preemption` (a real
SIGTERM, in this process and in real subprocesses) and `wait_for_new_step`."""

import collections
import os
import pathlib
import queue
import random
import re
import shutil
import signal
import tempfile
import threading
import time

import crash_worker
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import places
import preempt_worker
import prefork
import pytest
from arrays import tree_equal

import eqx_ckpt


def _tree(value):
    return {"w": jnp.full((2,), float(value)), "n": value}


@pytest.fixture
def sigterm():
    """Whatever a test does, SIGTERM's handler is put back as it was."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_stops_the_loop_at_the_next_call_and_close_puts_the_handler_back(tmp_path, sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    assert manager.reached_preemption(0) is False
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    assert manager.reached_preemption(1) is False
    # Delivered here, in the main thread: without the manager's handler the
    # default action would end pytest.
    signal.raise_signal(signal.SIGTERM)
    assert manager.reached_preemption(2) is True
    assert manager.reached_preemption(2) is True  # asked twice in one step: the same answer
    manager.save(2, _tree(2))
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert manager.all_steps() == [2]


def test_a_previous_python_handler_still_runs_and_is_put_back(tmp_path, sigterm):
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, previous)
    with eqx_ckpt.CheckpointManager(tmp_path) as manager:
        assert manager.reached_preemption(0) is False
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert manager.reached_preemption(1) is True
    assert signal.getsignal(signal.SIGTERM) is previous
    # A handler installed after the manager's is the user's: close leaves it.
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.reached_preemption(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_the_first_call_must_come_from_the_main_thread(tmp_path, sigterm):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    errors = []

    def call():
        try:
            manager.reached_preemption(0)
        except eqx_ckpt.CheckpointError as e:
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert len(errors) == 1 and re.search("only in the main thread", str(errors[0]))
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match="A step must be an int"):
        manager.reached_preemption(1.5)


def test_wait_for_new_step_returns_committed_steps_only(tmp_path, faults):
    trainer = eqx_ckpt.CheckpointManager(tmp_path / "run")
    evaluator = eqx_ckpt.CheckpointManager(tmp_path / "run")
    assert evaluator.wait_for_new_step(timeout=0) is None
    trainer.save(3, _tree(3))
    assert evaluator.wait_for_new_step() == 3
    assert evaluator.wait_for_new_step(after=3, timeout=0.05) is None
    # A save held just before its commit: its step folder holds its arrays, and
    # is never returned, however long the evaluator waits.
    reached, release = threading.Event(), threading.Event()
    faults("commit.manifest_write", lambda *args: (reached.set(), release.wait()))
    saving = threading.Thread(target=trainer.save, args=(5, _tree(5)))
    saving.start()
    try:
        assert reached.wait(60)
        assert (tmp_path / "run" / "step_00000005").is_dir()
        assert evaluator.wait_for_new_step(after=3, timeout=0.3) is None
    finally:
        release.set()
        saving.join()
    assert evaluator.wait_for_new_step(after=3, timeout=60) == 5
    assert tree_equal(evaluator.restore(_tree(0), step=5), _tree(5), typematch=True)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="`timeout` must be a non-negative number"):
        evaluator.wait_for_new_step(after=3, timeout=-1)


def test_the_lowest_newer_step_comes_first(tmp_path):
    trainer = eqx_ckpt.CheckpointManager(tmp_path)
    for step in (1, 4, 9):
        trainer.save(step, _tree(step))
    evaluator = eqx_ckpt.CheckpointManager(tmp_path)
    assert [evaluator.wait_for_new_step(after=a, timeout=0) for a in (None, 1, 4, 9)] == [1, 4, 9, None]


def test_a_step_retention_deleted_after_the_wait_is_a_clear_error(tmp_path):
    trainer = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=2)
    evaluator = eqx_ckpt.CheckpointManager(tmp_path)
    trainer.save(1, _tree(1))
    assert evaluator.wait_for_new_step() == 1
    trainer.save(2, _tree(2))
    trainer.save(3, _tree(3))
    message = (
        f"There is no committed step 1 in {str(tmp_path)!r}; the committed steps are [2, 3]. It was committed "
        "(`wait_for_new_step` returned it), and has been deleted since by the retention rules"
    )
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(message)):
        evaluator.restore(_tree(0), step=1)
    assert evaluator.wait_for_new_step(after=1) == 2


def test_a_step_deleted_while_it_is_restored_is_a_clear_error(tmp_path, faults):
    """Retention deletes a step while another manager reads it: never a partial
    tree, never 'replaced by a newer save', but what happened and what is kept."""
    trainer = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1)
    big = {"w": np.arange(100_000, dtype=np.float32), "n": 1}
    trainer.save(1, big)
    evaluator = eqx_ckpt.CheckpointManager(tmp_path)
    assert evaluator.wait_for_new_step() == 1
    deleted = []

    def retention(*args):
        if not deleted:
            deleted.append(True)
            trainer.save(2, {"w": np.zeros(100_000, np.float32), "n": 2})

    faults("local_read.start_reads", retention)
    message = (
        f"Step 1 was deleted from {str(tmp_path)!r} while it was being restored (by the retention rules of the "
        f"manager saving there), so nothing of it is returned; the committed steps now are [2]."
    )
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(message)):
        evaluator.restore({"w": np.zeros(100_000, np.float32), "n": 0}, step=1)
    assert deleted


# The campaign: a training run (tests/support/preempt_worker.py) is sent SIGTERM at
# random moments and relaunched until it has done all its steps; its final state
# is then bitwise the state of a run that was never interrupted. Seeded (set
# `EQX_CKPT_PREEMPT_SEED` to replay a campaign); the figures are printed and
# recorded in docs/reliability.md.

SEED = int(os.environ.get("EQX_CKPT_PREEMPT_SEED", "20261125"))
STEPS = 40
WORKER = places.SUPPORT / "preempt_worker.py"
ROOT = places.ROOT


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of the processes these tests start: one CPU device each,
    this checkout first on the path, and one persistent compilation cache for
    all (every launch compiles the same programs: the first writes them, the
    others load them, the same executables; its lock keeps a process from
    reading an entry another is writing)."""
    environ = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environ.pop("XLA_FLAGS", None)  # one CPU device per process
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**30)  # (a size limit: the cache then locks its files)
    return environ


class _Child:
    """`subprocess.Popen([sys.executable, *args], stdout=PIPE, stderr=STDOUT,
    text=True)`, forked from a `prefork` template that imported JAX (a second
    and more less per launch): a real process (`pid`, signalled as any),
    its output read from a FIFO as from a pipe, line by line as it prints."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: pathlib.Path | None = None) -> None:
        self._folder = tempfile.mkdtemp(prefix="eqx-ckpt-child-")
        fifo = os.path.join(self._folder, "out")
        os.mkfifo(fifo)
        # Opened before the child (without blocking: nobody writes yet), so
        # that the template's open for writing returns at once.
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self.process = prefork.spawn(args, env=env, output=fifo, cwd=None if cwd is None else str(cwd))
        except BaseException:
            os.close(fd)
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        os.set_blocking(fd, True)  # the child holds the writing end: reads wait for its lines, end at its exit
        self.stdout = os.fdopen(fd, "r")
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.stdout.close()
        shutil.rmtree(self._folder, ignore_errors=True)


class _Job:
    """One launch of the training job: `count` worker processes, started at once
    (their imports overlap whatever the parent does next), training on `go`."""

    def __init__(
        self,
        directory: pathlib.Path,
        env: dict[str, str],
        count: int = 1,
        options: list[str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        distributed = [] if count == 1 else [str(places.free_port()), str(count)]
        self.lines: queue.Queue = queue.Queue()
        self.procs: list[_Child] = []
        self.readers: list[threading.Thread] = []
        self._go = pathlib.Path(tempfile.mkdtemp(prefix="eqx-ckpt-job-")) / "go"
        for i in range(count):
            extra = [] if count == 1 else [str(i), distributed[1], distributed[0]]
            command = [str(WORKER), f"--go={self._go}", *(options or []), *(args or [str(directory), str(STEPS)])]
            proc = _Child([*command, *extra], env)
            reader = threading.Thread(target=self._read, args=(i, proc), daemon=True)
            reader.start()
            self.procs.append(proc)
            self.readers.append(reader)
        self.outputs: list[list[str]] = [[] for _ in range(count)]
        self.ended = [0.0] * count  # when each process's output ended
        self.died = 0.0  # when a process said it dies (`--die-at`)

    def _read(self, i: int, proc: _Child) -> None:
        for line in proc.stdout:
            self.lines.put((i, line.rstrip("\n")))
        self.lines.put((i, None))

    def run(self, term_at: int | None = None, to: int = 0, delay: float = 0.0, limit: float = 180) -> list[int]:
        """Let the job train; after process `to` reports step `term_at`, wait
        `delay` seconds and send it SIGTERM. Returns the exit codes; a job still
        running after `limit` seconds (a hang) is killed and fails the test."""
        self._go.touch()
        deadline, open_ = time.monotonic() + limit, len(self.procs)
        try:
            while open_:
                try:
                    i, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"the job hung:\n{self.text()}") from None
                if line is None:
                    open_ -= 1
                    self.ended[i] = time.monotonic()
                    continue
                if line.startswith("process ") and " dies " in line:
                    self.died = time.monotonic()
                self.outputs[i].append(line)
                if term_at is not None and i == to and line == f"step {term_at}":
                    time.sleep(delay)
                    self.procs[to].send_signal(signal.SIGTERM)
        finally:
            self.close()
        return [proc.wait() for proc in self.procs]

    def text(self) -> str:
        return "\n".join(f"--- process {i}:\n" + "\n".join(out[-40:]) for i, out in enumerate(self.outputs))

    def close(self) -> None:
        for proc, reader in zip(self.procs, self.readers, strict=True):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            reader.join()
            proc.close()
        shutil.rmtree(self._go.parent, ignore_errors=True)


def _final(directory: pathlib.Path) -> dict:
    """The last step's state, as host arrays (keys as their data)."""
    manager = eqx_ckpt.CheckpointManager(directory)
    assert manager.latest_step() == STEPS - 1
    state = manager.restore(eqx.filter_eval_shape(preempt_worker.make_state))
    state["key"] = jax.random.key_data(state["key"])
    return state


def _bitwise_equal(a: dict, b: dict) -> bool:
    leaves_a, tree_a = jax.tree.flatten(eqx.filter(a, eqx.is_array_like))
    leaves_b, tree_b = jax.tree.flatten(eqx.filter(b, eqx.is_array_like))
    same = tree_a == tree_b and len(leaves_a) == len(leaves_b)
    return same and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b, strict=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """The final state of a run that was never interrupted."""
    directory = tmp_path_factory.mktemp("reference") / "run"
    job = _Job(directory, env)
    assert job.run() == [0], job.text()
    assert job.outputs[0][-1] == "finished"
    return _final(directory)


def _campaign(
    directory: pathlib.Path, env: dict[str, str], count: int, interruptions: int, rng: random.Random
) -> collections.Counter:
    """Train to the end under `interruptions` SIGTERMs (each to a random process,
    at a random step and moment), relaunching after each; the figures."""
    figures: collections.Counter = collections.Counter()
    job = _Job(directory, env, count)
    while True:
        latest = eqx_ckpt.CheckpointManager(directory).latest_step()
        start = 0 if latest is None else latest + 1
        left = interruptions - figures["interruptions"]
        signalled = left > 0 and start < STEPS - 12
        # Spread over the steps left, so that every interruption fits in, and
        # a few steps before the end, so that the processes can agree in time.
        term_at = start + rng.randrange(max(1, (STEPS - 12 - start) // max(1, left))) if signalled else None
        to, delay = rng.randrange(count), rng.uniform(0, 0.02)
        # The relaunch, importing meanwhile; none after a run that no SIGTERM stops (it finishes).
        spare = _Job(directory, env, count) if signalled else None
        codes = job.run(term_at, to, delay)
        figures["runs"] += 1
        figures["resumes"] += start > 0
        stops = {out[-1] for out in job.outputs}
        assert codes == [0] * count and len(stops) == 1, f"exit codes {codes}:\n{job.text()}"
        (stop,) = stops
        if stop == "finished":
            if spare is not None:
                spare.close()
            return figures
        # Every process saved the same step, at or after the one signalled, and exited.
        assert signalled and spare is not None and stop.startswith("preempted at "), job.text()
        step = int(stop.removeprefix("preempted at "))
        assert term_at <= step and eqx_ckpt.CheckpointManager(directory).latest_step() == step
        figures["interruptions"] += 1
        job = spare


@pytest.fixture(scope="module")
def rng():
    print(f"\npreemption campaign seeded with EQX_CKPT_PREEMPT_SEED={SEED}")
    return random.Random(SEED)


@pytest.mark.parametrize("count, interruptions", [(1, 5), (2, 3)], ids=["one-process", "two-processes"])
def test_a_preempted_run_resumes_to_the_same_bits(tmp_path, env, reference, rng, count, interruptions):
    figures = _campaign(tmp_path / "run", env, count, interruptions, rng)
    equal = _bitwise_equal(_final(tmp_path / "run"), reference)
    print(
        f"{count} process(es): {figures['runs']} runs, {figures['interruptions']} SIGTERMs, "
        f"{figures['resumes']} resumes, final state bitwise equal to an uninterrupted run: {equal}"
    )
    assert figures["interruptions"] == interruptions and figures["resumes"] == interruptions
    assert equal


def test_a_process_waiting_in_a_save_stops_at_the_same_step(tmp_path, env):
    """Process 0 is slow, so process 1 runs ahead and waits for it in the
    barriers of its next save; process 0 is then sent SIGTERM. Process 1's main
    thread cannot answer while it waits there (a stop step agreed by the main
    threads, at a barrier, would deadlock: each waiting for the other), but its
    watcher thread can: both processes save the same step, after the one
    process 1 was saving, and exit 0."""
    job = _Job(tmp_path / "run", env, 2, options=["--slow=0"])
    codes = job.run(term_at=5, to=0)
    assert codes == [0, 0], job.text()
    stops = {out[-1] for out in job.outputs}
    assert len(stops) == 1 and next(iter(stops)).startswith("preempted at "), job.text()
    step = int(next(iter(stops)).removeprefix("preempted at "))
    # When process 0 reported step 5, process 1 had asked about step 7 and was
    # saving it (saves are at steps 3, 7, 11, ...), or was about to.
    assert "step 7" in job.outputs[1] and step >= 7, job.text()
    print(f"process 1 ahead, waiting in a save; SIGTERM to process 0 after step 5: both stopped at step {step}")
    assert eqx_ckpt.CheckpointManager(tmp_path / "run").latest_step() == step


# `jax.distributed`'s heartbeat time-out in the workers of the test below (10 s
# in the others): how long the survivor takes to learn that process 1 died.
# Its heartbeats come from a thread of JAX's own, in C++: a busy machine does
# not silence a process that lives for seconds. (Shorter than eqx_ckpt's own
# `_multihost.SILENT_SECONDS`, 10 s, which a barrier of the save would wait
# for: JAX ends the survivor first.)
HEARTBEAT = 4


@pytest.mark.parametrize("dying", [0, 1])
def test_a_process_dying_mid_save_fails_the_other_and_the_run_resumes(tmp_path, env, reference, rng, dying):
    """One of two processes is SIGKILLed in the middle of saving a step (process
    0 before the commit, process 1 joining it). The other does not hang: the
    coordination service reports the dead process (after the job's heartbeat
    time-out, `HEARTBEAT`; at once if process 0, which runs the service,
    died) and JAX ends the survivor ("another task died"). The last committed
    step is whole, the step in flight is not one, and a relaunch resumes to the
    same bits as a run that was never interrupted."""
    directory = tmp_path / "run"
    die_at = preempt_worker.EVERY * rng.randrange(2, 6) - 1  # a periodic save
    job = _Job(directory, env, 2, options=[f"--die-at={die_at}:{dying}", f"--heartbeat={HEARTBEAT}"])
    codes = job.run()
    survivor = 1 - dying
    assert codes[dying] == -signal.SIGKILL and f"process {dying} dies saving step {die_at}" in job.text()
    assert codes[survivor] != 0, job.text()
    report = "\n".join(job.outputs[survivor])
    assert "another task died" in report, job.text()
    print(
        f"process {dying} killed saving step {die_at}: process {survivor} failed "
        f"{job.ended[survivor] - job.died:.1f} s later, exit code {codes[survivor]}"
    )
    manager = eqx_ckpt.CheckpointManager(directory)
    latest = die_at - preempt_worker.EVERY
    assert manager.all_steps() == [s for s in (latest - preempt_worker.EVERY, latest) if s >= 0]
    assert not (directory / f"step_{die_at:08d}" / "manifest.json").exists()
    assert eqx_ckpt.verify(manager.step_path(latest)) == []
    restored = manager.restore(eqx.filter_eval_shape(preempt_worker.make_state))
    assert restored["data"] == latest + 1
    if dying == 1:
        return  # the relaunch is the same as after process 0's death (CI's time)
    relaunch = _Job(directory, env, 2)
    assert relaunch.run() == [0, 0], relaunch.text()
    assert [out[-1] for out in relaunch.outputs] == ["finished", "finished"]
    assert _bitwise_equal(_final(directory), reference)


def test_an_evaluator_beside_a_training_run_never_sees_a_partial_step(tmp_path, env):
    """A trainer process saves 30 steps in the background with `max_to_keep=2`;
    this process follows it with a manager of its own (`wait_for_new_step`, then
    `restore`). Every step restored is exactly the one saved; a step retention
    deleted before or while it was restored is a `CheckpointNotFoundError`
    naming the steps kept, and the evaluator goes on to the next; it ends on the
    trainer's last step."""
    steps, directory = 30, tmp_path / "run"
    trainer, codes = _Job(directory, env, args=["--trainer", str(directory), str(steps)]), []
    training = threading.Thread(target=lambda: codes.append(trainer.run()))
    training.start()
    evaluator = eqx_ckpt.CheckpointManager(directory)
    like = crash_worker.tree(0)
    seen, evaluated, deleted = None, [], []
    try:
        while seen != steps - 1:
            step = evaluator.wait_for_new_step(after=seen, timeout=120)
            assert step is not None, "the evaluator waited 120 s for a step"
            assert seen is None or step > seen
            try:
                state = evaluator.restore(like, step=step)
            except eqx_ckpt.CheckpointNotFoundError as e:
                assert re.search(rf"[Ss]tep {step}\b.*the committed steps (now )?are \[", str(e)), str(e)
                deleted.append(step)
            else:
                assert tree_equal(state, crash_worker.tree(step), typematch=True), f"step {step} is not as saved"
                evaluated.append(step)
            seen = step
    finally:
        training.join()
    assert codes == [[0]] and trainer.outputs[0][-1] == "finished", trainer.text()
    print(f"evaluator: {len(evaluated)} steps restored exactly, {len(deleted)} deleted by retention first")
    assert evaluated[-1] == steps - 1


def _documented(section: str) -> str:
    """The first ```python block of a section of docs/manager.md."""
    text = (ROOT / "docs" / "manager.md").read_text()
    part = text[text.index(f"\n## {section}\n") + 1 :]
    part = part[: part.index("\n## ")]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def _start(script: str, cwd: pathlib.Path, env: dict[str, str]) -> _Child:
    """`python script` in `cwd` (its folder first on the path, as `python` puts it)."""
    return _Child([script], env, cwd=cwd)


def _finish(proc: _Child, lines: list[str]) -> int:
    """Read the rest of `proc`'s output into `lines`; its exit code."""
    lines.extend(line.rstrip("\n") for line in proc.stdout)
    proc.close()
    return proc.wait()


def test_the_documented_loops_run(tmp_path, env):
    """docs/manager.md's `train.py` and `evaluate.py`, as written: the training
    script is sent SIGTERM, saves the step it stopped at and exits 0; relaunched,
    it resumes there and finishes; the evaluator beside it follows every launch
    and ends on the last step."""
    (tmp_path / "train.py").write_text(_documented("Preemption"))
    (tmp_path / "evaluate.py").write_text(_documented("Following a run: an evaluator"))
    evaluator = _start("evaluate.py", tmp_path, env)
    trainer = _start("train.py", tmp_path, env)
    procs = [evaluator, trainer]
    # A hang fails the test instead of stalling the suite.
    watchdog = threading.Timer(300, lambda: [p.kill() for p in procs if p.poll() is None])
    watchdog.start()
    try:
        first: list[str] = []
        for line in trainer.stdout:
            first.append(line.rstrip("\n"))
            if first[-1] == "step 100":
                trainer.send_signal(signal.SIGTERM)
                break
        assert _finish(trainer, first) == 0, "\n".join(first)
        assert first[0] == "starting at step 0" and first[-1].startswith("preempted: saved step "), first
        stopped = int(first[-1].removeprefix("preempted: saved step "))
        assert stopped >= 100
        procs.append(relaunch := _start("train.py", tmp_path, env))
        second: list[str] = []
        assert _finish(relaunch, second) == 0, "\n".join(second)
        assert second[0] == f"starting at step {stopped + 1}" and second[-1] == "done", second
        evaluated: list[str] = []
        assert _finish(evaluator, evaluated) == 0, "\n".join(evaluated)
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            if not proc.stdout.closed:
                _finish(proc, [])
    steps = [int(re.match(r"step (\d+): loss \d+\.\d+$", line).group(1)) for line in evaluated]
    assert steps == sorted(set(steps)) and steps[-1] == 999, evaluated
