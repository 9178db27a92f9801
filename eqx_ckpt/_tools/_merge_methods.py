"""The merge methods, as pure functions on blocks of NumPy arrays, and a
merge's options checked against them (`checked`); `_merge` reads the blocks
and writes the result.

A block holds consecutive elements of one leaf of every input, flattened,
in the accumulator dtype (`accumulator`): float32 for float16, bfloat16 and
float32 inputs, float64 for float64. Sums run in input order. What needs
the whole leaf is worked out first, over its blocks, and passed to every
block: TIES's threshold per input (`kth_largest`, exact: a selection among
the leaf's magnitudes as integers), SLERP's angle (`slerp_coefficients`, in
float64). DARE's random drops depend only on the key, the leaf's path, the
input and the element's index (`kept`), so no block size changes a byte.

The definitions follow mergekit's (Goddard et al. 2024): TIES is Yadav et
al. 2023 (trim, elect the sign, disjoint mean), DARE is Yu et al. 2023 (drop
with probability `1 - density`, rescale by `1 / density`); `dare_ties` and
`dare_linear` sum the kept differences without dividing by the weights, as
mergekit does by default. docs/sharing.md ("Merging") has the formulas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import os
import types
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._base import _state
from .._base._errors import CheckpointTypeError, CheckpointValueError, option

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp")
# The methods that add differences from a base.
WITH_BASE = frozenset(("task_arithmetic", "ties", "dare_linear", "dare_ties"))
WITH_DENSITY = frozenset(("ties", "dare_linear", "dare_ties"))
RANDOM = frozenset(("dare_linear", "dare_ties"))
# SLERP blends linearly where the two leaves' cosine is above this in
# magnitude (mergekit's `DOT_THRESHOLD`), or where either's norm is at most `NORM_EPS`.
DOT_THRESHOLD = 0.9995
NORM_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class Method:
    """A merge's method and options, checked (`_merge`). `seed`: DARE's key as an int."""

    name: str
    weights: tuple[float, ...]
    density: float | None = None
    t: float | None = None
    seed: int = 0


def checked(name: Any, inputs: Any, weights: Any, base: Any, density: Any, t: Any, key: Any) -> Method:
    """The options checked against the method, as one `Method`."""
    if name not in METHODS:
        raise CheckpointValueError(f"`method` must be one of {', '.join(map(repr, METHODS))}; not {name!r}.")
    if isinstance(inputs, (str, bytes, os.PathLike)) or not isinstance(inputs, Sequence) or not inputs:
        raise CheckpointTypeError(f"`inputs` must be a non-empty list of paths (`['a', 'b']`), not {inputs!r}.")
    if name == "slerp" and len(inputs) != 2:
        raise CheckpointValueError(f'`method="slerp"` merges two inputs; {len(inputs)} were given.')
    _allowed(name, "base", base, WITH_BASE, "the model whose differences are merged")
    _allowed(name, "density", density, WITH_DENSITY, "the fraction of each difference kept, in (0, 1]")
    _allowed(name, "t", t, {"slerp"}, "where between the two inputs, from 0 to 1")
    _allowed(name, "weights", weights, set(METHODS) - {"slerp"}, "one number per input")
    _allowed(name, "key", key, RANDOM, "the random drops' key, an int or a JAX PRNG key", needed=False)
    if density is not None and not (_real(density) and 0 < density <= 1):
        raise CheckpointValueError(f"`density` must be a number in (0, 1] (the fraction kept), not {density!r}.")
    if t is not None and not (_real(t) and 0 <= t <= 1):
        raise CheckpointValueError(f"`t` must be a number from 0 to 1, not {t!r}.")
    checked = _weights(weights, len(inputs), name)
    return Method(name, checked, density, t, _seed(key))


def _allowed(name: str, keyword: str, value: Any, methods_: Any, meaning: str, *, needed: bool = True) -> None:
    """`keyword` given exactly where `name` uses it (`needed`: and must be)."""
    shown = option(f"`{keyword}`", "`--seed`" if keyword == "key" else f"`--{keyword}`")
    if value is not None and name not in methods_:
        raise CheckpointValueError(f'{shown} is not used by `method="{name}"`; leave it out.')
    if value is None and needed and name in methods_ and keyword != "weights":
        raise CheckpointValueError(f'`method="{name}"` needs {shown} ({meaning}).')


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _weights(weights: Any, count: int, name: str) -> tuple[float, ...]:
    if weights is None:
        return (1.0,) * count
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != count:
        raise CheckpointValueError(f"`weights` must be a list of {count} numbers, one per input; not {weights!r}.")
    if not all(_real(w) for w in weights):
        raise CheckpointValueError(f"`weights` must be finite numbers; not {list(weights)!r}.")
    if name == "linear" and sum(float(w) for w in weights) == 0:
        raise CheckpointValueError(f'`method="linear"` divides by the sum of `weights`, which is 0: {list(weights)!r}.')
    return tuple(float(w) for w in weights)


def _seed(key: Any) -> int:
    """DARE's key as an int: itself, or a JAX PRNG key's key data."""
    if key is None:
        return 0
    if isinstance(key, numbers.Integral) and not isinstance(key, bool) and int(key) >= 0:
        return int(key)
    if isinstance(key, jax.Array):
        data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        if jax.dtypes.issubdtype(data.dtype, np.unsignedinteger):
            return int.from_bytes(np.asarray(data).tobytes(), "little")
    raise CheckpointTypeError(f"`key` must be a non-negative int or a JAX PRNG key (`jax.random.key(0)`), not {key!r}.")


def accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype a leaf of `dtype` is merged in: float64 kept, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype).itemsize >= 8 else np.dtype(np.float32)


def linear(xs: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray | None = None) -> np.ndarray:
    """The weighted average: `sum(w_i * x_i) / sum(w_i)` (made in `out`, if given)."""
    return np.divide(weighted_sum(xs, weights), total(weights, xs[0].dtype.type), out=out)


def total(weights: Sequence[float], acc: type[np.floating]) -> np.floating:
    """The weights summed in `acc`, in order."""
    out = acc(0)
    for w in weights:
        out += acc(w)
    return out


def weighted_sum(xs: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """`sum(w_i * x_i)`, in input order (each product made in one scratch block)."""
    acc = xs[0].dtype.type
    total = acc(weights[0]) * xs[0]
    scratch = np.empty_like(total)
    for x, w in zip(xs[1:], weights[1:], strict=True):
        total += np.multiply(acc(w), x, out=scratch)
    return total


def combine(
    method: Method,
    xs: list[np.ndarray],
    base: np.ndarray | None,
    *,
    thresholds: Sequence[int] = (),
    coefficients: tuple[float, float] = (1.0, 0.0),
    seeds: Sequence[int] = (),
    start: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One block of the merged leaf (made in `out`, if given: an array of the
    block's size and dtype). What `_merge` worked out over the whole leaf
    first: `thresholds` (TIES), `coefficients` (SLERP), and for DARE `seeds`
    (one per input); `start`: the block's first element."""
    if method.name == "linear":
        return linear(xs, method.weights, out)
    acc = xs[0].dtype.type
    if method.name == "slerp":
        return np.add(acc(coefficients[0]) * xs[0], acc(coefficients[1]) * xs[1], out=out)
    if base is None:
        raise RuntimeError(f"Internal error: `method={method.name!r}` merged without a base.")
    # (Each difference is a new array of the block's: the steps below change it in place.)
    deltas = [np.subtract(x, base) for x in xs]
    if method.name == "task_arithmetic":
        return np.add(base, weighted_sum(deltas, method.weights), out=out)
    if method.name == "ties":
        scratch = np.empty_like(base)
        deltas = [trimmed(d, k, scratch) for d, k in zip(deltas, thresholds, strict=True)]
    else:
        density = method.density or 1.0
        deltas = [dropped(d, density, seed, start) for d, seed in zip(deltas, seeds, strict=True)]
    elect = method.name != "dare_linear"
    return np.add(base, disjoint(deltas, method.weights, elect=elect, mean=method.name == "ties"), out=out)


def disjoint(deltas: list[np.ndarray], weights: Sequence[float], *, elect: bool, mean: bool) -> np.ndarray:
    """The weighted differences summed: with `elect`, only those whose sign is
    the sign of their sum (0 counts as +; a zero difference has no sign); with
    `mean`, divided by the weights summed (of those kept; 1 where none is).
    `deltas` are weighted in place."""
    acc = deltas[0].dtype.type
    # (A weight of 1 changes no bit: a difference is made by arithmetic, so it is never a signalling NaN.)
    weighted = [d if w == 1 else np.multiply(acc(w), d, out=d) for d, w in zip(deltas, weights, strict=True)]
    if not elect:
        summed = weighted[0] * acc(1)
        for wd in weighted[1:]:
            summed += wd
        return summed / total(weights, acc) if mean else summed
    positive, negative = elected(weighted)
    agreeing = divisor = None
    product = np.empty_like(weighted[0])
    agree, opposite = np.empty(product.shape, bool), np.empty(product.shape, bool)
    for wd, w in zip(weighted, weights, strict=True):
        agreeing_ = _agreeing(wd, positive, negative, agree, opposite)
        if agreeing is None:  # (`0 + p`, as a sum from 0 makes it: -0 becomes 0)
            agreeing = np.add(np.multiply(wd, agreeing_, out=product), acc(0))
        else:
            agreeing += np.multiply(wd, agreeing_, out=product)
        if mean:  # (the divisor's zeros, whatever their sign, are made 1 below)
            if divisor is None:
                divisor = np.multiply(acc(w), agreeing_)
            else:
                divisor += np.multiply(acc(w), agreeing_, out=product)
    assert agreeing is not None
    if divisor is None:
        return agreeing
    # 1 where it is 0 (`divisor + (divisor == 0)`: a masked assignment takes ten times as long).
    np.add(divisor, np.equal(divisor, 0, out=agree), out=divisor)
    return np.divide(agreeing, divisor, out=agreeing)


def elected(weighted: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Where the sign elected is + (the weighted differences' sum at least 0), and where it is -."""
    summed = np.add(weighted[0], weighted[1]) if len(weighted) > 1 else weighted[0]
    for wd in weighted[2:]:
        summed += wd
    positive = np.greater_equal(summed, 0)
    return positive, np.logical_not(positive)


def _agreeing(
    wd: np.ndarray, positive: np.ndarray, negative: np.ndarray, agree: np.ndarray, opposite: np.ndarray
) -> np.ndarray:
    """Where `wd` has the sign elected (`np.sign(wd)` is +1 where + is, -1 where
    - is; never where it is 0 or NaN), made in `agree` (`opposite`: scratch)."""
    np.logical_and(np.greater(wd, 0, out=agree), positive, out=agree)
    np.logical_and(np.less(wd, 0, out=opposite), negative, out=opposite)
    return np.logical_or(agree, opposite, out=agree)


# The magnitude key of an infinity, by the accumulator's itemsize: every larger key is a NaN's.
_INFINITY = types.MappingProxyType(
    {4: int(np.float32(np.inf).view(np.uint32)), 8: int(np.float64(np.inf).view(np.uint64))}
)


def magnitude_keys(delta: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`|delta|` as unsigned integers of its width, in the same order (made in `out`, if given)."""
    return np.abs(delta, out=out).view(np.uint64 if delta.dtype.itemsize == 8 else np.uint32)


def trimmed(delta: np.ndarray, threshold: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """`delta` where its magnitude (`magnitude_keys`) is at least `threshold`,
    else 0, in place (`scratch`: an array of its shape and dtype to use).

    Made as `delta * kept` (a tenth of a masked copy's time) where every
    element dropped is finite, so that each is then 0, or -0 where it was
    negative: `disjoint` makes the same of both (no sign, summed to 0)."""
    keys = magnitude_keys(delta, scratch)
    if threshold <= _INFINITY[delta.dtype.itemsize]:
        return np.multiply(delta, np.greater_equal(keys, threshold), out=delta)
    np.copyto(delta, delta.dtype.type(0), where=keys < threshold)  # (an infinity may be dropped)
    return delta


def kept_count(density: float, size: int) -> int:
    """How many of a leaf's `size` differences TIES keeps: `int(density * size)`, at least 1."""
    return max(1, int(density * size))


def kth_largest(keys: np.ndarray, k: int) -> int:
    """The `k`-th largest (from 1) of the unsigned integers `keys` (0 where
    there are fewer), found by reordering `keys` in place (a selection, linear
    in their number)."""
    if k > keys.size:
        return 0
    at = keys.size - k
    keys.partition(at)
    return int(keys[at])


def seed(key: int, path: str, index: int) -> int:
    """The seed of DARE's drops of input `index`'s leaf at `path` under `key`."""
    digest = hashlib.blake2b(f"{key}\0{path}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@_state.memo(4)
def _strides(size: int) -> np.ndarray:
    """`j * 0x9E3779B97F4A7C15` (modulo 2**64) for `j` in `range(size)`, read-only."""
    out = np.arange(size, dtype=np.uint64)
    out *= np.uint64(_GOLDEN)
    out.flags.writeable = False
    return out


def kept(seed: int, start: int, size: int, density: float) -> np.ndarray:
    """Whether each element `start`, ..., `start + size - 1` is kept, with
    probability `density`: SplitMix64 of (seed, index), its top 53 bits below
    `density * 2**53`."""
    below = int(density * 2**53)
    if below >= 2**53:  # (density 1: every element)
        return np.ones(size, bool)
    # z = seed + (index + 1) * golden, as the sum of a fixed stride and this block's offset.
    z = _strides(size) + np.uint64((seed + (start + 1) * _GOLDEN) % 2**64)
    shifted = np.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        z ^= np.right_shift(z, np.uint64(shift), out=shifted)
        if multiplier is not None:
            z *= np.uint64(multiplier)
    return np.less(z, np.uint64(below << 11))  # (the top 53 bits below `below`)


def dropped(delta: np.ndarray, density: float, seed: int, start: int) -> np.ndarray:
    """`delta` with elements dropped (`kept`), the kept ones divided by `density` (in place)."""
    np.multiply(delta, kept(seed, start, delta.size, density), out=delta)
    return np.divide(delta, delta.dtype.type(density), out=delta)


def slerp_coefficients(dot: float, norm0: float, norm1: float, t: float) -> tuple[float, float]:
    """The weights of the two leaves' SLERP at `t`, from their dot product and
    norms (float64); linear (`1 - t`, `t`) where they are nearly parallel."""
    if norm0 <= NORM_EPS or norm1 <= NORM_EPS:
        return 1.0 - t, t
    cosine = dot / (norm0 * norm1)
    if abs(cosine) > DOT_THRESHOLD:
        return 1.0 - t, t
    theta = math.acos(cosine)
    return math.sin((1.0 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
