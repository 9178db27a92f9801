"""Safetensors files and Hugging Face sharded directories as sources of leaves,
with every load option; only the selected tensors' bytes are read."""

import gc
import json
import re
import shutil

import http_server
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal
from http_server import RangeServer, serving_ranges
from safetensors.numpy import load_file, save, save_file

import eqx_ckpt

W = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.arange(4, dtype=np.int64)


def _tensors():
    return {"model.w": W, "model.b": B, "head.w": np.full((2, 2), 0.5, ml_dtypes.bfloat16), "step": np.array(3)}


@pytest.fixture
def single(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    return path


def _shard(directory, groups):
    """A Hugging Face sharded directory: one file per group plus the index."""
    directory.mkdir(exist_ok=True)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(directory / name))
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_checkpoint_lists_a_file_and_reads_regions(single):
    ckpt = eqx_ckpt.Checkpoint(single)
    assert ckpt.format == "safetensors"
    assert list(ckpt) == ["head.w", "model.b", "model.w", "step"]
    assert ckpt["model.w"].shape == (3, 4) and ckpt["model.w"].dtype == np.float32
    np.testing.assert_array_equal(ckpt["model.w"][1:3, 2], W[1:3, 2])
    assert ckpt.total_bytes == W.nbytes + B.nbytes + 8 + 8
    assert ckpt.tree()["model"] == {"b": "int64[4]", "w": "float32[3,4]"}


def test_load_with_options(single):
    like = {"w": jnp.zeros((3, 4)), "b": np.zeros(4, np.int64)}
    loaded = eqx_ckpt.tree_deserialise_leaves(single, like, prefix="model")
    assert tree_equal(loaded, {"w": jnp.asarray(W), "b": B}, typematch=True)
    # `where`: only the selected leaf is loaded, the other is `like`'s.
    part = eqx_ckpt.tree_deserialise_leaves(single, like, prefix="model", where=lambda t: t["w"])
    assert tree_equal(part, {"w": jnp.asarray(W), "b": like["b"]}, typematch=True)
    # Mapping `rename` and `missing="keep"`.
    like2 = {"weight": jnp.zeros((3, 4)), "extra": jnp.ones(2)}
    loaded = eqx_ckpt.tree_deserialise_leaves(single, like2, rename={"weight": "model.w"}, missing="keep")
    assert tree_equal(loaded, {"weight": jnp.asarray(W), "extra": jnp.ones(2)}, typematch=True)
    # `cast`: bfloat16 on disk, float32 asked for.
    head = eqx_ckpt.tree_deserialise_leaves(single, {"w": jnp.zeros((2, 2))}, prefix="head", cast=True)
    assert tree_equal(head, {"w": jnp.full((2, 2), 0.5)}, typematch=True)
    # Lazy leaves read on demand; a Python scalar of `like` comes back as one.
    lazy = eqx_ckpt.tree_deserialise_leaves(single, {"model": like, "step": 0}, lazy=True)
    assert isinstance(lazy["model"]["w"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), {"model": {"w": jnp.asarray(W), "b": B}, "step": 3})


def test_load_problems_are_reported_together(single):
    like = {"model": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(4, jnp.int32), "gone": jnp.zeros(1)}}
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(single, like, strict=True)
    message = str(info.value)
    assert "3 leaves do not match" not in message
    assert re.search(re.escape("`model.w` (key path ['model']['w']") + ".*shape changed", message)
    assert re.search(re.escape("`model.b` (key path ['model']['b']") + ".*dtype changed", message)
    assert "`model.gone` (key path ['model']['gone']" in message and "missing" in message
    assert "`head.w`: unexpected" in message and "`step`: unexpected" in message


def test_regex_rules_and_transform(single):
    like = {"layers": [{"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(4)}], "skip": jnp.ones(2)}
    rules = [(r"^layers\.(\d+)\.kernel$", r"model.w"), (r"^layers\.\d+\.bias$", "model.b"), (r"^skip$", None)]
    transform = [(r"kernel$", np.transpose), (r"bias$", lambda b: b.astype(np.float32))]
    loaded = eqx_ckpt.tree_deserialise_leaves(single, like, rename=rules, transform=transform, strict=False)
    expected = {"layers": [{"kernel": jnp.asarray(W.T), "bias": jnp.asarray(B, jnp.float32)}], "skip": jnp.ones(2)}
    assert tree_equal(loaded, expected, typematch=True)
    # Several stored tensors combined by one transform.
    both = eqx_ckpt.tree_deserialise_leaves(
        single,
        {"x": np.zeros(4)},
        rename=[("^x$", ("model.b", "model.b"))],
        transform={"x": lambda a, b: (a + b) * 1.0},
    )
    np.testing.assert_array_equal(both["x"], 2.0 * B)
    with pytest.raises(
        eqx_ckpt.LeafError, match=re.escape("gives 2 stored paths (model.b, model.w) but no `transform`")
    ):
        eqx_ckpt.tree_deserialise_leaves(single, {"x": np.zeros(4)}, rename=[("^x$", ("model.b", "model.w"))])
    # A transform giving the wrong shape is reported with the leaf's name.
    with pytest.raises(
        eqx_ckpt.LeafError, match=re.escape("after its `transform` the shape is (3, 4), but `like` has (4, 3)")
    ):
        eqx_ckpt.tree_deserialise_leaves(
            single, {"k": jnp.zeros((4, 3))}, rename=[("^k$", "model.w")], transform={"k": np.asarray}
        )
    # Lazily: the leaf has `like`'s shape, and is read and transformed when asked.
    lazy = eqx_ckpt.tree_deserialise_leaves(single, like, rename=rules, transform=transform, lazy=True)
    assert isinstance(lazy["layers"][0]["kernel"], eqx_ckpt.LazyArray) and lazy["layers"][0]["kernel"].shape == (4, 3)
    np.testing.assert_array_equal(lazy["layers"][0]["kernel"][1:3], W.T[1:3])
    assert tree_equal(eqx_ckpt.materialise(lazy), expected, typematch=True)
    bad = eqx_ckpt.tree_deserialise_leaves(
        single, {"k": jnp.zeros((4, 3))}, rename=[("^k$", "model.w")], transform={"k": np.asarray}, lazy=True
    )
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("leaf `model.w` (key path ['k'])")):
        eqx_ckpt.materialise(bad)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("is not a regular expression")):
        eqx_ckpt.tree_deserialise_leaves(single, like, rename=[("(", "x")])


def test_sharded_directory_and_load_or_initialise(tmp_path):
    directory = _shard(tmp_path / "hf", [{"model.w": W}, {"model.b": B, "step": np.array(3)}])
    ckpt = eqx_ckpt.Checkpoint(directory)
    assert list(ckpt) == ["model.b", "model.w", "step"]
    make = lambda: {
        "model": {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)},
        "new": jnp.ones(3),
    }
    with pytest.raises(eqx_ckpt.LeafError, match="dtype changed"):
        eqx_ckpt.load_or_initialise(directory, make)
    loaded = eqx_ckpt.load_or_initialise(directory, make, cast=True)
    np.testing.assert_array_equal(loaded["model"]["w"], W)
    np.testing.assert_array_equal(loaded["new"], np.ones(3))


def test_sharded_like_leaves(tmp_path):
    big = np.arange(64 * 6, dtype=np.float32).reshape(64, 6)
    path = tmp_path / "big.safetensors"
    save_file({"w": big}, str(path))
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    loaded = eqx_ckpt.tree_deserialise_leaves(
        path, {"w": jax.ShapeDtypeStruct((64, 6), jnp.float32, sharding=sharding)}
    )
    assert loaded["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(loaded["w"]), big)


def test_damaged_files_are_explained(tmp_path, single):
    data = single.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "cut.safetensors")
    damaged = r"is damaged or incomplete: DATA_LOSS: .*\(the file is truncated\)"
    with pytest.raises(eqx_ckpt.IntegrityError, match=damaged):
        for key in ckpt:
            np.asarray(ckpt[key])
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(
        eqx_ckpt.CorruptCheckpointError, match=re.escape("'short.safetensors' is shorter than a safetensors header")
    ):
        eqx_ckpt.Checkpoint(tmp_path / "short.safetensors")
    (tmp_path / "short.safetensors").write_bytes((64).to_bytes(8, "little") + b"{}")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("'short.safetensors' ends inside its header")):
        eqx_ckpt.Checkpoint(tmp_path / "short.safetensors")
    (tmp_path / "bad.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("is not valid JSON")):
        eqx_ckpt.Checkpoint(tmp_path / "bad.safetensors")
    header = json.dumps({"packed": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "f4.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(
        eqx_ckpt.CheckpointValueError, match=re.escape("has the safetensors dtype 'F4', which eqx_ckpt")
    ):
        eqx_ckpt.Checkpoint(tmp_path / "f4.safetensors")
    hostile = _shard(tmp_path / "hostile", [{"a": W}])
    (hostile / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("names the shard '../outside.safetensors'")):
        eqx_ckpt.Checkpoint(hostile)


@pytest.mark.parametrize(
    "index, said",
    [
        (b"[" * 100_000 + b"]" * 100_000, "has no `weight_map` of tensor names to files"),  # past Python recursion
        (b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "duplicate JSON key 'a'"),
    ],
    ids=["deep", "a-tensor-twice"],
)
def test_a_hostile_index_is_a_clear_error(tmp_path, index, said):
    """An index is read by the untrusted parser, as a manifest is: nested past
    Python's recursion (a `RecursionError` before), or naming a tensor twice
    (the last won before), it is refused."""
    hostile = _shard(tmp_path / "hostile", [{"a": W}])
    (hostile / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(hostile)


def test_an_index_naming_more_shards_than_allowed_reads_none(tmp_path):
    """An index naming more than `MAX_SHARDS` shards (each is read when the
    folder is opened: ten thousand took minutes on the Hub) is refused before
    any is read; at the bound, the shards are read (here: the missing one is named)."""
    from eqx_ckpt._ondisk._format import MAX_SHARDS

    folder = _shard(tmp_path / "many", [{"a": W}])
    for count, said in [
        (MAX_SHARDS + 1, f"names {MAX_SHARDS + 1} shards, more than the {MAX_SHARDS} allowed"),
        (MAX_SHARDS, f"lists the shard 'model-00002-of-{MAX_SHARDS:05d}.safetensors', which is not there"),
    ]:
        weight_map = {"a": "model-00001-of-00001.safetensors"}
        weight_map |= {f"t{i}": f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(2, count + 1)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
            eqx_ckpt.Checkpoint(folder)


def test_an_unreachable_server_is_a_connection_error_within_seconds():
    """A file or a Hugging Face directory on a server that refuses the connection."""
    file, folder = http_server.refused_url("hf/model.safetensors"), http_server.refused_url("hf/")
    raised = http_server.raised(f"""
        import numpy as np
        import eqx_ckpt
        CALLS = {{
            "file": lambda: eqx_ckpt.Checkpoint({file!r}),
            "folder": lambda: eqx_ckpt.tree_deserialise_leaves({folder!r}, {{"small": np.zeros(10, np.float32)}}),
        }}
    """)
    assert sorted(raised) == ["file", "folder"]
    for url, error in [(file, raised["file"]), (folder, raised["folder"])]:
        assert error["type"] == "eqx_ckpt.CheckpointConnectionError", error
        assert error["message"].startswith(f"Cannot reach {url!r}: "), error
        assert error["seconds"] < 20, error


class _Failing(RangeServer):
    """`RangeServer`, except that a request for `failing` gets a 500."""

    failing = ""

    def do_GET(self):
        if self.path.lstrip("/") == self.failing:
            self.send_error(500)
            return
        super().do_GET()


_SHARDS = ["model.safetensors.index.json", "model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("failing", ["hf/manifest.json", *(f"hf/{name}" for name in _SHARDS)])
def test_a_server_error_is_a_storage_error_naming_the_file(failing):
    """A server answering 500 (once its retries were spent) for the manifest,
    the index or a shard's header: once a bare TensorStore `ValueError`."""
    shards = {"model-00001-of-00002.safetensors": {"w": W}, "model-00002-of-00002.safetensors": {"b": B}}
    files = {f"hf/{name}": save(group) for name, group in shards.items()}
    weight_map = {tensor: name for name, group in shards.items() for tensor in group}
    files["hf/model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    _Failing.root, _Failing.failing = files, failing
    with http_server.serve(_Failing) as url:
        retries = {"max_retries": 1, "initial_delay": "10ms", "max_delay": "10ms"}
        spec = {"driver": "http", "base_url": url, "path": "/hf/", "http_request_retries": retries}
        name = failing.removeprefix("hf/")
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match=re.escape(f"would not serve {name!r} of")) as info:
            eqx_ckpt.tree_deserialise_leaves(spec, {"w": np.zeros((3, 4), np.float32)}, missing="keep")
        assert "[HTTP code 500]" in str(info.value) and "may well be whole" in str(info.value)
        _Failing.failing = ""
        loaded = eqx_ckpt.tree_deserialise_leaves(spec, {"w": np.zeros((3, 4), np.float32)}, missing="keep")
        np.testing.assert_array_equal(loaded["w"], W)


def test_only_the_selected_tensors_bytes_are_read(tmp_path):
    small, large = np.arange(10, dtype=np.float32), np.ones((2048, 2048), np.float32)
    save_file({"large": large, "small": small}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    with serving_ranges({"hf/model.safetensors": data}) as url:
        loaded = eqx_ckpt.tree_deserialise_leaves(f"{url}/hf/", {"small": np.zeros(10, np.float32)})
        np.testing.assert_array_equal(loaded["small"], small)
        # The header and the 40 bytes of `small`: not one byte of the 16 MiB of `large`
        # but the file's last (read to check that no bytes follow the last tensor).
        assert RangeServer.sent == header + 1 + small.nbytes
        RangeServer.sent = 0
        lazy = eqx_ckpt.Checkpoint(f"{url}/hf/model.safetensors")["large"]
        np.testing.assert_array_equal(lazy[3], large[3])
        # One row reads the run of rows (4 MiB) that holds it, not the whole tensor.
        assert 0 < RangeServer.sent <= header + 1 + large.nbytes // 4
        # Sharded by rows over 4 devices: each device reads its own quarter, so the
        # tensor is read once in all, not once per device.
        RangeServer.sent = 0
        mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"), axis_types=(jax.sharding.AxisType.Explicit,))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        like = {"large": jax.ShapeDtypeStruct(large.shape, jnp.float32, sharding=sharding)}
        loaded = eqx_ckpt.tree_deserialise_leaves(f"{url}/hf/", like)
        assert loaded["large"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(loaded["large"]), large)
        assert RangeServer.sent == header + 1 + large.nbytes


def test_on_an_object_store(s3, store):
    bucket = ts.KvStore.open(store).result()
    shards = {"model-00001-of-00002.safetensors": {"model.w": W}, "model-00002-of-00002.safetensors": {"model.b": B}}
    for name, group in shards.items():
        bucket.write(name, save(group)).result()
    weight_map = {"model.w": "model-00001-of-00002.safetensors", "model.b": "model-00002-of-00002.safetensors"}
    bucket.write("model.safetensors.index.json", json.dumps({"weight_map": weight_map})).result()
    loaded = eqx_ckpt.tree_deserialise_leaves(
        store, {"w": jnp.zeros((3, 4)), "b": np.zeros(4, np.int64)}, prefix="model"
    )
    assert tree_equal(loaded, {"w": jnp.asarray(W), "b": B}, typematch=True)
    assert eqx_ckpt.Checkpoint(store).format == "safetensors"


def test_a_transform_cast_refuses_values_that_would_change(single):
    """`cast=True` after a `transform` follows the load's rule: a value beyond
    the target's range is an error (it once became infinity), eagerly and lazily."""
    rename, transform = [("^x$", "model.b")], {"x": lambda b: np.asarray(b) * 1e6}
    like = {"x": np.zeros(4, np.float16)}
    why = "after its `transform` it cannot become float16: the value"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(why)):
        eqx_ckpt.tree_deserialise_leaves(single, like, rename=rename, transform=transform, cast=True)
    lazy = eqx_ckpt.tree_deserialise_leaves(single, like, rename=rename, transform=transform, cast=True, lazy=True)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(why)):
        eqx_ckpt.materialise(lazy)
    within = eqx_ckpt.tree_deserialise_leaves(
        single, like, rename=rename, transform={"x": lambda b: np.asarray(b) * 2}, cast=True
    )
    np.testing.assert_array_equal(within["x"], (2 * B).astype(np.float16))


def _raw_file(path, header: str, data: bytes):
    """A safetensors file with the header text given as is."""
    body = header.encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)
    return path


@pytest.mark.parametrize(
    ("header", "said"),
    [
        # JSON keeps the last of two names: the file once loaded as w = [2, 3].
        (
            '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
            ' "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            "duplicate JSON key 'w'",
        ),
        (
            '{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},'
            ' "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}',
            "tensor 'v' in 'x.safetensors' overlaps the tensor before it",
        ),
        (
            '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            "tensor 'w' in 'x.safetensors' leaves bytes 0 to 8 unused",
        ),
        # Bytes after the last tensor were accepted: a tensor entry lost from a header went unnoticed.
        (
            '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
            "'x.safetensors' has bytes after its last tensor",
        ),
        # A `__metadata__` that is not strings was skipped: the file held no tensors, without an error.
        (
            '{"__metadata__": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
            "the `__metadata__` of 'x.safetensors' is not a map of strings to strings",
        ),
        (
            '{"__metadata__": {"step": 3}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
            "the `__metadata__` of 'x.safetensors' is not a map of strings to strings",
        ),
    ],
)
def test_a_header_the_safetensors_library_refuses_is_corrupt(tmp_path, header, said):
    path = _raw_file(tmp_path / "x.safetensors", header, np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(path)


def test_a_tensor_with_a_tensor_further_below_it_is_named_with_it(tmp_path):
    path = str(tmp_path / "deep.safetensors")
    save_file({"x.a": np.ones(2, np.float32), "x.a.b.c": np.zeros(3, np.float32), "x.c": np.ones(1)}, path)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=r"`x\.a` in .* has leaves below it \(`x\.a\.b\.c`\)"):
        eqx_ckpt.Checkpoint(path).load()


def test_names_that_need_escaping_load_from_a_sharded_directory(tmp_path):
    # Plain names are their own dotted paths; these are escaped, and the index
    # (which names tensors as the files do) is checked against the headers all the same.
    groups = [{"layer 0.w": W, "é.b": B}, {"a..b": np.ones(2, np.float32), "": np.zeros(1, np.float32)}]
    ckpt = eqx_ckpt.Checkpoint(_shard(tmp_path / "hf", groups))
    assert list(ckpt) == ["%C3%A9.b", "%e", "a.%e.b", "layer%200.w"]
    tree = ckpt.load()
    assert set(tree) == {"layer 0", "é", "a", ""}
    np.testing.assert_array_equal(tree["layer 0"]["w"], W)
    np.testing.assert_array_equal(tree["a"][""]["b"], np.ones(2, np.float32))


def test_checkpoint_opens_and_loads_with_the_garbage_collector_paused(single, faults):
    # As `tree_deserialise_leaves` does. Its collections, triggered by the
    # objects made for each tensor with JAX's many objects alive, came to a
    # third of `Checkpoint(path).load()` of ten thousand small tensors.
    enabled = []
    # The headers are read and parsed, then the leaves nested as containers.
    faults(["safetensors.read_headers", "nested.load"], lambda *a: enabled.append(gc.isenabled()))
    assert gc.isenabled()
    tree = eqx_ckpt.Checkpoint(single).load()
    assert enabled == [False, False]
    assert gc.isenabled()
    np.testing.assert_array_equal(tree["model"]["w"], W)


def test_a_tensor_with_tensors_below_it_cannot_be_shown_nested(tmp_path):
    path = str(tmp_path / "ab.safetensors")
    save_file({"a": np.ones(2, np.float32), "a.b": np.zeros(3, np.float32)}, path)
    ckpt = eqx_ckpt.Checkpoint(path)
    # Each once raised a bare TypeError or IndexError.
    for call in (ckpt.tree, ckpt.load, lambda: ckpt.load("a"), lambda: ckpt.load(lazy=True)):
        with pytest.raises(eqx_ckpt.CheckpointValueError, match=r"`a` in .* is a leaf and also has leaves below it"):
            call()
    # By dotted path, or into a `like`, each is there.
    np.testing.assert_array_equal(ckpt["a.b"].read(), np.zeros(3, np.float32))
    loaded = eqx_ckpt.tree_deserialise_leaves(path, {"a": np.zeros(2, np.float32)})
    assert tree_equal(loaded, {"a": np.ones(2, np.float32)}, typematch=True)


def test_an_index_listing_a_tensor_its_shard_lacks_is_corrupt(tmp_path):
    save_file({"l.0.w": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"l.1.w": np.full(2, 2, np.float32)}, str(tmp_path / "s2.safetensors"))
    weight_map = {"l.0.w": "s1.safetensors", "l.1.w": "s2.safetensors", "l.2.w": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    like = {"l": [{"w": np.zeros(2, np.float32)} for _ in range(3)]}
    # `missing="keep"` once kept l.2.w's initial value without a word.
    expected = "lists the tensor 'l.2.w' in 's2.safetensors', which does not hold it"
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(expected)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, missing="keep")


def test_an_index_with_no_tensors_says_the_checkpoint_holds_none(tmp_path):
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    # Once: "pass `prefix=` naming it (e.g. `prefix=''`)".
    with pytest.raises(eqx_ckpt.LeafError, match=r"\(looked for `w`\); it holds no leaves\. Check the path\."):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": np.zeros(2, np.float32)})


# Small tensors are read in runs of adjacent tensors, one range read per run
# (`_safetensors.read_runs`); these tests watch the runs through the fault
# point `safetensors.read_run`.

MIXED = {
    "f32": np.linspace(-1, 1, 33, dtype=np.float32),
    "bf16": np.arange(-8, 9, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(17, 1),
    "f16": np.array([[np.inf, -0.0], [np.nan, 65504]], np.float16),
    "i8": np.arange(-128, 127, 17, dtype=np.int8),
    "u8": np.arange(7, dtype=np.uint8),
    "i64": np.array([-(2**62), 2**62 + 1], np.int64),
    "b": np.array([True, False, True]),
    "scalar": np.array(2.5, np.float32),
    "scalar_i8": np.array(-3, np.int8),
    "empty": np.zeros((0,), np.float32),
    "empty2": np.zeros((3, 0), np.int8),
    **{f"many.{i:03d}": np.full(i % 7 + 1, i, np.float32) for i in range(200)},
}


def _runs(faults):
    """The `(file, start, end)` of every run read from now on."""
    seen = []
    faults("safetensors.read_run", lambda loc, file, start, end: seen.append((file, start, end)))
    return seen


def _offsets(path):
    """Each tensor's `(start, end)` in the file."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    return {name: (8 + size + e["data_offsets"][0], 8 + size + e["data_offsets"][1]) for name, e in header.items()}


def test_runs_return_every_tensors_exact_bytes(tmp_path, faults):
    path = tmp_path / "mixed.safetensors"
    save_file(MIXED, str(path))
    runs = _runs(faults)
    as_numpy = eqx_ckpt.tree_deserialise_leaves(path, _nested_like(MIXED, np.zeros))
    # Every tensor in one read of the file's data (the header's end to the last byte).
    offsets = _offsets(path)
    assert runs == [("mixed.safetensors", min(s for s, _ in offsets.values()), max(e for _, e in offsets.values()))]
    jax_dtypes = ("f32", "bf16", "f16", "i8", "u8", "b", "scalar", "scalar_i8", "empty", "empty2")
    as_jax = eqx_ckpt.tree_deserialise_leaves(
        path, {k: jax.ShapeDtypeStruct(MIXED[k].shape, MIXED[k].dtype) for k in jax_dtypes}
    )
    for name, want in MIXED.items():
        got = as_numpy
        for part in name.split("."):
            got = got[part]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
        if name in as_jax:
            assert isinstance(as_jax[name], jax.Array)
            assert np.asarray(as_jax[name]).tobytes() == want.tobytes(), name
    # `Checkpoint.load` (no `like`) reads the same one run.
    runs.clear()
    loaded = eqx_ckpt.Checkpoint(path).load()
    assert len(runs) == 1
    for name in jax_dtypes:
        assert np.asarray(loaded[name]).tobytes() == MIXED[name].tobytes(), name
    for i in range(200):
        assert np.asarray(loaded["many"][f"{i:03d}"]).tobytes() == MIXED[f"many.{i:03d}"].tobytes(), i


def _nested_like(flat, make):
    tree: dict = {}
    for name, value in flat.items():
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = make(value.shape, value.dtype)
    return tree


def test_a_file_cut_inside_a_run_names_the_first_tensor_it_cuts(tmp_path, faults):
    tensors = {f"t{i:03d}": np.full(16, i, np.float32) for i in range(100)}
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path))
    start, _ = _offsets(path)["t037"]
    path.write_bytes(path.read_bytes()[: start + 10])  # inside t037; every tensor after it is gone too
    runs = _runs(faults)
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"t037.*damaged or incomplete: DATA_LOSS: .*truncated") as e:
        eqx_ckpt.tree_deserialise_leaves(path, {name: np.zeros(16, np.float32) for name in tensors})
    assert "t036" not in str(e.value) and "t099" not in str(e.value)
    assert len(runs) == 1
    # A load of the tensors before the cut reads them.
    before = {f"t{i:03d}": np.zeros(16, np.float32) for i in range(37)}
    loaded = eqx_ckpt.tree_deserialise_leaves(path, before)
    assert all(np.array_equal(loaded[name], tensors[name]) for name in before)


@pytest.mark.parametrize("kind", ["file", "shard"])
def test_a_rewrite_between_the_header_and_the_run_is_reported_replaced(tmp_path, faults, kind):
    tensors = {f"model.t{i:03d}": np.full(8, i, np.float32) for i in range(50)}
    changed = {name: value + 1 for name, value in tensors.items()}
    if kind == "file":
        path = tmp_path / "model.safetensors"
        save_file(tensors, str(path))
        target = path
    else:
        path = _shard(tmp_path / "hf", [dict(list(tensors.items())[:25]), dict(list(tensors.items())[25:])])
        target = path / "model-00002-of-00002.safetensors"
    rewritten = []

    def rewrite(loc, file, start, end):
        if not rewritten:  # the same names, shapes and offsets; other values
            save_file({k: changed[k] for k in load_file(str(target))}, str(target))
            rewritten.append(file)

    faults("safetensors.read_run", rewrite)
    like = {"model": {name.split(".")[1]: np.zeros(8, np.float32) for name in tensors}}
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match="was replaced after it was opened"):
        eqx_ckpt.tree_deserialise_leaves(path, like)
    assert rewritten
    # `Checkpoint.load` (no `like`) reads the same runs.
    tensors, changed = changed, {name: value + 1 for name, value in changed.items()}
    ckpt = eqx_ckpt.Checkpoint(path)
    rewritten.clear()
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match="was replaced after it was opened"):
        ckpt.load()
    assert rewritten


def test_a_partial_load_reads_only_the_runs_it_needs(tmp_path, faults):
    # In the file (sorted by name): a.*, then b (1 MiB, between the two groups), then c.*.
    tensors = {
        **{f"a.{i}": np.full(4, i, np.float32) for i in range(10)},
        "b": np.zeros(2**18, np.float32),
        **{f"c.{i}": np.full(4, -i, np.float32) for i in range(10)},
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    offsets = _offsets(path)

    def span(group):
        return (
            min(offsets[n][0] for n in tensors if n.startswith(group)),
            max(offsets[n][1] for n in tensors if n.startswith(group)),
        )

    def like(group):
        return {str(i): np.zeros(4, np.float32) for i in range(10)}

    runs = _runs(faults)
    loaded = eqx_ckpt.tree_deserialise_leaves(path, like("c"), prefix="c")
    assert all(np.array_equal(loaded[str(i)], tensors[f"c.{i}"]) for i in range(10))
    assert runs == [("model.safetensors", *span("c."))]  # c's 160 bytes, not a byte of b
    runs.clear()
    both = {"a": like("a"), "c": like("c"), "b": np.zeros(2**18, np.float32)}
    eqx_ckpt.tree_deserialise_leaves(path, both, where=lambda t: (t["a"], t["c"]))
    # Two runs: b (1 MiB, unwanted) lies between them, more than the gap read through.
    assert runs == [("model.safetensors", *span("a.")), ("model.safetensors", *span("c."))]
    runs.clear()
    # A lazy leaf reads its own tensor, not a run of its neighbours: by the
    # load's reader, a run of that tensor alone.
    lazy = eqx_ckpt.tree_deserialise_leaves(path, like("a"), prefix="a", lazy=True)
    np.testing.assert_array_equal(np.asarray(lazy["3"]), tensors["a.3"])
    assert runs == [("model.safetensors", *offsets["a.3"])]


def test_a_large_local_tensor_is_a_run_of_its_own(tmp_path, faults):
    big = np.arange(2**19, dtype=np.float32).reshape(512, 1024)  # 2 MiB: more than a small tensor
    tensors = {"a": np.ones(3, np.float32), "b": big, "c": big[::-1].copy(), "d": np.zeros(5, np.float32)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    offsets = _offsets(path)
    runs = _runs(faults)
    loaded = eqx_ckpt.tree_deserialise_leaves(path, {k: jnp.zeros(v.shape) for k, v in tensors.items()})
    assert all(np.asarray(loaded[k]).tobytes() == v.tobytes() for k, v in tensors.items())
    # a, d (small) and b, c (large) each a run: a large tensor is never part of another's run.
    assert sorted(runs) == sorted(("model.safetensors", *offsets[k]) for k in "abcd")
    # Placed by rows over 4 devices from the one read.
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    loaded = eqx_ckpt.tree_deserialise_leaves(
        path, {"b": jax.ShapeDtypeStruct(big.shape, jnp.float32, sharding=sharding)}, prefix=None, strict=False
    )
    assert loaded["b"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(loaded["b"]), big)


def test_a_name_with_a_number_too_long_for_int_is_listed_and_loaded(tmp_path):
    """Numbered segments sort by value; one of more digits than Python's `int()`
    accepts (4,300), in a hostile file, sorts as a name instead of raising."""
    huge = "9" * 5000
    path = tmp_path / "long.safetensors"
    tensors = {f"layers.{huge}": np.ones(2, np.float32), "layers.10": np.zeros(1, np.float32)}
    tensors["layers.2"] = np.full(3, 2, np.float32)
    save_file(tensors, str(path))
    ckpt = eqx_ckpt.Checkpoint(path)
    assert list(ckpt) == ["layers.2", "layers.10", f"layers.{huge}"]
    assert np.array_equal(np.asarray(ckpt[f"layers.{huge}"]), np.ones(2, np.float32))


def test_a_folder_holding_two_layouts_is_refused_naming_both(tmp_path):
    """An index and its shards beside a `model.safetensors` the index does not
    name (a re-export into the same folder left one of them): no load picks
    one, as none does from the Hub (issue 65)."""
    tree = {"a": np.arange(4096, dtype=np.float32), "b": np.ones(4096, np.float32)}
    eqx_ckpt.export_safetensors(tmp_path / "sharded", tree, max_shard_size="20KB")
    eqx_ckpt.export_safetensors(tmp_path / "single", tree)
    shutil.copy(tmp_path / "single" / "model.safetensors", tmp_path / "sharded" / "model.safetensors")
    said = (
        "it holds two layouts at once, the index `model.safetensors.index.json` and the single file "
        "`model.safetensors`, which it does not name"
    )
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(tmp_path / "sharded")
    (tmp_path / "sharded" / "model.safetensors").unlink()
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "sharded").load(), tree)
