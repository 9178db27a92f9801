"""`diff`: compare two checkpoints key by key, and optionally byte by byte:
chunk by chunk, as `verify` reads, so in bounded memory whatever the size."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._base._errors import CheckpointError, check_flag
from .._base._location import Location
from .._base._progress import Progress, Tracker
from .._load import _read, _rebuild
from .._load._checkpoint import describe, human as _human
from .._load._load_plan import LoadOptions
from .._ondisk import _iterators
from .._ondisk._format import LeafRecord, dtype_from_name
from .._ondisk._iterators import IteratorRecord
from .._sources import _opening, _source
from .._store import _storage, _storage_errors


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """How two checkpoints differ, as [`eqx_ckpt.diff`][] finds it.

    Iterating gives one sorted line per differing key: `+ key` added, `- key`
    removed, `~ key` shape, dtype or type changed, `! key` values (or an
    iterator's saved states) differ. `len()` counts them. So the diff is falsy
    exactly when the checkpoints hold the same leaves with the same bytes, and
    the same iterator states.

    **Attributes:**

    - `added`: dotted paths only in the second checkpoint (an iterator's too).
    - `removed`: dotted paths only in the first.
    - `changed`: `(dotted path, "before -> after")` pairs whose shape, dtype or
        leaf type differ; for an iterator, the kind of its states or how many
        processes saved them (`iterator (json, 1 process) -> iterator (json, 2 processes)`).
    - `values`: dotted paths with the same shape and dtype but different values.
    - `structure`: `(dotted path, "before -> after")` pairs where the saved
        structures differ other than in stored leaves: a class, its fields, a
        static value (a hyperparameter such as an MLP's `depth`), a function
        (`jax.nn.relu -> jax.nn.gelu`); compared where both checkpoints record
        their structure (format 5 on). Lines `* key: ...`.
    - `rewrapped`: `(key in the first, key in the second)` pairs of a leaf
        removed and one added that hold the same bytes, where one checkpoint
        is a fine-tune that takes the leaf from the other under another key
        path (a weight re-wrapped, as a LoRA wrapper does, or renamed):
        compared with `values=True` only. Their `+`/`-` lines say so.
    - `iterators`: `(dotted path, what)` pairs of iterators in both whose
        saved states differ (see [docs/manager.md](../manager.md#resuming-the-data)):
        `what` is `"iterator state differs"`, or, saved by several processes,
        says which (`"iterator states differ in processes 1, 3 of 4"`).
        Lines `! key: ...`.
    - `magnitudes`: for each of `values`, how far apart they are:
        `(max_abs, relative)`, the largest `|a - b|` and `‖a - b‖ / ‖a‖`
        (2-norms over the whole leaf; `inf` where `‖a‖` is 0; NaN where a
        value is NaN), as float64; `(nan, nan)` for PRNG keys.
    - `equal`: how many leaves were compared and found equal.
    - `nbytes`: the bytes of the leaves compared (of the first checkpoint),
        and `changed_nbytes`: those of `values`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("a", {"w": jnp.ones(2), "b": jnp.zeros(2)})
        eqx_ckpt.tree_serialise_leaves("b", {"w": jnp.full(2, 2.0), "lr": 0.1})
        changes = eqx_ckpt.diff("a", "b")
        print(list(changes))   # ['- b', '+ lr', '! w: values differ']
        print(changes.values)  # ('w',)
        ```
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[tuple[str, str], ...] = ()
    values: tuple[str, ...] = ()
    structure: tuple[tuple[str, str], ...] = ()
    rewrapped: tuple[tuple[str, str], ...] = ()
    iterators: tuple[tuple[str, str], ...] = ()
    magnitudes: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict, hash=False)
    equal: int = 0
    nbytes: int = 0
    changed_nbytes: int = 0

    def lines(self, *, magnitudes: bool = False) -> list[str]:
        """One sorted line per difference (what iterating gives); with
        `magnitudes=True`, each `!` line also says how far apart the values
        are (as `eqx-ckpt diff` prints it)."""
        now = {a: b for a, b in self.rewrapped}
        before = {b: a for a, b in self.rewrapped}
        out = [
            (k, f"+ {k}" + (f": the same bytes as `{before[k]}`, re-wrapped" if k in before else ""))
            for k in self.added
        ]
        out += [(k, f"- {k}" + (f": the same bytes now at `{now[k]}`" if k in now else "")) for k in self.removed]
        out += [(k, f"~ {k}: {what}") for k, what in self.changed]
        out += [(k, f"! {k}: values differ{self._magnitude(k) if magnitudes else ''}") for k in self.values]
        out += [(k, f"* {k or '(the root)'}: {what}") for k, what in self.structure]
        out += [(k, f"! {k}: {what}") for k, what in self.iterators]
        return [line for _, line in sorted(out)]

    def _magnitude(self, key: str) -> str:
        largest, relative = self.magnitudes.get(key, (math.nan, math.nan))
        if math.isnan(largest) and math.isnan(relative):
            return ""
        return f" (max |a-b| {largest:.3g}, |a-b|/|a| {relative:.3g})"

    def summary(self) -> str:
        """One line of totals: the leaves in both (equal, differing in values,
        or in shape, dtype or type), added, removed, and the bytes compared."""
        both = self.equal + len(self.values) + len(self.changed)
        line = (
            f"{both} leaves in both: {self.equal} equal, {len(self.values)} with other values "
            f"({_human(self.changed_nbytes)} of {_human(self.nbytes)} compared), {len(self.changed)} of another "
            f"shape, dtype or type; {len(self.added)} added, {len(self.removed)} removed"
        )
        line += f"; {len(self.structure)} structure differences" if self.structure else ""
        count = len(self.iterators)
        if count:
            line += "; 1 iterator whose state differs" if count == 1 else f"; {count} iterators whose states differ"
        return line

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines())

    def __len__(self) -> int:
        kinds = (self.added, self.removed, self.changed, self.values, self.structure, self.iterators)
        return sum(map(len, kinds))


def diff(a: Any, b: Any, *, values: bool = True, progress: Progress = None, token: str | None = None) -> CheckpointDiff:
    """Compare two checkpoints key by key: their leaves, their structure, and
    the saved states of their iterators (a data pipeline's position).

    **Arguments:**

    - `a`, `b`: checkpoint directories or kvstore URLs; or any other source
        `Checkpoint` opens (a `.safetensors` file, a Hugging Face directory, an
        orbax checkpoint), so an export can be compared with its checkpoint.
    - `values`: also read both copies of every leaf whose shape and dtype agree,
        and compare their bytes (chunk by chunk, in bounded memory). With `False`
        only the manifests are compared.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and there is much to compare; `False` hides it,
        `True` shows it whatever the size, and a callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)`.
    - `token`: a Hugging Face Hub token, for `hf://` paths of private or
        gated repositories; `None` takes `HF_TOKEN` or the one `hf auth login` saved.

    **Returns:**

    A [`eqx_ckpt.CheckpointDiff`][]: empty (falsy) when the checkpoints are equal.

    **Raises:**

    [`eqx_ckpt.CheckpointNotFoundError`][] or
    [`eqx_ckpt.CorruptCheckpointError`][] if either is missing or its manifest
    is invalid; [`eqx_ckpt.IntegrityError`][] naming the leaf if a leaf cannot
    be read.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("a", {"w": jnp.ones(3), "b": jnp.ones(2)})
        eqx_ckpt.tree_serialise_leaves("b", {"w": jnp.zeros(3), "c": jnp.ones(2)})
        print(list(eqx_ckpt.diff("a", "b")))  # ['- b', '+ c', '! w: values differ']
        ```
    """
    values = check_flag("values", values, "whether to compare the values of leaves that agree in shape and dtype")
    options = LoadOptions(token=token)
    source_a, source_b = _opening.open_source(a, options, whole=False), _opening.open_source(b, options, whole=False)
    recs_a, recs_b = source_a.manifest.by_path(), source_b.manifest.by_path()
    its_a = {it.path: it for it in source_a.manifest.iterators}
    its_b = {it.path: it for it in source_b.manifest.iterators}
    keys_a, keys_b = recs_a.keys() | its_a.keys(), recs_b.keys() | its_b.keys()
    changed, same, states = [], [], []
    for key in sorted(keys_a & keys_b):
        before = _signature(recs_a[key] if key in recs_a else its_a[key])
        after = _signature(recs_b[key] if key in recs_b else its_b[key])
        if before != after:
            changed.append((key, f"{before} -> {after}"))
        elif key in recs_a:
            same.append((recs_a[key], recs_b[key]))
        elif (what := _states_differ(its_a[key], its_b[key])) is not None:
            states.append((key, what))
    differ: dict[str, tuple[float, float]] = {}
    nbytes = sum(ra.nbytes for ra, _ in same)
    moved = _moved(source_a.manifest, source_b.manifest, recs_a, recs_b) if values else []
    if values:
        pairs = same + [(recs_a[x], recs_b[y]) for x, y in moved]
        total = nbytes + sum(recs_a[x].nbytes for x, _ in moved)
        with Tracker(progress, leaves=len(pairs), nbytes=total, what="diff") as tracker:
            differ = _compare_values(source_a, source_b, pairs, tracker)
        moved = [(x, y) for x, y in moved if differ.pop(x, None) is None]
    structure = _rebuild.differences(source_a.manifest, source_b.manifest, source_a.loc.display, source_b.loc.display)
    return CheckpointDiff(
        added=tuple(sorted(keys_b - keys_a)),
        removed=tuple(sorted(keys_a - keys_b)),
        changed=tuple(changed),
        values=tuple(sorted(differ)),
        structure=tuple(structure),
        rewrapped=tuple(moved),
        iterators=tuple(states),
        magnitudes=differ,
        equal=len(same) - len(differ) if values else 0,
        nbytes=nbytes if values else 0,
        changed_nbytes=sum(recs_a[path].nbytes for path in differ),
    )


def _moved(
    manifest_a: Any, manifest_b: Any, recs_a: dict[str, LeafRecord], recs_b: dict[str, LeafRecord]
) -> list[tuple[str, str]]:
    """`(key in a, key in b)` of each leaf only in one that a fine-tune (either
    one) records as taken from a leaf only in the other, under another key,
    of the same shape and dtype: to be compared (`CheckpointDiff.rewrapped`)."""
    pairs = set()
    for manifest, flip in ((manifest_b, False), (manifest_a, True)):
        family = getattr(manifest, "family", None)
        for key, taken in ({} if family is None else family.references).items():
            x, y = (key, taken) if flip else (taken, key)
            if x in recs_a and y in recs_b and x not in recs_b and y not in recs_a:
                if _signature(recs_a[x]) == _signature(recs_b[y]):
                    pairs.add((x, y))
    return sorted(pairs)


def _signature(record: LeafRecord | IteratorRecord) -> str:
    if isinstance(record, IteratorRecord):
        return _iterators.describe(record)
    shown = describe(record).split(" (stored")[0]
    return shown if record.type in ("jax", "numpy") else f"{shown} ({record.type})"


def _states_differ(a: IteratorRecord, b: IteratorRecord) -> str | None:
    """How the states of an iterator of the same kind and processes differ
    (their stored text compared: equal states are stored alike), or `None`."""
    pairs = enumerate(zip(a.states, b.states, strict=True))
    differ = [i for i, (x, y) in pairs if (x.kind, x.data) != (y.kind, y.data)]
    if not differ:
        return None
    if len(a.states) == 1:
        return "iterator state differs"
    which = f"process {differ[0]}" if len(differ) == 1 else f"processes {', '.join(map(str, differ))}"
    return f"iterator states differ in {which} of {len(a.states)}"


def _open(source: _source.Source, record: LeafRecord) -> Any:
    """A leaf's opened array: eqx_ckpt's with its zarr.json checked against the
    manifest (`Source.open` does not), another format's as its source opens it."""
    try:
        if source.opener is None:
            return _storage.open_array(source.data, record).result()
        return source.open(record).result()
    except CheckpointError:
        raise
    except Exception as e:
        raise _storage_errors.leaf_io_error(e, record, source.data, "open") from e


def _compare_values(
    source_a: _source.Source, source_b: _source.Source, pairs: list[tuple[LeafRecord, LeafRecord]], tracker: Tracker
) -> dict[str, tuple[float, float]]:
    """The leaves of `pairs` whose values differ, each with how far apart
    (`CheckpointDiff.magnitudes`), read chunk by chunk: a differing leaf is
    read to its end, for its magnitude."""
    data_a, data_b = source_a.data, source_b.data
    opened = [(ra, rb, _open(source_a, ra), _open(source_b, rb)) for ra, rb in pairs]
    errors: list[BaseException] = []
    # Per differing leaf: the largest |a - b|, the sums of |a - b|^2 and |a|^2.
    found: dict[str, list[float]] = {}
    sums: dict[str, float] = {}  # |a|^2 of every leaf, until it is known to be equal

    def read(_: LeafRecord, pair: Any, index: tuple[slice, ...]) -> Callable[[], Any]:
        ra, rb, sa, sb = pair
        fa, fb = _read.start_region(sa, data_a, ra, index), _read.start_region(sb, data_b, rb, index)
        measured = ra.type != "prng_key"  # key data has no magnitude
        return lambda: _compare(
            _logical(np.asarray(fa()), ra, data_a), _logical(np.asarray(fb()), rb, data_b), measured
        )

    stop = lambda: bool(errors)
    jobs = ((pair[0], pair, index) for pair in opened for index in _read.chunk_indices(pair[0], stop=stop))
    done = _read.scan_chunks(jobs, skip=lambda r: stop(), failed=lambda r, e: errors.append(e), read=read)
    count = _read.LeafCounter([ra for ra, _ in pairs], tracker)
    for record, (equal, largest, squared, norm), size in done:
        sums[record.path] = sums.get(record.path, 0.0) + norm
        if not equal:
            seen = found.setdefault(record.path, [0.0, 0.0])
            seen[0], seen[1] = _larger(seen[0], largest), seen[1] + squared
        count(record, size)
    if errors:
        raise errors[0]
    return {path: (largest, _relative(squared, sums[path])) for path, (largest, squared) in found.items()}


def _compare(x: np.ndarray, y: np.ndarray, measured: bool) -> tuple[bool, float, float, float]:
    """Whether two chunks are bitwise equal (NaNs with equal bits are, 0.0 and
    -0.0 are not); the largest `|x - y|`, the sum of `|x - y|^2` and of
    `|x|^2`, each NaN where not `measured` (PRNG key data)."""
    equal = x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
    if not measured or x.dtype.kind not in "biufc" or x.shape != y.shape:
        return equal, math.nan, math.nan, math.nan
    a = x.astype(np.complex128 if x.dtype.kind == "c" else np.float64)
    b = y.astype(a.dtype)
    with np.errstate(all="ignore"):
        gap = np.abs(a - b)
        norm = float(np.sum(np.abs(a) ** 2))
        if equal:
            return True, 0.0, 0.0, norm
        return False, float(np.max(gap)) if gap.size else 0.0, float(np.sum(gap**2)), norm


def _larger(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _relative(squared: float, norm: float) -> float:
    """`‖a - b‖ / ‖a‖`; `inf` where `a` is all zeros."""
    if math.isnan(squared) or math.isnan(norm):
        return math.nan
    return math.sqrt(squared) / math.sqrt(norm) if norm > 0 else math.inf


def _logical(array: np.ndarray, record: LeafRecord, data: Location) -> np.ndarray:
    """Stored bytes as the leaf's own dtype (undoing a cast on save: an error if
    a stored value cannot become it)."""
    dtype = None if record.type == "prng_key" else dtype_from_name(record.dtype)
    return _read.host_converter(record, dtype, data)(array)
