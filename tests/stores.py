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
