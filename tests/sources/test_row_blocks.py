"""Blocks of whole rows (`eqx_ckpt.json` version 6, issue 84): each leaf's
block digests are taken over as many whole rows as 128 KiB holds, the runs of
rows a lazy read fetches, so that a slice reads and hashes no byte beyond the
rows of its runs. Checked against digests computed here, with `blake3` itself."""

from __future__ import annotations

import json

import blake3
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ckpt
from eqx_ckpt._ondisk._format import BLOCK_BYTES

ROW = 750 * 4  # a float32 row of the weight: 3,000 bytes, which do not divide a block
PER_BLOCK = BLOCK_BYTES // ROW  # 43 rows, 129,000 bytes


def _tree() -> dict:
    return {
        "weight": jnp.arange(1000 * 750, dtype=jnp.float32).reshape(1000, 750),
        "wide": jnp.arange(3 * 40_000, dtype=jnp.float32).reshape(3, 40_000),  # rows longer than a block
        "flat": jnp.arange(300_001, dtype=jnp.int8),
        "scalar": jnp.float32(2.5),
        "empty": jnp.zeros((3, 0)),
    }


def _expected(data: bytes, block: int) -> tuple[str, str]:
    """`blocks` and `digest` as version 6 records them, computed here."""
    blocks = b"".join(blake3.blake3(data[i : i + block]).digest() for i in range(0, len(data), block))
    return blocks.hex(), "blake3:" + blake3.blake3(blocks).hexdigest()


def test_an_export_records_blocks_of_whole_rows(tmp_path):
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    record = json.loads((tmp_path / "pub" / "eqx_ckpt.json").read_text())
    assert record["format_version"] == 6 and record["block_bytes"] == BLOCK_BYTES
    leaves = {leaf["path"]: leaf for leaf in record["leaves"]}
    sizes = {"weight": PER_BLOCK * ROW, "wide": BLOCK_BYTES, "flat": BLOCK_BYTES, "scalar": BLOCK_BYTES}
    for name, block in {**sizes, "empty": BLOCK_BYTES}.items():
        data = np.asarray(_tree()[name]).tobytes()
        assert (leaves[name]["blocks"], leaves[name]["digest"]) == _expected(data, block), name
    assert len(leaves["weight"]["blocks"]) // 64 == 24  # (23 blocks of 128 KiB would hold its bytes)
    assert eqx_ckpt.verify(tmp_path / "pub") == []
    assert eqx_ckpt.verify(tmp_path / "pub").checked[0].endswith("(blake3 per block of whole rows, up to 128 KiB)")


@pytest.mark.parametrize("rows", [(0, 2), (41, 43), (86, 88), (999, 1000)])
def test_a_slice_checks_the_blocks_of_its_rows_only(tmp_path, rows):
    """A byte of row 43 (block 1, its first row) rewritten: a slice of rows in
    other blocks loads its values (in blocks of 128 KiB, block 0 would have
    held that byte too), a slice of block 1's rows names the leaf and block 1."""
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    path = tmp_path / "pub" / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    start = 8 + header + json.loads(data[8 : 8 + header])["weight"]["data_offsets"][0]
    data[start + PER_BLOCK * ROW + 500] ^= 0x40  # (within the first 128 KiB of the leaf)
    path.write_bytes(bytes(data))
    weight = eqx_ckpt.Checkpoint(tmp_path / "pub")["weight"]
    lo, hi = rows
    assert np.asarray(weight[lo:hi]).tobytes() == np.asarray(_tree()["weight"][lo:hi]).tobytes()
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `weight` .*: block 1 \(bytes 129000 to 258000 "):
        np.asarray(weight[44:46])
