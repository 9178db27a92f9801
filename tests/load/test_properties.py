"""Property-based tests: random nested dicts, lists, tuples and Modules with
adversarial keys and many dtypes and shapes round-trip exactly, never collide,
and never write outside the checkpoint directory."""

import itertools
import os
import pathlib
import re
import string
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal
from hypothesis import HealthCheck, given, settings, strategies as st

import eqx_ckpt
from eqx_ckpt._base import _keypath
from eqx_ckpt._save import _records

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Keys chosen to break naive escaping: separators, escapes, the checkpoint's own
# file names, path traversal, empty, unicode, NUL.
AWKWARD = [
    "",
    ".",
    "..",
    "../..",
    "/",
    "/abs",
    "a/b",
    "a.b",
    "%",
    "%2E",
    "%e",
    "%i0",
    "%r",
    " ",
    "with space",
    "日本",
    "ünï©ødé",
    "\x00",
    "manifest.json",
    "saving.json",
    "gen.2",
    "zarr.json",
    "c",
    "0",
    "-",
    "_",
]
SAFE = string.ascii_letters + string.digits + "_-"
STR_KEYS = st.one_of(
    st.sampled_from(AWKWARD),
    st.text(max_size=12),
    # Escaped segments may have up to 200 characters.
    st.text(SAFE, min_size=190, max_size=200),
    st.text("é.", min_size=1, max_size=33),  # 6 escaped characters each: up to 198
)
INT_KEYS = st.integers(-(10**6), 10**6)

DTYPES = ["bool", "int8", "uint16", "int32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"]
DTYPES += ["complex64", "complex128", "float8_e4m3fn", "int4", "uint4"]
JAX_DTYPES = {"bool", "int8", "uint16", "int32", "float16", "bfloat16", "float32", "complex64", "float8_e4m3fn"}


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


@st.composite
def arrays(draw: Any) -> Any:
    name = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3).map(tuple))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    low = 0 if name.startswith(("uint", "bool")) else -7
    high = 2 if name == "bool" else 8
    values = rng.integers(low, high, size=shape)
    if name.startswith("complex"):
        values = values + 1j * rng.integers(-7, 8, size=shape)
    array = values.astype(_dtype(name))
    if name in JAX_DTYPES and draw(st.booleans()):
        return jnp.asarray(array)
    return array


SCALARS = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.sampled_from([np.float32(1.5), np.int16(-3), np.bool_(True), np.uint8(200)]),
    st.integers(0, 100).map(jax.random.key),
)


class Pair(eqx.Module):
    first: Any
    second: Any


class Tagged(eqx.Module):
    value: Any
    tag: str = eqx.field(static=True, default="static")


def _containers(children: Any) -> Any:
    return st.one_of(
        st.dictionaries(STR_KEYS, children, max_size=4),
        st.dictionaries(INT_KEYS, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.builds(Pair, children, children),
        st.builds(Tagged, children),
    )


TREES = st.recursive(st.one_of(arrays(), SCALARS), _containers, max_leaves=10)

# The largest leaf packed: none (a folder per leaf), the tiniest only (a mix of
# packs and folders in one checkpoint), or as saved by default (all of these).
PACK_BYTES = st.sampled_from([-1, 16, _records.PACK_BYTES])


def _save(path: pathlib.Path, tree: Any, pack_bytes: int) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_records, "PACK_BYTES", pack_bytes)
        eqx_ckpt.tree_serialise_leaves(path, tree)


_counter = itertools.count()


def _fresh(tmp_path: pathlib.Path) -> pathlib.Path:
    """A new empty folder holding only the checkpoint-to-be (hypothesis reuses
    `tmp_path` across examples)."""
    parent = tmp_path / f"example{next(_counter)}"
    parent.mkdir()
    return parent


def _equal(a: Any, b: Any) -> bool:
    # Key arrays compare through their data; everything else as Equinox does.
    unwrap = lambda x: jax.random.key_data(x) if eqx.is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    same_kind = jax.tree.map(lambda x, y: type(x) is type(y), a, b)
    return all(jax.tree.leaves(same_kind)) and bool(
        tree_equal(jax.tree.map(unwrap, a), jax.tree.map(unwrap, b), typematch=True)
    )


_NAME = re.compile(r"^(%e|%i-?[0-9]+|%r(?:[A-Za-z0-9_-]|%[0-9A-F]{2})*|(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+)$")
_DATA_ROOT = re.compile(r"gen\.[0-9a-f]{16}")
_PACK = re.compile(r"packed\.[a-z0-9_]+")


def _assert_contained(parent: pathlib.Path) -> None:
    """Everything the save wrote lies inside `parent/ckpt`, with escaped names."""
    assert os.listdir(parent) == ["ckpt"]
    root = parent / "ckpt"
    for folder, dirs, files in os.walk(root):
        here = pathlib.Path(folder)
        assert not here.is_symlink() and here.resolve().is_relative_to(root.resolve())
        relative = here.relative_to(root).parts
        # Below a leaf's (or a pack's) `c/` chunk folder, names are chunk indices.
        in_chunks = "c" in relative
        # Packs lie at the top of a data root: the checkpoint, or a `gen.<commit>` in it.
        data_root = relative == () or (len(relative) == 1 and _DATA_ROOT.fullmatch(relative[0]))
        for name in dirs:
            assert (
                in_chunks
                or name == "c"
                or _DATA_ROOT.fullmatch(name)
                or (data_root and _PACK.fullmatch(name))
                or _NAME.match(name)
            ), name
        for name in files:
            assert name in ("zarr.json", "manifest.json", "c") or (in_chunks and name.isdigit()), name


@SETTINGS
@given(tree=TREES, pack_bytes=PACK_BYTES)
def test_round_trip(tmp_path, tree, pack_bytes):
    parent = _fresh(tmp_path)
    _save(parent / "ckpt", tree, pack_bytes)
    _assert_contained(parent)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(parent / "ckpt", tree), tree)
    # Abstract `like`, as `eqx.filter_eval_shape` gives, loads the same arrays.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(parent / "ckpt", abstract), tree)
    # One stored leaf per leaf: no two key paths collided.
    leaves = jax.tree.leaves(tree)
    assert len(eqx_ckpt.Checkpoint(parent / "ckpt")) == len(leaves)
    assert eqx_ckpt.verify(parent / "ckpt") == []


@SETTINGS
@given(first=TREES, second=TREES, first_pack_bytes=PACK_BYTES, second_pack_bytes=PACK_BYTES)
def test_overwrite_round_trip(tmp_path, first, second, first_pack_bytes, second_pack_bytes):
    parent = _fresh(tmp_path)
    _save(parent / "ckpt", first, first_pack_bytes)
    _save(parent / "ckpt", second, second_pack_bytes)
    _assert_contained(parent)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(parent / "ckpt", second), second)


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.one_of(STR_KEYS, INT_KEYS.map(str)), min_size=2, max_size=30, unique=True))
def test_dict_keys_never_collide(keys):
    # Distinct keys of one dict always get distinct dotted paths and folders.
    dotted = [eqx_ckpt.LeafHandle((jax.tree_util.DictKey(k),), "", "").keystr for k in keys]
    segments = [_keypath.segment(jax.tree_util.DictKey(k)) for k in keys]
    assert len(set(segments)) == len(keys) == len(set(dotted))
    assert all(_NAME.match(s) and "." not in s and "/" not in s for s in segments)


@pytest.mark.usefixtures("unpacked")  # the folders of keys
@SETTINGS
@given(
    keys=st.lists(
        st.text(SAFE, min_size=201, max_size=260) | st.text("é", min_size=34, max_size=60), min_size=1, max_size=3
    )
)
def test_overlong_keys_are_stored_under_short_distinct_names(tmp_path, keys):
    parent = _fresh(tmp_path)
    tree = {key: np.full(2, float(i)) for i, key in enumerate(keys)}
    eqx_ckpt.tree_serialise_leaves(parent / "ckpt", tree)
    names = [n for n in os.listdir(parent / "ckpt") if n not in ("manifest.json", "zarr.json")]
    assert len(names) == len(tree) and all(len(n) <= 200 and _keypath.is_valid_dotted(n) for n in names)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(parent / "ckpt", tree), tree, typematch=True)
