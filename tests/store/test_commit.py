"""Atomic commit: overwrites alternate data roots, and a failed save leaves the
previous checkpoint as it was."""

import errno
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import prefork
import pytest
from arrays import tree_equal
from disk import snapshot

import eqx_ckpt
from eqx_ckpt._base import _faults, _interrupts, _location
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _durable


def _array_dirs(root):
    def is_array(d):
        with open(os.path.join(d, "zarr.json")) as f:
            return json.load(f).get("node_type") == "array"

    return sorted(os.path.relpath(d, root) for d, _, files in os.walk(root) if "zarr.json" in files and is_array(d))


def _data_root(path):
    return json.loads((path / "manifest.json").read_text())["data_root"]


def _is_generation(name):
    return re.fullmatch(r"gen\.[0-9a-f]{16}", name) is not None


def test_overwrites_use_fresh_data_roots_and_leave_nothing_stale(tmp_path, packing):
    # A first save writes at the key paths themselves; every overwrite writes a
    # new `gen.<commit>` folder, so no data root name is ever reused.
    trees = [
        {"a": jnp.full(3, 1.0), "old": {"x": jnp.zeros(2)}},
        {"a": jnp.full(3, 2.0), "b": jnp.ones(4, jnp.int32)},
        {"a": jnp.full(3, 3.0), "c": np.arange(2)},
    ]
    # The arrays of each save: a folder per leaf, or (packed) one array per stored dtype.
    packs = [["packed.float32"], ["packed.float32", "packed.int32"], ["packed.float32", "packed.int64"]]
    roots = []
    for tree, packed in zip(trees, packs):
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
        root = _data_root(tmp_path)
        roots.append(root)
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
        arrays = packed if packing == "packed" else [k.replace(".", "/") for k in sorted(eqx_ckpt.Checkpoint(tmp_path))]
        assert _array_dirs(tmp_path) == [f"{root}/{a}" if root else a for a in arrays]
        first = {a.split("/")[0] for a in arrays}
        assert sorted(os.listdir(tmp_path)) == sorted(
            ["manifest.json", root] if root else [*first, "zarr.json", "manifest.json"]
        )
    assert roots[0] == "" and all(_is_generation(r) for r in roots[1:]) and roots[1] != roots[2]
    commits = {json.loads((tmp_path / "manifest.json").read_text())["commit"]}
    assert roots[2] == "gen." + commits.pop()
    assert sorted(eqx_ckpt.Checkpoint(tmp_path)) == ["a", "c"]


def _fail_manifest(before=None):
    """Make the commit (the manifest's conditional write) fail, inside the returned context."""

    def write_conditional(loc, name):
        if name == "manifest.json":
            if before is not None:
                before()
            raise OSError("disk full")

    return _faults.armed("commit.manifest_write", write_conditional)


def test_old_checkpoint_loads_until_the_new_manifest_is_written(tmp_path):
    old = {"a": jnp.arange(3), "b": 1.5}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)
    before, old_arrays = snapshot(tmp_path), _array_dirs(tmp_path)
    seen = {}

    def check():
        # Everything new is written; the old checkpoint is still the visible one.
        seen["new arrays"] = _array_dirs(tmp_path)
        seen["old loads"] = tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)

    with _fail_manifest(check):
        with pytest.raises(eqx_ckpt.CheckpointError, match="nothing was committed"):
            eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.arange(3) + 10, "b": 2.5})
    new = [d for d in seen["new arrays"] if d not in old_arrays]  # (packed) an int32 and a float64 array
    assert len(new) == 2 and _is_generation(new[0].split("/")[0]) and seen["old loads"]
    assert snapshot(tmp_path) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)


def test_a_failure_encoding_the_manifest_beside_the_writes_commits_nothing(tmp_path):
    """The manifest is encoded while the arrays are being written: a failure
    there waits for the writes, deletes them and leaves the old checkpoint."""
    from eqx_ckpt._base import _faults

    old = {"small": jnp.arange(3), "large": jnp.ones((512, 1024))}  # a pack, and an array of its own
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)
    before = snapshot(tmp_path)

    new = {"small": jnp.arange(3) + 1, "large": jnp.zeros((512, 1024))}
    with _faults.armed("commit.manifest_encode", OSError("cannot encode")):
        with pytest.raises(eqx_ckpt.CheckpointError, match="nothing was committed: cannot encode") as info:
            eqx_ckpt.tree_serialise_leaves(tmp_path, new)
    # An OSError without an errno the storage gives: not the storage's fault.
    assert isinstance(info.value, eqx_ckpt.LeafError) and not isinstance(info.value, eqx_ckpt.CheckpointStorageError)
    assert snapshot(tmp_path) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)
    eqx_ckpt.tree_serialise_leaves(tmp_path, new)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, new), new, typematch=True)


# A save killed after writing every array, just before its manifest.
_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys
    import jax.numpy as jnp
    import eqx_ckpt
    from eqx_ckpt._base import _faults

    def write_conditional(loc, name):
        if name == "manifest.json":
            os._exit(17)

    with _faults.armed("commit.manifest_write", write_conditional):
        eqx_ckpt.tree_serialise_leaves(sys.argv[1], {"half": jnp.ones(3)})
    """
)


def _killed_save(path):
    # Forked from a template with JAX imported (`prefork`): the save is cut
    # short by `os._exit`, so nothing of a new interpreter's start or exit counts.
    result = prefork.run(["-c", _KILLED_SAVE, str(path)], env=dict(os.environ), timeout=120)
    assert result.returncode == 17, result.stderr


def test_a_sync_failing_after_the_manifest_landed_is_a_warning_that_it_was_committed(tmp_path):
    """The manifest is written, then syncing its directory fails (EIO): the save
    is committed (it loads), so the failure is a `CommitWarning` saying so and
    what it may cost, not an error claiming nothing was committed."""
    path = tmp_path / "ckpt"
    old, new = {"a": jnp.arange(3), "b": 1.5}, {"a": jnp.arange(3) + 10, "b": 2.5}
    eqx_ckpt.tree_serialise_leaves(path, old)
    manifest_written = threading.Event()

    def failing_sync(directory):
        # Only the sync of the manifest's directory, the first after its write.
        if manifest_written.is_set():
            manifest_written.clear()
            raise OSError(errno.EIO, "Input/output error (injected)")

    faults = {"commit.manifest_write": lambda loc, name: manifest_written.set(), "sync.directory": failing_sync}
    with _faults.armed(faults), pytest.warns(eqx_ckpt.CommitWarning) as caught:
        eqx_ckpt.tree_serialise_leaves(path, new)
    message = " ".join(str(w.message) for w in caught)
    assert "was committed (its manifest is this save's)" in message, message
    assert "may not survive a power loss" in message and "injected" in message, message
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, old), new, typematch=True)
    assert eqx_ckpt.verify(path) == []


def test_interrupted_save_leaves_no_checkpoint_and_next_save_cleans_up(tmp_path):
    _killed_save(tmp_path)
    assert (tmp_path / "saving.json").is_file()
    assert _array_dirs(tmp_path) == ["packed.float32"]  # `half` is packed
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"half": jnp.zeros(3)})
    tree = {"a": jnp.ones(2, jnp.int32)}  # another dtype: the dead save's pack must be cleared, not reused
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "packed.int32", "zarr.json"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_interrupted_overwrite_keeps_the_old_checkpoint(tmp_path):
    old = {"a": jnp.arange(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)
    _killed_save(tmp_path)
    dead = [d for d in _array_dirs(tmp_path) if d != "packed.int32"]
    assert len(dead) == 1 and dead[0].endswith("/packed.float32")  # the killed save's `half`
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["a"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)
    new = {"b": jnp.arange(3) * 5}
    eqx_ckpt.tree_serialise_leaves(tmp_path, new)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, new), new, typematch=True)
    assert _array_dirs(tmp_path) == [f"{_data_root(tmp_path)}/packed.int32"]
    assert not (tmp_path / "saving.json").exists()


def test_overwrite_false_on_empty_directory_is_fine(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": 1}, overwrite=False)
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": 0}) == {"a": 1}
    with pytest.raises(eqx_ckpt.CheckpointExistsError) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": 2}, overwrite=False)
    assert isinstance(info.value, FileExistsError)
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": 0}) == {"a": 1}


def test_files_next_to_a_checkpoint_survive_an_overwrite(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2)})
    (tmp_path / "README.txt").write_text("notes")
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(2)})
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.full(2, 2.0)})
    assert (tmp_path / "README.txt").read_text() == "notes"


def test_user_files_named_like_keys_survive_overwrites(tmp_path):
    # Only names a save wrote (listed in the old manifest or in `saving.json`) are
    # ever deleted, and a save never writes into a name it did not create, even
    # when a user's folder is named like a key of the new tree.
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2), "b": jnp.zeros(1)})
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run1.txt").write_text("log")
    (tmp_path / "NOTES").write_text("notes")
    for value in (1.0, 2.0, 3.0):
        tree = {"a": jnp.full(2, value), "logs": jnp.full(3, value)}
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
        assert (tmp_path / "logs" / "run1.txt").read_text() == "log"
    assert sorted(os.listdir(tmp_path / "logs")) == ["run1.txt"]
    assert (tmp_path / "NOTES").read_text() == "notes"
    # ...while the arrays of replaced checkpoints are gone.
    assert not (tmp_path / "b").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NOTES", _data_root(tmp_path), "logs", "manifest.json"]


def _outside(path):
    """Every file of `path` outside its live data root, and the manifest."""
    root = _data_root(path)
    return sorted(k for k in snapshot(path) if k != "manifest.json" and not (root and k.startswith(root + os.sep)))


@pytest.mark.parametrize("layout", ["directories", "ocdbt"])
def test_a_users_files_inside_a_replaced_checkpoints_folders_survive(tmp_path, layout):
    # An overwrite once removed the old leaf folders whole, and with them a
    # user's notes put inside (SPEC 3: a save deletes only what saves wrote).
    tree = {"model": {"w": np.ones((600, 600), np.float32), "b": np.zeros(3, np.float32)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout=layout)
    mine = {
        "directories": ["model/README.txt", "model/w/NOTES", "model/w/c/notes.txt", "packed.float32/why"],
        "ocdbt": ["ocdbt.db/README.txt"],
    }[layout]
    for name in mine:
        (tmp_path / name).write_text(f"mine: {name}")
    before = _outside(tmp_path)
    assert len(before) > len(mine)  # the old checkpoint's own files are there too
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout=layout)
    # Every file of the old arrays went; the user's stayed, with their folders.
    assert _outside(tmp_path) == sorted(n.replace("/", os.sep) for n in mine)
    for name in mine:
        assert (tmp_path / name).read_text() == f"mine: {name}"
    if layout == "directories":
        assert sorted(os.listdir(tmp_path / "model" / "w")) == ["NOTES", "c"]
        assert os.listdir(tmp_path / "model" / "w" / "c") == ["notes.txt"]
    # A data root holding a user's file outlives the next overwrite (and every
    # later sweep of `gen.<commit>` folders) as that file alone.
    root = _data_root(tmp_path)
    (tmp_path / root / "kept.txt").write_text("mine")
    for _ in range(2):
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout=layout)
    assert (tmp_path / root / "kept.txt").read_text() == "mine"
    assert os.listdir(tmp_path / root) == ["kept.txt"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
    assert eqx_ckpt.verify(tmp_path) == []


def test_a_save_killed_after_its_commit_leaves_a_users_files_to_the_next_save(tmp_path):
    # The next save finishes a dead save's clean-up from its journal, which
    # names only the top-level folders of the arrays it replaced.
    tree = {"model": {"w": np.ones((600, 600), np.float32)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    (tmp_path / "model" / "README.txt").write_text("mine")
    with _faults.armed("storage.remove_written", OSError("the clean-up died")):
        with pytest.warns(eqx_ckpt.CommitWarning, match="the clean-up died"):
            eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    journal = json.loads((tmp_path / "saving.json").read_text())
    assert journal["old_names"] == ["model", "zarr.json"]
    assert (tmp_path / "model" / "w" / "zarr.json").exists()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert not (tmp_path / "saving.json").exists()
    assert _outside(tmp_path) == [os.path.join("model", "README.txt")]
    assert (tmp_path / "model" / "README.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("key", "ours"),
    [
        ("zarr.json", True),
        ("model/w/zarr.json", True),
        ("model/w/zarr.json.__lock", True),
        ("model/w/c", True),  # the chunk of a 0-d array
        ("model/w/c/0/12", True),
        ("gen.0123456789abcdef/packed.float32/c/3", True),
        ("ocdbt.db/manifest.ocdbt", True),
        ("gen.0123456789abcdef/ocdbt.db/d/0a1b2c", True),
        ("model/README.txt", False),
        ("model/w/c/notes.txt", False),
        ("model/w/c/0/notes", False),
        ("model/w/cc", False),
        ("model/w/zarr.json.bak", False),
        ("ocdbt.db/README.txt", False),
        ("ocdbt.db/d/notes.txt", False),
    ],
)
def test_the_names_a_save_writes(key, ours):
    assert _format.written_by_a_save(key) is ours


def test_manifest_is_written_last(tmp_path, faults, packing):
    order = []

    def write_conditional(loc, name):
        order.append((name, sorted(_array_dirs(tmp_path))))

    faults("commit.manifest_write", write_conditional)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2), "b": {"c": jnp.ones(3)}})
    assert order == [("manifest.json", ["a", "b/c"] if packing == "unpacked" else ["packed.float32"])]


def test_lock_files_of_a_killed_write_are_cleared(tmp_path):
    # TensorStore writes `<name>.__lock` and renames it: a save killed while writing
    # `saving.json` leaves only that file, which must not block the next save.
    (tmp_path / "saving.json.__lock").write_text('{"tar')
    (tmp_path / "zarr.json.__lock").write_text("{")
    tree = {"a": jnp.arange(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "packed.int32", "zarr.json"]
    (tmp_path / "manifest.json.__lock").write_text("{")
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert sorted(os.listdir(tmp_path)) == sorted([_data_root(tmp_path), "manifest.json"])
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_arrays_are_flushed_before_the_manifest_commits(tmp_path, faults):
    # Arrays are written without a per-file fsync; one flush of every file the save
    # wrote must come before the manifest, or a power cut could commit lost data.
    events = []

    def flush(loc):
        events.append(("flush", sorted(p.name for p in pathlib.Path(loc.local).iterdir())))

    def write_conditional(loc, name):
        events.append(("write", name))

    faults({"sync.flush": flush, "commit.manifest_write": write_conditional})
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2), "b": {"c": jnp.ones(3)}})
    kinds = [e[0] if e[0] == "flush" else e[1] for e in events]
    assert kinds == ["flush", "manifest.json"]
    assert events[0][1] == ["packed.float32", "saving.json", "zarr.json"]


def test_flush_tolerates_another_writers_temporary_files(tmp_path):
    # In a multi-process save the other processes are still writing under the same
    # data root while this one flushes: their `<name>.__lock` files appear and are
    # renamed away at any moment. A file vanishing mid-flush must not fail the save.
    loc = _location.location(tmp_path)
    (tmp_path / "kept").write_bytes(b"x")
    (tmp_path / "gone").symlink_to(tmp_path / "never-there")  # listed, then cannot be opened
    stop = threading.Event()

    def other_writer():
        for i in itertools.cycle(range(8)):  # a bounded set of chunks, rewritten
            if stop.is_set():
                return
            (tmp_path / f"c{i}.__lock").write_bytes(b"chunk")
            os.rename(tmp_path / f"c{i}.__lock", tmp_path / f"c{i}")

    writer = threading.Thread(target=other_writer)
    writer.start()
    try:
        for _ in range(20):
            _durable.flush(loc)
    finally:
        stop.set()
        writer.join()
    assert (tmp_path / "kept").read_bytes() == b"x"
    with pytest.raises(FileNotFoundError):
        _durable.fsync(str(tmp_path / "gone"))  # outside a flush, a missing file is an error


@pytest.mark.skipif(sys.platform != "linux", reason="statfs magic numbers are Linux's")
def test_file_system_type_matches_stat(tmp_path):
    # The magic number read through ctypes is the one coreutils reports.
    expected = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True, check=True)
    assert _durable.file_system_type(str(tmp_path)) == int(expected.stdout, 16)


@pytest.mark.parametrize("count", [3, _durable.SYNCFS_FROM])
def test_flush_syncs_the_file_system_only_for_many_files_on_a_local_disk(tmp_path, faults, count):
    for i in range(count):
        (tmp_path / f"f{i}").write_bytes(b"x")
    calls = []
    faults("sync.file", lambda path: calls.append(("fsync", path)))
    faults("sync.file_system", lambda path: calls.append(("syncfs", path)))
    _durable.flush(_location.location(tmp_path))
    journaled = _durable.file_system_type(str(tmp_path)) in _durable._SYNCFS_FILE_SYSTEMS
    if count >= _durable.SYNCFS_FROM and journaled:
        assert calls == [("syncfs", str(tmp_path))]
    else:
        # The directory itself and every file in it, each synced on its own.
        assert sorted(p for _, p in calls) == sorted([str(tmp_path), *(str(tmp_path / f"f{i}") for i in range(count))])
        assert {kind for kind, _ in calls} == {"fsync"}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_flush_never_trusts_syncfs_on_other_file_systems(faults):
    # A FUSE or network mount may answer syncfs without writing anything: only the
    # listed local file systems get it. tmpfs stands in for "another" file system.
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        for i in range(_durable.SYNCFS_FROM):
            with open(os.path.join(directory, f"f{i}"), "wb") as f:
                f.write(b"x")
        used = []
        faults("sync.file_system", used.append)
        _durable.flush(_location.location(directory))
        assert used == []
    finally:
        shutil.rmtree(directory)


def test_new_directories_are_synced_in_their_parents(tmp_path, faults):
    # A crash right after a save must not lose the checkpoint's own folder (or a
    # missing parent of it): each new directory's entry is fsynced in its parent.
    synced = []
    faults("sync.file", synced.append)
    path = tmp_path / "runs" / "a" / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"w": jnp.ones(2)})
    for directory in (tmp_path, tmp_path / "runs", tmp_path / "runs" / "a"):
        assert str(directory) in synced, directory
    # An overwrite's new data root is synced in the checkpoint directory before
    # the manifest that names it is committed.
    synced.clear()
    faults("commit.manifest_write", lambda loc, name: synced.append("commit"))
    eqx_ckpt.tree_serialise_leaves(path, {"w": jnp.zeros(2)})
    assert str(path) in synced[: synced.index("commit")]


def test_a_generation_folder_no_manifest_uses_is_cleared_by_the_next_save(tmp_path):
    # Whatever left it (a save that failed while its clean-up also failed), a
    # `gen.<commit>` folder the manifest does not name is the format's own garbage.
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2)})
    (tmp_path / "gen.0123456789abcdef" / "a").mkdir(parents=True)
    (tmp_path / "gen.0123456789abcdef" / "a" / "zarr.json").write_text("{}")
    (tmp_path / "gen.notes").mkdir()  # not a generation's name: the user's
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(2)})
    root = _data_root(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([root, "gen.notes", "manifest.json"])
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.zeros(2)}), {"a": jnp.ones(2)})


class _Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt or SystemExit would)."""


@pytest.fixture
def interrupt_after():
    """`interrupt_after(seconds)`: the main thread is interrupted (by SIGUSR1,
    whose handler raises `_Interrupt`) that many seconds from now."""
    previous = signal.signal(signal.SIGUSR1, lambda *args: (_ for _ in ()).throw(_Interrupt()))
    timers = []

    def start(seconds):
        timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGUSR1))
        timers.append(timer)
        timer.start()

    yield start
    for timer in timers:
        timer.join()
    signal.signal(signal.SIGUSR1, previous)


def test_uninterrupted_finishes_its_work_before_the_interrupt_is_raised(interrupt_after):
    done = []

    def work():
        time.sleep(0.5)
        done.append(threading.current_thread() is threading.main_thread())

    interrupt_after(0.1)
    start = time.perf_counter()
    with pytest.raises(_Interrupt):
        _interrupts.uninterrupted(work)
    assert done == [False] and time.perf_counter() - start >= 0.5
    with pytest.raises(ZeroDivisionError):  # its own error is raised as it is
        _interrupts.uninterrupted(lambda: 1 / 0)


def test_an_interrupt_while_the_manifest_is_written_never_commits_a_checkpoint_without_its_data(
    tmp_path, interrupt_after
):
    """Found by the interrupt campaign: the manifest write had started when the
    interrupt was raised, its future was lost, the abort deleted the arrays, and
    then the manifest landed (a committed step with an empty pack). Here the
    write is held back while the interrupt lands, and made later, as a lost
    future's would land."""
    old, new = {"w": np.zeros(64, np.float32), "n": 1}, {"w": np.ones(64, np.float32), "n": 2}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)

    def held_back(loc, name):
        # The interrupt lands while the write waits here: timed from the write's
        # start, so a busy machine's slower save cannot land it before.
        interrupt_after(0.1)
        time.sleep(0.5)

    with _faults.armed("commit.manifest_write", held_back):
        with pytest.raises(_Interrupt):
            eqx_ckpt.tree_serialise_leaves(tmp_path, new)
        time.sleep(0.6)  # anything still in flight has landed by now
    # The write happened, so the save is committed, and whole.
    assert eqx_ckpt.verify(tmp_path) == []
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), new, typematch=True)


@pytest.mark.parametrize("queued", [True, False], ids=["after-the-put", "before-the-put"])
def test_an_interrupt_around_queuing_the_job_still_waits_for_it_and_runs_it_once(faults, queued):
    # An interrupt landed once between queuing the manifest write and the wait
    # for it: the save aborted and deleted its arrays while the write went on,
    # committing a checkpoint without them (seen once in the SIGINT campaign).
    runs, raised = [], []

    def interrupting(job):
        if not raised:
            raised.append(True)
            raise _Interrupt()

    faults("interrupts.queued" if queued else "interrupts.queue", interrupting)

    def write():
        time.sleep(0.2)
        runs.append("written")

    with pytest.raises(_Interrupt):
        _interrupts.uninterrupted(write)
    assert runs == ["written"]  # finished before the interrupt was raised, and once
    time.sleep(0.3)
    assert runs == ["written"]
