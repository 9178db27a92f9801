"""`transform`: stored arrays -> the array a leaf of `like` expects.

For layouts that differ between frameworks (a PyTorch conv bias is `(out,)`,
Equinox's `(out, 1, 1)`; PyTorch packs the query, key and value projections of
attention into one tensor). A transformed leaf is read whole on the host,
passed through its function, checked against `like`, then placed like any other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _dtypes, _memory, _read, _storage_errors, _window
from ._errors import CheckpointValueError, LeafError, leaf_message
from ._format import LeafRecord
from ._lazy import LazyArray

if TYPE_CHECKING:
    from ._source import Source

Transform = Callable[..., Any]


def finder(transform: Any) -> Callable[[str], Transform | None]:
    """`transform` as a function from a dotted path of `like` to its function.

    A mapping names exact dotted paths; a list of `(pattern, function)` rules
    picks the first rule whose pattern is found in the path (`re.search`).
    """
    if transform is None:
        return lambda path: None
    if isinstance(transform, Mapping):
        table = dict(transform)
        for key, fn in table.items():
            if not isinstance(key, str) or not callable(fn):
                raise CheckpointValueError(
                    f"`transform` maps {key!r} to {fn!r}; it must map dotted paths to functions."
                )
        return table.get
    if isinstance(transform, Sequence) and not isinstance(transform, str):
        rules = []
        for rule in transform:
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and callable(rule[1])):
                raise CheckpointValueError(
                    f"`transform` rules must be `(pattern, function)` pairs, like "
                    f"`(r'conv\\.bias$', lambda b: b[:, None, None])`; got {rule!r}."
                )
            try:
                rules.append((re.compile(rule[0]), rule[1]))
            except (re.error, TypeError) as e:
                raise CheckpointValueError(f"`transform` rule {rule[0]!r} is not a regular expression: {e}.") from None
        return lambda path: next((fn for pattern, fn in rules if pattern.search(path)), None)
    raise CheckpointValueError(
        f"`transform` must be a mapping from dotted paths of `like` to functions, or a list of "
        f"`(pattern, function)` rules, not {type(transform).__name__}."
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One leaf of `like` made by a function of one or more stored arrays."""

    index: int
    keypath: tuple[Any, ...]
    like: Any
    stored: tuple[str, ...]
    records: tuple[LeafRecord, ...]
    fn: Transform


def plan(
    index: int, keypath: tuple[Any, ...], like: Any, stored: str | tuple[str, ...], fn: Transform | None,
    records: dict[str, LeafRecord], *, missing: str,
) -> tuple[Plan | None, str]:  # fmt: skip
    """The plan of a leaf made by `fn` from one or more stored arrays, or why not."""
    names = stored if isinstance(stored, tuple) else (stored,)
    if fn is None:
        return None, f"`rename` gives {len(names)} stored paths ({', '.join(names)}) but no `transform` combines them."
    absent = [name for name in names if name not in records]
    if absent:
        return None, f"missing: {', '.join(absent)} not in the checkpoint." if missing == "error" else ""
    if _dtypes.like_type(like) is None:
        return None, ""
    return Plan(index, keypath, like, names, tuple(records[n] for n in names), fn), ""


def shown(stored: str | tuple[str, ...]) -> str:
    """How messages name the stored path(s) of a transformed leaf."""
    return ", ".join(stored) if isinstance(stored, tuple) else stored


def load(source: Source, plans: list[Plan], *, cast: bool, lazy: bool) -> tuple[list[Any], list[tuple[Plan, str]]]:
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
    problems: list[tuple[Plan, str]] = []

    def finish(i: int, reads: list[Any]) -> None:
        plan = plans[i]
        arrays = []
        for record, future in zip(plan.records, reads):
            try:
                arrays.append(_dtypes.decode(future.result(), record))
            except Exception as e:
                raise _storage_errors.leaf_io_error(e, record, source.data, "read") from e
        try:
            out = np.asarray(plan.fn(*arrays))
        except Exception as e:
            problems.append((plan, f"its `transform` raised {type(e).__name__}: {e}."))
            return
        values[i], problem = finish_value(out, plan.like, cast)
        if problem:
            problems.append((plan, problem))

    def start(plan: Plan) -> list[Any]:
        return [_start(source, record) for record in plan.records]

    # The stored arrays of a plan are read ahead of the transform that consumes them.
    jobs = ((i, sum(r.nbytes for r in plan.records), functools.partial(start, plan)) for i, plan in enumerate(plans))
    for i, _, reads in _window.windowed(jobs):
        finish(i, reads)
    return values, problems


def _start(source: Source, record: LeafRecord) -> Any:
    _memory.refuse_beyond_memory(source.data, record, record.nbytes, "it")
    try:
        store = source.open(record).result()
    except Exception as e:
        raise _storage_errors.leaf_io_error(e, record, source.data, "open") from e
    return store.read()


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

    def __init__(self, source: Source, plan: Plan, *, cast: bool):
        super().__init__(source.data, plan.records[0], plan.like, opener=source.opener, check=source.check)
        self._parts = tuple(LazyArray(source.data, r, opener=source.opener, check=source.check) for r in plan.records)
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

    def _value(self) -> np.ndarray:
        arrays = [np.asarray(part) for part in self._parts]
        try:
            out, problem = checked(np.asarray(self._fn(*arrays)), self._like, self._cast)
        except Exception as e:
            out, problem = np.empty(0), f"its `transform` raised {type(e).__name__}: {e}."
        if problem:
            raise self._error(problem)
        return out

    def _error(self, problem: str) -> LeafError:
        message = leaf_message(problem, keypath=self._keypath, dotted=self.path, path=self._loc.display)
        return LeafError(message, path=self._loc.display, keypaths=[self._keypath], dotted=[self.path])

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._value()[index]

    def start(self, *, checked: bool = True) -> Any:
        def finish() -> Any:
            value, problem = finish_value(self._value(), self._like, self._cast)
            if problem:
                raise self._error(problem)
            return value

        return finish
