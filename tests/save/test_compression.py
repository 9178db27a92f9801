"""Compressed chunks (`compression=`, issue 73): zarr v3's own codecs in each
array's `zarr.json`, read back bit for bit by eqx_ckpt, TensorStore and
zarr-python; checked as stored; shared by incremental saves; refused when a
file is larger than a compressed chunk can be, or when a manifest names a
compression it may not."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import places
import pytest
import tensorstore as ts
from arrays import bits, tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _format

COMPRESSIONS = list(_format.COMPRESSIONS)
ROOT = places.ROOT


def _weights(shape, dtype=np.float32, seed=0):
    """Values shaped like trained weights: small, normal, their exponents skewed."""
    return (np.random.default_rng(seed).normal(0, 0.02, size=shape)).astype(dtype)


def _tree():
    """Large leaves of several dtypes (arrays of their own), small ones (packed),
    scalars and a PRNG key."""
    return {
        "w_bf16": jnp.asarray(_weights((1024, 1024), ml_dtypes.bfloat16)),
        "w_f32": _weights((700, 513)),
        "f16": _weights((600, 1000), np.float16),
        "i8": np.arange(2_000_000, dtype=np.int64).astype(np.int8).reshape(2000, 1000),
        "mask": np.arange(1_500_000).reshape(1500, 1000) % 3 == 0,
        "c64": (_weights((300, 600)) + 1j * _weights((300, 600), seed=1)).astype(np.complex64),
        "u4": np.arange(2_100_000, dtype=np.uint8).astype(ml_dtypes.uint4).reshape(2100, 1000),
        "small": {"bias": jnp.arange(7.0), "i": np.arange(5, dtype=np.int32), "b": np.array([True, False])},
        "key": jax.random.key(3),
        "step": 12,
        "lr": 0.5,
    }


def _files(path):
    return {p: p.stat() for p in pathlib.Path(path).rglob("*") if p.is_file()}


def _chunk_files(path):
    return sorted(p for p in _files(path) if "c" in p.relative_to(path).parts)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_kind_of_leaf_round_trips_bit_for_bit(tmp_path, compression):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree, compression=compression)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "c", tree)
    assert tree_equal(loaded, tree, typematch=True)
    assert [bits(x) for x in jax.tree.leaves(loaded)] == [bits(x) for x in jax.tree.leaves(tree)]
    assert eqx_ckpt.verify(tmp_path / "c") == []
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["format_version"] == 6
    assert {pack["compression"] for pack in manifest["packs"]} == {compression}
    own = [leaf for leaf in manifest["leaves"] if "pack" not in leaf]
    assert len(own) == 7 and {leaf["compression"] for leaf in own} == {compression}
    assert all("compression" not in leaf for leaf in manifest["leaves"] if "pack" in leaf)


def test_true_is_blosc_lz4_and_none_writes_version_5_unchanged(tmp_path):
    tree = {"w": _weights((2000, 1000))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "true", tree, compression=True)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "none", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "false", tree, compression=False)
    compressed = json.loads((tmp_path / "true" / "manifest.json").read_text())
    assert compressed["leaves"][0]["compression"] == "blosc-lz4"
    for plain in ("none", "false"):
        text = (tmp_path / plain / "manifest.json").read_text()
        assert json.loads(text)["format_version"] == 5 and "compression" not in text
        codecs = json.loads((tmp_path / plain / "w" / "zarr.json").read_text())["codecs"]
        assert [codec["name"] for codec in codecs] == ["bytes", "crc32c"]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_tensorstore_and_zarr_python_read_a_compressed_array_without_eqx_ckpt(tmp_path, compression):
    zarr = pytest.importorskip("zarr")
    tree = {"w": _weights((3000, 1000)), "h": _weights((300, 3000), ml_dtypes.bfloat16)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, compression=compression)
    metadata = json.loads((tmp_path / "w" / "zarr.json").read_text())
    names = [codec["name"] for codec in metadata["codecs"]]
    assert names == ["bytes", compression.split("-")[0], "crc32c"]
    if compression.startswith("blosc"):
        config = metadata["codecs"][1]["configuration"]
        assert config["shuffle"] == "bitshuffle" and config["typesize"] == 4
        assert config["cname"] == compression.removeprefix("blosc-")
    # Chunks of at most 8 MiB (not 64): 3000 rows of 4000 bytes in chunks of 1500 rows.
    assert metadata["chunk_grid"]["configuration"]["chunk_shape"] == [1500, 1000]
    for name in ("w", "h"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / name)}}
        read = ts.open(spec, open=True).result().read().result()
        assert read.dtype == tree[name].dtype and bits(read) == bits(tree[name])
    # zarr-python knows no bfloat16 (a TensorStore extension): the float32 array.
    assert bits(zarr.open_array(str(tmp_path / "w"), mode="r")[:]) == bits(tree["w"])


def test_trained_like_weights_are_stored_in_fewer_bytes(tmp_path):
    tree = {"bf16": _weights((1024, 2048), ml_dtypes.bfloat16), "f32": _weights((1024, 1024))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "raw", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "lz4", tree, compression=True)
    for name in tree:
        raw = sum(p.stat().st_size for p in _chunk_files(tmp_path / "raw") if name in p.parts)
        packed = sum(p.stat().st_size for p in _chunk_files(tmp_path / "lz4") if name in p.parts)
        assert packed < 0.95 * raw, (name, packed, raw)


def test_an_asynchronous_save_and_a_manager_compress_too(tmp_path):
    tree = {"w": jnp.asarray(_weights((2048, 1024))), "b": jnp.zeros(4)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree, blocking=False, compression="zstd").wait()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", tree), tree, typematch=True)
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["format_version"] == 6
    with eqx_ckpt.CheckpointManager(tmp_path / "m", blocking=False) as manager:
        manager.save(0, tree, compression="blosc-zstd")
    restored = eqx_ckpt.CheckpointManager(tmp_path / "m").restore(tree)
    assert tree_equal(restored, tree, typematch=True)
    assert "blosc-zstd" in (tmp_path / "m" / _format.step_name(0) / "manifest.json").read_text()


def test_an_incremental_save_shares_the_unchanged_compressed_chunks_without_a_warning(tmp_path):
    first = {"frozen": _weights((4096, 1024)), "head": _weights((4096, 1024), seed=1), "s": np.arange(9.0)}
    second = {**first, "head": first["head"] + 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a changed chunk of another size is no damage
        with eqx_ckpt.CheckpointManager(tmp_path) as manager:
            manager.save(0, first, compression=True)
            manager.save(1, second, compression=True)
    step0, step1 = (tmp_path / _format.step_name(s) for s in (0, 1))
    for name, shared in (("frozen", True), ("head", False)):
        files0 = sorted(p for p in _chunk_files(step0) if name in p.parts)
        files1 = sorted(p for p in _chunk_files(step1) if name in p.parts)
        assert len(files0) == len(files1) >= 2
        same = [a.stat().st_ino == b.stat().st_ino for a, b in zip(files0, files1)]
        assert same == [shared] * len(files0), name
    restored = eqx_ckpt.CheckpointManager(tmp_path).restore(second, step=1)
    assert tree_equal(restored, second, typematch=True)


def test_lazy_and_partial_loads_read_compressed_leaves(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, compression=True)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert bits(ckpt["w_f32"][5:7]) == bits(tree["w_f32"][5:7])
    assert bits(np.asarray(ckpt["small.bias"][...])) == bits(np.asarray(tree["small"]["bias"]))
    part = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree["small"], prefix="small")
    assert tree_equal(part, tree["small"], typematch=True)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree, lazy=True)
    assert bits(np.asarray(lazy["i8"])) == bits(tree["i8"])


def test_verify_finds_a_damaged_compressed_chunk_and_a_load_refuses_it(tmp_path):
    tree = {"w": _weights((4096, 1024)), "small": np.arange(10.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, compression=True)
    chunk = _chunk_files(tmp_path / "w")[1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    problems = eqx_ckpt.verify(tmp_path)
    assert [p.leaf for p in problems] == ["w"], problems
    with pytest.raises(eqx_ckpt.IntegrityError, match="`w`"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)


def test_a_chunk_file_larger_than_any_compressed_chunk_is_refused_before_it_is_read(tmp_path):
    tree = {"w": _weights((2048, 1024))}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, compression=True)
    chunk = _chunk_files(tmp_path / "w")[0]
    most = _format.most_stored_bytes(2048 * 1024 * 4, "blosc-lz4") + _format.CHECKSUM_BYTES  # one chunk
    chunk.write_bytes(chunk.read_bytes() + bytes(most))
    expected = f"is {chunk.stat().st_size} bytes, which no compressed chunk is (1 to {most} bytes)"
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(expected)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    [problem] = eqx_ckpt.verify(tmp_path)
    assert expected in str(problem)


def _rewrite_manifest(path, edit):
    """Edit a manifest's JSON and write it back with a digest that matches."""
    import manifests

    body = json.loads((path / "manifest.json").read_text())
    edit(body)
    (path / "manifest.json").write_bytes(manifests.sign(body))


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda b: b["leaves"][0].update(compression="gzip"), r"unknown compression 'gzip' \(one of blosc-lz4"),
        (lambda b: b["packs"][0].update(compression=7), r"unknown compression '7'"),
        (
            lambda b: (
                b.update(format_version=5),
                [pack.pop("compression") for pack in b["packs"]],
                b["leaves"][0].update(compression="zstd"),
            ),
            r"unknown compression 'zstd' \(none before format version 6\)",
        ),
        (
            lambda b: [leaf.update(compression="zstd") for leaf in b["leaves"] if "pack" in leaf],
            "a packed leaf's chunks are its pack's",
        ),
    ],
    ids=["unknown", "not-a-string", "before-version-6", "on-a-packed-leaf"],
)
def test_a_manifest_naming_a_compression_it_may_not_is_refused(tmp_path, edit, why):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": _weights((2048, 1024)), "s": np.arange(3.0)}, compression=True)
    _rewrite_manifest(tmp_path, edit)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=why):
        eqx_ckpt.Checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("gzip", eqx_ckpt.CheckpointValueError),
        ("LZ4", eqx_ckpt.CheckpointValueError),
        (1, eqx_ckpt.CheckpointTypeError),
    ],
)
def test_an_unknown_compression_is_an_error_and_nothing_is_written(tmp_path, value, error):
    expected = f'`compression` must be None, True or one of "blosc-lz4", "blosc-zstd", "zstd", not {value!r}.'
    with pytest.raises(error, match=re.escape(expected)):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "c", {"w": np.zeros(3)}, compression=value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def _previous_eqx_ckpt(tmp_path):
    """The source tree of the last commit whose saves were all version 5 (before
    compression), taken out with `git archive`; `None` where git or its history is missing."""
    try:
        commit = subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", "eqx_ckpt/_ondisk/_format.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        history = subprocess.run(
            ["git", "log", "--format=%H", f"{commit}", "--", "eqx_ckpt/_ondisk/_format.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    for candidate in history:
        text = subprocess.run(
            ["git", "show", f"{candidate}:eqx_ckpt/_ondisk/_format.py"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        if "FORMAT_VERSION = 5" in text:
            break
    else:
        return None
    target = tmp_path / "old"
    target.mkdir()
    archive = subprocess.run(["git", "archive", candidate, "eqx_ckpt"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def test_an_eqx_ckpt_of_format_5_refuses_a_compressed_checkpoint_by_its_version(tmp_path):
    old = _previous_eqx_ckpt(tmp_path)
    if old is None:
        pytest.skip("this checkout has no git history holding an eqx_ckpt of format version 5")
    tree = {"w": _weights((2048, 1024))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "new", tree, compression=True)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", tree)
    script = (
        "import sys, eqx_ckpt, numpy as np\n"
        "print(eqx_ckpt.__file__)\n"
        "ok = eqx_ckpt.tree_deserialise_leaves(sys.argv[2], {'w': np.zeros((2048, 1024), np.float32)})\n"
        "print('plain loads:', float(abs(ok['w']).sum()) > 0)\n"
        "try:\n"
        "    eqx_ckpt.tree_deserialise_leaves(sys.argv[1], {'w': np.zeros((2048, 1024), np.float32)})\n"
        "except eqx_ckpt.CheckpointVersionError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(old)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "new"), str(tmp_path / "plain")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(str(old)), lines  # the old code, not this checkout's
    assert lines[1] == "plain loads: True"
    assert "format version 6, which is not one this eqx_ckpt reads (up to 5)" in lines[2], lines


def test_the_compressed_fixture_is_a_copy_of_what_a_save_writes_today(tmp_path):
    """tests/fixtures/format_6 (test_compat.py loads it) holds compressed arrays
    that today's save writes the same way: the same codecs, the same chunk bytes."""
    fixture = places.FIXTURES / "format_6"
    spec = __import__("importlib.util").util.spec_from_file_location("mf", places.FIXTURES / "make_fixture.py")
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "today", module.expected(), compression="blosc-lz4")
    for name in ("big/zarr.json", "big/c/0/0", "packed.float32/zarr.json", "packed.float32/c/0"):
        assert (fixture / name).read_bytes() == (tmp_path / "today" / name).read_bytes(), name
    shutil.rmtree(tmp_path / "today")


def test_info_ls_and_checkpoint_show_the_stored_and_the_raw_size(tmp_path, capsys):
    from eqx_ckpt._load._checkpoint import human
    from eqx_ckpt._tools._cli import main

    tree = {"w": _weights((2048, 1024), ml_dtypes.bfloat16), "b": np.arange(4.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", tree, compression="blosc-zstd")
    eqx_ckpt.tree_serialise_leaves(tmp_path / "raw", tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "c")
    on_disk = sum(p.stat().st_size for p in _chunk_files(tmp_path / "c"))
    assert ckpt.compression == "blosc-zstd" and ckpt.stored_bytes == on_disk < 0.85 * ckpt.total_bytes
    raw = eqx_ckpt.Checkpoint(tmp_path / "raw")
    assert raw.compression is None and raw.stored_bytes == sum(p.stat().st_size for p in _chunk_files(tmp_path / "raw"))
    assert main(["info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "format:          eqx_ckpt 6 " in out and "compression:     blosc-zstd\n" in out
    ratio = on_disk / ckpt.total_bytes
    assert f"stored:          {on_disk} (" in out and f", {ratio:.2f}x, checksums included)" in out, out
    assert main(["ls", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.endswith(f"2 leaves, 4.0 MiB, stored compressed (blosc-zstd) in {human(on_disk)}\n")
    assert main(["info", str(tmp_path / "raw")]) == 0
    assert "compression" not in capsys.readouterr().out


def test_diff_compares_values_not_stored_bytes(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "raw", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "zstd", tree, compression="zstd")
    assert not eqx_ckpt.diff(tmp_path / "raw", tmp_path / "zstd")
    changed = {**tree, "w_f32": tree["w_f32"] + 1}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "changed", changed, compression=True)
    assert list(eqx_ckpt.diff(tmp_path / "zstd", tmp_path / "changed")) == ["! w_f32: values differ"]


def _replace_chunk(chunk, data: bytes) -> None:
    """Write `data` as the chunk file's bytes, with a checksum that matches them."""
    import crc32c

    chunk.write_bytes(data + crc32c.crc32c(data).to_bytes(4, "little"))


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("forged", ["garbage", "fewer bytes", "more bytes"])
def test_a_chunk_with_a_good_checksum_that_does_not_decompress_to_one_chunk_is_refused(tmp_path, compression, forged):
    """A hostile file may carry a valid crc32c of bytes that are not a chunk:
    eqx_ckpt's own reads (and TensorStore's, through `Checkpoint`) refuse it."""
    tree = {"w": _weights((2048, 1024))}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, compression=compression)
    chunk = _chunk_files(tmp_path / "w")[0]
    codec = _format.codec(compression, 4)
    chunk_bytes = tree["w"][:1024].view(np.uint32)
    data = {
        "garbage": bytes(range(256)) * 100,
        "fewer bytes": bytes(codec.encode(chunk_bytes[:1000])),
        "more bytes": bytes(codec.encode(np.concatenate([chunk_bytes, chunk_bytes[:10]]))),
    }[forged]
    _replace_chunk(chunk, data)
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `w`.*(does not decompress|decompresses to|damaged)"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert [p.leaf for p in eqx_ckpt.verify(tmp_path)] == ["w"]


def test_a_lazy_slice_reads_only_the_chunks_that_hold_it(tmp_path):
    """Every chunk but the one holding the rows damaged (same size): the slice
    still reads, so nothing else was read; the whole leaf does not."""
    w = _weights((8192, 1024))  # 32 MiB: four compressed chunks of 2048 rows
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": w}, compression=True)
    files = _chunk_files(tmp_path / "w")
    assert [f.relative_to(tmp_path / "w").as_posix() for f in files] == [f"c/{i}/0" for i in range(4)]
    for i in (0, 1, 3):
        data = bytearray(files[i].read_bytes())
        data[100] ^= 0xFF
        files[i].write_bytes(bytes(data))
    assert bits(np.asarray(eqx_ckpt.Checkpoint(tmp_path)["w"][5000:5002])) == bits(w[5000:5002])
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": w}, lazy=True)["w"]
    assert bits(np.asarray(lazy[4096:4100])) == bits(w[4096:4100])
    with pytest.raises(eqx_ckpt.IntegrityError, match="crc32c"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": w})


def test_the_ocdbt_layout_compresses_too(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, layout="ocdbt", compression="blosc-zstd")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert [bits(x) for x in jax.tree.leaves(loaded)] == [bits(x) for x in jax.tree.leaves(tree)]
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert ckpt.layout == "ocdbt" and ckpt.compression == "blosc-zstd" and ckpt.stored_bytes is None
    assert eqx_ckpt.verify(tmp_path) == []
