"""`convert_eqx_file`: Equinox `.eqx` files become path-keyed checkpoints."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ckpt


def _tree(seed=0):
    key1, key2 = jax.random.split(jax.random.key(seed))
    return {
        "model": eqx.nn.MLP(3, 2, 8, 2, key=key1),
        "embed": jax.random.normal(key2, (4, 2), jnp.bfloat16),
        "mask": np.arange(5) % 2 == 0,
        "count": np.int16(seed),
        "step": 100 + seed,
        "lr": 1e-3 * (seed + 1),
        "flag": True,
        "name": "not an array: kept from like",
    }


def test_convert_round_trip(tmp_path):
    tree = _tree(1)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", tree)
    out = eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", _tree(0))
    assert eqx.tree_equal(out, tree, typematch=True)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", _tree(0))
    assert eqx.tree_equal(loaded, tree, typematch=True)
    # Keyed by path now: a part can be loaded by itself.
    keys = set(eqx_ckpt.Checkpoint(tmp_path / "ckpt"))
    assert {"model.layers.0.weight", "embed", "mask", "count", "step", "lr", "flag"} <= keys
    model = eqx_ckpt.tree_deserialise_leaves(
        tmp_path / "ckpt", eqx.filter_eval_shape(lambda: _tree(0)["model"]), prefix="model"
    )
    assert eqx.tree_equal(model, tree["model"], typematch=True)


def test_convert_with_abstract_like(tmp_path):
    tree = _tree(2)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", tree["model"])
    like = eqx.filter_eval_shape(lambda: _tree(0)["model"])
    eqx_ckpt.convert_eqx_file(str(tmp_path / "model.eqx"), str(tmp_path / "ckpt"), like)
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like), tree["model"], typematch=True)


def test_convert_stateful_model(tmp_path):
    make = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", momentum=0.5, mode="ema")
    model, state = make()
    x = jnp.arange(12.0).reshape(4, 3)
    _, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    eqx.tree_serialise_leaves(tmp_path / "bn.eqx", (model, state))
    eqx_ckpt.convert_eqx_file(tmp_path / "bn.eqx", tmp_path / "ckpt", make())
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", make())
    assert eqx.tree_equal(loaded, (model, state), typematch=True)


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "a.eqx", {"w": jnp.ones(3)})
    eqx.tree_serialise_leaves(tmp_path / "b.eqx", {"w": jnp.full(3, 2.0)})
    eqx_ckpt.convert_eqx_file(tmp_path / "a.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("`overwrite=False`")):
        eqx_ckpt.convert_eqx_file(tmp_path / "b.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"w": jnp.zeros(3)}), {"w": jnp.ones(3)})
    eqx_ckpt.convert_eqx_file(tmp_path / "b.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)}, overwrite=True)
    assert eqx.tree_equal(
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"w": jnp.zeros(3)}), {"w": jnp.full(3, 2.0)}
    )


def test_missing_file(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape("There is no Equinox file at")):
        eqx_ckpt.convert_eqx_file(tmp_path / "nope.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    assert not (tmp_path / "ckpt").exists()


def test_wrong_like_is_explained_and_writes_nothing(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", {"w": jnp.ones(3)})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`like` must be exactly the tree it was saved from")):
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", {"w": jnp.zeros(4)})
    assert not (tmp_path / "ckpt").exists()
