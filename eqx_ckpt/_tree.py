"""Flattening with key paths, and mapping a prefix tree of filter specs."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax.tree_util as jtu

from ._errors import CheckpointTypeError, CheckpointValueError, LeafError, leaf_message


def leaf_specs(
    filter_spec: Any,
    tree: Any,
    is_leaf: Callable[[Any], bool] | None,
    *,
    what: str = "pytree",
    count: int | None = None,
) -> list[Any]:
    """One filter spec per leaf of `tree`: `filter_spec` is a callable or a PyTree
    prefix of `tree` whose leaves are callables, as in Equinox. `count`: the
    number of leaves of `tree`, when the caller knows it."""
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
    return specs


def _short(error: Exception, limit: int = 300) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
    return jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)


def check_unique(keypaths: list[tuple[Any, ...]], paths: list[str], *, checkpoint: str) -> None:
    """Raise unless the dotted paths of `keypaths` (`paths`) are all different."""
    if len(set(paths)) == len(paths):
        return
    seen: dict[str, tuple[Any, ...]] = {}
    for keypath, path in zip(keypaths, paths, strict=True):
        if path in seen:
            other = seen[path]
            message = leaf_message(
                f"it would be stored at the same place as the leaf at key path {jtu.keystr(other)} "
                f"({other!r}): their keys have different types but the same name.",
                keypath=keypath,
                dotted=path,
                path=checkpoint,
                fix="Rename one of the keys.",
            )
            raise LeafError(message, path=checkpoint, keypaths=[other, keypath], dotted=[path])
        seen[path] = keypath


_GC_LOCK = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a block makes many small,
    acyclic objects (a manifest's records, a tree's leaves): its collections,
    triggered by the count of new objects, took a third of the time of parsing
    a manifest of ten thousand leaves. Reference counting still frees memory.

    Counted, so that a background save and the caller's thread may both pause
    it: the last to leave restores what the first found."""
    pause_gc()
    try:
        yield
    finally:
        resume_gc()


def pause_gc() -> None:
    """`gc_paused`, entered; each call is ended by one `resume_gc` (possibly
    in another thread: an asynchronous save's caller pauses the collector for
    the background part, so that no collection of the objects it just made
    falls between the two)."""
    global _gc_pauses, _gc_was_enabled
    with _GC_LOCK:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1


def resume_gc() -> None:
    global _gc_pauses
    with _GC_LOCK:
        _gc_pauses -= 1
        if _gc_pauses == 0 and _gc_was_enabled:
            gc.enable()
