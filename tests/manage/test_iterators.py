"""A data pipeline's position saved with the tree (`_iterators`, issue 85),
with real Grain pipelines and real files."""

import json
import os
import random
import re
import signal
import warnings

import grain
import iterator_worker
import jax
import jax.numpy as jnp
import manifests
import numpy as np
import places
import prefork
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._tools._cli import main


class Position:
    """An iterator of the shape eqx_ckpt saves: any state it is given."""

    def __init__(self, state, refuse=None):
        self.state, self.refuse = state, refuse

    def get_state(self):
        return self.state

    def set_state(self, state):
        if self.refuse is not None:
            raise ValueError(self.refuse)
        self.state = state


def _dataset():
    return grain.MapDataset.range(11).shuffle(seed=7).map(lambda x: x * 3).batch(2)


def _take(iterator, count):
    return [np.asarray(next(iterator)) for _ in range(count)]


@pytest.mark.parametrize("blocking", [True, False])
def test_map_dataset_iterators_resume_where_they_were(tmp_path, blocking):
    ds = _dataset()
    train, evaluation = iter(ds), iter(ds.repeat(3))
    _take(train, 2), _take(evaluation, 9)  # the second one in its second epoch
    tree = {"w": jnp.arange(3.0), "data": [train, {"eval": evaluation}]}
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree, blocking=blocking)
    after = _take(train, 3), _take(evaluation, 6)  # taken after the save asked for the states
    if pending is not None:
        pending.wait()
    like = {"w": jnp.zeros(3), "data": [iter(ds), {"eval": iter(ds.repeat(3))}]}
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", like)
    assert out["data"][0] is like["data"][0] and out["data"][1]["eval"] is like["data"][1]["eval"]
    assert tree_equal(out["w"], tree["w"], typematch=True)
    resumed = _take(out["data"][0], 3), _take(out["data"][1]["eval"], 6)
    assert tree_equal(resumed, after, typematch=True)


def test_a_data_loader_iterator_resumes_over_epochs(tmp_path):
    uninterrupted = iter(iterator_worker.loader())
    expected = _take(uninterrupted, 7)  # three epochs of ten records, by four
    run = iter(iterator_worker.loader())
    _take(run, 4)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", {"step": 4, "data": run})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["format_version"] == 7
    assert [s["kind"] for s in manifest["iterators"][0]["states"]] == ["bytes"]  # as Grain gives it
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", {"step": 0, "data": iter(iterator_worker.loader())})
    assert out["step"] == 4
    assert tree_equal(_take(out["data"], 3), expected[4:], typematch=True)


WORKER = places.SUPPORT / "iterator_worker.py"
STEPS = 7
# The step after whose batch the preempted runs send SIGTERM; print the seed to rerun one.
SEED = int(os.environ.get("EQX_CKPT_ITERATOR_SEED", random.randrange(2**32)))


@pytest.fixture
def env(tmp_path):
    """The environment of the runs: one CPU device a process, this checkout first
    on the path, and one persistent compilation cache (the runs compile the
    same programs: the first writes them, the others load the same executables)."""
    environ = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environ.pop("XLA_FLAGS", None)
    environ["PYTHONPATH"] = os.pathsep.join([str(places.ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax-cache")
    environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**30)  # (a size limit: the cache then locks its files)
    return environ


def _run(directory, out, env, term_at=None, processes=1, workers=0, kill_at=None):
    """One launch of `iterator_worker.py DIRECTORY STEPS OUT [TERM_AT]` in
    `processes` processes of a `jax.distributed` job (each forked from a
    `prefork` template that imported JAX: a new process all the same, with its
    own data loader, model, manager and SIGTERM): each process's batches, and
    the line each ended with (`None` for a run SIGKILLed at `kill_at`)."""
    out.mkdir()
    port, launches = places.free_port(), []
    for i in range(processes):
        flags = [f"--workers={workers}"] + ([f"--process={i},{processes},{port}"] if processes > 1 else [])
        flags += [] if kill_at is None else [f"--kill-at={kill_at}"]
        args = [str(WORKER), *flags, str(directory), str(STEPS), str(out)] + ([] if term_at is None else [str(term_at)])
        launches.append((args, out.parent / f"{out.name}.{i}.log"))
    codes, logs = prefork.run_all(launches, env=env)
    if kill_at is not None:
        assert codes == [-signal.SIGKILL] * processes, "\n".join(logs)
        return None
    assert codes == [0] * processes, "\n".join(logs)
    names = ["batches.json"] if processes == 1 else [f"batches.{i}.json" for i in range(processes)]
    # (Grain's workers may leave a warning of Python's after it)
    ends = [re.findall(r"^(finished|preempted at \d+)$", log, re.MULTILINE)[-1:] for log in logs]
    return [json.loads((out / name).read_text()) for name in names], [
        end[0] if end else log for end, log in zip(ends, logs)
    ]


def _same_model(a, b):
    a, b = eqx_ckpt.Checkpoint(a), eqx_ckpt.Checkpoint(b)
    assert sorted(a) == sorted(b)
    for key in a:
        assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), key


@pytest.mark.parametrize(
    "processes, workers",
    [(1, 1), (2, 0)],
    ids=["one-process-a-grain-worker", "two-jax-processes"],
)
def test_a_preempted_run_resumes_its_data_and_ends_bit_for_bit(tmp_path, env, processes, workers):
    """A run preempted by SIGTERM at a random step, through the manager, and
    resumed by a fresh launch takes, in each process, the batches an
    uninterrupted run takes after that step, and ends with its parameters bit
    for bit. One process reads through a Grain worker process; with two
    `jax.distributed` processes, each reads its own shard."""
    # (from step 1: the manager takes SIGTERM over at the loop's first `reached_preemption`)
    term_at = random.Random(SEED).randrange(1, STEPS - 2)
    print(f"SIGTERM after step {term_at} (EQX_CKPT_ITERATOR_SEED={SEED})")
    whole, ends = _run(tmp_path / "whole", tmp_path / "whole_out", env, processes=processes, workers=workers)
    assert ends == ["finished"] * processes
    first, ends = _run(tmp_path / "run", tmp_path / "first", env, term_at, processes, workers)
    (stop,) = set(ends)  # every process stopped at the same step, at or after the SIGTERM
    stopped = int(stop.removeprefix("preempted at "))
    assert term_at <= stopped < STEPS - 1 and eqx_ckpt.CheckpointManager(tmp_path / "run").latest_step() == stopped
    second, ends = _run(tmp_path / "run", tmp_path / "second", env, processes=processes, workers=workers)
    assert ends == ["finished"] * processes
    for i in range(processes):
        assert len(first[i]) == stopped + 1 and first[i] + second[i] == whole[i], f"process {i}"
    _same_model(tmp_path / "whole_out" / "model", tmp_path / "second" / "model")
    if processes > 1:
        _check_per_process(tmp_path / "run", stopped, whole)


def test_a_killed_run_resumes_its_data_from_its_last_step_bit_for_bit(tmp_path, env):
    """A run SIGKILLed (no save, no exit work) after it took a batch resumes,
    in a fresh process, from its last committed step: it takes again the
    batches after that step, as an uninterrupted run does, and ends with its
    parameters bit for bit."""
    kill_at = random.Random(SEED).randrange(3, STEPS - 1)  # after step 2's periodic save
    print(f"SIGKILL after step {kill_at}'s batch (EQX_CKPT_ITERATOR_SEED={SEED})")
    (whole,), _ = _run(tmp_path / "whole", tmp_path / "whole_out", env)
    assert _run(tmp_path / "run", tmp_path / "first", env, kill_at=kill_at) is None
    latest = eqx_ckpt.CheckpointManager(tmp_path / "run").latest_step()
    assert latest == kill_at - 1 - (kill_at - 1 - 2) % 3  # the last periodic save (steps 2, 5, ...) before it
    (second,), ends = _run(tmp_path / "run", tmp_path / "second", env)
    assert ends == ["finished"] and second == whole[latest + 1 :]
    _same_model(tmp_path / "whole_out" / "model", tmp_path / "second" / "model")


def _check_per_process(run, step, whole):
    """Each process read its own shard; the step holds each process's state,
    and a restore by another number of processes is an error naming the leaf."""
    assert not {str(row) for batch in whole[0] for row in batch} & {str(row) for batch in whole[1] for row in batch}
    (folder,) = [p for p in run.iterdir() if p.name.endswith(f"{step:08d}")]
    (record,) = json.loads((folder / "manifest.json").read_text())["iterators"]
    assert record["path"] == "data" and len(record["states"]) == 2
    assert record["states"][0]["data"] != record["states"][1]["data"]
    like = {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32), "data": iter(iterator_worker.loader((0, 2)))}
    said = r"Leaf `data` .*its iterator states were saved by 2 JAX process\(es\), but 1 are loading it"
    with pytest.raises(eqx_ckpt.LeafError, match=said):
        eqx_ckpt.CheckpointManager(run).restore(like, step=step)


@pytest.mark.parametrize(
    "state, why",
    [
        (b"x" * (2**20 + 1), "it is 1048577 bytes, more than the 1048576 allowed"),
        ({"next_index": (1, 2)}, "it holds a builtins.tuple, which is neither JSON nor bytes"),
        ({"next_index": np.int64(3)}, "it holds a numpy.int64"),
        ({1: 2}, "it is a dict with a key of type int (1), not str"),
        ({"at": float("nan")}, "it holds nan, which JSON has no number for"),
    ],
)
def test_a_state_that_cannot_be_saved_names_the_leaf_and_commits_nothing(tmp_path, state, why):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)})
    before = (tmp_path / "manifest.json").read_bytes()
    for blocking in (True, False):
        with pytest.raises(eqx_ckpt.LeafError, match=re.escape("['pipe'][0]") + ".*" + re.escape(why)):
            eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "pipe": [Position(state)]}, blocking=blocking)
    assert (tmp_path / "manifest.json").read_bytes() == before


def _edit_states(path, edit):
    body = json.loads((path / "manifest.json").read_text())
    edit(body["iterators"][0]["states"])
    (path / "manifest.json").write_bytes(manifests.sign(body))


@pytest.mark.parametrize(
    "edit, error, why",
    [
        (lambda s: s[0].update(data='{"next_index":9}'), eqx_ckpt.IntegrityError, "do not match their digest"),
        (lambda s: s[0].update(kind="bytes"), eqx_ckpt.IntegrityError, "not base64"),
        (lambda s: s[0].update(data="e30="), eqx_ckpt.IntegrityError, "do not match their digest"),
        (lambda s: s[0].update(data="not base64!", kind="bytes"), eqx_ckpt.IntegrityError, "not base64"),
        (lambda s: s.append(dict(s[0])), eqx_ckpt.LeafError, "saved by 2 JAX process(es), but 1 are loading it"),
    ],
)
def test_a_damaged_or_foreign_state_is_an_error_naming_the_leaf(tmp_path, edit, error, why):
    it = iter(_dataset())
    _take(it, 2)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "data": it})
    _edit_states(tmp_path, edit)
    fresh = iter(_dataset())
    with pytest.raises(error, match=r"`data`.*" + re.escape(why)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(2), "data": fresh})
    assert fresh.get_state() == {"next_index": 0}  # never a silent restart, never half-set


def test_a_manifest_whose_states_are_malformed_is_refused(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "data": Position({"at": 1})})
    _edit_states(tmp_path, lambda s: s[0].update(data="x" * (2 * 2**20)))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="iterator #0: a state is not one of"):
        eqx_ckpt.Checkpoint(tmp_path)


@pytest.mark.parametrize(
    "paths",
    [["model.w"], ["model.w.inner"], ["model"], [""], ["data", "data.inner"], ["data", "data"]],
    ids=["at-a-leaf", "inside-a-leaf", "above-a-leaf", "the-root", "inside-an-iterator", "twice"],
)
def test_an_iterator_where_another_part_lies_is_refused(tmp_path, paths):
    """A record places each iterator apart from every leaf and every other
    iterator: one at, inside or above another part is a damaged manifest."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"w": jnp.ones(2)}, "data": Position({"at": 1})})
    body = json.loads((tmp_path / "manifest.json").read_text())
    (record,) = body["iterators"]
    assert record["keypath"] == [["key", "data"]]
    keypath = lambda path: [["key", part] for part in path.split(".")] if path else []
    body["iterators"] = [{**record, "path": path, "keypath": keypath(path)} for path in paths]
    (tmp_path / "manifest.json").write_bytes(manifests.sign(body))
    said = "an iterator is listed twice" if len(set(paths)) < len(paths) else "lies inside another, or at the same"
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=said):
        eqx_ckpt.Checkpoint(tmp_path)


def test_a_missing_state_is_an_error_unless_kept(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)})
    like = {"w": jnp.zeros(2), "data": Position({"at": 0})}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("['data']") + ".*its iterator state is not in"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, missing="keep")
    assert out["data"] is like["data"] and out["data"].state == {"at": 0}


def test_a_refused_state_is_an_error_with_the_iterators_message(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "data": Position(b"\x00\xff")})
    like = {"w": jnp.zeros(2), "data": Position(None, refuse="not my pipeline")}
    with pytest.raises(eqx_ckpt.LeafError, match=r"`data`.*refused the saved state: ValueError: not my pipeline"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(2), "data": Position(None)})
    assert out["data"].state == b"\x00\xff"


def test_a_load_that_does_not_select_the_iterator_leaves_it_alone(tmp_path):
    saved = {"model": {"w": jnp.ones(2)}, "data": Position({"at": 5})}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"model": {"w": jnp.zeros(2)}, "data": Position({"at": 0})}
    for options in ({"where": lambda t: t["model"]}, {"where": lambda t: t["model"], "lazy": True}):
        out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, **options)
        assert out["data"] is like["data"] and like["data"].state == {"at": 0}
    fresh = Position({"at": 0})
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(2)}, prefix="model")["w"].shape == (2,)
    assert fresh.state == {"at": 0}
    # A plain leaf where the iterator was is left as it is.
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, {"model": {"w": jnp.zeros(2)}, "data": None})["data"] is None
    # Selected alone, the iterator is loaded.
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda t: t["data"])
    assert like["data"].state == {"at": 5} and tree_equal(out["model"], like["model"])


def test_a_partial_save_keeps_the_states_it_does_not_pick(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": Position({"at": 1}), "b": Position({"at": 2}), "w": jnp.ones(2)})
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": None, "b": Position({"at": 3}), "w": None}, where=lambda t: t["b"])
    like = {"a": Position(None), "b": Position(None), "w": jnp.zeros(2)}
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert (out["a"].state, out["b"].state) == ({"at": 1}, {"at": 3})
    assert tree_equal(out["w"], jnp.ones(2), typematch=True)


def test_the_manager_saves_and_restores_a_step_with_its_data(tmp_path):
    ds = _dataset()
    with eqx_ckpt.CheckpointManager(tmp_path) as manager:
        it = iter(ds)
        for step in range(3):
            _take(it, 1)
            manager.save(step, {"w": jnp.full(2, float(step)), "data": it})
        after = _take(it, 2)
        out = manager.restore({"w": jnp.zeros(2), "data": iter(ds)})
        assert tree_equal(_take(out["data"], 2), after, typematch=True)
        out = manager.restore({"w": jnp.zeros(2), "data": iter(ds)}, step=0)
        assert out["data"].get_state() == {"next_index": 1}


def test_verify_checks_every_state_digest(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "data": Position({"at": 1})})
    assert eqx_ckpt.verify(tmp_path) == []
    _edit_states(tmp_path, lambda s: s[0].update(data='{"at":2}'))
    (problem,) = eqx_ckpt.verify(tmp_path)
    assert problem.leaf == "data" and "the state of process 0" in problem.message
    assert "do not match their digest" in problem.message


def test_a_load_into_the_same_tree_reads_no_structure_record(tmp_path, faults):
    """The save records an iterator as not stored as an array; a load into a
    `like` of the same tree makes the same record, so it never parses the
    stored one (a restore of 1,204 leaves spent 90 ms there)."""
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", {"w": jnp.ones(3), "data": Position({"at": 5})})
    compared = []
    faults("load.structure_compared", compared.append)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", {"w": jnp.zeros(3), "data": Position(None)})
    assert out["data"].state == {"at": 5} and compared == []
    # (a `like` of another structure is compared)
    other = {"w": jnp.zeros(3), "data": Position(None), "n": 1}
    eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", other, missing="keep")
    assert compared == [str(tmp_path / "c")]


# -- Seen by `Checkpoint`, `ls`, `info` and `diff` -----------------------------------------------


def _two_iterators(path):
    """A checkpoint of two arrays and two iterators, one of JSON state, one of bytes."""
    tree = {"w": jnp.ones(3), "data": [Position({"at": 1}), {"eval": Position(b"\x00\xff\x01")}], "step": 7}
    eqx_ckpt.tree_serialise_leaves(path, tree)


def test_ls_and_info_show_each_iterator_with_the_arrays(tmp_path, capsys):
    _two_iterators(tmp_path / "c")
    assert main(["ls", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "data/",
        "  0       iterator (json, 1 process)          8 B",
        "  1/",
        "    eval  iterator (bytes, 1 process)         3 B",
        "step      int64[]                             8 B",
        "w         float32[3]                         12 B",
        "2 leaves, 20 B; 2 iterators, 11 B of state",
    ]
    assert main(["ls", "--depth", "1", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "data/  2 iterators        11 B"
    assert main(["info", str(tmp_path / "c")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("leaves:          2")
    assert lines[at + 1] == "iterators:       2 states of 2 iterators (data.0, data.1.eval), saved by 1 process"
    # A checkpoint without iterators shows none.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", {"w": jnp.ones(3)})
    assert main(["info", str(tmp_path / "plain")]) == 0
    assert "iterator" not in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "plain")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 leaves, 12 B"


def test_checkpoint_counts_iterators_and_reads_their_states(tmp_path):
    _two_iterators(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert repr(ckpt) == f"Checkpoint({str(tmp_path)!r}, 2 leaves, 2 iterators, 20 bytes)"
    assert list(ckpt) == ["step", "w"] and "data.0" not in ckpt  # the mapping's keys are array leaves
    assert ckpt.iterator_states() == {"data.0": [{"at": 1}], "data.1.eval": [b"\x00\xff\x01"]}
    with pytest.raises(eqx_ckpt.CheckpointKeyError, match=r"'data\.0' is the saved state of an iterator") as info:
        ckpt["data.0"]
    assert "`Checkpoint(path).iterator_states()['data.0']` reads it" in str(info.value)
    with pytest.raises(eqx_ckpt.CheckpointKeyError, match=r"'data' holds no array leaf .*\(data\.0, data\.1\.eval\)"):
        ckpt.load("data")
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", {"w": jnp.ones(3)})
    plain = eqx_ckpt.Checkpoint(tmp_path / "plain")
    assert plain.iterator_states() == {} and "iterator" not in repr(plain)


def test_checkpoint_refuses_a_damaged_state_naming_the_leaf(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2), "data": Position({"at": 1})})
    _edit_states(tmp_path, lambda s: s.append(dict(s[0])))  # as two processes save it
    assert eqx_ckpt.Checkpoint(tmp_path).iterator_states() == {"data": [{"at": 1}, {"at": 1}]}
    _edit_states(tmp_path, lambda s: s[1].update(data='{"at":2}'))
    ckpt = eqx_ckpt.Checkpoint(tmp_path)  # opens: the states are checked where they are read
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"`data`.*its iterator state is damaged.*do not match"):
        ckpt.iterator_states()


def test_diff_of_checkpoints_differing_only_in_the_data_position(tmp_path, capsys):
    it = iter(_dataset())
    _take(it, 1)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", {"w": jnp.ones(3), "pipeline": it})
    _take(it, 1)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", {"w": jnp.ones(3), "pipeline": it})
    changes = eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")
    assert changes.iterators == (("pipeline", "iterator state differs"),) and len(changes) == 1
    assert list(changes) == ["! pipeline: iterator state differs"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "! pipeline: iterator state differs",
        "1 leaves in both: 1 equal, 0 with other values (0 B of 12 B compared), 0 of another shape, dtype or type; "
        "0 added, 0 removed; 1 iterator whose state differs",
    ]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out == (
        f"{tmp_path / 'a'} and {tmp_path / 'a'} are equal: the same leaves, dtypes, shapes, values and structure.\n"
    )
    assert not eqx_ckpt.diff(tmp_path / "a", tmp_path / "a")


def test_diff_names_the_process_whose_state_differs(tmp_path, capsys):
    for name in "abc":
        eqx_ckpt.tree_serialise_leaves(tmp_path / name, {"w": jnp.ones(2), "data": Position({"at": 1})})
    # As three processes save it: in `b`, process 1 is elsewhere.
    _edit_states(tmp_path / "a", lambda s: s.extend([dict(s[0]), dict(s[0])]))
    _edit_states(tmp_path / "b", lambda s: s.extend([dict(s[0], data='{"at":2}'), dict(s[0])]))
    assert list(eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")) == ["! data: iterator states differ in process 1 of 3"]
    assert list(eqx_ckpt.diff(tmp_path / "c", tmp_path / "a")) == [
        "~ data: iterator (json, 1 process) -> iterator (json, 3 processes)"
    ]
    row = eqx_ckpt.Checkpoint(tmp_path / "a").listing().splitlines()[0]
    assert row.split() == "data iterator (json, 3 processes) 8 B".split()
    assert main(["info", str(tmp_path / "a")]) == 0
    assert "iterators:       3 states of 1 iterator (data), saved by 3 processes\n" in capsys.readouterr().out


def test_diff_of_an_iterator_in_one_checkpoint_only(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", {"w": jnp.ones(2), "data": Position({"at": 1}), "z": Position(1)})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", {"w": jnp.ones(2), "data": Position(b"\x01"), "z": jnp.ones(1)})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", {"w": jnp.ones(2)})
    assert list(eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")) == [
        "~ data: iterator (json, 1 process) -> iterator (bytes, 1 process)",
        "~ z: iterator (json, 1 process) -> float32[1]",
    ]
    # Said once, as an added or removed leaf (not again as a part of the structure).
    changes = eqx_ckpt.diff(tmp_path / "c", tmp_path / "a")
    assert list(changes) == ["+ data", "+ z"] and changes.added == ("data", "z")
    assert list(eqx_ckpt.diff(tmp_path / "a", tmp_path / "c")) == ["- data", "- z"]


def test_an_export_names_the_iterators_it_leaves_out(tmp_path):
    """A published folder holds a model's arrays: a run's data position is not
    exported, and the export says so, naming it (never silently)."""
    run = {"model": {"w": jnp.ones(3)}, "data": Position({"at": 2})}
    # (and, as for any object, that a load without `like` cannot rebuild it)
    with pytest.warns(eqx_ckpt.NeedsCodeWarning), pytest.warns(UserWarning, match=r"Not exported: `data`, a data"):
        eqx_ckpt.export_safetensors(tmp_path / "pub", run)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", run)
    with pytest.warns(eqx_ckpt.NeedsCodeWarning), pytest.warns(UserWarning, match=r"Not exported: `data`"):
        eqx_ckpt.export_safetensors(tmp_path / "pub2", tmp_path / "c")  # a checkpoint's path, likewise
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model alone: no warning
        eqx_ckpt.export_safetensors(tmp_path / "model", run, prefix="model")
    assert eqx_ckpt.Checkpoint(tmp_path / "model").keys() == {"w"}
