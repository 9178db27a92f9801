"""`_local_read.start_read`: a large local leaf read straight into one aligned buffer
gives TensorStore's bytes, and refuses every kind of damage naming the leaf."""

import dataclasses
import mmap
import os
import pathlib
import re
import shutil
import threading
import time

import crc32c
import jax
import ml_dtypes
import numpy as np
import pytest
from arrays import in_a_mapping, values
from hypothesis import given, settings, strategies as st

import eqx_ckpt
from eqx_ckpt._base import _location
from eqx_ckpt._load._load_plan import LoadOptions
from eqx_ckpt._ondisk import _format
from eqx_ckpt._ondisk._format import LeafRecord
from eqx_ckpt._save import _records
from eqx_ckpt._sources._opening import open_source
from eqx_ckpt._store import _chunk_files, _local_read, _memory, _storage


@pytest.fixture(autouse=True)
def own_folders(monkeypatch):
    """Every leaf in a folder of its own: these tests are about those arrays."""
    monkeypatch.setattr(_records, "PACK_BYTES", -1)


@pytest.fixture
def small(monkeypatch):
    """Chunks of at most 1 KiB read in pieces of 1000 bytes and steps of 300
    (cutting through elements), and no size floor, so small arrays exercise
    many chunks, pieces, steps and an edge chunk."""
    monkeypatch.setattr(_format, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(_local_read, "PIECE_BYTES", 1000)
    monkeypatch.setattr(_local_read, "STEP_BYTES", 300)
    monkeypatch.setattr(_local_read, "MIN_BYTES", 1)


def _saved(path, tree):
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return open_source(path, LoadOptions()).data, eqx_ckpt.Checkpoint(path)


def read_leaf(data, record):
    """A whole leaf by the local fast path (the location's chunk files'), or
    `None` where it does not apply."""
    finish = _chunk_files.chunk_files(data).start_read(record)
    return None if finish is None else finish()


def _ts_read(data, record):
    return _storage.open_array(data, record).result().read().result()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.complex64])
@pytest.mark.parametrize("shape", [(1001, 3), (4099,), (101, 5, 3)])
def test_same_bytes_as_tensorstore(tmp_path, small, dtype, shape):
    x = values(shape, dtype)
    data, ckpt = _saved(tmp_path, {"model": {"w": x}})
    record = ckpt.record("model.w")
    assert record.chunks[0] < shape[0] and shape[0] % record.chunks[0], "want several chunks and an edge chunk"
    y = read_leaf(data, record)
    assert y.dtype == np.dtype(dtype) and y.shape == shape and y.flags.c_contiguous
    np.testing.assert_array_equal(y, _ts_read(data, record))
    np.testing.assert_array_equal(y, x)


def test_default_pieces_and_chunks(tmp_path, monkeypatch):
    # Real constants, but chunks of 256 KiB: a 4 MiB leaf in 16 chunks and one piece each.
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2**18)
    x = values((1025, 1024), np.float32)
    data, ckpt = _saved(tmp_path, {"w": x})
    np.testing.assert_array_equal(read_leaf(data, ckpt.record("w")), x)


def test_stored_encodings_come_back_as_stored(tmp_path, small):
    # "view" (float8_e4m3 as raw bytes) and "key_data" leaves: the stored bytes, undecoded.
    f8 = values((300, 7), np.float32).astype(ml_dtypes.float8_e4m3)
    tree = {"f8": f8, "key": jax.random.split(jax.random.key(0), 700)}
    data, ckpt = _saved(tmp_path, tree)
    for name in tree:
        record = ckpt.record(name)
        assert record.encoding in ("view", "key_data")
        np.testing.assert_array_equal(read_leaf(data, record), _ts_read(data, record))


def test_tensorstore_pads_edge_chunks_to_full_size(tmp_path, small):
    """What `read_leaf` relies on: TensorStore itself writes an edge chunk as a
    whole chunk plus the checksum."""
    loc = _location.location(tmp_path)
    record = LeafRecord("x", [["key", "x"]], "numpy", (10, 3), "int16", (10, 3), "int16", "plain", (4, 3))
    x = np.arange(30, dtype=np.int16).reshape(10, 3)
    _storage.create_array(loc, record).result().write(x).result()
    sizes = {name: os.path.getsize(tmp_path / "x" / "c" / name / "0") for name in os.listdir(tmp_path / "x" / "c")}
    assert sizes == {"0": 4 * 3 * 2 + 4, "1": 4 * 3 * 2 + 4, "2": 4 * 3 * 2 + 4}
    np.testing.assert_array_equal(read_leaf(loc, record), x)


def test_aligned_and_adopted_by_jax(tmp_path, small):
    data, ckpt = _saved(tmp_path, {"w": values((1001, 3), np.float32)})
    y = read_leaf(data, ckpt.record("w"))
    assert y.ctypes.data % 64 == 0
    device = jax.devices("cpu")[0]
    assert jax.device_put(y, device).unsafe_buffer_pointer() == y.ctypes.data


def test_ineligible_leaves(tmp_path, monkeypatch):
    monkeypatch.setattr(_format, "CHUNK_BYTES", 4096)
    tree = {"small": np.ones(10, np.float32), "wide": np.ones((1, 300_000), np.float32), "tall": np.ones((300_000, 1))}
    data, ckpt = _saved(tmp_path / "local", tree)
    assert read_leaf(data, ckpt.record("small")) is None  # under MIN_BYTES
    assert ckpt.record("wide").chunks[1] < 300_000
    assert read_leaf(data, ckpt.record("wide")) is None  # chunks split the second axis
    assert read_leaf(data, ckpt.record("tall")) is not None
    for elsewhere, options in [("memory://direct/", {}), (tmp_path / "ocdbt", {"layout": "ocdbt"})]:
        eqx_ckpt.tree_serialise_leaves(elsewhere, tree, **options)
        assert read_leaf(open_source(elsewhere, LoadOptions()).data, ckpt.record("tall")) is None


def _damage_setup(tmp_path):
    # Chunks of 63 rows: c/3/0 is the edge chunk, 61 rows and 2 of padding.
    data, ckpt = _saved(tmp_path, {"model": {"w": values((250, 3), np.float32)}})
    record = ckpt.record("model.w")
    assert record.chunks == (63, 3)
    folder = pathlib.Path(data.local, record.directory)
    return data, record, folder


def _refused(data, record, *words):
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`model.w`")) as info:
        read_leaf(data, record)
    assert info.value.dotted == ("model.w",)
    for word in words:
        assert word in str(info.value)


def _edit(chunk: pathlib.Path, edit):
    data = bytearray(chunk.read_bytes())
    edit(data)
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda c: c.unlink(), ["'model/w/c/3/0'", "missing"]),
        (lambda c: _edit(c, lambda d: d.pop()), ["'model/w/c/3/0'", "bytes, not"]),
        (lambda c: _edit(c, lambda d: d.append(0)), ["'model/w/c/3/0'", "bytes, not"]),
        (lambda c: c.write_bytes(b""), ["'model/w/c/3/0'", "is 0 bytes, not"]),
        (lambda c: _edit(c, lambda d: d.__setitem__(5, d[5] ^ 0x10)), ["'model/w/c/3/0'", "checksum"]),
        (lambda c: _edit(c, lambda d: d.__setitem__(-1, d[-1] ^ 0x01)), ["'model/w/c/3/0'", "checksum"]),
        (
            lambda c: _edit(c, lambda d: d.__setitem__(-6, d[-6] ^ 0x01)),
            ["'model/w/c/3/0'", "checksum"],
        ),  # edge padding
        (lambda c: (c.unlink(), c.mkdir()), ["'model/w/c/3/0'", "not a regular file"]),
        (lambda c: (c.unlink(), os.mkfifo(c)), ["'model/w/c/3/0'", "not a regular file"]),
    ],
    ids=["missing", "shorter", "longer", "empty", "data", "checksum", "padding", "folder", "fifo"],
)
def test_damaged_chunk(tmp_path, small, damage, words):
    data, record, folder = _damage_setup(tmp_path)
    damage(folder / "c" / "3" / "0")
    _refused(data, record, *words)


@pytest.mark.parametrize("position", [0, 299, 300, 301, 999, 1000, 1019])
def test_every_piece_and_step_is_checked(tmp_path, small, position):
    """A chunk of 1,020 bytes and its checksum is read in two pieces (bytes
    0-999 and the rest), the first in four steps: a flipped bit anywhere in
    it, at either side of each cut, fails the joined checksum."""
    data, ckpt = _saved(tmp_path, {"model": {"w": values((510, 1), np.float32)}})
    record = ckpt.record("model.w")
    assert record.chunks == (255, 1) and record.chunk_nbytes == 1020
    _edit(pathlib.Path(data.local, record.directory, "c", "1", "0"), lambda d: d.__setitem__(position, d[position] ^ 4))
    _refused(data, record, "'model/w/c/1/0'", "fails its crc32c checksum")


def test_file_shrinking_during_the_read(tmp_path, small, faults):
    """A chunk file cut short after its checks (an overwrite racing the load):
    the step that reads past its new end names the file and its size."""
    data, record, folder = _damage_setup(tmp_path)
    chunk = folder / "c" / "1" / "0"

    def racing(fd, offset):
        if os.fstat(fd).st_ino == chunk.stat().st_ino:
            os.truncate(chunk, 100)

    faults("local_read.read", racing)
    _refused(data, record, "'model/w/c/1/0'", "is 100 bytes, not")


@given(st.binary(max_size=3000), st.binary(max_size=3000), st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_crc32c_combine(a, b, c):
    """The checksum of a chunk joined from its pieces' is the checksum of its bytes."""
    ab = _local_read.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b))
    assert ab == crc32c.crc32c(a + b)
    assert _local_read.crc32c_combine(ab, crc32c.crc32c(c), len(c)) == crc32c.crc32c(a + b + c)


def test_crc32c_combine_of_long_pieces():
    a, b = os.urandom(2**20 + 3), os.urandom(17 * 2**20 + 5)
    assert _local_read.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


@pytest.mark.parametrize("where", ["model", "model/w", "model/w/c", "model/w/c/1", "model/w/c/1/0"])
def test_links_are_refused(tmp_path, small, where):
    """A folder or chunk file replaced by a link to its copy outside the checkpoint."""
    data, record, _ = _damage_setup(tmp_path / "ckpt")
    inside, outside = pathlib.Path(data.local, where), tmp_path / "outside"
    inside.rename(outside)
    inside.symlink_to(outside)
    _refused(data, record, "symbolic link", repr(where))


def test_absurd_shape_allocates_nothing(tmp_path, small, faults):
    data, record, _ = _damage_setup(tmp_path)
    allocated = []

    def refused(nbytes):
        allocated.append(nbytes)
        raise MemoryError(f"{nbytes} bytes")  # never allocated, even when the check fails

    faults("memory.map", refused)
    hostile = dataclasses.replace(record, stored_shape=(10**15, 3), shape=(10**15, 3))
    _refused(data, hostile, "'model/w/c/4/0'", "missing")
    bigger = dataclasses.replace(record, stored_shape=(10**15, 3), shape=(10**15, 3), chunks=(10**14, 3))
    _refused(data, bigger, "'model/w/c/0/0'", "bytes, not")
    assert allocated == []


class _SlowReads:
    """The reads of chunk files (fault point `local_read.read`, each step just
    before it is read), slowed down and watched: how many reads are running,
    which started, and which finished after `returned` was set."""

    def __init__(self, faults):
        self.in_flight, self.started, self.finished_after = 0, [], []
        self.returned, self._lock = threading.Event(), threading.Lock()
        faults("local_read.read", self._read)

    def _read(self, *args):
        with self._lock:
            self.in_flight += 1
            self.started.append(args)
        try:
            time.sleep(0.01)
        finally:
            with self._lock:
                self.in_flight -= 1
            if self.returned.is_set():
                self.finished_after.append(args)

    def check_all_stopped(self):
        self.returned.set()
        assert self.in_flight == 0
        assert len(self.started) < 64, "the reads not yet started are cancelled"
        time.sleep(0.05)
        assert self.finished_after == []


def test_interrupt_waits_for_the_readers(tmp_path, small, faults):
    data, ckpt = _saved(tmp_path, {"w": values((4000, 3), np.float32)})
    assert ckpt.record("w").chunks == (63, 3)  # 64 chunks of one piece each
    reads = _SlowReads(faults)
    faults("local_read.crc", KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        read_leaf(data, ckpt.record("w"))
    reads.check_all_stopped()


def test_interrupt_while_the_files_are_checked_stops_the_reads_they_start(tmp_path, small, faults):
    """The checks of a leaf's files run in a thread of their own, which then
    starts the reads: a real SIGALRM interrupting the wait for the checks is
    raised only once they and every read they started have stopped."""
    import signal

    data, ckpt = _saved(tmp_path, {"w": values((4000, 3), np.float32)})
    reads = _SlowReads(faults)
    submitted = []

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    faults("local_read.check_files", lambda directory: time.sleep(0.3))
    faults("local_read.start_reads", lambda *args: submitted.append(args))
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            read_leaf(data, ckpt.record("w"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started >= 0.3, "raised only once the checks had finished"
    assert len(submitted) == 1, "the checks went on to start the reads"
    reads.check_all_stopped()


def test_missing_folder(tmp_path, small):
    data, record, folder = _damage_setup(tmp_path)
    shutil.rmtree(folder)
    _refused(data, record, "folder cannot be opened")


def _private_copy_cases():
    big = 2 * _memory.FRESH_MIN_BYTES // 4  # float32 elements: twice the threshold
    return {
        "big": np.arange(big, dtype=np.float32),
        "big-fortran": np.asfortranarray(np.arange(big, dtype=np.float32).reshape(1024, -1)),
        "big-strided": np.arange(2 * big, dtype=np.float32)[::2],
        "big-big-endian": np.arange(big, dtype=">i4"),
        "big-bool": np.arange(4 * big) % 3 == 0,
        "small": np.arange(10, dtype=np.int16),
        "zero-size": np.zeros((0, 3), np.float64),
        "scalar": np.asarray(np.float32(1.5)),
        "objects": np.array([1, "a"], dtype=object),
    }


def test_a_private_copy_is_equal_contiguous_and_shares_nothing():
    """The copies an asynchronous save makes of NumPy leaves: the same values,
    dtype (byte order included) and shape, C-contiguous, and independent of
    the original; from `FRESH_MIN_BYTES` on, in page-aligned mapped memory (not
    NumPy's, which asks for huge pages)."""
    cases = _private_copy_cases()
    copies = _memory.private_copies(list(cases.values()))
    assert len(copies) == len(cases)
    for (name, original), copy in zip(cases.items(), copies, strict=True):
        single = _memory.private_copy(original)
        for out in (copy, single):
            assert type(out) is np.ndarray and out.dtype == original.dtype, name
            assert out.shape == original.shape and np.array_equal(out, original), name
            assert out.flags.c_contiguous and out.flags.writeable, name
            assert not np.shares_memory(out, original), name
            mapped = original.nbytes >= _memory.FRESH_MIN_BYTES and not original.dtype.hasobject
            assert in_a_mapping(out) == mapped, name
            assert out.ctypes.data % mmap.PAGESIZE == 0 or not mapped, name
    before = copies[0].copy()
    cases["big"][:] = -1  # the caller goes on
    assert np.array_equal(copies[0], before)
