"""Peak host memory of a save against its staging budget (issue 50, item 3).

`python -m benchmarks.staging [--gib 1] [--leaves 64] [--budgets default,64] [--cast bfloat16] [--reps 1]
[--dir DIR] [--json FILE]`

A state of `--gib` GiB of float32 `jax.Array`s in `--leaves` equal leaves is
made on the default device, then saved into a fresh directory under `--dir`
with `cast=--cast` (a cast makes new host arrays, so a save on a CPU, where a
`jax.Array`'s host data is a view of its buffer, still has host data to
stage; `--cast none` saves as it is), once per budget of `--budgets`:
`default` calls `tree_serialise_leaves` without `staging_bytes` (the library's
default, or, for an eqx_ckpt from before the budget, whatever it did), a
number is `staging_bytes` in MiB. Each save runs in a fresh process (so that
no save's freed memory is another's peak), and reports:

- `seconds`: the wall time of the blocking save (durable when it returns);
- `rss_added`: the peak resident memory of the process during the save over
  what it held before (the state included), sampled every 10 ms in a thread
  (`benchmarks.gpu.PeakRSS`);
- `staged_peak`: the most bytes the save reported staged (the fault point
  `save.staged`; absent for an eqx_ckpt without it).

Prints a table; `--json` writes every row. Run it once with this checkout
and once with an older one on `PYTHONPATH` to compare (docs/benchmarks.md,
"A save's host memory").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MIB = 2**20


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """One save, in this (fresh) process."""
    import gc

    import jax
    import jax.numpy as jnp

    import eqx_ckpt

    from .gpu import PeakRSS

    leaves, gib = job["leaves"], job["gib"]
    rows = max(1, int(gib * 2**30) // (leaves * 1024 * 4))
    state = {f"w{i:03d}": jnp.full((rows, 1024), i + 0.5, jnp.float32) for i in range(leaves)}
    jax.block_until_ready(state)
    kwargs: dict[str, Any] = {}
    if job["cast"] != "none":
        kwargs["cast"] = jnp.dtype(job["cast"])
    if job["budget"] != "default":
        kwargs["staging_bytes"] = int(float(job["budget"]) * MIB)
    staged = _staged_probe()
    gc.collect()
    with staged, PeakRSS() as rss:
        start = time.perf_counter()
        eqx_ckpt.tree_serialise_leaves(job["path"], state, **kwargs)
        seconds = time.perf_counter() - start
    row = {"seconds": seconds, "rss_added": rss.added, "state_bytes": sum(x.nbytes for x in state.values())}
    if staged.peak is not None:
        row["staged_peak"] = staged.peak
    return row


class _staged_probe:
    """The most bytes `save.staged` reported during a `with` block (`None`
    where the fault point does not exist: an eqx_ckpt from before it)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._lock = threading.Lock()
        self._armed: Any = None

    def _record(self, nbytes: int, budget: int) -> None:
        with self._lock:
            self.peak = max(self.peak or 0, nbytes)

    def __enter__(self) -> _staged_probe:
        from eqx_ckpt._base import _faults

        if "save.staged" in _faults.POINTS:
            self._armed = _faults.armed("save.staged", self._record)
            self._armed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._armed is not None:
            self._armed.__exit__(*exc)


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """`measure(job)` in a fresh Python process; its row (or its error)."""
    return measure_in_fresh_process("staging", job)


def measure_in_fresh_process(module: str, job: dict[str, Any]) -> dict[str, Any]:
    """`benchmarks.<module>.measure(job)` in a fresh Python process, its
    result printed as JSON on its last line; that row (or its error)."""
    code = (
        f"import json, sys; from benchmarks import {module} as m; print(json.dumps(m.measure(json.loads(sys.argv[1]))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'budget':>8s} {'rep':>3s} {'seconds':>8s} {'peak RSS added':>14s} {'staged peak':>11s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['budget']:>8s} {r['rep']:3d} error: {r['error'].splitlines()[-1]}")
            continue
        staged = f"{r['staged_peak'] / MIB:7.0f} MiB" if "staged_peak" in r else f"{'-':>11s}"
        lines.append(f"{r['budget']:>8s} {r['rep']:3d} {r['seconds']:8.2f} {r['rss_added'] / MIB:10.0f} MiB {staged}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of float32 state")
    parser.add_argument("--leaves", type=int, default=64, help="leaves of equal size")
    parser.add_argument("--budgets", default="default,64", help="comma-separated: `default` or MiB")
    parser.add_argument("--cast", default="bfloat16", help="the dtype saved (`none`: as it is)")
    parser.add_argument("--reps", type=int, default=1, help="saves of each budget")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="eqx_ckpt_staging_", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for budget in [b for b in args.budgets.split(",") if b]:
                path = os.path.join(root, f"{budget}-{rep}")
                job = {"gib": args.gib, "leaves": args.leaves, "cast": args.cast, "budget": budget, "path": path}
                os.sync()  # what earlier saves left unwritten is written now, not during this one
                rows.append({"budget": budget, "rep": rep, **run_one(job)})
                shutil.rmtree(path, ignore_errors=True)
                print(table(rows[-1:]).splitlines()[1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
