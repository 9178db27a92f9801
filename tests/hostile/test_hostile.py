"""Hostile checkpoints: every bad manifest, absurd shape and symbolic link gets a
clear eqx_ckpt error, before any read outside the checkpoint and before any
large allocation (proved in a subprocess under an address-space limit).

A hostile manifest can recompute its own digest (sha256 of the canonical JSON
without the `digest` key), so every edit here does, and the other checks are
what stop it.
"""

import json
import os
import pathlib
import re
import shutil

import jax
import manifests
import numpy as np
import places
import prefork
import pytest
import ramdisk

import eqx_ckpt

HUGE = 10**12


def _tree():
    return {"a": np.arange(1000, dtype=np.float32), "k": jax.random.key(0), "n": 3}


def _like():
    return {"a": np.zeros(1000, np.float32), "k": jax.random.key(1), "n": 0}


def _rewrite(path: pathlib.Path, edit) -> None:
    """Edit the manifest as a JSON object, then sign it again."""
    body = json.loads((path / "manifest.json").read_text())
    edit(body)
    (path / "manifest.json").write_bytes(manifests.sign(body))


def _leaf(body: dict, name: str) -> dict:
    return next(leaf for leaf in body["leaves"] if leaf["path"] == name)


def _set_leaf(name: str, **fields):
    return lambda body: _leaf(body, name).update(fields)


# Manifest edits that must be refused when the manifest is parsed: before any
# array is opened, so before any read of a leaf, inside or outside.
MANIFEST_EDITS = {
    "path-dotdot": _set_leaf("a", path=".."),
    "path-traversal": _set_leaf("a", path="../../outside"),
    "path-absolute": _set_leaf("a", path="/etc/passwd"),
    "path-slash": _set_leaf("a", path="a/../../x"),
    "keypath-traversal": _set_leaf("a", path="../../outside", keypath=[["key", "../../outside"]]),
    "keypath-absolute": _set_leaf("a", path="/tmp", keypath=[["attr", "/tmp"]]),
    "keypath-wrong-type": _set_leaf("a", keypath=[["key", 5]]),
    "keypath-unknown-kind": _set_leaf("a", keypath=[["pickle", "a"]]),
    "keypath-not-list": _set_leaf("a", keypath="a"),
    "path-not-string": _set_leaf("a", path=["a"]),
    "shape-string": _set_leaf("a", shape="1000"),
    "shape-negative": _set_leaf("a", shape=[-1], stored_shape=[-1]),
    "shape-float": _set_leaf("a", shape=[1000.0], stored_shape=[1000.0]),
    "shape-bool": _set_leaf("a", shape=[True], stored_shape=[True]),
    "shape-rank-33": _set_leaf("a", shape=[1] * 33, stored_shape=[1] * 33, chunks=[1] * 33),
    "shape-too-many-elements": _set_leaf("a", shape=[2**40, 2**40], stored_shape=[2**40, 2**40], chunks=[1, 1]),
    "scalar-with-huge-shape": _set_leaf("n", shape=[HUGE], stored_shape=[HUGE], chunks=[1]),
    "stored-shape-not-shape": _set_leaf("a", stored_shape=[HUGE]),
    "chunks-larger-than-array": _set_leaf("a", chunks=[HUGE]),
    "chunks-zero": _set_leaf("a", chunks=[0]),
    "type-unknown": _set_leaf("a", type="pickle"),
    "dtype-object": _set_leaf("a", dtype="object", stored_dtype="object"),
    "dtype-not-string": _set_leaf("a", dtype=5),
    "encoding-unknown": _set_leaf("a", encoding="pickle"),
    "missing-field": lambda body: _leaf(body, "a").pop("dtype"),
    "leaf-not-object": lambda body: body["leaves"].append(["a"]),
    "leaves-not-list": lambda body: body.update(leaves={"a": 1}),
    "duplicate-leaf": lambda body: body["leaves"].append(dict(_leaf(body, "a"))),
    "leaf-inside-leaf": lambda body: body["leaves"].append(
        {**_leaf(body, "a"), "path": "a.b", "keypath": [["key", "a"], ["key", "b"]]}
    ),
    "data-root-traversal": lambda body: body.update(data_root="../.."),
    "data-root-absolute": lambda body: body.update(data_root="/tmp"),
    "format-version-string": lambda body: body.update(format_version="1"),
    "format-wrong": lambda body: body.update(format="pickle"),
    "created-not-string": lambda body: body.update(created=5),
}

# Raw manifest bytes that are not a valid manifest at all.
RAW_MANIFESTS = {
    "duplicate-json-key": lambda text: text.replace(
        '"format": "eqx_ckpt"', '"format": "eqx_ckpt", "format": "eqx_ckpt"'
    ),
    "nan-constant": lambda text: re.sub(r'"format_version": \d+', '"format_version": NaN', text, count=1),
    "deep-nesting": lambda text: "[" * 100_000 + "]" * 100_000,
    "top-level-list": lambda text: "[]",
    "binary": lambda text: "\x00\xff\xfe garbage",
    "empty": lambda text: "",
}


def _make(path: pathlib.Path) -> pathlib.Path:
    eqx_ckpt.tree_serialise_leaves(path, _tree())
    return path


@pytest.mark.parametrize("name", sorted(MANIFEST_EDITS))
def test_hostile_manifest_is_refused(tmp_path, name):
    _rewrite(_make(tmp_path), MANIFEST_EDITS[name])
    for action in (lambda: eqx_ckpt.tree_deserialise_leaves(tmp_path, _like()), lambda: eqx_ckpt.Checkpoint(tmp_path)):
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(f"checkpoint {str(tmp_path)!r}")):
            action()
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.leaf is None and "manifest" in problem.message
    # A save never writes into a directory whose manifest it cannot trust.
    with pytest.raises(eqx_ckpt.CorruptCheckpointError):
        eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())


@pytest.mark.parametrize("name", sorted(RAW_MANIFESTS))
def test_malformed_manifest_is_refused(tmp_path, name):
    manifest = _make(tmp_path) / "manifest.json"
    manifest.write_text(RAW_MANIFESTS[name](manifest.read_text()), encoding="latin-1")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(str(tmp_path))):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())


def test_huge_manifest_is_refused(tmp_path):
    manifest = _make(tmp_path) / "manifest.json"
    with open(manifest, "r+b") as f:
        f.truncate(300 * 2**20)  # sparse: costs no disk
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="more than the 268435456 allowed"):
        eqx_ckpt.Checkpoint(tmp_path)


@pytest.mark.usefixtures("unpacked")  # keys escaped to folder names: every leaf in a folder of its own
def test_escaped_dotdot_key_stays_inside(tmp_path):
    # A key that *is* ".." or an absolute path is fine: it is escaped.
    tree = {"..": np.ones(2), "/etc/passwd": np.zeros(2), ".": np.arange(2)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sorted(os.listdir(tmp_path / "c")) == ["%2E", "%2E%2E", "%2Fetc%2Fpasswd", "manifest.json", "zarr.json"]
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", tree)
    assert all(np.array_equal(out[k], tree[k]) for k in tree)


def _absurd_shape(path: pathlib.Path, *, zarr_too: bool, huge_chunks: bool = False) -> None:
    chunks = [HUGE] if huge_chunks else [1000]
    nbytes = 4 * HUGE
    _rewrite(path, _set_leaf("a", shape=[HUGE], stored_shape=[HUGE], chunks=chunks, nbytes=nbytes))
    _rewrite(path, lambda body: body.update(total_bytes=body["total_bytes"] + nbytes - 4000))
    if zarr_too:
        metadata = json.loads((path / "a" / "zarr.json").read_text())
        metadata["shape"] = [HUGE]
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        (path / "a" / "zarr.json").write_text(json.dumps(metadata))


@pytest.mark.usefixtures("unpacked")  # (a packed leaf's shape must fit its pack: test_pack.py)
@pytest.mark.parametrize("zarr_too,huge_chunks", [(False, False), (True, False), (True, True)])
def test_absurd_shape(tmp_path, zarr_too, huge_chunks):
    _absurd_shape(_make(tmp_path), zarr_too=zarr_too, huge_chunks=huge_chunks)
    # Loading into a `like` of the real shape is a shape mismatch, found before reading.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(f"from (1000,) in `like` to ({HUGE},) on disk")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    # Reading the entry as the manifest describes it is refused, not allocated.
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert ckpt["a"].shape == (HUGE,)
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `a`")):
        np.asarray(ckpt["a"])
    assert [p.leaf for p in eqx_ckpt.verify(tmp_path)] == ["a"]


@pytest.mark.usefixtures("unpacked")
def test_huge_key_data(tmp_path):
    # A key's data axis is checked against its implementation (threefry: 2
    # uint32 words) when the manifest is read, before anything is read or allocated.
    _rewrite(_make(tmp_path), _set_leaf("k", stored_shape=[HUGE], chunks=[1000], nbytes=4 * HUGE))
    why = f"('k'): the key data of 'threefry2x32' keys of shape [] is uint32 of shape [2], not uint32 of shape [{HUGE}]"
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(why)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(why)):
        eqx_ckpt.Checkpoint(tmp_path)


@pytest.mark.usefixtures("unpacked")  # (a packed leaf's dtype must be its pack's: test_pack.py)
def test_manifest_dtype_disagrees_with_zarr_json(tmp_path):
    _rewrite(_make(tmp_path), _set_leaf("a", dtype="float64", stored_dtype="float64", nbytes=8000))
    _rewrite(tmp_path, lambda body: body.update(total_bytes=body["total_bytes"] + 4000))
    like = _like()
    with pytest.raises(eqx_ckpt.LeafError, match="changed dtype"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    like["a"] = np.zeros(1000, np.float64)
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `a`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert [p.leaf for p in eqx_ckpt.verify(tmp_path)] == ["a"]


def test_manifest_totals_edited(tmp_path):
    _rewrite(_make(tmp_path), _set_leaf("a", nbytes=1))
    assert [p.leaf for p in eqx_ckpt.verify(tmp_path)] == ["a"]
    _rewrite(tmp_path, lambda body: (_leaf(body, "a").update(nbytes=4000), body.update(leaf_count=9)))
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.leaf is None and "totals" in problem.message


def _outside_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """A sound checkpoint outside the one under attack: if a link were followed,
    the load would succeed by reading it."""
    return _make(tmp_path / "outside")


def _same_on_load(path):
    out = eqx_ckpt.tree_deserialise_leaves(path, _like())
    return np.array_equal(out["a"], _tree()["a"])


@pytest.mark.usefixtures("unpacked")  # (a link in place of a pack: test_pack.py)
def test_leaf_folder_symlink_is_refused(tmp_path):
    outside = _outside_copy(tmp_path)
    ckpt = _make(tmp_path / "ckpt")
    shutil.rmtree(ckpt / "a")
    (ckpt / "a").symlink_to(outside / "a", target_is_directory=True)
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `a`: 'a' in checkpoint")):
        eqx_ckpt.tree_deserialise_leaves(ckpt, _like())
    with pytest.raises(eqx_ckpt.IntegrityError, match="symbolic link"):
        np.asarray(eqx_ckpt.Checkpoint(ckpt)["a"])
    assert [p.leaf for p in eqx_ckpt.verify(ckpt)] == ["a"]
    # Overwriting removes the link itself, never what it points to.
    eqx_ckpt.tree_serialise_leaves(ckpt, _tree())
    eqx_ckpt.tree_serialise_leaves(ckpt, _tree())
    assert _same_on_load(outside) and eqx_ckpt.verify(outside) == []
    assert _same_on_load(ckpt) and not (ckpt / "a").is_symlink()


@pytest.mark.usefixtures("unpacked")
@pytest.mark.parametrize("target", ["a/c/0", "a/zarr.json", "a/c"])
def test_file_symlink_inside_leaf_is_refused(tmp_path, target):
    outside = _outside_copy(tmp_path)
    ckpt = _make(tmp_path / "ckpt")
    link = ckpt / target
    shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(outside / target)
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(f"{target!r} in checkpoint")):
        eqx_ckpt.tree_deserialise_leaves(ckpt, _like())
    assert [p.leaf for p in eqx_ckpt.verify(ckpt)] == ["a"]


def test_manifest_symlink_is_refused(tmp_path):
    outside = _outside_copy(tmp_path)
    ckpt = _make(tmp_path / "ckpt")
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").symlink_to(outside / "manifest.json")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"'manifest\.json' .* is a symbolic link"):
        eqx_ckpt.tree_deserialise_leaves(ckpt, _like())
    [problem] = eqx_ckpt.verify(ckpt)
    assert problem.leaf is None and "symbolic link" in problem.message


def test_data_root_symlink_is_refused(tmp_path):
    outside = _outside_copy(tmp_path)
    ckpt = _make(tmp_path / "ckpt")
    eqx_ckpt.tree_serialise_leaves(ckpt, _tree())  # now in gen.<commit>
    root = json.loads((ckpt / "manifest.json").read_text())["data_root"]
    shutil.rmtree(ckpt / root)
    (ckpt / root).symlink_to(outside, target_is_directory=True)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=rf"'{re.escape(root)}' .* is a symbolic link"):
        eqx_ckpt.tree_deserialise_leaves(ckpt, _like())
    with pytest.raises(eqx_ckpt.CorruptCheckpointError):
        eqx_ckpt.Checkpoint(ckpt)


def test_checkpoint_itself_may_be_a_symlink(tmp_path):
    # Only links *inside* a checkpoint are refused: `latest -> step_100` is fine.
    _make(tmp_path / "real")
    (tmp_path / "latest").symlink_to(tmp_path / "real", target_is_directory=True)
    assert _same_on_load(tmp_path / "latest")
    assert eqx_ckpt.verify(tmp_path / "latest") == []


def _hostile_checkpoints(root: pathlib.Path) -> dict[str, pathlib.Path]:
    made = {}
    for name, edit in MANIFEST_EDITS.items():
        made[name] = _make(root / name)
        _rewrite(made[name], edit)
    for name, (zarr_too, huge) in {
        "absurd": (False, False),
        "absurd-zarr": (True, False),
        "absurd-chunks": (True, True),
    }.items():
        made[name] = _make(root / name)
        _absurd_shape(made[name], zarr_too=zarr_too, huge_chunks=huge)
    made["key-data-huge"] = _make(root / "key-data-huge")
    _rewrite(made["key-data-huge"], _set_leaf("k", stored_shape=[HUGE], chunks=[1000], nbytes=4 * HUGE))
    # The link points at a folder whose chunk "file" is a FIFO with no writer:
    # opening it would block until the test times out, so reaching the end
    # proves nothing outside the checkpoint was opened.
    trap = root / "trap"
    shutil.copytree(_make(root / "trap-source") / "a", trap)
    (trap / "c" / "0").unlink()
    os.mkfifo(trap / "c" / "0")
    made["leaf-link-to-fifo"] = _make(root / "leaf-link-to-fifo")
    shutil.rmtree(made["leaf-link-to-fifo"] / "a")
    (made["leaf-link-to-fifo"] / "a").symlink_to(trap, target_is_directory=True)
    return made


@pytest.mark.usefixtures("unpacked")  # the checkpoints are made here, with a folder per leaf to attack
def test_hostile_loads_under_memory_limit(tmp_path):
    # Some forty small saves, whose disk is not under test: in memory (`ramdisk`).
    with ramdisk.folder(tmp_path) as folder:
        made = _hostile_checkpoints(folder)
        # The worker's `main`, in a child forked from a template with JAX imported
        # (`prefork`): the address-space limit is the child's own, set after its warm-up.
        code = f"import sys; sys.path.insert(0, {str(places.SUPPORT)!r}); "
        code += "import hostile_worker; hostile_worker.main(sys.argv[1:])"
        run = prefork.run(["-c", code, *(str(p) for p in made.values())], env=dict(os.environ), timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        results = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["path"] for r in results] == [str(p) for p in made.values()]
        for result in results:
            for action in ("load", "lazy", "checkpoint", "verify"):
                assert result[action].startswith("eqx_ckpt."), (result["path"], action, result[action])


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"impl": "bogus"}, "unknown PRNG implementation 'bogus'"),
        ({"impl": "rbg"}, "the key data of 'rbg' keys of shape [] is uint32 of shape [4], not uint32 of shape [2]"),
        ({"impl": "x" * 10_000}, "unknown PRNG implementation 'xxxx"),
    ],
)
def test_a_key_leaf_with_a_bad_prng_implementation_is_refused(tmp_path, fields, why):
    """Once a bare JAX `ValueError` or `TypeError` on load, and sound to `verify`."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    _rewrite(tmp_path, _set_leaf("k", **fields))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(why)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(why)):
        eqx_ckpt.Checkpoint(tmp_path)
    problems = eqx_ckpt.verify(tmp_path)
    assert len(problems) == 1 and why in problems[0].message


def test_an_array_leaf_with_a_prng_implementation_is_refused(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    _rewrite(tmp_path, _set_leaf("a", impl="threefry2x32"))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("a numpy leaf has no PRNG implementation")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, _like())
