"""Reading and writing through TensorStore: small files, listings, and arrays.

Everything here returns or composes TensorStore futures; callers block with
`.result()` only at the public boundary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import queue
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tensorstore as ts

from ._errors import (
    CheckpointConnectionError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointTypeError,
    CorruptCheckpointError,
    IntegrityError,
    stored_leaf_error,
)
from ._local import check_leaf_files, check_pack_files, refuse_links
from ._manifest import LeafRecord
from ._spec import CACHED, CONTEXT, UNSYNCED, Location, array_spec

__all__ = ["check_pack_files", "refuse_links"]


def kvstore(loc: Location, *, synced: bool = True) -> ts.KvStore:
    return result(ts.KvStore.open(loc.kvstore, context=_context(loc, synced)))


def _context(loc: Location, synced: bool) -> ts.Context:
    return UNSYNCED if not synced and on_local_disk(loc) else CONTEXT


def result(future: ts.Future) -> Any:
    """`future.result()`, except that an interrupt (Ctrl-C, `sys.exit` from a
    signal handler) waits for the operation to finish before it is raised: an
    operation left running when the interpreter exits aborts the process, and a
    save must know whether a write happened before it decides what to undo."""
    try:
        return future.result()
    except Exception:
        raise
    except BaseException:
        while not future.done():
            with contextlib.suppress(BaseException):
                future.result()
        raise


def uninterrupted(fn: Callable[[], Any]) -> None:
    """Run `fn` to its end, however the caller is interrupted.

    Python raises an interrupt (Ctrl-C, `sys.exit` from a signal handler) in the
    main thread, between any two bytecodes: also between a call that starts an
    operation and the line that keeps its future, which is then lost, and a
    save cannot know what it must wait for before it undoes anything (a
    manifest write that landed after the abort deleted the arrays committed a
    checkpoint without its data). In the main thread, `fn` therefore runs in a
    helper thread, which signals never reach: it keeps what it starts (it
    stores its results itself, in objects the caller holds), and an interrupt
    while waiting is raised once `fn` has finished. In other threads `fn` just
    runs. `fn`'s own error is raised as it is.

    (Not `Thread.join`: an interrupted join in Python 3.11 can mark a running
    thread as finished, and the next join returns at once.)
    """
    if threading.current_thread() is not threading.main_thread():
        fn()
        return
    _ensure_helper()  # an interrupt here has started nothing
    job = _Job(fn)
    interrupt: BaseException | None = None
    while True:
        # An interrupt may land before or after the job is queued: it is queued
        # again, and runs once. (Once, it landed in the wait loop's condition,
        # outside any `try`: the save aborted while the queued manifest write
        # went on, and committed a checkpoint whose arrays the abort deleted.)
        try:
            _JOBS.put(job)
            break
        except BaseException as e:
            interrupt = interrupt or e
    while True:
        try:
            if job.done.wait(0.05):
                break
        except BaseException as e:
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
    if job.error is not None:
        raise job.error


class _Job:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._claim = threading.Lock()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # queued twice (see `uninterrupted`): it runs once
        try:
            self.fn()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


_JOBS: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_HELPERS: list[threading.Thread] = []


def _helper() -> None:
    while True:
        _JOBS.get().run()


def _ensure_helper() -> None:
    """Start the helper thread of `uninterrupted` unless one runs. Two threads
    starting at once, or a start cut short by an interrupt, may leave two
    helpers, which is harmless: each job is taken from the queue once. (No lock
    here: one that an interrupt left held would stop every later save.)"""
    if not any(thread.is_alive() for thread in _HELPERS):
        thread = threading.Thread(target=_helper, name="eqx_ckpt-io", daemon=True)
        thread.start()
        _HELPERS.append(thread)


def on_local_disk(loc: Location) -> bool:
    """Whether `loc` is a local directory reached through the `file` driver (so
    writes can skip fsync and must then be flushed, and eqx_ckpt may read and
    write its chunk files itself)."""
    return loc.local is not None and loc.kvstore.get("driver") == "file"


def flush(loc: Location) -> None:
    """Make everything written under `loc` without fsync durable, before a commit.

    Every file (and directory) is fsynced, many at once: the file system's journal
    batches concurrent syncs, where one fsync after each write would wait for each.
    When a save wrote many files to a local ext4, XFS or Btrfs file system, one
    `syncfs` of that file system replaces them (for 10,000 leaves, 0.6-1.3 s
    instead of 5.7-7.9 s on a busy machine); it may also wait for other programs'
    unwritten data there, which is why a save of a few files fsyncs them instead.
    Other file systems (network, FUSE) always get an fsync per file: their
    `syncfs` may not reach the server.

    In a multi-process save the other processes may still be writing here: their
    temporary files (TensorStore's `*.__lock`) come and go, so those are skipped
    and a file that vanishes before it is opened is not an error. What each process
    wrote is final before it flushes, and each process flushes, so every file and
    directory entry of the save is synced by the process that wrote it.
    """
    local = loc.local if on_local_disk(loc) else None
    if local is None:
        return
    paths = [local]
    for root, dirs, files in os.walk(local):
        paths.extend(os.path.join(root, name) for name in [*dirs, *files] if not name.endswith(TEMPORARY))
    if len(paths) >= SYNCFS_FROM and _syncfs_is_complete(local):
        _syncfs(local)
        return
    sync = functools.partial(_fsync, missing_ok=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
            for _ in pool.map(sync, paths):
                pass
    except RuntimeError:  # at interpreter exit no thread pool starts: one at a time, then
        for path in paths:
            sync(path)


# The file driver writes `<name>` as `<name>.__lock` and renames it into place.
TEMPORARY = ".__lock"
# From how many files and directories a flush syncs the whole file system.
SYNCFS_FROM = 256
# `statfs` magic numbers of the local file systems whose `syncfs` writes back every
# file and commits the journal: ext2/3/4, XFS, Btrfs.
_SYNCFS_FILE_SYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E})


def _fsync(path: str, *, missing_ok: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def file_system_type(path: str) -> int | None:
    """The `statfs` magic number of the file system holding `path`, on 64-bit
    Linux; None elsewhere or when unknown."""
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes; f_type comes first
    if _libc().statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value


def _syncfs_is_complete(path: str) -> bool:
    return file_system_type(path) in _SYNCFS_FILE_SYSTEMS


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs failed: {os.strerror(error)}", path)
    finally:
        os.close(fd)


def read_file(loc: Location, name: str, *, limit: int) -> bytes | None:
    """The bytes of a small file, or `None` if it does not exist. A file of more
    than `limit` bytes is a `CorruptCheckpointError`, found before it is read (on
    an object store, by asking for the one byte past the limit), so a hostile
    checkpoint cannot make us download or allocate a huge file."""
    return read_file_stamped(loc, name, limit=limit)[0]


def read_file_stamped(loc: Location, name: str, *, limit: int) -> tuple[bytes | None, bytes]:
    """`read_file`, and a stamp that changes whenever the file is replaced (see
    `file_changed`)."""
    if loc.local is not None:
        full = os.path.join(loc.local, name)
        refuse_links(loc, name)
        if not os.path.isfile(full):
            return None, b""
        try:
            f = open(full, "rb")
        except FileNotFoundError:  # deleted since the check (a writer's retention)
            return None, b""
        with f:
            st = os.fstat(f.fileno())
            if st.st_size > limit:
                raise _too_large(loc, name, limit, st.st_size)
            data, stamp = f.read(limit + 1), _stat_stamp(st)
    else:
        with read_explained(loc, name):
            _refuse_large_object(loc, name, limit)
            found = _read(loc, name)
        if found.state != "value":
            return None, found.stamp.generation
        data, stamp = found.value, _digest(found.value) + found.stamp.generation
    if len(data) > limit:  # it grew between the check and the read
        raise _too_large(loc, name, limit, len(data))
    return data, stamp


def _refuse_large_object(loc: Location, name: str, limit: int) -> None:
    """On an object store, ask for the one byte past `limit` before downloading."""
    try:
        probe = _read(loc, name, byte_range=slice(limit, limit + 1))
    except ValueError:
        # OUT_OF_RANGE: the file ends before `limit`. (Some servers answer a range
        # past the end otherwise, e.g. gcp-storage-emulator with a malformed
        # Content-Range: the size is then checked after the read.)
        return
    if probe.state == "value" and len(probe.value):
        raise _too_large(loc, name, limit, None)


def _read(loc: Location, name: str, **options: Any) -> Any:
    """One read of a file of an object store or server (`ts.KvStore.read`);
    storage that cannot be reached is a `CheckpointConnectionError`."""
    try:
        return result(kvstore(loc).read(name, **options))
    except Exception as e:
        error = unreachable(loc, e)
        if error is None:
            raise
        raise error from None


# curl's codes for a connection that was never made: a proxy (5) or host (6)
# name that does not resolve, a refused connection (7), a timeout (28).
# TensorStore reports them, once its retries are spent, as `[curl_code='7']`.
_UNREACHABLE = re.compile(r"\[curl_code='(5|6|7|28)'\]")


# TensorStore's codes for storage that answered but would not serve: forbidden
# (HTTP 403, or a local file's permissions), unauthenticated (401), failing
# (5xx: `ABORTED: All 4 retry attempts failed`, or `UNAVAILABLE`).
_REFUSED = re.compile(r"^(PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE|ABORTED):")


# The OS's codes for a destination that will not take a write: forbidden
# (EACCES, EPERM), read-only (EROFS), full (ENOSPC, EDQUOT, and EFBIG past a
# file size limit), failing (EIO). TensorStore writes them as `[os_error_code='28']`
# (or `[OS error 28: ...]`).
_WRITE_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
_OS_ERROR = re.compile(r"(?:\[OS error |\[os_error_code=')(\d+)")


def write_refusal(error: BaseException) -> type[CheckpointStorageError] | None:
    """The class of error for a write that failed with `error` (TensorStore's or
    the OS's) because of the storage: `CheckpointConnectionError` when it could
    not be reached, `CheckpointStorageError` when it would not take the write
    (forbidden, read-only, full, failing once the retries were spent); `None`
    for any other failure."""
    if isinstance(error, CheckpointStorageError):
        return type(error)
    text = explain(error)
    if _UNREACHABLE.search(text):
        return CheckpointConnectionError
    codes = {int(code) for code in _OS_ERROR.findall(text)}
    if isinstance(error, OSError) and error.errno is not None:
        codes.add(error.errno)
    if _REFUSED.match(text) or codes & _WRITE_REFUSED:
        return CheckpointStorageError
    return None


def storage_failure(loc: Location, error: BaseException, what: str) -> CheckpointStorageError | None:
    """The error for storage that could not be reached or would not serve
    `what` (a file, a leaf), if `error` (TensorStore's) says so; `None` for any
    other failure."""
    connection = unreachable(loc, error)
    text = explain(error)
    if connection is not None or not _REFUSED.match(text):
        return connection
    return CheckpointStorageError(
        f"The storage would not serve {what} of checkpoint {loc.display!r}: {text}. The checkpoint may well be "
        f"whole: check that you may read it (credentials, permissions) and that the storage works, then try again.",
        path=loc.display,
    )


def unreachable(loc: Location, error: BaseException) -> CheckpointConnectionError | None:
    """The error for storage that could not be reached, if `error` (TensorStore's)
    says so; `None` for any other failure."""
    text = explain(error)
    if not _UNREACHABLE.search(text):
        return None
    return CheckpointConnectionError(
        f"Cannot reach {loc.display!r}: {text}. Check the URL (host name and port) and that the server is "
        f"running and reachable from this machine, then try again.",
        path=loc.display,
    )


def _too_large(loc: Location, name: str, limit: int, size: int | None) -> CorruptCheckpointError:
    shown = f"is {size} bytes, more than the {limit} allowed" if size is not None else f"holds more than {limit} bytes"
    return CorruptCheckpointError(
        f"The file {name!r} of checkpoint {loc.display!r} {shown}, so it "
        f"was not read. The checkpoint is damaged or was not written by eqx_ckpt; do not load it.",
        path=loc.display,
    )


def _stat_stamp(st: os.stat_result) -> bytes:
    # A replaced file (written beside, then renamed) has another inode; an
    # edited one another modification time or size.
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_size}".encode()


def file_changed(loc: Location, name: str, stamp: bytes) -> bool:
    """Whether the file `name` is no longer the one `read_file_stamped` stamped."""
    if loc.local is not None:
        try:
            return _stat_stamp(os.stat(os.path.join(loc.local, name))) != stamp
        except FileNotFoundError:
            return True
    digest, generation = stamp[:_DIGEST_BYTES], stamp[_DIGEST_BYTES:]
    with read_explained(loc, name):
        try:
            found = _read(loc, name, if_not_equal=generation)
        except ValueError:
            # A server whose generations TensorStore cannot send back in a condition
            # (gcp-storage-emulator's): compare the generation of a one-byte read.
            return _read(loc, name, byte_range=slice(0, 1)).stamp.generation != generation
    if found.state == "unspecified":  # not modified since
        return False
    # A plain HTTP server may send the file again although it is unchanged: one
    # that ignores `If-None-Match` or sends no `ETag` (Python's own http.server
    # does both). Its content then decides.
    return found.state != "value" or _digest(found.value) != digest


# On an object store or server, a stamp is the SHA-256 of the file, then its generation.
_DIGEST_BYTES = 32


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def read_file_generation(loc: Location, name: str, *, limit: int) -> tuple[bytes | None, bytes]:
    """`read_file`, and the file's TensorStore storage generation, for a write
    conditional on it (`write_conditional`)."""
    refuse_links(loc, name)
    if loc.local is not None:
        full = os.path.join(loc.local, name)
        if os.path.isfile(full) and os.path.getsize(full) > limit:
            raise _too_large(loc, name, limit, os.path.getsize(full))
    else:
        _refuse_large_object(loc, name, limit)
    found = result(kvstore(loc).read(name))
    if found.state != "value":
        return None, found.stamp.generation
    if len(found.value) > limit:
        raise _too_large(loc, name, limit, len(found.value))
    return found.value, found.stamp.generation


def write_conditional(
    loc: Location, name: str, data: bytes, if_equal: bytes
) -> tuple[bool, BaseException | None, BaseException | None]:
    """Write a small file only if its generation is still `if_equal`.

    Returns `(written, error, interrupt)`. An interrupt (Ctrl-C, `sys.exit`
    from a signal handler) while the write is under way does not abandon it:
    the write is waited for, so that whether it happened is known, and the
    interrupt is returned for the caller to raise once that is recorded.
    `error` is the write's failure or, once written, the directory sync's, as
    raised: the caller, which can tell whether the file is its own, says what
    it left."""
    future = kvstore(loc).write(name, data, if_equal=if_equal)
    interrupt: BaseException | None = None
    error: BaseException | None = None
    written = False
    while True:
        try:
            written = bool(future.result().generation)
            break
        except Exception as e:
            if "Malformed StorageGeneration" in str(e) and if_equal != b"":
                # A server that reported a generation it cannot be asked for
                # back (gcp-storage-emulator reports 0 on reads): the condition
                # cannot be expressed there, so the write is made without it.
                future, if_equal = kvstore(loc).write(name, data), b""
                continue
            error = e
            break
        except BaseException as e:  # kept and returned, so the write's outcome is known first
            interrupt = interrupt or e
    if written and loc.local is not None:
        try:
            sync_directory(loc.local)
        except Exception as e:
            error = e
        except BaseException as e:  # the commit happened; the caller raises it afterwards
            interrupt = interrupt or e
    return written, error, interrupt


def sync_directory(path: str) -> None:
    """Make the entries of a local directory (created, renamed, deleted) durable."""
    _fsync(path)


def write_file(loc: Location, name: str, data: bytes) -> None:
    """Write a small file atomically (TensorStore writes beside, then renames)."""
    try:
        store = kvstore(loc)
        result(store.write(name, data))
        if loc.local is not None:
            _fsync(loc.local)
    except Exception as e:
        raise write_error(loc, name, e) from e


@contextlib.contextmanager
def explained(loc: Location, doing: str) -> Iterator[None]:
    """Turn a storage failure (TensorStore's or the OS's) into a `CheckpointError`
    saying what was being done, where, and that nothing was changed."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise (write_refusal(e) or CheckpointError)(
            f"{doing} {loc.display!r} failed, and nothing was changed: {e}. Check that the storage is reachable "
            f"and writable, then try again.",
            path=loc.display,
        ) from e


@contextlib.contextmanager
def read_explained(loc: Location, name: str) -> Iterator[None]:
    """Turn a failed read of the file `name` into `read_error`'s error."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise read_error(loc, name, e) from e


def read_error(loc: Location, name: str, error: BaseException) -> CheckpointError:
    """The error of a failed read of the file `name` (TensorStore's `error`,
    once its retries were spent)."""
    refused = storage_failure(loc, error, f"{name!r}")
    if refused is not None:
        return refused
    message = f"Reading {name!r} of checkpoint {loc.display!r} failed: {explain(error)}."
    return CheckpointError(message, path=loc.display)


def write_error(loc: Location, name: str, error: BaseException, outcome: str = "") -> CheckpointError:
    """A full disk, a read-only or forbidden destination: say so, not TensorStore's
    code (a `CheckpointStorageError` when `error` says the storage refused).
    `outcome`, when the caller knows it, says what the failure left ("nothing
    was written")."""
    so = f", so {outcome}" if outcome else ""
    return (write_refusal(error) or CheckpointError)(
        f"Cannot write {name!r} in {loc.display!r}{so}: {error}. Check that the destination is writable "
        f"and has free space.",
        path=loc.display,
    )


def delete_file(loc: Location, name: str) -> None:
    result(kvstore(loc).delete_range(ts.KvStore.KeyRange(name, name + "\0")))


def list_names(loc: Location) -> list[str]:
    """The top-level entries of a checkpoint directory."""
    if loc.local is not None:
        return sorted(os.listdir(loc.local)) if os.path.isdir(loc.local) else []
    return sorted({key.split("/", 1)[0] for key in list_keys(loc)})


def list_keys(loc: Location) -> list[str]:
    """Every key below `loc`, relative to it."""
    try:
        keys = result(kvstore(loc).list())
    except NotImplementedError:
        raise read_only_store(loc) from None
    return [key.decode("utf-8", "replace") for key in keys]


def read_only_store(loc: Location) -> CheckpointTypeError:
    """The error for a store that cannot list or write keys (http)."""
    driver = loc.kvstore.get("driver")
    return CheckpointTypeError(
        f"{loc.display!r} is on a store that cannot list its keys (TensorStore's {driver!r} driver), so "
        f"eqx_ckpt cannot save or manage checkpoints there. Save to a local directory or an object store "
        f"(s3://, gs://); a checkpoint can still be loaded over http.",
        path=loc.display,
    )


def remove(loc: Location, names: Iterable[str]) -> None:
    """Remove top-level entries (files or directories) of a checkpoint."""
    names = list(names)
    if loc.local is not None:
        for name in names:
            full = os.path.join(loc.local, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
                if os.path.lexists(full):
                    # A file that landed while the tree was removed: once more, and
                    # an error now is raised (the caller's journal keeps the name).
                    shutil.rmtree(full)
            elif os.path.lexists(full):
                os.unlink(full)
        return
    store = kvstore(loc)
    futures = [store.delete_range(ts.KvStore.KeyRange(name, name + "\0")) for name in names]
    futures += [store.delete_range(_below(name)) for name in names]
    for future in futures:
        result(future)


# The files a save writes inside a data root, by their path below it: zarr
# metadata (`zarr.json`) in every folder, a leaf's chunks (`c`, then the
# chunk's indices), an OCDBT database's manifests and data files, and
# TensorStore's temporaries of any of them.
_CHUNK = re.compile(r"(^|/)c(/[0-9]+)*$")
_DATABASE = re.compile(r"(^|/)ocdbt\.db/(manifest\.ocdbt|manifest\.[0-9a-f]+|d/[0-9a-f]+)$")


def written_by_a_save(key: str) -> bool:
    """Whether the file at `key` (relative to a checkpoint) has a name a save writes."""
    key = key.removesuffix(TEMPORARY)
    return key.rsplit("/", 1)[-1] == "zarr.json" or bool(_CHUNK.search(key) or _DATABASE.search(key))


def remove_written(loc: Location, names: Iterable[str]) -> None:
    """Remove what saves wrote under the top-level entries `names` of a
    checkpoint: every file `written_by_a_save`, then every folder left empty.

    Anything else (a user's notes in a leaf's folder) stays, with the folders
    that lead to it: a save deletes only what saves wrote (SPEC 3)."""
    names = list(names)
    if loc.local is None:
        store = kvstore(loc)
        ranges = [r for name in names for r in (ts.KvStore.KeyRange(name, name + "\0"), _below(name))]
        keys = [key.decode("utf-8", "surrogateescape") for r in ranges for key in result(store.list(r))]
        futures = [store.delete_range(ts.KvStore.KeyRange(k, k + "\0")) for k in keys if written_by_a_save(k)]
        for future in futures:
            result(future)
        return
    for name in names:
        full = os.path.join(loc.local, name)
        if os.path.islink(full):
            _unlink(full)  # in place of an entry a save wrote: the link goes, never what it points to
            continue
        if not os.path.isdir(full):
            if os.path.lexists(full) and written_by_a_save(name):
                _unlink(full)
            continue
        for root, folders, files in os.walk(full, topdown=False, onerror=_unless_missing):
            relative = os.path.relpath(root, loc.local).replace(os.sep, "/")
            links = [f for f in folders if os.path.islink(os.path.join(root, f))]  # (never walked into)
            for file in files + links:
                if written_by_a_save(f"{relative}/{file}"):
                    _unlink(os.path.join(root, file))
            try:
                os.rmdir(root)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise


def _unless_missing(error: OSError) -> None:
    """Raise `error`, unless it says a file is gone already."""
    if not isinstance(error, FileNotFoundError):
        raise error


def _below(name: str) -> ts.KvStore.KeyRange:
    """The keys inside a folder `name` ("0" follows "/")."""
    return ts.KvStore.KeyRange(name + "/", name + "0")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def ensure_directory(loc: Location) -> None:
    """Create a local directory (and its parents), durably: the entry of each
    new directory is synced in its parent, so a crash cannot lose the folder of
    a committed checkpoint."""
    if loc.local is None:
        return
    missing, path = [], os.path.abspath(loc.local)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(loc.local, exist_ok=True)
        for created in reversed(missing):
            _fsync(os.path.dirname(created))
    except OSError as e:
        raise write_error(loc, ".", e, "nothing was written") from e


def transaction() -> ts.Transaction:
    """A (non-atomic) TensorStore transaction: writes staged in it are written out
    only by its `commit_async()`."""
    return ts.Transaction()


def create_array(loc: Location, record: LeafRecord, *, synced: bool = True) -> ts.Future:
    spec = array_spec(
        loc, record.directory, shape=record.stored_shape, stored_dtype=record.stored_dtype, chunks=list(record.chunks)
    )
    return create_spec(spec, loc, synced=synced)


def create_spec(spec: dict[str, Any], loc: Location, *, synced: bool = True) -> ts.Future:
    return ts.open(spec, create=True, context=_context(loc, synced))


def open_array(loc: Location, record: LeafRecord, *, synced: bool = True, checked: bool = True) -> ts.Future:
    """Open a stored leaf (a packed one as an in-memory copy of its elements).

    With `checked`, its zarr.json is read and checked against the manifest
    (shape, data type, chunks and the crc32c codec must all be as recorded);
    without, the manifest's metadata is taken as it is, and a file whose chunks
    do not decode that way fails its checksum when read."""
    if record.pack is not None:
        from . import _pack

        return _pack.open_leaf(loc, record)
    check_leaf_files(loc, record)
    refuse_beyond_memory(loc, record, record.chunk_nbytes, "one of its chunks")
    spec = array_spec(
        loc, record.directory, shape=record.stored_shape, stored_dtype=record.stored_dtype, chunks=list(record.chunks)
    )
    if not checked:
        return ts.open(spec, open=True, assume_metadata=True, context=_context(loc, synced))
    return ts.open(spec, open=True, context=_context(loc, synced))


def open_spec(spec: dict[str, Any], loc: Location, *, cached: bool = False) -> ts.Future:
    """Open an existing array from its full spec, checking its zarr.json;
    `cached` keeps decoded chunks in a shared cache (`_spec.CACHED`)."""
    return ts.open(spec, open=True, context=CACHED if cached else CONTEXT)


@functools.cache
def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_beyond_memory(loc: Location, record: LeafRecord, nbytes: int, what: str) -> None:
    """Refuse a read that would allocate more than this machine's memory.

    Such a read cannot succeed, and TensorStore would abort the whole process on
    the failed allocation. On a local disk the chunk files are counted first
    (`_local.check_leaf_files`); on an object store this is what stands between a
    hostile manifest's absurd shape and a crash.
    """
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


def explain(error: BaseException) -> str:
    """A TensorStore error's message, without the whole spec it appends (every
    context resource, the metadata: noise to a user, and long)."""
    return re.sub(r"\s*\[(tensorstore_spec|source locations)='.*?'\]", "", str(error), flags=re.S)


def leaf_io_error(error: BaseException, record: LeafRecord, loc: Location, doing: str) -> CheckpointError:
    """Explain a TensorStore failure on one leaf."""
    if isinstance(error, CheckpointError):
        return error
    refused = storage_failure(loc, error, f"leaf `{record.path}`")
    if refused is not None:
        return refused
    text = explain(error)
    if "NOT_FOUND" in text or "DATA_LOSS" in text or "FAILED_PRECONDITION" in text or "digest" in text.lower():
        return stored_leaf_error(
            IntegrityError,
            f"it is damaged or incomplete: {text}.",
            dotted=record.path,
            path=loc.display,
            fix="Its bytes do not match what was saved. If the checkpoint was overwritten or deleted while this "
            "read ran, read it again; otherwise restore it from a good copy, or run `eqx-ckpt verify` to list "
            "every damaged leaf.",
        )
    return stored_leaf_error(IntegrityError, f"could not {doing} it: {text}", dotted=record.path, path=loc.display)
