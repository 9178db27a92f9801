"""`lazy=True`, `LazyArray` and `materialise`."""

import json
import os
import re
import shutil
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import prefork
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _format


def _tree():
    return {
        "w": jnp.arange(24.0).reshape(6, 4),
        "n": np.arange(5, dtype=np.int16),
        "bf": jnp.linspace(0, 1, 3).astype(jnp.bfloat16),
        "key": jax.random.key(3),
        "s": 2.5,
        "fn": jnp.tanh,
    }


def test_lazy_leaves_know_their_metadata(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    w = lazy["w"]
    assert isinstance(w, eqx_ckpt.LazyArray)
    assert w.shape == (6, 4) and w.ndim == 2 and w.size == 24 and len(w) == 6
    assert w.dtype == np.float32
    assert w.nbytes == 24 * 4
    assert w.path == "w"
    assert lazy["bf"].dtype == jnp.bfloat16
    assert lazy["n"].nbytes == 10
    assert lazy["fn"] is jnp.tanh
    np.testing.assert_array_equal(np.asarray(w), np.asarray(tree["w"]))
    np.testing.assert_array_equal(w[1:3, 2], np.asarray(tree["w"])[1:3, 2])
    assert np.asarray(lazy["bf"]).dtype == jnp.bfloat16


def test_materialise_gives_the_eager_result(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    like = eqx.filter_eval_shape(lambda: {k: v for k, v in tree.items() if k != "n"})
    like["n"] = np.zeros(5, np.int16)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, lazy=True)
    eager = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    materialised = eqx_ckpt.materialise(lazy)
    assert tree_equal(materialised, eager, typematch=True)
    assert tree_equal(materialised, tree, typematch=True)
    assert type(materialised["n"]) is np.ndarray
    assert isinstance(materialised["w"], jax.Array)


def test_lazy_read_honours_cast(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.arange(3, dtype=jnp.int32)})
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(3)}, lazy=True, cast=True)
    assert tree_equal(eqx_ckpt.materialise(lazy), {"x": jnp.arange(3.0)}, typematch=True)


@pytest.mark.usefixtures("unpacked")  # a leaf of several chunks (a packed leaf is read whole)
def test_slicing_reads_only_that_region(tmp_path, monkeypatch):
    # 32-byte chunks: an (8, 4) float32 array is four chunks of two rows.
    monkeypatch.setattr(_format, "CHUNK_BYTES", 32)
    x = jnp.arange(32.0).reshape(8, 4)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    monkeypatch.undo()
    record = eqx_ckpt.Checkpoint(tmp_path).record("x")
    assert record.chunks == (2, 4)
    chunk_files = sorted(p for p in (tmp_path / "x").rglob("*") if p.is_file() and p.name != "zarr.json")
    assert len(chunk_files) == 4
    # Remove the chunk of rows 6 and 7.
    (tmp_path / "x" / "c" / "3" / "0").unlink()

    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros((8, 4))}, lazy=True)["x"]
    np.testing.assert_array_equal(lazy[0:6], np.asarray(x)[0:6])
    np.testing.assert_array_equal(lazy[2], np.asarray(x)[2])
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`x`")):
        np.asarray(lazy)
    with pytest.raises(eqx_ckpt.IntegrityError):
        lazy[5:7]
    with pytest.raises(eqx_ckpt.IntegrityError):
        eqx_ckpt.materialise({"x": lazy})
    with pytest.raises(eqx_ckpt.IntegrityError):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros((8, 4))})


def test_lazy_prng_key_slicing(tmp_path):
    keys = jax.random.split(jax.random.key(0), 4)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"k": keys})
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"k": keys}, lazy=True)["k"]
    assert lazy.shape == (4,)
    np.testing.assert_array_equal(lazy[1:3], np.asarray(jax.random.key_data(keys))[1:3])
    assert tree_equal(lazy.read(), keys, typematch=True)


def test_lazy_array_is_not_an_array(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.ones(3)})
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(3)}, lazy=True)
    assert not eqx.is_array(lazy["x"])
    assert eqx.filter(lazy, eqx.is_array)["x"] is None
    with pytest.raises(TypeError):
        jax.jit(lambda t: t["x"] + 1)(lazy)
    with pytest.raises(TypeError):
        hash(lazy["x"])


def test_a_lazy_tree_passed_to_filter_jit_says_to_materialise_it(tmp_path):
    """Issue 59, item 13: `eqx.filter_jit` of a lazy tree failed with JAX's
    "Non-hashable static arguments are not supported" alone."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.ones(3)})
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"x": jnp.zeros(3)}, lazy=True)
    advice = "Read the lazy leaves first: `tree = eqx_ckpt.materialise(tree)`, then pass `tree`."
    with pytest.raises(ValueError, match=re.escape(advice)) as raised:
        eqx.filter_jit(lambda t: t["x"] + 1)(lazy)
    assert "A LazyArray (leaf 'x', not read yet) is not a JAX array" in str(raised.value)
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape(advice)):
        hash(lazy["x"])
    assert eqx.filter_jit(lambda t: t["x"] + 1)(eqx_ckpt.materialise(lazy)).tolist() == [2.0, 2.0, 2.0]


def test_lazy_load_reads_no_data_until_asked(tmp_path, packing):
    # Two dtypes, so that packed, `a` and `b` are in packs of their own too.
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(3), "b": jnp.zeros(2, jnp.int32)})
    for chunk in (tmp_path / ("a" if packing == "unpacked" else "packed.float32")).rglob("*"):
        if chunk.is_file() and chunk.name != "zarr.json":
            chunk.unlink()
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.zeros(3), "b": jnp.ones(2, jnp.int32)}, lazy=True)
    np.testing.assert_array_equal(np.asarray(lazy["b"]), np.zeros(2, np.int32))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`a`")):
        lazy["a"].read()


def test_materialise_keeps_non_lazy_leaves():
    tree = {"a": jnp.ones(2), "b": "text", "c": None}
    out = eqx_ckpt.materialise(tree)
    assert out["a"] is tree["a"] and out["b"] == "text" and out["c"] is None


@pytest.mark.parametrize(
    "index",
    [
        np.s_[-1],
        np.s_[-2:],
        np.s_[1:100],
        np.s_[::-1],
        np.s_[::2, -3],
        np.s_[4:1],
        np.s_[4:1:-1],
        np.s_[..., -1],
        np.s_[None, 1, ...],
        np.s_[np.int64(-2), :],
        (),
    ],
)
def test_slicing_follows_numpy(tmp_path, index):
    x = np.arange(30, dtype=np.int32).reshape(6, 5)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    got = eqx_ckpt.Checkpoint(tmp_path)["x"][index]
    assert got.shape == x[index].shape
    np.testing.assert_array_equal(got, x[index])


@pytest.mark.parametrize("index", [np.s_[6], np.s_[-7], np.s_[0, 0, 0], np.s_[..., 0, ...]])
def test_out_of_bounds_index_is_an_index_error(tmp_path, index):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.zeros((6, 5))})
    with pytest.raises(IndexError):
        eqx_ckpt.Checkpoint(tmp_path)["x"][index]


@pytest.mark.parametrize(
    "index",
    [
        np.s_[[0, -1, 2]],
        np.s_[[-1, -2], 1:3],
        np.s_[np.array([True, False, True, False, False, True])],
        np.s_[np.arange(30).reshape(6, 5) % 3 == 0],
        np.s_[:, [4, -5]],
        np.s_[np.array([[0, 1], [-1, -2]])],
    ],
)
def test_advanced_indices_follow_numpy(tmp_path, index):
    x = np.arange(30, dtype=np.int32).reshape(6, 5)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": x})
    got = eqx_ckpt.Checkpoint(tmp_path)["x"][index]
    np.testing.assert_array_equal(got, x[index])
    assert got.shape == x[index].shape


@pytest.mark.parametrize("index", [1.0, "a", np.s_[0, 1.5], np.s_[{}]])
def test_invalid_indices_are_index_errors_not_damage(tmp_path, index):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": np.zeros((6, 5))})
    with pytest.raises(IndexError, match=re.escape("are valid indices of a LazyArray")):
        eqx_ckpt.Checkpoint(tmp_path)["x"][index]
    with pytest.raises(TypeError):
        eqx_ckpt.Checkpoint(tmp_path)["x"][0.5:2]


def test_read_without_like_gives_the_saved_type(tmp_path):
    tree = {"n": np.arange(3), "j": jnp.arange(3.0), "k": jax.random.key(0, impl="rbg")}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    got = {key: ckpt[key].read() for key in tree}
    assert type(got["n"]) is np.ndarray
    assert tree_equal(got["n"], tree["n"], typematch=True)
    assert tree_equal(got["j"], tree["j"], typematch=True)
    assert jax.random.key_impl(got["k"]) == jax.random.key_impl(tree["k"])
    assert jnp.array_equal(jax.random.key_data(got["k"]), jax.random.key_data(tree["k"]))


def test_lazy_read_keeps_the_weak_type_of_like(tmp_path):
    like = {"scale": jnp.asarray(2.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, like)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"scale": jnp.zeros(3)[0] + 1.0}, lazy=True)
    assert not eqx_ckpt.materialise(lazy)["scale"].weak_type
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, lazy=True)
    loaded = eqx_ckpt.materialise(lazy)
    assert loaded["scale"].weak_type
    assert tree_equal(loaded, like, typematch=True)


@pytest.mark.parametrize("index", [np.s_[:: 10**20], np.s_[:, :: -(10**20)], np.s_[1 :: 2**63], np.s_[:: -(2**63)]])
def test_a_step_longer_than_the_axis_reads_as_numpy_does(tmp_path, index):
    # A step beyond int64 once reached TensorStore and read as "damaged".
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.arange(12.0).reshape(3, 4)})
    reference = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(eqx_ckpt.Checkpoint(tmp_path)["w"][index], reference[index])


def test_a_leaf_loaded_with_cast_reads_as_its_like_dtype_in_every_way(tmp_path):
    """A lazy leaf loaded into a bfloat16 `like` with `cast=True` said `dtype`
    float32 and sliced as float32 while `read()` gave bfloat16, so exporting the
    lazy tree and exporting `materialise(lazy)` wrote different files."""
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"w": jnp.arange(6.0) + 0.001, "i": jnp.arange(3), "big": np.full(2, 1e6)})
    like = {
        "w": jax.ShapeDtypeStruct((6,), jnp.bfloat16),
        "i": jax.ShapeDtypeStruct((3,), jnp.float32),
        "big": np.zeros(2, np.float16),
    }
    lazy = eqx_ckpt.tree_deserialise_leaves(path, like, cast=True, lazy=True)
    eager = {k: v for k, v in eqx_ckpt.materialise({k: lazy[k] for k in ("w", "i")}).items()}
    for name in ("w", "i"):
        assert lazy[name].dtype == like[name].dtype == eager[name].dtype
        region = lazy[name][1:3]
        assert region.dtype == like[name].dtype
        np.testing.assert_array_equal(region, np.asarray(eager[name])[1:3])
        assert np.asarray(lazy[name]).dtype == like[name].dtype
    exported = tmp_path / "export.safetensors"
    eqx_ckpt.export_safetensors(exported, {k: lazy[k] for k in ("w", "i")})
    assert {k: v.dtype for k, v in eqx_ckpt.Checkpoint(exported).items()} == {"i": np.float32, "w": jnp.bfloat16}
    # A value the like's dtype cannot hold is an error from a slice too, as from a load.
    assert lazy["big"].dtype == np.float16
    with pytest.raises(eqx_ckpt.LeafError, match="cannot convert it from float64 to float16"):
        lazy["big"][:1]


_SAVE_X64 = """
import sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import eqx_ckpt
tree = {"f": jnp.array([1 / 3]), "i": jnp.array([2**40 + 5]), "s": jnp.float32(2.5)}
eqx_ckpt.tree_serialise_leaves(sys.argv[1], tree)
"""

_LOAD_X64 = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import eqx_ckpt
like = {"f": jnp.zeros(1), "i": jnp.zeros(1, jnp.int64), "s": jnp.float32(0)}
loaded = {}
for path in sys.argv[1:]:
    out = eqx_ckpt.tree_deserialise_leaves(path, like)
    loaded[path] = {k: [type(v).__name__, str(v.dtype), v.tolist()] for k, v in out.items()}
print(json.dumps(loaded))
"""


def _x64_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args`, forked from a template that imported JAX (`prefork`):
    the code turns JAX's 64-bit mode on as its first step, as a new process would."""
    return prefork.run(["-c", code, *args], env=dict(os.environ), timeout=120)


@pytest.fixture(scope="module")
def x64_checkpoint(tmp_path_factory):
    """A checkpoint of 64-bit JAX leaves, saved once by a process in JAX's 64-bit mode (tests copy it)."""
    path = tmp_path_factory.mktemp("x64") / "source"
    done = _x64_python(_SAVE_X64, str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    return path


@pytest.mark.skipif(jax.config.read("jax_enable_x64"), reason="about a process without JAX's 64-bit mode")
@pytest.mark.parametrize("opened", ["checkpoint", "lazy-load"])
def test_a_lazy_checkpoint_of_64_bit_jax_leaves_saves_again_without_x64(tmp_path, opened, x64_checkpoint):
    """Saving a lazily opened checkpoint is a copy: 64-bit JAX leaves, which this
    process cannot hold as JAX arrays, were refused with the x64 error. They
    are written as their exact host values, recorded as JAX leaves, also back
    onto the checkpoint itself. (The checkpoint is saved once, in a 64-bit
    process, and copied for each test; both copies are loaded in one 64-bit
    process at the end.)"""
    source = tmp_path / "source"
    shutil.copytree(x64_checkpoint, source)
    for destination in (tmp_path / "copy", source):
        if opened == "checkpoint":
            tree = dict(eqx_ckpt.Checkpoint(source).items())
        else:
            like = {k: jax.ShapeDtypeStruct((1,), t) for k, t in (("f", np.float64), ("i", np.int64))}
            like["s"] = jax.ShapeDtypeStruct((), jnp.float32)
            tree = eqx_ckpt.tree_deserialise_leaves(source, like, lazy=True)
        eqx_ckpt.tree_serialise_leaves(destination, tree)
        saved = eqx_ckpt.Checkpoint(destination)
        assert {k: (saved.record(k).type, saved.record(k).dtype) for k in saved} == {
            "f": ("jax", "float64"),
            "i": ("jax", "int64"),
            "s": ("jax", "float32"),
        }, destination
        host = saved.load()
        assert host["i"].tolist() == [2**40 + 5] and host["f"].tolist() == [1 / 3], destination
    destinations = [str(tmp_path / "copy"), str(source)]
    done = _x64_python(_LOAD_X64, *destinations)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    for destination in destinations:
        assert loaded[destination] == {
            "f": ["ArrayImpl", "float64", [1 / 3]],
            "i": ["ArrayImpl", "int64", [2**40 + 5]],
            "s": ["ArrayImpl", "float32", 2.5],
        }, destination


@pytest.mark.parametrize("how", ["read", "asarray", "materialise"])
def test_a_lazy_leaf_is_read_by_the_loads_reader(tmp_path, faults, how):
    """A lazy leaf's whole read goes through the reader every load uses
    (`load.read_stored`, then its checkpoint checked): a large leaf on a local
    disk is read straight from its chunk files (`local_read.start_reads`),
    not through TensorStore's read of the array."""
    tree = {"big": np.arange(2**19, dtype=np.float32).reshape(512, 1024), "small": jnp.arange(4.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    events = []
    faults("load.read_stored", lambda loc: events.append("read_stored"))
    faults("local_read.start_reads", lambda path, keys: events.append(f"direct {path}"))
    if how == "read":
        value = lazy["big"].read()
    elif how == "asarray":
        value = np.asarray(lazy["big"])
    else:
        value = eqx_ckpt.materialise({"big": lazy["big"]})["big"]
    assert tree_equal(value, tree["big"], typematch=True)
    assert any(e.startswith("direct ") for e in events), events
    assert events[0] == "read_stored", events  # (`materialise` too, since it reads through `read_leaves`)


@pytest.mark.parametrize("how", ["read", "asarray"])
def test_a_lazily_read_packed_leaf_is_read_from_its_pack_by_the_pack_reader(tmp_path, faults, how):
    """A packed lazy leaf is read as a load reads packed leaves: by the pack
    reader, a run of its pack that holds it alone (`pack.read_run`); it was
    read by an open of its own (`_storage.open_packed`)."""
    tree = {"a": jnp.arange(6.0), "b": np.arange(3, dtype=np.int32), "c": jnp.ones(5)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert all(eqx_ckpt.Checkpoint(tmp_path).record(key).pack is not None for key in tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    runs = []
    faults("pack.read_run", lambda loc, pack, paths: runs.append(paths))
    for key in ("a", "b"):
        value = lazy[key].read() if how == "read" else np.asarray(lazy[key])
        assert tree_equal(value, tree[key] if how == "read" else np.asarray(tree[key]), typematch=True)
    assert runs == [["a"], ["b"]]


def test_materialise_reads_by_the_loads_reader_once_per_checkpoint(tmp_path, faults):
    """`materialise` reads the lazy leaves of each checkpoint it reads from as
    a load reads them (`load.read_stored`: the one reader of stored leaves),
    once per checkpoint whatever its number of leaves, its progress counting
    every leaf and byte of them all. (It read them with the reader's inner
    function, without the point.)"""
    tree = {"big": np.arange(2**19, dtype=np.float32).reshape(512, 1024), "small": jnp.arange(4.0), "w": jnp.ones(3)}
    other = jax.tree.map(lambda x: x + 1, tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", other)
    lazy = {
        "a": eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", tree, lazy=True),
        "b": eqx_ckpt.tree_deserialise_leaves(tmp_path / "b", other, lazy=True),
    }
    reads, calls = [], []
    faults(["load.read_stored"], lambda loc: reads.append(loc.display))
    back = eqx_ckpt.materialise(lazy, progress=lambda *counts: calls.append(counts))
    assert tree_equal(back, {"a": tree, "b": other}, typematch=True)
    assert sorted(reads) == [str(tmp_path / "a"), str(tmp_path / "b")]
    nbytes = 2 * sum(x.nbytes for x in jax.tree.leaves(tree))
    assert calls[-1] == (6, 6, nbytes, nbytes)


def test_a_script_that_keeps_lazy_leaves_to_its_end_exits_without_a_word(tmp_path):
    """A lazy leaf a script holds until it ends dies as the interpreter exits,
    after eqx_ckpt's modules are emptied: its finaliser printed a traceback
    (`AttributeError: 'NoneType' object has no attribute 'pop'`) on every
    such run. A fresh interpreter, as the exit is what is tested."""
    script = tmp_path / "script.py"
    script.write_text(
        "import jax.numpy as jnp, eqx_ckpt\n"
        f"eqx_ckpt.tree_serialise_leaves({str(tmp_path / 'c')!r}, {{'w': jnp.ones((3, 3)), 'b': jnp.zeros(4)}})\n"
        f"tree = eqx_ckpt.Checkpoint({str(tmp_path / 'c')!r}).load(lazy=True)\n"
        f"leaf = eqx_ckpt.Checkpoint({str(tmp_path / 'c')!r})['w']\n"
        "print(type(leaf).__name__, type(tree['b']).__name__)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "LazyArray LazyArray\n", "")
