"""Atomic commit: a checkpoint exists only once its manifest has been written.

The arrays of a checkpoint live under its *data root*: the checkpoint directory
itself, or its `gen.2/` sub-directory. A save over an existing checkpoint writes
its arrays under the root the current one does not use, then replaces
`manifest.json` in one atomic write (a rename on a local disk, a single PUT on an
object store), and only then deletes the old arrays. A process killed at any
moment leaves the old manifest pointing at untouched old arrays, or the new one
pointing at complete new arrays. `saving.json` marks a save in progress and
lists the top-level names it writes and will delete, so the next save knows
exactly which leftovers are its own: nothing else in the directory is touched.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from collections.abc import Sequence

from . import _io, _keypath, _layout, _lock
from ._errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from ._local import refuse_links
from ._manifest import DATA_ROOTS, LAYOUTS, MANIFEST, MAX_MANIFEST_BYTES, SAVING, Manifest, parse
from ._spec import Location

# What a top-level name written by a save can look like: an escaped segment (see
# `_keypath`), the root group's metadata, or the OCDBT database. Names read back
# from `saving.json` must match, so a damaged marker cannot delete anything else.
_OURS = re.compile(r"^(%e|%i-?[0-9]+|%r[A-Za-z0-9_%-]*|[A-Za-z0-9_%-]+|zarr\.json|ocdbt\.db)$")
# A save killed mid-write leaves a temporary `<name>.__lock` behind (see
# `_io.TEMPORARY`); it is ours as `<name>` is.
_STALE = (MANIFEST + _io.TEMPORARY, SAVING + _io.TEMPORARY)


def read_manifest(loc: Location) -> Manifest | None:
    data = _io.read_file(loc, MANIFEST, limit=MAX_MANIFEST_BYTES)
    return None if data is None else parse(data, where=loc.display)


def require_manifest(loc: Location) -> Manifest:
    manifest = read_manifest(loc)
    if manifest is None:
        raise CheckpointNotFoundError(
            f"There is no eqx_ckpt checkpoint at {loc.display!r} (no {MANIFEST}). "
            f"Check the path; a save that was interrupted leaves no checkpoint.",
            path=loc.display,
        )
    # The data root (and an OCDBT database in it) must not lead out of the checkpoint.
    ocdbt = manifest.layout == "ocdbt"
    refuse_links(loc, manifest.data_root + ("/" + _layout.OCDBT_FOLDER if ocdbt else ""), subtree=ocdbt)
    return manifest


@dataclasses.dataclass(frozen=True)
class Transaction:
    loc: Location
    old: Manifest | None
    target: str
    layout: str = "directories"
    lock: _lock.Lock | None = dataclasses.field(default=None, compare=False)
    names: tuple[str, ...] = ()

    @property
    def data(self) -> Location:
        return _layout.data_location(self.loc, self.target, self.layout)


def top_names(paths: list[str], layout: str) -> tuple[str, ...]:
    """The top-level entries of a data root holding leaves at dotted `paths`."""
    if layout == "ocdbt":
        return (_layout.OCDBT_FOLDER,)
    names = {"zarr.json"}
    for path in paths:
        # A root leaf is an array at the data root itself: its chunk is `c`.
        names.add(_keypath.split_dotted(path)[0] if path else "c")
    return tuple(sorted(names))


def begin(loc: Location, *, overwrite: bool, layout: str = "directories", paths: Sequence[str] = ()) -> Transaction:
    """Check the destination may be written, clear leftovers, mark a save begun.

    `paths` are the dotted paths of the leaves the save will write."""
    if loc.local is not None and _exists_not_dir(loc.local):
        raise CheckpointExistsError(
            f"{loc.display!r} is a file, not a directory. eqx_ckpt saves a checkpoint "
            f"as a directory; choose another path.",
            path=loc.display,
        )
    # Locked before looking: two saves must not both take the other's files for leftovers.
    _io.ensure_directory(loc)
    lock = _lock.acquire(loc)
    try:
        return dataclasses.replace(_begin(loc, overwrite=overwrite, layout=layout, paths=list(paths)), lock=lock)
    except BaseException:
        _lock.release(lock)
        raise


def _begin(loc: Location, *, overwrite: bool, layout: str, paths: list[str]) -> Transaction:
    names = _io.list_names(loc)
    old = read_manifest(loc) if MANIFEST in names else None
    if old is None:
        if names and SAVING not in names and SAVING + _io.TEMPORARY not in names:
            raise CheckpointExistsError(
                f"{loc.display!r} is not empty and is not an eqx_ckpt checkpoint, so "
                f"nothing was written into it. Save into a new or empty directory.",
                path=loc.display,
            )
        target = ""
    elif not overwrite:
        raise CheckpointExistsError(
            f"A checkpoint already exists at {loc.display!r} and `overwrite=False`. "
            f"Pass `overwrite=True` to replace it, or choose another path.",
            path=loc.display,
        )
    else:
        target = DATA_ROOTS[1] if old.data_root == "" else ""
    new = top_names(paths, layout)
    _io.ensure_directory(loc)
    _io.remove(loc, _leftovers(loc, names, old, target, new))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    old_names = _area(old) if old is not None else ()
    marker = {"target": target, "layout": layout, "started": started, "names": new, "old_names": old_names}
    _io.write_file(loc, SAVING, json.dumps(marker).encode())
    return Transaction(loc, old, target, layout, names=new)


def _area(manifest: Manifest) -> tuple[str, ...]:
    """The top-level entries a committed checkpoint's arrays occupy."""
    if manifest.data_root:
        return (manifest.data_root,)
    return top_names([leaf.path for leaf in manifest.leaves], manifest.layout)


def _leftovers(loc: Location, names: list[str], old: Manifest | None, target: str, new: tuple[str, ...]) -> list[str]:
    """What must go before writing into `target`: anything an interrupted save
    wrote there (as its `saving.json` lists), and whatever holds the names this
    save needs; never the live checkpoint's arrays."""
    if target:
        return [target] if target in names else []
    marker = _read_marker(loc) if SAVING in names else {}
    stale = [*new, *marker.get("names", ()), *marker.get("old_names", ())]
    live = set(_area(old)) if old is not None else set()
    return sorted({n for n in stale if n in names and n not in live} | {n for n in names if n in _STALE})


def _read_marker(loc: Location) -> dict[str, list[str]]:
    try:
        marker = json.loads(_io.read_file(loc, SAVING, limit=2**24) or b"{}")
    except ValueError:
        return {}
    out = {}
    for key in ("names", "old_names"):
        value = marker.get(key, []) if isinstance(marker, dict) else []
        ok = isinstance(value, list) and all(isinstance(n, str) for n in value)
        out[key] = [n for n in value if _OURS.match(n) and n not in (MANIFEST, SAVING)] if ok else []
    return out


def join(loc: Location) -> Transaction:
    """The transaction another process began at `loc` (read from `saving.json`)."""
    data = _io.read_file(loc, SAVING, limit=2**16)
    try:
        marker = json.loads(data or b"null")
        target, layout = marker["target"], marker["layout"]
    except (ValueError, TypeError, KeyError):
        target = layout = None
    if target not in DATA_ROOTS or layout not in LAYOUTS:
        raise CheckpointError(
            f"Process 0 began saving {loc.display!r}, but this process cannot read its "
            f"{SAVING} there. Every process must save to the same shared storage (a "
            f"shared file system or an object store), not to a local disk each.",
            path=loc.display,
        )
    return Transaction(loc, None, target, layout)


def commit(tx: Transaction, manifest: Manifest) -> None:
    """Make the new checkpoint visible, then delete what the old one used."""
    _io.write_file(tx.loc, MANIFEST, manifest.to_bytes())
    # Committed: from here on a failure must not fail the save (which would
    # delete the new arrays). Leftovers are cleared by the next save.
    try:
        if tx.old is not None:
            stale = _area(tx.old)
            # Writing into the root, the new arrays may reuse the old names there.
            _io.remove(tx.loc, [n for n in stale if tx.target or n not in tx.names])
        _io.delete_file(tx.loc, SAVING)
    except Exception:
        pass
    _lock.release(tx.lock)


def abort(tx: Transaction) -> None:
    """After a failed save: delete what it wrote; the old checkpoint stays."""
    try:
        _io.remove(tx.loc, [tx.target] if tx.target else list(tx.names))
        _io.delete_file(tx.loc, SAVING)
    except Exception:  # the original error matters more
        pass
    _lock.release(tx.lock)


def _exists_not_dir(path: str) -> bool:
    return os.path.lexists(path) and not os.path.isdir(path)
