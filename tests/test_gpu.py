"""Saves of a state that lives on an accelerator: each piece copied to the
host as its write nears, within the staging budget, and back onto the device
bit for bit. Skipped where JAX computes on CPUs alone (CI); a machine with a
GPU runs them (docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from test_staging import MIB, Staged

import eqx_ckpt
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
    assert eqx.tree_equal(out, state, typematch=True) and _on_device(out)


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
    assert eqx.tree_equal(out, state, typematch=True) and _on_device(out)


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
    assert eqx.tree_equal(out, expected, typematch=True)


def test_a_failed_copy_to_the_host_fails_the_save_by_name(tmp_path):
    """A piece whose copy cannot be made (its array deleted before the save)
    is an error naming the leaf, and nothing is committed."""
    state = _state(leaves=2)
    state["w1"].delete()
    with pytest.raises(eqx_ckpt.CheckpointError, match="w1"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "c", state)
    assert not (tmp_path / "c" / "manifest.json").exists()
