"""Run the checkpoint benchmarks: `python -m benchmarks.run --workload large`.

Every measurement runs in a fresh subprocess (`benchmarks.worker`), one at a time,
`--reps` times. Results are written as JSON lines to
`benchmarks/results/<workload>.jsonl` (rewritten for each workload run); then,
unless `--no-report`, `docs/benchmarks.md` and `docs/benchmarks.png` are
regenerated from every results file there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import psutil

from . import contenders, workload

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ALL_CONTENDERS = list(contenders.CONTENDERS)
# Which operations each workload measures; `open` only where it means something.
OPS = {
    "large": ["save", "load_cold", "load_warm", "params_cold", "params_warm"],
    "small": ["save", "load_cold", "load_warm", "params_cold", "params_warm"],
    "many": ["save", "load_cold", "load_warm", "open_cold", "open_warm"],
    "tiny": ["save", "load_cold", "load_warm", "params_cold", "params_warm", "open_cold", "open_warm"],
}


def run_job(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its result."""
    wait_for_memory(job)
    command = [sys.executable, "-m", "benchmarks.worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(HERE))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"benchmark job {job} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def wait_for_memory(job: dict[str, Any], patience: float = 300.0) -> None:
    """Other people share this machine: wait until three copies of the state fit."""
    needed = 3 * workload.state_bytes(workload.skeleton(workload.Sizes(**job["sizes"])))
    deadline = time.monotonic() + patience
    while psutil.virtual_memory().available < needed and time.monotonic() < deadline:
        time.sleep(5)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def has_op(name: str, op: str) -> bool:
    return not op.startswith("open") or hasattr(contenders.CONTENDERS[name], "open_lazy")


def bench_workload(names: list[str], ops: list[str], base: dict[str, Any], directory: str, reps: int, log: Any) -> None:
    """Every contender saves (`reps` times, keeping the last checkpoint); then the
    loads run interleaved, contender after contender within each repetition, so
    a change in machine load hits them all alike. Checkpoints are deleted after."""
    paths = {name: os.path.join(directory, name + contenders.CONTENDERS[name].suffix) for name in names}

    def one(name: str, op: str, rep: int) -> None:
        kind, _, cache = op.partition("_")
        job = {**base, "contender": name, "op": kind, "cache": cache or None, "path": paths[name], "rep": rep}
        try:
            result = run_job(job, timeout=1800)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            # Keep going: one failed measurement should not cost the whole run.
            print(f"  {name:12s} {op:12s} rep {rep}: FAILED\n{e}", flush=True)
            return
        log.write(json.dumps(result) + "\n")
        log.flush()
        print(f"  {name:12s} {op:12s} rep {rep}: {result['seconds']:.3f} s", flush=True)

    try:
        for name in names:
            for rep in range(reps):
                one(name, "save", rep)
        for rep in range(reps):
            for op in ops:
                for name in names:
                    if op != "save" and has_op(name, op):
                        one(name, op, rep)
    finally:
        for path in paths.values():
            remove(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(workload.PRESETS), action="append", help="repeatable")
    parser.add_argument("--all", action="store_true", help="small, many and large")
    parser.add_argument("--contenders", default=",".join(ALL_CONTENDERS), help="comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ops", help="comma-separated subset of the workload's operations, e.g. save,load_warm")
    parser.add_argument("--layers", type=int, help="override the workload's number of blocks")
    parser.add_argument("--width", type=int, help="override the workload's width")
    parser.add_argument("--vocab", type=int, help="override the workload's vocabulary")
    parser.add_argument("--results", default=RESULTS, help="where results and checkpoints go")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite docs/benchmarks.*")
    args = parser.parse_args(argv)
    workloads = ["small", "many", "large"] if args.all else (args.workload or ["small"])
    names = [n for n in args.contenders.split(",") if n]
    os.makedirs(args.results, exist_ok=True)
    for name in workloads:
        sizes = workload.PRESETS[name]
        overrides = {k: getattr(args, k) for k in ("layers", "width", "vocab") if getattr(args, k)}
        sizes = workload.Sizes(**{**sizes.__dict__, **overrides})
        base = {"workload": name, "sizes": sizes.__dict__, "verify": name == "tiny"}
        directory = os.path.join(args.results, f"run-{name}")
        os.makedirs(directory, exist_ok=True)
        print(f"{name}: {sizes}, {workload.state_bytes(workload.skeleton(sizes)) / 1e9:.3f} GB", flush=True)
        with open(os.path.join(args.results, f"{name}.jsonl"), "w") as log:
            ops = [op for op in OPS[name] if not args.ops or op in args.ops.split(",")]
            bench_workload(names, ops, base, directory, args.reps, log)
        shutil.rmtree(directory, ignore_errors=True)
    if not args.no_report:
        from . import report

        report.write(
            args.results, " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
        )


if __name__ == "__main__":
    main()
