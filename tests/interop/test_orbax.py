"""orbax-checkpoint PyTree checkpoints (OCDBT or not, zarr or zarr3) as sources,
read with TensorStore, with every load option."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt

ocp = pytest.importorskip("orbax.checkpoint")

FORMATS = [(True, True), (True, False), (False, True), (False, False)]


def _tree():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"), axis_types=(jax.sharding.AxisType.Explicit,))
    sharded = jax.device_put(jnp.arange(32.0).reshape(8, 4), jax.NamedSharding(mesh, jax.P("x")))
    return {
        "params": {"w": sharded, "b": jnp.ones(4, jnp.bfloat16)},
        "layers": [np.arange(3, dtype=np.int32), {"gain": jnp.full((2, 2), 2.0)}],
        "step": 7,
    }


def _same(a, b):
    """Equal values and leaf types (compared on the host: the shardings differ)."""
    assert jax.tree.map(type, a) == jax.tree.map(type, b)
    assert tree_equal(jax.device_get(a), jax.device_get(b), typematch=True)


def _save(path, tree, *, ocdbt, zarr3):
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return path


@pytest.mark.parametrize(("ocdbt", "zarr3"), FORMATS)
def test_checkpoint_and_full_load(tmp_path, ocdbt, zarr3):
    tree = _tree()
    path = _save(tmp_path / "orbax", tree, ocdbt=ocdbt, zarr3=zarr3)
    ckpt = eqx_ckpt.Checkpoint(path)
    assert ckpt.format == "orbax"
    assert list(ckpt) == ["layers.0", "layers.1.gain", "params.b", "params.w", "step"]
    assert ckpt["step"] == 7
    np.testing.assert_array_equal(ckpt["params.w"][2:4], np.asarray(tree["params"]["w"])[2:4])
    loaded = eqx_ckpt.tree_deserialise_leaves(path, tree)
    _same(loaded, tree)
    assert loaded["params"]["w"].sharding == tree["params"]["w"].sharding


@pytest.mark.parametrize(("ocdbt", "zarr3"), [(True, True), (False, False)])
def test_load_options(tmp_path, ocdbt, zarr3):
    tree = _tree()
    path = _save(tmp_path / "orbax", tree, ocdbt=ocdbt, zarr3=zarr3)
    # `prefix` + abstract `like` placed with a different sharding.
    mesh = jax.make_mesh(
        (2, 2), ("a", "b"), devices=jax.devices("cpu"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    sharding = jax.NamedSharding(mesh, jax.P(None, "b"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding), "b": jnp.zeros(4, jnp.bfloat16)}
    params = eqx_ckpt.tree_deserialise_leaves(path, like, prefix="params")
    assert params["w"].sharding == sharding
    _same(params, tree["params"])
    # `where`, `rename` rules, `cast`, `missing`, `lazy`, `transform`.
    like = {"weight": jnp.zeros((4, 8)), "bias": jnp.zeros(4), "new": jnp.ones(1), "gain": jnp.zeros((2, 2))}
    out = eqx_ckpt.tree_deserialise_leaves(
        path,
        like,
        where=lambda t: (t["weight"], t["bias"], t["new"]),
        rename=[(r"^weight$", "params.w"), (r"^bias$", "params.b")],
        transform={"weight": np.transpose},
        cast=True,
        missing="keep",
    )
    expected = {"weight": tree["params"]["w"].T, "bias": jnp.ones(4), "new": jnp.ones(1), "gain": jnp.zeros((2, 2))}
    _same(out, expected)
    lazy = eqx_ckpt.tree_deserialise_leaves(path, {"gain": jnp.zeros((2, 2))}, prefix="layers.1", lazy=True)
    assert isinstance(lazy["gain"], eqx_ckpt.LazyArray)
    _same(eqx_ckpt.materialise(lazy), tree["layers"][1])
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(path, {"w": jnp.zeros((8, 4), jnp.int32)}, prefix="params", strict=True)
    assert re.search(re.escape("`params.w` (key path ['w']") + ".*dtype changed", str(info.value))
    assert "`params.b`: unexpected" in str(info.value)


def test_equinox_model_saved_by_standard_checkpointer(tmp_path):
    model = {"encoder": eqx.nn.Linear(3, 4, key=jax.random.key(0)), "head": eqx.nn.Linear(4, 2, key=jax.random.key(1))}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "std", model)
    make = lambda: {
        "encoder": eqx.nn.Linear(3, 4, key=jax.random.key(5)),
        "head": eqx.nn.Linear(4, 2, key=jax.random.key(6)),
        "adapter": eqx.nn.Linear(2, 2, key=jax.random.key(7)),
    }
    loaded = eqx_ckpt.load_or_initialise(tmp_path / "std", make)
    assert tree_equal(loaded["encoder"], model["encoder"]) and tree_equal(loaded["head"], model["head"])
    assert tree_equal(loaded["adapter"], make()["adapter"])


def test_a_checkpoint_manager_step_and_an_empty_directory(tmp_path):
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(3, args=ocp.args.StandardSave({"w": jnp.arange(3.0)}))
        manager.wait_until_finished()
    # A step's single item sits in `default/`; the step directory is enough.
    assert tree_equal(
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "run" / "3", {"w": jnp.zeros(3)}), {"w": jnp.arange(3.0)}
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape("or orbax `_METADATA` there either")):
        eqx_ckpt.Checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("item", [None, "state"])
def test_an_eqx_ckpt_manager_on_an_orbax_managers_directory_names_its_steps(tmp_path, capsys, item):
    """`CheckpointManager(orbax_root).all_steps()` said `[]`, and its first save
    would have started a second run beside orbax's steps."""
    root = tmp_path / "run"
    with ocp.CheckpointManager(root, item_names=(item,) if item else None) as manager:
        for step in (3, 5):
            save = ocp.args.StandardSave({"w": jnp.arange(3.0) + step})
            manager.save(step, args=ocp.args.Composite(**{item: save}) if item else save)
        manager.wait_until_finished()
    one = str(root / "5" / item) if item else str(root / "5")
    said = (
        "It is an orbax CheckpointManager's directory (steps 3, 5): load one step by its folder, e.g. "
        f"`eqx_ckpt.tree_deserialise_leaves({one!r}, like)`"
    )
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(said)):
        eqx_ckpt.CheckpointManager(root)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    # The advice is true advice, and the other entry points say the same.
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(one, {"w": jnp.zeros(3)}), {"w": jnp.arange(3.0) + 5})
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(root)
    from eqx_ckpt._tools._cli import main

    assert main(["ls", str(root)]) == 2
    assert said in capsys.readouterr().err
    # An empty, a fresh and an eqx_ckpt manager's directory are as they were.
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "empty", tmp_path / "fresh"):
        assert eqx_ckpt.CheckpointManager(directory).all_steps() == []
    eqx_ckpt.CheckpointManager(tmp_path / "ours").save(1, {"w": jnp.ones(2)})
    assert eqx_ckpt.CheckpointManager(tmp_path / "ours").all_steps() == [1]


def test_a_deleted_chunk_is_damage_not_zeros(tmp_path):
    path = _save(tmp_path / "orbax", {"w": jnp.arange(6.0), "b": jnp.ones(2)}, ocdbt=False, zarr3=False)
    (path / "w" / "0").unlink()
    ckpt = eqx_ckpt.Checkpoint(path)
    np.testing.assert_array_equal(np.asarray(ckpt["b"]), np.ones(2))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `w` in checkpoint") + ".*is missing"):
        np.asarray(ckpt["w"])


@pytest.mark.parametrize(("ocdbt", "zarr3"), FORMATS)
def test_keys_holding_a_slash_load_and_an_empty_key_is_refused_by_name(tmp_path, ocdbt, zarr3):
    """Orbax restores both; a key with `/` was refused as "damaged" (with the
    whole checkpoint); it loads now. An empty key names no folder: refused,
    as such, not as damage."""
    tree = {"dense/kernel": jnp.arange(6.0).reshape(2, 3), "w": jnp.zeros(3)}
    path = _save(tmp_path / "slash", tree, ocdbt=ocdbt, zarr3=zarr3)
    assert sorted(eqx_ckpt.Checkpoint(path)) == ["dense%2Fkernel", "w"]
    _same(eqx_ckpt.tree_deserialise_leaves(path, tree), tree)
    empty = _save(tmp_path / "empty", {"": jnp.ones(2), "w": jnp.zeros(3)}, ocdbt=ocdbt, zarr3=zarr3)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("gives the array name '', which is not a name")):
        eqx_ckpt.Checkpoint(empty)
