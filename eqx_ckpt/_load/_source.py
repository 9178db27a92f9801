"""Where a load reads leaves from: an eqx_ckpt checkpoint, safetensors, or orbax.

Every load path (`tree_deserialise_leaves`, `Checkpoint`, lazy leaves,
`load_or_initialise`, export) asks `open_source(path)` for a `Source`. It holds:

- the stored leaves, as manifest records keyed by dotted path;
- a function that opens one of them as a TensorStore array.

The format decides only how those two are made. Everything after is the same
code for every format:

- the load plan (`_load_plan`: `where`, `prefix`, `rename`, `transform` and
  the checks of records against `like`);
- windows of reads;
- sharded placement;
- lazy reads.

An eqx_ckpt checkpoint is opened by `checkpoint` alone, wherever it is opened
(a load, `verify`, a partial save, an incremental save's base). It reads the
manifest as untrusted input, refuses a data root that leads out of the
checkpoint, and returns the `Source` of its leaves.

Each foreign format module has a `find` (`FINDERS`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .._base._errors import CheckpointNotFoundError, CheckpointReplacedError, shown_names
from .._base._location import Hub, Location, location
from .._foreign import _orbax, _safetensors
from .._ondisk import _format, _layout
from .._ondisk._format import MANIFEST, LeafRecord
from .._ondisk._manifest import Manifest
from .._store import _storage, _transaction, _untrusted
from . import _family, _hub

# A record -> a future of the `_storage.Array` of that leaf.
Opener = Callable[[LeafRecord], "_storage.Future | _storage.Mapped"]
Runs = Callable[[list[LeafRecord]], tuple[list[int], Any]]


# What each foreign format's `find` returns for a checkpoint of its format,
# read here by name into a `Source` (see there for each member).
Foreign = _safetensors.Tensors | _orbax.Arrays
# Each foreign format's `find`, in the order `open_source` tries them.
FINDERS: tuple[Callable[[Location], Foreign | None], ...] = (_safetensors.find, _orbax.find)


@dataclasses.dataclass(frozen=True)
class Source:
    """The stored leaves of one checkpoint, whatever wrote it.

    **Attributes:**

    - `format`: `"eqx_ckpt"`, `"safetensors"` or `"orbax"`.
    - `loc`: the path as given (messages name it).
    - `data`: the location the leaves' errors are reported against.
    - `manifest`: the leaves' records (made from the files for other formats).
    - `opener`: record -> future of the `_storage.Array` holding that leaf;
        `None` for eqx_ckpt's own zarr3 arrays under `data` (`_storage.open_array`).
    - `changed`: for other formats, the name of a file of the source that is
        no longer the one opened (`None` while none is).
    - `runs`: for safetensors, the reader of many small tensors in a few large
        reads (`_safetensors.read_runs`); `None` for the others.
    - `pinned`: for a Hugging Face Hub repository (`hf://`), its folder pinned
        to the commit it is read at (`_hub.Pinned`); `None` for every other source.
    - `checked`: for a Hub repository downloaded whole, what its download
        checked, as `verify` says it (`_hub.download`).
    - `base`: for a fine-tune stored against a base, its base
        (`_family.Base`, opened when first needed), from which `opener`
        reads the leaves it did not change.
    """

    format: str
    loc: Location
    data: Location
    manifest: Manifest
    opener: Opener | None = None
    changed: Callable[[], str | None] | None = None
    runs: Runs | None = None
    pinned: _hub.Pinned | None = None
    checked: tuple[str, ...] = ()
    base: _family.Base | None = None

    @property
    def revision(self) -> str | None:
        """The commit a Hub repository is read at (`None`: no Hub repository)."""
        return None if self.pinned is None else self.pinned.sha

    def open(self, record: LeafRecord) -> Any:
        return self.opener(record) if self.opener is not None else _storage.open_array(self.data, record, checked=False)

    def stored_in(self, record: LeafRecord) -> tuple[Source, LeafRecord]:
        """Where the bytes of the leaf `record` are: this source and `record`,
        or for a leaf a fine-tune takes from its base, the base's source and
        its record (the base opened, where it was not)."""
        if self.base is not None and record.path in self.base.references:
            opened = self.base.opened()  # (the base's source, its records of the leaves taken)
            return opened[0], opened[1][record.path]
        return self, record

    def need(self, paths: Iterable[str]) -> None:
        """Open what reading the stored leaves `paths` needs, before any is
        read: a fine-tune's base, where one of them is taken from it. Its
        errors (a missing base among them) are raised here."""
        if self.base is not None:
            self.base.need(paths)

    def check(self) -> None:
        """Raise `CheckpointReplacedError` if the source was replaced since it was
        opened.

        Readers call it after reading, and when a read fails. So what they
        return was read from the source as it was opened. An eqx_ckpt
        checkpoint is checked by its manifest (`_transaction.check_unchanged`),
        other formats by their files (`changed`)."""
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
    def base(self) -> Any: ...


def open_source(
    path: Any,
    options: Options,
    *,
    whole: bool | None = None,
    depth: int = 0,
    pinned: _hub.Pinned | None = None,
) -> Source:
    """The source at `path`, recognised from its files. It is an eqx_ckpt
    checkpoint when nothing else matches, so its error names what is missing.

    A Hub repository (`hf://`) is read at the commit its revision names now
    (`_hub.pin`, once; `pinned`: where it was, by the source it is opened
    again from). It is read from the Hub's local cache in two cases:
    where the files a load reads are there, and where the load is `whole`
    (they are downloaded into it first). Else it is read by byte ranges of its
    files: the headers and the leaves a load selects.

    `options` is the load's, whole (`LoadOptions`): `options.token` is the
    Hub token it is read with (`None`: huggingface_hub's own, `HF_TOKEN`);
    `whole` is `options.whole` unless the caller says (`Checkpoint` opens by
    byte ranges, `verify` downloads a Hub repository). A fine-tune stored
    against a base is returned with its base (`_family.with_base`), `depth`
    bases deep: the one its record names, or `options.base`, where the
    caller gives one."""
    loc = location(path)
    whole = options.whole if whole is None else whole
    base = options.base
    if loc.hub is not None:
        hub = _from_hub(loc.hub, whole, options.token, pinned)
        return _family.with_base(hub, open_source, options, whole=whole, depth=depth)
    # A `.safetensors` path is never a directory: `_safetensors.find` reads it
    # (or raises), before anything else is tried.
    source = None if _safetensors.is_file_path(loc) else checkpoint(loc)
    if source is not None:  # (no base of its own: a `base` given is refused there)
        return source if base is None else _family.with_base(source, open_source, options, whole=whole, depth=depth)
    for find in FINDERS:
        found = find(loc)
        if found is not None:
            return _family.with_base(_foreign(loc, found), open_source, options, whole=whole, depth=depth)
    held = _what_is_there(loc)
    if held:
        # What it is and what to do, nothing else: the note on interrupted
        # saves sent users looking for one beside a `pytorch_model.bin`.
        raise CheckpointNotFoundError(f"{loc.display!r} is not a checkpoint eqx_ckpt reads.{held}", path=loc.display)
    raise CheckpointNotFoundError(
        f"There is no eqx_ckpt checkpoint at {loc.display!r} (no {MANIFEST}). Check the path; a save that was "
        f"interrupted leaves no checkpoint. Nor is it another format eqx_ckpt reads: no `{_safetensors.INDEX}`, "
        f"`{_safetensors.SINGLE}` (or a fine-tune's `{_safetensors.single_name(_safetensors.FINETUNE)}`) or orbax "
        f"`{_orbax.METADATA}` there either (see docs/interop.md)." + _hub_hint(path, loc),
        path=loc.display,
    )


def _hub_hint(path: Any, loc: Location) -> str:
    """A Hugging Face habit's hint: `owner/name` given for a Hub repository,
    where no such local folder exists."""
    if not isinstance(path, str) or loc.local is None or _storage.local_entry(os.path.dirname(loc.local)).exists:
        return ""  # (where the owner is a local folder, the path is one of its own)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[^/\s]+)?", path):
        return ""
    return f" No local folder {path!r} exists either: did you mean the Hugging Face Hub repository `hf://{path}`?"


def _from_hub(where: Hub, whole: bool, token: str | None, pinned: _hub.Pinned | None) -> Source:
    """A folder of a Hub repository, pinned to a commit: its safetensors (with
    `eqx_ckpt.json` where there is one).

    It is read as a local folder of the cache where the cache holds them, else
    by byte ranges. A folder pinned already (`pinned`: a `Checkpoint` loaded
    whole after it was opened) keeps its pin: the revision it was asked by,
    the commit, the token."""
    if pinned is None or (token is not None and token != pinned.token):
        pinned = _hub.pin(where, token)
    files = _hub.Files(pinned)
    names = _hub.needed(pinned, _hub.reader(files, whole=whole))
    checked: tuple[str, ...] = ()
    if whole or pinned.offline or _hub.cached(pinned, names):
        downloaded = _hub.download(pinned, names)  # (the folder, and what was checked)
        folder = downloaded[0].rstrip("/")  # the cached copy, a local folder named in messages as the Hub's
        opened = Location({"driver": "file", "path": folder + "/"}, pinned.display, folder)
        checked = downloaded[1]
        found = _safetensors.find(opened)
    else:
        opened = files.loc
        found = _safetensors.find(opened, files)
    if found is None:  # `needed` found safetensors files there
        raise CheckpointNotFoundError(
            f"{pinned.display} holds no safetensors file eqx_ckpt reads.", path=pinned.display
        )
    return dataclasses.replace(_foreign(opened, found), pinned=pinned, checked=checked)


def checkpoint(loc: Location, manifest: Manifest | None = None) -> Source | None:
    """The eqx_ckpt checkpoint at `loc`, opened; `None` where there is none (no
    manifest). Every module opens one here.

    - Its manifest is read and checked as untrusted input (`_manifest`).
    - Its data root (with an OCDBT database in it) must not lead out of it
      through a symbolic link (`CorruptCheckpointError`).
    - A `manifest` given is the one its caller already read from `loc` (the
      one a save's transaction replaces). It is taken as it is."""
    if manifest is None:
        manifest = _transaction.read_manifest(loc)
        if manifest is None:
            return None
        ocdbt = manifest.layout == "ocdbt"
        root = manifest.data_root + ("/" + _format.OCDBT_FOLDER if ocdbt else "")
        _untrusted.refuse_links(loc, root, subtree=ocdbt)
    return Source("eqx_ckpt", loc, _layout.data_location(loc, manifest.data_root, manifest.layout), manifest)


def _foreign(loc: Location, found: Foreign) -> Source:
    return Source(found.format, loc, loc, found.manifest, found.opener, found.changed, found.runs)


# Files of PyTorch's pickle format, which eqx_ckpt never opens.
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _what_is_there(loc: Location) -> str:
    """What a local path that holds no format eqx_ckpt reads does hold, and what
    to do with it ("" when nothing is recognised).

    It recognises an Equinox `.eqx` file, PyTorch pickles, safetensors shards
    without their index, and orbax items or steps."""
    path = loc.local
    if path is None:
        return ""
    entry = _storage.local_entry(path)
    if not entry.exists:
        return ""
    if not entry.folder:
        if path.endswith(".eqx"):
            return (
                " It is an Equinox file (`eqx.tree_serialise_leaves` writes one stream with no names in it): "
                "convert it once with `eqx_ckpt.convert_eqx_file(eqx_path, ckpt_path, like)`, then load the "
                "checkpoint."
            )
        return " It is a file; an eqx_ckpt checkpoint is a directory."
    names = _storage.local_names(path)
    shards = [n for n in names if n.endswith(_safetensors.SUFFIX)]
    if shards:
        return (
            f" It holds {len(shards)} safetensors files ({shown_names(shards)}) but no `{_safetensors.INDEX}` saying "
            f"which tensor is in which: load one file by its path, or write the index."
        )
    pickles = [n for n in names if n.endswith(_PICKLES)]
    if pickles:
        return (
            f" It holds {shown_names(pickles)}: pickled files (PyTorch's `torch.save`), which eqx_ckpt never reads, "
            f"since unpickling runs code from the file. Where you trust the file, convert it with PyTorch "
            f"(`safetensors.torch.save_file(torch.load(path), 'model.safetensors')`) and load that."
        )
    items = [n for n in names if _storage.local_entry(os.path.join(path, n, _orbax.METADATA)).file]
    if items:
        return f" It is an orbax checkpoint of several items ({shown_names(items)}): pass one item's folder."
    orbax_manager = _orbax.manager_steps(path)
    if orbax_manager:
        return orbax_manager
    steps = [n for n in names if n.isdigit() and _storage.local_entry(os.path.join(path, n)).folder]
    if steps:
        return f" It looks like an orbax CheckpointManager's directory (steps {shown_names(steps)}): pass one step."
    return ""
