"""`convert_eqx_file`: Equinox `.eqx` files become path-keyed checkpoints."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

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
    assert tree_equal(out, tree, typematch=True)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", _tree(0))
    assert tree_equal(loaded, tree, typematch=True)
    # Keyed by path now: a part can be loaded by itself.
    keys = set(eqx_ckpt.Checkpoint(tmp_path / "ckpt"))
    assert {"model.layers.0.weight", "embed", "mask", "count", "step", "lr", "flag"} <= keys
    model = eqx_ckpt.tree_deserialise_leaves(
        tmp_path / "ckpt", eqx.filter_eval_shape(lambda: _tree(0)["model"]), prefix="model"
    )
    assert tree_equal(model, tree["model"], typematch=True)


def test_convert_with_abstract_like(tmp_path):
    tree = _tree(2)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", tree["model"])
    like = eqx.filter_eval_shape(lambda: _tree(0)["model"])
    eqx_ckpt.convert_eqx_file(str(tmp_path / "model.eqx"), str(tmp_path / "ckpt"), like)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like), tree["model"], typematch=True)


def test_convert_stateful_model(tmp_path):
    make = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", momentum=0.5, mode="ema")
    model, state = make()
    x = jnp.arange(12.0).reshape(4, 3)
    _, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    eqx.tree_serialise_leaves(tmp_path / "bn.eqx", (model, state))
    eqx_ckpt.convert_eqx_file(tmp_path / "bn.eqx", tmp_path / "ckpt", make())
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", make())
    assert tree_equal(loaded, (model, state), typematch=True)


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "a.eqx", {"w": jnp.ones(3)})
    eqx.tree_serialise_leaves(tmp_path / "b.eqx", {"w": jnp.full(3, 2.0)})
    eqx_ckpt.convert_eqx_file(tmp_path / "a.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("`overwrite=False`")):
        eqx_ckpt.convert_eqx_file(tmp_path / "b.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"w": jnp.zeros(3)}), {"w": jnp.ones(3)})
    eqx_ckpt.convert_eqx_file(tmp_path / "b.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)}, overwrite=True)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"w": jnp.zeros(3)}), {"w": jnp.full(3, 2.0)})


def test_missing_file(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape("There is no Equinox file at")):
        eqx_ckpt.convert_eqx_file(tmp_path / "nope.eqx", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    assert not (tmp_path / "ckpt").exists()


def test_wrong_like_is_explained_and_writes_nothing(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", {"w": jnp.ones(3)})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`like` must be exactly the tree it was saved from")):
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", {"w": jnp.zeros(4)})
    assert not (tmp_path / "ckpt").exists()


def test_64_bit_values_are_kept_or_refused_without_x64(tmp_path):
    value, fine = 2**40 + 7, 1 + 2**-40
    with jax.enable_x64(True):
        eqx.tree_serialise_leaves(
            tmp_path / "x64.eqx", {"step": jnp.array([value], jnp.int64), "w": jnp.array([fine], jnp.float64)}
        )
    assert not jax.config.read("jax_enable_x64")
    # A JAX array would hold them as int32/float32: a clear error, never 7 or 1.0.
    like = {"step": jnp.zeros(1, jnp.int32), "w": jnp.zeros(1, jnp.float32)}  # the `like` made without x64
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `step` (key path ['step'])")) as info:
        eqx_ckpt.convert_eqx_file(tmp_path / "x64.eqx", tmp_path / "ckpt", like)
    assert "it holds int64 values, and JAX's 64-bit mode is off" in str(info.value)
    assert not (tmp_path / "ckpt").exists()
    # NumPy holds them in any process, and so does the checkpoint.
    numpy_like = {"step": np.zeros(1, np.int64), "w": np.zeros(1, np.float64)}
    expected = {"step": np.array([value], np.int64), "w": np.array([fine], np.float64)}
    out = eqx_ckpt.convert_eqx_file(tmp_path / "x64.eqx", tmp_path / "ckpt", numpy_like)
    assert tree_equal(out, expected, typematch=True)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", numpy_like), expected, typematch=True)


@pytest.mark.parametrize(
    "saved, like, why",
    [
        (2.5, 0, "the file holds float64 data of shape () but `like` holds a Python int"),
        (7, False, "the file holds int64 data of shape () but `like` holds a Python bool"),
        (2**60 + 1, 0.0, "`like` holds a Python float, which cannot hold it exactly"),
    ],
)
def test_python_scalars_are_never_coerced(tmp_path, saved, like, why):
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", {"a": 1, "b": saved})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `b` (key path ['b'])")) as info:
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", {"a": 0, "b": like})
    assert why in str(info.value)
    assert not (tmp_path / "ckpt").exists()


def test_like_must_cover_the_whole_file(tmp_path):
    params, opt_state = {"w": jnp.arange(3.0)}, {"mu": jnp.ones(3), "nu": jnp.ones(3)}
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", (params, opt_state))
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("the file holds more than `like` describes")):
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", ({"w": jnp.zeros(3)},))
    assert not (tmp_path / "ckpt").exists()
    longer = ({"w": jnp.zeros(3)}, {"mu": jnp.zeros(3), "nu": jnp.zeros(3), "z": jnp.zeros(3)})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `1.z` (key path [1]['z'])")) as info:
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", longer)
    assert "the file ends before this leaf" in str(info.value)


def test_the_file_named_is_read_even_without_a_suffix(tmp_path):
    with open(tmp_path / "weights", "wb") as f:
        eqx.tree_serialise_leaves(f, {"w": jnp.full(3, 1.0)})
    eqx.tree_serialise_leaves(tmp_path / "weights.eqx", {"w": jnp.full(3, 2.0)})  # another file beside it
    out = eqx_ckpt.convert_eqx_file(tmp_path / "weights", tmp_path / "ckpt", {"w": jnp.zeros(3)})
    assert tree_equal(out, {"w": jnp.full(3, 1.0)}, typematch=True)
    (tmp_path / "weights.eqx").unlink()
    out = eqx_ckpt.convert_eqx_file(tmp_path / "weights", tmp_path / "ckpt", {"w": jnp.zeros(3)}, overwrite=True)
    assert tree_equal(out, {"w": jnp.full(3, 1.0)}, typematch=True)


def test_object_arrays_and_damaged_records_are_refused(tmp_path):
    with open(tmp_path / "pickle.eqx", "wb") as f:
        np.save(f, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("leaf `w` (key path ['w'])")) as info:
        eqx_ckpt.convert_eqx_file(tmp_path / "pickle.eqx", tmp_path / "ckpt", {"w": np.zeros(2)})
    assert "declares object of shape (2,), which is never read" in str(info.value)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", {"w": jnp.ones(1000)})
    data = (tmp_path / "model.eqx").read_bytes()
    (tmp_path / "short.eqx").write_bytes(data[:-8])
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("the file ends inside its float32 data")):
        eqx_ckpt.convert_eqx_file(tmp_path / "short.eqx", tmp_path / "ckpt", {"w": jnp.zeros(1000)})
    (tmp_path / "garbage.eqx").write_bytes(b"not a numpy record" + data)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("its record is not a NumPy array")):
        eqx_ckpt.convert_eqx_file(tmp_path / "garbage.eqx", tmp_path / "ckpt", {"w": jnp.zeros(1000)})
    assert not (tmp_path / "ckpt").exists()


def test_custom_filter_spec(tmp_path):
    skip_jax = lambda f, x: None if isinstance(x, jax.Array) else eqx.default_serialise_filter_spec(f, x)
    tree = {"w": jnp.ones(3), "n": np.arange(3), "lr": 0.5}
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", tree, filter_spec=skip_jax)
    keep_jax = lambda f, x: x if isinstance(x, jax.Array) else eqx.default_deserialise_filter_spec(f, x)
    like = {"w": jnp.zeros(3), "n": np.zeros(3, np.int64), "lr": 0.0}
    out = eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt", like, filter_spec=keep_jax)
    assert tree_equal(out, {"w": jnp.zeros(3), "n": np.arange(3), "lr": 0.5}, typematch=True)
    bad = lambda f, x: eqx.default_deserialise_filter_spec(f, x) if isinstance(x, np.ndarray) else 1
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `lr` (key path ['lr'])")) as info:
        eqx_ckpt.convert_eqx_file(tmp_path / "model.eqx", tmp_path / "ckpt2", like, filter_spec=bad)
    assert "`filter_spec` returned int, where `like` holds float" in str(info.value)
