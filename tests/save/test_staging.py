"""A save's staging budget (`eqx_ckpt/_save/_staging.py`): the host bytes a save
stages and has not yet written stay within `staging_bytes`, observed through
the fault point `save.staged`; what is saved is the same whatever the budget."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal
from staged import MIB, Staged

import eqx_ckpt
from eqx_ckpt._save import _staging
from eqx_ckpt._store import _memory


def _tree(n=12, rows=768, cols=1024):
    """`n` leaves of `rows * cols` float32 (3 MiB each by default, 1.5 MiB as
    bfloat16: each an array of its own, none packed), NumPy and JAX
    alternately, each different."""
    return {
        f"w{i}": (jnp.asarray if i % 2 else np.asarray)(np.full((rows, cols), i + 0.25, np.float32)) for i in range(n)
    }


@pytest.mark.parametrize("where", ["local", "tensorstore"])
@pytest.mark.parametrize("cast", [None, jnp.bfloat16])
def test_staged_bytes_never_exceed_the_budget(tmp_path, faults, where, cast):
    """12 leaves of 3 MiB (1.5 MiB as bfloat16) through a budget of 5 MiB: the
    bytes staged never go above it, reach it as closely as whole leaves allow,
    and are all released by the end; the checkpoint is what a save with the
    default budget writes."""
    tree = _tree()
    stored = 3 * MIB // 2 if cast is not None else 3 * MIB
    budget = 5 * MIB
    path = tmp_path / "ckpt" if where == "local" else f"memory://{tmp_path.name}/ckpt"
    staged = Staged(faults)
    eqx_ckpt.tree_serialise_leaves(path, tree, cast=cast, staging_bytes=budget)
    assert {b for _, b in staged.seen} == {budget}
    assert staged.peak <= budget
    assert staged.peak > budget - stored  # as many leaves as fit were staged at once: the bound is real
    assert staged.seen[-1][0] == 0
    like = tree if cast is None else {k: np.zeros(v.shape, ml_dtypes.bfloat16) for k, v in tree.items()}
    loaded = eqx_ckpt.tree_deserialise_leaves(path, like)
    expected = tree if cast is None else {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in tree.items()}
    assert tree_equal(loaded, expected, typematch=True)
    # The same bytes as a save that stages everything at once.
    if where == "local":
        eqx_ckpt.tree_serialise_leaves(tmp_path / "default", tree, cast=cast)
        assert not eqx_ckpt.diff(tmp_path / "ckpt", tmp_path / "default")


def test_a_leaf_larger_than_the_budget_is_staged_alone(tmp_path, faults):
    """A 8 MiB leaf between 2 MiB ones, through a 3 MiB budget: it is staged
    when nothing else is, and the others stay within the budget."""
    two = np.ones((512, 1024), np.float32)
    tree = {"a": two, "big": jnp.full((2048, 1024), 3.0), "c": two * 2}
    staged = Staged(faults)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, staging_bytes=3 * MIB)
    over = [n for n, _ in staged.seen if n > 3 * MIB]
    assert over == [8 * MIB]  # staged once, alone
    assert staged.seen[-1][0] == 0
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_sharded_leaves_are_staged_a_shard_at_a_time(faults, tmp_path):
    """A leaf sharded over 4 devices, written through TensorStore, is staged
    shard by shard: a budget of two shards holds."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    leaf = jax.device_put(jnp.arange(4 * 256 * 1024, dtype=jnp.float32).reshape(4 * 256, 1024), sharding)
    tree = {"s": leaf, "t": leaf + 1}
    shard = leaf.nbytes // 4
    staged = Staged(faults)
    path = f"memory://{tmp_path.name}/sharded"
    eqx_ckpt.tree_serialise_leaves(path, tree, staging_bytes=2 * shard)
    assert staged.peak == 2 * shard
    loaded = eqx_ckpt.tree_deserialise_leaves(path, tree)
    assert tree_equal(loaded, tree, typematch=True)


def test_an_asynchronous_save_stages_within_the_budget_and_keeps_the_callers_values(tmp_path, faults):
    """With `blocking=False` and a cast, the cast is still made as each leaf
    is staged, within the budget; changing the NumPy leaves and deleting the
    `jax.Array`s once the call has returned changes nothing saved."""
    tree = _tree(n=8)
    expected = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in tree.items()}
    staged = Staged(faults)
    for custom in (False, True):
        spec = eqx_ckpt.default_serialise_filter_spec if not custom else (lambda handle, x: handle.write(x))
        source = {k: (v.copy() if isinstance(v, np.ndarray) else v + 0) for k, v in tree.items()}
        path = tmp_path / f"custom_{custom}"
        pending = eqx_ckpt.tree_serialise_leaves(
            path, source, spec, blocking=False, cast=jnp.bfloat16, staging_bytes=3 * MIB
        )
        for value in source.values():
            if isinstance(value, np.ndarray):
                value[...] = -1
            else:
                value.delete()
        pending.wait()
        like = {k: np.zeros(v.shape, ml_dtypes.bfloat16) for k, v in tree.items()}
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, like), expected, typematch=True)
    assert staged.peak == 3 * MIB  # two leaves of 1.5 MiB


def test_a_partial_save_and_a_managers_save_take_the_budget(tmp_path, faults):
    tree = _tree(n=4)
    staged = Staged(faults)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    changed = {**tree, "w1": jnp.full((768, 1024), 7.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", changed, where=lambda t: t["w1"], staging_bytes=4 * MIB)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), changed, typematch=True)
    with eqx_ckpt.CheckpointManager(tmp_path / "steps") as manager:
        manager.save(1, tree, staging_bytes=7 * MIB)
    budgets = [b for _, b in staged.seen]
    assert budgets[-1] == 7 * MIB and 4 * MIB in budgets
    assert max(n for n, b in staged.seen if b == 7 * MIB) == 6 * MIB


def test_a_partial_save_reads_the_leaves_it_keeps_as_it_stages_them(tmp_path, faults):
    """A partial save keeps the stored leaves it does not replace, saved with
    their values from the checkpoint it replaces: each is read as the save
    stages it, within the budget, not all of them while the save is planned
    (they were, holding the whole checkpoint in memory at once)."""
    tree = _tree(n=8)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree, share=False)
    events = []
    # A kept leaf starts being read: by the load's reader, or (as it was) through TensorStore.
    faults("load.read_stored", lambda loc: events.append(("read", loc)))
    faults("storage.open_array", lambda loc, record: events.append(("read", record.path)))
    faults("save.staged", lambda nbytes, budget: events.append(("staged", nbytes)))
    changed = {**tree, "w1": jnp.full((768, 1024), 7.0)}
    eqx_ckpt.tree_serialise_leaves(
        tmp_path / "ckpt", changed, where=lambda t: t["w1"], staging_bytes=4 * MIB, share=False
    )
    saved = list(events)  # the save's, not the load's below
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), changed, typematch=True)
    reads = [i for i, (what, _) in enumerate(saved) if what == "read"]
    first_staged = next(i for i, (what, _) in enumerate(saved) if what == "staged")
    assert len(reads) >= 7 and reads[-1] > first_staged, saved
    assert max(n for what, n in saved if what == "staged") <= 4 * MIB


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, eqx_ckpt.CheckpointValueError, "`staging_bytes` must be a positive int"),
        (-5, eqx_ckpt.CheckpointValueError, "`staging_bytes` must be a positive int"),
        (1.5, eqx_ckpt.CheckpointTypeError, "`staging_bytes` must be a positive int"),
        (True, eqx_ckpt.CheckpointTypeError, "`staging_bytes` must be a positive int"),
        ("64MiB", eqx_ckpt.CheckpointTypeError, "not '64MiB'"),
    ],
)
def test_a_bad_budget_is_a_clear_error_and_nothing_is_written(tmp_path, value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.ones(3)}, staging_bytes=value)
    assert list(tmp_path.iterdir()) == []


def test_the_default_budget_is_the_documented_fraction_of_memory(tmp_path, faults, monkeypatch):
    memory = _memory.physical_memory()
    assert memory is not None
    expected = max(_staging.STAGING_MIN_BYTES, int(memory * _staging.STAGING_FRACTION))
    if jax.default_backend() != "cpu":  # with an accelerator, at most 1 GiB (tests/hosts/test_gpu.py)
        expected = min(expected, _staging.ACCELERATOR_STAGING_BYTES)
    assert _staging.STAGING_FRACTION == 0.25 and _staging.STAGING_MIN_BYTES == 64 * MIB
    assert _staging.ACCELERATOR_STAGING_BYTES == 1024 * MIB
    staged = Staged(faults)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", _tree(n=2))
    assert {b for _, b in staged.seen} == {expected}
    # The knobs move it: a smaller fraction, and the floor under it.
    monkeypatch.setattr(_staging, "STAGING_FRACTION", 1e-9)
    monkeypatch.setattr(_staging, "STAGING_MIN_BYTES", 4 * MIB)
    staged.seen.clear()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", _tree(n=4))
    assert {b for _, b in staged.seen} == {4 * MIB} and staged.peak == 3 * MIB


def test_a_cast_that_would_change_values_fails_before_anything_is_staged(tmp_path, faults):
    """The cast's values are checked while planning (a block at a time), so
    a bad value is an error naming its leaf before the destination exists."""
    staged = Staged(faults)
    tree = {"ok": np.ones((768, 1024), np.float32), "bad": np.full((768, 1024), 300.0, np.float32)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `bad`")):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "x", tree, cast={np.float32: np.int8}, staging_bytes=MIB)
    assert staged.seen == [] and not (tmp_path / "x").exists()


def test_check_cast_checks_every_block(monkeypatch):
    """`_dtypes.check_cast` finds a bad value in any block, the last one included."""
    from eqx_ckpt._ondisk import _dtypes

    monkeypatch.setattr(_dtypes, "CHECK_BYTES", 64)
    x = np.ones((100, 4), np.float32)
    _dtypes.check_cast(x, np.int8)
    x[-1, -1] = 1000.0
    with pytest.raises(ValueError, match="does not fit in int8"):
        _dtypes.check_cast(x, np.int8)
    assert _dtypes.stored_values(np.dtype(np.int8), "plain", x[:2]).dtype == np.int8


@pytest.mark.parametrize("where", ["local", "tensorstore"])
def test_a_pack_is_staged_a_run_of_its_chunk_files_at_a_time(tmp_path, faults, monkeypatch, where):
    """400 small leaves of 40 KiB (16 MiB, packed into one array) with pack
    chunks of 256 KiB, through a 2 MiB budget: the pack is staged in runs of
    its chunk files (a leaf across two runs in both), within the budget, and
    the checkpoint is what the default budget writes, every leaf in place."""
    from eqx_ckpt._save import _records

    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", 256 << 10)
    # 10,000 float32 each: not a multiple of the 64-byte alignment, so leaves cross chunk files.
    tree = {
        f"s{i}": (jnp.asarray if i % 3 else np.asarray)(np.arange(10_000, dtype=np.float32) + i) for i in range(400)
    }
    path = tmp_path / "ckpt" if where == "local" else f"memory://{tmp_path.name}/pack"
    staged = Staged(faults)
    eqx_ckpt.tree_serialise_leaves(path, tree, staging_bytes=2 * MIB)
    assert staged.peak <= 2 * MIB and staged.peak > MIB and staged.seen[-1][0] == 0
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, tree), tree, typematch=True)
    assert len(eqx_ckpt.Checkpoint(path).keys()) == 400
    if where == "local":
        assert eqx_ckpt.verify(path) == []
        eqx_ckpt.tree_serialise_leaves(tmp_path / "default", tree)
        assert not eqx_ckpt.diff(path, tmp_path / "default")
