"""How the arrays of a checkpoint are laid out under its data root.

- `"directories"`: one folder per leaf, named after its key path, holding that
  leaf's zarr v3 array (`zarr.json` and one file per chunk). Any tool that reads
  zarr v3 reads any leaf; a leaf can be copied or inspected with `ls`.
- `"ocdbt"`: every array in one TensorStore OCDBT database (a key-value store kept
  in a few large files) in the folder `ocdbt.db/` of the data root. The keys
  inside the database are the same per-leaf paths, so the zarr arrays, the
  manifest and every kind of load are unchanged; only the number of files is not.

The database sits in its own folder so that deleting a data root (see `_commit`)
deletes it whole.
"""

from __future__ import annotations

import dataclasses

from ._errors import CheckpointValueError
from ._manifest import LAYOUTS
from ._spec import Location

OCDBT_FOLDER = "ocdbt.db"


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
    spec = {"driver": "ocdbt", "base": root.child(OCDBT_FOLDER), "path": ""}
    return Location(spec, loc.display, None)
