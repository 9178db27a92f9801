"""The load plan: which stored record, if any, feeds each leaf of `like`, and how.

A load's options are resolved here, once, for every source format: `where`
picks leaves of `like`, `prefix` and `rename` name where each is stored,
`transform` makes some from stored arrays, and `missing`, `strict` and `cast`
say which differences are allowed. Every problem is raised together, before
anything is read, as one `LeafError` (`Report`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from .._base import _keypath, _select, _tree
from .._base._errors import CheckpointTypeError, CheckpointValueError, check_flag
from .._base._location import Location
from .._base._progress import Progress
from .._hosts import _sharding
from .._ondisk import _dtypes, _iterators
from .._ondisk._format import LeafRecord
from .._ondisk._manifest import Manifest, loads_file
from .._sources._source import Source
from ._load_report import (
    Narrowing,
    Report,
    Unmatched,
    keys_below,
    narrowed,
    refuse_no_match,
    refuse_unmatched,
    shown_keys,
)


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """A load's options, made once by each public load from its keyword
    arguments, then passed whole to the source, the plan and the readers.
    Each defaults and means as in `tree_deserialise_leaves`.

    `missing`, `strict`, `lazy`, `cast` and `read_once` are checked here, in
    that order; the others where they are used (by `plan`, or the rebuild)."""

    where: Callable[[Any], Any] | None = None
    prefix: str | None = None
    rename: Any = None
    transform: Any = None
    missing: str = "error"
    strict: bool = False
    cast: bool = False
    lazy: bool = False
    read_once: bool | None = None
    progress: Progress = None
    trust: Iterable[Any] = ()
    check_init: bool = False
    token: str | None = None
    base: Any = None

    def __post_init__(self) -> None:
        if self.missing not in ("error", "keep"):
            raise CheckpointValueError(f"`missing` must be 'error' or 'keep', not {self.missing!r}.")
        strict = check_flag("strict", self.strict, "whether stored leaves `like` lacks are an error")
        lazy = check_flag("lazy", self.lazy, "whether to return `LazyArray`s that read when asked")
        cast, read_once = self.cast, self.read_once
        if not isinstance(cast, (bool, np.bool_)):
            raise CheckpointValueError(
                f"`cast` of a load must be `True` or `False`, not {cast!r}: a load converts to "
                f"the dtypes of `like`. (A dtype to store in is `tree_serialise_leaves`'s `cast`.)"
            )
        if read_once is not None and not isinstance(read_once, (bool, np.bool_)):
            raise CheckpointTypeError(
                f"`read_once` must be `None` (share reads where it pays), `True` or `False`, not {read_once!r}."
            )
        # Frozen: the checked flags are set once, here, as plain `bool`s.
        object.__setattr__(self, "strict", strict)
        object.__setattr__(self, "lazy", lazy)
        object.__setattr__(self, "cast", bool(cast))
        object.__setattr__(self, "read_once", None if read_once is None else bool(read_once))

    @property
    def whole(self) -> bool:
        """Whether the load asks for everything stored: a Hub load then
        downloads the files into its cache, instead of reading byte ranges."""
        return self.where is None and self.prefix is None and not self.lazy

    def without_base(self) -> LoadOptions:
        """These options with no base given: what a fine-tune's base is opened with."""
        return dataclasses.replace(self, base=None)


@dataclasses.dataclass
class LeafPlan:
    """One selected leaf of `like`, fed by one stored path (`record`: its record,
    `None` where the checkpoint has none). `named(index)`: its key path, made
    when asked (`keypath`): a load asks only for the leaves its errors name."""

    index: int
    named: Callable[[int], tuple[Any, ...]] = dataclasses.field(repr=False, compare=False)
    like: Any
    stored: str
    record: LeafRecord | None = None

    @property
    def keypath(self) -> tuple[Any, ...]:
        return self.named(self.index)

    @classmethod
    def of(cls, index: int, record: LeafRecord, like: Any) -> LeafPlan:
        """The plan of reading `record` as `like`, named by the record's own key
        path, for a read that no `like` tree planned (`materialise`, say)."""
        return cls(index, functools.partial(_keypath_of, record), like, record.path, record)


def _keypath_of(record: LeafRecord, index: int) -> tuple[Any, ...]:
    return _keypath.from_json(record.keypath)


@dataclasses.dataclass(frozen=True)
class TransformPlan:
    """One leaf of `like` made by a function of one or more stored arrays."""

    index: int
    keypath: tuple[Any, ...]
    like: Any
    stored: tuple[str, ...]
    records: tuple[LeafRecord, ...]
    fn: _select.Transform


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What a load reads, and into which leaf of `like` each value goes. Leaves
    in none of `reads`, `custom` and `transformed` stay as `like` has them."""

    loc: Location
    treedef: Any
    # `like`'s leaves, in order.
    leaves: list[Any]
    # Read by the load (`default_deserialise_filter_spec`), records checked against `like`.
    reads: list[LeafPlan]
    # Read by a custom filter spec, which is given a handle to read with.
    custom: list[tuple[LeafPlan, Any]]
    # Made by a `transform` of the stored arrays, checked against `like` once made.
    transformed: list[TransformPlan]
    # The load's options (`cast`, `lazy`, `read_once`: how the readers read).
    options: LoadOptions
    # The iterators of `like` the load puts a state into: (index, key path,
    # dotted path stored, the state, checked: `_iterators.state_of`).
    iterators: list[tuple[int, tuple[Any, ...], str, Any]] = dataclasses.field(default_factory=list)


def plan(
    source: Source,
    like: Any,
    is_leaf: Any,
    filter_spec: Any,
    default: Any,
    options: LoadOptions,
    flat: tuple[list[Any], _tree.Names] | None = None,
) -> LoadPlan:
    """The plan of loading `source` into `like`, every problem raised together.
    `default`: the filter spec whose leaves the load reads itself. `flat`:
    `like` flattened and named (`_tree.flatten_named`), where the caller has it."""
    values, named = flat if flat is not None else _tree.flatten_named(like, is_leaf)
    treedef = named.treedef
    specs = _tree.leaf_specs(filter_spec, like, is_leaf, what="like", count=len(values))
    leaves = _Leaves(values, named, specs, default)
    chosen = _chosen(options.where, treedef, leaves)
    names = _names(source.loc, source.manifest, named.paths, options)
    _check_keys(options, named.paths, names, source.loc)
    report = Report(source.loc, cast=options.cast)
    leaves.assign(chosen, names, report, missing=options.missing, cast=options.cast)
    iterators = _iterator_states(leaves, chosen, names, source.manifest, report, missing=options.missing)
    _check_whole(leaves, names, report, source.manifest, strict=options.strict)
    if report.kinds == {"shape changed"}:
        report.narrowing = _narrowing(leaves, chosen, report.reshaped)
    report.raise_if_any()
    # A fine-tune's base is opened (and checked) here, where a leaf read is taken from it: before any read.
    source.need(
        [p.stored for p in leaves.reads]
        + [p.stored for p, _ in leaves.custom]
        + [name for t in leaves.transformed for name in t.stored]
    )
    return LoadPlan(source.loc, treedef, values, leaves.reads, leaves.custom, leaves.transformed, options, iterators)


def _iterator_states(
    leaves: _Leaves, chosen: list[int], names: _Names, manifest: Manifest, report: Report, *, missing: str
) -> list[tuple[int, tuple[Any, ...], str, Any]]:
    """The checked state of each chosen iterator of `like`, from this process's
    place in the job (`_iterators.state_of`). One the checkpoint lacks goes to
    `report` (unless `missing="keep"`: the fresh iterator is kept)."""
    at = leaves.iterators
    if not at:
        return []
    stored = {it.path: it for it in manifest.iterators}
    picked = set(chosen)
    out = []
    for i in at:
        path = names.stored(i) if i in picked else None
        if not isinstance(path, str):  # not selected, renamed to `None` (or to several)
            continue
        record = stored.get(path)
        if record is None:
            if missing == "error":
                report.add("missing", "its iterator state is not in the checkpoint.", leaves.names.keypath(i), path)
            continue
        where = report.loc.display
        process, processes = jax.process_index(), jax.process_count()
        state = _iterators.state_of(record, process, processes, checkpoint=where, loads=loads_file)
        out.append((i, leaves.names.keypath(i), path, state))
    return out


def _chosen(where: Callable[[Any], Any] | None, treedef: Any, leaves: _Leaves) -> list[int]:
    """The indices of the leaves of `like` that `where` selects, in order."""
    chosen = _select.selected(where, treedef, len(leaves.values))
    values, specs, default, dotted = leaves.values, leaves.specs, leaves.default, leaves.dotted
    iterators = set(leaves.iterators)
    if where is not None and not any(_loaded(values[i], specs[i], default) or i in iterators for i in chosen):
        shown = ", ".join(f"`{dotted[i]}`" for i in sorted(chosen)[:3])
        raise CheckpointValueError(
            f"`where` selected only leaves of `like` that are not loaded ({shown}: not arrays or scalars, such "
            f"as functions or strings, which stay as `like` has them), so nothing would be loaded. Select the "
            f"sub-trees holding the arrays to load."
        )
    return sorted(chosen)


def _check_whole(leaves: _Leaves, names: _Names, report: Report, manifest: Manifest, *, strict: bool) -> None:
    """The checks once every leaf is planned: a load that matches nothing, and the
    stored leaves `like` lacks (an error with `strict`, else listed beside the
    leaves that do not match)."""
    if strict:  # the report lists both sides
        _report_unexpected(leaves, names, report)
        return
    refuse_no_match(leaves.wanted, leaves.custom, leaves.transformed, manifest, report.loc, names.root)
    if report.lines:
        found = {plan.stored for plan in leaves.wanted} | {plan.stored for plan, _ in leaves.custom}
        report.unexpected = sorted(
            (p for p in names.records if _keypath.is_within(p, names.root) and p not in found), key=_keypath.sort_key
        )


def _narrowing(leaves: _Leaves, chosen: list[int], reshaped: set[tuple[Any, ...]]) -> Narrowing | None:
    """Where only shapes changed: the `where` that loads all but the sub-trees
    that changed (`narrowed`), from every leaf of `like` a load reads."""
    picked = set(chosen)
    states = []
    for i, (leaf, spec) in enumerate(zip(leaves.values, leaves.specs)):
        if _loaded(leaf, spec, leaves.default):
            keypath = leaves.names.keypath(i)
            states.append((keypath, "changed" if keypath in reshaped else "kept" if i in picked else "out"))
    return narrowed(states)


@dataclasses.dataclass(frozen=True)
class _Names:
    """`prefix`, `rename` and `transform` resolved: where each leaf of `like` is
    stored (`stored`, by index), and the function making a leaf from what is
    stored (`transform`, by dotted path)."""

    root: str
    records: dict[str, LeafRecord]
    stored: Callable[[int], _select.Target]
    transform: Callable[[str], _select.Transform | None]


def _names(loc: Location, manifest: Manifest, dotted: list[str], options: LoadOptions) -> _Names:
    """Where each leaf of `like` is stored, and its transform; a `prefix` that is
    not in the checkpoint is an error."""
    root = _select.check_prefix(options.prefix)
    to_stored = _select.renamer(options.rename)
    to_transform = _select.finder(options.transform)
    records = manifest.by_path()
    if root and not any(_keypath.is_within(p, root) for p in records):
        raise CheckpointValueError(
            f"`prefix` {root!r} is not in checkpoint {loc.display!r}; its top-level keys are "
            f"{shown_keys(keys_below(manifest, ''))}.",
            path=loc.display,
        )

    def stored_path(i: int) -> _select.Target:
        """Where leaf `i` of `like` is stored."""
        target = to_stored(dotted[i])
        if not root:  # most loads: the stored path is the target itself
            return target
        if isinstance(target, tuple):
            return tuple(_keypath.join_dotted(root, t) for t in target)
        return None if target is None else _keypath.join_dotted(root, target)

    return _Names(root, records, stored_path, to_transform)


def _check_keys(options: LoadOptions, dotted: list[str], names: _Names, loc: Location) -> None:
    """Refuse a key of a `rename` or `transform` mapping that names no leaf of
    `like` (whatever `where` and `missing` say; a `rename` key may name a
    sub-tree): it would leave a leaf as `like` has it without a word. Rule
    lists and callables are not checked: they are often written for many models."""
    unmatched: list[tuple[str, str, set[str]]] = []
    if isinstance(options.rename, Mapping) and options.rename:
        # Every sub-tree of `like` holding a leaf (the root, `""`, is not a key `rename` applies).
        trees = {".".join(parts[:n]) for parts in map(_keypath.split_dotted, dotted) for n in range(1, len(parts) + 1)}
        unmatched += [("rename", key, trees) for key in options.rename if key not in trees]
    if isinstance(options.transform, Mapping) and options.transform:
        leaves = set(dotted)
        unmatched += [("transform", key, leaves) for key in options.transform if key not in leaves]
    if unmatched:
        shown = [_unmatched(*u, dotted, names) for u in unmatched[:_SHOWN_KEYS]]
        refuse_unmatched(shown, {option for option, _, _ in unmatched}, len(unmatched), loc)


# How many unmatched keys an error explains (each costs a search of `like`'s paths).
_SHOWN_KEYS = 12


def _unmatched(option: str, key: str, paths: set[str], dotted: list[str], names: _Names) -> Unmatched:
    """What a key that names nothing in `like` is: the paths of `like` nearest to
    it and, if it is a name in the checkpoint, the leaves of `like` loaded from it."""
    as_stored = {key, _keypath.join_dotted(names.root, key)}
    stored = bool(key) and any(_keypath.is_within(p, s) for p in names.records for s in as_stored)
    loaded_from = []
    if stored:
        for i, path in enumerate(dotted):
            try:
                target = names.stored(i)
            except CheckpointValueError:  # a rename callable's own error is raised where it is used
                continue
            if target in as_stored or (isinstance(target, tuple) and as_stored & set(target)):
                loaded_from.append(path)
    return Unmatched(option, key, stored, loaded_from[:3], _nearest(key, paths))


def _nearest(key: str, paths: set[str]) -> list[str]:
    """A few of `paths` near `key`: the closest spellings, else those ending in
    its last segment (a stored name's leaf below another parent), else the first."""
    close = difflib.get_close_matches(key, paths, n=3)
    last = key.rpartition(".")[2]
    ending = [p for p in paths if p.rpartition(".")[2] == last]
    return close or sorted(ending or paths, key=_keypath.sort_key)[:3]


class _Leaves:
    """The selected leaves of `like`, sorted into what feeds each."""

    def __init__(self, values: list[Any], names: _tree.Names, specs: list[Any], default: Any):
        self.values, self.names, self.specs, self.default = values, names, specs, default
        self.dotted = names.paths
        self.reads: list[LeafPlan] = []
        self.custom: list[tuple[LeafPlan, Any]] = []
        self.transformed: list[TransformPlan] = []
        # The indices of the iterators among `values` (`_iterators`).
        self.iterators = _iterators.found(values)
        # Every array leaf the load reads itself, whether its record passed the checks or not.
        self.wanted: list[LeafPlan] = []

    def assign(self, chosen: list[int], names: _Names, report: Report, *, missing: str, cast: bool) -> None:
        """Plan every leaf of `chosen`; problems go to `report`. (A hot loop: it
        runs for every leaf of `like`, hence the names bound before it.)"""
        values, dotted, specs, default, records = self.values, self.dotted, self.specs, self.default, names.records
        stored_path, to_transform, wanted, reads = names.stored, names.transform, self.wanted, self.reads
        named = self.names.keypath
        iterators = set(self.iterators)
        for i in chosen:
            leaf = values[i]
            if iterators and i in iterators:  # given its state by `_iterator_states`
                continue
            stored = stored_path(i)
            if stored is None:  # renamed to `None`: keeps `like`'s value
                continue
            fn = to_transform(dotted[i])
            if specs[i] is not default:
                self.custom.append((self._custom(i, stored, fn, records), specs[i]))
            elif fn is not None or isinstance(stored, tuple):
                tplan, problem = _transformed(i, named(i), leaf, stored, fn, records, missing=missing)
                if problem:
                    report.add_transform(named(i), stored, problem)
                self.transformed += [tplan] if tplan is not None else []
            elif _dtypes.like_type(leaf) is not None:
                plan = LeafPlan(i, named, leaf, stored, records.get(stored))
                wanted.append(plan)
                if check_leaf(plan, report, missing=missing, cast=cast):
                    reads.append(plan)

    def _custom(self, i: int, stored: _select.Target, fn: Any, records: dict[str, LeafRecord]) -> LeafPlan:
        """The plan of a leaf a custom filter spec loads: from one stored array, as it is."""
        if isinstance(stored, tuple):
            raise CheckpointValueError(
                f"`rename` gives several stored paths {stored} for `{self.dotted[i]}`, "
                "but a custom filter spec loads it; only a `transform` combines several."
            )
        if fn is not None:
            # Skipped, it once left the leaf untransformed without a word.
            raise CheckpointValueError(
                f"`transform` applies to `{self.dotted[i]}`, but a custom filter spec loads it, and a "
                f"filter spec reads the stored array itself. Transform inside the filter spec, or leave this "
                f"leaf to `eqx_ckpt.default_deserialise_filter_spec`."
            )
        assert stored is not None
        return LeafPlan(i, self.names.keypath, self.values[i], stored, records.get(stored))


def _transformed(
    index: int,
    keypath: tuple[Any, ...],
    like: Any,
    stored: str | tuple[str, ...],
    fn: _select.Transform | None,
    records: dict[str, LeafRecord],
    *,
    missing: str,
) -> tuple[TransformPlan | None, str]:
    """The plan of a leaf made by `fn` from one or more stored arrays, or why not."""
    names = stored if isinstance(stored, tuple) else (stored,)
    if fn is None:
        return None, f"`rename` gives {len(names)} stored paths ({', '.join(names)}) but no `transform` combines them."
    absent = [name for name in names if name not in records]
    if absent:
        return None, f"missing: {', '.join(absent)} not in the checkpoint." if missing == "error" else ""
    if _dtypes.like_type(like) is None:
        return None, ""
    return TransformPlan(index, keypath, like, names, tuple(records[n] for n in names), fn), ""


def _loaded(leaf: Any, spec: Any, default: Any) -> bool:
    """Whether a leaf of `like` is loaded: an array or a scalar, or any leaf a
    custom filter spec is given (functions and strings otherwise stay as they are)."""
    return _dtypes.like_type(leaf) is not None or spec is not default


def check_leaf(plan: LeafPlan, report: Report, *, missing: str, cast: bool) -> bool:
    """Whether the leaf will be read; problems go to `report`."""
    record = plan.record
    if record is None:
        if missing == "error":
            report.add("missing", "it is not in the checkpoint.", plan.keypath, plan.stored)
        return False
    problem = _dtypes.compatible(record, plan.like, cast=cast)
    if problem is not None:
        report.add("type changed", f"{problem}.", plan.keypath, plan.stored)
        return False
    shape, dtype = _dtypes.expected(plan.like)
    if _dtypes.like_type(plan.like) in ("bool", "int", "float", "complex"):
        return True
    if tuple(record.shape) != shape:
        report.add(
            "shape changed",
            f"Deserialised leaf at path {plan.keypath!r} has changed shape "
            f"from {shape} in `like` to {record.shape} on disk.",
            plan.keypath,
            plan.stored,
        )
        return False
    unplaceable = _sharding.unplaceable(getattr(plan.like, "sharding", None))
    if unplaceable is not None:
        report.add("placement", f"{unplaceable}.", plan.keypath, plan.stored)
        return False
    keys = record.type == "prng_key" or _dtypes.like_type(plan.like) == "prng_key"
    if dtype not in (record.dtype, record.stored_dtype) and not (cast and not keys):
        kind = "dtype changed"
        if keys:
            kind = "key type changed"
            why = "PRNG key arrays of different implementations cannot be converted (not even with `cast=True`)"
        else:
            why = "pass `cast=True` to convert" if not cast else "`cast=True` cannot convert these"
        report.add(
            kind,
            f"Deserialised leaf at path {plan.keypath!r} has changed dtype "
            f"from {dtype} in `like` to {record.dtype} on disk ({why}).",
            plan.keypath,
            plan.stored,
        )
        return False
    return True


def _report_unexpected(leaves: _Leaves, names: _Names, report: Report) -> None:
    wanted: set[str] = set()
    for i, (leaf, spec) in enumerate(zip(leaves.values, leaves.specs)):
        if _loaded(leaf, spec, leaves.default):
            target = names.stored(i)
            wanted.update(target if isinstance(target, tuple) else () if target is None else (target,))
    for path in sorted(names.records, key=_keypath.sort_key):
        if _keypath.is_within(path, names.root) and path not in wanted:
            report.add(
                "unexpected", "it is in the checkpoint but not in `like` (you passed `strict=True`).", None, path
            )
