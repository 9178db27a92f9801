"""Test arrays of any dtype, filled so that every byte matters."""

from __future__ import annotations

import mmap

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


def values(shape, dtype, seed: int = 0) -> np.ndarray:
    """Random values of `dtype` (bools, small integers, complex or normal floats)."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100, 100, shape).astype(dtype)
    if np.dtype(dtype).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def in_a_mapping(array: np.ndarray) -> bool:
    """Whether `array`'s memory belongs to an `mmap` (through any views of it)."""
    owner = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return isinstance(getattr(owner, "obj", owner), mmap.mmap)


# A data-parallel training state for the multi-process tests: every leaf held
# by every process. Saved with `_format.CHUNK_BYTES = STATE_CHUNK_BYTES` and
# `_sharding.SPLIT_BYTES = STATE_SPLIT_BYTES`, so that a few hundred KiB make
# leaves of many chunks.
STATE_CHUNK_BYTES = 64 << 10
STATE_SPLIT_BYTES = 32 << 10


def replicated_state() -> dict[str, dict[str, np.ndarray]]:
    """The state's values, by group: "large", leaves of several chunks (split
    between the processes; "columns" is sharded by columns over each process's
    devices, each column shard held by every process); "single", one chunk
    above the split threshold; "small", leaves under it."""
    large = {
        "rows": values((1024, 128), np.float32, 1),  # 8 chunks of 128 rows
        "deep": values((2, 2048, 32), np.float32, 2),  # 2 x 4 chunks: split along axis 1
        "half": values((1536, 96), ml_dtypes.bfloat16, 3),  # 8 chunks
        "odd": values((300, 256), np.int32, 4),  # 8 chunks of 38 rows, the last of 34
        "columns": values((512, 128), np.float32, 5),
    }
    small = {f"s{i}": values((16, 8 + i), np.float32, 10 + i) for i in range(8)}
    small["count"] = np.asarray(7, np.int32)
    return {"large": large, "single": {"w": values((128, 128), np.float32, 6)}, "small": small}


def bits(x):
    """A leaf as what must come back exactly: its type, dtype, shape and bytes
    (a NaN's payload, -0.0, bfloat16's bits, a PRNG key's implementation and
    key data); other leaves as themselves."""
    import jax

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), x.shape, np.asarray(jax.random.key_data(x)).tobytes())
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        array = np.asarray(x)
        return (type(x), array.dtype.name, array.shape, array.tobytes())
    return (type(x), x)


def tree_equal(*trees, typematch: bool = False, rtol=0.0, atol=0.0):
    """`eqx.tree_equal`, with each pair of JAX arrays compared on the host.

    The answer is the same: the structures, each leaf's type (`typematch`),
    each array's shape and dtype, then its values (equal, or within
    `rtol`/`atol` for inexact dtypes). But no comparison is compiled: JAX
    compiles one for each dtype and shape it meets, most of the seconds of
    a test comparing a tree of many. A leaf that is not a concrete array (a
    scalar, `None`, an object, a tracer) is compared by `eqx.tree_equal`."""
    flat, treedef = jax.tree.flatten(trees[0])
    for tree in trees[1:]:
        other, other_def = jax.tree.flatten(tree)
        if other_def != treedef:
            return False
        for x, y in zip(flat, other):
            if typematch and type(x) is not type(y):
                return False
            if _concrete(x) and _concrete(y):
                if x.shape != y.shape or x.dtype != y.dtype:
                    return False
                if not _host_equal(_host(x), _host(y), rtol, atol):
                    return False
            elif not eqx.tree_equal(x, y, typematch=typematch, rtol=rtol, atol=atol):
                return False
    return True


def _concrete(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def _host(x) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _host_equal(x: np.ndarray, y: np.ndarray, rtol, atol) -> bool:
    if (rtol == 0 and atol == 0) or not jnp.issubdtype(x.dtype, jnp.inexact):
        return bool(np.all(x == y))
    wide = np.complex128 if jnp.issubdtype(x.dtype, jnp.complexfloating) else np.float64
    return bool(np.allclose(x.astype(wide), y.astype(wide), rtol=rtol, atol=atol))
