"""The fault seam itself (`eqx_ckpt._base._faults`): an armed point raises or runs its
callback, a disarmed one does nothing, arming ends with its block, and every
point its docstring names is reached by a save or a load."""

import collections
import os
import re
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base import _faults
from eqx_ckpt._store import _durable, _local_write


class Injected(Exception):
    pass


def test_an_armed_point_raises_and_a_disarmed_one_does_nothing():
    _faults.fire("storage.list", "anything")  # nothing armed
    with _faults.armed("storage.list", Injected("instance")):
        with pytest.raises(Injected, match="instance"):
            _faults.fire("storage.list", "loc")
        _faults.fire("storage.remove", "loc", [])  # another point: not armed
    with _faults.armed(["storage.list", "storage.remove"], Injected):
        for point in ("storage.list", "storage.remove"):
            with pytest.raises(Injected):
                _faults.fire(point)
    _faults.fire("storage.list", "loc")
    assert _faults._ARMED == {}


def test_a_callback_gets_the_points_arguments_in_every_thread():
    seen = []
    with _faults.armed({"local_read.read": lambda *args: seen.append((threading.current_thread().name, args))}):
        _faults.fire("local_read.read", 3, 4096)
        thread = threading.Thread(target=_faults.fire, args=("local_read.read", 5, 0), name="other")
        thread.start()
        thread.join()
    assert seen == [("MainThread", (3, 4096)), ("other", (5, 0))]


def test_arming_is_undone_after_the_block_even_on_error():
    calls = []
    with _faults.armed("sync.file", lambda path: calls.append(("outer", path))):
        with pytest.raises(Injected):
            with _faults.armed("sync.file", lambda path: calls.append(("inner", path))):
                _faults.fire("sync.file", "a")
                raise Injected
        _faults.fire("sync.file", "b")  # the outer action is back
    _faults.fire("sync.file", "c")
    assert calls == [("inner", "a"), ("outer", "b")]
    assert _faults._ARMED == {}


def test_unknown_points_and_missing_actions_are_refused():
    with pytest.raises(ValueError, match="Unknown fault points"):
        with _faults.armed("storage.lsit", Injected):
            pass
    with pytest.raises(ValueError, match="needs an action"):
        with _faults.armed("storage.list"):
            pass
    assert _faults._ARMED == {}


def test_every_point_is_described():
    # Each description starts with the arguments the point passes.
    assert set(_faults.DESCRIBED) == _faults.POINTS
    for point, described in _faults.DESCRIBED.items():
        assert re.fullmatch(r"\(([a-z_]+(, [a-z_]+)*)?\): \S.*", described), point


# Points that no single-process save or load reaches, and where they are tested.
_ELSEWHERE = {
    "transaction.join": "reached only by the processes other than 0 of a multi-process save "
    "(armed in tests/support/multiprocess_worker.py, run by tests/hosts/test_multiprocess.py)",
    "save.slices": "reached only by a multi-process save (armed in tests/support/multiprocess_matrix_worker.py, "
    "run by tests/hosts/test_multiprocess.py)",
    "save.pinned_copies": "reached by a save only on an accelerator (armed in tests/hosts/test_gpu.py; "
    "tests/hosts/test_host_memory.py arms it around `_memory.pinned` on a CPU)",
    "save.device_copies": "reached only by an asynchronous save on a GPU's memory (armed in tests/hosts/test_gpu.py; "
    "tests/save/test_pinned_save.py arms it on CPU devices with the pinned paths switched on for them)",
    "manager.undo": "reached only when a manager's save fails (armed in tests/manage/test_manager.py)",
    "tiers.copy_file": "reached only by a manager with a local tier, copying a step to its directory "
    "(armed in tests/manage/test_tiers.py)",
    "exchange.window": "reached only by a tiered manager with `peers`, of several processes (armed in "
    "tests/support/iterator_worker.py, run by tests/manage/test_tier_processes.py)",
    "hub.commit": "reached only by a push to a Hub "
    "(armed in tests/sources/test_hub.py, against tests/support/hub_server.py)",
    "load.pinned_pool": "reached only by a load through the pool of host buffers, on for GPUs alone "
    "(`_memory.PINNED_PLATFORMS`; armed in tests/load/test_pinned_load.py, which switches it on for CPUs)",
    "load.pinned_view": "reached only by a load through the pool's buffers in pinned memory, off by default "
    "(armed in tests/load/test_pinned_load.py, which switches it on for CPUs)",
    "load.read_once": "reached only by a multi-process restore that shares reads (armed in "
    "tests/support/multiprocess_kill_worker.py, run by tests/hosts/test_multiprocess.py)",
}


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """How many times each point fired during a local save, load, overwrite,
    load and verify, two asynchronous saves, a save through TensorStore, a
    load into JAX arrays and one without a skeleton, an export to safetensors loaded back, and two saves of a
    manager that keeps one step. Few files make a
    flush `syncfs` here, and every chunk file of a leaf goes past the page cache."""
    counts = collections.Counter()
    lock = threading.Lock()

    def count(point, *args):
        with lock:
            counts[point] += 1

    tree = {
        "big": np.arange(2**19, dtype=np.float32),  # 2 MiB: an array of its own, read by `_local_read`
        "small": np.arange(3),  # packed
    }
    like = {k: np.zeros_like(v) for k, v in tree.items()}
    path = tmp_path_factory.mktemp("seam")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_durable, "SYNCFS_FROM", 1)
        m.setattr(_local_write, "UNBUFFERED_FROM", 0)
        with _faults.armed({point: lambda *args, point=point: count(point, *args) for point in _faults.POINTS}):
            for generation in (1, 2):
                eqx_ckpt.tree_serialise_leaves(path / "ckpt", {k: v + generation for k, v in tree.items()})
                loaded = eqx_ckpt.tree_deserialise_leaves(path / "ckpt", like)
                assert all(np.array_equal(loaded[k], tree[k] + generation) for k in tree)
            assert eqx_ckpt.verify(path / "ckpt") == []
            # Asynchronous saves (the leaves held, or a custom filter spec's
            # copied), a load into JAX arrays, and one without a skeleton.
            eqx_ckpt.tree_serialise_leaves(path / "held", tree, blocking=False).wait()
            custom = lambda handle, x: handle.write(x)
            eqx_ckpt.tree_serialise_leaves(path / "custom", tree, custom, blocking=False).wait()
            on_device = eqx_ckpt.tree_deserialise_leaves(path / "ckpt", {"small": jnp.zeros(3, jnp.int32)}, cast=True)
            assert np.array_equal(on_device["small"], tree["small"] + 2)
            assert tree_equal(eqx_ckpt.Checkpoint(path / "custom").load(), tree)
            # A save through TensorStore (its transaction), not local chunk
            # files, with a leaf whose record is made the general way (a scalar).
            eqx_ckpt.tree_serialise_leaves(f"memory://{path.name}/ts", {**tree, "step": 3})
            # Another format's source (`_safetensors`).
            eqx_ckpt.export_safetensors(path / "st", tree)
            assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path / "st", like), tree)
            with eqx_ckpt.CheckpointManager(path / "steps", max_to_keep=1) as manager:
                for step in (1, 2):
                    manager.save(step, tree)
    return counts


@pytest.mark.parametrize("point", sorted(_faults.POINTS))
def test_every_point_is_reached(reached, point, tmp_path):
    if point in _ELSEWHERE:
        pytest.skip(_ELSEWHERE[point])
    if point == "sync.file_system" and not _durable._syncfs_is_complete(str(tmp_path)):
        pytest.skip("a flush syncs the file system only on ext4, XFS or Btrfs")
    if point == "local_write.unbuffered" and not _takes_unbuffered_writes(tmp_path):
        pytest.skip("this file system refuses unbuffered (O_DIRECT) writes")
    assert reached[point] > 0, f"{point} was never reached: {dict(reached)}"


def _takes_unbuffered_writes(folder):
    fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        return _local_write._set_direct(fd, True)
    finally:
        os.close(fd)
