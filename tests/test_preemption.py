"""Preemption and following a run: `CheckpointManager.reached_preemption` (a real
SIGTERM, in this process and in real subprocesses) and `wait_for_new_step`."""

import re
import signal
import threading

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

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
    assert eqx.tree_equal(evaluator.restore(_tree(0), step=5), _tree(5), typematch=True)
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
