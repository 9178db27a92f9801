"""Checks that hold on every object store (not a test module): each store's
test module calls them with a location on its own server."""

import equinox as eqx
import numpy as np

import eqx_ckpt
from eqx_ckpt._base._location import location
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _storage


def check_every_manager_step_is_whole(store) -> None:
    """Issue 41: object stores have no hard links, so each step is written in
    full (the documented choice); deleting the others by hand leaves it whole."""
    trees = [{"base": np.arange(300_000, dtype=np.float32), "head": np.full(3, float(step))} for step in range(3)]
    with eqx_ckpt.CheckpointManager(store) as manager:
        for step, tree in enumerate(trees):
            manager.save(step, tree)
    # Every object of steps 0 and 1 deleted, as `aws s3 rm --recursive` would.
    _storage.remove(location(store), [_format.step_name(0), _format.step_name(1)])
    step = location(store).joined(_format.step_name(2)).kvstore
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(step, trees[2]), trees[2], typematch=True)
    assert eqx_ckpt.verify(step) == []


def check_compressed_saves_round_trip(store) -> None:
    """Issue 73: a compressed save here (TensorStore compresses and writes each
    chunk) loads bit for bit, whole and by a slice, and verifies."""
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(0, 0.02, (2048, 1100)).astype(np.float32), "b": np.arange(5.0)}
    eqx_ckpt.tree_serialise_leaves(store, tree, compression="blosc-zstd")
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(store, tree), tree, typematch=True)
    ckpt = eqx_ckpt.Checkpoint(store)
    assert ckpt.format_version == 6
    assert np.array_equal(np.asarray(ckpt["w"][1000:1002]), tree["w"][1000:1002])
    assert eqx_ckpt.verify(store) == []
