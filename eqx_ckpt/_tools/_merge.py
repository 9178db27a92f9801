"""`merge`: several models' leaves merged into one checkpoint, out of core.

The story: check the options (`_merge_methods.checked`), open every input and the base,
choose the leaves merged (`_chosen`: `where`, float arrays), account for
every leaf of every input (`_account`, one error before anything is
written), then save the first input's tree as nested dicts through the
ordinary save: each merged leaf an `_records.Unread` made when the save
stages it (`_Merged`: a block of rows at a time, each input read by
windows of whole chunks, `_Rows`), every other leaf the first input's lazy leaf. The save commits the
first input's structure record and the merge's options (`metrics`).

Two cores are kept busy (`_Ahead`): while one leaf's blocks are made (by
`MERGE_THREADS` threads, each block into its own place), the next leaf's
inputs are read, and what it needs of its whole leaf worked out, on a thread
of its own. Each block is made alone, so no thread's timing changes a byte.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base import _interrupts, _keypath, _select, _threads, _tree
from .._base._errors import (
    CheckpointTypeError,
    CheckpointValueError,
    LeafError,
    leaf_message,
    shown_names,
)
from .._base._location import location, writable
from .._base._progress import Progress
from .._load import _lazy, _rebuild
from .._load._checkpoint import Checkpoint
from .._load._lazy import LazyArray
from .._ondisk import _digests
from .._ondisk._format import dtype_from_name
from .._save import _records, _serialise
from .._sources import _verified
from . import _merge_methods as methods
from ._merge_methods import Method

# A block holds whole rows (of the first axis) of about this many elements,
# of every input at once: a fixed size, so that no budget changes a byte.
BLOCK_ELEMENTS = 1 << 16
# A window of a safetensors leaf holds whole blocks of the digests recorded of its
# stored bytes (each read and checked whole), at most this many bytes of them
# (as an eqx_ckpt chunk file at most): a leaf of that size is read once.
WINDOW_BYTES = 64 * 2**20
# The most mismatched leaves an error lists one by one (it names them all in `dotted`).
MAX_LISTED = 50
# The threads that make a leaf's blocks (`TASK_BLOCKS` blocks handed to one at a time).
MERGE_THREADS = max(1, min(os.cpu_count() or 1, 4))
TASK_BLOCKS = 8
# Whether the next merged leaf's inputs are read (and TIES's thresholds and
# SLERP's angle worked out) while a leaf is made (`_Ahead`): it holds what
# one more leaf's reads hold. `False`: each leaf is read when it is made.
READ_AHEAD = True


def merge(
    path: Any,
    inputs: Sequence[Any],
    *,
    method: str,
    weights: Sequence[float] | None = None,
    base: Any = None,
    density: float | None = None,
    t: float | None = None,
    key: Any = None,
    where: Any = None,
    overwrite: bool = True,
    progress: Progress = None,
    staging_bytes: int | None = None,
) -> None:
    """Merge models leaf by leaf into a new checkpoint at `path`.

    Every input is read lazily, a block of rows at a time; the merge holds one
    leaf of the result (in its dtype), the chunks of each input that the
    current block lies in, the same of the next leaf (read ahead, on another
    thread), and a few float32 blocks for each thread (for TIES, the
    magnitudes of one input's differences for one leaf): never a whole
    model. Blocks are made on several threads, each into its own place.
    Inputs whose leaf records the same digest (a fine-tune's leaf taken from
    its base) are read once. Floating-point array leaves are merged in float32
    (float64 leaves in float64) and stored in their own dtype; every other
    leaf (integers, booleans, scalars) and every leaf outside `where` is the
    first input's. The result is a checkpoint like a
    save of the first input: the same leaves, and its structure record, so a
    load without `like` rebuilds the same model. Its manifest's `metrics`
    record the method, the inputs and the options ([`eqx_ckpt.Checkpoint.metrics`][]).
    The same inputs and options give the same bytes. See
    [docs/sharing.md](../sharing.md#merging) for the formulas.

    **Arguments:**

    - `path`: where to save the result, as for [`eqx_ckpt.tree_serialise_leaves`][].
    - `inputs`: the models, any path [`eqx_ckpt.Checkpoint`][] opens
        (checkpoints, published folders, `hf://` repositories, fine-tunes
        with their bases). They must hold the same leaves, of the same shapes
        and dtypes.
    - `method`: `"linear"` (weighted average), `"task_arithmetic"` (`base`
        plus the weighted sum of the inputs' differences from it), `"ties"`
        (each difference trimmed to its `density` largest magnitudes, a sign
        elected per element, the weighted mean of the agreeing ones),
        `"dare_linear"` and `"dare_ties"` (differences dropped at random with
        probability `1 - density`, the kept ones divided by `density`, then
        summed, or summed where they agree with the elected sign), `"slerp"`
        (two inputs, spherical interpolation at `t`, per leaf).
    - `weights`: one number per input (default: all 1). Not for `"slerp"`.
    - `base`: the model the differences are taken from (all but `"linear"`
        and `"slerp"`).
    - `density`: the fraction of each difference kept, in (0, 1] (`"ties"`, `"dare_*"`).
    - `t`: `"slerp"`'s position from the first input (0) to the second (1).
    - `key`: DARE's random drops: an int or a JAX PRNG key (default 0).
    - `where`: the sub-trees merged: a dotted path (`"model.encoder"`), a
        list of them, or a callable picking nodes of the first input's tree
        as `Checkpoint(inputs[0]).load(lazy=True)` gives it: nested dicts
        and lists whose keys are also attributes, so `lambda m: m.encoder`
        picks a Module's field as `lambda t: t["encoder"]` does. Only those
        leaves are merged and accounted for; the rest are the first input's.
    - `overwrite`, `progress`, `staging_bytes`: as for
        [`eqx_ckpt.tree_serialise_leaves`][]; the progress counts the leaves
        of the result as they are merged and written.

    **Raises:**

    - [`eqx_ckpt.LeafError`][] listing every leaf missing from an input (or
        the base), or of another shape or dtype, before anything is written.
    - `CheckpointValueError`, `CheckpointTypeError` for options that do not
        fit the method.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        for seed in (0, 1):
            eqx_ckpt.tree_serialise_leaves(f"mlp{seed}", eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(seed)))
        eqx_ckpt.merge("soup", ["mlp0", "mlp1"], method="linear", weights=[0.75, 0.25])
        soup = eqx_ckpt.Checkpoint("soup").load(trust=[])   # an MLP, as the inputs were
        print(eqx_ckpt.Checkpoint("soup").metrics["merge_method"])   # linear
        ```
    """
    checked = methods.checked(method, inputs, weights, base, density, t, key)
    opened = [Checkpoint(p) for p in inputs]
    based = Checkpoint(base) if base is not None else None
    first = opened[0]
    tree = _tree_of(first)
    leaves, names = _tree.flatten_named(tree, lambda x: isinstance(x, LazyArray), keypaths=True)
    chosen = _chosen(where, tree, names.paths)
    merged = {p for p in chosen if _floating(first, p)}
    _account(opened, based, [p for p in first if p in chosen], merged)
    ahead = _Ahead()
    for i, dotted in enumerate(names.paths):
        if dotted in merged:
            same: dict[str, _Rows] = {}  # (the base first: a fine-tune's leaf taken from it is read there)
            base_rows = None if based is None else _Rows.shared(based, dotted, same)
            parts = [_Rows.shared(ckpt, dotted, same) for ckpt in opened]
            leaves[i] = ahead.add(_Merged(checked, dotted, parts, base_rows, ahead)).unread()
    record = _rebuild.record_of(first._manifest, first.path)
    options = _serialise.SaveOptions(
        overwrite=overwrite,
        progress=progress,
        staging_bytes=staging_bytes,
        metrics=_metrics(checked, opened, based),
        structure=None if record is None else (lambda _: record),
        keypaths={p: first.record(p).keypath for p in first},
    )
    out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree, lambda x: isinstance(x, LazyArray)), leaves)
    loc = writable(location(path), "`merge`")
    try:
        ahead.start(0)
        _serialise.save(loc, out, _serialise.default_serialise_filter_spec, None, options)
    finally:
        ahead.close()


def _tree_of(ckpt: Checkpoint) -> Any:
    """The checkpoint's tree as nested dicts and lists of lazy leaves (and
    scalars), as `Checkpoint.load(lazy=True)` gives it, without its warning
    that a published model's classes are not rebuilt: they are, from the
    structure record the result commits."""
    records = list(ckpt._records.values())
    return _lazy.nested(ckpt._source, records, "", lazy=True, progress=False, numbered=ckpt._numbered)


def _chosen(where: Any, tree: Any, paths: list[str]) -> set[str]:
    """The dotted paths of the leaves `where` selects (all where `None`)."""
    if where is None:
        return set(paths)
    if isinstance(where, str) or (isinstance(where, Sequence) and all(isinstance(w, str) for w in where)):
        prefixes = [where] if isinstance(where, str) else list(where)
        unknown = [p for p in prefixes if not any(_keypath.is_within(path, p) for path in paths)]
        if unknown:
            raise CheckpointValueError(f"`where` names no leaf of the first input: {shown_names(unknown)}.")
        return {path for path in paths if any(_keypath.is_within(path, p) for p in prefixes)}
    if not callable(where):
        raise CheckpointTypeError(f"`where` must be a dotted path, a list of them or a callable; not {where!r}.")
    treedef = jax.tree_util.tree_structure(tree, lambda x: isinstance(x, LazyArray))
    try:
        picked = _select.marked_indices(_unwrapped(where(_Node(_select.marked(treedef, len(paths))))))
    except Exception as e:
        raise CheckpointValueError(
            f"`where` raised {type(e).__name__}: {e}. It is called on the first input's tree as nested dicts and "
            f"lists (`Checkpoint(path).load(lazy=True)`), whose keys are also attributes: "
            f"`where=lambda m: m.encoder` or `where=lambda t: t['encoder']`."
        ) from e
    if not picked:
        raise CheckpointValueError("`where` selected no leaves of the first input; it must return nodes of its tree.")
    return {paths[i] for i in picked}


class _Node:
    """A node of the first input's tree as `where` sees it: its keys are
    items (`t["encoder"]`, `t["layers"][0]`) and, as a Module's fields are,
    attributes (`m.encoder.layers[0]`), so a selector written for the model
    picks the same nodes. `_unwrapped` gives back what `where` returned."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def __getattr__(self, name: str) -> Any:
        value = object.__getattribute__(self, "_value")
        if isinstance(value, dict) and name in value:
            return _wrapped(value[name])
        keys = f" (its keys: {shown_names([str(k) for k in value])})" if isinstance(value, dict) else ""
        raise AttributeError(f"the node has no key {name!r}{keys}")

    def __getitem__(self, key: Any) -> Any:
        return _wrapped(self._value[key])

    def __len__(self) -> int:
        return len(self._value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._value) if isinstance(self._value, dict) else map(_wrapped, self._value)


def _wrapped(value: Any) -> Any:
    return _Node(value) if isinstance(value, (dict, list, tuple)) else value


def _unwrapped(value: Any) -> Any:
    """What `where` returned, its nodes the tree's own (tuples and lists of them too)."""
    if isinstance(value, _Node):
        return value._value
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrapped(v) for v in value)
    return value


def _floating(ckpt: Checkpoint, dotted: str) -> bool:
    """Whether the leaf is a floating-point array (merged; else taken as it is)."""
    record = ckpt.record(dotted)
    return record.type in ("jax", "numpy") and jnp.issubdtype(dtype_from_name(record.dtype), jnp.floating)


def _account(opened: list[Checkpoint], based: Checkpoint | None, chosen: list[str], merged: set[str]) -> None:
    """One `LeafError` naming every leaf of `chosen` (all the first input's
    where `where` is `None`) missing from an input, or of another shape or
    dtype, every leaf an input holds there that the first does not, and
    every merged leaf the base lacks or holds differently."""
    first, lines, dotted = opened[0], [], []

    def compare(ckpt: Checkpoint, which: str, paths: Sequence[str]) -> None:
        for p in paths:
            if p not in ckpt:
                what = f"it is missing from {which}."
            else:
                want, have = first.record(p), ckpt.record(p)
                if (tuple(want.shape), want.dtype) == (tuple(have.shape), have.dtype):
                    continue
                what = f"{which} holds {have.dtype}{list(have.shape)}, the first input {want.dtype}{list(want.shape)}."
            lines.append(leaf_message(what, keypath=None, dotted=p, path=ckpt.path))
            dotted.append(p)

    selected = set(chosen)
    for i, ckpt in enumerate(opened[1:], start=2):
        compare(ckpt, f"input {i}", chosen)
        extra = [p for p in ckpt if p not in selected and _selected_prefix(p, chosen, first)]
        for p in extra:
            what = f"input {i} holds it; the first input does not."
            lines.append(leaf_message(what, keypath=None, dotted=p, path=ckpt.path))
            dotted.append(p)
    if based is not None:
        compare(based, "the base", [p for p in chosen if p in merged])
    if lines:
        shown = "\n".join(f"  - {line}" for line in lines[:MAX_LISTED])
        hidden = len(lines) - MAX_LISTED
        more = f"\n  ... and {hidden} more (`.dotted` names them all)" if hidden > 0 else ""
        raise LeafError(
            f"`merge` needs the same leaves, shapes and dtypes in every input; {len(lines)} differ "
            f"(nothing was written):\n{shown}{more}\nMerge models of one architecture, or merge only the "
            f"sub-trees they share (`where=`).",
            path=first.path,
            dotted=dotted,
        )


def _selected_prefix(path: str, chosen: list[str], first: Checkpoint) -> bool:
    """Whether a leaf the first input lacks is inside the merged part: all of
    it without `where`, else under a node holding a chosen leaf."""
    if len(chosen) == len(first):
        return True
    parent = path.rpartition(".")[0]
    return any(_keypath.is_within(c, parent) for c in chosen) if parent else False


def _metrics(method: Method, opened: list[Checkpoint], based: Checkpoint | None) -> dict[str, Any]:
    """What the result records of how it was made (its manifest's `metrics`)."""

    def name(ckpt: Checkpoint) -> str:
        return ckpt.path if ckpt.revision is None or "@" in ckpt.path else f"{ckpt.path}@{ckpt.revision}"

    out: dict[str, Any] = {
        "merge_method": method.name,
        "merge_inputs": json.dumps([name(c) for c in opened]),
        "merge_weights": json.dumps(list(method.weights)) if method.name != "slerp" else "",
    }
    extra = {"merge_base": based and name(based), "merge_density": method.density, "merge_t": method.t}
    if method.name in methods.RANDOM:
        extra["merge_key"] = str(method.seed)
    out.update({k: v for k, v in extra.items() if v is not None and v != ""})
    return {k: v for k, v in out.items() if v != ""}


class _Rows:
    """One input's leaf, read by rows: each read a window of whole chunks
    (of an eqx_ckpt checkpoint, whose chunk files are read whole) or of whole
    blocks up to `WINDOW_BYTES` (of a safetensors file, read
    by byte ranges: a published folder's digests are of such blocks), kept
    for the blocks inside it. A window's rows that the next one holds too are
    not read again."""

    def __init__(self, leaf: LazyArray, chunk_rows: int):
        self.leaf, self.chunk_rows = leaf, max(chunk_rows, 1)
        self.dtype, self.shape = np.dtype(leaf.dtype), tuple(leaf.shape)
        self.kind = leaf.saved_as
        self._window: tuple[int, int, np.ndarray] | None = None

    @classmethod
    def of(cls, ckpt: Checkpoint, dotted: str) -> _Rows:
        record = ckpt.record(dotted)
        if not record.shape:
            return cls(ckpt[dotted], 1)
        if ckpt.format == "eqx_ckpt" and record.pack is None and len(record.chunks) == len(record.shape):
            return cls(ckpt[dotted], record.chunks[0])
        # Whole blocks (the fewest rows that end where one does, or else those
        # that hold one), as many as `WINDOW_BYTES` holds.
        row = record.nbytes // record.stored_shape[0] if record.stored_shape[0] else 0
        if not row:
            return cls(ckpt[dotted], record.shape[0])
        block = _verified.recorded_block(ckpt._manifest, record)  # (a folder's own size, or its rows')
        unit = block // math.gcd(block, row)
        unit = unit if unit * row <= WINDOW_BYTES else -(-block // row)
        return cls(ckpt[dotted], unit * max(1, WINDOW_BYTES // (unit * row)))

    @classmethod
    def shared(cls, ckpt: Checkpoint, dotted: str, same: dict[str, _Rows]) -> _Rows:
        """`of(ckpt, dotted)`, or the one made for another input (in `same`)
        whose leaf has the same recorded digest (SHA-256 or BLAKE3, as
        published folders record them): the same bytes, read once. Each read
        is checked against its own source's digest, so either holds them."""
        digest = ckpt._manifest.digests.get(dotted, "")
        if _digests.algorithm_of(digest) is None:
            return cls.of(ckpt, dotted)
        if digest not in same:
            same[digest] = cls.of(ckpt, dotted)
        return same[digest]

    def read(self, rows: Any) -> np.ndarray:
        """The rows `rows` (a slice of the first axis, or `()` for a scalar leaf)."""
        if rows == ():
            return np.asarray(self.leaf)
        if self.chunk_rows == 1:
            return self.leaf[rows]
        if self._window is None or not (self._window[0] <= rows.start and rows.stop <= self._window[1]):
            start = rows.start - rows.start % self.chunk_rows
            stop = min(self.shape[0], -(-rows.stop // self.chunk_rows) * self.chunk_rows)
            kept, self._window = self._kept(start), None  # (the rest freed before the next window is read)
            if kept is not None:  # the rows of the last window that this one holds, then the rest
                rest = np.asarray(self.leaf[start + len(kept) : stop])
                self._window = (start, stop, np.concatenate([kept, rest]))
            else:
                # A window of the whole leaf is read as a load reads it (locally, straight into one buffer).
                whole = start == 0 and stop == self.shape[0]
                self._window = (start, stop, np.asarray(self.leaf) if whole else np.asarray(self.leaf[start:stop]))
        start, _, window = self._window
        return window[rows.start - start : rows.stop - start]

    def _kept(self, start: int) -> np.ndarray | None:
        """The last window's rows from `start` to its end, where it starts at
        or before `start` and ends after it (a block that straddles two windows)."""
        if self._window is None or not (self._window[0] <= start < self._window[1]):
            return None
        first, _, window = self._window
        return window[start - first :]

    def done(self) -> None:
        self._window = None


class _Ahead:
    """A merge's merged leaves, in the tree's order (the order the save makes
    them in, but for packed leaves, made last): while one is made, the next
    one not yet made is prepared (`_Merged.prepare`: its inputs' first
    windows read, what it needs of its whole leaf worked out) on the
    `eqx_ckpt-merge-ahead` thread. A leaf made before its turn is prepared
    when it is made."""

    def __init__(self) -> None:
        self.leaves: list[_Merged] = []
        self.started: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self.made: set[int] = set()
        # TIES's magnitudes, kept from leaf to leaf (a fresh array faults in
        # every page again); taken by one preparation at a time.
        self.scratch: np.ndarray | None = None
        self.lock = threading.Lock()

    def magnitudes(self, size: int, dtype: np.dtype) -> np.ndarray:
        """An array of `size` elements of `dtype`: the kept one, if it holds them."""
        with self.lock:
            kept, self.scratch = self.scratch, None
        if kept is None or kept.dtype != dtype or kept.size < size:
            kept = None  # (freed before the larger one is made)
            return np.empty(size, dtype)
        return kept[:size]

    def keep(self, magnitudes: np.ndarray) -> None:
        """Keep `magnitudes` (`magnitudes`'s array) for the next leaf."""
        whole = magnitudes.base if isinstance(magnitudes.base, np.ndarray) else magnitudes
        with self.lock:
            self.scratch = whole

    def add(self, leaf: _Merged) -> _Merged:
        leaf.index = len(self.leaves)
        self.leaves.append(leaf)
        return leaf

    def prepared(self, leaf: _Merged) -> dict[str, Any]:
        """What `leaf` needs of its whole leaf (`_Merged.whole`), its first
        windows read; then the next leaf's preparation started."""
        self.made.add(leaf.index)
        future = self.started.pop(leaf.index, None)
        whole = _interrupts.finish(future) if future is not None else leaf.prepare()
        self.start(leaf.index + 1)
        return whole

    def start(self, index: int) -> None:
        """Start preparing the first leaf from `index` on not yet made (the
        first leaf: as the save begins), unless it is under way."""
        following = next((i for i in range(index, len(self.leaves)) if i not in self.made), None)
        if READ_AHEAD and following is not None and following not in self.started:
            pool = _threads.pool("eqx_ckpt-merge-ahead", 1)
            self.started[following] = pool.submit(self.leaves[following].prepare)

    def close(self) -> None:
        """Wait for the preparations still under way (the save has ended, or
        failed), and drop what they read."""
        futures = list(self.started.values())
        _interrupts.stop(futures)
        for index in self.started:
            self.leaves[index].done()
        self.started.clear()
        self.scratch = None


class _Merged:
    """One merged leaf: the inputs' (and the base's) leaves at `path`, read by rows."""

    def __init__(self, method: Method, path: str, inputs: list[_Rows], base: _Rows | None, ahead: _Ahead):
        self.method, self.path, self.inputs, self.base = method, path, inputs, base
        self.dtype, self.shape = inputs[0].dtype, inputs[0].shape
        self.acc = methods.accumulator(self.dtype)
        self.ahead, self.index = ahead, 0

    def unread(self) -> _records.Unread:
        kind = self.inputs[0].kind
        return _records.Unread(self.value, self.dtype, self.shape, kind if kind in ("jax", "numpy") else "jax")

    def blocks(self) -> Iterator[tuple[Any, int]]:
        """Each block's index (rows of the first axis) and first element."""
        if not self.shape:
            yield (), 0
            return
        row = math.prod(self.shape[1:])
        step = max(1, BLOCK_ELEMENTS // max(row, 1))
        for start in range(0, self.shape[0], step):
            yield slice(start, min(start + step, self.shape[0])), start * row

    def read(self, leaf: _Rows, rows: Any) -> np.ndarray:
        """A block of `leaf`, flat, in the accumulator dtype."""
        return self.flat(leaf.read(rows))

    def flat(self, block: Any) -> np.ndarray:
        return np.asarray(block).astype(self.acc, copy=False).reshape(-1)

    def rows(self) -> list[_Rows]:
        """The leaves read, each once (inputs read by one `_Rows` are the same bytes)."""
        return list({id(x): x for x in [*([self.base] if self.base is not None else []), *self.inputs]}.values())

    def prepare(self) -> dict[str, Any]:
        """What each block needs of the whole leaf (`whole`), once the first
        window of each leaf is read: all at once, on the `eqx_ckpt-merge` threads."""
        first = next(self.blocks(), None)  # (none: an empty leaf)
        pool = _threads.pool("eqx_ckpt-merge", MERGE_THREADS)
        reads = [pool.submit(leaf.read, first[0]) for leaf in self.rows()] if first is not None else []
        try:
            for read in reads:
                _interrupts.finish(read)
        finally:
            _interrupts.stop(reads)
        return self.whole()

    def value(self) -> np.ndarray:
        """The merged leaf, made a block at a time into one array of its dtype:
        `TASK_BLOCKS` blocks at a time on the `eqx_ckpt-merge` threads, the
        blocks read (their rows cut from the windows) here, in order."""
        tasks: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        try:
            whole = self.ahead.prepared(self)
            out = np.empty(self.shape, self.dtype)
            flat = out.reshape(-1)
            pool = _threads.pool("eqx_ckpt-merge", MERGE_THREADS)
            task: list[tuple[int, list[Any], Any]] = []
            for rows, start in self.blocks():
                base = None if self.base is None else self.base.read(rows)
                task.append((start, [x.read(rows) for x in self.inputs], base))
                if len(task) == TASK_BLOCKS:
                    tasks.append(pool.submit(self.make, flat, task, whole))
                    task = []
                    while len(tasks) > 2 * MERGE_THREADS:
                        _interrupts.finish(tasks.popleft())
            if task and not tasks:  # (a small leaf: made here)
                self.make(flat, task, whole)
            elif task:
                tasks.append(pool.submit(self.make, flat, task, whole))
            while tasks:
                _interrupts.finish(tasks.popleft())
            return out
        finally:
            _interrupts.stop(list(tasks))  # (after an error: no thread writes into `out` once it is dropped)
            self.done()

    def make(self, flat: np.ndarray, task: list[tuple[int, list[Any], Any]], whole: dict[str, Any]) -> None:
        """The blocks of `task` (each its first element, its inputs' and base's rows), into `flat`."""
        for start, xs, base in task:
            acc_base = None if base is None else self.flat(base)
            into = flat[start : start + xs[0].size] if self.acc == self.dtype else None  # (else cast below)
            block = methods.combine(self.method, [self.flat(x) for x in xs], acc_base, start=start, out=into, **whole)
            if into is None:
                flat[start : start + block.size] = block.astype(self.dtype)

    def done(self) -> None:
        for leaf in self.rows():
            leaf.done()

    def whole(self) -> dict[str, Any]:
        """What each block needs of the whole leaf (`methods.combine`)."""
        name = self.method.name
        if name == "ties":  # (once for inputs read by one `_Rows`: the same bytes)
            found: dict[int, int] = {}
            magnitudes = self.ahead.magnitudes(math.prod(self.shape), self.acc)  # (one array for every input's)
            for x in self.inputs:
                if id(x) not in found:
                    found[id(x)] = self._threshold(x, magnitudes)
            self.ahead.keep(magnitudes)
            return {"thresholds": [found[id(x)] for x in self.inputs]}
        if name == "slerp":
            return {"coefficients": self._coefficients()}
        if name in methods.RANDOM:
            return {"seeds": [methods.seed(self.method.seed, self.path, i) for i in range(len(self.inputs))]}
        return {}

    def _threshold(self, leaf: _Rows, magnitudes: np.ndarray) -> int:
        """The magnitude (`methods.magnitude_keys`) of `leaf`'s difference from
        the base that TIES keeps at least: the magnitudes are made a block at a
        time into `magnitudes` (an array of the leaf's size, `acc`), and the
        threshold selected among them."""
        size = math.prod(self.shape)
        density = self.method.density or 1.0
        if density >= 1 or size == 0:
            return 0
        if self.base is None:
            raise RuntimeError("Internal error: a TIES merge without a base.")
        for rows, start in self.blocks():
            x, base = self.read(leaf, rows), self.read(self.base, rows)
            np.subtract(x, base, out=magnitudes[start : start + x.size])
        return methods.kth_largest(methods.magnitude_keys(magnitudes, magnitudes), methods.kept_count(density, size))

    def _coefficients(self) -> tuple[float, float]:
        """SLERP's two weights for this leaf, from its dot product and norms in float64."""
        dot = norm0 = norm1 = 0.0
        for rows, _ in self.blocks():
            a, b = (self.read(x, rows).astype(np.float64) for x in self.inputs)
            dot += float(np.sum(a * b))
            norm0 += float(np.sum(a * a))
            norm1 += float(np.sum(b * b))
        return methods.slerp_coefficients(dot, math.sqrt(norm0), math.sqrt(norm1), self.method.t or 0.0)
