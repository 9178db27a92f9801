"""`transform`: stored arrays -> the array a leaf of `like` expects.

For layouts that differ between frameworks (a PyTorch conv bias is `(out,)`,
Equinox's `(out, 1, 1)`; PyTorch packs the query, key and value projections of
attention into one tensor). A transformed leaf is read whole on the host,
passed through its function, checked against `like`, then placed like any other.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _dtypes, _io, _read
from ._errors import CheckpointValueError
from ._manifest import LeafRecord

Transform = Callable[..., Any]

# Bytes of stored arrays read ahead of the transform that consumes them.
READ_WINDOW = 128 * 2**20


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


def load(source: Any, plans: list[Plan], *, cast: bool) -> tuple[list[Any], list[tuple[Plan, str]]]:
    """Read, transform and check every plan; returns the values (`None` where a
    problem was found) and the problems, to be reported together."""
    values: list[Any] = [None] * len(plans)
    problems: list[tuple[Plan, str]] = []
    window: collections.deque[tuple[int, int, list[Any]]] = collections.deque()
    in_flight = 0

    def finish() -> None:
        nonlocal in_flight
        i, size, reads = window.popleft()
        in_flight -= size
        plan = plans[i]
        arrays = []
        for record, future in zip(plan.records, reads):
            try:
                arrays.append(_dtypes.decode(future.result(), record))
            except Exception as e:
                raise _io.leaf_io_error(e, record, source.data, "read") from e
        try:
            out = np.asarray(plan.fn(*arrays))
        except Exception as e:
            problems.append((plan, f"its `transform` raised {type(e).__name__}: {e}."))
            return
        values[i], problem = _finish(out, plan.like, cast)
        if problem:
            problems.append((plan, problem))

    for i, plan in enumerate(plans):
        size = sum(record.nbytes for record in plan.records)
        while window and in_flight + size > READ_WINDOW:
            finish()
        window.append((i, size, [_start(source, record) for record in plan.records]))
        in_flight += size
    while window:
        finish()
    return values, problems


def _start(source: Any, record: LeafRecord) -> Any:
    _io.refuse_beyond_memory(source.data, record, record.nbytes, "it")
    try:
        store = source.open(record).result()
    except Exception as e:
        raise _io.leaf_io_error(e, record, source.data, "open") from e
    return store.read()


def _finish(out: np.ndarray, like: Any, cast: bool) -> tuple[Any, str]:
    shape, dtype = _dtypes.expected(like)
    kind = _dtypes.like_type(like)
    if tuple(out.shape) != shape:
        return None, f"after its `transform` the shape is {tuple(out.shape)}, but `like` has {shape}."
    if kind in ("jax", "numpy", "numpy_scalar") and out.dtype.name != dtype:
        if not cast:
            return None, (
                f"after its `transform` the dtype is {out.dtype.name}, but `like` has {dtype} (pass `cast=True` "
                f"to convert, or convert in the transform)."
            )
        out = out.astype(np.dtype(like.dtype))
    return _dtypes.to_result(out, like, sharding=_read.target_sharding(like)), ""
