"""`tree_deserialise_leaves`: round trips of every leaf kind, and its errors."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ckpt


def _round_trip(path, tree, like=None):
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return eqx_ckpt.tree_deserialise_leaves(path, tree if like is None else like)


def _mlp(seed=0):
    return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(seed))


def test_python_scalars_come_back_exact_and_as_their_type(tmp_path):
    tree = {"tenth": 0.1, "third": 1 / 3, "big": 2**62 + 1, "neg": -7, "t": True, "f": False, "c": 0.1 + 1 / 3 * 1j}
    like = {"tenth": 0.0, "third": 0.0, "big": 0, "neg": 0, "t": False, "f": True, "c": 0j}
    loaded = _round_trip(tmp_path, tree, like)
    assert eqx.tree_equal(loaded, tree, typematch=True)
    assert loaded["tenth"] == 0.1 and type(loaded["tenth"]) is float
    assert loaded["third"].hex() == (1 / 3).hex()
    assert type(loaded["big"]) is int and loaded["big"] == 2**62 + 1
    assert loaded["t"] is True and loaded["f"] is False
    assert type(loaded["c"]) is complex and loaded["c"] == 0.1 + 1 / 3 * 1j


def test_python_floats_are_stored_as_float64(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": 0.1})
    assert eqx_ckpt.Checkpoint(tmp_path).record("x").dtype == "float64"


def test_numpy_stays_numpy_and_jax_stays_jax(tmp_path):
    tree = {
        "np64": np.linspace(0, 1, 7),
        "np_i64": np.arange(-3, 3, dtype=np.int64),
        "np_c128": np.array([1 + 1e-300j, 2]),
        "jax": jnp.arange(5.0),
        "zero_d_jax": jnp.array(3, jnp.int8),
        "zero_d_np": np.array(2.5),
        "np_scalar": np.float32(1.25),
        "np_int_scalar": np.int64(-2),
    }
    loaded = _round_trip(tmp_path, tree)
    assert eqx.tree_equal(loaded, tree, typematch=True)
    assert type(loaded["np64"]) is np.ndarray and loaded["np64"].dtype == np.float64
    assert type(loaded["zero_d_np"]) is np.ndarray and loaded["zero_d_np"].shape == ()
    assert isinstance(loaded["jax"], jax.Array)
    assert isinstance(loaded["zero_d_jax"], jax.Array) and loaded["zero_d_jax"].shape == ()
    assert type(loaded["np_scalar"]) is np.float32
    assert type(loaded["np_int_scalar"]) is np.int64


def test_prng_keys_round_trip(tmp_path):
    tree = {
        "key": jax.random.key(0),
        "keys": jax.random.split(jax.random.key(1), (2, 3)),
        "rbg": jax.random.key(5, impl="rbg"),
    }
    loaded = _round_trip(tmp_path, tree)
    assert eqx.tree_equal(loaded, tree, typematch=True)
    assert jax.random.key_impl(loaded["rbg"]) == jax.random.key_impl(tree["rbg"])
    assert loaded["keys"].shape == (2, 3)
    assert jax.random.normal(loaded["key"]) == jax.random.normal(tree["key"])
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, abstract), tree, typematch=True)


def test_key_like_with_plain_stored_array_is_a_type_error(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"k": jnp.zeros(2, jnp.uint32)})
    with pytest.raises(eqx_ckpt.LeafError, match="PRNG key"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"k": jax.random.key(0)})


def test_mixed_tree_keeps_likes_functions_and_objects(tmp_path):
    saved_fn, like_fn = (lambda x: x + 1), (lambda x: x + 2)
    saved_obj, like_obj = object(), object()
    tree = {"arr": jnp.arange(3), "np": np.ones(2), "fn": saved_fn, "obj": saved_obj, "none": None, "s": "text"}
    like = {
        "arr": jnp.zeros(3, jnp.int32),
        "np": np.zeros(2),
        "fn": like_fn,
        "obj": like_obj,
        "none": None,
        "s": "other",
    }
    loaded = _round_trip(tmp_path, tree, like)
    assert loaded["fn"] is like_fn
    assert loaded["obj"] is like_obj
    assert loaded["s"] == "other"
    assert eqx.tree_equal(loaded["arr"], tree["arr"], typematch=True)
    assert eqx.tree_equal(loaded["np"], tree["np"], typematch=True)


def test_model_into_filter_eval_shape_skeleton(tmp_path):
    model = _mlp(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    like = eqx.filter_eval_shape(_mlp, 1)
    assert isinstance(like.layers[0].weight, jax.ShapeDtypeStruct)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert eqx.tree_equal(loaded, model, typematch=True)
    x = jnp.ones(3)
    assert jnp.array_equal(loaded(x), model(x))


def test_stateful_batchnorm_model_round_trips(tmp_path):
    make = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")
    model, state = make()
    x = jnp.arange(8.0).reshape(2, 4)
    _, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    eqx_ckpt.tree_serialise_leaves(tmp_path, (model, state))
    fresh_model, fresh_state = make()
    assert not eqx.tree_equal(fresh_state, state)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, (fresh_model, fresh_state))
    assert eqx.tree_equal(loaded, (model, state), typematch=True)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(repr(str(tmp_path / "nope")))) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "nope", {"a": jnp.zeros(1)})
    assert isinstance(info.value, FileNotFoundError)
    # An empty directory is no checkpoint either.
    with pytest.raises(FileNotFoundError):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.zeros(1)})


def test_one_error_lists_every_problem(tmp_path):
    saved = {"model": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.int32), "ok": jnp.zeros(1)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {
        "model": {
            "w": jnp.zeros((3, 2)),
            "b": jnp.zeros(3, jnp.float32),
            "ok": jnp.zeros(1),
            "new": [jnp.zeros(4)],
        }
    }
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    error = info.value
    message = str(error)
    assert isinstance(error, RuntimeError)
    assert "3 leaves do not match" in message
    assert set(error.dotted) == {"model.w", "model.b", "model.new.0"}
    # Shape: dotted, keystr, the key-path tuple, and Equinox's phrase.
    w_path = (jax.tree_util.DictKey("model"), jax.tree_util.DictKey("w"))
    assert "`model.w`" in message
    assert jax.tree_util.keystr(w_path) in message
    assert repr(w_path) in message
    assert "has changed shape from (3, 2) in `like` to (2, 3) on disk" in message
    # Dtype.
    assert "`model.b`" in message and "['model']['b']" in message
    assert "has changed dtype from float32 in `like` to int32 on disk" in message
    # Missing, inside a list.
    new_path = (jax.tree_util.DictKey("model"), jax.tree_util.DictKey("new"), jax.tree_util.SequenceKey(0))
    assert "`model.new.0`" in message and "['model']['new'][0]" in message and repr(new_path) in message
    assert "missing" in message
    assert "ok" not in error.dotted
    assert str(tmp_path) in message


def test_leaf_type_change_is_reported(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"n": jnp.array([1.5, 2.5])})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`like` holds a Python int")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"n": 0})


def test_python_scalar_loads_from_a_narrower_stored_kind(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"n": 3, "b": True})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"n": 0.0, "b": 0})
    assert loaded == {"n": 3.0, "b": 1}
    assert type(loaded["n"]) is float and type(loaded["b"]) is int


def test_dtype_change_needs_cast(tmp_path):
    saved = {"x": jnp.array([1.5, -2.0, 3.25], jnp.float32)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"x": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("pass `cast=True`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, cast=True)
    assert eqx.tree_equal(loaded, {"x": saved["x"].astype(jnp.bfloat16)}, typematch=True)


def test_loaded_array_is_placed_like_likes_leaf(tmp_path):
    device = jax.devices()[2]
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.arange(4)})
    like = {"x": jax.device_put(jnp.zeros(4, jnp.int32), device)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["x"].devices() == {device}


def test_unknown_missing_option(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": 1})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="`missing` must be 'error' or 'keep'"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": 0}, missing="ignore")


def test_custom_deserialise_filter_spec_error_names_the_leaf(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.zeros(2)})

    def spec(handle, x):
        raise ValueError("broken spec")

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("(DictKey(key='x'),)")) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(2)}, spec)
    assert "broken spec" in str(info.value)


def test_custom_spec_read_checks_the_shape(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.zeros(2)})
    spec = lambda handle, x: handle.read(jnp.zeros(5))
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("has changed shape from (5,) in `like` to (2,) on disk")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(2)}, spec)


def test_deserialise_filter_spec_prefix_tree(tmp_path):
    saved = {"a": jnp.ones(2), "b": {"c": jnp.full(3, 2.0), "d": 4}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"a": jnp.zeros(2), "b": {"c": jnp.zeros(3), "d": 0}}
    keep = lambda handle, x: x
    spec = {"a": keep, "b": eqx_ckpt.default_deserialise_filter_spec}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, spec)
    assert loaded["a"] is like["a"]
    assert eqx.tree_equal(loaded["b"], saved["b"], typematch=True)


def test_manifest_edit_is_detected_on_load(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.zeros(2)})
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"float32"', '"float16"'))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="digest does not match"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(2)})


def test_damaged_chunk_is_an_integrity_error_naming_the_leaf(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"w": jnp.arange(16.0)}})
    chunk = next(p for p in (tmp_path / "model" / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`model.w`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"model": {"w": jnp.zeros(16)}})


def test_custom_spec_result_is_checked_against_like(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(3)})
    like = {"w": jnp.zeros(3)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("has changed type from <class")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, lambda h, x: [1.0, 2.0, 3.0])
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("has changed shape from (3,) in `like` to (2,) on disk")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, lambda h, x: jnp.zeros(2))
    # An abstract `like` accepts the JAX array the spec reads.
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, eqx.filter_eval_shape(lambda: like), lambda h, x: h.read(x))
    assert eqx.tree_equal(out, {"w": jnp.ones(3)}, typematch=True)
