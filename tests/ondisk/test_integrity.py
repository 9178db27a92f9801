"""Damage on disk is found by `verify` and by a load of the damaged leaf, and the
error names that leaf; `diff` reports every kind of difference."""

import hashlib
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import manifests
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal
from jax.sharding import NamedSharding, PartitionSpec

import eqx_ckpt
from eqx_ckpt._ondisk import _format, _layout, _manifest

# Damage to a leaf's own folder (its chunk files, its zarr.json): every leaf gets
# one. Damage to a pack of small leaves is tested in test_pack.py.
per_leaf = pytest.mark.usefixtures("unpacked")


def _tree():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    sharded = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, PartitionSpec("x")))
    return {
        "a": jnp.arange(1000.0),
        "b": {"c": np.arange(12, dtype=np.int32).reshape(3, 4)},
        "sharded": sharded,
        "half": jnp.ones(5, jnp.bfloat16),
        "key": jax.random.key(3),
        "step": 7,
    }


def _like():
    # Abstract leaves with the concrete sharding of the saved array.
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
    return jax.tree.map(abstract, _tree())


def _same(a, b) -> bool:
    """`eqx.tree_equal(a, b, typematch=True)`, leaf by leaf on the host (the sharded
    leaf lives on 4 devices, the others on one, and one jitted `&` cannot mix them)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if not tree_equal(jax.device_get(x), jax.device_get(y), typematch=True) or type(x) is not type(y):
            return False
    return True


def _save(path: pathlib.Path):
    eqx_ckpt.tree_serialise_leaves(path, _tree())
    assert eqx_ckpt.verify(path) == []
    return path


def _chunk_files(path: pathlib.Path, leaf: str) -> list[pathlib.Path]:
    folder = path.joinpath(*leaf.split("."), "c")
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    assert files, f"no chunk files for {leaf}"
    return files


def _assert_reported_but_loads(path: pathlib.Path, leaf: str) -> None:
    """Metadata damage that changes no stored byte: `verify` names the leaf;
    loads, which take the metadata from the manifest, return the saved values."""
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == [leaf], problems
    assert _same(eqx_ckpt.tree_deserialise_leaves(path, _like()), _tree())
    saved = _tree()
    for key in leaf.split("."):
        saved = saved[key]
    np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(path)[leaf]), np.asarray(saved))


def _assert_detected(path: pathlib.Path, leaf: str, error=eqx_ckpt.IntegrityError, *, groups=()):
    """Damage to the bytes of `leaf`: `verify` names it (after the group metadata
    `groups`, by key, found missing), and every read of it fails naming it; the
    other leaves still load."""
    problems = eqx_ckpt.verify(path)
    assert [p.leaf for p in problems] == [None] * len(groups) + [leaf], problems
    for problem, key in zip(problems, groups):
        assert problem.message.startswith(f"The zarr group metadata {key!r} is missing"), problem
    assert all(isinstance(p, eqx_ckpt.Problem) for p in problems)
    # A full load, a load of that leaf alone, and a lazy read all fail naming it.
    with pytest.raises(error, match=re.escape(f"`{leaf}`")):
        eqx_ckpt.tree_deserialise_leaves(path, _like())
    top = leaf.split(".")[0]
    with pytest.raises(error, match=re.escape(f"`{leaf}`")):
        eqx_ckpt.tree_deserialise_leaves(path, _like(), where=lambda t: t[top])
    with pytest.raises(error, match=re.escape(f"`{leaf}`")):
        np.asarray(eqx_ckpt.Checkpoint(path)[leaf])
    # Every other leaf still loads.
    others = [k for k in _like() if k != top]
    loaded = eqx_ckpt.tree_deserialise_leaves(path, _like(), where=lambda t: [t[k] for k in others])
    assert _same([loaded[k] for k in others], [_tree()[k] for k in others])


def test_sound_checkpoints_verify_clean(tmp_path, packing):
    _save(tmp_path / "one")
    # Each overwrite writes a new `gen.<commit>` data root.
    for _ in range(2):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "one", _tree())
        assert eqx_ckpt.verify(tmp_path / "one") == []
    eqx_ckpt.tree_serialise_leaves("memory://integrity/", _tree())
    assert eqx_ckpt.verify("memory://integrity/") == []
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ocdbt", _tree(), layout="ocdbt")
    assert eqx_ckpt.verify(tmp_path / "ocdbt") == []


def test_verify_progress_counts_every_byte(tmp_path, packing):
    _save(tmp_path)
    seen = []
    assert eqx_ckpt.verify(tmp_path, progress=lambda *counts: seen.append(counts)) == []
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert seen[-1] == (len(ckpt), len(ckpt), ckpt.total_bytes, ckpt.total_bytes)


def test_verify_missing_checkpoint(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(str(tmp_path / "nope"))):
        eqx_ckpt.verify(tmp_path / "nope")


@per_leaf
@pytest.mark.parametrize("leaf", ["a", "b.c", "half", "key", "step"])
def test_flipped_byte(tmp_path, leaf):
    _save(tmp_path)
    chunk = _chunk_files(tmp_path, leaf)[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))
    _assert_detected(tmp_path, leaf)


@per_leaf
def test_flipped_checksum_byte(tmp_path):
    _save(tmp_path)
    chunk = _chunk_files(tmp_path, "a")[0]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01
    chunk.write_bytes(bytes(data))
    _assert_detected(tmp_path, "a")


@per_leaf
@pytest.mark.parametrize("keep", [0, 1, -4, -1])
def test_truncated_chunk(tmp_path, keep):
    _save(tmp_path)
    chunk = _chunk_files(tmp_path, "b.c")[0]
    data = chunk.read_bytes()
    chunk.write_bytes(data[: keep if keep >= 0 else len(data) + keep])
    _assert_detected(tmp_path, "b.c")


@per_leaf
@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_leafs_resized_or_missing_chunk_file_is_worded_alike_by_verify_and_a_load(tmp_path, damage):
    """A load and `verify` name the chunk file and its size in the same words
    (`its chunk file 'a/c/0' is 100 bytes, not 4004`), also through
    TensorStore's reader (`Checkpoint[...]`)."""
    _save(tmp_path)
    chunk = _chunk_files(tmp_path, "a")[0]
    expected = chunk.stat().st_size
    if damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:100])
    else:
        chunk.unlink()
    said = "is missing" if damage == "deleted" else f"is 100 bytes, not {expected}"
    said = f"it is damaged or incomplete: its chunk file 'a/c/0' {said}. Nothing was"
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == ["a"] and said in problems[0].message, problems
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(f"Leaf `a` in checkpoint {str(tmp_path)!r}: {said}")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(said)):
        np.asarray(eqx_ckpt.Checkpoint(tmp_path)["a"])


@per_leaf
@pytest.mark.parametrize("leaf", ["a", "step", "sharded"])
def test_deleted_chunk_is_not_read_as_fill_values(tmp_path, leaf):
    _save(tmp_path)
    files = _chunk_files(tmp_path, leaf)
    files[len(files) // 2].unlink()
    _assert_detected(tmp_path, leaf)


@per_leaf
def test_extra_bytes_appended_to_chunk(tmp_path):
    # TensorStore ignores bytes after the checksum, so the values still load
    # exactly; `verify` checks every chunk file's size and reports them.
    _save(tmp_path)
    chunk = _chunk_files(tmp_path, "a")[0]
    chunk.write_bytes(chunk.read_bytes() + b"\0")
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == ["a"]
    assert "4004" in problems[0].message and "4005" in problems[0].message
    assert _same(eqx_ckpt.tree_deserialise_leaves(tmp_path, _like()), _tree())


def _edit_zarr_json(path: pathlib.Path, leaf: str, edit) -> None:
    file = path.joinpath(*leaf.split("."), "zarr.json")
    metadata = json.loads(file.read_text())
    edit(metadata)
    file.write_text(json.dumps(metadata))


@per_leaf
@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(shape=[4, 3]),
        lambda m: m.update(data_type="uint32"),
        lambda m: m.update(codecs=m["codecs"][:1]),
        lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[1, 4]),
        lambda m: m.update(node_type="group"),
    ],
    ids=["shape", "dtype", "no-checksum", "chunks", "group"],
)
def test_edited_zarr_json(tmp_path, edit):
    _save(tmp_path)
    _edit_zarr_json(tmp_path, "b.c", edit)
    _assert_reported_but_loads(tmp_path, "b.c")


@per_leaf
def test_garbled_or_deleted_zarr_json(tmp_path):
    _save(tmp_path / "x")
    tmp_path.joinpath("x", "b", "c", "zarr.json").write_text("{not json")
    _assert_reported_but_loads(tmp_path / "x", "b.c")
    _save(tmp_path / "y")
    tmp_path.joinpath("y", "a", "zarr.json").unlink()
    _assert_reported_but_loads(tmp_path / "y", "a")


@per_leaf
def test_edited_fill_value_is_reported_by_verify(tmp_path):
    # A load never reads the fill value (a missing chunk is an error, not fill),
    # so the bytes still load exactly; verify still reports the edit.
    _save(tmp_path)
    _edit_zarr_json(tmp_path, "a", lambda m: m.update(fill_value=1.0))
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == ["a"]
    assert "fill_value" in problems[0].message
    assert _same(eqx_ckpt.tree_deserialise_leaves(tmp_path, _like()), _tree())


@per_leaf
def test_deleted_leaf_folder(tmp_path):
    _save(tmp_path)
    for file in sorted(tmp_path.joinpath("b").rglob("*"), reverse=True):
        file.unlink() if file.is_file() else file.rmdir()
    tmp_path.joinpath("b").rmdir()
    _assert_detected(tmp_path, "b.c", groups=["b/zarr.json"])


# The zarr.json of every group (the data root, every folder above a leaf): loads
# never read them, zarr tools do.
_GROUPED = {"model": {"w": np.ones((600, 600), np.float32), "b": np.zeros(3)}}
_NOT_A_GROUP = json.dumps({"zarr_format": 3, "node_type": "array", "attributes": {}}).encode()
_GROUP_DAMAGE = {
    "garbage": (lambda db, key: db.write(key, b"\x89PNG\x00\xff garbage"), "is not valid JSON."),
    "missing": (lambda db, key: db.delete_range(ts.KvStore.KeyRange(key, key + "\0")), "is missing from"),
    "array": (
        lambda db, key: db.write(key, _NOT_A_GROUP),
        "is not the zarr v3 group eqx_ckpt writes (node_type: 'array' instead of 'group').",
    ),
}


def _arrays(path: pathlib.Path) -> ts.KvStore:
    """The keys of a checkpoint's arrays: its data root, or the OCDBT database in it."""
    manifest = json.loads((path / "manifest.json").read_text())
    root = {"driver": "file", "path": f"{path / manifest['data_root']}/"}
    if manifest.get("layout") == "ocdbt":
        root = {"driver": "ocdbt", "base": {**root, "path": f"{path / manifest['data_root'] / 'ocdbt.db'}/"}}
    return ts.KvStore.open(root).result()


@pytest.mark.parametrize("layout", ["directories", "ocdbt"])
@pytest.mark.parametrize("damage", sorted(_GROUP_DAMAGE))
@pytest.mark.parametrize("key", ["zarr.json", "model/zarr.json"])
def test_damaged_group_metadata_is_reported(tmp_path, layout, damage, key):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _GROUPED, layout=layout)
    assert eqx_ckpt.verify(tmp_path) == []
    edit, says = _GROUP_DAMAGE[damage]
    edit(_arrays(tmp_path), key).result()
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.leaf is None and str(problem) == problem.message
    assert re.match(re.escape(f"The zarr group metadata {key!r} {says}"), problem.message), problem
    assert "Loads do not read it, but zarr tools do" in problem.message
    # Loads never read it.
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, _GROUPED), _GROUPED, typematch=True)


@pytest.mark.parametrize("layout", ["directories", "ocdbt"])
def test_group_metadata_of_a_generation_data_root(tmp_path, layout):
    for _ in range(2):
        eqx_ckpt.tree_serialise_leaves(tmp_path, _GROUPED, layout=layout)
    assert json.loads((tmp_path / "manifest.json").read_text())["data_root"].startswith("gen.")
    assert eqx_ckpt.verify(tmp_path) == []
    arrays = _arrays(tmp_path)
    arrays.write("zarr.json", b"").result()
    arrays.delete_range(ts.KvStore.KeyRange("model/zarr.json", "model/zarr.json\0")).result()
    messages = [p.message for p in eqx_ckpt.verify(tmp_path)]
    assert [m.split(" Loads")[0] for m in messages] == [
        "The zarr group metadata 'zarr.json' is not valid JSON.",
        f"The zarr group metadata 'model/zarr.json' is missing from {str(tmp_path)!r}.",
    ]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # What a zarr tool may add to a group, which leaves it one: sound.
        ({"attributes": {"note": "tuned", "xarray": [1, 2]}}, None),
        ({"attributes": None}, "attributes: None, not a JSON object"),
        ({"consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}, None),
        (
            {"extension": {"must_understand": True}},
            "extension: {'must_understand': True}, a field no zarr reader knows",
        ),
        ({"extension": 1}, "extension: 1, a field no zarr reader knows"),
        ({"zarr_format": 2}, "zarr_format: 2 instead of 3"),
        ({"zarr_format": 3.0}, "zarr_format: 3.0 instead of 3"),
        ({"node_type": ...}, "node_type: None instead of 'group'"),  # (`...`: left out)
        ({"extension": "x" * 10**6}, "extension: '" + "x" * 196 + "..., a field"),
    ],
    ids=[
        "attributes",
        "attributes-null",
        "consolidated",
        "must-understand",
        "extension",
        "v2",
        "float",
        "no-type",
        "huge",
    ],
)
def test_group_metadata_is_compared_with_what_saves_write(tmp_path, body, says):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _GROUPED)
    metadata = {"zarr_format": 3, "node_type": "group", "attributes": {}, **body}
    (tmp_path / "model" / "zarr.json").write_text(json.dumps({k: v for k, v in metadata.items() if v is not ...}))
    problems = eqx_ckpt.verify(tmp_path)
    if says is None:
        assert problems == []
    else:
        [problem] = problems
        assert problem.message.startswith("The zarr group metadata 'model/zarr.json' is not the zarr v3 group")
        assert says in problem.message and len(problem.message) < 600


def test_group_metadata_is_read_as_untrusted_input(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _GROUPED)
    model = tmp_path / "ckpt" / "model"
    for content, says in [
        (b"[" * 100_000, "is not valid JSON."),  # deeper than Python recurses
        (b"\xff\xfe\x00\xd8" * 1000, "is not valid JSON."),
        (b'["zarr_format", 3]', "is not a JSON object."),
        (b" " * (2**20 + 1), "is 1048577 bytes, more than the 1048576 allowed"),
    ]:
        (model / "zarr.json").write_bytes(content)
        [problem] = eqx_ckpt.verify(tmp_path / "ckpt")
        assert problem.leaf is None and says in problem.message and "'model/zarr.json'" in problem.message
    # A link is never followed, even to a sound group's metadata.
    (tmp_path / "group.json").write_bytes(b'{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    (model / "zarr.json").unlink()
    (model / "zarr.json").symlink_to(tmp_path / "group.json")
    [problem] = eqx_ckpt.verify(tmp_path / "ckpt")
    assert problem.leaf is None and "symbolic link" in problem.message


@per_leaf
def test_a_leafs_zarr_json_nested_too_deep_is_a_problem_not_a_crash(tmp_path):
    _save(tmp_path)
    tmp_path.joinpath("b", "c", "zarr.json").write_bytes(b"[" * 100_000)
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.leaf == "b.c" and problem.message == "its zarr.json is not valid JSON."


def test_verify_expects_exactly_the_groups_a_save_writes(tmp_path, packing):
    big, small = np.ones((600, 600), np.float32), np.zeros(3)
    trees = [{"model": {"layers": [{"w": big, "b": small}], "head": big}, "opt": {"mu": small}, "step": 1}, big, small]
    for i, tree in enumerate(trees):
        path = tmp_path / str(i)
        eqx_ckpt.tree_serialise_leaves(path, tree)
        files = path.rglob("zarr.json")
        written = sorted(
            f.relative_to(path).as_posix() for f in files if json.loads(f.read_text())["node_type"] == "group"
        )
        manifest = _manifest.parse((path / "manifest.json").read_bytes(), where=str(path))
        assert written == sorted(_format.metadata_key(g) for g in _layout.groups(manifest.leaves))
        assert eqx_ckpt.verify(path) == []
    assert json.loads((tmp_path / "1" / "zarr.json").read_text())["node_type"] == "array"  # a bare array: at the root


def test_a_data_root_holding_only_packs_is_a_group_too(tmp_path, packing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": {"b": np.ones(3)}})
    assert (tmp_path / "a").is_dir() == (packing == "unpacked")  # packed, `a` has no folder, nor group
    assert eqx_ckpt.verify(tmp_path) == []
    (tmp_path / "zarr.json").unlink()
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.message.startswith("The zarr group metadata 'zarr.json' is missing")


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace('"int32"', '"int16"', 1),
        lambda text: text.replace('"shape": [\n    3,', '"shape": [\n    2,', 1),
        lambda text: text[: len(text) // 2],
        lambda text: text.replace("sha256:", "sha256:0", 1),
        lambda text: text + " ",
    ],
    ids=["dtype", "shape", "truncated", "digest", "trailing-space"],
)
def test_edited_manifest(tmp_path, edit):
    _save(tmp_path)
    manifest = tmp_path / "manifest.json"
    text = manifest.read_text()
    edited = edit(text)
    if edited.rstrip() == text.rstrip():
        # Whitespace does not change the content the digest covers: still sound.
        manifest.write_text(edited)
        assert eqx_ckpt.verify(tmp_path) == []
        return
    assert edited != text
    manifest.write_text(edited)
    problems = eqx_ckpt.verify(tmp_path)
    assert len(problems) == 1 and problems[0].leaf is None
    assert "manifest" in problems[0].message
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(str(tmp_path))):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    with pytest.raises(eqx_ckpt.CorruptCheckpointError):
        eqx_ckpt.Checkpoint(tmp_path)


def _resign(path: pathlib.Path, edit, version: int = 4) -> None:
    """Edit the body of `path`'s manifest and sign it again (as version `version`)."""
    body = json.loads((path / _format.MANIFEST).read_bytes())
    edit(body)
    text = manifests.sign(body) if version == 4 else manifests.as_version(body, version)
    (path / _format.MANIFEST).write_bytes(text)


def test_verify_compares_the_manifests_own_totals_with_its_leaves(tmp_path):
    """A signed manifest whose `leaf_count`, `total_bytes` or a leaf's
    `nbytes` disagree with its leaves is a problem of `verify`, though a load
    ignores them (they follow from the leaf records)."""
    tree = {"a": np.arange(3, dtype=np.float32), "b": np.arange(5, dtype=np.int64)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    _resign(tmp_path, lambda body: body.update(leaf_count=3))
    totals = f"The manifest of {str(tmp_path)!r} gives totals that disagree with its leaves."
    assert [(p.leaf, p.message) for p in eqx_ckpt.verify(tmp_path)] == [(None, totals)]
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    _resign(tmp_path, lambda body: body["leaves"][1].update(nbytes=7))  # version 4 leaves it out; given, checked
    assert [(p.leaf, p.message) for p in eqx_ckpt.verify(tmp_path)] == [("b", "the manifest gives 7 bytes, not 40.")]
    # Before version 4, every leaf gives its `nbytes`: a missing one is a problem too.
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    _resign(tmp_path, lambda body: body.update(total_bytes=1), version=3)
    assert [(p.leaf, p.message) for p in eqx_ckpt.verify(tmp_path)] == [(None, totals)]
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    body = json.loads((tmp_path / _format.MANIFEST).read_bytes())
    (tmp_path / _format.MANIFEST).write_bytes(manifests.as_version(body, 3))
    assert eqx_ckpt.verify(tmp_path) == []
    version_3 = json.loads((tmp_path / _format.MANIFEST).read_bytes())
    del version_3["leaves"][0]["nbytes"], version_3["digest"]
    content = json.dumps(version_3, sort_keys=True, separators=(",", ":")).encode()
    version_3["digest"] = "sha256:" + hashlib.sha256(content).hexdigest()
    (tmp_path / _format.MANIFEST).write_text(json.dumps(version_3))
    assert [(p.leaf, p.message) for p in eqx_ckpt.verify(tmp_path)] == [("a", "the manifest gives None bytes, not 12.")]


def test_verify_reads_the_manifest_once(tmp_path, faults):
    """`verify` checks the manifest's own totals against the one parse of it
    that opened the checkpoint (issue 61, item 2: it read and parsed the file
    a second time for them)."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    reads = []
    faults("storage.read_file", lambda loc, name: reads.append(name))
    assert eqx_ckpt.verify(tmp_path) == []
    assert reads.count(_format.MANIFEST) == 1


@per_leaf
def test_several_damaged_leaves_are_all_named(tmp_path):
    _save(tmp_path)
    _chunk_files(tmp_path, "a")[0].unlink()
    chunk = _chunk_files(tmp_path, "half")[0]
    chunk.write_bytes(chunk.read_bytes()[:-1])
    assert [p.leaf for p in eqx_ckpt.verify(tmp_path)] == ["a", "half"]


@per_leaf
def test_damage_in_a_generation_data_root(tmp_path):
    _save(tmp_path)
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    root = json.loads((tmp_path / "manifest.json").read_text())["data_root"]
    assert root.startswith("gen.")
    chunk = _chunk_files(tmp_path / root, "a")[0]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _assert_detected(tmp_path, "a")


def test_diff_equal_and_different(tmp_path, packing):
    _save(tmp_path / "x")
    _save(tmp_path / "y")
    same = eqx_ckpt.diff(tmp_path / "x", tmp_path / "y")
    assert not same and list(same) == [] and len(same) == 0
    tree = _tree()
    tree["new"] = jnp.zeros(2)
    del tree["half"]
    tree["a"] = tree["a"].at[999].set(-1.0)
    tree["b"]["c"] = tree["b"]["c"].astype(np.int64)
    tree["step"] = 8
    eqx_ckpt.tree_serialise_leaves(tmp_path / "y", tree)
    result = eqx_ckpt.diff(tmp_path / "x", tmp_path / "y")
    assert result.added == ("new",)
    assert result.removed == ("half",)
    assert result.changed == (("b.c", "int32[3,4] -> int64[3,4]"),)
    assert result.values == ("a", "step")
    assert list(result) == [
        "! a: values differ",
        "~ b.c: int32[3,4] -> int64[3,4]",
        "- half",
        "+ new",
        "! step: values differ",
    ]
    metadata_only = eqx_ckpt.diff(tmp_path / "x", tmp_path / "y", values=False)
    assert metadata_only.values == () and len(metadata_only) == 3


def test_diff_is_bitwise(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "x", {"v": jnp.array([0.0, jnp.nan])})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "y", {"v": jnp.array([0.0, jnp.nan])})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "z", {"v": jnp.array([-0.0, jnp.nan])})
    assert len(eqx_ckpt.diff(tmp_path / "x", tmp_path / "y")) == 0
    assert eqx_ckpt.diff(tmp_path / "x", tmp_path / "z").values == ("v",)


def test_diff_type_and_cast_changes(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "x", {"n": 3, "w": jnp.ones(4)})
    eqx_ckpt.tree_serialise_leaves(
        tmp_path / "y", {"n": np.int64(3), "w": jnp.ones(4)}, cast={jnp.float32: jnp.bfloat16}
    )
    result = eqx_ckpt.diff(tmp_path / "x", tmp_path / "y")
    assert [k for k, _ in result.changed] == ["n"]
    # Stored as bfloat16, but 1.0 survives the cast: the values are equal.
    assert result.values == ()


@per_leaf
def test_diff_names_a_damaged_leaf(tmp_path):
    _save(tmp_path / "x")
    _save(tmp_path / "y")
    _chunk_files(tmp_path / "y", "b.c")[0].unlink()
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`b.c`")):
        eqx_ckpt.diff(tmp_path / "x", tmp_path / "y")
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        eqx_ckpt.diff(tmp_path / "x", tmp_path / "missing")


@per_leaf
def test_a_leaf_folder_removed_while_it_is_checked_is_an_integrity_error(tmp_path):
    # A reader racing an overwrite can find a leaf's folder, then see it deleted by
    # the overwrite's cleanup before listing it: that must be the documented
    # IntegrityError (retry), not a bare FileNotFoundError.
    from eqx_ckpt._base import _faults, _location
    from eqx_ckpt._store import _untrusted

    loc = _location.location(tmp_path)
    assert _untrusted._scan(loc, str(tmp_path / "gone"), "a") == 0
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"a": jnp.arange(4)})

    def scan_after_cleanup(directory):
        shutil.rmtree(directory)  # the folder existed when checked; now it is gone

    with _faults.armed("untrusted.scan", scan_after_cleanup):
        with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `a` .* is damaged or incomplete"):
            eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"a": jnp.zeros(4, jnp.int32)})


def test_verify_from_several_threads_at_once(tmp_path):
    import concurrent.futures

    # Distinct shapes and chunks, so every thread needs new reference metadata at once.
    paths = []
    for i in range(6):
        path = tmp_path / f"c{i}"
        eqx_ckpt.tree_serialise_leaves(path, {f"w{j}": np.zeros((i + 2, j + 3), np.float32) for j in range(4)})
        paths.append(path)
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(eqx_ckpt.verify, paths * 3))
    assert results == [[]] * 18


@per_leaf
def test_diff_against_an_edited_zarr_json_names_the_leaf_briefly(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", {"w": jnp.ones(2)})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", {"w": jnp.ones(2)})
    metadata = tmp_path / "b" / "w" / "zarr.json"
    body = json.loads(metadata.read_text())
    body["shape"] = [3]
    metadata.write_text(json.dumps(body))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `w` in checkpoint")) as info:
        eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")
    assert "tensorstore_spec" not in str(info.value)
    assert len(str(info.value)) < 500


def test_errors_name_the_checkpoint_not_its_data_root(tmp_path, packing):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)})
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones(2)})
    root = json.loads((tmp_path / "manifest.json").read_text())["data_root"]
    assert root.startswith("gen.")
    (tmp_path / root / ("packed.float32" if packing == "packed" else "w") / "c" / "0").unlink()
    with pytest.raises(eqx_ckpt.IntegrityError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(2)})
    assert f"in checkpoint {str(tmp_path)!r}" in str(info.value)
    assert f"{str(tmp_path / root)!r}" not in str(info.value)


def _manager_run(directory):
    """A manager's directory of three steps, each with a leaf of its own (`big`) and a packed one (`w`)."""
    manager = eqx_ckpt.CheckpointManager(directory)
    for step in (1, 2, 3):
        manager.save(step, {"w": np.full(3, float(step)), "big": np.full((600, 600), float(step), np.float32)})
    manager.close()
    return manager


def test_verify_of_a_manager_directory_checks_every_step(tmp_path):
    """Issue 51, item 4: `verify(run_dir)` said there was no checkpoint there.
    It verifies every committed step now, under one progress bar, and each
    problem names its step and leaf."""
    run = tmp_path / "run"
    manager = _manager_run(run)
    seen = []
    report = eqx_ckpt.verify(run, progress=lambda *counts: seen.append(counts))
    assert report == [] and report.steps == (1, 2, 3) and report.unchecked == ()
    total = sum(eqx_ckpt.Checkpoint(manager.step_path(step)).total_bytes for step in (1, 2, 3))
    assert seen[-1] == (6, 6, total, total)
    chunk = run / "step_00000002" / "big" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    manifest = run / "step_00000003" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"w"', '"v"'))
    report = eqx_ckpt.verify(run)
    assert report.steps == (1, 2, 3)
    assert [(problem.step, problem.leaf) for problem in report] == [(2, "big"), (3, None)]
    assert str(report[0]).startswith(f"step 2: big: Leaf `big` in checkpoint {str(run / 'step_00000002')!r}: ")
    assert "Digest mismatch" in report[0].message
    assert str(report[1]).startswith("step 3: ") and "digest does not match" in report[1].message
    # A step alone is a checkpoint of its own.
    alone = eqx_ckpt.verify(manager.step_path(2))
    assert [(problem.step, problem.leaf) for problem in alone] == [(None, "big")] and alone.steps == ()
    # On a store without folders too.
    with eqx_ckpt.CheckpointManager("memory://verify_steps/run/") as remote:
        for step in (4, 7):
            remote.save(step, {"w": np.full(3, float(step))})
    report = eqx_ckpt.verify("memory://verify_steps/run/")
    assert report == [] and report.steps == (4, 7)


def test_a_step_deleted_while_its_directory_is_verified_is_not_reported_as_damaged(tmp_path, faults):
    """Retention of a run still saving may delete a step while `verify` reads
    it: its missing files are no damage, and `unchecked` says it was deleted."""
    run = tmp_path / "run"
    _manager_run(run)

    def retention(loc, record):
        if loc.display.endswith("step_00000001") and (run / "step_00000001").exists():
            shutil.rmtree(run / "step_00000001")

    faults("storage.open_array", retention)
    report = eqx_ckpt.verify(run)
    assert report == [] and report.steps == (2, 3)
    assert report.unchecked == (
        "Step 1 was deleted while it was verified (by the retention of the manager saving there), so it is not "
        "reported on.",
    )
