"""`tree_deserialise_leaves`: round trips of every leaf kind, and its errors."""

import dataclasses
import inspect
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

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
    assert tree_equal(loaded, tree, typematch=True)
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
    assert tree_equal(loaded, tree, typematch=True)
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
    assert tree_equal(loaded, tree, typematch=True)
    assert jax.random.key_impl(loaded["rbg"]) == jax.random.key_impl(tree["rbg"])
    assert loaded["keys"].shape == (2, 3)
    assert jax.random.normal(loaded["key"]) == jax.random.normal(tree["key"])
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, abstract), tree, typematch=True)


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
    assert tree_equal(loaded["arr"], tree["arr"], typematch=True)
    assert tree_equal(loaded["np"], tree["np"], typematch=True)


def test_model_into_filter_eval_shape_skeleton(tmp_path):
    model = _mlp(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    like = eqx.filter_eval_shape(_mlp, 1)
    assert isinstance(like.layers[0].weight, jax.ShapeDtypeStruct)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert tree_equal(loaded, model, typematch=True)
    x = jnp.ones(3)
    assert jnp.array_equal(loaded(x), model(x))


def test_stateful_batchnorm_model_round_trips(tmp_path):
    make = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")
    model, state = make()
    x = jnp.arange(8.0).reshape(2, 4)
    _, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    eqx_ckpt.tree_serialise_leaves(tmp_path, (model, state))
    fresh_model, fresh_state = make()
    assert not tree_equal(fresh_state, state)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, (fresh_model, fresh_state))
    assert tree_equal(loaded, (model, state), typematch=True)


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
    # Each leaf by its dotted path and keystr; the first also in Equinox's words
    # (its key-path tuple), the others once.
    first = next(line for line in message.splitlines() if line.startswith("  - "))
    assert first.startswith("  - Error at leaf with path (DictKey(key='model'), ")
    w_path = (jax.tree_util.DictKey("model"), jax.tree_util.DictKey("w"))
    assert "`model.w`" in message and jax.tree_util.keystr(w_path) in message
    assert "from (3, 2) in `like` to (2, 3) on disk" in message
    # Dtype.
    assert "`model.b`" in message and "['model']['b']" in message
    assert "from float32 in `like` to int32 on disk" in message
    # Missing, inside a list.
    assert "`model.new.0`" in message and "['model']['new'][0]" in message
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
    assert tree_equal(loaded, {"x": saved["x"].astype(jnp.bfloat16)}, typematch=True)


def test_loaded_array_is_placed_like_likes_leaf(tmp_path):
    device = jax.devices("cpu")[2]
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
    assert tree_equal(loaded["b"], saved["b"], typematch=True)


def test_manifest_edit_is_detected_on_load(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.zeros(2)})
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"float32"', '"float16"'))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="digest does not match"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(2)})


def test_damaged_chunk_is_an_integrity_error_naming_the_leaf(tmp_path, packing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"w": jnp.arange(16.0)}})
    folder = tmp_path / ("packed.float32" if packing == "packed" else "model/w")
    chunk = next(p for p in folder.rglob("*") if p.is_file() and p.name != "zarr.json")
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
    assert tree_equal(out, {"w": jnp.ones(3)}, typematch=True)


def _state(seed=0):
    return {"model": _mlp(seed), "opt_state": {"mu": jnp.zeros(3)}, "step": 5}


@pytest.mark.parametrize("missing", ["error", "keep"])
def test_a_load_matching_nothing_names_the_top_level_keys(tmp_path, missing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _state())
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _mlp(1), missing=missing)
    message = str(info.value)
    assert message.startswith("None of the 6 leaves of `like` is in checkpoint")
    assert "its top-level keys are 'model', 'opt_state', 'step'" in message
    assert "pass `prefix=` naming it (e.g. `prefix='model'`)" in message
    assert len(message) < 600
    # With the prefix, the same load works.
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, _mlp(1), prefix="model", missing=missing)
    assert tree_equal(loaded, _mlp(0), typematch=True)


def test_a_failed_load_lists_stored_leaves_like_lacks_and_stays_short(tmp_path):
    saved = {"encoder": {f"w{i}": jnp.zeros(2) for i in range(40)}, "head": jnp.zeros(2)}
    like = {"body": {f"w{i}": jnp.zeros(2) for i in range(40)}, "head": jnp.zeros(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    message = str(info.value)
    assert "40 leaves do not match" in message
    assert "Error at leaf with path (DictKey(key='body'), DictKey(key='w0')): leaf `body.w0`" in message
    assert "... and 28 more (the error's `dotted` attribute lists them all)." in message
    assert "Stored leaves that `like` lacks (perhaps the missing ones, renamed):" in message
    assert "  + `encoder.w0` (stored, not in `like`)" in message
    assert "... and 32 more." in message
    assert len(message) < 4000
    assert len(info.value.dotted) == 40


def test_lazy_scalars_come_back_as_values(tmp_path):
    tree = {"step": 7, "lr": np.float32(0.5), "flag": True, "w": jnp.ones(2), "n": np.ones(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    assert lazy["step"] == 7 and type(lazy["step"]) is int
    assert lazy["lr"] == np.float32(0.5) and type(lazy["lr"]) is np.float32
    assert lazy["flag"] is True
    assert isinstance(lazy["w"], eqx_ckpt.LazyArray) and isinstance(lazy["n"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), tree, typematch=True)


def test_weak_type_of_like_is_kept(tmp_path):
    like = {"scale": jnp.asarray(2.0), "w": jnp.ones(2)}
    assert like["scale"].weak_type
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"scale": jnp.asarray(3.0), "w": jnp.ones(2)})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["scale"].weak_type and not loaded["w"].weak_type
    assert tree_equal(loaded, {"scale": jnp.asarray(3.0), "w": jnp.ones(2)}, typematch=True)
    abstract = eqx.filter_eval_shape(lambda: like)
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, abstract)["scale"].weak_type
    traces = []

    @jax.jit
    def f(tree):
        traces.append(None)
        return tree["scale"] * 2

    f(like)
    f(loaded)
    assert len(traces) == 1


def test_64_bit_values_are_exact_or_refused_without_x64(tmp_path):
    value = 2**40 + 5
    with jax.enable_x64(True):
        saved = {"j": jnp.array([value], jnp.int64), "n": np.array([value], np.int64), "f": jnp.array([0.1])}
        eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    assert not jax.config.read("jax_enable_x64")
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    # NumPy holds 64-bit values in any process.
    assert ckpt["j"][...].tolist() == [value] and ckpt["j"][...].dtype == np.int64
    assert np.asarray(ckpt["n"]).tolist() == [value]
    assert type(ckpt["n"].read()) is np.ndarray and ckpt["n"].read().tolist() == [value]
    like = {"j": np.zeros(1, np.int64), "n": np.zeros(1, np.int64), "f": np.zeros(1)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["j"].tolist() == [value] and loaded["f"].tolist() == [0.1]
    # A JAX array cannot hold them: a clear error, never 5.
    refused = "it holds int64 values, and JAX's 64-bit mode is off"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("Leaf `j` in checkpoint")) as info:
        ckpt["j"].read()
    assert refused in str(info.value)
    abstract = {"j": jax.ShapeDtypeStruct((1,), np.int64)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(refused)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, abstract)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, abstract, lazy=True)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(refused)):
        eqx_ckpt.materialise(lazy)
    # Into int32 with `cast=True`: converted only if it fits.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("the value 1099511627781 does not fit in int32")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"j": jnp.zeros(1, jnp.int32)}, cast=True)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("it holds float64 values")) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"f": jax.ShapeDtypeStruct((1,), np.float64)})
    assert "would hold them as float32 and change them" in str(info.value)
    small = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"f": jnp.zeros(1, jnp.float32)}, cast=True)
    assert tree_equal(small, {"f": jnp.array([0.1], jnp.float32)}, typematch=True)


def test_prng_implementation_mismatch_does_not_suggest_cast(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"k": jax.random.key(0, impl="rbg")})
    like = {"k": jax.random.key(1, impl="threefry2x32")}
    for cast in (False, True):
        with pytest.raises(eqx_ckpt.LeafError) as info:
            eqx_ckpt.tree_deserialise_leaves(tmp_path, like, cast=cast)
        message = str(info.value)
        assert "PRNG key arrays of different implementations cannot be converted" in message
        assert "`cast=True` converts dtypes" not in message


def test_filter_spec_that_is_not_a_prefix_is_a_clear_error(tmp_path):
    tree = {"a": jnp.ones(1), "b": jnp.ones(1)}
    spec = {"a": eqx_ckpt.default_serialise_filter_spec}
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("its structure does not match `pytree`")):
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree, spec)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    spec = [eqx_ckpt.default_deserialise_filter_spec]
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("its structure does not match `like`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, spec)


def test_a_load_racing_an_overwrite_says_the_checkpoint_was_replaced(tmp_path):
    from eqx_ckpt._base import _faults

    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.zeros(3)})

    def overwritten_meanwhile(loc):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(3)})

    with _faults.armed("load.read_stored", overwritten_meanwhile):
        with pytest.raises(eqx_ckpt.CheckpointReplacedError) as info:
            eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(3)})
    message = str(info.value)
    assert message.startswith(f"Checkpoint {str(tmp_path)!r} was replaced by a newer save after it was opened")
    assert "Open or load it again to read the new one" in message
    assert "gen." not in message
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(3)}), {"w": jnp.ones(3)})


def test_a_python_scalar_like_holds_the_stored_value_exactly_or_is_an_error(tmp_path):
    """A Python `float` or `complex` `like` takes a stored integer only when it
    holds it exactly: `2**53 + 1` once came back as `2**53` with no `cast`."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"step": 2**53 + 1, "small": 7, "flag": True})
    for like in (0.0, 0j):
        with pytest.raises(eqx_ckpt.LeafError, match=re.escape("Leaf `step` in checkpoint")) as info:
            eqx_ckpt.tree_deserialise_leaves(tmp_path, {"step": like, "small": 0, "flag": False})
        kind = type(like).__name__
        assert f"`like` holds a Python {kind}, which cannot hold it exactly: 9007199254740993 would become" in str(
            info.value
        )
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"step": 0, "small": 0.0, "flag": 0})
    assert tree_equal(loaded, {"step": 2**53 + 1, "small": 7.0, "flag": 1}, typematch=True)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("which cannot hold it exactly")):  # lazily too
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"step": 0.0, "small": 0, "flag": False}, lazy=True)


# Found by a pass of adversarial use of the load side: a transform's result
# once skipped checks a plain load makes, and some mistakes left no trace.


@pytest.mark.parametrize("lazy", [False, True])
def test_a_transformed_64_bit_leaf_is_refused_without_x64(tmp_path, lazy):
    with jax.enable_x64(True):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"i": np.array([2**40 + 5, 7]), "f": np.array([1e300, 0.1])})
    assert not jax.config.read("jax_enable_x64")
    for name, dtype in (("i", jnp.int64), ("f", jnp.float64)):
        like = {name: jax.ShapeDtypeStruct((2,), dtype)}
        # It once came back as int32 [5, 7], and float32 [inf, 0.1].
        with pytest.raises(eqx_ckpt.LeafError, match=rf"leaf `{name}`.*64-bit mode is off, so a JAX array would"):
            out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, transform={name: lambda a: a}, lazy=lazy)
            eqx_ckpt.materialise(out)
    # Into NumPy, the values are exact.
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"i": np.zeros(2, np.int64)}, transform={"i": lambda a: a})
    assert out["i"].tolist() == [2**40 + 5, 7]


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(
    ("like", "fn", "said"),
    [
        (0, lambda a: a + 0.7, "the value 5.7 is not a whole number, so a Python int cannot hold it"),
        (0, lambda a: 2.1 - a, "the value -2.9 is not a whole number"),
        (False, lambda a: a * 0.1, "0.5 would become True"),
        (0, lambda a: a + 1j, r"\(5\+1j\) has an imaginary part"),
        (0.0, lambda a: a + 1j, r"\(5\+1j\) has an imaginary part"),
    ],
)
def test_a_transform_into_a_python_scalar_holds_the_value_exactly_or_is_an_error(tmp_path, like, fn, said, lazy):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": 5})
    # Once truncated silently (5.7 -> 5), or a bare TypeError for a complex value.
    with pytest.raises(eqx_ckpt.LeafError, match=rf"leaf `x`.*cannot hold it exactly: {said}"):
        eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": like}, transform={"x": fn}, lazy=lazy))
    exact = (lambda a: a > 3) if type(like) is bool else (lambda a: a * 2)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": like}, transform={"x": exact})
    assert out == {"x": True if type(like) is bool else 10} and type(out["x"]) is type(like)


def test_a_transform_for_a_leaf_a_custom_filter_spec_loads_is_an_error(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(4.0).reshape(2, 2)})
    spec = lambda handle, x: eqx_ckpt.default_deserialise_filter_spec(handle, x)
    # The transform was once skipped: the matrix came back untransposed.
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=r"`transform` applies to `w`, but a custom filter spec"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": np.zeros((2, 2))}, spec, transform={"w": np.transpose})


@pytest.mark.parametrize("lazy", [False, True])
def test_a_transform_that_raises_is_the_cause_of_the_error(tmp_path, lazy):
    """Issue 40, item 9: the `LeafError` for a `transform` that raised once lost
    the exception (`__cause__` was None), and with it the traceback into the
    user's function."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.ones(2, np.float32), "b": np.ones(2, np.float32)})
    oops = ZeroDivisionError("oops")

    def broken(a):
        raise oops

    like = {"w": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    transform = {"w": broken, "b": lambda a: a * 2}
    said = re.escape("its `transform` raised ZeroDivisionError: oops.")
    with pytest.raises(eqx_ckpt.LeafError, match=r"leaf `w`.*" + said) as info:
        eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(tmp_path, like, transform=transform, lazy=lazy))
    assert info.value.__cause__ is oops and info.value.dotted == ("w",)
    if lazy:  # a lazy leaf read on its own, not through `materialise`
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, transform=transform, lazy=True)
        with pytest.raises(eqx_ckpt.LeafError, match=said) as info:
            np.asarray(loaded["w"])
        assert info.value.__cause__ is oops
        assert np.array_equal(np.asarray(loaded["b"]), np.full(2, 2, np.float32))


def test_a_rename_callable_that_raises_is_a_checkpoint_error(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.ones(2)})
    with pytest.raises(
        eqx_ckpt.CheckpointValueError, match=r"`rename` raised KeyError: 'w' \(called with `w`\)"
    ) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": np.zeros(2)}, rename=lambda path: {}[path])
    assert isinstance(info.value.__cause__, KeyError)


def test_where_selecting_only_leaves_that_are_not_loaded_is_an_error(tmp_path):
    class Net(eqx.Module):
        w: jax.Array
        act: object
        name: str

    eqx_ckpt.tree_serialise_leaves(tmp_path, Net(jnp.ones(3), jax.nn.relu, "n"))
    like = Net(jnp.zeros(3), jax.nn.relu, "n")
    for where in (lambda m: m.act, lambda m: (m.act, m.name)):
        with pytest.raises(eqx_ckpt.CheckpointValueError, match=r"selected only leaves of `like` that are not loaded"):
            eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=where)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: (m.w, m.act))
    assert tree_equal(loaded, Net(jnp.ones(3), jax.nn.relu, "n"))


def test_a_prefix_naming_one_leaf_says_so(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"w": jnp.ones((3, 4))}, "step": 1})
    like = {"weight": jax.ShapeDtypeStruct((3, 4), jnp.float32)}
    # It once said "its top-level keys are 'model.w'".
    expected = r"`prefix` 'model\.w' names one leaf, so `like` must be that leaf alone\. .* pass `prefix='model'`"
    with pytest.raises(eqx_ckpt.LeafError, match=expected):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model.w")
    with pytest.raises(eqx_ckpt.LeafError, match=r"its keys below `prefix` 'model' are 'w'\."):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like["weight"], prefix="model.w")
    assert tree_equal(loaded, jnp.ones((3, 4)))


def _eqx_file(tmp_path):
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, {"w": jnp.ones(3)})
    return path


def _pickles_only(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle; never opened
    return tmp_path


def _shards_without_index(tmp_path):
    import safetensors.numpy

    for i in (1, 2):
        safetensors.numpy.save_file({f"w{i}": np.ones(2, np.float32)}, str(tmp_path / f"model-0000{i}.safetensors"))
    return tmp_path


def _orbax_items(tmp_path):
    for item in ("params", "opt_state"):
        (tmp_path / item).mkdir()
        (tmp_path / item / "_METADATA").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    "make, said",
    [
        (
            _eqx_file,
            "It is an Equinox file (`eqx.tree_serialise_leaves` writes one stream with no names in it): "
            "convert it once with `eqx_ckpt.convert_eqx_file(eqx_path, ckpt_path, like)`",
        ),
        (
            _pickles_only,
            "It holds `pytorch_model.bin`: pickled files (PyTorch's `torch.save`), which eqx_ckpt "
            "never reads, since unpickling runs code from the file.",
        ),
        (
            _shards_without_index,
            "It holds 2 safetensors files (`model-00001.safetensors`, "
            "`model-00002.safetensors`) but no `model.safetensors.index.json`",
        ),
        (_orbax_items, "It is an orbax checkpoint of several items (`opt_state`, `params`): pass one item's folder."),
    ],
    ids=["eqx-file", "pytorch-bin", "shards-without-index", "orbax-items"],
)
def test_a_path_holding_no_format_eqx_ckpt_reads_says_what_it_holds(tmp_path, make, said):
    """Each said only "no manifest.json ... a save that was interrupted leaves no
    checkpoint", which sent users looking for an interrupted save; then it said
    that before what it holds. It says only what it is and what to do."""
    path = make(tmp_path)
    whole = re.escape(f"{str(path)!r} is not a checkpoint eqx_ckpt reads. {said}")
    for call in (
        lambda: eqx_ckpt.tree_deserialise_leaves(path, {"w": np.ones(3, np.float32)}),
        lambda: eqx_ckpt.Checkpoint(path),
        lambda: eqx_ckpt.verify(path),
    ):
        with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match="^" + whole) as caught:
            call()
        assert "interrupted" not in str(caught.value) and "manifest.json" not in str(caught.value)


def test_an_empty_directory_says_no_checkpoint_is_there_and_why_there_may_be_none(tmp_path):
    """Where nothing there is recognised, the message names what is missing,
    and that an interrupted save leaves no checkpoint."""
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError) as caught:
        eqx_ckpt.Checkpoint(tmp_path)
    assert str(caught.value) == (
        f"There is no eqx_ckpt checkpoint at {str(tmp_path)!r} (no manifest.json). Check the path; a save that "
        f"was interrupted leaves no checkpoint. Nor is it another format eqx_ckpt reads: no "
        f"`model.safetensors.index.json`, `model.safetensors` (or a fine-tune's `finetune.safetensors`) or orbax "
        f"`_METADATA` there either (see "
        f"docs/interop.md)."
    )


@pytest.mark.parametrize("read_once", [None, True, False])
def test_read_once_in_one_process_reads_as_any_load(tmp_path, read_once):
    """`read_once` shares reads between processes (tests/hosts/test_multiprocess.py);
    in one process there is nobody to share with, and every value loads as
    without it, through `tree_deserialise_leaves` and a manager's restore."""
    tree = {"model": _mlp(), "step": 3, "mean": jnp.arange(5.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree, read_once=read_once)
    assert tree_equal(loaded, tree, typematch=True)
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    manager.save(0, tree)
    assert tree_equal(manager.restore(tree, read_once=read_once), tree, typematch=True)
    assert tree_equal(manager.restore_or_initialise(lambda: tree, read_once=read_once)[1], tree, typematch=True)


@pytest.mark.parametrize("value", ["yes", 1, "auto"])
def test_read_once_is_none_true_or_false(tmp_path, value):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(3)})
    said = f"`read_once` must be `None` (share reads where it pays), `True` or `False`, not {value!r}."
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape(said)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(3)}, read_once=value)
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape(said)):
        eqx_ckpt.load_or_initialise(tmp_path, lambda: {"w": jnp.zeros(3)}, read_once=value)


def test_a_report_of_many_leaves_names_each_leaf_once(tmp_path):
    """A `LeafError` about several leaves says each one once, as `dotted` (key
    path ...): what changed. Only the first keeps Equinox's words (it named
    each leaf three ways more, 3,325 characters for 12 lines shown; issue 59)."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {f"layer{i}": {"w": np.zeros((4, 4), np.float32)} for i in range(16)})
    like = {f"layer{i}": {"w": jax.ShapeDtypeStruct((5, 4), jnp.float32)} for i in range(16)}
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    message = str(info.value)
    first, *others = [line for line in message.splitlines() if line.startswith("  - ")]
    assert first.startswith("  - Error at leaf with path (DictKey(key='layer0'), DictKey(key='w')): leaf `layer0.w`")
    assert "Deserialised leaf at path (DictKey(key='layer0'), DictKey(key='w')) has changed shape" in first
    shape = "shape changed: from (5, 4) in `like` to (4, 4) on disk."
    assert others[0] == f"  - `layer1.w` (key path ['layer1']['w']): {shape}"
    assert len(others) == 11 and not any("DictKey" in line or "Deserialised" in line for line in others)
    assert len(message) < 1800 and info.value.dotted == tuple(sorted(f"layer{i}.w" for i in range(16)))


@pytest.mark.parametrize("count", [3, 40])
def test_a_load_names_every_mismatched_leaf_by_its_own_key_path(tmp_path, count):
    """A load names its leaves from `like`'s structure and makes a leaf's key
    path only when an error names it: the first few one at a time, then all
    at once. Either way, every leaf the error names has its own key path, as
    JAX flattens `like`."""

    class Block(eqx.Module):
        w: jax.Array
        n: int = eqx.field(static=True)

    tree = {"blocks": [Block(jnp.ones(2), i) for i in range(count)], "opt": {7: jnp.zeros(1)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    like = {"blocks": [Block(jnp.ones(3), i) for i in range(count)], "opt": {7: jnp.zeros(2)}}
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    expected = [keypath for keypath, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    assert list(info.value.keypaths) == expected
    assert "`blocks.0.w` (key path ['blocks'][0].w)" in str(info.value)


def _load_entries(tmp_path):
    """Each public load that takes the options of `tree_deserialise_leaves`, as
    a call `(like, **options)` of a checkpoint holding `{"w": ones(3)}`."""
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"w": jnp.ones(3)})
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    manager.save(0, {"w": jnp.ones(3)})
    return {
        "tree_deserialise_leaves": lambda like, **o: eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like, **o),
        "load_or_initialise": lambda like, **o: eqx_ckpt.load_or_initialise(tmp_path / "ckpt", lambda: like, **o),
        "restore": lambda like, **o: manager.restore(like, **o),
        "restore_or_initialise": lambda like, **o: manager.restore_or_initialise(lambda: like, **o)[1],
    }


_PUBLIC_LOADS = {
    "tree_deserialise_leaves": eqx_ckpt.tree_deserialise_leaves,
    "load_or_initialise": eqx_ckpt.load_or_initialise,
    "restore": eqx_ckpt.CheckpointManager.restore,
    "restore_or_initialise": eqx_ckpt.CheckpointManager.restore_or_initialise,
}


@pytest.mark.parametrize("entry", sorted(_PUBLIC_LOADS))
def test_every_option_of_a_public_load_is_a_load_option_with_its_default(entry):
    """Issue 69 item 2: a public load makes its options one object
    (`LoadOptions(...)`, one call), taking them by name. A keyword option
    named otherwise, or defaulting otherwise, would silently not reach it."""
    from eqx_ckpt._load._load_plan import LoadOptions

    fields = {field.name: field.default for field in dataclasses.fields(LoadOptions)}
    params = inspect.signature(_PUBLIC_LOADS[entry]).parameters
    options = {
        name: p.default
        for name, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("filter_spec", "is_leaf")
    }
    assert len(options) >= 9
    assert {name: fields.get(name, "not a field of LoadOptions") for name in options} == options


@pytest.mark.parametrize("entry", sorted(_PUBLIC_LOADS))
def test_every_public_load_checks_and_uses_its_options(tmp_path, entry):
    """Each option given to a public load reaches the load: a flag is checked
    with its own message, and `prefix`, `missing`, `cast` do what they say."""
    load = _load_entries(tmp_path)[entry]
    for flag in ("strict", "cast"):
        with pytest.raises(eqx_ckpt.CheckpointError, match=re.escape(f"`{flag}`")):
            load({"w": jnp.zeros(3)}, **{flag: "yes"})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`prefix` 'model' is not in checkpoint")):
        load({"w": jnp.zeros(3)}, prefix="model")
    with pytest.raises(eqx_ckpt.LeafError, match="pass `cast=True` to convert"):
        load({"w": jnp.zeros(3, jnp.int32)}, cast=False)
    assert tree_equal(load({"w": jnp.zeros(3, jnp.int32)}, cast=True), {"w": jnp.ones(3, jnp.int32)})
    if entry in ("tree_deserialise_leaves", "restore", "restore_or_initialise"):
        loaded = load({"w": jnp.zeros(3), "new": jnp.zeros(2)}, missing="keep")
        assert tree_equal(loaded["w"], jnp.ones(3)) and loaded["new"].shape == (2,)
