"""`verify` of the other formats eqx_ckpt reads: a safetensors file, a Hugging
Face directory of them, an orbax checkpoint.

Each is checked for what its format can be checked for: opening it checks its
metadata (`_safetensors`, `_orbax`), then every chunk of every tensor is read
(`_chunk_scan`). Neither format stores checksums, so a changed byte cannot be
detected, and the result says so (`unchecked`). A leaf of the published
layout whose digest the record keeps (`_published`) is read whole and its
digest compared instead; a fine-tune's leaves taken from its base are read
from the base, at its pin (docs/interop.md, docs/sharing.md).
"""

from __future__ import annotations

from typing import Any

from .._base._errors import CorruptCheckpointError
from .._base._location import Location
from .._base._progress import Progress, Tracker
from .._foreign import _orbax
from .._load import _family, _source
from .._load._load_plan import LoadOptions
from .._ondisk import _published
from .._ondisk._format import LeafRecord
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
    loc: Location, progress: Progress, token: str | None = None, base: Any = None
) -> tuple[list[tuple[str | None, str]], tuple[str, ...], tuple[str, ...]]:
    """The problems of the checkpoint of another format at `loc`, as `(dotted
    path or None, message)`, what its format could not be checked for, and
    what was checked beyond it (a Hub repository's files, by their digests).
    `base`: a fine-tune's base, as the caller gave it (`None`: as recorded)."""
    hub = loc.hub is not None
    try:
        # A Hub repository is verified as the cache holds it: downloaded whole,
        # every file checked against the digest the Hub lists for it.
        source = _source.open_source(loc, LoadOptions(token=token, base=base), whole=hub)
    except CorruptCheckpointError as e:
        return [(None, str(e))], (), ()
    records = sorted(source.manifest.leaves, key=lambda r: r.path)
    digests = source.manifest.digests
    with Tracker(progress, leaves=len(records), nbytes=source.manifest.total_bytes, what="verify") as tracker:
        bad = _read_every_chunk(source, [r for r in records if r.path not in digests], tracker)
        bad.update(_compare_digests(source, [r for r in records if r.path in digests], tracker))
    problems: list[tuple[str | None, str]] = [(r.path, bad[r.path]) for r in records if r.path in bad]
    said = _family_said(source, len(digests) == len(records))
    if hub:  # (the whole load compared every file with the Hub's digest, or refused it)
        checked = source.checked + said
        return problems, () if checked else (SAFETENSORS_UNCHECKED,), checked
    if source.format == "safetensors":
        return problems, () if said else (SAFETENSORS_UNCHECKED,), said
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


def _compare_digests(source: _source.Source, records: list[LeafRecord], tracker: Tracker) -> dict[str, str]:
    """What is wrong with each leaf whose bytes are not those its recorded
    digest says (or cannot be read), by dotted path. A leaf of a base that
    backs several leaves of a fine-tune is read and hashed once."""
    bad: dict[str, str] = {}
    family = source.manifest.family
    references = {} if family is None else family.references
    hashed: dict[str, str] = {}  # by the base's dotted path
    for record in records:
        taken = references.get(record.path)
        try:
            found = hashed.get(taken) if taken is not None else None
            if found is None:
                found = _family.stored_digest(source, record)
                if taken is not None:
                    hashed[taken] = found
        except Exception as e:
            bad[record.path] = _damage(e, record, source.data, "read")
        else:
            if found != source.manifest.digests[record.path]:
                where = (
                    ""
                    if family is None or record.path not in family.references
                    else (f" (read from the base's leaf `{family.references[record.path]}`)")
                )
                bad[record.path] = (
                    f"its bytes{where} are not those its digest in {_published.NAME} records (xxh3-128 "
                    f"{found.removeprefix(_published.DIGEST_PREFIX)}, recorded "
                    f"{source.manifest.digests[record.path].removeprefix(_published.DIGEST_PREFIX)}): a changed byte"
                )
        tracker.advance(leaves=1, nbytes=record.nbytes)
    return bad


def _family_said(source: _source.Source, every: bool) -> tuple[str, ...]:
    """What `verify` says it checked of a published folder by its digests."""
    if not every:
        return ()
    said = [f"every leaf's bytes, against the xxh3-128 digest {_published.NAME} records of it"]
    family = source.manifest.family
    if family is not None:
        base = source.base
        shown = family.base.shown if family.base.revision or base is None else repr(base.loc.display)
        count = len(family.references)
        said.append(
            f"its base {shown} is there, at the version pinned (by "
            f"{'its commit' if family.base.revision else 'the sha256 of its record'}), and the "
            f"{count} {'leaf' if count == 1 else 'leaves'} taken from it are read from it"
        )
    return tuple(said)


def _damage(error: BaseException, record: LeafRecord, data: Location, doing: str) -> str:
    return str(_chunk_scan.damage(error, record, data, doing))
