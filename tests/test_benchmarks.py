"""Smoke test of the benchmark harness (benchmarks/), so it cannot rot: the tiny
workload, eqx_ckpt and raw only, page cache warm (dropping it would slow everyone
else on the machine), one repetition, each measurement in its own process."""

import json
import pathlib
import sys

import equinox as eqx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# benchmarks/ is a folder at the repository root, not part of the installed package.
sys.path.insert(0, str(ROOT))

from benchmarks import contenders, report, run, workload  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    argv = ["--workload", "tiny", "--contenders", "eqx_ckpt,raw", "--reps", "1"]
    argv += ["--ops", "save,load_warm", "--results", str(directory), "--no-report"]
    run.main(argv)
    with open(directory / "tiny.jsonl") as f:
        return directory, [json.loads(line) for line in f]


def test_every_measurement_ran_and_loaded_the_saved_values(results):
    directory, rows = results
    done = {(r["contender"], r["op"], r["cache"]) for r in rows}
    for contender in ("eqx_ckpt", "raw"):
        assert {(contender, "save", None), (contender, "load", "warm")} <= done
    for row in rows:
        assert row["seconds"] > 0
        if row["op"] in ("load", "params"):
            # The worker compares what was loaded with the tree that was saved.
            assert row["verified"] is True, row
            assert row["rss_added"] >= 0
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
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in table] == ["`eqx_ckpt`", "`raw`"]
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
