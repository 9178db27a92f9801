"""Cast on save: store arrays in another dtype (`float32` as `bfloat16`)."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_ckpt


def _tree():
    return {
        "w": jnp.linspace(-3.0, 3.0, 12, dtype=jnp.float32).reshape(3, 4) / 7,
        "n": jnp.arange(4, dtype=jnp.int32),
        "host": np.full(3, 1 / 3, np.float32),
        "lr": 0.1,
    }


def _bf16_rounded(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


def _record(path, name):
    leaves = json.loads((path / "manifest.json").read_text())["leaves"]
    return next(leaf for leaf in leaves if leaf["path"] == name)


def test_manifest_and_zarr_record_both_dtypes(tmp_path, packing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), cast={jnp.float32: jnp.bfloat16})
    for name in ("w", "host"):
        record = _record(tmp_path, name)
        assert (record["dtype"], record["stored_dtype"]) == ("float32", "bfloat16")
        # A small leaf is packed with the others of its stored dtype, unless packing is off.
        folder = name if packing == "unpacked" else "packed.bfloat16"
        assert record.get("pack", name) == folder
        assert json.loads((tmp_path / folder / "zarr.json").read_text())["data_type"] == "bfloat16"
    # Other dtypes, and Python scalars (always stored exactly), are untouched: the
    # record leaves out a stored dtype equal to the dtype.
    assert _record(tmp_path, "n")["dtype"] == "int32" and "stored_dtype" not in _record(tmp_path, "n")
    assert _record(tmp_path, "lr")["dtype"] == "float64" and "stored_dtype" not in _record(tmp_path, "lr")
    assert eqx_ckpt.Checkpoint(tmp_path).record("w").nbytes == 12 * 2


def test_load_into_float32_upcasts(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast={jnp.float32: jnp.bfloat16})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, eqx.filter_eval_shape(_tree))
    assert loaded["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded["w"]), _bf16_rounded(tree["w"]))
    assert not np.array_equal(np.asarray(loaded["w"]), np.asarray(tree["w"]))  # it was rounded
    host = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)["host"]
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_array_equal(host, _bf16_rounded(tree["host"]))


def test_load_into_bfloat16(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast={jnp.float32: jnp.bfloat16})
    like = {**tree, "w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    expected = {**tree, "w": tree["w"].astype(jnp.bfloat16), "host": _bf16_rounded(tree["host"])}
    assert tree_equal(loaded, expected, typematch=True)


def test_other_dtypes_still_need_cast_true(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), cast={jnp.float32: jnp.bfloat16})
    like = {**_tree(), "w": jax.ShapeDtypeStruct((3, 4), jnp.float16)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("['w']")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, cast=True)
    assert loaded["w"].dtype == jnp.float16


def test_callable_picks_leaves_by_path(tmp_path):
    tree = {"model": {"w": jnp.ones(3) / 3}, "opt": {"mu": jnp.ones(3) / 3}}
    seen = []

    def cast(path, dtype):
        seen.append((path, dtype))
        return jnp.bfloat16 if path.startswith("model.") else None

    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast=cast)
    assert sorted(seen) == [("model.w", np.dtype("float32")), ("opt.mu", np.dtype("float32"))]
    assert _record(tmp_path, "model.w")["stored_dtype"] == "bfloat16"
    assert _record(tmp_path, "opt.mu").get("stored_dtype", "float32") == "float32"
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    np.testing.assert_array_equal(np.asarray(loaded["opt"]["mu"]), np.asarray(tree["opt"]["mu"]))


def test_lazy_and_checkpoint_give_the_saved_dtype(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast={jnp.float32: jnp.bfloat16})
    lazy = eqx_ckpt.Checkpoint(tmp_path)["w"]
    assert lazy.dtype == np.float32
    assert np.asarray(lazy).dtype == np.float32 and lazy[1:].dtype == np.float32
    np.testing.assert_array_equal(lazy[1:], _bf16_rounded(tree["w"])[1:])


def test_sharded_array_cast_and_loaded_sharded(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    sharding = NamedSharding(mesh, P("x"))
    value = jax.device_put(jnp.arange(16.0).reshape(8, 2) / 3, sharding)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": value}, cast={jnp.float32: jnp.bfloat16})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": value})["w"]
    assert loaded.sharding == sharding and loaded.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded), _bf16_rounded(value))


def test_cast_in_the_ocdbt_layout(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast={jnp.float32: jnp.bfloat16}, layout="ocdbt")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), _bf16_rounded(tree["w"]))


@pytest.mark.parametrize("target", [ml_dtypes.float8_e4m3, object, "not a dtype"])
def test_target_zarr_cannot_store_is_refused(tmp_path, target):
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("['w']")):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)}, cast=lambda path, dtype: target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cast", [jnp.bfloat16, "bfloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)])
def test_a_dtype_stores_floating_leaves_in_it(tmp_path, cast):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), cast=cast)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert ckpt.record("w").stored_dtype == "bfloat16"
    assert ckpt.record("host").stored_dtype == "bfloat16"
    assert ckpt.record("n").stored_dtype == "int32"  # integers are not floating
    assert ckpt.record("lr").stored_dtype == "float64"  # Python scalars keep their type
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, _tree())
    assert np.array_equal(np.asarray(loaded["w"]), _bf16_rounded(_tree()["w"]))


@pytest.mark.parametrize("cast", [5, "not_a_dtype", {jnp.float32: "nope"}])
def test_a_bad_cast_is_a_clear_error(tmp_path, cast):
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("`cast`")):
        eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), cast=cast)
    assert list(tmp_path.iterdir()) == []


def test_load_cast_must_be_a_bool(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`cast` of a load must be `True` or `False`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _tree(), cast=jnp.bfloat16)


def test_cast_on_save_refuses_values_that_would_wrap(tmp_path):
    tree = {"x": np.array([1.0, 300.0], np.float32)}
    message = "Error at leaf with path (DictKey(key='x'),): leaf `x` (key path ['x']) in checkpoint"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree, cast={np.float32: np.int8})
    assert "the value 300.0 does not fit in int8" in str(info.value)
    assert not (tmp_path / "manifest.json").exists()
    # Whole numbers that fit are stored; a fraction is never dropped (issue 40, item 10).
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("the value 1.5 is not a whole number, so int8")):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.array([1.5, -100.0], np.float32)}, cast={np.float32: np.int8})
    assert not (tmp_path / "manifest.json").exists()
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.array([1.0, -100.0], np.float32)}, cast={np.float32: np.int8})
    assert np.array_equal(eqx_ckpt.Checkpoint(tmp_path)["x"][...], np.array([1.0, -100.0], np.float32))


@pytest.mark.parametrize(
    "saved, like, why",
    [
        (np.array([2**40], np.int64), np.zeros(1, np.int32), "the value 1099511627776 does not fit in int32"),
        (np.array([np.nan], np.float32), np.zeros(1, np.int32), "NaN or infinity cannot become int32"),
        (np.array([-np.inf], np.float64), np.zeros(1, np.int64), "NaN or infinity cannot become int64"),
        (np.array([300.0], np.float32), np.zeros(1, np.int8), "the value 300.0 does not fit in int8"),
        (np.array([300.7], np.float32), np.zeros(1, np.int8), "the value 300.7 is not a whole number, so int8"),
        (np.array([-1], np.int16), np.zeros(1, np.uint16), "the value -1 does not fit in uint16"),
        (np.array([1e300]), np.zeros(1, np.float32), "the value 1e+300 is beyond the range of float32"),
        (np.array([1 + 1j]), np.zeros(1, np.float64), "values with an imaginary part cannot become float64"),
    ],
)
def test_cast_true_on_load_refuses_values_that_would_change(tmp_path, saved, like, why):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"x": saved}})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(why)) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"model": {"x": like}}, cast=True)
    assert "Leaf `model.x` in checkpoint" in str(info.value)
    assert info.value.dotted == ("model.x",)


def test_cast_true_rounds_floats_and_converts_what_fits(tmp_path):
    saved = {"f": np.array([1 / 3, 1e30]), "i": np.array([7, -8], np.int64), "nan": np.array([np.nan], np.float32)}
    like = {"f": np.zeros(2, ml_dtypes.bfloat16), "i": np.zeros(2, np.int8), "nan": np.zeros(1, np.float16)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, cast=True)
    assert np.array_equal(loaded["f"], saved["f"].astype(ml_dtypes.bfloat16))
    assert np.array_equal(loaded["i"], np.array([7, -8], np.int8))
    assert np.isnan(loaded["nan"][0]) and loaded["nan"].dtype == np.float16


# Float types without infinity (float8 `fn` types give NaN, float4_e2m1fn its
# largest value), an integer beyond a float's range, infinity and NaN into types
# without them, a negative value into an unsigned float: each once became another
# value silently, on save and on load.
_OUT_OF_RANGE = [
    (np.array([1000.0, 1.0], np.float32), ml_dtypes.float8_e4m3fn, "the value 1000.0"),
    (np.array([300.0], np.float32), ml_dtypes.float8_e4m3fnuz, "the value 300.0"),
    (np.array([7.0], np.float32), ml_dtypes.float4_e2m1fn, "the value 7.0"),
    (np.array([np.inf], np.float32), ml_dtypes.float8_e4m3fn, "the value inf"),
    (np.array([np.nan], np.float32), ml_dtypes.float4_e2m1fn, "the value nan"),
    (np.array([-2.0], np.float32), ml_dtypes.float8_e8m0fnu, "the value -2.0"),
    (np.array([70000, 1], np.int64), np.float16, "the value 70000"),
    (np.array([2**17], np.int32), ml_dtypes.float8_e5m2, "the value 131072"),
    (np.array([1e39 + 1j]), np.complex64, "the value 1e+39"),
]


@pytest.mark.parametrize("saved, target, why", _OUT_OF_RANGE)
def test_cast_refuses_values_beyond_any_float_types_range(tmp_path, saved, target, why):
    name = np.dtype(target).name
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(f"{why} is beyond the range of {name}")):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "save", {"x": saved}, cast={saved.dtype.type: target})
    assert not (tmp_path / "save").exists()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "load", {"x": saved})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(f"{why} is beyond the range of {name}")) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "load", {"x": np.zeros(saved.shape, target)}, cast=True)
    assert "Leaf `x` in checkpoint" in str(info.value)


def test_cast_rounds_to_the_largest_value_but_no_further(tmp_path):
    """Within half a step of a type's largest value is rounding (to it); beyond is an error."""
    saved = {"e4m3": np.array([455.0, -455.0], np.float32), "half": np.array([65519.0], np.float32)}
    cast = {"e4m3": ml_dtypes.float8_e4m3fn, "half": np.float16}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved, cast=lambda path, dtype: cast[path])
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {k: np.zeros_like(v) for k, v in saved.items()})
    assert np.array_equal(loaded["e4m3"], [448.0, -448.0]) and np.array_equal(loaded["half"], [65504.0])


def test_a_stored_value_that_cannot_become_the_leafs_dtype_is_an_error(tmp_path):
    """A leaf cast on save reads back in its own dtype (lazily too, and in
    `diff`, all through `_read.host_converter`): a stored value that cannot
    (infinity for an integer leaf, as a hand-made checkpoint may hold) is an
    error naming the stored dtype, never a wrapped integer."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"n": np.array([7, 1])}, cast={np.int64: np.float16})
    ck = eqx_ckpt.Checkpoint(tmp_path)
    assert np.array_equal(ck["n"][...], [7, 1]) and ck["n"][...].dtype == np.int64
    converter = eqx_ckpt._load._read.host_converter(ck.record("n"), np.dtype(np.int64), ck._source.data)
    why = "cannot convert it from float16 (how this int64 leaf is stored) to int64: NaN or infinity cannot become int64"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(why)):
        converter(np.array([np.inf, 1.0], np.float16))


def test_the_range_check_reaches_every_block(monkeypatch):
    """The check runs a block at a time (bounded memory): a value in the last,
    partial block of a 2-D array, or in an imaginary part, is still caught."""
    from eqx_ckpt._ondisk import _dtypes

    monkeypatch.setattr(_dtypes, "_CHECK_BLOCK", 3)
    values = np.ones((3, 4), np.float32)
    values[2, 3] = 1000.0
    with pytest.raises(ValueError, match=re.escape("the value 1000.0 is beyond the range of float8_e4m3fn")):
        _dtypes.checked_cast(values, ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=re.escape("the value 1e+39 is beyond the range of complex64")):
        _dtypes.checked_cast(np.array([1 + 1j, 2, 3, 4, 1e39j]), np.complex64)
    values[2, 3] = 2.0
    assert np.array_equal(_dtypes.checked_cast(values, ml_dtypes.float8_e4m3fn).astype(np.float32), values)


def test_a_cast_callable_that_raises_is_named(tmp_path):
    """It was reported as the filter spec raising."""

    def cast(path, dtype):
        raise KeyError("oops")

    message = "the `cast` callable raised KeyError: 'oops'. Nothing was written."
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.ones(2, np.float32)}, cast=cast)
    assert info.value.dotted == ("x",)
    assert list(tmp_path.iterdir()) == []


def _save_source(path, kind, model):
    """`{"model": model}` saved as eqx_ckpt's format, or as a safetensors file."""
    if kind == "eqx_ckpt":
        eqx_ckpt.tree_serialise_leaves(path, {"model": model})
        return path
    from safetensors.numpy import save_file

    path.mkdir()
    save_file({f"model.{k}": v for k, v in model.items()}, str(path / "model.safetensors"))
    return path / "model.safetensors"


_INTEGER_LIKES = {
    "numpy": lambda: np.zeros(2, np.int32),
    "jax": lambda: jax.ShapeDtypeStruct((2,), jnp.int32),
    "numpy scalar": lambda: np.int32(0),
    "python int": lambda: 0,
}


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("like_kind", list(_INTEGER_LIKES))
@pytest.mark.parametrize("source", ["eqx_ckpt", "safetensors"])
def test_cast_true_into_an_integer_never_drops_a_fraction(tmp_path, source, like_kind, lazy):
    """One rule for every integer `like` (issue 40, item 10): `cast=True` turned
    float `[2.7, -0.4]` into int32 `[2, 0]` silently while a Python `int` leaf
    refused `5.7` even with `cast=True`. A float becomes an integer only when it
    is a whole number that fits; otherwise the load names the leaf and a value."""
    scalar = like_kind in ("numpy scalar", "python int")
    fractions = np.array(5.7 if scalar else [2.0, -0.4])
    whole = np.array(5.0 if scalar else [2.0, -3.0])
    path = _save_source(tmp_path / "ckpt", source, {"x": fractions, "y": whole})
    like = _INTEGER_LIKES[like_kind]()
    shown = "5.7" if scalar else "-0.4"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(f"the value {shown} is not a whole number")) as info:
        eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(path, {"model": {"x": like}}, cast=True, lazy=lazy))
    assert "Leaf `model.x` in checkpoint" in str(info.value) and info.value.dotted == ("model.x",)
    loaded = eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(path, {"model": {"y": like}}, cast=True, lazy=lazy))
    expected = {
        "numpy": np.array([2, -3], np.int32),
        "jax": jnp.array([2, -3], jnp.int32),
        "numpy scalar": np.int32(5),
        "python int": 5,
    }[like_kind]
    assert tree_equal(loaded, {"model": {"y": expected}}, typematch=True)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan, 2.0**70])
@pytest.mark.parametrize("like", [np.zeros(1, np.int64), np.int64(0), 0], ids=["numpy", "numpy scalar", "python int"])
def test_cast_true_refuses_non_finite_and_out_of_range_floats_into_integers(tmp_path, value, like):
    """NaN and infinity are errors for every integer `like` (`int(inf)` into a
    Python `int` once raised a bare `OverflowError`); a value beyond int64 is an
    error for int64 and loads exactly into a Python `int`, which holds it."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.full(np.shape(like), value)})
    if value == 2.0**70 and isinstance(like, int):
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": like}, cast=True)
        assert tree_equal(loaded, {"x": 2**70}, typematch=True)
        return
    why = "does not fit in int64" if value == 2.0**70 else "NaN or infinity cannot become"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(why)) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": like}, cast=True)
    assert "Leaf `x` in checkpoint" in str(info.value)
