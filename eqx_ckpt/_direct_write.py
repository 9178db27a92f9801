"""Writing chunk files on a local disk without TensorStore, writeback started at once.

The mirror of `_direct` (reads). A save to a local disk writes every chunk file
of a leaf whose chunks split only its first axis, and of every pack, itself:
the chunk's bytes straight from the leaf's host buffer (no copy) and their
crc32c, with one `writev`, by a small pool of threads. Right after each file is
written, its writeback to the disk is started (`sync_file_range`), so the disk
works while the save goes on; the flush before the commit (`_io.flush`) then
waits only for what is still in flight. Through TensorStore, every file waited
in the page cache until that flush, and the save took the time of writing into
memory plus the time of writing to disk.

The files are exactly what TensorStore's zarr3 driver writes for the metadata
that TensorStore itself created (`zarr.json`, written first): a chunk file is
the chunk's elements in C order, little-endian, edge chunks padded to the full
chunk with the fill value (zero), then the 4-byte crc32c of those bytes. Any
zarr v3 reader reads them; `tests/test_direct_write.py` reads them back through
TensorStore alone.

Only single-process saves of the "directories" layout use it, into their own
fresh data root (a file that exists already is an error, never overwritten).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # now: at interpreter exit its import fails
import ctypes
import functools
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np

from . import _direct
from ._manifest import LeafRecord, PackRecord
from ._spec import Location, dtype_from_name

THREADS = 4
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_IOV_MAX = 1024
_SYNC_FILE_RANGE_WRITE = 2


def eligible(loc: Location, record: LeafRecord, pieces: Sequence[tuple[tuple[slice, ...], Any]]) -> bool:
    """Whether this leaf's chunk files are written here: a local disk, one host
    piece holding the whole array, and chunks that split only its first axis."""
    return (
        _direct.supported(loc)
        and record.pack is None
        and len(pieces) == 1
        and not pieces[0][0]
        and tuple(record.chunks[1:]) == tuple(record.stored_shape[1:])
    )


def start_leaf(loc: Location, record: LeafRecord, piece: Any) -> list[concurrent.futures.Future[None]]:
    """Start writing every chunk file of one leaf (its `zarr.json` exists);
    `piece` is its stored array. One future per chunk file."""
    data = _bytes_of(piece, record.stored_dtype)
    shape, keys = record.stored_shape, list(_direct.chunk_keys(record.stored_shape, record.chunks))
    # A chunk is `chunks[0]` rows of the array (the whole array for a scalar).
    size = record.chunks[0] * (data.nbytes // shape[0]) if keys and shape else data.nbytes
    jobs: list[tuple[str, Callable[[], list[Any]]]] = [
        (key, functools.partial(_rows, data, i * size, size)) for i, key in enumerate(keys)
    ]
    return _start(loc, record.directory, f"leaf `{record.path}`", jobs)


def _rows(data: np.ndarray, start: int, size: int) -> list[Any]:
    """The chunk of `size` bytes from `start` on, padded with zeros past the end."""
    view = data.data[start : start + size]
    return [view, _zeros(size - len(view))]


def start_pack(
    loc: Location, pack: PackRecord, records: Sequence[LeafRecord], pieces: Sequence[Any]
) -> list[concurrent.futures.Future[None]]:
    """Start writing the chunk files of `pack`: each member's elements at its
    offset, zeros between, written from the members' own buffers (no copy)."""
    placed = sorted(
        ((r.offset, r.size, piece) for r, piece in zip(records, pieces, strict=True) if r.size),
        key=operator.itemgetter(0),
    )
    starts = np.fromiter((offset for offset, _, _ in placed), np.int64, len(placed))
    stops = starts + np.fromiter((size for _, size, _ in placed), np.int64, len(placed))
    members = [piece for _, _, piece in placed]
    dtype = dtype_from_name(pack.dtype)
    jobs: list[tuple[str, Callable[[], list[Any]]]] = []
    for n, key in enumerate(_direct.chunk_keys((pack.size,), (pack.chunk,))):
        lo, hi = n * pack.chunk, (n + 1) * pack.chunk
        # The members with elements in [lo, hi) (offsets increase, sizes are positive).
        first, last = int(np.searchsorted(stops, lo, "right")), int(np.searchsorted(starts, hi, "left"))
        chunk = _Chunk(members[first:last], starts[first:last], stops[first:last], lo, hi, dtype)
        jobs.append((key, chunk.views))
    return _start(loc, pack.name, f"pack `{pack.name}` (small leaves)", jobs)


class _Chunk:
    """One chunk of a pack, `[lo, hi)` in elements: `members` (host arrays) at
    `[starts, stops)`, zeros between. Its writer makes the views to write.

    Views of the members' own memory, not one buffer: a fresh buffer's pages
    cost more to fault in than the copy itself (0.1 s for the 42 MB of ten
    thousand leaves, in a new process here), and the kernel copies anyway."""

    def __init__(self, members: list[Any], starts: np.ndarray, stops: np.ndarray, lo: int, hi: int, dtype: Any):
        self.members, self.starts, self.stops, self.lo, self.hi, self.dtype = members, starts, stops, lo, hi, dtype

    def views(self) -> list[Any]:
        itemsize = self.dtype.itemsize
        if not self.members:
            return [_zeros((self.hi - self.lo) * itemsize)]
        if self.starts[0] >= self.lo and self.stops[-1] <= self.hi and not np.any(self.starts[1:] != self.stops[:-1]):
            # Back to back, as most packs are (sizes of 64-byte multiples need no padding).
            return [
                _zeros((int(self.starts[0]) - self.lo) * itemsize),
                *[self._bytes(member) for member in self.members],
                _zeros((self.hi - int(self.stops[-1])) * itemsize),
            ]
        views: list[Any] = []
        position = self.lo
        for member, start, stop in zip(self.members, self.starts.tolist(), self.stops.tolist(), strict=True):
            view = self._bytes(member)
            # Cut at the chunk's edges.
            view = view[max(0, self.lo - start) * itemsize : (min(stop, self.hi) - start) * itemsize]
            start = max(start, self.lo)
            views.append(_zeros((start - position) * itemsize))
            views.append(view)
            position = start + len(view) // itemsize
        views.append(_zeros((self.hi - position) * itemsize))
        return views

    def _bytes(self, member: Any) -> memoryview:
        if type(member) is np.ndarray and member.dtype == self.dtype and member.flags.c_contiguous:
            try:
                return memoryview(member).cast("B")  # type: ignore[arg-type]
            except (TypeError, ValueError):  # a dtype the buffer protocol lacks (bfloat16, float8...)
                pass
        return _bytes_of(member, self.dtype).data


def _bytes_of(piece: Any, dtype: Any) -> np.ndarray:
    """The stored bytes of a host piece, as a flat uint8 array (a view when it is
    C-contiguous already). `dtype`: the stored dtype, or its name."""
    # Little-endian, as the codec says: only the byte order may change here.
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    array = np.asarray(piece).astype(dtype, casting="equiv", copy=False)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _start(
    loc: Location, directory: str, what: str, jobs: list[tuple[str, Callable[[], list[Any]]]]
) -> list[concurrent.futures.Future[None]]:
    """Write each chunk file `key` of `jobs` with the bytes its `make()` gives,
    by the pool's threads. One future per file."""
    folder = os.path.join(loc.local or "", directory) if directory else (loc.local or "")
    futures = []
    for key, make in jobs:
        job = functools.partial(_write_chunk, folder, directory, key, what, make)
        try:
            futures.append(_pool().submit(job))
        except RuntimeError:  # at interpreter exit no thread starts: written here, in turn
            futures.append(_run_now(job))
    return futures


def _run_now(job: Callable[[], None]) -> concurrent.futures.Future[None]:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    try:
        job()
        future.set_result(None)
    except Exception as e:
        future.set_exception(e)
    return future


def _write_chunk(folder: str, directory: str, key: str, what: str, make: Callable[[], list[Any]]) -> None:
    """One chunk file: the bytes `make()` gives, then their crc32c."""
    views = make()
    checksum = 0
    for view in views:
        checksum = crc32c.crc32c(view, checksum)
    views.append(checksum.to_bytes(4, "little"))
    path = os.path.join(folder, *key.split("/"))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, _FLAGS, 0o666)
        try:
            _write_all(fd, views)
            _start_writeback(fd)
        finally:
            os.close(fd)
    except OSError as e:
        name = f"{directory}/{key}" if directory else key
        raise OSError(e.errno, f"{e.strerror}: cannot write chunk file {name!r} of {what}") from None


def _write_all(fd: int, views: list[Any]) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = memoryview(views[0])[n:]


@functools.lru_cache(maxsize=8)
def _zero_block(size: int) -> memoryview:
    return memoryview(bytes(size))


def _zeros(size: int) -> memoryview:
    """`size` zero bytes (a shared block for the small gaps between packed leaves)."""
    return _zero_block(64)[:size] if size <= 64 else memoryview(bytearray(size))


@functools.cache
def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing this file to disk now, without waiting
    (Linux); durability still comes from the flush before the commit."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return _direct.shared_pool("eqx_ckpt-write", THREADS)
