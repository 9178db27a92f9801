"""Flattening with key paths, and mapping a prefix tree of filter specs."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from . import _faults, _keypath, _state
from ._errors import CheckpointTypeError, CheckpointValueError, LeafError, leaf_message


def leaf_specs(
    filter_spec: Any,
    tree: Any,
    is_leaf: Callable[[Any], bool] | None,
    *,
    what: str = "pytree",
    count: int | None = None,
) -> list[Any]:
    """One filter spec per leaf of `tree`, from a callable or a PyTree prefix of
    callables, as in Equinox. `count`: `tree`'s number of leaves, if known."""
    if count is not None and callable(filter_spec) and jtu.treedef_is_leaf(jtu.tree_structure(filter_spec)):
        return [filter_spec] * count  # one function for every leaf: nothing to map
    specs: list[Any] = []

    def expand(spec: Any, sub: Any) -> None:
        if not callable(spec):
            raise CheckpointTypeError(
                f"Every leaf of `filter_spec` must be a callable `(handle, leaf) -> ...`, not {spec!r}."
            )
        specs.extend([spec] * len(jtu.tree_leaves(sub, is_leaf=is_leaf)))

    try:
        jtu.tree_map(expand, filter_spec, tree)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointTypeError):
            raise
        raise CheckpointValueError(
            f"`filter_spec` must be a callable, or a PyTree prefix of `{what}` whose leaves are callables "
            f"(as `eqx.tree_serialise_leaves` takes it); its structure does not match `{what}`: {_short(e)}"
        ) from None
    if count is not None and len(specs) != count:
        # `filter_spec` is mapped over `tree` without `is_leaf` (as in Equinox):
        # a prefix reaching inside a node `is_leaf` makes one leaf splits it.
        raise CheckpointValueError(
            f"`filter_spec` reaches inside a node that `is_leaf` makes one leaf of `{what}`: it gives "
            f"{len(specs)} filter specs for the {count} leaves of `{what}`. Give one callable for each node "
            f"`is_leaf` accepts (or for a node above it), or change `is_leaf`."
        )
    return specs


def _short(error: Exception, limit: int = 300) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
    return jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)


class Names:
    """The names of every leaf of a flattened tree.

    - `paths`, `records`: each leaf's dotted path and key path record
      (`_keypath.to_json`), in flattening order.
    - `keypath(i)`: a leaf's key path, on request (a save needs a few).
    - `treedef`: the tree's structure where known.
    - `memo`: a dict shared by every tree of this structure while its names are
      remembered (`names_from_structure`), else `None`; a save keeps its
      `_records.Plan` there for the next one."""

    __slots__ = ("_keypath", "memo", "paths", "records", "treedef")

    def __init__(
        self,
        paths: list[str],
        records: list[list[list[Any]]],
        keypath: Callable[[int], tuple[Any, ...]],
        treedef: Any = None,
        memo: dict[Any, Any] | None = None,
    ):
        self.paths, self.records, self._keypath, self.treedef = paths, records, keypath, treedef
        self.memo = memo

    def keypath(self, i: int) -> tuple[Any, ...]:
        return self._keypath(i)


def names_from_keypaths(keypaths: list[tuple[Any, ...]], treedef: Any = None) -> Names:
    """The names of the leaves of a tree (of structure `treedef`) flattened with these key paths."""
    paths, records = _keypath.dotted_and_records(keypaths)
    return Names(paths, records, keypaths.__getitem__, treedef)


def flatten_named(
    tree: Any, is_leaf: Callable[[Any], bool] | None, *, keypaths: bool = False
) -> tuple[list[Any], Names]:
    """The leaves of `tree`, and their names: from its structure (the faster
    way: docs/benchmarks.md) when every node `rebuilds_plainly` and the caller
    will not ask for every key path (`keypaths`), else from its key paths.
    Which way the last tree of the same type went decides which is tried first."""
    if not keypaths and _PLAIN_ROOTS.get(type(tree), True):
        leaves, treedef = jtu.tree_flatten(tree, is_leaf)
        if rebuilds_plainly(treedef):
            return leaves, names_from_structure(treedef)
    flat, treedef = flatten(tree, is_leaf)
    leaves = [leaf for _, leaf in flat]
    if not keypaths:
        plain = _PLAIN_ROOTS.put(type(tree), rebuilds_plainly(treedef))
        if plain:
            return leaves, names_from_structure(treedef)
    return leaves, names_from_keypaths([keypath for keypath, _ in flat], treedef)


_PLAIN_ROOTS: _state.Table[type, bool] = _state.table("tree.plain_roots", 64, "clear")


def names_from_structure(treedef: Any) -> Names:
    """The names of the leaves of a tree of structure `treedef`, whose nodes
    `rebuilds_plainly`, from the structure alone.

    Each node's keys are those of a copy rebuilt around numbers
    (`_child_keys`). Each distinct subtree is named once; a later occurrence
    (the next block of a model) copies those names behind its own prefix. A
    whole tree's names are remembered by structure (`_NAMED`) where they
    follow equality (`_names_follow_equality`): a training loop saves one
    structure again and again."""
    _faults.fire("tree.name_by_structure", treedef)
    named = _lookup(_NAMED, treedef)
    if named is None:
        named = _named(treedef)
    paths, records, memo = named
    # Copies of the lists: a save frees its own (`_staging.Batch.free`).
    return Names(list(paths), list(records), _StructureKeypaths(treedef), treedef, memo)


def _named(treedef: Any) -> tuple[list[str], list[list[list[Any]]], dict[Any, Any] | None]:
    """The dotted paths and key path records of `names_from_structure`."""
    paths: list[str] = []
    records: list[list[list[Any]]] = []
    # A subtree already named: (its first leaf, its last + 1, the length of the
    # dotted prefix and of the record prefix there).
    first: dict[Any, tuple[int, int, int, int]] = {}

    def name(node: Any, prefix: str, record: list[list[Any]]) -> bool:
        """Name the leaves of `node`; whether a subtree equal to it has the same
        names (see `_names_follow_equality`)."""
        if node.node_data() is None:  # a leaf
            paths.append(prefix[:-1])
            records.append(record)
            return True
        seen = _lookup(first, node)
        if seen is not None:
            start, stop, cut, cut_record = seen
            paths.extend([prefix + path[cut:] for path in paths[start:stop]])
            records.extend([record + old[cut_record:] for old in records[start:stop]])
            return True
        start, same = len(paths), True
        children = node.children()
        for key, child in zip(_child_keys(node, len(children)), children, strict=True):
            kind, value = _keypath.remembered_record(key)
            same &= _names_follow_equality(kind, value)
            same &= name(child, prefix + _keypath.stored_segment(kind, value) + ".", [*record, [kind, value]])
        if same:
            try:
                first[node] = (start, len(paths), len(prefix), len(record))
            except Exception:  # a structure that cannot be compared (see `_lookup`)
                return False
        return same

    if not name(treedef, "", []):
        return paths, records, None
    named: tuple[list[str], list[list[list[Any]]], dict[Any, Any]] = (paths, records, {})
    try:
        return _NAMED.put(treedef, named)
    except Exception:  # a structure that cannot be compared (see `_lookup`)
        return paths, records, None


# The names of the last few structures named, each with its `Names.memo`; their
# key path records are shared by every save of the structure: never changed.
_NAMED: _state.Table[Any, tuple[list[str], list[list[list[Any]]], dict[Any, Any]]] = _state.table(
    "tree.named", 4, "oldest"
)


def _lookup(first: dict[Any, Any], node: Any) -> Any:
    """`first.get(node)`, or None where JAX cannot compare `node` with a
    structure of the same hash (arrays in an Equinox module's static fields)."""
    try:
        return first.get(node)
    except Exception:
        return None


def _names_follow_equality(kind: str, value: Any) -> bool:
    """Whether every key equal to this one has its name. `{1: x}` and `{True: x}`
    are equal structures with different names (`%i1`, `True`), so a dict key
    other than a `str` is named anew wherever it occurs. Attribute names and
    indices follow from the node's type and length; a key equal to a `str` (a
    `StrEnum`) is named by the same characters."""
    return kind in ("attr", "index") or (kind == "key" and type(value) is str)


_LEAF = jtu.tree_structure(0)


def _child_keys(node: Any, count: int) -> list[Any]:
    """The keys of the children of the node at the root of `node` (a structure
    that `rebuilds_plainly`): those of the node rebuilt with numbers for
    children. (`jax.tree_util.flatten_one_level_with_keys` gave every field
    of a namedtuple the first field's key in JAX 0.10.2.)"""
    shell = node.from_node_data_and_children(jtu.default_registry, node.node_data(), [_LEAF] * count)
    return [keypath[0] for keypath in _rebuilt_keypaths(shell)]


def _rebuilt_keypaths(treedef: Any) -> list[tuple[Any, ...]]:
    """The key paths of the leaves of a tree of structure `treedef` (whose
    nodes `rebuilds_plainly`), from a copy of it with numbers for leaves."""
    count = treedef.num_leaves
    flat = jtu.tree_flatten_with_path(treedef.unflatten(range(count)))[0]
    if [leaf for _, leaf in flat] != list(range(count)):
        raise RuntimeError(f"Internal error: a tree rebuilt from {treedef} flattens differently.")
    return [keypath for keypath, _ in flat]


class _StructureKeypaths:
    """The key path of leaf `i` of a tree of structure `treedef` (whose nodes
    `rebuilds_plainly`): the first few by descending through its nodes, then
    all at once, from a copy of the tree with numbers for leaves."""

    _DESCENTS = 16

    def __init__(self, treedef: Any):
        self.treedef, self.asked = treedef, 0
        self.all: list[tuple[Any, ...]] | None = None

    def __call__(self, i: int) -> tuple[Any, ...]:
        if self.all is None:
            self.asked += 1
            if self.asked <= self._DESCENTS:
                return self._descend(i)
            self.all = _rebuilt_keypaths(self.treedef)
        return self.all[i]

    def _descend(self, i: int) -> tuple[Any, ...]:
        keypath = []
        node = self.treedef
        while node.node_data() is not None:
            children = node.children()
            for key, child in zip(_child_keys(node, len(children)), children, strict=True):
                if i < child.num_leaves:
                    keypath.append(key)
                    node = child
                    break
                i -= child.num_leaves
            else:
                raise IndexError(f"Internal error: no leaf {i} in {self.treedef}.")
        return tuple(keypath)


def rebuilds_plainly(treedef: Any) -> bool:
    """Whether `tree_unflatten` rebuilds every node of `treedef` without running
    the user's code: dicts, lists, tuples, `None`, plain namedtuples and
    Equinox modules (rebuilt field by field). Remembered by structure."""
    try:
        found = _PLAIN.get(treedef)
        if found is None:
            found = _PLAIN.put(treedef, all(_rebuilds_plainly(cls) for cls in _node_types(treedef)))
    except Exception:
        # Node data that cannot be compared (an array in an Equinox module's
        # static field): the caller takes the key paths instead.
        return False
    return found


_PLAIN: _state.Table[Any, bool] = _state.table("tree.plain", 64, "clear")


def _node_types(treedef: Any) -> set[type]:
    """The types of the nodes of `treedef`, each distinct subtree walked once."""
    types_: set[type] = set()
    seen: set[Any] = set()
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is None or node in seen:
            continue  # a leaf, or a subtree already walked
        seen.add(node)
        types_.add(data[0])
        stack.extend(node.children())
    return types_


def _rebuilds_plainly(cls: type) -> bool:
    if cls in _BUILTIN_NODES or issubclass(cls, eqx.Module):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        # Rebuilt by calling it: plain unless given its own `__new__` or `__init__`.
        new_made_by_namedtuple = getattr(cls.__new__, "__module__", "").startswith("namedtuple_")
        return new_made_by_namedtuple and cls.__init__ is object.__init__
    return False


_BUILTIN_NODES = frozenset({dict, list, tuple, type(None), collections.OrderedDict, collections.defaultdict})


def check_unique(names: Names, *, checkpoint: str) -> None:
    """Raise unless the dotted paths of `names` are all different."""
    paths = names.paths
    if len(set(paths)) == len(paths):
        return
    seen: dict[str, int] = {}
    for i, path in enumerate(paths):
        if seen.setdefault(path, i) != i:
            other, keypath = names.keypath(seen[path]), names.keypath(i)
            message = leaf_message(
                f"it would be stored at the same place as the leaf at key path {jtu.keystr(other)} "
                f"({other!r}): {_same_name(other, keypath)}",
                keypath=keypath,
                dotted=path,
                path=checkpoint,
                fix="Rename one of the keys.",
            )
            raise LeafError(message, path=checkpoint, keypaths=[other, keypath], dotted=[path])


def _same_name(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """Why two key paths have the same dotted path, said of their first difference."""
    first, second = next(((x, y) for x, y in zip(a, b, strict=False) if x != y), (a[-1], b[-1]))
    if type(first) is not type(second) or type(getattr(first, "key", None)) is not type(getattr(second, "key", None)):
        return "their keys have different types but the same name."
    if isinstance(first, jtu.DictKey):
        return (
            f"their keys are two different {type(first.key).__name__} objects with the same repr "
            f"({first.key!r}), which is what names such a key on disk."
        )
    return f"their keys differ but are written the same ({first})."
