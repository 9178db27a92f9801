"""What a peer sends is untrusted (`_peers`, issue 86): a part's stream whose
header lies, names a file outside the part's folder, or stops short is
refused, and nothing of it is kept or written elsewhere."""

import hashlib
import json

import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base._location import location
from eqx_ckpt._manage import _peers


def _stream(header: dict, files: list[bytes]) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(files)


def _id(names):
    return hashlib.sha256("\n".join(sorted(n for n in names if n != "manifest.json")).encode()).hexdigest()[:32]


def _receive(tmp_path, stream, *, part, size=None, step=5, windows=7):
    """Feed `stream` (in `windows` pieces) to a receiver expecting `part` of
    `size` bytes (the stream's length by default); its error, or `None`."""
    where = location(tmp_path / "local").joined("peers").joined(f"step_{step:08d}")
    incoming = _peers._Incoming(where, step, {"id": part, "size": len(stream) if size is None else size}, "process 3")
    cut = max(1, len(stream) // windows)
    for start in range(0, len(stream), cut):
        incoming.take(start, memoryview(stream)[start : start + cut])
    return incoming.finish()


def _files(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())


def test_a_genuine_part_is_written_with_its_manifest_last(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "part", {"w": jnp.arange(6.0), "b": np.ones(3)})
    outgoing = _peers._Outgoing(location(tmp_path / "part"), 5)
    stream = bytearray(outgoing.size)
    for start in range(0, outgoing.size, 100):
        outgoing.fill(start, memoryview(stream)[start : start + 100])
    stream = bytes(stream)
    assert len(stream) == outgoing.size and outgoing.error is None
    assert _receive(tmp_path, stream, part=outgoing.id) is None
    copy = tmp_path / "local" / "peers" / "step_00000005" / outgoing.id
    original = sorted(p.relative_to(tmp_path / "part") for p in (tmp_path / "part").rglob("*") if p.is_file())
    assert sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file()) == original
    out = eqx_ckpt.tree_deserialise_leaves(copy, {"w": jnp.zeros(6), "b": np.zeros(3)})
    assert tree_equal(out, {"w": jnp.arange(6.0), "b": np.ones(3)}, typematch=True)


NAMES = ["w/zarr.json", "w/c/0", "manifest.json"]


@pytest.mark.parametrize(
    "names, sizes, header, said",
    [
        (["../../escaped", "manifest.json"], [3, 2], {}, "it names the file '../../escaped'"),
        (["/etc/escaped", "manifest.json"], [3, 2], {}, "it names the file '/etc/escaped'"),
        (["w/./c", "manifest.json"], [3, 2], {}, "it names the file 'w/./c'"),
        (NAMES, [3, -1, 2], {}, "of -1 bytes"),
        (["w/zarr.json", "manifest.json", "w/c/0"], [3, 2, 3], {}, "its files are not those of part"),
        (["w/zarr.json", "w/zarr.json", "manifest.json"], [3, 3, 2], {}, "its files are not those of part"),
        (NAMES, [3, 3, 2], {"step": 4}, "its header is not that of part"),
        (NAMES, [3, 3, 2], {"id": "0" * 32}, "its header is not that of part"),
        (NAMES, [3, 3, 2], {"files": "w/c/0"}, "its header lists no files"),
    ],
)
def test_a_hostile_header_is_refused_before_a_byte_is_written(tmp_path, names, sizes, header, said):
    part = _id(names)
    files = [[name, size] for name, size in zip(names, sizes)]
    stream = _stream({"id": part, "step": 5, "files": files, **header}, [b"x" * max(size, 0) for size in sizes])
    error = _receive(tmp_path, stream, part=part)
    assert isinstance(error, eqx_ckpt.CheckpointError) and said in str(error), error
    assert "process 3" in str(error) and f"part {part}" in str(error)
    assert _files(tmp_path) == []


def test_sizes_that_do_not_add_up_and_a_stream_cut_short_are_refused(tmp_path):
    part = _id(NAMES)
    stream = _stream({"id": part, "step": 5, "files": [[n, 3] for n in NAMES]}, [b"abc"] * 3)
    error = _receive(tmp_path, stream, part=part, size=len(stream) + 5)
    assert "its files' sizes do not add up to the bytes it announced" in str(error)
    short = _stream({"id": part, "step": 5, "files": [[n, 3] for n in NAMES]}, [b"abc"] * 2)
    error = _receive(tmp_path / "b", short, part=part, size=len(short))
    assert "sizes do not add up" in str(error)
    error = _receive(tmp_path / "c", stream[:-4], part=part, size=len(stream))
    assert f"it sent {len(stream) - 4} of the {len(stream)} bytes it announced" in str(error)
    assert not list((tmp_path / "c").rglob("manifest.json"))  # never committed


def test_a_header_longer_than_its_bound_is_refused(tmp_path):
    stream = (64 << 20).to_bytes(8, "little") + b"{}"
    error = _receive(tmp_path, stream, part="0" * 32, size=(64 << 20) + 10)
    assert "its header would be 67108864 bytes long" in str(error)
    assert _files(tmp_path) == []
