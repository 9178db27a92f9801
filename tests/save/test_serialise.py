"""`tree_serialise_leaves`: on-disk layout, where it may write, filter specs."""

import collections
import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal
from disk import snapshot

import eqx_ckpt


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))


def _open(directory):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(directory)}}).result()


def test_layout_one_zarr_array_per_leaf(tmp_path, unpacked):
    tree = {"model": _mlp(), "step": 3}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert (tmp_path / "manifest.json").is_file()
    assert (tmp_path / "model" / "layers" / "0" / "weight" / "zarr.json").is_file()
    assert (tmp_path / "model" / "layers" / "1" / "bias" / "zarr.json").is_file()
    assert (tmp_path / "step" / "zarr.json").is_file()
    weight = tree["model"].layers[0].weight
    array = _open(tmp_path / "model" / "layers" / "0" / "weight")
    assert array.shape == weight.shape
    np.testing.assert_array_equal(array.read().result(), np.asarray(weight))
    assert _open(tmp_path / "step").read().result() == 3


def test_every_array_folder_opens_with_plain_tensorstore(tmp_path, unpacked):
    model = _mlp()
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array)):
        directory = tmp_path.joinpath(*[str(getattr(k, "name", getattr(k, "idx", None))) for k in keypath])
        np.testing.assert_array_equal(_open(directory).read().result(), np.asarray(leaf))


def test_group_metadata_above_every_leaf(tmp_path, unpacked):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": _mlp()})
    for group in (tmp_path, tmp_path / "model", tmp_path / "model" / "layers", tmp_path / "model" / "layers" / "0"):
        meta = json.loads((group / "zarr.json").read_text())
        assert meta["zarr_format"] == 3
        assert meta["node_type"] == "group"
    leaf_meta = json.loads((tmp_path / "model" / "layers" / "0" / "weight" / "zarr.json").read_text())
    assert leaf_meta["node_type"] == "array"
    assert [c["name"] for c in leaf_meta["codecs"]] == ["bytes", "crc32c"]


def test_saving_into_an_existing_empty_directory(tmp_path):
    assert tmp_path.is_dir() and os.listdir(tmp_path) == []
    tree = {"a": jnp.arange(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_saving_creates_missing_parents(tmp_path):
    path = tmp_path / "a" / "b" / "ckpt"
    eqx_ckpt.tree_serialise_leaves(str(path), {"x": 1.5})
    assert eqx_ckpt.tree_deserialise_leaves(str(path), {"x": 0.0}) == {"x": 1.5}


def test_non_checkpoint_directory_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = snapshot(tmp_path)
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match="not an eqx_ckpt checkpoint"):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2)})
    assert snapshot(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "sub"]


def test_directory_with_a_stray_folder_named_like_a_leaf_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep.txt").write_text("mine")
    with pytest.raises(eqx_ckpt.CheckpointExistsError):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(2)})
    assert (tmp_path / "a" / "keep.txt").read_text() == "mine"


def test_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "model.eqx"
    target.write_bytes(b"not a checkpoint")
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match="is a file"):
        eqx_ckpt.tree_serialise_leaves(target, {"a": jnp.zeros(2)})
    assert target.read_bytes() == b"not a checkpoint"


def test_file_object_is_a_type_error_saying_what_to_pass(tmp_path):
    with open(tmp_path / "model.eqx", "wb") as f:
        with pytest.raises(eqx_ckpt.CheckpointTypeError, match="pass the directory's path") as info:
            eqx_ckpt.tree_serialise_leaves(f, {"a": jnp.zeros(2)})
    assert isinstance(info.value, TypeError)
    with open(tmp_path / "model.eqx", "rb") as f:
        with pytest.raises(TypeError, match="not a file object"):
            eqx_ckpt.tree_deserialise_leaves(f, {"a": jnp.zeros(2)})


def test_non_path_argument_is_a_type_error(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match="must be a `str`"):
        eqx_ckpt.tree_serialise_leaves(123, {"a": jnp.zeros(2)})


def test_overwrite_false_refuses_and_keeps_the_old_checkpoint(tmp_path):
    old = {"a": jnp.arange(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match="overwrite=False"):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.arange(3) + 1}, overwrite=False)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([object(), 1], dtype=object), "cannot save an array of dtype object"),
        (2**70, "does not fit in int64"),
        (np.array(["a", "b"]), "cannot save an array of dtype <U1"),
    ],
)
def test_bad_leaf_leaves_existing_checkpoint_untouched(tmp_path, bad, message):
    old = {"a": jnp.arange(3), "b": np.float32(2.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, old)
    before = snapshot(tmp_path)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.arange(3) + 1, "b": bad})
    assert "['b']" in str(info.value)
    assert "(DictKey(key='b'),)" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert snapshot(tmp_path) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, old), old, typematch=True)


def test_custom_filter_spec_callable(tmp_path):
    def spec(handle, x):
        # Store only the NumPy leaves; record what the handle knows.
        seen.append(handle.path)
        if isinstance(x, np.ndarray):
            handle.write(x)

    seen = []
    tree = {"j": jnp.ones(2), "n": np.arange(3), "s": 1.0}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, spec)
    assert seen == ["j", "n", "s"]
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["n"]


def test_custom_filter_spec_pytree_prefix(tmp_path):
    skip = lambda handle, x: None
    tree = {"keep": {"a": jnp.ones(2), "b": 2}, "skip": {"c": jnp.zeros(3)}}
    spec = {"keep": eqx_ckpt.default_serialise_filter_spec, "skip": skip}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, spec)
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["keep.a", "keep.b"]
    assert not (tmp_path / "skip").exists()


def test_filter_spec_can_store_a_transformed_value(tmp_path):
    spec = lambda handle, x: handle.write(x * 2)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.arange(3)}, spec)
    np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(tmp_path)["a"]), [0, 2, 4])


def test_filter_spec_error_names_the_leaf(tmp_path):
    def spec(handle, x):
        raise ValueError("nope")

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("(DictKey(key='a'),)")) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(1)}, spec)
    assert "ValueError: nope" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_is_leaf_stores_a_node_as_one_leaf(tmp_path):
    class Pair(eqx.Module):
        a: jax.Array
        b: jax.Array

    tree = {"p": Pair(jnp.ones(2), jnp.zeros(2))}
    is_pair = lambda x: isinstance(x, Pair)

    def spec(handle, x):
        if isinstance(x, Pair):
            handle.write(jnp.stack([x.a, x.b]))

    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, spec, is_leaf=is_pair)
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["p"]
    assert eqx_ckpt.Checkpoint(tmp_path)["p"].shape == (2, 2)

    def load(handle, x):
        both = handle.read(jax.ShapeDtypeStruct((2, 2), jnp.float32))
        return Pair(both[0], both[1])

    like = {"p": Pair(jnp.zeros(2), jnp.zeros(2))}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, load, is_leaf=is_pair)
    assert tree_equal(loaded, tree, typematch=True)


def test_int_and_str_keys_side_by_side(tmp_path):
    tree = collections.OrderedDict([("a", jnp.zeros(1)), (0, jnp.ones(1)), ("0", jnp.full(1, 2.0))])
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["%i0", "0", "a"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


class _SameRepr:
    def __repr__(self):
        return "same"


def test_keys_stored_at_the_same_path_are_refused(tmp_path):
    # Two distinct non-string keys with one repr would share a folder.
    first, second = _SameRepr(), _SameRepr()
    tree = collections.OrderedDict([(first, jnp.zeros(1)), (second, jnp.ones(1))])
    with pytest.raises(eqx_ckpt.LeafError, match="would be stored at the same place as the leaf at key path"):
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert os.listdir(tmp_path) == []


def test_empty_tree_saves_and_loads(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {})
    assert len(eqx_ckpt.Checkpoint(tmp_path)) == 0
    assert eqx_ckpt.tree_deserialise_leaves(tmp_path, {}) == {}


def test_root_leaf(tmp_path):
    x = jnp.arange(4.0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, x)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, jnp.zeros(4)), x, typematch=True)


def test_kvstore_url_round_trip(tmp_path, unpacked):
    tree = {"model": _mlp(), "step": 4}
    url = f"memory://{tmp_path.name}/ckpt/"
    eqx_ckpt.tree_serialise_leaves(url, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(url, eqx.filter_eval_shape(lambda: tree))
    assert tree_equal(loaded, tree, typematch=True)
    assert "model.layers.0.weight" in eqx_ckpt.Checkpoint(url)
    file_url = (tmp_path / "on_disk").as_uri()
    eqx_ckpt.tree_serialise_leaves(file_url, tree)
    assert (tmp_path / "on_disk" / "model" / "layers" / "0" / "weight" / "zarr.json").is_file()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "on_disk", tree), tree, typematch=True)


def test_a_lazily_loaded_tree_saved_back_keeps_every_value(tmp_path):
    # Lazy leaves were once skipped by the default filter spec, so saving back a
    # lazily loaded tree replaced a whole checkpoint with its few eager leaves.
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}, "step": 7}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree, lazy=True)
    assert isinstance(lazy["w"], eqx_ckpt.LazyArray)
    lazy["step"] = 8
    eqx_ckpt.tree_serialise_leaves(tmp_path / "copy", lazy)  # elsewhere
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", lazy)  # and over the checkpoint it comes from
    # That replaced its source: the lazy tree says so instead of reading the new save.
    with pytest.raises(eqx_ckpt.CheckpointReplacedError):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "again", lazy)
    expected = {**tree, "step": 8}
    for path in ("ckpt", "copy"):
        assert sorted(eqx_ckpt.Checkpoint(tmp_path / path)) == ["b.c", "step", "w"]
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / path, tree)
        assert tree_equal(loaded, expected, typematch=True)


def test_an_abstract_tree_is_refused_not_saved_empty(tmp_path):
    make = lambda: eqx.nn.Linear(2, 3, key=jax.random.key(0))
    skeleton = eqx.filter_eval_shape(make)
    eqx_ckpt.tree_serialise_leaves(tmp_path, make())
    message = "Error at leaf with path (GetAttrKey(name='weight'),): leaf `weight` (key path .weight) in checkpoint"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message) + ".*it is abstract") as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, skeleton)
    assert "filter_eval_shape" in str(info.value)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, skeleton), make(), typematch=True)


def test_a_store_that_cannot_list_is_refused_clearly():
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("is on a store that cannot list its keys")):
        eqx_ckpt.tree_serialise_leaves("http://127.0.0.1:9/ckpt/", {"w": jnp.ones(2)})


def test_rank_beyond_zarr_is_refused_naming_the_leaf(tmp_path):
    tree = {"ok": np.zeros(2), "deep": np.zeros((1,) * 33)}
    message = "Error at leaf with path (DictKey(key='deep'),): leaf `deep`"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert "it has 33 dimensions; a zarr v3 array (TensorStore) has at most 32" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_saving_inside_jit_is_a_clear_error(tmp_path):
    @jax.jit
    def step(x):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": x})
        return x

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("it is a traced value: a save inside `jax.jit`")):
        step(jnp.ones(2))
    assert list(tmp_path.iterdir()) == []


def test_a_filter_spec_that_writes_a_leaf_twice_is_an_error_and_nothing_is_written(tmp_path):
    """Once, both values were committed and the checkpoint (listing the leaf
    twice) could be neither loaded nor overwritten."""

    def twice(handle, x):
        handle.write(x)
        handle.write(x + 1)

    path = tmp_path / "ckpt"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("the filter spec wrote it twice")) as info:
        eqx_ckpt.tree_serialise_leaves(path, {"y": np.ones(1)}, filter_spec=twice)
    assert info.value.dotted == ("y",)
    assert not path.exists()
    eqx_ckpt.tree_serialise_leaves(path, {"y": np.ones(1)})
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, {"y": np.zeros(1)}), {"y": np.ones(1)})


@pytest.mark.parametrize("blocking", [True, False])
def test_a_deleted_array_is_an_error_naming_the_leaf(tmp_path, blocking):
    donated = jnp.ones(3)
    jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
    assert donated.is_deleted()
    tree = {"ok": jnp.zeros(2), "gone": donated}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `gone` (key path ['gone'])")) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree, blocking=blocking)
    assert "it is a deleted `jax.Array` (deleted, or donated to a function compiled with `donate_argnums`)" in str(
        info.value
    )
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_masked_array_is_refused_not_saved_without_its_mask(tmp_path, blocking):
    masked = np.ma.masked_array([1.0, -999.0, 3.0], mask=[False, True, False])
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("it is a NumPy masked array, whose mask")) as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"m": masked}, blocking=blocking)
    assert info.value.dotted == ("m",)
    assert not (tmp_path / "ckpt").exists()
    # What the message suggests round-trips.
    tree = {"data": masked.data, "mask": np.ma.getmaskarray(masked)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_handle_written_after_the_filter_spec_returned_is_refused(tmp_path, blocking):
    """Once, a filter spec that kept a handle and wrote through it after the call
    returned was not refused: an asynchronous save committed a manifest listing
    that leaf with no array (over a good checkpoint), a blocking one dropped it
    silently. Now the late write is an error, and the save holds what the filter
    spec wrote while it ran."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.zeros(3), "b": np.ones(2)})
    kept = []

    def deferred(handle, x):
        if handle.path == "w":
            handle.write(x)
        else:
            kept.append((handle, x))

    tree = {"w": jnp.ones(3), "b": np.zeros(2)}
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path, tree, deferred, blocking=blocking)
    [(handle, x)] = kept
    message = "`handle.write` was called after the filter spec returned: the save has already begun"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)) as info:
        handle.write(x)
    assert info.value.dotted == ("b",)
    if pending is not None:
        pending.wait()
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["w"]
    assert [r["path"] for r in json.loads((tmp_path / "manifest.json").read_text())["leaves"]] == ["w"]
    assert eqx_ckpt.verify(tmp_path) == []
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(3)})
    assert tree_equal(loaded, {"w": jnp.ones(3)}, typematch=True)


def test_a_filter_spec_finer_than_is_leaf_is_a_clear_error(tmp_path):
    """Once a bare `ValueError` from inside the library (`zip()` of specs and leaves)."""
    spec = eqx_ckpt.default_serialise_filter_spec
    tree = {"a": [jnp.ones(1), jnp.ones(2)], "b": jnp.zeros(3)}
    is_list = lambda node: isinstance(node, list)
    message = "`filter_spec` reaches inside a node that `is_leaf` makes one leaf of `pytree`: it gives 3 filter specs"
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree, {"a": [spec, spec], "b": spec}, is_leaf=is_list)
    assert not (tmp_path / "ckpt").exists()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    load = eqx_ckpt.default_deserialise_filter_spec
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`is_leaf` makes one leaf of `like`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree, {"a": [load, load], "b": load}, is_leaf=is_list)


def test_a_leaf_path_longer_than_the_system_allows_names_the_leaf(tmp_path, unpacked):
    """Once TensorStore's message of 15 kB ("Error reading local file", its whole
    spec), naming no leaf. Nothing is written, and the old checkpoint stays."""
    tree = np.arange(4, dtype=np.float32)
    for i in range(25):
        tree = {chr(97 + i) * 190: tree}  # a folder path of about 4,800 bytes
    dotted = ".".join(chr(97 + i) * 190 for i in reversed(range(25)))
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"x": jnp.ones(2)})
    before = snapshot(path)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("more than the 4095 this system allows (PATH_MAX)")) as info:
        eqx_ckpt.tree_serialise_leaves(path, tree)
    assert info.value.dotted == (dotted,)
    assert 'Save with `layout="ocdbt"`' in str(info.value) and "Error reading local file" not in str(info.value)
    assert snapshot(path) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, {"x": jnp.zeros(2)}), {"x": jnp.ones(2)})
    eqx_ckpt.tree_serialise_leaves(path, tree, layout="ocdbt")
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, tree), tree, typematch=True)


class _Tag:
    """A dict key whose repr is the same for every value."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return "Tag"

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return isinstance(other, _Tag) and other.value == self.value

    def __lt__(self, other):
        return self.value < other.value


def test_keys_of_one_type_with_the_same_repr_are_said_to_be_so(tmp_path):
    """They were said to have "different types but the same name"."""
    message = "their keys are two different _Tag objects with the same repr (Tag)"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(message)):
        eqx_ckpt.tree_serialise_leaves(tmp_path, {_Tag(1): jnp.ones(1), _Tag(2): jnp.zeros(1)})
    assert list(tmp_path.iterdir()) == []


def test_a_broken_symbolic_link_is_named_so(tmp_path):
    """It was called "a file, not a directory"."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("link' is a broken symbolic link (to ")):
        eqx_ckpt.tree_serialise_leaves(str(tmp_path / "link"), {"x": jnp.ones(1)})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("is a broken symbolic link, not a directory")):
        eqx_ckpt.CheckpointManager(tmp_path / "link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"] and (tmp_path / "link").is_symlink()


def test_a_filter_spec_is_given_each_leafs_key_path(tmp_path):
    tree = {"model": [eqx.nn.Linear(2, 2, key=jax.random.key(i)) for i in range(3)], "step": 3, "opt": (jnp.ones(1),)}
    given = []

    def spec(handle, x):
        given.append((handle.keypath, handle.path))
        eqx_ckpt.default_serialise_filter_spec(handle, x)

    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree, spec)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert [keypath for keypath, _ in given] == [keypath for keypath, _ in flat]
    assert given[1] == (flat[1][0], "model.0.bias")


@pytest.mark.parametrize("which", [2, 40])
def test_a_leaf_that_cannot_be_saved_is_named_by_its_key_path(tmp_path, which):
    """Names come from the tree's structure; the key path of a failed leaf is
    found there: by descent, or all at once once many leaves (the floats, each
    given a handle) have asked."""
    tree = {"blocks": [{"w": jnp.full(2, float(i)), "p": 0.5} for i in range(30)]}
    tree["blocks"][which // 2]["w"].delete()
    with pytest.raises(eqx_ckpt.LeafError, match=rf"blocks\.{which // 2}\.w.*deleted") as info:
        eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree)
    keys = jax.tree_util
    assert list(info.value.keypaths) == [(keys.DictKey("blocks"), keys.SequenceKey(which // 2), keys.DictKey("w"))]
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("below", ["ckpt", "run/ckpt"])
def test_a_file_where_a_folder_of_the_path_should_be_is_named(tmp_path, below):
    """It said "Cannot write '.'", naming neither the file nor the folder."""
    (tmp_path / "notes.txt").write_text("mine")
    path = tmp_path / "notes.txt" / below
    expected = f"{str(tmp_path / 'notes.txt')!r} is a file, not a folder, so nothing was written"
    with pytest.raises(eqx_ckpt.CheckpointError, match=re.escape(expected)):
        eqx_ckpt.tree_serialise_leaves(path, {"w": np.ones(2, np.float32)})
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
