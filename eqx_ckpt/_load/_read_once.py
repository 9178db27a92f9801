"""A restore in which several processes need the same bytes (replicated
parameters and optimiser state, in data-parallel training): each byte is read
from storage by one process, and reaches the others through JAX's collectives.

Which leaves: a stored leaf (not packed) loaded as a `jax.Array` one of
whose regions is held by at least `REPLICAS` processes (two with
`read_once=True`; never with `read_once=False`).

How (every process computes the same plan from its `like`, without
communication, and the processes compare a digest of it first):

1. Each shared region is cut into slices on the stored chunk grid
   (`_sharding.slices`), each dealt to one of its holders (`_sharding.Deal`).
2. The leaves are taken in batches within the read budget; each process
   reads its slices of the batch.
3. The processes meet at a barrier (`_multihost.Group`, at most `TIMEOUT`
   seconds): a reader that failed, died or is late is an error in every
   process before any collective starts, since a collective that one process
   never joins waits for ever.
4. One all-gather gives every process every slice of the batch; each
   assembles the regions its devices hold and places them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .._base import _faults
from .._base._errors import CheckpointError, CheckpointValueError
from .._base._location import Location
from .._base._progress import Tracker
from .._hosts import _multihost, _sharding
from .._ondisk import _dtypes
from .._ondisk._format import LeafRecord, dtype_from_name
from .._store import _storage, _storage_errors, _window
from . import _read
from ._load_plan import LeafPlan

# Reads are shared by default for leaves some region of which this many
# processes (or more) hold. Below it, reading in every process costs less
# than the barrier and the all-gather (orbax measured sharing slower at 2
# replicas); `read_once=True` shares from 2.
REPLICAS = 4

# How long the processes wait at a batch's barrier for the slowest reader
# (one that died is found sooner, by its heartbeat).
TIMEOUT = 300.0


# The all-gather's row lengths between two powers of two (see `_gather`).
_LENGTHS = 16
# Slices start at multiples of this in an all-gather's rows, so that each
# is an aligned array once gathered.
_ALIGN = 64


class _Part(NamedTuple):
    """A slice of a region of a leaf, read by process `owner`; `shared`: whether
    other processes hold the region too (else it stays with its one holder)."""

    region: _sharding.Region
    part: _sharding.Region
    owner: int
    nbytes: int
    shared: bool


class _Leaf(NamedTuple):
    slot: int  # the leaf's index among the load's
    record: LeafRecord
    like: Any
    sharding: Any
    parts: list[_Part]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def chosen(plans: list[LeafPlan], records: list[LeafRecord], read_once: bool | None) -> list[int]:
    """The indices of the leaves this load reads once and shares."""
    if read_once is False or jax.process_count() == 1:
        return []
    least = 2 if read_once else REPLICAS
    picked = [i for i, (plan, record) in enumerate(zip(plans, records)) if _replicas(plan, record) >= least]
    if picked:
        why = _no_collectives()
        if why is not None and read_once:
            raise CheckpointValueError(f"`read_once=True` cannot share reads: {why}")
        if why is not None:
            return []
    return picked


def _replicas(plan: LeafPlan, record: LeafRecord) -> int:
    """How many processes hold the most-held region of the leaf (0: not a leaf
    this reader takes)."""
    sharding = _read.target_sharding(plan.like)
    if record.pack is not None or _dtypes.like_type(plan.like) != "jax" or sharding is None:
        return 0
    if sharding.is_fully_addressable:
        return 0
    return max(len(holders) for _, holders in _sharding.regions_held(sharding, tuple(record.shape)))


def _no_collectives() -> str | None:
    """Why this JAX cannot run collectives across processes, or `None`."""
    if jax.devices()[0].platform != "cpu":
        return None
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) is not None:
        return None  # gloo by default since JAX 0.4.36, or MPI
    return (
        "JAX's CPU backend was set up without collectives across processes "
        "(`jax_cpu_collectives_implementation` is None). Leave it at its default, 'gloo', or call "
        "`jax.config.update('jax_cpu_collectives_implementation', 'gloo')` before "
        "`jax.distributed.initialize(...)`, in every process."
    )


def read(
    open_store: Callable[[LeafRecord], _storage.Array],
    loc: Location,
    plans: list[LeafPlan],
    records: list[LeafRecord],
    tracker: Tracker,
) -> list[Any]:
    """The values of `plans` (of `records`, every one `chosen`), each stored
    byte read by one process and gathered by every process that needs it."""
    group = _multihost.Group("restore", timeout=TIMEOUT)
    try:
        leaves = _plan(plans, records, loc)
    except Exception as e:  # the others would wait for this process at the barrier
        raise group.sync("planned", e) or e from None
    error = group.sync("planned", None, plan=_digest(leaves))
    if error is not None:
        raise error
    out: list[Any] = [None] * len(plans)
    batches = _batches(leaves)
    for number, batch in enumerate(batches):
        slices = _read_batch(open_store, loc, group, number, batch)
        try:
            for leaf in batch:
                out[leaf.slot] = _place(leaf, slices, loc, tracker)
        except Exception as e:
            if number + 1 < len(batches):  # the others wait for this process at the next batch's barrier
                group.sync(f"read/{number + 1}", e)
            raise
    return out


def _plan(plans: list[LeafPlan], records: list[LeafRecord], loc: Location) -> list[_Leaf]:
    """Every leaf's regions cut and dealt, the same in every process."""
    deal, leaves = _sharding.Deal(), []
    for slot, (plan, record) in enumerate(zip(plans, records)):
        _read.refuse_narrowing(loc, record, plan.like.dtype)
        sharding = _read.target_sharding(plan.like)
        itemsize = dtype_from_name(record.stored_dtype).itemsize
        parts = []
        for region, holders in _sharding.regions_held(sharding, tuple(record.shape)):
            cut = _sharding.slices(region, tuple(record.chunks), len(holders), itemsize)
            sizes = [math.prod(b - a for a, b in part) * itemsize for part in cut]
            for part, owner, size in zip(cut, deal.owners(holders, sizes), sizes):
                parts.append(_Part(region, part, owner, size, len(holders) > 1))
        leaves.append(_Leaf(slot, record, plan.like, sharding, parts))
    return leaves


def _digest(leaves: list[_Leaf]) -> str:
    """What every process must have planned alike: each leaf, its slices and their readers."""
    plan = [(leaf.record.path, leaf.record.stored_dtype, [tuple(p) for p in leaf.parts]) for leaf in leaves]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def _batches(leaves: list[_Leaf]) -> list[list[_Leaf]]:
    """The leaves in order, in batches within the read budget (a larger leaf
    alone): one barrier and one all-gather a batch, whose gathered bytes every
    process holds at once."""
    batches: list[list[_Leaf]] = []
    budget = _window.Budget(_window.READ_BUDGET)
    for leaf in leaves:
        if not batches or not budget.fits(leaf.nbytes, alone=False):
            batches.append([])
            budget = _window.Budget(_window.READ_BUDGET)
        batches[-1].append(leaf)
        budget.take(leaf.nbytes)
    return batches


def _read_batch(
    open_store: Callable[[LeafRecord], _storage.Array],
    loc: Location,
    group: _multihost.Group,
    number: int,
    batch: list[_Leaf],
) -> dict[tuple[int, int], np.ndarray]:
    """The bytes of each slice of `batch` this process needs, by (leaf, part
    index): its own read, then every process's shared ones gathered."""
    me = group.index
    error: BaseException | None
    mine: dict[tuple[int, int], np.ndarray] = {}
    try:
        error = _read_mine(open_store, loc, batch, me, mine)
    except Exception as e:  # an error this process cannot name a leaf for still reaches the others
        error = e
    error = group.sync(f"read/{number}", error)  # before the all-gather, which waits for ever for a missing process
    if error is not None:
        raise error
    # Where each shared slice sits in its reader's row of the all-gather:
    # the reader's slices in order, each at a multiple of `_ALIGN` bytes.
    layout, ends = [], [0] * group.count
    for leaf in batch:
        for k, part in enumerate(leaf.parts):
            if part.shared:
                layout.append((leaf.slot, k, part, ends[part.owner]))
                ends[part.owner] += -(-part.nbytes // _ALIGN) * _ALIGN
    rows = _gather({at: mine[slot, k] for slot, k, part, at in layout if part.owner == me}, max(ends))
    for slot, k, part, at in layout:
        mine[slot, k] = rows[part.owner][at : at + part.nbytes]
    return mine


def _read_mine(
    open_store: Callable[[LeafRecord], _storage.Array],
    loc: Location,
    batch: list[_Leaf],
    me: int,
    mine: dict[tuple[int, int], np.ndarray],
) -> BaseException | None:
    """Read this process's slices of `batch` into `mine`, every read started
    before any is waited for; the error of the first leaf whose read failed."""
    started = []
    for leaf in batch:
        taken = [(k, p) for k, p in enumerate(leaf.parts) if p.owner == me]
        if not taken:
            continue
        try:
            store = open_store(leaf.record)
            regions = [(k, p, tuple(slice(a, b) for a, b in p.part)) for k, p in taken]
            started.append((leaf, [(k, p, _read.start_region(store, loc, leaf.record, at)) for k, p, at in regions]))
        except Exception as e:
            return _storage_errors.leaf_io_error(e, leaf.record, loc, "open")
    for leaf, reads in started:
        try:
            for k, _, finish in reads:
                mine[leaf.slot, k] = np.ascontiguousarray(finish()).reshape(-1).view(np.uint8)
            _faults.fire("load.read_once", leaf.record.path, [p.part for _, p, _ in reads])
        except Exception as e:
            return e if isinstance(e, CheckpointError) else _storage_errors.leaf_io_error(e, leaf.record, loc, "read")
    return None


def _gather(mine: dict[int, np.ndarray], longest: int) -> Any:
    """Every process's shared slices by one all-gather: row `i` holds process
    `i`'s (`mine`: this process's, by offset). Rows are padded to `longest`
    rounded up to a multiple of the next power of two over `_LENGTHS`, so that
    batches of near sizes share one compiled all-gather."""
    from jax.experimental import multihost_utils

    step = max(1, (1 << longest.bit_length()) // _LENGTHS)
    buffer = np.zeros(-(-longest // step) * step, np.uint8)
    for at, data in mine.items():
        buffer[at : at + data.size] = data
    return multihost_utils.process_allgather(buffer)


def _place(leaf: _Leaf, slices: dict[tuple[int, int], np.ndarray], loc: Location, tracker: Tracker) -> Any:
    """The leaf's value: the regions this process's devices hold, assembled
    from their slices, placed with `like`'s sharding."""
    shape = tuple(leaf.record.shape)
    dtype = dtype_from_name(leaf.record.stored_dtype)
    held_here = leaf.sharding.addressable_devices_indices_map(shape).values()
    needed = {_sharding.region_key(index, shape) for index in held_here}
    regions: dict[_sharding.Region, np.ndarray] = {}
    for k, part in enumerate(leaf.parts):
        if part.region not in needed:
            continue
        data = slices[leaf.slot, k].view(dtype).reshape([b - a for a, b in part.part])
        if part.part == part.region:
            regions[part.region] = data
            continue
        into = regions.setdefault(part.region, np.empty([b - a for a, b in part.region], dtype))
        into[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(part.part, part.region))] = data
    on_bytes = tracker.within(leaf.record.nbytes)
    convert = _read.host_converter(leaf.record, leaf.like.dtype, loc)
    # The regions are read already: `read_placed` places them as it places any read.
    assembled = lambda index: functools.partial(regions.__getitem__, _sharding.region_key(index, shape))
    value = _sharding.read_placed(assembled, shape, leaf.sharding, convert, on_bytes)()
    tracker.advance(leaves=1, nbytes=on_bytes.rest())
    return value
