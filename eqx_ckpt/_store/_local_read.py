"""Reading a large leaf on a local disk straight into one aligned host buffer.

A leaf whose chunks split only its first axis has each chunk's bytes
contiguous in the array, so each chunk file is read with `os.preadv` into its
slice of one buffer (`_memory.fresh_bytes`) that `jax.device_put` adopts,
with no assembly as TensorStore's reads need.

A leaf's file checks (no links, each size) run on a second pool, so that the
next leaves' checks overlap the reads. Each reading thread checksums what it
just read, a `STEP_BYTES` step at a time while it is in cache; the loading
thread joins the pieces' checksums (`crc32c_combine`). docs/benchmarks.md
has the measurements. The bytes are returned as stored, not decoded.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
from collections.abc import Callable, Iterator

import crc32c
import numpy as np

from .._base import _faults, _interrupts, _state, _threads
from .._base._errors import IntegrityError, stored_leaf_error
from .._base._location import Location
from .._ondisk import _format
from .._ondisk._format import LeafRecord, PackRecord, dtype_from_name
from . import _memory, _share, _window
from ._local_paths import READ_FLAGS, local_open, local_stat, special
from ._memory import refuse_beyond_memory
from ._storage_errors import leaf_io_error
from ._untrusted import refuse_links, refuse_special, wrong_size

# Smaller leaves gain little over TensorStore (and will be packed together):
# `_chunk_files.LocalFiles.reads` leaves them to it.
MIN_BYTES = 2**20
PIECE_BYTES = 16 * 2**20
# Each piece is read and checked a step at a time: a step fits in a core's cache.
STEP_BYTES = 2**19
# `READ_FLAGS`: a FIFO planted as a chunk file must not block the open (`special` of its fstat then refuses it).
_FILE_FLAGS = READ_FLAGS | getattr(os, "O_NOFOLLOW", 0)
_FOLDER_FLAGS = _FILE_FLAGS | getattr(os, "O_DIRECTORY", 0)


def start_read(
    loc: Location, record: LeafRecord, *, on_bytes: Callable[[int], None] | None = None
) -> Callable[[], np.ndarray]:
    """Start reading a whole leaf (`LocalFiles.reads`) into one aligned buffer;
    a function returning it as a NumPy array of the stored shape and dtype.

    Every chunk file is checked before the buffer is allocated, and every
    crc32c before it is returned (else an `IntegrityError` naming the leaf).
    An interrupt waits for the reading threads, so none writes into the buffer
    afterwards. `on_bytes` gets each chunk's bytes once it is checked."""
    started = _threads.pool("eqx_ckpt-open", _window.READ_THREADS).submit(_start_checked, loc, record)

    def finish() -> np.ndarray:
        try:
            out, reads = started.result()
        except Exception:
            raise
        except BaseException:  # an interrupt: the checks, then the reads they started, stop first
            _interrupts.stop([started])
            if not started.cancelled() and started.exception() is None:
                started.result()[1].settle()
            raise
        reads.wait(on_bytes)
        return out.view(dtype_from_name(record.stored_dtype)).reshape(record.stored_shape)

    return finish


def _start_checked(loc: Location, record: LeafRecord) -> tuple[np.ndarray, _Reads]:
    # Lazily: a hostile shape's chunk keys end at the first missing file.
    path = _check_chunk_files(loc, record, record.directory, _format.chunk_keys(record.stored_shape, record.chunks))
    refuse_beyond_memory(loc, record, record.nbytes, "it")
    out = _memory.fresh_bytes(record.nbytes)
    return out, _read_chunks(path, loc, record, out.data, list(_format.chunk_keys(record.stored_shape, record.chunks)))


def start_pack_run(loc: Location, pack: PackRecord, start: int, stop: int) -> Callable[[], np.ndarray]:
    """Start reading elements `[start, stop)` (not empty) of a pack the same
    way, in whole chunks. A failure names the pack; the caller finds the leaf."""
    first, count = start // pack.chunk, (stop - 1) // pack.chunk - start // pack.chunk + 1
    # The chunks read, as one array of their own: its chunk files are the pack's from `first` on.
    shape = (count * pack.chunk,)
    chunks, compression = (pack.chunk,), pack.compression
    record = LeafRecord(
        pack.name, [], "numpy", shape, pack.dtype, shape, pack.dtype, "plain", chunks, compression=compression
    )
    keys = [_format.chunk_key([first + i]) for i in range(count)]
    path = _check_chunk_files(loc, record, pack.name, iter(keys))
    out = _memory.fresh_bytes(record.nbytes)
    reads = _read_chunks(path, loc, record, out.data, keys)

    def finish() -> np.ndarray:
        reads.wait()
        offset = first * pack.chunk
        return out.view(dtype_from_name(pack.dtype))[start - offset : stop - offset]

    return finish


def start_chunks(loc: Location, record: LeafRecord, first: int, count: int, out: memoryview) -> Callable[[], None]:
    """Start reading `count` chunks of a leaf, from chunk `first` on its first
    axis, checked the same way, into the reused buffer `out` (cut at the leaf's end)."""
    keys = [_format.chunk_key([first + i, *[0] * (len(record.chunks) - 1)]) for i in range(count)]
    path = _check_chunk_files(loc, record, record.directory, iter(keys))
    reads = _read_chunks(path, loc, record, out, keys)
    return reads.wait


def _check_chunk_files(loc: Location, record: LeafRecord, directory: str, keys: Iterator[str]) -> str:
    """Check the array's folder `directory` and its chunk files `keys`; the folder's path."""
    _faults.fire("local_read.check_files", directory)
    refuse_links(loc, directory, leaf=record.path)
    path = os.path.join(loc.local or "", directory)
    folder = _open_folder(path, loc, record)
    try:
        for key in keys:
            os.close(_open_chunk(folder, loc, record, key, directory))
    finally:
        os.close(folder)
    return path


def _open_folder(path: str, loc: Location, record: LeafRecord) -> int:
    try:
        return os.open(path, _FOLDER_FLAGS)
    except OSError as e:
        raise _damaged(loc, record, f"its folder cannot be opened ({e.strerror})") from None


def _open_chunk(folder: int, loc: Location, record: LeafRecord, key: str, directory: str) -> int:
    """Open a chunk file below the array's folder (open as `folder`), following
    no link; check it is a regular file of one full chunk and its checksum."""
    try:
        fd = _open_below(folder, key)
    except FileNotFoundError:
        raise _damaged(loc, record, _size_message(record, key, None)) from None
    except OSError as e:
        refuse_links(loc, f"{directory}/{key}", leaf=record.path)
        refuse_special(loc, f"{directory}/{key}", leaf=record.path)  # a socket cannot be opened at all
        raise _damaged(loc, record, f"its chunk file {_name(record, key)!r} cannot be opened ({e.strerror})") from None
    try:
        st = local_stat(fd)
        kind = special(st.st_mode) or ("" if stat.S_ISREG(st.st_mode) else "a folder")
        if kind:
            raise _damaged(loc, record, f"its chunk file {_name(record, key)!r} is {kind}, not a regular file")
        wrong = wrong_size(_name(record, key), st.st_size, record.chunk_nbytes, record.compression)
        if wrong is not None:
            raise _damaged(loc, record, wrong)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reopen_chunk(path: str, loc: Location, record: LeafRecord, key: str) -> int:
    """`_open_chunk` of `key` in the array's folder `path`, in a reading thread."""
    folder = _open_folder(path, loc, record)
    try:
        return _open_chunk(folder, loc, record, key, os.path.relpath(path, loc.local or ""))
    finally:
        os.close(folder)


def _open_below(folder: int, key: str) -> int:
    """`os.open` of `key` relative to `folder`, one component at a time, each with
    `O_NOFOLLOW`: a link anywhere below the folder fails the open."""
    *directories, name = key.split("/")
    current = folder
    try:
        for part in directories:
            parent, current = current, os.open(part, _FOLDER_FLAGS, dir_fd=current)
            if parent != folder:
                os.close(parent)
        return os.open(name, _FILE_FLAGS, dir_fd=current)
    finally:
        if current != folder:
            os.close(current)


def _read_chunks(path: str, loc: Location, record: LeafRecord, out: memoryview, keys: list[str]) -> _Reads:
    """Start reading the chunk files `keys` into their slices of `out`."""
    _faults.fire("local_read.start_reads", path, keys)
    size = record.chunk_nbytes
    # Only the last chunk runs past the array (zarr stores edge chunks full-size):
    # its padding is read, for the checksum, into a buffer dropped on return.
    padding = memoryview(bytearray(len(keys) * size - len(out)))
    checksums = memoryview(bytearray(_format.CHECKSUM_BYTES * len(keys)))
    chunks = []
    for i, key in enumerate(keys):
        data = out[i * size : (i + 1) * size]
        stored = checksums[_format.CHECKSUM_BYTES * i : _format.CHECKSUM_BYTES * (i + 1)]
        chunks.append((key, [data, padding if len(data) < size else padding[:0]], stored))
    reads = _Reads(loc, record, chunks)
    pool = _window.read_pool()
    try:
        for key, segments, stored in chunks:
            pieces: list[tuple[int, concurrent.futures.Future[int]]] = []
            reads.futures.append(pieces)  # before submitting: an interrupt then still finds every read
            if record.compression:  # read whole, then decompressed into the segments (on every core)
                job = _window.codec_pool().submit(_read_compressed, path, loc, record, key, segments, stored)
                pieces.append((0, job))
                continue
            for offset, views, checked in _pieces([*segments, stored]):
                pieces.append((checked, pool.submit(_read_piece, path, loc, record, key, offset, views, checked)))
    except BaseException:
        reads.settle()
        raise
    return reads


class _Reads:
    """The reads of one array's chunk files, started."""

    def __init__(self, loc: Location, record: LeafRecord, chunks: list[tuple[str, list[memoryview], memoryview]]):
        self.loc, self.record, self.chunks = loc, record, chunks
        # Per chunk file, (bytes checked, future of their crc32c) for each piece.
        self.futures: list[list[tuple[int, concurrent.futures.Future[int]]]] = []

    def wait(self, on_bytes: Callable[[int], None] | None = None) -> None:
        """Wait for the reads, checking each chunk's checksum (its pieces'
        checksums, joined) in order, as soon as its pieces are read; then
        `on_bytes` of its bytes."""
        try:
            for (key, segments, stored), pieces in zip(self.chunks, self.futures):
                computed = 0
                for checked, piece in pieces:
                    computed = crc32c_combine(computed, piece.result(), checked)
                _check_crc(self.loc, self.record, key, computed, stored)
                if on_bytes is not None:
                    on_bytes(len(segments[0]))
        except BaseException:
            self.settle()
            raise

    def settle(self) -> None:
        """Cancel the reads not started, and wait for the others."""
        _interrupts.stop([piece for pieces in self.futures for _, piece in pieces])


def _pieces(segments: list[memoryview]) -> Iterator[tuple[int, list[memoryview], int]]:
    """(file offset, buffers, bytes to check) for each piece of a chunk file,
    `segments` in file order, the checksum last (checked bytes stop before it)."""
    total = sum(len(s) for s in segments)
    cuts = [*range(0, total - _format.CHECKSUM_BYTES, PIECE_BYTES)] or [0]
    for lo, hi in zip(cuts, [*cuts[1:], total]):
        views, position = [], 0
        for segment in segments:
            start, stop = max(lo - position, 0), min(hi - position, len(segment))
            if start < stop:
                views.append(segment[start:stop])
            position += len(segment)
        yield lo, views, max(0, min(hi, total - _format.CHECKSUM_BYTES) - lo)


def _read_piece(
    path: str, loc: Location, record: LeafRecord, key: str, offset: int, views: list[memoryview], checked: int
) -> int:
    """Read one piece of a chunk file into `views`; the crc32c of its first
    `checked` bytes, computed step by step while they are in cache."""
    fd = _reopen_chunk(path, loc, record, key)
    crc, done = 0, 0
    try:
        for step in _steps(views, STEP_BYTES):
            wanted = sum(len(v) for v in step)
            got = _pread_all(fd, step, offset + done)
            if got < wanted:  # the file shrank since it was opened (an overwrite racing this read)
                raise _damaged(loc, record, _size_message(record, key, offset + done + got))
            for view in step:
                n = min(len(view), checked - done)
                if n > 0:
                    crc = crc32c.crc32c(view[:n], crc)
                done += len(view)
    except OSError as e:
        raise leaf_io_error(e, record, loc, "read") from None
    finally:
        os.close(fd)
    return crc


def _read_compressed(
    path: str, loc: Location, record: LeafRecord, key: str, segments: list[memoryview], stored: memoryview
) -> int:
    """Read a compressed chunk file whole, copy its checksum into `stored`, and,
    where its bytes give that checksum, decompress them into `segments`; the
    crc32c of the compressed bytes, which `_Reads.wait` compares."""
    fd = _reopen_chunk(path, loc, record, key)
    try:
        size = local_stat(fd).st_size
        buffer = _compressed_buffer(size)
        if _pread_all(fd, [buffer], 0) < size:  # (an overwrite racing this read)
            raise _damaged(loc, record, f"its chunk file {_name(record, key)!r} shrank as it was read")
    except OSError as e:
        raise leaf_io_error(e, record, loc, "read") from None
    finally:
        os.close(fd)
    data = buffer[: size - _format.CHECKSUM_BYTES]
    stored[:] = buffer[size - _format.CHECKSUM_BYTES : size]
    crc = crc32c.crc32c(data)
    if crc == int.from_bytes(stored, "little"):
        _decompress(loc, record, key, data, segments)
    return crc


def _decompress(loc: Location, record: LeafRecord, key: str, data: memoryview, segments: list[memoryview]) -> None:
    """Decompress a chunk's checked bytes into `segments`; its header must say
    exactly one chunk (fewer bytes would leave some unwritten)."""
    size = _format.decoded_size(record.compression, data)
    if size != record.chunk_nbytes:
        said = "no size" if size is None else f"{size} bytes"
        what = f"its chunk file {_name(record, key)!r} decompresses to {said}, not one chunk of {record.chunk_nbytes}"
        raise _damaged(loc, record, what)
    codec = _format.codec(record.compression, dtype_from_name(record.stored_dtype).itemsize)
    try:
        if not len(segments[1]):
            codec.decode(data, out=segments[0])
            return
        whole = codec.decode(data, out=np.empty(record.chunk_nbytes, np.uint8))
        segments[0][:] = whole[: len(segments[0])]
    except (ValueError, RuntimeError, TypeError) as e:
        raise _damaged(loc, record, f"its chunk file {_name(record, key)!r} does not decompress ({e})") from None


_BUFFERS = threading.local()


def _compressed_buffer(size: int) -> memoryview:
    """This thread's buffer for a compressed chunk file, of at least `size` bytes (kept)."""
    buffer = getattr(_BUFFERS, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _BUFFERS.buffer = memoryview(_memory.fresh_bytes(max(size, 1)).data)
    return buffer[:size]


def _steps(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """`views` cut into consecutive lists of at most `size` bytes each."""
    step: list[memoryview] = []
    room = size
    for view in views:
        while len(view):
            part, view = view[:room], view[room:]
            step.append(part)
            room -= len(part)
            if not room:
                yield step
                step, room = [], size
    if step:
        yield step


def _pread_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill `views` from `offset` on; returns the bytes read (fewer at end of file)."""
    _faults.fire("local_read.read", fd, offset)
    done, views = 0, [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return done


# With `filled`, a range is read in pieces of this many bytes: each piece is
# still in the reading core's cache when `filled` hashes it (docs/benchmarks.md,
# "Hashed as read (issue 84)").
FILL_BYTES = 2**20


def read_range(
    path: str, start: int, end: int, filled: Callable[[np.ndarray, int], None] | None = None
) -> np.ndarray | None:
    """Bytes `start` to `end` of the regular file `path`, in memory
    `jax.device_put` adopts; `None` if the file ends before `end`. `filled(out,
    n)`: called, in this thread, each time the first `n` bytes of `out` are read."""
    size, done = end - start, 0
    piece = size if filled is None else FILL_BYTES
    with local_open(path) as f:
        out = _memory.fresh_empty((size,), np.uint8)
        while done < size:
            want = min(piece, size - done)
            got = _pread_all(f.fileno(), [out.data[done : done + want]], start + done)
            done += got
            if got < want:  # (the file ends early)
                break
            if filled is not None:
                filled(out, done)
    return out if done == size else None


def _check_crc(loc: Location, record: LeafRecord, key: str, computed: int, stored: memoryview) -> None:
    _faults.fire("local_read.crc", key)
    expected = int.from_bytes(stored, "little")
    if computed != expected:
        raise _damaged(
            loc,
            record,
            f"its chunk file {_name(record, key)!r} fails its crc32c checksum (the file records {expected:#010x}, "
            f"its bytes give {computed:#010x}), so they are not the bytes that were saved",
        )


# CRC-32C (Castagnoli), reflected, as the `crc32c` package computes it.
_POLY = 0x82F63B78


def crc32c_combine(crc1: int, crc2: int, length2: int) -> int:
    """The crc32c of `a + b` from `crc1` of `a`, `crc2` of `b` and `len(b)`:
    `crc1` times x^(8 * length2) modulo the polynomial, plus `crc2`."""
    return _multiply(_shift(length2), crc1) ^ crc2


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both in reflected bit order."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..63 (lengths below 2^60 bytes)."""
    out = [1 << 30]  # x^1
    for _ in range(63):
        out.append(_multiply(out[-1], out[-1]))
    return out


_X_2K = _powers()


@_state.memo(64)
def _shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial (a load's pieces have few lengths)."""
    power, k, n = 1 << 31, 3, length  # x^0; x^(8 n) = product of x^(2^k) over the bits of n, from k = 3
    while n:
        if n & 1:
            power = _multiply(_X_2K[k], power)
        n >>= 1
        k += 1
    return power


def _size_message(record: LeafRecord, key: str, size: int | None) -> str:
    """Chunk file `key` of `record` is `size` bytes (`None`: missing), in `wrong_size`'s words."""
    return wrong_size(_name(record, key), size, record.chunk_nbytes, record.compression) or ""


def _name(record: LeafRecord, key: str) -> str:
    """Chunk file `key` of `record`, named from the data root."""
    return f"{record.directory}/{key}"


def _damaged(loc: Location, record: LeafRecord, what: str) -> IntegrityError:
    error = stored_leaf_error(
        IntegrityError,
        f"it is damaged or incomplete: {what}. Nothing was loaded.",
        dotted=record.path,
        path=loc.display,
        fix="If the checkpoint was overwritten or deleted while this read ran, read it again; otherwise restore it "
        "from a good copy, or run `eqx-ckpt verify` to list every damaged leaf.",
    )
    _share.forget_damaged(error, loc.local or "", record)
    return error
