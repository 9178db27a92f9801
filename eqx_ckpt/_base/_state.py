"""Every registry and memo eqx_ckpt keeps for the life of the process.

Each is made here, named and bounded, so that none grows without limit and
`reset` empties them all. `table(name, bound, evict)` is a dict whose `put`
first makes room: `"clear"` forgets every entry, `"oldest"` the oldest one,
`"lru"` the least recently used (read by `recent`), and `"refuse"` raises (one
entry too many is a bug). A `"live"` table has no bound: each entry leaves when
what it names ends (`weak_table` holds its values weakly). `memo(bound)` is
`functools.lru_cache`.

Each `lock` guards what is read and written together. A forked child renews
every lock (a vanished thread may hold one) and empties the tables made with
`fork="empty"` (the parent's threads, pools, saves and leases).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeVar

Evict = Literal["clear", "oldest", "lru", "refuse", "live"]
Fork = Literal["keep", "empty"]
_K = TypeVar("_K")
_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])


class Table(dict[_K, _V]):
    """A registry or memo of the process (see the module docstring)."""

    def __init__(self, name: str, bound: int | None, evict: Evict, fork: Fork):
        super().__init__()
        self.name, self.bound, self.evict, self.fork, self.lock = name, bound, evict, fork, threading.RLock()

    def put(self, key: _K, value: _V) -> _V:
        """`self[key] = value`, the most recently used, once there is room for it; returns `value`."""
        with self.lock:
            if self.evict == "lru":
                self.pop(key, None)
            if self.bound is not None and key not in self and len(self) >= self.bound:
                if self.evict == "refuse":
                    raise RuntimeError(f"eqx_ckpt's {self.name!r} is full ({self.bound}): a bug, please report it.")
                if self.evict == "clear":
                    self.clear()
                else:
                    del self[next(iter(self))]
            self[key] = value
        return value

    def recent(self, key: _K) -> _V | None:
        """`self.get(key)`, now the most recently used."""
        with self.lock:
            value = self.pop(key, None)
            return value if value is None else self.put(key, value)


class WeakTable(weakref.WeakValueDictionary[_K, _V]):
    """A live table whose values are held weakly."""

    def __init__(self, name: str, fork: Fork):
        super().__init__()
        self.name, self.bound, self.evict, self.fork, self.lock = name, None, "live", fork, threading.RLock()


_TABLES: list[Table[Any, Any] | WeakTable[Any, Any]] = []
_MEMOS: list[Any] = []


def table(name: str, bound: int | None, evict: Evict, *, fork: Fork = "keep") -> Table[Any, Any]:
    """A new table of the process: `bound` is `None` where `evict` is `"live"`, and only there."""
    made: Table[Any, Any] = Table(name, bound, evict, fork)
    if (bound is None) != (evict == "live") or name in {t.name for t in _TABLES}:
        raise ValueError(f"The table {name!r} needs a name of its own, and a bound unless it is live.")
    _TABLES.append(made)
    return made


def weak_table(name: str, *, fork: Fork = "keep") -> WeakTable[Any, Any]:
    """A new live table of the process, holding its values weakly."""
    made: WeakTable[Any, Any] = WeakTable(name, fork)
    _TABLES.append(made)
    return made


def memo(bound: int) -> Callable[[_F], _F]:
    """`functools.lru_cache(maxsize=bound)`, emptied by `reset` too."""

    def made(fn: _F) -> _F:
        _MEMOS.append(functools.lru_cache(maxsize=bound)(fn))
        return _MEMOS[-1]  # (an `lru_cache`, called as `fn` is)

    return made


def reset(*names: str) -> None:
    """Empty the tables named; with no name, every table and memo."""
    unknown = set(names) - {t.name for t in _TABLES}
    if unknown:
        raise ValueError(f"No table is named {sorted(unknown)}; the tables are {sorted(t.name for t in _TABLES)}.")
    for made in _TABLES:
        if not names or made.name in names:
            with made.lock:
                made.clear()
    for cached in _MEMOS if not names else ():
        cached.cache_clear()


def _forked() -> None:
    for made in _TABLES:
        made.lock = threading.RLock()
        if made.fork == "empty":
            made.clear()


os.register_at_fork(after_in_child=_forked)
