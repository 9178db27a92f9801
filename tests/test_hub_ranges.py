"""What a slice of a lazy leaf fetches by byte ranges (issue 75, item 5): the
runs of rows of about `_safetensors.ROW_CHUNK_BYTES` that hold it, as
docs/sharing.md ("Load part of a model") says, never the whole tensor.
Against the local Hub server (`hub_server`), in a new process (`test_hub.Client`)."""

from __future__ import annotations

import importlib.util

import hub_server
import pytest
from test_hub import Client

from eqx_ckpt._foreign._safetensors import ROW_CHUNK_BYTES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)


def test_a_slice_fetches_the_runs_of_rows_holding_it(tmp_path):
    """Two rows of a 16 MiB tensor fetch one run of 4 MiB (and the file's
    header), rows across a run's end fetch two; the values are the rows."""
    with hub_server.serving() as (url, state):
        client = Client(url, tmp_path / "hf")
        tensor = "np.arange(1 << 22, dtype=np.float32).reshape(4096, 1024)"
        client.run(f"emit(eqx_ckpt.push_to_hub({{'w': {tensor}}}, 'me/big'))")
        header = 2**10  # (at most: one tensor's entry, and the file's length)
        for rows, runs in (((0, 2), 1), ((1023, 1025), 2)):
            state.sent.clear()
            got = client.run(
                f"x = np.asarray(eqx_ckpt.Checkpoint('hf://me/big')['w'][{rows[0]}:{rows[1]}]);"
                f"emit(bool((x == {tensor}[{rows[0]}:{rows[1]}]).all()))"
            )
            assert got is True
            assert runs * ROW_CHUNK_BYTES <= state.sent[""] <= runs * ROW_CHUNK_BYTES + header, (rows, state.sent)
