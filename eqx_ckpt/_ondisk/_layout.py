"""How the arrays of a checkpoint are laid out under its data root.

- `"directories"`: one folder per leaf, named after its key path, holding that
  leaf's zarr v3 array (`zarr.json` and one file per chunk). Any tool that reads
  zarr v3 reads any leaf; a leaf can be copied or inspected with `ls`.
- `"ocdbt"`: every array in one TensorStore OCDBT database (a key-value store kept
  in a few large files) in the folder `ocdbt.db/` of the data root. The keys
  inside the database are the same per-leaf paths, so the zarr arrays, the
  manifest and every kind of load are unchanged; only the number of files is not.

The database sits in its own folder so that deleting a data root (see `_transaction`)
deletes it whole.

Either way, the folders above the leaves are zarr v3 groups (`groups`): a save
writes their `zarr.json`, so that zarr tools can walk the tree, and `verify`
checks them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .._base import _keypath
from .._base._errors import CheckpointValueError
from .._base._location import Location
from . import _format
from ._format import LAYOUTS, LeafRecord


def check(layout: str) -> str:
    if layout not in LAYOUTS:
        raise CheckpointValueError(
            f"`layout` must be one of {', '.join(repr(name) for name in LAYOUTS)}, not {layout!r}: "
            f"'directories' writes one folder per leaf, 'ocdbt' keeps every array in a few files."
        )
    return layout


def data_location(loc: Location, data_root: str, layout: str) -> Location:
    """The location the arrays' keys (`model/w/zarr.json`...) are relative to.

    Messages name it as the checkpoint (`loc.display`): a user can pass that
    back, where an internal data root such as `ckpt/gen.2` means nothing."""
    root = dataclasses.replace(loc.joined(data_root), display=loc.display) if data_root else loc
    if layout == "directories":
        return root
    spec = {"driver": "ocdbt", "base": root.child(_format.OCDBT_FOLDER), "path": ""}
    return Location(spec, loc.display, None)


def groups(records: Iterable[LeafRecord]) -> list[str]:
    """The zarr v3 groups of a data root holding `records`: their folders below
    it, sorted ("" is the data root itself). Every folder above a leaf with an
    array of its own is one, and so is the data root, unless nothing is stored
    there or its only array is a leaf at the root (a checkpoint of one array)."""
    found: set[str] = set()
    for record in records:
        if record.pack is not None:
            found.add("")
            continue
        parts = _keypath.split_dotted(record.path)
        found.update("/".join(parts[:i]) for i in range(len(parts)))
    return sorted(found)
