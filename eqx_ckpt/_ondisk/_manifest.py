"""The manifest: one JSON file at the root of a checkpoint, written last (its
presence makes the checkpoint exist), listing every saved leaf with its exact
key path. Read as untrusted input: every field is type-checked, every directory
recomputed from the key path, and a digest over the content detects edits.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .._base import _gc, _keypath
from .._base._errors import CheckpointVersionError, CorruptCheckpointError, from_file
from . import _digests, _iterators
from ._dtypes import is_known_dtype, key_data_shape
from ._format import (
    COMPRESSED_VERSION,
    COMPRESSIONS,
    ENCODINGS,
    FORMAT,
    FORMAT_VERSION,
    LAYOUTS,
    LEAF_TYPES,
    MANIFEST_BYTES_PER_CONTAINER,
    MAX_ELEMENTS,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_CONTAINERS,
    MAX_RANK,
    SCALAR_TYPES,
    UNCOMPRESSED_VERSION,
    UPGRADE,
    LeafRecord,
    PackRecord,
    is_data_root,
    pack_name,
    whole_chunks,
)


@dataclasses.dataclass(frozen=True)
class Declared:
    """A parsed manifest's own totals, unchecked (any JSON value), for `verify`
    to compare with its leaves."""

    leaf_count: Any
    total_bytes: Any
    # The `nbytes` a leaf's record gives, by the leaf's index. Every leaf has
    # one before version 4 (`None` where missing); versions 4 and later write none.
    nbytes: dict[int, Any]


@dataclasses.dataclass(frozen=True)
class Manifest:
    leaves: tuple[LeafRecord, ...]
    data_root: str = ""
    created: str = ""
    library_version: str = ""
    format_version: int = FORMAT_VERSION
    layout: str = "directories"
    # The save that wrote it (a random id; "" for version 1).
    commit: str = ""
    # Numbers stored with the save (a manager's metrics), committed with it.
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Where the reader found it: changes when the manifest file is replaced.
    stamp: bytes = dataclasses.field(default=b"", compare=False)
    # The arrays holding packed leaves.
    packs: tuple[PackRecord, ...] = ()
    # Another format's own strings (a safetensors header's `__metadata__`).
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    # The tree's structure record (version 5 on, `_structure`), as JSON text:
    # parsed and checked only when a load rebuilds from it (`_rebuild.record_of`),
    # so a load with `like` pays nothing for it. `None`: none.
    structure: str | None = dataclasses.field(default=None, compare=False)
    # The user's metadata of a published folder (`_published`: its `info`).
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    # `structure` as a JSON string, where a save made it with the text (`structure_texts`).
    structure_string: bytes | None = dataclasses.field(default=None, compare=False, repr=False)
    # Its own totals, as `parse` read them; `None` for one made in memory.
    declared: Declared | None = dataclasses.field(default=None, compare=False)
    # A published fine-tune's base and the leaves it takes from it
    # (`_published.Family`); `None` for every other checkpoint.
    family: Any = dataclasses.field(default=None, compare=False)
    # A published folder's recorded digest of each leaf (`_published`), by dotted path.
    digests: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    # ... and its block digests (`_digests`, `eqx_ckpt.json` version 4 on), with
    # their block size and hash (the record's version's), and whether each
    # leaf's blocks are whole rows of at most that size (version 6 on).
    blocks: dict[str, bytes] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    block_bytes: int = dataclasses.field(default=0, compare=False)
    block_algorithm: _digests.Algorithm | None = dataclasses.field(default=None, compare=False)
    row_blocks: bool = dataclasses.field(default=False, compare=False)
    # The sha256 of the file this was parsed from (`manifest.json`, a published
    # folder's `eqx_ckpt.json`), as read: what pins it as a fine-tune's base
    # (`_family`). "" for one made otherwise.
    record_sha256: str = dataclasses.field(default="", compare=False)
    # The iterator states saved with the tree (version 7 on, `_iterators`).
    iterators: tuple[_iterators.IteratorRecord, ...] = ()

    @property
    def total_bytes(self) -> int:
        # Each stored (dtype, shape) worked out once: ten thousand leaves have a few dozen.
        sizes: dict[tuple[str, tuple[int, ...]], int] = {}
        total = 0
        for leaf in self.leaves:
            key = (leaf.stored_dtype, leaf.stored_shape)
            nbytes = sizes.get(key)
            if nbytes is None:
                nbytes = sizes[key] = leaf.nbytes
            total += nbytes
        return total

    def by_path(self) -> dict[str, LeafRecord]:
        return {leaf.path: leaf for leaf in self.leaves}

    @_gc.gc_paused()
    def to_bytes(self, *, leaves: list[Any] | None = None) -> bytes:
        """The manifest's bytes. `leaves`: `leaves_text(self.leaves)`, where the caller kept it."""
        body = {
            "format": FORMAT,
            "format_version": version_of(self.leaves, self.packs, self.iterators),
            "library_version": self.library_version,
            "created": self.created,
            "data_root": self.data_root,
            "layout": self.layout,
            "commit": self.commit,
            "metrics": self.metrics,
            "packs": [pack.to_json() for pack in self.packs],
            "leaf_count": len(self.leaves),
            "total_bytes": self.total_bytes,
        }
        if self.iterators:
            body["iterators"] = [record.to_json() for record in self.iterators]
        structure = self.structure_string
        if structure is None and self.structure is not None:
            structure = orjson.dumps(self.structure)
        if leaves is None:
            leaves = leaves_text(self.leaves)
        return _encoded(body, leaves, structure=structure)


def version_of(leaves: Sequence[LeafRecord], packs: Sequence[PackRecord], iterators: Sequence[Any] = ()) -> int:
    """The oldest format version that holds what the manifest does (iterator
    states, compressed chunks), so that an eqx_ckpt of that version reads it too."""
    if iterators:
        return FORMAT_VERSION
    compressed = any(pack.compression for pack in packs) or any(leaf.compression for leaf in leaves)
    return COMPRESSED_VERSION if compressed else UNCOMPRESSED_VERSION


# Leaf records encoded at a time: their dicts are freed before the next ones are
# made, so a save reuses the same memory (fresh pages cost more than the encoding).
_BATCH = 256


def leaves_text(leaves: Sequence[LeafRecord]) -> list[Any]:
    """The text of a manifest's `leaves` list, in parts, without its brackets:
    a record of each of `leaves` (`LeafRecord.to_json`), one a line."""
    return _records_text(leaves, LeafRecord.to_json)


def _records_text(records: Sequence[Any], to_json: Callable[[Any], Any] | None) -> list[Any]:
    """`leaves_text`, with `to_json` making each record (`None`: they are records).

    A batch `orjson` cannot encode (an integer beyond 64 bits, a string that is
    not valid Unicode) falls back to `json`, which escapes. `},{"path"` cannot
    occur unescaped inside a JSON string, so it splits records into lines."""
    parts: list[Any] = []
    for start in range(0, len(records), _BATCH):
        batch = records[start : start + _BATCH]
        if to_json is not None:
            batch = [to_json(record) for record in batch]
        try:
            text = orjson.dumps(batch)
        except orjson.JSONEncodeError:
            # The records hold no cycles: the encoder need not look for them.
            text = json.dumps(batch, allow_nan=False, separators=(",", ":"), check_circular=False).encode()
        del batch
        # Without the batch's brackets; batches joined as records are.
        if start:
            parts.append(b",\n")
        parts.append(memoryview(text.replace(b'},{"path":', b'},\n{"path":'))[1:-1])
    return parts


def _encoded(body: dict[str, Any], leaves: list[Any], *, structure: bytes | None = None) -> bytes:
    """The bytes of a version 4 manifest: `body`, then `structure` (a JSON
    string), the `leaves` text in parts, and last the sha256 of every byte
    before it. The bytes are copied once, into the result."""
    parts: list[Any] = [_head(body, structure) + b"[", *leaves, b"]"]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return b"".join([*parts, _tail(digest)])


def _head(body: dict[str, Any], structure: bytes | None = None) -> bytes:
    """The start of a manifest, up to its `leaves` value (`structure`: a JSON string)."""
    head = json.dumps(body, allow_nan=False)[:-1].encode()
    if structure is not None:
        head += b',\n"structure": ' + structure
    return head + b',\n"leaves": '


def _tail(digest: Any) -> bytes:
    """The end of a version 4 manifest, after the bytes that `digest` has hashed."""
    return b',\n"digest": "sha256:' + digest.hexdigest().encode() + b'"}\n'


def encode_structure(record: Any) -> str:
    """A structure record as the manifest holds it: compact JSON text (so that
    one made again from an equal tree is the same text)."""
    return _json(record).decode()


def structure_texts(record: Any) -> tuple[str, bytes]:
    """`record`'s JSON text, and that text as a JSON string (how the manifest
    holds it), byte for byte those of `_json(record)` and `orjson.dumps` of it.

    Equal sub-trees share one sub-record (`_structure`), so each is encoded and
    escaped once: JSON escapes character by character, so the string of a
    joined text is the join of the strings."""
    try:
        text, string = _Texts().of(record)
    except orjson.JSONEncodeError:
        whole = _json(record).decode()
        return whole, orjson.dumps(whole)
    return text.decode(), b'"' + string + b'"'


class _Texts:
    """The texts of the parts of one record, each shared part made once (by `id`:
    the record holds every part while this runs)."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[bytes, bytes]] = {}

    def of(self, node: Any) -> tuple[bytes, bytes]:
        """`node`'s JSON text, and that text escaped (a JSON string without its quotes)."""
        found = self.made.get(id(node))
        if found is None:
            found = self.made[id(node)] = self._make(node)
        return found

    def _make(self, node: Any) -> tuple[bytes, bytes]:
        children = node.get("c") if type(node) is dict else None
        if type(children) is not list or next(reversed(node)) != "c":
            text = orjson.dumps(node)
            return text, _escaped(text)
        # `{...,"c":[` (the node's other items, its children last), then each child's text.
        head = orjson.dumps({key: value for key, value in node.items() if key != "c"})
        start = head[:-1] + (b"," if len(head) > 2 else b"") + b'"c":['
        parts = [self.of(child) for child in children]
        text = start + b",".join([part[0] for part in parts]) + b"]}"
        string = _escaped(start) + b",".join([part[1] for part in parts]) + b"]}"
        return text, string


def _json(value: Any) -> bytes:
    """Compact JSON, by `orjson` where it can (integers beyond 64 bits it cannot)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()


def _escaped(text: bytes) -> bytes:
    """JSON text (UTF-8) as the inside of a JSON string."""
    return orjson.dumps(text.decode())[1:-1]


# The end of a version 4 manifest: its digest, of every byte before this.
_DIGEST_TAIL = re.compile(rb',\n"digest": "(sha256:[0-9a-f]{64})"\}\s*\Z')


def new_manifest(
    leaves: Sequence[LeafRecord],
    data_root: str,
    layout: str = "directories",
    *,
    commit: str = "",
    metrics: dict[str, Any] | None = None,
    packs: Sequence[PackRecord] = (),
    structure: Any = None,
    iterators: Sequence[_iterators.IteratorRecord] = (),
) -> Manifest:
    """A manifest of `leaves`, which use `packs` (sorted by name), and the
    tree's `structure` record."""
    from .. import __version__

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    text, string = (None, None) if structure is None else structure_texts(structure)
    return Manifest(
        tuple(leaves),
        data_root,
        now,
        __version__,
        layout=layout,
        commit=commit,
        metrics=metrics or {},
        packs=tuple(packs),
        structure=text,
        structure_string=string,
        iterators=tuple(iterators),
    )


def _digest(body: dict[str, Any]) -> str:
    """The digest of a version 1-3 manifest: of its content, keys sorted."""
    content = {k: v for k, v in body.items() if k != "digest"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are all different (`json` keeps the last of two),
    as `json.loads`' `object_pairs_hook`."""
    out = dict(pairs)
    if len(out) != len(pairs):  # looked for one key at a time only then: this runs for every object of a header
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate JSON key {key!r}")
            seen.add(key)
    return out


@_gc.gc_paused()
def parse(data: bytes, *, where: str, stamp: bytes = b"") -> Manifest:
    """Parse and validate manifest bytes; any problem is a `CorruptCheckpointError`."""
    named = f"The manifest of checkpoint {where!r}"
    bad = invalid(named, where, holder="checkpoint")
    body, version = _parse_json(data, bad, named, where)
    commit, metrics = _check_header(body, bad)
    packs = _parse_packs(body.get("packs", []), commit, bad, compressed=version >= 6)
    nbytes: dict[int, Any] = {}
    records = _parse_leaves(body.get("leaves"), packs, version, bad, nbytes)
    iterators = _parse_iterators(body, version, records, bad)
    for key in ("created", "library_version", "structure"):
        if not isinstance(body.get(key, ""), str):
            raise bad(f"`{key}` is not a string")
    return Manifest(
        tuple(records),
        body["data_root"],
        body.get("created", ""),
        body.get("library_version", ""),
        version,
        layout=body.get("layout", "directories"),
        commit=commit,
        metrics=metrics,
        stamp=stamp,
        packs=tuple(packs.values()),
        structure=body.get("structure") if version >= 5 else None,
        declared=Declared(body.get("leaf_count"), body.get("total_bytes"), nbytes),
        record_sha256=hashlib.sha256(data).hexdigest(),
        iterators=iterators,
    )


def _parse_iterators(
    body: dict[str, Any], version: int, records: list[LeafRecord], bad: Callable[[str], Exception]
) -> tuple[_iterators.IteratorRecord, ...]:
    """The manifest's iterator states (version 7 on), checked; an iterator
    at a leaf's path, or inside or above one, is refused."""
    if "iterators" not in body:
        return ()
    if version < 7:
        raise bad(f"it holds `iterators`, which format version {version} does not")
    try:
        iterators = _iterators.parse(body["iterators"], {})
    except ValueError as e:
        raise bad(str(e)) from None
    leaves = {record.path for record in records}
    paths = {it.path for it in iterators}
    if len(paths) != len(iterators):
        raise bad("an iterator is listed twice")
    taken = leaves | paths
    for path in paths:  # (a few: each checked against every leaf's path, not each leaf's ancestors)
        inside = path + "." if path else ""
        if path in leaves or _ancestors(path) & taken or any(leaf.startswith(inside) for leaf in leaves):
            raise bad(f"iterator or leaf {from_file(path)!r} lies inside another, or at the same path")
    return iterators


def _ancestors(path: str) -> set[str]:
    """The dotted paths above `path`, the root included."""
    parts = _keypath.split_dotted(path)
    return {".".join(parts[:n]) for n in range(len(parts))}


def invalid(named: str, where: str, *, holder: str, fix: str = "") -> Callable[[str], CorruptCheckpointError]:
    """`bad(why)`, the error of an invalid versioned eqx_ckpt file at `where`
    (`named`: how the message names it; `holder`: what it describes; `fix`:
    what else to do, after "do not load it")."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{named} is invalid: {why}. The {holder} is damaged or was not written by eqx_ckpt; do not load it{fix}.",
            path=where,
        )

    return bad


def read_document(
    data: bytes, bad: Callable[[str], Exception], *, fmt: str, newest: int, named: str, where: str
) -> tuple[dict[str, Any], int]:
    """The JSON object of a manifest or an `eqx_ckpt.json`, and its format
    version: bounded in bytes, parsed by `loads_file`, saying `"format": fmt`
    and a version from 1 to `newest`. A newer version is a
    `CheckpointVersionError` (naming the file as `named`); any other problem, `bad(why)`.

    The version is read first (`declared_version`), before anything else of
    the file is judged: a newer format may write everything else differently,
    its digest too, and must not be called damaged for that."""
    version = declared_version(data)
    if version is not None and version > newest:
        raise CheckpointVersionError(
            f"{named} says format version {version}, which is not one this eqx_ckpt reads (up to {newest}): a newer "
            f"eqx_ckpt wrote it, and nothing is wrong with the checkpoint. {UPGRADE} to load it.",
            path=where,
        )
    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"it is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        body = loads_file(data)
    except ValueError as e:
        raise bad(str(e)) from None
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise bad(f'it does not say `"format": "{fmt}"`')
    version = body.get("format_version")
    if type(version) is not int or not 1 <= version <= newest:
        raise bad(f"format version {version!r} is not one this eqx_ckpt reads (up to {newest})")
    return body, version


# The tokens that say where a JSON text's top level is: strings (skipped
# whole, so that no bracket or key inside one counts) and brackets.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]]', re.DOTALL)
_VERSION_VALUE = re.compile(rb"\s*:\s*(\d{1,9})\s*[,}]")


def declared_version(data: bytes) -> int | None:
    """The `format_version` that the top-level JSON object of `data` declares,
    read without parsing the rest: nothing else of the file is trusted or
    judged by it (an edited file that declares a newer version is refused
    all the same), and it reads at most `MAX_MANIFEST_BYTES`. `None` where
    none is found (the full parse then says what is wrong)."""
    depth = 0
    for token in _TOKENS.finditer(data, 0, MAX_MANIFEST_BYTES):
        text = token.group()
        if text in (b"{", b"["):
            depth += 1
        elif text in (b"}", b"]"):
            depth -= 1
        elif depth == 1 and text == b'"format_version"':
            value = _VERSION_VALUE.match(data, token.end())
            return None if value is None else int(value.group(1))
    return None


def _parse_json(data: bytes, bad: Callable[[str], Exception], named: str, where: str) -> tuple[dict[str, Any], int]:
    """The manifest's JSON object and format version, its digest checked."""
    body, version = read_document(data, bad, fmt=FORMAT, newest=FORMAT_VERSION, named=named, where=where)
    if version >= 4:
        tail = _DIGEST_TAIL.search(data)
        digest = "sha256:" + hashlib.sha256(data[: tail.start()]).hexdigest() if tail else None
        if tail is None or body.get("digest") != tail.group(1).decode():
            raise bad("it does not end with its digest, so it was edited or damaged")
    else:
        digest = _digest(body)
    if body.get("digest") != digest:
        raise bad("its digest does not match its content, so it was edited or damaged")
    return body, version


def _check_header(body: dict[str, Any], bad: Callable[[str], Exception]) -> tuple[str, dict[str, Any]]:
    """The manifest's fields other than its leaves and packs checked; its commit and metrics."""
    root = body.get("data_root")
    if not (root == "" or (isinstance(root, str) and is_data_root(root))):
        raise bad(f"data root {root!r} is neither '' nor a `gen.<commit>` folder")
    commit, metrics = body.get("commit", ""), body.get("metrics", {})
    if not isinstance(commit, str) or not re.fullmatch(r"([0-9a-f]{16})?", commit):
        raise bad(f"commit {commit!r} is not a 16-digit hex identity")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in metrics.items()
    ):
        raise bad("`metrics` is not a mapping from name to number")
    if body.get("layout", "directories") not in LAYOUTS:
        raise bad(f"layout {body.get('layout')!r} is not one of {LAYOUTS}")
    return commit, metrics


def _parse_leaves(
    leaves: Any,
    packs: dict[str, PackRecord],
    version: int,
    bad: Callable[[str], Exception],
    nbytes: dict[int, Any] | None = None,
) -> list[LeafRecord]:
    """Every leaf record, each checked, then their paths together. Into
    `nbytes`, where given: the `nbytes` each record gives (`Declared`)."""
    if not isinstance(leaves, list):
        raise bad("`leaves` is not a list")
    records = []
    lean, compressed = version >= 4, version >= 6
    checked: dict[Any, Any] = {}
    for i, item in enumerate(leaves):
        try:
            records.append(_parse_leaf(item, packs, lean=lean, checked=checked, compressed=compressed))
        except (ValueError, TypeError, KeyError) as e:
            raise bad(f"leaf #{i} ({_peek_path(item)}): {e}") from None
        if nbytes is not None and (not lean or "nbytes" in item):
            nbytes[i] = item.get("nbytes")
    _check_paths(records, bad)
    return records


def parse_leaves(leaves: Any, bad: Callable[[str], Exception]) -> list[LeafRecord]:
    """Leaf records of another file (`_published`), each checked as a version 4
    manifest's, and none packed; `bad(why)` is the error raised."""
    return _parse_leaves(leaves, {}, 4, bad)


def loads_file(data: bytes | str) -> Any:
    """The JSON in a file eqx_ckpt reads: the one parser of JSON read from files,
    all untrusted. Refused, as a `ValueError` whose message is a clause (`it is
    not valid JSON (...)`):

    - too many containers, counted before parsing (`too_many_containers`):
        millions of tiny ones (`[],`) would cost gigabytes of Python objects;
    - two names alike in one object (`json` keeps the last);
    - `NaN`, `Infinity`, or a number such as `1e400` that is one as a float;
    - JSON nested past Python's recursion limit."""
    why = too_many_containers(data, MAX_MANIFEST_CONTAINERS)
    if why:
        raise ValueError(why)
    try:
        return json.loads(
            data, object_pairs_hook=no_duplicates, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except RecursionError:
        raise ValueError("it is not valid JSON (it is nested too deep)") from None
    except ValueError as e:
        raise ValueError(f"it is not valid JSON ({from_file(str(e))})") from None


def too_many_containers(data: bytes | str, limit: int) -> str | None:
    """Why the JSON text `data` holds too many containers to parse, or `None`.
    Every `{` and `[` counts, in strings too: a bound taken without parsing."""
    brackets = (b"{", b"[") if isinstance(data, bytes) else ("{", "[")
    count = data.count(brackets[0]) + data.count(brackets[1])  # type: ignore[arg-type]
    if count > limit:
        return f"it holds more than the {limit} JSON containers (objects and arrays) allowed"
    if count > len(data) // MANIFEST_BYTES_PER_CONTAINER + 1000:
        return (
            f"it holds {count} JSON containers (objects and arrays) in {len(data)} bytes, more than one "
            f"in {MANIFEST_BYTES_PER_CONTAINER} bytes as any eqx_ckpt writes"
        )
    return None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return x


def _peek_path(item: Any) -> str:
    path = item.get("path") if isinstance(item, dict) else None
    return repr(path)[:200] if isinstance(path, str) else "no path"


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_RANK:
        raise ValueError(f"`{name}` must be a list of at most {MAX_RANK} integers")
    for n in value:
        if type(n) is not int or not 0 <= n < 2**62:
            raise ValueError(f"`{name}` must hold non-negative integers, got {value!r}")
    if math.prod(value) > MAX_ELEMENTS:
        raise ValueError(f"`{name}` {value} has more than 2**53 elements")
    return tuple(value)


def _parse_packs(items: Any, commit: str, bad: Any, *, compressed: bool = False) -> dict[str, PackRecord]:
    if not isinstance(items, list):
        raise bad("`packs` is not a list")
    packs: dict[str, PackRecord] = {}
    for i, item in enumerate(items):
        try:
            if not isinstance(item, dict):
                raise TypeError("not a JSON object")
            name, dtype = item["name"], item["dtype"]
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise TypeError("`name` and `dtype` must be strings")
            if not is_known_dtype(dtype) or name != pack_name(dtype):
                raise ValueError(f"a pack of dtype {dtype[:50]!r} cannot be named {name[:50]!r}")
            (size,), (chunk,) = _shape(item["shape"], "shape"), _shape(item["chunks"], "chunks")
            if not 1 <= chunk <= max(1, size):
                raise ValueError(f"`chunks` [{chunk}] do not fit the pack's shape [{size}]")
            compression = _compression(item, compressed)
        except (ValueError, TypeError, KeyError) as e:
            raise bad(f"pack #{i}: {e}") from None
        if name in packs:
            raise bad(f"pack {name!r} is listed twice")
        packs[name] = PackRecord(name, dtype, size, chunk, commit, compression)
    return packs


def _compression(item: dict[str, Any], compressed: bool) -> str:
    """The `compression` of a leaf's or a pack's record: one of `COMPRESSIONS`
    from version 6 on (`compressed`), else none."""
    compression = item.get("compression", "")
    if compression != "" and (not compressed or compression not in COMPRESSIONS):
        allowed = f"one of {', '.join(COMPRESSIONS)}" if compressed else "none before format version 6"
        raise ValueError(f"unknown compression {str(compression)[:50]!r} ({allowed})")
    return compression


def _parse_leaf(
    item: Any, packs: dict[str, PackRecord], *, lean: bool, checked: dict[Any, Any], compressed: bool = False
) -> LeafRecord:
    """One leaf record, every field checked; written for speed (one a leaf).
    `lean`: version 4 on, fields equal to their defaults left out; `compressed`:
    version 6 on, `compression` allowed; `checked`: see `stored_dotted`."""
    if type(item) is not dict:
        raise TypeError("not a JSON object")
    path = item["path"]
    if type(path) is not str:
        raise TypeError("`path` is not a string")
    expected = _keypath.stored_dotted(item["keypath"], checked)
    if path != expected:
        raise ValueError(f"`path` {path[:200]!r} does not match its key path (expected {expected[:200]!r})")
    kind, dtype = item["type"], item["dtype"]
    stored_dtype: Any
    if lean:
        stored_dtype, encoding, impl = (
            item.get("stored_dtype", dtype),
            item.get("encoding", "plain"),
            item.get("impl", ""),
        )
    else:
        stored_dtype, encoding, impl = item["stored_dtype"], item["encoding"], item["impl"]
    if not all(type(v) is str for v in (kind, dtype, stored_dtype, encoding, impl)):
        raise TypeError("`type`, `dtype`, `stored_dtype`, `encoding` and `impl` must be strings")
    if kind not in LEAF_TYPES:
        raise ValueError(f"unknown leaf type {kind!r}")
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}")
    if not is_known_dtype(stored_dtype):
        raise ValueError(f"unknown stored dtype {stored_dtype!r}")
    if kind != "prng_key" and not is_known_dtype(dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    shape, stored_shape, chunks, pack, offset = _parse_layout(item, packs, kind, encoding, stored_dtype, impl, lean)
    compression = _compression(item, compressed) if "compression" in item else ""
    if compression and pack is not None:
        raise ValueError("a packed leaf's chunks are its pack's: it names no `compression` of its own")
    return LeafRecord(
        path,
        item["keypath"],
        kind,
        shape,
        dtype,
        stored_shape,
        stored_dtype,
        encoding,
        chunks,
        impl,
        pack,
        offset,
        compression,
    )


def _parse_layout(
    item: dict[str, Any],
    packs: dict[str, PackRecord],
    kind: str,
    encoding: str,
    stored_dtype: str,
    impl: str,
    lean: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], PackRecord | None, int]:
    """A leaf record's shape, stored shape, chunks, pack and offset in it, checked
    against each other."""
    shape = _shape(item["shape"], "shape")
    stored_shape = _shape(item["stored_shape"], "stored_shape") if "stored_shape" in item or not lean else shape
    if "chunks" in item or not lean:
        chunks = _shape(item["chunks"], "chunks")
    else:
        chunks = whole_chunks(stored_shape)
    if len(chunks) != len(stored_shape) or 0 in chunks:
        raise ValueError("`chunks` must give a positive size for every stored dimension")
    # What eqx_ckpt writes always agrees with itself; a hostile manifest that
    # does not could otherwise make a load read (and allocate) far more than `like`
    # asks for, or a chunk far larger than the array.
    if kind in SCALAR_TYPES and shape != ():
        raise ValueError(f"a {kind} scalar must have shape [], not {list(shape)}")
    if encoding == "key_data" and (len(stored_shape) != len(shape) + 1 or stored_shape[: len(shape)] != shape):
        raise ValueError(f"`stored_shape` {list(stored_shape)} does not extend `shape` {list(shape)} by the key data")
    if encoding != "key_data" and stored_shape != shape:
        raise ValueError(f"`stored_shape` {list(stored_shape)} differs from `shape` {list(shape)}")
    if any(c > max(1, n) for c, n in zip(chunks, stored_shape)):
        raise ValueError(f"`chunks` {list(chunks)} are larger than the array {list(stored_shape)}")
    if kind == "prng_key":
        _check_key_data(impl, shape, stored_shape, stored_dtype)
    elif impl:
        raise ValueError(f"a {kind} leaf has no PRNG implementation (`impl` {impl[:50]!r})")
    pack, offset = None, 0
    if "pack" in item:
        pack, offset = packs.get(item["pack"]), item["offset"]
        if pack is None:
            raise ValueError(f"its pack {str(item['pack'])[:50]!r} is not among the manifest's `packs`")
        if pack.dtype != stored_dtype:
            raise ValueError(f"it is stored as {stored_dtype}, but its pack holds {pack.dtype}")
        if type(offset) is not int or not 0 <= offset <= pack.size - math.prod(stored_shape):
            raise ValueError(f"`offset` {offset!r} does not place it inside its pack of {pack.size} elements")
        if chunks != whole_chunks(stored_shape):
            raise ValueError("a packed leaf is one chunk: `chunks` must equal its shape")
    return shape, stored_shape, chunks, pack, offset


def _check_key_data(impl: str, shape: tuple[int, ...], stored: tuple[int, ...], stored_dtype: str) -> None:
    """A PRNG key leaf names an implementation JAX has, and its stored key data
    has that implementation's shape and dtype."""
    key_shape = key_data_shape(impl) if len(impl) <= 100 else None
    if key_shape is None:
        raise ValueError(f"unknown PRNG implementation {impl[:100]!r}")
    if stored != shape + key_shape or stored_dtype != "uint32":
        raise ValueError(
            f"the key data of {impl!r} keys of shape {list(shape)} is uint32 of shape "
            f"{list(shape + key_shape)}, not {stored_dtype} of shape {list(stored)}"
        )


def _check_paths(records: list[LeafRecord], bad: Any) -> None:
    seen: set[str] = set()
    for record in records:
        if record.path in seen:
            raise bad(f"leaf {record.path!r} is listed twice")
        seen.add(record.path)
    if "" in seen and len(seen) > 1:
        raise bad("a root leaf cannot sit beside other leaves")
    # A leaf cannot have children: one path being a prefix of another would make
    # one array's directory hold another array. Every ancestor of every leaf is
    # looked up (sorted neighbours are not enough: `a`, `a-x`, `a.c` sort so).
    for path in seen:
        parts = _keypath.split_dotted(path)
        for i in range(1, len(parts)):
            ancestor = ".".join(parts[:i])
            if ancestor in seen:
                raise bad(f"leaf {path!r} lies inside leaf {ancestor!r}")
