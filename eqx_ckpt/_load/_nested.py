"""Loading without a skeleton: a checkpoint (or a sub-tree of it) as nested dicts
and lists, built from the key paths the manifest records.

For inspecting a checkpoint, or converting one whose code is gone. The structure
comes from each leaf's recorded key path:

- Sequence indices become lists.
- Every other key (dict keys, attribute names) becomes a dict key.
- Keys of one container that cannot be sorted together (indices beside names,
  from a custom pytree node) become their names in dotted paths.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import _faults, _keypath
from .._base._errors import CheckpointValueError
from .._base._progress import Progress
from .._ondisk._format import SCALAR_TYPES, LeafRecord, dtype_from_name
from . import _reader
from ._lazy import LazyArray
from ._load_plan import LeafPlan
from ._rebuild import abstract
from ._source import Source


def load(source: Source, records: list[LeafRecord], key: str, *, lazy: bool, progress: Progress, numbered: bool) -> Any:
    """The leaves of `records` of `source` (all at or below dotted `key`) as
    nested containers, read as any load reads (`_reader.read_leaves`),
    or lazily. `numbered`: see `structure`."""
    data = source.data
    refuse_leaves_with_children([record.path for record in records], data.display)
    # One kind of array in one load: if a leaf saved from JAX cannot be a JAX
    # array at full precision (64 bits without x64), none of them is.
    host = any(_needs_host(dtype) for dtype in {record.dtype for record in records if record.type == "jax"})
    like = _Likes(host)
    _faults.fire("nested.load", data, key)
    source.need([record.path for record in records])  # (a fine-tune's base, before any read)
    if lazy:
        leaf = functools.partial(_lazy_leaf, source, like=like)
        return structure(records, key, leaf, numbered=numbered)
    plans = [LeafPlan.of(i, record, like(record)) for i, record in enumerate(records)]
    values = dict(zip((record.path for record in records), _reader.read_leaves(source, plans, progress=progress)))
    return structure(records, key, lambda record: values[record.path], numbered=numbered)


def structure(
    records: list[LeafRecord], key: str, leaf: Callable[[LeafRecord], Any], *, numbered: bool, names: bool = False
) -> Any:
    """`leaf(record)` for each record (all at or below dotted `key`), nested as
    their key paths say. `numbered`: the source's key paths do not say which
    keys index a sequence (safetensors names), so children named `0`, `1`, ...
    (contiguous from 0) are a list. `names`: dicts are keyed by dotted-path
    segments (escaped) rather than by the keys themselves."""
    depth = len(_keypath.split_dotted(key))
    if len(records) == 1 and records[0].path == key:
        return leaf(records[0])
    root = _Node()
    # Each key made once (the same few recur in every leaf's key path); by
    # value and type, so that `True` is never taken for the `1` it equals.
    made: dict[tuple[str, Any, type], tuple[str, Any, str]] = {}
    for record in records:
        keys = []
        for kind, value in record.keypath[depth:]:
            found = made.get((kind, value, type(value)))
            if found is None:
                found = made[(kind, value, type(value))] = _plain_key(kind, value, numbered)
            keys.append(found)
        _insert(root, keys, leaf(record))
    return _finish(root, names) if root else {}


def _needs_host(dtype_name: str) -> bool:
    """Whether a leaf saved from JAX as `dtype_name` holds 64-bit values this
    process's JAX would round or wrap (x64 off): NumPy keeps them exactly."""
    dtype = dtype_from_name(dtype_name)
    return bool(jax.dtypes.canonicalize_dtype(dtype) != dtype)


class _Likes:
    """`_like` of each record, one object for all the records of one type,
    dtype and shape: it is only asked for those (ten thousand tensors of a
    model have a few dozen shapes)."""

    def __init__(self, host: bool):
        self.host = host
        self.made: dict[tuple[Any, ...], Any] = {}

    def __call__(self, record: LeafRecord) -> Any:
        key = (record.type, record.dtype, tuple(record.shape), tuple(record.stored_shape), record.impl)
        found = self.made.get(key)
        if found is None:
            found = self.made[key] = _like(record, self.host)
        return found


def _lazy_leaf(source: Source, record: LeafRecord, *, like: _Likes) -> Any:
    """A `LazyArray` standing for the leaf as the type it was saved as (a NumPy
    array where `host`); scalars are read at once (they come back as values,
    lazy or not)."""
    lazy = LazyArray(source, record, like(record))
    if record.type in SCALAR_TYPES:
        return lazy.read()
    return lazy


def _like(record: LeafRecord, host: bool) -> Any:
    """A leaf of `like`, allocating nothing, that asks for the saved type on the
    default device (or NumPy, where `host`: any leaf of the load needs it)."""
    if host and record.type == "jax":
        return np.broadcast_to(np.zeros((), dtype_from_name(record.dtype)), record.shape)
    return abstract(record)


_NUMBER = re.compile(r"0|[1-9][0-9]*")


def _plain_key(kind: str, value: Any, numbered: bool) -> tuple[str, Any, str]:
    """Sequence indices stay ints (and become list positions); other keys keep
    their value (attribute names and string dict keys as they are), marked as
    a `number` where `numbered` and the key is one. Last, the key's name in
    dotted paths, for a dict whose keys cannot be sorted."""
    if kind in ("index", "flat"):
        return ("index", value, _keypath.stored_segment(kind, value))
    name = _keypath.stored_segment(kind, value)
    if numbered and kind == "key" and isinstance(value, str) and _NUMBER.fullmatch(value):
        return ("number", value, name)
    return ("key", value, name)


class _Node(dict):
    """A container being built: its children by `(kind, key)`."""


def refuse_leaves_with_children(paths: list[str], where: str) -> None:
    """Nested containers cannot show a leaf with leaves below it. An eqx_ckpt
    manifest never has one; a safetensors file may (tensors `a` and `a.b`)."""
    known = set(paths)
    # Every path with a leaf below it, each walked up from once: a leaf among
    # them is rare, and only then are the paths looked through for the message.
    parents: set[str] = set()
    for path in paths:
        parent, dot, _ = path.rpartition(".")
        while dot and parent not in parents:
            parents.add(parent)
            parent, dot, _ = parent.rpartition(".")
    if known.isdisjoint(parents):
        return
    for path in paths:
        parts = _keypath.split_dotted(path)
        for n in range(1, len(parts)):
            above = ".".join(parts[:n])
            if above in known:
                raise CheckpointValueError(
                    f"`{above}` in {where!r} is a leaf and also has leaves below it (`{path}`), so the "
                    f"checkpoint cannot be shown as nested containers. Read leaves by dotted path "
                    f"(`Checkpoint(path)[{path!r}]`), or load into a `like` with `tree_deserialise_leaves`.",
                    path=where,
                )


def _insert(node: _Node, keys: list[tuple[str, Any, str]], leaf: Any) -> None:
    # No leaf's path lies below another leaf's (`refuse_leaves_with_children`).
    for key in keys[:-1]:
        node = node.setdefault(key, _Node())
    node[keys[-1]] = leaf


def _finish(node: Any, names: bool = False) -> Any:
    """`_Node`s as lists or dicts.

    - A list when every key is a sequence index. Indices that were not saved,
      such as the activations between layers, are `None`.
    - A list when every key is a `number` and they run from 0 without a gap.
    - Otherwise a dict, also for indices too sparse to be a list, as a hostile
      manifest may claim."""
    if not isinstance(node, _Node):
        return node
    kinds = {kind for kind, _, _ in node}
    if kinds == {"index"} and max(i for _, i, _ in node) < 2 * len(node) + 8:
        out: list[Any] = [None] * (max(i for _, i, _ in node) + 1)
        for (_, i, _), child in node.items():
            out[i] = _finish(child, names)
        return out
    if kinds == {"number"} and {int(n) for _, n, _ in node} == set(range(len(node))):
        return [_finish(child, names) for _, child in sorted(node.items(), key=lambda item: int(item[0][1]))]
    if names:
        return {name: _finish(child, names) for (_, _, name), child in node.items()}
    try:
        sorted(key for _, key, _ in node)
    except TypeError:
        # Keys JAX cannot sort (a custom node's indices beside names): each is
        # named as in the dotted paths instead, which tells them apart.
        return {name: _finish(child, names) for (_, _, name), child in node.items()}
    return {key: _finish(child, names) for (_, key, _), child in node.items()}
