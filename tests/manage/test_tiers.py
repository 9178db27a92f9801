"""`CheckpointManager(directory, local=...)`: every step to a local tier, every
`persistent_every`-th copied from it to `directory` in the background, restores
from the nearest tier holding a step (docs/manager.md, "Tiers")."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal
from disk import snapshot

import eqx_ckpt
from eqx_ckpt._base._location import location
from eqx_ckpt._manage import _tiers
from eqx_ckpt._ondisk import _format
from eqx_ckpt._tools._cli import main


class Position:
    """A data pipeline's position, as an iterator of the shape eqx_ckpt saves."""

    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def _tree(step):
    # `w` in a folder of its own (over 1 MiB), `b` and `step` packed.
    return {"w": jnp.arange(300_000, dtype=jnp.float32) + step, "b": jnp.full(3, float(step)), "step": step}


def _like():
    return _tree(0)


@pytest.fixture(params=["disk", "s3"])
def persistent(request, tmp_path):
    """The persistent tier: a local directory, or a bucket on the local S3 server."""
    if request.param == "disk":
        return str(tmp_path / "persistent")
    return request.getfixturevalue("store")


@pytest.fixture(autouse=True)
def _no_pauses(monkeypatch):
    monkeypatch.setattr(_tiers, "PAUSES", (0.0,))


def test_every_step_goes_to_the_local_tier_and_every_nth_is_copied(tmp_path, persistent):
    local = tmp_path / "local"
    with eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=3, local_max_to_keep=2) as manager:
        for step in range(7):
            manager.save(step, _tree(step), metrics={"loss": 10.0 - step})
        manager.wait_until_finished()
        assert manager.tier_steps() == {"local": [5, 6], "persistent": [0, 3, 6]}
        assert manager.all_steps() == [0, 3, 5, 6] and manager.latest_step() == 6
        assert manager.metrics(3) == {"loss": 7.0} and manager.metrics(5) == {"loss": 5.0}
    # The persistent directory is an ordinary manager directory: any manager, any load reads it.
    plain = eqx_ckpt.CheckpointManager(persistent)
    assert plain.all_steps() == [0, 3, 6]
    for step in (0, 3, 6):
        assert tree_equal(plain.restore(_like(), step=step), _tree(step), typematch=True)
        assert eqx_ckpt.verify(location(persistent).joined(_format.step_name(step)).kvstore) == []
    if not isinstance(persistent, dict):
        # A copy, byte for byte, of the local step.
        assert snapshot(os.path.join(persistent, _format.step_name(6))) == snapshot(local / _format.step_name(6))


def test_restore_takes_the_newest_step_of_either_tier_from_the_nearest(tmp_path, persistent):
    local = tmp_path / "local"
    with eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2) as manager:
        for step in range(4):
            manager.save(step, _tree(step))
    # A relaunch on the same host finds step 3 in the local tier only.
    again = eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2)
    assert again.tier_steps() == {"local": [2, 3], "persistent": [0, 2]}
    assert again.step_path(3) == str(local / _format.step_name(3))
    assert tree_equal(again.restore(_like()), _tree(3), typematch=True)
    assert again.restore_or_initialise(_like)[0] == 3
    # A host replaced by an empty one: the newest persistent step.
    fresh = eqx_ckpt.CheckpointManager(persistent, local=tmp_path / "empty", persistent_every=2)
    assert fresh.latest_step() == 2
    step, state = fresh.restore_or_initialise(_like)
    assert step == 2 and tree_equal(state, _tree(2), typematch=True)


@pytest.mark.parametrize("damage", ["chunk", "leaf folder"])
def test_a_damaged_local_step_is_loaded_from_the_persistent_tier_or_refused(tmp_path, damage):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2) as manager:
        for step in range(4):
            manager.save(step, _tree(step))
    for step in (2, 3):
        folder = local / _format.step_name(step) / "w"
        if damage == "chunk":
            (folder / "c" / "0").write_bytes(b"\0" * 16)
        else:
            for path in sorted(folder.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            folder.rmdir()
    manager = eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2)
    with pytest.warns(
        eqx_ckpt.IntegrityWarning, match=r"Step 2 of the local tier .* loaded from the persistent tier"
    ) as caught:
        assert tree_equal(manager.restore(_like(), step=2), _tree(2), typematch=True)
    assert caught[0].filename == __file__  # said where `restore` was called
    # Step 3 is in the local tier alone: never returned damaged.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `w` in checkpoint .*step_00000003"):
            manager.restore(_like(), step=3)


def test_save_returns_once_the_local_step_is_committed_and_the_copy_goes_on(tmp_path, faults):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    release, copying = threading.Event(), threading.Event()

    def held(step, name):
        copying.set()
        assert release.wait(60)

    faults("tiers.copy_file", held)
    manager = eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2, local_max_to_keep=1)
    manager.save(0, _tree(0))
    assert copying.wait(60)  # the copy of step 0 waits in the background...
    assert manager.tier_steps() == {"local": [0], "persistent": []}
    # ...and the local tier keeps step 0 while it is copied, whatever its retention says.
    manager.save(1, _tree(1))
    assert manager.tier_steps() == {"local": [0, 1], "persistent": []}
    release.set()
    manager.wait_until_finished()
    assert manager.tier_steps() == {"local": [1], "persistent": [0]}  # step 0 goes from the local tier once copied
    manager.save(2, _tree(2))
    manager.close()
    assert manager.tier_steps() == {"local": [2], "persistent": [0, 2]}


def test_a_failed_write_of_the_copy_is_tried_again(tmp_path, faults):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    failed = []

    def fail_once(step, name):
        if name not in failed:
            failed.append(name)
            raise OSError(f"link down at {name}")

    faults("tiers.copy_file", fail_once)
    with eqx_ckpt.CheckpointManager(persistent, local=local) as manager:
        manager.save(0, _tree(0))
    assert _format.MANIFEST in failed and len(failed) > 3
    assert eqx_ckpt.CheckpointManager(persistent).all_steps() == [0]
    assert tree_equal(eqx_ckpt.CheckpointManager(persistent).restore(_like()), _tree(0), typematch=True)


# Every file of a step of `_tree`: the first copied, a leaf's, a pack's, and the manifest, written last.
_STEP_FILES = ["packed.float32/c/0", "w/c/0", "w/zarr.json", "zarr.json", _format.MANIFEST]


@pytest.mark.parametrize("failing", _STEP_FILES)
def test_a_copy_that_keeps_failing_is_named_once_and_leaves_nothing_half_there(tmp_path, faults, failing):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    manager = eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2, local_max_to_keep=1)
    manager.save(0, _tree(0))
    manager.wait_until_finished()
    assert sorted(snapshot(local / _format.step_name(0))) == sorted(
        [*_STEP_FILES, "packed.float32/zarr.json", "packed.int64/c/0", "packed.int64/zarr.json"]
    )
    faults("tiers.copy_file", lambda step, name: step != 2 or name != failing or _raise(OSError("link down")))
    manager.save(1, _tree(1))
    manager.save(2, _tree(2))
    message = (
        r"Step 2 was saved to the local tier \('.*step_00000002'\), but its copy to the persistent tier \('.*"
        rf"persistent'\) failed: Cannot write '{failing}' .*link down.* Nothing of it is committed there"
    )
    with pytest.raises(eqx_ckpt.CheckpointError, match=message):
        manager.wait_until_finished()
    assert sorted(os.listdir(persistent)) == [_format.step_name(0)]
    # Named once; the local tier keeps step 2 until a later copy succeeds.
    manager.save(3, _tree(3))
    assert manager.tier_steps() == {"local": [2, 3], "persistent": [0]}
    manager.save(4, _tree(4))
    manager.close()
    assert manager.tier_steps() == {"local": [4], "persistent": [0, 4]}


def _raise(error):
    raise error


def test_a_program_that_ends_finishes_the_copy_first(tmp_path):
    """A script whose last line saves a step: the copy to the persistent tier
    goes on in the background, and the interpreter waits for it at exit."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    program = textwrap.dedent(
        f"""
        import time
        import jax.numpy as jnp
        import eqx_ckpt
        from eqx_ckpt._base import _faults

        _faults.armed("tiers.copy_file", lambda step, name: time.sleep(0.2)).__enter__()   # a slow link
        manager = eqx_ckpt.CheckpointManager({str(persistent)!r}, local={str(local)!r})
        manager.save(3, {{"w": jnp.arange(300_000.0)}})
        print(manager.tier_steps(), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "{'local': [3], 'persistent': []}\n"
    assert "waiting for 1 checkpoint save(s) to commit before exiting" in done.stderr
    manager = eqx_ckpt.CheckpointManager(persistent)
    assert manager.all_steps() == [3]
    assert tree_equal(manager.restore({"w": jnp.zeros(300_000)}), {"w": jnp.arange(300_000.0)}, typematch=True)


def test_an_interrupted_tiered_save_leaves_no_step_in_either_tier(tmp_path, faults):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    manager = eqx_ckpt.CheckpointManager(persistent, local=local)
    faults("save.start_writes", KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        manager.save(1, _tree(1))
    faults("save.start_writes", lambda loc: None)
    assert manager.tier_steps() == {"local": [], "persistent": []}
    manager.save(2, _tree(2))
    manager.close()
    assert manager.tier_steps() == {"local": [2], "persistent": [2]}
    assert [name for name in sorted(os.listdir(local)) if name.startswith("step_")] == [_format.step_name(2)]


def test_a_process_killed_during_the_copy_leaves_no_persistent_step(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    program = textwrap.dedent(
        f"""
        import os
        import jax.numpy as jnp
        import eqx_ckpt
        from eqx_ckpt._base import _faults

        def die(step, name):
            if name == "manifest.json":
                os._exit(3)   # killed after every other file was copied

        manager = eqx_ckpt.CheckpointManager({str(persistent)!r}, local={str(local)!r})
        with _faults.armed("tiers.copy_file", die):
            manager.save(5, {{"w": jnp.arange(8.0)}})
            manager.wait_until_finished()
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert (persistent / _format.step_name(5) / "packed.float32" / "zarr.json").is_file()  # copied, not committed
    manager = eqx_ckpt.CheckpointManager(persistent, local=local)
    assert manager.tier_steps() == {"local": [5], "persistent": []}
    assert tree_equal(manager.restore({"w": jnp.zeros(8)}), {"w": jnp.arange(8.0)}, typematch=True)
    manager.save(6, {"w": jnp.arange(8.0) + 6})
    manager.close()
    assert sorted(os.listdir(persistent)) == [_format.step_name(6)]


def test_retention_applies_per_tier(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with eqx_ckpt.CheckpointManager(
        persistent, local=local, persistent_every=2, max_to_keep=2, keep_every=4, local_max_to_keep=3
    ) as manager:
        for step in range(11):
            manager.save(step, _tree(step))
    assert manager.tier_steps() == {"local": [8, 9, 10], "persistent": [0, 4, 8, 10]}
    assert manager.delete_steps_after(8) == [9, 10]
    assert manager.tier_steps() == {"local": [8], "persistent": [0, 4, 8]}


@pytest.mark.parametrize("blocking", [True, False])
def test_the_data_pipelines_position_travels_in_both_tiers(tmp_path, blocking):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with eqx_ckpt.CheckpointManager(persistent, local=local, blocking=blocking) as manager:
        manager.save(7, {"w": jnp.ones(3), "data": Position({"next_index": 70})})
    for where in (local, tmp_path / "empty"):  # from the local tier, then from the persistent one
        manager = eqx_ckpt.CheckpointManager(persistent, local=where)
        out = manager.restore({"w": jnp.zeros(3), "data": Position({"next_index": 0})})
        assert out["data"].get_state() == {"next_index": 70}


def test_an_async_local_save_that_fails_is_raised_once_and_copies_nothing(tmp_path, faults):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    manager = eqx_ckpt.CheckpointManager(persistent, local=local, blocking=False)
    faults("transaction.commit", OSError("disk full"))
    manager.save(1, _tree(1))
    with pytest.raises(eqx_ckpt.LeafError, match="disk full"):
        manager.wait_until_finished()
    manager.wait_until_finished()  # raised once
    assert manager.tier_steps() == {"local": [], "persistent": []}
    assert not os.path.exists(persistent / _format.step_name(1))


def test_a_step_saved_again_replaces_the_persistent_copy(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with eqx_ckpt.CheckpointManager(persistent, local=local) as manager:
        manager.save(1, _tree(1))
        manager.save(1, _tree(5), overwrite=True)
    assert tree_equal(eqx_ckpt.CheckpointManager(persistent).restore(_like()), _tree(5), typematch=True)


def test_the_step_saved_at_preemption_is_copied_whatever_persistent_every(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=100) as manager:
        for step in range(1, 50):
            if step == 3:
                signal.raise_signal(signal.SIGTERM)  # what the fleet sends
            if manager.reached_preemption(step):
                manager.save(step, _tree(step))
                break
            manager.save(step, _tree(step))
    assert manager.tier_steps() == {"local": [2, 3], "persistent": [3]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"local": "s3://bucket/run"}, "`local` must be a directory on this host"),
        ({"local": "PERSISTENT"}, "must be two separate directories, neither inside the other"),
        ({"local": "PERSISTENT/local"}, "must be two separate directories"),
        ({"persistent_every": 5}, re.escape("`persistent_every` says how often") + ".*pass `local=`"),
        ({"local": "LOCAL", "persistent_every": 0}, "`persistent_every` must be a positive int, not 0"),
        ({"local": "LOCAL", "local_max_to_keep": 1.5}, "`local_max_to_keep` must be a positive int, not 1.5"),
        ({"local": "LOCAL", "peers": 1}, r"`peers=1`: peers are other JAX processes, .* this job has one process"),
        ({"local": "LOCAL", "peer_stride": 0}, "`peer_stride` must be a positive int, not 0"),
        ({"peers": -1}, "`peers` must be a non-negative int, not -1"),
    ],
)
def test_tier_options_are_checked(tmp_path, options, message):
    places = {"PERSISTENT": str(tmp_path / "persistent"), "LOCAL": str(tmp_path / "local")}
    options = {
        k: v.replace("PERSISTENT", places["PERSISTENT"]).replace("LOCAL", places["LOCAL"]) if isinstance(v, str) else v
        for k, v in options.items()
    }
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=message):
        eqx_ckpt.CheckpointManager(tmp_path / "persistent", **options)
    assert not os.path.exists(tmp_path / "persistent") and not os.path.exists(tmp_path / "local")


def test_the_local_tier_holds_what_numpy_leaves_were_saved_as(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    tree = {"a": np.arange(5, dtype=np.int16), "n": 3}
    with eqx_ckpt.CheckpointManager(persistent, local=local) as manager:
        manager.save(0, tree)
        assert tree_equal(manager.restore(tree), tree, typematch=True)
    assert tree_equal(eqx_ckpt.CheckpointManager(persistent).restore(tree), tree, typematch=True)


def test_ls_and_info_say_which_steps_each_tier_holds(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with eqx_ckpt.CheckpointManager("run", local="shm", persistent_every=2) as manager:
        for step in range(5):
            manager.save(step, {"w": jnp.ones(3)}, metrics={"loss": 1.0 / (step + 1)})
    assert main(["ls", "run", "--local", "shm"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[-1] for line in listing[:4]] == [
        "[persistent] loss=1",
        "[persistent] loss=0.333333",
        "[local] loss=0.25",
        "[local+persistent] loss=0.2",
    ]
    assert listing[-1] == "4 steps in a CheckpointManager directory; `eqx-ckpt ls shm/step_00000004` lists one"
    assert main(["info", "run", "--local", "shm"]) == 0
    assert capsys.readouterr().out.splitlines()[1:3] == [
        "local tier (shm): 2 steps (3, 4)",
        "persistent tier (run): 3 steps (0, 2, 4)",
    ]
    # Without `--local`: the persistent tier, an ordinary manager directory.
    assert main(["ls", "run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("3 steps in a CheckpointManager directory")


@pytest.mark.parametrize("share", [True, False])
def test_a_copy_shares_unchanged_chunk_files_with_the_newest_persistent_step(tmp_path, share):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    frozen = jnp.arange(500_000, dtype=jnp.float32)  # a frozen base: the same bytes at every step

    def tree(step):
        return {"frozen": frozen, "damaged": frozen + 1, "head": frozen + step}

    def chunk(step, name):
        return persistent / _format.step_name(step) / name / "c" / "0"

    with eqx_ckpt.CheckpointManager(persistent, local=local, persistent_every=2, share=share) as manager:
        for step in range(3):
            manager.save(step, tree(step))
            if step == 0:
                manager.wait_until_finished()
                # A byte changed in the persistent step 0: step 2 must not share that file.
                damaged = bytearray(chunk(0, "damaged").read_bytes())
                damaged[100] ^= 1
                chunk(0, "damaged").write_bytes(bytes(damaged))
    assert chunk(2, "frozen").stat().st_nlink == (2 if share else 1)
    assert (chunk(2, "frozen").stat().st_ino == chunk(0, "frozen").stat().st_ino) == share
    assert chunk(2, "damaged").stat().st_nlink == 1 and chunk(2, "head").stat().st_nlink == 1
    restored = eqx_ckpt.CheckpointManager(persistent).restore(tree(0), step=2)
    assert tree_equal(restored, tree(2), typematch=True)
    assert eqx_ckpt.verify(str(persistent / _format.step_name(2))) == []
