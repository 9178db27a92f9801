"""Compare the two on-disk layouts on a tree with many leaves.

`layout="directories"` (one folder per leaf) against `layout="ocdbt"` (every array
in one OCDBT database): files created, save time, full-load time, the time to
load one leaf, and the time to delete the checkpoint. Each figure is the median of `--repeats` runs, on a local disk.

    python benchmarks/layouts.py --leaves 10000 --repeats 3

Prints a Markdown table (the one in docs/scaling.md came from this command).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqx_ckpt


def make_tree(leaves: int, size: int) -> dict:
    """`leaves` float32 arrays of `size` elements, 100 to a sub-dictionary."""
    base = jnp.arange(size, dtype=jnp.float32)
    blocks = range(0, leaves, 100)
    return {f"block{j // 100}": {f"w{i - j}": base + i for i in range(j, min(j + 100, leaves))} for j in blocks}


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(layout: str, tree: dict, like: dict, workdir: str) -> dict[str, float]:
    path = os.path.join(workdir, layout)
    shutil.rmtree(path, ignore_errors=True)
    save = timed(lambda: eqx_ckpt.tree_serialise_leaves(path, tree, layout=layout))
    files = count_files(path)
    load = timed(lambda: jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(path, like)))
    one = timed(lambda: eqx_ckpt.tree_deserialise_leaves(path, like, where=lambda t: t["block0"]["w0"]))
    # What an overwrite does to the old data root, and a manager to an old step.
    delete = timed(lambda: shutil.rmtree(path))
    return {"files": files, "save": save, "load": load, "one": one, "delete": delete}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=256, help="float32 elements per leaf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    tree = make_tree(args.leaves, args.size)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    workdir = tempfile.mkdtemp(dir=args.dir)
    try:
        rows = {}
        for layout in ("directories", "ocdbt"):
            runs = [measure(layout, tree, like, workdir) for _ in range(args.repeats)]
            rows[layout] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total = args.leaves * args.size * 4
    print(f"{args.leaves} leaves of {args.size} float32 ({total / 2**20:.1f} MiB), median of {args.repeats} runs\n")
    print("| layout | files | save (s) | load all (s) | load one leaf (s) | delete (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout, row in rows.items():
        figures = f"{row['save']:.2f} | {row['load']:.2f} | {row['one']:.3f} | {row['delete']:.2f}"
        print(f"| {layout} | {row['files']:.0f} | {figures} |")
    print(f"\n{os.cpu_count()} CPUs, jax {jax.__version__}, numpy {np.__version__}")


if __name__ == "__main__":
    main()
