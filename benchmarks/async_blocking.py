"""How long an asynchronous save blocks the caller, next to a synchronous save.

`python -m benchmarks.async_blocking [--gib 3] [--numpy] [--dir DIR]`

Saves one tree of float32 `jax.Array`s (or NumPy arrays with `--numpy`; 64 MiB
each, `--gib` GiB in all) twice
into fresh directories under `--dir`: once with `blocking=True`, timing the whole
call, and once with `blocking=False`, timing the call (the time the training loop
is stalled) and then `wait()`. Prints the three times and the blocked/synchronous
ratio. An asynchronous save stages `jax.Array`s without copying them (their host
data cannot change) and copies NumPy arrays (the caller may change them), so the
two kinds block for very different times.

`python -m benchmarks.run` measures the same on each benchmark workload's tree
(its `save_async` operation) and reports it among the targets of
docs/benchmarks.md; this script is the quick check on arbitrary sizes and on
NumPy trees.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqx_ckpt

LEAF = (4096, 4096)  # 64 MiB of float32


def make_tree(gib: float, numpy: bool) -> dict[str, Any]:
    count = max(1, round(gib * 2**30 / (LEAF[0] * LEAF[1] * 4)))
    if numpy:
        return {f"layer{i:03d}": np.full(LEAF, i, dtype=np.float32) for i in range(count)}
    tree = {f"layer{i:03d}": jnp.full(LEAF, i, dtype=jnp.float32) for i in range(count)}
    jax.block_until_ready(tree)
    return tree


def timed_saves(tree: dict[str, Any], root: str) -> tuple[float, float, float]:
    """(synchronous save, time blocked by the asynchronous one, its total time)."""
    start = time.perf_counter()
    eqx_ckpt.tree_serialise_leaves(os.path.join(root, "sync"), tree)
    sync = time.perf_counter() - start
    start = time.perf_counter()
    pending = eqx_ckpt.tree_serialise_leaves(os.path.join(root, "async"), tree, blocking=False)
    blocked = time.perf_counter() - start
    assert pending is not None
    pending.wait()
    total = time.perf_counter() - start
    return sync, blocked, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="size of the tree in GiB")
    parser.add_argument("--numpy", action="store_true", help="save NumPy arrays instead of jax.Arrays")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    tree = make_tree(args.gib, args.numpy)
    nbytes = sum(x.nbytes for x in tree.values())
    root = tempfile.mkdtemp(prefix="eqx_ckpt_async_", dir=args.dir)
    try:
        # A small save first, so imports and TensorStore's start-up are not timed.
        eqx_ckpt.tree_serialise_leaves(os.path.join(root, "warmup"), {"x": jnp.ones(4)})
        sync, blocked, total = timed_saves(tree, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kind = "NumPy arrays" if args.numpy else "jax.Arrays"
    print(f"tree: {len(tree)} float32 {kind}, {nbytes / 2**30:.2f} GiB")
    print(f"synchronous save:            {sync:7.2f} s")
    print(f"asynchronous save, blocked:  {blocked:7.2f} s")
    print(f"asynchronous save, to commit:{total:7.2f} s")
    print(f"blocked / synchronous:       {blocked / sync:7.1%}")


if __name__ == "__main__":
    main()
