"""`LazyArray`: a stored leaf that is read only when asked (`materialise`, in
`_deserialise`, reads many), by the reader of whole leaves (`_reader`)."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._base import _state
from .._base._errors import CheckpointTypeError
from .._base._location import Location
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord, dtype_from_name
from .._store import _memory, _storage_errors
from . import _read, _reader
from ._load_plan import LeafPlan
from ._rebuild import abstract

if TYPE_CHECKING:
    from .._store._storage import Array
    from ._source import Source


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
    `eqx_ckpt.materialise` first. Materialise first.

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
        # The opened checkpoint it reads from (`_source.Source`). It knows how a
        # leaf of another format is opened. It checks, after every read, that
        # the checkpoint was not replaced, so that a read never returns a later
        # save's bytes. `materialise` reads many lazy leaves through it as one
        # load does.
        self._source = source
        self._loc = source.data
        self._record = record
        self._like = like
        self._store: Array | None = None
        live = weakref.ref(self, _forget)
        _LIVE[id(live)] = live

    def __hash__(self) -> int:
        # Unhashable on purpose: `jax.jit` would otherwise treat it as static.
        # `eqx.filter_jit` hashes the non-array parts of its arguments, this
        # among them: its error then says what to do, not JAX's "Non-hashable
        # static arguments are not supported" alone.
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
        return len(self._record.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._record.shape, dtype=np.int64))

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
        """The whole leaf as a NumPy array of its `dtype` (a PRNG key's, its key
        data), read as a load reads it.

        The reader of whole leaves reads it. On a local disk it reads
        straight into one aligned buffer. A packed leaf comes from its pack,
        through the process's cached open of it, as a leaf read alone. Its
        checkpoint is checked after the read. How `np.asarray` reads it, a
        save stages it, and `export_safetensors` writes it."""
        if self._record.type == "prng_key":
            return self[...]
        like = np.broadcast_to(np.zeros((), self.dtype), self.shape)
        return _reader.read_leaves(self._source, [LeafPlan.of(0, self._record, like)], cached=True)[0]

    def start(self, *, checked: bool = True) -> Any:
        """The read of the whole leaf, to run: the returned function reads it
        by the reader of whole leaves (`_reader.read_leaves`, as a load
        reads it) and gives the value, then (unless `checked=False`) checks
        that the checkpoint was not replaced."""
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
        reads as: "jax", "numpy", "prng_key", a scalar's), "placed" for a JAX
        array placed over several devices (saved shard by shard)."""
        like = self._read_as()
        sharding = _read.target_sharding(like)
        if sharding is not None and len(sharding.device_set) > 1:
            return "placed"
        return _dtypes.like_type(like) or "other"

    def to_save(self) -> tuple[Any, str | None]:
        """What a save of this leaf writes, and the leaf type it records when
        that is not the value's own.

        It writes `read()`'s value, with one exception: a leaf read as a JAX
        array of a 64-bit dtype, in a process without JAX's 64-bit mode. That
        one is read as NumPy, its values exact, and recorded as the JAX array it
        stands for. So a lazily opened checkpoint saved again is a copy."""
        like = self._read_as()
        if _dtypes.like_type(like) == "jax" and _dtypes.x64_missing(self.dtype):
            return np.asarray(self), "jax"
        return self.read(), None


def _is_advanced(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, (list, np.ndarray, jax.Array, bool, np.bool_)) for item in items)


_VALID = (
    "only integers, slices (`:`), ellipsis (`...`), None and integer or boolean arrays are valid indices "
    "of a LazyArray, as of a NumPy array"
)


def _numpy_index(index: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`index` with NumPy's meaning made explicit: TensorStore reads negative and
    out-of-range bounds as literal coordinates, NumPy counts them from the end and
    clips them. Returns one entry per axis (plus any `None`s), no `...`."""
    items = list(index) if isinstance(index, tuple) else [index]
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, (slice, int, np.integer))):
            raise IndexError(f"{_VALID}, not {type(item).__name__} ({item!r})")
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


def _forget(live: weakref.ref[LazyArray]) -> None:
    _LIVE.pop(id(live), None)


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
