"""`tree_deserialise_leaves`: full, partial, re-rooted, renamed and lazy loads."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from . import (
    _dtypes,
    _gc,
    _keypath,
    _pack,
    _read,
    _select,
    _source,
    _storage,
    _storage_errors,
    _transform,
    _tree,
    _window,
)
from ._errors import CheckpointError, CheckpointValueError, LeafError, check_flag, leaf_line, leaf_message
from ._format import LeafRecord
from ._handle import LeafHandle
from ._lazy import LazyArray
from ._location import Location
from ._manifest import Manifest
from ._progress import Progress, Tracker
from ._source import Source


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


@dataclasses.dataclass
class _Plan:
    """What a load does with one selected leaf of `like`."""

    index: int
    keypath: tuple[Any, ...]
    like: Any
    stored: str
    record: LeafRecord | None = None


# How many leaves a failed load names; the rest are counted (and all are in the
# error's `dotted` attribute). A forgotten `prefix=` on a large tree would
# otherwise print every leaf.
_SHOWN = 12
_SHOWN_UNEXPECTED = 8


class _Report:
    """Every problem a load finds, raised together as one `LeafError`."""

    def __init__(self, loc: Location, *, cast: bool = False):
        self.loc = loc
        self.cast = cast
        self.lines: list[str] = []
        self.kinds: set[str] = set()
        self.keypaths: list[tuple[Any, ...]] = []
        self.dotted: list[str] = []
        self.unexpected: list[str] = []

    def add(self, kind: str, what: str, plan: _Plan | None, stored: str) -> None:
        keypath = plan.keypath if plan is not None else None
        self.lines.append("  - " + _clip(leaf_line(f"{kind}: {what}", keypath=keypath, dotted=stored)))
        self.kinds.add(kind)
        if plan is not None:
            self.keypaths.append(plan.keypath)
        self.dotted.append(stored)

    def raise_if_any(self) -> None:
        if not self.lines:
            return
        count = len(self.lines)
        shown = self.lines[:_SHOWN]
        if count > _SHOWN:
            shown.append(f"  ... and {count - _SHOWN} more (the error's `dotted` attribute lists them all).")
        if self.unexpected and "missing" in self.kinds:
            extra = len(self.unexpected) - _SHOWN_UNEXPECTED
            shown.append(
                "Stored leaves that `like` lacks (perhaps the missing ones, renamed):\n"
                + "\n".join(
                    _clip(f"  + `{path}` (stored, not in `like`)") for path in self.unexpected[:_SHOWN_UNEXPECTED]
                )
                + (f"\n  ... and {extra} more." if extra > 0 else "")
            )
        raise LeafError(
            f"Cannot load checkpoint {self.loc.display!r} into `like`: {count} "
            f"lea{'f does' if count == 1 else 'ves do'} not match.\n" + "\n".join(shown) + "\n" + self._fixes(),
            path=self.loc.display,
            keypaths=self.keypaths,
            dotted=self.dotted,
        )

    def _fixes(self) -> str:
        fixes = []
        if "missing" in self.kinds:
            fixes.append("`missing='keep'` keeps `like`'s value for missing leaves")
            fixes.append("`where=`/`prefix=`/`rename=` pick and map what is loaded")
        if "dtype changed" in self.kinds and not self.cast:
            fixes.append("`cast=True` converts dtypes (an error if a value would change beyond rounding)")
        if "shape changed" in self.kinds:
            fixes.append("shapes must match: build `like` with the saved shapes")
        if "unexpected" in self.kinds:
            fixes.append("`strict=False` allows stored leaves that `like` lacks")
        return ("To load anyway: " + "; ".join(fixes) + ".") if fixes else ""


def _clip(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else line[: limit - 5] + " ...]"


# Loads make many small objects (see `_gc.gc_paused`).
@_gc.gc_paused()
def tree_deserialise_leaves(
    path: Any,
    like: PyTree,
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
) -> PyTree:
    """Load the leaves of a PyTree from a checkpoint directory.

    **Arguments:**

    - `path`: the checkpoint directory, or a kvstore URL. It may also be a
        `.safetensors` file, a directory of Hugging Face sharded safetensors
        (`model.safetensors.index.json`), or an orbax PyTree checkpoint: the
        format is recognised from the files (see `docs/interop.md`).
    - `like`: a PyTree with the structure and leaf types of what is loaded;
        concrete, or abstract (`jax.ShapeDtypeStruct` leaves, such as
        `eqx.filter_eval_shape` gives). Loaded leaves replace those of `like`;
        a loaded JAX array is placed with the sharding of `like`'s leaf.
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
        list of regular-expression rules `(pattern, replacement)`: the first
        rule whose pattern is found rewrites the path (`re.sub`, once); a
        replacement of `None` leaves that leaf unloaded (it keeps `like`'s
        value), a tuple of replacements reads several stored arrays, which a
        `transform` combines.
    - `missing`: `"error"` (the default) or `"keep"`: keep `like`'s leaf where the
        checkpoint has none.
    - `strict`: also report stored leaves (below `prefix`) that `like` lacks.
    - `cast`: `True` converts stored dtypes to `like`'s instead of raising. Rounding
        (to a narrower float, or a large integer to a float) is what a cast
        does; a value that would change otherwise (an integer that does not
        fit, NaN or infinity into an integer, a float beyond the target's range)
        is an error naming the leaf.
    - `lazy`: return [`eqx_ckpt.LazyArray`][]s that read when asked (see
        [`eqx_ckpt.materialise`][]).
    - `transform`: per-leaf layout changes, stored array(s) -> the array `like`
        expects: a mapping from dotted paths of `like` to functions, or a list of
        `(pattern, function)` rules (first match wins). A transformed leaf is read
        whole (lazily: when it is first read). See
        [`eqx_ckpt.torch_layout`][] for PyTorch's layers.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and the load is large; `False` hides it, `True`
        shows it whatever the size, and a callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)`.

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
    if missing not in ("error", "keep"):
        raise CheckpointValueError(f"`missing` must be 'error' or 'keep', not {missing!r}.")
    strict = check_flag("strict", strict, "whether stored leaves `like` lacks are an error")
    lazy = check_flag("lazy", lazy, "whether to return `LazyArray`s that read when asked")
    if not isinstance(cast, (bool, np.bool_)):
        raise CheckpointValueError(
            f"`cast` of a load must be `True` or `False`, not {cast!r}: a load converts to "
            f"the dtypes of `like`. (A dtype to store in is `tree_serialise_leaves`'s `cast`.)"
        )
    source = _source.open_source(path)
    loc, manifest = source.loc, source.manifest
    flat, treedef = _tree.flatten(like, is_leaf)
    # Each leaf's dotted path, each key named once (`_keypath.dotted_and_records`): naming
    # every key path apart took 6 us a leaf, twice, for ten thousand leaves.
    dotted = _keypath.dotted_and_records([keypath for keypath, _ in flat])[0]
    specs = _tree.leaf_specs(filter_spec, like, is_leaf, what="like", count=len(flat))
    chosen = _select.selected(where, treedef, len(flat))
    if where is not None and not any(_loaded(flat[i][1], specs[i]) for i in chosen):
        shown = ", ".join(f"`{dotted[i]}`" for i in sorted(chosen)[:3])
        raise CheckpointValueError(
            f"`where` selected only leaves of `like` that are not loaded ({shown}: not arrays or scalars, such "
            f"as functions or strings, which stay as `like` has them), so nothing would be loaded. Select the "
            f"sub-trees holding the arrays to load."
        )
    root = _select.check_prefix(prefix)
    to_stored = _select.renamer(rename)
    to_transform = _transform.finder(transform)
    records = manifest.by_path()
    if root and not any(_keypath.is_within(p, root) for p in records):
        raise CheckpointValueError(
            f"`prefix` {root!r} is not in checkpoint {loc.display!r}; its top-level keys are "
            f"{_shown_keys(_keys_below(manifest, ''))}.",
            path=loc.display,
        )

    def stored_path(i: int) -> _select.Target:
        """Where leaf `i` of `like` is stored."""
        target = to_stored(dotted[i])
        if isinstance(target, tuple):
            return tuple(_keypath.join_dotted(root, t) for t in target)
        return None if target is None else _keypath.join_dotted(root, target)

    leaves = [leaf for _, leaf in flat]
    report = _Report(loc, cast=bool(cast))
    plans: list[_Plan] = []
    custom: list[tuple[_Plan, Any]] = []
    wanted: list[_Plan] = []
    changed: list[_transform.Plan] = []
    for i in sorted(chosen):
        keypath, leaf = flat[i]
        stored = stored_path(i)
        if stored is None:
            continue
        fn = to_transform(dotted[i])
        if (fn is not None or isinstance(stored, tuple)) and specs[i] is default_deserialise_filter_spec:
            tplan, problem = _transform.plan(i, keypath, leaf, stored, fn, records, missing=missing)
            if problem:
                kind, what = _split_problem(problem)
                report.add(kind, what, _Plan(i, keypath, leaf, _transform.shown(stored)), _transform.shown(stored))
            changed += [tplan] if tplan is not None else []
            continue
        if isinstance(stored, tuple):
            raise CheckpointValueError(
                f"`rename` gives several stored paths {stored} for `{dotted[i]}`, "
                "but a custom filter spec loads it; only a `transform` combines several."
            )
        if fn is not None:
            # Skipped, it once left the leaf untransformed without a word.
            raise CheckpointValueError(
                f"`transform` applies to `{dotted[i]}`, but a custom filter spec loads it, and a "
                f"filter spec reads the stored array itself. Transform inside the filter spec, or leave this "
                f"leaf to `eqx_ckpt.default_deserialise_filter_spec`."
            )
        plan = _Plan(i, keypath, leaf, stored, records.get(stored))
        if specs[i] is not default_deserialise_filter_spec:
            custom.append((plan, specs[i]))
        elif _dtypes.like_type(leaf) is not None:
            wanted.append(plan)
            if _check(plan, report, missing=missing, cast=bool(cast)):
                plans.append(plan)
    if not strict:  # with `strict=True` the report below lists both sides anyway
        _refuse_no_match(wanted, custom, changed, manifest, loc, root)
    if strict:
        _report_unexpected(flat, specs, stored_path, root, records, report)
    elif report.lines:
        found = {plan.stored for plan in wanted} | {plan.stored for plan, _ in custom}
        report.unexpected = sorted(
            (p for p in records if _keypath.is_within(p, root) and p not in found), key=_keypath.sort_key
        )
    report.raise_if_any()
    try:
        for plan, spec in custom:
            leaves[plan.index] = _run_custom(spec, plan, source, bool(cast), lazy)
        values, problems = _transform.load(source, changed, cast=bool(cast), lazy=lazy)
        for tplan, what in problems:
            shown = _transform.shown(tplan.stored)
            report.add(*_split_problem(what), _Plan(tplan.index, tplan.keypath, tplan.like, shown), shown)
        report.raise_if_any()
        for tplan, value in zip(changed, values):
            leaves[tplan.index] = value
        loaded = _load(source, plans, lazy=lazy, progress=progress)
    except Exception:
        source.check()  # a read that failed because the checkpoint was replaced says so
        raise
    if not lazy:
        source.check()
    for plan, value in zip(plans, loaded):
        leaves[plan.index] = value
    return treedef.unflatten(leaves)


def _split_problem(problem: str) -> tuple[str, str]:
    """A transform's problem as the report's (kind, what): `missing: ...` is a
    missing leaf; anything else is about the transform."""
    kind, sep, what = problem.partition(": ")
    return (kind, what) if sep and kind == "missing" else ("transform", problem)


def _refuse_no_match(
    wanted: list[_Plan],
    custom: list[tuple[_Plan, Any]],
    changed: list[Any],
    manifest: Manifest,
    loc: Location,
    root: str,
) -> None:
    """A load that finds none of `like`'s leaves is almost always a forgotten
    `prefix=`, or the wrong checkpoint: never return `like` unchanged for it."""
    if not wanted or changed or any(plan.record is not None for plan in wanted):
        return
    if any(plan.record is not None for plan, _ in custom):
        return
    looked = ", ".join(f"`{plan.stored}`" for plan in wanted[:3]) + (", ..." if len(wanted) > 3 else "")
    below = _keys_below(manifest, root)
    if not below:
        where, hint = "it holds no leaves", "Check the path."
    elif not root and below == [""]:
        where, hint = "it holds one array, saved as the whole tree", "Load it into a `like` that is one array leaf."
    elif not root:
        where = f"its top-level keys are {_shown_keys(below)}"
        hint = f"If `like` is one part of what was saved, pass `prefix=` naming it (e.g. `prefix={below[0]!r}`)."
    elif below == [""]:
        parent = root.rpartition(".")[0]
        where = f"`prefix` {root!r} names one leaf, so `like` must be that leaf alone"
        hint = f"To load the sub-tree holding it, pass `prefix={parent!r}`." if parent else "Pass no `prefix`."
    else:
        where = f"its keys below `prefix` {root!r} are {_shown_keys(below)}"
        hint = "Check `prefix=` and `rename=` against `Checkpoint(path).keys()`."
    raise LeafError(
        f"None of the {len(wanted)} leaves of `like` is in checkpoint {loc.display!r} "
        f"(looked for {looked}); {where}. {hint}",
        path=loc.display,
        keypaths=[plan.keypath for plan in wanted[:_SHOWN]],
        dotted=[plan.stored for plan in wanted],
    )


def _keys_below(manifest: Manifest, root: str) -> list[str]:
    """The first segments of the leaves' paths below dotted `root`, sorted (`""`
    for a leaf at `root` itself)."""
    firsts = set()
    for leaf in manifest.leaves:
        if _keypath.is_within(leaf.path, root):
            rest = _keypath.split_dotted(_keypath.relative(leaf.path, root))
            firsts.add(rest[0] if rest else "")
    return sorted(firsts, key=_keypath.sort_key)


def _shown_keys(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:20]) + (", ..." if len(keys) > 20 else "") if keys else "(none)"


def _check(plan: _Plan, report: _Report, *, missing: str, cast: bool) -> bool:
    """Whether the leaf will be read; problems go to `report`."""
    record = plan.record
    if record is None:
        if missing == "error":
            report.add("missing", "it is not in the checkpoint.", plan, plan.stored)
        return False
    problem = _dtypes.compatible(record, plan.like)
    if problem is not None:
        report.add("type changed", f"{problem}.", plan, plan.stored)
        return False
    shape, dtype = _dtypes.expected(plan.like)
    if _dtypes.like_type(plan.like) in ("bool", "int", "float", "complex"):
        return True
    if tuple(record.shape) != shape:
        report.add(
            "shape changed",
            f"Deserialised leaf at path {plan.keypath!r} has changed shape "
            f"from {shape} in `like` to {record.shape} on disk.",
            plan,
            plan.stored,
        )
        return False
    if dtype not in (record.dtype, record.stored_dtype) and not (cast and _castable(record, plan.like)):
        kind = "dtype changed"
        if record.type == "prng_key" or _dtypes.like_type(plan.like) == "prng_key":
            kind = "key type changed"
            why = "PRNG key arrays of different implementations cannot be converted (not even with `cast=True`)"
        else:
            why = "pass `cast=True` to convert" if not cast else "`cast=True` cannot convert these"
        report.add(
            kind,
            f"Deserialised leaf at path {plan.keypath!r} has changed dtype "
            f"from {dtype} in `like` to {record.dtype} on disk ({why}).",
            plan,
            plan.stored,
        )
        return False
    return True


def _castable(record: LeafRecord, like: Any) -> bool:
    return record.type != "prng_key" and _dtypes.like_type(like) != "prng_key"


def _loaded(leaf: Any, spec: Any) -> bool:
    """Whether a leaf of `like` is loaded: an array or a scalar, or any leaf a
    custom filter spec is given (functions and strings otherwise stay as they are)."""
    return _dtypes.like_type(leaf) is not None or spec is not default_deserialise_filter_spec


def _report_unexpected(
    flat: list[Any], specs: list[Any], stored_path: Any, root: str, records: dict[str, LeafRecord], report: _Report
) -> None:
    wanted: set[str] = set()
    for i, ((_, leaf), spec) in enumerate(zip(flat, specs)):
        if _loaded(leaf, spec):
            target = stored_path(i)
            wanted.update(target if isinstance(target, tuple) else () if target is None else (target,))
    for path in sorted(records, key=_keypath.sort_key):
        if _keypath.is_within(path, root) and path not in wanted:
            report.add(
                "unexpected", "it is in the checkpoint but not in `like` (you passed `strict=True`).", None, path
            )


def _target_dtype(like: Any) -> np.dtype | None:
    kind = _dtypes.like_type(like)
    if kind in ("jax", "numpy", "numpy_scalar"):
        return np.dtype(like.dtype)
    return None


_SCALARS = ("bool", "int", "float", "complex", "numpy_scalar")


def _load(source: Source, plans: list[_Plan], *, lazy: bool, progress: Progress = False) -> list[Any]:
    """Open every array, then read leaves concurrently within the read budget
    (`_window`), converting (and freeing the host buffer of) the oldest as new
    reads start."""
    data = source.data
    if lazy:
        # Scalars come back as values, as `Checkpoint(path)[key]` gives them.
        scalars = [i for i, plan in enumerate(plans) if _dtypes.like_type(plan.like) in _SCALARS]
        out: list[Any] = [
            LazyArray(data, _record_of(plan), plan.like, opener=source.opener, check=source.check) for plan in plans
        ]
        values = _load(source, [plans[i] for i in scalars], lazy=False)
        for i, value in zip(scalars, values):
            out[i] = value
        return out
    records = [_record_of(plan) for plan in plans]
    total = sum(r.nbytes for r in records)
    with _gc.gc_paused(), Tracker(progress, leaves=len(records), nbytes=total, what="load") as tracker:
        return _read_all(source, plans, records, tracker)


def _read_all(source: Source, plans: list[_Plan], records: list[LeafRecord], tracker: Tracker) -> list[Any]:
    data = source.data
    results: list[Any] = [None] * len(plans)
    packed = [i for i, record in enumerate(records) if record.pack is not None]
    if packed:
        _read_packed(data, [plans[i] for i in packed], [records[i] for i in packed], tracker, packed, results)
    own = [i for i, record in enumerate(records) if record.pack is None]
    # Large local leaves are read straight into their buffers; the others
    # through TensorStore, opened ahead of the reads.
    direct = {i for i in own if source.opener is None and _read.direct(data, records[i], plans[i].like)}
    opens = {i: source.open(records[i]) for i in own if i not in direct}

    def start(i: int) -> Callable[[], Any]:
        plan, record = plans[i], records[i]
        dtype = _target_dtype(plan.like)
        if i in direct:
            return _read.start_direct(data, record, plan.like, dtype=dtype)
        try:
            store = opens.pop(i).result()
        except Exception as e:
            raise _storage_errors.leaf_io_error(e, record, data, "open") from e
        return _read.start(store, data, record, plan.like, dtype=dtype)

    for i, size, finish in _window.windowed((i, records[i].nbytes, functools.partial(start, i)) for i in own):
        results[i] = finish()
        tracker.advance(leaves=1, nbytes=size)
    return [_dtypes.keep_weak_type(value, plan.like) for value, plan in zip(results, plans)]


def _read_packed(
    data: Location, plans: list[_Plan], records: list[LeafRecord], tracker: Tracker, slots: list[int], out: list[Any]
) -> None:
    """Packed leaves, read in a few runs of their packs and placed together."""
    for members, start, finish in _pack.read_leaves(data, records):
        try:
            run = finish()
        except Exception as e:
            # Which leaf of the run is damaged: read them one by one.
            for m in members:
                try:
                    _storage.open_packed(data, records[m]).result()
                except Exception as each:
                    raise _storage_errors.leaf_io_error(each, records[m], data, "read") from e
            raise _storage_errors.leaf_io_error(e, records[members[0]], data, "read") from e
        hosts = [run[records[m].offset - start :][: records[m].size].reshape(records[m].stored_shape) for m in members]
        values = _read.place(data, hosts, [records[m] for m in members], [plans[m].like for m in members])
        for m, value in zip(members, values):
            out[slots[m]] = value
        tracker.advance(leaves=len(members), nbytes=sum(records[m].nbytes for m in members))


def _record_of(plan: _Plan) -> LeafRecord:
    if plan.record is None:
        raise CheckpointValueError(f"Internal error: leaf `{plan.stored}` has no record to read.")
    return plan.record


def _run_custom(spec: Any, plan: _Plan, source: Source, cast: bool, lazy: bool) -> Any:
    """Call a user's filter spec with a handle whose `read` loads one leaf."""

    def read(like: Any) -> Any:
        report = _Report(loc, cast=cast)
        sub = dataclasses.replace(plan, like=like)
        if not _check(sub, report, missing="error", cast=cast):
            report.raise_if_any()
        return _load(source, [sub], lazy=lazy)[0]

    loc = source.loc
    handle = LeafHandle(plan.keypath, plan.stored, loc.display, read=read)
    try:
        value = spec(handle, plan.like)
    except CheckpointError:
        raise
    except Exception as e:
        message = leaf_message(
            f"the filter spec raised {type(e).__name__}: {e}",
            keypath=plan.keypath,
            dotted=plan.stored,
            path=loc.display,
        )
        raise LeafError(
            message,
            path=loc.display,
            keypaths=[plan.keypath],
            dotted=[plan.stored],
        ) from e
    _assert_same(value, plan, loc)
    return value


def _assert_same(value: Any, plan: _Plan, loc: Location) -> None:
    """What a custom filter spec returns must match `like`, as Equinox checks."""
    like = plan.like
    abstract = isinstance(like, jax.ShapeDtypeStruct) and isinstance(value, (jax.Array, jax.ShapeDtypeStruct))
    if isinstance(value, LazyArray):
        return
    if not abstract and type(value) is not type(like):
        # Equinox names the leaf by `keystr` in quotes here, and by the key-path tuple below.
        where = f"'{jax.tree_util.keystr(plan.keypath)}'"
        raise _changed(plan, loc, f"type from {type(like)} in `like` to {type(value)} on disk.", where)
    for attr in ("shape", "dtype"):
        old, new = getattr(like, attr, None), getattr(value, attr, None)
        if old is not None and new is not None and old != new:
            raise _changed(plan, loc, f"{attr} from {old} in `like` to {new} on disk.")


def _changed(plan: _Plan, loc: Location, what: str, where: str | None = None) -> LeafError:
    """Equinox's message for a loaded leaf that differs from `like`."""
    message = leaf_message(
        f"Deserialised leaf at path {where or repr(plan.keypath)} has changed {what}",
        keypath=plan.keypath,
        dotted=plan.stored,
        path=loc.display,
    )
    return LeafError(message, path=loc.display, keypaths=[plan.keypath], dotted=[plan.stored])
