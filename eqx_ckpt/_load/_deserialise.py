"""`tree_deserialise_leaves`: full, partial, re-rooted, renamed and lazy loads.

A load is four steps: open the source (`_source`), plan which record feeds
each leaf of `like` (`_load_plan`), read (custom filter specs, transforms,
then the stored leaves through `_reader`, or as `LazyArray`s), place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._base import _faults, _gc, _tree
from .._base._errors import CheckpointError, LeafError, check_flag, leaf_message
from .._base._handle import LeafHandle
from .._base._location import Location
from .._base._progress import Progress, Tracker
from .._ondisk import _dtypes, _iterators
from .._ondisk._format import SCALAR_TYPES
from .._ondisk._trust import Trust
from .._sources import _opening
from .._sources._source import Source
from .._store import _window
from . import _lazy, _load_plan, _reader, _rebuild
from ._lazy import LazyArray, is_lazy
from ._load_plan import LeafPlan, LoadOptions, LoadPlan
from ._load_report import Report


def default_deserialise_filter_spec(handle: LeafHandle, x: Any) -> Any:
    """Default filter specification for deserialising a leaf.

    **Arguments:**

    - `handle`: the leaf's storage location, a [`eqx_ckpt.LeafHandle`][].
    - `x`: the leaf of `like`.

    **Returns:**

    The loaded leaf for JAX arrays, `jax.ShapeDtypeStruct`s, NumPy arrays and
    scalars and Python `bool`/`int`/`float`/`complex`; `x` itself for every other
    leaf.

    !!! example

        Keep the JAX arrays of `like` and load the rest:

        ```python
        import jax, jax.numpy as jnp, numpy as np
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", (jnp.ones(2), np.ones(2)))
        spec = lambda h, x: x if isinstance(x, jax.Array) else eqx_ckpt.default_deserialise_filter_spec(h, x)
        tree = eqx_ckpt.tree_deserialise_leaves("ckpt", (jnp.zeros(2), np.zeros(2)), spec)
        ```
    """
    if _dtypes.like_type(x) is None:
        return x
    return handle.read(x)


def tree_deserialise_leaves(
    path: Any,
    like: PyTree = None,
    filter_spec: Any = default_deserialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    where: Callable[[PyTree], Any] | None = None,
    prefix: str | None = None,
    rename: Mapping[str, str] | Callable[[str], str] | Sequence[tuple[str, Any]] | None = None,
    missing: str = "error",
    strict: bool = False,
    cast: bool = False,
    lazy: bool = False,
    transform: Any = None,
    progress: Progress = None,
    trust: Iterable[Any] = (),
    check_init: bool = False,
    read_once: bool | None = None,
    token: str | None = None,
    base: Any = None,
) -> PyTree:
    """Load the leaves of a PyTree from a checkpoint directory.

    **Arguments:**

    - `path`: the checkpoint directory, or a kvstore URL. It may also be a
        `.safetensors` file, a directory of Hugging Face sharded safetensors
        (`model.safetensors.index.json`), or an orbax PyTree checkpoint: the
        format is recognised from the files (see [docs/interop.md](../interop.md)).
    - `like`: a PyTree with the structure and leaf types of what is loaded;
        concrete, or abstract (`jax.ShapeDtypeStruct` leaves, such as
        `eqx.filter_eval_shape` gives). Loaded leaves replace those of `like`;
        a loaded JAX array is placed with the sharding of `like`'s leaf.
        `None` (the default): rebuild the saved tree (below `prefix`) from its
        structure record, with its own classes, as
        [`eqx_ckpt.Checkpoint.skeleton`][] does with `trust` and `check_init`
        (see [docs/structure.md](../structure.md)).
    - `filter_spec`: how to load each leaf: a callable `(handle, leaf) -> leaf`
        or a PyTree prefix of `like` of them. (See
        [`eqx_ckpt.default_deserialise_filter_spec`][].)
    - `is_leaf`: called on every node of `like`; where it returns `True` the
        node is treated as a leaf.
    - `where`: load only these sub-trees, selected as in `eqx.tree_at`
        (`lambda t: t["model"]`, `lambda m: (m.encoder, m.embed)`). Nothing else
        is read; every other leaf comes back exactly as it is in `like`.
    - `prefix`: the dotted path in the checkpoint that `like` corresponds to
        (`"model"` loads a bare model out of `{"model": ..., "opt_state": ...}`).
    - `rename`: a mapping or callable from a dotted path in `like` to one in the
        checkpoint (below `prefix`). A mapping renames whole sub-trees
        (`{"body": "encoder"}`); unmapped paths pass through. Or an ordered
        list of regular-expression rules `(pattern, replacement)`. The first
        rule whose pattern is found rewrites the path (`re.sub`, once). A
        replacement of `None` leaves that leaf unloaded: it keeps `like`'s
        value. A tuple of replacements reads several stored arrays, which a
        `transform` combines. A mapping key that names no leaf or sub-tree of
        `like` is a `CheckpointValueError` (whatever `missing` says); rules and
        callables are not checked so. A stored name may also be given as its
        file spells it (`params/Dense_0/kernel` for the dotted path
        `params%2FDense_0%2Fkernel`).
    - `missing`: `"error"` (the default) or `"keep"`: keep `like`'s leaf where the
        checkpoint has none.
    - `strict`: also report stored leaves (below `prefix`) that `like` lacks.
    - `cast`: `True` converts stored dtypes to `like`'s instead of raising. Rounding
        (to a narrower float, or a large integer to a float) is what a cast
        does. A value that would change otherwise is an error naming the leaf
        and the value: an integer that does not fit, a float with a fraction
        into an integer, NaN or infinity into an integer, a float beyond the
        target's range. The rule is the same for array and scalar leaves of
        `like`: `5.0` loads into a Python `int` (or an `int32` array) as `5`,
        `5.7` into either is an error (see [docs/values.md](../values.md)).
    - `lazy`: return [`eqx_ckpt.LazyArray`][]s that read when asked (see
        [`eqx_ckpt.materialise`][]).
    - `transform`: per-leaf layout changes, stored array(s) -> the array `like`
        expects: a mapping from dotted paths of `like` to functions, or a list of
        `(pattern, function)` rules (first match wins). A mapping key that is
        not a dotted path of a leaf of `like` (a typo, or the leaf's stored
        name) is a `CheckpointValueError`; rules are not checked so. A
        transformed leaf is read whole (lazily: when it is first read). A
        function that raises is a `LeafError` naming the leaf, chained to its
        exception. See
        [`eqx_ckpt.torch_layout`][] for PyTorch's layers.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and the load is large. `False` hides it. `True`
        shows it whatever the size. A callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)` as the
        bytes are read. Bytes are read a chunk or a slab at a time, so a large
        leaf moves in steps.
    - `trust`, `check_init`: for `like=None` only: the classes, functions and
        modules the rebuilt tree may use beyond the default set, and whether
        to run their `__check_init__` (see [`eqx_ckpt.Checkpoint.skeleton`][]).
    - `read_once`: with several JAX processes, whether bytes that several of
        them need (replicated leaves of `like`) are read from storage by one
        process and sent to the others through JAX's collectives. `None` (the
        default): for leaves held by 4 processes or more; `True`: from 2;
        `False`: never. Sharing makes the load a collective: every process
        must call it, with the same `like` (see
        [docs/scaling.md](../scaling.md#restoring-replicated-state-each-byte-read-once)).
    - `token`: a Hugging Face Hub token, for an `hf://` path of a private or
        gated repository; `None` takes `HF_TOKEN` or the one `hf auth login` saved.
    - `base`: for a fine-tune stored against a base (`export_safetensors(...,
        base=)`), where to read its base from instead of where its record
        says; its leaves are checked against the digests the fine-tune
        records. Needed where the recorded base is not followed on its own:
        anything but an `hf://` base or a folder beside the fine-tune (see
        [docs/sharing.md](../sharing.md#model-families)).

    **Returns:**

    `like`, with the selected leaves replaced by those loaded.

    **Raises:**

    One [`eqx_ckpt.LeafError`][] listing every missing, shape- or dtype-changed
    (and, with `strict=True`, unexpected) leaf, and the stored leaves `like`
    lacks (often the missing ones under another name). A load that matches no
    leaf at all is an error even with `missing="keep"`: it names the
    checkpoint's top-level keys and suggests `prefix=`. A 64-bit leaf loaded as
    a JAX array while JAX's 64-bit mode is off is an error, never a wrapped value.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        make = lambda: eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
        eqx_ckpt.tree_serialise_leaves("mlp_ckpt", make())
        model = eqx_ckpt.tree_deserialise_leaves("mlp_ckpt", eqx.filter_eval_shape(make))
        ```
    """
    options = LoadOptions(
        where=where,
        prefix=prefix,
        rename=rename,
        transform=transform,
        missing=missing,
        strict=strict,
        cast=cast,
        lazy=lazy,
        read_once=read_once,
        progress=progress,
        trust=trust,
        check_init=check_init,
        token=token,
        base=base,
    )
    return deserialise(path, like, filter_spec, is_leaf, options)


# Loads make many small objects (see `_gc.gc_paused`).
@_gc.gc_paused()
def deserialise(
    path: Any, like: PyTree, filter_spec: Any, is_leaf: Callable[[Any], bool] | None, options: LoadOptions
) -> PyTree:
    """`tree_deserialise_leaves` with its `options`: open the source, then `load`."""
    source = _opening.open_source(path, options)
    flat = None
    if like is None:
        like = rebuilt(source, options.prefix or "", Trust(options.trust), check_init=options.check_init)
    elif not options.rename and not options.transform:  # a renamed `like` is laid out unlike the record
        flat = _tree.flatten_named(like, is_leaf)  # as a save names its leaves; the plan's too
    return load(source, like, is_leaf, filter_spec, options, flat=flat, static=flat is not None)


def load(
    source: Source,
    like: PyTree,
    is_leaf: Callable[[Any], bool] | None,
    filter_spec: Any,
    options: LoadOptions,
    *,
    flat: tuple[list[Any], _tree.Names] | None = None,
    static: bool = False,
) -> PyTree:
    """`like` loaded from an opened `source`. `flat`: `like` flattened and named,
    where the caller has it. `static` (with `flat`): once the load succeeded,
    warn where a static field of a part of `like` it read differs from the record."""
    plan = _load_plan.plan(source, like, is_leaf, filter_spec, default_deserialise_filter_spec, options, flat)
    leaves = list(plan.leaves)
    for i, value in zip(_fed(plan), _read_values(source, plan)):
        leaves[i] = value
    # Last, once every read succeeded: a failed load leaves the iterators where they were.
    for i, keypath, path, state in plan.iterators:
        _iterators.put(leaves[i], state, path, keypath, checkpoint=source.loc.display)
    tree = plan.treedef.unflatten(leaves)
    if static and flat is not None:
        prefix = options.prefix or ""
        read = functools.partial(_leaves_read, plan)
        _rebuild.warn_static(_rebuild.static_differences(source.manifest, *flat, prefix, source.loc.display, read))
    return tree


def _fed(plan: LoadPlan) -> list[int]:
    """The indices of the leaves of `like` the plan feeds, in the order `_read_values` reads them."""
    return [p.index for p, _ in plan.custom] + [t.index for t in plan.transformed] + [p.index for p in plan.reads]


def _leaves_read(plan: LoadPlan) -> list[bool | None]:
    """For each leaf of `like`, whether the load read it (`None`: a leaf no load
    reads, a function), for the static-field check (`_rebuild.static_differences`)."""
    read: list[bool | None] = [False if _dtypes.like_type(leaf) is not None else None for leaf in plan.leaves]
    for i in _fed(plan):
        read[i] = True
    return read


def rebuilt(source: Source, prefix: str, trust: Trust, *, check_init: bool = False) -> PyTree:
    """The skeleton of the sub-tree at `prefix` of `source`, from its structure record (`_rebuild`)."""
    check_init = check_flag("check_init", check_init, "whether to run `__check_init__` of the rebuilt classes")
    return _rebuild.skeleton(source.manifest, prefix, trust, where=source.loc.display, check_init=check_init)


def _read_values(source: Source, plan: LoadPlan) -> list[Any]:
    """The values of the leaves `plan.custom`, `plan.transformed` and `plan.reads`
    feed, read in that order. A lazy load reads only its scalars; its
    checkpoint is checked as each lazy leaf is read."""
    options = plan.options
    try:
        values = [_run_custom(spec, leaf, source, options.cast, options.lazy) for leaf, spec in plan.custom]
        values += _read_transformed(source, plan)
        if options.lazy:
            _faults.fire("load.read_stored", source.loc)
            return values + _lazy_leaves(source, plan.reads)
    except Exception:
        source.check()  # a read that failed because the checkpoint was replaced says so
        raise
    return values + _reader.read_leaves(source, plan.reads, progress=options.progress, read_once=options.read_once)


def _read_transformed(source: Source, plan: LoadPlan) -> list[Any]:
    """The values of the transformed leaves; their problems raised together."""
    cast = plan.options.cast
    values, problems = _lazy.transformed(source, plan.transformed, cast=cast, lazy=plan.options.lazy)
    report = Report(plan.loc, cast=cast)
    for tplan, what, cause in problems:
        report.add_transform(tplan.keypath, tplan.stored, what, cause=cause)
    report.raise_if_any()
    return values


def _lazy_leaves(source: Source, plans: list[LeafPlan]) -> list[Any]:
    """`LazyArray`s of `plans`' stored leaves, but for their scalars, read now
    as values (as `Checkpoint(path)[key]` gives them)."""
    scalars = [i for i, plan in enumerate(plans) if _dtypes.like_type(plan.like) in SCALAR_TYPES]
    out: list[Any] = [LazyArray(source, _reader.record_of(plan), plan.like) for plan in plans]
    values = _reader.read(source, [plans[i] for i in scalars])
    for i, value in zip(scalars, values):
        out[i] = value
    return out


def _run_custom(spec: Any, plan: LeafPlan, source: Source, cast: bool, lazy: bool) -> Any:
    """Call a user's filter spec with a handle whose `read` loads one leaf."""

    def read(like: Any) -> Any:
        report = Report(loc, cast=cast)
        sub = dataclasses.replace(plan, like=like)
        if not _load_plan.check_leaf(sub, report, missing="error", cast=cast):
            report.raise_if_any()
        return _lazy_leaves(source, [sub])[0] if lazy else _reader.read(source, [sub])[0]

    loc = source.loc
    handle = LeafHandle(plan.keypath, plan.stored, loc.display, read=read)
    try:
        value = spec(handle, plan.like)
    except CheckpointError:
        raise
    except Exception as e:
        raise _leaf_error(plan, loc, f"the filter spec raised {type(e).__name__}: {e}") from e
    _assert_same(value, plan, loc)
    return value


def _assert_same(value: Any, plan: LeafPlan, loc: Location) -> None:
    """What a custom filter spec returns must match `like`, as Equinox checks."""
    like = plan.like
    abstract = isinstance(like, jax.ShapeDtypeStruct) and isinstance(value, (jax.Array, jax.ShapeDtypeStruct))
    if isinstance(value, LazyArray):
        return
    if not abstract and type(value) is not type(like):
        # Equinox names the leaf by `keystr` in quotes here, and by the key-path tuple below.
        what = f"'{jax.tree_util.keystr(plan.keypath)}' has changed type from {type(like)} in `like` to {type(value)}"
        raise _leaf_error(plan, loc, f"Deserialised leaf at path {what} on disk.")
    for attr in ("shape", "dtype"):
        old, new = getattr(like, attr, None), getattr(value, attr, None)
        if old is not None and new is not None and old != new:
            what = f"{plan.keypath!r} has changed {attr} from {old} in `like` to {new}"
            raise _leaf_error(plan, loc, f"Deserialised leaf at path {what} on disk.")


def _leaf_error(plan: LeafPlan, loc: Location, what: str) -> LeafError:
    message = leaf_message(what, keypath=plan.keypath, dotted=plan.stored, path=loc.display)
    return LeafError(message, path=loc.display, keypaths=[plan.keypath], dotted=[plan.stored])


def materialise(tree: PyTree, *, progress: Progress = None) -> PyTree:
    """Read every [`eqx_ckpt.LazyArray`][] of a tree, concurrently.

    **Arguments:**

    - `tree`: any PyTree. Its lazy leaves are read concurrently, others are
        kept. The bytes in flight are bounded, so the peak memory stays near
        the result's size.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and there is much to read. `False` hides it.
        `True` shows it whatever the size. A callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)`.

    **Returns:**

    The tree with every lazy leaf replaced by its value.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(3)})
        lazy = eqx_ckpt.tree_deserialise_leaves("ckpt", {"w": jnp.zeros(3)}, lazy=True)
        tree = eqx_ckpt.materialise(lazy)
        ```
    """
    values, treedef = jtu.tree_flatten(tree, is_leaf=is_lazy)
    lazy = [i for i, leaf in enumerate(values) if is_lazy(leaf)]
    # Grouped by checkpoint: each group is read as one load reads, and its
    # checkpoint checked once, after every read. A transformed leaf reads itself.
    groups: dict[int, list[int]] = {}
    for i in lazy:
        if type(values[i]) is LazyArray:
            groups.setdefault(id(values[i]._source), []).append(i)
    sources = [values[indices[0]]._source for indices in groups.values()]
    grouped = {i for indices in groups.values() for i in indices}
    own = [i for i in lazy if i not in grouped]
    nbytes = sum(values[i].nbytes for i in lazy)
    with _gc.gc_paused(), Tracker(progress, leaves=len(lazy), nbytes=nbytes, what="materialise") as tracker:
        jobs = ((i, values[i].nbytes, values[i].start) for i in own)
        for i, size, finish in _window.windowed(jobs):
            values[i] = finish()
            tracker.advance(leaves=1, nbytes=size)
        for source, indices in zip(sources, groups.values()):
            leaves = [values[i] for i in indices]
            plans = [LeafPlan.of(k, x._record, x._read_as()) for k, x in enumerate(leaves)]
            read = _reader.read_leaves(source, plans, checked=False, tracker=tracker)
            for i, value in zip(indices, read):
                values[i] = value
    for source in sources:
        source.check()
    return jtu.tree_unflatten(treedef, values)
