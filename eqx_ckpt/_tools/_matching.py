"""An export against a base (`export_safetensors(..., base=)`): which leaves a
fine-tune takes from the model it was fine-tuned from.

A leaf is taken where a base leaf holds the same bytes (the digest an export
records, `_digests`), stored alike, whatever its name. The record pins the
base (`_published.Base`), which `_family` checks (docs/sharing.md,
"Model families").
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._base._errors import CheckpointNotFoundError, CheckpointTypeError, CheckpointValueError, option
from .._base._location import Location
from .._load._checkpoint import Checkpoint, human
from .._load._load_plan import LoadOptions
from .._ondisk import _digests, _published
from .._ondisk._format import LeafRecord
from .._sources import _family, _opening, _source, _verified

# An export against a base that would take from it under both 10% of its
# tensors' bytes and 1 MiB is written standalone: so few bytes are not worth a
# dependency that breaks when the base goes (docs/sharing.md, "Model families").
STANDALONE_FRACTION = 0.1
STANDALONE_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class Based:
    """A base opened for an export: its source (read whole), and the path it
    was given as (`None` for a `Checkpoint` at a revision)."""

    source: _source.Source
    given: Any

    @property
    def hub(self) -> str | None:
        """Its Hub repository (`owner/name`), or `None`."""
        return None if self.source.pinned is None else self.source.pinned.repo


def base_of(
    pytree: Any, base: Any, *, standalone: bool, single: str | None, destination: Location, token: str | None
) -> Based | None:
    """The base an export of `pytree` is made against: `base` as given; else,
    for a fine-tune's `Checkpoint`, its own base (unless `standalone`)."""
    if base is not None and standalone:
        both = f"{option('`base=`', '`--base`')} and {option('`standalone=True`', '`--standalone`')}"
        raise CheckpointValueError(f"{both} contradict: a standalone export holds every leaf.")
    inherited = None
    if base is None:
        lazy = pytree._source.base if isinstance(pytree, Checkpoint) and not standalone else None
        inherited = None if lazy is None else lazy.source  # (a missing base: its error, saying what works)
        if inherited is None:
            return None
    if single is not None:
        raise CheckpointValueError(
            f"An export against a base needs a folder, whose `{_published.NAME}` names the base: "
            f"{single!r} is one safetensors file. Export to a folder, or pass `standalone=True`."
        )
    given = base
    if inherited is not None:  # the base the fine-tune was opened with, as it was opened
        given, source = inherited.loc.display, inherited
    elif isinstance(base, Checkpoint):
        given = base.path if base.revision is None else None
        source = base._source
    elif isinstance(base, (str, os.PathLike, dict)):
        try:
            source = _opening.open_source(base, LoadOptions(token=token), whole=True)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"The base given as {option('`base=`', '`--base`')} ({_shown(base)}) cannot be found: {e} Check "
                f"the base's path or repository.",
                path=e.path,
            ) from e
    else:
        raise CheckpointTypeError(
            f"`base` must be a path (`hf://owner/name`, a checkpoint, a published folder) or a `Checkpoint`, not "
            f"{type(base).__name__}."
        )
    return Based(source, given)


def _shown(base: Any) -> str:
    """`base` as the caller gave it (a kvstore spec as JSON)."""
    return repr(os.fspath(base)) if isinstance(base, (str, os.PathLike)) else json.dumps(base, sort_keys=True)


def _pin(source: _source.Source, given: Any, destination: Location) -> _published.Base:
    if source.pinned is not None:  # (read from the cache or by ranges alike)
        return _published.Base(source.pinned.hub.path, revision=source.pinned.sha)
    sha256 = _family.record_sha256(source)
    if sha256 is None:
        raise CheckpointValueError(
            f"The base {source.loc.display!r} is {source.format} with no record of its own to pin it by: save it "
            f"with eqx_ckpt or export it with `export_safetensors` first, and export against that."
        )
    if source.loc.local is not None:
        path = source.loc.local
        if destination.local is not None:
            path = os.path.relpath(path, destination.local)
            if _family.beside(destination.local, path) is None:
                _not_followed(destination, path, "is not in the folder that holds the fine-tune")
        else:
            _not_followed(destination, path, "is on a local disk, and the fine-tune is not")
        return _published.Base(path, sha256=sha256)
    if not isinstance(given, (str, os.PathLike)):
        raise CheckpointTypeError(
            f"The base {source.loc.display!r} is on an object store: give it as a URL (`s3://bucket/base`), which "
            f"the fine-tune's record keeps."
        )
    _not_followed(destination, os.fspath(given), "is a URL")
    return _published.Base(os.fspath(given), sha256=sha256)


def _not_followed(destination: Location, path: str, why: str) -> None:
    """Warn that a load will not follow the base recorded as `path` (`_family.recorded`): it needs `base=`."""
    warnings.warn(
        f"The fine-tune exported to {destination.display!r} records its base as {path!r}, which {why}: a load "
        f"follows a fine-tune's record only to an `hf://` base or a folder beside the fine-tune (so that a folder "
        f"received from elsewhere reads nothing else), so loads of it need the base given "
        f"({option('`base=`', '`--with-base`')}). Export it beside its base to load it without.",
        UserWarning,
        stacklevel=5,
    )


def against(
    tensors: Sequence[Any],
    based: Based,
    digests: dict[str, _digests.Digested],
    tensor_bytes: Callable[[Any], Any],
    destination: Location,
) -> tuple[_published.Family | None, str]:
    """The family of an export of `tensors` (each with `record` and `nbytes`;
    `tensor_bytes` reads one's stored bytes) against `based`, and a line saying
    what it stores and takes. The family is `None` (every leaf stored) where it
    would take under both `STANDALONE_FRACTION` of its bytes and
    `STANDALONE_BYTES`. Every digest computed is kept in `digests`."""
    references = _matched(tensors, based.source, digests, tensor_bytes)
    total = sum(t.nbytes for t in tensors)
    taken = sum(t.nbytes for t in tensors if t.record.path in references)
    if taken < STANDALONE_BYTES and taken < STANDALONE_FRACTION * total:
        return None, (
            f"written standalone, {_count(len(tensors))}, {total} bytes ({human(total)}): it would take only "
            f"{taken} bytes from the base {based.source.loc.display}, under both "
            f"{STANDALONE_FRACTION:.0%} of its bytes and {human(STANDALONE_BYTES)}, so it loads without the base."
        )
    pin = _pin(based.source, based.given, destination)
    return _published.Family(pin, references), (
        f"stored {_count(len(tensors) - len(references))}, {total - taken} bytes ({human(total - taken)}); "
        f"took {_count(len(references))}, {taken} bytes ({human(taken)}) from the base {pin.shown}."
    )


def _count(leaves: int) -> str:
    return f"{leaves} leaf" if leaves == 1 else f"{leaves} leaves"


def _matched(
    tensors: Sequence[Any],
    source: _source.Source,
    digests: dict[str, _digests.Digested],
    tensor_bytes: Callable[[Any], Any],
) -> dict[str, str]:
    """Each of `tensors` whose bytes a leaf of the base `source` holds, with
    that leaf's dotted path."""
    candidates: dict[tuple[str, tuple[int, ...], str], list[LeafRecord]] = {}
    for record in source.manifest.leaves:
        candidates.setdefault(_kind(record), []).append(record)
    known: dict[str, str] = {}  # the base's digests, by dotted path, as they are read

    def base_digest(record: LeafRecord, like: str) -> str:
        if record.path not in known:
            # (blocks of the size an export records, whatever size the base's own record says)
            block = _verified.export_block(record)
            known[record.path] = _verified.stored_digest(source, record, like=like, block=block).digest
        return known[record.path]

    references: dict[str, str] = {}
    backing: dict[str, tuple[int, int]] = {}  # leaves and bytes each base leaf backs so far
    for tensor in tensors:
        found = candidates.get(_kind(tensor.record))
        if not found:
            continue
        mine = digests[tensor.record.path] = _verified.digest(tensor_bytes(tensor), tensor.record)
        # The leaf of the same name first: a fine-tune mostly keeps its names.
        for record in sorted(found, key=lambda r: r.path != tensor.record.path):
            count, claimed = backing.get(record.path, (0, 0))
            more = (count + 1, claimed + record.nbytes)
            # Beyond what a load accepts of one base leaf, the leaf is stored instead.
            if _family.may_back(*more, record.nbytes) and base_digest(record, mine.digest) == mine.digest:
                references[tensor.record.path] = record.path
                backing[record.path] = more
                break
    return references


def _kind(record: LeafRecord) -> tuple[str, tuple[int, ...], str]:
    return record.stored_dtype, tuple(record.stored_shape), record.encoding
