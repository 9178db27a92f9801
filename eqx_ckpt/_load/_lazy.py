"""Leaves read when asked, leaves made by a `transform`, and a checkpoint as
nested dicts.

- `LazyArray`: a stored leaf read only when asked, by the reader of whole
  leaves (`_reader`).
- `transformed`: stored arrays -> the array a leaf of `like` expects, for
  layouts that differ between frameworks (a PyTorch conv bias is `(out,)`,
  Equinox's `(out, 1, 1)`). A transformed leaf is read whole on the host,
  passed through its function, checked against `like`, then placed like any
  other; the load plan says which (`_load_plan.TransformPlan`).
- `nested`: a load without a skeleton, as nested dicts and lists built from
  the key paths the manifest records. Sequence indices become lists, other
  keys dict keys; keys of one container that cannot be sorted together
  become their names in dotted paths.
"""

from __future__ import annotations

import functools
import math
import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import numpy as np

from .._base import _faults, _keypath, _state
from .._base._errors import CheckpointTypeError, CheckpointValueError, LeafError, leaf_message
from .._base._location import Location
from .._base._progress import Progress
from .._ondisk import _dtypes
from .._ondisk._format import SCALAR_TYPES, LeafRecord, dtype_from_name
from .._sources import _verified
from .._sources._source import Source
from .._store import _memory, _storage_errors, _window
from . import _read, _reader
from ._load_plan import LeafPlan
from ._rebuild import abstract

if TYPE_CHECKING:
    from .._store._storage import Array
    from ._load_plan import TransformPlan


class LazyArray:
    """A leaf of a checkpoint that has not been read yet.

    It knows its `shape`, `dtype`, `ndim`, `size` and `nbytes` without reading.

    - `np.asarray(x)` reads it all.
    - `x[i:j]` reads only that region (a NumPy array).
    - `x.read()` reads it as the type of the `like` leaf it stands for: a JAX
        array placed with `like`'s sharding, a NumPy array, or a scalar.
    - [`eqx_ckpt.materialise`][] does that for every lazy leaf of a tree at
        once.

    A `LazyArray` is not a JAX array. `eqx.is_array` is `False` for it, so
    `eqx.filter` treats it as static. Passing it to a `jax.jit`-ted (or
    `eqx.filter_jit`-ted) function raises, saying to call
    `eqx_ckpt.materialise` first.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"emb": jnp.arange(12.0).reshape(4, 3)})
        lazy = eqx_ckpt.Checkpoint("ckpt")["emb"]     # nothing read yet
        print(lazy.shape, lazy.dtype, lazy.nbytes)   # (4, 3) float32 48
        rows = lazy[1:3]                              # reads two rows, as NumPy
        emb = lazy.read()                             # the whole leaf, as a JAX array
        ```
    """

    __slots__ = ("__weakref__", "_like", "_loc", "_record", "_source", "_store")

    def __init__(self, source: Source, record: LeafRecord, like: Any = None):
        # The opened checkpoint, checked after every read so a read never
        # returns a later save's bytes.
        self._source = source
        self._loc = source.data
        self._record = record
        self._like = like
        self._store: Array | None = None
        live = weakref.ref(self, _forget)
        _LIVE[id(live)] = live

    def __hash__(self) -> int:
        # Unhashable on purpose, or `jax.jit` would treat it as static; then
        # `eqx.filter_jit`'s hash of it says what to do.
        raise CheckpointTypeError(
            f"A LazyArray (leaf {self.path!r}, not read yet) is not a JAX array, so `jax.jit` and "
            f"`eqx.filter_jit` cannot take it (it is unhashable, and not an array). Read the lazy leaves first: "
            f"`tree = eqx_ckpt.materialise(tree)`, then pass `tree`."
        )

    @property
    def path(self) -> str:
        """The dotted path of the leaf in its checkpoint."""
        return self._record.path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._record.shape)

    @property
    def dtype(self) -> Any:
        """The dtype it reads as (slices too): its `like` leaf's, for an array
        `like` (the dtype a load with `cast=True` converts to), else the saved one."""
        if self._record.type == "prng_key":
            return self._record.dtype
        if self._like is not None and _dtypes.like_type(self._like) in ("jax", "numpy", "numpy_scalar"):
            return np.dtype(self._like.dtype)
        return dtype_from_name(self._record.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (for PRNG keys, those of their key data)."""
        return self._record.nbytes

    def __repr__(self) -> str:
        return f"LazyArray({self.path!r}, shape={self.shape}, dtype={self._record.dtype})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d LazyArray")
        return self.shape[0]

    def _open(self) -> Array:
        if self._store is None:
            try:
                self._store = self._source.open(self._record).result()
            except Exception as e:
                self._source.check()
                raise _storage_errors.leaf_io_error(e, self._record, self._loc, "open") from e
        return self._store

    def __getitem__(self, index: Any) -> np.ndarray:
        """Read the region `index` selects, as NumPy indexes: ints, slices, `...`
        and `None` read only that region; integer arrays and boolean masks (NumPy's
        advanced indexing) read the whole leaf (as `np.asarray` does), then select."""
        if _is_advanced(index):
            return self._host()[index]
        index = _numpy_index(index, self.shape)
        store = self._open()
        per_element = self._record.nbytes // max(self.size, 1)
        _memory.refuse_beyond_memory(self._loc, self._record, _region_size(index) * per_element, "this region")
        if self._record.type == "prng_key":
            index = index if isinstance(index, tuple) else (index,)
            # The key data is the last stored axis; a second `...` would be an error.
            index += (slice(None),) if any(i is Ellipsis for i in index) else (Ellipsis, slice(None))
        try:
            array = _read.start_region(store, self._loc, self._record, index)()
        except Exception:
            self._source.check()
            raise
        self._source.check()
        # A leaf cast on save reads back in the dtype it was saved from, as `dtype`
        # says (an error if a stored value cannot become it).
        dtype = None if self._record.type == "prng_key" else self.dtype
        return _read.host_converter(self._record, dtype, self._loc)(array)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._host()
        return array if dtype is None else array.astype(dtype)

    def _host(self) -> np.ndarray:
        """The whole leaf as a NumPy array of its `dtype` (a PRNG key's key data),
        read as a load reads it (by `np.asarray`, a save and `export_safetensors` too)."""
        if self._record.type == "prng_key":
            return self[...]
        like = np.broadcast_to(np.zeros((), self.dtype), self.shape)
        return _reader.read_leaves(self._source, [LeafPlan.of(0, self._record, like)], cached=True)[0]

    def start(self, *, checked: bool = True) -> Any:
        """A function reading the whole leaf as a load does, then (unless
        `checked=False`) checking that the checkpoint was not replaced."""
        plan = LeafPlan.of(0, self._record, self._read_as())
        return lambda: _reader.read_leaves(self._source, [plan], checked=checked, cached=True)[0]

    def _read_as(self) -> Any:
        """The `like` leaf it is read as: its own, or one of the type it was saved
        from (`_rebuild.abstract`: a NumPy array stays NumPy, a JAX array becomes one)."""
        return self._like if self._like is not None else abstract(self._record)

    def read(self) -> Any:
        """Read the whole leaf, as the type of the `like` leaf it stands for (without
        one, as the type it was saved from: a NumPy array stays NumPy)."""
        return self.start()()

    @property
    def saved_as(self) -> str:
        """The leaf type a save of it records (`_dtypes.like_type` of what it
        reads as), or "placed" for a JAX array over several devices."""
        like = self._read_as()
        sharding = _read.target_sharding(like)
        if sharding is not None and len(sharding.device_set) > 1:
            return "placed"
        return _dtypes.like_type(like) or "other"

    def to_save(self) -> tuple[Any, str | None]:
        """What a save of this leaf writes (`read()`'s value), and the leaf type it
        records where that is not the value's own: a 64-bit JAX leaf without
        x64 is written as exact NumPy, recorded as "jax", so a resave is a copy."""
        like = self._read_as()
        if _dtypes.like_type(like) == "jax" and _dtypes.x64_missing(self.dtype):
            return np.asarray(self), "jax"
        return self.read(), None


def _is_advanced(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, (list, np.ndarray, jax.Array, bool, np.bool_)) for item in items)


def _numpy_index(index: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`index` with NumPy's meaning made explicit: TensorStore reads negative and
    out-of-range bounds as literal coordinates, NumPy counts them from the end and
    clips them. Returns one entry per axis (plus any `None`s), no `...`."""
    items = list(index) if isinstance(index, tuple) else [index]
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, (slice, int, np.integer))):
            raise IndexError(
                "only integers, slices (`:`), ellipsis (`...`), None and integer or boolean arrays are valid "
                f"indices of a LazyArray, as of a NumPy array, not {type(item).__name__} ({item!r})"
            )
    axes = sum(1 for item in items if item is not None and item is not Ellipsis)
    if axes > len(shape):
        raise IndexError(f"too many indices for a LazyArray of shape {shape}")
    if sum(1 for item in items if item is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    out: list[Any] = []
    for item in items:
        if item is Ellipsis:
            out.extend([slice(None)] * (len(shape) - axes))
        else:
            out.append(item)
    out.extend([slice(None)] * (len(shape) - sum(1 for item in out if item is not None)))
    axis = 0
    for i, item in enumerate(out):
        if item is None:
            continue
        n = shape[axis]
        axis += 1
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            # An empty NumPy slice (stop before start) is an empty interval.
            stop = max(stop, start) if step > 0 else min(stop, start)
            # A step longer than the axis selects at most one element: as long as
            # the axis, it selects the same and fits the int64 TensorStore takes.
            step = max(-max(n, 1), min(max(n, 1), step))
            out[i] = slice(start, stop, step)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of bounds for axis {axis - 1} with size {n}")
            out[i] = int(item) % n
    return tuple(out)


def _region_size(index: tuple[Any, ...]) -> int:
    """How many elements a normalised index (see `_numpy_index`) selects."""
    lengths = [len(range(item.start, item.stop, item.step)) for item in index if isinstance(item, slice)]
    return math.prod(lengths)


# Every lazy leaf of this process, held weakly: a manager's retention keeps the
# steps they read from while they live (`reads_from`). Keyed by the weak
# reference's identity, as a lazy leaf is unhashable (see `LazyArray.__hash__`);
# a plain dict, as a `WeakValueDictionary` tripled what a lazy leaf costs to make.
_LIVE: _state.Table[int, weakref.ref[LazyArray]] = _state.table("lazy.live", None, "live")


def _forget(live: weakref.ref[LazyArray], table: _state.Table[int, weakref.ref[LazyArray]] = _LIVE) -> None:
    # (The table bound at definition: a leaf a script keeps to its end dies as the
    # interpreter exits, when this module's globals may already be None.)
    table.pop(id(live), None)


def reads_from(loc: Location) -> bool:
    """Whether a live `LazyArray` of this process reads from the checkpoint at
    `loc` (or from anything below it)."""
    while True:
        try:
            # One C call, which no other thread interrupts; a leaf collected
            # meanwhile in this thread changes the dict: then once more.
            refs = list(_LIVE.values())
            break
        except RuntimeError:
            continue
    # The leaves of one load share one location: compare each location once.
    places = {id(lazy._loc): lazy._loc for live in refs if (lazy := live()) is not None}
    store, path = _store_and_path(loc.kvstore)
    for place in places.values():
        other, below = _store_and_path(place.kvstore)
        if other == store and below.startswith(path):
            return True
    return False


def _store_and_path(spec: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The store a kvstore spec reads (the base of an OCDBT database), less its
    path, and the path."""
    while "base" in spec:
        spec = spec["base"]
    return {key: value for key, value in spec.items() if key != "path"}, spec.get("path", "")


def is_lazy(x: Any) -> bool:
    return isinstance(x, LazyArray)


# A problem of a transformed leaf: its plan, what is wrong, and the exception the
# `transform` raised (`None` if it returned a value that does not fit).
Problem: TypeAlias = "tuple[TransformPlan, str, Exception | None]"


def transformed(
    source: Source, plans: list[TransformPlan], *, cast: bool, lazy: bool
) -> tuple[list[Any], list[Problem]]:
    """Read, transform and check every plan; returns the values (`None` where a
    problem was found) and the problems, to be reported together. With `lazy`,
    array leaves become `TransformedArray`s, read and transformed when asked."""
    if lazy:
        arrays = [i for i, plan in enumerate(plans) if _dtypes.like_type(plan.like) in ("jax", "numpy")]
        now, found = transformed(source, [p for i, p in enumerate(plans) if i not in arrays], cast=cast, lazy=False)
        eager = iter(now)
        lazies = {i: TransformedArray(source, plans[i], cast=cast) for i in arrays}
        return [lazies[i] if i in lazies else next(eager) for i in range(len(plans))], found
    values: list[Any] = [None] * len(plans)
    problems: list[Problem] = []

    def finish(i: int, reads: list[Any]) -> None:
        plan = plans[i]
        arrays = []
        for record, read in zip(plan.records, reads):
            try:
                arrays.append(_dtypes.decode(read(), record))
            except Exception as e:
                raise _storage_errors.leaf_io_error(e, record, source.data, "read") from e
        try:
            out = np.asarray(plan.fn(*arrays))
        except Exception as e:
            problems.append((plan, _raised(e), e))
            return
        values[i], problem = finish_value(out, plan.like, cast)
        if problem:
            problems.append((plan, problem, None))

    def start(plan: TransformPlan) -> list[Any]:
        return [_start(source, record) for record in plan.records]

    # The stored arrays of a plan are read ahead of the transform that consumes them.
    jobs = ((i, sum(r.nbytes for r in plan.records), functools.partial(start, plan)) for i, plan in enumerate(plans))
    for i, _, reads in _window.windowed(jobs):
        finish(i, reads)
    return values, problems


def _start(source: Source, record: LeafRecord) -> Callable[[], np.ndarray]:
    """Start reading a stored array of a transformed leaf whole."""
    _memory.refuse_beyond_memory(source.data, record, record.nbytes, "it")
    try:
        store = source.open(record).result()
    except Exception as e:
        raise _storage_errors.leaf_io_error(e, record, source.data, "open") from e
    return _verified.whole(source, record, _read.start_region(store, source.data, record))


def _raised(e: Exception) -> str:
    """The problem of a leaf whose `transform` raised `e` (which the error chains)."""
    return f"its `transform` raised {type(e).__name__}: {e}."


def finish_value(out: np.ndarray, like: Any, cast: bool) -> tuple[Any, str]:
    """The transformed array as `like`'s type and placement, or a problem."""
    out, problem = checked(out, like, cast)
    if problem:
        return None, problem
    try:
        return _dtypes.to_result(out, like, sharding=_read.target_sharding(like)), ""
    except ValueError as e:
        return None, f"after its `transform`, `like`'s Python {type(like).__name__} cannot hold it exactly: {e}."


def checked(out: np.ndarray, like: Any, cast: bool) -> tuple[np.ndarray, str]:
    shape, dtype = _dtypes.expected(like)
    kind = _dtypes.like_type(like)
    if tuple(out.shape) != shape:
        return out, f"after its `transform` the shape is {tuple(out.shape)}, but `like` has {shape}."
    if kind in ("jax", "numpy", "numpy_scalar") and out.dtype.name != dtype:
        if not cast:
            return out, (
                f"after its `transform` the dtype is {out.dtype.name}, but `like` has {dtype} (pass `cast=True` "
                f"to convert, or convert in the transform)."
            )
        try:
            out = _dtypes.checked_cast(out, np.dtype(like.dtype))
        except ValueError as e:
            return out, f"after its `transform` it cannot become {np.dtype(like.dtype)}: {e}."
    if kind == "jax" and _dtypes.x64_missing(out.dtype):
        # `jax.device_put` would wrap or round it, as `_read.refuse_narrowing` says of a stored leaf.
        return out, (
            f"after its `transform` {_dtypes.x64_message(out.dtype)}. Enable it "
            f"(`jax.config.update('jax_enable_x64', True)`), or load into a NumPy `like` leaf."
        )
    return out, ""


class TransformedArray(LazyArray):
    """A lazy leaf made by a `transform` of stored arrays, of `like`'s shape and
    dtype; reading any of it reads and transforms the stored arrays whole."""

    __slots__ = ("_cast", "_fn", "_keypath", "_parts")

    def __init__(self, source: Source, plan: TransformPlan, *, cast: bool):
        super().__init__(source, plan.records[0], plan.like)
        self._parts = tuple(LazyArray(source, r) for r in plan.records)
        self._fn, self._cast, self._keypath = plan.fn, cast, plan.keypath

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._like.shape)

    @property
    def dtype(self) -> Any:
        return np.dtype(self._like.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"TransformedArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"

    def _host(self) -> np.ndarray:
        """The transformed value, checked against `like` (its stored arrays read whole)."""
        arrays = [np.asarray(part) for part in self._parts]
        try:
            made = np.asarray(self._fn(*arrays))
        except Exception as e:
            raise self._error(_raised(e)) from e
        out, problem = checked(made, self._like, self._cast)
        if problem:
            raise self._error(problem)
        return out

    def _error(self, problem: str) -> LeafError:
        message = leaf_message(problem, keypath=self._keypath, dotted=self.path, path=self._loc.display)
        return LeafError(message, path=self._loc.display, keypaths=[self._keypath], dotted=[self.path])

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._host()[index]

    def start(self, *, checked: bool = True) -> Any:
        def finish() -> Any:
            value, problem = finish_value(self._host(), self._like, self._cast)
            if problem:
                raise self._error(problem)
            return value

        return finish


def nested(
    source: Source, records: list[LeafRecord], key: str, *, lazy: bool, progress: Progress, numbered: bool
) -> Any:
    """The leaves of `records` (all at or below dotted `key`) as nested
    containers, read as any load reads, or lazily. `numbered`: see `structure`."""
    data = source.data
    refuse_leaves_with_children([record.path for record in records], data.display)
    # One kind of array in one load: if a leaf saved from JAX cannot be a JAX
    # array at full precision (64 bits without x64), none of them is: NumPy
    # keeps them exactly.
    dtypes = {record.dtype for record in records if record.type == "jax"}
    host = any(_dtypes.x64_missing(dtype_from_name(dtype)) for dtype in dtypes)
    like = _Likes(host)
    _faults.fire("nested.load", data, key)
    source.need([record.path for record in records])  # (a fine-tune's base, before any read)
    if lazy:
        leaf = functools.partial(_lazy_leaf, source, like=like)
        return structure(records, key, leaf, numbered=numbered)
    plans = [LeafPlan.of(i, record, like(record)) for i, record in enumerate(records)]
    values = dict(zip((record.path for record in records), _reader.read_leaves(source, plans, progress=progress)))
    return structure(records, key, lambda record: values[record.path], numbered=numbered)


def structure(
    records: list[LeafRecord], key: str, leaf: Callable[[LeafRecord], Any], *, numbered: bool, names: bool = False
) -> Any:
    """`leaf(record)` for each record (all at or below dotted `key`), nested as
    their key paths say. `numbered`: children named `0`, `1`, ... are a list (the
    key paths do not say which keys index a sequence: safetensors names).
    `names`: dicts are keyed by escaped dotted-path segments, not the keys."""
    depth = len(_keypath.split_dotted(key))
    if len(records) == 1 and records[0].path == key:
        return leaf(records[0])
    root = _Node()
    # Each key made once (the same few recur in every leaf's key path); by
    # value and type, so that `True` is never taken for the `1` it equals.
    made: dict[tuple[str, Any, type], tuple[str, Any, str]] = {}
    for record in records:
        keys = []
        for kind, value in record.keypath[depth:]:
            found = made.get((kind, value, type(value)))
            if found is None:
                found = made[(kind, value, type(value))] = _plain_key(kind, value, numbered)
            keys.append(found)
        # No leaf's path lies below another leaf's (`refuse_leaves_with_children`).
        node = root
        for part in keys[:-1]:
            node = node.setdefault(part, _Node())
        node[keys[-1]] = leaf(record)
    return _finish(root, names) if root else {}


class _Likes:
    """`_like` of each record, made once per type, dtype and shape (a model's
    ten thousand tensors have a few dozen shapes)."""

    def __init__(self, host: bool):
        self.host = host
        self.made: dict[tuple[Any, ...], Any] = {}

    def __call__(self, record: LeafRecord) -> Any:
        key = (record.type, record.dtype, tuple(record.shape), tuple(record.stored_shape), record.impl)
        found = self.made.get(key)
        if found is None:
            found = self.made[key] = _like(record, self.host)
        return found


def _lazy_leaf(source: Source, record: LeafRecord, *, like: _Likes) -> Any:
    """A `LazyArray` of the leaf; a scalar is read at once (it comes back as a value, lazy or not)."""
    lazy = LazyArray(source, record, like(record))
    if record.type in SCALAR_TYPES:
        return lazy.read()
    return lazy


def _like(record: LeafRecord, host: bool) -> Any:
    """A leaf of `like`, allocating nothing, that asks for the saved type on the
    default device (or NumPy, where `host`: any leaf of the load needs it)."""
    if host and record.type == "jax":
        return np.broadcast_to(np.zeros((), dtype_from_name(record.dtype)), record.shape)
    return abstract(record)


_NUMBER = re.compile(r"0|[1-9][0-9]*")


def _plain_key(kind: str, value: Any, numbered: bool) -> tuple[str, Any, str]:
    """`(kind, value, name)`: sequence indices stay ints ("index"); other keys
    keep their value, as a "number" where `numbered` and it is one; `name` is
    the key in dotted paths, for a dict whose keys cannot be sorted."""
    if kind in ("index", "flat"):
        return ("index", value, _keypath.stored_segment(kind, value))
    name = _keypath.stored_segment(kind, value)
    if numbered and kind == "key" and isinstance(value, str) and _NUMBER.fullmatch(value):
        return ("number", value, name)
    return ("key", value, name)


class _Node(dict):
    """A container being built: its children by `(kind, key)`."""


def refuse_leaves_with_children(paths: list[str], where: str) -> None:
    """Nested containers cannot show a leaf with leaves below it. An eqx_ckpt
    manifest never has one; a safetensors file may (tensors `a` and `a.b`)."""
    known = set(paths)
    # Every path with a leaf below it, each walked up from once: a leaf among
    # them is rare, and only then are the paths looked through for the message.
    parents: set[str] = set()
    for path in paths:
        parent, dot, _ = path.rpartition(".")
        while dot and parent not in parents:
            parents.add(parent)
            parent, dot, _ = parent.rpartition(".")
    if known.isdisjoint(parents):
        return
    for path in paths:
        parts = _keypath.split_dotted(path)
        for n in range(1, len(parts)):
            above = ".".join(parts[:n])
            if above in known:
                raise CheckpointValueError(
                    f"`{above}` in {where!r} is a leaf and also has leaves below it (`{path}`), so the "
                    f"checkpoint cannot be shown as nested containers. Read leaves by dotted path "
                    f"(`Checkpoint(path)[{path!r}]`), or load into a `like` with `tree_deserialise_leaves`.",
                    path=where,
                )


def _finish(node: Any, names: bool = False) -> Any:
    """`_Node`s as lists where every key is a sequence index (those not saved are
    `None`) or every key a `number` from 0 without a gap; else as dicts (also
    for indices too sparse to be a list, as a hostile manifest may claim)."""
    if not isinstance(node, _Node):
        return node
    kinds = {kind for kind, _, _ in node}
    if kinds == {"index"} and max(i for _, i, _ in node) < 2 * len(node) + 8:
        out: list[Any] = [None] * (max(i for _, i, _ in node) + 1)
        for (_, i, _), child in node.items():
            out[i] = _finish(child, names)
        return out
    if kinds == {"number"} and {int(n) for _, n, _ in node} == set(range(len(node))):
        return [_finish(child, names) for _, child in sorted(node.items(), key=lambda item: int(item[0][1]))]
    if names:
        return {name: _finish(child, names) for (_, _, name), child in node.items()}
    try:
        sorted(key for _, key, _ in node)
    except TypeError:
        # Keys JAX cannot sort (a custom node's indices beside names): each is
        # named as in the dotted paths instead, which tells them apart.
        return {name: _finish(child, names) for (_, _, name), child in node.items()}
    return {key: _finish(child, names) for (_, key, _), child in node.items()}
