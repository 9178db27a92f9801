"""Key paths <-> the names leaves have on disk and in dotted paths.

One escaping function makes a path segment out of one JAX key. Escaped segments
only ever contain `[A-Za-z0-9_-]` and `%`, so they never contain `.` or `/`: a
dotted path is the segments joined by `.`, a directory the segments joined by
`/`, and both are injective. Names containing a `.` (`manifest.json`,
`gen.2`) are therefore free for the checkpoint's own files.
"""

from __future__ import annotations

import hashlib
import re
import types
from typing import Any

import jax.tree_util as jtu
import numpy as np

from . import _state

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_SEGMENT = re.compile(
    r"^(%e|%i-?[0-9]+|%r(?:[A-Za-z0-9_-]|%[0-9A-F]{2})*(?:%h[0-9a-f]{32})?"
    r"|(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+(?:%h[0-9a-f]{32})?)$"
)
# Longer escaped segments are shortened (a file name may have 255 bytes): their
# first characters, then `%h` and a digest of the whole segment. Escaping never
# writes `%h`, so a shortened name can only equal another shortened one, of a key
# with the same digest.
MAX_SEGMENT = 200
_KEPT = 160


def escape(text: str) -> str:
    """Percent-encode every UTF-8 byte of `text` outside `[A-Za-z0-9_-]`.

    The empty string becomes `%e` (lower case, so it never reads as a byte).
    """
    if text == "":
        return "%e"
    if _ALL_SAFE.fullmatch(text):  # most keys: one match, not one per character
        return text
    out = []
    for char in text:
        if _SAFE.fullmatch(char):
            out.append(char)
        else:
            out.extend(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
    return "".join(out)


def segment(key: Any) -> str:
    """The escaped path segment of one key, made from its manifest record so
    that a reader recomputing it (`stored_segment`) can never disagree."""
    return stored_segment(*remembered_record(key))


def _memo_key(key: Any) -> tuple[type, Any, type] | None:
    """What identifies a common key exactly (its value's type too: `True` and
    `1` are equal dict keys with different segments); `None` for the others."""
    cls = type(key)
    if cls is jtu.GetAttrKey:
        value = key.name
    elif cls is jtu.SequenceKey:
        value = key.idx
    elif cls is jtu.DictKey:
        value = key.key
    else:
        return None
    kind = type(value)
    return (cls, value, kind) if kind is str or kind is int else None


def dotted(keypath: tuple[Any, ...]) -> str:
    """The dotted path of a key path: `model.layers.0.weight`."""
    return ".".join(segment(key) for key in keypath)


def split_dotted(path: str) -> tuple[str, ...]:
    """The segments of a dotted path ("" is the root)."""
    return tuple(path.split(".")) if path else ()


def join_dotted(*parts: str) -> str:
    return ".".join([part for part in parts if part])


def is_valid_dotted(path: str) -> bool:
    return all(_SEGMENT.match(part) for part in split_dotted(path))


def to_directory(path: str) -> str:
    """The directory, relative to the data root, of a dotted path."""
    return path.replace(".", "/")


def is_within(path: str, prefix: str) -> bool:
    """Whether dotted `path` is `prefix` or lies under it."""
    return not prefix or path == prefix or path.startswith(prefix + ".")


def relative(path: str, prefix: str) -> str:
    """`path` with the dotted `prefix` removed (it must lie under it)."""
    if not prefix:
        return path
    return "" if path == prefix else path[len(prefix) + 1 :]


def key_record(key: Any) -> tuple[str, Any]:
    """The manifest record of one key: `(kind, value)`."""
    if isinstance(key, jtu.SequenceKey):
        return "index", key.idx
    if isinstance(key, jtu.FlattenedIndexKey):
        return "flat", key.key
    if isinstance(key, jtu.GetAttrKey):
        return "attr", key.name
    if isinstance(key, jtu.DictKey) and isinstance(key.key, str):
        return "key", key.key
    if isinstance(key, jtu.DictKey) and (type(key.key) is int or isinstance(key.key, np.integer)):
        # `np.int64(3)` and `3` are one key to JAX (equal, same hash): one name here too.
        return "key_int", int(key.key)
    if isinstance(key, jtu.DictKey):
        return "key_repr", repr(key.key)
    return "other", str(key)


_NUMBER = re.compile(r"^(%i)?(-?[0-9]+)$")


def sort_key(path: str) -> tuple[tuple[int, Any, str], ...]:
    """Sort dotted paths segment by segment, numbers by value (`layers.2` before
    `layers.10`, `k2` before `k10`)."""
    return tuple(map(_segment_key, path.split("."))) if path else ()


@_state.memo(2**16)
def _segment_key(part: str) -> tuple[int, Any, str]:
    """One segment's `sort_key`, remembered: a tree's few names recur in thousands of paths."""
    match = _NUMBER.match(part)
    # Python refuses `int()` of more than 4,300 digits: a segment that long (a
    # hostile file's) sorts as a name.
    if match and len(match.group(2)) <= _LONGEST_NUMBER:
        return (0, int(match.group(2)), part)
    # A name's runs of digits compare by value, as (length without leading
    # zeros, digits): no `int()`, so a run of any length is fine.
    runs = _DIGITS.split(part)
    runs[1::2] = [(len(run.lstrip("0")), run.lstrip("0")) for run in runs[1::2]]
    return (1, tuple(runs), part)


_LONGEST_NUMBER = 4000
_DIGITS = re.compile(r"([0-9]+)")


def to_json(keypath: tuple[Any, ...]) -> list[list[Any]]:
    """A JSON record of the exact key path, for the manifest."""
    return [list(remembered_record(key)) for key in keypath]


def dotted_and_records(keypaths: list[tuple[Any, ...]]) -> tuple[list[str], list[list[list[Any]]]]:
    """The dotted path and manifest record (`to_json`) of every key path of one
    flattened tree. Leaves under one node share the key objects of their
    prefix, so each key object is named once (by identity: `keypaths` keeps
    them alive). The records returned share their keys' lists: never mutate."""
    seen: dict[int, tuple[str, list[Any]]] = {}
    dotted: list[str] = []
    records: list[list[list[Any]]] = []
    for keypath in keypaths:
        parts = []
        record = []
        for key in keypath:
            found = seen.get(id(key))
            if found is None:
                kind, value = remembered_record(key)
                found = seen[id(key)] = (stored_segment(kind, value), [kind, value])
            parts.append(found[0])
            record.append(found[1])
        dotted.append(".".join(parts))
        records.append(record)
    return dotted, records


def remembered_record(key: Any) -> tuple[str, Any]:
    """`key_record(key)`, remembered for the common keys, which recur in thousands of key paths."""
    memo = _memo_key(key)
    if memo is None:
        return key_record(key)
    found = _RECORDS.get(memo)
    return found if found is not None else _RECORDS.put(memo, key_record(key))


_RECORDS: _state.Table[tuple[type, Any, type], tuple[str, Any]] = _state.table("keypath.records", 2**16, "clear")


# Each kind of key record, and the key it rebuilds (`_ReprKey` for the others).
_KEYS = types.MappingProxyType(
    {
        "index": jtu.SequenceKey,
        "flat": jtu.FlattenedIndexKey,
        "attr": jtu.GetAttrKey,
        "key": jtu.DictKey,
        "key_int": jtu.DictKey,
    }
)
_KINDS = frozenset({*_KEYS, "key_repr", "other"})


def check_json(record: Any) -> None:
    """Raise `ValueError` unless `record` is a well-formed key path record."""
    if not isinstance(record, list):
        raise ValueError("a key path must be a list")
    for item in record:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"malformed key {item!r}")
        kind, value = item
        if kind in ("index", "flat", "key_int"):
            if type(value) is not int:
                raise ValueError(f"key {item!r} needs an integer")
        elif not isinstance(value, str):
            raise ValueError(f"key {item!r} needs a string")
        if kind not in _KINDS:
            raise ValueError(f"unknown key kind {kind!r}")


def stored_dotted(record: Any, checked: dict[tuple[Any, Any, type], str]) -> str:
    """The dotted path a manifest's key path record must come with; raises
    `ValueError` if it is malformed. `checked` remembers the segments of the
    keys checked, the value's type in its key (so `true` never passes for `1`)."""
    if type(record) is not list:
        raise ValueError("a key path must be a list")
    parts = []
    for item in record:
        segment = None
        if type(item) is list and len(item) == 2:
            try:
                segment = checked.get((item[0], item[1], type(item[1])))
            except TypeError:  # an unhashable value: malformed, said below
                pass
        if segment is None:
            check_json([item])
            kind, value = item
            segment = stored_segment(kind, value)
            if not _SEGMENT.match(segment):
                raise ValueError(f"key {item!r} gives the invalid segment {segment!r}")
            checked[(kind, value, type(value))] = segment
        parts.append(segment)
    return ".".join(parts)


def from_json(record: Any) -> tuple[Any, ...]:
    """Rebuild a key path from its manifest record; raises `ValueError` if malformed."""
    check_json(record)
    return tuple(_KEYS.get(kind, _ReprKey)(value) for kind, value in record)


class _ReprKey:
    """A stored key that cannot be rebuilt exactly (a non-str, non-int dict key)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"DictKey(key={self.text})"

    def __str__(self) -> str:
        return f"[{self.text}]"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ReprKey) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


@_state.memo(2**16)
def stored_segment(kind: str, value: Any) -> str:
    """The segment a manifest key record must have (readers recompute, never trust)."""
    if kind in ("index", "flat"):
        return str(value)
    if kind == "key_int":
        return f"%i{value}"
    if kind in ("key_repr", "other"):
        return _shortened("%r" + escape(value))
    return _shortened(escape(value))


def _shortened(text: str) -> str:
    if len(text) <= MAX_SEGMENT:
        return text
    cut = _KEPT
    # Never cut a `%XX` escape in two.
    while "%" in text[cut - 2 : cut]:
        cut -= 1
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return f"{text[:cut]}%h{digest}"
