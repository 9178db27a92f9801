"""Safetensors files, and Hugging Face directories of them, as a source of leaves.

A safetensors file is 8 bytes (little-endian header length), a JSON header
(`name -> {dtype, shape, data_offsets}`), then each tensor's raw little-endian
C-order bytes.

Each tensor becomes a virtual TensorStore array (`_storage.virtual_array`)
whose chunks are runs of rows, read with byte-range reads through the same
kvstore as any checkpoint. So a load reads the headers and the bytes of the
tensors (or rows) it selects, nothing else, locally or on an object store.
Where `eqx_ckpt.json` records block digests, each read is checked by the
verifying reader's check of its region (`Regions`, `_verified.region`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import shlex
import types
import urllib.parse
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .._base import _faults, _keypath, _location, _state
from .._base._errors import (
    MAX_SHOWN,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CheckpointValueError,
    CorruptCheckpointError,
    from_file,
)
from .._base._location import Location
from .._ondisk import _published
from .._ondisk._format import MAX_ELEMENTS, MAX_MANIFEST_BYTES, MAX_RANK, MAX_SHARDS, LeafRecord, dtype_from_name
from .._ondisk._manifest import Manifest, loads_file
from .._store import _chunk_files, _storage, _storage_errors, _window

# Safetensors dtype names -> the names eqx_ckpt (and ml_dtypes) use.
DTYPES = types.MappingProxyType({
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
})  # fmt: skip
NAMES = types.MappingProxyType({ours: theirs for theirs, ours in DTYPES.items()})
# The NumPy dtype of each of our names, looked up once, not once a tensor.
_NUMPY = types.MappingProxyType({ours: dtype_from_name(ours) for ours in DTYPES.values()})
# The safetensors library refuses headers above 100 MB; so do we, for one file and for a directory's together.
MAX_HEADER = 100 * 2**20
# The most tensors of a file, and of a directory's files together (real models
# hold under 100,000), counted before a header is parsed.
MAX_TENSORS = _published.MAX_LEAVES
SUFFIX = ".safetensors"
# A tensor is read in runs of rows of about this many bytes (one range request
# each), so that a slice or a device's shard reads only its runs.
ROW_CHUNK_BYTES = 4 * 2**20
# A file of at most this many bytes whose size is listed (on the Hub) is read
# whole when opened: its length, header and end in one request, not three.
WHOLE_FILE_BYTES = 16 * 2**10
# A load reads tensors of at most this many bytes in runs of adjacent tensors,
# one range read per run (`read_runs`); larger ones through their own arrays.
SMALL_BYTES = 2**20
# The stems of a Hugging Face folder's files (one file, or shards and their
# index): a whole model's is `model`, which every loader looks for. A
# fine-tune's files hold only the tensors that differ from its base, so their
# stem keeps loaders unaware of families (and PEFT's, for `adapter_model`) off.
MODEL = "model"
FINETUNE = "finetune"
STEMS = (MODEL, FINETUNE)
INDEX_SUFFIX = ".safetensors.index.json"


def single_name(stem: str = MODEL) -> str:
    """The one file of a folder whose tensors fit one file: `model.safetensors`."""
    return stem + SUFFIX


def index_name(stem: str = MODEL) -> str:
    """The index of a folder's shards: `model.safetensors.index.json`."""
    return stem + INDEX_SUFFIX


def shard_name(number: int, count: int, stem: str = MODEL) -> str:
    """The name Hugging Face gives shard `number` (from 1) of `count`."""
    return f"{stem}-{number:05d}-of-{count:05d}{SUFFIX}"


SINGLE = single_name(MODEL)
INDEX = index_name(MODEL)
# The single files a folder's layout names (`layout`), the whole model's first.
SINGLES = tuple(single_name(stem) for stem in STEMS)
# The keys of the `__metadata__` eqx_ckpt writes in each file of a fine-tune
# (`finetune_metadata`); a user's keys must not start so.
METADATA_PREFIX = "eqx_ckpt."
FINETUNE_NOTE = (
    "This file holds only the tensors of a fine-tune that differ from its base. It is not a whole model: eqx_ckpt "
    "reads the other tensors from the base."
)


def finetune_metadata(base: str, revision: str, shown: str) -> dict[str, str]:
    """The `__metadata__` of each file of the fine-tune `shown`, stored against
    `base` at `revision` (an `hf://` base's commit, else `""`): what the file
    holds, the base, and the command that makes a standalone copy."""
    return {
        METADATA_PREFIX + "fine_tune": FINETUNE_NOTE,
        METADATA_PREFIX + "base": base,
        **({METADATA_PREFIX + "base_revision": revision} if revision else {}),
        # (quoted as a shell reads it: a folder's name may hold a space)
        METADATA_PREFIX + "standalone": f"eqx-ckpt export --standalone {shlex.quote(shown)} <folder>",
    }


# A shard an index may name: a safetensors file beside it.
_SHARD = re.compile(r"[^/\\\x00-\x1f]+\.safetensors")


def is_published(name: str) -> bool:
    """Whether the file `name` of a folder belongs to the published layout (a
    safetensors file, an index, `eqx_ckpt.json`): an export or a push deletes
    those it does not write, and keeps a user's other files."""
    return "/" not in name and (name.endswith((SUFFIX, INDEX_SUFFIX)) or name == _published.NAME)


def layout(names: Collection[str]) -> tuple[list[str], list[str]]:
    """The indexes of a folder holding the files `names`, and the safetensors
    files a load may read without one (those of `SINGLES` where any is there,
    else all). A load reads one index, or else one file (see `ambiguous`)."""
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    singles = sorted(n for n in names if n.endswith(SUFFIX))
    return indexes, [n for n in SINGLES if n in singles] or singles


def ambiguous(names: Collection[str], index: str | None = None, shards: Collection[str] = ()) -> str | None:
    """What makes a folder holding `names` hold two layouts at once, or `None`:
    two indexes; an `index` and a file of `SINGLES` not among its `shards`; or
    no index and two files of `SINGLES`. A load refuses such a folder."""
    indexes = layout(names)[0]
    if len(indexes) > 1:
        return f"{len(indexes)} indexes ({', '.join(indexes[:5])})"
    stray = [n for n in SINGLES if n in names and n not in shards]
    if index is not None and stray:
        return f"the index `{index}` and the single file `{stray[0]}`, which it does not name"
    if not indexes and len(stray) > 1:
        return f"the single files `{stray[0]}` and `{stray[1]}`"
    return None


def is_shard(name: Any) -> bool:
    """Whether an index may name `name` as a shard: a safetensors file beside it."""
    return isinstance(name, str) and _SHARD.fullmatch(name) is not None and not name.startswith(".")


def is_file_path(loc: Location) -> bool:
    return loc.kvstore.get("path", "").rstrip("/").endswith(SUFFIX)


class Region(Protocol):
    """What the bytes of one tensor must hash to, block by block
    (`_verified.Region`): the bytes of the whole blocks holding a range of
    them, and the check of those bytes, which raises where one differs."""

    def covering(self, start: int, end: int) -> tuple[int, int]: ...

    def check(self, data: memoryview, start: int) -> None: ...


# The region check of a tensor read from the file named (as messages name
# it), or `None` where nothing is recorded: the verifying reader's
# (`_verified.region`), which knows what each byte must hash to.
Regions = Callable[[LeafRecord, str], Region | None]


@dataclasses.dataclass(frozen=True)
class Tensors:
    """The tensors `find` found, as a `_source.Source` reads them (`opener` is
    `_open`, given the checks of the verifying reader; `changed` is
    `_Files.changed`, `runs` is `read_runs`)."""

    manifest: Manifest
    opener: Callable[[LeafRecord, Regions], _storage.Future]
    changed: Callable[[], str | None]
    runs: Callable[[list[LeafRecord], Feeding | None], tuple[list[int], Any]] | None
    format: str = "safetensors"


def find(loc: Location, where: Folder | None = None) -> Tensors | None:
    """The tensors of a `.safetensors` file, or of a directory holding one or a
    Hugging Face index and its shards; `None` if `loc` is neither. `where`:
    the directory's files (`None`: through `_storage`; the Hub's `_hub.Files`).

    A directory's `eqx_ckpt.json` (`_published`) gives the tensors their key
    paths, types and dtypes, and the tree's structure. The files read follow
    `layout` where the directory is listed, else each stem's index, then each
    stem's one file."""
    if is_file_path(loc):
        spec, name = split_file(loc)
        local = os.path.dirname(loc.local) if loc.local is not None else None
        return _tensors(loc, _storage.Folder(Location(spec, loc.display, local)), [name], index=None)
    where = _storage.Folder(loc) if where is None else where
    names = where.names()
    # (A folder not listed, on an object store: each stem's index, then each one file.)
    indexes, singles = ([index_name(s) for s in STEMS], list(SINGLES)) if names is None else layout(names)
    both = None if names is None else ambiguous(names)
    if both is not None:
        raise _two_layouts(loc, both)
    record = functools.partial(_published_record, loc, where)
    for name in indexes:
        with _storage_errors.read_explained(loc, name):
            result = _storage.result(where.read(name))
        if result.value is not None:
            weight_map = _weight_map(loc, name, result.value)
            files = sorted(set(weight_map.values()))
            both = None if names is None else ambiguous(names, name, files)
            if both is not None:
                raise _two_layouts(loc, both)
            return _tensors(loc, where, files, index=name, weight_map=weight_map, published=record)
    for name in singles if len(singles) == 1 or names is None else ():
        try:
            return _tensors(loc, where, [name], index=None, published=record)
        except CheckpointNotFoundError:
            continue
    return None


def _two_layouts(loc: Location, held: str) -> CorruptCheckpointError:
    return _corrupt(
        loc,
        f"it holds two layouts at once, {held}; which one is the model is not said, so nothing is loaded (delete "
        f"the stale one)",
    )


class Folder(Protocol):
    """The files of a directory `find` reads: `_storage.Folder` (any kvstore),
    or a Hub repository's folder at a commit (`_hub.Files`)."""

    @property
    def loc(self) -> Location: ...

    def names(self) -> list[str] | None: ...

    def read(self, name: str, byte_range: slice | None = None) -> _storage.Mapped: ...

    def read_file(self, name: str, *, limit: int) -> bytes | None: ...

    def listed_size(self, name: str) -> int | None: ...

    def changed(self, name: str, generation: bytes) -> bool: ...


def _published_record(loc: Location, where: Folder) -> _published.Published | None:
    """The directory's `eqx_ckpt.json`, read as untrusted input (bounded, checked), or `None`."""
    data = where.read_file(_published.NAME, limit=MAX_MANIFEST_BYTES)
    return None if data is None else _published.parse(data, where=loc.display)


def _as_published(
    loc: Location, published: _published.Published, records: dict[str, LeafRecord]
) -> dict[str, LeafRecord]:
    """The headers' records replaced by those of `eqx_ckpt.json`: every recorded
    leaf stored as its header says, and every tensor recorded. A fine-tune's
    leaves taken from its base have no tensor here (`_family` reads them)."""
    out: dict[str, LeafRecord] = {}
    references = published.family.references if published.family is not None else {}
    for leaf in published.leaves:
        if leaf.path in references:
            if leaf.path in records:
                raise _corrupt(
                    loc, f"{_published.NAME} takes the leaf {leaf.path!r} from its base, but it is stored here too"
                )
            # Read in runs of rows as a safetensors base's are, its base unopened (`_source.Base`).
            rows = _chunks(leaf.stored_shape, dtype_from_name(leaf.stored_dtype).itemsize, _run_bytes_of(published))
            out[leaf.path] = dataclasses.replace(leaf, chunks=rows)
            continue
        found = records.get(leaf.path)
        if found is None:
            raise _corrupt(loc, f"{_published.NAME} records the leaf {leaf.path!r}, which no safetensors file holds")
        if (found.stored_dtype, found.stored_shape) != (leaf.stored_dtype, leaf.stored_shape):
            raise _corrupt(
                loc,
                f"{_published.NAME} records the leaf {leaf.path!r} as stored {leaf.stored_dtype}"
                f"{list(leaf.stored_shape)}, but its tensor is {found.stored_dtype}{list(found.stored_shape)}",
            )
        # Read in the safetensors reader's runs of rows, whatever the record says:
        # of about one block where blocks are recorded (a slice reads few of them).
        rows = _chunks(found.stored_shape, dtype_from_name(found.stored_dtype).itemsize, _run_bytes_of(published))
        out[leaf.path] = dataclasses.replace(leaf, chunks=rows)
    extra = sorted(set(records) - set(out))
    if extra:
        raise _corrupt(loc, f"{_published.NAME} does not record the tensor {extra[0]!r} ({len(extra)} in all)")
    return out


def _run_bytes_of(published: _published.Published) -> int:
    """The bytes of a run of rows of a published folder's tensors: a block, where it records them."""
    return published.block_bytes or ROW_CHUNK_BYTES


def split_file(loc: Location) -> tuple[dict[str, Any], str]:
    path = loc.kvstore["path"].rstrip("/")
    folder, _, name = path.rpartition("/")
    return {**loc.kvstore, "path": folder + "/" if folder else ""}, name


def _corrupt(loc: Location, what: str) -> CorruptCheckpointError:
    # (`what` may quote a file's tensor names: bounded, as every text read from a file)
    return CorruptCheckpointError(
        f"{loc.display!r} is not a valid safetensors checkpoint: {from_file(what, 4 * MAX_SHOWN)}. It is damaged or "
        f"incomplete; do not load it.",
        path=loc.display,
    )


def _weight_map(loc: Location, index: str, data: bytes) -> dict[str, str]:
    """The index's tensor names -> the shards holding them."""
    try:
        weight_map = loads_file(data)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(t, str) for t in weight_map):
            raise TypeError("it is not an object of tensor names")
    except (ValueError, KeyError, TypeError) as e:
        raise _corrupt(loc, f"{index} has no `weight_map` of tensor names to files ({from_file(str(e))})") from None
    shards = set(weight_map.values())
    for name in shards:
        # The index is untrusted: a shard must be a file beside it.
        if not isinstance(name, str) or not re.fullmatch(r"[^/\\]+", name) or name.startswith("."):
            raise _corrupt(loc, f"{index} names the shard {name!r}, which is not a file name in that directory")
    if len(shards) > MAX_SHARDS:
        raise _corrupt(
            loc,
            f"{index} names {len(shards)} shards, more than the {MAX_SHARDS} allowed (real models use a few hundred at "
            f"most), so none was read",
        )
    return weight_map


def _tensors(
    loc: Location,
    where: Folder,
    files: list[str],
    *,
    index: str | None,
    weight_map: dict[str, str] | None = None,
    published: Callable[[], _published.Published | None] = lambda: None,
) -> Tensors:
    """Read every file's header (two small reads each, all files at once; one
    for a small listed file, `WHOLE_FILE_BYTES`), and the `published` record."""
    local = where.loc.local if _location.on_local_disk(where.loc) else None
    listed = [where.listed_size(name) for name in files]
    heads = [
        where.read(name, slice(0, 8 if n is None or n > WHOLE_FILE_BYTES else n)) for name, n in zip(files, listed)
    ]
    sizes, versions, read = [], [], []
    for name, head in zip(files, heads):
        result = _result(loc, name, head, "is shorter than a safetensors header")
        versions.append(result.generation)
        if result.value is None:
            if index:  # the directory is there, and incomplete
                raise _corrupt(loc, f"{index} lists the shard {name!r}, which is not there")
            raise CheckpointNotFoundError(f"There is no safetensors file {name!r} at {loc.display!r}.")
        if len(result.value) < 8:
            raise _corrupt(loc, f"{name!r} is shorter than a safetensors header")
        size = int.from_bytes(result.value[:8], "little")
        if size > MAX_HEADER:
            raise _corrupt(loc, f"{name!r} declares a {size}-byte header, more than the {MAX_HEADER} allowed")
        sizes.append(size)
        read.append(result.value[8 : 8 + size])
    if sum(sizes) > MAX_HEADER:
        raise _corrupt(
            loc,
            f"its {len(files)} files declare headers of {sum(sizes)} bytes in all, more than the {MAX_HEADER} allowed",
        )
    _faults.fire("safetensors.read_headers", loc, files)
    bodies = [
        # (a header read whole with its length is from the same version of the file)
        _storage.ready(_storage.Found(got, version)) if len(got) == size else where.read(name, slice(8, 8 + size))
        for name, size, got, version in zip(files, sizes, read, versions)
    ]
    records: dict[str, LeafRecord] = {}
    places: dict[str, tuple[str, int]] = {}
    # Each tensor's file by its name in the headers (one dotted path per name:
    # `dotted` is one-to-one), for the index's check below.
    holder: dict[str, str] = {}
    metadata: dict[str, dict[str, str]] = {}
    ends: list[int] = []
    headers, generations = _headers(loc, files, sizes, bodies, versions)
    for name, size, data in zip(files, sizes, headers):
        parsed, metadata[name], used = _parse_header(loc, name, data)
        for tensor, record, offset in parsed:
            if record.path in records:
                raise _corrupt(loc, f"tensor {record.path!r} is in two files ({places[record.path][0]!r}, {name!r})")
            records[record.path] = record
            places[record.path] = (name, 8 + size + offset)
            holder[tensor] = name
        ends.append(8 + size + used)
    _check_ends(loc, where, files, ends, listed)
    for tensor, file in (weight_map or {}).items():
        # A shard replaced by another version may have lost a tensor the index promises.
        if holder.get(tensor) != file:
            raise _corrupt(loc, f"{index} lists the tensor {tensor!r} in {file!r}, which does not hold it")
    opened = _Files(loc, where, dict(zip(files, generations)), local)
    manifest = _manifest(loc, records, _merged(metadata), published())
    return Tensors(
        manifest,
        opener=functools.partial(_open, opened, places),
        changed=opened.changed,
        runs=functools.partial(read_runs, opened, places),
    )


def _headers(
    loc: Location,
    files: list[str],
    sizes: list[int],
    bodies: list[_storage.Future | _storage.Mapped],
    versions: list[bytes],
) -> tuple[list[bytes], list[bytes]]:
    """The files' headers and versions, each header from the version its length
    came from; their tensors counted before any is parsed."""
    headers, generations, counted = [], [], 0
    for name, size, body, version in zip(files, sizes, bodies, versions):
        found = _result(loc, name, body, "ends inside its header")
        data = found.value
        generations.append(found.generation)
        if found.generation != version:
            raise CheckpointReplacedError(
                f"The safetensors file {name!r} of {loc.display!r} was rewritten while it was being opened. "
                f"Open or load it again once it is written.",
                path=loc.display,
            )
        if data is None or len(data) != size:
            raise _corrupt(loc, f"{name!r} ends inside its header")
        # Every tensor of a header is a JSON object, so it holds at most as many as it has `{`.
        counted += data.count(b"{") - 1
        if counted > MAX_TENSORS:
            raise _corrupt(loc, f"its headers (up to {name!r}) hold more than the {MAX_TENSORS} tensors allowed")
        headers.append(data)
    return headers, generations


def _check_ends(loc: Location, where: Folder, files: list[str], ends: list[int], listed: list[int | None]) -> None:
    """Check that no file has bytes after its last tensor's: by its `listed`
    size, else by reading the last byte a tensor uses and the one after it,
    which must not be there. (Servers answer oddly a range starting at the
    end of the file; all refuse one ending past it.)"""
    probes = [
        (n, end, size, None if size is not None else where.read(n, slice(end - 1, end + 1)))
        for n, end, size in zip(files, ends, listed)
    ]
    for name, end, size, probe in probes:
        if probe is None:
            after = size is not None and size > end
        else:
            found = _result(loc, name, probe, None)
            after = found is not None and found.value is not None and len(found.value) > 1
        if after:
            raise _corrupt(loc, f"{name!r} has bytes after its last tensor (byte {end} on), which no tensor uses")


def _manifest(
    loc: Location, records: dict[str, LeafRecord], metadata: dict[str, str], published: _published.Published | None
) -> Manifest:
    """The manifest of the tensors' `records`, as their headers or `eqx_ckpt.json` say."""
    if published is None:
        return Manifest(tuple(records[path] for path in sorted(records)), layout="safetensors", metadata=metadata)
    records = _as_published(loc, published, records)
    return Manifest(
        tuple(records[path] for path in sorted(records)),
        created=published.created,
        library_version=published.library_version,
        layout="published",
        metadata=metadata,
        structure=published.structure,
        info=published.info,
        family=published.family,
        digests=published.digests,
        blocks=published.blocks,
        block_bytes=published.block_bytes,
        block_algorithm=published.block_algorithm,
        row_blocks=published.row_blocks,
        record_sha256=published.sha256,
    )


class _Files:
    """The files of one opened source, as they were when their headers were read:
    the tensors' offsets hold only in those versions. Every read is checked
    against its file's version (`read_matches`; an object store sends the
    generation with the bytes), and `changed` names a file no longer so."""

    def __init__(self, loc: Location, where: Folder, generations: dict[str, bytes], folder: str | None):
        # `loc` as the user named it (for messages); `where`, the folder of the files.
        self.loc, self.where, self.generations = loc, where, generations
        self.folder = folder  # the local directory, whose runs are read directly
        # On a local disk a file can be rewritten in place while it is read, so
        # the files read from are also checked after the reads.
        self.local = _location.on_local_disk(loc)
        self.opened: set[str] = set()
        self.seen: list[str] = []  # files a read found in another version
        # A read that found the file shorter: truncated, or rewritten smaller
        # (a range past the end comes back with no generation to compare).
        self.short = False

    def read_matches(self, file: str, generation: bytes) -> bool:
        if generation == self.generations[file]:
            return True
        self.seen.append(file)
        return False

    def changed(self) -> str | None:
        if self.seen:
            return self.seen[0]
        for name in sorted(self.opened) if self.local or self.short else ():
            with _storage_errors.read_explained(self.loc, name):
                if self.where.changed(name, self.generations[name]):
                    return name
        return None


def _merged(metadata: dict[str, dict[str, str]]) -> dict[str, str]:
    """The files' `__metadata__` as one map (shards repeat the same); a key whose
    value differs between files appears as `file:key`, once per file."""
    values: dict[str, set[str]] = {}
    for strings in metadata.values():
        for key, value in strings.items():
            values.setdefault(key, set()).add(value)
    out: dict[str, str] = {}
    for file, strings in metadata.items():
        for key, value in strings.items():
            out[key if len(values[key]) == 1 else f"{file}:{key}"] = value
    return dict(sorted(out.items()))


def _result(loc: Location, name: str, read: _storage.Future | _storage.Mapped, short: str | None) -> Any:
    """A byte-range read's result; past the end of the file, `None`, or with `short` corrupt."""
    try:
        return read.result()
    except Exception as e:
        if "OUT_OF_RANGE" not in str(e) and isinstance(e, CheckpointError) and type(e) is not CheckpointError:
            raise  # a read refused with its reason (a Hub server's answer), as it is
        if "OUT_OF_RANGE" not in str(e):
            raise _storage_errors.read_error(loc, name, e) from None
        if short is None:
            return None
        raise _corrupt(loc, f"{name!r} {short}") from None


def _parse_header(
    loc: Location, file: str, data: bytes
) -> tuple[list[tuple[str, LeafRecord, int]], dict[str, str], int]:
    """The tensors of a header (with names and offsets), its `__metadata__`,
    and how many bytes of data its tensors use."""
    try:
        header = loads_file(data)
    except ValueError as e:
        raise _corrupt(loc, f"the header of {file!r} is invalid: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(loc, f"the header of {file!r} is not a JSON object")
    out: list[tuple[str, LeafRecord, int]] = []
    spans: list[tuple[int, int, int]] = []  # (first byte, bytes, index into `out`) of each tensor
    metadata: dict[str, str] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise _corrupt(loc, f"the `__metadata__` of {file!r} is not a map of strings to strings")
            metadata = entry
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(dtype, str) and dtype not in DTYPES and re.fullmatch(r"[A-Z][A-Z0-9_]*", dtype):
            raise CheckpointValueError(
                f"Tensor {from_file(repr(name))} in {file!r} of {loc.display!r} has the safetensors dtype {dtype!r}, "
                f"which eqx_ckpt "
                f"does not read (it reads {', '.join(DTYPES)}). Convert the file, or export it without that tensor.",
                path=loc.display,
            )
        try:
            record, start, nbytes = _record(name, entry)
        except (ValueError, TypeError, KeyError) as e:
            raise _corrupt(loc, f"tensor {name!r} in {file!r}: {e}") from None
        spans.append((start, nbytes, len(out)))
        out.append((name, record, start))
    # As the format (and the `safetensors` library) requires: the tensors' bytes
    # follow one another from the start of the data, no two sharing a byte.
    end = 0
    for start, nbytes, i in sorted(spans):
        if start != end:
            what = "overlaps the tensor before it" if start < end else f"leaves bytes {end} to {start} unused"
            raise _corrupt(loc, f"tensor {out[i][1].path!r} in {file!r} {what}")
        end = start + nbytes
    return out, metadata, end


# A name whose parts are all non-empty and need no escaping (`_keypath.escape`).
_PLAIN = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


def dotted(name: str) -> str:
    """The dotted path of a tensor name: each `.`-separated part escaped as keys are."""
    if _PLAIN.fullmatch(name):  # most names: nothing to escape, one match for the whole name
        return name
    return _keypath.join_dotted(*(_keypath.escape(part) for part in name.split("."))) if name else "%e"


def tensor_name(path: str) -> str | None:
    """The tensor name whose `dotted` path is `path`, or `None` if none is
    (a part holding a `.`, an integer dict key `%i3`, a shortened long key)."""
    try:
        name = ".".join("" if part == "%e" else urllib.parse.unquote(part, errors="strict") for part in path.split("."))
    except UnicodeDecodeError:
        return None
    return name if dotted(name) == path else None


def _record(name: str, entry: Any) -> tuple[LeafRecord, int, int]:
    """A header entry's record, its first byte and its number of bytes."""
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"dtype {entry['dtype']!r} is not one eqx_ckpt reads ({', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(type(n) is int and n >= 0 for n in shape)):
        raise ValueError(f"`shape` {shape!r} is not a list of non-negative integers")
    size = math.prod(shape)
    if size > MAX_ELEMENTS:
        raise ValueError(f"`shape` {shape} has more than 2**53 elements")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)):
        raise ValueError(f"`data_offsets` {offsets!r} is not two non-negative integers")
    itemsize = _NUMPY[dtype].itemsize
    if offsets[1] - offsets[0] != size * itemsize:
        raise ValueError(f"`data_offsets` {offsets} do not span {shape} x {itemsize} bytes")
    shape = tuple(shape)
    path = dotted(name)
    keypath = [["key", part] for part in name.split(".")] if name else [["key", ""]]
    record = LeafRecord(path, keypath, "jax", shape, dtype, shape, dtype, "plain", _chunks(shape, itemsize))
    return record, offsets[0], size * itemsize


@_state.memo(4096)
def _chunks(shape: tuple[int, ...], itemsize: int, run: int = ROW_CHUNK_BYTES) -> tuple[int, ...]:
    """Runs of whole rows of about `run` bytes (remembered: shapes recur)."""
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, min(shape[0] if shape else 1, run // max(row, 1)))
    return (rows, *(max(1, n) for n in shape[1:])) if shape else ()


def _open(files: _Files, places: dict[str, tuple[str, int]], record: LeafRecord, regions: Regions) -> _storage.Future:
    """A read-only TensorStore array over the tensor's bytes, as a future; each
    read checked by its region check (`regions`, the verifying reader's), where
    one is recorded."""
    file, start = places[record.path]
    files.opened.add(file)
    dtype = _NUMPY[record.stored_dtype]
    region = regions(record, f"{files.loc.display}/{file}")
    read = functools.partial(_read_rows, files, file, start, dtype, record.stored_shape, region)
    return _storage.ready(_storage.virtual_array(read, dtype=dtype, shape=record.stored_shape, chunks=record.chunks))


def _read_rows(
    files: _Files,
    file: str,
    start: int,
    dtype: np.dtype,
    shape: tuple[int, ...],
    region: Region | None,
    rows: tuple[int, int] | None,
    array: np.ndarray,
) -> _storage.Future:
    """Fill one chunk (a run of whole rows) from one byte-range read: of the
    whole blocks holding it, checked by `region`, where one is recorded."""
    row = math.prod(shape[1:]) * dtype.itemsize
    lo, hi = rows if rows is not None else (0, 1)
    want = (hi - lo) * row if shape else dtype.itemsize
    first, end = (lo * row, lo * row + want) if region is None else region.covering(lo * row, lo * row + want)
    promise, done = _storage.pending()

    def fill(future: _storage.Mapped) -> None:
        try:
            try:
                result = future.result()
            except Exception as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
                result = None
            if result is not None and not files.read_matches(file, result.generation):
                raise _rewritten(file)
            if result is None or result.value is None or len(result.value) != end - first:
                files.short = True
                raise OSError(
                    f"DATA_LOSS: {file!r} ends before the tensor's bytes {start + first}..{start + end} "
                    f"(the file is truncated)"
                )
            data = memoryview(result.value)
            if region is not None:
                region.check(data, first)
            # Safetensors bytes are little-endian, as are the hosts JAX runs on.
            skip = lo * row - first
            array[...] = np.frombuffer(data[skip : skip + want], dtype).reshape(array.shape)
            promise.set_result(None)
        except Exception as e:
            promise.set_exception(e)

    files.where.read(file, slice(start + first, start + end)).add_done_callback(fill)
    return done


Run = tuple[str, int, int, list[int]]  # file, first byte, end, indices of the records it holds


# Given the records of a run read from a local file, each with the offset of
# its bytes in the run, the function that hashes them as the run's buffer
# fills (`_digests.Feed.filled`), or `None`.
Feeding = Callable[[list[tuple[LeafRecord, int]]], Callable[[np.ndarray, int], None] | None]


def read_runs(
    files: _Files,
    places: dict[str, tuple[str, int]],
    records: Sequence[LeafRecord],
    feeding: Feeding | None = None,
) -> tuple[list[int], Iterator[tuple[list[int], Callable[[], list[np.ndarray]]]]]:
    """Read the small ones of `records` in a few large reads (one array and one
    request per tensor took seconds for ten thousand). A run read from a local
    file is hashed as it is read where `feeding` says how.

    **Returns:**

    Their indices into `records`, and for each run of adjacent wanted tensors
    of one file, `(indices, finish)`: `finish()` waits for the run's one range
    read and returns each tensor's host array. Tensors far apart
    (`_window.runs`), or past the read budget, start another run; runs start
    ahead of their use within the budget (`_window`)."""
    # On a local disk a larger tensor is read so too, into memory that
    # `jax.device_put` adopts: three copies fewer than through a TensorStore array.
    most = _window.READ_BUDGET if files.folder is not None else SMALL_BYTES
    sizes = [record.nbytes for record in records]
    small = [i for i, nbytes in enumerate(sizes) if nbytes <= most]
    start = functools.partial(_start_run, files, places=places, feeding=feeding)
    jobs = (
        (run[3], run[2] - run[1], functools.partial(start, run, [records[m] for m in run[3]]))
        for run in _runs(places, records, sizes, small)
    )
    return small, ((members, finish) for members, _, finish in _window.windowed(jobs))


def _runs(
    places: dict[str, tuple[str, int]], records: Sequence[LeafRecord], sizes: list[int], wanted: list[int]
) -> list[Run]:
    """The runs covering the `wanted` records (of `sizes` bytes), file by file in the order of their bytes."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for i in wanted:
        file, start = places[records[i].path]
        by_file.setdefault(file, []).append((start, i))
    runs: list[Run] = []
    for file, starts in sorted(by_file.items()):
        starts.sort()
        spans = ((start, start + sizes[i], i) for start, i in starts)
        # A tensor larger than `SMALL_BYTES` is read by itself.
        found = _window.runs(spans, _window.READ_BUDGET, lambda size: size > SMALL_BYTES)
        runs.extend((file, lo, hi, members) for lo, hi, members in found)
    return runs


def _start_run(
    files: _Files, run: Run, records: list[LeafRecord], *, places: dict[str, tuple[str, int]], feeding: Feeding | None
) -> Callable[[], list[np.ndarray]]:
    """Start one run's range read. The function returned waits for it, checks it
    came whole from the header's version of the file, and slices out each tensor."""
    file, start, end, _ = run
    files.opened.add(file)
    _faults.fire("safetensors.read_run", files.loc, file, start, end)
    if files.folder is not None:
        # Checked after the reads, as every read of a local file is (`_Files.changed`).
        within = [(r, places[r.path][1] - start) for r in records]
        filled = (
            None
            if feeding is None
            else feeding([(r, at) for r, at in within if 0 <= at <= at + r.nbytes <= end - start])
        )
        path = os.path.join(files.folder, file)
        local = _window.read_pool().submit(_chunk_files.read_local_range, path, start, end, filled)
    else:
        read = files.where.read(file, slice(start, end)) if end > start else None

    def finish() -> list[np.ndarray]:
        if files.folder is not None:
            try:
                data = local.result()
            except OSError as e:
                raise _storage_errors.leaf_io_error(e, records[0], files.loc, "read") from e
        else:
            data = _run_bytes(files, file, start, end, read, records[0])
        if data is None:
            files.short = True
            raise _truncated(files, file, records, places)
        out = []
        for record in records:
            offset = places[record.path][1] - start
            nbytes = record.nbytes
            if not 0 <= offset <= offset + nbytes <= len(data):  # `_runs` made it so; checked all the same
                raise _corrupt(files.loc, f"tensor {record.path!r} in {file!r} is not within bytes {start}..{end}")
            # Safetensors bytes are little-endian, as are the hosts JAX runs on. (A view
            # of the run's bytes made in one call, not a slice, a view and a reshape.)
            out.append(np.ndarray(record.stored_shape, _NUMPY[record.stored_dtype], data, offset))
        return out

    return finish


def _run_bytes(
    files: _Files, file: str, start: int, end: int, read: _storage.Mapped | None, first: LeafRecord
) -> np.ndarray | None:
    """A run's bytes, or `None` if the file ends before the run does."""
    if read is None:  # nothing to read (`end == start`)
        return np.empty(0, np.uint8)
    try:
        result = read.result()
    except Exception as e:
        if "OUT_OF_RANGE" in str(e):
            return None
        raise _storage_errors.leaf_io_error(e, first, files.loc, "read") from e
    if not files.read_matches(file, result.generation):
        raise _rewritten(file)
    if result.value is None or len(result.value) != end - start:
        return None
    return np.frombuffer(result.value, np.uint8)


def _rewritten(file: str) -> OSError:
    return OSError(f"{file!r} was rewritten since it was opened: its tensors are at other offsets now")


def _truncated(files: _Files, file: str, records: list[LeafRecord], places: dict[str, tuple[str, int]]) -> Exception:
    """The error of a run the file ends inside, naming its first tensor not all
    there (found by bisecting on one-byte reads of the tensors' last bytes)."""
    cut = [r for r in records if r.nbytes]
    lo, hi = 0, len(cut) - 1  # the last one is cut, or the run would have been whole
    while lo < hi:
        mid = (lo + hi) // 2
        last = places[cut[mid].path][1] + cut[mid].nbytes
        try:
            found = files.where.read(file, slice(last - 1, last)).result()
            whole = found.value is not None and len(found.value) == 1
        except Exception as e:
            if "OUT_OF_RANGE" not in str(e):  # not the end of the file: a failed read
                return _storage_errors.leaf_io_error(e, cut[mid], files.loc, "read")
            whole = False
        if whole and not files.read_matches(file, found.generation):
            return _rewritten(file)
        lo, hi = (mid + 1, hi) if whole else (lo, mid)
    record = cut[lo]
    start = places[record.path][1]
    error = OSError(
        f"DATA_LOSS: {file!r} ends before the tensor's bytes {start}..{start + record.nbytes} (the file is truncated)"
    )
    return _storage_errors.leaf_io_error(error, record, files.loc, "read")
