"""The options that name leaves, each as a function: `where` (which leaves of
`like` are loaded), `prefix` and `rename` (from which dotted path of the
checkpoint), `transform` (made by which function of what is stored).

They are parsed here and resolved for every leaf of `like` in `_load_plan`;
`rules` also serves `export_safetensors`' `rename` and `torch_layout`."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import jax.tree_util as jtu

from . import _keypath
from ._errors import CheckpointValueError


class Marker:
    """Leaf `index` of a tree, in a copy given to `where` (a load's `like`, a
    partial save's `pytree`) to see which leaves the nodes it picks hold."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def marked(treedef: Any, count: int) -> Any:
    """A tree of structure `treedef` whose `count` leaves are `Marker`s."""
    return jtu.tree_unflatten(treedef, [Marker(i) for i in range(count)])


def marked_indices(nodes: Any) -> set[int]:
    """The indices of the `Marker`s in `nodes` (what `where` returned)."""
    is_marker = lambda x: isinstance(x, Marker)
    return {x.index for x in jtu.tree_leaves(nodes, is_leaf=is_marker) if is_marker(x)}


def selected(where: Callable[[Any], Any] | None, treedef: Any, count: int) -> set[int]:
    """The indices of the leaves inside the nodes `where` picks, as with `eqx.tree_at`."""
    if where is None:
        return set(range(count))
    marked_tree = marked(treedef, count)
    try:
        nodes = where(marked_tree)
    except Exception as e:
        raise CheckpointValueError(
            f"`where` raised {type(e).__name__}: {e}. It is called on `like` and must "
            f"return the nodes to load, as in `eqx.tree_at`, e.g. `where=lambda t: t['model']`."
        ) from e
    found = marked_indices(nodes)
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


# Where a leaf of `like` is loaded from: a dotted path, several (combined by a
# `transform`), or `None` (not loaded: it keeps `like`'s value).
Target = Union[str, tuple[str, ...], None]  # noqa: UP007 (a runtime alias on Python 3.10)


def renamer(rename: Any) -> Callable[[str], Target]:
    """`rename` as a function from a dotted path of `like` to one of the checkpoint.

    A mapping renames whole sub-trees: the longest key that is the path or a
    dotted prefix of it is replaced by its value. A list of `(pattern,
    replacement)` rules rewrites the path with the first rule whose pattern is
    found in it (see `rules`). Unmapped paths pass through.
    """
    if rename is None:
        return lambda path: path
    if callable(rename):
        return _checked(rename)
    if isinstance(rename, Sequence) and not isinstance(rename, str):
        return rules(rename, what="rename")
    if not isinstance(rename, Mapping):
        raise CheckpointValueError(
            f"`rename` must be a mapping, a callable or a list of `(pattern, replacement)` rules, "
            f"not {type(rename).__name__}."
        )
    table = {key: spelt(value) for key, value in rename.items()}
    for key, value in table.items():
        if not (isinstance(key, str) and isinstance(value, str) and _keypath.is_valid_dotted(value)):
            raise CheckpointValueError(
                f"`rename` maps {key!r} to {value!r}; both must be dotted paths (strings; the stored one may "
                f"also be spelt as its file spells it)."
            )
    keys = sorted(table, key=len, reverse=True)

    def apply(path: str) -> str:
        for key in keys:
            if _keypath.is_within(path, key) and key:
                return _keypath.join_dotted(table[key], _keypath.relative(path, key))
        return path

    return apply


def _checked(fn: Callable[[str], Any]) -> Callable[[str], Target]:
    def apply(path: str) -> Target:
        try:
            out = fn(path)
        except Exception as e:
            raise CheckpointValueError(
                f"`rename` raised {type(e).__name__}: {e} (called with `{path}`). It is called with every "
                f"dotted path of `like` and must return the stored path, or `None` to keep the path as it is."
            ) from e
        if out is None:
            return path
        return _target(out, f"`rename` returned {out!r} for `{path}`")

    return apply


def spelt(name: Any) -> Any:
    """A stored name as its file spells it (`params/Dense_0/kernel`, the
    tensor name of a safetensors file) as the dotted path that names it
    (`params%2FDense_0%2Fkernel`): each `.`-separated part escaped as
    `Checkpoint(path).keys()` escapes keys. A dotted path stays as it is."""
    if isinstance(name, str) and name and not _keypath.is_valid_dotted(name):
        return _keypath.join_dotted(*(_keypath.escape(part) for part in name.split(".")))
    return name


def _target(out: Any, where: str) -> Target:
    out = tuple(spelt(o) for o in out) if isinstance(out, tuple) else spelt(out)
    if isinstance(out, tuple) and out and all(isinstance(o, str) and _keypath.is_valid_dotted(o) for o in out):
        return out
    if not isinstance(out, str) or not _keypath.is_valid_dotted(out):
        raise CheckpointValueError(
            f"{where}; it must return a dotted path as `Checkpoint(path).keys()` lists them "
            f"(or a tuple of them, combined by a `transform`)."
        )
    return out


def rules(table: Sequence[Any], *, what: str) -> Callable[[str], Target]:
    """Ordered `(pattern, replacement)` rules as a function of a dotted path.

    The first rule whose regular expression is found in the path (`re.search`)
    wins: the path becomes `re.sub(pattern, replacement, path, count=1)`
    (`\\1` refers to a group). A replacement of `None` gives `None` (the leaf is
    not loaded), a tuple of replacements a tuple of paths. No match: unchanged.
    """
    example = r"(r'^blocks\.(\d+)\.', r'model.layers.\1.')"
    compiled = _compiled(
        table, what, "(pattern, replacement)", example, lambda rule: isinstance(rule[0], (str, re.Pattern))
    )

    def apply(path: str) -> Target:
        for pattern, replacement in compiled:
            if pattern.search(path) is None:
                continue
            if replacement is None:
                return None
            try:
                if isinstance(replacement, tuple):
                    out: Any = tuple(pattern.sub(r, path, count=1) for r in replacement)
                else:
                    out = pattern.sub(replacement, path, count=1)
            except (re.error, IndexError, TypeError) as e:
                raise CheckpointValueError(f"`{what}` rule {pattern.pattern!r} -> {replacement!r}: {e}.") from None
            return _target(out, f"`{what}` rule {pattern.pattern!r} -> {replacement!r} gave {out!r} for `{path}`")
        return path

    return apply


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
        example = r"(r'conv\.bias$', lambda b: b[:, None, None])"
        found = _compiled(transform, "transform", "(pattern, function)", example, lambda rule: callable(rule[1]))
        return lambda path: next((fn for pattern, fn in found if pattern.search(path)), None)
    raise CheckpointValueError(
        f"`transform` must be a mapping from dotted paths of `like` to functions, or a list of "
        f"`(pattern, function)` rules, not {type(transform).__name__}."
    )


def _compiled(table: Sequence[Any], what: str, pair: str, example: str, fits: Callable[[Any], bool]) -> list[Any]:
    """The `(pattern, value)` rules of the option `what`, each pattern compiled."""
    compiled = []
    for rule in table:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and fits(rule)):
            raise CheckpointValueError(f"`{what}` rules must be `{pair}` pairs, like `{example}`; got {rule!r}.")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except (re.error, TypeError) as e:
            raise CheckpointValueError(f"`{what}` rule {rule[0]!r} is not a regular expression: {e}.") from None
    return compiled
