"""Where a load reads leaves from: `open_source` recognises an eqx_ckpt
checkpoint, safetensors, orbax or a Hub repository from its files, and gives
its `_source.Source`, with a fine-tune's base (`_family.with_base`).

Every load path asks `open_source(path)` for its source. A safetensors folder's
leaves are opened through the verifying reader (`_verified`), which checks
each region read against the block digests its `eqx_ckpt.json` records.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from .._base._errors import CheckpointNotFoundError, shown_names
from .._base._location import Hub, Location, location
from .._foreign import _orbax, _safetensors
from .._ondisk._format import MANIFEST
from .._store import _storage
from . import _family, _hub, _verified
from ._source import FINDERS, Foreign, Options, Source, checkpoint


def open_source(
    path: Any,
    options: Options,
    *,
    whole: bool | None = None,
    depth: int = 0,
    pinned: _hub.Pinned | None = None,
) -> Source:
    """The source at `path`, recognised from its files; an eqx_ckpt checkpoint
    when nothing else matches, so its error names what is missing.

    `whole` (default `options.whole`): a Hub repository is downloaded into its
    cache first, else read by byte ranges unless its files are cached.
    `pinned`: the commit a Hub repository was opened at before. A fine-tune
    comes with its base (`_family.with_base`), `depth` bases deep."""
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
    """A hint for `owner/name` given for a Hub repository, where no such local folder exists."""
    if not isinstance(path, str) or loc.local is None or _storage.local_entry(os.path.dirname(loc.local)).exists:
        return ""  # (where the owner is a local folder, the path is one of its own)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[^/\s]+)?", path):
        return ""
    return f" No local folder {path!r} exists either: did you mean the Hugging Face Hub repository `hf://{path}`?"


def _from_hub(where: Hub, whole: bool, token: str | None, pinned: _hub.Pinned | None) -> Source:
    """A Hub repository's safetensors folder, pinned to a commit (`pinned`, a
    pin kept from an earlier open, unless the token changed): from the cache
    where it holds them, else by byte ranges."""
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


def _foreign(loc: Location, found: Foreign) -> Source:
    """The source of what a foreign format's `find` found; a safetensors folder's
    tensors opened through the verifying reader (`_verified.tensors`)."""
    opener = _verified.tensors(found) if isinstance(found, _safetensors.Tensors) else found.opener
    return Source(found.format, loc, loc, found.manifest, opener, found.changed, found.runs)


# Files of PyTorch's pickle format, which eqx_ckpt never opens.
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _what_is_there(loc: Location) -> str:
    """What a local path that holds no format eqx_ckpt reads does hold, and what
    to do with it ("" when nothing is recognised)."""
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
