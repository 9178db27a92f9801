"""`export_safetensors`: a checkpoint or a tree as Hugging Face sharded safetensors.

Leaves are read one at a time, from the checkpoint's storage. On a local disk
each shard streams to a `.partial` file, and all are renamed into place once
all are written (the leaves may come from the files being replaced). An object
store takes whole objects: a shard is assembled in memory, and a source in the
destination is refused (docs/interop.md, "Export to safetensors").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._base import _keypath, _select, _tree
from .._base._errors import (
    CheckpointExistsError,
    CheckpointKeyError,
    CheckpointTypeError,
    CheckpointValueError,
    LeafError,
    caller_level,
    from_file,
    leaf_message,
)
from .._base._location import Location, location
from .._base._progress import Progress, Tracker
from .._foreign import _safetensors
from .._load import _rebuild
from .._load._checkpoint import Checkpoint, need
from .._load._lazy import LazyArray
from .._ondisk import _digests, _dtypes, _iterators, _published, _structure
from .._ondisk._format import CARD, LEAF_TYPES, MANIFEST, UNPUBLISHED_SUFFIX, LeafRecord, dtype_from_name, whole_chunks
from .._sources import _verified
from .._store import _durable, _storage
from . import _card, _matching
from ._card import model_card

_LOG = logging.getLogger("eqx_ckpt")

_UNITS = types.MappingProxyType({"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """`export_safetensors`'s keywords, made once at each public entry (the
    functions, `eqx-ckpt export` and `push`) and passed whole (`export`)."""

    max_shard_size: int | str = "5GB"
    rename: Any = None
    metadata: dict[str, str] | None = None
    info: dict[str, Any] | None = None
    prefix: str | None = None
    card: bool = True
    card_path: str | None = None
    license: str | None = None
    base_model: str | Sequence[str] | None = None
    code: str | None = None
    base: Any = None
    standalone: bool = False
    token: str | None = None
    progress: Progress = None


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote: its files' names, relative to its folder, and,
    against a base, the line it logs of what it stored and took (`_matching.against`)."""

    names: list[str]
    report: str | None = None


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of the export: its safetensors name, its record in `eqx_ckpt.json`
    (its stored dtype and shape are the tensor's), and the reader of its value."""

    name: str
    record: LeafRecord
    read: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return self.record.nbytes


def export_safetensors(
    path: Any,
    pytree: PyTree,
    *,
    max_shard_size: int | str = "5GB",
    rename: Any = None,
    metadata: dict[str, str] | None = None,
    info: dict[str, Any] | None = None,
    prefix: str | None = None,
    card: bool = True,
    card_path: str | None = None,
    license: str | None = None,
    base_model: str | Sequence[str] | None = None,
    code: str | None = None,
    base: Any = None,
    standalone: bool = False,
    token: str | None = None,
    progress: Progress = None,
) -> list[str]:
    """Write a checkpoint or a tree as a folder anyone can read: Hugging Face
    sharded safetensors, its structure in `eqx_ckpt.json`, and a model card.

    The folder loads back everywhere a checkpoint path is accepted:
    `Checkpoint(folder).load(trust=[...])` with no `like`, a `like`, `where`,
    `prefix`, `lazy`, `eqx-ckpt verify`... Each leaf comes back as it was (its
    dtype, a PRNG key, a Python scalar). The `safetensors` library reads every
    tensor bit for bit. See "The published layout" in [docs/interop.md](../interop.md).

    **Arguments:**

    - `path`: a directory (local, or a kvstore URL / spec). It receives
        `model.safetensors` (above `max_shard_size`, `model-00001-of-0000N.safetensors`...
        and `model.safetensors.index.json`), `eqx_ckpt.json` and `README.md`. A
        fine-tune stored against a `base` gets `finetune.safetensors` (or its
        shards and index) instead, so that no loader takes it for a whole model.
        Or a path ending in `.safetensors`: that one file alone, with no
        `eqx_ckpt.json` or card, so it loads into a `like` only.
    - `pytree`: what to export: a PyTree of arrays and scalars, or a
        [`eqx_ckpt.Checkpoint`][] (any source it opens), whose leaves are read
        from storage one by one. Non-array leaves of a tree are kept in the
        structure record, not as tensors.
    - `max_shard_size`: bytes per shard (an int, or `"5GB"`, `"500MB"`, `"1GiB"`);
        a larger tensor gets a shard of its own.
    - `rename`: as for [`eqx_ckpt.tree_deserialise_leaves`][], from a leaf's
        dotted path to its tensor name (a rule to `None` leaves the leaf out).
        Without it, tensor names are the dotted paths. With it, the folder records
        no structure: it loads as nested dicts, or into a `like` with the same `rename`.
    - `metadata`: the header's `__metadata__` (strings), e.g. `{"format": "pt"}`.
        Keys starting with `eqx_ckpt.` are eqx_ckpt's own: a fine-tune's files
        name in them its base and the command that makes a standalone copy.
    - `info`: your own metadata, a dict of JSON values (at most 1 MiB as JSON)
        kept in `eqx_ckpt.json` and shown on the card: a `"description"`,
        hyperparameters, metrics (`"name"` titles the card; a `"metrics"` dict
        fills its metrics). `Checkpoint(folder).info` gives it back. A
        `CheckpointManager` step exported without `"metrics"` gets its saved metrics.
    - `prefix`: export only the sub-tree at this dotted path (`"model"` of
        `{"model": ..., "opt_state": ...}`). Its leaves' paths are relative to it
        (as `rename` sees them), so the folder loads as that sub-tree.
    - `card`: whether to write `README.md` (`False` leaves one there as it is).
    - `card_path`: the name the card's load snippet loads the model by;
        `path` as given by default.
    - `license`: the card's `license`, a Hub license id such as `"apache-2.0"`.
        A published model exported again keeps its `info`, `license` and
        `base_model` where they are not given.
    - `base_model`: the card's `base_model`: the Hub repository (`"owner/name"`,
        or a list of them) it was fine-tuned or made from.
    - `code`: where the classes of the card's `trust` list come from: a pip
        requirement (`"mypkg"`, `"git+https://github.com/me/mypkg"`) or a URL.
    - `base`: export a fine-tune as what changed: the model it was fine-tuned
        from (a path a load reads: `hf://owner/name@rev`, a checkpoint, a
        published folder; or a `Checkpoint`). A leaf whose bytes, dtype and
        shape equal a base leaf (matched by content, whatever its name) is not
        written: `eqx_ckpt.json` names that leaf and pins the base (an `hf://`
        base to its commit, any other to its record's sha256). Loads read those
        leaves from the base. The card's `base_model` defaults to an `hf://`
        base's repository. An export that would take under both 10% of its
        bytes and 1 MiB from the base is written standalone. One `INFO` line on
        the `eqx_ckpt` logger says the bytes stored and taken. See "Model
        families" in [docs/sharing.md](../sharing.md).
    - `standalone`: where `pytree` is a fine-tune stored against a base,
        write every leaf (its base's too), so the folder loads without the
        base. Without it such a fine-tune is exported against the same base.
    - `token`: the Hub token a `hf://` base is read with.
    - `progress`: as for [`eqx_ckpt.tree_serialise_leaves`][]: a bar on a
        terminal for a large export, `False` for none, or a callable receiving
        `(leaves_done, leaves_total, bytes_done, bytes_total)`.

    **Returns:**

    The names of the files written, relative to the directory.

    **Warns:**

    [`eqx_ckpt.NeedsCodeWarning`][] naming the dotted path of each part that a
    load without `like` cannot rebuild without the model's code (a lambda, a
    closure, a class defined in a script). The card then shows the loads that
    work.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        eqx_ckpt.export_safetensors("mlp_hf", model, info={"description": "A small MLP."})
        loaded = eqx_ckpt.Checkpoint("mlp_hf").load(trust=[])  # no model code: Equinox's own classes
        print(eqx.tree_equal(loaded, model))  # True
        ```
    """
    options = ExportOptions(
        max_shard_size=max_shard_size,
        rename=rename,
        metadata=metadata,
        info=info,
        prefix=prefix,
        card=card,
        card_path=card_path,
        license=license,
        base_model=base_model,
        code=code,
        base=base,
        standalone=standalone,
        token=token,
        progress=progress,
    )
    return export(path, pytree, options).names


def export(path: Any, pytree: PyTree, options: ExportOptions) -> Exported:
    """`export_safetensors(path, pytree, ...)` with its `options`."""
    # Everything is checked before anything is written or deleted.
    limit = _shard_bytes(options.max_shard_size)
    _check_metadata(options.metadata)
    info = _published.check_info(options.info)
    about = _card.about(license=options.license, base_model=options.base_model, code=options.code)
    pytree, tensors, structure = _exported(pytree, options)
    if isinstance(pytree, Checkpoint):  # a re-export keeps its description, license and base models
        info = info if options.info is not None else _published.check_info(pytree.info)
        about = _card.kept(pytree, about)
    loc, single = _destination(path)
    _refuse_source_in_destination(loc, pytree)
    about, family, report, digests = _against_base(pytree, tensors, options, about, single, loc)
    stored = tensors if family is None else [t for t in tensors if t.record.path not in family.references]
    shards = _plan(stored, limit) if single is None else [stored]
    # A fine-tune's files are named and labelled for what they hold (`_safetensors.FINETUNE`).
    stem = _safetensors.MODEL if family is None else _safetensors.FINETUNE
    names = [single] if single else _file_names(len(shards), stem)
    index = _safetensors.index_name(stem) if len(names) > 1 else None
    shown = options.card_path if options.card_path is not None else _portable(_as_given(path, loc))
    metadata = dict(options.metadata or {})
    if family is not None:
        metadata.update(_safetensors.finetune_metadata(family.base.path, family.base.revision, shown))
    need(pytree, [t.record.path for t in stored])  # a fine-tune's base, where a leaf written is taken from it
    _durable.ensure_directory(loc)  # only now: an export refused above leaves no empty folder behind
    files: dict[str, bytes] = {}
    try:
        nbytes = sum(t.nbytes for t in stored)
        with Tracker(options.progress, leaves=len(stored), nbytes=nbytes, what="export") as tracker:
            for name, shard in zip(names, shards):
                _write_shard(loc, name, shard, metadata, lambda n: tracker.advance(leaves=1, nbytes=n), digests)
        if not single:
            described = None if options.rename is not None else structure
            files = _described(
                pytree,
                tensors,
                described,
                info,
                names + ([index] if index else []),
                shown=shown,
                card=options.card,
                about=about,
                digests=digests,
                family=family,
            )
        for name, data in files.items():
            _storage.write_unpublished(loc, name, iter([data]))
    except BaseException:
        # A leaf that cannot be read (or an interrupt): the destination is left
        # as it was, without this export's temporaries.
        _storage.discard_unpublished(loc, names + list(files))
        raise
    # Only now, with every leaf read: the source may be these very files.
    _storage.publish(loc, names + list(files))
    if index is not None:
        _write_index(loc, index, names, shards)
        names.append(index)
    names += list(files)
    if single in (None, _safetensors.SINGLE):
        # What an earlier export left here and this one did not rewrite (and
        # their temporaries), as a push deletes them: a stale index beside a
        # new `model.safetensors` would be read instead of it, and a fine-tune's
        # `finetune.safetensors` beside a whole model's is refused.
        stale = [n for n in _storage.list_names(loc) if n not in names]
        _storage.remove(loc, [n for n in stale if _safetensors.is_published(n.removesuffix(UNPUBLISHED_SUFFIX))])
    if report is not None:
        _LOG.info("%s: %s", shown, report)
    return Exported(names, report)


def _portable(given: str) -> str:
    """How the published files (the card, a fine-tune's metadata) name a
    local folder: by its name, never by a path of the machine that wrote it
    (issue 88: a card said `Checkpoint("/home/me/...")`); a URL as it is."""
    if given.lstrip().startswith("{") or ("://" in given and not given.startswith("file://")):
        return given
    return os.path.basename(os.path.normpath(given.removeprefix("file://"))) or given


def _as_given(path: Any, loc: Location) -> str:
    """The destination as the caller gave it (a kvstore spec by its display)."""
    return str(path) if isinstance(path, (str, os.PathLike)) else loc.display


def _against_base(
    pytree: Any, tensors: list[_Tensor], options: ExportOptions, about: _card.About, single: str | None, loc: Location
) -> tuple[_card.About, _published.Family | None, str | None, dict[str, _digests.Digested]]:
    """An export's base, where it has one (`_matching`): the card's `about`
    naming an `hf://` base, the family, the line saying what the export
    stores and takes from the base, and the digests of the leaves compared."""
    digests: dict[str, _digests.Digested] = {}
    based = _matching.base_of(
        pytree, options.base, standalone=options.standalone, single=single, destination=loc, token=options.token
    )
    if based is None:
        return about, None, None, digests
    if options.base_model is None and based.hub is not None:
        about = dataclasses.replace(about, base_model=(based.hub,))
    family, report = _matching.against(tensors, based, digests, tensor_bytes, loc)
    return about, family, report, digests


def _exported(pytree: Any, options: ExportOptions) -> tuple[Any, list[_Tensor], Any]:
    """The tree to export (a path opened as a `Checkpoint`), its tensors under
    `prefix` as `rename` names them (an error where there are none), and their structure record."""
    if isinstance(pytree, (str, os.PathLike)):
        pytree = Checkpoint(pytree, token=options.token)
    tensors, structure, iterators = _tensors(pytree)
    found, structure = _within(tensors, structure, options.prefix)
    _warn_of_iterators(iterators, options.prefix)
    tensors = _named(found, options.rename)
    if not tensors:
        raise CheckpointValueError(
            "There is nothing to export: the tree has no array or scalar leaves (or `rename` left them all out)."
        )
    return pytree, tensors, structure


def _check_metadata(metadata: Any) -> None:
    """Refuse `metadata` that is not what safetensors stores: a dict of strings."""
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointTypeError(
            f"`metadata` must be a dict mapping strings to strings (safetensors stores no other), not {metadata!r}."
        )
    ours = sorted(k for k in metadata or () if k.startswith(_safetensors.METADATA_PREFIX))
    if ours:
        raise CheckpointValueError(
            f"`metadata` has the key {ours[0]!r}: keys starting with {_safetensors.METADATA_PREFIX!r} are the ones "
            f"eqx_ckpt writes itself (a fine-tune's base). Choose another key."
        )


def _write_index(loc: Location, index: str, names: list[str], shards: list[list[_Tensor]]) -> None:
    """The shards' `index` (`model.safetensors.index.json`): the file of each tensor, and their bytes in all."""
    weights = {
        "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
        "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
    }
    _storage.write_file(loc, index, json.dumps(weights, indent=2, sort_keys=True).encode())


def _described(
    source: Any,
    tensors: list[_Tensor],
    structure: Any,
    info: dict[str, Any],
    names: list[str],
    *,
    shown: str,
    card: bool,
    about: _card.About,
    digests: dict[str, _digests.Digested],
    family: _published.Family | None,
) -> dict[str, bytes]:
    """`eqx_ckpt.json` and the card (loading the model as `shown`, listing
    `names`) for the tensors of `source`, the same bytes for the same `source`;
    first a warning of the parts that need the model's code."""
    found = _card.needs(structure, source.path if isinstance(source, Checkpoint) else shown)
    _card.warn(found, shown)
    records = [t.record for t in tensors]
    created = source.created if isinstance(source, Checkpoint) else ""
    metrics = source._manifest.metrics if isinstance(source, Checkpoint) else {}
    if metrics and "metrics" not in info:
        info = _published.check_info({**info, "metrics": dict(sorted(metrics.items()))})
    files = {
        _published.NAME: _published.encode(records, structure, info, created=created, digests=digests, family=family)
    }
    if card:
        listed = [*names, _published.NAME]
        text = model_card(
            shown,
            structure=structure,
            info=info,
            files=listed,
            records=records,
            about=about,
            found=found,
            base=None if family is None else family.base.shown,
            stored=None if family is None else [r for r in records if r.path not in family.references],
        )
        files[CARD] = text.encode()
    return files


def _within(tensors: list[_Tensor], structure: Any, prefix: Any) -> tuple[list[_Tensor], Any]:
    """The tensors and structure record of the sub-tree at the dotted `prefix`
    (`None`: all of it), their paths and key paths made relative to it."""
    if prefix is None or prefix == "":
        return tensors, structure
    if not isinstance(prefix, str):
        raise CheckpointTypeError(f"`prefix` must be a dotted path such as 'model', not {type(prefix).__name__}.")
    inside = [t for t in tensors if _keypath.is_within(t.name, prefix)]
    if not inside or any(t.name == prefix for t in inside):
        tops = sorted({_keypath.split_dotted(t.name)[0] for t in tensors if t.name}, key=_keypath.sort_key)
        what = "a leaf, not a sub-tree" if inside else "no sub-tree of it"
        raise CheckpointKeyError(
            f"`prefix` {prefix!r} names {what}: pass the dotted path of a sub-tree to export (its top-level keys: "
            f"{', '.join(tops[:10])}{', ...' if len(tops) > 10 else ''})."
        )
    depth = len(_keypath.split_dotted(prefix))
    moved = []
    for t in inside:
        path = _keypath.relative(t.name, prefix)
        moved.append(_Tensor(path, dataclasses.replace(t.record, path=path, keypath=t.record.keypath[depth:]), t.read))
    try:
        node = None if structure is None else _structure.at(structure, prefix)
    except (KeyError, TypeError, ValueError):
        node = _structure.unrecordable("a part of the tree whose structure the checkpoint does not record")
    return moved, node


def _shard_bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointValueError(
            f"`max_shard_size` must be a positive number of bytes or a size like '5GB' or '500MiB', not {size!r}."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _warn_of_iterators(paths: list[str], prefix: Any) -> None:
    """Warn of the data iterators (at dotted `paths`) under `prefix`: a run's
    data position, which a published folder, a model's arrays, does not hold."""
    paths = [p for p in paths if not isinstance(prefix, str) or _keypath.is_within(p, prefix)]
    if paths:
        # (a checkpoint's paths were read from its manifest: shown escaped)
        named = ", ".join(f"`{from_file(p)}`" for p in paths[:5]) + (
            f" and {len(paths) - 5} more" if len(paths) > 5 else ""
        )
        warnings.warn(
            f"Not exported: {named}, a data iterator's state (a run's data position). A published folder holds a "
            f"model's arrays; save the run with `tree_serialise_leaves` or a `CheckpointManager` to keep its data "
            f"position, and export the model alone (`prefix=`) to leave this warning out.",
            UserWarning,
            stacklevel=caller_level(),
        )


def _tensors(pytree: Any) -> tuple[list[_Tensor], Any, list[str]]:
    """The tensors of `pytree`, in order, the structure record of its tree
    (`_structure`; a checkpoint's own, or `None` where it has none), and the
    dotted paths of its data iterators (which are not exported)."""
    if isinstance(pytree, Checkpoint):
        iterators = [it.path for it in pytree._manifest.iterators]
        return [_stored(pytree, key) for key in pytree], _rebuild.record_of(pytree._manifest, pytree.path), iterators
    leaves, names = _tree.flatten_named(pytree, lambda x: isinstance(x, LazyArray), keypaths=True)
    abstract = [(names.keypath(i), x) for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise _abstract(abstract)
    tensors = [t for i, x in enumerate(leaves) if (t := _leaf(names.paths[i], names.records[i], x)) is not None]
    saved = {t.record.path for t in tensors}
    structure = _structure.record(names.treedef, leaves, [p in saved for p in names.paths], names.records)
    return tensors, structure, [names.paths[i] for i in _iterators.found(leaves)]


def _leaf(path: str, keypath: list[list[Any]], leaf: Any) -> _Tensor | None:
    if isinstance(leaf, LazyArray):  # as it reads: a PRNG key's key data, else as the `like` it was loaded into
        r = leaf._record
        if r.type == "prng_key":
            return _Tensor(path, _record(path, keypath, r.type, r.shape, r.dtype, r.impl), _reader(leaf))
        as_type = leaf.saved_as if leaf.saved_as in LEAF_TYPES else "jax"
        record = _record(path, keypath, as_type, r.shape, _dtypes.name(np.dtype(leaf.dtype)))
        return _Tensor(path, record, _reader(leaf))
    kind = _dtypes.leaf_type(leaf)
    if kind is None:
        return None
    if kind == "prng_key":
        impl, read = str(jax.random.key_impl(leaf)), functools.partial(jax.random.key_data, leaf)
        return _Tensor(path, _record(path, keypath, kind, tuple(leaf.shape), str(leaf.dtype), impl), read)
    if kind in ("bool", "int", "float", "complex"):
        try:
            leaf = _dtypes.python_scalar_array(leaf)
        except OverflowError as e:
            raise _leaf_error(path, f"{e}, the largest integer safetensors stores.", "Export it as a float.") from None
    elif kind in ("numpy", "numpy_scalar"):
        leaf = np.asarray(leaf)
    return _Tensor(path, _record(path, keypath, kind, tuple(leaf.shape), _dtypes.name(leaf.dtype)), _reader(leaf))


def _record(
    path: str, keypath: list[list[Any]], kind: str, shape: tuple[int, ...], dtype: str, impl: str = ""
) -> LeafRecord:
    """The record of a leaf as the published layout stores it: in its dtype,
    where safetensors names it, else as unsigned integers of its width; a PRNG
    key as its key data (docs/interop.md has the table)."""
    shape = tuple(shape)
    if kind == "prng_key":
        stored_shape, stored, encoding = shape + (_dtypes.key_data_shape(impl) or ()), "uint32", "key_data"
    elif dtype in _safetensors.NAMES:
        stored_shape, stored, encoding = shape, dtype, "plain"
    elif dtype_from_name(dtype).itemsize in (1, 2, 4, 8):
        stored_shape, stored, encoding = shape, f"uint{8 * dtype_from_name(dtype).itemsize}", "view"
    else:
        raise _leaf_error(
            path,
            f"its dtype {dtype} has neither a safetensors name ({', '.join(sorted(_safetensors.NAMES))}) nor an "
            f"unsigned integer of its width to be stored as.",
            "Convert it first (a complex128 leaf into two float64 leaves), or leave it out with a `rename` rule to "
            "`None`.",
        )
    return LeafRecord(
        path, keypath, kind, shape, dtype, stored_shape, stored, encoding, whole_chunks(stored_shape), impl
    )


def _reader(array: Any) -> Callable[[], np.ndarray]:
    """A leaf's value as NumPy makes it (a lazy leaf's by `LazyArray.__array__`)."""
    return functools.partial(np.asarray, array)


def _abstract(leaves: list[tuple[Any, jax.ShapeDtypeStruct]]) -> LeafError:
    (keypath, leaf), names = leaves[0], [_keypath.dotted(keypath) for keypath, _ in leaves]
    others = f" So are {len(names) - 1} other leaves ({', '.join(names[1:6])}{', ...' * (len(names) > 6)})."
    message = leaf_message(
        f"it is abstract ({leaf.dtype}{list(leaf.shape)}, as `eqx.filter_eval_shape` gives): it has no value "
        f"to export.{others if len(names) > 1 else ''}",
        keypath=keypath,
        dotted=names[0],
        path="<export>",
        fix="Export a concrete tree, or a `Checkpoint`.",
    )
    return LeafError(message, keypaths=[keypath for keypath, _ in leaves], dotted=names)


def _stored(ckpt: Checkpoint, key: str) -> _Tensor:
    r = ckpt.record(key)
    # Read as the shard is written (`ckpt[key]` reads a scalar at once).
    return _Tensor(key, _record(key, r.keypath, r.type, r.shape, r.dtype, r.impl), lambda: np.asarray(ckpt[key]))


def _leaf_error(name: str, what: str, fix: str) -> LeafError:
    return LeafError(leaf_message(what, keypath=None, dotted=name, path="<export>", fix=fix), dotted=[name])


def _named(tensors: list[_Tensor], rename: Any) -> list[_Tensor]:
    to_name = _select.renamer(rename)
    out: list[_Tensor] = []
    seen: dict[str, str] = {}
    for tensor in tensors:
        name = to_name(tensor.name)
        if name is None:
            continue
        if isinstance(name, tuple):
            raise CheckpointValueError(f"`rename` gives several names {name} for `{tensor.name}`; an export needs one.")
        if name in seen:
            raise CheckpointValueError(f"`rename` gives the name {name!r} to both `{seen[name]}` and `{tensor.name}`.")
        seen[name] = tensor.name
        name = _tensor_name(tensor.name, name)
        if rename is None:
            out.append(dataclasses.replace(tensor, name=name))
        else:  # recorded under the name's dotted path and key path, as a plain safetensors tensor reads
            keypath = [["key", part] for part in name.split(".")]
            record = dataclasses.replace(tensor.record, path=_safetensors.dotted(name), keypath=keypath)
            out.append(_Tensor(name, record, tensor.read))
    return out


def _tensor_name(leaf: str, path: str) -> str:
    """The tensor name that reads back as the dotted `path` (see `_safetensors.dotted`)."""
    name = _safetensors.tensor_name(path)
    if name is None:
        raise _leaf_error(
            leaf,
            f"no safetensors tensor name reads back as `{path}` (a tensor name is split at `.`, so a key "
            f"holding a `.`, an integer dict key or a very long key has none).",
            "Give it a name with `rename`, and load it back with the same `rename`.",
        )
    if name == "__metadata__":
        raise _leaf_error(
            leaf,
            "its tensor name would be `__metadata__`, which safetensors keeps for the header's metadata.",
            "Give it another name with `rename`.",
        )
    return name


def _refuse_source_in_destination(loc: Location, pytree: Any) -> None:
    """Refuse a source in the destination on an object store: a shard replaces
    its file at once, and a later leaf read from it would read the new bytes."""
    if loc.local is not None:
        return
    lazy = [x for x in jtu.tree_leaves(pytree, is_leaf=lambda x: isinstance(x, LazyArray)) if isinstance(x, LazyArray)]
    for source in [pytree] if isinstance(pytree, Checkpoint) else lazy:
        folder = (
            _safetensors.split_file(source._loc)[0] if _safetensors.is_file_path(source._loc) else source._loc.kvstore
        )
        if folder == loc.kvstore:
            raise CheckpointExistsError(
                f"The export reads from {source._loc.display!r}, in the directory it writes to ({loc.display!r}); "
                f"on an object store the files it replaces would be read afterwards. Export to another directory.",
                path=loc.display,
            )


def _destination(path: Any) -> tuple[Location, str | None]:
    """The folder an export writes into, and its one file's name (or `None`
    for a directory of Hugging Face shards). The folder is not made here."""
    loc = location(path)
    if not _safetensors.is_file_path(loc):
        folder, name = loc, None
    else:
        spec, name = _safetensors.split_file(loc)
        local = os.path.dirname(loc.local) if loc.local is not None else None
        folder = Location(spec, os.path.dirname(loc.display.rstrip("/")) or ".", local)
    if _storage.file_exists(folder, MANIFEST):
        # (`eqx-ckpt export ckpt ckpt` once wrote the export into the checkpoint.)
        raise CheckpointExistsError(
            f"{folder.display!r} holds an eqx_ckpt checkpoint; an export there would mix its files with the "
            f"checkpoint's. Export to another directory.",
            path=folder.display,
        )
    return folder, name


def _plan(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _file_names(count: int, stem: str) -> list[str]:
    if count == 1:
        return [_safetensors.single_name(stem)]
    return [_safetensors.shard_name(i, count, stem) for i in range(1, count + 1)]


def _header(shard: list[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for tensor in shard:
        header[tensor.name] = {
            "dtype": _safetensors.NAMES[tensor.record.stored_dtype],
            "shape": list(tensor.record.stored_shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    # The data starts 8-byte aligned, padded with spaces as the safetensors library does.
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def tensor_bytes(tensor: _Tensor) -> memoryview:
    # Scalars read back as Python values: give them their stored dtype again.
    value, record = tensor.read(), tensor.record
    if record.encoding == "view":
        value = np.asarray(value, dtype=dtype_from_name(record.dtype)).view(dtype_from_name(record.stored_dtype))
    array = np.asarray(value, dtype=dtype_from_name(record.stored_dtype), order="C")
    if tuple(array.shape) != tuple(record.stored_shape):
        raise CheckpointValueError(f"Leaf `{tensor.name}` changed while it was exported; export again.")
    return memoryview(array.reshape(-1).view(np.uint8).data)


def _write_shard(
    loc: Location,
    name: str,
    shard: list[_Tensor],
    metadata: dict[str, str],
    update: Any,
    digests: dict[str, _digests.Digested],
) -> None:
    """Write one file of the export, not yet under its name
    (`_storage.write_unpublished`), keeping each tensor's digest in `digests`."""

    def parts() -> Iterator[bytes | memoryview]:
        yield _header(shard, metadata)
        for tensor in shard:
            data = tensor_bytes(tensor)
            if tensor.record.path not in digests:
                digests[tensor.record.path] = _verified.digest(data, tensor.record)
            yield data
            update(tensor.nbytes)

    _storage.write_unpublished(loc, name, parts())
