"""Iterator states: a data pipeline's position saved with the tree.

A leaf with callable `get_state()` and `set_state(state)` (Grain's dataset and
`DataLoader` iterators, or any object of that shape) is an iterator. A save
records its state, as the iterator gives it (a JSON value, or bytes), in the
manifest's `iterators`: one state per JAX process, each with the sha256 of its
bytes. Nothing is pickled. A load checks the state as untrusted data (size,
type, digest) before the iterator's `set_state` sees it. docs/format.md,
"Iterator states", has the record.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from .._base import _keypath
from .._base._errors import IntegrityError, LeafError, from_file, leaf_message
from ._format import MAX_ITERATOR_STATE_BYTES

_Leaf = TypeVar("_Leaf", bound=LeafError)

KINDS = ("json", "bytes")
# JSON values nest at most this deep: a position is a few small dicts.
_DEPTH = 32
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def is_iterator(x: Any) -> bool:
    """Whether a leaf is an iterator whose state a save records: its class has
    callable `get_state` and `set_state`."""
    return _iterator_class(type(x))


def _iterator_class(cls: type) -> bool:
    return callable(getattr(cls, "get_state", None)) and callable(getattr(cls, "set_state", None))


def found(leaves: list[Any]) -> list[int]:
    """The indices of the iterators among `leaves` (a tree of arrays costs one look per type)."""
    kinds = {cls for cls in set(map(type, leaves)) if _iterator_class(cls)}
    return [i for i, x in enumerate(leaves) if type(x) in kinds] if kinds else []


@dataclasses.dataclass(frozen=True)
class State:
    """One process's state of an iterator as stored: its `kind` (`KINDS`), its
    `data` (the JSON text, or the bytes in base64) and the sha256 of its bytes."""

    kind: str
    data: str
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "data": self.data, "digest": self.digest}


@dataclasses.dataclass(frozen=True)
class IteratorRecord:
    """An iterator leaf: its dotted `path`, its `keypath` record, and its
    `states`, by JAX process index."""

    path: str
    keypath: list[list[Any]]
    states: tuple[State, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of the largest state (what one process puts back)."""
        return max((_size(s) for s in self.states), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "keypath": self.keypath, "states": [s.to_json() for s in self.states]}


def describe(record: IteratorRecord) -> str:
    """An iterator leaf as `eqx-ckpt ls` and `diff` show it: the kind of its
    states and how many processes saved one, `iterator (json, 1 process)`."""
    kinds = "/".join(kind for kind in KINDS if any(s.kind == kind for s in record.states))
    count = len(record.states)
    return f"iterator ({kinds}, {count} {'process' if count == 1 else 'processes'})"


def _size(state: State) -> int:
    if state.kind == "bytes":
        return len(state.data) // 4 * 3 - state.data[-2:].count("=")
    return len(state.data.encode())


# -- Saving --------------------------------------------------------------------------------------


def capture(
    leaves: list[Any], keypaths: list[tuple[Any, ...]], dotted: list[str], *, checkpoint: str
) -> list[tuple[str, list[list[Any]], State]]:
    """This process's state of each iterator among `leaves` (named by
    `keypaths` and `dotted`), taken now: the caller's loop moves it on next.
    A state that is neither a JSON value nor bytes, or over
    `MAX_ITERATOR_STATE_BYTES`, is a `LeafError` naming the leaf."""
    out = []
    for x, keypath, path in zip(leaves, keypaths, dotted, strict=True):
        try:
            state = _stored(x.get_state())
        except (TypeError, ValueError) as e:
            message = leaf_message(
                f"its iterator state cannot be saved: {e}",
                keypath=keypath,
                dotted=path,
                path=checkpoint,
                fix="An iterator's `get_state()` must return a JSON value (dicts of strings, lists, numbers, "
                f"strings, booleans, None) or bytes, of at most {MAX_ITERATOR_STATE_BYTES} bytes. Nothing was "
                f"saved.",
            )
            raise LeafError(message, path=checkpoint, keypaths=[keypath], dotted=[path]) from None
        out.append((path, _keypath.to_json(keypath), state))
    return out


def _stored(value: Any) -> State:
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        kind, data = "bytes", base64.b64encode(raw).decode()
    else:
        _check_json(value, 0)
        data = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
        kind, raw = "json", data.encode()
    if len(raw) > MAX_ITERATOR_STATE_BYTES:
        raise ValueError(f"it is {len(raw)} bytes, more than the {MAX_ITERATOR_STATE_BYTES} allowed")
    return State(kind, data, "sha256:" + hashlib.sha256(raw).hexdigest())


def _check_json(value: Any, depth: int) -> None:
    """Refuse what JSON would not give back as it is (a tuple comes back a list)."""
    if depth > _DEPTH:
        raise ValueError(f"it is nested more than {_DEPTH} deep")
    if value is None or type(value) in (bool, int, str):
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"it holds {value!r}, which JSON has no number for")
        return
    if type(value) is list:
        for item in value:
            _check_json(item, depth + 1)
        return
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"it is a dict with a key of type {type(key).__name__} ({key!r}), not str")
            _check_json(item, depth + 1)
        return
    raise TypeError(f"it holds a {type(value).__module__}.{type(value).__qualname__}, which is neither JSON nor bytes")


# -- Reading the manifest ------------------------------------------------------------------------


def parse(items: Any, checked: dict[Any, Any]) -> tuple[IteratorRecord, ...]:
    """The manifest's `iterators`, every field's type and size checked (the
    digests are checked where a state is used: `state_of`). Raises `ValueError`
    saying what is wrong."""
    if type(items) is not list:
        raise ValueError("`iterators` is not a list")
    records = []
    for i, item in enumerate(items):
        try:
            records.append(_parse_one(item, checked))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"iterator #{i}: {e}") from None
    return tuple(records)


def _parse_one(item: Any, checked: dict[Any, Any]) -> IteratorRecord:
    if type(item) is not dict or set(item) != {"path", "keypath", "states"}:
        raise TypeError("not a JSON object of `path`, `keypath` and `states`")
    path = item["path"]
    if type(path) is not str or path != _keypath.stored_dotted(item["keypath"], checked):
        raise ValueError(f"`path` {from_file(path)} does not match its key path")
    states = item["states"]
    if type(states) is not list or not states:
        raise TypeError("`states` is not a non-empty list")
    most = 4 * (MAX_ITERATOR_STATE_BYTES // 3 + 1)  # base64 of the largest state
    for state in states:
        if type(state) is not dict or set(state) != {"kind", "data", "digest"}:
            raise TypeError("a state is not a JSON object of `kind`, `data` and `digest`")
        if state["kind"] not in KINDS or type(state["data"]) is not str or len(state["data"]) > most:
            raise ValueError(f"a state is not one of {KINDS} of at most {MAX_ITERATOR_STATE_BYTES} bytes")
        if type(state["digest"]) is not str or not _DIGEST.fullmatch(state["digest"]):
            raise ValueError("a state's digest is not `sha256:` and 64 hex digits")
    return IteratorRecord(path, item["keypath"], tuple(State(s["kind"], s["data"], s["digest"]) for s in states))


# -- Loading -------------------------------------------------------------------------------------


def state_of(
    record: IteratorRecord, process: int, processes: int, *, checkpoint: str, loads: Callable[[bytes], Any]
) -> Any:
    """Process `process`'s state of `record` (of a job of `processes`),
    checked: as many states as processes, within the size bound, of its kind,
    its digest matching. A damaged state is an `IntegrityError` naming the leaf."""
    count = len(record.states)
    if count != processes:
        raise _error(
            LeafError,
            record.path,
            checkpoint,
            f"its iterator states were saved by {count} JAX process(es), but {processes} are loading it.",
            "Restore with as many processes as saved it, or load with a `like` holding no iterator there "
            "(a fresh iterator starts the data from the beginning).",
        )
    return check_state(record.states[process], record.path, checkpoint=checkpoint, loads=loads)


def check_state(state: State, path: str, *, checkpoint: str, loads: Callable[[bytes], Any]) -> Any:
    """The value of one stored state, checked (see `state_of`); JSON parsed by
    `loads` (`_manifest.loads_file`, the one parser of JSON from files)."""
    try:
        raw = base64.b64decode(state.data, validate=True) if state.kind == "bytes" else state.data.encode()
    except (binascii.Error, ValueError):
        raise _damaged(path, checkpoint, "its bytes are not base64") from None
    if len(raw) > MAX_ITERATOR_STATE_BYTES:
        raise _damaged(path, checkpoint, f"it is {len(raw)} bytes, more than {MAX_ITERATOR_STATE_BYTES}")
    if "sha256:" + hashlib.sha256(raw).hexdigest() != state.digest:
        raise _damaged(path, checkpoint, "its bytes do not match their digest")
    if state.kind == "bytes":
        return raw
    try:
        return loads(raw)
    except ValueError as e:
        raise _damaged(path, checkpoint, str(e)) from None


def put(iterator: Any, value: Any, path: str, keypath: tuple[Any, ...], *, checkpoint: str) -> None:
    """Put a checked state into the iterator of `like`; its refusal is a `LeafError` with its own message."""
    try:
        iterator.set_state(value)
    except Exception as e:
        message = leaf_message(
            f"its iterator refused the saved state: {type(e).__name__}: {e}",
            keypath=keypath,
            dotted=path,
            path=checkpoint,
            fix="Load into the iterator of the same data pipeline that saved it.",
        )
        raise LeafError(message, path=checkpoint, keypaths=[keypath], dotted=[path]) from e


def _damaged(path: str, checkpoint: str, why: str) -> IntegrityError:
    return _error(
        IntegrityError,
        path,
        checkpoint,
        f"its iterator state is damaged: {why}.",
        "Nothing was loaded. Restore an earlier step, or start the data afresh: load with no iterator there.",
    )


def _error(cls: type[_Leaf], path: str, checkpoint: str, what: str, fix: str) -> _Leaf:
    message = leaf_message(what, keypath=None, dotted=path, path=checkpoint, fix=fix)
    return cls(message, path=checkpoint, dotted=[path])


# -- Several processes ---------------------------------------------------------------------------

Captured = list[tuple[str, list[list[Any]], State]]


def to_text(captured: Captured) -> str:
    """This process's states, as another process of the save reads them (`records`)."""
    return json.dumps([[path, keypath, state.to_json()] for path, keypath, state in captured])


def records(
    texts: dict[int, str], processes: int, kept: tuple[IteratorRecord, ...] = (), *, loads: Callable[[str], Any]
) -> list[IteratorRecord]:
    """The manifest's iterator records: each iterator's state from every
    process (`texts`, by index, from `to_text`), and the `kept` records of a
    partial save, sorted by path. Processes that saved different iterators
    are an error naming them."""
    by_process = [[(p, k, State(**s)) for p, k, s in loads(texts[i])] for i in range(processes)]
    first = [(path, keypath) for path, keypath, _ in by_process[0]]
    others = [i for i in range(1, processes) if [(p, k) for p, k, _ in by_process[i]] != first]
    if others:
        raise LeafError(
            f"The processes did not save the same iterators: process(es) {others} hold iterators at other paths "
            f"than process 0's ({', '.join(p for p, _ in first) or 'none'}), so nothing was written. Every "
            f"process must save the same tree."
        )
    made = [
        IteratorRecord(path, keypath, tuple(states[n][2] for states in by_process))
        for n, (path, keypath) in enumerate(first)
    ]
    return sorted([*kept, *made], key=lambda r: _keypath.sort_key(r.path))
