"""Test arrays of any dtype, filled so that every byte matters."""

from __future__ import annotations

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
