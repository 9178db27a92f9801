"""`layout="ocdbt"`: every array of a checkpoint in one OCDBT database."""

import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_ckpt
from eqx_ckpt._tools._cli import main as cli_main


def _tree():
    return {
        "model": eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)),
        "half": jnp.ones(5, jnp.bfloat16),
        "key": jax.random.key(1),
        "table": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "step": 12,
        "lr": 0.25,
        "odd.key/name": jnp.zeros(2, jnp.int32),
    }


def _like():
    # An abstract skeleton, but NumPy leaves stay NumPy (an abstract leaf loads as a JAX array).
    return {**eqx.filter_eval_shape(_tree), "table": np.zeros((2, 3), np.uint8)}


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def _database(folder):
    return ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(folder)}}).result()


def test_round_trip_and_few_files(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    assert tree_equal(loaded, tree, typematch=True)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "ocdbt.db"]
    assert json.loads((tmp_path / "manifest.json").read_text())["layout"] == "ocdbt"
    leaves = len(json.loads((tmp_path / "manifest.json").read_text())["leaves"])
    assert len(_files(tmp_path)) < leaves


@pytest.mark.usefixtures("unpacked")  # (packs in a database: test_pack.py)
def test_database_holds_the_same_per_leaf_zarr_arrays(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    keys = {k.decode() for k in _database(tmp_path / "ocdbt.db").list().result()}
    assert {"zarr.json", "model/zarr.json", "model/layers/0/weight/zarr.json", "odd%2Ekey%2Fname/zarr.json"} <= keys
    base = {"driver": "ocdbt", "base": {"driver": "file", "path": str(tmp_path / "ocdbt.db")}}
    weight = ts.open({"driver": "zarr3", "kvstore": {**base, "path": "model/layers/0/weight/"}}).result()
    np.testing.assert_array_equal(weight.read().result(), np.asarray(tree["model"].layers[0].weight))
    half = ts.open({"driver": "zarr3", "kvstore": {**base, "path": "half/"}}).result()
    assert half.dtype.numpy_dtype == np.dtype(ml_dtypes.bfloat16)


def test_partial_load_reads_only_the_selection(tmp_path, packing):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    # Remove every array but the model's from the database: a load that touched
    # any of them would fail. (Packed, the model's leaves are the float32 pack.)
    database = _database(tmp_path / "ocdbt.db")
    others = ("half", "key", "table", "step", "lr", "odd%2Ekey%2Fname")
    if packing == "packed":
        others = tuple(f"packed.{dtype}" for dtype in ("bfloat16", "uint32", "uint8", "int64", "float64", "int32"))
    for name in others:
        assert database.list(ts.KvStore.KeyRange(name + "/", name + "0")).result(), name
        database.delete_range(ts.KvStore.KeyRange(name + "/", name + "0")).result()
    like = eqx.filter_eval_shape(_tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda t: t["model"])
    assert tree_equal(loaded["model"], tree["model"], typematch=True)
    assert loaded["half"] is like["half"]
    model = eqx_ckpt.tree_deserialise_leaves(tmp_path, eqx.filter_eval_shape(lambda: tree["model"]), prefix="model")
    assert tree_equal(model, tree["model"], typematch=True)
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("is damaged or incomplete")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)


def test_sharded_arrays_each_device_reads_its_region(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    value = jnp.arange(32.0).reshape(8, 4)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jax.device_put(value, NamedSharding(mesh, P("x")))}, layout="ocdbt")
    for spec in (P("x"), P(None, "x"), P()):
        sharding = NamedSharding(mesh, spec)
        like = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)}
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)["w"]
        assert loaded.sharding == sharding
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(value))


def test_checkpoint_and_lazy_reads(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert "model.layers.0.weight" in ckpt and ckpt["step"] == 12
    np.testing.assert_array_equal(ckpt["table"][1:], np.arange(3, 6, dtype=np.uint8).reshape(1, 3))
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    assert isinstance(lazy["table"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), tree, typematch=True)


def _root(path):
    return json.loads((path / "manifest.json").read_text())["data_root"]


def test_overwrite_writes_a_new_database_and_removes_the_old_one(tmp_path):
    first, second, third = ({"w": jnp.arange(4) + i, "step": i} for i in range(3))
    eqx_ckpt.tree_serialise_leaves(tmp_path, first, layout="ocdbt")
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "ocdbt.db"]
    for tree in (second, third):
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
        assert sorted(os.listdir(tmp_path)) == sorted([_root(tmp_path), "manifest.json"])
        assert os.listdir(tmp_path / _root(tmp_path)) == ["ocdbt.db"]
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, first), tree, typematch=True)


def test_switching_layouts_on_overwrite(tmp_path):
    tree = {"a": {"b": jnp.arange(3)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    assert sorted(os.listdir(tmp_path)) == sorted([_root(tmp_path), "manifest.json"])
    assert os.listdir(tmp_path / _root(tmp_path)) == ["ocdbt.db"]
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert sorted(os.listdir(tmp_path)) == sorted([_root(tmp_path), "manifest.json"])
    assert sorted(os.listdir(tmp_path / _root(tmp_path))) == ["packed.int32", "zarr.json"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_failed_save_leaves_the_old_checkpoint(tmp_path):
    old = {"w": jnp.arange(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old, layout="ocdbt")
    before = _files(tmp_path)

    def spec(handle, x):
        if handle.path == "z":
            raise RuntimeError("boom")
        handle.write(x)

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("['z']")):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.arange(3) + 1, "z": jnp.ones(2)}, spec, layout="ocdbt")
    assert _files(tmp_path) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)


def test_memory_store_and_background_save():
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "n": 4}
    pending = eqx_ckpt.tree_serialise_leaves("memory://ocdbt_test/ckpt/", tree, layout="ocdbt", blocking=False)
    pending.wait()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves("memory://ocdbt_test/ckpt/", tree), tree, typematch=True)


def test_damaged_database_is_an_integrity_error(tmp_path, packing):
    tree = {"w": jnp.arange(64.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    for name in _files(tmp_path / "ocdbt.db"):
        if name.startswith("d" + os.sep):
            data = bytearray((tmp_path / "ocdbt.db" / name).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (tmp_path / "ocdbt.db" / name).write_bytes(bytes(data))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`w`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert cli_main(["verify", str(tmp_path)]) == 1


def test_verify_reads_every_chunk_in_the_database(tmp_path, packing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), layout="ocdbt")
    assert cli_main(["verify", str(tmp_path)]) == 0
    half = "half" if packing == "unpacked" else "packed.bfloat16"  # packed, the only bfloat16 leaf
    _database(tmp_path / "ocdbt.db").delete_range(ts.KvStore.KeyRange(f"{half}/c/", f"{half}/c0")).result()
    assert cli_main(["verify", str(tmp_path)]) == 1


def test_unknown_layout_is_refused(tmp_path):
    with pytest.raises(
        eqx_ckpt.CheckpointValueError, match=re.escape("`layout` must be one of 'directories', 'ocdbt'")
    ):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)}, layout="zip")
    assert os.listdir(tmp_path) == []
