"""The on-disk format, in one place (described for users in docs/format.md):
every name a checkpoint holds, the format version, the manifest's records, the
zarr v3 chunk codec, and the one answer to "did a save write this name?".
Encoding and parsing the manifest is `_manifest`'s job; key paths to folder
names, `_keypath`'s.

A checkpoint directory:

    manifest.json            written last: its presence makes the checkpoint exist
    saving.json              only while a save runs: its lease and journal
    zarr.json                the root zarr v3 group
    <leaf folders>/          one zarr v3 array per large leaf (zarr.json, c/0/0...)
    packed.<dtype>/          small leaves of one stored dtype, back to back
    gen.<commit>/            the data root of every save after the first
    ocdbt.db/                every array, with `layout="ocdbt"`

A manager's run holds:

- `step_<8+ digits>/` checkpoints;
- their `step_<...>.metrics.json` (version 1);
- `retention.json`: the rules its steps were saved under, so that retention
  deletes no step saved under others;
- while a manager writes there, `manager.json` (its lease, see `_lease`);
- in a local tier with peers, `peers/step_<...>/` (`parts.json` and the
  copies of other processes' parts, see `_peers`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._base import _keypath, _state


def _warn_again(caught: list[warnings.WarningMessage]) -> None:
    """numcodecs' import warnings, shown again but one: from 0.16.4 it warns
    about its own CRC32C codec, which eqx_ckpt never uses."""
    for warning in caught:
        if not str(warning.message).startswith("crc32c usage is deprecated"):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


with warnings.catch_warnings(record=True) as _caught:
    import numcodecs
_warn_again(_caught)
del _caught

FORMAT = "eqx_ckpt"
# Versions:
# - 2 adds the commit identity, per-save data roots (`gen.<commit>`) and
#   metrics;
# - 3 packs small leaves together (`packs`, and a leaf's `pack` and `offset`);
# - 4 leaves out of a leaf's record what equals its default (see
#   `LeafRecord.to_json`) and takes the digest over the file's own bytes;
# - 5 adds the tree's structure record (`structure`, see `_structure`);
# - 6 compresses chunks (a leaf's and a pack's `compression`, `COMPRESSIONS`);
# - 7 records iterator states (`iterators`, see `_iterators`).
# Versions 1 to 6 are still read. A save writes 5 unless it compresses (6) or
# holds an iterator (7), so that an older eqx_ckpt still reads what it can.
FORMAT_VERSION = 7
UNCOMPRESSED_VERSION = 5
COMPRESSED_VERSION = 6
# The most bytes of one iterator's state (its JSON text, or its bytes) in one
# process. Grain's are a few hundred bytes; the bound keeps a manifest small.
MAX_ITERATOR_STATE_BYTES = 2**20
# How to upgrade, worded as README installs eqx_ckpt: from its source checkout.
UPGRADE = (
    "Upgrade eqx_ckpt as you installed it (from its source checkout, as README does: `git pull`, then "
    "`pip install -c constraints.txt -e .` there)"
)

# -- Names ---------------------------------------------------------------------------------------

MANIFEST = "manifest.json"
SAVING = "saving.json"
# The metadata file of every zarr v3 array and group.
ZARR_JSON = "zarr.json"
# The folder of the OCDBT database (`layout="ocdbt"`) under a data root.
OCDBT_FOLDER = "ocdbt.db"
# TensorStore's file driver writes `<name>` as `<name>.__lock` and renames it into place.
TEMPORARY = ".__lock"
# An export's file on a local disk is written as `<name>.partial` until every one is written.
UNPUBLISHED_SUFFIX = ".partial"
# The published layout's record, beside its safetensors files (`_published`).
PUBLISHED = "eqx_ckpt.json"
# From its version 4, `eqx_ckpt.json` records a digest of each block of this
# many bytes of every leaf (`_digests`): a lazy slice reads and checks the whole
# blocks holding it. A slice over HTTP reads runs of rows of about one block
# (`_safetensors`), so it costs at most one block more at each end. 128 KiB
# (1 MiB until issue 84's measurements): a 2-row slice then hashes 128 KiB, not
# 1 MiB, and the digests are still 0.024% of the weights (0.049% as hex). A
# record says its own block size, so folders of either size load.
BLOCK_BYTES = 2**17
# The published layout's model card, beside it (`_card`).
CARD = "README.md"
# The `zarr.json` of every group a save writes.
GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}
GROUP_JSON = json.dumps(GROUP).encode()

# Data roots: "" or `gen.2` (version 1, alternating), `gen.<commit>` (version 2 on).
_DATA_ROOT = re.compile(r"^gen\.([0-9a-f]{16}|2)$")
_GENERATION = re.compile(r"^gen\.[0-9a-f]{16}$")
# What a top-level name written by a save can look like: an escaped segment (see
# `_keypath`), the root group's metadata, an OCDBT database, a data root or a
# pack. Names read back from a journal must match, so a damaged one cannot
# delete anything else.
_TOP_LEVEL = re.compile(
    r"^(%e|%i-?[0-9]+|%r[A-Za-z0-9_%-]*|[A-Za-z0-9_%-]+|zarr\.json|ocdbt\.db|gen\.[0-9a-f]+|packed\.[a-z0-9_]+)$"
)
# The files a save writes inside a data root, by their path below it: zarr
# metadata (`zarr.json`) in every folder, a leaf's chunks (`c`, then the
# chunk's indices), an OCDBT database's manifests and data files.
_CHUNK = re.compile(r"(^|/)c(/[0-9]+)*$")
_DATABASE = re.compile(r"(^|/)ocdbt\.db/(manifest\.ocdbt|manifest\.[0-9a-f]+|d/[0-9a-f]+)$")
# Step folders of a manager. Eight digits keep names sorting as numbers up to
# step 99,999,999; larger steps simply have more digits.
_STEP = re.compile(r"^step_([0-9]{8,})$")
_METRICS = re.compile(r"^(step_[0-9]{8,})\.metrics\.json$")


def data_root_name(commit: str) -> str:
    """The data root of a save that replaces a checkpoint: `gen.<commit>`."""
    return f"gen.{commit}"


def is_data_root(name: str) -> bool:
    """Whether `name` is a data root folder eqx_ckpt writes (`gen.<commit>`, or version 1's `gen.2`)."""
    return bool(_DATA_ROOT.match(name))


def is_generation(name: str) -> bool:
    """Whether `name` is the data root of a version 2+ save (`gen.<16 hex digits>`)."""
    return bool(_GENERATION.match(name))


def is_top_level_name(name: str) -> bool:
    """Whether `name` could be a top-level entry a save wrote (see `_TOP_LEVEL`)."""
    return bool(_TOP_LEVEL.match(name))


def is_save_temporary(name: str) -> bool:
    """Whether the top-level `name` is TensorStore's temporary of a file a save writes."""
    base = name.removesuffix(TEMPORARY)
    return base != name and (base in (MANIFEST, SAVING) or is_top_level_name(base))


def written_by_a_save(key: str) -> bool:
    """Whether the file at `key` (relative to a checkpoint) has a name a save
    writes, or is TensorStore's temporary of one."""
    key = key.removesuffix(TEMPORARY)
    return key.rsplit("/", 1)[-1] == ZARR_JSON or bool(_CHUNK.search(key) or _DATABASE.search(key))


def left_by_a_save(key: str) -> bool:
    """Whether the file at `key` (in a checkpoint without a manifest) is one a
    save writes before its commit or a step's deletion leaves: the journal, a
    temporary of it or of the manifest, or a file of its arrays."""
    return key in _BEFORE_COMMIT or written_by_a_save(key)


_BEFORE_COMMIT = frozenset({SAVING, SAVING + TEMPORARY, MANIFEST + TEMPORARY})


def metadata_key(folder: str) -> str:
    """The key of the `zarr.json` of the group or array in `folder` (below the
    data root; "" is the data root itself)."""
    return folder + "/" + ZARR_JSON if folder else ZARR_JSON


def step_name(step: int) -> str:
    """The folder name of a manager's step: `step_00000042`."""
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a folder name the manager wrote, or `None` for any other name
    (a non-canonical spelling such as `step_000000042` is not the manager's)."""
    match = _STEP.match(name)
    if match is None or step_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


# A manager's record of its retention rules and the steps saved under them.
RETENTION = "retention.json"
# The lease of the manager writing a run's directory (see `_lease`).
MANAGER_LEASE = "manager.json"
# In a local tier with peers (`_peers`): the folder of the copies of other
# processes' parts, and each step's record of every process's part.
PEERS = "peers"
PARTS = "parts.json"


def metrics_name(step: int) -> str:
    """The file beside a step's folder holding its metrics."""
    return step_name(step) + ".metrics.json"


def parse_metrics_name(name: str) -> int | None:
    """The step whose metrics file `name` is, or `None` for any other name."""
    match = _METRICS.match(name)
    return None if match is None else parse_step(match.group(1))


# -- Limits on what a manifest may claim (it is untrusted input) -----------------------------------

# How arrays sit under the data root (see `_layout`).
LAYOUTS = ("directories", "ocdbt")
MAX_MANIFEST_BYTES = 256 * 2**20
# JSON containers (objects and arrays) a manifest may hold: about ten a leaf
# (its record, shape lists and key path; its structure node) for a million
# leaves. Counted before parsing, with every `{` and `[` in the text (those in
# strings too), since each parsed container costs about 60 bytes or more.
MAX_MANIFEST_CONTAINERS = 20_000_000
# And at least this many bytes of text a container. A real manifest has about
# 25, so parsing costs a small multiple of the manifest's size (about twelve
# times at most). Millions of `[],` would cost twenty times and more.
MANIFEST_BYTES_PER_CONTAINER = 6
# The most shards a safetensors index may name (Llama 3.1 405B has 191). Every
# shard's header is read when a folder is opened (on the Hub, a request or two
# each), so more are refused before any is read (`_safetensors`, `_hub`).
MAX_SHARDS = 2048
MAX_RANK = 32
MAX_ELEMENTS = 2**53

# -- Records -------------------------------------------------------------------------------------

# How a leaf came in, which decides what a load gives back when `like` is silent.
LEAF_TYPES = ("jax", "numpy", "numpy_scalar", "prng_key", "bool", "int", "float", "complex")
# Those of one value, which a load gives back as a value (never a lazy leaf).
SCALAR_TYPES = ("bool", "int", "float", "complex", "numpy_scalar")
# How its bytes are stored: as they are, as raw unsigned integers of the same
# size ("view"), or as a PRNG key's key data.
ENCODINGS = ("plain", "view", "key_data")


@dataclasses.dataclass(frozen=True)
class PackRecord:
    """One one-dimensional array, `packed.<dtype>`, holding small leaves of its
    stored `dtype` back to back (see `_pack`); `size` and `chunk` in elements.
    `commit` is the listing manifest's (not stored: it tells apart the packs of
    two saves that used the same folder)."""

    name: str
    dtype: str
    size: int
    chunk: int
    commit: str = dataclasses.field(default="", compare=False)
    compression: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "dtype": self.dtype, "shape": [self.size], "chunks": [self.chunk]}
        if self.compression:
            out["compression"] = self.compression
        return out


def pack_name(stored_dtype: str) -> str:
    """A pack's folder: `packed.<stored dtype>` (a name with a `.`, so no key maps there)."""
    return f"packed.{stored_dtype}"


# Not `frozen`: a frozen dataclass's `__init__` costs six times as much, and
# every leaf of a save or load makes one; slots save a fifth of its memory.
# Never changed once made, except by `_records.assign` before anyone else sees it.
@dataclasses.dataclass(slots=True)
class LeafRecord:
    """One saved leaf.

    **Attributes:**

    - `path`: the dotted path (`model.layers.0.weight`).
    - `keypath`: the key path as a JSON list of `[kind, value]` pairs.
    - `type`: one of `LEAF_TYPES`.
    - `shape`, `dtype`: as the leaf had them (`dtype` "key<threefry2x32>" for keys).
    - `stored_shape`, `stored_dtype`: of the zarr array (they differ for PRNG keys,
      for dtypes stored as raw bytes, and when cast on save).
    - `encoding`: one of `ENCODINGS`; `chunks`: the zarr chunk shape.
    - `impl`: the PRNG implementation name of a key array, else "".
    - `pack`, `offset`: the pack holding it and where its elements start, or
      `None` when it has its own array.
    - `compression`: its own array's (`COMPRESSIONS`), or "".
    """

    path: str
    keypath: list[list[Any]]
    type: str
    shape: tuple[int, ...]
    dtype: str
    stored_shape: tuple[int, ...]
    stored_dtype: str
    encoding: str
    chunks: tuple[int, ...]
    impl: str = ""
    pack: PackRecord | None = None
    offset: int = 0
    compression: str = ""

    @property
    def size(self) -> int:
        """Its number of stored elements."""
        return math.prod(self.stored_shape)

    @property
    def directory(self) -> str:
        return _keypath.to_directory(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * _itemsize(self.stored_dtype)

    @property
    def chunk_nbytes(self) -> int:
        """The bytes of one full chunk as stored (before its checksum)."""
        return math.prod(self.chunks) * _itemsize(self.stored_dtype)

    def to_json(self) -> dict[str, Any]:
        """Its record in a version 4 manifest, without what equals its default.
        Shapes stay tuples, which the encoders write as JSON arrays (a `list`
        of each took a third of this call's time)."""
        shape, stored = self.shape, self.stored_shape
        out: dict[str, Any] = {
            "path": self.path,
            "keypath": self.keypath,
            "type": self.type,
            "shape": shape,
            "dtype": self.dtype,
        }
        if stored != shape:
            out["stored_shape"] = stored
        if self.stored_dtype != self.dtype:
            out["stored_dtype"] = self.stored_dtype
        if self.encoding != "plain":
            out["encoding"] = self.encoding
        if self.chunks != stored and self.chunks != whole_chunks(stored):
            out["chunks"] = self.chunks
        if self.impl:
            out["impl"] = self.impl
        if self.pack is not None:
            out["pack"], out["offset"] = self.pack.name, self.offset
        if self.compression:
            out["compression"] = self.compression
        return out


@_state.memo(256)
def _itemsize(dtype: str) -> int:
    return dtype_from_name(dtype).itemsize


@_state.memo(4096)
def whole_chunks(stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape of an array stored as one chunk."""
    return tuple(max(1, n) for n in stored_shape)


# -- The chunk codec -----------------------------------------------------------------------------

# Data types the zarr3 driver stores natively. Others (uint2, uint4, float8_e4m3)
# are stored as the raw bytes, viewed as an unsigned integer of the same size.
NATIVE_DTYPES = frozenset(
    "bool int2 int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "float16 bfloat16 float32 float64 complex64 complex128 float8_e3m4 "
    "float8_e4m3fn float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn".split()
)

# The largest chunk a save writes; compressed, `COMPRESSED_CHUNK_BYTES`: each
# writing thread holds one compressed at a time, and a read of a few rows
# decompresses the whole chunks that hold them.
CHUNK_BYTES = 64 * 2**20
COMPRESSED_CHUNK_BYTES = 8 * 2**20
# An array's chunk files sit under `c` in its folder: `c/<i>/<j>...` by their
# indices in the chunk grid, and a scalar's one chunk is the file `c` itself.
CHUNKS = "c"
# Each chunk file ends in the crc32c of its bytes, little-endian.
CHECKSUM_BYTES = 4


# The compressions a save may ask for (`compression=`), each one of zarr v3's
# own codecs, so that any zarr v3 reader decompresses the chunks. Bit-shuffled
# blosc: the bits of each byte position together, where trained weights' skewed
# exponents compress; lz4 is the default, as small as zstd on trained state and
# faster to compress (docs/benchmarks.md, "Compression").
COMPRESSIONS = ("blosc-lz4", "blosc-zstd", "zstd")
DEFAULT_COMPRESSION = "blosc-lz4"


def compressor(compression: str, itemsize: int) -> dict[str, Any]:
    """The zarr v3 codec of a `compression` (`COMPRESSIONS`), for elements of `itemsize` bytes."""
    if compression == "zstd":
        return {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
    cname, clevel = {"blosc-lz4": ("lz4", 5), "blosc-zstd": ("zstd", 3)}[compression]
    shuffle = {"cname": cname, "clevel": clevel, "shuffle": "bitshuffle", "typesize": itemsize, "blocksize": 0}
    return {"name": "blosc", "configuration": shuffle}


@_state.memo(16)
def codec(compression: str, itemsize: int) -> Any:
    """The numcodecs codec that writes and reads what `compressor` describes
    (its calls release the GIL)."""
    config = compressor(compression, itemsize)["configuration"]
    if compression == "zstd":
        return numcodecs.Zstd(level=config["level"], checksum=config["checksum"])
    return numcodecs.Blosc(config["cname"], config["clevel"], numcodecs.Blosc.BITSHUFFLE, config["blocksize"])


def decoded_size(compression: str, data: Any) -> int | None:
    """The bytes a compressed chunk's header says it decompresses to, or `None`
    where it says none (not a frame of its codec). Blosc: four bytes, then
    `nbytes`, `blocksize` and `cbytes` (uint32, little-endian; `cbytes` is the
    frame's own length). Zstd: its magic number, a descriptor, then the
    content size in 0, 1, 2, 4 or 8 bytes after an optional window byte and
    dictionary id."""
    head = bytes(data[:18])
    if compression != "zstd":
        whole = len(head) >= 16 and int.from_bytes(head[12:16], "little") == len(data)
        return int.from_bytes(head[4:8], "little") if whole else None
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = head[4]
    single = descriptor >> 5 & 1
    width = (single, 2, 4, 8)[descriptor >> 6]
    start = 6 - single + (0, 1, 2, 4)[descriptor & 3]
    if not width or len(head) < start + width:
        return None
    return int.from_bytes(head[start : start + width], "little") + (256 if width == 2 else 0)


def most_stored_bytes(chunk_nbytes: int, compression: str) -> int:
    """The most bytes a chunk of `chunk_nbytes` may take stored (before its
    checksum); compressed, blosc's or zstd's worst case (a header and a little per block)."""
    return chunk_nbytes + (chunk_nbytes // 128 + 1024 if compression else 0)


def codecs(stored_dtype: str, compression: str = "") -> list[dict[str, Any]]:
    """Little-endian bytes, then the `compression` if any, then a crc32c
    checksum of every chunk as stored."""
    itemsize = dtype_from_name(stored_dtype).itemsize
    # Single bytes have no endianness to name.
    endian = {"configuration": {"endian": "little"}} if itemsize > 1 else {}
    middle = [compressor(compression, itemsize)] if compression else []
    return [{"name": "bytes", **endian}, *middle, {"name": "crc32c"}]


def array_metadata(
    shape: tuple[int, ...], stored_dtype: str, chunks: list[int], compression: str = ""
) -> dict[str, Any]:
    """The `zarr.json` metadata of one stored array."""
    return {
        "shape": list(shape),
        "data_type": stored_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs(stored_dtype, compression),
    }


@_state.memo(256)
def dtype_from_name(name: str) -> np.dtype:
    """The NumPy dtype of a zarr/manifest dtype name (`ml_dtypes` for bfloat16 and co)."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def chunk_shape(
    shape: tuple[int, ...], itemsize: int, block: tuple[int, ...] | None = None, limit: int | None = None
) -> list[int]:
    """A chunk grid that lines up with `block` (a shard's shape) and keeps chunks
    under `limit` (`CHUNK_BYTES`), so large arrays are read and written in parallel."""
    chunk = [max(1, n) for n in (block if block is not None else shape)]
    limit = CHUNK_BYTES if limit is None else limit
    while math.prod(chunk) * itemsize > limit:
        for axis, n in enumerate(chunk):
            if n > 1:
                # Halving keeps every chunk inside one shard when `n` is even.
                chunk[axis] = n // 2 if n % 2 == 0 else -(-n // 2)
                break
        else:
            break
    return chunk


def chunk_keys(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[str]:
    """The chunk files, in order, of an array whose chunks split only its first
    axis; lazily, so a hostile manifest's absurd shape fails at its first
    missing file."""
    if not shape:
        yield CHUNKS
        return
    if 0 in shape:
        return
    rest = "/0" * (len(shape) - 1)
    for i in range(-(-shape[0] // chunks[0])):
        yield f"{CHUNKS}/{i}{rest}"


def chunk_key(indices: Sequence[int]) -> str:
    """The chunk file (below its array's folder) of the chunk at `indices` in the
    chunk grid: `c/1/0`, or `c` for a scalar's."""
    return "/".join([CHUNKS, *map(str, indices)])
