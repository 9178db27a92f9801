"""Smoke test of the benchmark harness (benchmarks/), so it cannot rot: the tiny
workload, eqx_ckpt and raw only, page cache warm (dropping it would slow everyone
else on the machine), one repetition, each measurement as its own worker
process runs it, and the foreign workload on 50 tensors and a 4 MB file in the
same run; that a failed measurement is recorded and the run goes on; and the
report's rules.

The benchmarks' fresh processes (`subprocess.run([sys.executable, "-c" or "-m",
...])`) are forked from a template that already imported JAX (`prefork`), the
same command in a new process, a second and a half less each: no figure the
tests check depends on the imports. Where what a test checks is what the
processes measure, not that they are processes (the harness's run, the
compression and warm-memory benchmarks), their commands run in this process
instead (`in_process`), each compiling nothing the one before compiled. The
harness's own start of a worker runs for real in
`test_the_worker_reports_its_own_failure`, and `replicas.py` and `alternating`
start theirs for real. The page cache is never dropped (every step of a cold
measurement still runs), and what JAX compiles in one of these processes is
taken by the next (`_forked`); the benchmarks' `gc.collect()`s in this process
leave out what the session held before (`_frozen`)."""

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import pathlib
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import places
import prefork
import pytest
from arrays import tree_equal

ROOT = places.ROOT
# benchmarks/ is a folder at the repository root, not part of the installed package.
sys.path.insert(0, str(ROOT))

import eqx_ckpt  # noqa: E402
from benchmarks import (  # noqa: E402
    compression,
    contenders,
    direct_read,
    families,
    foreign,
    gpu,
    gpu_budget,
    gpu_copies,
    gpu_join,
    hub,
    incremental,
    iterators,
    merge,
    page_sizes,
    report,
    run,
    staging,
    tiers,
    warm_memory,
    worker,
    workload,
)
from eqx_ckpt._save import _records  # noqa: E402

_RUN = subprocess.run


def _python_args(command, other):
    """What follows `python` in a `subprocess.run` of `[sys.executable, "-c"
    or "-m", ...]` with no options but those `_forked_run` names; `None`
    for any other call."""
    command = list(command) if isinstance(command, (list, tuple)) else None
    if command and command[:1] == [sys.executable] and command[1:2] in (["-c"], ["-m"]) and not other:
        return command[1:]
    return None


def _forked_run(command, *, capture_output=False, text=False, timeout=None, cwd=None, env=None, check=False, **other):
    """`subprocess.run` of `python -c ...` or `python -m ...`, its output
    captured as text or not captured at all, forked from a `prefork` template
    (output not captured is written to this process's, as a child's would
    be); any other call as it is.

    A template is started for each environment, so the children's differ
    in nothing that changes what they do: their `PYTHONPATH` starts with
    this checkout, once, without empty entries, as the benchmarks that set
    one have it (`replicas`, `staging`, `hub`; `-c` and `-m` put the working
    folder on the path anyway), and where this machine's JAX has only its
    CPU, `JAX_PLATFORMS` says so, as `hub` sets it."""
    args = _python_args(command, other)
    if args is None or capture_output != text:
        return _RUN(
            command, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd, env=env, check=check, **other
        )
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    if jax.default_backend() == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")
    done = prefork.run(args, env=env, cwd=cwd, timeout=timeout or 3600)
    if not capture_output:
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        done = subprocess.CompletedProcess(done.args, done.returncode)
    if check:
        done.check_returncode()
    return done


def _in_process_run(
    command, *, capture_output=False, text=False, timeout=None, cwd=None, env=None, check=False, **other
):
    """`subprocess.run` of `python -c CODE ARGS` or `python -m MODULE ARGS`,
    its output captured as text, run in this process instead (without a
    time limit): its own `__main__` namespace, `sys.argv`, environment and
    working folder for the call, and its output and exit status returned as
    the process's would be; any other call as `_forked_run` makes it."""
    args = _python_args(command, other)
    if args is None or not (capture_output and text):
        return _forked_run(
            command, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd, env=env, check=check, **other
        )
    flag, target, *arguments = args
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, dict(os.environ), os.getcwd()
    code = 0
    try:
        os.environ.clear()
        os.environ.update(saved[1] if env is None else env)
        os.chdir(cwd or saved[2])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if flag == "-c":
                    sys.argv = ["-c", *arguments]
                    exec(compile(target, "<string>", "exec", dont_inherit=True), {"__name__": "__main__"})
                else:
                    sys.argv = [target, *arguments]
                    with warnings.catch_warnings():
                        # (the module, imported here already, runs again as `__main__`, as in a new process)
                        warnings.filterwarnings("ignore", ".* found in sys.modules after import", RuntimeWarning)
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as e:  # as the interpreter exits
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved[0]
        os.environ.clear()
        os.environ.update(saved[1])
        os.chdir(saved[2])
    done = subprocess.CompletedProcess([sys.executable, *args], code, out.getvalue(), err.getvalue())
    if check:
        done.check_returncode()
    return done


@pytest.fixture
def in_process(monkeypatch):
    """The benchmark's fresh processes run in this one (`_in_process_run`),
    where a test's point is what they measure, not that they are processes:
    each would import eqx_ckpt and compile the same programs again."""
    monkeypatch.setattr(subprocess, "run", _in_process_run)


@pytest.fixture(scope="module", autouse=True)
def _forked(tmp_path_factory):
    """The benchmarks' fresh processes, forked from a template (the module's
    docstring). Each of them, and the cold measurements here, write the page
    cache's switch to a file of the test's (`EQX_CKPT_BENCH_DROP_CACHES`),
    as root too: every step of a cold measurement runs (as where the kernel's
    switch may be written), and the page cache of everything else on the
    machine stays. The processes keep what JAX compiles in a folder of the
    module's and take there what an earlier one compiled (JAX's persistent
    compilation cache, every program however fast it compiled): each of them
    makes the same workload's arrays and compares them, compiling each
    program again, for nothing a test checks."""
    scratch = tmp_path_factory.mktemp("bench-processes")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "run", _forked_run)
        patch.setenv("EQX_CKPT_BENCH_DROP_CACHES", str(scratch / "drop_caches"))
        patch.setattr(worker, "DROP_CACHES", str(scratch / "drop_caches"))
        patch.setenv("JAX_COMPILATION_CACHE_DIR", str(scratch / "jax-compiled"))
        patch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        patch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
        yield


@pytest.fixture(scope="module", autouse=True)
def _frozen():
    """What this process held before the module, left out of the collections
    the benchmarks run in it (`gc.freeze`): each of their `gc.collect()`s
    (before every measurement, for steady memory figures) walked every
    object of the test session, a few tenths of a second each after the whole
    suite's collection, for nothing a test checks. Given back after."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One run of the harness (`benchmarks.run`), its workers' commands run in
    this process (`_in_process_run`), shared by the tests of its results."""
    directory = tmp_path_factory.mktemp("bench")
    argv = ["--workload", "tiny", "--contenders", "eqx_ckpt,raw", "--reps", "1", "--save-reps", "2"]
    argv += ["--ops", "save,save_async,load_warm", "--results", str(directory), "--no-report"]
    argv += ["--workload", "foreign", "--foreign-tensors", "50", "--foreign-large-gib", "0.004", "--foreign-reps", "1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "run", _in_process_run)  # (the `in_process` fixture, for the module)
        run.main(argv)
    with open(directory / "tiny.jsonl") as f:
        return directory, [json.loads(line) for line in f]


def _rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_every_measurement_ran_and_loaded_the_saved_values(results):
    directory, rows = results
    done = {(r["contender"], r["op"], r["cache"]) for r in rows}
    for contender in ("eqx_ckpt", "raw"):
        assert {(contender, "save", None), (contender, "load", "warm")} <= done
    # Saves run `--save-reps` times, loads `--reps` times.
    for contender in ("eqx_ckpt", "raw"):
        assert sorted(r["rep"] for r in rows if r["contender"] == contender and r["op"] == "save") == [0, 1]
        assert sorted(r["rep"] for r in rows if r["contender"] == contender and r["op"] == "load") == [0]
    # Only eqx_ckpt saves asynchronously.
    assert [(r["contender"], r["op"]) for r in rows if r["op"] == "save_async"] == [("eqx_ckpt", "save_async")] * 2
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["job_seconds"] >= row["seconds"]
        if row["op"] in ("load", "params", "save_async"):
            # The worker compares what was loaded (or saved asynchronously, then
            # loaded) with the tree that was saved.
            assert row["verified"] is True, row
        if row["op"] in ("load", "params"):
            assert row["rss_added"] >= 0
        if row["op"] == "save_async":
            assert 0 < row["blocked"] <= row["committed"] <= row["seconds"]
            # The floor of the call (flattening, a host view of each of the
            # 88 arrays), measured on twins of the state in the same process.
            assert 0 < row["floor"] < row["seconds"]
    saves = {r["contender"]: r for r in rows if r["op"] == "save"}
    assert saves["raw"]["files"] == 1
    # The raw file is the arrays' bytes back to back, nothing else.
    assert saves["raw"]["bytes"] == workload.state_bytes(workload.skeleton(workload.PRESETS["tiny"]))
    assert saves["eqx_ckpt"]["files"] >= 4 and saves["eqx_ckpt"]["bytes"] > saves["raw"]["bytes"]
    # The checkpoints are deleted after the run.
    assert not any((directory / "run-tiny").glob("*"))


def test_the_foreign_workload_records_every_way_of_loading(results):
    """Each way of loading each foreign file ran once, in its own process, as
    a row shaped like the other workloads' (what report.py reads); the files
    are deleted after."""
    directory, _ = results
    rows = _rows(directory / "foreign.jsonl")
    expected = {(op, case) for case, ops in foreign.CASES.items() for op in ops}
    assert sorted((r["contender"], r["op"]) for r in rows) == sorted(expected)
    assert {"reference", "load_file", "eqx_ckpt", "checkpoint", "raw"} == {r["contender"] for r in rows}
    for row in rows:
        assert "error" not in row, row
        assert row["workload"] == "foreign" and row["cache"] == "warm" and row["rep"] == 0 and row["tensors"] == 50
        assert 0 < row["seconds"] <= row["job_seconds"] and "loadavg" in row
    large = next(r for r in rows if r["op"] == "large")
    assert 4 * 10**6 < large["bytes"] < 5 * 10**6
    assert not (directory / "run-foreign").exists()


def test_report_tables_name_both_contenders(results, tmp_path):
    directory, _ = results
    report.write(str(directory), "python -m benchmarks.run --workload tiny", docs=str(tmp_path), with_chart=False)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "### `tiny`: 88 leaves" in text
    assert "Seconds, min / median of 2 runs for saves and 1 for loads, each in a fresh process" in text
    tiny = text[text.index("### `tiny`") : text.index("### `foreign`")]
    table = [line for line in tiny.splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in table] == ["`eqx_ckpt`", "`raw`"]
    # The floor of an asynchronous save has its column, measured for eqx_ckpt only.
    head = next(line for line in tiny.splitlines() if line.startswith("| contender"))
    floor = head.split(" | ").index("`blocking=False`: floor (flatten + host views)")
    assert table[0].split(" | ")[floor][0].isdigit() and table[1].split(" | ")[floor] == "–"
    # The targets table lists every target, measured or not.
    targets = [line.split("|") for line in text.splitlines() if line[:4] in ("| 1 ", "| 3 ", "| 5 ")]
    assert {(cells[2].strip(), cells[1].strip()) for cells in targets} >= {("tiny", "1"), ("tiny", "3"), ("large", "1")}
    async_row = next(cells for cells in targets if cells[1].strip() == "3" and cells[2].strip() == "tiny")
    # Met or not (two runs on a busy machine may also break the stability rule).
    assert async_row[-2].strip() in ("yes", "no", "no (a run over 1.5x the median)"), async_row
    worst = async_row[-3].strip()  # the slower of two runs over their mean
    assert re.fullmatch(r"\d+\.\d\dx", worst) and float(worst[:-1]) >= 1.0, async_row
    # Its reference is the larger of the two bounds, and it says which applies
    # and what both are.
    assert "applies" in async_row[5] and "10% of the synchronous save, " in async_row[5]
    assert "1.25x the floor of " in async_row[5]
    assert "| 2 | large | peak RSS added by a full load" in text
    assert "| 2 | large | durable save <= 1.1x raw (`writev` + `fsync`) |" in text
    # The foreign targets: both ways of loading the file, the directory and
    # the large file, each against its reference, measured in this run.
    foreign_rows = [cells for cells in targets if cells[1].strip() == "5"]
    assert [cells[3].strip() for cells in foreign_rows] == [
        f"{what}, {how} <= {bound}"
        for what, bound in (
            ("one safetensors file of 50 small tensors", "2.0x `load_file` + `jnp.asarray`"),
            ("a Hugging Face directory of 50 small tensors", "2.0x `load_file` + `jnp.asarray`"),
            ("a 4.29 MB safetensors file", "1.2x raw reads of it"),
        )
        for how in ("`tree_deserialise_leaves`", "`Checkpoint(path).load()`")
    ]
    for cells in foreign_rows:
        assert cells[6].strip().endswith("x") and cells[-2].strip() in ("yes", "no"), cells
    # The stability line is there; whether it holds depends on the machine (two
    # saves on a busy one may differ by more than 1.5x; its rule is tested below).
    stability = "Stability (issue 42: no run of eqx_ckpt's worse than 1.5x the median of its runs): "
    assert stability + "holds" in text or stability + "does not hold for " in text
    # The foreign workload's own table: every way of loading, every file.
    assert "### `foreign`: 50 small float32 tensors in one safetensors file and in a directory of 4 shards" in text
    section = text[text.index("### `foreign`") :]
    assert "Seconds, min / median of 1 run, each in a fresh process, page cache warm" in section
    cells = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in section.splitlines() if line.startswith("| `")}
    assert list(cells) == ["`reference`", "`load_file`", "`eqx_ckpt`", "`checkpoint`", "`raw`"]
    assert cells["`raw`"][:2] == ["–", "–"] and cells["`load_file`"][2] == "– |"
    # Rewriting keeps one generated part, replacing the old one.
    report.write(str(directory), "again", docs=str(tmp_path), with_chart=False)
    assert (tmp_path / "benchmarks.md").read_text().count("<!-- end of generated part -->") == 1


@pytest.mark.parametrize("name", ["eqx_ckpt", "raw"])
def test_params_only_load_reads_the_model_of_the_saved_state(name, tmp_path):
    contender = contenders.CONTENDERS[name]()
    sizes = workload.PRESETS["tiny"]
    state = workload.concrete(sizes)
    path = str(tmp_path / ("ckpt" + contender.suffix))
    contender.save(path, state)
    loaded = contender.load_params(path, workload.skeleton(sizes))
    assert tree_equal(loaded, state["model"], typematch=True)
    assert not tree_equal(loaded, workload.concrete(sizes, seed=1)["model"])


_TINY = {"workload": "tiny", "sizes": workload.PRESETS["tiny"].__dict__, "verify": False}


def _measured(job):
    """What a worker returns for a measurement that succeeded (a save leaves
    its checkpoint behind)."""
    if job["op"] == "save":
        pathlib.Path(job["path"]).mkdir(exist_ok=True)
        return {**job, "seconds": 2.0, "files": 3, "bytes": 10}
    return {**job, "seconds": 1.0, "rss_added": 100}


def test_a_failed_measurement_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    """raw's saves and eqx_ckpt's asynchronous ones fail: they and raw's loads
    (nothing to read) are recorded as failures, the other measurements all run,
    and the report says what failed."""
    ran = []

    def fake_run_job(job, timeout):
        ran.append((job["contender"], job["op"], job["cache"], job["rep"]))
        if job["contender"] == "raw" and job["op"] == "save":
            raise RuntimeError("worker exited with status -9 and no result:\nKilled")
        if job["op"] == "save_async":
            return {**job, "error": "OSError: disk full", "traceback": "..."}
        return _measured(job)

    monkeypatch.setattr(run, "run_job", fake_run_job)
    directory = tmp_path / "run-tiny"
    directory.mkdir()
    with open(tmp_path / "tiny.jsonl", "w") as log:
        failures = run.bench_workload(
            ["eqx_ckpt", "raw"], ["save", "save_async", "load_warm"], _TINY, str(directory), 2, log
        )
    rows = [json.loads(line) for line in (tmp_path / "tiny.jsonl").read_text().splitlines()]
    expected = [("eqx_ckpt", "save_async")] * 2 + [("raw", "load")] * 2 + [("raw", "save")] * 2
    assert sorted((f["contender"], f["op"]) for f in failures) == expected
    assert "no checkpoint to read" in failures[-1]["error"]
    # The loads of raw were not even started: there was nothing to read.
    assert ("raw", "load", "warm", 0) not in ran
    assert sum(1 for r in rows if r["contender"] == "eqx_ckpt" and "error" not in r) == 4
    assert not any(directory.iterdir())

    report.write(str(tmp_path), "python -m benchmarks.run --workload tiny", docs=str(tmp_path), with_chart=False)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "| `raw` | failed | – | – | – | – | failed |" in text
    assert "- `raw`, durable save, run 1: RuntimeError: worker exited with status -9 and no result:" in text
    assert "- `eqx_ckpt`, `blocking=False` save, run 2: OSError: disk full" in text
    assert "| 3 | tiny | `blocking=False` blocks the caller" in text
    target = next(line for line in text.splitlines() if line.startswith("| 3 | tiny"))
    assert target.endswith("| not measured (failed) |")


def test_each_repetition_starts_with_another_contender(tmp_path, monkeypatch):
    """The first load after a change of cache state is the slow one on this VM,
    and a change in machine load must not fall on one contender's saves: no
    contender may always take the first place, and the saves of a repetition
    all come before the next one's, each asynchronous save right after its
    synchronous one."""
    ran = []

    def fake_run_job(job, timeout):
        ran.append((job["rep"], job["op"], job["cache"], job["contender"]))
        return _measured(job)

    monkeypatch.setattr(run, "run_job", fake_run_job)
    names = ["eqx_ckpt", "equinox", "raw"]
    (tmp_path / "run").mkdir()
    with open(tmp_path / "tiny.jsonl", "w") as log:
        run.bench_workload(
            names, ["save", "save_async", "load_cold", "load_warm"], _TINY, str(tmp_path / "run"), 3, log
        )
    saves = [(r, n, op) for r, op, c, n in ran if op in run.SAVES]
    rotations = [names, names[1:] + names[:1], names[2:] + names[:2]]
    assert saves == [
        (rep, name, op)
        for rep in range(3)
        for name in rotations[rep]
        for op in (["save", "save_async"] if name == "eqx_ckpt" else ["save"])
    ]
    assert ran.index((2, "save", None, "raw")) < ran.index((0, "load", "cold", "eqx_ckpt")), (
        "every save before the loads"
    )
    order = {
        (rep, cache): [n for r, op, c, n in ran if (r, op, c) == (rep, "load", cache)]
        for rep in range(3)
        for cache in ("cold", "warm")
    }
    for cache in ("cold", "warm"):
        assert [order[rep, cache] for rep in range(3)] == rotations
    assert run.rotated(names, 4) == ["equinox", "raw", "eqx_ckpt"] and run.rotated([], 1) == []


def test_the_worker_reports_its_own_failure(tmp_path, monkeypatch):
    """The harness's own start of a worker, in a new interpreter (not forked)."""
    monkeypatch.setattr(subprocess, "run", _RUN)
    job = {"workload": "tiny", "sizes": workload.PRESETS["tiny"].__dict__, "contender": "raw", "op": "load"}
    job |= {"cache": "warm", "path": str(tmp_path / "missing.bin"), "rep": 0}
    result = run.run_job(job, timeout=600)
    assert result["error"].startswith("FileNotFoundError"), result
    assert "Traceback" in result["traceback"] and "seconds" not in result


def test_warm_memory_measures_every_kind_after_each_warm_up_and_cleans_up(tmp_path, in_process):
    rows = warm_memory.main(["--workload", "tiny", "--rounds", "1", "--dir", str(tmp_path)])
    assert sorted((r["kind"], r["contender"]) for r in rows) == sorted(
        (kind, name) for kind in warm_memory.KINDS for name in warm_memory.NAMES
    )
    for row in rows:
        assert row["seconds"] > 0 and row["system"] >= 0, row
    assert not any(tmp_path.iterdir())


def test_warm_memory_reads_files_whole_and_touches_every_page(tmp_path):
    rng = np.random.default_rng(0)
    contents = [rng.bytes(warm_memory.PIECE + 3), b"", rng.bytes(5)]
    names = []
    for i, data in enumerate(contents):
        names.append(str(tmp_path / f"f{i}"))
        pathlib.Path(names[-1]).write_bytes(data)
    buffers = warm_memory.read_files(names)
    assert [bytes(b[: len(data)]) for b, data in zip(buffers, contents)] == contents
    touched = np.frombuffer(warm_memory.touch(3 * warm_memory.PAGE + 1), np.uint8)
    assert touched[:: warm_memory.PAGE].tolist() == [1, 1, 1, 1] and touched.sum() == 4


def test_a_run_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    """`large` keeps every contender's 3.1 GB checkpoint until its loads are
    done: a run that cannot fit stops at once, saying how much it needs."""
    needed = run.disk_needed(workload.PRESETS["large"], ["eqx_ckpt", "raw"], run.OPS["large"])
    assert 3 * 3.1e9 < needed < 3 * 3.3e9 + 2e9  # two checkpoints and eqx_ckpt's asynchronous one
    argv = ["--workload", "large", "--contenders", "eqx_ckpt,raw"]
    _refused_for_disk(tmp_path, monkeypatch, needed, argv, r"needs about 1\d\.\d GB free .* Free some space")
    assert not list(tmp_path.glob("*.jsonl"))


def _refused_for_disk(tmp_path, monkeypatch, needed, argv, match):
    """`run.main(argv)` with one byte less free than `needed` stops before any measurement."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: usage._replace(free=needed - 1))
    monkeypatch.setattr(run, "run_job", lambda *a, **k: pytest.fail("a measurement ran"))
    with pytest.raises(SystemExit, match=match):
        run.main([*argv, "--results", str(tmp_path), "--no-report"])


def test_the_foreign_benchmark_loads_what_it_wrote(tmp_path):
    """benchmarks/foreign.py on 12 tensors and a tiny large file, each
    measurement in this process (the script runs each in a fresh one)."""
    paths = foreign.write_files(str(tmp_path), 12, 1 / 1024)
    like = foreign.like_of(paths["hf"])
    assert sum(len(layer) for layer in like["model"]["layers"].values()) == 12
    loaded = eqx_ckpt.tree_deserialise_leaves(paths["hf"], like)
    np.testing.assert_array_equal(loaded["model"]["layers"]["1"]["w"], foreign.small_tensors(12)["model.layers.1.w"])
    for name, ops in [("single", ("load_file", "reference", "eqx_ckpt", "checkpoint")), ("large", ("raw", "eqx_ckpt"))]:
        for op in ops:
            assert foreign.measure(op, paths[name]) > 0


def _timed(workload_name, contender, op, cache, runs, **extra):
    return [
        {"workload": workload_name, "contender": contender, "op": op, "cache": cache, "rep": i, "seconds": s, **extra}
        for i, s in enumerate(runs)
    ]


def test_a_target_with_a_run_over_one_and_a_half_times_its_median_is_not_met():
    """Issue 42: a target is met only if its median ratio is and no run of
    eqx_ckpt's is worse than 1.5x their median. eqx_ckpt's saves here are
    half safetensors' at the median, but one of five took 1.6x the median;
    its cold loads vary less (1.4x) and meet theirs."""
    rows = _timed("small", "eqx_ckpt", "save", None, [1.0, 1.0, 1.6, 0.9, 1.1])
    rows += _timed("small", "safetensors", "save", None, [2.0] * 5)
    rows += _timed("small", "eqx_ckpt", "load", "cold", [1.0, 1.4, 0.9])
    rows += _timed("small", "safetensors", "load", "cold", [2.0] * 3)
    # The floor decides the asynchronous target: 1.25 x 0.096 s against 10% of 1 s.
    rows += _timed("small", "eqx_ckpt", "save_async", None, [1.2] * 5, blocked=0.09, floor=0.096)
    text = "\n".join(report.targets({"small": rows}))
    line = {row.split(" | ")[2]: row for row in text.splitlines() if row.startswith("| ") and "small" in row}
    save = line["durable save <= 1.0x the faster of equinox and safetensors"]
    assert save.endswith("| 0.50x | 1.60x | no (a run over 1.5x the median) |"), save
    cold = line["full load, cold <= 1.0x the faster of equinox and safetensors"]
    assert cold.endswith("| 0.50x | 1.40x | yes |"), cold
    blocked = line["`blocking=False` blocks the caller <= max(10% of a synchronous save, 1.25x the floor)"]
    assert "| 0.090 s | 0.120 s (1.25x the floor of 0.096 s, 0.120 s, applies; 10% of the synchronous save, " in blocked
    assert blocked.endswith("| 0.75x | 1.00x | yes |"), blocked
    assert (
        "Stability (issue 42: no run of eqx_ckpt's worse than 1.5x the median of its runs): does not hold for "
        "1 `small` durable save <= 1.0x the faster of equinox and safetensors (1.60x)."
    ) in text
    # Without the slow run, the same save meets its target and the rule holds.
    rows[2]["seconds"] = 1.4
    text = "\n".join(report.targets({"small": rows}))
    assert "| 0.50x | 1.40x | yes |" in text.split("durable save <= 1.0x")[1].splitlines()[0]
    assert "its runs): holds for every measured target." in text


def test_a_run_with_foreign_files_the_disk_cannot_hold_is_refused(tmp_path, monkeypatch):
    """The foreign workload's 3 GiB file and its small files count in the check."""
    needed = run.foreign_disk_needed(10000, 3.0)
    assert 3 * 2**30 + 2 * 14 * 10**6 < needed - 10**9 < 3 * 2**30 + 2 * 20 * 10**6
    argv = ["--workload", "tiny", "--workload", "foreign"]
    _refused_for_disk(tmp_path, monkeypatch, needed, argv, r"needs about 4\.\d GB free")
    assert not list(tmp_path.iterdir())


def test_the_foreign_script_still_runs_on_its_own(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks.foreign` measures what the harness does and prints
    each case against its reference (its fresh processes replaced here by
    measurements in this one)."""
    monkeypatch.setattr(foreign, "in_fresh_process", foreign.measure)
    foreign.main(["--tensors", "12", "--reps", "2", "--large-gib", str(1 / 1024), "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    for case, ops in foreign.CASES.items():
        section = out.split(f"\n{case}:\n")[1]
        for op in ops:
            assert re.search(rf"  {op} +median +[0-9.]+ s  worst +[0-9.]+ s +[0-9.]+x {foreign.BASES[case]}", section)
    assert not any(tmp_path.iterdir())


def test_page_sizes_reads_the_file_every_way(tmp_path):
    """`benchmarks.page_sizes` (issue 42's comparison of 4 KiB and huge pages
    for a load's fresh memory): every way reads the file's bytes, each
    measurement in a fresh process."""
    path = tmp_path / "data.bin"
    page_sizes.write_file(str(path), 3 * page_sizes.BUFFER_BYTES // 2 + 5)
    expected = path.read_bytes()
    for way in page_sizes.WAYS:
        buffers = page_sizes.read(str(path), way)
        assert b"".join(bytes(memoryview(b)) for b in buffers) == expected, way
    rows = page_sizes.main(["--gib", "0.01", "--rounds", "1", "--cache", "warm", "--dir", str(tmp_path)])
    assert sorted(rows) == sorted((way, "warm") for way in page_sizes.WAYS)
    assert all(len(runs) == 1 and runs[0]["seconds"] > 0 for runs in rows.values())
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]  # its own file was deleted


@pytest.fixture
def host_drawn_state(monkeypatch):
    """`gpu.make_state` with the same leaves (`gpu.leaf_rows`), their values
    drawn by NumPy and put on the device: `jax.random.normal` compiles its
    sampler again for each leaf shape (5 of them), about 4 s of CPU for each
    state on a CPU, for nothing these tests check. The script's own
    `make_state` runs in the children of the `--processes` test."""

    def make_state(gib, dtype, seed=0):
        rng = np.random.default_rng(seed)
        rows = gpu.leaf_rows(gib, jnp.dtype(dtype).itemsize)
        values = (rng.standard_normal((n, gpu.COLUMNS), np.float32).astype(jnp.dtype(dtype)) for n in rows)
        return {f"w{i:03d}": jax.device_put(x) for i, x in enumerate(values)}

    monkeypatch.setattr(gpu, "make_state", make_state)


def test_the_gpu_script_records_every_figure_on_a_cpu(tmp_path, monkeypatch, host_drawn_state):
    """`benchmarks.gpu` (issue 50), here on the CPU at 4 MiB of each dtype:
    every contender's save, asynchronous save (where it has one) and load of
    both dtypes, each with its seconds, GB/s and peak RSS, each load equal bit
    for bit; the JSON says on what and with which versions; the checkpoints
    are deleted.

    At 4 MiB (30 leaves of 4 to 270 KB: `jax.random` on the CPU made most of
    the time at 20 MiB), eqx_ckpt's pack limits are a fifth of the library's
    (`_records.PACK_BYTES`, `PACK_CHUNK_BYTES`), as the leaves are: the
    largest leaves of each dtype still have folders of their own and the
    others go to packs of more than one chunk, as at 20 MiB with the library's."""
    scale = 0.004 / 0.02
    monkeypatch.setattr(_records, "PACK_BYTES", int(_records.PACK_BYTES * scale))
    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", int(_records.PACK_CHUNK_BYTES * scale))
    out = tmp_path / "gpu.json"
    returned = gpu.main(["--gib", "0.004", "--dir", str(tmp_path), "--json", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    assert written["device"] and written["platform"] == jax.default_backend()  # the CPU here, a GPU there
    assert written["gib"] == 0.004 and written["reps"] == 1
    assert {"jax", "eqx_ckpt", "orbax-checkpoint"} <= set(written["versions"])
    assert "not installed" not in written["versions"].values()
    assert written["host"][0].startswith("- CPU: ") and written["filesystem"]
    for dtype in ("float32", "bfloat16"):
        assert written[f"leaves_{dtype}"] == 30 and written[f"bytes_{dtype}"] == pytest.approx(0.004 * 2**30, rel=1e-3)
    own = {
        "numpy": {"save", "to_host", "load", "load_cold"},
        "orbax": {"save", "save_async", "load", "load_cold"},
    }
    expected = {
        (dtype, name, op)
        for dtype in ("float32", "bfloat16")
        for name in gpu.CONTENDERS
        for op in gpu.OPS
        if op in own.get(name, set(gpu.OPS) - {"to_host"}) and (op != "load_cold" or worker.can_drop_caches())
    }
    rows = written["rows"]
    assert sorted((r["dtype"], r["contender"], r["op"]) for r in rows) == sorted(expected)
    for row in rows:
        assert row["seconds"] > 0 and row["gb_per_s"] > 0 and isinstance(row["rss_added"], int), row
        assert row["gb_per_s"] == pytest.approx(written[f"bytes_{row['dtype']}"] / 1e9 / row["seconds"])
        assert ("blocked" in row) == (row["op"] == "save_async"), row
        assert row.get("verified", True) is True and (("verified" in row) == row["op"].startswith("load")), row
        if row["op"] == "save_async":
            assert 0 < row["blocked"] <= row["seconds"], row
        if row["op"].startswith("save") and row["contender"].startswith("eqx_ckpt"):
            assert row["stored_bytes"] >= written[f"bytes_{row['dtype']}"], row  # not compressed
    assert written["run_seconds"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


def test_the_gpu_script_measures_each_contender_in_a_process_of_its_own(tmp_path):
    """`--processes`: each contender picked runs this script in a process of
    its own (here two, eqx_ckpt's pool, read threads and compression as
    given), and its rows come back to the one JSON, in order. At 108 KiB,
    every leaf is one row: `jax.random` compiles its sampler once, not for
    each of 5 shapes."""
    out = tmp_path / "gpu.json"
    argv = ["--gib", "0.0001", "--dtypes", "float32", "--dir", str(tmp_path), "--json", str(out)]
    eqx = ["--pool", "2x8", "--read-threads", "2", "--compression", "blosc-lz4"]
    gpu.main([*argv, "--processes", "--contenders", "numpy,eqx_ckpt", *eqx])
    written = json.loads(out.read_text())
    assert written["compression"] == "blosc-lz4"
    saves = [r for r in written["rows"] if r["contender"] == "eqx_ckpt" and r["op"].startswith("save")]
    assert len(saves) == 3 and all(0 < r["stored_bytes"] < written["bytes_float32"] for r in saves)
    cold = worker.can_drop_caches()
    assert [r["contender"] for r in written["rows"]] == ["numpy"] * (3 + cold) + ["eqx_ckpt"] * (4 + cold)
    assert all(r.get("verified", True) is True for r in written["rows"]) and written["bytes_float32"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


def test_a_failed_contender_of_the_gpu_script_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, host_drawn_state):
    """On a lent accelerator there may be no time for a second run: a
    contender whose save fails is one row with the error, its checkpoint is
    deleted, and the others are measured."""
    ops = gpu.operations

    def broken(name):
        found = ops(name)
        if name == "orbax":
            found["save"] = lambda path, state: (pathlib.Path(path).mkdir(), 1 / 0)
        return found

    monkeypatch.setattr(gpu, "operations", broken)
    monkeypatch.setattr(gpu, "CONTENDERS", ("orbax", "numpy"))
    rows = gpu.main(["--gib", "0.002", "--dtypes", "bfloat16", "--dir", str(tmp_path)])["rows"]
    loads = [("numpy", "load_cold")] * worker.can_drop_caches() + [("numpy", "load")]
    assert [(r["contender"], r.get("op")) for r in rows] == [
        ("orbax", None),
        ("numpy", "save"),
        ("numpy", "to_host"),
        *loads,
    ]
    assert rows[0]["error"] == "ZeroDivisionError: division by zero" and "1 / 0" in rows[0]["traceback"]
    assert rows[-1]["verified"] is True
    assert not any(tmp_path.iterdir())


def test_the_direct_read_script_reads_a_leaf_three_ways(capsys):
    """`benchmarks.direct_read`: the local-disk reader, TensorStore and raw
    reads of one leaf, each checked equal to what was saved, warm and cold."""
    direct_read.main(gib=0.01, repeats=1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [
        [cache, way] for cache in ("warm", "cold") for way in ("direct", "ts", "raw")
    ]


def test_the_gpu_copies_script_times_every_way_to_the_host(host_drawn_state):
    """`benchmarks.gpu_copies`, here on the CPU at 20 MiB: every way runs (a
    CPU has the memory kinds too) with its seconds and memory figures."""
    rows = gpu_copies.main(["--gib", "0.02"])
    assert [r["way"] for r in rows] == list(gpu_copies.WAYS)
    assert all(r["error"] is None and r["seconds"] > 0 and "rss_kept" in r for r in rows)


def test_the_gpu_join_script_joins_each_size_both_ways_bit_for_bit():
    """`benchmarks.gpu_join`, here on the CPU: each way in a process of its
    own joins every size from its slabs, equal to the leaf, timed twice."""
    rows = gpu_join.main(["--mib", "2,4", "--slab-mib", "1"])
    assert [(r["way"], r["mib"], r["slabs"]) for r in rows] == [(w, m, m) for w in gpu_join.WAYS for m in (2, 4)]
    assert all(r["equal"] and r["first_ms"] > 0 and r["again_ms"] > 0 for r in rows)


def test_the_gpu_budget_script_saves_once_per_budget_within_it(tmp_path, host_drawn_state):
    """`benchmarks.gpu_budget`, here on the CPU at 20 MiB: a first save, then
    one per budget, each staging no more than its budget; nothing left behind."""
    rows = gpu_budget.main(["--gib", "0.02", "--budgets", "default,8", "--dir", str(tmp_path)])
    assert [r["label"] for r in rows] == ["first save (1024 MiB)", "budget default", "budget 8"]
    assert [r["budget"] for r in rows] == [1 << 30, None, 8 << 20]
    assert all(r["seconds"] > 0 and r["staged_peak"] > 0 for r in rows)
    assert rows[2]["staged_peak"] <= 8 << 20 < rows[1]["staged_peak"]
    assert not any(tmp_path.iterdir())


def test_the_gpu_script_uses_a_few_dozen_leaves_of_64_to_256_mib_and_compares_bits():
    """At 4 GiB, 28 leaves of 64, 128 and 256 MiB in either dtype; and a load
    that gave -0.0 for 0.0 (equal as numbers) or another dtype does not pass."""
    for itemsize in (4, 2):
        rows = gpu.leaf_rows(4, itemsize)
        sizes = {n * gpu.COLUMNS * itemsize for n in rows}
        assert len(rows) == 28 and sizes == {64 * 2**20, 128 * 2**20, 256 * 2**20}
        assert sum(rows) * gpu.COLUMNS * itemsize == 4 * 2**30
    state = {"w": jnp.zeros((2, 3), jnp.bfloat16)}
    assert gpu.verified({"w": state["w"] + 0}, state)
    assert not gpu.verified({"w": -state["w"]}, state)
    assert not gpu.verified({"w": state["w"].astype(jnp.float32)}, state)


def _markdown_tables(text):
    """Each Markdown table of `text`: its rows (header first), as lists of cells."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_replicas_saves_in_shares_and_restores_reading_each_byte_once(storage):
    """`benchmarks/replicas.py` at 8 MiB, 2 processes, on a local disk and on
    its own S3 server: each process wrote half the state; restored without
    sharing, every process read all of it; with sharing, the two read it once
    between them (each restore compared with the saved values by the children).

    The script itself runs as `python -m benchmarks.replicas` (forked, as the
    module's other `-m` runs: it only starts the children and the S3 server);
    the children it starts are fresh interpreters running the file as a
    script, `jax.distributed` joining them, as `python benchmarks/replicas.py` has it."""
    if storage == "s3":
        pytest.importorskip("moto.moto_server.werkzeug_app", reason="the S3 run needs moto (the test extra)")
    argv = [sys.executable, "-m", "benchmarks.replicas", "--processes", "2", "--total-mib", "8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        argv + ["--s3"] * (storage == "s3"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saves, restores = _markdown_tables(done.stdout)
    assert saves[0][:5] == ["code", "processes", "MiB written by each process", "largest / equal share", "save (s)"]
    [save] = saves[1:]
    assert save[:2] == ["this", "2"] and float(save[3]) <= 1.05 and float(save[4]) > 0
    assert [float(n) for n in save[2].split(", ")] == [pytest.approx(4.1, abs=0.1)] * 2
    assert [r[:3] for r in restores[1:]] == [["this", "2", "false"], ["this", "2", "true"]]
    unshared, shared = ({h: c for h, c in zip(restores[0], row)} for row in restores[1:])
    assert 2 <= float(unshared["/ checkpoint"]) <= 2.1 and 1 <= float(shared["/ checkpoint"]) <= 1.05
    assert float(shared["largest process"]) < float(unshared["largest process"])
    if storage == "s3":
        # The server's count of what it received and sent agrees with TensorStore's.
        assert float(save[5]) == pytest.approx(sum(float(n) for n in save[2].split(", ")), abs=0.2)
        for row in (unshared, shared):
            assert float(row["S3 server sent (MiB)"]) == pytest.approx(float(row["MiB read, all processes"]), abs=0.2)


def test_the_compression_benchmark_measures_every_part_on_trained_state(tmp_path, in_process):
    """`benchmarks.compression` (issue 73) on an MLP of width 64 trained 3
    steps (64 inputs and outputs too: every weight one shape and every bias
    another, each initialised by a program compiled once), one round, one
    compression: the codec table has every group through it and the
    byte-shuffled reference; every contender's save ran as its fresh process
    runs it (the same program, in this process: `in_process`) on a local disk
    and on the S3 server behind the limited link, each load equal bit for bit
    (the children compare); the compressed checkpoints are the smaller; every
    target has a figure for the compression; the checkpoints are deleted. No
    time is asserted."""
    parts = "codecs,local,s3" if importlib.util.find_spec("moto") else "codecs,local"
    out = tmp_path / "compression.json"
    argv = ["--in-size", "64", "--out-size", "64", "--width", "64", "--depth", "1", "--steps", "3", "--batch", "8"]
    argv += ["--reps", "1", "--compressions", "blosc-lz4", "--mbps", "50", "--parts", parts]
    returned = compression.main([*argv, "--dir", str(tmp_path), "--json", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    assert written["train"]["seconds"] > 0 and written["state_bytes"] > 2 * written["bf16_bytes"] > 0
    codecs = ["blosc-lz4", compression.BYTE_SHUFFLE]
    assert [(r["group"], r["codec"]) for r in written["codecs"]] == [(g, c) for g in compression.GROUPS for c in codecs]
    for row in written["codecs"]:
        assert 0 < row["ratio"] < 1.1 and row["compress_gb_s"] > 0 and row["decompress_gb_s"] > 0, row
    contenders = ["raw", "blosc-lz4"]
    stores = [("local", tree) for tree in compression.TREES] + [("s3", "state")] * ("s3" in parts)
    for store, tree in stores:
        rows = [r for r in written[store] if r["tree"] == tree]
        assert sorted(r["compression"] for r in rows) == sorted(contenders)
        for row in rows:
            assert "error" not in row, row
            assert row["save_s"] > 0 and len(row["loads_s"]) == (2 if store == "local" else 1), row
            assert isinstance(row["rss_added"], int) and len(row["save_cpu_s"]) == 2, row
        medians = {m["compression"]: m for m in written[f"{store}_medians"] if m["tree"] == tree}
        if store == "local":
            # Stored bytes: the raw checkpoint's are its arrays' and their checksums.
            assert 1.0 <= medians["raw"]["ratio"] < 1.05
            assert medians["blosc-lz4"]["ratio"] < medians["raw"]["ratio"]
        else:
            # What the server received for each save and sent for its load.
            raw = medians["raw"]
            assert raw["received_bytes"] >= raw["total_bytes"] and raw["sent_bytes"] >= raw["total_bytes"]
            assert medians["blosc-lz4"]["received_bytes"] < raw["received_bytes"]
            assert all(row["server_cpu_s"]["save"] >= 0 and row["link_up_bytes"] > 0 for row in rows)
    names = [t["target"] for t in written["targets"]]
    assert names[:2] == [
        "stored bf16 params <= 0.80x (`stored_bytes / total_bytes`)",
        "stored fp32 params + Adam state <= 0.92x (`stored_bytes / total_bytes`)",
    ]
    assert "local disk: warm load of the bf16 params <= 1.3x raw" in names
    assert ("S3 at 50 MB/s: save of the state <= 0.9x raw" in names) == ("s3" in parts)
    for target in written["targets"]:
        assert "blosc-lz4" in target["figures"], target
        assert all(f["met"] in (True, False) for f in target["figures"].values()), target
    assert [p.name for p in tmp_path.iterdir()] == ["compression.json"]


def test_the_compression_benchmark_link_holds_its_rate():
    """The token bucket of `benchmarks.compression`'s link: 4 threads taking
    64 KiB at a time get 10 MB through in about a quarter of a second at 40
    MB/s, not at once."""
    bucket = compression.TokenBucket(40e6)

    def take():
        for _ in range(38):
            bucket.take(65536)

    threads = [threading.Thread(target=take) for _ in range(4)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0.22 < time.perf_counter() - start < 30


def test_the_staging_benchmark_measures_each_budget_in_a_fresh_process(tmp_path):
    """`benchmarks.staging` at 32 MiB in 8 leaves: one row per budget, each
    with its seconds, peak RSS and the most bytes the save staged, within
    the budget where one was given; the checkpoints are deleted."""
    out = tmp_path / "staging.json"
    argv = ["--gib", "0.03125", "--leaves", "8", "--budgets", "default,2", "--dir", str(tmp_path)]
    rows = staging.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(r["budget"], r["rep"]) for r in rows] == [("default", 0), ("2", 0)]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and isinstance(row["rss_added"], int) and row["state_bytes"] == 32 * 2**20
    # 8 leaves of 4 MiB, 2 MiB each as bfloat16: the default stages them all at once, 2 MiB one at a time.
    assert rows[0]["staged_peak"] == 16 * 2**20 and rows[1]["staged_peak"] == 2 * 2**20
    assert [p.name for p in tmp_path.iterdir()] == ["staging.json"]


def test_the_merge_benchmark_measures_a_merge_and_its_reference_in_fresh_processes(tmp_path):
    """`benchmarks.merge` at 4 MiB a model, in two rounds: a row for the merge
    and one for its reference each round, each with its seconds and peak RSS;
    the median of the rounds' ratios; the models are deleted."""
    out = tmp_path / "merge.json"
    argv = ["--gib", "0.00390625", "--leaves", "2", "--methods", "ties", "--rounds", "2"]
    rows = merge.main([*argv, "--dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(r["method"], r["what"], r["round"]) for r in rows] == [
        ("ties", what, round_) for round_ in (0, 1) for what in ("merge", "reference")
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and isinstance(row["rss_added"], int)
    each = [rows[i]["seconds"] / rows[i + 1]["seconds"] for i in (0, 2)]
    said = merge.ratios(rows)
    assert said.startswith("            ties merge / reference: median ") and f"{sum(each) / 2:.2f}x" in said
    assert [p.name for p in tmp_path.iterdir()] == ["merge.json"]


def test_the_hub_benchmark_fetches_and_loads_every_way(monkeypatch, capsys):
    """`benchmarks.hub` against the local Hub server, on 16 KiB tensors: every
    way of fetching runs and loads what was published; the partial load's
    bytes are a fraction of the whole download's."""
    if importlib.util.find_spec("huggingface_hub") is None:
        pytest.skip("needs the `hub` extra (huggingface_hub)")
    monkeypatch.setattr(hub, "TENSOR", (64, 64))
    rows = hub.main(["--mib", "1", "--reps", "1"])
    assert [r["op"] for r in rows] == list(hub.OPS)
    sent = {r["op"]: r["sent"] for r in rows}
    assert sent["reference"] == sent["download"] > 2**20
    # The whole loads fetch every file but the card, which no load reads; a second one fetches nothing.
    assert 0 < sent["download"] - sent["eqx_ckpt"] < 8192
    # `Checkpoint(...)` reads the headers by ranges when it opens, before `.load()` fetches every file.
    assert sent["eqx_ckpt"] <= sent["checkpoint"] < sent["eqx_ckpt"] + 2**16
    assert sent["second"] == 0
    assert 64 * 64 * 4 <= sent["partial"] < sent["download"] / 10
    assert "| partial |" in capsys.readouterr().out


def test_the_families_benchmark_measures_every_target(monkeypatch, capsys):
    """`benchmarks.families` (issue 67) on 64 KiB body tensors and a 1 KiB
    head, 2 fine-tunes: every measurement runs, every load is checked bit for
    bit, and the byte targets hold (bytes do not depend on the machine;
    times do, so none is asserted)."""
    if importlib.util.find_spec("huggingface_hub") is None:
        pytest.skip("needs the `hub` extra (huggingface_hub)")
    monkeypatch.setattr(families, "TENSOR", (128, 128))
    monkeypatch.setattr(families, "HEAD", (16, 16))
    rows = families.main(["--mib", "1", "--reps", "1", "--finetunes", "2"])
    by = {r["measure"]: r for r in rows}
    assert list(by) == [
        "upload, `base=`",
        "stored, `base=`",
        "cache, 2 fine-tunes",
        "load, warm base",
        "load, both cached",
        "load, cold",
        "load standalone, cold",
        "export, `base=`",
        "export stored, `base=`",
        "load, local checkpoint base",
    ]
    # The loads of items 2 (2 + 2), 3 (the base, then 7), 4 (2) and 5 (2 + 2), each checked.
    assert all(r["checked"] == 18 for r in rows)
    assert all(r["values"] and r["versus_median"] > 0 for r in rows)
    head = (16 * 16 + 16) * 4
    for name in ("upload, `base=`", "stored, `base=`", "cache, 2 fine-tunes", "export stored, `base=`"):
        assert by[name]["met"] is True, by[name]
    # A fine-tune against its base sends and stores its head and small files; a whole one, everything.
    assert head <= by["upload, `base=`"]["worst"] < 2**16 < 2**20 <= by["upload, `base=`"]["versus_median"]
    assert by["stored, `base=`"]["worst"] < 2**16 < 2**20 <= by["stored, `base=`"]["versus_median"]
    assert by["export stored, `base=`"]["median"] < 2**16 < 2**20 <= by["export stored, `base=`"]["versus_median"]
    # One cache of the base and 2 heads, against 2 whole models.
    assert 2**20 <= by["cache, 2 fine-tunes"]["median"] < 2**20 + 2**17
    assert 2 * 2**20 <= by["cache, 2 fine-tunes"]["versus_median"]
    assert "| load, cold |" in capsys.readouterr().out


def test_the_incremental_benchmark_measures_a_small_model_all_packed(tmp_path):
    """`benchmarks.incremental`'s small-model case (issue 59), at 4.1 MiB (a
    last pack chunk that was mostly padding): a manager's steps, the disk each
    adds, within the changed bytes + 1 MiB."""
    args = incremental.argparse.Namespace(steps=2, small_base_mib=4.1, small_head_kib=2.0)
    out = incremental.small_steps(args, str(tmp_path / "run"))
    assert out["small_changed_bytes"] == 2048 + 8
    assert len(out["small_step_added_bytes"]) == 2
    assert 0 < max(out["small_step_added_bytes"]) <= out["small_changed_bytes"] + (1 << 20)


def test_alternating_decides_by_paired_rounds():
    """`benchmarks.alternating`'s verdict: each round's ratio to the first tree
    cancels what the machine did that round; a tree 10% slower in every round,
    however noisy the rounds, is called slower, and one equal within the noise
    is called the same."""
    from benchmarks import alternating

    busy = [1.0, 1.6, 0.9, 2.2, 1.1, 1.3, 0.95]  # the machine's load, round by round
    base = [b * 0.1 for b in busy]
    slower = [b * 0.11 for b in busy]
    same = [b * 0.1 * (1 + 0.01 * (-1) ** i) for i, b in enumerate(busy)]
    ratio = alternating.paired(base, slower)
    assert ratio[0] == pytest.approx(1.1) and 1.0 < ratio[1] <= ratio[0] <= ratio[2]
    assert alternating.verdict("after", "before", ratio).endswith(": slower than before")
    assert alternating.verdict("after", "before", alternating.paired(base, same)).endswith("within the spread")
    assert alternating.verdict("after", "before", alternating.paired(slower, base)).endswith(": faster than before")
    assert alternating.half_width(alternating.paired(base, same)) < 0.05
    # Unpaired, the spread of those medians is far wider than the 10% it must see.
    assert (max(base) - min(base)) / statistics.median(base) > 1


def test_alternating_adds_rounds_until_the_interval_is_narrow(tmp_path, monkeypatch, capsys):
    """`--spread` adds rounds until every tree's paired CPU interval is that
    narrow, 3 rounds at least and `--max-rounds` at most, then prints the
    verdict lines. Driven by made-up timings (each process's `run` replaced;
    the real one is tested below): a tree 5% slower in every round, however
    busy the round, is known that closely from the first round and still
    runs 3; one whose rounds disagree goes on to the last."""
    from benchmarks import alternating

    busy = [1.0, 1.6, 0.9, 2.2, 1.1, 1.3, 0.95]  # the machine's load, round by round
    argv = ["alternating", "--tree", f"a={ROOT}", "--tree", f"b={ROOT}", "--workload", "tiny", "--op", "save"]
    argv += ["--rounds", "1", "--reps", "2", "--spread", "0.05", "--max-rounds", "5", "--scratch", str(tmp_path)]

    def measured(factors):
        """The trees `main` ran, in order, and what it printed, tree b's
        seconds `factors[r % 2]` times tree a's in round r."""
        started = []

        def fake_run(tree, job):
            assert job["op"] == "save" and job["reps"] == 2 and os.path.isdir(job["folder"])
            started.append(os.path.basename(job["folder"]))
            round_ = (len(started) - 1) // 2
            seconds = 0.1 * busy[round_] * (1 if started[-1] == "a" else factors[round_ % 2])
            return {"library": tree, "wall": [seconds, seconds * 1.01], "cpu": [seconds, seconds * 1.01]}

        monkeypatch.setattr(alternating, "run", fake_run)
        monkeypatch.setattr(sys, "argv", argv)
        alternating.main()
        return started, capsys.readouterr().out

    for factors, rounds in (((1.05, 1.05), 3), ((0.8, 1.3), 5)):
        started, out = measured(factors)
        assert started == ["a", "b"] * rounds
        assert f"round {rounds} b:" in out and f"round {rounds + 1}" not in out
        assert f"tiny save, {rounds} rounds x 2 in alternating processes:" in out
        assert re.search(r"b: cpu \d\.\d{3}x a \(95% interval \d\.\d{3}-\d\.\d{3}\): ", out)
        assert ("b: cpu 1.050x a (95% interval 1.050-1.050): slower than a" in out) == (rounds == 3)
        assert not any(tmp_path.iterdir())


def test_alternating_times_a_tree_in_a_fresh_interpreter(tmp_path):
    """A round's process, for real: a new interpreter (`-P`) that imports
    eqx_ckpt from the tree it was given (checked), warms up, then times
    `--reps` saves of the `tiny` workload, and deletes them."""
    from benchmarks import alternating

    timed = alternating.run(str(ROOT), {"workload": "tiny", "op": "save", "reps": 2, "folder": str(tmp_path)})
    assert pathlib.Path(timed["library"]).resolve() == ROOT / "eqx_ckpt" / "__init__.py"
    assert len(timed["wall"]) == len(timed["cpu"]) == 2 and min(timed["wall"]) > 0
    assert not any(tmp_path.iterdir())


def test_alternating_loads_a_published_folder(tmp_path):
    """`--op load-published`: a process exports the workload once, and the
    measuring processes load the published folder (its digests checked), or
    (`--op slice-published`) read lazy slices of it."""
    from benchmarks import alternating

    job = {"workload": "tiny", "folder": str(tmp_path), "reps": 2, "published": True}
    alternating.work({**job, "op": "prepare"})
    assert (tmp_path / "published" / "eqx_ckpt.json").is_file() and not (tmp_path / "checkpoint").exists()
    timed = alternating.work({**job, "op": "load"})
    assert len(timed["wall"]) == len(timed["cpu"]) == 2
    # `--op slice-published`: lazy slices of 2 rows of the same folder.
    timed = alternating.work({**job, "op": "slice"})
    assert len(timed["wall"]) == len(timed["cpu"]) == 2


def test_check_floor_hashes_the_blocks_a_checked_load_hashes(tmp_path):
    """`benchmarks.check_floor`: its `hash` arm hashes each tensor in the
    blocks its record pins (the digests it gives are the recorded ones), its
    `hash-fixed` arm in blocks of the record's `block_bytes`; `plain` is the
    same safetensors file with no record. A process of each arm times its
    operation; the floor of a round is `(plain + hash) / plain`."""
    from benchmarks import alternating, check_floor
    from eqx_ckpt._ondisk import _digests

    # Rows of 4,000 bytes: blocks of 32 rows (128,000 bytes), not of 128 KiB.
    state = {"w": jnp.arange(300 * 1000, dtype=jnp.float32).reshape(300, 1000), "b": jnp.ones(5), "step": 3}
    eqx_ckpt.export_safetensors(tmp_path / "rows", state)
    record = json.loads((tmp_path / "rows" / "eqx_ckpt.json").read_bytes())
    leaves = {leaf["path"]: leaf["blocks"] for leaf in record["leaves"]}
    data = memoryview((tmp_path / "rows" / "model.safetensors").read_bytes())
    tensors = check_floor.blocks(str(tmp_path / "rows"))
    assert sorted(name for name, *_ in tensors) == sorted(leaves) and ("w", 1_200_000, 128_000) in {
        (name, nbytes, block) for name, _, nbytes, block in tensors
    }
    for name, offset, nbytes, block in tensors:
        assert _digests._hash(data[offset : offset + nbytes], block, _digests.BLAKE3).hex() == leaves[name], name
    fixed = check_floor.blocks(str(tmp_path / "rows"), fixed=True)
    assert [t[:3] for t in fixed] == [t[:3] for t in tensors]
    assert {block for *_, block in fixed} == {record["block_bytes"]} == {128 * 1024}

    job = {"workload": "tiny", "folder": str(tmp_path), "reps": 2, "published": True}
    alternating.work({**job, "op": "prepare"})
    published, plain = tmp_path / "published", tmp_path / "plain"
    check_floor.plain_copy(str(published), str(plain))
    assert os.listdir(plain) == ["model.safetensors"]
    assert os.path.samefile(plain / "model.safetensors", published / "model.safetensors")
    for arm in check_floor.ARMS:
        timed = check_floor.work({**job, "arm": arm})
        assert len(timed["wall"]) == len(timed["cpu"]) == 2 and min(timed["cpu"]) > 0, arm
    # A plain load on 1.8 cores (1.8 s of CPU in 1 s) and a hash of 0.45 s: 1.25x, in CPU and wall time.
    rounds = {arm: {"wall": [1.0, 2.0], "cpu": [1.8, 3.6]} for arm in check_floor.ARMS}
    rounds["hash"] = {"wall": [0.45, 0.9], "cpu": [0.45, 0.9]}
    assert check_floor.floors(rounds) == {"cpu": [1.25, 1.25], "wall": [1.25, 1.25]}
    report = check_floor.report(rounds, argparse.Namespace(workload="tiny", reps=2))
    assert "floor with hash, cpu: 1.250x plain" in report and "floor with hash-fixed, wall: 2.000x plain" in report
    assert "checked, cpu: 1.000x plain" in report


def test_the_iterators_benchmark_times_saves_and_restores_with_and_without_the_data_position(tmp_path):
    out = iterators.measure("tiny", 2, tmp_path)
    assert out["rounds"] == 2 and out["leaves"] > 10
    for name in ("save_s", "save_with_iterator_s", "restore_s", "restore_with_iterator_s", "capture_s"):
        assert out[name] > 0, name
    assert out["save_ratio_low"] <= out["save_ratio"] <= out["save_ratio_high"]
    assert 100 < out["state_bytes"] < 4096  # Grain's DataLoader state: its JSON, a few hundred bytes
    # A step saved with the iterator holds its state, and a restore puts it back.
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    (step,) = [
        s
        for s in manager.all_steps()
        if (pathlib.Path(manager.step_path(s)) / "manifest.json").read_text().count('"iterators"')
    ]
    moved = iterators.pipeline()
    saved = moved.get_state()  # the benchmark's pipeline, as it was saved
    next(moved)
    assert moved.get_state() != saved
    like = {**eqx.filter_eval_shape(workload.make_state, workload.PRESETS["tiny"]), "data": moved}
    assert manager.restore(like, step=step)["data"].get_state() == saved


def test_the_tiers_benchmark_times_each_contender_and_restores_both_tiers_bit_for_bit(tmp_path, capsys):
    """`benchmarks.tiers` on 4 MiB in two leaves, one round, the bucket behind a
    link of 50 MB/s: every contender's save and its time to the bucket, and
    the tiered step restored from each tier (the benchmark compares them bit
    for bit, and raises otherwise); the local tier's folders are removed. No
    time is asserted."""
    out = tmp_path / "tiers.json"
    local = tmp_path / "shm"
    local.mkdir()
    argv = ["--mib", "4", "--leaves", "2", "--reps", "1", "--mbps", "50", "--local", str(local)]
    assert tiers.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(row["contender"] for row in rows) == sorted(tiers.CONTENDERS)
    for row in rows:
        assert 0 < row["save_s"] <= row["done_s"], row
        assert ("restore_local_s" in row) == (row["contender"] == "tiered"), row
    printed = capsys.readouterr().out
    assert "tiered save blocks" in printed and "restore from the local tier" in printed
    assert list(local.iterdir()) == []


def test_the_tiers_benchmark_with_two_processes_takes_the_slowest_and_restores_each_part(tmp_path, capsys):
    """`benchmarks.tiers --processes 2 --peers 1`: two real `jax.distributed`
    worker processes, each leaf sharded by rows over them, each with its own
    local tier. Every contender's row holds both processes' figures and the
    slowest of each; the three restores ran on both processes (each compares
    the shards it holds bit for bit, and fails otherwise), none from the
    bucket in place of the local tier; the local tiers are removed. No time
    is asserted."""
    out = tmp_path / "tiers.json"
    local = tmp_path / "shm"
    local.mkdir()
    argv = ["--mib", "4", "--leaves", "2", "--reps", "1", "--mbps", "50", "--local", str(local), "--processes", "2"]
    argv += ["--peers", "1"]
    assert tiers.main([*argv, "--json", str(out), "--timeout", "120"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(row["contender"] for row in rows) == sorted(tiers.CONTENDERS)
    for row in rows:
        assert len(row["processes"]) == 2, row
        for key in ("save_s", "done_s"):
            assert row[key] == max(part[key] for part in row["processes"]) > 0, row
        restored = {"restore_persistent_s", "restore_local_s", "restore_peer_s"} <= row["processes"][1].keys()
        assert restored == (row["contender"] == "tiered"), row
        assert not any("restore_local_fell_back" in part for part in row["processes"]), row
    printed = capsys.readouterr().out
    assert "2 processes" in printed and "process 1's part from its peer" in printed
    assert list(local.iterdir()) == []
