"""Checks on a local checkpoint directory before TensorStore reads from it.

A checkpoint may come from elsewhere, so its files are untrusted
(docs/format.md): no symbolic link inside it is followed; only regular files
are read (`refuse_special`); a leaf's chunk files must hold the bytes its
manifest gives it, so a hostile shape cannot make a load allocate terabytes.
A save checks first that no path would be too long (`check_path_lengths`):
TensorStore reports that only midway, naming no leaf.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .._base import _faults
from .._base._errors import (
    CheckpointError,
    CorruptCheckpointError,
    IntegrityError,
    LeafError,
    leaf_line,
    leaf_message,
    stored_leaf_error,
)
from .._base._keypath import from_json
from .._base._location import Location
from .._ondisk import _format
from .._ondisk._format import MAX_RANK, LeafRecord, PackRecord, dtype_from_name
from ._local_paths import local_entry, local_names, local_real_path, local_stat, local_walk


def refuse_links(loc: Location, relative: str, *, leaf: str | None = None, subtree: bool = False) -> int:
    """Raise if any component of `relative` below `loc` is a symbolic link, or
    (with `subtree`) anything inside is a link or special; the total size of
    the files inside (with `subtree`), else 0. `leaf` names the leaf concerned."""
    if loc.local is None:
        return 0
    current = loc.local
    for part in (p for p in relative.split("/") if p):
        current = os.path.join(current, part)
        if local_entry(current).link and not _cached_blob(loc.local, current):
            raise _link_error(loc, current, leaf)
    return _scan(loc, current, leaf) if subtree and local_entry(current).folder else 0


def refuse_special(loc: Location, name: str, *, leaf: str | None = None) -> None:
    """Raise if the file `name` below `loc` (a link followed) is neither a
    regular file nor a folder. `leaf` names the leaf concerned."""
    if loc.local is None:
        return
    found = local_entry(os.path.join(loc.local, name)).special
    if found:
        raise special_error(loc, name, found, leaf=leaf)


def refuse_special_inside(loc: Location) -> None:
    """`refuse_special` of every file below `loc`: for another program's
    checkpoint (orbax's), whose files no record names."""
    if loc.local is None:
        return
    for root, _, names in local_walk(loc.local):
        for name in names:
            path = os.path.join(root, name)
            found = local_entry(path).special
            if found:
                raise special_error(loc, os.path.relpath(path, loc.local), found)


def special_error(loc: Location, name: str, kind: str, *, leaf: str | None = None) -> CheckpointError:
    """The error of the file `name` of `loc` that is `kind` (a FIFO...), not a regular file."""
    what = (
        f"{name!r} in checkpoint {loc.display!r} is {kind}, not a regular file, so it was not opened. eqx_ckpt "
        f"reads only regular files from a checkpoint: opening a FIFO waits forever, and a device reads what it "
        f"likes. Replace it with the file it stands for, or restore the checkpoint from a good copy."
    )
    return _corrupt(loc, what, leaf)


def _corrupt(loc: Location, what: str, leaf: str | None) -> CheckpointError:
    """A `CorruptCheckpointError` saying `what`, or an `IntegrityError` of the leaf `leaf`."""
    if leaf is None:
        return CorruptCheckpointError(what, path=loc.display)
    return IntegrityError(leaf_line(what, keypath=None, dotted=leaf), path=loc.display, dotted=[leaf])


def _cached_blob(folder: str, path: str) -> bool:
    """Whether `path`, in `folder`, is a file of a Hugging Face Hub cache snapshot
    (`models--owner--name/snapshots/<commit>/...`): a link to the same repository's `blobs/`."""
    parts = folder.split(os.sep)
    if "snapshots" not in parts[:-1]:
        return False
    at = len(parts) - 1 - parts[::-1].index("snapshots")
    root = os.sep.join(parts[:at])
    if not os.path.basename(root).startswith("models--"):
        return False
    target = local_real_path(path)
    return os.path.dirname(target) == local_real_path(os.path.join(root, "blobs")) and local_entry(target).file


def check_leaf_files(loc: Location, record: LeafRecord) -> None:
    """Before a local leaf is opened: no links, and enough bytes on disk (in
    a process's part, its regions' chunk files, as each is read: `check_region_files`)."""
    if loc.local is None:
        return
    found = refuse_links(loc, record.directory, leaf=record.path, subtree=True)
    if loc.part:
        return
    if found >= record.nbytes and not record.compression:
        return
    shape, chunks, chunk_nbytes = record.stored_shape, record.chunks, record.chunk_nbytes
    why = first_wrong_chunk_file(loc, record.directory, shape, chunks, chunk_nbytes, record.compression)
    if why is None and record.compression:
        return
    # With no chunk file amiss, its files changed while they were checked.
    why = why or f"the manifest gives it {record.nbytes} bytes, but its folder holds only {found} bytes"
    raise _incomplete(loc, record, why, "it")


def check_region_files(loc: Location, record: LeafRecord, index: tuple[Any, ...]) -> None:
    """Before the region `index` of a leaf of a process's part (`Location.part`)
    is read: each chunk file it covers is there, the size a save writes. (A
    part lacks the other processes' regions, which a read would give as zeros.)"""
    if loc.local is None:
        return
    spans = []
    for axis, (size, chunk) in enumerate(zip(record.stored_shape, record.chunks)):
        start, stop, _ = (index[axis] if axis < len(index) else slice(None)).indices(size)
        spans.append(range(start // chunk, -(-stop // chunk)) if stop > start else range(0))
    keys = (_format.chunk_key(indices) for indices in itertools.product(*spans))
    why = _first_wrong(loc, record.directory, keys, record.chunk_nbytes, record.compression)
    if why is not None:
        raise _incomplete(loc, record, why, "this process's part of it")


def _incomplete(loc: Location, record: LeafRecord, why: str, what: str) -> IntegrityError:
    """The error of a leaf (`what` of it) whose chunk files are not those a save writes (`why`)."""
    return stored_leaf_error(
        IntegrityError,
        f"{what} is damaged or incomplete: {why}. Nothing was read.",
        dotted=record.path,
        path=loc.display,
        fix=_DAMAGED_FIX,
    )


def check_pack_files(loc: Location, pack: PackRecord, *, leaf: str | None = None) -> None:
    """Before a local pack is opened (for `leaf`, if one): no links, and every chunk file sound."""
    if loc.local is None:
        return
    refuse_links(loc, pack.name, leaf=leaf, subtree=True)  # (a FIFO or device inside refused too)
    chunk_nbytes = pack.chunk * dtype_from_name(pack.dtype).itemsize
    why = first_wrong_chunk_file(loc, pack.name, (pack.size,), (pack.chunk,), chunk_nbytes, pack.compression)
    if why is None:
        return
    # Worded as `verify` words it, with the leaf's own words around it.
    if leaf is not None:
        what = f"its pack {pack.name!r} is damaged: {why}. Nothing was read."
        raise stored_leaf_error(IntegrityError, what, dotted=leaf, path=loc.display, fix=_DAMAGED_FIX)
    raise CorruptCheckpointError(
        f"In checkpoint {loc.display!r}, the pack {pack.name!r} (the small leaves of dtype {pack.dtype}) is "
        f"damaged: {why}. Nothing was read. {_DAMAGED_FIX}",
        path=loc.display,
    )


_DAMAGED_FIX = (
    "If the checkpoint was overwritten or deleted while this read ran, read it again; otherwise restore it "
    "from a good copy, or run `eqx-ckpt verify` to list every damaged leaf."
)


def wrong_chunk_file(name: str, size: int | None, expected: int) -> str:
    """A chunk file that is not the size a save writes (`None`: missing), in the
    words a load and `verify` both use."""
    if size is None:
        return f"its chunk file {name!r} is missing"
    return f"its chunk file {name!r} is {size} bytes, not {expected}"


def wrong_size(name: str, size: int | None, chunk_nbytes: int, compression: str) -> str | None:
    """Why a chunk file of `size` bytes (`None`: missing) is not what a save
    writes for a chunk of `chunk_nbytes` (compressed: at most the worst case,
    refused before decompressing); `None` where it is."""
    expected = chunk_nbytes + _format.CHECKSUM_BYTES
    if size is None or not compression:
        return None if size == expected else wrong_chunk_file(name, size, expected)
    most = _format.most_stored_bytes(chunk_nbytes, compression) + _format.CHECKSUM_BYTES
    if _format.CHECKSUM_BYTES < size <= most:
        return None
    return f"its chunk file {name!r} is {size} bytes, which no compressed chunk is (1 to {most} bytes)"


def first_wrong_chunk_file(
    loc: Location,
    directory: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    chunk_nbytes: int,
    compression: str = "",
) -> str | None:
    """Why the first wrong chunk file of the array in `directory` is wrong
    (`wrong_size`), or `None`; a hostile shape costs one missing file."""
    return _first_wrong(loc, directory, _format.chunk_keys(shape, chunks), chunk_nbytes, compression)


def _first_wrong(loc: Location, directory: str, keys: Iterable[str], chunk_nbytes: int, compression: str) -> str | None:
    """`first_wrong_chunk_file` of the chunk files `keys` (taken lazily)."""
    for key in keys:
        try:
            size: int | None = local_stat(os.path.join(loc.local or "", directory, key), follow=False).st_size
        except FileNotFoundError:
            size = None
        why = wrong_size(f"{directory}/{key}", size, chunk_nbytes, compression)
        if why is not None:
            return why
    return None


def _scan(loc: Location, directory: str, leaf: str | None) -> int:
    # A file or folder removed while it is scanned (a reader racing an overwrite's
    # cleanup) counts as no bytes, so the load fails with an IntegrityError.
    _faults.fire("untrusted.scan", directory)
    try:
        names = local_names(directory)
    except FileNotFoundError:
        return 0
    total = 0
    for name in names:
        path = os.path.join(directory, name)
        entry = local_entry(path)
        if entry.link:
            raise _link_error(loc, path, leaf)
        if entry.special:
            raise special_error(loc, os.path.relpath(path, loc.local or "."), entry.special, leaf=leaf)
        if entry.folder:
            total += _scan(loc, path, leaf)
        elif entry.file:
            total += entry.size
    return total


# What a leaf's folder holds beyond its name, at most: `/c` and a chunk index
# of up to 20 digits per dimension, or `/zarr.json`; TensorStore adds `.__lock`
# while it writes one.
_INSIDE = len("/" + _format.chunk_key([2**64 - 1] * MAX_RANK)) + len(_format.TEMPORARY)


def check_path_lengths(loc: Location, records: Sequence[LeafRecord]) -> None:
    """Raise, before a save writes anything, if a file of a leaf of `records`
    would have a path longer than the system allows."""
    if loc.local is None or not records:
        return
    limit = _path_max(loc.local)
    # A later save writes under a data root `gen.<16 hex digits>` (`_transaction`).
    base = len(os.fsencode(os.path.join(loc.local, _format.data_root_name("0" * 16)))) + len("/")
    if base + max(len(r.path) for r in records) + _INSIDE < limit:
        return  # the common case: no path comes close
    for r in records:
        grid = [-(-size // chunk) if chunk else 1 for size, chunk in zip(r.stored_shape, r.chunks, strict=True)]
        inside = max(len("/" + _format.ZARR_JSON), len("/" + _format.chunk_key([max(n - 1, 0) for n in grid])))
        longest = base + len(r.path) + inside + len(_format.TEMPORARY)  # a dotted path is its folder, in ASCII
        if longest >= limit:  # PATH_MAX counts the terminating NUL
            what = (
                f"the path of a file in its folder would have about {longest} bytes, more than the "
                f"{limit - 1} this system allows (PATH_MAX), so nothing was written."
            )
            fix = (
                'Save with `layout="ocdbt"` (all arrays in one database: no folder per leaf), or use '
                "shorter keys or a shorter checkpoint path."
            )
            keypath = from_json(r.keypath)
            message = leaf_message(what, keypath=keypath, dotted=r.path, path=loc.display, fix=fix)
            raise LeafError(message, path=loc.display, keypaths=[keypath], dotted=[r.path])


def _path_max(path: str) -> int:
    """PATH_MAX of the file system holding `path` (or what would hold it)."""
    while True:
        try:
            return os.pathconf(path, "PC_PATH_MAX")
        except (OSError, ValueError):
            parent = os.path.dirname(path)
            if parent == path:
                return 4096  # Linux's
            path = parent


def _link_error(loc: Location, found: str, leaf: str | None) -> CheckpointError:
    name = os.path.relpath(found, loc.local or ".")
    what = (
        f"{name!r} in checkpoint {loc.display!r} is a symbolic link. eqx_ckpt never writes links and follows none "
        f"inside a checkpoint, so that no checkpoint can make it read files outside itself. If you made the link, "
        f"replace it with a copy of what it points to."
    )
    return _corrupt(loc, what, leaf)
