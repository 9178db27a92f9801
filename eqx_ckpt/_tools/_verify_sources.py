"""`verify` of the other formats eqx_ckpt reads: a safetensors file, a Hugging
Face directory of them, an orbax checkpoint.

Each is checked for what its format can be checked for. Opening it checks its
metadata:

- `_safetensors`: every header parses. Its offsets follow one another from the
  start of the data with no byte unused, and no bytes follow the last tensor.
  The index names files that are there and tensors they hold.
- `_orbax`: `_METADATA` describes a PyTree whose every array opens.

Then every chunk of every tensor is read, a bounded number of bytes at a time
(`_chunk_scan`). A truncated file or a missing chunk is a problem of the
tensor it belongs to. Neither format stores checksums of its data, so a
changed byte cannot be detected. The result says so (`unchecked`), and never
passes over it.
"""

from __future__ import annotations

from typing import Any

from .._base._errors import CorruptCheckpointError
from .._base._location import Location
from .._base._progress import Progress, Tracker
from .._foreign import _orbax
from .._load import _source
from .._ondisk._format import LeafRecord
from .._store import _hub
from . import _chunk_scan

SAFETENSORS_UNCHECKED = (
    "Safetensors files hold no checksums: a changed byte inside a tensor cannot be detected. Checked: the "
    "headers (and the index), and that every tensor's bytes are there."
)
ORBAX_UNCHECKED = (
    "orbax stores no checksums of its arrays: a changed byte is detected only where it breaks a chunk's "
    "encoding. Checked: its _METADATA, every array's metadata, and that every chunk is there and decodes."
)
ORBAX_INCOMPLETE = (
    "This orbax checkpoint does not record that every chunk was written (older orbax leaves out chunks of "
    "zeros), so a missing chunk reads as zeros and cannot be told from one that was never written."
)


def check(
    loc: Location, progress: Progress, token: str | None = None
) -> tuple[list[tuple[str | None, str]], tuple[str, ...], tuple[str, ...]]:
    """The problems of the checkpoint of another format at `loc`, as `(dotted
    path or None, message)`, what its format could not be checked for, and
    what was checked beyond it (a Hub repository's files, by their digests).

    Raises `CheckpointNotFoundError` (saying what `loc` holds) if it is no
    checkpoint of any format."""
    hub = _hub.is_hub(loc)
    try:
        # A Hub repository is verified as the cache holds it: downloaded whole,
        # every file checked against the digest the Hub lists for it.
        source = _source.open_source(loc, whole=hub, token=token)
    except CorruptCheckpointError as e:
        return [(None, str(e))], (), ()
    records = sorted(source.manifest.leaves, key=lambda r: r.path)
    with Tracker(progress, leaves=len(records), nbytes=source.manifest.total_bytes, what="verify") as tracker:
        bad = _read_every_chunk(source, records, tracker)
    problems: list[tuple[str | None, str]] = [(r.path, bad[r.path]) for r in records if r.path in bad]
    if hub:  # (the whole load compared every file with the Hub's digest, or refused it)
        checked = tuple(_hub.checked(source.loc))
        return problems, () if checked else (SAFETENSORS_UNCHECKED,), checked
    if source.format == "safetensors":
        return problems, (SAFETENSORS_UNCHECKED,), ()
    return problems, (ORBAX_UNCHECKED,) + (() if _orbax.writes_every_chunk(loc) else (ORBAX_INCOMPLETE,)), ()


def _read_every_chunk(source: _source.Source, records: list[LeafRecord], tracker: Tracker) -> dict[str, str]:
    """What is wrong with each tensor that is not sound, by dotted path."""
    bad: dict[str, str] = {}
    stores: dict[str, Any] = {}
    for record in records:
        try:
            stores[record.path] = source.open(record).result()
        except Exception as e:
            bad[record.path] = _damage(e, record, source.data, "open")

    def failed(record: LeafRecord, error: BaseException) -> None:
        bad.setdefault(record.path, _damage(error, record, source.data, "read"))

    _chunk_scan.scan_leaves(source.data, records, stores, bad, failed, tracker)
    return bad


def _damage(error: BaseException, record: LeafRecord, data: Location, doing: str) -> str:
    return str(_chunk_scan.damage(error, record, data, doing))
