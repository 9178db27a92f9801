"""Preemption and following a run: `CheckpointManager.reached_preemption` (a real
SIGTERM, in this process and in real subprocesses) and `wait_for_new_step`."""

import re
import signal
import threading

import jax.numpy as jnp
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
