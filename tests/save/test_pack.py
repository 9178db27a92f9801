"""Small leaves packed into one zarr v3 array per dtype (planned by
eqx_ckpt/_save/_records.py, read by eqx_ckpt/_load/_pack.py): the files on disk, reading a
packed leaf without eqx_ckpt, every kind of load, damage to a pack, hostile
pack records, and checkpoints written before packing."""

import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import manifests
import numpy as np
import pytest
import tensorstore as ts
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._save import _records


def _tree():
    return {
        "model": {
            "w": jnp.arange(12.0).reshape(3, 4),
            "b": jnp.ones(5, jnp.bfloat16),
            "big": jnp.arange(300_000, dtype=jnp.float32),  # 1.2 MB: an array of its own
        },
        "opt": {"count": np.int32(7), "mu": np.full((2, 3), 2.5, np.float32), "flag": True},
        "key": jax.random.key(3),
    }


def _manifest(path: pathlib.Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _leaf(body: dict, name: str) -> dict:
    return next(leaf for leaf in body["leaves"] if leaf["path"] == name)


def test_small_leaves_share_one_array_per_dtype(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "manifest.json",
        "model",
        "packed.bfloat16",
        "packed.bool",
        "packed.float32",
        "packed.int32",
        "packed.uint32",
        "zarr.json",
    ]
    # Only the large leaf has a folder of its own.
    assert sorted(os.listdir(tmp_path / "model")) == ["big", "zarr.json"]
    body = _manifest(tmp_path)
    assert body["format_version"] == 5
    packs = {pack["name"]: pack for pack in body["packs"]}
    assert set(packs) == {n for n in names if n.startswith("packed.")}
    w, mu = _leaf(body, "model.w"), _leaf(body, "opt.mu")
    assert w["pack"] == mu["pack"] == "packed.float32"
    assert "pack" not in _leaf(body, "model.big")
    # Every leaf starts on a 64-byte boundary, in dotted-path order.
    assert (w["offset"] * 4) % 64 == 0 and (mu["offset"] * 4) % 64 == 0 and w["offset"] < mu["offset"]


def test_a_packed_leaf_reads_back_with_tensorstore_alone(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    leaf = _leaf(_manifest(tmp_path), "opt.mu")
    pack = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / leaf["pack"])}}).result()
    size = int(np.prod(leaf["shape"]))
    values = pack[leaf["offset"] : leaf["offset"] + size].read().result().reshape(leaf["shape"])
    np.testing.assert_array_equal(values, np.full((2, 3), 2.5, np.float32))


@pytest.mark.parametrize("lazy", [False, True])
def test_every_load_of_packed_leaves(tmp_path, lazy):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path, skeleton, lazy=lazy)
    assert tree_equal(eqx_ckpt.materialise(back), tree, typematch=True)
    model = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree["model"], prefix="model", lazy=lazy)
    assert tree_equal(eqx_ckpt.materialise(model), tree["model"], typematch=True)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    np.testing.assert_array_equal(ckpt["model.w"][1:, ::2], np.arange(12.0).reshape(3, 4)[1:, ::2])
    assert ckpt["opt.count"] == 7 and ckpt["opt.flag"] is True
    assert eqx_ckpt.verify(tmp_path) == []
    assert not eqx_ckpt.diff(tmp_path, tmp_path)


def test_a_packed_leaf_loads_onto_several_devices(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    tree = {"v": jnp.arange(8.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert "pack" in _leaf(_manifest(tmp_path), "v")
    like = {"v": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)}
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert back["v"].sharding == sharding and tree_equal(back, tree, typematch=True)


def test_a_sharded_leaf_keeps_its_own_array(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu"))
    sharded = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"v": sharded, "s": jnp.ones(3)})
    body = _manifest(tmp_path)
    assert "pack" not in _leaf(body, "v") and "pack" in _leaf(body, "s")
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"v": sharded, "s": jnp.ones(3)})["v"], sharded)


def test_overwrites_remove_the_old_packs(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(3)})
    assert "packed.float32" in os.listdir(tmp_path)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(3, jnp.int32)})
    (generation,) = [n for n in os.listdir(tmp_path) if n.startswith("gen.")]
    assert sorted(os.listdir(tmp_path)) == [generation, "manifest.json"]
    assert sorted(os.listdir(tmp_path / generation)) == ["packed.int32", "zarr.json"]
    assert tree_equal(
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.ones(3, jnp.int32)}), {"a": jnp.zeros(3, jnp.int32)}
    )


def _many(count=2000):
    return {f"l{i:04d}": np.full(1000, i, np.float32) for i in range(count)}  # 4 kB each


def _damage_chunk(path: pathlib.Path, name: str, index: int) -> None:
    chunk = path / name / "c" / str(index)
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))


def _chunk_of(body: dict, name: str) -> int:
    pack = next(p for p in body["packs"] if p["name"] == "packed.float32")
    return _leaf(body, name)["offset"] // pack["chunks"][0]


def test_damage_to_a_pack_names_the_leaves_in_that_chunk(tmp_path):
    tree = _many()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    body = _manifest(tmp_path)
    assert len(os.listdir(tmp_path / "packed.float32" / "c")) >= 2, "the test needs a pack of several chunks"
    _damage_chunk(tmp_path, "packed.float32", 1)
    in_chunk = sorted(
        k
        for k in tree
        if _leaf(body, k)["offset"] // _pack_chunk(body) <= 1 <= (_leaf(body, k)["offset"] + 999) // _pack_chunk(body)
    )
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == in_chunk
    assert all("packed.float32" in p.message and "damaged" in p.message for p in problems)
    # A load that needs the chunk fails naming a leaf in it...
    with pytest.raises(eqx_ckpt.IntegrityError, match=in_chunk[0]):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    with pytest.raises(eqx_ckpt.IntegrityError, match=in_chunk[-1]):
        eqx_ckpt.Checkpoint(tmp_path)[in_chunk[-1]][...]
    # ...one that does not never reads it: a partial load reads only its chunks.
    first = {k: v for k, v in tree.items() if _chunk_of(body, k) == 0 and k not in in_chunk}
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, where=lambda t: [t[k] for k in first])
    assert tree_equal({k: back[k] for k in first}, first)


def _pack_chunk(body: dict) -> int:
    return next(p for p in body["packs"] if p["name"] == "packed.float32")["chunks"][0]


@pytest.mark.parametrize("damage", ["deleted", "truncated", "appended"])
def test_a_missing_or_resized_pack_chunk_is_found(tmp_path, damage):
    tree = _many()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    chunk = tmp_path / "packed.float32" / "c" / "0"
    if damage == "deleted":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-10])
    else:
        chunk.write_bytes(chunk.read_bytes() + b"\0")
    problems = eqx_ckpt.verify(tmp_path)
    assert "l0000" in [p.leaf for p in problems]
    expected = (tmp_path / "packed.float32" / "c" / "1").stat().st_size
    size = "missing" if damage == "deleted" else f"{chunk.stat().st_size} bytes, not {expected}"
    # One wording for `verify` and a load (the load's once read "it is in the pack ... is
    # damaged or incomplete: ... its folder holds only 386", a size nobody could find).
    said = f"its pack 'packed.float32' is damaged: its chunk file 'packed.float32/c/0' is {size}."
    assert problems[0].message == said, problems[0]
    if damage != "appended":  # bytes after the checksum change no value; verify alone reports them
        with pytest.raises(
            eqx_ckpt.IntegrityError,
            match=re.escape(f"Leaf `l0000` in checkpoint {str(tmp_path)!r}: {said} Nothing was read."),
        ):
            eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
        with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(said)):
            eqx_ckpt.Checkpoint(tmp_path)["l0001"][...]


def _rewrite(path: pathlib.Path, edit) -> None:
    body = _manifest(path)
    edit(body)
    (path / "manifest.json").write_bytes(manifests.sign(body))


def _edit_leaf(name, **fields):
    return lambda body: _leaf(body, name).update(fields)


def _edit_pack(**fields):
    return lambda body: body["packs"][0].update(fields)


HOSTILE = {
    "offset beyond the pack": (_edit_leaf("a", offset=10**9), "does not place it inside its pack"),
    "negative offset": (_edit_leaf("a", offset=-1), "does not place it inside its pack"),
    "offset not an integer": (_edit_leaf("a", offset=1.5), "does not place it inside its pack"),
    "unknown pack": (_edit_leaf("a", pack="packed.int8"), "is not among the manifest's `packs`"),
    "pack of another dtype": (_edit_leaf("a", stored_dtype="int32", dtype="int32"), "but its pack holds float32"),
    "pack name leads elsewhere": (_edit_pack(name="../../etc"), "cannot be named"),
    "pack name of another dtype": (_edit_pack(name="packed.int8"), "cannot be named"),
    "absurd pack": (_edit_pack(shape=[2**60]), "more than 2\\*\\*53 elements"),
    "chunks beyond the pack": (_edit_pack(chunks=[10**6]), "do not fit the pack's shape"),
    "packs not a list": (lambda body: body.update(packs={}), "`packs` is not a list"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_pack_records_are_refused(tmp_path, name):
    edit, message = HOSTILE[name]
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(3), "b": jnp.zeros(2)})
    _rewrite(tmp_path, edit)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=message):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.ones(3), "b": jnp.zeros(2)})


def test_a_pack_folder_symlink_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"a": jnp.ones(3)})
    outside = tmp_path / "outside"
    (path / "packed.float32").rename(outside)
    (path / "packed.float32").symlink_to(outside)
    with pytest.raises(eqx_ckpt.IntegrityError, match="symbolic link"):
        eqx_ckpt.tree_deserialise_leaves(path, {"a": jnp.ones(3)})


def test_checkpoints_written_before_packing_still_load(tmp_path, monkeypatch):
    tree = _tree()
    monkeypatch.setattr(_records, "PACK_BYTES", -1)  # a leaf folder each, as format 2 wrote
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    monkeypatch.undo()

    body = _manifest(tmp_path)
    del body["packs"]
    (tmp_path / "manifest.json").write_bytes(manifests.as_version(body, 2))
    assert os.path.isdir(tmp_path / "model" / "w")
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
    assert eqx_ckpt.Checkpoint(tmp_path).format_version == 2 and eqx_ckpt.verify(tmp_path) == []
    # Overwritten by this version, it is packed, and the old folders are gone.
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert not os.path.exists(tmp_path / "model") and _manifest(tmp_path)["format_version"] == 5
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


def test_the_first_packed_format_verifies_without_a_root_group(tmp_path):
    # Format 3 as first written wrote no group metadata at the data root when
    # every leaf was packed; a save now does (zarr tools see the packs in a group).
    tree = {"a": np.ones(3, np.float32), "b": {"c": np.arange(4)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    (tmp_path / "zarr.json").unlink()
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.message.startswith("The zarr group metadata 'zarr.json' is missing")
    (tmp_path / "manifest.json").write_bytes(manifests.as_version(_manifest(tmp_path), 3))
    assert eqx_ckpt.Checkpoint(tmp_path).format_version == 3 and eqx_ckpt.verify(tmp_path) == []
    # Damaged, rather than missing, it is a problem in format 3 too.
    (tmp_path / "zarr.json").write_bytes(b"garbage")
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.message.startswith("The zarr group metadata 'zarr.json' is not valid JSON.")


def test_ocdbt_layout_packs_too(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt")
    assert any(leaf.get("pack") for leaf in _manifest(tmp_path)["leaves"])
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
    assert eqx_ckpt.verify(tmp_path) == []


def test_an_asynchronous_save_copies_numpy_leaves_before_it_returns(tmp_path):
    tree = _many(200)
    expected = {k: v.copy() for k, v in tree.items()}
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path, tree, blocking=False)
    for value in tree.values():
        value[:] = -1  # the caller changes its arrays while the save is written
    pending.wait()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), expected)


def _striped(count=60):
    """Leaves of assorted sizes over many 4 KiB chunks of one pack."""
    rng = np.random.default_rng(1)
    return {f"l{i:02d}": rng.standard_normal(int(rng.integers(1, 900))).astype(np.float32) for i in range(count)}


@pytest.fixture
def small_pack_chunks(monkeypatch):
    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", 4096)


def test_local_packs_are_read_by_eqx_ckpt_only_the_chunks_a_load_needs(tmp_path, faults, small_pack_chunks):
    """On a local disk a pack's chunk files are read without TensorStore
    (`_local_read.start_pack_run`), and a partial load reads only the chunks holding
    the selected leaves, even when they start and end inside a chunk."""
    tree = _striped()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    body = _manifest(tmp_path)
    assert 1000 <= _pack_chunk(body) <= 1024 and len(os.listdir(tmp_path / "packed.float32" / "c")) > 8

    def no_tensorstore(*args, **kwargs):
        raise AssertionError("a local pack was opened with TensorStore")

    faults("storage.open_pack", no_tensorstore)
    read = []
    faults("local_read.start_reads", lambda path, keys: read.extend(keys))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)
    assert sorted(set(read)) == sorted(f"c/{i}" for i in range(len(os.listdir(tmp_path / "packed.float32" / "c"))))
    chosen = ["l20", "l21", "l22"]
    needed = {f"c/{c}" for k in chosen for c in range(_chunk_of(body, k), _last_chunk_of(body, k) + 1)}
    read.clear()
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, where=lambda t: [t[k] for k in chosen])
    assert tree_equal({k: back[k] for k in chosen}, {k: tree[k] for k in chosen}, typematch=True)
    assert set(read) == needed


def _last_chunk_of(body: dict, name: str) -> int:
    leaf = _leaf(body, name)
    return (leaf["offset"] + int(np.prod(leaf["shape"])) - 1) // _pack_chunk(body)


def test_a_pack_chunk_file_symlink_is_refused(tmp_path, small_pack_chunks):
    tree = _striped()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    chunk = tmp_path / "packed.float32" / "c" / "3"
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    chunk.rename(outside)
    chunk.symlink_to(outside)
    # Named: the link, and a leaf of the pack (the refusal comes before any read).
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `l\d\d`: 'packed.float32/c/3' .* is a symbolic link"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert outside.exists()


@pytest.mark.parametrize("target", ["folder", "nothing"])
def test_verify_names_a_link_to_a_folder_or_to_nothing_in_a_pack(tmp_path, target):
    """A link beside a pack's chunk files that leads to a folder, or nowhere, is
    reported by `verify` as a link, a problem of each leaf of the pack. (The
    chunk-size check once walked past a link to a folder but read the size of
    a broken link, so `verify` crashed with `FileNotFoundError`; through
    `_storage.local_entry` it must skip both alike, for the read that names
    the link.)"""
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, {"a": jnp.ones(3), "b": jnp.zeros(2)})
    link = path / "packed.float32" / "c" / "99"
    (tmp_path / "folder").mkdir()
    link.symlink_to(tmp_path / target)
    problems = eqx_ckpt.verify(path)
    link_name = "'packed.float32/c/99'"
    expected = f"its pack 'packed.float32' is damaged: {link_name} in checkpoint {str(path)!r} is a symbolic link."
    assert [p.leaf for p in problems] == ["a", "b"]
    assert all(p.message.startswith(expected) for p in problems), problems


def test_packs_elsewhere_are_read_through_tensorstore(small_pack_chunks):
    tree = _striped()
    eqx_ckpt.tree_serialise_leaves("memory://striped/", tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves("memory://striped/", tree), tree, typematch=True)


def _held(tree: dict, body: dict) -> list[list[str]]:
    """The leaves each chunk of the float32 pack holds, chunk by chunk."""
    chunk = _pack_chunk(body)
    spans = {k: (_leaf(body, k)["offset"], _leaf(body, k)["offset"] + tree[k].size) for k in tree}
    count = -(-max(hi for _, hi in spans.values()) // chunk)
    return [sorted(k for k, (lo, hi) in spans.items() if lo // chunk <= c < -(-hi // chunk)) for c in range(count)]


def test_verify_reads_a_pack_by_the_pack_reader_a_run_a_chunk(tmp_path, faults, small_pack_chunks):
    """`verify` reads a pack as a load does, by the pack reader (`pack.read_run`):
    every chunk once, in order, as a run of its own naming the leaves it holds,
    and a damaged chunk is a problem of exactly those leaves. (It read the
    chunks itself, outside the pack reader: no run.)"""
    tree = _striped()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    held = _held(tree, _manifest(tmp_path))
    assert len(held) == len(os.listdir(tmp_path / "packed.float32" / "c")) > 8
    runs = []
    faults("pack.read_run", lambda loc, pack, paths: runs.append((pack.name, sorted(paths))))
    assert eqx_ckpt.verify(tmp_path) == []
    assert runs == [("packed.float32", paths) for paths in held]
    _damage_chunk(tmp_path, "packed.float32", 3)
    runs.clear()
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == held[3]
    assert all(p.message.startswith("its pack 'packed.float32' is damaged: ") for p in problems), problems
    assert runs == [("packed.float32", paths) for paths in held]


def test_a_failed_run_finds_its_damaged_leaf_by_the_pack_reader(tmp_path, faults, small_pack_chunks):
    """A run of a pack that fails to read is read again leaf by leaf, each a
    run of its own by the pack reader (`pack.read_run`, one leaf), in order,
    until the damaged leaf, which the error names. (Each was read by an open
    of its own, `_storage.open_packed`: no run.)"""
    tree = _striped()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    held = _held(tree, _manifest(tmp_path))
    _damage_chunk(tmp_path, "packed.float32", 3)
    runs = []
    faults("pack.read_run", lambda loc, pack, paths: runs.append(list(paths)))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(f"Leaf `{held[3][0]}` in checkpoint")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert runs[0] == sorted(tree), runs  # the whole pack fits one run
    before = sorted(k for k in tree if k < held[3][0])
    assert runs[1:] == [[k] for k in [*before, held[3][0]]]


@pytest.mark.parametrize("elements", [1000, 32 * 1024 + 58, 1024 * 1024 + 10_500, 3 * 32 * 1024])
def test_a_packs_chunk_files_hold_its_data_not_padding(tmp_path, elements):
    """Chunks of at most `PACK_CHUNK_BYTES`, cut as evenly as the pack allows:
    the chunk files (zarr stores each one full) pad less than 64 bytes per
    chunk past the pack's data, where a last chunk of the full length was
    mostly zeros (42 KB of data in a 4 MiB file)."""
    leaves = {f"l{i:03d}": np.arange(n, dtype=np.float32) for i, n in enumerate(_sizes(elements))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", leaves)
    (pack,) = _manifest(tmp_path / "ckpt")["packs"]
    (size,), (chunk,) = pack["shape"], pack["chunks"]
    assert chunk * 4 <= _records.PACK_CHUNK_BYTES
    files = sorted((tmp_path / "ckpt" / "packed.float32" / "c").iterdir())
    assert len(files) == -(-size // chunk)
    stored = sum(f.stat().st_size - 4 for f in files)  # each ends with its crc32c
    assert 0 <= stored - size * 4 < 64 * len(files), (size, chunk, len(files))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", leaves)
    assert tree_equal(loaded, leaves, typematch=True)


def _sizes(elements):
    """Leaves of at most 60 KiB (float32) making `elements` in all."""
    out = [15 * 1024] * (elements // (15 * 1024))
    return [*out, elements % (15 * 1024)] if elements % (15 * 1024) else out
