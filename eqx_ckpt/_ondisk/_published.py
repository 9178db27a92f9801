"""The published layout's record: `eqx_ckpt.json`, beside Hugging Face safetensors.

`export_safetensors` into a folder writes `model.safetensors` (or shards and
`model.safetensors.index.json`; a fine-tune stored against a base, from
version 3, `finetune.safetensors` and so on: `_safetensors.STEMS`), and this
small JSON file. It says what the safetensors files cannot:

- each leaf's key path, type and dtype as eqx_ckpt records them (so a dtype
  safetensors has no name for comes back exactly);
- the tree's structure record (`_structure`);
- the user's own metadata (`info`).

Its fields are documented in docs/interop.md ("`eqx_ckpt.json`"): format
version 6 records each leaf's BLAKE3 block digests (`_digests`), each block
whole rows of the leaf (`_digests.leaf_block`), for a folder holding every
leaf and for a fine-tune stored against a pinned `base`; version 5 recorded
blocks of `block_bytes` each, and version 4 SHA-256 ones (`BLOCK_ALGORITHMS`:
the version says which hash a reader checks with). Earlier versions recorded one xxh3-128 a leaf: 1 for a
folder holding every leaf, 3 for a fine-tune (2, in the whole model's file
names); all are still read.

It is untrusted input, read by the manifest's own code:

- bounded in bytes and containers, and parsed, by `_manifest.read_document`;
- every leaf record checked by `_manifest.parse_leaves`;
- the structure record kept as text for `_rebuild`, which checks it as any
  checkpoint's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

from .._base._errors import CheckpointTypeError, CheckpointValueError, from_file
from .._base._location import HUB_SCHEME
from . import _digests
from ._format import PUBLISHED, LeafRecord, dtype_from_name
from ._manifest import invalid, parse_leaves, read_document

NAME = PUBLISHED
FORMAT = "eqx_ckpt.safetensors"
VERSION = 6
# The versions a fine-tune wrote, which always name a base; from 4 on, a record may.
FAMILY_VERSIONS = (2, 3)
# The first version recording block digests, and the block sizes a record may say.
BLOCKS_VERSION = 4
# The hash of each version's block digests: an export records `VERSION`'s.
BLOCK_ALGORITHMS = types.MappingProxyType({4: _digests.SHA256, 5: _digests.BLAKE3, 6: _digests.BLAKE3})
# The first version whose blocks are whole rows of each leaf, of at most `block_bytes`.
ROWS_VERSION = 6
BLOCK_SIZES = tuple(2**n for n in range(16, 27))
# The user's metadata is small: a description, hyperparameters, metrics.
MAX_INFO_BYTES = 1 << 20
MAX_INFO_DEPTH = 32
# The most leaves a record lists, those a fine-tune takes from its base among
# them: the bound on a folder's tensors (`_safetensors.MAX_TENSORS` is this).
MAX_LEAVES = 2**17


@dataclasses.dataclass(frozen=True)
class Base:
    """The base of a fine-tune, pinned: `path` as recorded (a local one is
    relative to the fine-tune's folder), and the `revision` (an `hf://` base's
    commit) or the `sha256` of its record file (any other)."""

    path: str
    revision: str = ""
    sha256: str = ""

    def to_json(self) -> dict[str, str]:
        pin = {"revision": self.revision} if self.revision else {"sha256": self.sha256}
        return {"path": self.path, **pin}

    @property
    def shown(self) -> str:
        """How messages name it: an `hf://` base at its commit."""
        return hub_at(self.path, self.revision) if self.revision else self.path


@dataclasses.dataclass(frozen=True)
class Family:
    """A fine-tune's base and the leaves it takes from it: dotted path -> the
    base's dotted path holding the same bytes."""

    base: Base
    references: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Published:
    """What an `eqx_ckpt.json` holds, checked (see the module docstring)."""

    leaves: tuple[LeafRecord, ...]
    structure: str | None
    info: dict[str, Any]
    library_version: str
    created: str
    format_version: int
    # Each leaf's recorded digest, by dotted path (none in older exports).
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    # Each leaf's block digests, one after the other (version 4 on), the block
    # size and the hash (`BLOCK_ALGORITHMS`).
    blocks: dict[str, bytes] = dataclasses.field(default_factory=dict)
    block_bytes: int = 0
    block_algorithm: _digests.Algorithm | None = None
    family: Family | None = None
    # The sha256 of the `eqx_ckpt.json` this was parsed from.
    sha256: str = ""
    # Whether each leaf's blocks are whole rows of at most `block_bytes` (version 6 on).
    row_blocks: bool = False


def hub_at(path: str, revision: str) -> str:
    """`hf://owner/name[/folder]` at `revision`: `hf://owner/name@revision[/folder]`."""
    parts = path.split("/", 4)  # "hf:", "", owner, name, folder
    head, rest = "/".join(parts[:4]), parts[4:]
    return f"{head}@{revision}" + "".join("/" + r for r in rest)


def encode(
    records: Sequence[LeafRecord],
    structure: Any,
    info: dict[str, Any] | None,
    *,
    created: str = "",
    digests: dict[str, _digests.Digested] | None = None,
    family: Family | None = None,
) -> bytes:
    """The bytes of an `eqx_ckpt.json` for `records` (every leaf, in the tree's
    order, those taken from a base included), the tree's `structure` record (or
    `None`), the user's `info`, each leaf's digest and a fine-tune's `family`.
    `created` (`""`: no field) is the only time in it: the same arguments give
    the same bytes."""
    from .. import __version__

    leaves = []
    references = family.references if family is not None else {}
    for record in records:
        item = record.to_json()
        item.pop("chunks", None)  # the safetensors reader chooses its own
        if digests and record.path in digests:
            item["digest"] = digests[record.path].digest
            item["blocks"] = digests[record.path].blocks.hex()
        if record.path in references:
            item["base"] = references[record.path]
        leaves.append(item)
    head = {
        "format": FORMAT,
        "format_version": VERSION,
        "block_bytes": _digests.BLOCK_BYTES,
        "library_version": __version__,
        "created": created,
        "leaf_count": len(records),
        "total_bytes": sum(record.nbytes for record in records),
        "info": info or {},
        "structure": structure,
        **({"base": family.base.to_json()} if family is not None else {}),
    }
    # A field a line, a leaf a line: readable, and compact for ten thousand leaves.
    lines = [f"{json.dumps(key)}: {_compact(value)}," for key, value in head.items() if key != "created" or created]
    lines.append('"leaves": [\n' + ",\n".join(_compact(leaf) for leaf in leaves) + "\n]")
    return ("{\n" + "\n".join(lines) + "\n}\n").encode()


def _compact(value: Any) -> str:
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def check_info(info: Any) -> dict[str, Any]:
    """`info` if it is a JSON object of JSON values (nested at most
    `MAX_INFO_DEPTH` deep, at most `MAX_INFO_BYTES` encoded); else an error."""
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise CheckpointTypeError(
            f"`info` must be a dict of JSON values (a description, hyperparameters...), not {type(info).__name__}."
        )
    problem = _json_problem(info, "info", 0)
    if problem is not None:
        raise CheckpointTypeError(f"`info` must hold JSON values only: {problem}.")
    size = len(json.dumps(info, allow_nan=False))
    if size > MAX_INFO_BYTES:
        raise CheckpointValueError(
            f"`info` is {size} bytes as JSON, more than the {MAX_INFO_BYTES} allowed: keep it to metadata (store "
            f"arrays as leaves of the tree)."
        )
    return info


def _json_problem(value: Any, where: str, depth: int) -> str | None:
    """What in `value` is not a JSON value, or `None`."""
    if depth > MAX_INFO_DEPTH:
        return f"`{where}` nests more than {MAX_INFO_DEPTH} levels deep"
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"`{where}` is {value}, which JSON cannot hold"
    if isinstance(value, (list, tuple)):
        items: Any = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return f"`{where}` has a key that is not a string"
        items = ((f"{where}[{k!r}]", v) for k, v in value.items())
    else:
        return f"`{where}` is a {type(value).__name__}"
    for name, item in items:
        problem = _json_problem(item, name, depth + 1)
        if problem is not None:
            return problem
    return None


def parse(data: bytes, *, where: str) -> Published:
    """An `eqx_ckpt.json`'s bytes, checked; any problem is a `CorruptCheckpointError`."""
    named = f"The {NAME} of {where!r}"
    fix = f" (remove {NAME} to load its safetensors files by name, with `like`)"
    bad = invalid(named, where, holder="folder", fix=fix)
    body, version = read_document(data, bad, fmt=FORMAT, newest=VERSION, named=named, where=where)
    for key in ("library_version", "created"):
        if not isinstance(body.get(key, ""), str):
            raise bad(f"`{key}` is not a string")
    info = body.get("info", {})
    problem = "`info` is not a JSON object" if not isinstance(info, dict) else _json_problem(info, "info", 0)
    if problem is None and len(json.dumps(info)) > MAX_INFO_BYTES:
        problem = f"`info` is more than the {MAX_INFO_BYTES} bytes allowed"
    if problem is not None:
        raise bad(problem)
    structure = body.get("structure")
    if structure is not None and not isinstance(structure, dict):
        raise bad("`structure` is neither a JSON object nor null")
    raw = body.get("leaves")
    if isinstance(raw, list) and len(raw) > MAX_LEAVES:
        raise bad(f"it records {len(raw)} leaves, more than the {MAX_LEAVES} allowed (those taken from a base count)")
    block = _block_bytes(body, version, bad)
    algorithm = BLOCK_ALGORITHMS[version] if version >= BLOCKS_VERSION else None
    digests, references = _extras(raw, bad, version)
    leaves = parse_leaves(raw, bad)
    _check_totals(body, leaves, bad)
    rows = version >= ROWS_VERSION
    blocks = {} if algorithm is None else _blocks(raw or [], leaves, digests, block, algorithm, bad, rows=rows)
    family = _family(body, version, references, bad)
    return Published(
        tuple(leaves),
        None if structure is None else json.dumps(structure, allow_nan=False, separators=(",", ":")),
        info,
        body.get("library_version", ""),
        body.get("created", ""),
        version,
        digests,
        blocks,
        block,
        algorithm,
        family,
        hashlib.sha256(data).hexdigest(),
        rows,
    )


# A leaf's digest: one xxh3-128 before version 4, then its blocks' root in the version's hash.
_XXH3_DIGEST = re.compile(re.escape(_digests.XXH3) + "[0-9a-f]{32}"), f"{_digests.XXH3}<32 hex digits>"
_ROOTS = types.MappingProxyType(
    {
        version: (re.compile(re.escape(algorithm.prefix) + "[0-9a-f]{64}"), f"{algorithm.prefix}<64 hex digits>")
        for version, algorithm in BLOCK_ALGORITHMS.items()
    }
)
_COMMIT = re.compile("[0-9a-f]{40}")
_SHA256 = re.compile("[0-9a-f]{64}")
# A base's path: printable, no control characters, bounded.
MAX_BASE_PATH = 1024
_BASE_PATH = re.compile(r"[^\x00-\x1f\x7f]+")


def _block_bytes(body: dict[str, Any], version: int, bad: Callable[[str], Exception]) -> int:
    """The block size of a record's block digests (`BLOCK_SIZES`; 0 before `BLOCKS_VERSION`)."""
    block = body.get("block_bytes")
    if version < BLOCKS_VERSION:
        if block is not None:
            raise bad(f"it records `block_bytes`, which only format version {BLOCKS_VERSION} and later record")
        return 0
    if type(block) is not int or block not in BLOCK_SIZES:
        raise bad(f"`block_bytes` {from_file(repr(block), 40)} is not a power of two from 64 KiB to 64 MiB")
    return block


def _blocks(
    raw: list[Any],
    leaves: list[LeafRecord],
    digests: dict[str, str],
    block: int,
    algorithm: _digests.Algorithm,
    bad: Callable[[str], Exception],
    *,
    rows: bool,
) -> dict[str, bytes]:
    """Each leaf's `blocks` (version 4 on): hex digits of one digest a block
    of `block` bytes (`rows`: of the whole rows of the leaf that `block` bytes
    hold, `_digests.leaf_block`), in the version's hash `algorithm`, as many
    as its bytes make, whose own digest is its `digest`."""
    out: dict[str, bytes] = {}
    for leaf, record in zip(raw, leaves):
        text, path = leaf.get("blocks"), from_file(repr(record.path))
        if record.path not in digests or not isinstance(text, str):
            raise bad(f"the leaf {path} has no `digest` and `blocks`, which format version {BLOCKS_VERSION} records")
        size = leaf_block(record, block) if rows else block
        want = _digests.count(record.nbytes, size) * _digests.SIZE
        try:
            blocks = bytes.fromhex(text) if len(text) == 2 * want else None
        except ValueError:
            blocks = None
        if blocks is None:
            shown = f"{want // _digests.SIZE} {algorithm.shown} digests"
            raise bad(f"the leaf {path} records `blocks` that are not {shown} in hex")
        if _digests.root(blocks, algorithm) != digests[record.path]:
            raise bad(f"the leaf {path} records a `digest` that is not the {algorithm.shown} of its `blocks`")
        out[record.path] = blocks
    return out


def leaf_block(record: LeafRecord, most: int) -> int:
    """The bytes of each block of the leaf `record`, in a record of blocks of
    whole rows of at most `most` bytes (`_digests.leaf_block`)."""
    return _digests.leaf_block(record.stored_shape, dtype_from_name(record.stored_dtype).itemsize, most)


def _extras(raw: Any, bad: Callable[[str], Exception], version: int) -> tuple[dict[str, str], dict[str, str]]:
    """The leaves' `digest` and `base` fields, checked (the rest is `parse_leaves`')."""
    pattern, shown = _ROOTS[version] if version >= BLOCKS_VERSION else _XXH3_DIGEST
    digests: dict[str, str] = {}
    references: dict[str, str] = {}
    for leaf in raw if isinstance(raw, list) else []:
        if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str):
            continue  # (refused by `parse_leaves`)
        path, digest, base = leaf["path"], leaf.get("digest"), leaf.get("base")
        if digest is not None:
            if not isinstance(digest, str) or not pattern.fullmatch(digest):
                raise bad(
                    f"the leaf {from_file(repr(path))} has the digest {from_file(repr(str(digest)), 80)}, not {shown}"
                )
            digests[path] = digest
        if base is not None:
            if not isinstance(base, str) or not 0 < len(base) <= 4096:
                raise bad(
                    f"the leaf {from_file(repr(path))} names its base's leaf as {repr(base)[:80]}, which is not a "
                    f"dotted path"
                )
            if digest is None:
                raise bad(f"the leaf {from_file(repr(path))} names its base's leaf as {base[:80]!r}, without a digest")
            references[path] = base
    return digests, references


def _family(
    body: dict[str, Any], version: int, references: dict[str, str], bad: Callable[[str], Exception]
) -> Family | None:
    """A fine-tune's record's base (`FAMILY_VERSIONS`), checked, with its leaves' references."""
    base = body.get("base")
    if version not in FAMILY_VERSIONS and (version < BLOCKS_VERSION or (base is None and not references)):
        if base is not None or references:
            raise bad("it names a base, which only format version 2 and later record")
        return None
    if not isinstance(base, dict) or "path" not in base:
        raise bad(f"format version {version} records a `base` object with a `path`, which it lacks")
    path = base["path"]
    if not isinstance(path, str):
        raise bad(f"its base's `path` is {type(path).__name__}, not a string")
    if not path:
        raise bad("its base's `path` is empty")
    if len(path) > MAX_BASE_PATH:
        raise bad(f"its base's `path` is {len(path)} characters long, more than the {MAX_BASE_PATH} allowed")
    if not _BASE_PATH.fullmatch(path):
        raise bad(f"its base's `path` {from_file(repr(path))} holds a control character (a line break, a NUL...)")
    revision, sha256 = base.get("revision", ""), base.get("sha256", "")
    if path.startswith(HUB_SCHEME):
        if not isinstance(revision, str) or not _COMMIT.fullmatch(revision) or sha256:
            raise bad(f"its base {from_file(repr(path))} is not pinned to a commit (40 hex digits)")
    elif not isinstance(sha256, str) or not _SHA256.fullmatch(sha256) or revision:
        raise bad(f"its base {from_file(repr(path))} is not pinned by the sha256 of its record (64 hex digits)")
    return Family(Base(path, revision, sha256), references)


def _check_totals(body: dict[str, Any], leaves: list[LeafRecord], bad: Callable[[str], Exception]) -> None:
    count, total = body.get("leaf_count"), body.get("total_bytes")
    if count != len(leaves) or type(count) is not int:
        raise bad(f"`leaf_count` {count!r} is not the {len(leaves)} leaves it lists")
    if total != sum(leaf.nbytes for leaf in leaves) or type(total) is not int:
        raise bad(f"`total_bytes` {total!r} is not the bytes of the leaves it lists")
