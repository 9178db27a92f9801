"""Every byte a lazy read returns is checked (issue 84): a published folder
records the BLAKE3 of each block of every leaf (`eqx_ckpt.json` version 5;
version 4 recorded SHA-256, still checked with it), and a slice, a row
range, a prefix and a whole load of a leaf whose bytes were rewritten under
an unchanged record each raise `IntegrityError` naming the
leaf, the block and the source; the other leaves (and blocks) still load bit
for bit, and `verify` names the leaf (or the base). For every source a
published folder, or a fine-tune's base, is read from: a local folder, one on
S3 and on GCS, a fine-tune's own files, a fine-tune's base (a published
folder, an eqx_ckpt checkpoint) given at load time, and over HTTP from the
local Hub server and a mirror: a published folder, a fine-tune's own files
and its `hf://` base, each served rewritten at its pinned commit. And the
fixtures of versions 4 and 5, each checked with its version's hash."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import re
import shutil
from typing import Any

import gcs_server
import jax
import jax.numpy as jnp
import numpy as np
import places
import pytest
import tensorstore as ts
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base._location import location
from eqx_ckpt._ondisk._format import BLOCK_BYTES

COLUMNS = 1024
BLOCK_ROWS = BLOCK_BYTES // (4 * COLUMNS)  # float32 rows a block: 32 of 128 KiB
ROWS = 3 * BLOCK_ROWS  # 3 blocks
WEIGHT = "model.body.weight"
FLIPPED = 1  # the block whose bytes are rewritten
MID = BLOCK_ROWS + BLOCK_ROWS // 6  # a row inside block `FLIPPED`
READS = {  # the rows each read covers: every one meets block `FLIPPED`
    "slice": (MID, MID + 2),
    "row range": (3 * BLOCK_ROWS // 4, MID),
    "prefix": (0, 2 * BLOCK_ROWS + BLOCK_ROWS // 3),
}
KEPT = ((0, 2), (2 * BLOCK_ROWS + 3 * BLOCK_ROWS // 4, ROWS))  # rows of the blocks not rewritten


def _tree(head: float = 0.0, other: bool = False) -> dict:
    """The model. `other`: other values in block `FLIPPED` of its weight (a
    forged base's, or a fine-tune's own). The embedding (1 MiB) is what a
    fine-tune storing its own weight takes from its base (one that would take
    less is written standalone)."""
    weight = jnp.arange(ROWS * COLUMNS, dtype=jnp.float32).reshape(ROWS, COLUMNS)
    if other:
        weight = weight.at[FLIPPED * BLOCK_BYTES // (4 * COLUMNS) + 1, 3].set(jnp.inf)
    embed = jnp.full((256, COLUMNS), 0.5, jnp.float32)
    return {"model": {"body": {"weight": weight, "bias": jnp.ones(8)}, "embed": embed, "head": jnp.full(4, 1.0 + head)}}


def _like() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree())


def _others(tree: dict) -> tuple:
    """The leaves besides the weight, none of whose bytes is rewritten."""
    return tree["model"]["head"], tree["model"]["body"]["bias"], tree["model"]["embed"]


def _rewritten(data: bytes, name: str = WEIGHT, at: int = FLIPPED * BLOCK_BYTES + 100) -> bytes | None:
    """The safetensors file `data` with an inf at byte `at` of the tensor
    `name` (by default in block `FLIPPED` of the weight, among its counting
    numbers; same names, shapes, size); `None` where it does not hold it."""
    size = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8 : 8 + size]).get(name)
    if entry is None:
        return None
    start = 8 + size + entry["data_offsets"][0] + at
    assert data[start : start + 4] != b"\x00\x00\x80\x7f"
    return data[:start] + b"\x00\x00\x80\x7f" + data[start + 4 :]


def _rewrite(where: Any, name: str = WEIGHT, at: int = FLIPPED * BLOCK_BYTES + 100) -> None:
    """Rewrite the tensor `name` (`_rewritten`) in the folder at `where` (a
    path, a kvstore spec or a URL), under its unchanged `eqx_ckpt.json`."""
    store = ts.KvStore.open(location(where).kvstore).result()
    keys = [k for k in store.list().result() if k.endswith(b".safetensors")]
    found = [(k, _rewritten(store.read(k).result().value, name, at)) for k in keys]
    ((key, data),) = [(k, d) for k, d in found if d is not None]
    store.write(key, data).result()


# -- Sources read in this process ---------------------------------------------------------------

# Where the folder a load names lies, and where a fine-tune takes its weight from.
SOURCES = ["local", "s3", "gcs", "own-files", "base", "checkpoint-base", "checkpoint-base-on-s3"]


def _source(request: pytest.FixtureRequest, tmp_path: pathlib.Path, source: str) -> tuple[Any, dict, dict]:
    """The folder a load names (a path, a kvstore spec or a URL), its weight's
    bytes rewritten under a record that is not; the load's keywords; and the
    values every other byte holds. A base given at load time (`base=`, which
    no pin covers) holds other values under a record of its own that matches
    them: only the fine-tune's block digests of the leaves it takes can tell."""
    if "base" in source:
        save = eqx_ckpt.export_safetensors if source == "base" else eqx_ckpt.tree_serialise_leaves
        save(tmp_path / "base", _tree())
        eqx_ckpt.export_safetensors(tmp_path / "ft", _tree(head=1.0), base=tmp_path / "base")
        assert WEIGHT.encode() not in (tmp_path / "ft" / "finetune.safetensors").read_bytes()[:4096]
        forged = request.getfixturevalue("store") if source.endswith("on-s3") else tmp_path / "forged"
        save(forged, _tree(other=True))
        return tmp_path / "ft", {"base": forged}, _tree(head=1.0)
    if source == "own-files":  # a fine-tune storing its weight, taking the rest from its base
        eqx_ckpt.export_safetensors(tmp_path / "base", _tree())
        eqx_ckpt.export_safetensors(tmp_path / "ft", _tree(other=True), base=tmp_path / "base")
        assert WEIGHT.encode() in (tmp_path / "ft" / "finetune.safetensors").read_bytes()[:4096]
        _rewrite(tmp_path / "ft")
        return tmp_path / "ft", {}, _tree(other=True)
    where: Any = tmp_path / "pub"
    if source == "s3":
        where = request.getfixturevalue("store")
    elif source == "gcs":
        request.getfixturevalue("gcs")
        where = f"gs://{gcs_server.BUCKET}/pub"
    eqx_ckpt.export_safetensors(where, _tree())  # (to an object store too: no folder to upload)
    _rewrite(where)
    return where, {}, _tree()


def _message(
    named: str, base: str | None = None, *, leaf: str = WEIGHT, block: int = FLIPPED, hashed: str = "BLAKE3"
) -> str:
    """What each error says: the leaf, the block, the source (and the base a
    fine-tune takes the leaf from: a regular expression of how it is named),
    and the hash of the record's version."""
    taken = "" if base is None else rf".*taken from the base '{base}' \(its leaf '{re.escape(leaf)}'\)"
    said = rf": block {block} \(.*\) differs from its {hashed} digest in the record"
    return rf"Leaf `{re.escape(leaf)}` in checkpoint '{re.escape(named)}[^']*'{taken}.*{said}"


def _check_verified(problems: list[tuple[str | None, str]], taken: bool) -> None:
    """`verify`'s problems (leaf, message): the weight's block, or one of the
    base, not one of each leaf taken from it (issue 88), with the hash of the
    version an export writes."""
    if not taken:
        assert [leaf for leaf, _ in problems] == [WEIGHT], problems
        assert f"block {FLIPPED} of 3 differs from its BLAKE3" in problems[0][1]
    else:
        assert [leaf for leaf, _ in problems] == [None], problems
        assert "holds other values than when the fine-tune was exported: 1 of the" in problems[0][1]
        assert (
            f"(`{WEIGHT}`)" in problems[0][1]
            and f"blake3 per block of whole rows, up to {BLOCK_BYTES // 1024} KiB" in problems[0][1]
        )


@pytest.mark.parametrize("source", SOURCES)
def test_a_rewritten_block_is_refused_by_every_read(request, tmp_path, source):
    """Each source read in this process, through every read of the weight."""
    where, base, expected = _source(request, tmp_path, source)
    message = _message(location(where).display, re.escape(location(base["base"]).display) if base else None)
    ckpt = eqx_ckpt.Checkpoint(where, **base)
    lazy = ckpt[WEIGHT]
    for start, stop in READS.values():
        with pytest.raises(eqx_ckpt.IntegrityError, match=message):
            lazy[start:stop]
    with pytest.raises(eqx_ckpt.IntegrityError, match=message):
        eqx_ckpt.tree_deserialise_leaves(where, _like(), **base)
    with pytest.raises(eqx_ckpt.IntegrityError, match=message):
        np.asarray(lazy)
    # The blocks and leaves not rewritten still load, bit for bit.
    weight = np.asarray(expected["model"]["body"]["weight"])
    for start, stop in KEPT:
        assert np.asarray(lazy[start:stop]).tobytes() == weight[start:stop].tobytes()
    others = eqx_ckpt.tree_deserialise_leaves(where, _like(), where=_others, **base)
    assert tree_equal(_others(others), _others(expected), typematch=True)
    _check_verified([(p.leaf, p.message) for p in eqx_ckpt.verify(where, **base)], taken=bool(base))


# -- The Hub and a mirror, read in a new process (`hub_client.Client`) --------------------------

# What a process reads of each repository: each read of the weight (the
# errors), digests of the blocks and leaves not rewritten, and `verify`.
_HUB_READS = f"""
import hashlib
def digest(x):
    return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
found = {{}}
for path in PATHS:
    ckpt = eqx_ckpt.Checkpoint(path)
    lazy = ckpt[{WEIGHT!r}]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ckpt.load(lazy=True))
    errors = [raised(lambda: lazy[a:b]) for a, b in {list(READS.values())!r}]
    errors.append(raised(lambda: eqx_ckpt.tree_deserialise_leaves(path, like)))
    errors.append(raised(lambda: np.asarray(lazy)))
    errors.append(raised(lambda: eqx_ckpt.Checkpoint(path).load()))
    where = lambda t: (t["model"]["head"], t["model"]["body"]["bias"], t["model"]["embed"])
    others = where(eqx_ckpt.tree_deserialise_leaves(path, like, where=where))
    kept = [digest(lazy[a:b]) for a, b in {list(KEPT)!r}] + [digest(x) for x in others]
    found[path] = [errors, kept, [[p.leaf, p.message] for p in eqx_ckpt.verify(path)]]
emit(found)
"""


def _committed(state: Any, repo: str) -> dict[str, str]:
    """The files of `repo`'s commit on the Hub server: the SHA-256 of each, by name."""
    return state.repos[repo].commits[state.repos[repo].branches["main"]]


def _serve(state: Any, repo: str, files: dict[str, bytes]) -> None:
    """The Hub server answers `repo`'s commit (the same id, which a fine-tune
    pins its base by) with `files` in place of those of the same names, and
    lists them so: as a forger serving both would."""
    for name, data in files.items():
        _committed(state, repo)[name] = oid = hashlib.sha256(data).hexdigest()
        state.blobs[oid] = data


def _rewritten_files(state: Any, repo: str) -> dict[str, bytes]:
    """The file of `repo`'s commit holding the weight, rewritten (`_rewritten`)."""
    files = _committed(state, repo).items()
    found = {name: _rewritten(state.blobs[oid]) for name, oid in files if name.endswith(".safetensors")}
    return {name: data for name, data in found.items() if data is not None}


def _folder(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def _hub_digests(tree: dict) -> list[str]:
    """What `_HUB_READS` finds of the blocks and leaves not rewritten, holding `tree`."""
    weight = np.asarray(tree["model"]["body"]["weight"])
    kept = [weight[a:b] for a, b in KEPT] + [np.asarray(x) for x in _others(tree)]
    return [hashlib.sha256(x.tobytes()).hexdigest() for x in kept]


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra")
def test_rewritten_bytes_served_over_http_are_refused_by_every_read(hub, tmp_path):
    """A server answering a pinned commit with other bytes than the record's,
    as the Hub and as a mirror (whole files for ranges): every ranged read of
    them, and every whole download, is refused. Of a published folder
    (`me/pub`, its record unchanged), of a fine-tune's own files (`me/own`),
    and of the base a fine-tune takes its weight from (`me/ft`, whose record
    pins `me/base` by its commit, served as another model with a record that
    matches it: only the fine-tune's block digests can tell). The Hub and the
    mirror are read in one test, from the same pushes (a process of seconds)."""
    from hub_client import Client

    client, state = hub
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    eqx_ckpt.export_safetensors(tmp_path / "forged", _tree(other=True))
    for name, tree in (("ft", _tree(head=1.0)), ("own", _tree(other=True))):
        eqx_ckpt.tree_serialise_leaves(tmp_path / f"{name}-tree", tree)
    state.put_files("me/pub", _folder(tmp_path / "pub"))
    pinned = f"hf://me/base@{state.put_files('me/base', _folder(tmp_path / 'pub'))}"
    client.run(  # (both pushes in one process)
        "".join(
            f"eqx_ckpt.push_to_hub({str(tmp_path / f'{name}-tree')!r}, 'me/{name}', base='hf://me/base')\n"
            for name in ("ft", "own")
        )
        + "emit(None)"
    )
    assert all("finetune.safetensors" in _committed(state, repo) for repo in ("me/ft", "me/own"))
    _serve(state, "me/pub", _rewritten_files(state, "me/pub"))
    _serve(state, "me/own", _rewritten_files(state, "me/own"))
    _serve(state, "me/base", _folder(tmp_path / "forged"))
    expected = {"me/pub": _tree(), "me/ft": _tree(head=1.0), "me/own": _tree(other=True)}
    for mirror in (False, True):
        state.mirror = mirror
        fresh = Client(client.url, tmp_path / ("mirror" if mirror else "hub"))  # (a cache of its own)
        found = fresh.run(_HUB_READS.replace("PATHS", repr([f"hf://{repo}" for repo in expected])))
        for repo, tree in expected.items():
            errors, kept, problems = found[f"hf://{repo}"]
            message = _message(f"hf://{repo}", re.escape(pinned) if repo == "me/ft" else None)
            for error in errors:
                assert error is not None and error[0] == "IntegrityError", (mirror, repo, error)
                assert re.search(message, error[2]), (mirror, repo, error[2])
            assert kept == _hub_digests(tree), (mirror, repo)
            _check_verified([tuple(p) for p in problems], taken=repo == "me/ft")


# -- Each version's fixture, checked with its version's hash -----------------------------------

# The hash of each version's block digests, as an error names it, and as `verify` says a record's
# digests; the block of the large leaf holding its byte 2**20 (its row 256), and its blocks: of
# 1 MiB in the fixtures of versions 4 and 5, then of the 32 rows of 4 KiB that 128 KiB holds.
HASHES = {
    4: ("SHA-256", "sha256 per 1 MiB block", 1, 2),
    5: ("BLAKE3", "blake3 per 1 MiB block", 1, 2),
    6: ("BLAKE3", "blake3 per block of whole rows, up to 128 KiB", 8, 9),
}


@pytest.mark.parametrize("version", sorted(HASHES))
def test_each_version_checks_its_blocks_with_its_hash(tmp_path, version):
    """A copy of the fixture of version 4 (SHA-256 block digests), of 5
    (BLAKE3) and of 6 (BLAKE3, blocks of whole rows): its export's large leaf
    rewritten in its row 256 under its unchanged record, and its fine-tune given a base holding other bytes in
    the leaf it takes as `small.f32` and `adapter.w` (an export of its own,
    whose record matches them: only the fine-tune's record, of its version,
    can tell). Every read of them is refused, naming the hash of the version;
    the other blocks and leaves load as in the fixture, bit for bit."""
    shown, said, block, count = HASHES[version]
    fixture, folder = places.FIXTURES / f"published_{version}", tmp_path / "fixture"
    shutil.copytree(fixture, folder)
    assert json.loads((folder / "eqx_ckpt.json").read_text())["format_version"] == version
    _rewrite(folder, "big", 2**20)  # (row 256 of 257)
    ckpt, original = eqx_ckpt.Checkpoint(folder), eqx_ckpt.Checkpoint(fixture)
    message = _message(str(folder), leaf="big", block=block, hashed=shown)
    for read in (lambda: ckpt["big"][255:257], lambda: np.asarray(ckpt["big"]), lambda: ckpt.load(trust=[])):
        with pytest.raises(eqx_ckpt.IntegrityError, match=message):
            read()
    assert np.asarray(ckpt["big"][1:3]).tobytes() == np.asarray(original["big"][1:3]).tobytes()
    problems = [(p.leaf, p.message) for p in eqx_ckpt.verify(folder)]
    assert [leaf for leaf, _ in problems] == [
        "big"
    ] and f"block {block} of {count} differs from its {shown}" in problems[0][1]
    tree = eqx_ckpt.Checkpoint(fixture / "base").load(trust=[])
    tree["small"]["f32"] = tree["small"]["f32"].at[0, 0].set(jnp.inf)
    eqx_ckpt.export_safetensors(tmp_path / "forged", tree)
    finetune = eqx_ckpt.Checkpoint(folder / "finetune", base=tmp_path / "forged")
    message = _message(
        str(folder / "finetune"), re.escape(str(tmp_path / "forged")), leaf="small.f32", block=0, hashed=shown
    )
    for read in (lambda: finetune["small.f32"][0:1], lambda: np.asarray(finetune["small.f32"])):
        with pytest.raises(eqx_ckpt.IntegrityError, match=message):
            read()
    with pytest.raises(eqx_ckpt.IntegrityError, match=f"taken from the base .* differs from its {shown} digest"):
        finetune.load(trust=[])
    original = eqx_ckpt.Checkpoint(fixture / "finetune")
    for leaf in ("special.f32", "model.layers.1.weight"):  # taken from the base, and its own
        assert np.asarray(finetune[leaf]).tobytes() == np.asarray(original[leaf]).tobytes()
    problems = [(p.leaf, p.message) for p in eqx_ckpt.verify(folder / "finetune", base=tmp_path / "forged")]
    assert [leaf for leaf, _ in problems] == [None], problems
    assert "holds other values than when the fine-tune was exported: 2 of the" in problems[0][1]
    assert "(`adapter.w`, `small.f32`)" in problems[0][1] and f"({said})" in problems[0][1]


@pytest.mark.parametrize(
    ("folder", "said"),
    [
        ("published_6", "blake3 per block of whole rows, up to 128 KiB"),
        ("published_5", "blake3 per 1 MiB block"),
        ("published_4", "sha256 per 1 MiB block"),
        ("published_3/base", "xxh3-128 per leaf (an earlier version: checks accidents, not forgery)"),
    ],
)
def test_info_says_which_digests_a_folder_carries(folder, said, capsys):
    from eqx_ckpt._tools._cli import main

    fixture = places.FIXTURES / folder
    assert main(["info", str(fixture)]) == 0
    assert f"\ndigests:         {said}\n" in capsys.readouterr().out
