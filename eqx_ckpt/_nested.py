"""Loading without a skeleton: a checkpoint (or a sub-tree of it) as nested dicts
and lists, built from the key paths the manifest records.

For inspecting a checkpoint, or converting one whose code is gone. The structure
comes from each leaf's recorded key path: sequence indices become lists, every
other key (dict keys, attribute names) a dict key; keys of one container that
cannot be sorted together (indices beside names, from a custom pytree node)
become their names in dotted paths.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _dtypes, _keypath
from ._errors import CheckpointValueError
from ._format import LeafRecord
from ._lazy import LazyArray, materialise
from ._location import Location
from ._progress import Progress

_PYTHON = {"bool": False, "int": 0, "float": 0.0, "complex": 0j}


def load(
    data: Location,
    records: list[LeafRecord],
    key: str,
    *,
    lazy: bool,
    progress: Progress,
    opener: Any = None,
    check: Any = None,
) -> Any:
    """The leaves of `records` (all at or below dotted `key`) as nested containers.
    `opener` and `check` are the source's (see `LazyArray`)."""
    refuse_leaves_with_children([record.path for record in records], data.display)
    depth = len(_keypath.split_dotted(key))
    leaf = functools.partial(_leaf, data, opener=opener, check=check)
    if len(records) == 1 and records[0].path == key:
        tree = leaf(records[0])
    else:
        root = _Node()
        for record in records:
            _insert(root, [_plain_key(kind, value) for kind, value in record.keypath[depth:]], leaf(record))
        tree = _finish(root) if root else {}
    return tree if lazy else materialise(tree, progress=progress)


def _leaf(data: Location, record: LeafRecord, *, opener: Any, check: Any) -> Any:
    """A `LazyArray` standing for the leaf as the type it was saved as; scalars
    are read at once (they come back as values, lazy or not)."""
    lazy = LazyArray(data, record, _like(record), opener=opener, check=check)
    if record.type in _PYTHON or record.type == "numpy_scalar":
        return lazy.read()
    return lazy


def _like(record: LeafRecord) -> Any:
    """A leaf of `like`, allocating nothing, that asks for the saved type on the
    default device."""
    if record.type in _PYTHON:
        return _PYTHON[record.type]
    if record.type == "prng_key":
        data = jax.ShapeDtypeStruct(record.stored_shape, jnp.uint32)
        return jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=record.impl), data)
    dtype = _dtypes.dtype_from_name(record.dtype)
    if record.type == "numpy_scalar":
        return dtype.type(0)
    # 64-bit values in a process without x64 stay in NumPy, which keeps them exactly.
    if record.type == "numpy" or jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return np.broadcast_to(np.zeros((), dtype), record.shape)
    return jax.ShapeDtypeStruct(record.shape, dtype)


def _plain_key(kind: str, value: Any) -> tuple[str, Any, str]:
    """Sequence indices stay ints (and become list positions); other keys keep
    their value (attribute names and string dict keys as they are). Last, the
    key's name in dotted paths, for a dict whose keys cannot be sorted."""
    return ("index" if kind in ("index", "flat") else "key", value, _keypath.stored_segment(kind, value))


class _Node(dict):
    """A container being built: its children by `(kind, key)`."""


def refuse_leaves_with_children(paths: list[str], where: str) -> None:
    """Nested containers cannot show a leaf with leaves below it. An eqx_ckpt
    manifest never has one; a safetensors file may (tensors `a` and `a.b`)."""
    known = set(paths)
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


def _finish(node: Any) -> Any:
    """`_Node`s as lists (when every key is a sequence index; indices that were
    not saved, such as the activations between layers, are `None`) or dicts (also
    for indices too sparse to be a list, as a hostile manifest may claim)."""
    if not isinstance(node, _Node):
        return node
    if all(kind == "index" for kind, _, _ in node) and max(i for _, i, _ in node) < 2 * len(node) + 8:
        out: list[Any] = [None] * (max(i for _, i, _ in node) + 1)
        for (_, i, _), child in node.items():
            out[i] = _finish(child)
        return out
    try:
        sorted(key for _, key, _ in node)
    except TypeError:
        # Keys JAX cannot sort (a custom node's indices beside names): each is
        # named as in the dotted paths instead, which tells them apart.
        return {name: _finish(child) for (_, _, name), child in node.items()}
    return {key: _finish(child) for (_, key, _), child in node.items()}
