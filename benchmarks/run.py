"""Run the checkpoint benchmarks: `python -m benchmarks.run --workload large`.

Every measurement runs in a fresh subprocess (`benchmarks.worker`), one at a time,
`--save-reps` times for saves and `--reps` times for loads; the `foreign`
workload's loads of safetensors files (`benchmarks/foreign.py`) `--foreign-reps`
times. Results are written as JSON lines to
`benchmarks/results/<workload>.jsonl` (rewritten for each workload run); then,
unless `--no-report`, `docs/benchmarks.md` and `docs/benchmarks.png` are
regenerated from every results file there. A measurement that fails (an
exception, a crash, a timeout) is written as a line with an `error` and the run
goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import psutil

from . import contenders, foreign, workload

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ALL_CONTENDERS = list(contenders.CONTENDERS)
# Which operations each workload measures; `open` only where it means something.
# `save_async` is run by the contenders that have it (eqx_ckpt), next to `save`.
OPS = {
    "large": ["save", "save_async", "load_cold", "load_warm", "params_cold", "params_warm"],
    "small": ["save", "save_async", "load_cold", "load_warm", "params_cold", "params_warm"],
    "many": ["save", "save_async", "load_cold", "load_warm", "open_cold", "open_warm"],
    "tiny": ["save", "save_async", "load_cold", "load_warm", "params_cold", "params_warm", "open_cold", "open_warm"],
}
SAVES = ("save", "save_async")
FOREIGN = "foreign"
# Seconds one measurement may take before it is recorded as failed.
JOB_TIMEOUT = 1800.0


def run_job(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its result (a failed
    measurement's result has an `error`; a crash raises `RuntimeError`)."""
    wait_for_memory(job_bytes(job))
    command = [sys.executable, "-m", "benchmarks.worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(HERE))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"worker exited with status {done.returncode} and no result:\n{done.stderr[-4000:]}")


@functools.cache
def state_bytes(sizes: workload.Sizes) -> int:
    # Once per workload: tracing the `many` skeleton takes seconds.
    return workload.state_bytes(workload.skeleton(sizes))


def job_bytes(job: dict[str, Any]) -> int:
    """The bytes of the state a job saves or loads (of the files, for `foreign`)."""
    if job["workload"] == FOREIGN:
        return sum(os.path.getsize(f) for f in foreign.files_of(job["path"]))
    return state_bytes(workload.Sizes(**job["sizes"]))


def wait_for_memory(nbytes: int, patience: float = 300.0) -> None:
    """Other people share this machine: wait until three copies of the state fit."""
    needed = 3 * nbytes
    deadline = time.monotonic() + patience
    while psutil.virtual_memory().available < needed and time.monotonic() < deadline:
        time.sleep(5)


def disk_needed(sizes: workload.Sizes, names: list[str], ops: list[str]) -> int:
    """Bytes a workload's checkpoints take at once: every contender's last
    save is kept until the loads are done, and eqx_ckpt's asynchronous save
    writes a second checkpoint beside its first. A tenth more for formats'
    overheads, and 1 GB to spare."""
    copies = len(names) + sum(1 for name in names if "save_async" in ops and has_op(name, "save_async"))
    return int(copies * state_bytes(sizes) * 1.1) + 10**9


def foreign_disk_needed(tensors: int, large_gib: float) -> int:
    """Bytes the `foreign` workload's files take (they are only read), and 1 GB to spare."""
    return foreign.disk_needed(tensors, large_gib) + 10**9


def check_disk(directory: str, needed: int) -> None:
    """Refuse to start a run the disk cannot hold (a full disk made one fail
    midway, after many minutes, with a contender's save)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SystemExit(
            f"The benchmark needs about {needed / 1e9:.1f} GB free under {directory!r} for its checkpoints, "
            f"and {free / 1e9:.1f} GB are. Free some space, pass `--results` on a larger disk, or measure "
            f"fewer contenders (`--contenders`) or workloads."
        )


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def has_op(name: str, op: str) -> bool:
    contender = contenders.CONTENDERS[name]
    if op.startswith("open"):
        return hasattr(contender, "open_lazy")
    if op == "save_async":
        return hasattr(contender, "save_async")
    return True


def split_op(op: str) -> tuple[str, str | None]:
    """`load_cold` -> (`load`, `cold`); the saves have no page-cache state."""
    if op in SAVES:
        return op, None
    kind, _, cache = op.partition("_")
    return kind, cache or None


def rotated(names: list[str], rep: int) -> list[str]:
    """The contenders in the order repetition `rep` runs them: each repetition
    starts one further along, so no contender always runs first. (The first
    load after a change of cache state pays for memory the VM handed back to
    its host: a warm `large` load took 3.8-5.3 s there and 1.6 s after another
    warm load.)"""
    shift = rep % len(names) if names else 0
    return names[shift:] + names[:shift]


def measure_job(job: dict[str, Any], log: Any) -> dict[str, Any]:
    """Run one measurement (`run_job`), write its result to `log` and print it.
    A failure is recorded as a result with an `error`, and the run goes on."""
    started = time.monotonic()
    try:
        result = run_job(job, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        result = {**job, "error": f"timed out after {JOB_TIMEOUT:.0f} s"}
    except Exception as e:
        # Keep going: one failed measurement should not cost the whole run.
        result = {**job, "error": f"{type(e).__name__}: {e}"[-4000:]}
    # The whole job, process start and set-up included (for run-time estimates).
    result["job_seconds"] = time.monotonic() - started
    show(result, log)
    return result


def show(result: dict[str, Any], log: Any) -> None:
    log.write(json.dumps(result) + "\n")
    log.flush()
    name, rep = result["contender"], result["rep"]
    op = result["op"] + (f"_{result['cache']}" if result.get("cache") else "")
    if "error" in result:
        print(f"  {name:12s} {op:12s} rep {rep}: FAILED: {result['error']}", flush=True)
    else:
        blocked = f" (blocked {result['blocked']:.3f} s, floor {result['floor']:.3f} s)" if "blocked" in result else ""
        print(f"  {name:12s} {op:12s} rep {rep}: {result['seconds']:.3f} s{blocked}", flush=True)


def bench_workload(
    names: list[str],
    ops: list[str],
    base: dict[str, Any],
    directory: str,
    reps: int,
    log: Any,
    *,
    save_reps: int | None = None,
) -> list[dict[str, Any]]:
    """Every contender saves `save_reps` times (`reps` when not given), keeping the last checkpoint (with
    `save_async` in `ops`, each synchronous save is followed by an asynchronous
    one of the same tree to another path); then the loads run. Both run
    interleaved, contender after contender within each repetition (starting
    one further along in each, `rotated`), so a change in machine load hits
    them all alike.
    Checkpoints are deleted after. Returns the failures."""
    suffix = {name: contenders.CONTENDERS[name].suffix for name in names}
    paths = {name: os.path.join(directory, name + suffix[name]) for name in names}
    async_paths = {name: os.path.join(directory, name + "-async" + suffix[name]) for name in names}
    failures: list[dict[str, Any]] = []

    def one(name: str, op: str, rep: int) -> None:
        kind, cache = split_op(op)
        path = async_paths[name] if op == "save_async" else paths[name]
        job = {**base, "contender": name, "op": kind, "cache": cache, "path": path, "rep": rep}
        if kind not in SAVES and not os.path.lexists(path):
            result = {**job, "error": "no checkpoint to read (the contender's last save failed)"}
            show(result, log)
        else:
            result = measure_job(job, log)
        if "error" in result:
            failures.append(result)

    try:
        # Interleaved and rotated like the loads: a save of each contender in
        # turn, so that a change in machine load does not fall on one of them.
        for rep in range(reps if save_reps is None else save_reps):
            for name in rotated(names, rep):
                one(name, "save", rep)
                if "save_async" in ops and has_op(name, "save_async"):
                    one(name, "save_async", rep)
        for path in async_paths.values():
            remove(path)
        for rep in range(reps):
            for op in ops:
                for name in rotated(names, rep):
                    if op not in SAVES and has_op(name, op):
                        one(name, op, rep)
    finally:
        for path in [*paths.values(), *async_paths.values()]:
            remove(path)
    return failures


def bench_foreign(results: str, tensors: int, large_gib: float, reps: int) -> list[dict[str, Any]]:
    """The `foreign` workload: `benchmarks/foreign.py`'s files written under
    `results`, then its measurements (`foreign.bench`: warm page cache,
    repetitions interleaved), each in a fresh worker process, written to
    `<results>/foreign.jsonl`. Every way of loading is a contender; the file or
    directory loaded is the `op` (`single`, `hf`, `large`). The files are
    deleted after. Returns the failures."""
    print(f"{FOREIGN}: {tensors} small tensors, a {large_gib} GiB file", flush=True)
    directory = os.path.join(results, f"run-{FOREIGN}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    failures: list[dict[str, Any]] = []

    def one(case: str, op: str, rep: int) -> float | None:
        job = {"workload": FOREIGN, "tensors": tensors, "large_gib": large_gib, "contender": op, "op": case}
        result = measure_job({**job, "cache": "warm", "path": paths[case], "rep": rep}, log)
        if "error" in result:
            failures.append(result)
            return None
        return float(result["seconds"])

    try:
        with open(os.path.join(results, f"{FOREIGN}.jsonl"), "w") as log:
            paths = foreign.write_files(directory, tensors, large_gib)
            foreign.bench(paths, reps, one)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return failures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*workload.PRESETS, FOREIGN], action="append", help="repeatable")
    parser.add_argument("--all", action="store_true", help="small, many, large and foreign")
    parser.add_argument("--contenders", default=",".join(ALL_CONTENDERS), help="comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="runs of each load")
    parser.add_argument(
        "--save-reps",
        type=int,
        default=5,
        help="runs of each save (a save takes a fraction of a second, and a slow phase of the disk "
        "moved the median of 3 once)",
    )
    parser.add_argument("--ops", help="comma-separated subset of the workload's operations, e.g. save,load_warm")
    parser.add_argument("--layers", type=int, help="override the workload's number of blocks")
    parser.add_argument("--width", type=int, help="override the workload's width")
    parser.add_argument("--vocab", type=int, help="override the workload's vocabulary")
    parser.add_argument(
        "--foreign-tensors", type=int, default=10000, help="small tensors in the foreign file and directory"
    )
    parser.add_argument("--foreign-large-gib", type=float, default=3.0, help="GiB of the large foreign file (0: none)")
    parser.add_argument(
        "--foreign-reps",
        type=int,
        default=5,
        help="runs of each foreign load (most take a fraction of a second, like the saves)",
    )
    parser.add_argument("--results", default=RESULTS, help="where results and checkpoints go")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite docs/benchmarks.*")
    args = parser.parse_args(argv)
    workloads = ["small", "many", "large", FOREIGN] if args.all else (args.workload or ["small"])
    names = [n for n in args.contenders.split(",") if n]
    unknown = [n for n in names if n not in contenders.CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {ALL_CONTENDERS}")
    chosen_ops = [op for op in (args.ops or "").split(",") if op]
    unknown = [op for op in chosen_ops if not any(op in ops for ops in OPS.values())]
    if unknown:
        parser.error(f"unknown operations {unknown}; choose from {OPS['tiny']}")
    os.makedirs(args.results, exist_ok=True)
    overrides = {k: getattr(args, k) for k in ("layers", "width", "vocab") if getattr(args, k)}
    trees = [name for name in workloads if name != FOREIGN]
    sizes_of = {name: workload.Sizes(**{**workload.PRESETS[name].__dict__, **overrides}) for name in trees}
    ops_of = {name: [op for op in OPS[name] if not chosen_ops or op in chosen_ops] for name in trees}
    # Checked before the first measurement: each workload's checkpoints are deleted before the next.
    needs = [disk_needed(sizes_of[name], names, ops_of[name]) for name in trees]
    if FOREIGN in workloads:
        needs.append(foreign_disk_needed(args.foreign_tensors, args.foreign_large_gib))
    check_disk(args.results, max(needs))
    failures: list[dict[str, Any]] = []
    for name in workloads:
        if name == FOREIGN:
            failures += bench_foreign(args.results, args.foreign_tensors, args.foreign_large_gib, args.foreign_reps)
            continue
        sizes, ops = sizes_of[name], ops_of[name]
        base = {"workload": name, "sizes": sizes.__dict__, "verify": name == "tiny"}
        directory = os.path.join(args.results, f"run-{name}")
        os.makedirs(directory, exist_ok=True)
        print(f"{name}: {sizes}, {state_bytes(sizes) / 1e9:.3f} GB", flush=True)
        with open(os.path.join(args.results, f"{name}.jsonl"), "w") as log:
            failures += bench_workload(names, ops, base, directory, args.reps, log, save_reps=args.save_reps)
        shutil.rmtree(directory, ignore_errors=True)
    if failures:
        print(f"{len(failures)} measurements failed (recorded with an `error` in the results):", flush=True)
        for f in failures:
            print(f"  {f['workload']} {f['contender']} {f['op']} {f['cache'] or ''} rep {f['rep']}: {f['error']}")
    if not args.no_report:
        from . import report

        report.write(
            args.results, " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
        )


if __name__ == "__main__":
    main()
