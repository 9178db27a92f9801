"""`export_safetensors`: a checkpoint or a tree as Hugging Face sharded safetensors.

Leaves are read one at a time (from the checkpoint's storage, so a checkpoint
saved by several processes or kept on an object store exports without
gathering live arrays). On a local disk each shard is written as it is read,
leaf by leaf, to a `.partial` file, and every shard is renamed into place only
once all are written: the leaves may come from the very files being replaced
(an export of a directory onto itself). An object store takes whole objects and
has no rename, so there a shard is assembled in memory first (peak memory is
about one shard) and written at once, and an export whose source is in the
destination directory is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._base import _keypath, _select
from .._base._errors import CheckpointExistsError, CheckpointTypeError, CheckpointValueError, LeafError, leaf_message
from .._base._location import Location, location
from .._base._progress import Progress, Tracker
from .._foreign import _safetensors
from .._load._checkpoint import Checkpoint
from .._load._lazy import LazyArray
from .._ondisk import _dtypes
from .._ondisk._format import MANIFEST, MAX_MANIFEST_BYTES, UNPUBLISHED_SUFFIX, dtype_from_name
from .._store import _durable, _storage

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(dtype_from_name(self.dtype)).itemsize


def export_safetensors(
    path: Any,
    pytree: PyTree,
    *,
    max_shard_size: int | str = "5GB",
    rename: Any = None,
    metadata: dict[str, str] | None = None,
    progress: Progress = None,
) -> list[str]:
    """Write a checkpoint or a tree as safetensors, sharded as Hugging Face does.

    **Arguments:**

    - `path`: a directory (local, or a kvstore URL / spec) that receives
        `model.safetensors`, or, above `max_shard_size`,
        `model-00001-of-0000N.safetensors`... and `model.safetensors.index.json`;
        or a path ending in `.safetensors`: one file.
    - `pytree`: what to export: a PyTree of arrays and scalars, or a
        [`eqx_ckpt.Checkpoint`][] (any source it opens), whose leaves are read
        from storage one by one. Non-array leaves of a tree are skipped.
    - `max_shard_size`: bytes per shard (an int, or `"5GB"`, `"500MB"`, `"1GiB"`);
        a larger tensor gets a shard of its own.
    - `rename`: as `rename` of [`eqx_ckpt.tree_deserialise_leaves`][], from
        a leaf's dotted path to its tensor name (a rule to `None` leaves the
        leaf out). Without it, tensor names are the dotted paths.
    - `metadata`: the header's `__metadata__` (strings), e.g. `{"format": "pt"}`.
    - `progress`: as for [`eqx_ckpt.tree_serialise_leaves`][]: a bar on a
        terminal for a large export, `False` for none, or a callable receiving
        `(leaves_done, leaves_total, bytes_done, bytes_total)`.

    **Returns:**

    The names of the files written, relative to the directory.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        eqx_ckpt.tree_serialise_leaves("mlp_ckpt", model)
        eqx_ckpt.export_safetensors("mlp_hf", eqx_ckpt.Checkpoint("mlp_ckpt"), max_shard_size="1KB")
        ```
    """
    # Everything is checked before anything is written or deleted.
    limit = _shard_bytes(max_shard_size)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointTypeError(
            f"`metadata` must be a dict mapping strings to strings (safetensors stores no other), not {metadata!r}."
        )
    if isinstance(pytree, (str, os.PathLike)):
        pytree = Checkpoint(pytree)
    tensors = _named(_tensors(pytree), rename)
    if not tensors:
        raise CheckpointValueError(
            "There is nothing to export: the tree has no array or scalar leaves (or `rename` left them all out)."
        )
    loc, single = _destination(path)
    _refuse_source_in_destination(loc, pytree)
    shards = _plan(tensors, limit) if single is None else [tensors]
    names = [single] if single else _file_names(len(shards))
    try:
        with Tracker(progress, leaves=len(tensors), nbytes=sum(t.nbytes for t in tensors), what="export") as tracker:
            for name, shard in zip(names, shards):
                _write_shard(loc, name, shard, metadata or {}, lambda n: tracker.advance(leaves=1, nbytes=n))
    except BaseException:
        # A leaf that cannot be read (or an interrupt): the destination is left
        # as it was, without this export's temporaries.
        _storage.discard_unpublished(loc, names)
        raise
    # Only now, with every leaf read: the source may be these very files.
    _storage.publish(loc, names)
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        _storage.write_file(loc, _safetensors.INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
        names.append(_safetensors.INDEX)
    if single in (None, _safetensors.SINGLE):
        # What an earlier export left here and this one did not rewrite: a stale
        # index beside a new `model.safetensors` would be read instead of it.
        _storage.remove(loc, [n for n in _storage.list_names(loc) if _EXPORTED.match(n) and n not in names])
    return names


# The files an export into a directory writes (and their temporaries).
_EXPORTED = re.compile(
    r"^model(-[0-9]{5}-of-[0-9]{5})?\.safetensors(\.index\.json)?(" + re.escape(UNPUBLISHED_SUFFIX) + ")?$"
)


def _shard_bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointValueError(
            f"`max_shard_size` must be a positive number of bytes or a size like '5GB' or '500MiB', not {size!r}."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _tensors(pytree: Any) -> list[_Tensor]:
    if isinstance(pytree, Checkpoint):
        return [_stored(pytree, key) for key in pytree]
    leaves = jtu.tree_flatten_with_path(pytree, is_leaf=lambda x: isinstance(x, LazyArray))[0]
    abstract = [(keypath, leaf) for keypath, leaf in leaves if isinstance(leaf, jax.ShapeDtypeStruct)]
    if abstract:
        raise _abstract(abstract)
    return [tensor for keypath, leaf in leaves if (tensor := _leaf(_keypath.dotted(keypath), leaf)) is not None]


def _leaf(name: str, leaf: Any) -> _Tensor | None:
    kind = "lazy" if isinstance(leaf, LazyArray) else _dtypes.leaf_type(leaf)
    if kind is None:
        return None
    if kind == "prng_key":
        raise _unsupported(name, str(leaf.dtype))
    if kind in ("bool", "int", "float", "complex"):
        try:
            leaf = _dtypes.python_scalar_array(leaf)
        except OverflowError as e:
            raise _leaf_error(name, f"{e}, the largest integer safetensors stores.", "Export it as a float.") from None
    elif kind in ("numpy", "numpy_scalar"):
        leaf = np.asarray(leaf)
    return _Tensor(name, _dtype_name(name, leaf.dtype), tuple(leaf.shape), _reader(leaf))


def _reader(array: Any) -> Callable[[], np.ndarray]:
    """A leaf's value, read as it is written out, as NumPy makes it (a lazy
    leaf's by the one reader of stored leaves: `LazyArray.__array__`)."""
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
    record = ckpt.record(key)
    if record.type == "prng_key":
        raise _unsupported(key, record.dtype)
    # Read as the shard is written (`ckpt[key]` reads a scalar at once).
    return _Tensor(key, _dtype_name(key, record.dtype), tuple(record.shape), lambda: np.asarray(ckpt[key]))


def _dtype_name(name: str, dtype: Any) -> str:
    dtype = np.dtype(dtype).name
    if dtype not in _safetensors.NAMES:
        raise _unsupported(name, dtype)
    return dtype


def _unsupported(name: str, dtype: str) -> LeafError:
    return _leaf_error(
        name,
        f"its dtype {dtype} has no safetensors equivalent ({', '.join(sorted(_safetensors.NAMES))}).",
        "Convert it first, or leave it out with a `rename` rule to `None`.",
    )


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
        out.append(dataclasses.replace(tensor, name=_tensor_name(tensor.name, name)))
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
    """On an object store a shard replaces its file at once, so a later leaf
    read from that file would read the new bytes: refuse a source there."""
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
    for a directory of Hugging Face shards)."""
    loc = location(path)
    if not _safetensors.is_file_path(loc):
        folder, name = loc, None
    else:
        spec, name = _safetensors.split_file(loc)
        local = os.path.dirname(loc.local) if loc.local is not None else None
        folder = Location(spec, os.path.dirname(loc.display.rstrip("/")) or ".", local)
    if _storage.read_file(folder, MANIFEST, limit=MAX_MANIFEST_BYTES) is not None:
        # (`eqx-ckpt export ckpt ckpt` once wrote the export into the checkpoint.)
        raise CheckpointExistsError(
            f"{folder.display!r} holds an eqx_ckpt checkpoint; an export there would mix its files with the "
            f"checkpoint's. Export to another directory.",
            path=folder.display,
        )
    _durable.ensure_directory(folder)
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


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [_safetensors.SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for tensor in shard:
        dtype = _safetensors.NAMES[tensor.dtype]
        header[tensor.name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    # The data starts 8-byte aligned, padded with spaces as the safetensors library does.
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _bytes(tensor: _Tensor) -> memoryview:
    # Scalars read back as Python values: give them their stored dtype again.
    array = np.asarray(tensor.read(), dtype=dtype_from_name(tensor.dtype), order="C")
    if tuple(array.shape) != tensor.shape:
        raise CheckpointValueError(f"Leaf `{tensor.name}` changed while it was exported; export again.")
    return memoryview(array.reshape(-1).view(np.uint8).data)


def _write_shard(loc: Location, name: str, shard: list[_Tensor], metadata: dict[str, str], update: Any) -> None:
    """Write one file of the export, tensor by tensor, not yet under its name
    (`_storage.write_unpublished`: on a local disk streamed, elsewhere whole)."""

    def parts() -> Iterator[bytes | memoryview]:
        yield _header(shard, metadata)
        for tensor in shard:
            yield _bytes(tensor)
            update(tensor.nbytes)

    _storage.write_unpublished(loc, name, parts())
