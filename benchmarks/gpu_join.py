"""Joining a leaf's slabs on the device, two ways, timed with the device memory
they take (issue 74, item 3: the pool of pinned load buffers joins each leaf's
slabs with `jnp.concatenate`, `_load/_reader.py`).

`python -m benchmarks.gpu_join [--mib 64,128,256] [--slab-mib 64]`

For each way, in a process of its own (the device's peak memory only grows),
leaves of `--mib` MiB of float32 rows, smallest first, are each sent to the
default device as slabs of `--slab-mib` MiB and joined:

- `concatenate`: `jnp.concatenate(slabs)`, as the pool does;
- `in_place`: each slab written into one buffer allocated for the whole leaf,
  by a jitted `lax.dynamic_update_slice` that donates the buffer.

Each join is timed twice: the first call of a shape (compilation included)
and a second one; `extra_mib` is the device's peak memory during the join over
what the slabs themselves held (a leaf's worth: the join doubles the region).
Prints one row a leaf and way; `main` returns them.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MIB = 2**20
COLUMNS = 1024
WAYS = ("concatenate", "in_place")


@functools.partial(jax.jit, donate_argnums=0)
def _write(buffer: jax.Array, slab: jax.Array, row: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, slab, row, axis=0)


def _in_place(slabs: list[jax.Array]) -> jax.Array:
    rows = sum(s.shape[0] for s in slabs)
    buffer = jnp.empty((rows, *slabs[0].shape[1:]), slabs[0].dtype)
    row = 0
    for slab in slabs:
        buffer = _write(buffer, slab, jnp.int32(row))
        row += slab.shape[0]
    return buffer


JOINS = {"concatenate": jnp.concatenate, "in_place": _in_place}


def _memory(stat: str) -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get(stat, 0))


def _slabs(mib: int, slab_mib: int) -> list[jax.Array]:
    rows, per_slab = mib * MIB // (4 * COLUMNS), slab_mib * MIB // (4 * COLUMNS)
    host = np.random.default_rng(mib).standard_normal((rows, COLUMNS), dtype=np.float32)
    return jax.block_until_ready([jax.device_put(host[lo : lo + per_slab]) for lo in range(0, rows, per_slab)])


def measure(way: str, sizes: list[int], slab_mib: int) -> list[dict[str, Any]]:
    """`way`'s joins of each size in this process, smallest first."""
    rows = []
    for mib in sorted(sizes):
        slabs = _slabs(mib, slab_mib)
        expected = np.concatenate([np.asarray(s) for s in slabs])
        row: dict[str, Any] = {"way": way, "mib": mib, "slabs": len(slabs)}
        held, peak = _memory("bytes_in_use"), _memory("peak_bytes_in_use")
        for run in ("first", "again"):
            start = time.perf_counter()
            joined = jax.block_until_ready(JOINS[way](slabs))
            row[f"{run}_ms"] = round((time.perf_counter() - start) * 1000, 2)
            if run == "first":
                # The peak only grows, and smaller leaves came first: this one's
                # join is seen where it went past them (else: not measured).
                grown = _memory("peak_bytes_in_use") > peak
                row["extra_mib"] = round((_memory("peak_bytes_in_use") - held) / MIB, 1) if grown else None
                row["equal"] = bool(np.array_equal(np.asarray(joined), expected))
            del joined
        rows.append(row)
        del slabs
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="64,128,256", help="comma-separated leaf sizes, MiB")
    parser.add_argument("--slab-mib", type=int, default=64, help="MiB of each slab sent to the device")
    parser.add_argument("--way", choices=WAYS, default=None, help=argparse.SUPPRESS)  # one process's share
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.mib.split(",")]
    if args.way is not None:
        rows = measure(args.way, sizes, args.slab_mib)
        print(json.dumps(rows))
        return rows
    rows = []
    for way in WAYS:
        command = [sys.executable, "-m", "benchmarks.gpu_join", "--way", way, "--mib", args.mib]
        done = subprocess.run([*command, "--slab-mib", str(args.slab_mib)], capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'way':<12} {'MiB':>5} {'slabs':>5} {'first ms':>9} {'again ms':>9} {'extra MiB':>9} equal")
    for r in rows:
        print(
            f"{r['way']:<12} {r['mib']:>5} {r['slabs']:>5} {r['first_ms']:>9} {r['again_ms']:>9}"
            f" {r['extra_mib']!s:>9} {r['equal']}"
        )
    return rows


if __name__ == "__main__":
    main()
