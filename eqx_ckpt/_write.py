"""What a save writes: each leaf's manifest record and host pieces, then the
arrays themselves, created and written concurrently through TensorStore."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from . import (
    _dtypes,
    _durable,
    _format,
    _interrupts,
    _keypath,
    _layout,
    _local_read,
    _local_write,
    _memory,
    _multihost,
    _pack,
    _sharding,
    _storage,
    _transaction,
)
from ._errors import CheckpointTypeError
from ._format import LeafRecord, PackRecord, chunk_shape
from ._handle import LeafHandle
from ._lazy import LazyArray
from ._location import Location
from ._progress import Tracker


@dataclasses.dataclass(slots=True)
class Pending:
    record: LeafRecord
    pieces: list[tuple[tuple[slice, ...], np.ndarray]]


class Batch:
    """A save's pending leaves (records final, packs assigned), sorted once by
    where they are written: `own`, the leaves with an array of their own, and
    `packs`, each pack with its members, by name; `nbytes`, their host bytes."""

    def __init__(self, pending: list[Pending], *, made: list[Any] | None = None):
        self.pending = pending
        # Other lists the save made along with `pending` (its flattened tree):
        # freed with it, by `free`.
        self.made = made if made is not None else []
        self.freed = False
        self.own: list[Pending] = []
        members: dict[str, tuple[PackRecord, list[Pending]]] = {}
        nbytes = 0
        for p in pending:
            pack = p.record.pack
            if pack is None:
                self.own.append(p)
            elif pack.name in members:
                members[pack.name][1].append(p)
            else:
                members[pack.name] = (pack, [p])
            for _, piece in p.pieces:
                nbytes += piece.nbytes
        self.packs = [members[name] for name in sorted(members)]
        self.nbytes = nbytes

    def records(self) -> list[LeafRecord]:
        if self.freed:
            raise RuntimeError("Internal error: the records of a save were asked for after they were freed.")
        return [p.record for p in self.pending]

    def free(self) -> None:
        """Empty this batch, freeing its records and host views (the writes keep
        references of their own to the data): called once the records are
        encoded, while the writes are in flight. Ten thousand leaves' records,
        views and key paths took 16-22 ms to free, which the end of a save
        waited for; freed here, they overlap the writes. A few hundred at a
        time, so that the writer threads get the GIL between them."""
        self.freed = True
        lists: list[list[Any]] = [self.pending, self.own, *(members for _, members in self.packs)]
        for items in [*lists, self.packs, self.made]:
            while items:
                del items[-_FREE_STEP:]


_FREE_STEP = 256


class Held:
    """A `jax.Array` leaf of an asynchronous save, with the host data the save
    writes taken while the caller waited: a donation or deletion of the array
    after the call returns cannot reach it.

    - `value`: the array (its shape, dtype and sharding are read later).
    - `data`: what is stored: the array, or a PRNG key array's key data.
    - `pieces`: `_sharding.host_pieces(data)`, or `[]` when another process writes it.

    (A plain class with slots: one is made per leaf.)
    """

    __slots__ = ("data", "pieces", "value")

    def __init__(self, value: jax.Array, data: jax.Array, pieces: list[tuple[tuple[slice, ...], Any]]):
        self.value, self.data, self.pieces = value, data, pieces


def hold(x: jax.Array, primary: bool) -> Held:
    """`x` with its host data taken; `primary`: whether this is process 0. (The
    common leaf, a plain array on one device, an asynchronous save's caller
    holds by its NumPy view alone: `_serialise._hold`.)"""
    data = jax.random.key_data(x) if _dtypes.is_prng_key(x) else x
    return Held(x, data, _sharding.host_pieces(data) if _multihost.writes(data, primary) else [])


def prepare(
    handle: LeafHandle,
    x: Any,
    cast: Callable[[str, np.dtype], Any] | None,
    *,
    primary: bool | None = None,
    keypath: list[list[Any]] | None = None,
) -> Pending:
    """The manifest record and the host pieces of one leaf; `primary`: whether
    this is process 0 (asked of JAX when not given); `keypath`: the manifest
    record of `handle.keypath`, when the caller has it."""
    if keypath is None:
        keypath = _keypath.to_json(handle.keypath)
    if cast is None:
        primary = jax.process_index() == 0 if primary is None else primary
        common = plain(x, handle.path, keypath, primary)
        if common is not None:
            return common
    held = None
    if isinstance(x, Held):
        held, x = x, x.value
    if isinstance(x, jax.core.Tracer):
        raise handle.error(
            "it is a traced value: a save inside `jax.jit` (or `vmap`, `grad`...) sees no values.",
            "Save outside the transformed function, with the arrays it returns.",
        )
    recorded_as = None
    if isinstance(x, LazyArray):
        # A leaf of a lazily loaded tree is saved with its value: read it now,
        # before anything is written (it may come from the checkpoint being
        # replaced, which stays whole until this save commits).
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
    if kind != "prng_key":
        if not _dtypes.is_known_dtype(_dtypes.name(x.dtype)):
            raise handle.error(f"cannot save an array of dtype {x.dtype}.", "Only numeric and bool arrays are stored.")
        dtype_name, shape = _dtypes.name(x.dtype), tuple(x.shape)
    if len(shape) > _format.MAX_RANK:
        raise handle.error(
            f"it has {len(shape)} dimensions; a zarr v3 array (TensorStore) has at most {_format.MAX_RANK}.",
            "Reshape it before saving (and back after loading), or let the filter spec skip it.",
        )
    block = _sharding.block_shape(x)
    if held is not None:
        pieces = held.pieces
    else:
        pieces = _sharding.host_pieces(x) if _multihost.writes(x, primary) else []
    logical = _cast_dtype(handle, x.dtype, cast) if kind in ("jax", "numpy") else np.dtype(x.dtype)
    if logical != x.dtype:
        try:
            pieces = [(index, _dtypes.checked_cast(np.asarray(piece), logical)) for index, piece in pieces]
        except ValueError as e:
            raise handle.error(
                f"cannot store it as {logical} (`cast`): {e}.",
                "Nothing was written. Cast it to a dtype that holds its values.",
            ) from None
    stored, encoding = _dtypes.stored_dtype(logical)
    if kind == "prng_key":
        encoding = "key_data"
    pieces = [(index, _dtypes.encode(piece, encoding)) for index, piece in pieces]
    itemsize = _dtypes.dtype_from_name(stored).itemsize
    chunks = chunk_shape(tuple(x.shape), itemsize, block)
    record = LeafRecord(
        handle.path, keypath, kind, shape, dtype_name,
        tuple(x.shape), stored, encoding, tuple(chunks), impl,
    )  # fmt: skip
    return Pending(record, pieces)


def plain(x: Any, path: str, keypath: list[list[Any]], primary: bool) -> Pending | None:
    """`prepare` of the common leaf, or `None` for any other: a NumPy array or a
    `jax.Array` on one device (or either held), of a dtype stored as it is, not
    cast. One host piece, in whole-array chunks."""
    return plain_leaves([x], [path], [keypath], primary)[0]


def plain_leaves(
    leaves: list[Any], paths: list[str], keypaths: list[list[list[Any]]], primary: bool
) -> list[Pending | None]:
    """`plain` of every leaf, in one loop: what a save with the default filter
    spec and no `cast` does with each leaf (`None` for a leaf that is not the
    common one). The record's fixed part is worked out once per dtype and shape
    (the `many` benchmark tree's records: 32 ms in a save against 37 ms leaf by
    leaf, about 17 of them JAX's `np.asarray`). `tests/test_write.py` checks
    that it gives what `plain` gives."""
    out: list[Pending | None] = []
    append = out.append
    kinds, one_device, limit = _KINDS, jax.sharding.SingleDeviceSharding, _format.CHUNK_BYTES
    # (dtype, shape) -> (dtype name, chunk shape); the name `None` when not stored as it is.
    fixed: dict[tuple[Any, tuple[int, ...]], tuple[str | None, tuple[int, ...]]] = {}
    for x, path, keypath in zip(leaves, paths, keypaths, strict=True):
        try:
            cls = type(x)
            held = None
            if cls is Held:
                held, x = x, x.value
                cls = type(x)
            kind = kinds.get(cls) or array_kind(cls)
            if kind == "jax":
                if type(x.sharding) is not one_device and not _sharding.on_one_device(x):
                    append(None)
                    continue
            elif kind != "numpy":
                append(None)
                continue
            dtype, shape = x.dtype, x.shape
            known = fixed.get((dtype, shape))
            if known is None:
                name = _plain_dtype(dtype) if len(shape) <= _format.MAX_RANK else None
                known = fixed[dtype, shape] = (name, _chunk_grid(shape, dtype.itemsize, limit) if name else ())
            name, chunks = known
            if name is None:
                append(None)
                continue
            if held is not None:
                pieces = held.pieces
            else:
                pieces = [((), np.asarray(x))] if primary else []
        except Exception:
            # (A deleted `jax.Array`, say.) `prepare`'s general path raises the
            # error again, where the save names the leaf.
            append(None)
            continue
        append(Pending(LeafRecord(path, keypath, kind, shape, name, shape, name, "plain", chunks), pieces))
    return out


def array_kind(cls: type) -> str:
    """What a leaf of type `cls` is: "jax" (a `jax.Array` with values), "numpy"
    (exactly `np.ndarray`), "ndarray" (a subclass of it), "abstract" (a tracer or
    a `jax.ShapeDtypeStruct`) or "other". Remembered by type: an `isinstance`
    against JAX's classes costs about a microsecond, ten thousand times a save."""
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            kind = "abstract"
        elif issubclass(cls, jax.Array):
            kind = "jax"
        elif issubclass(cls, np.ndarray):
            kind = "numpy" if cls is np.ndarray else "ndarray"
        else:
            kind = "other"
        _KINDS[cls] = kind
    return kind


_KINDS: dict[type, str] = {}


@functools.lru_cache(maxsize=256)
def _plain_dtype(dtype: np.dtype) -> str | None:
    """The name of `dtype` when an array of it is stored as it is (not a PRNG
    key, a dtype zarr v3 has); else `None`."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    name = _dtypes.name(dtype)
    if not _dtypes.is_known_dtype(name) or _dtypes.stored_dtype(dtype) != (name, "plain"):
        return None
    return name


@functools.lru_cache(maxsize=4096)
def _chunk_grid(shape: tuple[int, ...], itemsize: int, limit: int) -> tuple[int, ...]:
    """`chunk_shape`, remembered; `limit` (`CHUNK_BYTES`, which tests change)
    is part of the key, so that no chunk shape outlives the limit it was made for."""
    return tuple(chunk_shape(shape, itemsize))


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


# Saves still writing in the background, by destination. A later save to the same
# destination waits for them: two saves at once would write the same data root.


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
        return _dtypes.dtype_from_name(value) if isinstance(value, str) else np.dtype(value)
    except (TypeError, ValueError, AttributeError):
        raise TypeError(f"{value!r}, which is not a dtype") from None


# (leaves, bytes, futures) of the writes `start_writes` leaves running, in order.
Writing = list[tuple[int, int, list[Any]]]


def start_writes(
    tx: _transaction.Transaction,
    batch: Batch,
    group: _multihost.Group,
    *,
    tracker: Tracker | None = None,
    out: list[Any],
) -> Writing:
    """Create every array and stage every write, then start writing them out.
    Puts in `out` the future that finishes when the data is written (not yet
    durable): an interrupt after it started still leaves it there, so an abort
    waits for it before deleting anything. Returns what `follow` reports the
    progress of; the caller may work while the data is written.

    Process 0 creates the arrays' metadata; the other processes open the arrays
    once it has (a store cannot be written before its metadata exists).
    Packed leaves are copied into their packs here (see `_pack`).
    """
    data, created, own = tx.data, None, batch.own
    opens: list[Any] = []
    groups: list[Any] = []
    if group.primary:

        def create() -> None:
            # In a helper thread, which keeps every future it starts (see
            # `_interrupts.uninterrupted`): a creation landing after an abort would leave
            # a file the next save refuses to write beside.
            _durable.ensure_directory(data)
            for p in own:
                opens.append(_storage.create_array(data, p.record, synced=False))
            for pack, _ in batch.packs:
                opens.append(_storage.create_spec(_storage.pack_spec(data, pack), data, synced=False))
            groups.extend(_group_writes(data, batch.records()))

        try:
            _interrupts.uninterrupted(create)
        except BaseException:
            # What was started must finish before an abort deletes it.
            settle([*opens, *groups])
            raise
        # Every future, not just up to the first failure: an abort must find every file.
        try:
            created = wait_all([*opens, *groups], None)
        except BaseException:  # an interrupt: nothing may be left running
            settle([*opens, *groups])
            raise
    error = group.sync("created", created)
    if error is not None:
        raise error
    if not group.primary:
        opens = []
        try:
            for p in own:
                opens.append(_storage.open_array(data, p.record, synced=False))
        except BaseException:
            settle(opens)
            raise
    # On a local disk, the chunk files of most leaves and of the packs are written
    # by eqx_ckpt's own threads, each file's writeback started at once (`_local_write`).
    single = group.count == 1 and tx.layout == "directories"
    fast = {i for i, p in enumerate(own) if single and _local_write.eligible(data, p.record, p.pieces)}
    fast_packs = single and _local_read.supported(data)
    direct: Writing = []

    def start_direct() -> None:
        # In the helper thread too: every future started is kept in `out`.
        for i in sorted(fast):
            futures = _local_write.start_write(data, own[i].record, own[i].pieces[0][1])
            out.extend(futures)
            direct.append((1, own[i].record.nbytes, futures))
        for pack, members in batch.packs if fast_packs else []:
            views = [p.pieces[0][1] for p in members]
            futures = _local_write.start_pack(data, pack, [p.record for p in members], views)
            out.extend(futures)
            direct.append((len(members), sum(view.nbytes for view in views), futures))

    if fast or (fast_packs and batch.packs):
        _interrupts.uninterrupted(start_direct)
    # Staged in one transaction, every write only references its source until
    # the background commit. (The host data of a jax.Array never changes: a view
    # of it keeps its buffer alive through `delete()` and donation; the caller's
    # NumPy arrays were copied before an asynchronous save returned.)
    transaction, writes, counts = _storage.transaction(), [], []
    try:
        for n, (p, opened) in enumerate(zip(own, opens[: len(own)], strict=True)):
            if n in fast:
                continue
            store = opened.result().with_transaction(transaction)
            for i, (index, piece) in enumerate(p.pieces):
                target = store[index] if index else store
                writes.append(target.write(piece, can_reference_source_data_indefinitely=True))
                counts.append((int(i == len(p.pieces) - 1), piece.nbytes))
        for (pack, members), opened in zip(batch.packs if not fast_packs else [], opens[len(own) :]):
            views = [p.pieces[0][1] for p in members]
            contents = _pack.buffer(pack, [p.record for p in members], views)
            store = opened.result().with_transaction(transaction)
            writes.append(store.write(contents, can_reference_source_data_indefinitely=True))
            counts.append((len(members), sum(view.nbytes for view in views)))
        # Waited in order, so that progress is reported from this thread as writes complete.
        if tracker is not None:
            tracker.advance(leaves=sum(1 for p in own if not p.pieces))
        staged = None
        for write, (leaves, nbytes) in zip(writes, counts):
            staged = staged or attempt(write.result)
            if staged is None and tracker is not None:
                tracker.advance(leaves=leaves, nbytes=nbytes)
    except BaseException:
        transaction.abort()  # nothing staged was written out
        settle([*opens, *writes])
        raise
    if staged is not None:
        transaction.abort()  # nothing was written out
        raise staged
    _interrupts.uninterrupted(lambda: out.append(transaction.commit_async()))
    return direct


def follow(writing: Writing, tracker: Tracker) -> None:
    """Report the progress of `writing` as it finishes. A failed write is
    reported by the caller's wait for `start_writes`'s futures; here only progress."""
    for leaves, nbytes, futures in writing:
        if all(attempt(future.result) is None for future in futures):
            tracker.advance(leaves=leaves, nbytes=nbytes)


def private_copies(pending: list[Pending]) -> None:
    """Copy the host data of NumPy leaves, which the caller may change once an
    asynchronous save has returned (a jax.Array's host data never changes)."""
    mine = [p for p in pending if p.record.type == "numpy"]
    copies = iter(_memory.private_copies([piece for p in mine for _, piece in p.pieces]))
    for p in mine:
        p.pieces = [(index, next(copies)) for index, _ in p.pieces]


def _group_writes(data: Location, records: list[LeafRecord]) -> list[Any]:
    """Zarr v3 group metadata for every folder above a leaf (and for the data
    root: see `_layout.groups`), so zarr tools can walk the tree."""
    store = _storage.kvstore(data, synced=False)
    return [store.write(_format.metadata_key(g), _format.GROUP_JSON) for g in _layout.groups(records)]


def attempt(run: Callable[[], Any]) -> BaseException | None:
    """Run `run`; its error, or `None`. Interrupts (KeyboardInterrupt,
    SystemExit) are not errors of the save: they propagate as themselves."""
    try:
        run()
    except Exception as e:  # returned, and raised by the caller
        return e
    return None


def wait_all(futures: list[Any], error: BaseException | None) -> BaseException | None:
    """Wait for every future; the first error (or `error`, if given)."""
    for future in futures:
        error = error or attempt(future.result)
    return error


def _stored(future: Any) -> BaseException | None:
    """The exception a finished `concurrent.futures.Future` holds (TensorStore's
    futures never hold an interrupt)."""
    if isinstance(future, concurrent.futures.Future) and future.done() and not future.cancelled():
        return future.exception()
    return None


def settle(futures: list[Any]) -> None:
    """Wait until no write of `futures` is still running, so that deleting what
    they wrote cannot race them. Errors are ignored (the save has failed
    already); a further interrupt is raised once all have settled."""
    interrupt: BaseException | None = None
    for future in futures:
        while True:
            try:
                future.result()
                break
            except Exception:
                break
            except BaseException as e:  # raised below, once every write has stopped
                if _stored(future) is e:
                    break  # the write's own outcome (raised in a writer thread), not an interrupt of the wait
                interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
