"""Partial saves: `tree_serialise_leaves(path, pytree, where=...)` replaces only
the selected sub-trees of the checkpoint at `path`.

The save is an overwrite like any other, whose tree is the kept stored leaves
(read as lazy leaves, their chunk files shared) plus the picked nodes'
leaves. docs/format.md, "Incremental and partial saves", states its rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
import numpy as np

from .._base import _keypath, _select, _tree
from .._base._errors import CheckpointNotFoundError, CheckpointReplacedError, CheckpointValueError, IntegrityError
from .._base._location import Location
from .._load import _rebuild
from .._load._lazy import LazyArray
from .._ondisk import _structure
from .._ondisk._format import MANIFEST
from .._sources import _source
from .._store import _transaction


@dataclasses.dataclass(frozen=True)
class Partial:
    """A partial save's leaves: the `new` ones (of the picked nodes) first, then
    the kept stored ones, with their names and filter specs; the stored
    checkpoint's `commit` (the save is refused unless it is still the live
    one); the `cast` and `chunks` that keep the kept leaves as stored; and the
    `structure` record, with the picked sub-trees spliced into the stored one."""

    leaves: list[Any]
    names: _tree.Names
    specs: list[Any]
    commit: str
    cast: Callable[[str, np.dtype], Any] | None
    chunks: dict[str, tuple[int, ...]]
    new: int
    structure: Callable[[set[str]], Any]
    # The stored iterator states outside the picked sub-trees, kept as they are.
    iterators: tuple[Any, ...] = ()

    def kept_damaged(self, error: IntegrityError, loc: Location) -> IntegrityError:
        """`error`, a kept leaf found damaged as it was read, as this save's
        refusal: a damaged leaf is never saved again as if it were sound."""
        kept = set(self.names.paths[self.new :])
        if not error.dotted or not set(error.dotted) <= kept:
            return error  # a new leaf's (a lazy leaf of another checkpoint)
        return IntegrityError(
            f"{error} This save with `where` keeps that leaf as it is stored in {loc.display!r}, so it was refused "
            f"and nothing was written: the checkpoint is as it was. To go on, pick that leaf in `where` with its "
            f"good values, save the whole tree without `where`, or restore the checkpoint from a good copy.",
            path=error.path,
            keypaths=error.keypaths,
            dotted=error.dotted,
        )

    def keep_chunks(self, pending: list[Any]) -> None:
        """Give each kept leaf with an array of its own (in `pending`) the chunk
        grid it had, so that its chunk files are shared with those stored."""
        for p in pending:
            chunks = self.chunks.get(p.record.path)
            if chunks is not None and p.record.pack is None and len(chunks) == len(p.record.chunks):
                p.record.chunks = chunks


def collect(
    loc: Location,
    pytree: Any,
    where: Callable[[Any], Any],
    filter_spec: Any,
    is_leaf: Callable[[Any], bool] | None,
    cast: Callable[[str, np.dtype], Any] | None,
    *,
    overwrite: bool,
    default: Any,
) -> Partial:
    """The leaves a partial save writes (see the module docstring)."""
    if not overwrite:
        raise CheckpointValueError(
            "A save with `where` replaces sub-trees of the checkpoint there: it cannot be combined with "
            "`overwrite=False`. Nothing was written.",
            path=loc.display,
        )
    if not callable(where):
        raise CheckpointValueError(
            f"`where` must be a callable that picks nodes of `pytree`, as in `eqx.tree_at` "
            f"(e.g. `where=lambda t: t['head']`); not {where!r}."
        )
    flat, treedef = jtu.tree_flatten(pytree, is_leaf)
    picked, prefixes = _picked(where, treedef, len(flat), is_leaf)
    source = _source.checkpoint(loc)  # the checkpoint it keeps leaves of
    if source is None:
        raise CheckpointNotFoundError(
            f"A save with `where` replaces sub-trees of an existing checkpoint, and there is none at "
            f"{loc.display!r} (no {MANIFEST}); nothing was written. Save the whole tree first (without `where`).",
            path=loc.display,
        )
    manifest = source.manifest
    leaves, names = _tree.flatten_named(pytree, is_leaf, keypaths=True)
    specs = _tree.leaf_specs(filter_spec, pytree, is_leaf, count=len(leaves))
    new = sorted(picked)
    kept = [r for r in manifest.leaves if not any(_keypath.is_within(r.path, p) for p in prefixes)]
    for record in kept:
        inside = [p for p in prefixes if _keypath.is_within(p, record.path)]
        if inside:
            raise CheckpointValueError(
                f"`where` picks `{inside[0]}`, which lies inside the stored leaf `{record.path}` of "
                f"{loc.display!r}: a leaf has no sub-tree to replace. Pick `{record.path}` itself; "
                f"nothing was written.",
                path=loc.display,
            )
    stored = [LazyArray(source, r) for r in kept]
    keypaths = [names.keypath(i) for i in new] + [_keypath.from_json(r.keypath) for r in kept]
    combined = _tree.Names(
        [names.paths[i] for i in new] + [r.path for r in kept],
        [names.records[i] for i in new] + [r.keypath for r in kept],
        keypaths.__getitem__,
    )
    return Partial(
        [leaves[i] for i in new] + stored,
        combined,
        [specs[i] for i in new] + [default] * len(kept),
        manifest.commit,
        _keeping_dtypes(cast, {r.path: r.stored_dtype for r in kept if r.stored_dtype != r.dtype}),
        {r.path: tuple(r.chunks) for r in kept if r.pack is None},
        len(new),
        lambda stored: _spliced(_rebuild.record_of(manifest, loc.display), prefixes, treedef, flat, names, stored),
        tuple(it for it in manifest.iterators if not any(_keypath.is_within(it.path, p) for p in prefixes)),
    )


def _spliced(
    old: Any, prefixes: list[str], treedef: Any, flat: list[Any], names: _tree.Names, stored: set[str]
) -> dict[str, Any]:
    """The stored structure record `old` with the record of each picked sub-tree
    of the new tree in its place."""
    if old is None:
        return _structure.unrecordable("saved in part (with `where`) over a checkpoint that recorded no structure")
    new = _structure.record(treedef, flat, [path in stored for path in names.paths], names.records)
    try:
        for prefix in prefixes:
            old = _structure.replaced(old, prefix, _structure.at(new, prefix))
    except (KeyError, TypeError, ValueError, IndexError):
        return _structure.unrecordable("saved in part (with `where`) at a place its saved structure did not have")
    return old


def check_unreplaced(tx: _transaction.Transaction, *, commit: str) -> None:
    """Refuse a partial save whose checkpoint was replaced after its kept
    leaves were read (`commit` is theirs): committing would undo the other
    save's sub-trees."""
    if tx.old is None or tx.old.commit != commit:
        raise CheckpointReplacedError(
            f"Checkpoint {tx.loc.display!r} was replaced by another save while this save with `where` read the "
            f"leaves it keeps; nothing was written. Save again.",
            path=tx.loc.display,
        )


def _keeping_dtypes(
    cast: Callable[[str, np.dtype], Any] | None, stored: dict[str, str]
) -> Callable[[str, np.dtype], Any] | None:
    """`cast`, except that a kept leaf stored in another dtype stays so."""
    if not stored:
        return cast
    return lambda path, dtype: stored[path] if path in stored else (cast(path, dtype) if cast else None)


def _picked(
    where: Callable[[Any], Any], treedef: Any, count: int, is_leaf: Callable[[Any], bool] | None
) -> tuple[set[int], list[str]]:
    """The indices of the leaves inside the nodes `where` picks, and those
    nodes' dotted paths."""
    marked = _select.marked(treedef, count)
    places: dict[int, str | None] = {}
    _places(marked, (), places, is_leaf)
    try:
        out = where(marked)
    except Exception as e:
        raise CheckpointValueError(
            f"`where` raised {type(e).__name__}: {e}. It is called on `pytree` and must return the nodes "
            f"to save, as in `eqx.tree_at`, e.g. `where=lambda t: t['head']`; nothing was written."
        ) from e
    nodes = [out] if id(out) in places else list(out) if isinstance(out, (tuple, list)) else [out]
    prefixes = []
    for node in nodes:
        place = places.get(id(node), None)
        if place is None:
            raise CheckpointValueError(
                f"`where` returned {type(node).__name__} {_short(node)}, which is not a node of `pytree` "
                f"(or is one that occurs at several places, such as `None`); it must return nodes of "
                f"`pytree` (a sub-tree, or a tuple of sub-trees), as in `eqx.tree_at`. Nothing was written."
            )
        prefixes.append(place)
    return _select.marked_indices(nodes), prefixes


def _places(node: Any, keypath: tuple[Any, ...], out: dict[int, str | None], is_leaf: Any) -> None:
    """Record the dotted path of `node` and of every node below it, by
    identity (`None` for an object found at several places)."""
    here = _keypath.dotted(keypath)
    out[id(node)] = here if id(node) not in out else None
    if isinstance(node, _select.Marker) or (is_leaf is not None and is_leaf(node)):
        return
    children = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    if len(children) == 1 and children[0][1] is node:
        return  # a leaf
    for path, child in children:
        _places(child, keypath + tuple(path), out, is_leaf)


def _short(node: Any) -> str:
    text = repr(node)
    return text if len(text) <= 60 else text[:57] + "..."
