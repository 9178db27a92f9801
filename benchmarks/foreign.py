"""Loading foreign files: many small safetensors tensors, and one large file.

`python -m benchmarks.foreign [--tensors 10000] [--reps 5] [--large-gib 3] [--dir DIR]`

Writes, under a temporary directory (or `--dir`):

- `single.safetensors`: `--tensors` small float32 tensors (shapes `(64,)` to
  `(32, 32)`), named `model.layers.{i}.{name}`, five to a layer;
- `hf/`: the same tensors split into four shards with `model.safetensors.index.json`,
  as a Hugging Face model directory;
- with `--large-gib`, `large.safetensors`: that many GiB of 64 MiB float32 tensors.

Then times, each measurement in a fresh process (imports and JAX's start-up
not timed; the page cache warm: the files were just written and are read once
before the runs):

- `load_file`: `safetensors.numpy.load_file` of every file, alone;
- `reference`: `load_file` plus `jnp.asarray` of each tensor (what the target
  of SPEC §4 compares against: safetensors' own load, and placing the arrays);
- `eqx_ckpt`: `eqx_ckpt.tree_deserialise_leaves(path, like)`, `like` a tree of
  `jax.ShapeDtypeStruct`s;
- `checkpoint`: `eqx_ckpt.Checkpoint(path).load()` (no `like`);
- for the large file, `raw`: the file read whole into fresh anonymous memory
  by 4 threads of `preadv` in 16 MiB pieces (the harness's raw reads,
  `benchmarks/contenders.py`), against which the `eqx_ckpt` and `checkpoint`
  loads are compared.

Prints the median and worst of `--reps` runs of each, and the ratio of each
median to the reference's (for the large file, to `raw`).

`python -m benchmarks.run --all` (or `--workload foreign`) runs the same
measurements (`bench`) as its `foreign` workload, through its worker, and
reports them against their targets.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

LAYER = {"norm": (64,), "bias": (128,), "w": (32, 32), "scale": (16,), "proj": (16, 32)}
SHARDS = 4
LARGE_TENSOR = (4096, 4096)  # 64 MiB of float32
READ_THREADS, PIECE = 4, 16 * 2**20
# What each file is loaded by, in the order a repetition runs them.
SMALL_OPS = ("load_file", "reference", "eqx_ckpt", "checkpoint")
CASES = {"single": SMALL_OPS, "hf": SMALL_OPS, "large": ("raw", "eqx_ckpt", "checkpoint")}
# The reference each case is compared against.
BASES = {"single": "reference", "hf": "reference", "large": "raw"}


def small_tensors(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    names = [(i, name, shape) for i in range(-(-count // len(LAYER))) for name, shape in LAYER.items()][:count]
    return {f"model.layers.{i}.{name}": rng.standard_normal(shape, dtype=np.float32) for i, name, shape in names}


def write_files(root: str, count: int, large_gib: float) -> dict[str, str]:
    from safetensors.numpy import save_file

    tensors = small_tensors(count)
    paths = {"single": os.path.join(root, "single.safetensors"), "hf": os.path.join(root, "hf")}
    save_file(tensors, paths["single"])
    os.makedirs(paths["hf"])
    names = sorted(tensors)
    weight_map = {}
    for s in range(SHARDS):
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = names[s * len(names) // SHARDS : (s + 1) * len(names) // SHARDS]
        save_file({n: tensors[n] for n in part}, os.path.join(paths["hf"], file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(paths["hf"], "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if large_gib:
        count, shape = large_tensors(large_gib)
        large = {f"layer{i:03d}": np.full(shape, i, np.float32) for i in range(count)}
        paths["large"] = os.path.join(root, "large.safetensors")
        save_file(large, paths["large"])
    return paths


def large_tensors(large_gib: float) -> tuple[int, tuple[int, int]]:
    """How many float32 tensors of which shape make the large file."""
    nbytes = round(large_gib * 2**30)
    count = max(1, nbytes // (LARGE_TENSOR[0] * LARGE_TENSOR[1] * 4))
    return count, LARGE_TENSOR if count > 1 else (max(1, nbytes // (LARGE_TENSOR[1] * 4)), LARGE_TENSOR[1])


def disk_needed(count: int, large_gib: float) -> int:
    """Bytes `write_files` writes: the small tensors twice (a file, a
    directory), a generous allowance for the headers, and the large file."""
    per_layer = sum(4 * int(np.prod(shape)) for shape in LAYER.values())
    small = 2 * (-(-count // len(LAYER)) * per_layer + 200 * count)
    large = 0
    if large_gib:
        tensors, shape = large_tensors(large_gib)
        large = tensors * shape[0] * shape[1] * 4
    return small + large


def files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    return [path]


def like_of(path: str) -> Any:
    """A nested dict of `jax.ShapeDtypeStruct`s matching the files' tensors."""
    import jax
    from safetensors import safe_open

    tree: dict[str, Any] = {}
    for file in files_of(path):
        with safe_open(file, "numpy") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                node = tree
                *parents, last = name.split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                node[last] = jax.ShapeDtypeStruct(tuple(piece.get_shape()), np.float32)
    return tree


def measure(op: str, path: str) -> float:
    """One measurement of `op` on `path`, in this (fresh) process."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    import eqx_ckpt

    jax.block_until_ready(jnp.zeros(1))  # JAX's backend is up before the clock starts
    like = like_of(path) if op == "eqx_ckpt" else None
    start = time.perf_counter()
    if op == "load_file":
        for file in files_of(path):
            load_file(file)
    elif op == "reference":
        out = [jnp.asarray(x) for file in files_of(path) for x in load_file(file).values()]
        jax.block_until_ready(out)
    elif op == "eqx_ckpt":
        jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(path, like))
    elif op == "checkpoint":
        jax.block_until_ready(eqx_ckpt.Checkpoint(path).load())
    elif op == "raw":
        raw_read(path)
    else:
        raise ValueError(op)
    return time.perf_counter() - start


def raw_read(path: str) -> memoryview:
    """The file read whole into fresh anonymous memory, as the harness's raw
    contender reads: `READ_THREADS` threads of `preadv` in `PIECE`-byte pieces."""
    size = os.path.getsize(path)
    view = memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    fd = os.open(path, os.O_RDONLY)
    try:

        def piece(offset: int) -> None:
            done, want = 0, min(PIECE, size - offset)
            while done < want:
                n = os.preadv(fd, [view[offset + done : offset + want]], offset + done)
                if n == 0:
                    raise EOFError(f"{path} is shorter than it was")
                done += n

        with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(piece, range(0, size, PIECE)))
    finally:
        os.close(fd)
    return view


def bench(
    paths: dict[str, str], reps: int, one: Callable[[str, str, int], float | None]
) -> dict[str, dict[str, list[float]]]:
    """Every measurement of every case in `paths`, in the order both this
    script and the harness run them: a case's files read once (the page cache
    warm: they were just written), then `reps` repetitions, each op in turn
    within one, so that a slow phase of the machine hits every op.
    `one(case, op, rep)` measures one in a fresh process and returns its
    seconds (`None`: it failed). Returns the seconds, by case and op."""
    times: dict[str, dict[str, list[float]]] = {}
    for case, ops in CASES.items():
        if case not in paths:
            continue
        warm(paths[case])
        times[case] = {op: [] for op in ops}
        for rep in range(reps):
            for op in ops:
                if (seconds := one(case, op, rep)) is not None:
                    times[case][op].append(seconds)
    return times


def in_fresh_process(op: str, path: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.foreign", "--child", op, path], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def warm(path: str) -> None:
    for file in files_of(path):
        with open(file, "rb") as f:
            while f.read(64 * 2**20):
                pass


def report(name: str, times: dict[str, list[float]], base: str) -> None:
    print(f"{name}:")
    reference = statistics.median(times[base])
    for op, runs in times.items():
        median = statistics.median(runs)
        print(f"  {op:<11} median {median:7.3f} s  worst {max(runs):7.3f} s  {median / reference:6.2f}x {base}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10000, help="small tensors in the file and the directory")
    parser.add_argument("--reps", type=int, default=5, help="runs of each measurement")
    parser.add_argument("--large-gib", type=float, default=0.0, help="also one file of this many GiB (off: 0)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(measure(*args.child))
        return
    root = tempfile.mkdtemp(prefix="eqx_ckpt_foreign_", dir=args.dir)
    try:
        paths = write_files(root, args.tensors, args.large_gib)
        print(f"{args.tensors} small float32 tensors; {args.reps} runs each, fresh processes, warm page cache")
        times = bench(paths, args.reps, lambda case, op, rep: in_fresh_process(op, paths[case]))
        for case, runs in times.items():
            report(case, runs, BASES[case])
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
