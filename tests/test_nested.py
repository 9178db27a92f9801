"""`Checkpoint(path).load()`: the checkpoint as nested dicts and lists, no skeleton."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ckpt


def _model():
    return eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))


def _tree():
    return {
        "model": _model(),
        "opt": (np.arange(4, dtype=np.int32), {"count": np.int64(5)}),
        "key": jax.random.key(3),
        "lr": 0.5,
        "step": 7,
        "a.b": {"": jnp.ones(2, jnp.bfloat16), "x y": np.zeros((0, 2))},
        "ints": {1: jnp.arange(2), 30: jnp.arange(3)},
    }


def test_whole_checkpoint_as_nested_dicts_and_lists(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    out = eqx_ckpt.Checkpoint(tmp_path).load()
    model = tree["model"]
    # Attributes and dict keys become dict keys, sequence indices list positions;
    # the activation functions (not saved) leave no trace, and the types are as saved.
    expected = {
        "model": {"layers": [{"weight": layer.weight, "bias": layer.bias} for layer in model.layers]},
        "opt": [tree["opt"][0], {"count": np.int64(5)}],
        "key": tree["key"],
        "lr": 0.5,
        "step": 7,
        "a.b": tree["a.b"],
        "ints": tree["ints"],  # int dict keys stay dict keys, not list positions
    }
    assert eqx.tree_equal(out, expected, typematch=True)
    assert isinstance(out["model"]["layers"], list) and isinstance(out["opt"][0], np.ndarray)
    assert out["model"]["layers"][0]["weight"].devices() == {jax.devices()[0]}


def test_sub_tree_leaf_and_lazy(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    layer = tree["model"].layers[1]
    assert eqx.tree_equal(ckpt.load("model.layers.1"), {"weight": layer.weight, "bias": layer.bias}, typematch=True)
    assert eqx.tree_equal(ckpt.load("model.layers.1.bias"), layer.bias, typematch=True)
    assert ckpt.load("opt.1.count") == np.int64(5)

    lazy = ckpt.load("model", lazy=True)
    weight = lazy["layers"][0]["weight"]
    assert isinstance(weight, eqx_ckpt.LazyArray) and weight.shape == (4, 3)
    np.testing.assert_array_equal(weight[1:3], np.asarray(tree["model"].layers[0].weight)[1:3])
    assert ckpt.load(lazy=True)["step"] == 7  # scalars are values, lazy or not
    assert eqx.tree_equal(eqx_ckpt.materialise(lazy), ckpt.load("model"), typematch=True)

    seen = []
    ckpt.load("model", progress=lambda *counts: seen.append(counts))
    model_bytes = sum(ckpt.record(k).nbytes for k in ckpt if k.startswith("model."))
    assert seen[-1] == (6, 6, model_bytes, model_bytes)


def test_gaps_in_a_sequence_are_none(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, [jnp.ones(2), jax.nn.relu, np.arange(3)])
    out = eqx_ckpt.Checkpoint(tmp_path).load()
    assert eqx.tree_equal(out, [jnp.ones(2), None, np.arange(3)], typematch=True)


def test_root_leaf_and_empty_checkpoint(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "leaf", jnp.arange(3))
    assert eqx.tree_equal(eqx_ckpt.Checkpoint(tmp_path / "leaf").load(), jnp.arange(3), typematch=True)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "empty", {"f": jax.nn.relu})
    assert eqx_ckpt.Checkpoint(tmp_path / "empty").load() == {}


def test_64_bit_leaves_keep_their_values(tmp_path):
    big = np.array([2**40, -(2**40)], np.int64)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": big})
    out = eqx_ckpt.Checkpoint(tmp_path).load()["x"]
    # Without x64, JAX would wrap these to 32 bits; NumPy holds them exactly.
    assert out.dtype == np.int64 and out.tolist() == big.tolist()


def test_unknown_key(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    message = f"'model.layer' is not a leaf of checkpoint {str(tmp_path)!r}"
    with pytest.raises(eqx_ckpt.CheckpointKeyError, match=re.escape(message)):
        eqx_ckpt.Checkpoint(tmp_path).load("model.layer")
