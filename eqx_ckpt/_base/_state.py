"""Every registry and memo eqx_ckpt keeps for the life of the process.

Each is made here, with a name, a bound and what happens once it is full, so
that none grows without limit and one call empties them all (`reset`):

- `table(name, bound, evict)`: a dict of the process (a `WeakValueDictionary`
  with `weak=True`). A bounded table is written by `put`, which first makes
  room as `evict` says: `"clear"` forgets every entry (a memo cheap to fill
  again), `"oldest"` the oldest one, `"lru"` the least recently used (read by
  `recent`), and `"refuse"` raises: its entries are made once per name the
  code gives (the pools), so one more is a bug. A table of what is running
  (`"live"`, no bound) loses each entry when that ends: a thread, a save, a
  lease, a lazy leaf.
- `memo(bound)`: `functools.lru_cache` of a pure function of immutable
  arguments.

One read or write of a table is atomic (the GIL); its `lock` guards what must
be read and written together. A forked child has only the thread that forked:
it renews every lock (one that a vanished thread held would never be
released) and empties the tables made with `fork="empty"`, which hold the
parent's threads, pools, saves and leases, not its own.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeVar

Evict = Literal["clear", "oldest", "lru", "refuse", "live"]
_K = TypeVar("_K")
_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T", bound="Table[Any, Any] | WeakTable[Any, Any]")


class Table(dict[_K, _V]):
    """A registry or memo of the process (see the module docstring)."""

    def __init__(self, name: str, bound: int | None, evict: Evict, fork: Literal["keep", "empty"]):
        super().__init__()
        self.name, self.bound, self.evict, self.fork = name, bound, evict, fork
        self.lock = threading.RLock()

    def put(self, key: _K, value: _V) -> _V:
        """`self[key] = value` (the most recently used), once there is room for it; returns `value`."""
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
        """`self.get(key)`, made the most recently used."""
        with self.lock:
            value = self.pop(key, None)
            if value is not None:
                self[key] = value
            return value


class WeakTable(weakref.WeakValueDictionary[_K, _V]):
    """A table of what is running, each entry gone once nothing else holds its value."""

    def __init__(self, name: str, fork: Literal["keep", "empty"]):
        super().__init__()
        self.name, self.bound, self.evict, self.fork = name, None, "live", fork
        self.lock = threading.RLock()


_TABLES: list[Table[Any, Any] | WeakTable[Any, Any]] = []
_MEMOS: list[Any] = []


def table(name: str, bound: int | None, evict: Evict, *, fork: Literal["keep", "empty"] = "keep") -> Table[Any, Any]:
    """A new table of the process; `bound` is `None` exactly where `evict` is `"live"`."""
    if (bound is None) != (evict == "live"):
        raise ValueError(f"The table {name!r} needs a bound unless it is live, and only then.")
    return _known(Table(name, bound, evict, fork))


def weak_table(name: str, *, fork: Literal["keep", "empty"] = "keep") -> WeakTable[Any, Any]:
    """A new live table of the process whose values are held weakly."""
    return _known(WeakTable(name, fork))


def _known(made: _T) -> _T:
    if made.name in {t.name for t in _TABLES}:
        raise ValueError(f"Two tables are named {made.name!r}.")
    _TABLES.append(made)
    return made


def memo(bound: int) -> Callable[[_F], _F]:
    """`functools.lru_cache(maxsize=bound)`, emptied by `reset` too."""

    def made(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=bound)(fn)
        _MEMOS.append(cached)
        return cached  # type: ignore[return-value]  # (called as `fn` is)

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
