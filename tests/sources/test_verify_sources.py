"""`verify` and `diff` of the other formats eqx_ckpt reads: a safetensors file, a
Hugging Face directory, an orbax checkpoint. They said "no manifest.json ...
interrupted save", though a load's error about a truncated shard advised
`eqx-ckpt verify` (issue 40, item 7). Each is now checked for what its format
can be checked for, and the result says what it cannot be."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ckpt
from eqx_ckpt._tools._cli import main

TREE = {
    "model": {"w": np.arange(3000, dtype=np.float32).reshape(30, 100), "b": np.ones(100, np.float32)},
    "embed": np.arange(64, dtype=np.int32),
}


def _safetensors(tmp_path):
    eqx_ckpt.export_safetensors(tmp_path / "model.safetensors", TREE)
    return tmp_path / "model.safetensors"


def _hf(tmp_path):
    """A plain Hugging Face folder: shards and their index, no `eqx_ckpt.json`."""
    eqx_ckpt.export_safetensors(tmp_path / "hf", TREE, max_shard_size=1000)
    for name in ("eqx_ckpt.json", "README.md"):
        (tmp_path / "hf" / name).unlink()
    return tmp_path / "hf"


def _published(tmp_path):
    """The published layout: its `eqx_ckpt.json` records each leaf's digest."""
    eqx_ckpt.export_safetensors(tmp_path / "published", TREE, max_shard_size=1000)
    return tmp_path / "published"


def _orbax(ocdbt, zarr3):
    def make(tmp_path):
        ocp = pytest.importorskip("orbax.checkpoint")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(tmp_path / "orbax", args=ocp.args.PyTreeSave(TREE))
        return tmp_path / "orbax"

    return make


SOURCES = {
    "safetensors": _safetensors,
    "hf": _hf,
    "published": _published,
    "orbax-ocdbt": _orbax(True, True),
    "orbax-zarr3": _orbax(False, True),
    "orbax-zarr": _orbax(False, False),
}


def _shards(path):
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def _holding(path, tensor):
    """The safetensors file of `path` that holds `tensor`."""
    if path.is_file():
        return path
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][tensor]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_sound_checkpoint_of_every_format_verifies_and_says_what_is_not_checked(tmp_path, kind, capsys):
    path = SOURCES[kind](tmp_path)
    problems = eqx_ckpt.verify(path)
    assert problems == []
    if kind == "published":  # each leaf compared with its recorded digest (issue 67)
        assert problems.unchecked == () and "every leaf's bytes, against the digests" in problems.checked[0]
    else:
        assert problems.unchecked and "no checksums" in problems.unchecked[0]
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("checked: " if kind == "published" else "not checked: ") in out and out.strip().endswith(f"{path}: sound")
    # Every byte was read: the progress reaches the total.
    seen = []
    eqx_ckpt.verify(path, progress=lambda *counts: seen.append(counts))
    total = sum(a.nbytes for a in (TREE["model"]["w"], TREE["model"]["b"], TREE["embed"]))
    assert seen[-1] == (3, 3, total, total)
    # eqx_ckpt's own checkpoints are checked byte for byte: nothing is left unchecked.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", TREE)
    assert eqx_ckpt.verify(tmp_path / "ckpt").unchecked == ()


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_a_truncated_file_is_a_problem_of_its_tensors_as_the_load_error_advised(tmp_path, kind, capsys):
    path = SOURCES[kind](tmp_path)
    file = _holding(path, "model.w")
    file.write_bytes(file.read_bytes()[:-7])
    # The load's error advises `eqx-ckpt verify`, which now checks the path.
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"truncated.*run `eqx-ckpt verify`"):
        eqx_ckpt.Checkpoint(path).load()
    problems = eqx_ckpt.verify(path)
    assert "model.w" in [p.leaf for p in problems]
    assert all(re.search(r"ends before the tensor's bytes .*truncated", p.message) for p in problems)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^model\.w: .*truncated", out, flags=re.M) and "problem(s)" in out


def test_a_missing_shard_is_a_problem_of_the_directory(tmp_path, capsys):
    path = _hf(tmp_path)
    shard = _holding(path, "model.w")
    shard.unlink()
    problems = eqx_ckpt.verify(path)
    said = f"model.safetensors.index.json lists the shard {shard.name!r}, which is not there"
    assert [p.leaf for p in problems] == [None] and said in problems[0].message
    assert main(["verify", str(path)]) == 1
    assert said in capsys.readouterr().out
    # A load says the same, as damage, not as "no checkpoint here".
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)):
        eqx_ckpt.Checkpoint(path)


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_a_flipped_byte_in_a_tensor_is_said_to_be_undetectable(tmp_path, kind):
    """Safetensors holds no checksums: verify cannot see a changed byte, and
    says so rather than calling the file checked byte for byte."""
    path = SOURCES[kind](tmp_path)
    file = _holding(path, "model.w")
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))
    problems = eqx_ckpt.verify(path)
    assert problems == []
    assert "a changed byte inside a tensor cannot be detected" in problems.unchecked[0]


def test_a_flipped_byte_in_a_published_folder_is_found_by_its_digest(tmp_path, capsys):
    """The published layout records each leaf's digest (issue 67): there a
    changed byte is a problem of its leaf."""
    path = _published(tmp_path)
    file = _holding(path, "model.w")
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == ["model.w"]
    assert re.search(
        r"its bytes are not those its digests in eqx_ckpt.json record: block \d+ of \d+ differs from its BLAKE3: "
        r"a changed byte",
        problems[0].message,
    )
    assert main(["verify", str(path)]) == 1
    assert re.search(r"^model\.w: its bytes are not", capsys.readouterr().out, flags=re.M)


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_damaged_headers_are_problems(tmp_path, kind):
    path = SOURCES[kind](tmp_path)
    file = _shards(path)[-1]
    file.write_bytes(file.read_bytes() + b"extra")
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == [None]
    assert f"{file.name!r} has bytes after its last tensor" in problems[0].message


@pytest.mark.parametrize("zarr3", [True, False])
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_missing_or_truncated_orbax_chunk_is_a_problem_of_its_leaf(tmp_path, zarr3, damage):
    path = _orbax(False, zarr3)(tmp_path)
    chunk = next(p for p in (path / "model.w").rglob("*") if p.is_file() and p.name[0].isdigit())
    if damage == "deleted":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:-9])
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == ["model.w"]
    assert problems.unchecked[0].startswith("orbax stores no checksums")


def test_a_lost_ocdbt_data_file_is_a_problem(tmp_path):
    path = _orbax(True, True)(tmp_path)
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    files[-1].unlink()  # the largest: model.w's chunks
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == ["model.w"] and "DATA_LOSS" in problems[0].message


def test_an_orbax_checkpoint_that_may_leave_out_chunks_says_so(tmp_path):
    path = _orbax(False, False)(tmp_path)
    metadata = json.loads((path / "_METADATA").read_text())
    metadata["store_array_data_equal_to_fill_value"] = False
    (path / "_METADATA").write_text(json.dumps(metadata))
    problems = eqx_ckpt.verify(path)
    assert problems == [] and any("a missing chunk reads as zeros" in line for line in problems.unchecked)


def test_a_path_of_no_format_is_still_an_error_saying_what_it_holds(tmp_path, capsys):
    (tmp_path / "model.eqx").write_bytes(b"\0" * 8)
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match="It is an Equinox file"):
        eqx_ckpt.verify(tmp_path / "model.eqx")
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        eqx_ckpt.verify(tmp_path / "nothing.safetensors")


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_diff_compares_every_format_with_a_checkpoint(tmp_path, kind, capsys):
    path = SOURCES[kind](tmp_path)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "same", TREE)
    assert not eqx_ckpt.diff(path, tmp_path / "same")
    assert not eqx_ckpt.diff(path, path)
    changed = {**TREE, "model": {**TREE["model"], "b": np.zeros(100, np.float32)}, "extra": jnp.ones(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "changed", changed)
    assert list(eqx_ckpt.diff(path, tmp_path / "changed")) == ["+ extra", "! model.b: values differ"]
    assert main(["diff", str(path), str(tmp_path / "same")]) == 0
    assert main(["diff", str(tmp_path / "changed"), str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3] == "- extra" and out[-2].startswith("! model.b: values differ (max |a-b| ")
    assert out[-2].endswith(", |a-b|/|a| inf)")
    assert out[-1].startswith("3 leaves in both: 2 equal, 1 with other values (400 B of ")
