"""Ways to copy a state from the accelerator to the host, timed side by side
(docs/benchmarks.md, "GPU": what an asynchronous save could protect with).

`python -m benchmarks.gpu_copies [--gib 4]`

One process, a float32 state of `--gib` GiB on the default device
(`benchmarks.gpu.make_state`). Each way runs on device copies nobody else
holds (made before the timing), and prints its wall seconds and the peak
resident memory it added (and what stayed after its arrays were freed):

- `asarray`: `np.asarray` of each (JAX's own copy, cached on the array);
- `device_put cpu`: one `jax.device_put` of the list to the host's CPU device,
  then `np.asarray` of each (what a save does, `_memory.ahead`);
- `device copy`: a copy of each array on the device (`x.copy()`), waited for;
- `device copy + copy_to_host_async`: those copies sent to the host together;
- `device_put pinned_host`: to the device's pinned host memory, then `np.asarray`.

A way the device does not support prints its error and the others go on.
"""

from __future__ import annotations

import argparse
import functools
import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from . import gpu


def _fresh(leaves: list[jax.Array]) -> list[jax.Array]:
    return jax.block_until_ready([x.copy() for x in leaves])


def _to_cpu(leaves: list[jax.Array]) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.device_put(leaves, jax.devices("cpu")[0])]


def _copy_then_host(leaves: list[jax.Array]) -> list[np.ndarray]:
    copies = [x.copy() for x in leaves]
    for x in copies:
        x.copy_to_host_async()
    return [np.asarray(x) for x in copies]


def _pinned(leaves: list[jax.Array]) -> list[np.ndarray]:
    sharding = jax.sharding.SingleDeviceSharding(leaves[0].devices().pop(), memory_kind="pinned_host")
    return [np.asarray(x) for x in jax.device_put(leaves, sharding)]


WAYS: dict[str, Callable[[list[jax.Array]], Any]] = {
    "asarray": lambda leaves: [np.asarray(x) for x in leaves],
    "device_put cpu": _to_cpu,
    "device copy": lambda leaves: jax.block_until_ready([x.copy() for x in leaves]),
    "device copy + copy_to_host_async": _copy_then_host,
    "device_put pinned_host": _pinned,
}


def _attempt(way: Callable[[list[jax.Array]], Any], leaves: list[jax.Array]) -> dict[str, Any]:
    """`way`'s copies, or the error of a way the device does not support."""
    try:
        return {"out": way(leaves), "error": None}
    except Exception as e:  # a memory kind or device this JAX does not have
        return {"out": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def measure(name: str, way: Callable[[list[jax.Array]], Any], leaves: list[jax.Array]) -> dict[str, Any]:
    process = psutil.Process()
    fresh = _fresh(leaves)
    gc.collect()
    before = process.memory_info().rss
    done, figures = gpu.timed(functools.partial(_attempt, way, fresh), sum(x.nbytes for x in leaves))
    del done["out"], fresh
    gc.collect()
    row = {"way": name, **figures, "rss_kept": process.memory_info().rss - before, "error": done["error"]}
    print(
        f"{name:34s} {row['seconds']:7.3f} s   peak RSS added {row['rss_added'] >> 20:6d} MiB   "
        f"kept {row['rss_kept'] >> 20:6d} MiB" + (f"   failed: {row['error']}" if row["error"] else ""),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=gpu.FULL_GIB)
    args = parser.parse_args(argv)
    state = gpu.make_state(args.gib, jnp.float32)
    leaves = list(state.values())
    print(f"{sum(x.nbytes for x in leaves) / 2**30:.2f} GiB in {len(leaves)} arrays on {leaves[0].devices().pop()}")
    return [measure(name, way, leaves) for name, way in WAYS.items()]


if __name__ == "__main__":
    main()
