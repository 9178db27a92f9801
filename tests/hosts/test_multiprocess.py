"""Several JAX processes saving one checkpoint, for real: processes on this
machine, each with 1 or 2 CPU devices, joined by `jax.distributed`, saving to a
local directory or a local S3 server.

Each worker is a process of its own, forked from a template process that has
imported JAX but started no backend (`prefork.spawn`: as `python worker.py
...`, a second and a half less per process); the tests signal and kill them
by their pids."""

import json
import os
import pathlib
import re
import signal
import subprocess
import time
from typing import Any

import arrays
import jax
import numpy as np
import places
import prefork
import pytest
import s3_server
from arrays import tree_equal
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_ckpt
from eqx_ckpt._load import _read_once
from eqx_ckpt._ondisk import _format
from eqx_ckpt._save import _records
from eqx_ckpt._store import _window

WORKER = places.SUPPORT / "multiprocess_worker.py"
MATRIX_WORKER = places.SUPPORT / "multiprocess_matrix_worker.py"
ROWS_COLS = (8, 4)


def _run_workers(
    path: pathlib.Path, count: int = 2, timeout: float = 55, worker: pathlib.Path = WORKER, job: str | None = None
) -> list[str]:
    """Run `worker` in `count` processes (its last argument `job`, or else
    `path`); their output, or a failure with it. Logs go beside `path`."""
    port = places.free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # Output goes to files: a full pipe would block a worker that nobody reads yet.
    logs = [path.parent / f"worker{i}.log" for i in range(count)]
    procs = []
    for i, log in enumerate(logs):
        command = [str(worker), str(i), str(count), str(port), job or str(path)]
        procs.append(prefork.spawn(command, env=env, output=log))
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # Never leave a worker behind, whatever happened.
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc in procs:
        proc.wait()
    outputs = [log.read_text() for log in logs]
    assert not timed_out, "the workers did not finish in time:\n" + "\n".join(out[-4000:] for out in outputs)
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0 and f"worker {i} ok" in out, f"worker {i} failed:\n{out[-4000:]}"
    return outputs


def _value(scale: float) -> np.ndarray:
    return (np.arange(np.prod(ROWS_COLS), dtype=np.float32) * scale).reshape(ROWS_COLS)


def _chunk_files(folder: pathlib.Path) -> int:
    return sum(1 for f in (folder / "c").rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str]]:
    path = tmp_path_factory.mktemp("multiprocess") / "ckpt"
    return path, _run_workers(path)


@pytest.fixture(scope="module")
def saved(workers: tuple[pathlib.Path, list[str]]) -> pathlib.Path:
    return workers[0]


def test_each_shard_written_once(workers: tuple[pathlib.Path, list[str]]) -> None:
    saved, outputs = workers
    # The workers' last save overwrote the first one, so its arrays are in gen.<commit>/.
    root = json.loads((saved / "manifest.json").read_text())["data_root"]
    data = saved / root
    assert root.startswith("gen.") and sorted(p.name for p in saved.iterdir()) == [root, "manifest.json"]
    assert _chunk_files(data / "sharded") == 4
    assert _chunk_files(data / "half") == 2
    assert _chunk_files(data / "replicated") == 1
    assert _chunk_files(data / "small" / "table") == 1
    # Every file of that save was written by one process, once: the writes of all
    # processes add up to its files, plus manifest.json and the three writes of
    # the lease `saving.json` (created, its journal, deleted).
    writes = [int(re.search(r"worker \d wrote (\d+) files", out).group(1)) for out in outputs]
    files = sum(1 for f in data.rglob("*") if f.is_file())
    assert sum(writes) == files + 4
    assert all(n > 0 for n in writes)


def _like(sharding: jax.sharding.Sharding | None) -> dict:
    arrays = {
        name: jax.ShapeDtypeStruct(ROWS_COLS, np.float32, sharding=sharding)
        for name in ("sharded", "half", "replicated")
    }
    return {**arrays, "small": {"table": np.zeros(3, np.int32), "rate": 0.0}, "step": 0}


@pytest.mark.parametrize("devices", [4, 1])
def test_one_process_loads_all(saved: pathlib.Path, devices: int) -> None:
    mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices("cpu")[:devices])
    sharding = NamedSharding(mesh, P("x")) if devices > 1 else None
    loaded = eqx_ckpt.tree_deserialise_leaves(saved, _like(sharding))
    value = _value(2.0)
    expected = {
        "sharded": value,
        "half": value,
        "replicated": value,
        "small": {"table": np.arange(3, dtype=np.int32) + 2, "rate": 1.0},
        "step": 14,
    }
    host = {**loaded, **{name: np.asarray(loaded[name]) for name in ("sharded", "half", "replicated")}}
    assert tree_equal(host, expected, typematch=True)
    if sharding is not None:
        assert loaded["sharded"].sharding == sharding
    # The processes recorded one structure: the checkpoint rebuilds without a skeleton.
    rebuilt = eqx_ckpt.Checkpoint(saved).load(trust=[])
    rebuilt = {**rebuilt, **{name: np.asarray(rebuilt[name]) for name in ("sharded", "half", "replicated")}}
    assert tree_equal(rebuilt, expected, typematch=True)


def test_export_of_a_multiprocess_checkpoint(saved: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # Read leaf by leaf from storage: no process's live arrays are needed.
    from safetensors.numpy import load_file

    written = eqx_ckpt.export_safetensors(tmp_path / "hf", eqx_ckpt.Checkpoint(saved), max_shard_size=200)
    tensors = {}
    for name in written:
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(tmp_path / "hf" / name)))
    assert sorted(tensors) == sorted(eqx_ckpt.Checkpoint(saved))
    for name in ("sharded", "half", "replicated"):
        np.testing.assert_array_equal(tensors[name], _value(2.0))


def _matrix_value(shape: tuple[int, ...], scale: int) -> np.ndarray:
    # As tests/support/multiprocess_matrix_worker.py makes it.
    return (np.arange(np.prod(shape), dtype=np.float32) + np.float32(scale * 0.25)).reshape(shape)


def _run_matrix(
    tmp_path: pathlib.Path,
    processes: int,
    devices: int,
    checkpoints: list,
    *,
    shape: tuple[int, int],
    save: bool,
    chunk_bytes: int | None = None,
    read_once: list[bool | None] | None = None,
    gloo: bool = True,
    compression: str | None = None,
) -> list[str]:
    job = {"devices": devices, "shape": shape, "checkpoints": checkpoints, "save": save, "chunk_bytes": chunk_bytes}
    job.update(read_once=read_once or [None], gloo=gloo, compression=compression)
    logs = tmp_path / f"logs-{processes}x{devices}-{'save' if save else 'load'}"
    logs.mkdir()
    return _run_workers(logs / "_", count=processes, timeout=150, worker=MATRIX_WORKER, job=json.dumps(job))


def _bytes_read(outputs: list[str], name: str, read_once: bool | None, nth: int = 0) -> list[int]:
    """What each worker read from storage for the load with `read_once` of
    the `nth` checkpoint of sharding `name` in the job (in the job's order)."""
    said = re.compile(rf"worker \d+ read (\d+) bytes for {name} read_once={read_once}\n")
    return [int(said.findall(out)[nth]) for out in outputs]


def _stored_bytes(where: Any) -> int:
    """The bytes of every chunk file of a checkpoint (a local folder or S3 spec)."""
    checkpoint = eqx_ckpt.Checkpoint(where)
    return sum(checkpoint.record(path).nbytes for path in checkpoint)


def _where(tmp_path: pathlib.Path, storage: str, s3: Any, name: str) -> Any:
    return str(tmp_path / name) if storage == "local" else s3.spec(f"{tmp_path.name}/{name}/")


def _check_whole(where: Any, shape: tuple[int, int], scale: int) -> None:
    """One process, no sharding: the whole array, bit for bit, and nothing damaged."""
    expected = _matrix_value(shape, scale)
    loaded = eqx_ckpt.tree_deserialise_leaves(where, {"w": np.zeros(shape, np.float32)})
    assert tree_equal(loaded, {"w": expected}, typematch=True)
    assert loaded["w"].tobytes() == expected.tobytes()
    assert eqx_ckpt.verify(where) == []


MATRIX_SHAPE = (512, 512)  # 1 MiB of float32: rows and columns split evenly over up to 8 devices
SHARDINGS = ("rows", "columns", "replicated")


@pytest.fixture
def storage_for(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`storage_for(kind)`: the S3 server for "s3" (its credentials in the
    environment the workers inherit), `None` for "local"."""

    def storage(kind: str) -> Any:
        if kind == "local":
            return None
        s3_server.credentials(monkeypatch)
        return request.getfixturevalue("s3")

    return storage


class TestProcessMatrix:
    """2, 4 and 8 processes (one CPU device each, or two), saving one array
    sharded by rows, by columns, and replicated, to a local directory and to
    S3: each process loads its shards back with the same sharding, bit for
    bit, and one process loads the whole arrays. (In chunks of 128 KiB, so
    that the processes write the replicated array in slices.) (Four processes saving a
    sharded array once failed every time while two passed.) The full cross
    product runs for 2 and 4 processes on a local disk; 8 processes (one
    device each, on a local disk) and S3 (2 and 4 processes) run a subset:
    8 processes of JAX are slow on a small machine, and slower on S3."""

    @pytest.mark.parametrize(
        "processes, devices, storages",
        [
            (2, 1, ("local",)),
            (2, 2, ("local", "s3")),
            (4, 1, ("local", "s3")),
            (4, 2, ("local",)),
            (8, 1, ("local",)),
        ],
        ids=lambda v: "+".join(v) if isinstance(v, tuple) else str(v),
    )
    def test_save_and_load(
        self, tmp_path: pathlib.Path, storage_for: Any, processes: int, devices: int, storages: tuple[str, ...]
    ):
        """With two storages, one run of the processes saves and loads each
        storage's checkpoints in turn (one start-up of the processes for
        both); every check is made, and named, for each storage."""
        checkpoints = [
            [_where(tmp_path, storage, storage_for(storage), f"{storage}-{name}"), name, i]
            for storage in storages
            for i, name in enumerate(SHARDINGS)
        ]
        # Chunks of 128 KiB: the processes cut the replicated array between them.
        outputs = _run_matrix(
            tmp_path,
            processes,
            devices,
            checkpoints,
            shape=MATRIX_SHAPE,
            save=True,
            chunk_bytes=128 << 10,
            read_once=[False, True, None],
        )
        for nth, storage in enumerate(storages):
            ours = checkpoints[nth * len(SHARDINGS) : (nth + 1) * len(SHARDINGS)]
            for where, name, scale in ours:
                try:
                    _check_whole(where, MATRIX_SHAPE, scale)
                except AssertionError as e:
                    raise AssertionError(f"{storage}, {name}: {e}") from e

            def read(name: str, read_once: bool | None, nth: int = nth) -> list[int]:
                return _bytes_read(outputs, name, read_once, nth)

            # Each byte of the replicated array read from storage once in all (its
            # zarr.json and the manifest aside), against once per process unshared.
            stored = _stored_bytes(ours[2][0])
            assert sum(read("replicated", True)) <= 1.1 * stored, (storage, read("replicated", True))
            assert all(n >= stored for n in read("replicated", False)), (storage, read("replicated", False))
            # Rows each held by one process: nothing to share, the same reads either way.
            assert read("rows", True) == read("rows", False), (storage, read("rows", True), read("rows", False))
            # By default, shared from `_read_once.REPLICAS` (4) processes holding a region.
            shared = processes >= _read_once.REPLICAS
            assert read("replicated", None) == read("replicated", shared), (storage, read("replicated", None))

    def test_compressed_saves_by_two_processes(self, tmp_path: pathlib.Path):
        """Issue 73: each process's shards compressed by TensorStore, every
        sharding, loaded back in each process and whole, bit for bit."""
        checkpoints = [[str(tmp_path / name), name, i] for i, name in enumerate(SHARDINGS)]
        _run_matrix(
            tmp_path, 2, 2, checkpoints, shape=MATRIX_SHAPE, save=True, chunk_bytes=128 << 10, compression="zstd"
        )
        for where, _, scale in checkpoints:
            _check_whole(where, MATRIX_SHAPE, scale)
            assert eqx_ckpt.Checkpoint(where).record("w").compression == "zstd"

    def test_shared_reads_need_collectives(self, tmp_path: pathlib.Path):
        """Without collectives across processes (JAX's CPU backend set up
        without gloo, its default), a default load of replicated state reads in every
        process, and `read_once=True` is refused, saying what to set."""
        where = str(tmp_path / "ckpt")
        outputs = _run_matrix(
            tmp_path,
            4,
            1,
            [[where, "replicated", 0]],
            shape=MATRIX_SHAPE,
            save=True,
            chunk_bytes=128 << 10,
            read_once=[None, True],
            gloo=False,
        )
        stored = _stored_bytes(where)
        assert all(n >= stored for n in _bytes_read(outputs, "replicated", None))
        said = "`read_once=True` cannot share reads: JAX's CPU backend was set up without collectives across processes"
        assert all(f"refused read_once=True: {said}" in out for out in outputs), outputs
        assert "jax.config.update('jax_cpu_collectives_implementation', 'gloo')" in outputs[0]

    @pytest.mark.parametrize("storage", ["local", "s3"])
    def test_four_processes_save_two_load_with_another_sharding(
        self, tmp_path: pathlib.Path, storage_for: Any, storage: str
    ):
        s3 = storage_for(storage)
        where = _where(tmp_path, storage, s3, "ckpt")
        _run_matrix(tmp_path, 4, 1, [[where, "rows", 5]], shape=MATRIX_SHAPE, save=True)
        # Two processes of two devices each: columns, then every value on every device.
        _run_matrix(tmp_path, 2, 2, [[where, "columns", 5], [where, "replicated", 5]], shape=MATRIX_SHAPE, save=False)
        _check_whole(where, MATRIX_SHAPE, 5)

    def test_four_processes_save_one_array_of_16_mib_sharded_by_rows(self, tmp_path: pathlib.Path):
        """Four processes, one device each, save one 16 MiB array sharded by rows,
        and each loads its rows back. (A check of the load, that a leaf's folder
        holds all of its bytes, once ran inside the save when a process opened the
        array process 0 had created, before the others had written their rows:
        with four processes the save failed every time.)"""
        shape = (4096, 1024)
        where = str(tmp_path / "ckpt")
        _run_matrix(tmp_path, 4, 1, [[where, "rows", 0]], shape=shape, save=True)
        _check_whole(where, shape, 0)


def _place_state(mesh: Mesh) -> dict:
    """`arrays.replicated_state()` on `mesh`, as tests/support/multiprocess_matrix_worker.py places it."""

    def place(name: str, value: np.ndarray) -> jax.Array:
        return jax.device_put(value, NamedSharding(mesh, P(None, "local") if name == "columns" else P()))

    return {g: {n: place(n, v) for n, v in leaves.items()} for g, leaves in arrays.replicated_state().items()}


def _files(where: pathlib.Path) -> dict[str, bytes]:
    """Every file of the checkpoint at `where` but its manifest, by name, with its bytes."""
    return {
        str(f.relative_to(where)): f.read_bytes() for f in where.rglob("*") if f.is_file() and f.name != "manifest.json"
    }


def _manifest(where: pathlib.Path) -> dict:
    """The manifest, without what differs from one save of the same tree to another."""
    manifest = json.loads((where / "manifest.json").read_text())
    return {k: v for k, v in manifest.items() if k not in ("created", "commit", "digest")}


def _check_tiled(where: pathlib.Path, taken: list[dict[str, list]]) -> None:
    """The regions the processes wrote (`taken`) cover every leaf once, and
    start and end on its chunk grid (or its end): no chunk had two writers."""
    checkpoint = eqx_ckpt.Checkpoint(where)
    for path in checkpoint:
        record = checkpoint.record(path)
        count = np.zeros(record.stored_shape, np.int32)
        for regions in taken:
            for region in regions.get(path, []):
                count[tuple(slice(a, b) for a, b in region)] += 1
                for (a, b), chunk, n in zip(region, record.chunks, record.stored_shape):
                    assert a % chunk == 0 and (b % chunk == 0 or b == n), (path, region, record.chunks)
        assert (count == 1).all(), (path, taken)


@pytest.mark.parametrize("processes, devices", [(2, 2), (4, 1)], ids=lambda v: str(v))
def test_replicated_state_is_written_by_every_process(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, processes: int, devices: int
) -> None:
    """Data-parallel state, every leaf held by every process (with two devices
    each, one leaf's column shards too): each process writes its slices of
    the large leaves, within 1.25x of an equal share; the small ones are
    dealt round the processes in turn; every chunk is written once. It loads back
    bit for bit (in every process, and whole in one), and its files and
    manifest are those a single process saves (the same names, the same
    bytes)."""
    where = tmp_path / "ckpt"
    logs = tmp_path / "logs"
    logs.mkdir()
    # With two devices, the slices are cut on the device, as on an accelerator.
    job = json.dumps({"devices": devices, "state": str(where), "slice_on_device": devices > 1})
    outputs = _run_workers(logs / "_", count=processes, timeout=150, worker=MATRIX_WORKER, job=job)
    written = [int(re.search(r"worker \d+ wrote (\d+) bytes", out).group(1)) for out in outputs]
    taken = [json.loads(re.search(r"worker \d+ slices (.*)", out).group(1)) for out in outputs]
    _check_tiled(where, taken)
    values = arrays.replicated_state()
    itemsize = {f"{g}.{n}": v.dtype.itemsize for g, leaves in values.items() for n, v in leaves.items()}
    large = [
        sum(
            np.prod([b - a for a, b in r]) * itemsize[p]
            for p, regions in t.items()
            if p.startswith("large.")
            for r in regions
        )
        for t in taken
    ]
    assert max(large) <= 1.25 * sum(large) / processes, large
    assert max(written) <= 1.25 * sum(written) / processes, written
    # Loaded back with each byte read once and shared: within 1.1x of the
    # stored bytes in all, against every process reading every leaf.
    stored = _stored_bytes(where)
    assert sum(_bytes_read(outputs, "state", True)) <= 1.1 * stored, _bytes_read(outputs, "state", True)
    assert all(n >= stored for n in _bytes_read(outputs, "state", False)), _bytes_read(outputs, "state", False)
    small = [{path for path, regions in t.items() if path.startswith("small.") and regions} for t in taken]
    assert all(0 < len(paths) < len(values["small"]) for paths in small), small
    assert max(map(len, small)) - min(map(len, small)) <= 1, small
    loaded = eqx_ckpt.tree_deserialise_leaves(where, jax.tree.map(np.zeros_like, values))
    assert tree_equal(loaded, values, typematch=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(values)))
    # One process, the same arrays on as many devices, small leaves not packed.
    monkeypatch.setattr(_format, "CHUNK_BYTES", arrays.STATE_CHUNK_BYTES)
    monkeypatch.setattr(_records, "PACK_BYTES", -1)
    mesh = Mesh(np.array(jax.devices("cpu")[: processes * devices]).reshape(processes, devices), ("proc", "local"))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "one", _place_state(mesh))
    assert _files(where).keys() == _files(tmp_path / "one").keys()
    assert _files(where) == _files(tmp_path / "one")
    assert _manifest(where) == _manifest(tmp_path / "one")


KILL_WORKER = places.SUPPORT / "multiprocess_kill_worker.py"
# The kill workers' `_multihost.SILENT_SECONDS` (10 s by default): how long the
# others wait for a heartbeat before naming a process as gone. Sixteen times
# their beat (`HEARTBEAT_SECONDS`, 1 s by default, an eighth here), so that a
# busy machine never silences a process that lives (each beat needs the GIL
# and a round trip to the coordination service for a moment: a process is
# named only after 16 beats in a row did not come); and a barrier looks at the heartbeats
# every eighth of a second (`_WAIT_MS`, 1 s by default), so that the others
# name the victim soon after its silence passes. The same code path as the
# defaults, in a fifth of their wait (each test of a killed process waits it
# once).
SILENT_SECONDS = 2
HEARTBEAT_SECONDS = 0.125
WAIT_MS = 125


def _run_victim(tmp_path: pathlib.Path, processes: int, job: dict, *, kill: bool) -> tuple[list[Any], list[str]]:
    """Run `processes` kill workers with `job`; once the victim has stopped
    (its marker file), SIGKILL it (`kill`), or else wait for the others and
    then kill it. Every process must exit within 60 s of that (a hang at a
    barrier would last 100 s, `jax.distributed`'s heartbeat, or an hour).
    The seconds from the victim's stop until the others had all exited are
    left in `_run_victim.waited`."""
    marker, victim = tmp_path / "victim-stopped", job["victim"]
    timings = {"silent_seconds": SILENT_SECONDS, "heartbeat_seconds": HEARTBEAT_SECONDS, "wait_ms": WAIT_MS}
    argument = json.dumps({**job, "marker": str(marker), **timings})
    port, env = places.free_port(), {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    logs = [tmp_path / f"worker{i}.log" for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):
        command = [str(KILL_WORKER), str(i), str(processes), str(port), argument]
        procs.append(prefork.spawn(command, env=env, output=log))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline and procs[victim].poll() is None, logs[victim].read_text()[-4000:]
            time.sleep(0.1)
        stopped = time.monotonic()
        if kill:
            procs[victim].send_signal(signal.SIGKILL)
        for i, proc in enumerate(procs):
            if i != victim or kill:
                proc.wait(timeout=60)
        _run_victim.waited = time.monotonic() - stopped  # type: ignore[attr-defined]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs, [log.read_text() for log in logs]


def _check_survivors(procs: list[Any], outputs: list[str], victim: int, said: str) -> None:
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert f"worker {i} saved\n" in out and f"worker {i} saved again" not in out, out[-4000:]
        if i == victim:
            continue
        assert proc.returncode != 0, out[-4000:]
        if said and (i == 0 or proc.returncode == 3):
            assert proc.returncode == 3 and said in out, out[-4000:]
            assert "Nothing was committed: the checkpoint saved before is unchanged" in out, out[-4000:]
        elif said:
            # Process 0 raised first and exited, and with it the coordination
            # service: `jax.distributed` ended this one before its own wait had
            # noticed (a race, seen in CI). It stopped all the same.
            assert proc.returncode == -signal.SIGABRT and "coordination service" in out, out[-4000:]


def _check_first_save(where: Any) -> None:
    shape = (64, 16)  # as the kill worker saves it: the first save holds value(1)
    expected = {"w": np.arange(np.prod(shape), dtype=np.float32).reshape(shape)}
    loaded = eqx_ckpt.tree_deserialise_leaves(where, {"w": np.zeros(shape, np.float32)})
    assert tree_equal(loaded, expected, typematch=True)
    assert eqx_ckpt.verify(where) == []


@pytest.mark.parametrize(
    "processes, victim, storage, placed",
    [
        (2, 1, "local", "rows"),
        (4, 2, "local", "rows"),
        (2, 0, "local", "rows"),
        (4, 0, "local", "rows"),
        (2, 1, "s3", "rows"),
        (2, 1, "local", "replicated"),
        (4, 2, "local", "replicated"),
        (4, 3, "local", "replicated:save.slices"),
        (2, 1, "local", "replicated:save.staged"),
        (4, 2, "s3", "replicated:save.staged"),
    ],
    ids=lambda v: str(v),
)
def test_a_process_killed_mid_save(
    tmp_path: pathlib.Path, storage_for: Any, processes: int, victim: int, storage: str, placed: str
) -> None:
    """A process killed outright (SIGKILL) in the middle of a save: the others
    stop within seconds, never hanging at a barrier; the checkpoint saved
    before stays whole. (They once waited for `jax.distributed`'s heartbeat,
    100 s, which then aborted them.) A process other than 0 is named by
    eqx_ckpt's error; process 0 runs the coordination service, and without it
    `jax.distributed` ends the others at once. With a replicated array, the
    others write their slices of it while the victim is stopped, and process
    0 removes them. A victim may also stop while it plans its share of a
    replicated array (`save.slices`), or once it staged its first bytes for
    writing (`save.staged`)."""
    where = _where(tmp_path, storage, storage_for(storage), "ckpt")
    placed, _, point = placed.partition(":")  # and where the victim stops, if not where it does by default
    job = {
        "checkpoint": where,
        "victim": victim,
        "replicated": placed == "replicated",
        **({"point": point} if point else {}),
    }
    procs, outputs = _run_victim(tmp_path, processes, job, kill=True)
    assert procs[victim].returncode == -signal.SIGKILL
    said = f"Process {victim} of {processes} stopped answering during the save" if victim else ""
    _check_survivors(procs, outputs, victim, said)
    _check_first_save(where)
    if storage == "local" and victim != 0:
        assert sorted(p.name for p in pathlib.Path(where).iterdir()) == ["manifest.json", "w", "zarr.json"]


def _check_restore_survivors(procs: list[Any], outputs: list[str], victim: int, said: str) -> None:
    """The processes other than the victim failed their load, naming it, and none loaded."""
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert f"worker {i} saved\n" in out and f"worker {i} loaded" not in out, out[-4000:]
        if i == victim:
            continue
        if proc.returncode == -signal.SIGABRT and (victim == 0 or i != 0):
            # Process 0 runs the coordination service: it was killed, or it raised
            # first and exited, and `jax.distributed` ended this one before its
            # own wait had noticed (a race, as in a save's).
            assert "coordination service" in out, out[-4000:]
            continue
        assert proc.returncode == 3 and said in out and "Nothing was loaded." in out, out[-4000:]


@pytest.mark.parametrize(
    "processes, victim, point",
    [(2, 1, "load.read_once"), (4, 2, "load.read_once"), (4, 3, "load.read_stored"), (2, 0, "load.read_once")],
    ids=lambda v: str(v),
)
def test_a_reader_killed_mid_restore(tmp_path: pathlib.Path, processes: int, victim: int, point: str) -> None:
    """A process killed outright while the processes restore replicated state
    with each byte read once (before they planned the shared reads, or once
    it read its slices, before the all-gather): the others fail within
    seconds (its heartbeat stops: `_multihost.SILENT_SECONDS`), naming it,
    never waiting in a collective that it will not join. Process 0 runs the
    coordination service: killing it ends the others through
    `jax.distributed`."""
    where = str(tmp_path / "ckpt")
    job = {"checkpoint": where, "victim": victim, "replicated": True, "restore": point}
    procs, outputs = _run_victim(tmp_path, processes, job, kill=True)
    assert procs[victim].returncode == -signal.SIGKILL
    # Before the plan, the victim had not joined the shared reads yet (`_multihost.Group`).
    joined = "stopped answering during the restore" if point == "load.read_once" else "never joined the restore"
    said = f"Process {victim} of {processes} {joined}" if victim else ""
    _check_restore_survivors(procs, outputs, victim, said)
    # `SILENT_SECONDS` of silence, and the time to notice it on a busy machine: never a barrier's time-out (300 s).
    assert _run_victim.waited < 30, _run_victim.waited  # type: ignore[attr-defined]
    _check_first_save(where)


def test_a_reader_that_never_calls_the_restore_is_named(tmp_path: pathlib.Path) -> None:
    """A process alive but never reaching a restore that shares reads: the
    others give up at the barrier before any collective once its time-out
    passes (shortened to 1 s: nobody else is on the way), naming it."""
    where = str(tmp_path / "ckpt")
    job = {
        "checkpoint": where,
        "victim": 1,
        "replicated": True,
        "restore": "load.read_once",
        "absent": True,
        "read_timeout": 1,
    }
    procs, outputs = _run_victim(tmp_path, 2, job, kill=False)
    said = "Process 1 of 2 did not reach stage 'planned' of the restore within 1 s, although it is still running"
    _check_restore_survivors(procs, outputs, 1, said)


def test_a_process_that_never_calls_the_save_is_named(tmp_path: pathlib.Path) -> None:
    """A process that is alive but never reaches the save (a different code
    path): once the barrier's timeout has passed, the others raise an error
    naming it (they raised `jax.distributed`'s bare DEADLINE_EXCEEDED). The
    workers shorten the timeout (an hour) to 1 s: the only other process is
    already at the barrier."""
    where = str(tmp_path / "ckpt")
    job = {"checkpoint": where, "victim": 1, "absent": True, "timeout_ms": 1000}
    procs, outputs = _run_victim(tmp_path, 2, job, kill=False)
    said = "Process 1 of 2 did not reach stage 'prepared' of the save within 1 s, although it is still running"
    _check_survivors(procs, outputs, 1, said)
    _check_first_save(where)


# Each barrier of a save and of a restore that shares reads, in order (`_serialise.Stages`,
# `_read_once`), after `call`: before the process calls the save or load at all.
_SAVE_STAGES = ["call", "prepared", "begin", "joined", "created", "written", "committed"]
_RESTORE_STAGES = ["call", "planned", "read/0"]


def _said_of_a_process_killed_before(what: str, stages: list[str], stage: str, victim: int, processes: int) -> str:
    """What every survivor says of the victim killed just before `stage` (see `_multihost._lost`)."""
    waited = stages[max(1, stages.index(stage))]
    silent = f"(no heartbeat for {SILENT_SECONDS} s while the others waited for it at stage {waited!r})"
    if stage == "call":
        return (
            f"Process {victim} of {processes} never joined the {what}: it stopped answering before it began it {silent}"
        )
    passed = stages.index(stage) - 1
    where = f"after stage {stages[passed]!r}" if passed else "before its first stage"
    return f"Process {victim} of {processes} stopped answering during the {what}, {where} {silent}: it was killed"


@pytest.mark.parametrize(
    "what, processes, victim, stage",
    [("save", 3 if stage == "created" else 2, 1, stage) for stage in _SAVE_STAGES]
    + [("restore", 4 if stage == "call" else 2, 2 if stage == "call" else 1, stage) for stage in _RESTORE_STAGES],
    ids=lambda v: str(v),
)
def test_a_process_killed_before_each_stage_is_named(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, what: str, processes: int, victim: int, stage: str
) -> None:
    """A process killed outright (SIGKILL) just before it reaches a barrier of a
    save or of a restore that shares reads, or before it calls either at all,
    the save or load being each process's first call of eqx_ckpt (a job that
    starts and restores): every other process raises a `CheckpointError`
    within 30 s naming it, the stage the others waited at, and whether it
    died inside the save or restore or never joined it. (One that died before
    its first call had no heartbeat yet: the others waited for
    `jax.distributed`'s own, 100 s, which then aborted them.) Four processes
    restore replicated state with the third killed before its call, as the
    issue found it."""
    where = tmp_path / "ckpt"
    if what == "restore":  # a checkpoint of value(1) in chunks of 16 rows, unpacked, as the kill worker saves it
        monkeypatch.setattr(_format, "CHUNK_BYTES", 16 * 16 * 4)
        monkeypatch.setattr(_records, "PACK_BYTES", 0)
        eqx_ckpt.tree_serialise_leaves(where, {"w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16)})
    job = {"checkpoint": str(where), "victim": victim, "replicated": True, "fresh": True, "before": stage}
    if what == "restore":
        job["restore"] = "load.read_once"  # a restore (the point is not armed: the victim stops at `before`)
    procs, outputs = _run_victim(tmp_path, processes, job, kill=True)
    assert procs[victim].returncode == -signal.SIGKILL
    stages = _SAVE_STAGES if what == "save" else _RESTORE_STAGES
    said = _said_of_a_process_killed_before(what, stages, stage, victim, processes)
    if what == "save" and stage == "committed":
        outcome = "Process 0 may have committed it: load the checkpoint to see which save it holds."
    else:
        outcome = "Nothing was committed" if what == "save" else "Nothing was loaded."
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert f"worker {i} saved again" not in out and f"worker {i} loaded" not in out, out[-4000:]
        if i != victim:
            assert proc.returncode == 3 and said in out and outcome in out, out[-4000:]
    # `SILENT_SECONDS` of silence, and the time to notice it on a busy machine: never `jax.distributed`'s 100 s.
    assert _run_victim.waited < 30, _run_victim.waited  # type: ignore[attr-defined]
    if what == "restore":
        _check_first_save(where)
    elif stage != "committed":
        assert not (where / "manifest.json").exists()
    else:  # process 0 committed before the victim died: the save it made loads
        like = {"w": np.zeros((64, 16), np.float32)}
        expected = {"w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16) * np.float32(2)}
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(where, like), expected, typematch=True)


def test_shared_reads_are_batched_within_the_read_budget(monkeypatch):
    """A read-once restore shares its leaves in batches that each fit the read
    budget every load keeps (`_window.READ_BUDGET`): every process holds a
    batch's gathered bytes at once. A leaf larger than the budget goes alone."""
    monkeypatch.setattr(_window, "READ_BUDGET", 100)
    sizes = [60, 30, 20, 150, 10, 90]
    leaves = [
        _read_once._Leaf(i, None, None, None, [_read_once._Part(None, None, -1, n, True)]) for i, n in enumerate(sizes)
    ]
    assert [[leaf.slot for leaf in batch] for batch in _read_once._batches(leaves)] == [[0, 1], [2], [3], [4, 5]]
