"""Every dtype JAX and NumPy have round-trips bit-exactly, as the same array type."""

import json

import arrays
import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal

import eqx_ckpt

# Representable in every dtype of its family, and not all zero, so a bug that
# stores zeros or reinterprets bytes shows up.
_VALUES = {
    "bool": [[True, False, True], [False, False, True]],
    "int2": [[-2, -1, 0], [1, 1, -2]],
    "uint2": [[0, 1, 2], [3, 3, 1]],
    "int4": [[-8, -1, 0], [1, 5, 7]],
    "uint4": [[0, 1, 5], [9, 14, 15]],
    "signed": [[-100, -1, 0], [1, 42, 127]],
    "unsigned": [[0, 1, 7], [42, 100, 255]],
    "float": [[0.5, -1.0, 0.0], [1.5, 2.0, -4.0]],
    "float8_e8m0fnu": [[0.25, 0.5, 1.0], [2.0, 4.0, 8.0]],
    "complex": [[1 + 2j, -0.5j, 0], [3, -1 - 1j, 0.25 + 0.5j]],
}

JAX_DTYPES = [
    "bool",
    "int2",
    "uint2",
    "int4",
    "uint4",
    "int8",
    "int16",
    "int32",
    "uint8",
    "uint16",
    "uint32",
    "float16",
    "bfloat16",
    "float32",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e3m4",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "complex64",
]
X64_DTYPES = ["int64", "uint64", "float64", "complex128"]


def _dtype(name):
    return np.dtype(bool) if name == "bool" else np.dtype(getattr(ml_dtypes, name, None) or name)


def _values(name):
    if name in _VALUES:
        values = _VALUES[name]
    elif name.startswith("complex"):
        values = _VALUES["complex"]
    elif name.startswith("int"):
        values = _VALUES["signed"]
    elif name.startswith("uint"):
        values = _VALUES["unsigned"]
    else:
        values = _VALUES["float"]
    array = np.array(values).astype(_dtype(name))
    assert array.view(np.uint8).any()
    return array


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", JAX_DTYPES)
def test_jax_array_round_trip(tmp_path, name, packing):
    x = jnp.asarray(_values(name))
    assert x.dtype == _dtype(name)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros_like(x)})
    assert tree_equal(loaded, {"x": x}, typematch=True)
    assert isinstance(loaded["x"], jax.Array)
    assert _same_bits(loaded["x"], x)
    abstract = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
    assert _same_bits(abstract["x"], x)


@pytest.mark.parametrize("name", JAX_DTYPES + X64_DTYPES)
def test_numpy_array_round_trip(tmp_path, name, packing):
    x = _values(name)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": np.zeros_like(x)})
    assert type(loaded["x"]) is np.ndarray
    assert tree_equal(loaded, {"x": x}, typematch=True)
    assert _same_bits(loaded["x"], x)


@pytest.mark.parametrize("name", X64_DTYPES)
def test_x64_jax_array_round_trip(tmp_path, name):
    with jax.enable_x64(True):
        x = jnp.asarray(_values(name))
        assert x.dtype == _dtype(name)
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
        assert tree_equal(loaded, {"x": x}, typematch=True)
        assert _same_bits(loaded["x"], x)


@pytest.mark.parametrize("name", ["bool", "int8", "int64", "uint64", "float16", "bfloat16", "float64", "complex128"])
def test_numpy_scalar_round_trip(tmp_path, name):
    x = _values(name).flat[1]
    assert isinstance(x, np.generic)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": x.dtype.type(0)})
    assert type(loaded["x"]) is type(x)
    assert loaded["x"].dtype == x.dtype
    assert tree_equal(loaded, {"x": x}, typematch=True)


def test_special_float_values_are_bit_exact(tmp_path):
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, np.finfo(np.float32).max], dtype=np.float32)
    tree = {"np": x, "jax": jnp.asarray(x), "bf16": jnp.asarray(x).astype(jnp.bfloat16)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    for key in tree:
        assert _same_bits(loaded[key], tree[key]), key


def _array_of(path, leaf):
    """The folder of the zarr array holding `leaf` (its pack, or its own), and
    where its elements start in it."""
    record = next(r for r in json.loads((path / "manifest.json").read_text())["leaves"] if r["path"] == leaf)
    return path / record.get("pack", leaf), record.get("offset", 0)


def test_zarr_data_type_is_native_where_tensorstore_has_it(tmp_path, packing):
    tree = {
        "bf16": jnp.ones(2, jnp.bfloat16),
        "f8": jnp.ones(2, jnp.float8_e4m3fn),
        "e4m3": jnp.ones(2, jnp.float8_e4m3),
        "u4": jnp.ones(2, jnp.uint4),
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    data_type = lambda k: json.loads((_array_of(tmp_path, k)[0] / "zarr.json").read_text())["data_type"]
    assert data_type("bf16") == "bfloat16"
    assert data_type("f8") == "float8_e4m3fn"
    # What TensorStore lacks is stored as raw bytes of the same width.
    assert data_type("e4m3") == "uint8"
    assert data_type("u4") == "uint8"
    folder, offset = _array_of(tmp_path, "e4m3")
    assert folder.name == ("packed.uint8" if packing == "packed" else "e4m3")
    raw = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(folder)}}).result()
    np.testing.assert_array_equal(
        raw[offset : offset + 2].read().result(), np.ones(2, ml_dtypes.float8_e4m3).view(np.uint8)
    )


def test_cast_on_save_then_load(tmp_path, packing):
    x = jnp.array([1.0, 1.0 + 2**-10, 3.0], jnp.float32)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x, "i": jnp.arange(3)}, cast={jnp.float32: jnp.bfloat16})
    assert json.loads((_array_of(tmp_path, "x")[0] / "zarr.json").read_text())["data_type"] == "bfloat16"
    assert json.loads((_array_of(tmp_path, "i")[0] / "zarr.json").read_text())["data_type"] == "int32"
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(3), "i": jnp.zeros(3, jnp.int32)}, cast=True)
    expected = x.astype(jnp.bfloat16).astype(jnp.float32)
    assert tree_equal(loaded["x"], expected, typematch=True)
    assert not tree_equal(loaded["x"], x)


def test_byte_order_is_kept(tmp_path):
    tree = {"f": np.arange(4, dtype=">f4"), "c": np.array([1 + 2j], dtype=">c8"), "i": np.arange(3, dtype=">i2")}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(loaded, tree, typematch=True)
    assert loaded["f"].dtype == np.dtype(">f4")
    # Stored little-endian, so a native-order `like` reads the same values.
    native = eqx_ckpt.tree_deserialise_leaves(
        tmp_path, {"f": np.zeros(4, np.float32), "c": np.zeros(1, np.complex64), "i": np.zeros(3, np.int16)}
    )
    for key in tree:
        np.testing.assert_array_equal(native[key], tree[key])
        assert native[key].dtype.isnative


def test_the_host_comparison_of_the_tests_answers_as_equinox_does():
    """`arrays.tree_equal`, which most round trips here are checked with,
    gives `eqx.tree_equal`'s answer for every JAX dtype: equal arrays, one
    element changed, another shape, another dtype, NumPy against JAX with
    and without `typematch`, NaNs, tolerances, PRNG keys and leaves that are
    not arrays."""
    cases = []
    for name in JAX_DTYPES:
        x = _values(name)
        a = jnp.asarray(x)
        flipped = x.copy().reshape(-1)
        flipped[1] = flipped[0]  # (the values differ at 0 and 1 in every family)
        cases += [(a, jnp.asarray(x)), (a, jnp.asarray(flipped.reshape(x.shape))), (a, a[:1]), (a, x)]
        other = "int32" if name == "float32" else "float32"
        cases.append((a, jnp.zeros(x.shape, other)))
    nan = jnp.asarray([1.0, np.nan], jnp.float32)
    near = jnp.asarray([1.0, 2.0], jnp.bfloat16), jnp.asarray([1.0, 2.0078125], jnp.bfloat16)
    cases += [(nan, nan), (*near,), ({"a": [1, jnp.zeros(2)]}, {"a": [1, jnp.zeros(2)]}), ({"a": 1}, {"a": 2})]
    cases += [({"a": 1}, {"b": 1}), (jax.random.key(0), jax.random.key(0)), (jax.random.key(0), jax.random.key(1))]
    answers, reference = set(), eqx.tree_equal
    for x, y in cases:
        for options in ({}, {"typematch": True}, {"rtol": 0.01}, {"atol": 1e-6}):
            want = bool(reference(x, y, **options))
            assert arrays.tree_equal(x, y, **options) is want, (x, y, options)
            answers.add(want)
    assert answers == {True, False}
