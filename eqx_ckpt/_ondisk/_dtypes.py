"""Which leaves are saved, how each kind is encoded as a zarr array, and how it
comes back as the type of `like`'s leaf."""

from __future__ import annotations

import math
import types
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._base import _state
from ._format import NATIVE_DTYPES, dtype_from_name

_PYTHON_SCALARS = types.MappingProxyType(
    {
        bool: ("bool", np.bool_),
        int: ("int", np.int64),
        float: ("float", np.float64),
        complex: ("complex", np.complex128),
    }
)
_ALL_NAMES = NATIVE_DTYPES | {"uint2", "uint4", "float8_e4m3"}


def is_known_dtype(name: str) -> bool:
    return name in _ALL_NAMES


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _is_key_dtype(dtype)


# Per dtype, not per leaf: NumPy's `dtype.name` and JAX's `issubdtype` cost
# microseconds each, which ten thousand leaves multiply into a large part of a save.
@_state.memo(256)
def _is_key_dtype(dtype: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


@_state.memo(256)
def name(dtype: np.dtype) -> str:
    """`dtype.name`, remembered."""
    return dtype.name


def leaf_type(x: Any) -> str | None:
    """The manifest `type` of a leaf the default filter spec saves, else `None`."""
    if isinstance(x, jax.Array):
        return "prng_key" if is_prng_key(x) else "jax"
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, np.generic):
        return "numpy_scalar"
    # In this order: a bool is also an int. Subclasses (IntEnum, say) count as their base.
    for cls, (name, _) in _PYTHON_SCALARS.items():
        if isinstance(x, cls):
            return name
    return None


@_state.memo(256)
def stored_dtype(dtype: np.dtype) -> tuple[str, str]:
    """(stored dtype name, encoding) for an array of `dtype`."""
    if dtype.name in NATIVE_DTYPES:
        return dtype.name, "plain"
    return f"uint{8 * dtype.itemsize}", "view"


def python_scalar_array(x: Any) -> np.ndarray:
    """A Python scalar as a 0-d array; floats are float64 so nothing is lost."""
    name = leaf_type(x)
    _, np_type = next(v for v in _PYTHON_SCALARS.values() if v[0] == name)
    if name == "int" and not (-(2**63) <= x < 2**63):
        raise OverflowError(f"the int {x} does not fit in int64")
    return np.asarray(x, dtype=np_type)


def encode(array: np.ndarray, encoding: str) -> np.ndarray:
    """Host bytes as they are stored (a view, never a copy)."""
    if encoding == "view":
        return array.view(np.dtype(f"uint{8 * array.dtype.itemsize}"))
    return array


def decode(array: np.ndarray, record: Any) -> np.ndarray:
    if record.encoding == "view":
        return array.view(dtype_from_name(record.dtype))
    return array


def check_cast(array: np.ndarray, dtype: Any) -> None:
    """`ValueError` where `checked_cast(array, dtype)` would raise it, nothing
    kept: a save checks before it writes, and casts again as it stages."""
    if np.dtype(dtype) == array.dtype:
        return
    if array.ndim == 0 or array.nbytes <= CHECK_BYTES:
        checked_cast(array, dtype)
        return
    rows = max(1, CHECK_BYTES // max(1, array[0].nbytes))
    for start in range(0, array.shape[0], rows):
        checked_cast(array[start : start + rows], dtype)


# The block of a cast's values checked at a time (`check_cast`).
CHECK_BYTES = 16 << 20


def stored_values(dtype: np.dtype, encoding: str, array: np.ndarray) -> np.ndarray:
    """`checked_cast` then `encode`, for values `check_cast` has checked."""
    if array.dtype != dtype:
        if _kind(array.dtype) == "c" and _kind(dtype) != "c":
            array = np.real(array)
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(dtype)
    return encode(array, encoding)


def checked_cast(array: np.ndarray, dtype: Any) -> np.ndarray:
    """`array` converted to `dtype`, or `ValueError` where a value would change
    beyond rounding: out of range, a fraction or NaN into an integer, infinity
    or NaN into a type without them, an imaginary part into a real type."""
    target = np.dtype(dtype)
    if array.dtype == target:
        return array
    source = _kind(array.dtype)
    goal = _kind(target)
    if source == "c" and goal != "c":
        if array.size and np.any(np.imag(array) != 0):
            raise ValueError(f"{array.dtype} values with an imaginary part cannot become {target}")
        array = np.real(array)
        source = _kind(array.dtype)
    if goal in "biu" and array.size:
        _check_integer_range(array, source, target)
    with np.errstate(over="ignore", invalid="ignore"):
        out = array.astype(target)
    if goal in "fc" and array.size:
        if goal == "c":
            _check_float_range(np.real(array), np.real(out), target)
            _check_float_range(np.imag(array), np.imag(out), target)
        else:
            _check_float_range(array, out, target)
    return out


def _check_float_range(before: np.ndarray, after: np.ndarray, target: np.dtype) -> None:
    """`ValueError` unless each value of `after` is that of `before` rounded.
    A cast does more: overflow gives infinity, NaN or the largest value, by
    type; infinity and NaN become numbers in types without them;
    `float8_e8m0fnu` makes negatives NaN. Compared in float64 a block at a time,
    so a large leaf is never held twice in float64."""
    before, after = np.ravel(before), np.ravel(after)
    limit = _overflow_limit(target)
    for lo in range(0, before.size, _CHECK_BLOCK):
        with np.errstate(over="ignore", invalid="ignore"):
            values = before[lo : lo + _CHECK_BLOCK].astype(np.float64)
            got = after[lo : lo + _CHECK_BLOCK].astype(np.float64)
        finite = np.isfinite(values)
        changed = (np.isnan(values) != np.isnan(got)) | (np.isinf(values) & (got != values))
        changed |= finite & (~np.isfinite(got) | (np.abs(values) >= limit))
        changed |= finite & (values < 0) & (got > 0)
        if np.any(changed):
            value = before[lo : lo + _CHECK_BLOCK][changed].flat[0].item()
            raise ValueError(f"the value {value!r} is beyond the range of {target}")


# Elements compared at a time by `_check_float_range` (two float64 blocks of 8 MiB).
_CHECK_BLOCK = 2**20


@_state.memo(64)
def _overflow_limit(target: np.dtype) -> float:
    """The largest finite value of `target`'s real part plus half its spacing:
    from there on a value no longer rounds to it."""
    real = np.dtype(np.real(np.zeros(1, target)).dtype)
    info = ml_dtypes.finfo(real)
    largest = float(info.max)
    with np.errstate(over="ignore"):
        return float(np.float64(largest) + np.float64(2.0 ** (math.floor(math.log2(largest)) - int(info.nmant) - 1)))


def _kind(dtype: np.dtype) -> str:
    # ml_dtypes' types report kind 'V' in NumPy: 2- and 4-bit integers, and floats.
    if dtype.kind != "V":
        return dtype.kind
    return "u" if dtype.name.startswith("uint") else "i" if dtype.name.startswith("int") else "f"


def _check_integer_range(array: np.ndarray, source: str, target: np.dtype) -> None:
    if target.kind == "b":
        if source != "b" and np.any((array != 0) & (array != 1)):
            raise ValueError(f"only 0 and 1 become {target} unchanged; the values include others")
        return
    info = ml_dtypes.iinfo(target)
    if source == "b":
        return
    if source == "f":
        _check_whole_numbers(array, target, info)
        return
    low_i, high_i = int(np.min(array)), int(np.max(array))
    if low_i < int(info.min) or high_i > int(info.max):
        shown_i = low_i if low_i < int(info.min) else high_i
        raise ValueError(f"the value {shown_i} does not fit in {target} ([{info.min}, {info.max}])")


def _check_whole_numbers(array: np.ndarray, target: np.dtype, info: Any) -> None:
    """`ValueError` unless every value of the float `array` is a whole number
    within `target`'s range: dropping a fraction is not rounding (SPEC: "Values
    are never changed silently"). A block at a time, as `_check_float_range`."""
    flat = np.ravel(array)
    for lo in range(0, flat.size, _CHECK_BLOCK):
        block = flat[lo : lo + _CHECK_BLOCK]
        values = block.astype(np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"NaN or infinity cannot become {target}")
        fraction = values != np.trunc(values)
        if np.any(fraction):
            raise ValueError(fraction_message(block[fraction][0], str(target)))
        low, high = float(np.min(values)), float(np.max(values))
        # Both bounds as exact powers of two, so the comparison is exact in floats.
        if low < float(info.min) or high >= float(info.max) + 1:
            shown = low if low < float(info.min) else high
            raise ValueError(f"the value {shown!r} does not fit in {target} ([{info.min}, {info.max}])")


def fraction_message(value: Any, target: str) -> str:
    """Why a float `value` with a fraction cannot become the integer type `target`."""
    return (
        f"the value {value!s} is not a whole number, so {target} cannot hold it (a cast to an integer type "
        f"never drops a fraction; round the values first, in a `transform` say, if that is meant)"
    )


def is_floating(dtype: np.dtype) -> bool:
    """Whether `dtype` is a real floating type (bfloat16 and float8 types included)."""
    return _kind(dtype) == "f"


def x64_missing(dtype: Any) -> bool:
    """Whether `dtype` is 64-bit while JAX's 64-bit mode is off (`jax.device_put`
    would silently narrow it)."""
    return _narrowed(np.dtype(dtype), bool(jax.config.read("jax_enable_x64")))


def x64_message(dtype: Any) -> str:
    """Why a JAX array of `dtype` (`x64_missing`) would change its values."""
    held = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name
    return (
        f"it holds {np.dtype(dtype)} values, and JAX's 64-bit mode is off, so a JAX array would hold them as "
        f"{held} and change them"
    )


@_state.memo(256)
def _narrowed(dtype: np.dtype, x64: bool) -> bool:
    return jax.dtypes.canonicalize_dtype(dtype) != dtype


@_state.memo(256)
def _str(dtype: Any) -> str:
    """`str(dtype)`, remembered (NumPy works it out anew each time)."""
    return str(dtype)


def like_type(like: Any) -> str | None:
    """What a leaf of `like` asks to be loaded as, or `None` if it is not loaded."""
    if isinstance(like, jax.ShapeDtypeStruct):
        return "prng_key" if is_prng_key(like) else "jax"
    return leaf_type(like)


def expected(like: Any) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) a loaded leaf must have to replace `like`."""
    if isinstance(like, np.ndarray):
        # `name`, not `str`: a big-endian float32 is '>f4' but still float32.
        return tuple(like.shape), like.dtype.name
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        return tuple(like.shape), _str(like.dtype)
    if isinstance(like, np.generic):
        return (), like.dtype.name
    return (), ""


# The NumPy kinds of the stored values that a Python scalar `like` leaf holds exactly.
SCALAR_KINDS = types.MappingProxyType({"bool": "b", "int": "biu", "float": "biuf", "complex": "biufc"})
# ... and with `cast=True`, which then converts each value it holds exactly (the
# rule `checked_cast` applies to arrays: `5.0` into an `int`, not `5.7`).
_CAST_SCALAR_KINDS = types.MappingProxyType({"bool": "biuf", "int": "biuf", "float": "biuf", "complex": "biufc"})


def compatible(record: Any, like: Any, *, cast: bool = False) -> str | None:
    """Why the stored leaf cannot replace `like` (dtype aside), or `None`."""
    kind = like_type(like)
    if kind == "prng_key" and record.type != "prng_key":
        return f"`like` holds a PRNG key array ({like.dtype}) but the checkpoint holds a plain {record.dtype} array"
    if kind != "prng_key" and record.type == "prng_key":
        return f"the checkpoint holds a PRNG key array ({record.dtype}) but `like` holds {type(like).__name__}"
    if kind in ("bool", "int", "float", "complex"):
        allowed = (_CAST_SCALAR_KINDS if cast else SCALAR_KINDS)[kind]
        if record.shape != () or _kind(dtype_from_name(record.dtype)) not in allowed:
            return (
                f"`like` holds a Python {kind} but the checkpoint holds a {record.dtype} array of shape {record.shape}"
            )
    return None


def to_result(array: np.ndarray, like: Any, *, sharding: Any = None) -> Any:
    """A host array (already decoded) as the type `like` asks for; `ValueError`
    if `like` is a Python scalar that cannot hold its value exactly."""
    if isinstance(like, np.ndarray):
        return array
    if isinstance(like, np.generic):
        return type(like)(array[()])
    if isinstance(like, (bool, int, float, complex)):
        value = array.item()
        if type(like) is not bool and isinstance(like, int) and isinstance(value, float):
            # As `checked_cast` into an integer array: no fraction is dropped.
            if not math.isfinite(value):
                raise ValueError(f"NaN or infinity cannot become a Python {type(like).__name__}")
            if not value.is_integer():
                raise ValueError(fraction_message(array[()], f"a Python {type(like).__name__}"))
        try:
            out = type(like)(value)
        except TypeError:  # a complex value into an int or a float
            raise ValueError(f"{value!r} has an imaginary part") from None
        # An integer beyond 2**53 into a float, a fraction into an int, 2 into a
        # bool: each would change (NaN stays NaN, and is not equal to itself).
        if out != value and not (out != out and value != value):
            raise ValueError(f"{value!r} would become {out!r}")
        return out
    # `device_put` makes one copy; `jnp.asarray` of a NumPy array briefly holds two.
    return jax.device_put(array, sharding)


def keep_weak_type(value: Any, like: Any) -> Any:
    """`value` weakly typed if `like`'s leaf is, so that a `jax.jit` traced with
    `like` is not traced again for the loaded tree (Equinox drops the flag)."""
    if not (getattr(like, "weak_type", False) and isinstance(value, jax.Array)) or value.weak_type:
        return value
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # a JAX without it: the value is right, only the flag is lost
        return value
    return _convert_element_type(value, weak_type=True)


@_state.memo(32)
def key_data_shape(impl: str) -> tuple[int, ...] | None:
    """The key data shape of one PRNG key of `impl` ("threefry2x32": `(2,)`),
    or `None` if JAX has no such implementation."""
    try:
        key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        return tuple(jax.eval_shape(jax.random.key_data, key).shape)
    except Exception:
        return None
