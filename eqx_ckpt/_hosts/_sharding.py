"""Sharded arrays: which host pieces a save writes, and how a load reads each
device's region straight into place.

With several processes, each writes its slices of what several of them hold."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import _faults, _state
from .._store import _memory


def unplaceable(sharding: Any) -> str | None:
    """Why `sharding`, over an `AbstractMesh` (as `eqx.filter_eval_shape`
    gives), cannot be laid out over this process's devices; `None` where it
    can (or is over real devices)."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return None
    needed, available = math.prod(mesh.axis_sizes), jax.devices()
    if needed <= len(available):
        return None
    return (
        f"`like` has a sharding over an abstract mesh of {needed} devices (axes "
        f"{dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}, as `eqx.filter_eval_shape` gives), "
        f"and this process has {len(available)} {available[0].platform} device(s) to lay it out over. Give `like` "
        "a sharding over this process's devices (`jax.sharding.NamedSharding(jax.make_mesh(...), spec)`)"
    )


def block_shape(x: Any) -> tuple[int, ...] | None:
    """The shape of one shard of a sharded `jax.Array`, to line chunks up with."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        return tuple(x.sharding.shard_shape(x.shape))
    return None


def on_one_device(x: jax.Array) -> bool:
    """Whether `x` lives on one device (of this process: JAX makes no array on
    another process's single device)."""
    sharding = x.sharding
    # `type ... is` first: `isinstance` on JAX's sharding classes costs about a
    # microsecond, and an asynchronous save's caller waits for it leaf by leaf.
    return type(sharding) is jax.sharding.SingleDeviceSharding or isinstance(
        sharding, jax.sharding.SingleDeviceSharding
    )


def host_pieces(
    x: Any,
    chunks: tuple[int, ...] | None = None,
    itemsize: int = 1,
    *,
    deal: Deal | None = None,
    path: str = "",
    part: bool = False,
) -> list[tuple[tuple[slice, ...], Any]]:
    """(region, data) for every piece this process writes: a `jax.Array`, a
    `Deferred` slice of one, or NumPy data as it is. Replicated data is written
    once. With several processes, each region is cut between its holders
    (`slices`, on the chunk grid `chunks`) and its slices dealt (`deal`); a
    process's own `part` (a local tier's) holds every region it addresses, whole."""
    if not isinstance(x, jax.Array):
        return [((), np.asarray(x))]
    if on_one_device(x):
        return [((), x)]
    if x.is_fully_addressable and x.is_fully_replicated:
        return [((), x.addressable_data(0))]  # one replica, on its one device
    if x.is_fully_addressable:
        return [(shard.index, shard.data) for shard in x.addressable_shards if shard.replica_id == 0]
    if part:
        return list(own_regions(x).values())
    return _share(x, chunks, itemsize, deal if deal is not None else Deal(), path)


def own_regions(x: jax.Array) -> dict[Region, tuple[tuple[slice, ...], jax.Array]]:
    """Every region of `x` this process addresses, once (its first device's shard of it), by region."""
    shape = tuple(x.shape)
    regions: dict[Region, tuple[tuple[slice, ...], jax.Array]] = {}
    for shard in x.addressable_shards:
        region = region_key(shard.index, shape)
        if region not in regions:
            regions[region] = (tuple(slice(a, b) for a, b in region), shard.data)
    return regions


# A region of a leaf may be held by several processes: a replicated leaf, or a
# shard on devices of several processes. If it has fewer stored bytes than
# this, one of them writes it whole. A larger one is cut between them (`slices`).
SPLIT_BYTES = 4 << 20

Region = tuple[tuple[int, int], ...]


class Deal:
    """Who writes each slice of a multi-process save: a small region (under
    `SPLIT_BYTES`, not cut) goes to its holders in turn; any other slice to
    the holder of its region dealt the fewest bytes so far (the lowest rank on
    a tie), one slice of a region each. Every process deals the same slices in
    the same order, so all reach the same deal with no communication.

    Tried and dropped: a hash of each leaf's path (a few large leaves left one
    process 1.5x its share); the large leaves by index (with two processes,
    alternating layers all went to one); the small ones by bytes (one process
    wrote every small leaf's files)."""

    def __init__(self) -> None:
        self.dealt: dict[int, int] = {}  # process index -> bytes dealt to it
        self.turn = 0  # small regions dealt so far

    def owners(self, holders: tuple[int, ...], sizes: list[int]) -> list[int]:
        """The holder that writes each slice of a region, of `sizes` bytes."""
        if len(sizes) == 1 and sizes[0] < SPLIT_BYTES:
            self.turn += 1
            return [holders[(self.turn - 1) % len(holders)]]
        free, out = list(holders), []
        for size in sizes:
            owner = min(free, key=lambda p: (self.dealt.get(p, 0), p))
            free.remove(owner)
            out.append(owner)
            self.dealt[owner] = self.dealt.get(owner, 0) + size
        return out


def _share(
    x: jax.Array, chunks: tuple[int, ...] | None, itemsize: int, deal: Deal, path: str
) -> list[tuple[tuple[slice, ...], Any]]:
    """This process's share of a leaf spread over several processes: its
    slices of every region it holds, taken from a local shard. Every region
    is dealt, held here or not, so that every process's deal stays the same."""
    shape, me = tuple(x.shape), jax.process_index()
    shards = {region_key(shard.index, shape): shard for shard in x.addressable_shards}
    pieces: list[tuple[tuple[slice, ...], Any]] = []
    for region, holders in regions_held(x.sharding, shape):
        cut = slices(region, chunks if chunks is not None else (), len(holders), itemsize)
        owners = deal.owners(holders, [math.prod(b - a for a, b in part) * itemsize for part in cut])
        for owner, part in zip(owners, cut):
            if owner != me:
                continue
            pieces.append((tuple(slice(a, b) for a, b in part), _slice(shards[region].data, part, region)))
    _faults.fire("save.slices", path, [index for index, _ in pieces])
    return pieces


# Where a process cuts its slice out of a shard:
# - on the device: only the slice reaches the host, at one compilation per
#   slice shape (docs/benchmarks.md, "Measurements behind the design");
# - from the shard's host view: free on a CPU, whose view is the device
#   buffer; on an accelerator, a copy of the whole shard in every process.
# `None`: on the device on accelerators, from the host view on a CPU.
SLICE_ON_DEVICE: bool | None = None


def _slice(data: jax.Array, part: Region, region: Region) -> jax.Array | _memory.Deferred:
    """`part` of a shard `data` holding `region`, made when the save stages it."""
    if part == region:
        return data
    within = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(part, region))
    on_device = SLICE_ON_DEVICE
    if on_device is None:
        on_device = next(iter(data.devices())).platform != "cpu"
    nbytes = math.prod(b - a for a, b in part) * data.dtype.itemsize
    if on_device:
        return _memory.Deferred(functools.partial(data.__getitem__, within), nbytes)
    return _memory.Deferred(data, nbytes, operator.itemgetter(within))


@_state.memo(256)
def regions_held(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[tuple[Region, tuple[int, ...]], ...]:
    """Every region of a leaf of `shape` placed with `sharding`, with the
    processes whose devices hold it (in rank order); regions in order. The
    same in every process: it depends on the global placement alone."""
    held: dict[Region, set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        held.setdefault(region_key(index, shape), set()).add(device.process_index)  # type: ignore[attr-defined]
    return tuple((region, tuple(sorted(held[region]))) for region in sorted(held))


def slices(region: Region, chunks: tuple[int, ...], holders: int, itemsize: int) -> list[Region]:
    """`region` of a leaf (`(start, stop)` per axis) cut for its `holders`
    processes into at most one slice each, the same in every process. A region
    of at least `SPLIT_BYTES` is cut along the axis on which it spans the most
    chunks of the grid `chunks`, at chunk boundaries only (no two processes
    write one chunk file), the chunks shared as evenly as they go."""
    nbytes = math.prod(b - a for a, b in region) * itemsize
    if holders == 1 or nbytes < SPLIT_BYTES or not region or not chunks:
        return [region]
    inner = [range(c * (a // c + 1), b, c) for (a, b), c in zip(region, chunks)]
    axis = max(range(len(region)), key=lambda i: len(inner[i]))
    (start, stop), cuts = region[axis], inner[axis]
    n = len(cuts) + 1  # chunks (or parts of chunks, at the region's edges) along `axis`
    m = min(n, holders)
    if m == 1:
        return [region]
    q, r = divmod(n, m)
    # In chunks along `axis`: the first `r` slices hold one more.
    edges = [0, *itertools.accumulate(q + (j < r) for j in range(m))]

    def edge(k: int) -> int:
        return start if k == 0 else stop if k == n else cuts[k - 1]

    return [(*region[:axis], (edge(a), edge(b)), *region[axis + 1 :]) for a, b in itertools.pairwise(edges)]


def read_placed(
    read: Callable[[tuple[slice, ...]], Callable[[], np.ndarray]],
    shape: tuple[int, ...],
    sharding: Any,
    convert: Callable[[np.ndarray], np.ndarray],
    on_bytes: Callable[[int], None] | None = None,
) -> Callable[[], jax.Array]:
    """Start reading each device's region of a leaf (`read(region)`; a
    replicated region read once); a function that waits and assembles the
    `jax.Array` with `sharding`, calling `on_bytes` with each region's stored bytes."""
    index_map = sharding.addressable_devices_indices_map(shape)
    reads: dict[Any, Callable[[], np.ndarray]] = {}
    for index in index_map.values():
        key = region_key(index, shape)
        if key not in reads:
            reads[key] = read(tuple(index) if index is not None else ())

    def finish() -> jax.Array:
        hosts = {}
        for key, finish_read in reads.items():
            stored = finish_read()
            if on_bytes is not None:
                on_bytes(stored.nbytes)
            hosts[key] = convert(stored)
        arrays = [jax.device_put(hosts[region_key(index, shape)], device) for device, index in index_map.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    return finish


def region_key(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A region given as an index (slices, or `None` for the whole leaf) as
    `(start, stop)` per axis, comparable and hashable."""
    if index is None:
        return tuple((0, n) for n in shape)
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))
