"""A data pipeline's position saved with each step: what it adds to the step's save.

`python -m benchmarks.iterators [--preset small] [--rounds 15] [--dir DIR]`

A training state of the `--preset` workload (an Equinox transformer and its
Adam state) is saved by a `CheckpointManager`, one step after another, with
and without a Grain `DataLoader` iterator in the tree (shuffled records,
mapped and batched, two epochs in), in alternating order (A, B, B, A, ...),
so that the machine's load falls on both alike. It reports, medians over the
rounds:

- `save_s` and `save_with_iterator_s`: a blocking `manager.save(step, state)`
  (durable, committed), and their paired ratio with a 95% interval
  bootstrapped over the rounds (`benchmarks.alternating.paired`);
- `capture_s`: the iterator's part measured alone (its `get_state()` and the
  record a save makes of it), and `state_bytes`, the state's size;
- `restore_s` and `restore_with_iterator_s`: the restore of that step into
  a skeleton, with a fresh iterator that `set_state` puts back, and their
  paired ratio.

Grain is a test dependency (`pip install -e ".[test]"`); eqx_ckpt itself never imports it.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import grain
import jax
import numpy as np

import eqx_ckpt
from eqx_ckpt._ondisk import _iterators

from . import alternating, workload


class _Scale(grain.transforms.Map):
    def map(self, element: np.ndarray) -> np.ndarray:
        return element * np.float32(0.5)


def pipeline(records: int = 256) -> Any:
    """A Grain `DataLoader` iterator two epochs in: shuffled records of 64 floats, mapped, batched by 32."""
    source = [np.full(64, i, np.float32) for i in range(records)]
    sampler = grain.samplers.IndexSampler(records, shuffle=True, seed=0, num_epochs=None)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[_Scale(), grain.transforms.Batch(32)])
    iterator = iter(loader)
    for _ in range(2 * records // 32 + 5):
        next(iterator)
    return iterator


def _timed(run: Any, *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    run(*args, **kwargs)
    return time.perf_counter() - start


def measure(preset: str, rounds: int, root: Path) -> dict[str, Any]:
    sizes = workload.PRESETS[preset]
    state = workload.concrete(sizes)
    data = pipeline()
    trees = {"plain": state, "iterator": {**state, "data": data}}
    skeleton = eqx.filter_eval_shape(workload.make_state, sizes)
    likes = {"plain": skeleton, "iterator": {**skeleton, "data": pipeline()}}
    times: dict[str, list[float]] = {f"{op}_{kind}": [] for op in ("save", "restore") for kind in trees}
    steps = itertools.count()
    with eqx_ckpt.CheckpointManager(root / "run", max_to_keep=2) as manager:
        for kind in trees:  # a warm-up of each, untimed
            manager.save(next(steps), trees[kind])
        for r in range(rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for kind in order:
                step = next(steps)
                times[f"save_{kind}"].append(_timed(manager.save, step, trees[kind]))
                times[f"restore_{kind}"].append(_timed(manager.restore, likes[kind], step=step))
    keypath = (jax.tree_util.DictKey("data"),)
    args = ([data], [keypath], ["data"])
    capture = [_timed(_iterators.capture, *args, checkpoint="bench") for _ in range(15)]
    (_, _, stored) = _iterators.capture(*args, checkpoint="bench")[0]
    ratio = alternating.paired(times["save_plain"], times["save_iterator"])
    restored = alternating.paired(times["restore_plain"], times["restore_iterator"])
    return {
        "preset": preset,
        "leaves": len(jax.tree.leaves(state)),
        "rounds": rounds,
        "save_s": statistics.median(times["save_plain"]),
        "save_with_iterator_s": statistics.median(times["save_iterator"]),
        "save_ratio": ratio[0],
        "save_ratio_low": ratio[1],
        "save_ratio_high": ratio[2],
        "capture_s": statistics.median(capture),
        "state_bytes": len(stored.data),
        "restore_s": statistics.median(times["restore_plain"]),
        "restore_with_iterator_s": statistics.median(times["restore_iterator"]),
        "restore_ratio": restored[0],
        "restore_ratio_low": restored[1],
        "restore_ratio_high": restored[2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(workload.PRESETS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default=None, help="where to save (default: a new temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        out = measure(args.preset, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, value in out.items():
        print(f"{name:28s} {value:.4g}" if isinstance(value, float) else f"{name:28s} {value}")


if __name__ == "__main__":
    main()
