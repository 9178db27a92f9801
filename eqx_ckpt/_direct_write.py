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
# A chunk of more parts than this is assembled in a buffer first.
_MAX_PARTS = 16
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
    what = f"leaf `{record.path}`"
    return _start(loc, record.directory, what, record.stored_shape, record.chunks, [(0, data)], data.nbytes)


def start_pack(
    loc: Location, pack: PackRecord, records: Sequence[LeafRecord], pieces: Sequence[Any]
) -> list[concurrent.futures.Future[None]]:
    """Start writing the chunk files of `pack`: each member's bytes at its
    offset, zeros between (from the members' own buffers: never one copy of the
    whole pack, at most one of a chunk)."""
    itemsize = dtype_from_name(pack.dtype).itemsize
    placed = [(r.offset * itemsize, _bytes_of(piece, pack.dtype)) for r, piece in zip(records, pieces, strict=True)]
    segments = sorted(placed, key=lambda s: s[0])
    what = f"pack `{pack.name}` (small leaves)"
    return _start(loc, pack.name, what, (pack.size,), (pack.chunk,), segments, pack.size * itemsize)


def _bytes_of(piece: Any, dtype: str) -> np.ndarray:
    """The stored bytes of a host piece, as a flat uint8 array (a view when it is
    C-contiguous already)."""
    # Little-endian, as the codec says: only the byte order may change here.
    array = np.asarray(piece).astype(dtype_from_name(dtype), casting="equiv", copy=False)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _start(
    loc: Location,
    directory: str,
    what: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    segments: list[tuple[int, np.ndarray]],
    total: int,
) -> list[concurrent.futures.Future[None]]:
    folder = os.path.join(loc.local or "", directory) if directory else (loc.local or "")
    keys = list(_direct.chunk_keys(shape, chunks))
    # A chunk is `chunks[0]` rows of the array (the whole array for a scalar).
    chunk_bytes = chunks[0] * (total // shape[0]) if keys and shape else total
    futures = []
    for key, parts in zip(keys, _cut(segments, chunk_bytes, len(keys)), strict=True):
        job = functools.partial(_write_chunk, folder, directory, key, what, parts, chunk_bytes)
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


def _cut(segments: list[tuple[int, np.ndarray]], size: int, count: int) -> list[list[tuple[int, memoryview]]]:
    """`segments` (sorted `(start, bytes)`, not overlapping) cut into `count`
    chunks of `size` bytes: for each, its parts as `(start within it, view)`."""
    out: list[list[tuple[int, memoryview]]] = [[] for _ in range(count)]
    for start, data in segments:
        view, stop = data.data, start + data.nbytes
        position = start
        while position < stop:
            chunk = position // size
            end = min(stop, (chunk + 1) * size)
            out[chunk].append((position - chunk * size, view[position - start : end - start]))
            position = end
    return out


def _write_chunk(
    folder: str, directory: str, key: str, what: str, parts: list[tuple[int, memoryview]], size: int
) -> None:
    """One chunk file: `size` bytes, `parts` at their places and zeros between,
    then their crc32c."""
    views: list[Any] = []
    position = 0
    if len(parts) > _MAX_PARTS:
        # Many small leaves: one copy into a chunk buffer costs less than a
        # checksum call and an I/O vector for each.
        buffer = np.zeros(size, np.uint8)
        for start, view in parts:
            buffer[start : start + len(view)] = view
        parts, position = [], size
        views.append(buffer.data)
    for start, view in parts:
        if start > position:
            views.append(_zeros(start - position))
        views.append(view)
        position = start + len(view)
    if size > position:
        views.append(_zeros(size - position))
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
