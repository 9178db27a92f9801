"""Incremental saves: chunk files equal to the previous save's are shared, not written.

A save that replaces a checkpoint (`overwrite`), and a `CheckpointManager`'s
next step, follow an earlier checkpoint: its *base*. On a local disk, before a
chunk file is written (`_local_write`), its bytes' crc32c (the checksum the
file ends with anyway) is compared with the one the base's file at the same
place ends with. Where the length and the checksum are the same, the new file
is a hard link to the base's instead of a copy: the same bytes, no write.
Where either differs, the file is written as ever. Bytes are compared, never
object identity or `==`: `-0.0` after `0.0`, or a NaN with another payload, is
a change.

A chunk is "at the same place" when the leaf has the same dotted path, stored
dtype, stored shape, encoding and chunk grid in both saves (a pack: the same
name, dtype, length and chunk length), so that the chunk covers the same
elements. Every save still gets a complete data root of its own: deleting any
other checkpoint or step, by hand or by retention, leaves it whole (a hard
link is a name of the file like any other), and `verify` reads every byte it
uses.

Only what `_local_write` writes is shared: object stores, the OCDBT layout,
multi-process saves and leaves written through TensorStore are written in full.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from . import _faults, _format, _layout, _manifest, _storage
from ._errors import CheckpointNotFoundError, CorruptCheckpointError
from ._format import LeafRecord, PackRecord
from ._location import Location


class Base:
    """The checkpoint a save follows, as far as its chunk files may be shared:
    its data root on the local disk, its leaves with arrays of their own (by
    dotted path) and its packs (by name)."""

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


def _shape_of(record: LeafRecord) -> tuple[Any, ...]:
    return (record.stored_dtype, tuple(record.stored_shape), record.encoding, tuple(record.chunks))


def base(loc: Location, manifest: _manifest.Manifest | None) -> Base | None:
    """The base a save to a local disk may share from: the committed
    checkpoint at `loc` whose manifest is `manifest`; `None` where nothing can
    be shared (no manifest, the OCDBT layout, not on a local disk)."""
    if manifest is None or manifest.layout != "directories" or not _storage.local_chunk_files(loc):
        return None
    root = _layout.data_location(loc, manifest.data_root, manifest.layout).local
    return None if root is None else Base(root, manifest)


def base_at(loc: Location) -> Base | None:
    """The base of a save that follows the checkpoint at `loc` (a manager's
    previous step): `None` where there is none, or its manifest is damaged
    (that save is then written in full). A failure to read it is the save's."""
    if not _storage.local_chunk_files(loc):
        return None
    try:
        return base(loc, _manifest.read_manifest(loc))
    except (CorruptCheckpointError, CheckpointNotFoundError):
        return None


def stored_checksum(path: str, nbytes: int, start: Any = None) -> int | None:
    """The crc32c a base's chunk file `path` ends with, if it is a regular
    file of `nbytes` bytes (data and checksum), and, given `start` (a buffer),
    its first bytes are those of `start`; else `None`.

    `start` is a cheap look before the checksum of a large chunk, which costs a
    pass over all of its bytes: a chunk whose first bytes changed (an overwrite
    where everything changed) is written at once."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
            return None
        if start is not None:
            head = memoryview(start).cast("B")[:START_BYTES]
            if os.pread(fd, len(head), 0) != head:
                return None
        tail = os.pread(fd, _format.CHECKSUM_BYTES, nbytes - _format.CHECKSUM_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(tail, "little") if len(tail) == _format.CHECKSUM_BYTES else None


# How many first bytes of a large chunk are compared before its checksum is computed.
START_BYTES = 4096


def link(source: str, path: str, nbytes: int, checksum: int) -> bool:
    """Make `path` (which does not exist) a hard link to the base's chunk file
    `source`; whether it is one, still of `nbytes` bytes ending in `checksum`
    (checked again through the new name: the base may have been replaced or
    deleted meanwhile). Where it is not, nothing is left at `path`."""
    _faults.fire("share.link", source, path)
    try:
        os.link(source, path, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise  # nothing here is ever overwritten: the caller reports it
        return False  # another file system, no links, the base gone: written instead
    if stored_checksum(path, nbytes) == checksum:
        return True
    os.unlink(path)
    return False


def shared_files(loc: Location) -> tuple[int, int] | None:
    """How many files of the checkpoint at `loc`, and how many bytes, other
    checkpoints or steps also use (hard links: more than one name); `None`
    where files are never shared (not on a local disk, the OCDBT layout, or
    no eqx_ckpt checkpoint there)."""
    if loc.local is None:
        return None
    manifest = _manifest.read_manifest(loc)
    if manifest is None or manifest.layout != "directories":
        return None
    root = _layout.data_location(loc, manifest.data_root, manifest.layout).local or loc.local
    count = nbytes = 0
    for folder, _, names in os.walk(root):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                count, nbytes = count + 1, nbytes + info.st_size
    return count, nbytes
