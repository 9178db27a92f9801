"""Host memory for leaves: page-aligned buffers and copies, the memory check
before a read, the host data of a save's pieces, and the pinned paths of
GPUs (`PINNED_PLATFORMS`; docs/benchmarks.md, "GPU").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._base import _faults, _state, _threads
from .._base._errors import IntegrityError, stored_leaf_error

if TYPE_CHECKING:
    from .._base._location import Location
    from .._ondisk._format import LeafRecord


# Private anonymous memory: a shared mapping (`mmap`'s default) is backed by
# shmem, whose first touch of each page costs more (docs/benchmarks.md).
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def fresh_bytes(nbytes: int, *, huge: bool = False) -> np.ndarray:
    """`nbytes` of page-aligned anonymous memory (zeroed), as a NumPy `uint8`
    array that `jax.device_put` can adopt without a copy; `huge`: in huge
    pages where the kernel gives them on request (`madvise`)."""
    _faults.fire("memory.map", nbytes)
    memory = mmap.mmap(-1, nbytes, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, nbytes)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # (a kernel without them: small pages)
            memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.uint8)


def faulted_in(buffer: np.ndarray) -> np.ndarray:
    """`buffer`, each of its pages written once (a page's first touch is most
    of the cost of fresh memory; docs/benchmarks.md, "GPU")."""
    buffer[:: mmap.PAGESIZE] = 0
    return buffer


# NumPy asks for huge pages from 4 MiB on, and with the page cache full the
# kernel compacts memory to find them: copies that large go into `fresh_bytes`
# memory (docs/benchmarks.md). Smaller arrays stay NumPy's (a mapping per leaf
# costs system calls and whole pages).
FRESH_MIN_BYTES = 4 * 2**20


def fresh_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array, page-aligned in `fresh_bytes` memory
    when it has at least `FRESH_MIN_BYTES`, else NumPy's own."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < FRESH_MIN_BYTES or dtype.hasobject:
        return np.empty(shape, dtype)
    return fresh_bytes(nbytes).view(dtype).reshape(shape)


def private_copy(x: Any) -> np.ndarray:
    """A C-contiguous copy of host data that nothing else references (`fresh_empty`)."""
    x = np.asarray(x)
    out = fresh_empty(x.shape, x.dtype)
    np.copyto(out, x, casting="no")
    return out


def private_copies(arrays: Sequence[Any]) -> list[np.ndarray]:
    """`private_copy` of each; large ones by a few threads (the copy releases
    the GIL, and faulting fresh pages in is most of its cost)."""
    arrays = [np.asarray(x) for x in arrays]
    big = [i for i, x in enumerate(arrays) if x.nbytes >= FRESH_MIN_BYTES]
    if len(big) < 2:
        return [private_copy(x) for x in arrays]
    copies = list(arrays)  # each replaced by its copy below
    pool = _threads.pool("eqx_ckpt-copy", COPIERS)
    futures = [(i, pool.submit(private_copy, arrays[i])) for i in big]
    for i, x in enumerate(arrays):
        if x.nbytes < FRESH_MIN_BYTES:
            copies[i] = private_copy(x)
    for i, future in futures:
        copies[i] = future.result()
    return copies


# The threads that make `private_copies`' large copies.
COPIERS = min(max(os.cpu_count() or 1, 2), 4)


@_state.memo(1)
def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_beyond_memory(loc: Location, record: LeafRecord, nbytes: int, what: str) -> None:
    """Refuse a read that would allocate more than this machine's memory:
    TensorStore would abort the process on the failed allocation."""
    memory = physical_memory()
    if memory is None or nbytes <= memory:
        return
    raise stored_leaf_error(
        IntegrityError,
        f"reading {what} needs {nbytes} bytes (shape {list(record.stored_shape)}, chunks {list(record.chunks)} in "
        f"the manifest), more than this machine's {memory} bytes of memory. Nothing was read.",
        dotted=record.path,
        path=loc.display,
        fix="A manifest this large is damaged or hostile; if the leaf really is this large, read it in slices "
        "(`eqx_ckpt.Checkpoint(path)[key][...]`) or load it sharded across devices.",
    )


# -- The pool of host buffers a load on an accelerator reads through -------------------------------

# `(count, bytes)`: a load onto devices of `PINNED_PLATFORMS` reads each large
# local leaf through `count` reused host buffers (`_reader`), reads running
# ahead of the copies to the devices; `None`: off (docs/benchmarks.md, "GPU").
PINNED_LOAD_POOL: tuple[int, int] | None = (4, 256 * 2**20)
# Whether the pool's buffers ask for huge pages, and are faulted in by
# `COPIERS` threads at once when the pool is made. Off: on an H200's host
# they faulted in faster, yet a process's first cold load took no less
# (docs/benchmarks.md, "GPU").
POOL_HUGE_PAGES = False
# Whether the pool's buffers are the first local device's pinned host memory
# (`pinned_host` arrays, read into through their address): a leaf bound for
# that device alone then goes to it by one DMA of the buffer, sliced and
# viewed as its dtype there (one small program per shape), instead of
# through the runtime's staging of pageable memory. Off: on an H200 a warm
# load gained 5%, but the memory it pins is taken from what an asynchronous
# save would reuse, whose next copies then waited for a new allocation
# (docs/benchmarks.md, "GPU").
PINNED_LOAD_BUFFERS = False

# The platforms whose loads use the pool and whose blocking saves copy through
# pinned memory: the GPUs measured (not TPUs). Tests add "cpu".
PINNED_PLATFORMS: frozenset[str] = frozenset({"gpu", "cuda", "rocm"})


class BufferPool:
    """`count` host buffers of `size` bytes, each allocated once (counted in
    `allocations`); `take` hands out the next, round robin, once the copies
    from its last use (`sent`) are done."""

    def __init__(self, count: int, size: int):
        self.count, self.size, self.allocations = count, size, 0
        self.buffers: list[np.ndarray] = []
        # Where the buffers are pinned (`PINNED_LOAD_BUFFERS`): the device, and each buffer's `pinned_host` array.
        self.device: Any = None
        self.pinned: dict[int, jax.Array] = {}
        self.pending: list[list[Any]] = []
        self.next = 0
        self.lock = threading.Lock()  # one load through the pool at a time

    def fill(self) -> None:
        """Allocate every buffer not yet allocated, faulted in by a few threads at once."""
        missing = self.count - len(self.buffers)
        if missing <= 0:
            return
        huge = POOL_HUGE_PAGES
        made = []
        for _ in range(missing):
            _faults.fire("load.pinned_pool", self.size)
            made.append(self._pinned() if PINNED_LOAD_BUFFERS else fresh_bytes(self.size, huge=huge))
        if huge and not PINNED_LOAD_BUFFERS:
            made = list(_threads.pool("eqx_ckpt-copy", COPIERS).map(faulted_in, made))
        self.buffers += made
        self.pending += [[] for _ in made]
        self.allocations += missing

    def take(self) -> np.ndarray:
        i = self.next
        self.next = (i + 1) % self.count
        if i == len(self.buffers):
            self.fill()
        # Its copies to the devices are done: free to reuse. A copy may be the
        # caller's array by now (a leaf of one slab), deleted or donated since:
        # the load waited for it before returning it (`_reader._Reads.each`).
        jax.block_until_ready([x for x in self.pending[i] if not x.is_deleted()])
        self.pending[i] = []
        return self.buffers[i]

    def _pinned(self) -> np.ndarray:
        """A buffer in the first local device's pinned host memory: a writable
        view of a `pinned_host` array this pool keeps (JAX gives none of its
        own), zeroed."""
        device = jax.local_devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=_PINNED)
        array = jax.block_until_ready(jax.device_put(np.zeros(self.size, np.uint8), sharding))
        view = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(array.unsafe_buffer_pointer()))
        self.device = device
        self.pinned[view.ctypes.data] = array
        return view

    def pinned_array(self, buffer: np.ndarray) -> jax.Array | None:
        """The `pinned_host` array whose memory `buffer` is, if it is one."""
        return self.pinned.get(buffer.ctypes.data)

    def sent(self, buffer: np.ndarray, copies: list[Any]) -> None:
        """`copies`, made from `buffer`, which must finish before it is reused."""
        self.pending[next(i for i, b in enumerate(self.buffers) if b is buffer)] += copies


# (Two, for a test that changes `PINNED_LOAD_POOL`; a forked child has no device buffers.)
_LOAD_POOLS: _state.Table[tuple[int, int], BufferPool] = _state.table("memory.load_pools", 2, "oldest", fork="empty")


def load_pool() -> BufferPool | None:
    """The process's pool for `PINNED_LOAD_POOL`, or `None` where it is off."""
    setting = PINNED_LOAD_POOL
    if setting is None:
        return None
    with _LOAD_POOLS.lock:
        pool = _LOAD_POOLS.get(setting)
        return pool if pool is not None else _LOAD_POOLS.put(setting, BufferPool(*setting))


def pinned_platform(device: Any) -> bool:
    """Whether the pinned paths are used for `device` (`PINNED_PLATFORMS`)."""
    return device is not None and device.platform in PINNED_PLATFORMS


# -- The host data of a save's pieces ---------------------------------------------------------------


class Deferred:
    """A host piece made when the save stages it: `source` (an array, or a
    function making one) through `convert` (a cast, an encoding), `nbytes` as stored."""

    __slots__ = ("__weakref__", "convert", "nbytes", "source")

    def __init__(self, source: Any, nbytes: int, convert: Callable[[np.ndarray], np.ndarray] | None = None):
        self.source, self.nbytes, self.convert = source, nbytes, convert

    def resolved(self) -> Any:
        """The source, made (once) where it is a function."""
        self.source = self._made()
        return self.source

    def make(self) -> np.ndarray:
        """The host data, made now; nothing of it is kept here."""
        out = host(self._made())
        return out if self.convert is None else self.convert(out)

    def _made(self) -> Any:
        source = self.source
        if callable(source) and not isinstance(source, (jax.Array, np.ndarray)):
            return source()
        return source


def nbytes(data: Any) -> int:
    """The stored bytes of a piece (as its record counts them)."""
    return int(data.nbytes)


def ahead(data: Any) -> Any:
    """Start copying a piece's device data to the host; what to stage it from
    (`host`). The copy is the save's own (`copy_to_host_async` would cache it
    on the caller's array, beyond any budget), made in the copy pool:
    `jax.device_put` from a GPU returns only once it is done."""
    if isinstance(data, Deferred):
        data.source = ahead(data.resolved())
        return data
    if PINNED_SAVE_COPIES and isinstance(data, jax.Array) and _pinnable(data):
        copies = pinned([data])
        if copies is not None:  # (else, as without the knob)
            return copies[0]
    if isinstance(data, jax.Array) and not _on_cpu(data):
        cpu = _cpu_device()
        if cpu is None:
            data.copy_to_host_async()
        else:
            return _Copying(_threads.pool("eqx_ckpt-to-host", COPY_THREADS).submit(_on_host, data, cpu))
    return data


# Whether a blocking save copies pieces on `PINNED_PLATFORMS` devices to the
# host through pinned memory (`ahead`), overlapping the writes before them
# (docs/benchmarks.md, "GPU").
PINNED_SAVE_COPIES = True


def starts_copies() -> bool:
    """Whether a save's pieces have copies to the host to start (`ahead`): not
    on CPUs alone, unless the pinned copies are on for them (tests)."""
    return not only_cpus() or (PINNED_SAVE_COPIES and "cpu" in PINNED_PLATFORMS)


def _pinnable(data: jax.Array) -> bool:
    """What `pinned` copies for a blocking save: one device of `PINNED_PLATFORMS`, device memory, a plain dtype."""
    return (
        data.sharding.memory_kind not in _HOST_KINDS
        and pinned_platform(next(iter(data.devices())))
        and len(data.sharding.device_set) == 1
        and not jax.dtypes.issubdtype(data.dtype, jax.dtypes.extended)
    )


def pinned(arrays: list[jax.Array]) -> list[jax.Array] | None:
    """Copies of `jax.Array`s in their devices' pinned host memory, enqueued by
    one `jax.device_put` (much faster than through the CPU device); `None`
    where a device has none or the copy fails."""
    try:
        if not all(has_pinned(next(iter(x.devices()))) for x in arrays):
            return None
        _faults.fire("save.pinned_copies", arrays)
        return _put(arrays, [x.sharding.with_memory_kind(_PINNED) for x in arrays], may_alias=False)
    except Exception:  # (a device that refuses it: the copies go through the CPU device)
        return None


_PINNED = "pinned_host"
# Memory kinds of host memory: an array there is viewed by `host`, not copied.
_HOST_KINDS = frozenset((_PINNED, "unpinned_host"))


@_state.memo(64)
def has_pinned(device: Any) -> bool:
    """Whether `device` has pinned host memory (`pinned_host`)."""
    try:
        return any(m.kind == _PINNED for m in device.addressable_memories())
    except Exception:  # (a backend without memories)
        return False


# The copies to the host a save runs at once (`ahead`).
COPY_THREADS = 2


class _Copying:
    """A piece's copy to the host under way (`ahead`); `host` waits for it."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future[np.ndarray]):
        self.future = future


def _on_host(data: jax.Array, cpu: Any) -> np.ndarray:
    return np.asarray(_put(data, cpu))


def _put(arrays: Any, where: Any, **options: Any) -> Any:
    """`jax.device_put`, 64-bit values kept 64-bit: JAX's switch is per thread,
    and off (in the copy pool) a copy between devices narrows them."""
    dtypes = {x.dtype for x in (arrays if isinstance(arrays, list) else [arrays])}
    if not any(
        np.dtype(dtype).itemsize >= 8 for dtype in dtypes if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    ):
        return jax.device_put(arrays, where, **options)
    with jax.enable_x64(True):
        return jax.device_put(arrays, where, **options)


def host(data: Any) -> np.ndarray:
    """A piece's host data, as stored: `ahead`'s copy waited for, or one made now."""
    if type(data) is _Copying:
        return data.future.result()
    if isinstance(data, Deferred):
        return data.make()
    if isinstance(data, jax.Array) and not _on_cpu(data):
        cpu = _cpu_device()
        if cpu is not None:
            return _on_host(data, cpu)
    return np.asarray(data)


def hosts(datas: list[Any]) -> list[np.ndarray]:
    """`host` of each; on CPUs alone, with no copy under way or deferred piece,
    `np.asarray` without `host`'s checks (a few percent of a `many` save)."""
    if only_cpus() and not any(kind is _Copying or issubclass(kind, Deferred) for kind in set(map(type, datas))):
        return list(map(np.asarray, datas))
    return [host(data) for data in datas]


def held(arrays: list[jax.Array]) -> list[Any]:
    """What an asynchronous save holds of `jax.Array`s on one device each
    while its caller waits, safe from a later donation or deletion: their host
    views on CPUs, else copies on their devices (`on_device`, for the save's
    thread to move into pinned memory) or `pinned` copies (only enqueued),
    else copies through the CPU device (one `jax.device_put`). A PRNG key
    array has no host view: `TypeError`."""
    if only_cpus() and "cpu" not in PINNED_PLATFORMS:
        return list(map(np.asarray, arrays))
    if any(jax.dtypes.issubdtype(dtype, jax.dtypes.extended) for dtype in {x.dtype for x in arrays}):
        raise TypeError("a PRNG key array has no host view")
    copies = on_device(arrays)
    if copies is not None:
        return copies
    copies = pinned(arrays)
    if copies is not None:
        _PINNED_HELD.note(sum(x.nbytes for x in arrays))
        return copies
    cpu = _cpu_device()
    if cpu is None:
        return [host(x) for x in arrays]
    return list(map(np.asarray, _put(arrays, cpu)))


# An asynchronous save's first copies into pinned memory wait for the runtime
# to allocate it; later ones are enqueued at once (it keeps what was freed;
# docs/benchmarks.md, "GPU"). Until this process has held that many bytes in
# pinned memory, `held` copies the arrays on their device instead (a few
# milliseconds there), where the copies take at most `DEVICE_HOLD_FRACTION` of each
# device's free memory; the save's thread moves them to pinned memory at once
# (`off_device`), so they hold the device's memory only for that first
# allocation. 0 turns it off (docs/scaling.md, "On a GPU: pinned buffers").
DEVICE_HOLD_FRACTION = 0.25


class _HighWater:
    """The most bytes one asynchronous save has held in pinned memory in this process."""

    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()

    def note(self, nbytes: int) -> None:
        with self.lock:
            self.bytes = max(self.bytes, nbytes)


_PINNED_HELD = _HighWater()


def on_device(arrays: list[jax.Array]) -> list[jax.Array] | None:
    """Copies of `arrays` on their own devices, where the pinned memory they
    would take has not been allocated yet and they fit (`DEVICE_HOLD_FRACTION`);
    else `None`."""
    fraction = DEVICE_HOLD_FRACTION
    nbytes = sum(x.nbytes for x in arrays)
    if fraction <= 0 or nbytes <= _PINNED_HELD.bytes or not all(map(_pinnable, arrays)):
        return None
    wanted: dict[Any, int] = {}
    for x in arrays:
        device = next(iter(x.devices()))
        if not has_pinned(device):
            return None
        wanted[device] = wanted.get(device, 0) + x.nbytes
    if any(n > fraction * free_bytes(device) for device, n in wanted.items()):
        return None
    try:
        _faults.fire("save.device_copies", arrays)
        return _put(arrays, [x.sharding for x in arrays], may_alias=False)
    except Exception:  # (no room after all: pinned copies, as without it)
        return None


def free_bytes(device: Any) -> int:
    """The bytes `device`'s allocator has free now: for a CPU device, the
    host's available memory; 0 where the backend does not say."""
    try:
        stats = device.memory_stats()
        if stats is None and device.platform == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return max(0, int(stats["bytes_limit"]) - int(stats["bytes_in_use"]))
    except Exception:  # (a backend without memory statistics)
        return 0


def off_device(held: list[Any]) -> list[Any]:
    """`held` with `on_device`'s copies replaced by copies in pinned memory
    (enqueued; the device's copies are freed once they are made); in a save's
    thread. Copies that cannot be pinned stay, and are staged as a blocking
    save's pieces are."""
    moving = [i for i, x in enumerate(held) if isinstance(x, jax.Array) and _pinnable(x)]
    if not moving:
        return held
    copies = pinned([held[i] for i in moving])
    if copies is None:
        return held
    _PINNED_HELD.note(sum(x.nbytes for x in copies))
    out = list(held)
    for i, copy in zip(moving, copies, strict=True):
        out[i] = copy
    return out


def protected(data: Any, copy: bool) -> Any:
    """A piece that later changes to the caller's arrays cannot reach: a
    `jax.Array`'s host data, or with `copy` a private copy; a `Deferred` stays
    deferred, its source protected."""
    if isinstance(data, Deferred):
        source = data.resolved()
        return Deferred(protected(source, copy), data.nbytes, data.convert)
    if isinstance(data, jax.Array):
        return host(data)
    return private_copy(data) if copy else data


@_state.memo(1)
def _cpu_device() -> Any:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


@_state.memo(1)
def only_cpus() -> bool:
    """Whether this process computes on CPUs alone (no accelerator)."""
    return jax.default_backend() == "cpu"


def _on_cpu(x: jax.Array) -> bool:
    """Whether `x`'s host data is a view of its buffer (no copy to start)."""
    return only_cpus() or next(iter(x.devices())).platform == "cpu" or x.sharding.memory_kind in _HOST_KINDS
