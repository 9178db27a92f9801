"""Every byte a lazy read returns is checked (issue 84): a published folder
records the SHA-256 of each block of every leaf (`eqx_ckpt.json` version 4),
and a slice, a row range, a prefix and a whole load of a leaf whose bytes were
rewritten under an unchanged record each raise `IntegrityError` naming the
leaf, the block and the source; the other leaves (and blocks) still load bit
for bit. For each source: a local published folder, the same served over HTTP
by the local Hub server, and a fine-tune's leaves taken from its base."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import equinox as eqx
import hub_server
import jax
import jax.numpy as jnp
import numpy as np
import places
import pytest

import eqx_ckpt
from eqx_ckpt._ondisk._format import BLOCK_BYTES

ROWS, COLUMNS = 768, 1024  # float32: 3 MiB, 3 blocks of 256 rows
FLIPPED = 1  # the block whose bytes are rewritten
READS = {  # the rows each read covers: every one meets block `FLIPPED`
    "slice": (300, 302),
    "row range": (200, 300),
    "prefix": (0, 600),
}


def _tree(head: float = 0.0, forged: bool = False) -> dict:
    weight = jnp.arange(ROWS * COLUMNS, dtype=jnp.float32).reshape(ROWS, COLUMNS)
    if forged:  # other values in block `FLIPPED`
        weight = weight.at[FLIPPED * BLOCK_BYTES // (4 * COLUMNS) + 1, 3].set(jnp.inf)
    return {"model": {"body": {"weight": weight, "bias": jnp.ones(8)}, "head": jnp.full(4, 1.0 + head)}}


def _like() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree())


def _rewrite(folder: pathlib.Path, tensor: str) -> None:
    """Other values in block `FLIPPED` of `tensor`'s bytes (same names, shapes, file size)."""
    (file,) = [f for f in folder.glob("*.safetensors") if tensor.encode() in f.read_bytes()[:4096]]
    data = bytearray(file.read_bytes())
    size = int.from_bytes(data[:8], "little")
    start = 8 + size + json.loads(data[8 : 8 + size])[tensor]["data_offsets"][0] + FLIPPED * BLOCK_BYTES
    data[start + 100 : start + 104] = b"\x00\x00\x80\x7f"  # an inf among the counting numbers
    file.write_bytes(bytes(data))


def _folder(tmp_path: pathlib.Path, source: str) -> tuple[pathlib.Path, dict]:
    """The folder a load names, its weight rewritten under its unchanged
    `eqx_ckpt.json`, and the load's keywords. A fine-tune's weight is taken
    from a base given at load time (`base=`, which no pin covers), holding
    other values under a record that matches them: only the fine-tune's
    block digests of the leaves it takes can tell."""
    if source == "base":
        eqx_ckpt.export_safetensors(tmp_path / "base", _tree())
        eqx_ckpt.export_safetensors(tmp_path / "ft", _tree(head=1.0), base=tmp_path / "base")
        assert b"model.body.weight" not in (tmp_path / "ft" / "finetune.safetensors").read_bytes()[:4096]
        eqx_ckpt.export_safetensors(tmp_path / "forged", _tree(forged=True))
        return tmp_path / "ft", {"base": tmp_path / "forged"}
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    _rewrite(tmp_path / "pub", "model.body.weight")
    return tmp_path / "pub", {}


def _message(source: str, named: str) -> str:
    """What each error says: the leaf, the block, the source."""
    taken = r".*taken from the base '.*forged' \(its leaf 'model.body.weight'\)" if source == "base" else ""
    return rf"Leaf `model\.body\.weight` in checkpoint '{re.escape(named)}[^']*'{taken}.*: block {FLIPPED} \("


@pytest.mark.parametrize("source", ["local", "base"])
def test_a_rewritten_block_is_refused_by_every_read(tmp_path, source):
    folder, base = _folder(tmp_path, source)
    expected = _tree(head=1.0 if source == "base" else 0.0)
    ckpt = eqx_ckpt.Checkpoint(folder, **base)
    lazy = ckpt["model.body.weight"]
    for start, stop in READS.values():
        with pytest.raises(eqx_ckpt.IntegrityError, match=_message(source, str(folder))):
            lazy[start:stop]
    with pytest.raises(eqx_ckpt.IntegrityError, match=_message(source, str(folder))):
        eqx_ckpt.tree_deserialise_leaves(folder, _like(), **base)
    with pytest.raises(eqx_ckpt.IntegrityError, match=_message(source, str(folder))):
        np.asarray(lazy)
    # The blocks and leaves not rewritten still load, bit for bit.
    assert np.asarray(lazy[:2]).tobytes() == np.asarray(expected["model"]["body"]["weight"][:2]).tobytes()
    assert np.asarray(lazy[700:]).tobytes() == np.asarray(expected["model"]["body"]["weight"][700:]).tobytes()
    others = eqx_ckpt.tree_deserialise_leaves(
        folder, _like(), where=lambda t: (t["model"]["head"], t["model"]["body"]["bias"]), **base
    )
    assert eqx.tree_equal(others["model"]["head"], expected["model"]["head"], typematch=True)
    assert eqx.tree_equal(others["model"]["body"]["bias"], expected["model"]["body"]["bias"], typematch=True)
    problems = eqx_ckpt.verify(folder, **base)
    if source == "local":
        assert [p.leaf for p in problems] == ["model.body.weight"]
        assert f"block {FLIPPED} of 3 differs from its SHA-256" in problems[0].message
    else:  # one problem of the base, not one of each leaf taken from it (issue 88)
        assert [p.leaf for p in problems] == [None]
        assert "holds other values than when the fine-tune was exported: 1 of the" in problems[0].message
        assert "(`model.body.weight`)" in problems[0].message and "sha256 per 1 MiB block" in problems[0].message


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra")
def test_a_rewritten_block_served_over_http_is_refused_by_every_read(tmp_path):
    """A server answering for a pinned commit with other bytes than the record's:
    every ranged read of them, and the whole download, is refused."""
    from hub_client import Client

    folder, _ = _folder(tmp_path, "local")
    with hub_server.serving() as (url, state):
        state.put_files("me/pub", {p.name: p.read_bytes() for p in folder.iterdir()})
        client = Client(url, tmp_path / "hf")
        reads = {what: f"lambda: ckpt['model.body.weight'][{a}:{b}]" for what, (a, b) in READS.items()}
        reads["whole"] = "lambda: eqx_ckpt.Checkpoint('hf://me/pub').load()"
        found = client.run(
            "ckpt = eqx_ckpt.Checkpoint('hf://me/pub')\n"
            + "".join(f"r_{i} = raised({call})\n" for i, call in enumerate(reads.values()))
            + "kept = np.asarray(ckpt['model.body.weight'][:2]).tolist()\n"
            + f"emit([[{', '.join(f'r_{i}' for i in range(len(reads)))}], kept])"
        )
    errors, kept = found
    for what, error in zip(reads, errors):
        assert error is not None and error[0] == "IntegrityError", (what, error)
        assert re.search(_message("http", "hf://me/pub"), error[2]), (what, error[2])
    assert np.asarray(kept, np.float32).tobytes() == np.asarray(_tree()["model"]["body"]["weight"][:2]).tobytes()


@pytest.mark.parametrize(
    ("folder", "said"),
    [
        ("published_4", "sha256 per 1 MiB block"),
        ("published_3/base", "xxh3-128 per leaf (an earlier version: checks accidents, not forgery)"),
    ],
)
def test_info_says_which_digests_a_folder_carries(folder, said, capsys):
    from eqx_ckpt._tools._cli import main

    fixture = places.FIXTURES / folder
    assert main(["info", str(fixture)]) == 0
    assert f"\ndigests:         {said}\n" in capsys.readouterr().out
