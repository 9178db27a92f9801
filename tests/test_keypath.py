"""Key paths -> directory names: escaping is injective and never leaves the checkpoint."""

import collections
import enum
import os
import pathlib

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.random import key as jax_key

import eqx_ckpt
from eqx_ckpt import _keypath

AWKWARD_KEYS = [
    "a.b",
    "a/b",
    "a%2Eb",
    "%",
    "%e",
    "%i0",
    "with space",
    "ünï©ødé",
    "日本",
    "",
    ".",
    "..",
    "../..",
    "/abs",
    "0",
]


def _files_under(root: pathlib.Path) -> list[pathlib.Path]:
    return [pathlib.Path(d) / f for d, _, files in os.walk(root) for f in files]


def test_escape_keeps_safe_characters_and_encodes_the_rest():
    assert _keypath.escape("layer_1-a") == "layer_1-a"
    assert _keypath.escape("a.b") == "a%2Eb"
    assert _keypath.escape("a/b") == "a%2Fb"
    assert _keypath.escape("%") == "%25"
    assert _keypath.escape("") == "%e"
    assert _keypath.escape("é") == "%C3%A9"


def test_escape_is_injective_on_awkward_keys():
    escaped = [_keypath.escape(k) for k in AWKWARD_KEYS]
    assert len(set(escaped)) == len(AWKWARD_KEYS)
    for segment in escaped:
        assert "." not in segment and "/" not in segment
        assert segment not in ("", ".", "..")


def test_segments_of_every_key_kind():
    keypath = (jtu.GetAttrKey("layers"), jtu.SequenceKey(3), jtu.DictKey("w.x"), jtu.DictKey(7), jtu.DictKey((1, 2)))
    assert _keypath.dotted(keypath) == "layers.3.w%2Ex.%i7.%r%281%2C%202%29"
    assert _keypath.to_directory(_keypath.dotted(keypath)) == "layers/3/w%2Ex/%i7/%r%281%2C%202%29"


def test_int_key_and_string_key_differ():
    assert _keypath.segment(jtu.DictKey(0)) != _keypath.segment(jtu.DictKey("0"))
    assert _keypath.segment(jtu.DictKey(-1)) != _keypath.segment(jtu.DictKey("-1"))


@pytest.mark.parametrize("order", ["int first", "equal keys first"])
def test_equal_keys_of_other_types_keep_their_own_segments(order):
    """Segments are remembered by key; `True`, `1.0`, `np.int64(1)` equal `1` as
    dict keys, and each must still get its own segment, whichever came first."""
    keys = [jtu.DictKey(1), jtu.DictKey(True), jtu.DictKey(1.0), jtu.DictKey(np.int64(1)), jtu.SequenceKey(1)]
    expected = {0: "%i1", 1: "%rTrue", 2: "%r1%2E0", 3: "%i1", 4: "1"}
    indices = list(range(len(keys))) if order == "int first" else list(reversed(range(len(keys))))
    records = {0: ["key_int", 1], 1: ["key_repr", "True"], 2: ["key_repr", "1.0"], 3: ["key_int", 1], 4: ["index", 1]}
    for _ in range(2):  # computed, then remembered
        assert {i: _keypath.segment(keys[i]) for i in indices} == expected
        assert {i: _keypath.to_json((keys[i],))[0] for i in indices} == records


def test_named_gives_each_key_path_its_dotted_path_and_record():
    """`named` names each key object once per tree; what it gives is what
    `dotted` and `to_json` give, key path by key path, for every kind of key."""
    keys = [jtu.DictKey(1), jtu.DictKey(True), jtu.DictKey(1.0), jtu.DictKey(np.int64(1)), jtu.SequenceKey(1)]
    tree = {
        "a.b": [jnp.ones(1), {k: jnp.ones(1) for k in AWKWARD_KEYS[:8]}],
        "n": {1: {True: 2.0}},
        "m": eqx.nn.Linear(2, 2, key=jax_key(0)),
    }
    keypaths = [keypath for keypath, _ in jtu.tree_flatten_with_path(tree)[0]]
    keypaths += [(k,) for k in keys]
    dotted, records = _keypath.named(keypaths)
    assert dotted == [_keypath.dotted(k) for k in keypaths]
    assert records == [_keypath.to_json(k) for k in keypaths]


def test_the_key_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(_keypath, "_MEMO_MAX", 10)
    monkeypatch.setattr(_keypath, "_RECORDS", {})
    for i in range(25):
        assert _keypath.segment(jtu.GetAttrKey(f"a{i}")) == f"a{i}"
    assert len(_keypath._RECORDS) <= 10


def test_manifest_record_round_trips_the_key_path():
    keypath = (jtu.GetAttrKey("a"), jtu.SequenceKey(1), jtu.DictKey("k"), jtu.DictKey(5))
    assert _keypath.from_json(_keypath.to_json(keypath)) == keypath


def test_awkward_keys_round_trip_and_stay_inside(tmp_path, packing):
    tree = collections.OrderedDict((key, jnp.full(2, i, dtype=jnp.int32)) for i, key in enumerate(AWKWARD_KEYS))
    tree[0] = jnp.full(2, 100, dtype=jnp.int32)
    tree[-3] = jnp.full(2, 101, dtype=jnp.int32)
    tree[(1, "x")] = jnp.full(2, 102, dtype=jnp.int32)
    ckpt = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(ckpt, tree)

    loaded = eqx_ckpt.tree_deserialise_leaves(ckpt, tree)
    assert eqx.tree_equal(loaded, tree, typematch=True)
    # Every leaf has its own key and (unpacked) array folder: nothing collided.
    keys = list(eqx_ckpt.Checkpoint(ckpt))
    assert len(keys) == len(tree)
    assert len(set(keys)) == len(tree)
    array_dirs = {p.parent for p in _files_under(ckpt) if p.name == "zarr.json"} - {ckpt}
    assert len(array_dirs) == (len(tree) if packing == "unpacked" else 1)  # packed: `packed.int32` alone
    for key in keys:
        np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(ckpt)[key]), np.asarray(tree[_lookup(tree, key)]))
    # Nothing was written outside the checkpoint directory.
    outside = [p for p in _files_under(tmp_path) if not p.resolve().is_relative_to(ckpt.resolve())]
    assert outside == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _lookup(tree, dotted):
    for keypath, _ in jtu.tree_flatten_with_path(tree)[0]:
        if _keypath.dotted(keypath) == dotted:
            return keypath[0].key
    raise AssertionError(dotted)


@pytest.mark.usefixtures("unpacked")  # the folders of keys
def test_nested_dot_keys_do_not_alias_nesting(tmp_path):
    # {"a.b": x} and {"a": {"b": y}} must not share a folder.
    tree = {"a.b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert (tmp_path / "a%2Eb" / "zarr.json").is_file()
    assert (tmp_path / "a" / "b" / "zarr.json").is_file()
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert eqx.tree_equal(loaded, tree, typematch=True)


@pytest.mark.usefixtures("unpacked")  # the folders of keys
def test_keys_longer_than_a_file_name_are_stored(tmp_path):
    long_a, long_b = "x" * 300, "x" * 299 + "y"  # alike for far longer than is kept
    tree = {long_a: jnp.zeros(1), long_b: jnp.ones(1), "é" * 150: jnp.full(1, 2.0), "short": jnp.ones(1)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert eqx.tree_equal(loaded, tree, typematch=True)
    names = [name for name in os.listdir(tmp_path) if name not in ("manifest.json", "zarr.json")]
    assert len(names) == 4 and all(len(name) <= _keypath.MAX_SEGMENT for name in names)
    # The manifest keeps the whole key; the shortened names differ.
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    stored = {ckpt.record(path).keypath[0][1]: path for path in ckpt}
    assert set(stored) == set(tree)
    assert stored[long_a] != stored[long_b] and "%h" in stored[long_a]
    assert eqx_ckpt.verify(tmp_path) == []


def test_int_enum_dict_keys_round_trip(tmp_path):
    # An IntEnum is an int but not exactly one: what the save writes and what the
    # manifest check recomputes must agree on its segment.
    class Colour(enum.IntEnum):
        RED = 1

    tree = {Colour.RED: jnp.ones(2), 2: jnp.zeros(3)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, {Colour.RED: jnp.zeros(2), 2: jnp.ones(3)})
    assert eqx.tree_equal(out, tree, typematch=True)
    assert sorted(eqx_ckpt.Checkpoint(tmp_path)) == ["%i2", "%r" + _keypath.escape(repr(Colour.RED))]


def test_numpy_integer_dict_keys_are_the_int_keys(tmp_path):
    saved = {np.int64(3): jnp.ones(2), np.int32(-1): jnp.zeros(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["%i-1", "%i3"]
    # JAX gives `{3: ...}` and `{np.int64(3): ...}` one treedef; a load takes either.
    like = {3: jnp.zeros(2), -1: jnp.ones(2)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert eqx.tree_equal(loaded, {3: jnp.ones(2), -1: jnp.zeros(2)}, typematch=True)


def test_sort_key_orders_numbers_by_value():
    paths = ["a.10", "a.2", "b", "a.%i-3", "a.x", "a.1.c", "a.1"]
    assert sorted(paths, key=_keypath.sort_key) == ["a.%i-3", "a.1", "a.1.c", "a.2", "a.10", "a.x", "b"]
