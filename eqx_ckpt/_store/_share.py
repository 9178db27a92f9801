"""Incremental saves: chunk files equal to the previous save's are shared, not written.

An overwrite, and a manager's next step, follow a *base* checkpoint. On a
local disk `_local_write` compares each chunk file with the base's at the
same place by length and the xxh3-128 of its data bytes, never by its crc32c
(a damaged file still ends with the good bytes' checksum); an equal one
becomes a hard link. A base file is verified once per process before it is
shared (`_VERIFIED`); what this process writes is recorded too (`written`).
A file that fails is never shared (`IntegrityWarning`); damage found by a
read or `verify` forgets the array's files (`forget_damaged`).
docs/format.md, "Incremental and partial saves", says more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import types
import warnings
from typing import Any, NamedTuple

import crc32c
import xxhash

from .._base import _faults, _state
from .._base._errors import IntegrityError
from .._ondisk import _format, _manifest
from .._ondisk._format import LeafRecord, PackRecord
from ._local_paths import READ_FLAGS, SpecialFileError, local_open, local_stat, local_walk


class Base:
    """The checkpoint a save follows, as far as its chunk files may be shared:
    its local data root, its own arrays' leaves (by dotted path) and packs."""

    def __init__(self, root: str, manifest: _manifest.Manifest):
        self.root = root
        self.leaves = {leaf.path: leaf for leaf in manifest.leaves if leaf.pack is None}
        self.packs = {pack.name: pack for pack in manifest.packs}

    def leaf_folder(self, record: LeafRecord) -> str | None:
        """The base's folder of the leaf at `record`'s place, if its chunks
        cover the same elements; else `None`."""
        old = self.leaves.get(record.path)
        if old is None or _shape_of(old) != _shape_of(record):
            return None
        return os.path.join(self.root, old.directory) if old.directory else self.root

    def pack_folder(self, pack: PackRecord) -> str | None:
        old = self.packs.get(pack.name)
        if old is None or (old.dtype, old.size, old.chunk) != (pack.dtype, pack.size, pack.chunk):
            return None
        return os.path.join(self.root, pack.name)


class IntegrityWarning(UserWarning):
    """A save found a damaged chunk file in the checkpoint it follows (the one
    it replaces, or a manager's previous step), and did not share it. The save
    wrote that chunk anew, so the new checkpoint is sound.

    A manager's `restore` warns with it too, when a step of its local tier
    failed its checks (or its disk would not serve it) and the same step was
    loaded from the persistent tier instead.

    The warning names the file and its leaf (or the step). `eqx-ckpt verify` lists every
    damaged leaf of the old checkpoint.

    !!! example

        ```python
        import warnings
        import eqx_ckpt

        # Make a damaged earlier checkpoint an error, as for any warning:
        warnings.simplefilter("error", eqx_ckpt.IntegrityWarning)
        ```
    """


IntegrityWarning.__module__ = "eqx_ckpt"

# A file's identity while its bytes are unchanged: device, inode, size, modification time.
Key = tuple[int, int, int, int]

# The xxh3-128 digests of the chunk files this process verified or wrote, keyed
# by what a hard link keeps; at most 2**17 (about 300 bytes each), LRU.
_VERIFIED: _state.Table[Key, bytes] = _state.table("share.verified", 1 << 17, "lru")

# How many first bytes of a large chunk are compared before its hash is computed.
START_BYTES = 4096
# A base file is verified a piece at a time, through a buffer of each thread.
_READ_BYTES = 1 << 20
# (`READ_FLAGS`: a FIFO in a chunk file's place must not block the open; its fstat then refuses it.)
_READ_FLAGS = READ_FLAGS | getattr(os, "O_NOFOLLOW", 0)
_BUFFERS = threading.local()
_UNOPENED = types.MappingProxyType({errno.ENOENT: "is missing", errno.ELOOP: "is a symbolic link (never followed)"})


def _shape_of(record: LeafRecord) -> tuple[Any, ...]:
    return (record.stored_dtype, tuple(record.stored_shape), record.encoding, tuple(record.chunks))


def _key(info: os.stat_result) -> Key:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class Verified(NamedTuple):
    """A base's chunk file that may be shared: the xxh3-128 digest of its data
    bytes, and its `Key` when they were verified."""

    digest: bytes
    key: Key


def base_file(path: str, nbytes: int, what: str, start: Any = None, *, sized: bool = True) -> Verified | None:
    """The base's chunk file `path`, if it may be shared: a sound regular file
    of `nbytes` bytes starting with `start`'s bytes, where given. An unsound
    one is warned about (naming `what`) and never shared. Without `sized`
    (compressed chunks), another size is another content, not damage."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        _warn(path, what, _UNOPENED.get(e.errno or 0, f"cannot be opened ({e.strerror})"))
        return None
    try:
        info = local_stat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_size != nbytes and not sized:
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
            size = f"holds {info.st_size} bytes, not {nbytes}"
            _warn(path, what, size if stat.S_ISREG(info.st_mode) else "is not a regular file")
            return None
        if start is not None:
            head = memoryview(start).cast("B")[:START_BYTES]
            if os.pread(fd, len(head), 0) != head:
                return None
        key = _key(info)
        digest = _VERIFIED.recent(key)
        if digest is None:
            digest = _verify(fd, path, nbytes, what)
            if digest is None:
                return None
            _VERIFIED.put(key, digest)
        return Verified(digest, key)
    except OSError as e:
        _warn(path, what, f"cannot be read ({e.strerror})")
        return None
    finally:
        os.close(fd)


def _verify(fd: int, path: str, nbytes: int, what: str) -> bytes | None:
    """The xxh3-128 of a chunk file's data bytes if their crc32c is the one it
    ends with; else `None`, after a warning."""
    _faults.fire("share.verify", path)
    buffer = getattr(_BUFFERS, "buffer", None)
    if buffer is None:
        buffer = _BUFFERS.buffer = memoryview(bytearray(_READ_BYTES))
    size, done, checksum = nbytes - _format.CHECKSUM_BYTES, 0, 0
    hasher = xxhash.xxh3_128()
    while done < size:
        got = os.preadv(fd, [buffer[: min(_READ_BYTES, size - done)]], done)
        if got == 0:
            _warn(path, what, f"ends after {done} bytes, not {nbytes}")
            return None
        checksum = crc32c.crc32c(buffer[:got], checksum)
        hasher.update(buffer[:got])
        done += got
    stored = os.pread(fd, _format.CHECKSUM_BYTES, size)
    if len(stored) != _format.CHECKSUM_BYTES or int.from_bytes(stored, "little") != checksum:
        _warn(path, what, "fails its crc32c checksum (its bytes are not those that were saved)")
        return None
    return hasher.digest()


def _warn(path: str, what: str, why: str) -> None:
    warnings.warn(
        f"The chunk file {path!r} of {what}, in the checkpoint this save follows, {why}: it was not shared, and "
        f"this save wrote that chunk anew, so the new checkpoint is sound. The checkpoint it follows is damaged "
        f"there: run `eqx-ckpt verify` on it to list every damaged leaf.",
        IntegrityWarning,
        stacklevel=2,
    )


def written(fd: int, path: str, digest: bytes) -> None:
    """Record the chunk file `fd`, just written by this process, with its `digest`."""
    _faults.fire("share.written", path)
    _VERIFIED.put(_key(local_stat(fd)), digest)


def link(source: str, path: str, verified: Verified) -> bool:
    """Hard-link the new `path` to the base's chunk file `source`; whether it
    links the file that was `verified` (the base may have changed since).
    Where it does not, nothing is left at `path`."""
    _faults.fire("share.link", source, path)
    try:
        os.link(source, path, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise  # nothing here is ever overwritten: the caller reports it
        return False  # another file system, no links, the base gone: written instead
    try:
        if _key(local_stat(path, follow=False)) == verified.key:
            return True
    except OSError:
        pass
    os.unlink(path)
    return False


def link_if_equal(source: str, path: str, data: bytes) -> bool:
    """A copy's file shared: hard-link the new `path` to `source` (the same file
    of an earlier copy, on a local disk) if `source` holds exactly `data`, now
    and once linked; whether it did. Otherwise nothing is left at `path`
    (a manager's tiers: `_tiers.copy_step`)."""
    try:
        entry = local_stat(source, follow=False)
        if not stat.S_ISREG(entry.st_mode) or entry.st_size != len(data):
            return False
        with local_open(source) as f:
            if f.read(len(data) + 1) != data:
                return False
    except (OSError, SpecialFileError):
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return link(source, path, Verified(b"", _key(entry)))


def forget_damaged(error: BaseException, root: str, record: LeafRecord) -> BaseException:
    """Return `error`, after forgetting the files of `record`'s array (or pack)
    where it is an `IntegrityError`: the next save verifies them again."""
    if isinstance(error, IntegrityError):
        forget(root, record.pack.name if record.pack is not None else record.directory)
    return error


def forget(root: str, directory: str) -> None:
    """Forget every file of the array folder `directory` under `root`."""
    folder = os.path.join(root, directory) if directory else root
    keys = []
    for found, _, names in local_walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                keys.append(_key(local_stat(os.path.join(found, name), follow=False)))
    for key in keys:
        _VERIFIED.pop(key, None)


def shared_files(root: str) -> tuple[int, int]:
    """How many files and bytes under `root` other checkpoints also use (hard links)."""
    count = nbytes = 0
    for folder, _, names in local_walk(root):
        for name in names:
            info = local_stat(os.path.join(folder, name), follow=False)
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                count, nbytes = count + 1, nbytes + info.st_size
    return count, nbytes
