"""Test arrays of any dtype, filled so that every byte matters."""

from __future__ import annotations

import mmap

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
