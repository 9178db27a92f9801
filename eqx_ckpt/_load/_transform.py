"""`transform`: stored arrays -> the array a leaf of `like` expects.

For layouts that differ between frameworks (a PyTorch conv bias is `(out,)`,
Equinox's `(out, 1, 1)`; PyTorch packs the query, key and value projections of
attention into one tensor). A transformed leaf is read whole on the host,
passed through its function, checked against `like`, then placed like any other.
Which leaves are transformed, and from which stored arrays, the load plan says
(`_load_plan.TransformPlan`; the option is parsed by `_select.finder`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from .._base._errors import LeafError, leaf_message
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord
from .._store import _memory, _storage_errors, _window
from . import _family, _read
from ._lazy import LazyArray

if TYPE_CHECKING:
    from ._load_plan import TransformPlan
    from ._source import Source


# A problem of a transformed leaf: its plan, what is wrong, and the exception the
# `transform` raised (`None` if it returned a value that does not fit).
Problem: TypeAlias = "tuple[TransformPlan, str, Exception | None]"


def load(source: Source, plans: list[TransformPlan], *, cast: bool, lazy: bool) -> tuple[list[Any], list[Problem]]:
    """Read, transform and check every plan; returns the values (`None` where a
    problem was found) and the problems, to be reported together. With `lazy`,
    array leaves become `TransformedArray`s, read and transformed when asked."""
    if lazy:
        arrays = [i for i, plan in enumerate(plans) if _dtypes.like_type(plan.like) in ("jax", "numpy")]
        now, found = load(source, [p for i, p in enumerate(plans) if i not in arrays], cast=cast, lazy=False)
        eager = iter(now)
        lazies = {i: TransformedArray(source, plans[i], cast=cast) for i in arrays}
        return [lazies[i] if i in lazies else next(eager) for i in range(len(plans))], found
    values: list[Any] = [None] * len(plans)
    problems: list[Problem] = []

    def finish(i: int, reads: list[Any]) -> None:
        plan = plans[i]
        arrays = []
        for record, read in zip(plan.records, reads):
            try:
                arrays.append(_dtypes.decode(read(), record))
            except Exception as e:
                raise _storage_errors.leaf_io_error(e, record, source.data, "read") from e
        try:
            out = np.asarray(plan.fn(*arrays))
        except Exception as e:
            problems.append((plan, _raised(e), e))
            return
        values[i], problem = finish_value(out, plan.like, cast)
        if problem:
            problems.append((plan, problem, None))

    def start(plan: TransformPlan) -> list[Any]:
        return [_start(source, record) for record in plan.records]

    # The stored arrays of a plan are read ahead of the transform that consumes them.
    jobs = ((i, sum(r.nbytes for r in plan.records), functools.partial(start, plan)) for i, plan in enumerate(plans))
    for i, _, reads in _window.windowed(jobs):
        finish(i, reads)
    return values, problems


def _start(source: Source, record: LeafRecord) -> Callable[[], np.ndarray]:
    """Start reading a stored array of a transformed leaf whole (`_read.start_region`)."""
    _memory.refuse_beyond_memory(source.data, record, record.nbytes, "it")
    try:
        store = source.open(record).result()
    except Exception as e:
        raise _storage_errors.leaf_io_error(e, record, source.data, "open") from e
    finish = _read.start_region(store, source.data, record)
    check = _family.checker(source, record)
    if check is None:
        return finish

    def checked() -> np.ndarray:
        array = finish()
        check(array)
        check.result()
        return array

    return checked


def _raised(e: Exception) -> str:
    """The problem of a leaf whose `transform` raised `e` (which the error chains)."""
    return f"its `transform` raised {type(e).__name__}: {e}."


def finish_value(out: np.ndarray, like: Any, cast: bool) -> tuple[Any, str]:
    """The transformed array as `like`'s type and placement, or a problem."""
    out, problem = checked(out, like, cast)
    if problem:
        return None, problem
    try:
        return _dtypes.to_result(out, like, sharding=_read.target_sharding(like)), ""
    except ValueError as e:
        return None, f"after its `transform`, `like`'s Python {type(like).__name__} cannot hold it exactly: {e}."


def checked(out: np.ndarray, like: Any, cast: bool) -> tuple[np.ndarray, str]:
    shape, dtype = _dtypes.expected(like)
    kind = _dtypes.like_type(like)
    if tuple(out.shape) != shape:
        return out, f"after its `transform` the shape is {tuple(out.shape)}, but `like` has {shape}."
    if kind in ("jax", "numpy", "numpy_scalar") and out.dtype.name != dtype:
        if not cast:
            return out, (
                f"after its `transform` the dtype is {out.dtype.name}, but `like` has {dtype} (pass `cast=True` "
                f"to convert, or convert in the transform)."
            )
        try:
            out = _dtypes.checked_cast(out, np.dtype(like.dtype))
        except ValueError as e:
            return out, f"after its `transform` it cannot become {np.dtype(like.dtype)}: {e}."
    if kind == "jax" and _dtypes.x64_missing(out.dtype):
        # `jax.device_put` would wrap or round it, as `_read.refuse_narrowing` says of a stored leaf.
        return out, (
            f"after its `transform` {_dtypes.x64_message(out.dtype)}. Enable it "
            f"(`jax.config.update('jax_enable_x64', True)`), or load into a NumPy `like` leaf."
        )
    return out, ""


class TransformedArray(LazyArray):
    """A lazy leaf made by a `transform` of stored arrays. It has `like`'s shape
    and dtype; reading any of it reads the stored arrays whole and transforms them
    (a function of the whole array cannot be read in slices)."""

    __slots__ = ("_cast", "_fn", "_keypath", "_parts")

    def __init__(self, source: Source, plan: TransformPlan, *, cast: bool):
        super().__init__(source, plan.records[0], plan.like)
        self._parts = tuple(LazyArray(source, r) for r in plan.records)
        self._fn, self._cast, self._keypath = plan.fn, cast, plan.keypath

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._like.shape)

    @property
    def dtype(self) -> Any:
        return np.dtype(self._like.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"TransformedArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"

    def _host(self) -> np.ndarray:
        """The transformed value, checked against `like` (its stored arrays read whole)."""
        arrays = [np.asarray(part) for part in self._parts]
        try:
            made = np.asarray(self._fn(*arrays))
        except Exception as e:
            raise self._error(_raised(e)) from e
        out, problem = checked(made, self._like, self._cast)
        if problem:
            raise self._error(problem)
        return out

    def _error(self, problem: str) -> LeafError:
        message = leaf_message(problem, keypath=self._keypath, dotted=self.path, path=self._loc.display)
        return LeafError(message, path=self._loc.display, keypaths=[self._keypath], dotted=[self.path])

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._host()[index]

    def start(self, *, checked: bool = True) -> Any:
        def finish() -> Any:
            value, problem = finish_value(self._host(), self._like, self._cast)
            if problem:
                raise self._error(problem)
            return value

        return finish
