"""A blocking save of a state on the accelerator, by staging budget: seconds
and peak resident memory added (docs/benchmarks.md, "GPU").

`python -m benchmarks.gpu_budget [--gib 4] [--budgets default,1024,512,256]`

One process: a state of `--gib` GiB of float32 made on the default device
(`benchmarks.gpu.make_state`), one save first (the process's first copy to the
host, reported apart: the JAX runtime's first copy costs more and leaves memory
resident), then one save per budget in MiB (`default`: the library's own),
each into a fresh directory under `--dir`, with the peak bytes staged that
the fault point `save.staged` reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import jax.numpy as jnp

import eqx_ckpt
from eqx_ckpt._base import _faults

from . import gpu


def save(root: str, state: dict, label: str, budget: int | None) -> dict[str, Any]:
    path = os.path.join(root, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    staged = [0]
    nbytes = sum(x.nbytes for x in state.values())
    with _faults.armed("save.staged", lambda n, _: staged.__setitem__(0, max(staged[0], n))):
        _, figures = gpu.timed(lambda: eqx_ckpt.tree_serialise_leaves(path, state, staging_bytes=budget), nbytes)
    print(
        f"{label:28s} {figures['seconds']:7.2f} s   peak RSS added {figures['rss_added'] >> 20:6d} MiB   "
        f"staged {staged[0] >> 20} MiB"
    )
    return {"label": label, **figures, "staged_peak": staged[0], "budget": budget}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=gpu.FULL_GIB)
    parser.add_argument("--budgets", default="default,1024,512,256", help="MiB, or `default`")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)
    state = gpu.make_state(args.gib, jnp.float32)
    root = tempfile.mkdtemp(prefix="eqx_ckpt_budget_", dir=args.dir)
    try:
        rows = [save(root, state, "first save (1024 MiB)", 1 << 30)]
        for name in args.budgets.split(","):
            budget = None if name == "default" else int(name) << 20
            rows.append(save(root, state, f"budget {name}", budget))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
