"""Saves of a state that lives on an accelerator: each piece copied to the
host as its write nears, within the staging budget, and back onto the device
bit for bit. Skipped where JAX computes on CPUs alone (CI); a machine with a
GPU runs them (docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import threading

import equinox as eqx
import jax
import numpy as np
import pytest
from arrays import tree_equal
from staged import MIB, Staged

import eqx_ckpt
from eqx_ckpt._base._state import reset as reset_state
from eqx_ckpt._save import _staging
from eqx_ckpt._store import _memory

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator")


def _state(leaves: int = 8, rows: int = 1024) -> dict[str, jax.Array]:
    """`leaves` float32 arrays of 4 MiB made on the default device, and a bfloat16 one."""
    key = jax.random.key(0)
    state = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, 1024)) for i in range(leaves)}
    state["half"] = jax.random.normal(key, (rows, 512), jax.numpy.bfloat16)
    return jax.block_until_ready(state)


def _on_device(tree: dict[str, jax.Array]) -> bool:
    return all(x.devices() == {jax.devices()[0]} for x in tree.values())


def test_the_default_budget_is_bounded_on_an_accelerator(tmp_path, faults):
    staged = Staged(faults)
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state)
    quarter = max(_staging.STAGING_MIN_BYTES, int(_memory.physical_memory() * _staging.STAGING_FRACTION))
    assert {b for _, b in staged.seen} == {min(quarter, _staging.ACCELERATOR_STAGING_BYTES)}
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", state)
    assert tree_equal(out, state, typematch=True) and _on_device(out)


@pytest.mark.parametrize("budget", [4 * MIB, 12 * MIB])
def test_copies_to_the_host_stay_within_the_budget(tmp_path, faults, budget):
    """The copies run ahead of the writes (in the copy pool) but never past
    the budget; what is loaded back is the state, on its device."""
    staged = Staged(faults)
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, staging_bytes=budget)
    assert staged.peak <= budget and staged.seen[-1][0] == 0
    like = eqx.filter_eval_shape(lambda: state)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", like)
    assert tree_equal(out, state, typematch=True) and _on_device(out)


def test_an_asynchronous_save_survives_a_donating_step(tmp_path):
    """The save holds its own host copy: a jitted step that donates the
    state's buffers once the call returns cannot reach what is written."""
    state = _state(leaves=4)
    expected = jax.tree.map(np.asarray, state)
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=False)
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)
    jax.block_until_ready(step(state))
    pending.wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", expected)
    assert tree_equal(out, expected, typematch=True)


def test_a_failed_copy_to_the_host_fails_the_save_by_name(tmp_path):
    """A piece whose copy cannot be made (its array deleted before the save)
    is an error naming the leaf, and nothing is committed."""
    state = _state(leaves=2)
    state["w1"].delete()
    with pytest.raises(eqx_ckpt.CheckpointError, match="w1"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state)
    assert not (tmp_path / "c" / "manifest.json").exists()


def _in_use() -> int:
    return int(jax.devices()[0].memory_stats()["bytes_in_use"])


def _donate_and_check(tmp_path, state, pending) -> None:
    """Donate the state to a jitted step that overwrites it, then check that
    the save committed the values the state had when it was called."""
    expected = jax.tree.map(np.asarray, state)
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 7, t), donate_argnums=0)
    jax.block_until_ready(step(state))
    pending.wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", expected)
    assert tree_equal(out, expected, typematch=True)


def test_an_asynchronous_save_holds_copies_in_pinned_host_memory(tmp_path, faults, monkeypatch):
    """The caller waits only for the copies into pinned host memory to be
    enqueued; they take no device memory, and a donating step after the
    call cannot reach them. (Copies on the device first switched off.)"""
    monkeypatch.setattr(_memory, "DEVICE_HOLD_FRACTION", 0)
    state = _state()
    nbytes = sum(x.nbytes for x in state.values())
    copied, go_on = [], threading.Event()
    faults("save.pinned_copies", lambda arrays: copied.append(len(arrays)))
    faults("save.held", lambda loc: go_on.wait(30))  # the background waits until checked
    before = _in_use()
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=False)
    grown = _in_use() - before
    go_on.set()
    assert copied == [len(state)] and grown < nbytes
    _donate_and_check(tmp_path, state, pending)


def test_a_first_asynchronous_save_holds_copies_on_the_device_until_pinned(tmp_path, faults, monkeypatch):
    """Before this process has pinned memory for them, the caller waits only
    for copies on the device (`_memory.on_device`); the save's thread moves
    them into pinned memory and frees them; a donating step after the call
    cannot reach them. A second save copies straight into pinned memory."""
    monkeypatch.setattr(_memory, "_PINNED_HELD", _memory._HighWater())
    state = _state()
    nbytes = sum(x.nbytes for x in state.values())
    seen, go_on = [], threading.Event()
    faults("save.device_copies", lambda arrays: seen.append(("device", len(arrays))))
    faults("save.pinned_copies", lambda arrays: seen.append(("pinned", len(arrays))))
    faults("save.held", lambda loc: go_on.wait(30))  # the background waits until checked
    before = _in_use()
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=False)
    grown = _in_use() - before
    go_on.set()
    assert seen == [("device", len(state))] and grown >= nbytes
    _donate_and_check(tmp_path, state, pending)
    assert seen == [("device", len(state)), ("pinned", len(state))]
    assert _in_use() - before < nbytes  # the copies on the device are freed
    seen.clear()
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "d", _state(), blocking=False)
    pending.wait()
    assert seen[0] == ("pinned", len(state))


def test_a_pinned_copy_that_fails_is_made_through_the_cpu_device(tmp_path, faults, monkeypatch):
    """Where the copy into pinned memory fails (raised at the fault point),
    the call copies through the host's CPU device instead, and the save
    still writes what the caller passed."""
    monkeypatch.setattr(_memory, "DEVICE_HOLD_FRACTION", 0)
    state = _state()
    faults("save.pinned_copies", MemoryError("RESOURCE_EXHAUSTED: out of memory"))
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=False)
    _donate_and_check(tmp_path, state, pending)


def test_an_asynchronous_save_with_a_prng_key_copies_the_rest_at_once(tmp_path, faults, monkeypatch):
    """A PRNG key array is held by its key data; the other arrays still by
    pinned copies, made in one call."""
    monkeypatch.setattr(_memory, "DEVICE_HOLD_FRACTION", 0)
    copied = []
    faults("save.pinned_copies", lambda arrays: copied.append(len(arrays)))
    state = {**_state(leaves=2), "key": jax.random.key(3)}
    like = eqx.filter_eval_shape(lambda: state)
    expected = jax.tree.map(np.asarray, {k: v for k, v in state.items() if k != "key"})
    key_data = np.asarray(jax.random.key_data(state["key"]))
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=False)
    assert copied == [len(state) - 1]
    pending.wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", like)
    assert _on_device(out)
    assert tree_equal({k: np.asarray(v) for k, v in out.items() if k != "key"}, expected, typematch=True)
    assert np.array_equal(np.asarray(jax.random.key_data(out["key"])), key_data)


@pytest.mark.parametrize("blocking", [True, False])
def test_64_bit_arrays_stay_64_bit_in_every_thread_that_copies_them(tmp_path, blocking):
    """JAX's switch for 64-bit types is per thread: the copies to the host run
    in other threads (the copy pool, an asynchronous save's), and made there
    with it off they were narrowed to 32 bits. Made under `jax.enable_x64`,
    saved outside it, packed and in arrays of their own."""
    with jax.enable_x64(True):
        state = {
            "small": jax.numpy.arange(6, dtype=jax.numpy.float64) / 3,
            "ints": jax.numpy.arange(6, dtype=jax.numpy.int64) << 40,
            "large": jax.numpy.linspace(0, 1, 1 << 20, dtype=jax.numpy.float64),
        }
        expected = jax.tree.map(np.asarray, state)
    assert {x.dtype for x in expected.values()} == {np.dtype("float64"), np.dtype("int64")}
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, blocking=blocking)
    if pending is not None:
        pending.wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", expected)
    assert tree_equal(out, expected, typematch=True)


@pytest.mark.parametrize("compression", [None, "blosc-zstd"])
def test_a_training_loop_saving_every_5_steps_resumes_bit_for_bit(tmp_path, compression):
    """50 steps of a jitted step that donates its state, saved every 5 steps
    in the background (each save holds pinned copies while the next steps
    overwrite the state; compressed, by eqx_ckpt's writing threads); a new
    manager resumes every saved step bit for bit, on the device, and
    training on from step 50 gives what the original run would have."""
    train = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.5 + 1.0, t), donate_argnums=0)
    state = _state(leaves=4)
    saved: dict[int, dict[str, np.ndarray]] = {}
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run", blocking=False)
    for step in range(1, 51):
        state = train(state)
        if step % 5 == 0:
            saved[step] = jax.tree.map(np.asarray, state)
            manager.save(step, state, compression=compression)
    manager.wait_until_finished()
    manager.close()
    expected_next = jax.tree.map(np.asarray, train(jax.tree.map(jax.numpy.copy, state)))
    resumed = eqx_ckpt.CheckpointManager(tmp_path / "run")
    assert resumed.latest_step() == 50
    like = eqx.filter_eval_shape(lambda: state)
    for step in resumed.all_steps():
        out = resumed.restore(like, step=step)
        assert _on_device(out)
        assert tree_equal(jax.tree.map(np.asarray, out), saved[step], typematch=True), step
    latest = resumed.restore(like)
    assert tree_equal(jax.tree.map(np.asarray, train(latest)), expected_next, typematch=True)


@pytest.mark.parametrize("buffers", ["host", "pinned"])
@pytest.mark.parametrize("compression", [None, "blosc-lz4", "zstd"])
def test_a_load_through_the_pool_of_pinned_buffers_is_bit_for_bit_on_the_device(
    tmp_path, faults, monkeypatch, compression, buffers
):
    """Through a small pool (`_memory.PINNED_LOAD_POOL`, on by default on GPUs), a
    state of 8 leaves of 4 MiB (chunks of 1 MiB) is read through two reused
    buffers of 2 MiB (each leaf in two slabs, joined on the device): loaded
    bit for bit onto the device, the buffers allocated once for two loads.
    Compressed chunks are decompressed straight into the pool's buffers. The
    buffers page-aligned host memory, or pinned (`_memory.PINNED_LOAD_BUFFERS`)."""
    from eqx_ckpt._ondisk import _format

    monkeypatch.setattr(_memory, "PINNED_LOAD_BUFFERS", buffers == "pinned")
    monkeypatch.setattr(_format, "CHUNK_BYTES", MIB)
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", (2, 2 * MIB))
    reset_state("memory.load_pools")
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, compression=compression)
    assert eqx_ckpt.Checkpoint(tmp_path / "c").compression == compression
    allocated: list[int] = []
    faults("load.pinned_pool", allocated.append)
    # An abstract skeleton, and the arrays themselves (their sharding: one device, committed).
    for like in [eqx.filter_eval_shape(lambda: state)] * 2 + [state]:
        out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", like)
        assert tree_equal(out, state, typematch=True) and _on_device(out)
    assert allocated == [2 * MIB, 2 * MIB]


def test_a_load_falls_back_when_the_pool_cannot_be_allocated(tmp_path, faults, monkeypatch):
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", (2, 64 * MIB))
    reset_state("memory.load_pools")
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state)
    faults("load.pinned_pool", MemoryError("RESOURCE_EXHAUSTED: out of memory"))
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", eqx.filter_eval_shape(lambda: state))
    assert tree_equal(out, state, typematch=True) and _on_device(out)


@pytest.mark.parametrize("budget", [4 * MIB, 12 * MIB])
def test_a_blocking_save_through_pinned_memory_stays_within_the_budget(tmp_path, faults, monkeypatch, budget):
    """With `_memory.PINNED_SAVE_COPIES` (on by default on GPUs), each piece is
    copied into pinned host memory as the budget admits it, never past it,
    and the state loads back bit for bit."""
    staged = Staged(faults)
    copied: list[int] = []
    faults("save.pinned_copies", lambda arrays: copied.extend(x.nbytes for x in arrays))
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state, staging_bytes=budget)
    assert staged.peak <= budget and staged.seen[-1][0] == 0
    assert sorted(copied) == sorted(x.nbytes for x in state.values())
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", eqx.filter_eval_shape(lambda: state))
    assert tree_equal(out, state, typematch=True) and _on_device(out)
