"""A blocking save that copies its pieces to the host through pinned memory
(`_memory.PINNED_SAVE_COPIES`, issue 60), switched on here for JAX's CPU
devices, which have the `pinned_host` memory kind a GPU has. On by default for
GPUs alone (`_memory.PINNED_PLATFORMS`); `tests/test_gpu.py` runs it there."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_ckpt
from eqx_ckpt._store import _memory

# The pinned paths as JAX's CPU devices take them; on an accelerator the state
# would be placed on it, and tests/test_gpu.py runs these paths there.
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
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state), state, typematch=True)


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
    assert eqx.tree_equal(out, state, typematch=True)
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
    assert eqx.tree_equal(out, state, typematch=True)


def test_a_sharded_leaf_saved_through_pinned_memory_round_trips(tmp_path, pinned_saves, faults):
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    state = {"w": jax.device_put(jax.random.normal(jax.random.key(0), (1024, 1024)), sharding)}
    copied: list[int] = []
    faults(["save.pinned_copies"], lambda arrays: copied.extend(x.nbytes for x in arrays))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", state)
    assert bool(eqx.tree_equal(out, state, typematch=True))
    assert sum(copied) == state["w"].nbytes
