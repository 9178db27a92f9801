"""What a slice of a lazy leaf fetches by byte ranges (issue 75, item 5; issue
84): the whole blocks of `_format.BLOCK_BYTES` that hold it, each checked
against its digest, as docs/sharing.md ("Load part of a model") says, never
the whole tensor. Against the local Hub server (`hub_server`), in a new
process (`test_hub.Client`)."""

from __future__ import annotations

import importlib.util

import pytest

from eqx_ckpt._ondisk._format import BLOCK_BYTES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)


def test_a_slice_fetches_the_blocks_holding_it(hub):
    """Two rows of a 16 MiB tensor fetch one block of 1 MiB in one range
    request (and the file's header), rows across a block's end two blocks;
    the values are the rows."""
    client, state = hub
    tensor = "np.arange(1 << 22, dtype=np.float32).reshape(4096, 1024)"
    client.run(f"emit(eqx_ckpt.push_to_hub({{'w': {tensor}}}, 'me/big'))")
    header = 2**10  # (at most: one tensor's entry, and the file's length)
    for rows, blocks in (((0, 2), 1), ((255, 257), 2), ((1023, 1025), 2)):
        state.sent.clear()
        state.ranges.clear()
        got = client.run(
            f"x = np.asarray(eqx_ckpt.Checkpoint('hf://me/big')['w'][{rows[0]}:{rows[1]}]);"
            f"emit(bool((x == {tensor}[{rows[0]}:{rows[1]}]).all()))"
        )
        assert got is True
        # The tensor's file: its header's reads, and one range of whole blocks a run of rows.
        file = max(state.ranges, key=lambda r: r[2] - r[1])[0]  # (the record is read whole, and small)
        ranges = [(a, b) for name, a, b in state.ranges if name == file]
        large = [(a, b) for a, b in ranges if b - a > header]
        assert len(large) == blocks and all(b - a == BLOCK_BYTES for a, b in large), state.ranges
        assert sum(b - a for a, b in ranges) <= blocks * BLOCK_BYTES + header, state.ranges


def test_a_slice_of_rows_that_do_not_divide_a_block_fetches_its_rows_run(hub):
    """Rows of 3,000 bytes: each block is 43 whole rows (`eqx_ckpt.json`
    version 6), the run a slice reads. Two rows fetch that one run of 129,000
    bytes, not the two blocks of 128 KiB around it."""
    client, state = hub
    tensor = "np.arange(750_000, dtype=np.float32).reshape(1000, 750)"
    client.run(f"emit(eqx_ckpt.push_to_hub({{'w': {tensor}}}, 'me/rows'))")
    state.ranges.clear()
    got = client.run(
        f"x = np.asarray(eqx_ckpt.Checkpoint('hf://me/rows')['w'][44:46]); emit(bool((x == {tensor}[44:46]).all()))"
    )
    assert got is True
    file = max(state.ranges, key=lambda r: r[2] - r[1])[0]
    large = [(a, b) for name, a, b in state.ranges if name == file and b - a > 2**10]
    assert len(large) == 1 and large[0][1] - large[0][0] == 43 * 3000, state.ranges
