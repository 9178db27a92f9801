"""What a save writes: each leaf's manifest record and host pieces, then the
arrays themselves, created and written concurrently through TensorStore."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _commit, _dtypes, _io, _keypath, _multihost, _sharding
from ._handle import LeafHandle
from ._manifest import LeafRecord
from ._progress import Tracker
from ._spec import Location, chunk_shape


@dataclasses.dataclass
class Pending:
    record: LeafRecord
    pieces: list[tuple[tuple[slice, ...], np.ndarray]]


def prepare(handle: LeafHandle, x: Any, cast: Callable[[str, np.dtype], Any] | None) -> Pending:
    """The manifest record and the host pieces of one leaf."""
    kind = _dtypes.leaf_type(x)
    if kind is None:
        raise handle.error(
            f"cannot save a leaf of type {type(x).__name__}.",
            "Only arrays and bool/int/float/complex scalars are stored; let the "
            "filter spec skip this leaf, and it keeps `like`'s value on load.",
        )
    impl = ""
    if kind == "prng_key":
        impl, dtype_name, shape = str(jax.random.key_impl(x)), str(x.dtype), tuple(x.shape)
        x = jax.random.key_data(x)
    elif kind in ("bool", "int", "float", "complex"):
        try:
            x = _dtypes.python_scalar_array(x)
        except OverflowError as e:
            raise handle.error(f"{e}.", "Store it as a float, or split it into smaller ints.") from None
    elif not isinstance(x, jax.Array):
        x = np.asarray(x)
    if kind != "prng_key":
        if not _dtypes.is_known_dtype(x.dtype.name):
            raise handle.error(f"cannot save an array of dtype {x.dtype}.", "Only numeric and bool arrays are stored.")
        dtype_name, shape = x.dtype.name, tuple(x.shape)
    block = _sharding.block_shape(x)
    pieces = _sharding.host_pieces(x) if _multihost.writes(x) else []
    logical = _cast_dtype(handle, x.dtype, cast) if kind in ("jax", "numpy") else np.dtype(x.dtype)
    if logical != x.dtype:
        pieces = [(index, piece.astype(logical)) for index, piece in pieces]
    stored, encoding = _dtypes.stored_dtype(logical)
    if kind == "prng_key":
        encoding = "key_data"
    pieces = [(index, _dtypes.encode(piece, encoding)) for index, piece in pieces]
    itemsize = _dtypes.dtype_from_name(stored).itemsize
    chunks = chunk_shape(tuple(x.shape), itemsize, block)
    record = LeafRecord(
        handle.path, _keypath.to_json(handle.keypath), kind, shape, dtype_name,
        tuple(x.shape), stored, encoding, tuple(chunks), impl,
    )  # fmt: skip
    return Pending(record, pieces)


def _cast_dtype(handle: LeafHandle, dtype: Any, cast: Callable[[str, np.dtype], Any] | None) -> np.dtype:
    """The dtype a leaf is stored in: `dtype`, or what `cast` maps it to."""
    target = cast(handle.path, np.dtype(dtype)) if cast is not None else None
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
    if cast is None or callable(cast):
        return cast
    table = {np.dtype(k): np.dtype(v) for k, v in dict(cast).items()}
    return lambda _, dtype: table.get(np.dtype(dtype))


def start_writes(
    tx: _commit.Transaction,
    pending: list[Pending],
    group: _multihost.Group,
    *,
    copy: bool = False,
    tracker: Tracker | None = None,
) -> list[Any]:
    """Create every array and stage every write; return once the caller may change
    its arrays (with `copy=True`, for a save that returns before it has written,
    NumPy arrays are copied). Returns the future that finishes when data is durable.

    Process 0 creates the arrays' metadata; the other processes open the arrays
    once it has (a store cannot be written before its metadata exists).
    """
    data, groups, created = tx.data, [], None
    if group.primary:
        _io.ensure_directory(data)
        opens = [_io.create_array(data, p.record, synced=False) for p in pending]
        groups = _group_writes(data, [p.record.path for p in pending])
        # Every future, not just up to the first failure: an abort must find every file.
        created = wait_all([*opens, *groups], None)
    error = group.sync("created", created)
    if error is not None:
        raise error
    if not group.primary:
        opens = [_io.open_array(data, p.record, synced=False) for p in pending]
    # Staged in one transaction, every write only references its source until
    # the background commit; staging returns at once.
    transaction, writes, counts = _io.transaction(), [], []
    for p, opened in zip(pending, opens, strict=True):
        store = opened.result().with_transaction(transaction)
        # The host data of a jax.Array never changes (a view of it keeps its buffer
        # alive through `delete()` and donation); a NumPy array's can, so a save
        # that returns before writing stages a copy.
        private = copy and p.record.type == "numpy"
        for i, (index, piece) in enumerate(p.pieces):
            source = np.array(piece, copy=True) if private else piece
            target = store[index] if index else store
            writes.append(target.write(source, can_reference_source_data_indefinitely=True))
            counts.append((int(i == len(p.pieces) - 1), piece.nbytes))
    # Waited in order, so that progress is reported from this thread as writes complete.
    if tracker is not None:
        tracker.advance(leaves=sum(1 for p in pending if not p.pieces))
    staged = None
    for write, (leaves, nbytes) in zip(writes, counts):
        staged = staged or attempt(write.result)
        if staged is None and tracker is not None:
            tracker.advance(leaves=leaves, nbytes=nbytes)
    if staged is not None:
        transaction.abort()  # nothing was written out
        raise staged
    return [transaction.commit_async()]


_GROUP = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _group_writes(data: Location, paths: list[str]) -> list[Any]:
    """Zarr v3 group metadata for every directory above a leaf, so zarr tools
    can walk the tree."""
    groups = {""} if paths and paths != [""] else set()
    for path in paths:
        parts = _keypath.split_dotted(path)
        groups.update(".".join(parts[:i]) for i in range(1, len(parts)))
    store = _io.kvstore(data, synced=False)
    return [store.write(_keypath.to_directory(g) + ("/" if g else "") + "zarr.json", _GROUP) for g in sorted(groups)]


def attempt(run: Callable[[], Any]) -> BaseException | None:
    try:
        run()
    except BaseException as e:  # returned, and raised by the caller
        return e
    return None


def wait_all(futures: list[Any], error: BaseException | None) -> BaseException | None:
    """Wait for every future; the first error (or `error`, if given)."""
    for future in futures:
        error = error or attempt(future.result)
    return error
