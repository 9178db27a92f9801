"""Sharded arrays: which host pieces a save writes, and how a load reads each
device's region straight into place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


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


def host_pieces(x: Any) -> list[tuple[tuple[slice, ...], Any]]:
    """(region, host data) for every piece this process writes.

    Only the first replica of each shard is written, so replicated data is written
    once, and each process writes only the shards it can address.
    """
    if not isinstance(x, jax.Array) or on_one_device(x):
        return [((), np.asarray(x))]
    if x.is_fully_replicated and x.is_fully_addressable:
        return [((), np.asarray(x))]
    pieces = []
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            pieces.append((shard.index, np.asarray(shard.data)))
    return pieces


def read_placed(
    read: Callable[[tuple[slice, ...]], Any],
    shape: tuple[int, ...],
    sharding: Any,
    convert: Callable[[np.ndarray], np.ndarray],
    on_bytes: Callable[[int], None] | None = None,
) -> Callable[[], jax.Array]:
    """Start reading each device's region of a leaf; return a function that
    waits and assembles the `jax.Array` with `sharding`.

    `read(region)` starts a TensorStore read and returns its future; replicated
    regions are read once and placed on every device that holds them.
    `on_bytes`, when given, is called with the stored bytes of each region as
    it lands (progress within the leaf).
    """
    index_map = sharding.addressable_devices_indices_map(shape)
    futures: dict[Any, Any] = {}
    for index in index_map.values():
        key = _key(index, shape)
        if key not in futures:
            futures[key] = read(tuple(index) if index is not None else ())

    def finish() -> jax.Array:
        hosts = {}
        for key, future in futures.items():
            stored = future.result()
            if on_bytes is not None:
                on_bytes(stored.nbytes)
            hosts[key] = convert(stored)
        arrays = [jax.device_put(hosts[_key(index, shape)], device) for device, index in index_map.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    return finish


def _key(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if index is None:
        return tuple((0, n) for n in shape)
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))
