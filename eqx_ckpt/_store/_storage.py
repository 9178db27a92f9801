"""The storage seam: every byte eqx_ckpt reads or writes passes through it.

With `_location`, the only module that imports `tensorstore` (ruff's
banned-api rule); no TensorStore object leaves it. Functions return futures
(TensorStore's `Future`, or a `Mapped` that converts the result when asked);
callers block with `result` only at the public boundary. `_chunk_files`
calls this module, never the reverse.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from .._base import _faults, _interrupts, _location, _state
from .._base._location import Location
from .._ondisk import _format
from .._ondisk._format import LeafRecord, PackRecord
from . import _durable, _memory, _storage_errors, _untrusted
from ._local_paths import (
    LocalEntry as LocalEntry,
    SpecialFileError,
    local_entry as local_entry,
    local_names as local_names,
    local_open,
    local_stat,
    local_walk,
)
from ._storage_errors import read_explained, read_only_store, unreachable, write_error

Future = ts.Future
Promise = ts.Promise

# One context for every open: `memory://` stores persist between calls, and file
# I/O concurrency is bounded per process. TensorStore's default retries spent
# minutes on a refused connection; these give up within seconds, yet still ride
# out a brief 503 or throttling. A kvstore spec's own `"*_request_retries"` wins
# (docs/storage.md).
RETRIES = {
    "http_request_retries": {"max_retries": 4, "initial_delay": "0.25s", "max_delay": "2s"},
    "s3_request_retries": {"max_retries": 5, "initial_delay": "0.25s", "max_delay": "2s"},
    "gcs_request_retries": {"max_retries": 5, "initial_delay": "0.25s", "max_delay": "2s"},
}
CONTEXT = ts.Context(RETRIES)


# A save's arrays on a local disk: no fsync per file (thousands cost seconds);
# the save flushes once before it commits (`_durable.flush`). `file` driver only:
# a `memory://` store lives in its context.
UNSYNCED = ts.Context({"file_io_sync": False})


# Packs read one leaf at a time keep their decoded chunks, so the leaves of one
# chunk read it once. (A child of `CONTEXT`: same `memory://` stores.)
CACHED = ts.Context({"cache_pool": {"total_bytes_limit": 64 * 2**20}}, parent=CONTEXT)


def array_spec(
    loc: Location,
    directory: str,
    *,
    shape: tuple[int, ...],
    stored_dtype: str,
    chunks: list[int],
    compression: str = "",
) -> dict[str, Any]:
    """The spec that creates (or, opened, checks) one leaf's zarr v3 array."""
    return {
        "driver": "zarr3",
        "kvstore": loc.child(directory),
        "metadata": _format.array_metadata(shape, stored_dtype, chunks, compression),
        # A deleted chunk must be an error, not silently read back as zeros...
        "fill_missing_data_reads": False,
        # ...so every chunk is written, even one that equals the fill value.
        "store_data_equal_to_fill_value": True,
    }


def _kvstore(loc: Location, *, synced: bool = True) -> ts.KvStore:
    _faults.fire("storage.open", loc)
    return result(ts.KvStore.open(loc.kvstore, context=_context(loc, synced)))


def _context(loc: Location, synced: bool) -> ts.Context:
    return UNSYNCED if not synced and _location.on_local_disk(loc) else CONTEXT


def result(future: Future | Mapped) -> Any:
    """`future.result()`, but an interrupt waits for the operation first: one
    left running at exit aborts the process, and a save must know whether a
    write happened before it decides what to undo."""
    return _interrupts.finish(future)


def read_file(loc: Location, name: str, *, limit: int) -> bytes | None:
    """The bytes of a small file, or `None` if it does not exist. A file over
    `limit` bytes is a `CorruptCheckpointError`, found before it is read."""
    return read_file_stamped(loc, name, limit=limit)[0]


def read_file_stamped(loc: Location, name: str, *, limit: int) -> tuple[bytes | None, bytes]:
    """`read_file`, and a stamp that changes when the file is replaced (`file_changed`)."""
    _faults.fire("storage.read_file", loc, name)
    if loc.local is not None:
        full = os.path.join(loc.local, name)
        if not _local_file(loc, name).file:
            return None, b""
        _faults.fire("storage.file_found", full)
        # One line opens and enters: an interrupt between the two would leave
        # the file open until the traceback is freed.
        try:
            with local_open(full) as f:
                st = local_stat(f.fileno())
                if st.st_size > limit:
                    raise _storage_errors.too_large(loc, name, limit, st.st_size)
                # As many bytes as the stat says, and one more: a read of
                # `limit` bytes would allocate all of them (256 MiB for a manifest).
                data, stamp = f.read(st.st_size + 1), _stat_stamp(st)
                if st.st_size < len(data) <= limit:  # it grew since the stat: read on, to the limit
                    data += f.read(limit + 1 - len(data))
        except FileNotFoundError:  # deleted since the check (a writer's retention)
            return None, b""
        except SpecialFileError as e:  # put in its place since the check
            raise _untrusted.special_error(loc, name, e.kind) from None
    else:
        with read_explained(loc, name):
            _refuse_large_object(loc, name, limit)
            found = _read(loc, name)
        if found.state != "value":
            return None, found.stamp.generation
        data, stamp = found.value, _digest(found.value) + found.stamp.generation
    if len(data) > limit:  # it grew between the check and the read
        raise _storage_errors.too_large(loc, name, limit, len(data))
    return data, stamp


def file_exists(loc: Location, name: str) -> bool:
    """Whether the file `name` is at `loc`, asked without reading it; refused as `read_file` is."""
    _faults.fire("storage.read_file", loc, name)
    if loc.local is not None:
        return _local_file(loc, name).file
    with read_explained(loc, name):
        return result(Folder(loc).read(name, slice(0, 0))).value is not None


def _local_file(loc: Location, name: str) -> LocalEntry:
    """What is at the local path of file `name`, refusing links and FIFOs, sockets, devices."""
    _untrusted.refuse_links(loc, name)
    entry = local_entry(os.path.join(loc.local or "", name))
    if entry.special:
        raise _untrusted.special_error(loc, name, entry.special)
    return entry


def _refuse_large_object(loc: Location, name: str, limit: int) -> None:
    """On an object store, ask for the one byte past `limit` before downloading."""
    try:
        probe = _read(loc, name, byte_range=slice(limit, limit + 1))
    except ValueError:
        # OUT_OF_RANGE: the file ends before `limit`. (A server that answers
        # otherwise has the size checked after the read.)
        return
    if probe.state == "value" and len(probe.value):
        raise _storage_errors.too_large(loc, name, limit, None)


def _read(loc: Location, name: str, **options: Any) -> Any:
    """One `ts.KvStore.read`; storage that cannot be reached is a `CheckpointConnectionError`."""
    try:
        return result(_kvstore(loc).read(name, **options))
    except Exception as e:
        error = unreachable(loc, e)
        if error is None:
            raise
        raise error from None


def _stat_stamp(st: os.stat_result) -> bytes:
    # A replaced file (written beside, then renamed) has another inode; an
    # edited one another modification time or size.
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_size}".encode()


def file_changed(loc: Location, name: str, stamp: bytes) -> bool:
    """Whether the file `name` is no longer the one `read_file_stamped` stamped."""
    if loc.local is not None:
        try:
            return _stat_stamp(local_stat(os.path.join(loc.local, name))) != stamp
        except FileNotFoundError:
            return True
    with read_explained(loc, name):
        return _changed_since(loc, name, stamp[_DIGEST_BYTES:], stamp[:_DIGEST_BYTES])


def _changed_since(loc: Location, name: str, generation: bytes, digest: bytes | None) -> bool:
    """Whether the file `name` is no longer the one a read found at
    `generation`: one conditional read, of the whole file where `digest` (its
    SHA-256 then) is given, else of one byte. A server that refuses the
    condition is asked for a plain read's generation; one that ignores it is
    judged by what it sends."""
    whole = {} if digest is not None else {"byte_range": slice(0, 1)}
    try:
        found = _read(loc, name, if_not_equal=generation, **whole)
    except ValueError:
        try:
            return _read(loc, name, byte_range=slice(0, 1)).stamp.generation != generation
        except ValueError:
            return True
    if found.state == "unspecified":  # not modified since
        return False
    if found.state != "value":
        return True
    return _digest(found.value) != digest if digest is not None else found.stamp.generation != generation


# On an object store or server, a stamp is the SHA-256 of the file, then its generation.
_DIGEST_BYTES = 32


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def read_file_generation(loc: Location, name: str, *, limit: int) -> tuple[bytes | None, bytes]:
    """`read_file`, and the file's generation, for a conditional write (`write_if`)."""
    _faults.fire("storage.read_generation", loc, name)
    _untrusted.refuse_links(loc, name)
    if loc.local is not None:
        entry = local_entry(os.path.join(loc.local, name))
        if entry.file and entry.size > limit:
            raise _storage_errors.too_large(loc, name, limit, entry.size)
    else:
        _refuse_large_object(loc, name, limit)
    data, generation = read_generation(loc, name)
    if data is not None and len(data) > limit:
        raise _storage_errors.too_large(loc, name, limit, len(data))
    return data, generation


def read_generation(loc: Location, name: str) -> tuple[bytes | None, bytes]:
    """A small file's bytes (`None` if absent) and generation, its size unchecked
    (a lease's reader takes a bounded prefix); a FIFO or a device refused."""
    _untrusted.refuse_special(loc, name)
    found = result(_kvstore(loc).read(name))
    return (found.value if found.state == "value" else None), found.stamp.generation


# The generation of a file that is not there: a write conditional on it
# creates the file only if none is there.
ABSENT = b"\x02"


def write_if(loc: Location, name: str, data: bytes | None, if_equal: bytes) -> bytes | None:
    """Write a small file (delete it, for `None`) only if its generation is
    still `if_equal` (`ABSENT`: no file); its new generation, or `None` if the
    condition failed. A local directory is then synced."""
    try:
        generation = result(_kvstore(loc).write(name, data, if_equal=if_equal)).generation
    except NotImplementedError:
        raise read_only_store(loc) from None
    except Exception as e:
        raise write_error(loc, name, e, "nothing was written") from e
    if not generation:
        return None
    if loc.local is not None:
        _durable.sync_directory(loc.local)
    return generation


def write_conditional(
    loc: Location, name: str, data: bytes, if_equal: bytes
) -> tuple[bool, BaseException | None, BaseException | None]:
    """`write_if`, as `(written, error, interrupt)`: an interrupt waits for the
    write and is returned, for the caller to raise once the outcome is
    recorded. `error`: the write's or the directory sync's failure."""
    _faults.fire("commit.manifest_write", loc, name)
    found, error, interrupt = _interrupts.outcome(_kvstore(loc).write(name, data, if_equal=if_equal))
    if error is not None and "Malformed StorageGeneration" in str(error) and if_equal != b"":
        # A server that reported a generation it cannot be asked for back
        # (gcp-storage-emulator reports 0 on reads): the condition cannot be
        # expressed there, so the write is made without it.
        found, error, interrupted = _interrupts.outcome(_kvstore(loc).write(name, data, if_equal=None))
        interrupt = interrupt or interrupted
    written = error is None and bool(found.generation)
    if written and loc.local is not None:
        try:
            _durable.sync_directory(loc.local)
        except Exception as e:
            error = e
        except BaseException as e:  # the commit happened; the caller raises it afterwards
            interrupt = interrupt or e
    return written, error, interrupt


def write_file(loc: Location, name: str, data: bytes) -> None:
    """Write a small file atomically (TensorStore writes beside, then renames)."""
    try:
        store = _kvstore(loc)
        result(store.write(name, data))
        if loc.local is not None:
            _durable.fsync(loc.local)
    except Exception as e:
        raise write_error(loc, name, e) from e


def write_unpublished(loc: Location, name: str, parts: Iterable[bytes | memoryview]) -> None:
    """Write a file of many parts (an export's shard): on a local disk streamed
    to `name` + `.partial`, durably, for `publish` to rename; elsewhere joined
    and written to `name`."""
    if loc.local is None:
        write_file(loc, name, b"".join(parts))
        return
    path = _unpublished(loc, name)
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)
    _durable.fsync(path)


def publish(loc: Location, names: Iterable[str]) -> None:
    """Give the files `write_unpublished` wrote their names (on a local disk)."""
    if loc.local is not None:
        for name in names:
            os.replace(_unpublished(loc, name), os.path.join(loc.local, name))


def discard_unpublished(loc: Location, names: Iterable[str]) -> None:
    """Remove what `write_unpublished` wrote of `names` and did not publish."""
    if loc.local is not None:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(_unpublished(loc, name))


def _unpublished(loc: Location, name: str) -> str:
    return os.path.join(loc.local or "", name + _format.UNPUBLISHED_SUFFIX)


def start_writes(loc: Location, files: dict[str, bytes], *, synced: bool = True) -> list[Future]:
    """Start writing small files (name -> bytes), each atomically; their futures."""
    store = _kvstore(loc, synced=synced)
    return [store.write(name, data) for name, data in files.items()]


def delete_file(loc: Location, name: str) -> None:
    _faults.fire("storage.delete_file", loc, name)
    result(_kvstore(loc).delete_range(_key_alone(name)))


def list_names(loc: Location) -> list[str]:
    """The top-level entries of a checkpoint directory."""
    _faults.fire("storage.list", loc)
    if loc.local is not None:
        return local_names(loc.local) if local_entry(loc.local).folder else []
    return sorted({key.split("/", 1)[0] for key in list_keys(loc)})


def list_files(loc: Location) -> list[str]:
    """Every file below `loc`, relative and `/`-separated, sorted; a local link is listed, never followed."""
    if loc.local is None:
        return sorted(list_keys(loc))
    _faults.fire("storage.list", loc)
    files: list[str] = []
    for root, folders, names in local_walk(loc.local, strict=True):
        relative = os.path.relpath(root, loc.local)
        prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"
        links = [f for f in folders if local_entry(os.path.join(root, f)).link]  # (never walked into)
        files += [prefix + name for name in names + links]
    return sorted(files)


def list_keys(loc: Location) -> list[str]:
    """Every key below `loc`, relative to it."""
    try:
        keys = result(_kvstore(loc).list())
    except NotImplementedError:
        raise read_only_store(loc) from None
    except Exception as e:
        # A listing that fails is never "nothing there": a manager would read
        # a missing bucket as a run with no steps.
        raise _storage_errors.list_error(loc, e) from e
    if not keys and loc.kvstore.get("driver") == "gcs":
        _check_gcs_listing(loc)
    return [key.decode("utf-8", "replace") for key in keys]


# Where TensorStore's `gcs` driver sends its requests: this variable (an
# emulator), else Google.
GCS_URL_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"


def _check_gcs_listing(loc: Location) -> None:
    """Raise unless an empty `gcs` listing is really empty: the driver lists
    nothing on 401, 403 or 404. Refused credentials fail a read too; a missing
    bucket is a 404 of its metadata."""
    try:
        result(_kvstore(loc).read(_format.MANIFEST, byte_range=slice(0, 0)))  # no bytes: may it be read?
    except Exception as e:
        raise _storage_errors.list_error(loc, e) from e
    bucket = loc.kvstore.get("bucket", "")
    base = os.environ.get(GCS_URL_VARIABLE, "https://storage.googleapis.com").rstrip("/")
    metadata = {"driver": "http", "base_url": f"{base}/storage/v1/b/"}  # the bucket's name is the key
    try:
        found = result(result(ts.KvStore.open(metadata, context=CONTEXT)).read(bucket))
    except Exception:
        return  # refused (401, 403) or failing: the bucket is there, or nothing more can be told
    if found.state == "missing":
        raise _storage_errors.missing_bucket(loc, bucket)


def remove(loc: Location, names: Iterable[str]) -> None:
    """Remove top-level entries (files or directories) of a checkpoint."""
    _faults.fire("storage.remove", loc, names)
    names = list(names)
    if loc.local is not None:
        for name in names:
            full = os.path.join(loc.local, name)
            entry = local_entry(full)
            if entry.folder and not entry.link:
                shutil.rmtree(full, ignore_errors=True)
                if local_entry(full).found:
                    # A file that landed while the tree was removed: once more, and
                    # an error now is raised (the caller's journal keeps the name).
                    shutil.rmtree(full)
            elif entry.found:
                os.unlink(full)
        return
    store = _kvstore(loc)
    for future in [store.delete_range(r) for name in names for r in _ranges(name)]:
        result(future)


def remove_written(loc: Location, names: Iterable[str]) -> None:
    """Remove every file `written_by_a_save` under the top-level entries
    `names`, then every folder left empty. Anything else (a user's notes in a
    leaf's folder) stays, with the folders that lead to it (SPEC 3)."""
    _faults.fire("storage.remove_written", loc, names)
    names = list(names)
    if loc.local is None:
        store = _kvstore(loc)
        ranges = [r for name in names for r in _ranges(name)]
        keys = [key.decode("utf-8", "surrogateescape") for r in ranges for key in result(store.list(r))]
        futures = [store.delete_range(_key_alone(k)) for k in keys if _format.written_by_a_save(k)]
        for future in futures:
            result(future)
        return
    for name in names:
        full = os.path.join(loc.local, name)
        entry = local_entry(full)
        if entry.link:
            _unlink(full)  # in place of an entry a save wrote: the link goes, never what it points to
            continue
        if not entry.folder:
            if entry.found and _format.written_by_a_save(name):
                _unlink(full)
            continue
        for root, folders, files in local_walk(full, bottom_up=True, strict=True):
            relative = os.path.relpath(root, loc.local).replace(os.sep, "/")
            links = [f for f in folders if local_entry(os.path.join(root, f)).link]  # (never walked into)
            for file in files + links:
                if _format.written_by_a_save(f"{relative}/{file}"):
                    _unlink(os.path.join(root, file))
            try:
                os.rmdir(root)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise


def _key_alone(name: str) -> ts.KvStore.KeyRange:
    return ts.KvStore.KeyRange(name, name + "\0")


def _ranges(name: str) -> tuple[ts.KvStore.KeyRange, ts.KvStore.KeyRange]:
    """The key `name` alone, and the keys inside a folder `name` ("0" follows "/")."""
    return _key_alone(name), ts.KvStore.KeyRange(name + "/", name + "0")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Array:
    """An opened array, the only form in which one leaves this module: a thin
    wrapper of TensorStore's (no copy); a region is another `Array`, and reads
    and writes return futures."""

    __slots__ = ("_array",)

    def __init__(self, array: Any):
        self._array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype_name(self) -> str:
        """Its data type's name (`float32`, `bfloat16`, `string`...)."""
        return str(self._array.dtype.name)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self._array.dtype.numpy_dtype)

    @property
    def read_chunk_shape(self) -> tuple[int, ...]:
        """The shape of the chunks it is read in (`()` where it has none)."""
        return tuple(self._array.chunk_layout.read_chunk.shape or ())

    def __getitem__(self, index: Any) -> Array:
        return Array(self._array[index])

    def read(self) -> Future:
        """A future of a NumPy array."""
        return self._array.read()

    def write(self, value: np.ndarray, transaction: Transaction | None = None) -> Future:
        """Start writing `value` into it; a future of the write. Staged in
        `transaction`, it references `value`, which must not change until the
        commit writes it out."""
        if transaction is None:
            return self._array.write(value)
        staged = self._array.with_transaction(transaction._transaction)
        return staged.write(value, can_reference_source_data_indefinitely=True)


class Transaction:
    """A (non-atomic) transaction: writes staged in it (`Array.write`) are
    written out only by its `commit`."""

    __slots__ = ("_transaction",)

    def __init__(self) -> None:
        self._transaction = ts.Transaction()

    def commit(self) -> Future:
        """Start writing out what was staged: its future."""
        return self._transaction.commit_async()

    def abort(self) -> None:
        """Drop what was staged: nothing of it is written."""
        self._transaction.abort()


class Mapped:
    """A future of TensorStore's result made into this module's type (an
    `Array`, a `Found`) when asked for; `result`, `done`, `add_done_callback`."""

    __slots__ = ("_future", "_make")

    def __init__(self, future: Any, make: Callable[[Any], Any]):
        self._future, self._make = future, make

    def result(self) -> Any:
        return self._make(self._future.result())

    def done(self) -> bool:
        return bool(self._future.done())

    def add_done_callback(self, callback: Callable[[Mapped], None]) -> None:
        self._future.add_done_callback(lambda _: callback(self))


class Found(NamedTuple):
    """What a read of a file found: its bytes (`None` where there is no file)
    and its storage generation (see `Folder.changed`)."""

    value: bytes | None
    generation: bytes


def _found(read: Any) -> Found:
    return Found(read.value if read.state == "value" else None, read.stamp.generation)


class Folder:
    """The files of one directory of another program's checkpoint, opened once
    for the many byte-range reads of its arrays (`_safetensors`)."""

    __slots__ = ("_store", "loc")

    def __init__(self, loc: Location):
        self.loc, self._store = loc, _kvstore(loc)

    def names(self) -> list[str] | None:
        """The files of a local directory; `None` for any other (an object store's is not listed)."""
        if self.loc.local is None or not local_entry(self.loc.local).folder:
            return None
        return local_names(self.loc.local)

    def read(self, name: str, byte_range: slice | None = None) -> Mapped:
        """Start reading the file `name` (its bytes `byte_range`, else all):
        a future of a `Found`. A range past the end fails (`OUT_OF_RANGE`); a
        local FIFO, socket or device is a `CorruptCheckpointError` at once."""
        _untrusted.refuse_special(self.loc, name)  # before TensorStore opens it: a FIFO's open waits forever
        return Mapped(self._store.read(name, byte_range=byte_range), _found)

    def read_file(self, name: str, *, limit: int) -> bytes | None:
        return read_file(self.loc, name, limit=limit)

    def listed_size(self, name: str) -> int | None:
        """The bytes of the file `name` where they are known without a request: never, here."""
        return None

    def changed(self, name: str, generation: bytes) -> bool:
        """Whether the file `name` is no longer the one a read found at `generation`."""
        return _changed_since(self.loc, name, generation, None)


def open_local_file(path: str) -> io.BufferedReader:
    """A local file of another program's checkpoint (an `.eqx` file), opened to
    read; anything but a regular file is a `CorruptCheckpointError`."""
    try:
        return local_open(path)
    except SpecialFileError as e:
        where = Location({"driver": "file", "path": path}, path, os.path.dirname(path))
        raise _untrusted.special_error(where, os.path.basename(path), e.kind) from None


def local_remaining(f: io.BufferedReader) -> int:
    """The bytes of the file `f` (from `open_local_file`) after its position."""
    return local_stat(f.fileno()).st_size - f.tell()


def transaction() -> Transaction:
    _faults.fire("storage.transaction")
    return Transaction()


def _opening(future: Any) -> Mapped:
    return Mapped(future, Array)


def _leaf_spec(loc: Location, record: LeafRecord) -> dict[str, Any]:
    """The spec of a leaf's own zarr v3 array, as its record describes it."""
    return array_spec(
        loc,
        record.directory,
        shape=record.stored_shape,
        stored_dtype=record.stored_dtype,
        chunks=list(record.chunks),
        compression=record.compression,
    )


def create_array(loc: Location, record: LeafRecord, *, synced: bool = True) -> Mapped:
    return create_spec(_leaf_spec(loc, record), loc, synced=synced)


def create_spec(spec: dict[str, Any], loc: Location, *, synced: bool = True) -> Mapped:
    """Create an array from its full spec: a future of its `Array`."""
    _faults.fire("storage.create_array", loc)
    return _opening(ts.open(spec, create=True, context=_context(loc, synced)))


def open_array(loc: Location, record: LeafRecord, *, synced: bool = True, checked: bool = True) -> Future | Mapped:
    """Open a stored leaf (a packed one in memory): a future of its `Array`.
    Without `checked`, the manifest's metadata is trusted over its zarr.json
    (chunks that do not decode that way fail their checksum)."""
    _faults.fire("storage.open_array", loc, record)
    if record.pack is not None:
        return open_packed(loc, record)
    _untrusted.check_leaf_files(loc, record)
    _memory.refuse_beyond_memory(loc, record, record.chunk_nbytes, "one of its chunks")
    spec = _leaf_spec(loc, record)
    return _opening(ts.open(spec, open=True, assume_metadata=not checked, context=_context(loc, synced)))


def open_to_write(loc: Location, record: LeafRecord) -> Mapped:
    """Open a leaf's array another process of this save created, to write
    shards into it (`open_array`'s file checks fail while others write)."""
    _faults.fire("storage.open_array", loc, record)
    spec = _leaf_spec(loc, record)
    return _opening(ts.open(spec, open=True, context=_context(loc, synced=False)))


def open_spec(spec: dict[str, Any], loc: Location, *, cached: bool = False) -> Mapped:
    """Open an existing array from its full spec; `cached` keeps decoded chunks (`CACHED`)."""
    return _opening(ts.open(spec, open=True, context=CACHED if cached else CONTEXT))


def pack_spec(loc: Location, pack: PackRecord) -> dict[str, Any]:
    """The spec of a pack's zarr v3 array (see `_pack`)."""
    shape, chunks = (pack.size,), [pack.chunk]
    return array_spec(loc, pack.name, shape=shape, stored_dtype=pack.dtype, chunks=chunks, compression=pack.compression)


# Packs opened for reading single leaves (lazy leaves, verify, diff), so a
# hundred leaves of one chunk read it once. Keyed by a digest, not the spec
# (an http URL's query may hold a token).
_OPEN: _state.Table[bytes, Mapped] = _state.table("storage.open_packs", 8, "lru")


def open_pack(loc: Location, pack: PackRecord, *, cached: bool, leaf: str | None = None) -> Mapped:
    """A future of the pack's `Array`; `leaf` names the leaf it is opened for."""
    _faults.fire("storage.open_pack", loc, pack)
    _untrusted.check_pack_files(loc, pack, leaf=leaf)
    if not cached:
        return open_spec(pack_spec(loc, pack), loc)
    key = json.dumps([loc.kvstore, pack.name, pack.size, pack.chunk, pack.commit], sort_keys=True)
    digest = hashlib.sha256(key.encode()).digest()
    opened = _OPEN.recent(digest)
    return opened if opened is not None else _OPEN.put(digest, open_spec(pack_spec(loc, pack), loc, cached=True))


def open_packed(loc: Location, record: LeafRecord) -> Future:
    """A future of one (small) packed leaf, read now, as an in-memory `Array`."""
    assert record.pack is not None
    opened = open_pack(loc, record.pack, cached=True, leaf=record.path)
    promise, future = pending()
    try:
        read = opened.result()[record.offset : record.offset + record.size].read()
    except Exception as e:  # raised by whoever waits for the leaf, as any read error
        promise.set_exception(e)
        return future

    def done(f: Any) -> None:
        try:
            promise.set_result(in_memory(f.result().reshape(record.stored_shape)))
        except Exception as e:
            promise.set_exception(e)

    read.add_done_callback(done)
    return future


# -- For the readers of other formats (`_safetensors`, `_orbax`) ------------------------------------


def open_for_reading(specs: list[dict[str, Any]]) -> list[Mapped]:
    """Open another program's arrays read-only from their full specs: futures
    of their `Array`s. A context of their own: an orbax checkpoint saved
    again at one path is another OCDBT database, which a shared open refuses."""
    context = ts.Context({"cache_pool": {}, "ocdbt_coordinator": {}}, parent=CONTEXT)
    return [_opening(ts.open(spec, open=True, read=True, context=context)) for spec in specs]


def pending() -> tuple[Promise, Future]:
    """A promise and its future, for a result a callback sets later."""
    return ts.Promise.new()


def ready(value: Any) -> Future:
    """A future that already holds `value`."""
    promise, future = pending()
    promise.set_result(value)
    return future


def virtual_array(
    read: Callable[[tuple[int, int] | None, np.ndarray], Future],
    *,
    dtype: Any,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
) -> Array:
    """A read-only `Array` whose chunks `read(rows, array)` fills (a future);
    `rows`: the chunk's `(first, end)` on the first axis (`None`: a scalar)."""

    def fill(domain: Any, array: np.ndarray, _: Any) -> Future:
        return read((domain[0].inclusive_min, domain[0].exclusive_max) if shape else None, array)

    layout = ts.ChunkLayout(read_chunk_shape=chunks) if shape else None
    return Array(ts.virtual_chunked(fill, dtype=ts.dtype(np.dtype(dtype).name), shape=shape, chunk_layout=layout))


def in_memory(array: np.ndarray) -> Array:
    """A NumPy array as an `Array` (the type every opened leaf has)."""
    return Array(ts.array(array))
