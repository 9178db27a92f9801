"""Concurrent saves and reads of one checkpoint path.

Two saves into one local path: one wins and the other is refused with a clear
`CheckpointExistsError` (a save holds an `flock` on the directory, see
eqx_ckpt/_lock.py), or they run one after the other; the result always loads
exactly as one of them. A reader during overwrites sees the old or the new
checkpoint, or a clear error, never a mix of values.
"""

import collections
import threading

import equinox as eqx
import pytest
from crash_worker import Worker, tree

import eqx_ckpt

RACES = 6


@pytest.fixture
def workers():
    pair = [Worker(), Worker()]
    yield pair
    for worker in pair:
        worker.close()


def _generation(path) -> int:
    """The generation the checkpoint holds, checking it is exactly that one."""
    loaded = eqx_ckpt.tree_deserialise_leaves(path, tree(0))
    generation = loaded["step"]
    assert eqx.tree_equal(loaded, tree(generation), typematch=True), f"a mix of generations at {path}"
    return generation


def test_two_processes_save_to_one_path(tmp_path, workers):
    outcomes = collections.Counter()
    for race in range(RACES):
        # Even races start from nothing, odd ones overwrite a checkpoint.
        path = tmp_path / f"ckpt{race // 2}"
        mine = {id(w): 10 * race + i + 1 for i, w in enumerate(workers)}
        for worker in workers:
            worker.start("save", path, mine[id(worker)])
        for worker in workers:
            assert worker.finished_within(120)
        done = [mine[id(w)] for w in workers if w.last == "done"]
        refused = [w.last for w in workers if w.last != "done"]
        assert done, refused
        for message in refused:
            assert message.startswith("error CheckpointExistsError: Another save is writing to")
        assert _generation(path) in done
        assert eqx_ckpt.verify(path) == []
        outcomes["one refused" if refused else "both saved, one after the other"] += 1
    print(f"two savers, {RACES} races: {dict(outcomes)}")


def _race_threads(path, generations: list[int]) -> dict[int, str]:
    """Start one blocking save per generation at the same moment, in threads."""
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(generations))

    def save(generation: int) -> None:
        barrier.wait()
        try:
            eqx_ckpt.tree_serialise_leaves(path, tree(generation))
        except eqx_ckpt.CheckpointExistsError as e:
            results[generation] = str(e)
        else:
            results[generation] = "done"

    threads = [threading.Thread(target=save, args=(g,)) for g in generations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_threads_save_to_one_path(tmp_path):
    outcomes = collections.Counter()
    for race in range(RACES):
        results = _race_threads(tmp_path / "ckpt", [10 * race + 1, 10 * race + 2])
        done = [g for g, r in results.items() if r == "done"]
        assert done and all(r == "done" or "Another save is writing to" in r for r in results.values())
        assert _generation(tmp_path / "ckpt") in done
        outcomes["one refused" if len(done) == 1 else "both saved"] += 1
    print(f"two threads, {RACES} races: {dict(outcomes)}")


def test_async_save_then_save_waits_for_it(tmp_path):
    # In one process a second save to the same path waits for the first.
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path, tree(1), blocking=False)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree(2))
    assert pending is not None
    pending.wait()
    assert _generation(tmp_path) == 2


def test_reader_during_overwrites(tmp_path, workers):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, tree(0))
    writer = workers[0]
    outcomes: collections.Counter = collections.Counter()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                _generation(path)
            except eqx_ckpt.CheckpointError as e:
                # The arrays were deleted under the reader by the commit of a newer save.
                outcomes[type(e).__name__] += 1
            else:
                outcomes["exact"] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for generation in range(1, 11):
            writer.start("save", path, generation)
            assert writer.finished_within(120) and writer.last == "done"
    finally:
        stop.set()
        reader.join()
    print(f"reader during 10 overwrites: {dict(outcomes)}")
    assert outcomes["exact"] > 0
    # Never damaged bytes, never a mix: the reader is told the checkpoint was replaced.
    assert set(outcomes) <= {"exact", "CheckpointReplacedError"}
    assert _generation(path) == 10
