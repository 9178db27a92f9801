"""Which leaves are saved, how each kind is encoded as a zarr array, and how it
comes back as the type of `like`'s leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._spec import NATIVE_DTYPES, dtype_from_name

_PYTHON_SCALARS = {
    bool: ("bool", np.bool_),
    int: ("int", np.int64),
    float: ("float", np.float64),
    complex: ("complex", np.complex128),
}
_ALL_NAMES = NATIVE_DTYPES | {"uint2", "uint4", "float8_e4m3"}


def is_known_dtype(name: str) -> bool:
    return name in _ALL_NAMES


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


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
        return tuple(like.shape), str(like.dtype)
    if isinstance(like, np.generic):
        return (), like.dtype.name
    return (), ""


def compatible(record: Any, like: Any) -> str | None:
    """Why the stored leaf cannot replace `like` (dtype aside), or `None`."""
    kind = like_type(like)
    if kind == "prng_key" and record.type != "prng_key":
        return f"`like` holds a PRNG key array ({like.dtype}) but the checkpoint holds a plain {record.dtype} array"
    if kind != "prng_key" and record.type == "prng_key":
        return f"the checkpoint holds a PRNG key array ({record.dtype}) but `like` holds {type(like).__name__}"
    if kind in ("bool", "int", "float", "complex"):
        allowed = {"bool": "b", "int": "biu", "float": "biuf", "complex": "biufc"}[kind]
        stored = dtype_from_name(record.dtype)
        # bfloat16 and float8 types report kind 'V' in NumPy; they are floats.
        code = "f" if stored.kind == "V" else stored.kind
        if record.shape != () or code not in allowed:
            return (
                f"`like` holds a Python {kind} but the checkpoint holds a {record.dtype} array of shape {record.shape}"
            )
    return None


def to_result(array: np.ndarray, like: Any, *, sharding: Any = None) -> Any:
    """A host array (already decoded) as the type `like` asks for."""
    if isinstance(like, np.ndarray):
        return array
    if isinstance(like, np.generic):
        return type(like)(array[()])
    if isinstance(like, (bool, int, float, complex)):
        return type(like)(array.item())
    # `device_put` makes one copy; `jnp.asarray` of a NumPy array briefly holds two.
    return jax.device_put(array, sharding)


def wrap_keys(data: jax.Array, impl: str) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl)
