"""Chunk files that eqx_ckpt writes itself on a local disk (`_local_write`):
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

import jax
import ml_dtypes
import numpy as np
import pytest
from arrays import tree_equal, values

import eqx_ckpt
from eqx_ckpt._base import _faults, _interrupts, _location
from eqx_ckpt._load._load_plan import LoadOptions
from eqx_ckpt._ondisk import _format
from eqx_ckpt._save import _records
from eqx_ckpt._sources._opening import open_source
from eqx_ckpt._store import _chunk_files, _local_write, _storage

pytestmark = pytest.mark.skipif(not _chunk_files.LOCAL_PATH_SUPPORTED, reason="no direct writes on this host")


@pytest.fixture(params=["unbuffered", "buffered"])
def either_way(request, monkeypatch):
    """A leaf's chunk files written past the page cache (`O_DIRECT`, which this
    file system takes), whatever their size, or through it."""
    monkeypatch.setattr(_local_write, "UNBUFFERED_FROM", 0 if request.param == "unbuffered" else 2**62)
    return request.param


@pytest.fixture
def own_folders(monkeypatch):
    """Every leaf in its own folder, in chunks of at most 1 KiB."""
    monkeypatch.setattr(_records, "PACK_BYTES", -1)
    monkeypatch.setattr(_format, "CHUNK_BYTES", 1024)


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
    loc = _location.location(tmp_path / "by-tensorstore")
    _storage.create_spec(spec_of(loc), loc).result().write(stored).result()
    return _files(tmp_path / "by-tensorstore" / folder)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.complex64, np.float64])
@pytest.mark.parametrize("shape", [(1001, 3), (4099,), (101, 5, 3), (7,)])
def test_a_leafs_chunk_files_are_the_bytes_tensorstore_writes(tmp_path, own_folders, either_way, dtype, shape):
    x = values(shape, dtype)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"model": {"w": x}})
    data = open_source(tmp_path / "ckpt", LoadOptions()).data
    record = eqx_ckpt.Checkpoint(tmp_path / "ckpt").record("model.w")
    assert _chunk_files.chunk_files(data).writes(processes=1, layout="directories")
    assert _chunk_files.chunk_files(data).writes_leaf(record, [((), x)])
    ours = _files(tmp_path / "ckpt" / "model" / "w")
    if x.nbytes > 1024:
        assert len(ours) > 1 and shape[0] % record.chunks[0], "want several chunks and an edge chunk"
    theirs = _written_by_tensorstore(
        tmp_path,
        lambda loc: _storage.array_spec(
            loc, "", shape=shape, stored_dtype=record.stored_dtype, chunks=list(record.chunks)
        ),
        x,
    )
    assert ours == theirs
    # Read by TensorStore alone, through the checkpoint's own zarr.json.
    np.testing.assert_array_equal(_storage.open_array(data, record).result().read().result(), x)


def test_big_endian_arrays_are_stored_little_endian(tmp_path, own_folders):
    x = values((300, 2), np.float32)
    tree = {"big": x.astype(">f4"), "little": x}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert _files(tmp_path / "ckpt" / "big") == _files(tmp_path / "ckpt" / "little")
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", {"big": x, "little": x})
    assert tree_equal(loaded, {"big": x, "little": x}, typematch=True)


def test_encoded_leaves_round_trip_through_tensorstore(tmp_path, own_folders):
    # "view" (float8_e4m3, int4: raw bytes) and "key_data" leaves.
    tree = {
        "f8": values((300, 7), np.float32).astype(ml_dtypes.float8_e4m3),
        "i4": values((513,), np.int8).clip(-8, 7).astype(ml_dtypes.int4),
        "key": jax.random.split(jax.random.key(0), 300),
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)
    assert eqx_ckpt.verify(tmp_path / "ckpt") == []


PADDED = [1, 3, 700, 17, 1500, 2, 1, 0, 64, 900, *([1] * 80), 333, 0, 2500]
# Multiples of 16 float32s (64 bytes): back to back, the chunks' usual case.
BACK_TO_BACK = [16, 32, 1024, 48, 512, *([16] * 40), 0, 2048, 160]


@pytest.mark.parametrize("sizes", [PADDED, BACK_TO_BACK], ids=["padded", "back-to-back"])
def test_a_packs_chunk_files_are_the_bytes_tensorstore_writes(tmp_path, monkeypatch, either_way, sizes):
    # Chunks of 4 KiB: up to 64 leaves in one chunk, and leaves across chunk boundaries.
    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", 4096)
    tree = {f"l{i}": values((n,), np.float32, seed=i) for i, n in enumerate(sizes)}
    tree["scalar"] = np.float32(2.5)
    tree["flags"] = values((37,), np.bool_)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    data = open_source(tmp_path / "ckpt", LoadOptions()).data
    pack = ckpt.record("l0").pack
    assert pack is not None and pack.size > 3 * pack.chunk
    expected = np.zeros(pack.size, np.float32)
    for name, value in tree.items():
        record = ckpt.record(name)
        if record.pack is not None and record.pack.name == pack.name:
            expected[record.offset : record.offset + record.size] = np.ravel(value)
    ours = _files(tmp_path / "ckpt" / pack.name)
    assert ours == _written_by_tensorstore(tmp_path, lambda loc: _storage.pack_spec(loc, pack), expected, pack.name)
    np.testing.assert_array_equal(
        _storage.open_spec(_storage.pack_spec(data, pack), data).result().read().result(), expected
    )
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)


def _generation(n: int) -> dict:
    return {
        "big": np.full((600, 1000), n, np.float32),
        "small": {f"s{i}": np.full(300 + i, n, np.int32) for i in range(5)},
    }


def _loads_as(path, n: int) -> bool:
    loaded = eqx_ckpt.tree_deserialise_leaves(path, _generation(0))
    return bool(tree_equal(loaded, _generation(n), typematch=True)) and eqx_ckpt.verify(path) == []


def _count_chunk_files(path) -> int:
    return sum(1 for name in _files(path) if "/c/" in f"/{name}")


def test_a_failed_write_of_any_chunk_file_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2**20)  # `big` (2.4 MB) in chunks of 150 rows
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _generation(1))
    before = sorted(os.listdir(path))
    files = _count_chunk_files(path)
    assert files == 5  # four chunks of `big`, one of the pack
    for failing in range(files):
        calls = []
        lock = threading.Lock()

        def fail_one(fd, failing=failing, calls=calls, lock=lock):
            with lock:
                calls.append(fd)
                this = len(calls) - 1
            if this == failing:
                raise OSError(errno.ENOSPC, "No space left on device")

        with _faults.armed("local_write.chunk_bytes", fail_one):
            with pytest.raises(
                eqx_ckpt.CheckpointError, match=r"No space left on device: cannot write chunk file '.*/c/\d+"
            ):
                eqx_ckpt.tree_serialise_leaves(path, _generation(2))
        assert len(calls) == files
        assert _loads_as(path, 1)
        assert sorted(os.listdir(path)) == before, "the failed save left something behind"
    eqx_ckpt.tree_serialise_leaves(path, _generation(3))
    assert _loads_as(path, 3)


def test_the_error_names_the_leaf(tmp_path, faults):
    faults("local_write.chunk_bytes", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(eqx_ckpt.CheckpointError, match=r"chunk file 'big/c/0/0' of leaf `big`"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"big": _generation(1)["big"]})
    assert os.listdir(tmp_path / "ckpt") == []


def test_an_existing_file_is_never_overwritten(tmp_path):
    loc = _location.location(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "0").write_bytes(b"keep")
    futures = _local_write._start(loc, "", "leaf `x`", [("c/0", lambda: [memoryview(bytes(16))])])
    with pytest.raises(FileExistsError):
        futures[0].result()
    assert (tmp_path / "c" / "0").read_bytes() == b"keep"


class _Interrupt(BaseException):
    pass


def test_an_interrupt_while_chunk_files_are_written_waits_for_them_and_commits_nothing(tmp_path, monkeypatch, faults):
    """The main thread is interrupted while the writer threads are busy: the
    save waits for every one of them before it deletes what they wrote."""
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2**20)
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _generation(1))
    before = sorted(os.listdir(path))
    finished = []

    def slow(fd):
        time.sleep(0.5)
        finished.append(time.perf_counter())

    faults("local_write.chunk_bytes", slow)  # each file then written, right after
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
            _interrupts.settle([future])
        except BaseException as e:  # a looping settle raises the stored interrupt at last
            raised = e
        assert (future.calls, raised) == (1, None), error


# Unbuffered (`O_DIRECT`) writes: a small stage here, so that files cross it,
# end just short of it (no room for the checksum) and start on aligned sources.
_STAGE = 2 * 4096


@pytest.fixture
def small_stage(monkeypatch):
    monkeypatch.setattr(_local_write, "UNBUFFERED_FROM", 0)
    monkeypatch.setattr(_local_write, "STAGE_BYTES", _STAGE)
    monkeypatch.setattr(_local_write, "_BIG_COPY", 1000)  # NumPy's copy, too


@pytest.fixture
def unbuffered_calls(faults):
    """The files written unbuffered (their descriptors), as each write starts."""
    calls = []
    faults("local_write.unbuffered", calls.append)
    return calls


def _chunks_of(path: pathlib.Path) -> dict[str, bytes]:
    """The chunk files of a checkpoint (its manifest differs from save to save)."""
    return {name: data for name, data in _files(path).items() if "/c/" in f"/{name}"}


def _page_aligned(data: bytes) -> memoryview:
    import mmap

    memory = mmap.mmap(-1, len(data))
    memory[:] = data
    return memoryview(memory)


def _write_new(path, views) -> bytes:
    fd = os.open(path, _local_write._FLAGS, 0o666)
    try:
        _local_write._write_all(fd, views)
    finally:
        os.close(fd)
    return pathlib.Path(path).read_bytes()


@pytest.mark.parametrize(
    "sizes",
    [
        [0],
        [1],
        [4095],
        [4096],
        [_STAGE - 4],
        [_STAGE - 3],
        [_STAGE - 1],
        [_STAGE],
        [_STAGE + 1],
        [3, _STAGE - 5],
        [5000, 5000, 5000],
        [100] * 300,
        [3 * _STAGE + 17],
        [0, 7, 0],
    ],
)
@pytest.mark.parametrize("aligned", [False, True], ids=["copied", "page-aligned"])
def test_an_unbuffered_file_is_its_bytes_then_their_crc32c(tmp_path, small_stage, unbuffered_calls, sizes, aligned):
    import crc32c

    rng = np.random.default_rng(len(sizes) * 1000 + sum(sizes))
    parts = [rng.integers(0, 256, n, np.uint8).tobytes() for n in sizes]
    views = [_page_aligned(p) if aligned and len(p) else memoryview(p) for p in parts]
    data = b"".join(parts)
    assert _write_new(tmp_path / "f", views) == data + crc32c.crc32c(data).to_bytes(4, "little")
    assert len(unbuffered_calls) == 1


def test_a_file_system_that_refuses_unbuffered_writes_gets_buffered_ones(
    tmp_path, monkeypatch, small_stage, unbuffered_calls
):
    """A file system without `O_DIRECT` (injected: `fcntl` refuses to set it, as
    such a file system does) gets the same files through the page cache."""
    import fcntl

    setfl = fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return setfl(fd, cmd, arg)

    tree = _generation(4)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "unbuffered", tree)
    assert unbuffered_calls
    unbuffered_calls.clear()
    monkeypatch.setattr(fcntl, "fcntl", refuse)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "buffered", tree)
    assert unbuffered_calls == []
    assert _chunks_of(tmp_path / "buffered") == _chunks_of(tmp_path / "unbuffered")
    assert _loads_as(tmp_path / "buffered", 4)


def test_a_write_refused_part_way_is_written_again_through_the_page_cache(tmp_path, monkeypatch, small_stage):
    """A device that refuses an unbuffered write after the first (injected:
    `EINVAL`, as an alignment it does not take gives) gets the whole file again,
    buffered."""
    pwrite, refused = os.pwrite, []

    def second_refused(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset > 0:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    tree = _generation(5)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "plain", tree)
    monkeypatch.setattr(os, "pwrite", second_refused)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "refused", tree)
    monkeypatch.undo()
    assert refused, "no unbuffered write was refused"
    assert _chunks_of(tmp_path / "refused") == _chunks_of(tmp_path / "plain")
    assert _loads_as(tmp_path / "refused", 5)


def test_a_failed_unbuffered_write_names_the_file_and_leaves_the_old_checkpoint_whole(
    tmp_path, monkeypatch, small_stage
):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _generation(1))
    before = sorted(os.listdir(path))
    pwrite = os.pwrite

    def full(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(eqx_ckpt.CheckpointError, match=r"No space left on device: cannot write chunk file '.*/c/"):
        eqx_ckpt.tree_serialise_leaves(path, _generation(2))
    monkeypatch.undo()
    assert _loads_as(path, 1)
    assert sorted(os.listdir(path)) == before


@pytest.mark.parametrize("sizes", [PADDED, BACK_TO_BACK], ids=["padded", "back-to-back"])
@pytest.mark.parametrize("chunk", [1000, 2048, 5003])
def test_a_packs_chunk_gathered_in_the_stage_is_its_bytes_then_their_crc32c(tmp_path, small_stage, sizes, chunk):
    """Gathered part by part into the stage (parts of 2048 elements here), a
    pack's chunk is exactly its elements: members cut at the chunk's and the
    parts' edges, zeros between, one member big-endian."""
    import crc32c

    members = [values((n,), np.float32, seed=i) for i, n in enumerate(sizes) if n]
    members[len(members) // 2] = members[len(members) // 2].astype(">f4")
    step = _records.ALIGN_BYTES // 4
    starts = np.cumsum([0] + [-(-m.size // step) * step for m in members[:-1]])
    stops = starts + [m.size for m in members]
    total = int(stops[-1])
    pack = np.zeros(-(-total // chunk) * chunk, "<f4")
    for member, start, stop in zip(members, starts, stops):
        pack[start:stop] = member
    for n, lo in enumerate(range(0, total, chunk)):
        hi = lo + chunk
        first, last = int(np.searchsorted(stops, lo, "right")), int(np.searchsorted(starts, hi, "left"))
        part = _local_write._Chunk(members[first:last], starts[first:last], stops[first:last], lo, hi, np.dtype("<f4"))
        data = pack[lo:hi].tobytes()
        written = _write_new(tmp_path / f"c{n}", part)
        assert written == data + crc32c.crc32c(data).to_bytes(4, "little"), f"chunk {n}"
