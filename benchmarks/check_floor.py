"""What checking a published folder's bytes costs at least, on this machine.

    python -m benchmarks.check_floor --workload large --rounds 7 --reps 3

A load of a published folder checks every byte against the block digests its
`eqx_ckpt.json` records (issue 84): one BLAKE3 pass over the bytes, in blocks
of whole rows. However the load is built, that pass is CPU it must spend. So
the lowest CPU a checked load can take is the same load unchecked plus that
pass at the hash's best speed. This benchmark measures the three, in
alternating fresh processes (as `benchmarks.alternating` does), with this
tree only:

- `checked`: a warm `tree_deserialise_leaves` of the folder the workload was
  exported to (`export_safetensors`), into the abstract skeleton;
- `plain`: the same load of the same safetensors file without its
  `eqx_ckpt.json` (hard links to it in a folder of their own): a plain
  safetensors folder, whose bytes nothing records, so nothing checks;
- `hash`: the record's blocks of every tensor hashed by one thread, each
  piece read into one reused buffer (faulted in before the clock starts) and
  hashed right after, in cache: the CPU of the hashing alone. It is what a
  checked load must spend beyond an unchecked one, at the hash's best;
- `hash-fixed`: the same bytes hashed in blocks of 128 KiB (the record's
  `block_bytes`), not of whole rows: BLAKE3 at its fastest, a power of two of
  its 1 KiB chunks a block. The floor of any block layout.

Each round gives `checked / plain` (what checking costs now) and `(plain +
hash) / plain` (the floor: what it would cost if the check cost nothing but
the hash, overlapped perfectly), CPU time and wall time; the medians over the
rounds, with 95% intervals bootstrapped over them (`alternating.paired`).
For wall time the floor assumes the hash's CPU adds to the load's wall time
as it adds to its CPU time, in the proportion of the plain load's cores
busy (its CPU over its wall): exact when the plain load keeps every core
busy, as on the 2-core machine these figures are from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from typing import Any

from benchmarks import alternating

ARMS = ("plain", "checked", "hash", "hash-fixed")
# Each tensor is read and hashed a piece of about this many bytes at a time
# (whole blocks), as a checked load reads a local file (`_local_read.FILL_BYTES`).
PIECE_BYTES = 2**20


def work(job: dict[str, Any]) -> dict[str, Any]:
    """One process's part: warm up once, then `reps` timed operations of its arm."""
    import jax

    import eqx_ckpt

    folder, arm = job["folder"], job["arm"]
    if arm.startswith("hash"):
        operation = hashing(os.path.join(folder, "published"), fixed=arm == "hash-fixed")
        operation()  # warm-up
        times = [operation() for _ in range(job["reps"])]
    else:
        workload = alternating.load_workload()
        like = workload.skeleton(workload.PRESETS[job["workload"]])
        path = os.path.join(folder, "published" if arm == "checked" else "plain")

        def load() -> None:
            jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(path, like))

        load()  # warm-up
        times = [alternating.timed(load, lambda: None) for _ in range(job["reps"])]
    return {"library": eqx_ckpt.__file__, "wall": [t[0] for t in times], "cpu": [t[1] for t in times]}


def blocks(published: str, *, fixed: bool = False) -> list[tuple[str, int, int, int]]:
    """`(name, offset in the file, bytes, block)` of each tensor of the folder
    `published` (one safetensors file), cut into blocks as its record cuts
    them (`_digests.leaf_block`); `fixed`: in blocks of the record's
    `block_bytes` instead (`hash-fixed`)."""
    from eqx_ckpt._foreign._safetensors import DTYPES
    from eqx_ckpt._ondisk import _digests
    from eqx_ckpt._ondisk._format import dtype_from_name

    with open(os.path.join(published, "eqx_ckpt.json"), "rb") as f:
        most = json.loads(f.read())["block_bytes"]
    with open(os.path.join(published, "model.safetensors"), "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = []
    for name, tensor in header.items():
        if name != "__metadata__":
            start, end = tensor["data_offsets"]
            itemsize = dtype_from_name(DTYPES[tensor["dtype"]]).itemsize
            block = most if fixed else _digests.leaf_block(tensor["shape"], itemsize, most)
            out.append((name, 8 + length + start, end - start, block))
    return out


def hashing(published: str, *, fixed: bool = False) -> Any:
    """The `hash` arm's operation for the folder `published` (`fixed`: the
    `hash-fixed` arm's): it returns the (wall, CPU) seconds of the hashing
    alone, reads left out."""
    from eqx_ckpt._ondisk import _digests

    # Each tensor's pieces: whole blocks, about `PIECE_BYTES` of them.
    tensors = [
        (offset, nbytes, block, max(block, PIECE_BYTES // block * block))
        for _, offset, nbytes, block in blocks(published, fixed=fixed)
    ]
    view = memoryview(bytearray(max(t[3] for t in tensors)))  # (faulted in by the warm-up, before the timed operations)
    path = os.path.join(published, "model.safetensors")

    def operation() -> tuple[float, float]:
        wall = cpu = 0.0
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, nbytes, block, piece in tensors:
                for done in range(0, nbytes, piece):
                    n = os.preadv(fd, [view[: min(piece, nbytes - done)]], offset + done)
                    started, thread = time.perf_counter(), time.thread_time()
                    _digests._hash(view[:n], block, _digests.BLAKE3)
                    cpu += time.thread_time() - thread
                    wall += time.perf_counter() - started
        finally:
            os.close(fd)
        return wall, cpu

    return operation


def plain_copy(published: str, plain: str) -> None:
    """`plain`: the safetensors files of `published`, hard-linked (copied where
    links cannot be made), without its `eqx_ckpt.json`."""
    os.makedirs(plain)
    for name in os.listdir(published):
        if name.endswith(".safetensors"):
            try:
                os.link(os.path.join(published, name), os.path.join(plain, name))
            except OSError:
                shutil.copyfile(os.path.join(published, name), os.path.join(plain, name))


def floors(rounds: dict[str, dict[str, list[float]]], arm: str = "hash") -> dict[str, list[float]]:
    """Each round's floor of `checked / plain` (its `plain` and `arm` medians),
    for CPU and for wall time."""
    plain, hashed = rounds["plain"], rounds[arm]
    out: dict[str, list[float]] = {"cpu": [], "wall": []}
    for wall, cpu, hash_cpu in zip(plain["wall"], plain["cpu"], hashed["cpu"]):
        cores = cpu / wall
        out["cpu"].append((cpu + hash_cpu) / cpu)
        out["wall"].append((wall + hash_cpu / cores) / wall)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="large", choices=["many", "small", "large", "tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="where the folders are written (default: a temporary folder)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        alternating.answer(work, args.job)
        return
    with tempfile.TemporaryDirectory(prefix="check-floor-", dir=args.scratch) as scratch:
        print(report(measure(args, scratch), args))


def measure(args: argparse.Namespace, scratch: str) -> dict[str, dict[str, list[float]]]:
    """Each arm's medians, round by round (`{arm: {"wall": [...], "cpu": [...]}}`)."""
    tree = os.path.dirname(alternating.HERE)
    job = {"workload": args.workload, "folder": scratch, "reps": args.reps, "published": True}
    alternating.run(tree, {**job, "op": "prepare"})
    plain_copy(os.path.join(scratch, "published"), os.path.join(scratch, "plain"))
    rounds: dict[str, dict[str, list[float]]] = {arm: {"wall": [], "cpu": []} for arm in ARMS}
    for round_ in range(args.rounds):
        for arm in ARMS:
            result = alternating.run(tree, {**job, "arm": arm}, script=os.path.abspath(__file__))
            for kind in ("wall", "cpu"):
                rounds[arm][kind].append(statistics.median(result[kind]))
            walls, cpus = (", ".join(f"{t:.3f}" for t in result[kind]) for kind in ("wall", "cpu"))
            load = os.getloadavg()[0]
            print(f"round {round_ + 1} {arm}: wall {walls}; CPU {cpus}; load average {load:.2f}", flush=True)
    return rounds


def report(rounds: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    """The figures of `measure`: each arm's medians, then the ratios and floors."""
    lines = [f"{args.workload}, {len(rounds['plain']['cpu'])} rounds x {args.reps} in alternating processes:"]
    for arm in ARMS:
        walls, cpus = rounds[arm]["wall"], rounds[arm]["cpu"]
        lines.append(f"  {arm:>10}: wall {alternating.summary(walls)}; CPU {alternating.summary(cpus)}")
    for kind in ("cpu", "wall"):
        now = alternating.paired(rounds["plain"][kind], rounds["checked"][kind])
        lines.append(f"  checked, {kind}: {alternating.verdict('checked', 'plain', now)}")
        for arm in ARMS[2:]:
            floor = floors(rounds, arm)[kind]
            low, high = alternating.paired([1.0] * len(floor), floor)[1:]
            said = f"{statistics.median(floor):.3f}x plain (95% interval {low:.3f}-{high:.3f})"
            lines.append(f"  floor with {arm}, {kind}: {said}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
