"""A published folder on a local disk is hashed as it is read (issue 84): each
run of tensors is read in pieces (`_local_read.FILL_BYTES`), and the thread
that read a piece hashes its whole blocks while they are in its cache
(`_digests.Feed`). The digests must be those of the whole bytes however the
pieces cut the blocks and the leaves, and a changed byte anywhere in a run
must be found, naming its leaf and block."""

from __future__ import annotations

import json
import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _digests
from eqx_ckpt._ondisk._format import BLOCK_BYTES
from eqx_ckpt._store import _local_read

# Leaf sizes in bytes around the edges of a block: empty, one byte, a block
# less one, a block, a block and one, several blocks and a few bytes.
SIZES = [0, 1, 63, 64, 65, 3 * 64 + 7, 0, 640, 5]


@pytest.mark.parametrize("algorithm", [_digests.BLAKE3, _digests.SHA256], ids=lambda a: a.name)
@pytest.mark.parametrize("seed", range(4))
def test_a_feed_gives_each_leafs_digests_whatever_the_pieces(algorithm, seed):
    """Leaves one after another in a buffer, with a gap between two, filled in
    pieces of random lengths: each leaf's digests are those of its bytes hashed whole."""
    rng = random.Random(seed)
    block, spans, at = 64, [], 3
    for size in SIZES:
        spans.append(_digests.Span(at, size, algorithm, block))
        at += size + (11 if size == 63 else 0)
    buffer = np.frombuffer(rng.randbytes(at + 5), np.uint8)
    feed, end = _digests.Feed(spans), 0
    while end < len(buffer):
        end = min(len(buffer), end + rng.choice([1, 7, 64, 100, 333]))
        feed.filled(buffer, end)
    for i, span in enumerate(spans):
        expected = _digests.of(buffer[span.start : span.start + span.nbytes].tobytes(), algorithm, block)
        assert feed.digested(i) == expected, (i, span)


def test_a_leafs_digests_are_not_given_before_its_bytes_are_read():
    feed = _digests.Feed([_digests.Span(0, 100, _digests.BLAKE3, 64)])
    feed.filled(np.zeros(100, np.uint8), 99)
    with pytest.raises(AssertionError, match="before its bytes were all read"):
        feed.digested(0)


def _tree() -> dict:
    """Leaves of sizes that put block and piece edges everywhere in one run."""
    keys = jax.random.split(jax.random.key(0), 4)
    return {
        "a": jax.random.normal(keys[0], (3 * BLOCK_BYTES // 4 + 5,)),  # not a whole block
        "b": jnp.arange(7, dtype=jnp.int16),
        "c": jax.random.normal(keys[1], (96, 1024)),  # 3 blocks of float32 rows
        "d": jnp.zeros((0, 4)),
        "e": jax.random.normal(keys[2], (33, 1000)),
        "f": jax.random.normal(keys[3], (2,)),
    }


def _offsets(folder) -> dict:
    data = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return {name: 8 + size + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


@pytest.fixture(params=[1000, 4096 * 3, _local_read.FILL_BYTES], ids=lambda n: f"pieces-of-{n}")
def pieces(request, monkeypatch):
    monkeypatch.setattr(_local_read, "FILL_BYTES", request.param)
    return request.param


def test_a_whole_load_hashes_each_piece_in_the_thread_that_read_it(tmp_path, pieces, faults):
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(_tree()))
    seen = []
    faults("digests.filled", lambda end: seen.append((threading.current_thread().name, end)))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "pub", _like()), _tree())
    assert {name.rsplit("_", 1)[0] for name, _ in seen} == {"eqx_ckpt-read"}
    ends = sorted(end for _, end in seen)  # (one run: every tensor is small)
    assert ends == [*range(pieces, nbytes, pieces), nbytes]


def test_a_failure_while_hashing_is_the_reads(tmp_path, faults):
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    faults("digests.filled", OSError("EIO: hashing"))
    with pytest.raises(eqx_ckpt.CheckpointError, match=r"(?s)Leaf `a` .*EIO: hashing"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "pub", _like())


@pytest.mark.parametrize(
    ("leaf", "at"),
    # the first byte of a leaf, the last of a short last block, a small leaf's
    # last, one past a block edge, the last of the run
    [("a", 0), ("a", -1), ("b", -1), ("c", BLOCK_BYTES + 1), ("f", -1)],
)
def test_a_changed_byte_anywhere_in_a_run_is_found(tmp_path, pieces, leaf, at):
    """One byte changed under an unchanged record: the load names the leaf and
    its block, and loads nothing."""
    eqx_ckpt.export_safetensors(tmp_path / "pub", _tree())
    path = tmp_path / "pub" / "model.safetensors"
    nbytes = _tree()[leaf].nbytes
    at %= nbytes
    data = bytearray(path.read_bytes())
    data[_offsets(tmp_path / "pub")[leaf] + at] ^= 0x40
    path.write_bytes(bytes(data))
    message = rf"Leaf `{leaf}` .*: block {at // BLOCK_BYTES} \(bytes .*\) differs from its BLAKE3 digest"
    with pytest.raises(eqx_ckpt.IntegrityError, match=message):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "pub", _like())


def _like() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree())
