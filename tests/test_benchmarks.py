"""Smoke test of the benchmark harness (benchmarks/), so it cannot rot: the tiny
workload, eqx_ckpt and raw only, page cache warm (dropping it would slow everyone
else on the machine), one repetition, each measurement in its own process; and
that a failed measurement is recorded and the run goes on."""

import json
import pathlib
import sys

import equinox as eqx
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# benchmarks/ is a folder at the repository root, not part of the installed package.
sys.path.insert(0, str(ROOT))

import eqx_ckpt  # noqa: E402
from benchmarks import contenders, foreign, report, run, warm_memory, workload  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    argv = ["--workload", "tiny", "--contenders", "eqx_ckpt,raw", "--reps", "1", "--save-reps", "2"]
    argv += ["--ops", "save,save_async,load_warm", "--results", str(directory), "--no-report"]
    run.main(argv)
    with open(directory / "tiny.jsonl") as f:
        return directory, [json.loads(line) for line in f]


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
    saves = {r["contender"]: r for r in rows if r["op"] == "save"}
    assert saves["raw"]["files"] == 1
    # The raw file is the arrays' bytes back to back, nothing else.
    assert saves["raw"]["bytes"] == workload.state_bytes(workload.skeleton(workload.PRESETS["tiny"]))
    assert saves["eqx_ckpt"]["files"] >= 4 and saves["eqx_ckpt"]["bytes"] > saves["raw"]["bytes"]
    # The checkpoints are deleted after the run.
    assert not any((directory / "run-tiny").glob("*"))


def test_report_tables_name_both_contenders(results, tmp_path):
    directory, _ = results
    report.write(str(directory), "python -m benchmarks.run --workload tiny", docs=str(tmp_path), with_chart=False)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "### `tiny`: 88 leaves" in text
    assert "Seconds, min / median of 2 runs for saves and 1 for loads, each in a fresh process" in text
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in table] == ["`eqx_ckpt`", "`raw`"]
    # The targets table lists every target, measured or not.
    targets = [line.split("|") for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert {(cells[2].strip(), cells[1].strip()) for cells in targets} >= {("tiny", "1"), ("tiny", "3"), ("large", "1")}
    async_row = next(cells for cells in targets if cells[1].strip() == "3" and cells[2].strip() == "tiny")
    assert async_row[-2].strip() in ("yes", "no"), async_row
    assert "| 2 | large | peak RSS added by a full load" in text
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
    assert eqx.tree_equal(loaded, state["model"], typematch=True)
    assert not eqx.tree_equal(loaded, workload.concrete(sizes, seed=1)["model"])


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
    assert "| `raw` | failed | – | – | – | failed |" in text
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


def test_the_worker_reports_its_own_failure(tmp_path):
    job = {"workload": "tiny", "sizes": workload.PRESETS["tiny"].__dict__, "contender": "raw", "op": "load"}
    job |= {"cache": "warm", "path": str(tmp_path / "missing.bin"), "rep": 0}
    result = run.run_job(job, timeout=600)
    assert result["error"].startswith("FileNotFoundError"), result
    assert "Traceback" in result["traceback"] and "seconds" not in result


def test_warm_memory_measures_every_kind_after_each_warm_up_and_cleans_up(tmp_path):
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
    import shutil

    needed = run.disk_needed(workload.PRESETS["large"], ["eqx_ckpt", "raw"], run.OPS["large"])
    assert 3 * 3.1e9 < needed < 3 * 3.3e9 + 2e9  # two checkpoints and eqx_ckpt's asynchronous one
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: usage._replace(free=needed - 1))
    monkeypatch.setattr(run, "run_job", lambda *a, **k: pytest.fail("a measurement ran"))
    argv = ["--workload", "large", "--contenders", "eqx_ckpt,raw", "--results", str(tmp_path), "--no-report"]
    with pytest.raises(SystemExit, match=r"needs about 1\d\.\d GB free .* Free some space"):
        run.main(argv)
    assert not list(tmp_path.glob("*.jsonl"))


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
