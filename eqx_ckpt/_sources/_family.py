"""A fine-tune stored against its base: one source of leaves made of two.

A published folder whose `eqx_ckpt.json` names a base (`_published.Family`)
holds only the leaves that differ from it; the others are recorded with the
dotted path of the base's leaf holding the same bytes, and every leaf with the
digest of its bytes. `with_base` returns one `Source` whose opener and runs
read each leaf from where it lives, so every load option works on it as on
any source.

The base is opened as any source (`_opening.open_source`) only when a leaf taken
from it is first needed (`_source.Base`): by a load's plan (`_source.Source.need`), a
read, `Checkpoint` or `verify`. A load of only the fine-tune's own leaves never
opens it. Where it cannot be found, `Checkpoint` and `verify` say so
(`Base.missing`) and still describe what is stored.

The record, and the base it names, are untrusted input. Every check on a base
is made here, in this order:

- **Where** (`recorded`), before anything of the base is opened or stat'ed: a
  base given at load time (`base=`) is read wherever it is; a recorded one
  only if it is a pinned `hf://` base, or a relative local path inside the
  folder holding the fine-tune, through no symbolic link that leads out.
  Anything else is not reachable (`Base.refused`): nothing there is opened,
  the fine-tune's own leaves still read, and a read of a leaf taken from it
  is an `UntrustedError` that never says whether the path exists. A
  fine-tune read from the Hub may name only an `hf://` base.
- **Bounds** (`_bounded`), before the base is opened: how many leaves, and
  bytes, one leaf of the base may back.
- **Pin** (`_opened`), once the base is opened: an `hf://` base is read at its
  commit; any other must have the record file whose sha256 the fine-tune
  recorded, as its source read it when opened (no second read by path). A
  base given at load time needs no pin: its leaves are checked one by one.
- **Leaves**: each taken leaf is there, with the dtype and shape recorded
  (`_taken`); each leaf read whole, taken or stored, is checked against its
  recorded digest as it is read (`_verified.DigestCheck`); from `eqx_ckpt.json`
  version 4, a region of a taken leaf is read in whole blocks, each checked
  against the fine-tune's block digests (`_verified.taken`), whatever the base is.

A missing or changed base is an error naming the fine-tune, its base and what
was expected, never a mix of two models. Bases of bases are followed, at most
`MAX_DEPTH` deep, each by the same rules, relative to the base that names it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
from collections.abc import Callable

import numpy as np

from .._base._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    IntegrityError,
    UntrustedError,
    from_file,
    option,
    stored_leaf_error,
)
from .._base._location import Location, location
from .._foreign import _safetensors
from .._ondisk import _published
from .._ondisk._format import LeafRecord
from .._store import _chunk_files, _storage, _storage_errors
from .._store._local_paths import local_entry, local_link, local_names
from . import _verified
from ._source import Base, Opening, Options, Read, Runs, Source, reason

# Bases of bases followed at most this deep (a chain of fine-tunes).
MAX_DEPTH = 8
# One leaf of a base backs at most this many leaves of a fine-tune. Several
# are real (tied weights, biases that are all zeros), thousands are not.
MAX_BACKED = 1024
# ... and those leaves claim together at most this many times its bytes, or
# `BACKED_BYTES` where that is more (a thousand small zero biases).
BACKED_FACTOR = 4
BACKED_BYTES = 64 * 2**20
# Symbolic links followed inside the fine-tune's folder, at most (as the system's own limit).
MAX_LINKS = 40


def record_sha256(source: Source) -> str | None:
    """The sha256 of the file recording `source`'s leaves (`manifest.json`,
    `eqx_ckpt.json`) as read when it was opened; `None` for safetensors or orbax."""
    return source.manifest.record_sha256 or None


def recorded(base: _published.Base, where: Location, *, hub: bool) -> tuple[str, str]:
    """Where the recorded base of the fine-tune at `where` is read from: an
    `hf://` base at its commit, or a local one inside the fine-tune's folder
    (its links resolved), and `""`. Else `""` and why a load does not follow
    it, found before anything there is opened."""
    if base.revision:
        return _published.hub_at(base.path, base.revision), ""
    if hub:
        return "", "a fine-tune read from the Hub may take its base only from the Hub (`hf://`)"
    path = base.path
    beside_only = "and a fine-tune's record may name a base only beside it"
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path):
        return "", f"it is a URL, {beside_only}"
    if path.startswith("/"):
        return "", f"it is an absolute path, {beside_only}"
    if path.startswith("~"):
        return "", f"it starts with `~` (a home folder), {beside_only}"
    if where.local is None:
        return "", "it is a local path, relative to a folder on a local disk; this fine-tune is not on one"
    folder = os.path.dirname(where.local)
    relative = beside(where.local, path)
    if relative is None:
        return "", "it leads out of the folder that holds the fine-tune"
    found = _confined(folder, relative)
    if found is None:
        return "", "it leads out of the folder that holds the fine-tune, through a symbolic link"
    outside = _links_out(folder, found)
    if outside is not None:
        return "", (
            f"its entry {from_file(repr(outside))} is a symbolic link leading out of the folder that holds the "
            f"fine-tune"
        )
    return found, ""


def beside(finetune: str, path: str) -> str | None:
    """The local `path` of a base, relative to the fine-tune's folder `finetune`,
    made relative to that folder's parent; `None` where its text leads out of it."""
    relative = os.path.normpath(os.path.join(os.path.basename(finetune), path))
    return None if relative in (".", "..") or relative.startswith("../") else relative


def _confined(folder: str, relative: str) -> str | None:
    """`folder/relative` with its symbolic links resolved, or `None` where one
    leads out of `folder` (or they loop): each link's target is judged by its
    text before it is followed. A missing component is kept (the open says so)."""
    pending = relative.split("/")
    current, links = folder, 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if current == folder:
                return None
            current = os.path.dirname(current)
            continue
        following = os.path.join(current, part)
        if not local_entry(following).link:
            current = following
            continue
        links += 1
        if links > MAX_LINKS:
            return None
        target = local_link(following)
        if target.startswith("/"):
            target = os.path.normpath(target)
            if target != folder and not target.startswith(folder + "/"):
                return None
            current, target = folder, os.path.relpath(target, folder)
        pending = target.split("/") + pending
    return current


def _links_out(folder: str, base: str) -> str | None:
    """The first entry of the base's folder `base` that is a symbolic link
    leading out of `folder` (what the base's files are read through), or `None`."""
    if not local_entry(base).folder:
        return None  # (not a folder: the open says what it is)
    for name in local_names(base):
        path = os.path.join(base, name)
        if local_entry(path).link and _confined(folder, os.path.relpath(path, folder)) is None:
            return name
    return None


def _refused(where: Location, base: _published.Base, why: str) -> UntrustedError:
    return UntrustedError(
        f"{where.display!r} is a fine-tune whose record names its base as {from_file(repr(base.path))}, which is not "
        f"followed: {why}. A folder received from elsewhere could otherwise make a load read, or contact, what you "
        f"never named. Nothing was opened there. If you trust it, give the base yourself: {_give_base()}. Its "
        f"leaves are then checked against the digests the fine-tune records.",
        path=where.display,
    )


def may_back(count: int, claimed: int, size: int) -> bool:
    """Whether one leaf of a base, of `size` bytes, may back `count` leaves of a
    fine-tune claiming `claimed` bytes together (`_matching` exports within this)."""
    return count <= MAX_BACKED and claimed <= max(BACKED_FACTOR * size, BACKED_BYTES)


def _bounded(source: Source, family: _published.Family) -> None:
    """Refuse a fine-tune that claims more of its base than any fine-tune
    does: a leaf of the base backing more than `MAX_BACKED` leaves, or more
    than `max(BACKED_FACTOR` times its bytes`, BACKED_BYTES)` in all."""
    mine = source.manifest.by_path()
    backing: dict[str, list[int]] = {}
    for path, name in family.references.items():
        backing.setdefault(name, []).append(mine[path].nbytes)
    for name, sizes in backing.items():
        claimed = sum(sizes)
        if not may_back(len(sizes), claimed, min(sizes)):
            raise CorruptCheckpointError(
                f"{source.loc.display!r} takes {len(sizes)} leaves ({claimed} bytes in all) from one leaf of its "
                f"base, {from_file(repr(name))}: more than the {MAX_BACKED} leaves and max({BACKED_FACTOR} times its "
                f"bytes, {BACKED_BYTES}) bytes one leaf of a base may back. No fine-tune needs that much of one "
                f"leaf; the record is damaged or hostile, so nothing is loaded.",
                path=source.loc.display,
            )


def with_base(source: Source, open_source: Opening, options: Options, *, whole: bool, depth: int) -> Source:
    """`source`, a fine-tune, with its base's leaves: one `Source` of both (or
    `source` where it has no base). `options.base`, where given, is read instead
    of the recorded one. Where the base is, and how much it backs, are checked
    now; it is opened when a leaf taken from it is first needed (`Base`)."""
    given = options.base
    family: _published.Family | None = source.manifest.family
    where = source.loc
    if family is None:
        if given is not None:
            raise CheckpointValueError(
                f"`base` was given, but {where.display!r} is not a fine-tune stored against a base: it holds every "
                f"leaf itself. Load it without `base`."
            )
        return source
    if depth >= MAX_DEPTH:
        raise CorruptCheckpointError(
            f"{where.display!r} is a fine-tune of a fine-tune... more than {MAX_DEPTH} deep (its base: "
            f"{from_file(repr(family.base.path))}); "
            f"eqx_ckpt follows at most {MAX_DEPTH}. Export one of them with `standalone=True`.",
            path=where.display,
        )
    path, why = (given, "") if given is not None else recorded(family.base, where, hub=source.revision is not None)
    _bounded(source, family)
    if why:  # not reachable: a load of a leaf taken from it is refused, the fine-tune's own leaves still read
        refused = _refused(where, family.base, why)
        base = Base(from_file(family.base.path), family.references, _raising(refused), given=False)
        base.refused = (refused, why)
    else:
        pinned = given is None and bool(family.base.revision)
        shown = family.base.shown if pinned else repr(str(path))
        opening = functools.partial(open_source, path, options.without_base(), whole=whole, depth=depth + 1)
        base = Base(
            family.base.shown if pinned else location(path).display,
            family.references,
            lambda: _opened(source, family, shown, given, location(path), opening),
            given=given is not None,
        )
    return dataclasses.replace(
        source,
        opener=lambda record: _open(source, base, record),
        runs=_runs(source, base),
        changed=lambda: _changed(source, base),
        base=base,
    )


def _raising(error: UntrustedError) -> Callable[[], tuple[Source, dict[str, LeafRecord]]]:
    def opening() -> tuple[Source, dict[str, LeafRecord]]:
        raise error

    return opening


def _opened(
    source: Source, family: _published.Family, shown: str, given: object, at: Location, opening: Callable[[], Source]
) -> tuple[Source, dict[str, LeafRecord]]:
    """The base of the fine-tune `source`, opened (`opening`, of the base `at`)
    and checked against its pin (a recorded one), and its taken leaves
    (`_taken`); its errors name the fine-tune and the base (`shown`)."""
    where = source.loc
    try:
        base = opening()
        if base.base is not None:  # its own base, down a chain of fine-tunes: opened with it
            base.base.opened()
    except CheckpointNotFoundError as e:
        # Its reason alone: the base's own advice ("load another revision") would not load the fine-tune.
        cause = _gone(at) or e
        advice = (
            f"Check the path given as {option('`base=`', '`--with-base`')}."
            if given is not None
            else _without_base(where, family.base, at, hub=source.revision is not None)
        )
        raise CheckpointNotFoundError(
            f"{where.display!r} is a fine-tune that holds only the leaves it changed; the others are read from its "
            f"base {shown}, which cannot be found: {reason(cause)} {advice}",
            path=where.display,
        ) from cause
    except CheckpointError as e:
        raise _named(e, f"{where.display!r} is a fine-tune whose base {shown} cannot be read: {e}", where) from e
    if given is None and not family.base.revision:
        found = record_sha256(base)
        if found != family.base.sha256:
            raise CorruptCheckpointError(
                f"{where.display!r} is a fine-tune of the base {shown} as it was when the fine-tune was exported "
                f"(its record's sha256 {family.base.sha256[:16]}...), but that base has changed since (now "
                f"{'no record' if found is None else found[:16] + '...'}): its leaves may no longer be the ones the "
                f"fine-tune was made from, so nothing is loaded. Restore the base, give the base it was made from "
                f"as {option('`base=`', '`--with-base`')} (its leaves are then checked one by one), or export the "
                f"fine-tune again against the "
                f"base as it is now.",
                path=where.display,
            )
    return base, _taken(source, base, family, shown)


def _gone(at: Location) -> CheckpointNotFoundError | None:
    """That nothing is at the local path `at` (a base moved or deleted), or `None`
    where something is: the open's own error then says what it lacks."""
    if at.local is None or local_entry(at.local).exists:
        return None
    return CheckpointNotFoundError(
        f"There is nothing at {at.display!r}: no such folder (moved, renamed or deleted).", path=at.display
    )


def _give_base() -> str:
    """How to give a fine-tune its base, in Python or on the command line (`option`)."""
    python = (
        "`base=` on the load (`Checkpoint(path, base=...)`, `tree_deserialise_leaves(..., base=...)`, "
        "`verify(path, base=...)`)"
    )
    return option(python, "`--with-base BASE`")


def _without_base(where: Location, base: _published.Base, at: Location, *, hub: bool) -> str:
    """The ways to load the fine-tune at `where` (read from the Hub: `hub`)
    whose recorded `base` (read at `at`) is gone, each a command that works as printed once its
    placeholders are filled in. Putting back an `hf://` base may not help
    (the same bytes pushed again make another commit), so the fine-tune is
    stored again against the repository as it is now; a local base is put back."""
    tuned = shlex.quote(where.display)
    places = "OUT a new folder"
    given = option("`base=BASE` in Python, or `--with-base BASE` on the command line", "`--with-base BASE`")
    ways = [f"Give the copy: {given} (`eqx-ckpt ls {tuned} --with-base BASE`)."]
    if base.revision:
        now = shlex.quote(from_file(base.path))
        if hub:
            again, places = f"push {tuned} OWNER/NAME", places + " and OWNER/NAME the repository to push to"
        else:
            again = f"export {tuned} OUT"
        ways.append(
            f"Store the fine-tune again against the base as it is now (what the base no longer holds is then stored "
            f"in the fine-tune): `eqx-ckpt {again} --with-base BASE --base {now}`."
        )
    else:
        ways.append(f"Put the copy back at {at.display!r}, where the record names the base (its record unchanged).")
    ways.append(f"Make a copy that needs no base, once: `eqx-ckpt export --standalone {tuned} OUT --with-base BASE`.")
    listed = " ".join(f"{i}. {way}" for i, way in enumerate(ways, 1))
    return (
        f"With BASE a copy of the base the fine-tune was made from (the same leaves, at any path or commit: a "
        f"folder or checkpoint of it, or `hf://owner/name@<commit>`) and {places}, three ways work. {listed}"
    )


def _named(error: CheckpointError, message: str, where: Location) -> CheckpointError:
    """`error`, of its own class, with `message` (which names the fine-tune and its base)."""
    try:
        named = type(error)(message, path=where.display)
    except TypeError:  # (a class of other arguments)
        return error
    if hasattr(error, "dotted"):
        named.dotted = error.dotted  # type: ignore[attr-defined]
        named.keypaths = error.keypaths  # type: ignore[attr-defined]
    return named


def _taken(source: Source, base: Source, family: _published.Family, shown: str) -> dict[str, LeafRecord]:
    """The base's record of each leaf the fine-tune takes from it, by the
    fine-tune's dotted path; each checked against the fine-tune's record."""
    held = base.manifest.by_path()
    mine = source.manifest.by_path()
    taken: dict[str, LeafRecord] = {}
    stored = lambda r: (r.stored_dtype, r.stored_shape, r.encoding)
    for path, name in family.references.items():
        record, found = mine[path], held.get(name)
        if found is None:
            why = f"has no leaf {from_file(repr(name))}"
        elif stored(found) != stored(record):
            why = (
                f"stores its leaf {from_file(repr(name))} as {found.stored_dtype}{list(found.stored_shape)}, not as "
                f"the {record.stored_dtype}{list(record.stored_shape)} recorded"
            )
        else:
            taken[path] = found
            continue
        raise CorruptCheckpointError(
            f"{source.loc.display!r} takes its leaf {from_file(repr(path))} from its base {shown}, which {why}: it is "
            f"not the base the fine-tune was made from, so nothing is loaded.",
            path=source.loc.display,
        )
    return taken


def _open(source: Source, lazy: Base, record: LeafRecord) -> _storage.Future | _storage.Mapped:
    if record.path not in lazy.references:
        assert source.opener is not None  # (a published folder's tensors)
        return source.opener(record)
    base, taken = lazy.opened()
    found = taken[record.path]
    if found.pack is not None:  # a tiny leaf of an eqx_ckpt base, packed with others
        try:
            opened: _storage.Future | _storage.Mapped = _storage.ready(
                _storage.in_memory(_chunk_files.read_alone(base.data, found))
            )
        except Exception as e:
            raise _unreadable(source, base, record, found, e) from e
    else:
        opened = base.open(found)
    return _verified.taken(source, lazy, record, opened)


def reading_taken(
    source: Source,
    base: Source,
    record: LeafRecord,
    found: LeafRecord,
    reading: Callable[[], Callable[[], np.ndarray] | None],
) -> Callable[[], np.ndarray] | None:
    """`reading()`, the start of a read of a leaf `source` takes from `base`,
    its failure an error naming the fine-tune's leaf."""
    read = reading()
    if read is None:
        return None

    def finish() -> np.ndarray:
        try:
            return read()
        except Exception as e:
            raise _unreadable(source, base, record, found, e) from e

    return finish


def _unreadable(source: Source, base: Source, record: LeafRecord, found: LeafRecord, e: Exception) -> IntegrityError:
    failed = _storage_errors.leaf_io_error(e, found, base.data, "read")
    return stored_leaf_error(
        IntegrityError,
        f"it is taken from the base {base.loc.display!r}, whose leaf cannot be read: {failed}",
        dotted=record.path,
        path=source.loc.display,
    )


def _runs(source: Source, lazy: Base) -> Runs:
    """The reader of runs of small leaves: each from its own files, the fine-tune's
    or the base's (opened only where a run needs one of its leaves). Only the
    fine-tune's own runs are hashed as read (`feeding`): the base's records
    are the base's, and its leaves are checked against the fine-tune's digests."""

    def runs(records: list[LeafRecord], feeding: _safetensors.Feeding | None) -> tuple[list[int], Read]:
        done: list[int] = []
        groups = []
        own = [i for i, r in enumerate(records) if r.path not in lazy.references]
        from_base = [i for i, r in enumerate(records) if r.path in lazy.references]
        base, taken = lazy.opened() if from_base else (None, {})
        for reader, slots, fed in ((source.runs, own, feeding), (None if base is None else base.runs, from_base, None)):
            if reader is None or not slots:
                continue
            read, found = reader([taken.get(records[i].path, records[i]) for i in slots], fed)
            done += [slots[m] for m in read]
            groups.append((slots, found))
        return done, (([slots[m] for m in members], finish) for slots, found in groups for members, finish in found)

    return runs


def _changed(source: Source, lazy: Base) -> str | None:
    """The name of a file of the fine-tune rewritten since it was opened;
    a base replaced since it was opened raises as the base's own check does."""
    assert source.changed is not None
    name = source.changed()
    base = lazy.open
    if name is None and base is not None:
        base.check()
    return name
