"""orbax-checkpoint PyTree checkpoints as a source of leaves, read with TensorStore.

An orbax PyTree checkpoint (`StandardCheckpointer`, `PyTreeCheckpointer`) is a
directory holding a `_METADATA` JSON file listing every leaf's key path, and
one zarr or zarr3 array per leaf, named by its keys joined with `.`: a folder,
or with OCDBT (orbax's default) keys of a database at the root. TensorStore
opens both (through `_storage`); orbax itself is not imported.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable
from typing import Any

from .._base import _keypath
from .._base._errors import CheckpointValueError, CorruptCheckpointError
from .._base._location import Location
from .._ondisk import _manifest
from .._ondisk._dtypes import is_known_dtype
from .._ondisk._format import MAX_MANIFEST_BYTES, LeafRecord
from .._ondisk._manifest import Manifest
from .._store import _storage, _untrusted

METADATA = "_METADATA"
DEFAULT_ITEM = "default"
# What orbax's `CheckpointManager` writes in each step folder.
STEP_METADATA = "_CHECKPOINT_METADATA"
# orbax's `value_type` -> the leaf type a load without `like` gives back.
_TYPES = types.MappingProxyType({"jax.Array": "jax", "np.ndarray": "numpy", "scalar": ""})
_SCALARS = types.MappingProxyType({"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"})
# orbax's `key_type`: 1 a sequence index, 2 a dict key (and an attribute name).
_SEQUENCE = 1


@dataclasses.dataclass(frozen=True)
class Arrays:
    """The leaves `find` found, as a `_source.Source` reads them. `changed` names
    a file showing the checkpoint was saved again since; no `runs`."""

    manifest: Manifest
    opener: Callable[[LeafRecord], _storage.Future]
    changed: Callable[[], str | None]
    runs: None = None
    format: str = "orbax"


def find(loc: Location) -> Arrays | None:
    """The leaves of an orbax PyTree checkpoint at `loc`, or `None` if it is not one."""
    data, stamp = _storage.read_file_stamped(loc, METADATA, limit=MAX_MANIFEST_BYTES)
    if data is None:
        # A step of an orbax `CheckpointManager` keeps its one item in `default/`.
        item = loc.joined(DEFAULT_ITEM)
        data, stamp = _storage.read_file_stamped(item, METADATA, limit=MAX_MANIFEST_BYTES)
        if data is None:
            return None
        loc = item
    try:
        body = _manifest.loads_file(data)
        tree = body["tree_metadata"]
        driver = "zarr3" if body.get("use_zarr3") else "zarr"
        ocdbt = bool(body.get("use_ocdbt"))
        # orbax then writes every chunk, so a missing one is damage, not zeros.
        complete = body.get("store_array_data_equal_to_fill_value") is True
        found = [_leaf(entry) for entry in tree.values()]
    except _Unopenable as e:
        raise CheckpointValueError(
            f"orbax checkpoint {loc.display!r} has a leaf eqx_ckpt does not open: {e}. Restore it with orbax, "
            f"rename the key, and save again.",
            path=loc.display,
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(loc, f"its {METADATA} does not describe a PyTree ({type(e).__name__}: {e})") from None
    leaves = [leaf for leaf in found if leaf is not None]
    _untrusted.refuse_special_inside(loc)  # before TensorStore opens its files: a FIFO's open waits forever
    specs = [_array_spec(loc, driver, ocdbt, name) | {"fill_missing_data_reads": not complete} for _, name, _ in leaves]
    opens = _storage.open_for_reading(specs)
    records: dict[str, LeafRecord] = {}
    stores: dict[str, _storage.Array] = {}
    for (keypath, name, kind), opened in zip(leaves, opens):
        try:
            store = opened.result()
        except Exception as e:
            raise _corrupt(loc, f"its array {name!r} cannot be opened ({e})") from None
        record = _record(loc, keypath, name, kind, store)
        records[record.path] = record
        stores[record.path] = store
    manifest = Manifest(tuple(records[path] for path in sorted(records)), layout="orbax")
    stamps = [(METADATA, stamp), *_stamps(loc)]
    changed = lambda: next((name for name, was in stamps if _storage.file_changed(loc, name, was)), None)
    return Arrays(manifest, opener=lambda record: _storage.ready(stores[record.path]), changed=changed)


# Files an orbax save writes anew (its timestamps; an OCDBT manifest's random
# id): on S3 an ETag digests content, and `_METADATA` is the same for a tree of
# the same structure. (Locally, orbax's rename makes every file new.)
_SAVED_ANEW = ("_CHECKPOINT_METADATA", "manifest.ocdbt")


def _stamps(loc: Location) -> list[tuple[str, bytes]]:
    """The stamps of the files of `_SAVED_ANEW` that `loc` holds (older orbax writes no `_CHECKPOINT_METADATA`)."""
    out = []
    for name in _SAVED_ANEW:
        try:
            data, stamp = _storage.read_file_stamped(loc, name, limit=MAX_MANIFEST_BYTES)
        except CorruptCheckpointError:  # too large to read: a database of many versions
            continue
        if data is not None:
            out.append((name, stamp))
    return out


def writes_every_chunk(loc: Location) -> bool:
    """Whether the orbax checkpoint at `loc` records that every chunk was written
    (older orbax left out those equal to the fill value): a missing one is damage."""
    for folder in (loc, loc.joined(DEFAULT_ITEM)):
        data = _storage.read_file(folder, METADATA, limit=MAX_MANIFEST_BYTES)
        if data is not None:
            try:
                body = _manifest.loads_file(data)
            except ValueError:
                return False
            return isinstance(body, dict) and body.get("store_array_data_equal_to_fill_value") is True
    return False


def _corrupt(loc: Location, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{loc.display!r} is not a readable orbax checkpoint: {what}. It is damaged, incomplete, or of an "
        f"orbax format eqx_ckpt does not read (it reads PyTree checkpoints: zarr or zarr3, with or without OCDBT).",
        path=loc.display,
    )


def _leaf(entry: dict[str, Any]) -> tuple[list[list[Any]], str, str] | None:
    """(key path as manifest JSON, orbax's array name, leaf type), or `None` for
    leaves orbax stored no array for."""
    value = entry["value_metadata"]
    kind = _TYPES.get(value.get("value_type"))
    if kind is None or value.get("skip_deserialize"):
        return None
    keys = entry["key_metadata"]
    keypath = [["index", int(k["key"])] if k["key_type"] == _SEQUENCE else ["key", str(k["key"])] for k in keys]
    name = ".".join(str(k["key"]) for k in keys)
    # Untrusted: without OCDBT they are folders. A `/` in a key makes nested
    # folders, which is fine; an empty, `.` or `..` part names none inside it.
    if "\\" in name or any(part in ("", ".", "..") for part in name.split("/")):
        raise _Unopenable(
            f"its key path {keypath} gives the array name {name!r}, which is not a name inside the checkpoint"
        )
    return keypath, name, kind


class _Unopenable(Exception):
    """A leaf of a sound orbax checkpoint whose array name eqx_ckpt will not open."""


def _array_spec(loc: Location, driver: str, ocdbt: bool, name: str) -> dict[str, Any]:
    if ocdbt:
        return {"driver": driver, "kvstore": {"driver": "ocdbt", "base": loc.kvstore, "path": name + "/"}}
    return {"driver": driver, "kvstore": loc.child(name)}


def _record(loc: Location, keypath: list[list[Any]], name: str, kind: str, store: _storage.Array) -> LeafRecord:
    dtype = store.dtype_name
    if not is_known_dtype(dtype):
        raise _corrupt(loc, f"its array {name!r} has the data type {dtype!r}, which eqx_ckpt does not read")
    shape = store.shape
    if not kind:
        kind = _SCALARS.get(store.numpy_dtype.kind, "numpy_scalar") if shape == () else "numpy"
    path = _keypath.join_dotted(*(_keypath.stored_segment(k, v) for k, v in keypath))
    chunks = store.read_chunk_shape
    return LeafRecord(path, keypath, kind, shape, dtype, shape, dtype, "plain", chunks)


def manager_steps(path: str) -> str:
    """A sentence naming the steps and how to load one, if the local directory
    `path` is an orbax `CheckpointManager`'s (numbered step folders); else ""."""
    if not _storage.local_entry(path).folder:
        return ""
    steps = sorted(int(n) for n in _storage.local_names(path) if n.isdigit() and _is_step(os.path.join(path, n)))
    if not steps:
        return ""
    step = os.path.join(path, str(steps[-1]))
    items = [n for n in _storage.local_names(step) if _storage.local_entry(os.path.join(step, n, METADATA)).file]
    one = step if DEFAULT_ITEM in items or not items else os.path.join(step, items[0])
    shown = ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")
    return (
        f" It is an orbax CheckpointManager's directory (steps {shown}): load one step by its folder, e.g. "
        f"`eqx_ckpt.tree_deserialise_leaves({one!r}, like)` or `eqx_ckpt.Checkpoint({one!r})`."
    )


def _is_step(folder: str) -> bool:
    if _storage.local_entry(os.path.join(folder, STEP_METADATA)).file:
        return True
    if not _storage.local_entry(folder).folder:
        return False
    return any(_storage.local_entry(os.path.join(folder, n, METADATA)).file for n in _storage.local_names(folder))
