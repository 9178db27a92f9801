"""`_records`: every leaf becomes its record and pieces by one path, the
common leaf by a short branch of it; what a save of each kind of leaf writes
and loads back."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal, values

import eqx_ckpt
from eqx_ckpt._base import _faults, _tree
from eqx_ckpt._base._location import location
from eqx_ckpt._save import _records, _serialise

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    np.int8,
    np.int32,
    np.uint16,
    np.int64,
    np.bool_,
    np.complex64,
]
SHAPES = [(), (0,), (3,), (4, 5), (2, 0, 3), (1, 1, 1, 7)]


def _never_cast(path: str, dtype: np.dtype) -> None:
    """A `cast` that changes nothing (a save with a `cast` makes every record the general way)."""
    return None


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _leaves(path) -> list[dict]:
    return _manifest(path)["leaves"]


@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
def test_every_dtype_and_shape_round_trips_and_a_cast_of_nothing_writes_the_same(tmp_path, as_jax):
    """Arrays of every dtype stored as it is, of every shape (empty, scalar,
    several dimensions; and one larger than a pack takes), saved with no
    `cast` and with one that changes nothing: both load back exactly, and
    both manifests list the same records."""
    tree = {}
    for dtype in DTYPES:
        if as_jax and np.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
            continue  # 64-bit jax arrays need x64
        for shape in SHAPES:
            tree[f"{np.dtype(dtype).name}_{'x'.join(map(str, shape))}"] = np.asarray(values(shape, dtype))
    tree["large"] = values((600, 1000), np.float32)  # 2.4 MB: a folder of its own, not a pack
    if as_jax:
        tree = {k: jax.device_put(v) for k, v in tree.items()}
    # (zeros made by NumPy: a `jnp.zeros_like` of each dtype and shape would compile a program each)
    like = jax.tree.map(lambda x: jax.device_put(np.zeros_like(x)) if as_jax else np.zeros_like(x), tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "cast", tree, cast=_never_cast)
    for name in ("plain", "cast"):
        got = eqx_ckpt.tree_deserialise_leaves(tmp_path / name, like)
        assert tree_equal(got, tree, typematch=True)
    assert _leaves(tmp_path / "plain") == _leaves(tmp_path / "cast")
    kind = "jax" if as_jax else "numpy"
    assert {leaf["type"] for leaf in _leaves(tmp_path / "plain")} == {kind}
    assert (tmp_path / "plain" / "large" / "zarr.json").is_file()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_tree_of_every_kind_of_leaf_round_trips(tmp_path, blocking):
    """Leaves of the short branch and of the general way side by side, some
    sharing a dtype and shape (whose record's fixed part the short branch
    works out once): each is stored as its own kind, and loads back as it was."""

    class Sub(np.ndarray):
        pass

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    x = values((4,), np.float32)
    tree = {
        "a_numpy": x,
        "b_jax": jax.device_put(x),
        "c_big_endian": x.astype(">f4"),
        "d_key": jax.random.key(3),
        "e_int8": values((2, 3), np.int8),
        "f_bf16": jnp.asarray(x, jnp.bfloat16),
        "g_row": x[None],
        "h_float": 3.0,
        "i_f16": values((4,), np.float16),
        "j_sub": np.arange(4.0).view(Sub),
        "k_sharded": jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))),
        "l_numpy": x + 1,
        "m_jax": jax.device_put(x + 2),
    }
    expected = dict(tree, j_sub=np.arange(4.0), k_sharded=jnp.arange(8.0))
    like = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else jnp.zeros_like(v) for k, v in expected.items()}
    like.update(d_key=jax.random.key(0), h_float=0.0)
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path, tree, blocking=blocking)
    if pending is not None:
        pending.wait()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    key = out.pop("d_key")
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(tree["d_key"]))
    assert tree_equal(out, {k: v for k, v in expected.items() if k != "d_key"}, typematch=True)
    kinds = {leaf["path"]: leaf["type"] for leaf in _leaves(tmp_path)}
    assert kinds == {
        "a_numpy": "numpy",
        "b_jax": "jax",
        "c_big_endian": "numpy",
        "d_key": "prng_key",
        "e_int8": "numpy",
        "f_bf16": "jax",
        "g_row": "numpy",
        "h_float": "float",
        "i_f16": "numpy",
        "j_sub": "numpy",
        "k_sharded": "jax",
        "l_numpy": "numpy",
        "m_jax": "jax",
    }


def test_each_leaf_is_made_once_and_the_common_one_by_the_short_branch(tmp_path, faults):
    """The general way (fault point `save.leaf_record`) runs once for each leaf
    the short branch does not take, and never for a common leaf (a
    big-endian array is one: its bytes are swapped as written); through a
    custom filter spec's handle as with the default one."""
    made = []
    faults("save.leaf_record", made.append)
    tree = {"w": jnp.ones(3), "n": np.ones(2), "key": jax.random.key(0), "step": 4, "big": np.ones(3, ">f4")}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "default", tree)
    assert sorted(made) == ["key", "step"]
    made.clear()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "custom", tree, lambda handle, x: handle.write(x))
    assert sorted(made) == ["key", "step"]
    made.clear()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "cast", tree, cast=_never_cast)
    assert sorted(made) == ["big", "key", "n", "step", "w"]
    assert _leaves(tmp_path / "default") == _leaves(tmp_path / "custom") == _leaves(tmp_path / "cast")


def test_a_traced_value_written_by_a_filter_spec_is_refused(tmp_path):
    @jax.jit
    def f(x):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"w": x}, lambda handle, v: handle.write(v))
        return x

    with pytest.raises(eqx_ckpt.LeafError, match="it is a traced value"):
        f(jnp.ones(3))
    assert not (tmp_path / "ckpt").exists()


def _build(tree):
    leaves, names = _tree.flatten_named(tree, None)
    spec = _serialise.default_serialise_filter_spec
    return _records.build(location("memory://records"), leaves, names, [spec] * len(leaves), None, default=spec)


def test_other_processes_write_no_pieces(monkeypatch):
    """A process other than 0 makes the same records, and no pieces of a leaf on one device."""
    tree = {"j": jnp.ones(3), "n": np.ones((2, 2)), "s": 2.5}
    ours = _build(tree)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    theirs = _build(tree)
    assert [p.record for p in theirs] == [p.record for p in ours]
    assert all(p.pieces == [] and p.nbytes == 0 for p in theirs)
    assert all(len(p.pieces) == 1 for p in ours)


def test_kinds_are_remembered_by_type(tmp_path):
    """`array_kind` decides by type, once per type: what a save's records and
    an asynchronous save's hold both ask."""

    class Sub(np.ndarray):
        pass

    tracers = []
    jax.jit(lambda x: tracers.append(type(x)) or x)(jnp.ones(2))
    kinds = {
        np.ndarray: "numpy",
        Sub: "ndarray",
        type(jnp.ones(2)): "jax",
        tracers[0]: "abstract",
        jax.ShapeDtypeStruct: "abstract",
        int: "other",
        str: "other",
        _records.Held: "held",
    }
    for cls, kind in kinds.items():
        assert _records.array_kind(cls) == kind
        assert _records._KINDS[cls] == kind
    tree = {"sub": np.arange(3.0).view(Sub), "jax": jnp.ones(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert {leaf["path"]: leaf["type"] for leaf in _leaves(tmp_path)} == {"sub": "numpy", "jax": "jax"}


def _tree_of(dtype=np.float32, n=40):
    """Many small leaves (packed) and a large one (an array of its own), as a model's are."""
    return {
        "blocks": [{"w": jnp.full((4, 3), i, dtype), "b": np.arange(3, dtype=dtype) + i} for i in range(n)],
        "big": jnp.arange(300_000, dtype=jnp.float32),
    }


def _changed(tree):
    """Trees of `tree`'s structure, each with one leaf of another kind, dtype
    or shape, or deleted; named by what changed."""
    first = tree["blocks"][0]
    deleted = jnp.ones_like(first["w"])  # of the type, dtype and shape kept
    deleted.delete()
    return {
        "values": jax.tree.map(lambda x: x + 1, tree),
        "dtype": {**tree, "blocks": [{**first, "w": first["w"].astype(jnp.float16)}, *tree["blocks"][1:]]},
        "shape": {**tree, "blocks": [{**first, "b": np.arange(7.0)}, *tree["blocks"][1:]]},
        "numpy": {**tree, "blocks": [{**first, "w": np.asarray(first["w"])}, *tree["blocks"][1:]]},
        "jax": {**tree, "blocks": [{**first, "b": jnp.asarray(first["b"])}, *tree["blocks"][1:]]},
        "scalar": {**tree, "blocks": [{**first, "b": 2.5}, *tree["blocks"][1:]]},
        "deleted": {**tree, "blocks": [{**first, "w": deleted}, *tree["blocks"][1:]]},
        # (an iterator's state is recorded apart: the arrays' records are still kept and taken)
        "iterator": {**tree, "blocks": [{**first, "data": _Position()}, *tree["blocks"][1:]]},
    }


class _Position:
    """A data iterator's shape: its state is saved apart from the arrays."""

    def __init__(self):
        self.state = {"at": 3}

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


@pytest.mark.parametrize("change", ["values", "dtype", "shape", "numpy", "jax", "scalar", "deleted", "iterator"])
def test_a_save_after_one_of_the_same_structure_writes_what_a_first_save_writes(tmp_path, faults, packing, change):
    """A save keeps its records for the next save of the same structure
    (`_records.Plan`): taken as they are only where every leaf is of the type,
    dtype and shape it was (fault point `save.records_reused`). Whatever
    changed, the next save writes what a save making every record anew writes
    (one with a `cast`, which never takes kept records), and loads back; a
    deleted leaf is refused by name."""
    reused = []
    faults("save.records_reused", lambda loc: reused.append(loc.display))
    tree = _tree_of()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "first", tree)  # (an earlier test may have kept its records)
    reused.clear()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "again", tree)
    assert reused == [str(tmp_path / "again")]
    assert _leaves(tmp_path / "again") == _leaves(tmp_path / "first")
    other = _changed(tree)[change]
    if change == "deleted":
        with pytest.raises(eqx_ckpt.LeafError, match=re.escape("blocks.0.w") + ".*deleted"):
            eqx_ckpt.tree_serialise_leaves(tmp_path / "other", other)
        return
    eqx_ckpt.tree_serialise_leaves(tmp_path / "fresh", other, cast=_never_cast)  # every record made anew
    for name in ("other", "twice"):  # the records made anew (or, with `values`, taken), then taken if kept
        eqx_ckpt.tree_serialise_leaves(tmp_path / name, other)
        assert _leaves(tmp_path / name) == _leaves(tmp_path / "fresh")
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / name, other)
        assert tree_equal(loaded, other, typematch=True)
    # A tree with a leaf that is not the common leaf (a scalar) keeps no records.
    expected = ["other"] * (change == "values") + ["twice"] * (change != "scalar")
    assert reused[1:] == [str(tmp_path / name) for name in expected]


def test_kept_records_follow_the_knobs_and_a_managers_packs(tmp_path, monkeypatch, faults):
    """Records kept by a save are never taken by one that would make them
    otherwise: after a knob changed (`PACK_BYTES`, `_format.CHUNK_BYTES`, as
    tests change them), or for a manager's step, whose packs are cut in
    smaller chunks (`STEP_PACK_CHUNK_BYTES`) than a plain save's. (That
    knob is lowered here to 8 KiB, so that a pack of 200 blocks is cut in
    several chunks: the default's 128 KiB took 2,000 blocks, ten times the
    leaves to save and load, by the same code.)"""
    from eqx_ckpt._ondisk import _format

    monkeypatch.setattr(_records, "STEP_PACK_CHUNK_BYTES", 8 << 10)
    reused = []
    faults("save.records_reused", lambda loc: reused.append(loc.display))
    tree = _tree_of(n=200)  # 200 x 60 bytes, each leaf aligned to 64: a pack of over `STEP_PACK_CHUNK_BYTES`
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", tree)
    with eqx_ckpt.CheckpointManager(tmp_path / "steps") as manager:
        manager.save(1, tree)  # (an earlier test may have kept its records)
        reused.clear()
        manager.save(2, tree)
    plain, steps = _manifest(tmp_path / "plain"), _manifest(tmp_path / "steps" / "step_00000002")
    assert steps["packs"] == _manifest(tmp_path / "steps" / "step_00000001")["packs"]
    assert all(p["chunks"][0] * 4 <= _records.STEP_PACK_CHUNK_BYTES for p in steps["packs"])
    assert all(p["shape"][0] * 4 > _records.STEP_PACK_CHUNK_BYTES for p in steps["packs"])  # so cut in several chunks
    assert plain["packs"][0]["chunks"][0] > steps["packs"][0]["chunks"][0]
    assert reused == [str(tmp_path / "steps" / "step_00000002")]
    monkeypatch.setattr(_records, "PACK_BYTES", -1)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "unpacked", tree)
    assert _manifest(tmp_path / "unpacked")["packs"] == [] and len(reused) == 1
    monkeypatch.setattr(_format, "CHUNK_BYTES", 64 << 10)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "chunked", tree)
    big = {leaf["path"]: leaf for leaf in _leaves(tmp_path / "chunked")}["big"]
    before = {leaf["path"]: leaf for leaf in plain["leaves"]}["big"]
    assert big["chunks"][0] * 4 <= 64 << 10 < before.get("chunks", before["shape"])[0] * 4 and len(reused) == 1
    for name in ("unpacked", "chunked"):
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / name, tree), tree, typematch=True)


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_a_save_that_fails_as_it_takes_kept_records_leaves_nothing_and_keeps_them_whole(tmp_path, faults, raised):
    """An error or an interrupt as a save takes the records a save of the same
    structure kept: nothing is written, and the kept records stay as they
    were: the next save takes them and writes what the first one did."""
    tree = _tree_of()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "first", tree)

    def fail(loc):
        raise raised("injected")

    with _faults.armed("save.records_reused", fail), pytest.raises(raised, match="injected"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "failed", tree)
    assert not (tmp_path / "failed").exists()
    reused = []
    faults("save.records_reused", reused.append)
    changed = jax.tree.map(lambda x: x * 2, tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "next", changed)
    assert len(reused) == 1
    assert _leaves(tmp_path / "next") == _leaves(tmp_path / "first")
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "next", tree), changed, typematch=True)
