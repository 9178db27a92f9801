"""A save's host memory: every piece's host data made as the writes reach
it, within one budget of staged bytes.

A save plans every record up front (the manifest, and the plan several
processes compare, need them all), but a piece of a leaf (its data, a shard,
a slice of it, cast or encoded as stored) is kept as what it comes from: a
`jax.Array`, a NumPy array, or a `Deferred` (a cast, a device-side slice, a
PRNG key's data). `Window` takes a save's writes in order: each is admitted
while the bytes staged and not yet written stay within the budget (a write
larger than the budget is admitted alone, once nothing else is staged), its
arrays' copies to the host started at once (`ahead`), so that they overlap
the writes before it; it is staged (`host`) and written, and its bytes are
released when its write has finished.

Every piece admitted counts at its stored size, whether staging copies it or
not (on a CPU a `jax.Array`'s host data is a view of its buffer, and a NumPy
leaf is the caller's own array): the budget bounds what the save may hold,
not what it happened to copy. The fault point `save.staged` reports the bytes
staged each time they change.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from . import _faults, _memory
from ._errors import CheckpointTypeError, CheckpointValueError

# The default staging budget, as a fraction of this machine's physical memory
# (`staging_bytes=None`), and its floor: a machine whose memory cannot be
# read gets the floor.
STAGING_FRACTION = 0.25
STAGING_MIN_BYTES = 64 << 20


def budget(staging_bytes: Any) -> int:
    """The staging budget of a save, in bytes: `staging_bytes` checked, or by
    default `STAGING_FRACTION` of physical memory (at least `STAGING_MIN_BYTES`)."""
    if staging_bytes is None:
        memory = _memory.physical_memory()
        return max(STAGING_MIN_BYTES, int((memory or 0) * STAGING_FRACTION))
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, (int, np.integer)):
        raise CheckpointTypeError(
            f"`staging_bytes` must be a positive int (the host bytes a save stages at a time) or `None` "
            f"(a {STAGING_FRACTION:g} of this machine's memory); not {staging_bytes!r}."
        )
    if staging_bytes <= 0:
        raise CheckpointValueError(
            f"`staging_bytes` must be a positive int (the host bytes a save stages at a time); not {staging_bytes}."
        )
    return int(staging_bytes)


class Deferred:
    """A host piece made when the save stages it: `source` (a `jax.Array` or
    a NumPy array, or a function making it, such as a device-side slice)
    through `convert` (a cast, an encoding), `nbytes` bytes as stored."""

    __slots__ = ("__weakref__", "convert", "nbytes", "source")

    def __init__(self, source: Any, nbytes: int, convert: Callable[[np.ndarray], np.ndarray] | None = None):
        self.source, self.nbytes, self.convert = source, nbytes, convert

    def resolved(self) -> Any:
        """The source, made (once) where it is a function."""
        self.source = self._made()
        return self.source

    def make(self) -> np.ndarray:
        """The host data, made now; nothing of it is kept here."""
        out = host(self._made())
        return out if self.convert is None else self.convert(out)

    def _made(self) -> Any:
        source = self.source
        if callable(source) and not isinstance(source, (jax.Array, np.ndarray)):
            return source()
        return source


def nbytes(data: Any) -> int:
    """The stored bytes of a piece (as its record counts them)."""
    return int(data.nbytes)


def ahead(data: Any) -> Any:
    """Start copying a piece's device data to the host, without waiting; what
    to stage it from then (`host`).

    The copy is a new array on the host's CPU device (`jax.device_put`, which
    returns at once), which the save owns and drops once written: the array's
    own `copy_to_host_async` would cache the host copy on the caller's
    `jax.Array`, held for as long as the caller holds the array, beyond any
    budget. Without a CPU device, it is `copy_to_host_async` after all."""
    if isinstance(data, Deferred):
        data.source = ahead(data.resolved())
        return data
    if isinstance(data, jax.Array) and not _on_cpu(data):
        cpu = _cpu_device()
        if cpu is None:
            data.copy_to_host_async()
        else:
            return jax.device_put(data, cpu)
    return data


def host(data: Any) -> np.ndarray:
    """A piece's host data, as stored (waits for its copy to the host, which
    `ahead` started, or makes it now; never cached on the caller's array)."""
    if isinstance(data, Deferred):
        return data.make()
    if isinstance(data, jax.Array) and not _on_cpu(data):
        cpu = _cpu_device()
        if cpu is not None:
            data = jax.device_put(data, cpu)
    return np.asarray(data)


def host_views(arrays: list[jax.Array]) -> list[np.ndarray]:
    """The host data of `jax.Array`s on one device each, as `host` makes it:
    views on a CPU; elsewhere copies the save owns, all started at once (one
    `jax.device_put`), never cached on the caller's arrays."""
    if _only_cpus():
        return list(map(np.asarray, arrays))
    cpu = _cpu_device()
    if cpu is None:
        return [host(x) for x in arrays]
    return list(map(np.asarray, jax.device_put(arrays, cpu)))


def protected(data: Any, copy: bool) -> Any:
    """A piece that a change of the caller's arrays after an asynchronous save
    returned cannot reach: a `jax.Array`'s host data (which never changes, and
    outlives a deletion or donation of the array), and with `copy` (a NumPy
    leaf's), a private copy of the host data. A cast or encoding stays
    deferred: what it starts from is what is protected."""
    if isinstance(data, Deferred):
        source = data.resolved()
        return Deferred(protected(source, copy), data.nbytes, data.convert)
    if isinstance(data, jax.Array):
        return host(data)
    return _memory.private_copy(data) if copy else data


@functools.cache
def _cpu_device() -> Any:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


@functools.cache
def _only_cpus() -> bool:
    return jax.default_backend() == "cpu"


def _on_cpu(x: jax.Array) -> bool:
    """Whether `x`'s host data is a view of its buffer (no copy to start)."""
    return _only_cpus() or next(iter(x.devices())).platform == "cpu"


class Window:
    """The admission of a save's writes within `budget` staged bytes, in order
    (see the module docstring). `units`: objects with `nbytes` (what staging
    them holds) and `datas` (their pieces, whose copies to the host `admit`
    starts)."""

    def __init__(self, units: Iterable[Any], budget: int):
        self._todo: collections.deque[Any] = collections.deque(units)
        self.budget = budget
        self.staged = 0

    def admit(self) -> list[Any]:
        """The next units that fit, counted as staged, their copies to the host begun."""
        out = []
        todo = self._todo
        while todo and (self.staged == 0 or self.staged + todo[0].nbytes <= self.budget):
            unit = todo.popleft()
            self._change(unit.nbytes)
            out.append(unit)
        if not _only_cpus():  # (on a CPU, host data is a view: nothing to start)
            for unit in out:
                unit.datas = [ahead(data) for data in unit.datas]
        return out

    def release(self, unit: Any) -> None:
        """`unit` was written: its bytes are no longer staged."""
        self._change(-unit.nbytes)

    def _change(self, nbytes: int) -> None:
        if nbytes:
            self.staged += nbytes
            _faults.fire("save.staged", self.staged, self.budget)

    @property
    def waiting(self) -> bool:
        """Whether some units are still to be admitted."""
        return bool(self._todo)

    def drop(self) -> None:
        """Admit nothing more (the save has failed)."""
        self._todo.clear()
