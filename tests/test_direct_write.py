"""Chunk files that eqx_ckpt writes itself on a local disk (`_direct_write`):
byte for byte what TensorStore writes for the same array, read back by
TensorStore alone, and a failure or an interrupt at any chunk file leaves the
old checkpoint whole and nothing behind."""

import concurrent.futures
import errno
import os
import pathlib
import signal
import threading
import time

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from arrays import values

import eqx_ckpt
from eqx_ckpt import _direct_write, _io, _pack, _spec, _write
from eqx_ckpt._source import open_source

pytestmark = pytest.mark.skipif(not _direct_write._direct.SUPPORTED, reason="no direct writes on this host")


@pytest.fixture
def own_folders(monkeypatch):
    """Every leaf in its own folder, in chunks of at most 1 KiB."""
    monkeypatch.setattr(_pack, "PACK_BYTES", -1)
    monkeypatch.setattr(_spec, "CHUNK_BYTES", 1024)


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    """Every chunk file below `folder` (not `zarr.json`), by relative path."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name != "zarr.json":
                path = pathlib.Path(root, name)
                out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def _written_by_tensorstore(tmp_path, spec_of, stored: np.ndarray, folder: str = "") -> dict[str, bytes]:
    """The chunk files TensorStore itself writes for `stored` with the same
    metadata (`spec_of(location)`, whose array is in `folder`)."""
    loc = _spec.location(tmp_path / "by-tensorstore")
    _io.create_spec(spec_of(loc), loc).result().write(stored).result()
    return _files(tmp_path / "by-tensorstore" / folder)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.complex64, np.float64])
@pytest.mark.parametrize("shape", [(1001, 3), (4099,), (101, 5, 3), (7,)])
def test_a_leafs_chunk_files_are_the_bytes_tensorstore_writes(tmp_path, own_folders, dtype, shape):
    x = values(shape, dtype)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"model": {"w": x}})
    data = open_source(tmp_path / "ckpt").data
    record = eqx_ckpt.Checkpoint(tmp_path / "ckpt").record("model.w")
    assert _direct_write.eligible(data, record, [((), x)])
    ours = _files(tmp_path / "ckpt" / "model" / "w")
    if x.nbytes > 1024:
        assert len(ours) > 1 and shape[0] % record.chunks[0], "want several chunks and an edge chunk"
    theirs = _written_by_tensorstore(
        tmp_path,
        lambda loc: _spec.array_spec(
            loc, "", shape=shape, stored_dtype=record.stored_dtype, chunks=list(record.chunks)
        ),
        x,
    )
    assert ours == theirs
    # Read by TensorStore alone, through the checkpoint's own zarr.json.
    np.testing.assert_array_equal(_io.open_array(data, record).result().read().result(), x)


def test_big_endian_arrays_are_stored_little_endian(tmp_path, own_folders):
    x = values((300, 2), np.float32)
    tree = {"big": x.astype(">f4"), "little": x}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert _files(tmp_path / "ckpt" / "big") == _files(tmp_path / "ckpt" / "little")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"big": x, "little": x})
    assert eqx.tree_equal(loaded, {"big": x, "little": x}, typematch=True)


def test_encoded_leaves_round_trip_through_tensorstore(tmp_path, own_folders):
    # "view" (float8_e4m3, int4: raw bytes) and "key_data" leaves.
    tree = {
        "f8": values((300, 7), np.float32).astype(ml_dtypes.float8_e4m3),
        "i4": values((513,), np.int8).clip(-8, 7).astype(ml_dtypes.int4),
        "key": jax.random.split(jax.random.key(0), 300),
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)
    assert eqx_ckpt.verify(tmp_path / "ckpt") == []


PADDED = [1, 3, 700, 17, 1500, 2, 1, 0, 64, 900, *([1] * 80), 333, 0, 2500]
# Multiples of 16 float32s (64 bytes): back to back, the chunks' usual case.
BACK_TO_BACK = [16, 32, 1024, 48, 512, *([16] * 40), 0, 2048, 160]


@pytest.mark.parametrize("sizes", [PADDED, BACK_TO_BACK], ids=["padded", "back-to-back"])
def test_a_packs_chunk_files_are_the_bytes_tensorstore_writes(tmp_path, monkeypatch, sizes):
    # Chunks of 4 KiB: up to 64 leaves in one chunk, and leaves across chunk boundaries.
    monkeypatch.setattr(_pack, "PACK_CHUNK_BYTES", 4096)
    tree = {f"l{i}": values((n,), np.float32, seed=i) for i, n in enumerate(sizes)}
    tree["scalar"] = np.float32(2.5)
    tree["flags"] = values((37,), np.bool_)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    data = open_source(tmp_path / "ckpt").data
    pack = ckpt.record("l0").pack
    assert pack is not None and pack.size > 3 * pack.chunk
    expected = np.zeros(pack.size, np.float32)
    for name, value in tree.items():
        record = ckpt.record(name)
        if record.pack is not None and record.pack.name == pack.name:
            expected[record.offset : record.offset + record.size] = np.ravel(value)
    ours = _files(tmp_path / "ckpt" / pack.name)
    assert ours == _written_by_tensorstore(tmp_path, lambda loc: _pack.spec(loc, pack), expected, pack.name)
    np.testing.assert_array_equal(_io.open_spec(_pack.spec(data, pack), data).result().read().result(), expected)
    assert eqx.tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)


def _generation(n: int) -> dict:
    return {
        "big": np.full((600, 1000), n, np.float32),
        "small": {f"s{i}": np.full(300 + i, n, np.int32) for i in range(5)},
    }


def _loads_as(path, n: int) -> bool:
    loaded = eqx_ckpt.tree_deserialise_leaves(path, _generation(0))
    return bool(eqx.tree_equal(loaded, _generation(n), typematch=True)) and eqx_ckpt.verify(path) == []


def _chunk_files(path) -> int:
    return sum(1 for name in _files(path) if "/c/" in f"/{name}")


def test_a_failed_write_of_any_chunk_file_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_spec, "CHUNK_BYTES", 2**20)  # `big` (2.4 MB) in chunks of 150 rows
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _generation(1))
    before = sorted(os.listdir(path))
    files = _chunk_files(path)
    assert files == 5  # four chunks of `big`, one of the pack
    write_all = _direct_write._write_all
    for failing in range(files):
        calls = []
        lock = threading.Lock()

        def fail_one(fd, views, failing=failing, calls=calls, lock=lock):
            with lock:
                calls.append(fd)
                this = len(calls) - 1
            if this == failing:
                raise OSError(errno.ENOSPC, "No space left on device")
            write_all(fd, views)

        monkeypatch.setattr(_direct_write, "_write_all", fail_one)
        with pytest.raises(
            eqx_ckpt.CheckpointError, match=r"No space left on device: cannot write chunk file '.*/c/\d+"
        ):
            eqx_ckpt.tree_serialise_leaves(path, _generation(2))
        assert len(calls) == files
        assert _loads_as(path, 1)
        assert sorted(os.listdir(path)) == before, "the failed save left something behind"
    monkeypatch.setattr(_direct_write, "_write_all", write_all)
    eqx_ckpt.tree_serialise_leaves(path, _generation(3))
    assert _loads_as(path, 3)


def test_the_error_names_the_leaf(tmp_path, monkeypatch):
    def full(fd, views):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_direct_write, "_write_all", full)
    with pytest.raises(eqx_ckpt.CheckpointError, match=r"chunk file 'big/c/0/0' of leaf `big`"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"big": _generation(1)["big"]})
    assert os.listdir(tmp_path / "ckpt") == []


def test_an_existing_file_is_never_overwritten(tmp_path):
    loc = _spec.location(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "0").write_bytes(b"keep")
    futures = _direct_write._start(loc, "", "leaf `x`", [("c/0", lambda: [memoryview(bytes(16))])])
    with pytest.raises(FileExistsError):
        futures[0].result()
    assert (tmp_path / "c" / "0").read_bytes() == b"keep"


class _Interrupt(BaseException):
    pass


def test_an_interrupt_while_chunk_files_are_written_waits_for_them_and_commits_nothing(tmp_path, monkeypatch):
    """The main thread is interrupted while the writer threads are busy: the
    save waits for every one of them before it deletes what they wrote."""
    monkeypatch.setattr(_spec, "CHUNK_BYTES", 2**20)
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _generation(1))
    before = sorted(os.listdir(path))
    write_all, finished = _direct_write._write_all, []

    def slow(fd, views):
        time.sleep(0.5)
        write_all(fd, views)
        finished.append(time.perf_counter())

    monkeypatch.setattr(_direct_write, "_write_all", slow)
    previous = signal.signal(signal.SIGUSR1, lambda *args: (_ for _ in ()).throw(_Interrupt()))
    timer = threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(_Interrupt):
            eqx_ckpt.tree_serialise_leaves(path, _generation(2))
        interrupted_at = time.perf_counter()
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert len(finished) == 5 and max(finished) <= interrupted_at
    assert _loads_as(path, 1)
    assert sorted(os.listdir(path)) == before


def test_progress_counts_every_leaf_and_byte(tmp_path):
    tree = _generation(1)
    seen = []
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree, progress=lambda *a: seen.append(a))
    total = sum(x.nbytes for x in jax.tree.leaves(tree))
    assert seen[-1] == (6, 6, total, total)


def test_settling_a_write_that_raised_an_interrupt_in_its_thread_waits_once():
    """A writer thread's own `KeyboardInterrupt` (or `SystemExit`) is that write's
    outcome: settling must not take it for an interrupt of the wait and wait
    again (it did, forever, each raise growing the traceback until memory ran out)."""

    class Counting(concurrent.futures.Future):
        calls = 0

        def result(self, timeout=None):
            self.calls += 1
            if self.calls > 3:  # a settle that loops stops here, and the test fails
                return None
            return super().result(timeout)

    for error in (KeyboardInterrupt(), SystemExit(1), OSError("disk")):
        future = Counting()
        future.set_exception(error)
        raised = None
        try:
            _write.settle([future])
        except BaseException as e:  # a looping settle raises the stored interrupt at last
            raised = e
        assert (future.calls, raised) == (1, None), error
