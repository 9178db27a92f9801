"""A blocking save that copies its pieces to the host through pinned memory
(`_memory.PINNED_SAVE_COPIES`, issue 60), switched on here for JAX's CPU
devices, which have the `pinned_host` memory kind a GPU has. On by default for
GPUs alone (`_memory.PINNED_PLATFORMS`); `tests/hosts/test_gpu.py` runs it there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._store import _memory

# The pinned paths as JAX's CPU devices take them; on an accelerator the state
# would be placed on it, and tests/hosts/test_gpu.py runs these paths there.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="simulates the pinned paths on CPU devices")


@pytest.fixture
def pinned_saves(monkeypatch):
    monkeypatch.setattr(_memory, "PINNED_SAVE_COPIES", True)
    monkeypatch.setattr(_memory, "PINNED_PLATFORMS", _memory.PINNED_PLATFORMS | {"cpu"})


def _state() -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 6)
    return {
        **{f"w{i}": jax.random.normal(keys[i], (512, 1024)) for i in range(4)},  # 2 MiB each
        "half": jax.random.normal(keys[4], (1024, 512)).astype(jnp.bfloat16),
        "ints": jnp.arange(2**19, dtype=jnp.int32),
        "small": jnp.arange(12.0).reshape(3, 4),
        "key": jax.random.key(3),
    }


def test_the_copies_are_on_for_gpus_and_not_for_cpus(tmp_path, faults):
    """By default a blocking save copies through pinned memory on GPUs alone:
    here, on CPU devices, no piece goes that way."""
    assert _memory.PINNED_SAVE_COPIES is True
    assert "gpu" in _memory.PINNED_PLATFORMS and "cpu" not in _memory.PINNED_PLATFORMS
    copied: list[int] = []
    faults(["save.pinned_copies"], lambda arrays: copied.append(len(arrays)))
    state = _state()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state)
    assert copied == []
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state), state, typematch=True)


def test_a_blocking_save_copies_each_piece_through_pinned_memory_within_its_budget(tmp_path, pinned_saves, faults):
    state = _state()
    budget = 3 * 2**20
    staged: list[int] = [0]
    copied: list[tuple[int, int]] = []  # (bytes copied, bytes staged then)

    def copying(arrays):
        assert all(x.sharding.memory_kind == "device" for x in arrays)
        copied.append((sum(x.nbytes for x in arrays), staged[-1]))

    faults(["save.staged"], lambda nbytes, _: staged.append(nbytes))
    faults(["save.pinned_copies"], copying)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state, staging_bytes=budget)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state)
    assert tree_equal(out, state, typematch=True)
    # Every large leaf went through pinned memory, one at a time as admitted.
    large = sorted(x.nbytes for k, x in state.items() if k not in ("small", "key"))
    assert sorted(nbytes for nbytes, _ in copied if nbytes >= 2**20) == large
    assert max(staged) <= budget
    assert all(then <= budget for _, then in copied)


def test_a_failed_pinned_copy_saves_through_the_usual_copy(tmp_path, pinned_saves, faults):
    state = _state()
    faults(["save.pinned_copies"], MemoryError("no pinned memory"))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state)
    assert tree_equal(out, state, typematch=True)


def test_a_sharded_leaf_saved_through_pinned_memory_round_trips(tmp_path, pinned_saves, faults):
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    state = {"w": jax.device_put(jax.random.normal(jax.random.key(0), (1024, 1024)), sharding)}
    copied: list[int] = []
    faults(["save.pinned_copies"], lambda arrays: copied.extend(x.nbytes for x in arrays))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state)
    assert bool(tree_equal(out, state, typematch=True))
    assert sum(copied) == state["w"].nbytes


@pytest.fixture
def first_async_saves(pinned_saves, monkeypatch):
    """An asynchronous save as on a GPU whose process has pinned nothing yet
    (a CPU device's free memory is the host's available memory)."""
    monkeypatch.setattr(_memory, "_PINNED_HELD", _memory._HighWater())


def _arrays(n: int = 4) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(1), n)
    return {f"w{i}": jax.random.normal(keys[i], (256, 1024)) for i in range(n)}


def _watched(faults) -> list[tuple[str, int]]:
    """The copies an asynchronous save makes, in order: (on the device or into pinned memory, arrays)."""
    seen: list[tuple[str, int]] = []
    faults(["save.device_copies"], lambda arrays: seen.append(("device", len(arrays))))
    faults(["save.pinned_copies"], lambda arrays: seen.append(("pinned", len(arrays))))
    return seen


def test_a_first_asynchronous_save_copies_on_the_device_then_into_pinned_memory(tmp_path, first_async_saves, faults):
    """The caller waits for copies on the device alone (no pinned allocation);
    the save's thread moves them into pinned memory; the caller's arrays,
    deleted as soon as the call returns, are not needed; a later save of as
    many bytes copies straight into pinned memory, already allocated."""
    seen = _watched(faults)
    state = _arrays()
    expected = jax.tree.map(np.asarray, state)
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "first", state, blocking=False)
    assert seen[0] == ("device", len(state))
    for x in state.values():
        x.delete()
    pending.wait()
    assert seen == [("device", len(state)), ("pinned", len(state))]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "first", expected), expected, typematch=True)
    seen.clear()
    again = _arrays()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "again", again, blocking=False).wait()
    assert seen == [("pinned", len(again))]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "again", again), again, typematch=True)


def test_copies_on_the_device_only_where_they_fit_its_free_memory(tmp_path, first_async_saves, faults, monkeypatch):
    seen = _watched(faults)
    state = _arrays()
    nbytes = sum(x.nbytes for x in state.values())
    free = _memory.free_bytes(jax.devices()[0])
    assert free > nbytes / _memory.DEVICE_HOLD_FRACTION  # (the default fits: the test above)
    monkeypatch.setattr(_memory, "DEVICE_HOLD_FRACTION", nbytes / free / 2)  # half of what would fit
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state, blocking=False).wait()
    assert seen == [("pinned", len(state))]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state), state, typematch=True)


@pytest.mark.parametrize("point", ["save.device_copies", "save.pinned_copies"])
def test_a_failed_copy_on_the_device_or_into_pinned_memory_still_saves_what_was_passed(
    tmp_path, first_async_saves, faults, point
):
    """A copy on the device that fails falls back to pinned copies; pinned
    copies that fail in the save's thread leave the device's copies to be
    staged as a blocking save's pieces are. Either way the caller's arrays
    may be deleted once the call returns."""
    faults([point], MemoryError("RESOURCE_EXHAUSTED: out of memory"))
    state = _arrays()
    expected = jax.tree.map(np.asarray, state)
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state, blocking=False)
    for x in state.values():
        x.delete()
    pending.wait()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", expected), expected, typematch=True)


def test_copies_on_the_device_are_off_with_a_fraction_of_zero(tmp_path, first_async_saves, faults, monkeypatch):
    monkeypatch.setattr(_memory, "DEVICE_HOLD_FRACTION", 0)
    seen = _watched(faults)
    state = _arrays()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state, blocking=False).wait()
    assert seen == [("pinned", len(state))]
