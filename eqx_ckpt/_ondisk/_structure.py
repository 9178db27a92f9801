"""The structure record: a saved tree's nodes as data, so it can be rebuilt without its code.

A save records every node of its tree in the manifest (format version 5), as
JSON, never pickle: each node a JSON object with a kind `t` (`leaf`, `value`,
`none`, `dict`, `list`, `tuple`, `namedtuple`, `object`, `node`,
`unrecordable`), classes and functions named `module:qualname`, static values
as tagged JSON data. The grammar is in docs/format.md ("The structure record").

What cannot be recorded (a lambda, a closure, an arbitrary object) never fails
the save. It is recorded as "unrecordable" with the reason, and only a load
without `like` of that part reports it. Reading the record is `_rebuild`'s job
(the record is untrusted input). Deciding which names may be built is
`_trust`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._base import _keypath
from ._dtypes import is_known_dtype
from ._trust import name_of

LEAF = {"t": "leaf"}
NONE = {"t": "none"}
# Deeper trees are recorded as "unrecordable" below this depth: the manifest
# stays JSON that every reader parses (Python's parser stops near 1,000 levels).
MAX_DEPTH = 200
# Static values nest at most this deep (a tuple of tuples...).
MAX_VALUE_DEPTH = 32
JNP_TYPE = type(jnp.float32)
_LEAF_TREEDEF = jtu.tree_structure(0)


class Unrecordable(Exception):
    """Why a value cannot be recorded as data."""


def record(treedef: Any, leaves: Sequence[Any], saved: Sequence[bool], keys: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The structure record of a tree flattened into `leaves` with structure
    `treedef`. `saved[i]`: whether leaf `i` is stored (else it is recorded as a
    value). `keys[i]`: its key path record, whose keys name the children of
    registered nodes.

    Only Equinox modules are rebuilt, one level deep around placeholders, to
    read their static fields; that runs no code of the user's. A save may run
    in the background, after the caller has deleted its arrays."""
    walk = _Walk(leaves, saved, keys)
    try:
        root = walk.node(treedef, 0)
    except RecursionError:
        return unrecordable("the tree is too deep to record")
    if walk.count != len(leaves):
        return unrecordable("the tree's structure does not match its leaves")
    return root


def unrecordable(why: str) -> dict[str, Any]:
    return {"t": "unrecordable", "why": why}


class _Walk:
    def __init__(self, leaves: Sequence[Any], saved: Sequence[bool], keys: Sequence[Sequence[Any]]):
        self.leaves, self.saved, self.keys, self.count = leaves, saved, keys, 0
        # How many of the first i leaves are stored: a sub-tree whose leaves are
        # all stored is recorded from its structure alone.
        self.stored = list(itertools.accumulate(saved, initial=0))
        self.memo: dict[tuple[Any, int], dict[str, Any]] = {}

    def node(self, td: Any, depth: int) -> dict[str, Any]:
        """The record of the sub-tree `td` whose first leaf is leaf `self.count`.

        A sub-tree whose leaves are all stored is recorded once per structure
        and depth, so a model's equal blocks share one record, never changed
        once made (`replaced` copies)."""
        n = td.num_leaves
        if n and self.stored[self.count + n] - self.stored[self.count] == n:
            try:
                found = self.memo.get((td, depth))
            except TypeError:  # node data that cannot be hashed
                return self._node(td, depth)
            if found is None:
                found = self.memo[(td, depth)] = self._node(td, depth)
            else:
                self.count += n
            return found
        return self._node(td, depth)

    def _node(self, td: Any, depth: int) -> dict[str, Any]:
        data = td.node_data()
        if data is None:
            i = self.count
            self.count += 1
            return LEAF if self.saved[i] else _leaf_value(self.leaves[i])
        if depth >= MAX_DEPTH:
            self.count += td.num_leaves
            return unrecordable(f"the tree is more than {MAX_DEPTH} levels deep here")
        cls, aux = data
        children = td.children()
        kind = _BUILTIN.get(cls)
        if kind == "none":
            return NONE
        if kind is not None:
            out: dict[str, Any] = {"t": kind}
            if kind == "dict":
                keys = [_dict_key(k) for k in aux]
                if None in keys:
                    self.count += td.num_leaves
                    return unrecordable("a dict with keys that are neither strings nor integers")
                out["k"] = keys
            out["c"] = [self.node(child, depth + 1) for child in children]
            return out
        return self._custom(td, cls, aux, children, depth)

    def _custom(self, td: Any, cls: type, aux: Any, children: list[Any], depth: int) -> dict[str, Any]:
        name = name_of(cls)
        if name is None:
            self.count += td.num_leaves
            return unrecordable(f"an instance of {cls.__qualname__}, a class defined inside a function")
        if issubclass(cls, tuple) and hasattr(cls, "_fields"):
            nodes = [self.node(child, depth + 1) for child in children]
            return {"t": "namedtuple", "cls": name, "f": list(cls._fields), "c": nodes}
        try:
            if issubclass(cls, eqx.Module):
                return self._dataclass(td, cls, name, children, depth)
            return {"t": "node", "cls": name, "aux": value(aux), **self._keyed(children, depth)}
        except Unrecordable as e:
            self.count += td.num_leaves
            return unrecordable(f"a `{name}` node: {e}")

    def _dataclass(self, td: Any, cls: type, name: str, children: list[Any], depth: int) -> dict[str, Any]:
        """Every field of a dataclass-style node, in order: its children where
        they are, each static field's value (or why it cannot be recorded)."""
        shell = _one_level(td, len(children)).unflatten([_Slot(i) for i in range(len(children))])
        fields, found = [], []
        for f in dataclasses.fields(cls):
            x = getattr(shell, f.name, _UNSET)
            if x is _UNSET:
                raise Unrecordable(f"its field `{f.name}` is not set")
            fields.append(f.name)
            found.append(x if isinstance(x, _Slot) else _leaf_value(x))
        if sorted(x.index for x in found if isinstance(x, _Slot)) != list(range(len(children))):
            raise Unrecordable("its children are not its fields")
        # Walked in the children's own order, in which the leaves come.
        built = [self.node(child, depth + 1) for child in children]
        nodes = [built[x.index] if isinstance(x, _Slot) else x for x in found]
        return {"t": "object", "cls": name, "f": fields, "c": nodes}

    def _keyed(self, children: list[Any], depth: int) -> dict[str, Any]:
        """The children of another registered node, each keyed as its first
        leaf's key path names it, or by its index if it has no leaves. (Never
        rebuilt: its unflatten is the user's code.)"""
        keys, start = [], self.count
        for i, child in enumerate(children):
            key = list(self.keys[start][depth]) if child.num_leaves else ["flat", i]
            if key[0] in ("key_repr", "other"):
                raise Unrecordable(f"the key {key[1]!r} of a child cannot be recorded")
            keys.append(key)
            start += child.num_leaves
        return {"k": keys, "c": [self.node(child, depth + 1) for child in children]}


_UNSET = object()


class _Slot:
    """Where a child goes in a node rebuilt one level deep."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _one_level(td: Any, count: int) -> Any:
    return td.from_node_data_and_children(jtu.default_registry, td.node_data(), [_LEAF_TREEDEF] * count)


_BUILTIN = types.MappingProxyType({type(None): "none", dict: "dict", list: "list", tuple: "tuple"})


def _dict_key(key: Any) -> list[Any] | None:
    kind, v = _keypath.key_record(jtu.DictKey(key))
    return [kind, v] if kind in ("key", "key_int") and type(key) in (str, int) else None


def _leaf_value(x: Any) -> dict[str, Any]:
    """A leaf the save did not store, as a value node (or why it cannot be)."""
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return unrecordable(
            f"an array ({_short_type(x)}) that the save did not store (a static field, or a leaf the filter "
            f"spec skipped)"
        )
    try:
        return {"t": "value", "v": value(x)}
    except Unrecordable as e:
        return unrecordable(str(e))


def value(x: Any, depth: int = 0) -> Any:
    """`x` as JSON data (see the module docstring); raises `Unrecordable`."""
    if depth > MAX_VALUE_DEPTH:
        raise Unrecordable(f"a value nested more than {MAX_VALUE_DEPTH} levels deep")
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return x if math.isfinite(x) else {"float": repr(x)}
    if type(x) is complex:
        return {"complex": [value(x.real), value(x.imag)]}
    return _value_of_other(x, depth)


def _value_of_other(x: Any, depth: int) -> Any:
    if type(x) in (tuple, list):
        return {type(x).__name__: [value(v, depth + 1) for v in x]}
    if type(x) is dict:
        return {"dict": [[value(k, depth + 1), value(v, depth + 1)] for k, v in x.items()]}
    if isinstance(x, np.dtype) and is_known_dtype(x.name):
        return {"dtype": x.name}
    if isinstance(x, type) and issubclass(x, np.generic) and is_known_dtype(np.dtype(x).name):
        return {"scalar_type": np.dtype(x).name}
    if isinstance(x, JNP_TYPE) and is_known_dtype(np.dtype(x.dtype).name):
        return {"jnp_type": np.dtype(x.dtype).name}
    if isinstance(x, np.generic) and x.dtype.kind in "biufc" and is_known_dtype(x.dtype.name):
        return {"numpy": [x.dtype.name, value(x.item(), depth + 1)]}
    if isinstance(x, enum.Enum):
        name = name_of(type(x))
        if name is None:
            raise Unrecordable(f"the enum member {x!r} of a class defined inside a function")
        return {"enum": name, "name": x.name}
    return _function(x)


def _function(x: Any) -> Any:
    """A function by its name: only where the name finds this very object in
    its module, as a load will find it among the trusted objects."""
    if isinstance(x, type) or not callable(x):
        raise Unrecordable(f"an object of class {_short_type(x)}")
    name = name_of(x)
    if name is None:
        what = "a lambda" if "<lambda>" in getattr(x, "__qualname__", "") else None
        what = what or ("a function defined inside another (a closure)" if hasattr(x, "__qualname__") else None)
        raise Unrecordable(what or f"a callable object of class {_short_type(x)}")
    if _found(name) is not x:
        raise Unrecordable(f"the function `{name}`, which its module does not hold under that name")
    return {"function": name}


def _found(name: str) -> Any:
    """What the module already imported as `module` holds at `qualname` (no import)."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _short_type(x: Any) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def children(node: dict[str, Any]) -> list[tuple[list[Any], dict[str, Any]]]:
    """The children of a (checked) record node with the key record of each, as
    JAX's key paths name them: dict keys, sequence indices, field names."""
    kind, nodes = node["t"], node.get("c", [])
    if kind == "dict" or kind == "node":
        return list(zip(node["k"], nodes))
    if kind in ("list", "tuple"):
        return [(["index", i], child) for i, child in enumerate(nodes)]
    if kind in ("namedtuple", "object"):
        return [(["attr", f], child) for f, child in zip(node["f"], nodes)]
    return []


def walk(node: dict[str, Any], visit: Callable[[str, dict[str, Any]], None], path: str = "") -> None:
    """Call `visit(dotted_path, node)` for `node` and every node below it."""
    stack = [(path, node)]
    while stack:
        here, current = stack.pop()
        visit(here, current)
        for key, child in reversed(children(current)):
            stack.append((_keypath.join_dotted(here, _keypath.stored_segment(*key)), child))


def replaced(root: Any, prefix: str, node: dict[str, Any]) -> dict[str, Any]:
    """A copy of the record `root` with the node at dotted `prefix` replaced by
    `node` (a partial save's). `KeyError` where `root` has no node there,
    `ValueError`/`TypeError` where it is malformed."""
    if not prefix:
        return node
    head, _, rest = prefix.partition(".")
    for i, (key, child) in enumerate(children(root)):
        if _keypath.stored_segment(*key) == head:
            out = dict(root)
            out["c"] = list(root["c"])
            out["c"][i] = replaced(child, rest, node)
            return out
    raise KeyError(prefix)


def at(root: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The node of the record `root` at dotted `prefix`; `KeyError` if none."""
    if not prefix:
        return root
    head, _, rest = prefix.partition(".")
    for key, child in children(root):
        if _keypath.stored_segment(*key) == head:
            return at(child, rest)
    raise KeyError(prefix)
