"""Test arrays of any dtype, filled so that every byte matters."""

from __future__ import annotations

import mmap

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
