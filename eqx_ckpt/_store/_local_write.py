"""Writing chunk files on a local disk without TensorStore, writeback started at once.

The mirror of `_local_read`: a small pool of threads writes the files
`_chunk_files.LocalFiles` picks into a fresh data root (a file that exists
is an error). A leaf's chunk goes straight from its host buffer (past the
page cache from `UNBUFFERED_FROM` bytes); a pack's is gathered into a staging
buffer a part at a time. Writeback starts at once (`sync_file_range`), so
the flush before the commit waits only for what is in flight. The files are
exactly what TensorStore's zarr3 driver writes; docs/benchmarks.md says why.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # now: at interpreter exit its import fails
import ctypes
import errno
import fcntl
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np
import xxhash

from .._base import _faults, _state, _threads
from .._base._location import Location
from .._ondisk import _format
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from . import _memory, _share, _window

THREADS = 4
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_IOV_MAX = 1024
_SYNC_FILE_RANGE_WRITE = 2


def start_write(
    loc: Location, record: LeafRecord, piece: Any, base: str | None = None, *, remember: bool = False
) -> list[concurrent.futures.Future[None]]:
    """Start writing every chunk file of one leaf from `piece`, its stored array;
    one future per file. Files equal to those of `base` (the leaf's folder in
    the checkpoint this save follows) are shared; with `remember`, each written
    is recorded with its digest (`_share`)."""
    data = _bytes_of(piece, record.stored_dtype)
    itemsize = dtype_from_name(record.stored_dtype).itemsize
    shape, keys = record.stored_shape, list(_format.chunk_keys(record.stored_shape, record.chunks))
    # A chunk is `chunks[0]` rows of the array (the whole array for a scalar).
    size = record.chunks[0] * (data.nbytes // shape[0]) if keys and shape else data.nbytes
    jobs: list[tuple[str, Callable[[], Any]]] = [
        (key, _compressing(functools.partial(_rows, data, i * size, size), record.compression, itemsize))
        for i, key in enumerate(keys)
    ]
    return _start(loc, record.directory, f"leaf `{record.path}`", jobs, base, remember, bool(record.compression))


def _rows(data: np.ndarray, start: int, size: int) -> list[Any]:
    """The chunk of `size` bytes from `start` on, padded with zeros past the end."""
    view = data.data[start : start + size]
    return [view, _zeros(size - len(view))]


def start_pack(
    loc: Location,
    pack: PackRecord,
    records: Sequence[LeafRecord],
    pieces: Sequence[Any],
    base: str | None = None,
    *,
    remember: bool = False,
    files: range | None = None,
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[concurrent.futures.Future[None]]:
    """Start writing the chunk files of `pack` (with `files`, those indices):
    each member of `records` (in offset order) at its offset, zeros between.
    `base`, `remember`: as for `start_write`; `bounds`: `member_bounds(records)`."""
    n = len(records)
    starts, stops = bounds if bounds is not None else member_bounds(records)
    if n > 1 and bool((starts[1:] < stops[:-1]).any()):
        raise RuntimeError(f"Internal error: the members of pack `{pack.name}` overlap, or are out of order.")
    members = list(pieces)
    if bool((stops == starts).any()):  # empty leaves: nothing to write
        kept = np.flatnonzero(stops > starts)
        starts, stops, members = starts[kept], stops[kept], [members[i] for i in kept]
    dtype = dtype_from_name(pack.dtype)
    jobs: list[tuple[str, Callable[[], _Chunk]]] = []
    for n, key in enumerate(_format.chunk_keys((pack.size,), (pack.chunk,))):
        if files is not None and n not in files:
            if n >= files.stop:
                break
            continue
        lo, hi = n * pack.chunk, (n + 1) * pack.chunk
        # The members with elements in [lo, hi) (offsets increase, sizes are positive).
        first, last = int(np.searchsorted(stops, lo, "right")), int(np.searchsorted(starts, hi, "left"))
        chunk = _Chunk(members[first:last], starts[first:last], stops[first:last], lo, hi, dtype)
        jobs.append((key, _compressing(functools.partial(_given, chunk), pack.compression, dtype.itemsize)))
    return _start(loc, pack.name, f"pack `{pack.name}` (small leaves)", jobs, base, remember, bool(pack.compression))


def member_bounds(records: Sequence[LeafRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Where the members of a pack start and stop in it, in elements."""
    n = len(records)
    starts = np.fromiter((r.offset for r in records), np.int64, n)
    return starts, starts + np.fromiter((r.size for r in records), np.int64, n)


def _given(content: _Chunk) -> _Chunk:
    return content


def _compressing(make: Callable[[], Any], compression: str, itemsize: int) -> Callable[[], Any]:
    """`make`, its chunk's bytes compressed where the array is (`_compressed`)."""
    return functools.partial(_compressed, make, compression, itemsize) if compression else make


def _compressed(make: Callable[[], Any], compression: str, itemsize: int) -> list[Any]:
    """The bytes of the chunk `make()` gives, compressed, as one view (in the
    writing thread: the codec releases the GIL)."""
    content = make()
    if isinstance(content, _Chunk):
        raw = np.empty(content.nbytes, np.uint8)
        content.gather(raw)
    elif len(content) == 1 or not len(content[1]):
        raw = np.frombuffer(content[0], np.uint8)
    else:  # an edge chunk, padded
        raw = np.concatenate([np.frombuffer(view, np.uint8) for view in content])
    # Elements as unsigned integers of their size: what blosc shuffles by.
    elements = raw.view(f"<u{itemsize}") if itemsize in (2, 4, 8) else raw
    return _Compressed([memoryview(_format.codec(compression, itemsize).encode(elements))])


class _Compressed(list[Any]):
    """A compressed chunk's bytes, as one view: their size is their content's."""


class _Chunk:
    """One chunk of a pack, `[lo, hi)` in elements: `members` at `[starts,
    stops)`, zeros between. Gathered a part at a time into a reused staging
    buffer: fresh pages cost more to fault in than the copy itself."""

    def __init__(self, members: list[Any], starts: np.ndarray, stops: np.ndarray, lo: int, hi: int, dtype: Any):
        self.members, self.starts, self.stops, self.lo, self.hi, self.dtype = members, starts, stops, lo, hi, dtype

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.dtype.itemsize

    def part(self, lo: int, hi: int) -> _Chunk:
        """The elements `[lo, hi)` of this chunk, as a chunk of their own."""
        first = int(np.searchsorted(self.stops, lo, "right"))
        last = int(np.searchsorted(self.starts, hi, "left"))
        return _Chunk(self.members[first:last], self.starts[first:last], self.stops[first:last], lo, hi, self.dtype)

    def gather(self, out: np.ndarray) -> None:
        """Write the chunk's bytes into `out` (uint8, at least `nbytes` long)."""
        lo = self.lo
        members, starts, stops = list(self.members), self.starts.tolist(), self.stops.tolist()
        if members and starts[0] < lo:  # begins in the chunk before
            members[0], starts[0] = _flat(members[0], self.dtype)[lo - starts[0] :], lo
        if members and stops[-1] > self.hi:  # ends in the chunk after
            members[-1], stops[-1] = _flat(members[-1], self.dtype)[: self.hi - starts[-1]], self.hi
        elements = out[: self.nbytes].view(self.dtype)
        if not members:
            elements[:] = 0
            return
        first, last = starts[0] - lo, stops[-1] - lo
        elements[:first] = 0
        elements[last:] = 0
        if starts[1:] == stops[:-1]:
            # Back to back, as most packs are (sizes of 64-byte multiples need no
            # padding): one copy of every member, without a Python step each.
            try:
                np.concatenate(members, axis=None, out=elements[first:last], casting="no")
                return
            except TypeError:  # a member of another byte order: copied one by one, below
                pass
        elements[first:last] = 0
        for member, start, stop in zip(members, starts, stops, strict=True):
            elements[start - lo : stop - lo] = _flat(member, self.dtype)


def _bytes_of(piece: Any, dtype: Any) -> np.ndarray:
    """The stored bytes of a host piece (`dtype`, or its name) as a flat uint8 array."""
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    return np.ascontiguousarray(_flat(piece, dtype)).view(np.uint8)


def _flat(piece: Any, dtype: np.dtype) -> np.ndarray:
    """A host piece's elements as a flat array of `dtype`; only the byte order may change."""
    return np.asarray(piece).astype(dtype, casting="equiv", copy=False).reshape(-1)


def _start(
    loc: Location,
    directory: str,
    what: str,
    jobs: list[tuple[str, Callable[[], Any]]],
    base: str | None = None,
    remember: bool = False,
    compressed: bool = False,
) -> list[concurrent.futures.Future[None]]:
    """Write each chunk file `key` of `jobs` with what `make()` gives, on the
    pool (`compressed`: the codec pool, one thread a core); one future per file."""
    folder = os.path.join(loc.local or "", directory) if directory else (loc.local or "")
    pool = _window.codec_pool() if compressed else _threads.pool("eqx_ckpt-write", THREADS)
    futures = []
    for key, make in jobs:
        job = functools.partial(_write_chunk, folder, directory, key, what, make, base, remember)
        try:
            futures.append(pool.submit(job))
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


def _write_chunk(
    folder: str, directory: str, key: str, what: str, make: Callable[[], Any], base: str | None, remember: bool
) -> None:
    """One chunk file: the bytes `make()` gives (views, or a `_Chunk`) and their
    crc32c, or a link to the file `key` of `base` that holds the same bytes. A
    file written is recorded with its xxh3-128 where one is at hand (`_share.written`)."""
    _faults.fire("local_write.chunk", directory, key)
    content = make()
    path = os.path.join(folder, *key.split("/"))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        digest = checksum = None
        if base is not None:
            linked, digest, checksum = _shared(os.path.join(base, *key.split("/")), path, content, what)
            if linked:
                return
        fd = os.open(path, _FLAGS, 0o666)
        try:
            # Hashed as written where the comparison did not: from the stage
            # in cache, not another pass over memory.
            hasher = xxhash.xxh3_128() if remember and digest is None else None
            _write_all(fd, content, checksum, hasher)
            digest = hasher.digest() if hasher is not None else digest
            if digest is not None:
                _share.written(fd, path, digest)
        finally:
            os.close(fd)
    except OSError as e:
        name = f"{directory}/{key}" if directory else key
        # An OSError made without an errno (`OSError("...")`) has its words in `str(e)`.
        reason = e.strerror if e.errno is not None else str(e)
        raise OSError(e.errno, f"{reason}: cannot write chunk file {name!r} of {what}") from None


def _shared(source: str, path: str, content: Any, what: str) -> tuple[bool, bytes | None, int | None]:
    """Whether `path` is now a link to the base's equal chunk file `source`; and
    the xxh3-128 and crc32c of `content` where computed (for the write)."""
    nbytes = (content.nbytes if isinstance(content, _Chunk) else sum(len(v) for v in content)) + _format.CHECKSUM_BYTES
    # A large chunk whose first bytes changed is written at once, unhashed: a
    # hash here would add a pass over its bytes where everything changed.
    large = nbytes >= UNBUFFERED_FROM and not isinstance(content, _Chunk)
    start = content[0] if large else None
    verified = _share.base_file(source, nbytes, what, start, sized=not isinstance(content, _Compressed))
    if verified is None:
        return False, None, None
    digest, checksum = _digest(content)
    return digest == verified.digest and _share.link(source, path, verified), digest, checksum


def _digest(content: Any) -> tuple[bytes, int | None]:
    """The xxh3-128 of a chunk's bytes and, for a pack's, their crc32c too
    (gathered into the stage, where both cost little)."""
    hasher = xxhash.xxh3_128()
    if isinstance(content, _Chunk):
        checksum = 0
        stage, staged = _stage()
        step = STAGE_BYTES // content.dtype.itemsize
        for lo in range(content.lo, content.hi, step):
            part = content.part(lo, min(lo + step, content.hi))
            part.gather(staged)
            hasher.update(stage[: part.nbytes])
            checksum = crc32c.crc32c(stage[: part.nbytes], checksum)
        return hasher.digest(), checksum
    for view in content:
        hasher.update(view)
    return hasher.digest(), None


def _write_all(fd: int, content: Any, checksum: int | None = None, hasher: xxhash.xxh3_128 | None = None) -> None:
    """Write `content` (a `_Chunk`, or views) and its crc32c (`checksum`, where
    known) into the new file `fd`, writeback started; `hasher`, where given,
    takes the bytes as they are written."""
    _faults.fire("local_write.chunk_bytes", fd)
    if isinstance(content, _Chunk):
        staged = _Staged(fd, direct=False, checksum=checksum, hasher=hasher)
        step = STAGE_BYTES // content.dtype.itemsize
        for lo in range(content.lo, content.hi, step):
            staged.gather(content.part(lo, min(lo + step, content.hi)))
        staged.finish()
        _start_writeback(fd)
        return
    # A compressed chunk (at most 8 MiB before) from a stage's worth on.
    unbuffered = STAGE_BYTES if isinstance(content, _Compressed) else UNBUFFERED_FROM
    if sum(len(view) for view in content) >= unbuffered and _set_direct(fd, True):
        try:
            _faults.fire("local_write.unbuffered", fd)
            staged = _Staged(fd, direct=True, checksum=checksum, hasher=hasher)
            for view in content:
                staged.copy(view)
            staged.finish()  # (its last block padded, then the file cut)
            return
        except _NotUnbuffered:
            # Refused (an alignment this device does not take): written again,
            # from the start, through the page cache.
            _set_direct(fd, False)
            os.ftruncate(fd, 0)
            if hasher is not None:
                hasher.reset()
    crc = 0
    for view in content:  # both over a view while it is in the cache
        if checksum is None:
            crc = crc32c.crc32c(view, crc)
        if hasher is not None:
            hasher.update(view)
    checksum = crc if checksum is None else checksum
    _write_buffered(fd, [*content, checksum.to_bytes(_format.CHECKSUM_BYTES, "little")])
    _start_writeback(fd)


def _write_buffered(fd: int, views: list[Any]) -> None:
    views = [v for v in views if len(v)]
    offset = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = memoryview(views[0])[n:]


# An unbuffered (`O_DIRECT`) write starts at a file offset and a memory address
# that are multiples of `_BLOCK`, and is a multiple of it long. Smaller files go
# through the page cache, whose writeback runs while the save goes on, where an
# unbuffered write waits for the disk (docs/benchmarks.md).
UNBUFFERED_FROM = 8 << 20
_BLOCK = 4096
# A stage's fresh pages are paid for once per thread: small, and kept.
STAGE_BYTES = 1 << 20
# From this many bytes, a view is copied by NumPy (without the GIL).
_BIG_COPY = 64 << 10


class _NotUnbuffered(Exception):
    """This file cannot be written unbuffered after all."""


def _set_direct(fd: int, on: bool) -> bool:
    """Turn `O_DIRECT` on or off for `fd`; whether it is now as asked (some file systems refuse it)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return not on
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | direct) if on else (flags & ~direct))
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return not on
        raise
    return True


class _Staged:
    """One file written from the stage, a full stage at a time (unbuffered with
    `direct`), then the crc32c (`checksum`, else computed as written)."""

    def __init__(self, fd: int, *, direct: bool, checksum: int | None = None, hasher: xxhash.xxh3_128 | None = None):
        self.fd, self.direct, self.known, self.hasher = fd, direct, checksum, hasher
        self.stage, self.staged = _stage()
        self.pos = self.offset = self.checksum = 0

    def gather(self, part: _Chunk) -> None:
        """Stage a part of a pack's chunk (it fits in what is left)."""
        part.gather(self.staged[self.pos :])
        self.pos += part.nbytes
        self._flush_if_full()

    def copy(self, view: Any) -> None:
        n, start = len(view), 0
        if self.direct and self.pos == 0 and n >= STAGE_BYTES and _address(view) % _BLOCK == 0:
            # Aligned already (a page-aligned host buffer): written as it is.
            start = n - n % _BLOCK
            self._write(memoryview(view)[:start])
        while start < n:
            k = min(n - start, STAGE_BYTES - self.pos)
            if k >= _BIG_COPY:
                np.copyto(self.staged[self.pos : self.pos + k], np.frombuffer(view, np.uint8, k, start))
            else:
                self.stage[self.pos : self.pos + k] = view[start : start + k]
            self.pos, start = self.pos + k, start + k
            self._flush_if_full()

    def finish(self) -> None:
        """Write what is staged and the checksum, and end the file there."""
        stage, pos = self.stage, self.pos
        if self.hasher is not None:
            self.hasher.update(stage[:pos])
        total = self.known if self.known is not None else crc32c.crc32c(stage[:pos], self.checksum)
        checksum = total.to_bytes(_format.CHECKSUM_BYTES, "little")
        if pos + _format.CHECKSUM_BYTES > STAGE_BYTES:
            # No room left for the checksum: out with the whole blocks first.
            whole = pos - pos % _BLOCK
            _pwrite(self.fd, stage[:whole], self.offset, direct=self.direct)
            stage[: pos - whole] = stage[whole:pos]
            pos, self.offset = pos - whole, self.offset + whole
        stage[pos : pos + _format.CHECKSUM_BYTES] = checksum
        pos += _format.CHECKSUM_BYTES
        if not self.direct:
            _pwrite(self.fd, stage[:pos], self.offset, direct=False)
            return
        padded = -(-pos // _BLOCK) * _BLOCK
        stage[pos:padded] = _zero_block(_BLOCK)[: padded - pos]
        _pwrite(self.fd, stage[:padded], self.offset, direct=True)
        os.ftruncate(self.fd, self.offset + pos)

    def _flush_if_full(self) -> None:
        if self.pos == STAGE_BYTES:
            self._write(self.stage)
            self.pos = 0

    def _write(self, view: memoryview) -> None:
        if self.known is None:
            self.checksum = crc32c.crc32c(view, self.checksum)
        if self.hasher is not None:
            self.hasher.update(view)
        _pwrite(self.fd, view, self.offset, direct=self.direct)
        self.offset += len(view)


def _pwrite(fd: int, view: memoryview, offset: int, *, direct: bool) -> None:
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise _NotUnbuffered from None
            raise
        if direct and n % _BLOCK and n < len(view):
            raise _NotUnbuffered  # what is left would start off a block boundary
        view, offset = view[n:], offset + n


def _address(view: Any) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


_STAGES = threading.local()


def _stage() -> tuple[memoryview, np.ndarray]:
    """This thread's staging buffer (kept), as a memoryview and as a NumPy array."""
    stage = getattr(_STAGES, "buffer", None)
    if stage is None or len(stage[0]) != STAGE_BYTES:
        memory = _memory.fresh_bytes(STAGE_BYTES)
        stage = _STAGES.buffer = (memory.data, memory)
    return stage


@_state.memo(8)
def _zero_block(size: int) -> memoryview:
    return memoryview(bytes(size))


def _zeros(size: int) -> memoryview:
    """`size` zero bytes (a shared block when they are few: the padding of a leaf's edge chunk)."""
    return _zero_block(64)[:size] if size <= 64 else memoryview(bytearray(size))


@_state.memo(1)
def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def _start_writeback(fd: int) -> None:
    """Start writing this file back now, without waiting (Linux); the flush makes it durable."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
