"""A large leaf loaded through the process's pool of reused host buffers.

On for GPUs (`_memory.PINNED_LOAD_POOL`, `PINNED_PLATFORMS`; measured in
docs/benchmarks.md, "GPU"). A large leaf on a local disk bound for
`jax.Array`s there loads as a pipeline as deep as the pool:

- A few whole chunks at a time are read into a buffer of the pool
  (`_memory.BufferPool`), the reads running all but one buffer ahead.
- Each device's region of those rows is copied to it (`jax.device_put`),
  while the next chunks are read into the next buffers.
- Host memory stays bounded by the pool: no host copy of the whole leaf, no
  fresh pages per load.
- Each device gets only its region, as slabs that it joins
  (`jnp.concatenate`). So a device holds its region twice for a moment.

JAX 0.10 gives no writable view of `pinned_host` memory (`np.asarray` of such
an array is read-only). So the buffers are page-aligned host memory, and the
copy from them goes through the runtime's own staging. The pool is used only
where every target device has `pinned_host` memory. A device without it loads
the leaf the usual way, and so does a pool that cannot be allocated (fault
point `load.pinned_pool`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base._location import Location
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord, dtype_from_name
from .._store import _chunk_files, _memory
from . import _read


def usable(files: _chunk_files.ChunkFiles, record: LeafRecord, like: Any) -> bool:
    """Whether this leaf loads through the pool. It does when all of these hold:

    - the pool is on;
    - it is a `jax.Array` leaf that `files` read themselves;
    - it is stored as it is loaded (no decoding, no cast);
    - its chunks fit a buffer;
    - it is bound for the device memory of devices with pinned memory, of
      `_memory.PINNED_PLATFORMS` (GPUs)."""
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


def start(
    files: _chunk_files.ChunkFiles, loc: Location, record: LeafRecord, like: Any, on_bytes: Callable[[int], None] | None
) -> Callable[[], Any] | None:
    """`_read.start_direct` through the pool, for a leaf `usable` accepts; the
    read runs in the returned function (the pool bounds it, not the read
    window). `None` where the pool cannot be allocated: read it the usual way."""
    pool = _memory.load_pool()
    if pool is None:
        return None
    try:
        with pool.lock:  # every buffer allocated now (once per process): a failure falls back before any read
            while len(pool.buffers) < pool.count:
                pool.take()
    except Exception:  # (no memory for it, or a refusal: the usual way)
        return None
    return lambda: _load(pool, files, loc, record, like, on_bytes)


def _load(
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
