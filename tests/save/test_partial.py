"""Partial saves (issue 41): `tree_serialise_leaves(path, pytree, where=...)`
replaces only the picked sub-trees of the checkpoint at `path` and keeps every
other stored leaf; the rest of `pytree` is never looked at."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base import _faults
from eqx_ckpt._base._location import location
from eqx_ckpt._store import _transaction


def _stored(path):
    """The stored tree, as nested dicts of NumPy arrays."""
    return {k: np.asarray(v) for k, v in eqx_ckpt.Checkpoint(path).items()}


def _bitwise(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k


def _first():
    return {
        "base": {"w": np.arange(300_000, dtype=np.float32), "b": np.ones(3, np.float32)},
        "head": {"w": np.zeros((4, 5), np.float32), "old": np.ones(2)},
        "step": 1,
    }


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def test_only_the_picked_sub_tree_is_replaced(tmp_path):
    path = tmp_path / "ckpt"
    first = _first()
    eqx_ckpt.tree_serialise_leaves(path, first)
    before = _stored(path)
    # The rest of the tree is abstract: never read. The head's structure changes.
    new = {"base": _abstract(first["base"]), "head": {"w2": np.full(3, 7.0)}, "step": 2}
    eqx_ckpt.tree_serialise_leaves(path, new, where=lambda t: t["head"])
    after = _stored(path)
    assert sorted(after) == ["base.b", "base.w", "head.w2", "step"]
    _bitwise(
        {k: v for k, v in after.items() if not k.startswith("head")},
        {k: before[k] for k in ("base.b", "base.w", "step")},
    )
    assert after["head.w2"].tobytes() == np.full(3, 7.0).tobytes()
    assert eqx_ckpt.verify(path) == []
    # Several nodes at once, as `eqx.tree_at` takes them.
    eqx_ckpt.tree_serialise_leaves(path, {**new, "step": 3}, where=lambda t: (t["head"], t["step"]))
    assert eqx_ckpt.Checkpoint(path)["step"] == 3


def test_an_equinox_module_sub_tree(tmp_path):
    path = tmp_path / "ckpt"
    model = eqx.nn.MLP(4, 4, 8, 2, key=jax.random.key(0))
    state = {"model": model, "opt": {"mu": jnp.zeros(3)}}
    eqx_ckpt.tree_serialise_leaves(path, state)
    trained = eqx.tree_at(lambda m: m.layers[1].weight, model, model.layers[1].weight + 1)
    new = {"model": trained, "opt": _abstract(state["opt"])}
    eqx_ckpt.tree_serialise_leaves(path, new, where=lambda s: s["model"].layers[1])
    loaded = eqx_ckpt.tree_deserialise_leaves(path, state)
    assert tree_equal(loaded["model"], trained, typematch=True)
    assert tree_equal(loaded["opt"], state["opt"], typematch=True)


def test_kept_arrays_share_their_files(tmp_path):
    path = tmp_path / "ckpt"
    first = _first()
    eqx_ckpt.tree_serialise_leaves(path, first)

    def inode():
        m = _transaction.read_manifest(location(str(path)))
        root = path / m.data_root if m.data_root else path
        return os.lstat(root / "base" / "w" / "c" / "0").st_ino

    before = inode()
    eqx_ckpt.tree_serialise_leaves(path, {**first, "head": {"x": np.ones(1)}}, where=lambda t: t["head"])
    assert inode() == before


def test_a_kept_leaf_stored_in_another_dtype_stays_so(tmp_path):
    path = tmp_path / "ckpt"
    first = _first()
    eqx_ckpt.tree_serialise_leaves(path, first, cast={np.float32: jnp.bfloat16})
    stored = {r.path: r.stored_dtype for r in _transaction.read_manifest(location(str(path))).leaves}
    eqx_ckpt.tree_serialise_leaves(path, {**first, "head": {"x": np.ones(1)}}, where=lambda t: t["head"])
    after = {r.path: r.stored_dtype for r in _transaction.read_manifest(location(str(path))).leaves}
    assert after["base.w"] == stored["base.w"] == "bfloat16"


def test_without_a_checkpoint_nothing_is_written(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match="replaces sub-trees of an existing checkpoint"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "none", _first(), where=lambda t: t["head"])
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("where", "options", "match"),
    [
        (lambda t: t["nope"], {}, "`where` raised KeyError"),
        (lambda t: 3, {}, "not a node of `pytree`"),
        ("head", {}, "must be a callable"),
        (lambda t: t["head"], {"overwrite": False}, "cannot be combined with `overwrite=False`"),
    ],
)
def test_bad_selections_write_nothing(tmp_path, where, options, match):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _first())
    before = sorted(os.listdir(path)), _stored(path)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=match):
        eqx_ckpt.tree_serialise_leaves(path, _first(), where=where, **options)
    assert sorted(os.listdir(path)) == before[0]
    _bitwise(_stored(path), before[1])


def test_a_pick_inside_a_stored_leaf_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"head": np.ones(3), "step": 1})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="lies inside the stored leaf `head`"):
        eqx_ckpt.tree_serialise_leaves(path, {"head": {"w": np.ones(2)}, "step": 1}, where=lambda t: t["head"]["w"])


_OTHER_SAVE = textwrap.dedent(
    """
    import sys, numpy as np, eqx_ckpt
    eqx_ckpt.tree_serialise_leaves(sys.argv[1], {"other": np.ones(2)})
    """
)


def test_a_checkpoint_replaced_while_a_partial_save_read_it_is_refused(tmp_path):
    """Another process replaces the checkpoint after the partial save read the
    leaves it keeps and before it began: committing would bring back what the
    other save replaced, so it is refused and the other checkpoint stays."""
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _first())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def replace(*args):
        subprocess.run([sys.executable, "-c", _OTHER_SAVE, str(path)], env=env, check=True, timeout=300)

    with (
        _faults.armed("transaction.begin", replace),
        pytest.raises(eqx_ckpt.CheckpointReplacedError, match="nothing was written"),
    ):
        eqx_ckpt.tree_serialise_leaves(path, _first(), where=lambda t: t["head"])
    assert sorted(_stored(path)) == ["other"]
    assert eqx_ckpt.verify(path) == []


@pytest.mark.parametrize("point", ["share.link", "local_write.chunk", "sync.flush", "commit.manifest_write"])
@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_partial_save_failing_at_any_step_keeps_the_checkpoint(tmp_path, point, error):
    path = tmp_path / "ckpt"
    first = _first()
    eqx_ckpt.tree_serialise_leaves(path, first)
    before = _stored(path)
    expected = KeyboardInterrupt if error is KeyboardInterrupt else eqx_ckpt.CheckpointError
    new = {**first, "head": {"x": np.full(400_000, 2.0, np.float32)}}
    with _faults.armed(point, error("injected")), pytest.raises(expected):
        eqx_ckpt.tree_serialise_leaves(path, new, where=lambda t: t["head"])
    _bitwise(_stored(path), before)
    assert eqx_ckpt.verify(path) == []
    eqx_ckpt.tree_serialise_leaves(path, new, where=lambda t: t["head"])
    assert sorted(_stored(path)) == ["base.b", "base.w", "head.x", "step"]
    assert [n for n in os.listdir(path) if n.startswith("gen.")] == [eqx_ckpt.Checkpoint(path)._manifest.data_root]


def test_a_partial_save_on_s3(s3, store):
    first = _first()
    eqx_ckpt.tree_serialise_leaves(store, first)
    new = {"base": _abstract(first["base"]), "head": {"w2": np.full(3, 7.0)}, "step": 2}
    eqx_ckpt.tree_serialise_leaves(store, new, where=lambda t: t["head"])
    after = {k: np.asarray(v) for k, v in eqx_ckpt.Checkpoint(store).items()}
    assert sorted(after) == ["base.b", "base.w", "head.w2", "step"]
    assert after["base.w"].tobytes() == first["base"]["w"].tobytes()
    assert eqx_ckpt.verify(store) == []


def test_sharded_arrays_picked_and_kept(tmp_path):
    """A sharded array in the picked sub-tree is written shard by shard; a kept
    one keeps its chunk grid (its shards'), so its chunks are shared as stored."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu")[:4])
    sharded = lambda v: jax.device_put(v, NamedSharding(mesh, P("x")))
    value = np.arange(64 * 8192, dtype=np.float32).reshape(64, 8192)  # 2 MiB: not packed
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"kept": sharded(value), "head": sharded(value)})
    chunks = {r.path: r.chunks for r in _transaction.read_manifest(location(str(path))).leaves}
    assert chunks["kept"] == (16, 8192)
    new = {"kept": jax.ShapeDtypeStruct(value.shape, value.dtype), "head": sharded(value * 2)}
    eqx_ckpt.tree_serialise_leaves(path, new, where=lambda t: t["head"])
    after = {r.path: r.chunks for r in _transaction.read_manifest(location(str(path))).leaves}
    assert after == chunks
    like = {"kept": sharded(np.zeros_like(value)), "head": sharded(np.zeros_like(value))}
    loaded = eqx_ckpt.tree_deserialise_leaves(path, like)
    np.testing.assert_array_equal(np.asarray(loaded["kept"]), value)
    np.testing.assert_array_equal(np.asarray(loaded["head"]), value * 2)
    assert loaded["head"].sharding == like["head"].sharding
