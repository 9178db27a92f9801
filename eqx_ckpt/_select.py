"""`where`, `prefix` and `rename`: which leaves of `like` are loaded, and from
which dotted path of the checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.tree_util as jtu

from . import _keypath
from ._errors import CheckpointValueError


class _Marker:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def selected(where: Callable[[Any], Any] | None, treedef: Any, count: int) -> set[int]:
    """The indices of the leaves inside the nodes `where` picks, as with `eqx.tree_at`."""
    if where is None:
        return set(range(count))
    marked = jtu.tree_unflatten(treedef, [_Marker(i) for i in range(count)])
    try:
        nodes = where(marked)
    except Exception as e:
        raise CheckpointValueError(
            f"`where` raised {type(e).__name__}: {e}. It is called on `like` and must "
            f"return the nodes to load, as in `eqx.tree_at`, e.g. `where=lambda t: t['model']`."
        ) from e
    is_marker = lambda x: isinstance(x, _Marker)
    found = {leaf.index for leaf in jtu.tree_leaves(nodes, is_leaf=is_marker) if is_marker(leaf)}
    if not found:
        raise CheckpointValueError(
            "`where` selected no leaves of `like`. It must return nodes of `like` "
            "(a sub-tree or a tuple of sub-trees) that contain array leaves."
        )
    return found


def check_prefix(prefix: str | None) -> str:
    if prefix is None:
        return ""
    if not isinstance(prefix, str) or not _keypath.is_valid_dotted(prefix):
        raise CheckpointValueError(
            f"`prefix` {prefix!r} is not a dotted path of a checkpoint. Write it as "
            f"`Checkpoint(path).keys()` lists keys, e.g. 'model' or 'model.encoder'."
        )
    return prefix


def renamer(rename: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    """`rename` as a function from a dotted path of `like` to one of the checkpoint.

    A mapping renames whole sub-trees: the longest key that is the path or a
    dotted prefix of it is replaced by its value. Unmapped paths pass through.
    """
    if rename is None:
        return lambda path: path
    if callable(rename):
        return _checked(rename)
    if not isinstance(rename, Mapping):
        raise CheckpointValueError(f"`rename` must be a mapping or a callable, not {type(rename).__name__}.")
    table = dict(rename)
    for key, value in table.items():
        if not (isinstance(key, str) and isinstance(value, str) and _keypath.is_valid_dotted(value)):
            raise CheckpointValueError(f"`rename` maps {key!r} to {value!r}; both must be dotted paths (strings).")
    keys = sorted(table, key=len, reverse=True)

    def apply(path: str) -> str:
        for key in keys:
            if _keypath.is_within(path, key) and key:
                return _keypath.join_dotted(table[key], _keypath.relative(path, key))
        return path

    return apply


def _checked(fn: Callable[[str], str]) -> Callable[[str], str]:
    def apply(path: str) -> str:
        out = fn(path)
        if out is None:
            return path
        if not isinstance(out, str) or not _keypath.is_valid_dotted(out):
            raise CheckpointValueError(f"`rename` returned {out!r} for `{path}`; it must return a dotted path.")
        return out

    return apply
