"""A local tier with several JAX processes (issue 86): four real
`jax.distributed` processes on this machine, each with a local directory of
its own (standing for its own host's RAM disk), the persistent tier shared.

Each run is `iterator_worker.py`: a model sharded by rows over the processes,
each process reading its own shard of the data, saving at steps 2 and 5 (and
where it is preempted)."""

import functools
import json
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import places
import prefork
import pytest

import eqx_ckpt

PROCESSES = 4
KILLED = "killed"
ENDED = "process 2 killed"
STEPS = 7
WORKER = places.SUPPORT / "iterator_worker.py"
# The step after whose batch the preempted run sends SIGTERM; print the seed to rerun one.
SEED = int(os.environ.get("EQX_CKPT_ITERATOR_SEED", random.randrange(2**32)))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One CPU device a process, this checkout first on the path, one compilation cache for every run."""
    environ = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environ.pop("XLA_FLAGS", None)
    environ["PYTHONPATH"] = os.pathsep.join([str(places.ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**30)
    return environ


def _run(root, name, env, *flags, term_at=None, codes=0, kill_on=None):
    """One launch of the tiered run in `root` (persistent tier `root/run`,
    process i's local tier `root/local_i`), its outputs in `root/name`: each
    process's batches and last line (`None` for a run that ends otherwise:
    every process's exit status is then `codes`, one or one per process;
    `KILLED`: each SIGKILLed, or aborted by `jax.distributed` once the
    process running its coordinator was). `kill_on`: a file whose creation
    makes this SIGKILL every process (a job killed from outside)."""
    out = root / name
    out.mkdir()
    port, launches = places.free_port(), []
    for i in range(PROCESSES):
        tiers = [f"--process={i},{PROCESSES},{port}", f"--local={root}/local_{{i}}", *flags]
        args = [str(WORKER), *tiers, str(root / "run"), str(STEPS), str(out)]
        launches.append((args + ([] if term_at is None else [str(term_at)]), root / f"{name}.{i}.log"))
    watch = None if kill_on is None else functools.partial(_kill_on, out / kill_on)
    ended, logs = prefork.run_all(launches, env=env, watch=watch)
    expected = codes if isinstance(codes, list) else [codes] * PROCESSES
    if codes == KILLED:
        expected = [code if code == -signal.SIGABRT else -signal.SIGKILL for code in ended]
        assert ended[0] == -signal.SIGKILL, "\n".join(logs)  # (the coordinator's process)
    if codes == ENDED:  # process 2 killed; each other one stopped itself (3) or was ended by `jax.distributed`
        stopped = [code if code in (3, -signal.SIGABRT) else 3 for code in ended]
        expected = [*stopped[:2], -signal.SIGKILL, *stopped[3:]]
    assert ended == expected, "\n".join(logs)
    if codes != 0:
        return logs
    ends = [re.findall(r"^(finished|preempted at \d+)$", log, re.MULTILINE)[-1:] for log in logs]
    batches = [json.loads((out / f"batches.{i}.json").read_text()) for i in range(PROCESSES)]
    return batches, [end[0] if end else log for end, log in zip(ends, logs)]


def _kill_on(marker, processes):
    """SIGKILL every process once `marker` exists (or one has ended)."""
    deadline = time.monotonic() + 120
    while not marker.exists() and all(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process in processes:
        process.kill()


@pytest.fixture(scope="module")
def whole(tmp_path_factory, env):
    """An uninterrupted tiered run: each process's batches, and the folder of its final model."""
    root = tmp_path_factory.mktemp("whole")
    batches, ends = _run(root, "out", env, "--every=2")
    assert ends == ["finished"] * PROCESSES
    return batches, root / "out" / "model"


def _resumes(root, env, whole, restored, *flags):
    """A fresh launch in `root` resumes from step `restored`: each process takes
    the batches an uninterrupted run takes after it, and ends with its model bit for bit."""
    batches, ends = _run(root, "second", env, "--every=2", *flags)
    assert ends == ["finished"] * PROCESSES
    for i in range(PROCESSES):
        assert batches[i] == whole[0][i][restored + 1 :], f"process {i}"
    ours, theirs = eqx_ckpt.Checkpoint(root / "second" / "model"), eqx_ckpt.Checkpoint(whole[1])
    assert sorted(ours) == sorted(theirs) == ["table", "w"]
    for key in ours:
        assert np.asarray(ours[key]).tobytes() == np.asarray(theirs[key]).tobytes()


def _chunks(step_folder, leaf):
    return sorted(p.name for p in (step_folder / leaf / "c").iterdir())


@pytest.mark.parametrize("then", ["persistent-step-deleted", "a-part-damaged"])
def test_each_process_saves_its_part_and_a_preempted_run_resumes_from_the_local_tiers(tmp_path, env, whole, then):
    """Preempted at a random step: each process's local tier holds its own row
    of the model, with every process's data position; the persistent step is
    their parts together. With the persistent step deleted, the relaunch
    restores it from the local tiers alone, bit for bit. With a byte of
    process 1's part flipped, every process loads the persistent step (with
    an `IntegrityWarning`), never process 1's part, nor a mix of tiers."""
    term_at = random.Random(SEED).randrange(1, STEPS - 2)
    print(f"SIGTERM after step {term_at} (EQX_CKPT_ITERATOR_SEED={SEED})")
    _, ends = _run(tmp_path, "first", env, "--every=1000", term_at=term_at)
    (stop,) = set(ends)
    stopped = int(stop.removeprefix("preempted at "))
    persistent = eqx_ckpt.CheckpointManager(tmp_path / "run")
    assert persistent.all_steps() == [stopped]  # the preempted step is copied, whatever `persistent_every` says
    name = f"step_{stopped:08d}"
    manifests = [(tmp_path / f"local_{i}" / name / "manifest.json").read_bytes() for i in range(PROCESSES)]
    for i in range(PROCESSES):
        for leaf in ("w", "table"):
            assert _chunks(tmp_path / f"local_{i}" / name, leaf) == [str(i)]  # its own rows, and no other
    for leaf in ("w", "table"):
        assert _chunks(tmp_path / "run" / name, leaf) == [str(i) for i in range(PROCESSES)]
    assert (tmp_path / "run" / name / "manifest.json").read_bytes() == manifests[0]
    states = [json.loads(m)["iterators"] for m in manifests]
    assert all(s == states[0] for s in states) and len(states[0][0]["states"]) == PROCESSES
    if then == "persistent-step-deleted":
        shutil.rmtree(tmp_path / "run" / name)
        _resumes(tmp_path, env, whole, stopped)
        return
    chunk = tmp_path / "local_1" / name / "table" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    _resumes(tmp_path, env, whole, stopped)
    for i in range(PROCESSES):
        log = (tmp_path / f"second.{i}.log").read_text()
        said = rf"IntegrityWarning: Step {stopped} of the local tier .*Leaf `table`.* loaded from the persistent tier"
        assert re.search(said, log, re.DOTALL), log
        assert ("Loading failed in 1 other process(es)" in log) == (i != 1), log


def test_a_lost_local_tier_restores_the_newest_whole_step(tmp_path, env, whole):
    """Killed after step 6's batch: the local tiers hold steps 2 and 5, the
    persistent tier step 2. With one host's tier emptied (a host replaced),
    every process restores step 2 from the persistent tier, never a mix of
    steps."""
    _run(tmp_path, "first", env, "--every=2", "--kill-at=6", codes=KILLED)
    assert eqx_ckpt.CheckpointManager(tmp_path / "run").all_steps() == [2]
    assert all((tmp_path / f"local_{i}" / "step_00000005" / "manifest.json").exists() for i in range(PROCESSES))
    shutil.rmtree(tmp_path / "local_1")
    _resumes(tmp_path, env, whole, 2)


def test_a_process_killed_as_it_commits_its_part_leaves_the_step_unwhole(tmp_path, env, whole):
    """Process 1 is SIGKILLed as it commits its part of step 5, after every
    process wrote its own: the others commit theirs, and name it. The step is
    whole nowhere, so the relaunch restores step 2, and saves step 5 again."""
    codes = [3, -signal.SIGKILL, 3, 3]
    logs = _run(tmp_path, "first", env, "--every=2", "--die-in-commit=5", codes=codes)
    for i in (0, 2, 3):
        said = r"failed: Process 1 of 4 stopped answering during the save, after stage 'written'.*Each other process"
        assert re.search(said, logs[i]), logs[i]
    parts = [(tmp_path / f"local_{i}" / "step_00000005" / "manifest.json").exists() for i in range(PROCESSES)]
    assert parts == [True, False, True, True]
    _resumes(tmp_path, env, whole, 2)
    assert all((tmp_path / f"local_{i}" / "step_00000005" / "manifest.json").exists() for i in range(PROCESSES))


def _parts(root, index, step):
    return json.loads((root / f"local_{index}" / "peers" / f"step_{step:08d}" / "parts.json").read_text())["parts"]


def test_a_host_replaced_by_an_empty_one_fetches_its_part_from_a_peer(tmp_path, env, whole):
    """With `peers=1`, each process's part of steps 2 and 5 is also held by the
    next process. Process 1's local tier emptied, the relaunch restores step 5
    (which the persistent tier lacks) with process 1's part fetched from its
    peer, bit for bit, and process 1 holds it again."""
    _run(tmp_path, "first", env, "--every=2", "--peers=1", "--kill-at=6", codes=KILLED)
    assert eqx_ckpt.CheckpointManager(tmp_path / "run").all_steps() == [2]
    ids = _parts(tmp_path, 0, 5)
    assert len(set(ids)) == PROCESSES and all(_parts(tmp_path, i, 5) == ids for i in range(PROCESSES))
    for i in range(PROCESSES):  # the copy of the previous process's part, committed
        copies = [p.name for p in (tmp_path / f"local_{i}" / "peers" / "step_00000005").iterdir() if p.is_dir()]
        assert copies == [ids[i - 1]]
        assert (tmp_path / f"local_{i}" / "peers" / "step_00000005" / ids[i - 1] / "manifest.json").exists()
    shutil.rmtree(tmp_path / "local_1")
    _resumes(tmp_path, env, whole, 5, "--peers=1")
    fetched = tmp_path / "local_1" / "peers" / "step_00000005" / ids[1]
    assert _chunks(fetched, "table") == ["1"]


def test_steps_every_local_tier_dropped_are_no_longer_listed_with_peers(tmp_path, env, whole):
    """With `peers=1` and `local_max_to_keep=1`, nothing in the persistent tier:
    once step 5 is saved, every process's retention drops step 2, its part and
    the peers' copies of it, and no process lists it any more, then or after a
    relaunch, which restores step 5."""
    flags = ["--every=3", "--peers=1", "--keep=1"]
    _, ends = _run(tmp_path, "first", env, *flags)
    assert ends == ["finished"] * PROCESSES
    logs = [(tmp_path / f"first.{i}.log").read_text() for i in range(PROCESSES)]
    assert all(re.findall(r"^steps (.*)$", log, re.MULTILINE) == ["[5]"] for log in logs), "\n".join(logs)
    assert eqx_ckpt.CheckpointManager(tmp_path / "run").all_steps() == []
    for i in range(PROCESSES):
        local = tmp_path / f"local_{i}"
        assert sorted(p.name for p in local.glob("step_*")) == ["step_00000005"]
        assert sorted(p.name for p in (local / "peers").iterdir()) == ["step_00000005"]
    _resumes(tmp_path, env, whole, 5, *flags)


def test_a_job_killed_while_parts_move_to_peers_restores_the_newest_whole_step(tmp_path, env, whole):
    """The job is killed while the parts of step 5 move to their peers (as
    the first process passes the first window): the local parts of step 5
    are committed, their copies are not. With process
    1's tier emptied, step 5 is whole nowhere, so every process restores step 2."""
    flags = ["--every=2", "--peers=1", "--die-in-exchange=5"]
    _run(tmp_path, "first", env, *flags, codes=KILLED, kill_on="exchange.marker")
    assert (tmp_path / "first" / "exchange.marker").exists()
    assert all((tmp_path / f"local_{i}" / "step_00000005" / "manifest.json").exists() for i in range(PROCESSES))
    copies = list((tmp_path / "local_2" / "peers" / "step_00000005").glob("*/manifest.json"))
    assert copies == []
    shutil.rmtree(tmp_path / "local_1")
    _resumes(tmp_path, env, whole, 2, "--peers=1")


def test_a_peer_killed_while_parts_move_is_named_and_its_host_restores_the_newest_whole_step(tmp_path, env, whole):
    """Process 2 is SIGKILLed while the parts of step 5 move to their peers.
    Each other process either names it within seconds (its part did not
    arrive: its heartbeat stopped, or its connection broke; or the next
    barrier found it gone), or is ended first by `jax.distributed`, which
    ends a job whose process died. Its
    host then replaced by an empty one, step 5 is whole nowhere (process 2's
    part has no committed copy), so every process restores step 2."""
    flags = ["--every=2", "--peers=1", "--peer-dies=5"]
    logs = _run(tmp_path, "first", env, *flags, codes=ENDED)
    for i in (0, 1, 3):
        # Named by the move of step 5, or (where this process's move had ended) by the next barrier.
        said = r"failed: Step 5 was saved to the local tiers, but sending the parts to their peers failed: "
        move = re.search(said + r".*process 2's part did not arrive", logs[i], re.DOTALL)
        named = move or re.search(r"failed: Process 2 of 4 (never joined|stopped answering)", logs[i])
        assert named or "Terminating process because the JAX distributed service" in logs[i], logs[i]
    assert not list((tmp_path / "local_3" / "peers" / "step_00000005").glob("*/manifest.json"))
    shutil.rmtree(tmp_path / "local_2")
    _resumes(tmp_path, env, whole, 2, "--peers=1")


def _outlived(index, processes):
    """SIGKILL process `index` once every other one has ended."""
    deadline = time.monotonic() + 120
    while any(p.poll() is None for i, p in enumerate(processes) if i != index) and time.monotonic() < deadline:
        time.sleep(0.05)
    processes[index].kill()


def test_a_process_that_never_lists_the_steps_is_named(tmp_path, env):
    """Process 3 never makes its manager's first listing of the steps: the
    others stop waiting for it after `_tiers.AGREE_SECONDS` (3 s here), and
    their error names it, still running, and what every process must call."""
    port, launches = places.free_port(), []
    for i in range(PROCESSES):
        flags = [f"--process={i},{PROCESSES},{port}", f"--local={tmp_path}/local_{{i}}", "--absent=3"]
        args = [str(WORKER), *flags, str(tmp_path / "run"), str(STEPS), str(tmp_path)]
        launches.append((args, tmp_path / f"{i}.log"))
    ended, logs = prefork.run_all(launches, env=env, watch=functools.partial(_outlived, 3))
    assert ended[:3] == [3, 3, 3] and ended[3] in (-signal.SIGKILL, -signal.SIGABRT), "\n".join(logs)
    said = (
        r"failed: Process 3 of 4 did not reach stage 'listed' of the agreement within 3 s, although it is still "
        r"running\. No step was chosen\. Every process must call the first listing of its tiered manager's steps"
    )
    for log in logs[:3]:
        assert re.search(said, log), log
