"""The reader of whole stored leaves: every whole leaf read from a checkpoint
(a load, `materialise`, a lazy leaf, a partial save, an export) is read here,
within one host-memory budget and one pool of reading threads (`_window`).
Each leaf goes to the first reader that takes it:

- What several processes need is read once and shared (`_read_once`).
- Packed leaves are read in runs of their packs (`_pack`).
- Small leaves of another format are read in runs of its file (`Source.runs`).
- A large local leaf is read straight into one aligned buffer
  (`_read.start_direct`), or through the pool of host buffers (`_start_pooled`).
- Anything else is read through TensorStore (`_read.start`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base import _faults, _gc
from .._base._errors import CheckpointValueError
from .._base._location import Location
from .._base._progress import Progress, Tracker
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord, dtype_from_name
from .._sources import _family, _verified
from .._sources._source import Source
from .._store import _chunk_files, _memory, _storage_errors, _window
from . import _pack, _read, _read_once
from ._load_plan import LeafPlan


def read_leaves(
    source: Source,
    plans: list[LeafPlan],
    *,
    progress: Progress = False,
    read_once: bool | None = False,
    checked: bool = True,
    cached: bool = False,
    tracker: Tracker | None = None,
) -> list[Any]:
    """The values of `plans`' stored leaves, read now. Unless `checked=False`,
    `source` is checked after the reads (and always when one fails) not to
    have been replaced. `tracker`: progress already shown (`materialise`'s),
    advanced instead of one of its own for `progress`."""
    try:
        _faults.fire("load.read_stored", source.loc)
        if tracker is None:
            values = read(source, plans, progress=progress, read_once=read_once, cached=cached)
        else:
            values = read_now(source, plans, tracker, read_once, cached=cached)
    except Exception:
        source.check()  # a read that failed because the checkpoint was replaced says so
        raise
    if checked:
        source.check()
    return values


def read(
    source: Source,
    plans: list[LeafPlan],
    *,
    progress: Progress = False,
    read_once: bool | None = False,
    cached: bool = False,
) -> list[Any]:
    """`read_now` with the progress `progress` reports, the checkpoint not checked after."""
    records = [record_of(plan) for plan in plans]
    total = sum(r.nbytes for r in records)
    with _gc.gc_paused(), Tracker(progress, leaves=len(records), nbytes=total, what="load") as tracker:
        return read_now(source, plans, tracker, read_once, cached=cached)


def read_now(
    source: Source, plans: list[LeafPlan], tracker: Tracker, read_once: bool | None = False, *, cached: bool = False
) -> list[Any]:
    """The values of `plans`, each read by the first of the module docstring's
    readers that takes it, all concurrently within the read budget.
    `cached`, for a leaf read alone: see `_pack.read_leaves`."""
    reads = _Reads(source, plans, tracker)
    records = reads.records
    # A leaf with a recorded digest is read whole by each process, to be checked.
    shared = [] if source.manifest.digests else _read_once.chosen(plans, records, read_once)
    if shared:
        opened = [plans[i] for i in shared], [records[i] for i in shared]
        reads.place(shared, _read_once.read(lambda r: source.open(r).result(), source.data, *opened, tracker))
    packed = [i for i, record in enumerate(records) if record.pack is not None]
    if packed:
        reads.packed(packed, cached=cached)
    taken = frozenset(shared)
    own = [i for i, record in enumerate(records) if record.pack is None and i not in taken]
    if source.runs is not None and own:
        own = reads.runs(own)
    reads.each(own)
    if reads.checks is not None:
        reads.checks.wait()
    return [_dtypes.keep_weak_type(value, plan.like) for value, plan in zip(reads.out, plans)]


class _Reads:
    """One `read_now`: its leaves, the values read (`out`, by the same index),
    and the digest checks where the source records digests (a published folder)."""

    def __init__(self, source: Source, plans: list[LeafPlan], tracker: Tracker):
        self.source, self.data, self.plans, self.tracker = source, source.data, plans, tracker
        self.records = [record_of(plan) for plan in plans]
        self.out: list[Any] = [None] * len(plans)
        self.checks = _verified.Checks(source) if source.manifest.digests else None

    def place(self, indices: list[int], values: Iterable[Any]) -> None:
        for i, value in zip(indices, values):
            self.out[i] = value

    def each(self, indices: list[int]) -> None:
        """Leaves read one array each: large local ones (a fine-tune's taken
        from an eqx_ckpt base, from the base's files) straight into their
        buffers, the others through TensorStore, opened ahead of the reads."""
        source, data, files = self.source, self.data, _chunk_files.chunk_files(self.data)
        plans, records, checks = self.plans, self.records, self.checks
        # Bytes within each leaf, reported as its chunks or slabs land.
        parts = {i: self.tracker.within(records[i].nbytes) for i in indices}
        # Through the pool of host buffers (on GPUs, `_memory.PINNED_PLATFORMS`), else the usual way.
        pooled: dict[int, Callable[[], Any]] = {}
        for i in indices:
            if source.opener is None and checks is None and _poolable(files, records[i], plans[i].like):
                finish = _start_pooled(files, data, records[i], plans[i].like, parts[i])
                if finish is not None:
                    pooled[i] = finish
        found = {i: _direct(source, records[i], plans[i].like, files) for i in indices if i not in pooled}
        direct = {i: at for i, at in found.items() if at is not None}
        opens = {i: source.open(records[i]) for i in indices if i not in direct and i not in pooled}

        def start(i: int) -> Callable[[], Any]:
            plan, record = plans[i], records[i]
            dtype = target_dtype(plan.like)
            if i in pooled:
                return pooled[i]
            check = None if checks is None else checks.for_record(record)
            if i in direct:
                holder, stored, holder_files = direct[i]
                reading = functools.partial(holder_files.start_read, stored, on_bytes=parts[i])
                if holder is not source:  # taken from the base: its failures name the fine-tune's leaf
                    reading = functools.partial(_family.reading_taken, source, holder, record, stored, reading)
                return _read.start_direct(reading, data, record, plan.like, dtype=dtype, check=check)
            try:
                store = opens.pop(i).result()
            except Exception as e:
                raise _storage_errors.leaf_io_error(e, record, data, "open") from e
            return _read.start(store, data, record, plan.like, dtype=dtype, on_bytes=parts[i], check=check)

        for i, _, finish in _window.windowed((i, records[i].nbytes, functools.partial(start, i)) for i in indices):
            self.out[i] = finish()
            self.tracker.advance(leaves=1, nbytes=parts[i].rest())
        # What came through the pool is on its devices before the caller holds it,
        # who may delete or donate it: the pool's next use cannot wait on it then.
        jax.block_until_ready([self.out[i] for i in pooled])

    def packed(self, indices: list[int], *, cached: bool) -> None:
        """Packed leaves, read in a few runs of their packs and placed together."""
        records = [self.records[i] for i in indices]
        runs = (
            ([indices[m] for m in members], functools.partial(_unpacked, self.data, records, members, start, finish))
            for members, start, finish in _pack.read_leaves(self.data, records, cached=cached)
        )
        self._place_runs(runs, None)

    def runs(self, indices: list[int]) -> list[int]:
        """Read and place the small leaves of another format in runs
        (`Source.runs`); return the others, left to be read one by one."""
        assert self.source.runs is not None
        feeding = None if self.checks is None else self.checks.feeding
        taken, runs = self.source.runs([self.records[i] for i in indices], feeding)
        self._place_runs((([indices[m] for m in members], finish) for members, finish in runs), self.checks)
        done = {indices[m] for m in taken}
        return [i for i in indices if i not in done]

    def _place_runs(
        self,
        runs: Iterable[tuple[list[int], Callable[[], list[np.ndarray]]]],
        check: Callable[[LeafRecord, np.ndarray], None] | None,
    ) -> None:
        """Place each run `(members, finish)` of adjacent leaves together (one
        `device_put` for many); `check` starts each one's digest check first."""
        for members, finish in runs:
            hosts = finish()
            records = [self.records[m] for m in members]
            if check is not None:
                for record, host in zip(records, hosts):
                    check(record, host)
            self.place(members, _read.place(self.data, hosts, records, [self.plans[m].like for m in members]))
            self.tracker.count_leaves([record.nbytes for record in records])


def _direct(
    source: Source, record: LeafRecord, like: Any, files: _chunk_files.ChunkFiles
) -> tuple[Source, LeafRecord, _chunk_files.ChunkFiles] | None:
    """The source, record and chunk files of a leaf read straight from its
    chunk files (`_read.direct`): its own, or its base's for a leaf a
    fine-tune takes from one; `None` for any other leaf."""
    holder, stored = source.stored_in(record)
    if holder.opener is not None:
        return None
    holder_files = files if holder is source else _chunk_files.chunk_files(holder.data)
    return (holder, stored, holder_files) if _read.direct(holder_files, stored, like) else None


def target_dtype(like: Any) -> np.dtype | None:
    """`like`'s dtype, for an array or a NumPy scalar; `None` (the stored one) else."""
    if _dtypes.like_type(like) in ("jax", "numpy", "numpy_scalar"):
        return np.dtype(like.dtype)
    return None


def _unpacked(
    data: Location, records: list[LeafRecord], members: list[int], start: int, finish: Callable[[], np.ndarray]
) -> list[np.ndarray]:
    """The host arrays of the packed leaves `members` of a run read from offset `start`."""
    try:
        run = finish()
    except Exception as e:
        # Which leaf of the run is damaged: read them one by one.
        for m in members:
            try:
                _chunk_files.read_alone(data, records[m])
            except Exception as each:
                raise _storage_errors.leaf_io_error(each, records[m], data, "read") from e
        raise _storage_errors.leaf_io_error(e, records[members[0]], data, "read") from e
    return [run[records[m].offset - start :][: records[m].size].reshape(records[m].stored_shape) for m in members]


def record_of(plan: LeafPlan) -> LeafRecord:
    """The stored record a plan reads (every plan handed here has one)."""
    if plan.record is None:
        raise CheckpointValueError(f"Internal error: leaf `{plan.stored}` has no record to read.")
    return plan.record


# -- A large leaf through the pool of host buffers ------------------------------------------------
#
# On for GPUs (`_memory.PINNED_LOAD_POOL`; docs/benchmarks.md, "GPU"). A large
# local leaf bound for `jax.Array`s there loads as a pipeline as deep as the
# pool: whole chunks are read into a buffer of the pool, all but one buffer
# ahead, while each device's region of the rows before is copied to it. Host
# memory stays bounded by the pool; a device joins its slabs, so holds its
# region twice for a moment. JAX 0.10 gives no writable view of `pinned_host`
# memory, so the buffers are page-aligned host memory and the copy goes
# through the runtime's own staging; with `_memory.PINNED_LOAD_BUFFERS` they
# are `pinned_host` arrays written through their address instead (`_from_pinned`).


def _poolable(files: _chunk_files.ChunkFiles, record: LeafRecord, like: Any) -> bool:
    """Whether this leaf loads through the pool: a `jax.Array` leaf `files` read
    themselves, stored as loaded, whose chunks fit a buffer, bound for the
    memory of devices with pinned memory."""
    pool = _memory.PINNED_LOAD_POOL
    if pool is None or _dtypes.like_type(like) != "jax" or not files.reads(record) or not record.shape:
        return False
    stored = dtype_from_name(record.stored_dtype)
    if record.encoding != "plain" or np.dtype(like.dtype) != stored or _dtypes.x64_missing(stored):
        return False
    if record.chunk_nbytes > pool[1]:
        return False
    sharding = _read.target_sharding(like)
    if sharding is not None and sharding.memory_kind not in (None, "device"):
        return False  # (bound for host memory: nothing to stage)
    devices = sharding.device_set if sharding is not None else {jax.local_devices()[0]}
    return all(_memory.pinned_platform(device) and _memory.has_pinned(device) for device in devices)


def _start_pooled(
    files: _chunk_files.ChunkFiles, loc: Location, record: LeafRecord, like: Any, on_bytes: Callable[[int], None] | None
) -> Callable[[], Any] | None:
    """`_read.start_direct` through the pool; the read runs in the returned
    function (the pool bounds it, not the read window). `None` where the pool
    cannot be allocated: read it the usual way."""
    pool = _memory.load_pool()
    if pool is None:
        return None
    try:
        with pool.lock:  # every buffer allocated now (once per process): a failure falls back before any read
            pool.fill()
    except Exception:  # (no memory for it, or a refusal: the usual way)
        return None
    return lambda: _load_pooled(pool, files, loc, record, like, on_bytes)


def _load_pooled(
    pool: _memory.BufferPool,
    files: _chunk_files.ChunkFiles,
    loc: Location,
    record: LeafRecord,
    like: Any,
    on_bytes: Callable[[int], None] | None,
) -> Any:
    shape, dtype = tuple(record.stored_shape), dtype_from_name(record.stored_dtype)
    sharding = _read.target_sharding(like)
    regions = sharding.addressable_devices_indices_map(shape) if sharding is not None else {None: ()}
    row_bytes = record.nbytes // shape[0]
    per_chunk = record.chunks[0]
    step = pool.size // record.chunk_nbytes * per_chunk  # rows of whole chunks a buffer holds
    slabs: dict[Any, list[jax.Array]] = {device: [] for device in regions}
    bounds = [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]
    reading: collections.deque[tuple[int, int, np.ndarray, Callable[[], None]]] = collections.deque()

    def read(lo: int, hi: int) -> None:  # into the next buffer, once its last copies are done
        buffer = pool.take()
        rows = buffer[: (hi - lo) * row_bytes].data
        reading.append((lo, hi, buffer, files.start_chunks(record, lo // per_chunk, -(-(hi - lo) // per_chunk), rows)))

    with pool.lock:
        try:
            # Reads run `pool.count - 1` buffers ahead of the copies to the devices.
            for lo, hi in bounds[: pool.count - 1]:
                read(lo, hi)
            for i in range(len(bounds)):
                lo, hi, buffer, wait = reading.popleft()
                if i + pool.count - 1 < len(bounds):
                    read(*bounds[i + pool.count - 1])
                try:
                    wait()
                except Exception as e:
                    raise _read.read_failed(e, loc, record) from e
                pinned = pool.pinned_array(buffer)
                if pinned is not None and _whole_on(pool.device, regions, dtype):
                    copies = {pool.device: _from_pinned(pinned, (hi - lo) * row_bytes, dtype, (hi - lo, *shape[1:]))}
                else:
                    host = buffer[: (hi - lo) * row_bytes].view(dtype).reshape((hi - lo, *shape[1:]))
                    copies = _copies(host, lo, hi, shape[0], regions)
                for device, copy in copies.items():
                    slabs[device].append(copy)
                pool.sent(buffer, list(copies.values()))
                if on_bytes is not None:
                    on_bytes((hi - lo) * row_bytes)
        finally:
            for _, _, _, wait in reading:  # (a failure: the reads still under way end before the buffers are reused)
                with contextlib.suppress(Exception):
                    wait()
        parts = {device: arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays) for device, arrays in slabs.items()}
    if sharding is None:
        return parts[None]
    return jax.make_array_from_single_device_arrays(shape, sharding, [parts[d] for d in regions])


def _whole_on(device: Any, regions: dict[Any, Any], dtype: np.dtype) -> bool:
    """Whether the leaf goes whole, committed, to `device` alone (the pool's
    pinned buffers' device), in a dtype its bytes can be viewed as there."""
    if len(regions) != 1 or device is None or np.dtype(dtype).kind not in "iufV":
        return False
    target, index = next(iter(regions.items()))
    return target == device and all(part == slice(None) for part in index)


def _from_pinned(pinned: jax.Array, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
    """The first `nbytes` of a pool buffer in pinned memory (`pinned`), on its
    device as an array of `dtype` and `shape`: the whole buffer copied there
    by one DMA, cut and viewed there."""
    _faults.fire("load.pinned_view", shape)
    whole = jax.device_put(pinned, pinned.sharding.with_memory_kind("device"), may_alias=False)
    return _view_as(whole, nbytes, np.dtype(dtype), shape)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _view_as(whole: jax.Array, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
    data = whole[:nbytes]
    if dtype.itemsize > 1:
        data = jax.lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype)
    elif dtype != np.uint8:
        data = jax.lax.bitcast_convert_type(data, dtype)
    return data.reshape(shape)


def _copies(host: np.ndarray, lo: int, hi: int, total: int, regions: dict[Any, Any]) -> dict[Any, jax.Array]:
    """The region of rows `[lo, hi)` (`host`) of each device whose region
    holds some of them, copied to it."""
    out: dict[Any, jax.Array] = {}
    for device, index in regions.items():
        first, last, _ = (index[0] if index else slice(None)).indices(total)
        a, b = max(first, lo), min(last, hi)
        if a >= b:
            continue
        piece = host[(slice(a - lo, b - lo), *index[1:])]
        if (device.platform if device is not None else jax.default_backend()) == "cpu":
            # A CPU device adopts host memory without a copy (`may_alias=False`
            # notwithstanding, in JAX 0.10): the buffer is reused, so copy it.
            piece = np.array(piece, copy=True)
        if device is None:  # the default device, uncommitted, as `jax.device_put` places it
            out[device] = jax.device_put(piece, may_alias=False)
        else:
            out[device] = jax.device_put(piece, device, may_alias=False)
    return out
