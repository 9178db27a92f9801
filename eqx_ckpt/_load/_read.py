"""Reading one stored leaf as the type, dtype and placement of `like`'s leaf,
and every chunk of many leaves with bounded memory, for `verify` and `diff`.

`verify` and `diff` read a leaf chunk by chunk, never whole, within the read
budget of every reader (`_window`) and at most `MAX_READS` chunks at once. A
hostile manifest may claim billions of chunks. So chunk indices are generated
lazily and a leaf stops at its first failure.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from .._base import _faults, _state
from .._base._errors import LeafError, stored_leaf_error
from .._base._location import Location
from .._base._progress import Tracker
from .._hosts import _sharding
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord, dtype_from_name
from .._store import _chunk_files, _memory, _storage_errors, _untrusted, _window

if TYPE_CHECKING:
    from .._store._storage import Array


class Check(Protocol):
    """A check of a leaf's stored bytes (`_verified.DigestCheck`): fed in order
    (`update`, then `done`), or called with the whole leaf."""

    def update(self, array: np.ndarray) -> None: ...

    def done(self) -> None: ...

    def __call__(self, array: np.ndarray) -> None: ...


def target_sharding(like: Any) -> Any:
    """Where a loaded leaf goes: `like`'s sharding, or `None` (the default device)."""
    if isinstance(like, jax.Array):
        return like.sharding
    if isinstance(like, jax.ShapeDtypeStruct):
        return concrete(getattr(like, "sharding", None))
    return None


def concrete(sharding: Any) -> Any:
    """A sharding over real devices: an `AbstractMesh` (as `eqx.filter_eval_shape`
    gives) laid out over this process's devices the way `jax.make_mesh` does."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    problem = _sharding.unplaceable(sharding)
    if problem is not None:
        raise ValueError(problem + ".")
    devices = jax.make_mesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types)
    return jax.sharding.NamedSharding(devices, sharding.spec, memory_kind=sharding.memory_kind)


def host_converter(record: LeafRecord, dtype: Any, loc: Location) -> Callable[[np.ndarray], np.ndarray]:
    """Stored bytes -> the logical dtype -> `dtype`, when given and different.
    A conversion that would change values beyond rounding is an error."""
    return functools.partial(converted, record=record, dtype=dtype, loc=loc)


def converted(array: np.ndarray, record: LeafRecord, dtype: Any, loc: Location) -> np.ndarray:
    """`host_converter(record, dtype, loc)(array)`, called at once (no function made a leaf)."""
    array = _dtypes.decode(array, record)
    if dtype is None or array.dtype == dtype:
        return array
    try:
        return _dtypes.checked_cast(array, dtype)
    except ValueError as e:
        # `array.dtype` differs from the leaf's for a leaf cast on save.
        source = array.dtype.name
        stored = f"{source} (how this {record.dtype} leaf is stored)" if source != record.dtype else record.dtype
        raise stored_leaf_error(
            LeafError,
            f"cannot convert it from {stored} to {np.dtype(dtype)}: {e}.",
            dotted=record.path,
            path=loc.display,
            fix="Nothing was loaded. Load it into a `like` of a dtype that holds its values (or leave `cast` off).",
        ) from None


def refuse_narrowing(loc: Location, record: LeafRecord, dtype: Any) -> None:
    """Refuse a 64-bit leaf as a JAX array while JAX's 64-bit mode is off, which
    `jax.device_put` would silently wrap or round. `dtype`: as read (`None`: as saved)."""
    dtype = dtype_from_name(record.dtype) if dtype is None else dtype
    if not _dtypes.x64_missing(dtype):
        return
    raise stored_leaf_error(
        LeafError,
        f"{_dtypes.x64_message(dtype)}.",
        dotted=record.path,
        path=loc.display,
        fix="Enable it (`jax.config.update('jax_enable_x64', True)`), read the leaf as NumPy "
        "(a NumPy `like` leaf, or `np.asarray` of a lazy leaf), or load into a 32-bit `like` "
        "with `cast=True` (an error if a value does not fit).",
    )


def start_region(
    store: Array, loc: Location, record: LeafRecord, index: tuple[Any, ...] = (), *, raw: bool = False
) -> Callable[[], np.ndarray]:
    """Start reading the region `index` (as `Array[index]` takes; `()`: all) of
    the stored leaf `record`, opened as `store` in the data root `loc`; the
    returned function waits and gives it as stored. Every read of a leaf's
    stored elements through TensorStore goes through here.

    A failure is the leaf's (`read_failed`); with `raw`, as storage raised it,
    for a caller that words it itself (a pack's run, `verify`)."""
    if loc.part:  # (a process's part of a local tier's step holds its own regions only)
        rows = _part_rows(loc, record, index)
        if rows is not None:
            return rows
        _untrusted.check_region_files(loc, record, index)
    try:
        future = (store[index] if index else store).read()
    except Exception as e:
        if raw:
            raise
        raise read_failed(e, loc, record) from e

    def finish() -> np.ndarray:
        try:
            return future.result()
        except Exception as e:
            if raw:
                raise
            raise read_failed(e, loc, record) from e

    return finish


def _part_rows(loc: Location, record: LeafRecord, index: tuple[Any, ...]) -> Callable[[], np.ndarray] | None:
    """The region `index` of a part's leaf read by eqx_ckpt itself (each chunk
    file checked, as a whole leaf's are), where it is whole chunks of rows of
    a leaf it reads so; else `None`, for TensorStore."""
    files, shape = _chunk_files.chunk_files(loc), tuple(record.stored_shape)
    if not index or not files.reads(record) or any(s != slice(None) for s in index[1:]):
        return None
    start, stop, step = index[0].indices(shape[0])
    per_chunk = record.chunks[0]
    if step != 1 or start % per_chunk or (stop % per_chunk and stop != shape[0]) or stop <= start:
        return None
    out = _aligned_empty((stop - start, *shape[1:]), dtype_from_name(record.stored_dtype))  # (adopted, not copied)
    count = -(-(stop - start) // per_chunk)
    wait = files.start_chunks(record, start // per_chunk, count, out.reshape(-1).view(np.uint8).data)

    def finish() -> np.ndarray:
        wait()
        return out

    return finish


def read_failed(error: BaseException, loc: Location, record: LeafRecord) -> Exception:
    """A failure to read `record` as the leaf's error. A damaged leaf's files are
    forgotten, so that the next save reads them again before it shares any."""
    failed = _storage_errors.leaf_io_error(error, record, loc, "read")
    _chunk_files.chunk_files(loc).forget_damaged(failed, record)
    return failed


# A large leaf is read in slabs of whole chunks into one 64-byte-aligned buffer,
# which `jax.device_put` adopts without a copy. The leaf is held once, plus two
# slabs in flight, instead of TensorStore's buffer and a copy of it.
SLAB_BYTES = 64 * 2**20


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= _memory.FRESH_MIN_BYTES:
        return _memory.fresh_empty(shape, dtype)  # page-aligned
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def _start_in_slabs(
    store: Array,
    loc: Location,
    record: LeafRecord,
    like: Any,
    sharding: Any,
    on_bytes: Callable[[int], None] | None,
    check: Check | None,
) -> Callable[[], Any]:
    dtype = dtype_from_name(record.stored_dtype)
    rows, row_bytes = record.shape[0], record.nbytes // max(record.shape[0], 1)
    step = max(record.chunks[0], SLAB_BYTES // max(row_bytes, 1) // record.chunks[0] * record.chunks[0])
    slabs = iter([(lo, min(lo + step, rows)) for lo in range(0, rows, step)])
    pending: collections.deque[tuple[int, int, Any]] = collections.deque()

    def launch() -> None:
        slab = next(slabs, None)
        if slab is not None:
            pending.append((*slab, start_region(store, loc, record, (slice(*slab),), raw=True)))

    launch()
    launch()

    def finish() -> Any:
        out = _aligned_empty(tuple(record.shape), dtype)
        try:
            while pending:
                lo, hi, finish_read = pending.popleft()
                launch()
                out[lo:hi] = finish_read()
                if check is not None:  # (while the next slab is read)
                    check.update(out[lo:hi])
                if on_bytes is not None:
                    on_bytes((hi - lo) * row_bytes)
        except Exception as e:
            raise read_failed(e, loc, record) from e
        if check is not None:
            check.done()
        return _dtypes.to_result(out, like, sharding=sharding)

    return finish


def place(loc: Location, hosts: list[np.ndarray], records: list[LeafRecord], likes: list[Any]) -> list[Any]:
    """Host arrays read for `records` as the types, dtypes and placements of
    `likes`, put on devices in one call per placement: one `jax.device_put` of
    many arrays costs far less than many."""
    out: list[Any] = [None] * len(hosts)
    batch: dict[Any, list[int]] = collections.defaultdict(list)
    narrowed: dict[Any, bool] = {}  # `x64_missing` of each dtype, asked once
    for i, (host, record, like) in enumerate(zip(hosts, records, likes, strict=True)):
        kind = _dtypes.like_type(like)
        dtype = like.dtype if kind in ("jax", "numpy", "numpy_scalar") else None
        if kind == "jax":
            if dtype not in narrowed:
                narrowed[dtype] = _dtypes.x64_missing(dtype)
            if narrowed[dtype]:
                refuse_narrowing(loc, record, dtype)
        array = converted(host, record, dtype, loc)
        sharding = target_sharding(like)
        if kind == "jax" and (sharding is None or len(sharding.device_set) == 1):
            out[i] = array
            batch[sharding].append(i)
        elif kind == "jax":
            out[i] = jax.make_array_from_callback(array.shape, sharding, functools.partial(_region, array))
        else:
            out[i] = _value(loc, array, record, like, sharding)
    for sharding, indices in batch.items():
        for i, value in zip(indices, put([out[i] for i in indices], sharding)):
            out[i] = value
    return out


def put(hosts: list[np.ndarray], sharding: Any) -> list[jax.Array]:
    """`jax.device_put(hosts, sharding)` (not `jnp.array`, which compiles a copy
    for every new shape and dtype).

    For one device, it calls what `device_put` ends in, `batched_device_put`
    of JAX's C++ extension, with what `device_put` would pass: a third of the
    cost a small leaf (docs/benchmarks.md). Anything unusual, or a JAX where
    that call fails, goes through `device_put`."""
    global FAST_PUT
    target = _one_device(sharding)
    if target is not None and FAST_PUT is not None:
        device, committed = target
        placed = sharding if sharding is not None else _default_sharding(device)
        x64 = bool(jax.config.read("jax_enable_x64"))
        if all(type(x) is np.ndarray and x.flags.c_contiguous and _canonical(x.dtype, x64) for x in hosts):
            shaped, batched = FAST_PUT
            # One aval (immutable) per shape and dtype: a model's leaves have few.
            avals: dict[tuple[Any, ...], Any] = {}

            def aval(x: np.ndarray) -> Any:
                found = avals.get((x.shape, x.dtype))
                if found is None:
                    _faults.fire("read.aval", x.shape, x.dtype)
                    found = avals[(x.shape, x.dtype)] = shaped(x.shape, x.dtype)
                return found

            try:
                _faults.fire("read.batched_put", hosts)
                return [batched(aval(x), placed, [x], [device], committed) for x in hosts]
            except Exception:  # a JAX whose internals differ: the public call from now on
                FAST_PUT = None
    return jax.device_put(hosts, sharding)


def _fast_put_function() -> tuple[Any, Any] | None:
    try:
        from jax._src import core
        from jax._src.lib import xla_client

        return core.ShapedArray, xla_client.batched_device_put
    except (ImportError, AttributeError):
        return None


# The JAX internals `put` calls (making an aval, and `batched_device_put`), or
# `None`: the public `jax.device_put` for every placement. It is set to `None`
# by the first failure of the internal call, for good; a test may set it too.
FAST_PUT = _fast_put_function()


@_state.memo(64)
def _default_sharding(device: Any) -> Any:
    return jax.sharding.SingleDeviceSharding(device)


@_state.memo(128)
def _canonical(dtype: np.dtype, x64: bool) -> bool:
    """Whether JAX keeps this dtype as it is (not float64 without x64, say)."""
    return dtype != jax.dtypes.float0 and np.dtype(jax.dtypes.canonicalize_dtype(dtype)) == dtype


def _one_device(sharding: Any) -> tuple[Any, bool] | None:
    """(device, committed) of a plain placement on one device, as `device_put`
    makes it; `None` for anything else."""
    if sharding is None:
        if getattr(jax.config, "jax_default_device", None) is not None:
            return None
        return jax.local_devices()[0], False
    if type(sharding) is jax.sharding.SingleDeviceSharding:
        (device,) = sharding.device_set
        return device, True
    return None


def _region(array: np.ndarray, index: Any) -> np.ndarray:
    return array[index]


def start(
    store: Array,
    loc: Location,
    record: LeafRecord,
    like: Any,
    *,
    dtype: Any = None,
    on_bytes: Callable[[int], None] | None = None,
    check: Check | None = None,
) -> Callable[[], Any]:
    """Start reading a leaf; the returned function waits and builds the value.

    `dtype`: the dtype the value must have (`like`'s). `on_bytes`: called with
    the bytes of each slab or device's region as it lands. `check`: fed the
    leaf as stored, before it is converted; such a leaf is read whole, even
    where it is placed across devices."""
    convert = host_converter(record, dtype, loc)
    sharding = target_sharding(like)
    kind = _dtypes.like_type(like)
    if kind == "jax":
        refuse_narrowing(loc, record, dtype)
    spread = kind == "jax" and sharding is not None and len(sharding.device_set) > 1

    # Each read's failure is worded once, with what the finish does after it.
    if spread and check is None:
        read = functools.partial(start_region, store, loc, record, raw=True)
        finish_placed = _sharding.read_placed(read, record.shape, sharding, convert, on_bytes)

        def finish_sharded() -> Any:
            try:
                return finish_placed()
            except Exception as e:
                raise read_failed(e, loc, record) from e

        return finish_sharded

    _memory.refuse_beyond_memory(loc, record, record.nbytes, "it")
    plain = record.nbytes > SLAB_BYTES and record.shape and record.encoding == "plain"
    if kind in ("jax", "numpy") and plain and not spread:
        if dtype is None or np.dtype(dtype) == dtype_from_name(record.stored_dtype):
            return _start_in_slabs(store, loc, record, like, sharding, on_bytes, check)

    read_all = start_region(store, loc, record, raw=True)

    def finish() -> Any:
        try:
            stored = read_all()
            if check is not None:
                check(stored)
            array = convert(stored)
        except Exception as e:
            raise read_failed(e, loc, record) from e
        if spread:
            return jax.make_array_from_callback(array.shape, sharding, functools.partial(_region, array))
        return _value(loc, array, record, like, sharding)

    return finish


def _value(loc: Location, array: np.ndarray, record: LeafRecord, like: Any, sharding: Any) -> Any:
    if _dtypes.like_type(like) == "prng_key":
        keys = jax.random.wrap_key_data(jax.numpy.asarray(array), impl=record.impl)
        return jax.device_put(keys, sharding) if sharding is not None else keys
    try:
        return _dtypes.to_result(array, like, sharding=sharding)
    except ValueError as e:  # a value a Python scalar `like` cannot hold exactly (an int beyond 2**53 as a float)
        raise stored_leaf_error(
            LeafError,
            f"`like` holds a Python {type(like).__name__}, which cannot hold it exactly: {e}.",
            dotted=record.path,
            path=loc.display,
            fix="Nothing was loaded. Load it into a `like` that holds its values (a Python int, or a "
            "NumPy or JAX leaf of its dtype; `cast=True` rounds into a narrower one).",
        ) from None


def direct(files: _chunk_files.ChunkFiles, record: LeafRecord, like: Any) -> bool:
    """Whether `start_direct` reads this leaf from `files`: a leaf they read
    themselves (a large local one), going to one device or to NumPy."""
    sharding = target_sharding(like)
    placed = _dtypes.like_type(like) == "jax" and sharding is not None and len(sharding.device_set) > 1
    return not placed and files.reads(record)


def start_direct(
    reading: Callable[[], Callable[[], np.ndarray] | None],
    loc: Location,
    record: LeafRecord,
    like: Any,
    *,
    dtype: Any = None,
    check: Check | None = None,
) -> Callable[[], Any]:
    """`start`, for a leaf `direct` accepts: `reading` starts the read of its
    chunk files straight into one aligned buffer, which becomes the value
    without another copy."""
    convert = host_converter(record, dtype, loc)
    if _dtypes.like_type(like) == "jax":
        refuse_narrowing(loc, record, dtype)
    read = reading()
    assert read is not None

    def finish() -> Any:
        array = read()
        if check is not None:
            check(array)
        return _value(loc, convert(array), record, like, target_sharding(like))

    return finish


# How many chunk reads may be in flight at once (chunks of a few bytes would
# otherwise start thousands of reads within the budget).
MAX_READS = 64


def chunk_indices(record: LeafRecord, *, stop: Callable[[], bool]) -> Iterator[tuple[slice, ...]]:
    """The index of every chunk of a leaf, lazily and until `stop()`: a hostile
    shape may claim billions of chunks, and the first missing one ends the leaf."""
    counts = [-(-n // c) for n, c in zip(record.stored_shape, record.chunks)]
    for position in _positions(counts):
        if stop():
            return
        yield tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(position, record.chunks, record.stored_shape))


def _positions(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Every position in a grid, lazily (`itertools.product` would first build
    each axis's full range)."""
    if not counts:
        yield ()
        return
    for i in range(counts[0]):
        for rest in _positions(counts[1:]):
            yield (i, *rest)


def _chunk_bytes(record: LeafRecord, index: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in index) * dtype_from_name(record.stored_dtype).itemsize


def scan_chunks(
    jobs: Iterator[tuple[LeafRecord, Any, tuple[slice, ...]]],
    *,
    skip: Callable[[LeafRecord], bool],
    failed: Callable[[LeafRecord, BaseException], None],
    read: Callable[[LeafRecord, Any, tuple[slice, ...]], Callable[[], Any]],
) -> Iterator[tuple[LeafRecord, Any, int]]:
    """Run chunk reads with a bounded number of bytes in flight; yield each
    `(record, value, bytes)` that read cleanly, and report the others.
    `read(record, store, index)` starts reading one chunk. `skip` is asked as
    each chunk is about to start, so a leaf stops at its first failure."""
    starts = (
        (record, _chunk_bytes(record, index), functools.partial(read, record, store, index))
        for record, store, index in jobs
        if not skip(record)
    )
    for record, size, finish in _window.windowed(starts, max_reads=MAX_READS):
        try:
            value = finish()
        except Exception as e:
            failed(record, e)
            continue
        yield record, value, size


class LeafCounter:
    """Turns the chunks `windowed` yields into progress: bytes at every chunk, a
    leaf once its last chunk is done (a leaf with no bytes is done at once)."""

    def __init__(self, records: list[LeafRecord], tracker: Tracker):
        self._left = {r.path: r.nbytes for r in records}
        self._tracker = tracker
        tracker.advance(leaves=sum(1 for r in records if r.nbytes == 0))

    def __call__(self, record: LeafRecord, size: int) -> None:
        self._left[record.path] -= size
        self._tracker.advance(leaves=int(self._left[record.path] == 0), nbytes=size)
