"""Incremental saves (issue 41): a save that replaces a checkpoint, and a
manager's next step, share the chunk files whose bytes did not change (hard
links on a local disk) and write the rest; every checkpoint and step stays
whole on its own, whatever else is deleted."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ckpt
from eqx_ckpt._base import _faults
from eqx_ckpt._base._location import location
from eqx_ckpt._load._checkpoint import human
from eqx_ckpt._ondisk import _format
from eqx_ckpt._save import _records
from eqx_ckpt._store import _local_write, _transaction

# Large enough for arrays of their own (not packed), small enough to be quick.
ROWS, COLS = 80, 4096  # 1.25 MiB of float32


def _tree(step, rng=None):
    rng = rng or np.random.default_rng(0)
    return {
        "base": {f"w{i}": rng.standard_normal((ROWS, COLS), dtype=np.float32) for i in range(3)},
        "head": {"w": np.full((ROWS, COLS), step, np.float32), "b": np.full(3, step, np.float32)},
        "step": step,
    }


def _files(directory):
    """Every file under `directory`: its path there -> (inode, device)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            st = os.lstat(full)
            out[os.path.relpath(full, directory)] = (st.st_ino, st.st_dev)
    return out


def _chunk_files(directory, leaf):
    """The inodes of the chunk files of `leaf` (a dotted path) in the
    checkpoint at `directory`, by chunk key."""
    manifest = _transaction.read_manifest(location(str(directory)))
    root = os.path.join(directory, manifest.data_root) if manifest.data_root else str(directory)
    folder = os.path.join(root, *leaf.split("."))
    assert os.path.isdir(folder), f"{leaf} has no array of its own"
    return {
        os.path.relpath(os.path.join(r, n), folder): os.lstat(os.path.join(r, n)).st_ino
        for r, _, names in os.walk(folder)
        for n in names
        if n != _format.ZARR_JSON
    }


def _pack_chunks(directory, dtype="float32"):
    manifest = _transaction.read_manifest(location(str(directory)))
    root = os.path.join(directory, manifest.data_root) if manifest.data_root else str(directory)
    folder = os.path.join(root, _format.pack_name(dtype))
    return {
        os.path.relpath(os.path.join(r, n), folder): os.lstat(os.path.join(r, n)).st_ino
        for r, _, names in os.walk(folder)
        for n in names
        if n != _format.ZARR_JSON
    }


def jax_leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _loads_as(path, tree):
    path = path.kvstore if hasattr(path, "kvstore") else path
    loaded = eqx_ckpt.tree_deserialise_leaves(path, tree)
    assert [np.asarray(x).tobytes() for x in jax_leaves(loaded)] == [np.asarray(x).tobytes() for x in jax_leaves(tree)]
    assert eqx_ckpt.verify(path) == []


def test_a_managers_next_step_shares_the_unchanged_arrays(tmp_path):
    trees = [_tree(step) for step in range(3)]
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        for step, tree in enumerate(trees):
            # New array objects with the same values, as `p + 0` updates give.
            manager.save(step, {**tree, "base": {k: v + 0 for k, v in tree["base"].items()}})
        paths = [manager.step_path(step) for step in range(3)]
    for leaf in ("base.w0", "base.w1", "base.w2"):
        inodes = [_chunk_files(p, leaf) for p in paths]
        assert inodes[0] == inodes[1] == inodes[2], leaf  # one file, three names
    heads = [_chunk_files(p, "head.w") for p in paths]
    assert not set(heads[0].values()) & set(heads[1].values())  # changed: written anew
    # Each step whole on its own: the others deleted by hand.
    shutil.rmtree(paths[0])
    shutil.rmtree(paths[2])
    _loads_as(paths[1], trees[1])


# Changes that `==` or object identity would miss, and a real change.
_CHANGES = {
    "value": lambda a: a + 1,
    "negative zero": lambda a: np.where(a == a.flat[0], -0.0, a).astype(a.dtype),
    "nan payload": lambda a: a.view(np.uint32).__or__(np.uint32(1)).view(np.float32),
    # The first bytes the same (a large chunk's first look), the last one not.
    "last element": lambda a: np.concatenate([a.reshape(-1)[:-1], a.reshape(-1)[-1:] + 1]).reshape(a.shape),
}


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("change", sorted(_CHANGES))
@pytest.mark.parametrize("where", ["overwrite", "manager"])
def test_changed_bytes_are_written_even_where_equal_by_value(tmp_path, monkeypatch, change, where, unbuffered):
    """...with the checksum computed for the comparison reused by the write,
    through the page cache and past it."""
    if unbuffered:
        monkeypatch.setattr(_local_write, "UNBUFFERED_FROM", 0)
    first = np.zeros((ROWS, COLS), np.float32)
    if change == "nan payload":
        first = np.full((ROWS, COLS), np.nan, np.float32)
    second = _CHANGES[change](first)
    assert first.tobytes() != second.tobytes()
    small_first, small_second = first[:1, :3].copy(), second[:1, :3].copy()  # packed
    trees = [{"big": first, "small": small_first}, {"big": second, "small": small_second}]
    if where == "overwrite":
        path = tmp_path / "ckpt"
        eqx_ckpt.tree_serialise_leaves(path, trees[0])
        before = _chunk_files(path, "big")
        eqx_ckpt.tree_serialise_leaves(path, trees[1])
    else:
        with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
            manager.save(0, trees[0])
            manager.save(1, trees[1])
            before = _chunk_files(manager.step_path(0), "big")
            path = manager.step_path(1)
    assert not set(before.values()) & set(_chunk_files(path, "big").values())
    _loads_as(path, trees[1])


def test_an_overwrite_shares_unchanged_chunks_of_a_table_and_of_packs(tmp_path, monkeypatch):
    """A large embedding table with a few rows updated rewrites only the
    chunks holding those rows; a pack chunk whose members did not change is
    shared too."""
    monkeypatch.setattr(_format, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", 4 << 10)
    monkeypatch.setattr(_records, "PACK_BYTES", 64 << 10)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((1024, 64), dtype=np.float32)  # 256 KiB: 4 chunks of 256 rows
    small = {f"s{i:02d}": rng.standard_normal(256, dtype=np.float32) for i in range(12)}  # 1 KiB each
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"table": table, "small": small})
    before, packs_before = _chunk_files(path, "table"), _pack_chunks(path)
    assert len(before) == 4
    table2 = table.copy()
    table2[300] += 1  # the second chunk only
    small2 = {**small, "s11": small["s11"] + 1}  # the last pack chunk only
    tree2 = {"table": table2, "small": small2}
    eqx_ckpt.tree_serialise_leaves(path, tree2)
    after, packs_after = _chunk_files(path, "table"), _pack_chunks(path)
    shared = {key for key in after if after[key] == before.get(key)}
    assert shared == set(before) - {"c/1/0"}, (before, after)
    if len(packs_before) > 1:
        shared_packs = {key for key in packs_after if packs_after[key] == packs_before.get(key)}
        assert shared_packs and shared_packs != set(packs_after)
    _loads_as(path, tree2)


def test_retention_and_hand_deletion_never_break_a_step(tmp_path):
    trees = [_tree(step) for step in range(5)]
    with eqx_ckpt.CheckpointManager(tmp_path / "run", max_to_keep=2) as manager:
        for step, tree in enumerate(trees):
            manager.save(step, tree)
        assert manager.all_steps() == [3, 4]
        shutil.rmtree(manager.step_path(3))
        _loads_as(manager.step_path(4), trees[4])
        manager.save(5, _tree(5))
        _loads_as(manager.step_path(5), _tree(5))


def test_a_lazy_tree_saved_back_onto_its_own_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    tree = _tree(1)
    eqx_ckpt.tree_serialise_leaves(path, tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(path, tree, lazy=True)
    before = _chunk_files(path, "base.w0")
    eqx_ckpt.tree_serialise_leaves(path, lazy)
    assert _chunk_files(path, "base.w0") == before
    _loads_as(path, tree)


def test_a_reader_of_the_replaced_checkpoint_is_told(tmp_path):
    path = tmp_path / "ckpt"
    tree = _tree(1)
    eqx_ckpt.tree_serialise_leaves(path, tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(path, tree, lazy=True)
    eqx_ckpt.tree_serialise_leaves(path, {**tree, "head": _tree(2)["head"]})
    with pytest.raises(eqx_ckpt.CheckpointReplacedError):
        eqx_ckpt.materialise(lazy)


def test_a_linked_base_file_is_never_followed(tmp_path):
    """A chunk file of the previous checkpoint that is a symbolic link (a
    hostile or damaged checkpoint) is never linked to: the save writes its own."""
    path = tmp_path / "ckpt"
    tree = _tree(1)
    eqx_ckpt.tree_serialise_leaves(path, tree)
    chunk = path / "base" / "w0" / "c" / "0" / "0"
    elsewhere = tmp_path / "elsewhere"
    shutil.copy(chunk, elsewhere)
    chunk.unlink()
    chunk.symlink_to(elsewhere)
    link = f"The chunk file {str(chunk)!r} of leaf `base.w0`, in the checkpoint this save follows, is a symbolic link"
    with pytest.warns(eqx_ckpt.IntegrityWarning, match=re.escape(link)):
        eqx_ckpt.tree_serialise_leaves(path, tree, overwrite=True)
    for name in _files(path):
        assert not os.path.islink(path / name), name
    _loads_as(path, tree)


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["overwrite", "manager"])
def test_a_failure_while_linking_leaves_the_last_checkpoint_whole(tmp_path, error, where):
    trees = [_tree(1), _tree(2)]
    calls = []
    expected = KeyboardInterrupt if error is KeyboardInterrupt else eqx_ckpt.CheckpointError

    def fail(source, path):
        calls.append(path)
        if len(calls) == 2:
            raise error("injected while linking")

    if where == "overwrite":
        path = tmp_path / "ckpt"
        eqx_ckpt.tree_serialise_leaves(path, trees[0])
        with _faults.armed("share.link", fail), pytest.raises(expected):
            eqx_ckpt.tree_serialise_leaves(path, trees[1])
        _loads_as(path, trees[0])
        assert [n for n in os.listdir(path) if n.startswith("gen.")] == []
        eqx_ckpt.tree_serialise_leaves(path, trees[1])
        _loads_as(path, trees[1])
    else:
        with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
            manager.save(1, trees[0])
            with _faults.armed("share.link", fail), pytest.raises(expected):
                manager.save(2, trees[1])
            assert manager.all_steps() == [1]
            _loads_as(manager.step_path(1), trees[0])
            manager.save(2, trees[1])
            _loads_as(manager.step_path(2), trees[1])
    assert len(calls) >= 2


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import eqx_ckpt
    from eqx_ckpt._base import _faults
    sys.path.insert(0, sys.argv[3])
    from test_incremental import _tree

    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)

    point = sys.argv[2]
    with _faults.armed(point, die):
        eqx_ckpt.tree_serialise_leaves(sys.argv[1], _tree(2))
    """
)


@pytest.mark.parametrize("point", ["share.link", "sync.flush", "transaction.commit"])
def test_a_process_killed_between_linking_and_commit(tmp_path, point):
    """SIGKILL while linking, after it (before the flush) and at the commit:
    the last checkpoint stays whole, and the next save clears what was left
    and still shares."""
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _tree(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", _KILLED, str(path), point, os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    _loads_as(path, _tree(1))
    before = _chunk_files(path, "base.w0")
    eqx_ckpt.tree_serialise_leaves(path, _tree(3))
    _loads_as(path, _tree(3))
    assert _chunk_files(path, "base.w0") == before
    assert len([n for n in os.listdir(path) if n.startswith("gen.")]) == 1


def test_an_asynchronous_manager_save_shares_too(tmp_path):
    trees = [_tree(1), _tree(2)]
    with eqx_ckpt.CheckpointManager(tmp_path / "run", blocking=False) as manager:
        manager.save(1, trees[0])
        manager.save(2, trees[1])
        manager.wait_until_finished()
        assert _chunk_files(manager.step_path(1), "base.w1") == _chunk_files(manager.step_path(2), "base.w1")
        _loads_as(manager.step_path(2), trees[1])


def test_info_says_how_much_is_shared(tmp_path, capsys):
    from eqx_ckpt._tools import _cli

    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(0, _tree(0))
        manager.save(1, _tree(1))
        paths = [manager.step_path(0), manager.step_path(1)]
    assert _cli.main(["info", paths[1]]) == 0
    # The three base arrays' chunk files are shared with step 0.
    base = 3 * (ROWS * COLS * 4 + _format.CHECKSUM_BYTES)
    assert (
        f"shared:          3 files, {human(base)}, also used by other checkpoints or steps" in capsys.readouterr().out
    )
    shutil.rmtree(paths[0])
    assert _cli.main(["info", paths[1]]) == 0
    assert "shared:          0 files, 0 B" in capsys.readouterr().out


# -- A fine-tune of a small model (issue 59): every leaf packed ---------------------------------

# Frozen leaves of 60 KiB; a head of 2 KB with its Adam moments, which change at every step.
_FROZEN_LEAF = 15 * 1024  # float32 elements
_HEAD = (16, 32)  # 2 KiB of float32

# How the frozen bytes sit around the head (in flattening order), by case: all
# leaves small, so everything is packed.
_SMALL_MODELS = {
    # 40 KiB in all: one pack chunk.
    "tiny": (40 << 10, 0),
    # Just under a 4 MiB chunk.
    "under 4 MiB": ((4 << 20) - (64 << 10), 0),
    # Just over it: the head's chunk is the last, mostly padding.
    "last chunk padded": ((4 << 20) + (30 << 10), 0),
    # 12 MiB, the head between frozen leaves, one frozen leaf bfloat16.
    "head in the middle": (6 << 20, 6 << 20),
}


def _frozen(nbytes, seed):
    rng = np.random.default_rng(seed)
    sizes = [_FROZEN_LEAF] * (nbytes // (_FROZEN_LEAF * 4))
    if nbytes % (_FROZEN_LEAF * 4):
        sizes.append(nbytes % (_FROZEN_LEAF * 4) // 4)
    return {f"l{i:03d}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}


def _fine_tune(case):
    """The steps of a fine-tune: a frozen base (new arrays of the same bytes at
    every step, as an optimiser update that leaves it alone gives) and a small
    head trained by Adam, saved as `{"model", "opt_state", "step"}`."""
    before, after = _SMALL_MODELS[case]
    base = {"a_frozen": _frozen(before, 0), "z_frozen": _frozen(after, 1)}
    if after:
        base["z_frozen"]["norm"] = np.ones(300, jnp.bfloat16)
    head = {"w": np.full(_HEAD, 0.5, np.float32), "b": np.zeros(_HEAD[1], np.float32)}
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(head)
    for step in range(4):
        yield {
            "model": {
                "a_frozen": jax.tree.map(lambda x: x + 0, base["a_frozen"]),
                "head": head,
                "z_frozen": jax.tree.map(lambda x: x + 0, base["z_frozen"]),
            },
            "opt_state": opt_state,
            "step": step,
        }
        grads = jax.tree.map(lambda x, g=step + 1.0: np.full(x.shape, g, np.float32), head)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = optimiser.update(grads, opt_state)
        head = optax.apply_updates(head, updates)


def _changed_bytes(old, new):
    """The stored bytes of the leaves of `new` whose bytes differ from `old`'s."""
    return sum(
        np.asarray(b).nbytes
        for a, b in zip(jax_leaves(old), jax_leaves(new), strict=True)
        if np.asarray(a).tobytes() != np.asarray(b).tobytes()
    )


def _new_blocks(directory, seen):
    """The bytes on disk (blocks) of the files under `directory` whose inodes
    are not in `seen` (a hard link to an earlier step's file counts nothing),
    which it then holds."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


@pytest.mark.parametrize("case", sorted(_SMALL_MODELS))
def test_a_fine_tune_of_a_small_model_adds_about_the_heads_bytes_per_step(tmp_path, case):
    """Every leaf small, so packed: a step adds to the disk at most the bytes
    that changed plus 1 MiB (docs/manager.md), however the frozen leaves sit
    around the head (before it, after it, a last pack chunk mostly padding)."""
    seen: set[tuple[int, int]] = set()
    trees = list(_fine_tune(case))
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        for step, tree in enumerate(trees):
            manager.save(step, tree)
            grew = _new_blocks(manager.step_path(step), seen)
            if step:
                changed = _changed_bytes(trees[step - 1], tree)
                assert 0 < changed < 16 << 10
                assert grew <= changed + (1 << 20), (step, grew, changed)
        _loads_as(manager.step_path(3), trees[3])
