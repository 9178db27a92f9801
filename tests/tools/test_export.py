"""`export_safetensors` and `eqx-ckpt export`: Hugging Face sharded safetensors
that the `safetensors` library opens, and that load back as the same tree."""

import json
import pathlib
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import places
import pytest
import tensorstore as ts
from arrays import tree_equal
from disk import snapshot
from safetensors import safe_open
from safetensors.numpy import load, load_file, save_file

import eqx_ckpt
from eqx_ckpt._tools._cli import main


def _tree():
    return {
        "model": {
            "mlp": eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0)),
            "embed": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
        },
        "mask": np.array([True, False]),
        "step": 7,
        "lr": 0.25,
    }


def _files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_checkpoint_exported_in_shards_round_trips(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    written = eqx_ckpt.export_safetensors(tmp_path / "hf", eqx_ckpt.Checkpoint(tmp_path / "ckpt"), max_shard_size=300)
    shards = [name for name in written if name.endswith(".safetensors")]
    assert len(shards) >= 3 and written[-3:] == ["model.safetensors.index.json", "eqx_ckpt.json", "README.md"]
    assert _files(tmp_path / "hf") == sorted(written)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    assert sorted(index["weight_map"]) == list(ckpt)
    assert index["metadata"]["total_size"] == ckpt.total_bytes
    # The real `safetensors` library reads every shard, with the dotted names.
    tensors = {}
    for shard in shards:
        with safe_open(str(tmp_path / "hf" / shard), framework="np") as f:
            assert all(index["weight_map"][k] == shard for k in f.keys())
        tensors.update(load_file(str(tmp_path / "hf" / shard)))
    np.testing.assert_array_equal(
        tensors["model.mlp.layers.0.weight"], np.asarray(tree["model"]["mlp"].layers[0].weight)
    )
    assert tensors["model.embed"].dtype == ml_dtypes.bfloat16 and tensors["step"].dtype == np.int64
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "hf", tree), tree, typematch=True)


def test_tree_to_one_file_with_rename_and_metadata(tmp_path):
    tree = _tree()
    rename = [(r"^model\.mlp\.layers\.(\d+)\.", r"mlp.\1."), (r"^lr$", None)]
    written = eqx_ckpt.export_safetensors(tmp_path / "one.safetensors", tree, rename=rename, metadata={"format": "pt"})
    assert written == ["one.safetensors"]
    with safe_open(str(tmp_path / "one.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert "mlp.1.bias" in f.keys() and "lr" not in f.keys()
    # Loading back uses the same rules the other way round.
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path / "one.safetensors", tree, rename=rename)
    assert tree_equal(back, tree, typematch=True)


def test_small_export_is_one_file_and_errors(tmp_path):
    done = []
    assert eqx_ckpt.export_safetensors(tmp_path / "hf", {"w": jnp.ones(3)}, progress=lambda *n: done.append(n)) == [
        "model.safetensors",
        "eqx_ckpt.json",
        "README.md",
    ]
    assert done == [(1, 1, 12, 12)]
    assert load_file(str(tmp_path / "hf" / "model.safetensors"))["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`max_shard_size` must be a positive number")):
        eqx_ckpt.export_safetensors(tmp_path / "x", {"w": jnp.ones(3)}, max_shard_size="big")
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("Leaf `c` in checkpoint '<export>': its dtype complex128")):
        eqx_ckpt.export_safetensors(tmp_path / "x", {"c": np.ones(2, np.complex128)})
    for metadata in ({"step": 3}, [("format", "pt")]):  # a list once raised a bare AttributeError
        with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("`metadata` must be a dict mapping strings")):
            eqx_ckpt.export_safetensors(tmp_path / "x", {"w": jnp.ones(3)}, metadata=metadata)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("gives the name 'w' to both `a` and `b`")):
        eqx_ckpt.export_safetensors(tmp_path / "x", {"a": jnp.ones(1), "b": jnp.ones(1)}, rename=[(".*", "w")])


@pytest.mark.parametrize("into", ["directory", "model.safetensors"])
def test_an_export_replaces_an_earlier_export_and_leaves_other_files(tmp_path, into):
    # Exported whole into one file over an earlier sharded export, the stale
    # index stayed and was read instead: the load gave the earlier values.
    old = {"a": np.ones(1000, np.float32), "b": np.ones(1000, np.float32)}
    new = {"a": np.zeros(1000, np.float32), "b": np.full(1000, 2, np.float32)}
    out = tmp_path / "hf"
    eqx_ckpt.export_safetensors(out, old, max_shard_size="5KB")
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors.partial").write_text("a killed export's")
    assert len(_files(out)) == 7
    eqx_ckpt.export_safetensors(out if into == "directory" else out / into, new, card=False)
    # One file by its path has no `eqx_ckpt.json`: the earlier one is removed with the shards.
    described = ["eqx_ckpt.json"] if into == "directory" else []
    assert _files(out) == ["README.md", "config.json", *described, "model.safetensors"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(out, old), new, typematch=True)
    # Sharded again, over the single file: the shards and their index only.
    eqx_ckpt.export_safetensors(out, old, max_shard_size="5KB")
    assert _files(out) == [
        "README.md",
        "config.json",
        "eqx_ckpt.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(out, new), old, typematch=True)


@pytest.mark.parametrize("out", ["ckpt", "ckpt/weights.safetensors"])
def test_an_export_into_a_checkpoint_is_refused(tmp_path, out):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    before = snapshot(tmp_path / "ckpt")
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=r"holds an eqx_ckpt checkpoint.*Export to another"):
        eqx_ckpt.export_safetensors(tmp_path / out, eqx_ckpt.Checkpoint(tmp_path / "ckpt"))
    assert snapshot(tmp_path / "ckpt") == before


def test_cli_export_of_a_checkpoint_onto_itself_is_refused(tmp_path, capsys):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    before = snapshot(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ckpt")]) == 2
    assert "holds an eqx_ckpt checkpoint" in capsys.readouterr().err
    assert snapshot(tmp_path / "ckpt") == before


@pytest.mark.parametrize("shard", ["5GB", "0.3KB"])
def test_cli_export_writes_metadata_and_checkpoint_and_info_show_it(tmp_path, capsys, shard):
    """`eqx-ckpt export --metadata KEY=VALUE` (repeatable) fills every file's
    `__metadata__`; `Checkpoint(...).metadata`, `print` and `eqx-ckpt info` show it."""
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    out = tmp_path / "hf"
    args = ["export", str(tmp_path / "ckpt"), str(out), "--max-shard-size", shard]
    assert main([*args, "--metadata", "format=pt", "--metadata", "note=a=b"]) == 0
    files = sorted(out.glob("*.safetensors"))
    assert (len(files) == 1) == (shard == "5GB")
    for file in files:
        with safe_open(file, "np") as f:
            assert f.metadata() == {"format": "pt", "note": "a=b"}
    ckpt = eqx_ckpt.Checkpoint(out)
    assert ckpt.metadata == {"format": "pt", "note": "a=b"}
    assert "metadata: {'format': 'pt', 'note': 'a=b'}" in str(ckpt)
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "metadata:        format=pt" in shown and "metadata:        note=a=b" in shown
    # A key without `=`, or given twice with two values, is refused before anything is written.
    for bad, said in (
        (["--metadata", "format"], "must be KEY=VALUE"),
        (["--metadata", "a=1", "--metadata", "a=2"], "twice"),
    ):
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "other"), *bad]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "other").exists()


def test_shards_with_different_metadata_keep_every_value(tmp_path):
    out = tmp_path / "hf"
    tree = {"a": np.ones(64, np.float32), "b": np.zeros(64, np.float32)}
    eqx_ckpt.export_safetensors(out, tree, max_shard_size=300, metadata={"format": "pt", "part": "x"})
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(names) == 2
    # Rewrite the second shard's header with another `part`.
    save_file({"b": tree["b"]}, str(out / names[1]), metadata={"format": "pt", "part": "y"})
    assert eqx_ckpt.Checkpoint(out).metadata == {"format": "pt", f"{names[0]}:part": "x", f"{names[1]}:part": "y"}
    assert eqx_ckpt.Checkpoint(tmp_path / "hf" / names[1]).metadata == {"format": "pt", "part": "y"}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert eqx_ckpt.Checkpoint(tmp_path / "ckpt").metadata == {}


def test_cli_export_from_an_object_store(tmp_path, store):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(store, tree)
    out = tmp_path / "hf"
    code = main(
        [
            "export",
            json.dumps(store),
            str(out),
            "--format",
            "safetensors",
            "--max-shard-size",
            "0.3KB",
            "--rename",
            r"^model\.=",
            "--rename",
            "^step$",
        ]
    )
    assert code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "mlp.layers.0.weight" in index["weight_map"] and "step" not in index["weight_map"]
    back = eqx_ckpt.tree_deserialise_leaves(out, tree["model"])
    assert tree_equal(back, tree["model"], typematch=True)


def test_export_to_an_object_store(store):
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.int32)}
    assert eqx_ckpt.export_safetensors(store, tree, max_shard_size=24) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "eqx_ckpt.json",
        "README.md",
    ]
    bucket = ts.KvStore.open(store).result()
    assert load(bucket.read("model-00002-of-00002.safetensors").result().value)["w"].shape == (2, 3)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, tree), tree, typematch=True)


def test_cli_lists_other_formats(tmp_path, capsys):
    eqx_ckpt.export_safetensors(tmp_path / "one.safetensors", {"model": {"w": jnp.ones((2, 3))}, "step": 1})
    assert main(["ls", str(tmp_path / "one.safetensors")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [["model/"], ["w", "float32[2,3]"], ["step", "int64[]"]]
    assert main(["info", str(tmp_path / "one.safetensors")]) == 0
    assert "format:          safetensors" in capsys.readouterr().out


def test_a_sharded_directory_exported_onto_itself_keeps_its_values(tmp_path):
    # Shard 1 was replaced, then `b` was read from the new file at its old offset: garbage, no error.
    tree = {"a": np.arange(8, dtype=np.float32), "b": np.arange(4, dtype=np.float32) + 100, "c": np.ones(4, np.float32)}
    out = tmp_path / "hf"
    eqx_ckpt.export_safetensors(out, tree, max_shard_size=48)
    for metadata in ({"format": "pt", "about": "a header longer than before " * 4}, None):
        eqx_ckpt.export_safetensors(out, eqx_ckpt.Checkpoint(out), max_shard_size=32, metadata=metadata)
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(out, tree), tree, typematch=True)
    # The same file names, [a, b] + [c] before, [a] + [b, c] now: nothing else left behind.
    assert _files(out) == [
        "README.md",
        "eqx_ckpt.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    # A lazily loaded tree of the same files, into one file over them.
    lazy = eqx_ckpt.tree_deserialise_leaves(out, tree, lazy=True)
    eqx_ckpt.export_safetensors(out, lazy)
    assert _files(out) == ["README.md", "eqx_ckpt.json", "model.safetensors"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(out, tree), tree, typematch=True)


def test_an_export_onto_its_source_on_an_object_store_is_refused(store):
    tree = {"a": np.arange(8, dtype=np.float32), "b": np.arange(4, dtype=np.float32)}
    eqx_ckpt.export_safetensors(store, tree, max_shard_size=32)
    bucket = ts.KvStore.open(store).result()
    before = {key: bucket.read(key).result().value for key in bucket.list().result()}
    for source in (eqx_ckpt.Checkpoint(store), eqx_ckpt.tree_deserialise_leaves(store, tree, lazy=True)):
        with pytest.raises(eqx_ckpt.CheckpointExistsError, match="in the directory it writes to"):
            eqx_ckpt.export_safetensors(store, source, max_shard_size=32, metadata={"format": "pt"})
    assert {key: bucket.read(key).result().value for key in bucket.list().result()} == before


@pytest.mark.parametrize("key", ["é", "", "a/b", "x%2Ey", "sp ace"])
def test_tensor_names_load_back_as_the_same_keys(tmp_path, key):
    # Tensors were named by the escaped path (`a/b` -> `a%2Fb`), which reads back escaped twice.
    tree = {"m": {key: jnp.ones(2)}, key: np.arange(3)}
    eqx_ckpt.export_safetensors(tmp_path / "one.safetensors", tree)
    assert sorted(load_file(str(tmp_path / "one.safetensors"))) == sorted([f"m.{key}", key])
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path / "one.safetensors", tree)
    assert tree_equal(back, tree, typematch=True)


@pytest.mark.parametrize(("tree", "leaf"), [({"x.y": 1.0, "x%2Ey": 2.0}, "x%2Ey"), ({1: 1.0}, "%i1")])
def test_a_key_no_tensor_name_reads_back_as_is_refused(tmp_path, tree, leaf):
    # `x.y` was written as `x%2Ey`, which `x%2Ey`'s leaf then loaded.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(f"Leaf `{leaf}` in checkpoint '<export>': no safetensors")):
        eqx_ckpt.export_safetensors(tmp_path / "hf", tree)
    assert not (tmp_path / "hf").exists()
    # Named by `rename`, loaded back by the same `rename`.
    rename = {leaf: "renamed"}
    eqx_ckpt.export_safetensors(tmp_path / "hf", tree, rename=rename)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "hf", tree, rename=rename), tree)


@pytest.mark.parametrize("rename", [None, {"w": "__metadata__"}])
def test_a_tensor_named_metadata_is_refused(tmp_path, rename):
    # It overwrote the header's metadata: a file the safetensors library refuses, read as empty.
    tree = {"__metadata__" if rename is None else "w": np.ones(3, np.float32)}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("its tensor name would be `__metadata__`")):
        eqx_ckpt.export_safetensors(tmp_path / "m.safetensors", tree, rename=rename, metadata={"format": "pt"})
    assert list(tmp_path.iterdir()) == []


def test_an_abstract_tree_or_nothing_to_export_is_refused_before_any_file_changes(tmp_path):
    model = eqx.nn.MLP(4, 4, 8, 2, key=jax.random.key(0))
    out = tmp_path / "hf"
    eqx_ckpt.export_safetensors(out, model, max_shard_size=200)
    before = snapshot(out)
    # It wrote a file with no tensors and deleted the shards of the earlier export.
    skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 4, 4, 8, 2, key=jax.random.key(0))
    said = "leaf `layers.0.weight` (key path .layers[0].weight) in checkpoint '<export>': it is abstract (float32[8, 4]"
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(said) + ".*So are 5 other leaves") as info:
        eqx_ckpt.export_safetensors(out, skeleton)
    assert len(info.value.dotted) == 6
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("There is nothing to export")):
        eqx_ckpt.export_safetensors(out, model, rename=[(".*", None)])
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("There is nothing to export")):
        eqx_ckpt.export_safetensors(out / "x.safetensors", {"note": "text"})
    assert snapshot(out) == before


def test_numpy_scalars_export_and_bad_scalars_are_leaf_errors(tmp_path):
    # `np.float64` and `np.complex128` subclass Python's float and complex: a bare StopIteration.
    tree = {"lr": np.float64(1.5), "beta": np.float32(0.5), "step": np.int64(3), "flag": np.bool_(True)}
    eqx_ckpt.export_safetensors(tmp_path / "s.safetensors", tree)
    assert load_file(str(tmp_path / "s.safetensors"))["lr"].dtype == np.float64
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "s.safetensors", tree), tree, typematch=True)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("Leaf `z` in checkpoint '<export>': its dtype complex128")):
        eqx_ckpt.export_safetensors(tmp_path / "c.safetensors", {"z": np.complex128(1 + 2j)})
    # An int beyond int64: a bare OverflowError.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("Leaf `step` in checkpoint '<export>': the int 2361")):
        eqx_ckpt.export_safetensors(tmp_path / "i.safetensors", {"step": 2**71})
    assert _files(tmp_path) == ["s.safetensors"]


def test_an_export_that_fails_midway_leaves_the_destination_as_it_was(tmp_path):
    """A leaf that cannot be read (here a damaged chunk) after other shards were
    written: the error is raised, the earlier export stays whole and no
    `.partial` file is left behind."""
    tree = {name: np.arange(1_000_000, dtype=np.float32) + i for i, name in enumerate(("a", "b", "c"))}
    source, out = tmp_path / "ckpt", tmp_path / "hf"
    eqx_ckpt.tree_serialise_leaves(source, tree)
    eqx_ckpt.export_safetensors(out, source, max_shard_size=5_000_000)
    before = snapshot(out)
    assert len(_files(out)) == 6  # three shards, their index, eqx_ckpt.json and README.md
    chunks = [p for p in source.rglob("*") if p.is_file() and p.parent.name == "c" and p.parent.parent.name == "b"]
    assert len(chunks) == 1
    damaged = bytearray(chunks[0].read_bytes())
    damaged[100] ^= 0xFF
    chunks[0].write_bytes(bytes(damaged))
    with pytest.raises(eqx_ckpt.IntegrityError, match="`b`"):
        eqx_ckpt.export_safetensors(out, source, max_shard_size=5_000_000)
    assert snapshot(out) == before


@pytest.mark.parametrize("what", ["checkpoint", "lazy tree"])
def test_an_export_reads_stored_leaves_by_the_loads_reader(tmp_path, faults, what):
    """A stored leaf is exported as a load reads it (`load.read_stored`: the one
    reader of stored leaves, with its local reader and its check that the
    checkpoint was not replaced), once per array leaf; scalars are values."""
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    source = (
        eqx_ckpt.Checkpoint(tmp_path / "ckpt")
        if what == "checkpoint"
        else eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree, lazy=True)
    )
    reads = []
    faults(["load.read_stored"], lambda loc: reads.append(loc))
    eqx_ckpt.export_safetensors(tmp_path / "hf", source)
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]
    assert len(reads) == len(arrays) == 8
    exported = eqx_ckpt.tree_deserialise_leaves(tmp_path / "hf", tree)
    assert tree_equal(exported, tree, typematch=True)


def _exported(source, into):
    eqx_ckpt.export_safetensors(into, source, max_shard_size=300, info={"description": "d"}, card_path="hf://me/m")
    return {p.name: p.read_bytes() for p in sorted(into.iterdir())}


def test_the_same_tree_exports_as_the_same_bytes(tmp_path):
    """Issue 65 item 7: every file of an export (safetensors, `eqx_ckpt.json`,
    `README.md`) is the same, byte for byte, for the same tree (`created`
    once held the export's time). A checkpoint's export keeps the
    checkpoint's own `created`; an older export's `created` still reads."""
    first = _exported(_tree(), tmp_path / "a")
    assert len(first) > 4 and "created" not in json.loads(first["eqx_ckpt.json"])
    time.sleep(1.1)  # the export's time, to the second, once differed
    assert _exported(_tree(), tmp_path / "a") == first
    assert _exported(_tree(), tmp_path / "b") == first
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    of_checkpoint = _exported(ckpt, tmp_path / "c")
    assert _exported(ckpt, tmp_path / "c") == of_checkpoint
    assert json.loads(of_checkpoint["eqx_ckpt.json"])["created"] == ckpt.created != ""
    assert eqx_ckpt.Checkpoint(tmp_path / "c").created == ckpt.created
    fixture = places.FIXTURES / "published_1"
    assert eqx_ckpt.Checkpoint(fixture).created == "2026-11-26T18:51:00+00:00"


def test_prefix_exports_a_sub_tree_that_loads_as_it(tmp_path, capsys):
    """Issue 65 item 6: `prefix=` (and `--prefix`) exports the model of a
    training state without its optimiser state, its key paths relative to
    the prefix, so that it loads as the model."""
    model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
    state = {"model": model, "opt_state": {"mu": jnp.zeros(10), "count": 2}, "step": 3}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", state)
    stored = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    eqx_ckpt.export_safetensors(tmp_path / "out", stored, prefix="model")
    out = eqx_ckpt.Checkpoint(tmp_path / "out")
    assert sorted(out) == sorted(k.removeprefix("model.") for k in stored if k.startswith("model."))
    assert tree_equal(out.load(trust=[]), model, typematch=True)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "out", model), model, typematch=True)
    leaves = {leaf["path"]: leaf for leaf in json.loads((tmp_path / "out" / "eqx_ckpt.json").read_text())["leaves"]}
    assert leaves["layers.0.weight"]["keypath"] == [
        ["attr", "layers"],
        ["index", 0],
        ["attr", "weight"],
    ]
    # A tree, renamed after the prefix; the command line.
    eqx_ckpt.export_safetensors(tmp_path / "tree", state, prefix="opt_state", rename=[(r"^mu$", "m")])
    assert sorted(eqx_ckpt.Checkpoint(tmp_path / "tree")) == ["count", "m"]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--prefix", "model"]) == 0
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "cli").load(trust=[]), model, typematch=True)
    for prefix, error, message in [
        (
            "opt",
            eqx_ckpt.CheckpointKeyError,
            "`prefix` 'opt' names no sub-tree of it: pass the dotted path of a sub-tree to export "
            "(its top-level keys: model, opt_state, step).",
        ),
        ("step", eqx_ckpt.CheckpointKeyError, "`prefix` 'step' names a leaf, not a sub-tree"),
        (3, eqx_ckpt.CheckpointTypeError, "`prefix` must be a dotted path such as 'model', not int."),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            eqx_ckpt.export_safetensors(tmp_path / "bad", stored, prefix=prefix)
    assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bad"), "--prefix", "opt"]) == 2
    assert "`prefix` 'opt' names no sub-tree of it" in capsys.readouterr().err


def test_cli_export_fills_the_card(tmp_path):
    """`--license`, `--base-model` (repeatable) and `--code` reach the card."""
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    args = ["--license", "mit", "--base-model", "me/base", "--base-model", "me/other", "--code", "mypkg"]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), *args]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith('---\nlibrary_name: eqx_ckpt\nlicense: "mit"\nbase_model:\n- "me/base"\n- "me/other"\n')
    assert "The model's code (its classes, for `trust`): `pip install mypkg`.\n" in card


def test_published_files_name_no_path_of_the_machine_that_wrote_them(tmp_path, monkeypatch):
    """Issue 88, point 9: an export wrote its folder's absolute path into
    `README.md` (`Checkpoint("/tmp/...")`) and into a fine-tune's metadata
    (`eqx_ckpt.standalone`). Exports by absolute paths, from Python and from
    the CLI, a base and a fine-tune of it: no byte of any file written holds
    the folder's path, its parents', the home directory or the working one."""
    root = (tmp_path / "exporter-8f3c1a-private").resolve()
    root.mkdir()
    monkeypatch.chdir(tmp_path)
    base = {"w": np.ones(300, np.float32), "b": np.zeros(3, np.float32)}
    eqx_ckpt.export_safetensors(root / "base", base)
    eqx_ckpt.export_safetensors(root / "tuned", dict(base, b=np.ones(3, np.float32)), base=root / "base")
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", base)
    assert main(["export", str(tmp_path / "ckpt"), str(root / "cli")]) == 0
    assert main(["export", str(root / "tuned"), str(root / "whole"), "--standalone"]) == 0
    assert eqx_ckpt.Checkpoint(root / "tuned").base is not None  # a fine-tune indeed
    places = {str(root), str(tmp_path), str(tmp_path.parent), str(pathlib.Path.home()), str(pathlib.Path.cwd())}
    places |= {str(root.relative_to(root.anchor))}  # the path without its leading slash
    places = {place for place in places if len(place) > 1}  # a home of "/" is in every path
    written = [path for path in root.rglob("*") if path.is_file()]
    assert {path.parent.name for path in written} == {"base", "tuned", "cli", "whole"}
    for path in written:
        data = path.read_bytes()
        assert not [place for place in places if place.encode() in data], path
    card = (root / "tuned" / "README.md").read_text()
    assert 'Checkpoint("tuned")' in card and "export --standalone tuned <folder>" in card


def test_pushed_files_name_no_path_of_the_machine_that_pushed_them(hub, tmp_path):
    """Issue 88, point 9, for the Hub: a checkpoint, a base and a fine-tune of
    it pushed from folders under a distinctive path (the fine-tune stored
    against the pushed base), with the standalone and base options: no byte of
    any file the server received holds that path, its parents' or the pusher's
    working folder."""
    root = (tmp_path / "pusher-5e9d2b-private").resolve()
    root.mkdir()
    base = {"w": np.ones(300, np.float32), "b": np.zeros(3, np.float32)}
    eqx_ckpt.tree_serialise_leaves(root / "ckpt", base)
    eqx_ckpt.export_safetensors(root / "base", base)
    eqx_ckpt.export_safetensors(root / "tuned", dict(base, b=np.ones(3, np.float32)), base=root / "base")
    client, state = hub
    client.run(
        f"eqx_ckpt.push_to_hub({str(root / 'ckpt')!r}, 'me/ckpt')\n"
        f"eqx_ckpt.push_to_hub({str(root / 'base')!r}, 'me/base')\n"
        f"eqx_ckpt.push_to_hub({str(root / 'tuned')!r}, 'me/tuned', base='hf://me/base')\n"
        f"eqx_ckpt.push_to_hub({str(root / 'tuned')!r}, 'me/whole', standalone=True)\n"
        "emit(True)"
    )
    blobs = dict(state.blobs)
    pushed = {repo: state.repos[repo].commits for repo in ("me/ckpt", "me/base", "me/tuned", "me/whole")}
    assert all(pushed.values()) and len(blobs) >= 8
    # The cards and records were among them (each names its repository).
    assert any(b"me/tuned" in data and b"Checkpoint(" in data for data in blobs.values())
    places = {str(root), str(tmp_path), str(tmp_path.parent), str(tmp_path / "hf"), str(root.relative_to(root.anchor))}
    for sha, data in blobs.items():
        assert not [place for place in places if place.encode() in data], (sha, data[:200])
