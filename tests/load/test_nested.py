"""`Checkpoint(path).load()`: the checkpoint as nested dicts and lists, no skeleton."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

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
    assert tree_equal(out, expected, typematch=True)
    assert isinstance(out["model"]["layers"], list) and isinstance(out["opt"][0], np.ndarray)
    assert out["model"]["layers"][0]["weight"].devices() == {jax.devices()[0]}


def test_sub_tree_leaf_and_lazy(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    layer = tree["model"].layers[1]
    assert tree_equal(ckpt.load("model.layers.1"), {"weight": layer.weight, "bias": layer.bias}, typematch=True)
    assert tree_equal(ckpt.load("model.layers.1.bias"), layer.bias, typematch=True)
    assert ckpt.load("opt.1.count") == np.int64(5)

    lazy = ckpt.load("model", lazy=True)
    weight = lazy["layers"][0]["weight"]
    assert isinstance(weight, eqx_ckpt.LazyArray) and weight.shape == (4, 3)
    np.testing.assert_array_equal(weight[1:3], np.asarray(tree["model"].layers[0].weight)[1:3])
    assert ckpt.load(lazy=True)["step"] == 7  # scalars are values, lazy or not
    assert tree_equal(eqx_ckpt.materialise(lazy), ckpt.load("model"), typematch=True)

    seen = []
    ckpt.load("model", progress=lambda *counts: seen.append(counts))
    model_bytes = sum(ckpt.record(k).nbytes for k in ckpt if k.startswith("model."))
    assert seen[-1] == (6, 6, model_bytes, model_bytes)


def test_gaps_in_a_sequence_are_none(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, [jnp.ones(2), jax.nn.relu, np.arange(3)])
    out = eqx_ckpt.Checkpoint(tmp_path).load()
    assert tree_equal(out, [jnp.ones(2), None, np.arange(3)], typematch=True)


def test_root_leaf_and_empty_checkpoint(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "leaf", jnp.arange(3))
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "leaf").load(), jnp.arange(3), typematch=True)
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


def _layers():
    return {
        "model": {
            "layers": [{"weight": jnp.full((2, 3), float(i))} for i in range(3)],
            "embed": jnp.arange(4.0),
        }
    }


def _source(kind, tmp_path, tree):
    """`tree` written in the format `kind`, as the path to open."""
    if kind == "eqx_ckpt":
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
        return tmp_path / "ckpt"
    if kind == "safetensors":
        eqx_ckpt.export_safetensors(tmp_path / "model.safetensors", tree)
        return tmp_path / "model.safetensors"
    if kind == "hf":
        eqx_ckpt.export_safetensors(tmp_path / "hf", tree, max_shard_size=4, card=False)
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
        # A Hugging Face directory of another library's: no eqx_ckpt.json (the published layout) beside the shards.
        (tmp_path / "hf" / "eqx_ckpt.json").unlink()
        return tmp_path / "hf"
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", tree)
    return tmp_path / "orbax"


SOURCES = ["eqx_ckpt", "safetensors", "hf", "orbax"]


@pytest.mark.parametrize("kind", SOURCES)
def test_numbered_layers_are_lists_for_every_source_in_load_and_tree(tmp_path, kind):
    """`Checkpoint(hf_dir).load()["model"]["layers"]` was a dict keyed "0", "1"
    (safetensors names do not say what is a list), and `tree()` keyed numbered
    layers "0" for every source, while `load()` of eqx_ckpt gave lists."""
    tree = _layers()
    ckpt = eqx_ckpt.Checkpoint(_source(kind, tmp_path, tree))
    assert tree_equal(ckpt.load(), tree, typematch=True)
    assert tree_equal(ckpt.load("model.layers"), tree["model"]["layers"], typematch=True)
    assert tree_equal(eqx_ckpt.materialise(ckpt.load(lazy=True)), tree, typematch=True)
    assert ckpt.tree() == {
        "model": {"embed": "float32[4]", "layers": [{"weight": "float32[2,3]"}] * 3},
    }


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_names_that_are_not_a_run_of_numbers_stay_dict_keys(tmp_path, kind):
    tree = {"gap": {"0": jnp.ones(1), "2": jnp.ones(1)}, "mixed": {"0": jnp.ones(1), "x": jnp.ones(1)}}
    tree["padded"] = {"00": jnp.ones(1), "1": jnp.ones(1)}
    ckpt = eqx_ckpt.Checkpoint(_source(kind, tmp_path, tree))
    assert tree_equal(ckpt.load(), tree, typematch=True)
    assert ckpt.tree()["gap"] == {"0": "float32[1]", "2": "float32[1]"}


def test_an_eqx_ckpt_dict_keyed_by_numbers_stays_a_dict(tmp_path):
    """eqx_ckpt records which keys index a sequence: a dict keyed "0", "1" is one."""
    tree = {"d": {"0": jnp.ones(1), "1": jnp.zeros(1)}}
    ckpt = eqx_ckpt.Checkpoint(_source("eqx_ckpt", tmp_path, tree))
    assert tree_equal(ckpt.load(), tree, typematch=True)
    assert ckpt.tree() == {"d": {"0": "float32[1]", "1": "float32[1]"}}


_SAVE_X64 = """
import sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import eqx_ckpt
eqx_ckpt.tree_serialise_leaves(sys.argv[1], {"w": jnp.arange(3, dtype=jnp.float32), "n": jnp.array([2**40 + 5])})
"""


@pytest.mark.skipif(jax.config.read("jax_enable_x64"), reason="about a process without JAX's 64-bit mode")
@pytest.mark.parametrize("kind", ["eqx_ckpt", "safetensors", "hf"])
def test_one_load_without_a_skeleton_gives_one_kind_of_array(tmp_path, kind):
    """A load without a skeleton mixed JAX arrays (float32) with NumPy arrays
    (the 64-bit leaves JAX would wrap without x64). Now, when any leaf saved
    from JAX cannot be a JAX array exactly, every such leaf of that load is
    NumPy; a load of leaves that all can be gives JAX arrays."""
    if kind == "eqx_ckpt":
        import subprocess
        import sys

        path = tmp_path / "ckpt"
        subprocess.run([sys.executable, "-c", _SAVE_X64, str(path)], check=True, timeout=120)
    else:
        path = _source(kind, tmp_path, {"w": np.arange(3, dtype=np.float32), "n": np.array([2**40 + 5])})
    ckpt = eqx_ckpt.Checkpoint(path)
    expected = {"n": np.array([2**40 + 5]), "w": np.arange(3, dtype=np.float32)}
    for out in (ckpt.load(), eqx_ckpt.materialise(ckpt.load(lazy=True))):
        assert tree_equal(out, expected, typematch=True)
        assert {type(leaf) for leaf in out.values()} == {np.ndarray}
    assert tree_equal(ckpt.load("w"), jnp.arange(3, dtype=jnp.float32), typematch=True)
