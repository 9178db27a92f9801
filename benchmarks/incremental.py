"""Incremental saves: a fine-tuning run whose large base never changes.

`python -m benchmarks.incremental [--base-gib 1] [--head-mib 24] [--steps 6] [--reps 5] [--dir DIR] [--json FILE]`

The workload of SPEC §4: a frozen base of `--base-gib` GiB (float32
`jax.Array`s of 64 MiB) and a trainable head of `--head-mib` MiB (arrays of
4 MiB) that changes at every step. The base is new array objects with the
same values at every step (`p + 0`, as an optimiser update that leaves it
alone gives), so nothing but its bytes tells that it did not change.

It measures, in one run:

- `fresh_head`: a first save of only the head into a new directory (the cost of
  writing just the changed bytes), the median of `--reps`;
- `checksum_pass`: one crc32c pass over the base's bytes in memory, the
  median of `--reps`; with `fresh_head`, the floor of a step (SPEC §4);
- `manager_first`: a `CheckpointManager`'s first step (step 0: the whole tree,
  nothing to follow), which records the digest of every chunk file it writes;
- `manager_step`: a manager's step of the whole tree (base and head) after
  the first, the median over `--steps` steps, and the disk each step adds
  (blocks of files not seen before, so a hard-linked file counts once); the
  first of them (`first_step`, the second step of the run) and the others
  (`steady_step`, a training loop's steady state) read nothing back, as the
  steps before them recorded what they wrote (a step that follows steps
  another process wrote reads each of their files once, to verify it);
- `manager_changed` and `after_changed`: a manager's step where every byte
  changed, then a step of the same tree again (nothing changed: every file
  shared, none read back), medians of `--reps`;
- `first_save` and `overwrite_changed`: a first save of the whole tree into a new
  directory, and an overwrite of it where every byte changed (the cost of
  comparing, plus the old generation's deletion), medians of `--reps`.

- `small_step_added_bytes`: the same fine-tune of a small model, every leaf
  packed (issue 59): a frozen base of `--small-base-mib` MiB in float32
  leaves of 60 KiB and a head of `--small-head-kib` KiB between them, a
  manager's steps (`--steps`) and the disk each adds, against the bytes
  that changed (`small_changed_bytes`): at most the changed bytes + 1 MiB.

Then prints the ratios SPEC §4 bounds (steady step / its floor <= 1.25, disk
per step / changed bytes <= 1.2, overwrite / first save <= 1.5), the first
step's against the floor, the manager's saves where everything is written
against a first save, and the earlier step / fresh head.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import crc32c
import jax
import jax.numpy as jnp
import numpy as np

import eqx_ckpt

BASE_LEAF = (4096, 4096)  # 64 MiB of float32
HEAD_LEAF = (1024, 1024)  # 4 MiB of float32


def make_tree(base_gib: float, head_mib: float) -> dict[str, Any]:
    n_base = max(1, round(base_gib * 2**30 / (BASE_LEAF[0] * BASE_LEAF[1] * 4)))
    n_head = max(1, round(head_mib * 2**20 / (HEAD_LEAF[0] * HEAD_LEAF[1] * 4)))
    key = jax.random.key(0)
    base = {f"layer{i:03d}": jax.random.normal(jax.random.fold_in(key, i), BASE_LEAF) for i in range(n_base)}
    head = {f"w{i}": jnp.full(HEAD_LEAF, 0.5 + i, jnp.float32) for i in range(n_head)}
    tree = {"base": base, "head": head, "step": 0}
    jax.block_until_ready(tree)
    return tree


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def disk_blocks(directory: str, seen: set[tuple[int, int]]) -> int:
    """Bytes of the blocks of the files under `directory` not in `seen` (by
    device and inode), which it then holds."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def step_tree(tree: dict[str, Any], step: int) -> dict[str, Any]:
    """The next step's tree: the base as new arrays of the same bytes, the head changed."""
    base = {k: v + 0 for k, v in tree["base"].items()}
    head = {k: v + step for k, v in tree["head"].items()}
    out = {"base": base, "head": head, "step": step}
    jax.block_until_ready(out)
    return out


def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    tree = make_tree(args.base_gib, args.head_mib)
    head_bytes = nbytes(tree["head"])
    # Once before any timing: the first save of a process pays for imports and thread pools.
    eqx_ckpt.tree_serialise_leaves(os.path.join(root, "warm-up"), step_tree(tree, 1)["head"])
    fresh = []
    for r in range(args.reps):
        head = {k: v + r for k, v in tree["head"].items()}
        jax.block_until_ready(head)
        fresh.append(timed(lambda r=r, h=head: eqx_ckpt.tree_serialise_leaves(os.path.join(root, f"head{r}"), h)))
    # Host views of the base (a jax.Array on the CPU needs no copy), as a save takes them.
    hosts = [np.asarray(x) for x in tree["base"].values()]
    checksum = [timed(lambda: [crc32c.crc32c(h) for h in hosts]) for _ in range(args.reps)]
    manager = manager_steps(args, tree, os.path.join(root, "run"))
    first, overwrite = [], []
    for r in range(args.reps):
        path = os.path.join(root, f"full{r}")
        first.append(timed(lambda p=path: eqx_ckpt.tree_serialise_leaves(p, tree)))
        changed = jax.tree_util.tree_map(lambda x: x + 1, tree)
        jax.block_until_ready(changed)
        overwrite.append(timed(lambda p=path, c=changed: eqx_ckpt.tree_serialise_leaves(p, c)))
        shutil.rmtree(path)
    result = {
        "base_bytes": nbytes(tree["base"]),
        "head_bytes": head_bytes,
        "fresh_head_s": fresh,
        "checksum_pass_s": checksum,
        **manager,
        "first_save_s": first,
        "overwrite_changed_s": overwrite,
    }
    steps, added = manager["manager_step_s"], manager["step_added_bytes"]
    floor = statistics.median(fresh) + statistics.median(checksum)
    result["ratios"] = {
        "steady_step_over_floor": statistics.median(steps[1:] or steps) / floor,
        "worst_steady_step_over_floor": max(steps[1:] or steps) / floor,
        "first_step_over_floor": steps[0] / floor,
        "step_over_fresh_head": statistics.median(steps) / statistics.median(fresh),
        "worst_step_over_fresh_head": max(steps) / statistics.median(fresh),
        "disk_per_step_over_changed": statistics.median(added) / head_bytes,
        "overwrite_over_first_save": statistics.median(overwrite) / statistics.median(first),
        "manager_first_over_first_save": manager["manager_first_s"] / statistics.median(first),
        "manager_changed_over_first_save": statistics.median(manager["manager_changed_s"]) / statistics.median(first),
    }
    return result


def manager_steps(args: argparse.Namespace, tree: dict[str, Any], directory: str) -> dict[str, Any]:
    """A manager's steps: the first, `--steps` more of the workload, then
    `--reps` pairs of a step where every byte changed and one where nothing did."""
    steps, added, changed, after = [], [], [], []
    seen: set[tuple[int, int]] = set()
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=3) as manager:
        for step in range(args.steps + 1):
            current = step_tree(tree, step)
            seconds = timed(lambda s=step, c=current: manager.save(s, c))
            grew = disk_blocks(manager.step_path(step), seen)
            if step:
                steps.append(seconds)
                added.append(grew)
            else:  # the first step writes everything
                first = seconds
        for r in range(args.reps):
            step = args.steps + 1 + 2 * r
            current = jax.tree_util.tree_map(lambda x, r=r: x + 1 + r, tree)
            jax.block_until_ready(current)
            changed.append(timed(lambda s=step, c=current: manager.save(s, c)))
            after.append(timed(lambda s=step, c=current: manager.save(s + 1, c)))
    return {
        "manager_first_s": first,
        "manager_step_s": steps,
        "step_added_bytes": added,
        "manager_changed_s": changed,
        "after_changed_s": after,
    }


SMALL_LEAF = 15 * 1024  # 60 KiB of float32: packed


def small_tree(base_mib: float, head_kib: float, step: int) -> dict[str, Any]:
    """A small model, every leaf packed: half the frozen base before the head,
    half after it (in flattening order), the head's values set by `step`."""
    count = max(2, round(base_mib * 2**20 / (SMALL_LEAF * 4)))
    rng = np.random.default_rng(0)
    frozen = [rng.standard_normal(SMALL_LEAF, dtype=np.float32) for _ in range(count)]
    head = np.full(max(1, round(head_kib * 1024 / 4)), 0.5 + step, np.float32)
    half = count // 2
    return {
        "a_base": {f"l{i:03d}": x + 0 for i, x in enumerate(frozen[:half])},
        "head": head,
        "z_base": {f"l{i:03d}": x + 0 for i, x in enumerate(frozen[half:])},
        "step": step,
    }


def small_steps(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """A manager's steps of `small_tree`: the disk each adds after the first."""
    added: list[int] = []
    seen: set[tuple[int, int]] = set()
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=3) as manager:
        for step in range(args.steps + 1):
            manager.save(step, small_tree(args.small_base_mib, args.small_head_kib, step))
            grew = disk_blocks(manager.step_path(step), seen)
            if step:
                added.append(grew)
    tree = small_tree(args.small_base_mib, args.small_head_kib, 0)
    return {
        "small_base_bytes": nbytes({k: tree[k] for k in ("a_base", "z_base")}),
        "small_changed_bytes": tree["head"].nbytes + 8,  # the head and `step` (an int64)
        "small_step_added_bytes": added,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-gib", type=float, default=1.0)
    parser.add_argument("--head-mib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--small-base-mib", type=float, default=12.0)
    parser.add_argument("--small-head-kib", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="eqx_ckpt_incremental_", dir=args.dir)
    try:
        result = measure(args, root)
        result.update(small_steps(args, os.path.join(root, "small")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    print(f"base {result['base_bytes'] / 2**20:.0f} MiB, head {result['head_bytes'] / 2**20:.0f} MiB")
    print(f"fresh save of the head:     median {med(result['fresh_head_s']):.3f} s")
    print(f"crc32c pass over the base:  median {med(result['checksum_pass_s']):.3f} s")
    print(f"manager's first step:       {result['manager_first_s']:.3f} s")
    steps = result["manager_step_s"]
    print(f"manager step (whole tree):  median {med(steps):.3f} s, worst {max(steps):.3f} s")
    print(f"  first (the run's second): {steps[0]:.3f} s")
    if steps[1:]:
        print(f"  steady (the others):      median {med(steps[1:]):.3f} s, worst {max(steps[1:]):.3f} s")
    print(f"disk added per step:        median {med(result['step_added_bytes']) / 2**20:.1f} MiB")
    print(f"manager step, all changed:  median {med(result['manager_changed_s']):.3f} s")
    print(f"  then the same tree again: median {med(result['after_changed_s']):.3f} s")
    print(f"first save of the tree:     median {med(result['first_save_s']):.3f} s")
    print(f"overwrite, all changed:     median {med(result['overwrite_changed_s']):.3f} s")
    small, changed = result["small_step_added_bytes"], result["small_changed_bytes"]
    print(
        f"small model, all packed:    base {result['small_base_bytes'] / 2**20:.1f} MiB, {changed} bytes changed "
        f"a step, disk added per step median {med(small) / 2**10:.0f} KiB, worst {max(small) / 2**10:.0f} KiB"
    )
    print(f"  worst step - changed:     {(max(small) - changed) / 2**20:.3f} MiB (at most 1 MiB)")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
