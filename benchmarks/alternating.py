"""One operation timed with two or more code trees, in alternating fresh processes.

    python -m benchmarks.alternating --tree before=../base --tree after=. \\
        --workload many --op save --rounds 3 --reps 7

Each round starts one process per tree, in turn (A, B, A, B, ...), so that the
load other people put on the machine hits every tree alike. A process imports
eqx_ckpt from its tree (`PYTHONPATH=<tree>`), builds the workload, warms up
with one untimed operation, then times `--reps` operations:

- `save`: a durable `tree_serialise_leaves`, each into a fresh folder;
- `load`: `tree_deserialise_leaves` into the abstract skeleton (a load with
  `like`), warm page cache, of a checkpoint that tree saved once before the
  rounds;
- `load-published`: the same load of a published folder that tree exported
  once before the rounds (`export_safetensors`: safetensors and an
  `eqx_ckpt.json` recording each leaf's digest, which a load checks);
- `slice-published`: `SLICES` lazy slices of 2 rows each, spread over the
  largest leaf of two or more dimensions of that folder, opened once as a
  `Checkpoint` (each slice reads, and where the record holds block digests
  checks, the blocks holding its rows).

Wall time and the process's CPU time (`time.process_time`, all its threads)
are printed per tree, median and min. On a shared machine CPU time is the
steadier of the two: other people's jobs lengthen the wall time of a run, not
the work it does.

Then it decides: each round gives every tree a median (of its `--reps`), and
each tree's is divided by the first tree's of the same round, so that a round
the machine was busier cancels out (a paired comparison). The median of those
ratios, with a 95% interval bootstrapped over the rounds, says whether a tree
is faster, slower, or within the noise. `--spread 0.05` adds rounds (up to
`--max-rounds`) until every interval's half-width is under 5% of its ratio, so
that a 10% change cannot hide in the spread. The workload itself comes from this file's own
`benchmarks/workload.py`, whatever tree is measured, so every tree saves the
same state. A tree is a folder holding `eqx_ckpt/`: make one of a commit with
`git worktree add --detach ../base <commit>` (and `git worktree remove` it
after).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# The lazy 2-row slices one `slice-published` operation reads.
SLICES = 64


def load_workload() -> Any:
    """This file's `workload.py`, imported by path: the measured tree is first
    on `sys.path`, and may hold a `benchmarks` package of its own."""
    spec = importlib.util.spec_from_file_location("_alternating_workload", os.path.join(HERE, "workload.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def timed(operation: Any, before: Any) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) of `operation()`, after an
    untimed `before()`."""
    before()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    operation()
    return time.perf_counter() - wall, time.process_time() - cpu


def work(job: dict[str, Any]) -> dict[str, Any]:
    """One process's part: warm up once, then `reps` timed operations."""
    import jax

    import eqx_ckpt

    workload = load_workload()
    sizes = workload.PRESETS[job["workload"]]
    folder, op = job["folder"], job["op"]
    published = job.get("published", False)
    checkpoint = os.path.join(folder, "published" if published else "checkpoint")
    if op == "prepare":
        state = jax.block_until_ready(workload.concrete(sizes))
        if published:
            eqx_ckpt.export_safetensors(checkpoint, state)
        else:
            eqx_ckpt.tree_serialise_leaves(checkpoint, state)
        return {"library": eqx_ckpt.__file__}
    if op == "save":
        state = jax.block_until_ready(workload.concrete(sizes))
        path = os.path.join(folder, "save")

        def operation() -> None:
            eqx_ckpt.tree_serialise_leaves(path, state)

        def before() -> None:
            # The last save removed: with every earlier save kept beside it, a save's
            # kernel time grew (0.03 s -> 0.15 s on `many` by the fifth). Then the data
            # left unwritten is written out, not in this save's syncs.
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
    elif op == "slice":
        operation = _slices(eqx_ckpt.Checkpoint(checkpoint))

        def before() -> None:
            pass
    else:
        like = workload.skeleton(sizes)

        def operation() -> None:
            jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(checkpoint, like))

        def before() -> None:
            pass

    timed(operation, before)  # warm-up
    times = [timed(operation, before) for _ in range(job["reps"])]
    if op == "save":
        shutil.rmtree(path)
    return {"library": eqx_ckpt.__file__, "wall": [t[0] for t in times], "cpu": [t[1] for t in times]}


def _slices(ckpt: Any) -> Any:
    """`SLICES` lazy reads of 2 rows, spread over the largest leaf of `ckpt` of two or more dimensions."""
    import numpy as np

    leaves = [ckpt[key] for key in ckpt]
    lazy = max((x for x in leaves if len(x.shape) >= 2), key=lambda x: math.prod(x.shape) * x.dtype.itemsize)
    starts = [i * (lazy.shape[0] - 2) // (SLICES - 1) for i in range(SLICES)]

    def operation() -> None:
        for start in starts:
            np.asarray(lazy[start : start + 2])

    return operation


def run(tree: str, job: dict[str, Any], *, script: str = __file__) -> dict[str, Any]:
    """`job` in a fresh interpreter that imports eqx_ckpt from `tree`, run by
    `script`'s `--job` (this file's, or a benchmark's that reuses it).

    `-P`: the folder of this script is not put on `sys.path` (its modules could
    shadow others); the working directory is a scratch folder, for the same reason."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    command = [sys.executable, "-P", os.path.abspath(script), "--job", json.dumps(job)]
    done = subprocess.run(command, env=env, cwd=job["folder"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            expected = os.path.join(os.path.abspath(tree), "eqx_ckpt", "__init__.py")
            if os.path.realpath(result["library"]) != os.path.realpath(expected):
                raise SystemExit(f"{tree}: the process imported {result['library']}, not {expected}")
            return result
    raise SystemExit(f"{tree}: the process exited with status {done.returncode}:\n{done.stderr[-4000:]}")


def answer(work: Any, job: str) -> None:
    """A fresh process's part of `run`: the result of `work` of the `--job` JSON, printed for `run` to find."""
    print("RESULT " + json.dumps(work(json.loads(job))), flush=True)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.4f} s, min {min(values):.4f} s"


def paired(base: list[float], other: list[float], *, draws: int = 2000) -> tuple[float, float, float]:
    """The median of `other[r] / base[r]` over rounds `r`, and a 95% interval
    of that median bootstrapped over the rounds (seeded: the same figures give
    the same interval)."""
    ratios = [o / b for b, o in zip(base, other)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def verdict(name: str, base: str, ratio: tuple[float, float, float]) -> str:
    """One line saying what the paired ratio of `name` to `base` shows."""
    middle, low, high = ratio
    if high < 1:
        said = f"faster than {base}"
    elif low > 1:
        said = f"slower than {base}"
    else:
        said = f"the same as {base}, within the spread"
    return f"{middle:.3f}x {base} (95% interval {low:.3f}-{high:.3f}): {said}"


def half_width(ratio: tuple[float, float, float]) -> float:
    """The interval's half-width, as a fraction of the ratio."""
    return (ratio[2] - ratio[1]) / 2 / ratio[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=FOLDER, twice or more")
    parser.add_argument("--workload", default="many", choices=["many", "small", "large", "tiny"])
    parser.add_argument("--op", default="save", choices=["save", "load", "load-published", "slice-published"])
    parser.add_argument("--rounds", type=int, default=3, help="rounds at least")
    parser.add_argument("--spread", type=float, default=None, help="add rounds until each interval is this narrow")
    parser.add_argument("--max-rounds", type=int, default=20, help="rounds at most, with --spread")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--scratch", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        answer(work, args.job)
        return
    trees = dict(tree.split("=", 1) for tree in args.tree)
    if len(trees) < 2:
        parser.error("give at least two trees: --tree NAME=FOLDER --tree NAME=FOLDER")
    scratch = tempfile.mkdtemp(prefix="alternating-", dir=args.scratch)
    try:
        measure(trees, args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(trees: dict[str, str], args: argparse.Namespace, scratch: str) -> None:
    published = args.op in ("load-published", "slice-published")
    base = {
        "workload": args.workload,
        "op": {"load-published": "load", "slice-published": "slice"}.get(args.op, args.op),
        "reps": args.reps,
        "published": published,
    }
    folders = {name: os.path.join(scratch, name) for name in trees}
    for name, tree in trees.items():
        os.makedirs(folders[name])
        if base["op"] in ("load", "slice"):
            run(tree, {**base, "op": "prepare", "folder": folders[name]})
    results: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in trees}
    rounds: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in trees}
    round_ = 0
    while round_ < args.rounds or (args.spread is not None and round_ < args.max_rounds and not narrow(rounds, args)):
        for name, tree in trees.items():
            result = run(tree, {**base, "folder": folders[name]})
            for kind in ("wall", "cpu"):
                results[name][kind] += result[kind]
                rounds[name][kind].append(statistics.median(result[kind]))
            walls, cpus = (", ".join(f"{t:.3f}" for t in result[kind]) for kind in ("wall", "cpu"))
            load = os.getloadavg()[0]
            print(f"round {round_ + 1} {name}: wall {walls}; CPU {cpus}; load average {load:.2f}", flush=True)
        round_ += 1
    print(f"{args.workload} {args.op}, {round_} rounds x {args.reps} in alternating processes:")
    for name in trees:
        print(f"  {name:>10}: wall {summary(results[name]['wall'])}; CPU {summary(results[name]['cpu'])}")
    first = next(iter(trees))
    for name in list(trees)[1:]:
        for kind in ("cpu", "wall"):
            said = verdict(name, first, paired(rounds[first][kind], rounds[name][kind]))
            print(f"  {name:>10}: {kind} {said}")


def narrow(rounds: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> bool:
    """Whether every tree's paired CPU ratio to the first is known within `--spread`."""
    names = list(rounds)
    base = rounds[names[0]]["cpu"]
    if len(base) < 3:
        return False
    return all(half_width(paired(base, rounds[name]["cpu"])) <= args.spread for name in names[1:])


if __name__ == "__main__":
    main()
