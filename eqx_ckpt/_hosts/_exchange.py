"""Bytes sent from process to process of a `jax.distributed` job by JAX's own
collectives: a tiered manager's parts, to their peers and back (`_peers`).

No network service of eqx_ckpt's own: each window of bytes is one row of a
global array (one device of each process), moved by `jax.lax.ppermute`
under `jax.shard_map`, as JAX moves any array between processes. Every
process calls `transfer` with the same pairs and sizes, in the same order:
a collective that one process never joins waits for ever, so a caller meets
the others at a barrier (`_multihost.Group`) before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._base import _faults, _state

# The bytes a process sends in one collective (a larger part takes several):
# what each process holds in memory at once, twice (sent and received).
WINDOW = 64 << 20


def transfer(
    pairs: Sequence[tuple[int, int]],
    sizes: Mapping[int, int],
    fill: Callable[[int, memoryview], None],
    take: Callable[[int, memoryview], None],
) -> None:
    """Send `sizes[sender]` bytes from each sender to its receiver (`pairs`:
    `(sender, receiver)`, each process in at most one pair as each). This
    process, if it sends, gives them by `fill(offset, view)`, which fills
    `view`; if it receives, takes them by `take(offset, view)` (a view of
    this window, valid during the call), in order. Neither may raise (the
    other processes go on with the collective): they keep their errors for
    the caller."""
    count, me = jax.process_count(), jax.process_index()
    longest = max((sizes[sender] for sender, _ in pairs), default=0)
    sending = sizes[me] if any(sender == me for sender, _ in pairs) else 0
    source = next((sender for sender, receiver in pairs if receiver == me), None)
    for start in range(0, longest, WINDOW):
        length = min(WINDOW, longest - start)
        row = np.zeros(length, np.uint8)
        if start < sending:
            fill(start, row.data[: min(length, sending - start)])
        _faults.fire("exchange.window", start, length)
        received = _permute(tuple(pairs), count, length)(_global_row(row, count))
        del row
        if source is not None and start < sizes[source]:
            mine = np.asarray(received.addressable_shards[0].data).reshape(-1)
            take(start, mine.data[: min(length, sizes[source] - start)])


def rounds(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` split into rounds in which each process sends at most once
    and receives at most once (in order: the same rounds in every process)."""
    out: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for batch in out:
            if all(pair[0] != s and pair[1] != r for s, r in batch):
                batch.append(pair)
                break
        else:
            out.append([pair])
    return out


def _devices() -> list[jax.Device]:
    """One device of each process (its first), by process index."""
    first: dict[int, jax.Device] = {}
    for device in jax.devices():
        first.setdefault(device.process_index, device)
    return [first[index] for index in range(jax.process_count())]


def _global_row(row: np.ndarray, count: int) -> jax.Array:
    """The global `(count, len(row))` array whose row `jax.process_index()` is `row`."""
    devices = _devices()
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("p",)), jax.sharding.PartitionSpec("p"))
    local = jax.device_put(row.reshape(1, -1), devices[jax.process_index()])
    return jax.make_array_from_single_device_arrays((count, row.size), sharding, [local])


@_state.memo(64)
def _permute(pairs: tuple[tuple[int, int], ...], count: int, length: int) -> Callable[[jax.Array], jax.Array]:
    """The compiled collective moving row `sender` to row `receiver` for each pair (others: zeros)."""
    del length  # (a key of the memo: one program per row length)
    mesh = jax.sharding.Mesh(np.array(_devices()), ("p",))
    spec = jax.sharding.PartitionSpec("p")
    shard_map: Any = getattr(jax, "shard_map", None)
    if shard_map is None:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map
    moved = shard_map(lambda x: jax.lax.ppermute(x, "p", list(pairs)), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(moved)
