"""A save's plan: each leaf's manifest record and host pieces, made here and
nowhere else (`build`, by one path: `_Collector.add`, each value once), and
the packing of the small ones (`assign`). A piece is kept as what it comes
from; its host data is made within the staging budget (`_staging`). A save of
one process keeps its records for the next save of the same structure (`Plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._base import _faults, _keypath, _state, _tree
from .._base._errors import CheckpointError, CheckpointTypeError, LeafError, leaf_message
from .._base._handle import LeafHandle
from .._base._location import Location
from .._hosts import _multihost, _sharding
from .._load._lazy import LazyArray
from .._ondisk import _dtypes, _format, _iterators
from .._ondisk._format import LeafRecord, PackRecord, chunk_shape, dtype_from_name, pack_name, whole_chunks
from .._store import _memory


@dataclasses.dataclass(slots=True)
class Pending:
    """A leaf's record, and its pieces: (region, data) for each, the data
    made host as the save stages it (`_staging`); `nbytes`, their stored bytes."""

    record: LeafRecord
    pieces: list[tuple[tuple[slice, ...], Any]]
    nbytes: int


class Held:
    """A `jax.Array` leaf (`value`) of an asynchronous save, its host data taken
    while the caller waited, out of reach of a later donation or deletion:
    `data` (the array, or a PRNG key's key data) and its `pieces` (`[]` where
    another process writes it)."""

    __slots__ = ("data", "pieces", "value")

    def __init__(self, value: jax.Array, data: jax.Array, pieces: list[tuple[tuple[slice, ...], Any]]):
        self.value, self.data, self.pieces = value, data, pieces


def hold(x: jax.Array, primary: bool) -> Held:
    """`x` held by its host pieces (`primary`: whether this is process 0)."""
    data = jax.random.key_data(x) if _dtypes.is_prng_key(x) else x
    if not _multihost.writes(data, primary):
        return Held(x, data, [])
    return Held(x, data, [(index, _memory.protected(d, False)) for index, d in _sharding.host_pieces(data)])


def build(
    loc: Location,
    leaves: list[Any],
    names: _tree.Names,
    specs: list[Any],
    cast: Callable[[str, np.dtype], Any] | None,
    *,
    default: Callable[[LeafHandle, Any], None],
    compression: str = "",
    part: bool = False,
) -> list[Pending]:
    """Run the filter specs (one per leaf) and make the record and host pieces
    of every value they write. Nothing is written yet: a bad leaf leaves the
    destination untouched. `default`: the default filter spec, whose work on an
    array this does without the call or a handle. `part`: this process's own
    part of a local tier's step, which holds every leaf and every region of
    one it addresses (`_sharding.host_pieces`)."""
    _faults.fire("save.records", loc)
    paths, records = names.paths, names.records
    _tree.check_unique(names, checkpoint=loc.display)
    collector = _Collector(loc, names, cast, part or jax.process_index() == 0, compression, part=part)
    add, kinds, as_is = collector.add, _KINDS, _WRITTEN_AS_IS
    i = 0
    try:
        for i, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
            if spec is default:
                cls = type(leaf)
                kind = kinds.get(cls) or array_kind(cls)
                if kind in as_is:
                    add(leaf, kind, paths[i], records[i], i)
                    continue
            spec(collector.handle(i), leaf)
    except CheckpointError:
        raise
    except Exception as e:
        raise _leaf_failed(e, loc, names.keypath(i), paths[i], leaves[i]) from e
    finally:
        # A handle kept past this point (and written through later) must not
        # add a leaf the manifest would list and no write would store.
        collector.collecting = False
    return collector.pending


class Plan:
    """A save's records, packs assigned, kept in its `_tree.Names.memo` for the
    next save of the same structure (a training loop saves one tree again and
    again), only where every leaf is the common leaf (or an iterator, whose
    state the save records apart), and never changed once kept. `written`:
    the indices of the leaves written (`None`: all). `text`: the manifest's
    text of the records, made by the first save that encodes them."""

    __slots__ = ("dtypes", "nbytes", "records", "shapes", "text", "types", "written")

    def __init__(self, pending: list[Pending], leaves: list[Any], written: tuple[int, ...] | None):
        self.records = [p.record for p in pending]
        self.nbytes = [p.nbytes for p in pending]
        self.types = list(map(type, leaves))
        self.written = written
        arrays = self.arrays(leaves)
        self.dtypes = [x.dtype for x in arrays]
        self.shapes = [x.shape for x in arrays]
        self.text: list[Any] | None = None

    def arrays(self, leaves: list[Any]) -> list[Any]:
        """The leaves this plan writes, of a tree of its structure."""
        return leaves if self.written is None else [leaves[i] for i in self.written]


def reuse(
    names: _tree.Names, leaves: list[Any], specs: list[Any], *, default: Any, for_steps: bool, compression: str = ""
) -> Plan | None:
    """The plan a save of `names`' structure kept (`remember`), where each of
    `leaves` is of the type, dtype and shape it was, on one device, written
    by the `default` filter spec; else `None`."""
    plan = names.memo.get(_plan_key(for_steps, compression)) if names.memo is not None else None
    if plan is None or len(plan.types) != len(leaves):
        return None
    if any(spec is not default for spec in specs) or any(type(x) is not c for x, c in zip(leaves, plan.types)):
        return None  # (the same types: the iterators, found by their class, where they were)
    one_device = _ONE_DEVICE
    for x, dtype, shape in zip(plan.arrays(leaves), plan.dtypes, plan.shapes, strict=True):
        if x.shape != shape or x.dtype != dtype:
            return None
        if type(x) is not np.ndarray and (type(x.sharding) is not one_device or x.is_deleted()):
            return None  # (a deleted array goes the way that names it)
    return plan


def remember(
    names: _tree.Names, leaves: list[Any], pending: list[Pending], *, for_steps: bool, compression: str = ""
) -> Plan | None:
    """Keep the plan of a save of one process (records made and packs assigned)
    for the next save of the same structure, where every leaf but the
    iterators is the common leaf, written whole as it is (see `Plan`). The
    plan kept, or `None`."""
    iterators = _iterators.found(leaves)
    written = tuple(sorted(set(range(len(leaves))) - set(iterators))) if iterators else None
    at = range(len(leaves)) if written is None else written
    if names.memo is None or len(pending) != len(at):
        return None
    for i, p in zip(at, pending, strict=True):
        x, path = leaves[i], names.paths[i]
        kind = _KINDS.get(type(x))
        pieces, record = p.pieces, p.record
        if kind not in ("jax", "numpy") or len(pieces) != 1 or pieces[0][1] is not x or pieces[0][0]:
            return None  # (a value a filter spec wrote, or written another way)
        if record.type != kind or record.encoding != "plain" or record.path != path:
            return None
        if kind == "jax" and type(x.sharding) is not _ONE_DEVICE:
            return None
    plan = names.memo[_plan_key(for_steps, compression)] = Plan(pending, leaves, written)
    return plan


def _plan_key(for_steps: bool, compression: str) -> tuple[Any, ...]:
    """Where a `Plan` is kept in a `_tree.Names.memo`: with the knobs its
    records were made by (tests change them), so that none outlives them."""
    chunks = (_format.CHUNK_BYTES, _format.COMPRESSED_CHUNK_BYTES)
    return (Plan, for_steps, compression, *chunks, PACK_BYTES, PACK_CHUNK_BYTES, STEP_PACK_CHUNK_BYTES, ALIGN_BYTES)


class _Collector:
    """The records and pieces of a save's values, in order (`pending`): each
    value written (by the default filter spec's work, or through a handle) is
    made one by `add`, once."""

    def __init__(
        self,
        loc: Location,
        names: _tree.Names,
        cast: Callable[[str, np.dtype], Any] | None,
        primary: bool,
        compression: str,
        *,
        part: bool = False,
    ):
        self.pending: list[Pending] = []
        self.collecting = True  # until the specs have run: `pending` is then the save's, and final
        self._loc, self._names = loc, names
        self._written: set[str] = set()
        self._record_of: dict[str, list[list[Any]]] | None = None  # made at the first handle write
        self.cast, self.primary = cast, primary
        # Who writes which slice of a leaf several processes hold: one deal for the save's leaves.
        self.deal = _sharding.Deal()
        self.part = part  # a process's own part: every region it addresses (`build`)
        # (dtype, shape) -> the common leaf's fixed part (`_fixed_part`), worked out once each.
        self._fixed: dict[tuple[Any, tuple[int, ...]], tuple[str | None, tuple[int, ...], int]] = {}
        self.compression = compression
        self.limit = min(_format.CHUNK_BYTES, _format.COMPRESSED_CHUNK_BYTES) if compression else _format.CHUNK_BYTES

    def handle(self, i: int) -> LeafHandle:
        """The handle of leaf `i`, which its filter spec writes through."""
        names = self._names
        return LeafHandle(names.keypath(i), names.paths[i], self._loc.display, write=self.write)

    def write(self, handle: LeafHandle, value: Any) -> None:
        if not self.collecting:
            raise handle.error(
                "`handle.write` was called after the filter spec returned: the save has already "
                "begun (or finished) with what the filter spec wrote while it ran, without this value.",
                "Call `handle.write` inside the filter spec, while `tree_serialise_leaves` runs it.",
            )
        if handle.path in self._written:
            raise handle.error(
                "the filter spec wrote it twice; a checkpoint holds one value per leaf.",
                "Call `handle.write` once for each leaf (or not at all, to leave it out).",
            )
        self._written.add(handle.path)
        if self._record_of is None:
            self._record_of = dict(zip(self._names.paths, self._names.records))
        keypath = self._record_of.get(handle.path) or _keypath.to_json(handle.keypath)
        cls = type(value)
        self.add(value, _KINDS.get(cls) or array_kind(cls), handle.path, keypath, handle)

    def add(self, x: Any, kind: str, path: str, keypath: list[list[Any]], where: int | LeafHandle) -> None:
        """Make the record and host pieces of `x` (of `array_kind` `kind`), written
        for the leaf at `path`; `where`: its handle, or the leaf's index.

        The common leaf (a NumPy array or a `jax.Array` on one device, held or
        not, of a dtype stored as it is, not cast) takes the short branch: its
        record's fixed part is worked out once per dtype and shape (faster than
        leaf by leaf: docs/benchmarks.md). Any other value goes the general way
        (`_general`), which checks what it can store and names the leaf in its errors."""
        held = None
        if kind == "held":
            held, x, kind = x, x.value, "jax"
        if self.cast is None and (
            kind == "numpy" or (kind == "jax" and (type(x.sharding) is _ONE_DEVICE or _sharding.on_one_device(x)))
        ):
            dtype, shape = x.dtype, x.shape
            fixed = self._fixed.get((dtype, shape))
            if fixed is None:
                fixed = self._fixed[dtype, shape] = _fixed_part(dtype, shape, self.limit)
            name, chunks, nbytes = fixed
            # (A deleted array goes the general way, which names the leaf.)
            if name is not None and (held is not None or not self.primary or kind == "numpy" or not x.is_deleted()):
                if held is not None:
                    pieces = held.pieces
                elif self.primary:
                    pieces = [((), x)]
                else:
                    pieces = []
                record = LeafRecord(path, keypath, kind, shape, name, shape, name, "plain", chunks)
                record.compression = self.compression
                self.pending.append(Pending(record, pieces, nbytes if pieces else 0))
                return
        if not isinstance(where, LeafHandle):
            where = self.handle(where)
        self.pending.append(_general(where, x if held is None else held, keypath, self))


_ONE_DEVICE = jax.sharding.SingleDeviceSharding
# The kinds (`array_kind`) the default filter spec writes as they are: arrays
# (a tracer's kind is "abstract": the default spec's write of it raises the
# error it should), and an asynchronous save's held arrays.
_WRITTEN_AS_IS = frozenset(("jax", "numpy", "ndarray", "held"))


def _fixed_part(dtype: np.dtype, shape: tuple[int, ...], limit: int) -> tuple[str | None, tuple[int, ...], int]:
    """A common leaf's record's fixed part: its dtype's name (`None` where it
    is not stored as it is, or has too many dimensions), chunk shape and bytes."""
    name = _plain_dtype(dtype) if len(shape) <= _format.MAX_RANK else None
    chunks = _chunk_grid(shape, dtype.itemsize, limit) if name else ()
    return name, chunks, math.prod(shape) * dtype.itemsize


def _leaf_failed(error: Exception, loc: Location, keypath: tuple[Any, ...], dotted: str, leaf: Any) -> LeafError:
    """The error of a leaf that could not be prepared (the filter spec raised)."""
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        what = (
            "it is a deleted `jax.Array` (deleted, or donated to a function compiled with "
            "`donate_argnums`): its values are gone."
        )
        fix = "Save the arrays before they are donated, or save the ones the donating function returned."
    else:
        what, fix = f"the filter spec raised {type(error).__name__}: {error}", ""
    message = leaf_message(what, keypath=keypath, dotted=dotted, path=loc.display, fix=fix)
    return LeafError(message, path=loc.display, keypaths=[keypath], dotted=[dotted])


class Unread:
    """An array leaf read (or made) only when the save stages it, so that a
    save of such leaves holds no more than its staging budget: a lazily loaded
    leaf (`of`; its checkpoint stays whole until the save commits: a save
    writes into another data root), or a leaf a tool computes (a merge's).
    `read`: makes its NumPy value, exactly of `dtype` and `shape`; `kind`:
    the leaf type it is saved as ("jax" or "numpy")."""

    def __init__(self, read: Callable[[], np.ndarray], dtype: Any, shape: tuple[int, ...], kind: str):
        self.read, self.kind = read, kind
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)

    @classmethod
    def of(cls, lazy: LazyArray) -> Unread | None:
        """`lazy` unread, where it stands for a NumPy or JAX array (else `None`: read now).
        Read by the load's reader (`LazyArray`'s NumPy value: on a local disk,
        straight into one aligned buffer, which the writer takes without another copy)."""
        kind = lazy.saved_as
        if kind not in ("jax", "numpy"):
            return None
        return cls(functools.partial(np.asarray, lazy), lazy.dtype, lazy.shape, kind)

    def piece(self) -> _memory.Deferred:
        """The host data, as the staging makes it."""
        return _memory.Deferred(self.read, int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize)


def _general(handle: LeafHandle, x: Any, keypath: list[list[Any]], collector: _Collector) -> Pending:
    """The record and host pieces of any other value (`_Collector.add`): any
    leaf type, a cast, a PRNG key, a sharded array, a lazily loaded leaf."""
    _faults.fire("save.leaf_record", handle.path)
    held = None
    if isinstance(x, Held):
        held, x = x, x.value
    x, kind, impl, dtype_name, shape = _value(handle, x, held)
    logical = _cast_dtype(handle, x.dtype, collector.cast) if kind in ("jax", "numpy") else np.dtype(x.dtype)
    stored, encoding = _dtypes.stored_dtype(logical)
    if kind == "prng_key":
        encoding = "key_data"
    itemsize = dtype_from_name(stored).itemsize
    # The chunk grid first: with several processes, it is what their slices follow.
    chunks = tuple(chunk_shape(tuple(x.shape), itemsize, _sharding.block_shape(x), collector.limit))
    if held is not None:
        pieces = held.pieces
    elif not _multihost.writes(x, collector.primary):
        pieces = []
    elif isinstance(x, Unread):
        pieces = [((), x.piece())]
    else:
        pieces = _sharding.host_pieces(x, chunks, itemsize, deal=collector.deal, path=handle.path, part=collector.part)
    pieces = _stored_pieces(handle, x, pieces, logical, encoding)
    record = LeafRecord(
        handle.path,
        keypath,
        kind,
        shape,
        dtype_name,
        tuple(x.shape),
        stored,
        encoding,
        chunks,
        impl,
        compression=collector.compression,
    )
    return Pending(record, pieces, sum(_memory.nbytes(piece) for _, piece in pieces))


def _value(handle: LeafHandle, x: Any, held: Held | None) -> tuple[Any, str, str, str, tuple[int, ...]]:
    """What is stored of `x` (an array), its leaf type, its PRNG implementation
    (or ""), and the dtype name and shape the manifest records; the error of a
    leaf that cannot be stored."""
    if isinstance(x, jax.core.Tracer):
        raise handle.error(
            "it is a traced value: a save inside `jax.jit` (or `vmap`, `grad`...) sees no values.",
            "Save outside the transformed function, with the arrays it returns.",
        )
    recorded_as = None
    if isinstance(x, Unread):
        return x, x.kind, "", _dtypes.name(x.dtype), x.shape
    if isinstance(x, LazyArray):
        unread = Unread.of(x)
        if unread is not None:
            return unread, unread.kind, "", _dtypes.name(unread.dtype), unread.shape
        # A scalar or a PRNG key of a lazily loaded tree: read now.
        x, recorded_as = x.to_save()
    kind = recorded_as or _dtypes.leaf_type(x)
    if kind is None:
        raise handle.error(
            f"cannot save a leaf of type {type(x).__name__}.",
            "Only arrays and bool/int/float/complex scalars are stored; let the "
            "filter spec skip this leaf, and it keeps `like`'s value on load.",
        )
    impl = ""
    if kind == "prng_key":
        impl, dtype_name, shape = str(jax.random.key_impl(x)), str(x.dtype), tuple(x.shape)
        x = jax.random.key_data(x) if held is None else held.data
    elif kind in ("bool", "int", "float", "complex"):
        try:
            x = _dtypes.python_scalar_array(x)
        except OverflowError as e:
            raise handle.error(f"{e}.", "Store it as a float, or split it into smaller ints.") from None
    elif isinstance(x, np.ma.MaskedArray):
        raise handle.error(
            "it is a NumPy masked array, whose mask a checkpoint would lose (it stores plain arrays).",
            "Save its data and its mask as two leaves (`x.data` and `np.ma.getmaskarray(x)`), or a "
            "filled copy (`x.filled()`).",
        )
    elif not isinstance(x, jax.Array):
        x = np.asarray(x)
    elif held is None and x.is_deleted():
        # (Its host data is made later, as the save stages it; a held leaf's was taken.)
        raise RuntimeError("the array was deleted")
    if kind != "prng_key":
        if not _dtypes.is_known_dtype(_dtypes.name(x.dtype)):
            raise handle.error(f"cannot save an array of dtype {x.dtype}.", "Only numeric and bool arrays are stored.")
        dtype_name, shape = _dtypes.name(x.dtype), tuple(x.shape)
    if len(shape) > _format.MAX_RANK:
        raise handle.error(
            f"it has {len(shape)} dimensions; a zarr v3 array (TensorStore) has at most {_format.MAX_RANK}.",
            "Reshape it before saving (and back after loading), or let the filter spec skip it.",
        )
    return x, kind, impl, dtype_name, shape


def _stored_pieces(handle: LeafHandle, x: Any, pieces: list[Any], logical: np.dtype, encoding: str) -> list[Any]:
    """The pieces of `x` as stored: cast to `logical`, then encoded, as the save
    stages them. The cast's values are checked here first, so that a value it
    would change is an error before anything is written."""
    cast = logical != x.dtype
    if not cast and encoding != "view":
        return pieces
    if cast:
        try:
            for _, piece in pieces:
                _dtypes.check_cast(_memory.host(piece), logical)
        except ValueError as e:
            raise handle.error(
                f"cannot store it as {logical} (`cast`): {e}.",
                "Nothing was written. Cast it to a dtype that holds its values.",
            ) from None
    convert = functools.partial(_dtypes.stored_values, logical, encoding)
    ratio = (logical.itemsize, np.dtype(x.dtype).itemsize)
    return [
        (index, _memory.Deferred(piece, _memory.nbytes(piece) * ratio[0] // ratio[1], convert))
        for index, piece in pieces
    ]


def array_kind(cls: type) -> str:
    """What a leaf of type `cls` is: "jax" (a `jax.Array` with values), "numpy"
    (exactly `np.ndarray`), "ndarray" (a subclass of it), "abstract" (a tracer or
    a `jax.ShapeDtypeStruct`), "held" (`Held`) or "other". Remembered by type: an `isinstance`
    against JAX's classes costs about a microsecond, ten thousand times a save."""
    _faults.fire("save.array_kind", cls)
    kind = _KINDS.get(cls)
    if kind is None:
        if cls is Held:
            kind = "held"
        elif issubclass(cls, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            kind = "abstract"
        elif issubclass(cls, jax.Array):
            kind = "jax"
        elif issubclass(cls, np.ndarray):
            kind = "numpy" if cls is np.ndarray else "ndarray"
        else:
            kind = "other"
        _KINDS.put(cls, kind)
    return kind


_KINDS: _state.Table[type, str] = _state.table("records.kinds", 256, "clear")


@_state.memo(256)
def _plain_dtype(dtype: np.dtype) -> str | None:
    """The name of `dtype` when an array of it is stored as it is (not a PRNG
    key, a dtype zarr v3 has); else `None`."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    name = _dtypes.name(dtype)
    if not _dtypes.is_known_dtype(name) or _dtypes.stored_dtype(dtype) != (name, "plain"):
        return None
    return name


@_state.memo(4096)
def _chunk_grid(shape: tuple[int, ...], itemsize: int, limit: int) -> tuple[int, ...]:
    """`chunk_shape`, remembered (`limit`, which tests change, is part of the key)."""
    return tuple(chunk_shape(shape, itemsize, limit=limit))


def _cast_dtype(handle: LeafHandle, dtype: Any, cast: Callable[[str, np.dtype], Any] | None) -> np.dtype:
    """The dtype a leaf is stored in: `dtype`, or what `cast` maps it to."""
    try:
        target = cast(handle.path, np.dtype(dtype)) if cast is not None else None
    except Exception as e:
        raise handle.error(f"the `cast` callable raised {type(e).__name__}: {e}.", "Nothing was written.") from e
    if target is None:
        return np.dtype(dtype)
    try:
        target = np.dtype(target)
    except TypeError:
        raise handle.error(f"`cast` gave {target!r}, which is not a dtype.", "Return a dtype or `None`.") from None
    if not _dtypes.is_known_dtype(target.name) or _dtypes.stored_dtype(target)[1] != "plain":
        raise handle.error(
            f"cannot cast {np.dtype(dtype)} to {target} on save: {target} has no zarr v3 data type.",
            "Cast to a type zarr stores natively (bfloat16, float16, float8_e4m3fn...), or do not cast this leaf.",
        )
    return target


def cast_function(cast: Any) -> Callable[[str, np.dtype], Any] | None:
    """`cast` as a function `(dotted_path, dtype) -> dtype | None`. A dtype (or its
    name) means: store every floating leaf in it."""
    if cast is None:
        return None
    if isinstance(cast, Mapping):
        try:
            table = {_dtype(k): _dtype(v) for k, v in cast.items()}
        except TypeError as e:
            raise CheckpointTypeError(f"`cast` maps {e}; both sides must be dtypes, such as `jnp.float32`.") from None
        return lambda _, dtype: table.get(np.dtype(dtype))
    if isinstance(cast, (str, np.dtype, type)) or (callable(cast) and hasattr(cast, "dtype")):
        try:
            target = _dtype(cast)
        except TypeError:
            target = None
        if target is not None:
            return lambda _, dtype: target if _dtypes.is_floating(np.dtype(dtype)) else None
    if callable(cast):
        return cast
    raise CheckpointTypeError(
        f"`cast` must be a dtype (floating leaves are stored in it, e.g. `jnp.bfloat16` or 'bfloat16'), "
        f"a mapping from dtype to dtype, or a callable `(dotted_path, dtype) -> dtype | None`; not {cast!r}."
    )


def _dtype(value: Any) -> np.dtype:
    """A dtype from a dtype, a scalar type or a name; `TypeError` naming `value` otherwise."""
    try:
        return dtype_from_name(value) if isinstance(value, str) else np.dtype(value)
    except (TypeError, ValueError, AttributeError):
        raise TypeError(f"{value!r}, which is not a dtype") from None


# -- The packing plan ----------------------------------------------------------------------------
#
# Small leaves share one array per stored dtype, each at an offset its record
# gives (the format, why, and how packs are read: `_pack`). Only single-process
# saves pack, and only leaves whose data is one host piece (not sharded over
# several devices): those are written by one writer in one go.

# Leaves of at most this many stored bytes are packed.
PACK_BYTES = 1 << 20
# The most bytes of a pack's chunk: what a partial load reads at least, and what
# an incremental save writes again around a changed leaf. A manager's step cuts
# small chunks, so that a fine-tune of a small model adds about the changed
# bytes per step; any other save cuts large ones, which cost less CPU
# (docs/benchmarks.md; docs/format.md, "How packs are cut").
PACK_CHUNK_BYTES = 4 << 20
STEP_PACK_CHUNK_BYTES = 128 << 10
ALIGN_BYTES = 64


def assign(
    records: Sequence[LeafRecord],
    pieces: Sequence[Sequence[tuple[tuple[slice, ...], Any]]],
    *,
    for_steps: bool = False,
    compression: str = "",
) -> None:
    """Place in packs by dtype, in order, the `records` of at most `PACK_BYTES`
    whose host data (`pieces`, the leaf's) is one whole piece, in chunks of at
    most `STEP_PACK_CHUNK_BYTES` `for_steps` of a manager, else `PACK_CHUNK_BYTES`,
    compressed by `compression`. In place: a save's records are new, and seen by nothing else yet."""
    ends: dict[str, int] = {}
    placed: list[LeafRecord] = []
    # (stored dtype, stored shape) -> (elements, bytes, alignment step, chunks):
    # worked out once for each (ten thousand leaves have a few dozen).
    known: dict[tuple[str, tuple[int, ...]], tuple[int, int, int, tuple[int, ...]]] = {}
    for record, leaf_pieces in zip(records, pieces, strict=True):
        if len(leaf_pieces) != 1 or leaf_pieces[0][0]:
            continue
        dtype, shape = record.stored_dtype, record.stored_shape
        sizes = known.get((dtype, shape))
        if sizes is None:
            size = math.prod(shape)
            itemsize = dtype_from_name(dtype).itemsize
            sizes = known[dtype, shape] = (size, size * itemsize, _align_step(dtype), whole_chunks(shape))
        size, nbytes, step, chunks = sizes
        if nbytes > PACK_BYTES:
            continue
        record.offset = offset = -(-ends.get(dtype, 0) // step) * step
        record.chunks, record.compression = chunks, ""
        ends[dtype] = offset + size
        placed.append(record)
    packs = {}
    limit = STEP_PACK_CHUNK_BYTES if for_steps else PACK_CHUNK_BYTES
    for dtype, size in ends.items():
        chunk = pack_chunk(size, dtype_from_name(dtype).itemsize, _align_step(dtype), limit)
        packs[dtype] = PackRecord(pack_name(dtype), dtype, size, chunk, compression=compression)
    for record in placed:
        record.pack = packs[record.stored_dtype]


def pack_chunk(size: int, itemsize: int, step: int, limit: int) -> int:
    """The chunk length of a pack of `size` elements of `itemsize` bytes.

    At most `limit` bytes, and as even as the pack allows, so that its last
    chunk pads little past its data (zarr stores every chunk full, and writes
    again whole a chunk whose members changed). Chunks of a pack of several
    are a whole number of `step` elements (64 bytes), so that every chunk
    starts aligned. E.g. 33,000 float32 elements are two chunks of 16,512
    (24 elements of padding), not 32,768 and a last one of 232."""
    most = max(1, limit // itemsize)
    if size <= most:
        return max(1, size)
    count = -(-size // most)
    chunk = -(-size // count)
    chunk = -(-chunk // step) * step
    return chunk if chunk <= most else most


@_state.memo(64)
def _align_step(dtype: str) -> int:
    """Offsets (in elements of `dtype`) that start on a 64-byte boundary."""
    return max(1, ALIGN_BYTES // dtype_from_name(dtype).itemsize)
