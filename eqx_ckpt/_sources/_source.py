"""The stored leaves of one source, whatever wrote it (`Source`), and a
fine-tune's base (`Base`), opened when first needed.

A source is an eqx_ckpt checkpoint, safetensors, or orbax: its leaves as
manifest records, and how to open each. The format decides only those two;
the plan, the reads and the placement after are the same code for every
format. `_opening.open_source` recognises a source from its files. An eqx_ckpt
checkpoint is opened by `checkpoint` alone, wherever it is opened. Each
foreign format module has a `find` (`FINDERS`).
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np

from .._base._errors import CheckpointError, CheckpointNotFoundError, CheckpointReplacedError, UntrustedError
from .._base._location import Location
from .._foreign import _orbax, _safetensors
from .._ondisk import _format, _layout
from .._ondisk._format import LeafRecord
from .._ondisk._manifest import Manifest
from .._store import _storage, _transaction, _untrusted
from . import _hub

# A record -> a future of the `_storage.Array` of that leaf.
Opener = Callable[[LeafRecord], "_storage.Future | _storage.Mapped"]
# Runs of small leaves: the indices of the records read so, and for each run
# `(indices, finish)`, `finish()` returning each one's host array.
Read = Iterator[tuple[list[int], Callable[[], list[np.ndarray]]]]

# (a run read from a local file is hashed as it is read where the second
# argument says how: `_verified.Checks.feeding`)
Runs = Callable[[list[LeafRecord], _safetensors.Feeding | None], tuple[list[int], Read]]


# What a foreign format's `find` returns, read by name into a `Source`.
Foreign = _safetensors.Tensors | _orbax.Arrays
# Each foreign format's `find`, in the order `_opening.open_source` tries them.
FINDERS: tuple[Callable[[Location], Foreign | None], ...] = (_safetensors.find, _orbax.find)


@dataclasses.dataclass(frozen=True)
class Source:
    """The stored leaves of one checkpoint, whatever wrote it."""

    format: str  # "eqx_ckpt", "safetensors" or "orbax"
    loc: Location  # the path as given (messages name it)
    data: Location  # what the leaves' errors are reported against
    manifest: Manifest  # made from the files for other formats
    # `None` for eqx_ckpt's own arrays under `data` (`_storage.open_array`).
    opener: Opener | None = None
    # Other formats: the name of a file no longer the one opened, or `None`.
    changed: Callable[[], str | None] | None = None
    # Safetensors: many small tensors in a few large reads (`_safetensors.read_runs`).
    runs: Runs | None = None
    # A Hub repository (`hf://`): its folder pinned to the commit it is read at.
    pinned: _hub.Pinned | None = None
    # A Hub repository downloaded whole: what its download checked, as `verify` says it.
    checked: tuple[str, ...] = ()
    # A fine-tune's base (opened when first needed), from which `opener` reads the leaves it did not change.
    base: Base | None = None

    @property
    def revision(self) -> str | None:
        """The commit a Hub repository is read at (`None`: no Hub repository)."""
        return None if self.pinned is None else self.pinned.sha

    def open(self, record: LeafRecord) -> _storage.Future | _storage.Mapped:
        return self.opener(record) if self.opener is not None else _storage.open_array(self.data, record, checked=False)

    def stored_in(self, record: LeafRecord) -> tuple[Source, LeafRecord]:
        """Where the bytes of `record` are: here, or for a leaf a fine-tune
        takes from its base, the base's source and record (opening the base)."""
        if self.base is not None and record.path in self.base.references:
            opened = self.base.opened()  # (the base's source, its records of the leaves taken)
            return opened[0], opened[1][record.path]
        return self, record

    def need(self, paths: Iterable[str]) -> None:
        """Open a fine-tune's base before any of `paths` is read, where one is
        taken from it, so that its errors (a missing base) are raised here."""
        if self.base is not None:
            self.base.need(paths)

    def check(self) -> None:
        """Raise `CheckpointReplacedError` if the source was replaced since it
        was opened. Readers call it after reading and when a read fails, so
        what they return was read from the source as it was opened."""
        if self.changed is None:
            _transaction.check_unchanged(self.loc, self.manifest)
            return
        name = self.changed()
        if name is not None:
            raise CheckpointReplacedError(
                f"{_LABELS[self.format]} {self.loc.display!r} was replaced after it was opened: its file `{name}` "
                f"was rewritten (or removed) since, so what was read from it may belong to either version and "
                f"was discarded. Open or load it again to read the new one.",
                path=self.loc.display,
            )


_LABELS = types.MappingProxyType({"safetensors": "Safetensors checkpoint", "orbax": "orbax checkpoint"})


class Options(Protocol):
    """What a source reads of a load's options (`_load_plan.LoadOptions`)."""

    @property
    def whole(self) -> bool: ...

    @property
    def token(self) -> str | None: ...

    @property
    def base(self) -> object:
        """The base given at load time (`base=`): a path, as `location` takes it, or `None`."""

    def without_base(self) -> Options:
        """The same options with no base given (what a base is opened with)."""


class Opening(Protocol):
    """`_opening.open_source`, as a fine-tune opens its base (`_family.with_base`)."""

    def __call__(self, path: object, options: Options, *, whole: bool | None = None, depth: int = 0) -> Source: ...


def checkpoint(loc: Location, manifest: Manifest | None = None) -> Source | None:
    """The eqx_ckpt checkpoint at `loc`, opened; `None` where there is no
    manifest. Its manifest is read as untrusted input, and its data root must
    not lead out of it through a link. A `manifest` given (one the caller
    read from `loc` already) is taken as it is."""
    if manifest is None:
        manifest = _transaction.read_manifest(loc)
        if manifest is None:
            return None
        ocdbt = manifest.layout == "ocdbt"
        root = manifest.data_root + ("/" + _format.OCDBT_FOLDER if ocdbt else "")
        _untrusted.refuse_links(loc, root, subtree=ocdbt)
    return Source("eqx_ckpt", loc, _layout.data_location(loc, manifest.data_root, manifest.layout), manifest)


class Base:
    """A fine-tune's base, opened and checked (`_family.with_base` makes it)
    when a leaf taken from it is first needed; until then nothing of it is
    opened or requested.

    `display`: the base as messages name it. `references`: the fine-tune's
    dotted path of each leaf taken from it -> the base's. `given`: the base
    was given at load time (`base=`), so it is held to the digests, not the
    pin. `refused`: where the recorded base is not followed (`_family.recorded`), why;
    its every open raises that. An open that fails is tried again when next
    needed (a base put back is then found)."""

    def __init__(
        self,
        display: str,
        references: dict[str, str],
        opening: Callable[[], tuple[Source, dict[str, LeafRecord]]],
        *,
        given: bool,
    ):
        self.references = references
        self._display = display
        self._opening = opening
        self.given = given
        self.refused: tuple[UntrustedError, str] | None = None
        self._opened: tuple[Source, dict[str, LeafRecord]] | None = None
        self._lock = threading.Lock()

    def opened(self) -> tuple[Source, dict[str, LeafRecord]]:
        """The base's source and its record of each taken leaf, opened and checked
        once; a missing base raises `CheckpointNotFoundError`."""
        with self._lock:
            if self._opened is None:
                self._opened = self._opening()
            return self._opened

    @property
    def source(self) -> Source:
        return self.opened()[0]

    @property
    def open(self) -> Source | None:
        """The base's source where it was opened already, else `None`."""
        return None if self._opened is None else self._opened[0]

    @property
    def display(self) -> str:
        opened = self.open
        return self._display if opened is None else opened.loc.display

    def need(self, paths: Iterable[str]) -> None:
        """Open the base where one of the fine-tune's leaves `paths` is taken from it."""
        if any(path in self.references for path in paths):
            self.opened()

    def missing(self) -> CheckpointError | None:
        """Why the base (or one down its chain) cannot be reached, or `None`
        where it opens: it cannot be found (`CheckpointNotFoundError`), or its
        record names it where a load does not follow (`UntrustedError`,
        nothing there opened). Any other error of the base is raised."""
        try:
            self.opened()
        except (CheckpointNotFoundError, UntrustedError) as e:
            return e
        return None

    def reason(self, missing: CheckpointError) -> str:
        """`missing` (what `missing()` gave) in one sentence."""
        if self.refused is not None and missing is self.refused[0]:
            said = f"its record names it as `{self._display}`, which a load does not follow on its own"
            return f"{said}: {self.refused[1]}."
        return reason(missing)


def reason(missing: CheckpointError) -> str:
    """The short reason a missing base cannot be found: the first sentence of
    its open's own error, whose end is looked for after the path it quotes
    (a path may hold ". " too)."""
    cause = missing.__cause__ if isinstance(missing.__cause__, CheckpointError) else missing
    text = str(cause)
    quoted = repr(cause.path)
    start = text.find(quoted) + len(quoted) if quoted in text else 0
    end = text.find(". ", start)
    return (text if end < 0 else text[:end]).rstrip(".") + "."
