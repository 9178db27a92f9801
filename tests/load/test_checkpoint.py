"""`Checkpoint(path)`: a read-only mapping over a checkpoint, and `skeleton`."""

import re
import time

import equinox as eqx
import http_server
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _format


def _save(path):
    tree = {
        "model": {"head": {"weight": jnp.arange(6.0).reshape(2, 3), "bias": jnp.zeros(2, jnp.bfloat16)}},
        "step": 7,
        "lr": 0.1,
        "flag": True,
        "np_scalar": np.float32(1.5),
        "a.b": np.arange(4, dtype=np.int64),
    }
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return tree


def test_keys_are_sorted_dotted_paths(tmp_path):
    _save(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    keys = list(ckpt.keys())
    assert keys == sorted(keys)
    assert set(keys) == {"model.head.weight", "model.head.bias", "step", "lr", "flag", "np_scalar", "a%2Eb"}
    assert len(ckpt) == 7
    assert "model.head.weight" in ckpt
    assert "model.head" not in ckpt
    assert "a.b" not in ckpt
    assert list(iter(ckpt)) == keys


def test_values_are_lazy_arrays_or_scalars(tmp_path):
    tree = _save(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    weight = ckpt["model.head.weight"]
    assert isinstance(weight, eqx_ckpt.LazyArray)
    assert weight.shape == (2, 3) and weight.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(weight), np.asarray(tree["model"]["head"]["weight"]))
    assert ckpt["model.head.bias"].dtype == jnp.bfloat16
    assert ckpt["step"] == 7 and type(ckpt["step"]) is int
    assert ckpt["lr"] == 0.1 and type(ckpt["lr"]) is float
    assert ckpt["flag"] is True
    assert ckpt["np_scalar"] == np.float32(1.5) and type(ckpt["np_scalar"]) is np.float32
    np.testing.assert_array_equal(np.asarray(ckpt["a%2Eb"]), np.arange(4))
    items = dict(ckpt.items())
    assert set(items) == set(ckpt.keys())
    assert items["step"] == 7


def test_unknown_key_is_a_key_error_naming_it(tmp_path):
    _save(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    with pytest.raises(eqx_ckpt.CheckpointKeyError, match=re.escape("'model.head.wieght'")) as info:
        ckpt["model.head.wieght"]
    assert isinstance(info.value, KeyError)
    assert "model.head.weight" in str(info.value)
    assert ckpt.get("nope", "default") == "default"


def test_total_bytes_and_records(tmp_path):
    _save(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    expected = 6 * 4 + 2 * 2 + 8 + 8 + 1 + 4 + 4 * 8
    assert ckpt.total_bytes == expected
    assert sum(ckpt.record(k).nbytes for k in ckpt) == expected
    assert ckpt.record("model.head.bias").dtype == "bfloat16"
    assert ckpt.library_version == eqx_ckpt.__version__
    # Uncompressed, the version before compression (an eqx_ckpt of version 5 reads it).
    assert ckpt.format_version == _format.UNCOMPRESSED_VERSION == 5
    assert _format.COMPRESSED_VERSION == 6 and _format.FORMAT_VERSION == 7
    assert ckpt.created
    assert "7 leaves" in repr(ckpt)


def test_tree_view_is_nested(tmp_path):
    _save(tmp_path)
    view = eqx_ckpt.Checkpoint(tmp_path).tree()
    assert view["model"]["head"]["weight"] == "float32[2,3]"
    assert view["model"]["head"]["bias"] == "bfloat16[2]"
    assert view["step"] == "int64[]"
    assert set(view) == {"model", "step", "lr", "flag", "np_scalar", "a%2Eb"}


def test_is_read_only(tmp_path):
    _save(tmp_path)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    with pytest.raises(TypeError):
        ckpt["step"] = 3


def test_missing_checkpoint(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        eqx_ckpt.Checkpoint(tmp_path / "none")


def test_checkpoint_of_an_overwritten_save_reads_the_new_data(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"x": jnp.zeros(3)})
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"y": jnp.ones(2)})
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert list(ckpt) == ["y"]
    np.testing.assert_array_equal(np.asarray(ckpt["y"]), np.ones(2))


def test_skeleton_equals_filter_eval_shape():
    args = (3, 2, 8, 2)
    kwargs = {"key": jax.random.key(0)}
    made = eqx_ckpt.skeleton(eqx.nn.MLP, *args, **kwargs)
    expected = eqx.filter_eval_shape(eqx.nn.MLP, *args, **kwargs)
    assert tree_equal(made, expected)
    assert isinstance(made.layers[0].weight, jax.ShapeDtypeStruct)
    assert made.layers[0].weight.shape == (8, 3)


def test_skeleton_loads(tmp_path):
    model = eqx.nn.Linear(3, 4, key=jax.random.key(1))
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    like = eqx_ckpt.skeleton(eqx.nn.Linear, 3, 4, key=jax.random.key(2))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, like), model, typematch=True)


def test_numeric_keys_sort_by_value(tmp_path):
    tree = {"layers": [jnp.zeros(1) for _ in range(12)], "b": {10: 1, 2: 2, -1: 3}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    keys = list(eqx_ckpt.Checkpoint(tmp_path))
    assert keys == ["b.%i-1", "b.%i2", "b.%i10"] + [f"layers.{i}" for i in range(12)]


def test_print_shows_the_nested_structure(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}, "step": 7})
    text = str(eqx_ckpt.Checkpoint(tmp_path))
    lines = text.splitlines()
    assert lines[0] == f"Checkpoint {str(tmp_path)!r}:"
    assert lines[1] == "model/"
    assert lines[2].split() == ["b", "float32[3]", "12", "B"]
    assert lines[3].split() == ["w", "float32[2,3]", "24", "B"]
    assert lines[4].split() == ["step", "int64[]", "8", "B"]
    assert lines[5] == "3 leaves, 44 B"


def test_print_of_a_large_checkpoint_is_cut_short(tmp_path):
    """One list of 500 leaves: its first leaves, how many more, and the totals."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": [np.zeros(1) for _ in range(500)]}, layout="ocdbt")
    lines = str(eqx_ckpt.Checkpoint(tmp_path)).splitlines()
    assert lines[1:] == [
        "w/",
        "  0  float64[1]         8 B",
        "  1  float64[1]         8 B",
        "  2  float64[1]         8 B",
        "  3  float64[1]         8 B",
        "  4  float64[1]         8 B",
        "  ... and 495 more",
        "... 495 leaves not listed one by one (`Checkpoint(path).listing()` lists them all)",
        "500 leaves, 3.9 KiB",
    ]
    assert len(eqx_ckpt.Checkpoint(tmp_path).listing().splitlines()) == 502


@pytest.mark.parametrize("key", [0, None, ("a",)])
def test_a_key_that_is_not_a_string_is_a_key_error(tmp_path, key):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": np.zeros(2)})
    with pytest.raises(eqx_ckpt.CheckpointKeyError, match=re.escape("leaves are named by their dotted paths")):
        eqx_ckpt.Checkpoint(tmp_path)[key]


class _Mixed:
    """A custom node whose children are keyed by an index and by a name."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _Mixed,
    lambda n: (((jax.tree_util.SequenceKey(0), n.a), (jax.tree_util.DictKey("b"), n.b)), None),
    lambda _, children: _Mixed(*children),
)


def test_load_without_like_names_keys_that_cannot_be_sorted_as_dotted_paths_do(tmp_path):
    """Once a bare `ValueError` from JAX sorting `{0: ..., "b": ...}`."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"m": _Mixed(np.zeros(3), np.ones(2)), "l": [np.ones(1)]})
    loaded = eqx_ckpt.Checkpoint(tmp_path).load()
    expected = {"l": [np.ones(1)], "m": {"0": np.zeros(3), "b": np.ones(2)}}
    assert tree_equal(loaded, expected, typematch=True)
    assert sorted(eqx_ckpt.Checkpoint(tmp_path).keys()) == ["l.0", "m.0", "m.b"]


def _with_a_large_leaf():
    # `big` is over `_records.PACK_BYTES`, so it is an array of its own; the others are packed.
    return {"big": np.arange(2**18 + 1, dtype=np.float32), "model": {"w": jnp.arange(6.0).reshape(2, 3)}, "step": 7}


def test_a_checkpoint_loads_over_http(tmp_path):
    """From a plain file server (read-only, no range requests): `Checkpoint`,
    full, lazy and sliced reads."""
    tree = _with_a_large_leaf()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    with http_server.serving(tmp_path) as root:
        url = f"{root}/ckpt"
        ckpt = eqx_ckpt.Checkpoint(url)
        assert list(ckpt.keys()) == ["big", "model.w", "step"]
        np.testing.assert_array_equal(ckpt["big"][5:9], tree["big"][5:9])
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(url, tree), tree, typematch=True)
        lazy = eqx_ckpt.tree_deserialise_leaves(url, tree, lazy=True)
        assert tree_equal(eqx_ckpt.materialise(lazy), tree, typematch=True)


def test_an_unreachable_server_is_a_connection_error_within_seconds():
    """Once, TensorStore retried a refused connection for a quarter of an hour,
    and `Checkpoint(url)` or a load seemed to hang."""
    url = http_server.refused_url("ckpt")
    raised = http_server.raised(f"""
        import numpy as np
        import eqx_ckpt
        CALLS = {{
            "Checkpoint": lambda: eqx_ckpt.Checkpoint({url!r}),
            "tree_deserialise_leaves": lambda: eqx_ckpt.tree_deserialise_leaves({url!r}, {{"w": np.zeros(2)}}),
        }}
    """)
    assert sorted(raised) == ["Checkpoint", "tree_deserialise_leaves"]
    for call, error in raised.items():
        assert error["type"] == "eqx_ckpt.CheckpointConnectionError", (call, error)
        assert re.match(re.escape(f"Cannot reach {url!r}: ") + ".*Check the URL", error["message"]), (call, error)
        assert error["seconds"] < 20, (call, error)


def test_an_http_spec_dict_is_named_by_its_url_and_keeps_its_own_retries():
    """A kvstore spec dict's `http_request_retries` win over eqx_ckpt's; messages
    name its URL, without the query string (it may hold a token)."""
    base = http_server.refused_url("").rstrip("/")
    retries = {"max_retries": 1, "initial_delay": "10ms", "max_delay": "10ms"}
    spec = {"driver": "http", "base_url": f"{base}?token=secret", "path": "/ckpt/", "http_request_retries": retries}
    start = time.monotonic()
    with pytest.raises(eqx_ckpt.CheckpointConnectionError, match=re.escape(f"Cannot reach '{base}/ckpt/': ")) as info:
        eqx_ckpt.Checkpoint(spec)
    assert time.monotonic() - start < 3  # one attempt, where eqx_ckpt's own retries take about 4 s
    assert "secret" not in str(info.value) and isinstance(info.value, ConnectionError)


def test_a_server_gone_after_the_open_is_a_connection_error(tmp_path):
    """Leaves opened while the server ran, read after it stopped."""
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _with_a_large_leaf())
    raised = http_server.raised(f"""
        import numpy as np
        import eqx_ckpt
        from http_server import serving
        with serving({str(tmp_path)!r}) as root:
            leaf = eqx_ckpt.Checkpoint(root + "/ckpt")["big"]
            like = {{"big": np.zeros(2**18 + 1, np.float32)}}
            lazy = eqx_ckpt.tree_deserialise_leaves(root + "/ckpt", like, lazy=True)
        CALLS = {{"read": lambda: np.asarray(leaf), "materialise": lambda: eqx_ckpt.materialise(lazy)}}
    """)
    assert sorted(raised) == ["materialise", "read"]
    for call, error in raised.items():
        assert error["type"] == "eqx_ckpt.CheckpointConnectionError", (call, error)
        assert re.match(re.escape("Cannot reach 'http://127.0.0.1:") + r"[0-9]+/ckpt': ", error["message"]), error
        assert error["seconds"] < 30, (call, error)  # the read, then the check that the checkpoint is unchanged


def test_printing_a_large_checkpoint_summarises_every_top_level_entry_first(tmp_path):
    """A small `model` beside 3,000 leaves of `big`: the printout showed the first
    leaves of `big` and never `model`."""
    tree = {
        "big": {f"k{i}": np.full(3, i, np.float32) for i in range(3000)},
        "model": {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)},
        "step": 7,
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    lines = str(eqx_ckpt.Checkpoint(tmp_path / "ckpt")).splitlines()
    assert [line.split()[:2] for line in lines[1:13]] == [
        ["big/"],
        ["k0", "float32[3]"],
        ["k1", "float32[3]"],
        ["k2", "float32[3]"],
        ["k3", "float32[3]"],
        ["k4", "float32[3]"],
        ["...", "and"],
        ["model/"],
        ["b", "float32[4]"],
        ["w", "float32[4,4]"],
        ["step", "int64[]"],
        ["...", "2995"],
    ]
    assert lines[-1] == "3003 leaves, 35.2 KiB"
    # A checkpoint that fits is listed whole, without a summary.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "small", {"model": tree["model"], "step": 7})
    assert "..." not in str(eqx_ckpt.Checkpoint(tmp_path / "small"))


def test_printing_shows_a_model_layer_by_layer_whatever_sits_beside_it(tmp_path):
    """Sub-trees open breadth first within the 60 lines: an MLP beside 3,000
    leaves shows every layer's leaves (it showed as "4 leaves"), the large
    sibling shows its first keys in natural order (`k2` before `k10`), and a
    sub-tree that cannot open at all is one line with its count and bytes."""
    model = eqx.nn.MLP(4, 2, 16, 3, key=jax.random.key(0))
    deep = {f"block{i}": {f"w{j}": np.zeros(2, np.float32) for j in range(30)} for i in range(3)}
    big = {f"k{i}": np.zeros(3, np.float32) for i in range(3000)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"big": big, "deep": deep, "model": model})
    lines = str(eqx_ckpt.Checkpoint(tmp_path)).splitlines()
    assert len(lines) <= 1 + 60 + 2
    names = [line.split()[0] for line in lines[1:]]
    model_at = names.index("model/")
    assert names[model_at : model_at + 14] == [
        "model/",
        "layers/",
        "0/",
        "bias",
        "weight",
        "1/",
        "bias",
        "weight",
        "2/",
        "bias",
        "weight",
        "3/",
        "bias",
        "weight",
    ]
    assert lines[1 + model_at + 4].split()[1] == "float32[16,4]"
    assert names[:7] == ["big/", "k0", "k1", "k2", "k3", "k4", "..."]
    # Of `deep`'s three blocks of 30, one opens whole within the 60 lines, the
    # next shows the lines left of it, the last is one line.
    deep_at = 1 + names.index("deep/")
    assert lines[deep_at + 1 : deep_at + 3] == ["  block0/", "    w0        float32[2]             8 B"]
    assert lines[deep_at + 32 : deep_at + 39] == [
        "  block1/",
        "    w0        float32[2]             8 B",
        "    w1        float32[2]             8 B",
        "    w2        float32[2]             8 B",
        "    w3        float32[2]             8 B",
        "    ... and 26 more",
        "  block2/     30 leaves            240 B",
    ]
    assert lines[-2] == "... 3051 leaves not listed one by one (`Checkpoint(path).listing()` lists them all)"
    # `listing()` lists every leaf, `k2` before `k10`.
    full = [line.split()[0] for line in eqx_ckpt.Checkpoint(tmp_path).listing().splitlines()]
    assert full[1:12] == ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9", "k10"]
