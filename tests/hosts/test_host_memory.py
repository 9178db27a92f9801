"""Arrays in host memory kinds (`pinned_host`, `unpinned_host`): what an
asynchronous save on an accelerator holds of the caller's arrays
(`_memory.pinned`), and what a user's host-offloaded state is. JAX's CPU
devices have these memory kinds too, so the path after the copy (staged by
a view, written, loaded back) runs here as it does on a GPU
(`tests/hosts/test_gpu.py` runs the copy itself there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._store import _memory


def _state() -> dict[str, jax.Array]:
    key = jax.random.key(0)
    return {
        "big": jax.random.normal(key, (512, 1024)),  # 2 MiB: an array of its own
        "small": jnp.arange(12.0).reshape(3, 4),  # packed
        "ints": jnp.arange(5, dtype=jnp.int32),
    }


def _in(kind: str, tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: jax.device_put(x, x.sharding.with_memory_kind(kind)) for k, x in tree.items()}


def test_pinned_copies_are_new_arrays_in_pinned_host_memory(faults):
    """`_memory.pinned` copies each array into its device's pinned host
    memory, in one call (fault point `save.pinned_copies`), and the copies
    outlive a deletion of the arrays they were made from."""
    state = _state()
    expected = jax.tree.map(np.asarray, state)
    seen = []
    faults("save.pinned_copies", lambda arrays: seen.append(len(arrays)))
    copies = _memory.pinned([state[k] for k in expected])
    assert copies is not None and seen == [len(state)]
    assert {x.sharding.memory_kind for x in copies} == {"pinned_host"}
    for x in state.values():
        x.delete()
    assert tree_equal(dict(zip(expected, map(np.asarray, copies))), expected, typematch=True)


def test_a_failed_pinned_copy_is_none_for_the_caller_to_copy_otherwise(faults):
    faults("save.pinned_copies", MemoryError("RESOURCE_EXHAUSTED: out of pinned memory"))
    assert _memory.pinned(list(_state().values())) is None


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_state_in_host_memory_round_trips(tmp_path, kind, blocking):
    """Leaves in a host memory kind are staged by their views, written, and
    loaded back into the memory kind of `like`, bit for bit; an asynchronous
    save's leaves can be deleted once the call returns."""
    state = _in(kind, _state())
    expected = jax.tree.map(np.asarray, state)
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path, state, blocking=blocking)
    if pending is not None:
        for x in state.values():
            x.delete()
        pending.wait()
    like = _in(kind, jax.tree.map(jnp.zeros_like, _state()))
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert {x.sharding.memory_kind for x in out.values()} == {kind}
    assert tree_equal(jax.tree.map(np.asarray, out), expected, typematch=True)


def test_pinned_copies_saved_asynchronously_are_what_the_caller_passed(tmp_path):
    """What an asynchronous save on an accelerator does with its caller's
    arrays, step by step on a CPU: pinned copies made, the arrays then
    changed by a donating step, the copies saved: the values written are the
    arrays' before the step."""
    state = _state()
    expected = jax.tree.map(np.asarray, state)
    copies = dict(zip(state, _memory.pinned(list(state.values())), strict=True))
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 7, t), donate_argnums=0)
    jax.block_until_ready(step(state))
    eqx_ckpt.tree_serialise_leaves(tmp_path, copies, blocking=False).wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, expected)
    assert tree_equal(out, expected, typematch=True)


def test_hosts_gives_what_host_gives_piece_by_piece():
    """`_memory.hosts` (a write's pieces at once) makes the host data `host`
    makes of each piece: views of CPU arrays and NumPy pieces, the value of a
    deferred one, with or without a deferred piece among them."""
    array = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    plain = np.arange(4, dtype=np.int32)
    deferred = _memory.Deferred(lambda: np.full(3, 7, np.int16), 6)
    for datas in ([array, plain], [array, plain, deferred]):
        got, want = _memory.hosts(datas), [_memory.host(data) for data in datas]
        assert [type(x) for x in got] == [np.ndarray] * len(datas)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    # A CPU array's host data is a view of its buffer, not a copy.
    assert np.shares_memory(_memory.hosts([array])[0], _memory.host(array))
