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
from arrays import tree_equal
from jax.random import key as jax_key

import eqx_ckpt
from eqx_ckpt._base import _keypath, _state

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
    dotted, records = _keypath.dotted_and_records(keypaths)
    assert dotted == [_keypath.dotted(k) for k in keypaths]
    assert records == [_keypath.to_json(k) for k in keypaths]


def test_the_key_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(_keypath._RECORDS, "bound", 10)
    _state.reset("keypath.records")
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
    assert tree_equal(loaded, tree, typematch=True)
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
    assert tree_equal(loaded, tree, typematch=True)


@pytest.mark.usefixtures("unpacked")  # the folders of keys
def test_keys_longer_than_a_file_name_are_stored(tmp_path):
    long_a, long_b = "x" * 300, "x" * 299 + "y"  # alike for far longer than is kept
    tree = {long_a: jnp.zeros(1), long_b: jnp.ones(1), "é" * 150: jnp.full(1, 2.0), "short": jnp.ones(1)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(loaded, tree, typematch=True)
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
    assert tree_equal(out, tree, typematch=True)
    assert sorted(eqx_ckpt.Checkpoint(tmp_path)) == ["%i2", "%r" + _keypath.escape(repr(Colour.RED))]


def test_numpy_integer_dict_keys_are_the_int_keys(tmp_path):
    saved = {np.int64(3): jnp.ones(2), np.int32(-1): jnp.zeros(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    assert list(eqx_ckpt.Checkpoint(tmp_path)) == ["%i-1", "%i3"]
    # JAX gives `{3: ...}` and `{np.int64(3): ...}` one treedef; a load takes either.
    like = {3: jnp.zeros(2), -1: jnp.ones(2)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert tree_equal(loaded, {3: jnp.ones(2), -1: jnp.zeros(2)}, typematch=True)


def test_sort_key_orders_numbers_by_value():
    paths = ["a.10", "a.2", "b", "a.%i-3", "a.x", "a.1.c", "a.1"]
    assert sorted(paths, key=_keypath.sort_key) == ["a.%i-3", "a.1", "a.1.c", "a.2", "a.10", "a.x", "b"]


def test_sort_key_orders_numbered_names_naturally():
    """`k2` before `k10`, also with several runs of digits and leading zeros; a
    run too long for `int()` still sorts."""
    paths = ["k10", "k2", "k1x10", "k1x9", "k", "k02", "kb", "v1", f"k{'9' * 5000}", "k100"]
    assert sorted(paths, key=_keypath.sort_key) == [
        "k",
        "k1x9",
        "k1x10",
        "k02",
        "k2",
        "k10",
        "k100",
        f"k{'9' * 5000}",
        "kb",
        "v1",
    ]


# Naming a tree from its structure (`_tree.flatten_named`) must give exactly
# what naming it from its key paths gives.

_Moments = collections.namedtuple("_Moments", ["count", "mu", "nu"])


class _Block(eqx.Module):
    w: jnp.ndarray
    b: jnp.ndarray | None
    extra: dict
    act: str = eqx.field(static=True, default="relu")


class _Color(enum.StrEnum):
    RED = "red"


class _StaticTable(eqx.Module):
    w: jnp.ndarray
    table: np.ndarray = eqx.field(static=True)


def _by_key_paths(tree, is_leaf=None):
    flat = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    keypaths = [keypath for keypath, _ in flat]
    dotted, records = _keypath.dotted_and_records(keypaths)
    return [leaf for _, leaf in flat], dotted, records, keypaths


def _check_named_as_by_key_paths(tree, is_leaf=None):
    from eqx_ckpt._base import _tree

    leaves, names = _tree.flatten_named(tree, is_leaf)
    expected_leaves, dotted, records, keypaths = _by_key_paths(tree, is_leaf)
    assert len(leaves) == len(expected_leaves) and all(a is b for a, b in zip(leaves, expected_leaves, strict=True))
    assert names.paths == dotted
    assert names.records == records
    assert [names.keypath(i) for i in range(len(leaves))] == keypaths
    # Every key of the same type as JAX's (`1` and `np.int64(1)` are one key to JAX, not to `is`).
    for i, keypath in enumerate(keypaths):
        assert [type(getattr(k, "key", k)) for k in names.keypath(i)] == [type(getattr(k, "key", k)) for k in keypath]
    return names


def _block(i, extra):
    return _Block(jnp.full(2, float(i)), None if i % 2 else jnp.ones(1), extra)


_TREES = {
    "repeated blocks and Adam moments": lambda: {
        "model": [_block(i, {"s": jnp.ones(1)}) for i in range(5)],
        "opt": (_Moments(jnp.zeros(()), [_block(i, {"s": 1}) for i in range(5)], [_block(i, {}) for i in range(5)]),),
    },
    "equal dict keys of other types": lambda: {
        "a": {1: jnp.ones(1), 2: 2},
        "b": {True: jnp.ones(1), False: 2},
        "c": {1.0: jnp.ones(1), 2.0: 2},
        "d": {np.int64(1): jnp.ones(1), 2: 2},
        "e": [{1: 3}, {True: 3}, {1: 3}, {1.0: 3}],
    },
    "string enum keys beside strings": lambda: {"a": {_Color.RED: 1.0}, "b": {"red": 1.0}, "c": {_Color.RED: 1.0}},
    "awkward keys": lambda: {k: [jnp.ones(1), {k: 2}] for k in AWKWARD_KEYS},
    "ordered and default dicts, None, empty nodes": lambda: {
        "o": collections.OrderedDict(b=1, a=[2, None, ()]),
        "d": collections.defaultdict(list, z=[3.0], y={}),
        "n": None,
        "e": [[], {}, ()],
    },
    "a single leaf": lambda: jnp.ones(3),
    "static arrays that cannot be compared": lambda: [_StaticTable(jnp.ones(2), np.ones(2)) for _ in range(3)],
}


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
@pytest.mark.parametrize("which", list(_TREES))
def test_names_from_the_structure_are_those_of_the_key_paths(which):
    _check_named_as_by_key_paths(_TREES[which]())


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_structures_that_cannot_be_compared_are_named_apart():
    """JAX raises comparing two Equinox modules holding equal arrays (distinct
    objects) in a static field; `rebuilds_plainly` sends such trees to their key
    paths, and naming from the structure does not fail on them either."""
    from eqx_ckpt._base import _tree

    tree = [_StaticTable(jnp.full(2, float(i)), np.ones(2)) for i in range(3)]
    treedef = jtu.tree_structure(tree)
    assert not _tree.rebuilds_plainly(treedef)
    names = _tree.names_from_structure(treedef)
    assert names.paths == _by_key_paths(tree)[1] == ["0.w", "1.w", "2.w"]


def test_names_from_the_structure_with_is_leaf():
    tree = {"model": [_block(i, {"s": jnp.ones(1)}) for i in range(3)], "other": (1, 2)}
    _check_named_as_by_key_paths(tree, is_leaf=lambda x: isinstance(x, _Block) and x.b is None)


def test_equal_structures_with_differently_named_keys_are_named_apart(tmp_path):
    """`{1: x}` and `{True: x}` are equal structures to JAX: the second must not
    be given the first one's names."""
    tree = {"a": {1: jnp.ones(1)}, "b": {True: jnp.full(1, 2.0)}}
    names = _check_named_as_by_key_paths(tree)
    assert names.paths == ["a.%i1", "b.%rTrue"]
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree)
    assert sorted(eqx_ckpt.Checkpoint(tmp_path / "c")) == ["a.%i1", "b.%rTrue"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", tree), tree, typematch=True)


class _Registered:
    def __init__(self, x):
        self.x = x


jtu.register_pytree_with_keys(
    _Registered, lambda r: (((jtu.GetAttrKey("x"), r.x),), None), lambda _, c: _Registered(*c)
)


def test_a_tree_with_another_node_is_named_from_its_key_paths(faults):
    """A registered node may run code of the user's when rebuilt: its tree is
    named from its key paths, never rebuilt; which way a root type went is
    remembered for the next tree of that type."""
    from eqx_ckpt._base import _tree

    def refuse(*args):
        raise AssertionError("rebuilt")

    _state.reset("tree.plain_roots")
    tree = {"r": [_Registered(jnp.ones(2)), _Registered(3.0)], "p": jnp.zeros(1)}
    faults("tree.name_by_structure", refuse)
    _check_named_as_by_key_paths(tree)
    assert _tree._PLAIN_ROOTS == {dict: False}
    _check_named_as_by_key_paths(tree)  # tried with key paths first this time, as remembered


class _Pair(eqx.Module):
    a: object
    b: object


def _twin(tree):
    """`tree` with every number key `k` of a dict replaced by `float(k)` (equal,
    of the same hash, named `%r1.0` instead of `%i1` or `%rTrue`)."""
    if isinstance(tree, dict):
        return {(float(k) if isinstance(k, int) else k): _twin(v) for k, v in tree.items()}
    if isinstance(tree, _Moments):
        return _Moments(*map(_twin, tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map(_twin, tree))
    if isinstance(tree, _Pair):
        return _Pair(_twin(tree.a), _twin(tree.b))
    return tree


def _trees():
    from hypothesis import strategies as st

    leaves = st.one_of(st.integers(-3, 3), st.floats(-1, 1), st.just(None), st.builds(jnp.ones, st.integers(0, 2)))
    keys = st.one_of(
        st.lists(st.sampled_from(["a", "b", "", "a.b", "%i1", "1"]), unique=True, max_size=3),
        st.lists(st.integers(-2, 2), unique=True, max_size=3),
        st.lists(st.booleans(), unique=True, max_size=2),
        st.lists(st.sampled_from([0.0, 1.0, 1.5]), unique=True, max_size=2),
    )

    def nodes(children):
        return st.one_of(
            st.builds(lambda ks, vs: dict(zip(ks, vs)), keys, st.lists(children, min_size=3, max_size=3)),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.builds(_Moments, children, children, children),
            st.builds(_Pair, children, children),
            # The same subtree again and again, as a model's blocks are.
            st.builds(lambda t, n: [t] * n, children, st.integers(1, 3)),
        )

    return st.recursive(leaves, nodes, max_leaves=12)


def test_names_from_the_structure_are_those_of_the_key_paths_on_any_tree():
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_trees())
    def check(tree):
        # With its twin: an equal structure to JAX whose number keys are named otherwise.
        _check_named_as_by_key_paths({"x": tree, "y": [tree, {"z": _twin(tree)}, tree]})

    check()


def test_names_remembered_by_structure_are_those_of_the_key_paths():
    """A whole tree's names are remembered by its structure: named again one
    after another, an equal structure whose number keys are named otherwise
    (its twin) still gets its own names, and a tree named again gets its
    names in lists of its own."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_trees())
    def check(tree):
        for named in (tree, _twin(tree), tree, _twin(tree)):
            _check_named_as_by_key_paths({"x": named})

    check()


def test_names_remembered_by_structure_are_a_copy_for_each_tree():
    """A save frees its names (`_staging.Batch.free` empties the lists): the
    names remembered for the next tree of that structure are kept whole."""
    from eqx_ckpt._base import _tree

    tree = {"a": [jnp.ones(2), jnp.zeros(3)], "b": {"c": jnp.ones(1)}}
    first = _tree.flatten_named(tree, None)[1]
    expected = (list(first.paths), [list(r) for r in first.records])
    first.paths.clear()
    first.records.clear()
    again = _tree.flatten_named(tree, None)[1]
    assert (again.paths, again.records) == expected == (["a.0", "a.1", "b.c"], expected[1])
