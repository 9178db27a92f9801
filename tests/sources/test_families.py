"""Model families: `export_safetensors(..., base=)` and `eqx-ckpt export --base`
write a fine-tune as the leaves that differ from a pinned base, matched by
content (never by name alone); every load of the fine-tune reads the rest
from the base, bit for bit, whatever the base is (a published folder, in one
file or in shards; an eqx_ckpt checkpoint, its tiny leaves packed or not).

Covered here: what the folder holds (its safetensors, named and labelled as
a fine-tune's, its `eqx_ckpt.json` version 3 with the base's pin and each
taken leaf, every leaf's digest, the card); every load option on a fine-tune; leaves matched by content (renamed,
re-wrapped); nothing or everything changed; a base missing, changed since or
lacking a leaf, each an error naming the base with nothing loaded; standalone
exports (the library and the command line); a re-export keeping its base; a
chain of fine-tunes, and its depth limit; damaged or hostile records; a
fine-tune moved together with its base. (Hub bases are tested in
tests/sources/test_hub.py.)"""

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import places
import pytest
from arrays import bits
from families import (  # noqa: F401
    BASES,
    CHANGED,
    Classifier,
    Family,
    _assert_same,
    _base_tree,
    _blake3,
    _by_path,
    _digest,
    _finetuned,
    _leaves,
    _like,
    _make_base,
    _model,
    _no_reads,
    _record,
    _stored_bytes,
    _tensors,
)
from safetensors import safe_open

import eqx_ckpt
from eqx_ckpt._ondisk._published import VERSION
from eqx_ckpt._tools._cli import main

# The folder and its record.


def test_a_finetune_holds_only_the_leaves_it_changed(family):
    assert sorted(_tensors(family.finetune)) == CHANGED
    record = _record(family.finetune)
    assert record["format_version"] == VERSION
    sha256 = hashlib.sha256(family.record_file.read_bytes()).hexdigest()
    assert record["base"] == {"path": os.path.join("..", "base"), "sha256": sha256}
    assert (family.finetune / record["base"]["path"]).resolve() == family.base.resolve()
    leaves = _leaves(family.finetune)
    expected = _by_path(family.tree)
    assert sorted(leaves) == sorted(expected) and record["leaf_count"] == len(expected)
    for path, leaf in leaves.items():
        # Every leaf's digest is of its stored bytes; each leaf not changed names the base's leaf.
        assert leaf["digest"] == _digest(expected[path]), path
        assert leaf.get("base") == (None if path in CHANGED else path), path
    # What the folder stores is the fine-tune's own values.
    for path, data in _tensors(family.finetune).items():
        assert data == _stored_bytes(expected[path]), path


def test_an_export_without_a_base_is_the_current_version_with_every_digest(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    record = _record(tmp_path / "base")
    assert record["format_version"] == VERSION and "base" not in record
    stored = _tensors(tmp_path / "base")
    for path, leaf in _leaves(tmp_path / "base").items():
        assert "base" not in leaf
        assert leaf["digest"] == _blake3(stored[path]), path


# A fine-tune's files: named and labelled for what they hold.


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".json")))


def _label(folder: pathlib.Path, name: str) -> dict[str, str]:
    """The `__metadata__` of the file `name` of the fine-tune `folder`."""
    with safe_open(str(folder / name), framework="np") as f:
        metadata = f.metadata()
    assert metadata == {
        "eqx_ckpt.fine_tune": (
            "This file holds only the tensors of a fine-tune that differ from its base. It is not a whole "
            "model: eqx_ckpt reads the other tensors from the base."
        ),
        "eqx_ckpt.base": os.path.join("..", "base"),
        # The folder by its name (issue 88, point 9): run where it is.
        "eqx_ckpt.standalone": f"eqx-ckpt export --standalone {folder.name} <folder>",
    }
    return metadata


def test_a_finetunes_files_say_what_they_hold(family, monkeypatch):
    """Its tensors are in `finetune.safetensors`, never under the name a
    loader takes for a whole model; the file's metadata names the base and
    the command that makes a standalone copy."""
    from safetensors.numpy import load_file

    assert _files(family.finetune) == ["eqx_ckpt.json", "finetune.safetensors"]
    command = _label(family.finetune, "finetune.safetensors")["eqx_ckpt.standalone"]
    # A loader that looks for a whole model's file finds none.
    with pytest.raises(FileNotFoundError):
        load_file(str(family.finetune / "model.safetensors"))
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    assert ckpt.metadata["eqx_ckpt.standalone"] == command
    assert eqx_ckpt.verify(family.finetune) == []
    # The command does what it says: a copy that loads with the base gone.
    argv = shlex.split(command.replace("<folder>", str(family.finetune.parent / "whole")))
    monkeypatch.chdir(family.finetune.parent)  # the command names the folder by its name
    assert argv[0] == "eqx-ckpt" and main(argv[1:]) == 0
    assert _files(family.finetune.parent / "whole") == ["eqx_ckpt.json", "model.safetensors"]
    with safe_open(str(family.finetune.parent / "whole" / "model.safetensors"), framework="np") as f:
        assert not f.metadata()
    shutil.rmtree(family.base)
    _assert_same(eqx_ckpt.Checkpoint(family.finetune.parent / "whole").load(trust=[Classifier]), family.tree)


def test_a_sharded_finetunes_files_say_what_they_hold(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base", max_shard_size=8)
    shards = [f"finetune-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert _files(tmp_path / "ft") == sorted(["eqx_ckpt.json", "finetune.safetensors.index.json", *shards])
    index = json.loads((tmp_path / "ft" / "finetune.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards and sorted(index["weight_map"]) == CHANGED
    for name in shards:
        _label(tmp_path / "ft", name)
    assert "- `finetune.safetensors.index.json`" in (tmp_path / "ft" / "README.md").read_text()
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[Classifier]), _finetuned(tree))
    assert eqx_ckpt.verify(tmp_path / "ft") == []


def test_a_finetunes_label_keeps_the_users_metadata_and_its_bytes_are_the_same_each_time(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base", metadata={"format": "pt"})
    first = {p.name: p.read_bytes() for p in (tmp_path / "ft").iterdir()}
    with safe_open(str(tmp_path / "ft" / "finetune.safetensors"), framework="np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["eqx_ckpt.base"] == os.path.join("..", "base")
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base", metadata={"format": "pt"})
    assert {p.name: p.read_bytes() for p in (tmp_path / "ft").iterdir()} == first
    # Keys under `eqx_ckpt.` are the library's: refused, nothing written.
    said = "`metadata` has the key 'eqx_ckpt.base': keys starting with 'eqx_ckpt.' are the ones eqx_ckpt writes"
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(said)):
        eqx_ckpt.export_safetensors(tmp_path / "mine", tree, metadata={"eqx_ckpt.base": "elsewhere"})
    assert not (tmp_path / "mine").exists()
    # A folder's name as a shell reads it.
    eqx_ckpt.export_safetensors(tmp_path / "my ft", _finetuned(tree), base=tmp_path / "base")
    with safe_open(str(tmp_path / "my ft" / "finetune.safetensors"), framework="np") as f:
        command = f.metadata()["eqx_ckpt.standalone"]
    assert shlex.split(command) == ["eqx-ckpt", "export", "--standalone", "my ft", "<folder>"]


@pytest.mark.parametrize("sharded", [False, True])
def test_an_export_into_a_folder_switching_between_finetune_and_whole_deletes_the_other_files(tmp_path, sharded):
    """A fine-tune exported again whole into its folder (or a whole model
    exported again as a fine-tune) leaves no file of the other layout, which
    a load would refuse beside the new one."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    shard = 8 if sharded else "5GB"
    finetuned, folder = _finetuned(tree), tmp_path / "ft"
    eqx_ckpt.export_safetensors(folder, finetuned, base=tmp_path / "base", max_shard_size=shard)
    assert all(n.startswith(("finetune", "eqx_ckpt")) for n in _files(folder))
    eqx_ckpt.export_safetensors(folder, finetuned, max_shard_size=shard)
    assert all(n.startswith(("model", "eqx_ckpt")) for n in _files(folder))
    assert _record(folder)["format_version"] == VERSION
    _assert_same(eqx_ckpt.Checkpoint(folder).load(trust=[Classifier]), finetuned)
    eqx_ckpt.export_safetensors(folder, eqx_ckpt.Checkpoint(folder), base=tmp_path / "base", max_shard_size=shard)
    assert all(n.startswith(("finetune", "eqx_ckpt")) for n in _files(folder)) and sorted(_tensors(folder)) == CHANGED
    _assert_same(eqx_ckpt.Checkpoint(folder).load(trust=[Classifier]), finetuned)


@pytest.mark.parametrize("shard", ["5GB", 8])
def test_a_finetune_on_a_store_that_is_not_listed_is_found_by_its_names(tmp_path, shard):
    """Where a folder is not listed (an object store), a load tries a
    fine-tune's index and file after a whole model's."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    folder = f"memory://{tmp_path.name}-{shard}/ft/"
    with pytest.warns(UserWarning, match="loads of it need the base given"):
        names = eqx_ckpt.export_safetensors(folder, _finetuned(tree), base=tmp_path / "base", max_shard_size=shard)
    assert names[0] == ("finetune.safetensors" if shard == "5GB" else "finetune-00001-of-00003.safetensors")
    ckpt = eqx_ckpt.Checkpoint(folder, base=tmp_path / "base")
    assert ckpt.metadata["eqx_ckpt.standalone"] == f"eqx-ckpt export --standalone {folder} <folder>"
    _assert_same(ckpt.load(trust=[Classifier]), _finetuned(tree))


def _copy(source: pathlib.Path, folder: pathlib.Path, names: list[str]) -> None:
    for name in names:
        shutil.copy(source / name, folder / name)


def test_a_folder_holding_a_whole_models_files_and_a_finetunes_is_refused_naming_both(tmp_path):
    """Which of two layouts is the model is never guessed: one file of each
    stem, an index with a single file of the other stem, two indexes."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.export_safetensors(tmp_path / "whole", tree, max_shard_size=200)
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
    eqx_ckpt.export_safetensors(tmp_path / "ft_sharded", _finetuned(tree), base=tmp_path / "base", max_shard_size=8)
    (tmp_path / "both").mkdir()
    _copy(tmp_path / "base", tmp_path / "both", ["model.safetensors", "eqx_ckpt.json"])
    _copy(tmp_path / "ft", tmp_path / "both", ["finetune.safetensors"])
    indexed = [n for n in _files(tmp_path / "ft_sharded") if n.startswith("finetune")]
    assert len(indexed) > 2
    cases = {
        "both": "the single files `model.safetensors` and `finetune.safetensors`",
        "ft_sharded": "the index `finetune.safetensors.index.json` and the single file `model.safetensors`, which "
        "it does not name",
        "whole": "the index `model.safetensors.index.json` and the single file `finetune.safetensors`, which it "
        "does not name",
    }
    _copy(tmp_path / "base", tmp_path / "ft_sharded", ["model.safetensors"])
    _copy(tmp_path / "ft", tmp_path / "whole", ["finetune.safetensors"])
    for name, held in cases.items():
        said = f"it holds two layouts at once, {held}; which one is the model is not said, so nothing is loaded"
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
            eqx_ckpt.Checkpoint(tmp_path / name)
        problems = eqx_ckpt.verify(tmp_path / name)
        assert len(problems) == 1 and said in problems[0].message
    (tmp_path / "whole" / "finetune.safetensors").unlink()
    _copy(tmp_path / "ft_sharded", tmp_path / "whole", ["finetune.safetensors.index.json"])
    said = "it holds two layouts at once, 2 indexes (finetune.safetensors.index.json, model.safetensors.index.json)"
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(tmp_path / "whole")


def test_a_version_2_finetune_exported_again_is_version_3_and_leaves_no_model_file(tmp_path):
    """A fine-tune written before version 3 (its tensors in `model.safetensors`,
    the compatibility fixture) loads; exported again into its own folder it
    is version 3, and its `model.safetensors` is gone."""
    fixture = places.FIXTURES / "published_2"
    shutil.copytree(fixture, tmp_path / "family")
    folder = tmp_path / "family" / "finetune"
    before = eqx_ckpt.Checkpoint(folder).load(trust=[])
    eqx_ckpt.export_safetensors(folder, eqx_ckpt.Checkpoint(folder))
    assert _files(folder) == ["eqx_ckpt.json", "finetune.safetensors"] and _record(folder)["format_version"] == VERSION
    after = eqx_ckpt.Checkpoint(folder).load(trust=[])
    assert jax.tree.structure(after) == jax.tree.structure(before)  # (NaNs among them: compared bit for bit)
    assert [bits(x) for x in jax.tree.leaves(after)] == [bits(x) for x in jax.tree.leaves(before)]


# Every load option reads the base's leaves.


def test_a_finetune_loads_bit_for_bit_without_like(family):
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    assert sorted(ckpt) == sorted(_by_path(family.tree))
    _assert_same(ckpt.load(trust=[Classifier]), family.tree)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, None, trust=[Classifier]), family.tree)
    _assert_same(ckpt.load("model", trust=[Classifier]), family.tree["model"])
    _assert_same(eqx_ckpt.materialise(ckpt.load(trust=[Classifier], lazy=True)), family.tree)
    skeleton = ckpt.skeleton(trust=[Classifier])
    _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, skeleton), family.tree)
    with pytest.raises(eqx_ckpt.CheckpointError, match=r"families:Classifier"):
        ckpt.load(trust=[])


def test_a_finetune_loads_bit_for_bit_into_like(family):
    like = _like(family.tree)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, like), family.tree)
    # A part: the selected sub-trees (from the base, and the fine-tune's own), nothing else.
    part = eqx_ckpt.tree_deserialise_leaves(
        family.finetune, like, where=lambda t: (t["model"].body.layers[0], t["model"].head, t["embed"])
    )
    _assert_same(part["model"].body.layers[0], family.tree["model"].body.layers[0])
    _assert_same(part["model"].head, family.tree["model"].head)
    _assert_same(part["embed"], family.tree["embed"])
    assert part["step"] == 0 and part["lr"] == 0.0 and part["key"] is like["key"]
    assert part["model"].body.layers[1].weight is like["model"].body.layers[1].weight
    # By prefix: a sub-tree, and one leaf taken from the base.
    model = eqx_ckpt.tree_deserialise_leaves(family.finetune, like["model"], prefix="model")
    _assert_same(model, family.tree["model"])
    layer = eqx_ckpt.tree_deserialise_leaves(
        family.finetune, like["model"].body.layers[1], prefix="model.body.layers.1"
    )
    _assert_same(layer, family.tree["model"].body.layers[1])


def test_a_finetune_loads_lazily_and_in_slices(family):
    tree = family.tree
    lazy = eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(tree), lazy=True)
    for leaf in (lazy["model"].body.layers[0].weight, lazy["model"].head.weight, lazy["embed"], lazy["key"]):
        assert isinstance(leaf, eqx_ckpt.LazyArray)
    assert bits(lazy["key"].read()) == bits(tree["key"])
    _assert_same(eqx_ckpt.materialise(lazy), tree)
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    weight = ckpt["model.body.layers.0.weight"]  # the base's
    assert isinstance(weight, eqx_ckpt.LazyArray) and weight.shape == (5, 3)
    expected = np.asarray(tree["model"].body.layers[0].weight)
    assert np.asarray(weight[1:4, ::2]).tobytes() == expected[1:4, ::2].tobytes()
    assert np.asarray(ckpt["embed"][2]).tobytes() == np.asarray(tree["embed"][2]).tobytes()
    assert np.asarray(ckpt["model.head.bias"][1:]).tobytes() == np.asarray(tree["model"].head.bias[1:]).tobytes()
    assert np.asarray(ckpt["ids"][::2]).tobytes() == tree["ids"][::2].tobytes()
    assert bits(ckpt["key"].read()) == bits(tree["key"])
    assert bits(ckpt["lr"]) == bits(0.25) and bits(ckpt["step"]) == bits(4)


def test_load_or_initialise_reads_a_finetune_and_its_base(family):
    def init():
        return {"model": _model(9), "embed": jnp.zeros((3, 4), jnp.bfloat16), "step": 0, "extra": jnp.ones(2)}

    grown = eqx_ckpt.load_or_initialise(family.finetune, init)
    _assert_same(grown["model"], family.tree["model"])
    _assert_same(grown["embed"], family.tree["embed"])
    assert bits(grown["step"]) == bits(4) and grown["extra"].tolist() == [1.0, 1.0]


# Matched by content.


def test_leaves_are_matched_by_content_never_by_name(tmp_path):
    """A weight renamed or re-wrapped (a LoRA-like wrapper) takes the base's
    leaf under its other name; a leaf of the same name but other bytes, or the
    same bytes as another dtype or shape, is stored."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    base = {"w": w, "b": np.ones(4, np.float32), "zeros": np.zeros(6, np.int32), "more_zeros": np.zeros(6, np.int32)}
    eqx_ckpt.export_safetensors(tmp_path / "base", base)
    tree = {
        "lora": {"w": w.copy(), "a": np.full((4, 2), 0.5, np.float32)},  # the base's `w`, re-wrapped
        "bias": np.ones(4, np.float32),  # the base's `b`, renamed
        "b": np.full(4, 2.0, np.float32),  # the base's name, other bytes
        "as_ints": w.view(np.int32),  # the base's `w` bytes, another dtype
        "flat": w.reshape(-1),  # the base's `w` bytes, another shape
        "more_zeros": np.zeros(6, np.int32),  # two base leaves hold its bytes: its own name first
    }
    eqx_ckpt.export_safetensors(tmp_path / "ft", tree, base=tmp_path / "base")
    taken = {path: leaf["base"] for path, leaf in _leaves(tmp_path / "ft").items() if "base" in leaf}
    assert taken == {"lora.w": "w", "bias": "b", "more_zeros": "more_zeros"}
    assert sorted(_tensors(tmp_path / "ft")) == ["as_ints", "b", "flat", "lora.a"]
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tree)), tree)
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[]), tree)
    # `diff` of the base and the fine-tune pairs the re-wrapped weight with the
    # base's, read and found the same bytes (issue 88.7g); `bias` is added beside
    # a `b` in both, so no leaf moved.
    changes = eqx_ckpt.diff(tmp_path / "base", tmp_path / "ft")
    assert changes.rewrapped == (("w", "lora.w"),)
    assert "+ lora.w: the same bytes as `w`, re-wrapped" in list(changes)
    assert "- w: the same bytes now at `lora.w`" in list(changes)
    assert "! b: values differ" in list(changes) and "zeros" in changes.removed
    back = eqx_ckpt.diff(tmp_path / "ft", tmp_path / "base")
    assert back.rewrapped == (("lora.w", "w"),)
    assert eqx_ckpt.diff(tmp_path / "base", tmp_path / "ft", values=False).rewrapped == ()
    # A base given as a `Checkpoint` is the same base: the same record.
    eqx_ckpt.export_safetensors(tmp_path / "ft2", tree, base=eqx_ckpt.Checkpoint(tmp_path / "base"))
    assert (tmp_path / "ft2" / "eqx_ckpt.json").read_bytes() == (tmp_path / "ft" / "eqx_ckpt.json").read_bytes()


def test_a_leaf_of_another_type_with_the_same_bytes_loads_as_its_own_type(tmp_path):
    """The base stores NumPy arrays and a Python float; the fine-tune, JAX arrays
    and a NumPy float64 of the same bytes: it takes them, and loads them as
    its own types."""
    base = {"w": np.arange(4, dtype=np.float32), "lr": 0.5}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", base)
    tree = {"w": jnp.arange(4, dtype=jnp.float32), "lr": np.float64(0.5), "new": jnp.ones(2)}
    eqx_ckpt.export_safetensors(tmp_path / "ft", tree, base=tmp_path / "base")
    assert sorted(_tensors(tmp_path / "ft")) == ["new"]
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[]), tree)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", tree), tree)


@pytest.mark.parametrize("changed", ["nothing", "everything"])
@pytest.mark.parametrize("kind", ["published", "checkpoint"])
def test_nothing_or_everything_changed(tmp_path, changed, kind):
    tree = _base_tree()
    _make_base(kind, tmp_path / "base", tree)
    if changed == "everything":
        tree = {
            "model": jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, tree["model"]),
            "embed": tree["embed"] * 2,
            "ids": tree["ids"] + 1,
            "mask": ~tree["mask"],
            "key": jax.random.key(1),
            "step": 5,
            "lr": 0.125,
        }
    eqx_ckpt.export_safetensors(tmp_path / "ft", tree, base=tmp_path / "base")
    record = _record(tmp_path / "ft")
    taken = [path for path, leaf in _leaves(tmp_path / "ft").items() if "base" in leaf]
    if changed == "nothing":
        assert record["format_version"] == VERSION and record["base"]["path"] == os.path.join("..", "base")
        assert sorted(p.name for p in (tmp_path / "ft").glob("*.safetensors")) == ["finetune.safetensors"]
        assert _tensors(tmp_path / "ft") == {} and sorted(taken) == sorted(_by_path(tree))
    else:  # nothing taken from the base: a standalone folder, which loads without it
        assert record["format_version"] == VERSION and "base" not in record
        assert sorted(_tensors(tmp_path / "ft")) == sorted(_by_path(tree)) and taken == []
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[Classifier]), tree)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tree)), tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tree), lazy=True)
    _assert_same(eqx_ckpt.materialise(lazy), tree)


# A base missing, changed or not the one the fine-tune was made from.


def _every_load(folder: pathlib.Path, tree: Any, *, opened: bool = True) -> list[Any]:
    """Every kind of load that reads leaves taken from the base (a load of
    only the leaves a fine-tune stores needs no base: tests/sources/test_family_missing.py);
    `opened`: and the opening of a `Checkpoint`, which checks a base it finds."""
    return [
        *([lambda: eqx_ckpt.Checkpoint(folder)] if opened else []),
        lambda: eqx_ckpt.Checkpoint(folder).load(trust=[Classifier]),
        lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree)),
        lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree), lazy=True),
        lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree), where=lambda t: t["model"].body),
        lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree["model"]), prefix="model"),
        lambda: eqx_ckpt.load_or_initialise(folder, lambda: {"model": _model(9)}),
    ]


def test_a_missing_base_is_an_error_naming_it(family, faults):
    shutil.rmtree(family.base)
    reads = _no_reads(faults)
    said = re.escape(
        f"{str(family.finetune)!r} is a fine-tune that holds only the leaves it changed; the others are read from its "
        f"base {str(family.base)!r}, which cannot be found: "
    )
    for load in _every_load(family.finetune, family.tree, opened=False):
        with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=said + ".*three ways work"):
            load()
    assert reads == []
    assert eqx_ckpt.Checkpoint(family.finetune).base_missing.startswith("There is no")


def test_each_of_the_three_ways_the_missing_base_error_names_works(tmp_path, capsys):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    tuned, ft, elsewhere = _finetuned(tree), str(tmp_path / "ft"), str(tmp_path / "moved" / "base")
    eqx_ckpt.export_safetensors(ft, tuned, base=tmp_path / "base")
    shutil.move(tmp_path / "base", elsewhere)
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError) as missing:
        eqx_ckpt.Checkpoint(ft).load(trust=[Classifier])
    said = str(missing.value)
    assert "`base=BASE` in Python, or `--with-base BASE` on the command line" in said
    assert f"2. Put the copy back at {str(tmp_path / 'base')!r}, where the record names the base" in said
    assert f"`eqx-ckpt export --standalone {ft} OUT --with-base BASE`" in said
    # The same error on the command line names the flags, not the keywords (issue 88).
    capsys.readouterr()
    assert main(["export", ft, str(tmp_path / "out")]) == 2
    cli = capsys.readouterr().err
    assert "1. Give the copy: `--with-base BASE` (" in cli and "`base=" not in cli and "in Python" not in cli
    # 1. The base given, in Python and on the CLI.
    _assert_same(eqx_ckpt.Checkpoint(ft, base=elsewhere).load(trust=[Classifier]), tuned)
    assert main(["ls", ft, "--with-base", elsewhere]) == 0
    # Stored again against the base where it is now (beside it: followed on its own). (The second way,
    # the copy put back, is followed in tests/sources/test_family_told.py.)
    again = str(tmp_path / "moved" / "ft")
    assert main(["export", ft, again, "--with-base", elsewhere, "--base", elsewhere]) == 0
    _assert_same(eqx_ckpt.Checkpoint(again).load(trust=[Classifier]), tuned)
    # 3. A standalone copy, which needs no base.
    assert main(["export", "--standalone", ft, str(tmp_path / "alone"), "--with-base", elsewhere]) == 0
    shutil.rmtree(elsewhere)
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "alone").load(trust=[Classifier]), tuned)


def test_a_base_changed_since_is_an_error_naming_it(family, faults):
    """Re-exported or re-saved with other values, the same structure: its
    record's sha256 is not the pinned one."""
    changed = jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, family.base_tree)
    _make_base(family.kind, family.base, changed)
    reads = _no_reads(faults)
    said = re.escape(f"is a fine-tune of the base {str(family.base)!r} as it was when the fine-tune was exported")
    for load in _every_load(family.finetune, family.tree):
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=said + ".*that base has changed since"):
            load()
    assert reads == []


def test_a_base_replaced_after_the_finetune_was_opened_is_detected(family):
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    lazy = eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(family.tree), lazy=True)
    _make_base(
        family.kind, family.base, jax.tree.map(lambda x: x * 2 if eqx.is_inexact_array(x) else x, family.base_tree)
    )
    for read in (
        lambda: ckpt["model.body.layers.0.weight"][:2],
        lambda: lazy["embed"].read(),
        lambda: ckpt.load(trust=[Classifier]),
        lambda: eqx_ckpt.materialise(lazy),
    ):
        with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape(str(family.base))):
            read()


@pytest.mark.parametrize(
    ("reference", "why"),
    [
        ("model.body.nothere", "has no leaf 'model.body.nothere'"),
        (
            "model.body.layers.0.bias",
            "stores its leaf 'model.body.layers.0.bias' as float32[5], not as the float32[5, 3]",
        ),
    ],
)
def test_a_base_lacking_a_leaf_or_storing_it_otherwise_is_an_error(family, faults, reference, why):
    """The fine-tune names a base leaf the base lacks, or holds with another
    shape. (A base cannot lose a leaf without its pinned record changing, so
    the fine-tune's record is edited to name one.)"""
    record = _record(family.finetune)
    (edited,) = [leaf for leaf in record["leaves"] if leaf["path"] == "model.body.layers.0.weight"]
    edited["base"] = reference
    (family.finetune / "eqx_ckpt.json").write_text(json.dumps(record))
    reads = _no_reads(faults)
    name = "'model.body.layers.0.weight'"
    said = re.escape(f"{str(family.finetune)!r} takes its leaf {name} from its base {str(family.base)!r}, which {why}")
    for load in _every_load(family.finetune, family.tree):
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=said + ".*nothing is loaded"):
            load()
    assert reads == []


def test_verify_checks_the_leaves_a_finetune_takes_from_its_base(tmp_path, unpacked):
    tree = {"w": np.arange(64, dtype=np.float32), "b": np.ones(3, np.float32)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", {**tree, "b": np.zeros(3, np.float32)}, base=tmp_path / "base")
    assert sorted(_tensors(tmp_path / "ft")) == ["b"]
    assert eqx_ckpt.verify(tmp_path / "ft") == []
    (chunk,) = [p for p in (tmp_path / "base" / "w").rglob("*") if p.is_file() and p.name != "zarr.json"]
    damaged = bytearray(chunk.read_bytes())
    damaged[10] ^= 0xFF
    chunk.write_bytes(bytes(damaged))
    problems = eqx_ckpt.verify(tmp_path / "ft")
    assert [p.leaf for p in problems] == ["w"] and str(chunk) in problems[0].message
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(f"Leaf `w` in checkpoint {str(tmp_path / 'ft')!r}")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", tree)


# Standalone exports, and exports that keep the base.


def test_a_standalone_export_holds_every_leaf_and_loads_without_the_base(family):
    out = family.finetune.parent / "standalone"
    eqx_ckpt.export_safetensors(out, eqx_ckpt.Checkpoint(family.finetune), standalone=True)
    record = _record(out)
    assert record["format_version"] == VERSION and "base" not in record
    assert all("base" not in leaf for leaf in record["leaves"])
    expected = _by_path(family.tree)
    assert {name: data for name, data in _tensors(out).items()} == {p: _stored_bytes(x) for p, x in expected.items()}
    card = (out / "README.md").read_text()
    assert "fine-tune" not in card and "--standalone" not in card
    shutil.rmtree(family.base)
    _assert_same(eqx_ckpt.Checkpoint(out).load(trust=[Classifier]), family.tree)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(out, _like(family.tree)), family.tree)


def test_a_reexport_keeps_the_description_license_and_base_models(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    about = {"license": "mit", "base_model": ["me/base", "me/other"], "info": {"description": "A head."}}
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base", **about)
    eqx_ckpt.export_safetensors(tmp_path / "alone", eqx_ckpt.Checkpoint(tmp_path / "ft"), standalone=True)
    assert eqx_ckpt.Checkpoint(tmp_path / "alone").info == {"description": "A head."}
    front = (tmp_path / "alone" / "README.md").read_text().split("\n---", 1)[0]
    assert 'license: "mit"' in front and 'base_model:\n- "me/base"\n- "me/other"' in front
    # What the export is given wins.
    eqx_ckpt.export_safetensors(tmp_path / "mine", eqx_ckpt.Checkpoint(tmp_path / "ft"), license="apache-2.0", info={})
    assert eqx_ckpt.Checkpoint(tmp_path / "mine").info == {}
    assert 'license: "apache-2.0"' in (tmp_path / "mine" / "README.md").read_text()


def test_the_cli_exports_against_a_base_and_standalone(tmp_path, capsys):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    finetuned = _finetuned(tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", finetuned)
    # --base: the same folder as the library writes for the same checkpoint.
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--base", str(tmp_path / "base")]) == 0
    eqx_ckpt.export_safetensors(tmp_path / "lib", eqx_ckpt.Checkpoint(tmp_path / "ckpt"), base=tmp_path / "base")
    assert sorted(_tensors(tmp_path / "cli")) == CHANGED
    assert _record(tmp_path / "cli") == _record(tmp_path / "lib")
    assert _record(tmp_path / "cli")["base"]["path"] == os.path.join("..", "base")
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "cli").load(trust=[Classifier]), finetuned)
    # --standalone: every leaf; it loads with the base gone.
    assert main(["export", str(tmp_path / "cli"), str(tmp_path / "alone"), "--standalone"]) == 0
    eqx_ckpt.export_safetensors(tmp_path / "lib_alone", eqx_ckpt.Checkpoint(tmp_path / "lib"), standalone=True)
    assert _record(tmp_path / "alone")["format_version"] == VERSION
    assert (tmp_path / "alone" / "model.safetensors").read_bytes() == (
        tmp_path / "lib_alone" / "model.safetensors"
    ).read_bytes()
    assert sorted(_tensors(tmp_path / "alone")) == sorted(_by_path(finetuned))
    shutil.rmtree(tmp_path / "base")
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "alone").load(trust=[Classifier]), finetuned)
    # Both at once: refused by the parser, nothing written.
    capsys.readouterr()
    both = ["export", str(tmp_path / "ckpt"), str(tmp_path / "both"), "--base", str(tmp_path / "x"), "--standalone"]
    assert main(both) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "both").exists()


def _report_numbers(said: str) -> list[int]:
    """The byte counts a report line gives, in order."""
    return [int(n) for n in re.findall(r"(\d+) bytes", said)]


def test_a_full_finetune_exported_against_its_base_is_standalone_and_says_so(tmp_path, caplog, capsys):
    """Every weight changed, tiny scalars (`lr`, a PRNG key) unchanged: the
    17-ish bytes the base would give are not worth depending on it."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    tuned = {**tree, "model": jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, tree["model"])}
    tuned = {**tuned, "embed": tree["embed"] * 2, "ids": tree["ids"] + 1, "mask": ~tree["mask"], "step": 5}
    with caplog.at_level("INFO", logger="eqx_ckpt"):
        eqx_ckpt.export_safetensors(tmp_path / "ft", tuned, base=tmp_path / "base")
    [said] = [r.getMessage() for r in caplog.records if "standalone" in r.getMessage()]
    record = _record(tmp_path / "ft")
    assert record["format_version"] == VERSION and "base" not in record
    on_disk = _tensors(tmp_path / "ft")
    assert sorted(on_disk) == sorted(_by_path(tuned))
    total = sum(len(data) for data in on_disk.values())
    unchanged = len(_stored_bytes(tree["lr"])) + len(_stored_bytes(tree["key"]))
    assert _report_numbers(said) == [total, unchanged]
    assert "written standalone" in said and "under both 10% of its bytes and 1.0 MiB" in said
    shutil.rmtree(tmp_path / "base")
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[Classifier]), tuned)
    # The CLI says the same on stderr; stdout lists the files.
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tuned)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--base", str(tmp_path / "base")]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["model.safetensors", "eqx_ckpt.json", "README.md"]
    assert err.startswith("eqx-ckpt: written standalone") and _report_numbers(err) == [total, unchanged]


def test_a_head_only_finetune_keeps_its_base_and_reports_what_it_stored_and_took(family, caplog, capsys):
    tuned = _finetuned(family.base_tree)
    with caplog.at_level("INFO", logger="eqx_ckpt"):
        eqx_ckpt.export_safetensors(family.finetune, tuned, base=family.base)
    [said] = [r.getMessage() for r in caplog.records if "from the base" in r.getMessage()]
    references = _record(family.finetune)["base"]
    stored = sum(len(data) for data in _tensors(family.finetune).values())
    by_path = _by_path(family.base_tree)
    taken = [p for p, leaf in _leaves(family.finetune).items() if "base" in leaf]
    assert sorted(taken) == sorted(set(by_path) - set(CHANGED))
    taken_bytes = sum(len(_stored_bytes(by_path[p])) for p in taken)
    assert _report_numbers(said) == [stored, taken_bytes]
    assert f"stored {len(CHANGED)} leaves" in said and f"took {len(taken)} leaves" in said
    assert said.endswith(f"from the base {references['path']}.")
    # The CLI prints it on stderr.
    if family.kind.startswith("checkpoint"):
        capsys.readouterr()
        args = ["export", str(family.base), str(family.finetune.parent / "again"), "--base", str(family.base)]
        assert main(args) == 0
        assert _report_numbers(capsys.readouterr().err) == [0, sum(len(_stored_bytes(x)) for x in by_path.values())]


def test_contradictory_or_impossible_base_options_are_refused(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`base=` and `standalone=True` contradict")):
        eqx_ckpt.export_safetensors(tmp_path / "out", tree, base=tmp_path / "base", standalone=True)
    said = "An export against a base needs a folder, whose `eqx_ckpt.json` names the base: 'one.safetensors' is one"
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(said)):
        eqx_ckpt.export_safetensors(tmp_path / "out" / "one.safetensors", tree, base=tmp_path / "base")
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("`base` must be a path")):
        eqx_ckpt.export_safetensors(tmp_path / "out", tree, base=3)
    said = f"The base given as `base=` ({str(tmp_path / 'nothere')!r}) cannot be found: "
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(said) + ".*Check the base's path"):
        eqx_ckpt.export_safetensors(tmp_path / "out", tree, base=tmp_path / "nothere")
    # Each refused before anything is written: not even the folder (it was made, and left empty).
    assert not (tmp_path / "out").exists()


def test_the_command_line_names_its_flags_where_python_names_keywords(tmp_path, capsys):
    """Issue 88: `eqx-ckpt export --base` was called "`base=`" in its messages."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    base = str(tmp_path / "base")
    nothere = str(tmp_path / "nothere")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--base", nothere]) == 2
    assert f"The base given as `--base` ({nothere!r}) cannot be found" in capsys.readouterr().err
    # Python, after the command line ran, names keywords again.
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`base=` and `standalone=True` contradict")):
        eqx_ckpt.export_safetensors(tmp_path / "out", tree, base=base, standalone=True)


def test_a_reexport_of_a_finetune_keeps_its_base(family):
    """A fine-tune's `Checkpoint` exported without `base=` is exported against
    the same base, re-matched, its path relative to the new folder."""
    record = _record(family.finetune)
    for out in (family.finetune.parent / "again", family.finetune.parent / "deeper" / "still" / "again"):
        beside = out.parent == family.base.parent
        with (
            pytest.warns(UserWarning, match=r"'\.\./\.\./\.\./base', which is not in the folder")
            if not beside
            else (contextlib.nullcontext())
        ):
            eqx_ckpt.export_safetensors(out, eqx_ckpt.Checkpoint(family.finetune))
        again = _record(out)
        assert again["format_version"] == VERSION
        assert again["base"]["sha256"] == record["base"]["sha256"]
        assert again["base"]["path"] == os.path.relpath(family.base, out)
        assert _leaves(out) == _leaves(family.finetune)
        assert sorted(_tensors(out)) == CHANGED
        # A base not beside the fine-tune is read only where the load gives it.
        given = {} if beside else {"base": family.base}
        _assert_same(eqx_ckpt.Checkpoint(out, **given).load(trust=[Classifier]), family.tree)
        if not beside:
            with pytest.raises(eqx_ckpt.UntrustedError, match="leads out of the folder that holds the fine-tune"):
                eqx_ckpt.Checkpoint(out).load(trust=[Classifier])
    # A lazily loaded tree of it is a tree, not a `Checkpoint`: exported against the base given (none here).
    lazy = eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(family.tree), lazy=True)
    eqx_ckpt.export_safetensors(family.finetune.parent / "tree", lazy)
    assert _record(family.finetune.parent / "tree")["format_version"] == VERSION


# Chains.


def test_a_finetune_of_a_finetune_loads_bit_for_bit(tmp_path):
    base = _base_tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", base)
    first = _finetuned(base)
    eqx_ckpt.export_safetensors(tmp_path / "ft1", first, base=tmp_path / "base")
    model = eqx.tree_at(lambda m: m.body.layers[0].bias, first["model"], first["model"].body.layers[0].bias * 3)
    second = {**first, "model": model, "lr": 0.5}
    eqx_ckpt.export_safetensors(tmp_path / "ft2", second, base=tmp_path / "ft1")
    assert sorted(_tensors(tmp_path / "ft2")) == ["lr", "model.body.layers.0.bias"]
    record = _record(tmp_path / "ft2")
    assert record["base"] == {
        "path": os.path.join("..", "ft1"),
        "sha256": hashlib.sha256((tmp_path / "ft1" / "eqx_ckpt.json").read_bytes()).hexdigest(),
    }
    # The new head is the first fine-tune's; the body the base's, through the first fine-tune.
    assert _leaves(tmp_path / "ft2")["model.head.weight"]["base"] == "model.head.weight"
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft2").load(trust=[Classifier]), second)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft2", _like(second)), second)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft2", _like(second), lazy=True)
    _assert_same(eqx_ckpt.materialise(lazy), second)
    # A standalone export of the chain's end needs neither.
    eqx_ckpt.export_safetensors(tmp_path / "alone", eqx_ckpt.Checkpoint(tmp_path / "ft2"), standalone=True)
    shutil.rmtree(tmp_path / "base")
    shutil.rmtree(tmp_path / "ft1")
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "alone").load(trust=[Classifier]), second)
    # A missing base down the chain is named.
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(f"its base {str(tmp_path / 'ft1')!r}")):
        eqx_ckpt.Checkpoint(tmp_path / "ft2").load(trust=[Classifier])


def test_a_chain_loads_eight_deep_and_no_deeper(tmp_path):
    tree = {"w": np.arange(4, dtype=np.float32), "b": np.zeros(3, np.float32)}
    eqx_ckpt.export_safetensors(tmp_path / "ft0", tree)
    for depth in range(1, 10):
        tree = {**tree, "w": tree["w"] + 1}
        eqx_ckpt.export_safetensors(tmp_path / f"ft{depth}", tree, base=tmp_path / f"ft{depth - 1}")
        assert sorted(_tensors(tmp_path / f"ft{depth}")) == ["w"]
        if depth == 8:
            eighth = tree
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "ft8").load(), eighth)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"more than 8 deep.*follows at most 8"):
        eqx_ckpt.Checkpoint(tmp_path / "ft9")


# Damaged and hostile records.


def _taken_leaf(record: dict[str, Any]) -> dict[str, Any]:
    return next(leaf for leaf in record["leaves"] if leaf["path"] == "embed")


def _stored_leaf(record: dict[str, Any]) -> dict[str, Any]:
    return next(leaf for leaf in record["leaves"] if leaf["path"] == "step")


def _set(record: dict[str, Any], **fields: Any) -> None:
    record.update(fields)


def _as_version(record: dict[str, Any], version: int) -> None:
    """`record` (of the current version) made to say an earlier `version`: one xxh3-128 digest a leaf, no blocks."""
    record.update(format_version=version)
    record.pop("block_bytes")
    for leaf in record["leaves"]:
        leaf.pop("blocks")
        leaf["digest"] = "xxh3-128:" + "0" * 32


HOSTILE = {
    "version 1 naming a base": (lambda r: _as_version(r, 1), "it names a base, which only format version 2"),
    "version 1 with a leaf taken from a base": (
        lambda r: (_as_version(r, 1), r.pop("base")),
        "it names a base, which only format version 2",
    ),
    "version 5 taking leaves without a base": (
        lambda r: r.pop("base"),
        f"format version {VERSION} records a `base` object with a `path`",
    ),
    "version 5 with blocks missing": (
        lambda r: _set(r, block_bytes=3),
        "`block_bytes` 3 is not a power of two from 64 KiB to 64 MiB",
    ),
    "version 2 without a base": (
        lambda r: (_as_version(r, 2), r.pop("base")),
        "format version 2 records a `base` object with a `path`",
    ),
    "a base that is no object": (lambda r: _set(r, base="../base"), "records a `base` object with a `path`"),
    "a base path with a control character": (
        lambda r: r["base"].update(path="../ba\x00se"),
        "its base's `path` '../ba\\x00se' holds a control character",
    ),
    "an hf base without a commit": (
        lambda r: _set(r, base={"path": "hf://me/base", "revision": "main"}),
        "its base 'hf://me/base' is not pinned to a commit (40 hex digits)",
    ),
    "an hf base pinned by sha256": (
        lambda r: _set(r, base={"path": "hf://me/base", "sha256": "0" * 64}),
        "its base 'hf://me/base' is not pinned to a commit",
    ),
    "an hf base with a short commit": (
        lambda r: _set(r, base={"path": "hf://me/base", "revision": "0" * 39}),
        "its base 'hf://me/base' is not pinned to a commit",
    ),
    "a local base without a sha256": (
        lambda r: r["base"].pop("sha256"),
        "is not pinned by the sha256 of its record (64 hex digits)",
    ),
    "a local base with a short sha256": (
        lambda r: r["base"].update(sha256="ab" * 16),
        "is not pinned by the sha256 of its record",
    ),
    "a local base with upper-case hex": (
        lambda r: r["base"].update(sha256=r["base"]["sha256"].upper()),
        "is not pinned by the sha256 of its record",
    ),
    "a local base pinned by a commit too": (
        lambda r: r["base"].update(revision="0" * 40),
        "is not pinned by the sha256 of its record",
    ),
    "a malformed digest": (
        lambda r: _taken_leaf(r).update(digest="blake3:xyz"),
        "the leaf 'embed' has the digest 'blake3:xyz', not blake3:<64 hex digits>",
    ),
    "a digest of another hash": (
        lambda r: _stored_leaf(r).update(digest="xxh3-128:" + "0" * 32),
        "the leaf 'step' has the digest 'xxh3-128:",
    ),
    "a digest that is not that of its blocks": (
        lambda r: _stored_leaf(r).update(digest="blake3:" + "0" * 64),
        "the leaf 'step' records a `digest` that is not the BLAKE3 of its `blocks`",
    ),
    "blocks that are too few": (
        lambda r: _stored_leaf(r).update(blocks=""),
        "the leaf 'step' records `blocks` that are not 1 BLAKE3 digests in hex",
    ),
    "a digest that is no string": (lambda r: _stored_leaf(r).update(digest=7), "the leaf 'step' has the digest '7'"),
    "a reference without a digest": (
        lambda r: _taken_leaf(r).pop("digest"),
        "the leaf 'embed' names its base's leaf as 'embed', without a digest",
    ),
    "a reference that is no string": (
        lambda r: _taken_leaf(r).update(base=5),
        "the leaf 'embed' names its base's leaf as 5, which is not a dotted path",
    ),
    "an empty reference": (
        lambda r: _taken_leaf(r).update(base=""),
        "the leaf 'embed' names its base's leaf as '', which is not a dotted path",
    ),
    "a leaf both stored and taken": (
        lambda r: _stored_leaf(r).update(base="step"),
        "takes the leaf 'step' from its base, but it is stored here too",
    ),
    "a base that is the fine-tune itself": (lambda r: r["base"].update(path="."), "more than 8 deep"),
}


@pytest.mark.parametrize("damage", sorted(HOSTILE))
def test_a_damaged_or_hostile_record_is_corrupt(tmp_path, faults, damage):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    finetuned = _finetuned(tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", finetuned, base=tmp_path / "base")
    edit, said = HOSTILE[damage]
    record = _record(tmp_path / "ft")
    edit(record)
    (tmp_path / "ft" / "eqx_ckpt.json").write_text(json.dumps(record))
    reads = _no_reads(faults)
    for load in _every_load(tmp_path / "ft", finetuned):
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
            load()
    assert reads == []


# Moving, and the card.


def test_a_finetune_moved_with_its_base_still_loads(tmp_path):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "old" / "models" / "base", tree)
    finetuned = _finetuned(tree)
    eqx_ckpt.export_safetensors(
        tmp_path / "old" / "models" / "ft", finetuned, base=tmp_path / "old" / "models" / "base"
    )
    shutil.move(tmp_path / "old" / "models", tmp_path / "new")
    assert not (tmp_path / "old" / "models").exists()
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "new" / "ft").load(trust=[Classifier]), finetuned)
    # Moved alone, it names where it looked.
    shutil.move(tmp_path / "new" / "ft", tmp_path / "ft")
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(f"its base {str(tmp_path / 'base')!r}")):
        eqx_ckpt.Checkpoint(tmp_path / "ft").load(trust=[Classifier])


def test_the_card_of_a_finetune_says_it_needs_its_base_and_how_to_do_without(tmp_path, capsys, monkeypatch):
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    finetuned = _finetuned(tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", finetuned, base=tmp_path / "base")
    card = (tmp_path / "ft" / "README.md").read_text()
    base = os.path.join("..", "base")
    assert f"it holds only the leaves that differ from its base, `{base}`, and every load reads the others" in card
    assert "base_model" not in card  # a local base is no Hub repository
    # The command it shows makes a copy that needs no base.
    command = re.search(r"`(eqx-ckpt export --standalone [^`]*)`", card).group(1)
    argv = shlex.split(command.replace("<folder>", shlex.quote(str(tmp_path / "alone"))))
    assert argv[:3] == ["eqx-ckpt", "export", "--standalone"] and argv[3] == "ft"  # by its name (issue 88.9)
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    shutil.rmtree(tmp_path / "base")
    _assert_same(eqx_ckpt.Checkpoint(tmp_path / "alone").load(trust=[Classifier]), finetuned)
    # A base-less export's card says none of it.
    assert "--standalone" not in (tmp_path / "alone" / "README.md").read_text()


def test_ls_info_and_diff_say_which_leaves_come_from_the_base(family, capsys):
    """Issue 67 item 5: `ls` marks the leaves read from the base, `info` names
    the base, and `diff` of the fine-tune against its base lists exactly the
    leaves it stores."""
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    taken = sorted(set(_by_path(family.tree)) - set(CHANGED))
    assert sorted(ckpt.from_base()) == taken and all(ckpt.from_base()[p] == p for p in taken)
    assert ckpt.base == str(family.base) and eqx_ckpt.Checkpoint(family.base).base is None
    assert main(["ls", str(family.finetune)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.endswith("  base") for line in lines) == len(taken)
    assert not any(line.startswith("step") and line.endswith("base") for line in lines)
    assert f"; {len(taken)} of them (" in lines[-1] and f"read from the base {family.base}" in lines[-1]
    # A folder shown as one line says how many of its leaves the base holds (issue 88).
    assert main(["ls", str(family.finetune), "--depth", "1"]) == 0
    (model,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model/")]
    in_model = [p for p in _by_path(family.tree) if p.startswith("model.")]
    based = [p for p in taken if p.startswith("model.")]
    assert f"{len(in_model)} leaves ({len(based)} from the base)" in model
    capsys.readouterr()
    assert main(["info", str(family.finetune)]) == 0
    out = capsys.readouterr().out
    assert f"base:            {family.base}\n" in out
    assert f"stored here:     {len(CHANGED)} leaves" in out and f"{len(taken)} read from the base" in out
    assert main(["diff", str(family.base), str(family.finetune)]) == 1
    changed = re.findall(r"^[!~+-] (\S+):", capsys.readouterr().out, flags=re.M)
    assert sorted(changed) == CHANGED == sorted(_tensors(family.finetune))
