"""A fine-tune stored against its base: one source of leaves made of two.

A published folder whose `eqx_ckpt.json` names a base (`_published.Family`)
holds only the leaves that differ from it. The others are recorded with the
dotted path of the base's leaf holding the same bytes. `with_base` opens the
base as any source (`_source.open_source`: the Hub's cache for an `hf://` base,
a local checkpoint, another published folder) and returns one `Source` whose
opener and runs read each leaf from where it lives. Every load option works
on it as on any source, since the load plan sees one set of records.

The base is checked before anything is read from it:

- it is there, at its pin: an `hf://` base is opened at its commit; any other
  must have the record file (`manifest.json` or `eqx_ckpt.json`) whose sha256
  the fine-tune recorded;
- each leaf taken from it is there, stored with the dtype and shape recorded.

A missing or changed base is an error naming it and what was expected, never
a mix of two models. A fine-tune read from the Hub may name only an `hf://`
base: what a repository names is untrusted, and must not reach local files.
Bases of bases are followed, at most `MAX_DEPTH` deep.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from .._base._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._base._location import HUB_SCHEME, Location
from .._ondisk import _published
from .._ondisk._format import MANIFEST, MAX_MANIFEST_BYTES, LeafRecord
from .._store import _storage
from . import _pack

# A `_source.Source` (typed loosely: `_source` imports this module, not the reverse).
Source = Any

# Bases of bases followed at most this deep (a chain of fine-tunes).
MAX_DEPTH = 8
# A leaf's digest is taken over reads of about this many bytes (rows of it).
DIGEST_SLAB_BYTES = 64 * 2**20


def digest(data: Any) -> str:
    """The recorded digest of a leaf's stored bytes (`_published`)."""
    return _published.DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(data)


def stored_digest(source: Source, record: LeafRecord) -> str:
    """The digest of the leaf `record` of `source` as it is stored (a PRNG
    key's key data, a viewed dtype's unsigned integers), read in slabs of rows
    so a large leaf never needs its size in memory twice."""
    store = source.open(record).result()
    hasher = xxhash.xxh3_128()
    shape = tuple(record.stored_shape)
    if not shape or shape[0] == 0:
        hasher.update(_raw(store.read().result()))
    else:
        row = max(1, math.prod(shape[1:]) * store.numpy_dtype.itemsize)
        step = max(1, DIGEST_SLAB_BYTES // row)
        for start in range(0, shape[0], step):
            end = min(start + step, shape[0])
            hasher.update(_raw(store[start:end].read().result()))
    return _published.DIGEST_PREFIX + hasher.hexdigest()


def _raw(array: np.ndarray) -> memoryview:
    """An array's bytes in C order (a bfloat16's too: as bytes, not as a buffer of its dtype)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def record_sha256(source: Source) -> str | None:
    """The sha256 of the file recording `source`'s leaves (an eqx_ckpt
    checkpoint's `manifest.json`, a published folder's `eqx_ckpt.json`), read
    now; `None` for a source with neither (plain safetensors, orbax)."""
    name = (
        MANIFEST if source.format == "eqx_ckpt" else _published.NAME if source.manifest.layout == "published" else None
    )
    data = None if name is None else _storage.read_file(source.loc, name, limit=MAX_MANIFEST_BYTES)
    return None if data is None else hashlib.sha256(data).hexdigest()


def base_path(base: _published.Base, where: Location) -> str:
    """Where the base of the fine-tune at `where` is read from: an `hf://` base
    at its commit; a local one relative to the fine-tune's folder."""
    if base.revision:
        return _published.hub_at(base.path, base.revision)
    if "://" in base.path or os.path.isabs(base.path):
        return base.path
    if where.local is None:
        raise CorruptCheckpointError(
            f"{where.display!r} is a fine-tune whose base {base.path!r} is a local path, relative to a folder on a "
            f"local disk; this one is not. Copy the fine-tune beside its base, or export it with "
            f"`standalone=True`.",
            path=where.display,
        )
    return os.path.normpath(os.path.join(where.local, base.path))


def with_base(
    source: Source, open_source: Callable[..., Source], *, whole: bool, token: str | None, depth: int
) -> Source:
    """`source`, a fine-tune, with its base's leaves: one `Source` of both (or
    `source` itself where it has no base)."""
    family: _published.Family | None = source.manifest.family
    if family is None:
        return source
    where = source.loc
    if depth >= MAX_DEPTH:
        raise CorruptCheckpointError(
            f"{where.display!r} is a fine-tune of a fine-tune... more than {MAX_DEPTH} deep (its base: "
            f"{family.base.path!r}); "
            f"eqx_ckpt follows at most {MAX_DEPTH}. Export one of them with `standalone=True`.",
            path=where.display,
        )
    if source.revision is not None and not family.base.path.startswith(HUB_SCHEME):
        raise CorruptCheckpointError(
            f"{where.display!r} is a fine-tune read from the Hub whose base is {family.base.path!r}, not an `hf://` "
            f"repository: a published model may take its base only from the Hub, so nothing is read from there.",
            path=where.display,
        )
    path = base_path(family.base, where)
    shown = family.base.shown if family.base.revision else repr(path)
    try:
        base = open_source(path, whole=whole, token=token, depth=depth + 1)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{where.display!r} is a fine-tune that holds only the leaves it changed; the others are read from its "
            f"base {shown}, which cannot be found: {e} Put the base back (or download it), or load a standalone "
            f"export of the fine-tune.",
            path=where.display,
        ) from e
    if not family.base.revision:
        found = record_sha256(base)
        if found != family.base.sha256:
            raise CorruptCheckpointError(
                f"{where.display!r} is a fine-tune of the base {shown} as it was when the fine-tune was exported "
                f"(its record's sha256 {family.base.sha256[:16]}...), but that base has changed since (now "
                f"{'no record' if found is None else found[:16] + '...'}): its leaves may no longer be the ones the "
                f"fine-tune was made from, so nothing is loaded. Restore the base, or export the fine-tune again "
                f"against the base as it is now.",
                path=where.display,
            )
    taken = _taken(source, base, family, shown)
    return dataclasses.replace(
        source,
        manifest=dataclasses.replace(
            source.manifest,
            leaves=tuple(
                dataclasses.replace(r, chunks=taken[r.path].chunks) if r.path in taken else r
                for r in source.manifest.leaves
            ),
        ),
        opener=lambda record: _open(source, base, taken, record),
        runs=_runs(source, base, taken),
        changed=lambda: _changed(source, base),
        base=base,
    )


def _taken(source: Source, base: Source, family: _published.Family, shown: str) -> dict[str, LeafRecord]:
    """The base's record of each leaf the fine-tune takes from it, by the
    fine-tune's dotted path; each checked against the fine-tune's record."""
    held = base.manifest.by_path()
    mine = source.manifest.by_path()
    taken: dict[str, LeafRecord] = {}
    for path, name in family.references.items():
        record, found = mine[path], held.get(name)
        if found is None:
            why = f"has no leaf {name!r}"
        elif (found.stored_dtype, found.stored_shape, found.encoding) != (
            record.stored_dtype,
            record.stored_shape,
            record.encoding,
        ):
            why = (
                f"stores its leaf {name!r} as {found.stored_dtype}{list(found.stored_shape)}, not as the "
                f"{record.stored_dtype}{list(record.stored_shape)} recorded"
            )
        else:
            taken[path] = found
            continue
        raise CorruptCheckpointError(
            f"{source.loc.display!r} takes its leaf {path!r} from its base {shown}, which {why}: it is not the base "
            f"the fine-tune was made from, so nothing is loaded.",
            path=source.loc.display,
        )
    return taken


def _open(source: Source, base: Source, taken: dict[str, LeafRecord], record: LeafRecord) -> Any:
    found = taken.get(record.path)
    if found is None:
        assert source.opener is not None  # (a published folder's tensors)
        return source.opener(record)
    if found.pack is not None:  # a tiny leaf of an eqx_ckpt base, packed with others
        return _storage.ready(_storage.in_memory(_pack.read_alone(base.data, found)))
    return base.open(found)


def _runs(
    source: Source, base: Source, taken: dict[str, LeafRecord]
) -> Callable[[list[LeafRecord]], tuple[list[int], Any]] | None:
    """The reader of runs of small leaves: the fine-tune's own from its files,
    the base's from the base's (where its format reads runs)."""
    if source.runs is None and base.runs is None:
        return None

    def runs(records: list[LeafRecord]) -> tuple[list[int], Any]:
        done: list[int] = []
        groups = []
        for reader, slots in (
            (source.runs, [i for i, r in enumerate(records) if r.path not in taken]),
            (base.runs, [i for i, r in enumerate(records) if r.path in taken]),
        ):
            if reader is None or not slots:
                continue
            read, found = reader([taken.get(records[i].path, records[i]) for i in slots])
            done += [slots[m] for m in read]
            groups.append((slots, found))
        return done, (([slots[m] for m in members], finish) for slots, found in groups for members, finish in found)

    return runs


def _changed(source: Source, base: Source) -> str | None:
    """The name of a file of the fine-tune rewritten since it was opened;
    a base replaced since raises as the base's own check does."""
    assert source.changed is not None
    name = source.changed()
    if name is None:
        base.check()
    return name
