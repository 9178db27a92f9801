"""What Equinox's serialisation promises, checked against eqx_ckpt with a directory."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt


def test_mixed_tree_round_trip(tmp_path):
    def saved_fn(x):
        return x

    def like_fn(x):
        return -x

    class Thing:
        pass

    saved_obj, like_obj = Thing(), Thing()
    tree = (
        jnp.array([1.0, 2.0]),
        np.array([3, 4], dtype=np.int32),
        True,
        1,
        1.0,
        1 + 1j,
        saved_fn,
        saved_obj,
        jnp.array(5, jnp.int8),
        np.float64(0.5),
    )
    like = (
        jnp.array([0.0, 0.0]),
        np.array([0, 0], dtype=np.int32),
        False,
        0,
        0.0,
        0j,
        like_fn,
        like_obj,
        jnp.array(0, jnp.int8),
        np.float64(0.0),
    )
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    array, np_array, boolean, integer, floating, cplx, fn, obj, small, np_scalar = loaded
    assert tree_equal(array, tree[0], typematch=True)
    assert type(np_array) is np.ndarray and np.array_equal(np_array, tree[1])
    assert boolean is True
    assert type(integer) is int and integer == 1
    assert type(floating) is float and floating == 1.0
    assert type(cplx) is complex and cplx == 1 + 1j
    assert fn is like_fn
    assert obj is like_obj
    assert tree_equal(small, tree[8], typematch=True)
    assert type(np_scalar) is np.float64 and np_scalar == 0.5


def test_generic_dtypes(tmp_path):
    bf16 = ml_dtypes.bfloat16
    tree = (jnp.array(bf16(1)), np.array(bf16(1)), bf16(1), np.float32(1))
    like = (jnp.array(bf16(2)), np.array(bf16(2)), bf16(2), np.float32(2))
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    for got, want in zip(loaded, tree):
        assert type(got) is type(want)
        assert got.dtype == want.dtype
        assert got == want
    assert tree_equal(loaded, tree, typematch=True)


def test_generic_dtypes_after_jit(tmp_path):
    bf16 = ml_dtypes.bfloat16
    # Under `jax.jit` every leaf comes back as a 0-d JAX array.
    tree = jax.jit(lambda x: x)((jnp.array(bf16(1)), np.array(bf16(1)), bf16(1), np.float32(1)))
    assert all(isinstance(x, jax.Array) for x in tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    like = (bf16(2), bf16(2), bf16(2), np.float32(2))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    for got, want in zip(loaded, like):
        assert type(got) is type(want)
        assert got == type(want)(1)


def test_custom_filter_specs(tmp_path):
    def save_spec(handle, x):
        if not isinstance(x, jax.Array):
            eqx_ckpt.default_serialise_filter_spec(handle, x)

    replacement = lambda x: x * 3

    def load_spec(handle, x):
        if isinstance(x, jax.Array):
            return x
        if callable(x):
            return replacement
        return eqx_ckpt.default_deserialise_filter_spec(handle, x)

    tree = {"j": jnp.array([1.0, 2.0]), "n": np.array([3.0, 4.0]), "s": 5, "f": lambda x: x + 1}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, save_spec)
    assert sorted(eqx_ckpt.Checkpoint(tmp_path)) == ["n", "s"]
    like = {"j": jnp.zeros(2), "n": np.zeros(2), "s": 0, "f": lambda x: x - 1}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, load_spec)
    assert loaded["j"] is like["j"]
    assert np.array_equal(loaded["n"], tree["n"]) and type(loaded["n"]) is np.ndarray
    assert loaded["s"] == 5
    assert loaded["f"] is replacement
    # The default spec would have looked for the JAX array and not found it.
    with pytest.raises(eqx_ckpt.LeafError, match="missing"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)


class _TwoNorms(eqx.Module):
    linear: eqx.nn.Linear
    norm1: eqx.nn.BatchNorm
    norm2: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.norm1 = eqx.nn.BatchNorm(3, "batch", mode="ema")
        self.norm2 = eqx.nn.BatchNorm(3, "batch", mode="ema")

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.norm2(self.linear(x), state)
        return x, state


@eqx.filter_jit
def _run(model, state, batch):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(batch, state)


def test_stateful_model_round_trip(tmp_path):
    model = _TwoNorms(jax.random.key(0))
    state = eqx.nn.State(model)
    batch = jnp.arange(12.0).reshape(4, 3)
    _, state = _run(model, state, batch)
    eqx_ckpt.tree_serialise_leaves(tmp_path, (model, state))

    model2 = _TwoNorms(jax.random.key(1))
    state2 = eqx.nn.State(model2)
    assert not tree_equal(state2, state)
    loaded_model, loaded_state = eqx_ckpt.tree_deserialise_leaves(tmp_path, (model2, state2))
    # Each BatchNorm's state index holds a fresh marker (a static field), so the
    # tree structures differ; the leaves must be the saved ones.
    leaves = jax.tree_util.tree_leaves

    # Bit for bit: BatchNorm's initial buffers are `jnp.empty`, on a GPU whatever
    # the memory held, NaNs included, which `==` (and `eqx.tree_equal`) never equals.
    def bits(tree):
        return [
            (type(x), x.dtype, x.shape, np.asarray(x).tobytes()) if isinstance(x, jax.Array) else x
            for x in leaves(tree)
        ]

    assert bits(loaded_model) == bits(model)
    assert tree_equal(leaves(loaded_state), leaves(state), typematch=True)
    for norm in ("norm1", "norm2"):
        got = loaded_state.get(getattr(loaded_model, norm).ema_state_index)
        want = state.get(getattr(model, norm).ema_state_index)
        assert tree_equal(got, want, typematch=True)
    # The loaded pair works together.
    out, new_state = _run(loaded_model, loaded_state, batch)
    expected, expected_state = _run(model, state, batch)
    assert jnp.array_equal(out, expected)
    assert tree_equal(leaves(new_state), leaves(expected_state))


def test_shape_mismatch_uses_equinoxs_phrase(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, (jnp.zeros(2),))
    with pytest.raises(RuntimeError, match=r"has changed shape from \(3,\) in `like` to \(2,\) on disk"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, (jnp.zeros(3),))


# Equinox's own messages, literally as its `_serialisation.py` words them; code and
# tests written against Equinox match on these.
_AT_1_A = "Error at leaf with path (SequenceKey(idx=1), DictKey(key='a'))"


def test_missing_leaf_is_named_in_equinoxs_words(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, [jnp.array(1.0), {"b": jnp.array(2.0)}])
    with pytest.raises(RuntimeError, match=re.escape(_AT_1_A)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, [jnp.array(0.0), {"a": jnp.array(0.0), "b": jnp.array(0.0)}])


def test_unloadable_leaf_is_named_in_equinoxs_words(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, [1, {"a": jnp.ones(3)}])
    with pytest.raises(RuntimeError, match=re.escape(_AT_1_A)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, [1, {"a": 2}])


def test_filter_spec_errors_are_named_in_equinoxs_words(tmp_path):
    def broken(handle, x):
        if handle.path == "1.a":
            raise ValueError("no")
        return eqx_ckpt.default_serialise_filter_spec(handle, x)

    tree = [jnp.array(1.0), {"a": jnp.array(2.0)}]
    with pytest.raises(RuntimeError, match=re.escape(_AT_1_A)):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree, broken)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", tree)

    def broken_load(handle, x):
        if handle.path == "1.a":
            raise ValueError("no")
        return eqx_ckpt.default_deserialise_filter_spec(handle, x)

    with pytest.raises(RuntimeError, match=re.escape(_AT_1_A)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "b", tree, broken_load)


def test_changed_shape_dtype_and_type_in_equinoxs_words(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, [jnp.zeros(2), {"a": jnp.zeros(2, jnp.int32)}])
    shape = "Deserialised leaf at path (SequenceKey(idx=0),) has changed shape from (3,) in `like` to (2,) on disk."
    with pytest.raises(RuntimeError, match=re.escape(shape)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, [jnp.zeros(3), {"a": jnp.zeros(2, jnp.int32)}])
    dtype = (
        "Deserialised leaf at path (SequenceKey(idx=1), DictKey(key='a')) has changed dtype from float32 "
        "in `like` to int32 on disk"
    )
    with pytest.raises(RuntimeError, match=re.escape(dtype)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, [jnp.zeros(2), {"a": jnp.zeros(2)}])
    # A filter spec whose result is not of `like`'s type, as Equinox checks it.
    changed = (
        "Deserialised leaf at path '[1]['a']' has changed type from <class 'int'> in `like` to <class 'float'> on disk."
    )
    with pytest.raises(RuntimeError, match=re.escape(changed)):
        spec = [eqx_ckpt.default_deserialise_filter_spec, lambda handle, x: 1.5]
        eqx_ckpt.tree_deserialise_leaves(tmp_path, [jnp.zeros(2), {"a": 0}], spec)


def _named_state(model, state):
    """The safe pattern of docs/values.md: each layer's state keyed by where the
    layer sits in the model, not by its position in `eqx.nn.State`."""
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_index)[0]
    return {jax.tree_util.keystr(path): state.get(index) for path, index in found if is_index(index)}


def _set_named_state(model, state, named):
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
    for path, index in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_index)[0]:
        if is_index(index) and jax.tree_util.keystr(path) in named:
            state = state.set(index, named[jax.tree_util.keystr(path)])
    return state


class _ThreeNorms(eqx.Module):
    extra: eqx.nn.BatchNorm  # a stateful layer inserted before the others
    norm1: eqx.nn.BatchNorm
    norm2: eqx.nn.BatchNorm

    def __init__(self):
        self.extra = eqx.nn.BatchNorm(3, "batch", mode="ema")
        self.norm1 = eqx.nn.BatchNorm(3, "batch", mode="ema")
        self.norm2 = eqx.nn.BatchNorm(3, "batch", mode="ema")


def test_state_is_keyed_by_position_and_the_named_pattern_is_safe(tmp_path):
    model = _TwoNorms(jax.random.key(0))
    state = eqx.nn.State(model)
    _, state = _run(model, state, jnp.arange(12.0).reshape(4, 3))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "positional", state)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "named", _named_state(model, state))

    bigger = _ThreeNorms()
    fresh = eqx.nn.State(bigger)
    want = state.get(model.norm1.ema_state_index)
    # By position, the inserted layer takes norm1's statistics (and norm1 norm2's).
    positional = eqx_ckpt.tree_deserialise_leaves(tmp_path / "positional", fresh, missing="keep")
    assert tree_equal(positional.get(bigger.extra.ema_state_index), want)
    # By name, each layer gets its own; the new one keeps its initial state.
    named = eqx_ckpt.tree_deserialise_leaves(tmp_path / "named", _named_state(bigger, fresh), missing="keep")
    initial = fresh.get(bigger.extra.ema_state_index)
    loaded = _set_named_state(bigger, fresh, named)  # `State.set` consumes `fresh`
    assert tree_equal(loaded.get(bigger.norm1.ema_state_index), want)
    assert tree_equal(loaded.get(bigger.extra.ema_state_index), initial)
