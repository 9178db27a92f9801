"""Host memory and time of `merge` against one read of its inputs and one write.

`python -m benchmarks.merge [--gib 1] [--leaves 32] [--methods linear,ties,slerp] [--rounds 1]
[--dir DIR] [--json FILE]`

Three models of `--gib` GiB of float32 each (`--leaves` equal leaves of
1024 columns, different values) are saved under `--dir`. Then, each in a
fresh process:

- `merge`, once per method of `--methods`: `linear` of the three, `ties`
  and `dare_ties` of the last two against the first as base (density 0.5),
  `task_arithmetic` likewise, `slerp` of the first two (t 0.5);
- the reference: every leaf of the inputs that method reads, read whole
  once (`np.asarray` of each lazy leaf, then dropped), plus one save of a
  model of the same size made in memory beforehand.

Each row reports `seconds` and `rss_added`: the peak resident memory over
what the process held before (sampled every 10 ms in a thread,
`benchmarks.gpu.PeakRSS`). The page cache is warm: the inputs were just
written. JAX's backend is made before either is measured. Prints a table; `--json` writes every row.

`--rounds N` measures each method's merge and reference N times, one after
the other in each round (`round` in each row), and prints the median of
the rounds' ratios of merge to reference: on a shared machine, a round's
two runs meet about the same load, which the ratio cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

from .staging import measure_in_fresh_process

MIB = 2**20


def plan(method: str, models: list[str]) -> dict[str, Any]:
    """The keyword arguments of `merge` for `method` over the three `models`."""
    if method == "linear":
        return {"inputs": models, "method": method}
    if method == "slerp":
        return {"inputs": models[:2], "method": method, "t": 0.5}
    options: dict[str, Any] = {"inputs": models[1:], "method": method, "base": models[0]}
    if method != "task_arithmetic":
        options["density"] = 0.5
    return options


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """One merge, or its reference (`job["reference"]`), in this (fresh) process."""
    import gc

    import numpy as np

    import eqx_ckpt

    from .gpu import PeakRSS

    options = plan(job["method"], job["models"])
    inputs = options.pop("inputs")
    if job["reference"]:
        read = [*inputs, options["base"]] if "base" in options else inputs
        model = {k: np.ones(v.shape, v.dtype) for k, v in eqx_ckpt.Checkpoint(inputs[0]).items()}
        gc.collect()
        with PeakRSS() as rss:
            start = time.perf_counter()
            for path in read:
                for leaf in eqx_ckpt.Checkpoint(path).values():
                    np.asarray(leaf)
            eqx_ckpt.tree_serialise_leaves(job["out"], model)
            seconds = time.perf_counter() - start
    else:
        import jax

        jax.devices()  # the backend made before, as the reference's arrays made it
        gc.collect()
        with PeakRSS() as rss:
            start = time.perf_counter()
            eqx_ckpt.merge(job["out"], inputs, **options)
            seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss_added": rss.added}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """`measure(job)` in a fresh Python process; its row (or its error)."""
    return measure_in_fresh_process("merge", job)


def make_models(root: str, gib: float, leaves: int) -> list[str]:
    """Three models of `gib` GiB of float32, saved under `root`, a leaf at a time in memory."""
    import numpy as np

    import eqx_ckpt

    rows = max(1, int(gib * 2**30) // (leaves * 1024 * 4))
    paths = []
    for m in range(3):
        rng = np.random.default_rng(m)
        model = {f"w{i:03d}": rng.standard_normal((rows, 1024), np.float32) for i in range(leaves)}
        paths.append(os.path.join(root, f"model{m}"))
        eqx_ckpt.tree_serialise_leaves(paths[-1], model)
        del model
    return paths


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'method':>16s} {'what':>9s} {'seconds':>8s} {'peak RSS added':>14s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:>16s} {r['what']:>9s} error: {r['error'].splitlines()[-1]}")
            continue
        lines.append(f"{r['method']:>16s} {r['what']:>9s} {r['seconds']:8.2f} {r['rss_added'] / MIB:10.0f} MiB")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> str:
    """Each method's median ratio of its merge's seconds to its reference's, over the rounds."""
    import statistics

    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        pairs: dict[int, dict[str, float]] = {}
        for r in rows:
            if r["method"] == method and "error" not in r:
                pairs.setdefault(r.get("round", 0), {})[r["what"]] = r["seconds"]
        each = [p["merge"] / p["reference"] for p in pairs.values() if len(p) == 2]
        if each:
            shown = ", ".join(f"{x:.2f}" for x in each)
            lines.append(f"{method:>16s} merge / reference: median {statistics.median(each):.2f}x ({shown})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of float32 per model")
    parser.add_argument("--leaves", type=int, default=32, help="leaves of equal size per model")
    parser.add_argument("--methods", default="linear,ties,slerp", help="comma-separated merge methods")
    parser.add_argument("--rounds", type=int, default=1, help="merge and reference measured this many times")
    parser.add_argument("--dir", default=None, help="where the models go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="eqx_ckpt_merge_", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        models = make_models(root, args.gib, args.leaves)
        for round_ in range(args.rounds):
            for method in [m for m in args.methods.split(",") if m]:
                for what in ("merge", "reference"):
                    out = os.path.join(root, f"out-{method}-{what}")
                    job = {"method": method, "models": models, "out": out, "reference": what == "reference"}
                    os.sync()  # what earlier writes left unwritten is written now, not during this one
                    row = {"method": method, "what": what, "gib": args.gib, "round": round_, **run_one(job)}
                    rows.append(row)
                    shutil.rmtree(out, ignore_errors=True)
                    print(table(rows[-1:]).splitlines()[1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows), flush=True)
    print(ratios(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
