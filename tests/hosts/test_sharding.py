"""Sharded arrays on 4 CPU devices: chunks line up with shards; loads reshard."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import eqx_ckpt
from eqx_ckpt._hosts import _sharding
from eqx_ckpt._ondisk import _format


@pytest.fixture
def mesh():
    assert len(jax.devices("cpu")) == 4
    return Mesh(np.array(jax.devices("cpu")), ("x",))


@pytest.fixture
def mesh2d():
    return Mesh(np.array(jax.devices("cpu")).reshape(2, 2), ("a", "b"))


def _saved(path, mesh):
    values = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    tree = {
        "sharded": jax.device_put(values, NamedSharding(mesh, P("x"))),
        "replicated": jax.device_put(values * 2, NamedSharding(mesh, P())),
    }
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return values, tree


def _chunk_shape(path, key):
    return json.loads((path / key / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"]


def _chunk_files(path, key):
    return sorted(p for p in (path / key).rglob("*") if p.is_file() and p.name != "zarr.json")


def test_chunks_line_up_with_shards(tmp_path, mesh, packing):
    _, tree = _saved(tmp_path, mesh)
    assert tree["sharded"].sharding.shard_shape((8, 6)) == (2, 6)
    assert _chunk_shape(tmp_path, "sharded") == [2, 6]  # sharded: never packed
    assert len(_chunk_files(tmp_path, "sharded")) == 4
    # Replicated data is one block, written once: in a chunk of its own, or packed.
    if packing == "unpacked":
        assert _chunk_shape(tmp_path, "replicated") == [8, 6]
        assert len(_chunk_files(tmp_path, "replicated")) == 1
    else:
        assert not (tmp_path / "replicated").exists()
        record = eqx_ckpt.Checkpoint(tmp_path).record("replicated")
        assert record.pack is not None and record.pack.name == "packed.float32" and record.chunks == (8, 6)


def test_small_chunks_stay_inside_shards(tmp_path, mesh, monkeypatch):
    monkeypatch.setattr(_format, "CHUNK_BYTES", 16)
    x = jax.device_put(jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4), NamedSharding(mesh, P("x")))
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    chunk = _chunk_shape(tmp_path, "x")
    shard = x.sharding.shard_shape(x.shape)
    assert all(s % c == 0 for s, c in zip(shard, chunk))
    assert np.prod(chunk) * 4 <= 16


def test_round_trip_keeps_the_saved_sharding_of_like(tmp_path, mesh):
    values, tree = _saved(tmp_path, mesh)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(loaded, tree, typematch=True)
    assert loaded["sharded"].sharding == tree["sharded"].sharding
    assert loaded["replicated"].sharding == tree["replicated"].sharding
    np.testing.assert_array_equal(np.asarray(loaded["sharded"]), values)


def test_load_with_a_different_sharding(tmp_path, mesh, mesh2d):
    values, _ = _saved(tmp_path, mesh)
    columns = NamedSharding(mesh2d, P("a", "b"))
    replicated = NamedSharding(mesh2d, P())
    like = {
        "sharded": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=columns),
        "replicated": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=replicated),
    }
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["sharded"].sharding == columns
    assert loaded["replicated"].sharding == replicated
    np.testing.assert_array_equal(np.asarray(loaded["sharded"]), values)
    np.testing.assert_array_equal(np.asarray(loaded["replicated"]), values * 2)
    for shard in loaded["sharded"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])
        assert shard.data.shape == (4, 3)


def test_replicated_save_loads_sharded(tmp_path, mesh):
    values, _ = _saved(tmp_path, mesh)
    rows = NamedSharding(mesh, P("x"))
    like = {"replicated": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=rows)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["replicated"].sharding == rows
    np.testing.assert_array_equal(np.asarray(loaded["replicated"]), values * 2)


def test_load_onto_one_device(tmp_path, mesh):
    values, _ = _saved(tmp_path, mesh)
    device = jax.devices("cpu")[3]
    like = {
        "sharded": jax.device_put(jnp.zeros((8, 6)), device),
        "replicated": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=SingleDeviceSharding(device)),
    }
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    for key in like:
        assert loaded[key].sharding == SingleDeviceSharding(device)
        assert loaded[key].devices() == {device}
    np.testing.assert_array_equal(np.asarray(loaded["sharded"]), values)
    np.testing.assert_array_equal(np.asarray(loaded["replicated"]), values * 2)
    plain = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"sharded": jnp.zeros((8, 6)), "replicated": jnp.zeros((8, 6))})
    assert len(plain["sharded"].devices()) == 1
    np.testing.assert_array_equal(np.asarray(plain["sharded"]), values)


def test_sharded_prng_keys_and_lazy_region_reads(tmp_path, mesh):
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, P("x")))
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"k": keys})
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"k": keys})
    assert tree_equal(loaded, {"k": keys}, typematch=True)
    assert loaded["k"].sharding == keys.sharding
    lazy = eqx_ckpt.Checkpoint(tmp_path)["k"]
    np.testing.assert_array_equal(lazy[2:4], np.asarray(jax.random.key_data(keys))[2:4])


def test_filter_eval_shape_skeleton_with_abstract_mesh_is_placed(tmp_path):
    # `eqx.filter_eval_shape` gives shardings over an AbstractMesh (no devices),
    # laid out over the default backend's devices (4 CPUs, else all there are).
    n = 4 if len(jax.devices()) >= 4 else len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

    def make():
        return {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))}

    eqx_ckpt.tree_serialise_leaves(tmp_path, make())
    like = eqx.filter_eval_shape(make)
    assert isinstance(like["w"].sharding.mesh, jax.sharding.AbstractMesh)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert tree_equal(out, make(), typematch=True)
    assert out["w"].sharding.spec == P("x", None)
    assert len(out["w"].sharding.device_set) == n


def test_an_abstract_mesh_larger_than_this_process_is_a_clear_error(tmp_path):
    """A skeleton whose abstract mesh needs more devices than the process has
    says so (how many, on which platform), rather than JAX's bare error."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.arange(64.0).reshape(8, 8)})
    n = 2 * len(jax.devices())
    abstract = jax.sharding.AbstractMesh((n,), ("x",))
    like = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(abstract, P("x")))}
    with pytest.raises(
        eqx_ckpt.LeafError, match=rf"placement: .*abstract mesh of {n} devices .* has {n // 2} \w+ device"
    ) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert "'w'" in str(info.value)


@pytest.mark.parametrize("seed", range(40))
def test_replica_slices_cover_a_region_once_on_its_chunk_grid(seed, monkeypatch):
    """Several processes holding one region cut it (`_sharding.slices`, what
    each process of a multi-process save computes alone) into disjoint
    slices that cover it, at chunk boundaries, one per holder at most,
    largest first; a region under `SPLIT_BYTES` is not cut."""
    monkeypatch.setattr(_sharding, "SPLIT_BYTES", 64)
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(1, 4))
    chunks = tuple(int(c) for c in rng.integers(1, 6, rank))
    starts = [int(rng.integers(0, 3)) * c for c in chunks]
    region = tuple((a, a + int(rng.integers(0, 20))) for a in starts)
    holders = int(rng.integers(1, 6))
    cut = _sharding.slices(region, chunks, holders, 4)
    count = np.zeros([b for _, b in region], np.int32)
    for part in cut:
        count[tuple(slice(a, b) for a, b in part)] += 1
        for (a, b), (lo, hi), c in zip(part, region, chunks):
            assert lo <= a <= b <= hi and (a == lo or a % c == 0) and (b == hi or b % c == 0)
    assert (count[tuple(slice(a, b) for a, b in region)] == 1).all()
    sizes = [np.prod([b - a for a, b in part]) for part in cut]
    assert 1 <= len(cut) <= holders and sizes == sorted(sizes, reverse=True)
    if np.prod([b - a for a, b in region]) * 4 < 64:
        assert cut == [region]


def test_replica_slices_follow_the_axis_of_most_chunks_in_equal_shares(monkeypatch):
    monkeypatch.setattr(_sharding, "SPLIT_BYTES", 1 << 20)
    # 8 chunks of 128 rows, 4 holders: 2 chunks each.
    assert _sharding.slices(((0, 1024), (0, 512)), (128, 512), 4, 4) == [
        ((0, 256), (0, 512)),
        ((256, 512), (0, 512)),
        ((512, 768), (0, 512)),
        ((768, 1024), (0, 512)),
    ]
    # 5 chunks (the last of 44 rows) for 2: the first slice one chunk larger.
    assert _sharding.slices(((0, 300), (0, 4096)), (64, 4096), 2, 4) == [((0, 192), (0, 4096)), ((192, 300), (0, 4096))]
    # Axis 1 has the most chunks (4, against 2).
    cut = _sharding.slices(((0, 2), (0, 2048), (0, 64)), (1, 512, 64), 2, 4)
    assert cut == [((0, 2), (0, 1024), (0, 64)), ((0, 2), (1024, 2048), (0, 64))]
    # Fewer chunks than holders: a chunk each, for as many holders.
    assert _sharding.slices(((0, 512), (0, 1024)), (256, 1024), 4, 4) == [
        ((0, 256), (0, 1024)),
        ((256, 512), (0, 1024)),
    ]
    # One chunk, or under the threshold: not cut.
    assert _sharding.slices(((0, 512), (0, 1024)), (512, 1024), 4, 4) == [((0, 512), (0, 1024))]
    assert _sharding.slices(((0, 16), (0, 8)), (1, 8), 3, 4) == [((0, 16), (0, 8))]
    assert _sharding.slices((), (), 3, 4) == [()]


def test_a_deal_gives_each_slice_to_the_holder_dealt_least(monkeypatch):
    monkeypatch.setattr(_sharding, "SPLIT_BYTES", 10)
    deal = _sharding.Deal()
    # Two uneven cuts: the larger slice goes to a different process each time.
    assert deal.owners((0, 1, 2, 3), [30, 20, 20, 20]) == [0, 1, 2, 3]
    assert deal.owners((0, 1, 2, 3), [30, 20, 20, 20]) == [1, 2, 3, 0]
    # Whole large leaves alternating with small ones, for two processes: the
    # large ones by bytes dealt, the small ones in turn.
    pair = _sharding.Deal()
    owners = [pair.owners((0, 1), [size])[0] for size in [100, 1, 100, 1, 100, 1, 100, 1, 150, 1]]
    assert owners == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    # A small region held by some processes only goes to one of them.
    assert {deal.owners((1, 3), [1])[0] for _ in range(4)} == {1, 3}
