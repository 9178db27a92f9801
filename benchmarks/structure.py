"""The structure record's cost: on a save, and rebuilding a tree without its code.

`python -m benchmarks.structure [--preset many] [--reps 7] [--dir DIR]`

On the `many` workload (an Equinox transformer and its Adam state, 9,988
leaves of a few KB), it measures, medians of `--reps`:

- `save`: a durable save of the state into a new directory (the record included);
- `record`: the part of that save the structure record costs: building it from
  the flattened tree (`_structure.record`, as the save calls it) and encoding it
  as the manifest holds it (JSON text in a JSON string), measured alone on the
  same tree; with
  `record / save`, what the record adds (SPEC section 4: at most 5%);
- `manifest_bytes`: the manifest's size with and without the record;
- `skeleton`: `Checkpoint(path).skeleton(trust=[...])` of that checkpoint,
  against `eqx.filter_eval_shape` of the function that made the state
  (SPEC section 4: no longer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import optax
import orjson

import eqx_ckpt
from eqx_ckpt._base import _tree
from eqx_ckpt._ondisk import _structure

from . import workload


def _median(run: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(preset: str, reps: int, root: Path) -> dict[str, float]:
    sizes = workload.PRESETS[preset]
    state = workload.concrete(sizes)
    count = iter(range(10**6))

    def save() -> None:
        path = root / f"save_{next(count)}"
        eqx_ckpt.tree_serialise_leaves(path, state)
        shutil.rmtree(path)

    # Flattened once: the save flattens the tree anyway, the record is what it adds.
    leaves, names = _tree.flatten_named(state, None)

    def record() -> None:
        made = _structure.record(names.treedef, leaves, [True] * len(leaves), names.records)
        orjson.dumps(orjson.dumps(made).decode())

    path = root / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, state)
    trust = [workload, optax]
    out = {
        "leaves": len(eqx_ckpt.Checkpoint(path)),
        "save_s": _median(save, reps),
        "record_s": _median(record, reps),
        "skeleton_s": _median(lambda: eqx_ckpt.Checkpoint(path).skeleton(trust=trust), reps),
        "filter_eval_shape_s": _median(lambda: eqx.filter_eval_shape(workload.make_state, sizes), reps),
    }
    manifest = json.loads((path / "manifest.json").read_bytes())
    out["manifest_bytes"] = (path / "manifest.json").stat().st_size
    out["structure_bytes"] = len(orjson.dumps(manifest["structure"]))
    out["record_over_save"] = out["record_s"] / out["save_s"]
    out["skeleton_over_filter_eval_shape"] = out["skeleton_s"] / out["filter_eval_shape_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="many", choices=sorted(workload.PRESETS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to save (default: a new temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        out = measure(args.preset, args.reps, Path(root))
    for name, value in out.items():
        print(f"{name:32s} {value:.4g}" if isinstance(value, float) else f"{name:32s} {value}")


if __name__ == "__main__":
    main()
