"""One of the JAX processes of `tests/hosts/test_multiprocess.py::test_a_process_killed_mid_save`
(not a test module).

Run as `python multiprocess_kill_worker.py PROCESS_ID NUM_PROCESSES PORT JOB`,
`JOB` a JSON object: `checkpoint` (a path or kvstore spec), `victim` (the
process the test kills), `marker` (a file the victim creates once its second
save is under way); with `absent`, the victim never calls the second save (it
creates the marker and sleeps); `timeout_ms` replaces the barriers' timeout;
with `replicated`, the array is held whole by every process, in chunks of 16
rows that the processes split between them, and a victim other than process 0
stops once the others are writing their slices (as it starts its own writes).

Every process (one CPU device each) saves `value(1)` sharded by rows, then
starts saving `value(2)`. The victim stops in the middle of that save (process
0 while it creates the arrays, any other once process 0 has created them, as
it opens them to write its rows), creates the marker and sleeps until the test
kills it. The others print `worker <id> failed: <message>` when the save
raises, and exit with status 3 (without `jax.distributed`'s exit hook, which
would wait for the dead process).

With `point`, the victim stops at that fault point of the second save instead
(`save.slices`: while it plans its share, before the first barrier;
`save.staged`: once it staged its first bytes, as it writes).

With `restore` (a fault point's name), the second step is a load instead:
every process loads the first save with `read_once=True` (each byte read by
one process and shared), and the victim stops at that point of the load
(`load.read_stored`: before the processes plan the shared reads;
`load.read_once`: once it read its slices, before the barrier that precedes
the all-gather); with `absent`, it never calls the load. `read_timeout`
replaces `_read_once.TIMEOUT`. The others print `worker <id> failed:
<message>` when the load raises, and exit with status 3; a load that returns
prints `worker <id> loaded`.

`silent_seconds` replaces `_multihost.SILENT_SECONDS` (how long the others
wait for the victim's heartbeat before naming it as gone), `heartbeat_seconds`
`_multihost.HEARTBEAT_SECONDS` (how often each process beats) and `wait_ms`
`_multihost._WAIT_MS` (how long a barrier waits between two looks at the
heartbeats and its time-out).

With `fresh`, there is no first save: the second step (the save of `value(2)`,
or the load of a checkpoint the test wrote) is each process's first call of
eqx_ckpt, as when a job starts and restores (once each process's heartbeat
has started, within a second of JAX's backend: see `_multihost._Heartbeat`).
With `before` (a stage of `_multihost.Group.sync`, or `call`), the victim
stops just before it reaches that barrier (fault point `multihost.barrier`),
or with `call`, before it calls the save or load at all. Every process that
failed reports it in the coordination service, and process 0, which runs the
service, exits only once the others have (or 30 s passed), so that its exit
does not end them before they print.
"""

import contextlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_ckpt  # noqa: E402
from eqx_ckpt._base import _faults  # noqa: E402
from eqx_ckpt._hosts import _multihost, _sharding  # noqa: E402
from eqx_ckpt._load import _read_once  # noqa: E402
from eqx_ckpt._ondisk import _format  # noqa: E402

SHAPE = (64, 16)


def value(scale: int) -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * np.float32(scale)


def main(process_id: int, num_processes: int, port: int, job: dict) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=90,
    )
    if "silent_seconds" in job:
        _multihost.SILENT_SECONDS = job["silent_seconds"]
    if "heartbeat_seconds" in job:  # (the next beat on: the heartbeat thread reads it before each wait)
        _multihost.HEARTBEAT_SECONDS = job["heartbeat_seconds"]
    if "wait_ms" in job:
        _multihost._WAIT_MS = job["wait_ms"]
    mesh = jax.make_mesh((num_processes,), ("rows",), devices=jax.devices())
    sharding = NamedSharding(mesh, P() if job.get("replicated") else P("rows"))
    if job.get("replicated"):
        _format.CHUNK_BYTES, _sharding.SPLIT_BYTES = 16 * SHAPE[1] * 4, 0

    def tree(scale: int) -> dict:
        full = value(scale)
        return {"w": jax.make_array_from_callback(SHAPE, sharding, lambda index: full[index])}

    if not job.get("fresh"):
        eqx_ckpt.tree_serialise_leaves(job["checkpoint"], tree(1))
    else:  # as a job that ran a while: eqx_ckpt's heartbeat has started (within a second of JAX's backend)
        with contextlib.suppress(Exception):  # (a version without that heartbeat goes on after 10 s)
            distributed.global_state.client.blocking_key_value_get(_multihost._Heartbeat.key(process_id), 10_000)
    print(f"worker {process_id} saved", flush=True)

    def stop(*args: object) -> None:
        pathlib.Path(job["marker"]).touch()
        time.sleep(600)  # until the test kills this process

    if job.get("before") == "call":
        job["absent"] = True

    if "restore" in job:
        restore(process_id, job, sharding, stop)
    point = "storage.create_array" if job["victim"] == 0 else "storage.open_array"
    if job["victim"] != 0 and job.get("replicated"):
        point = "storage.transaction"
    point = job.get("point", point)
    victim = process_id == job["victim"]
    if victim and job.get("absent"):
        stop()  # never calls the save, but stays alive
    if "timeout_ms" in job:
        _multihost.TIMEOUT_MS = job["timeout_ms"]
    try:
        with stopped_at(point, stop, job) if victim else contextlib.nullcontext():
            eqx_ckpt.tree_serialise_leaves(job["checkpoint"], tree(2))
    except eqx_ckpt.CheckpointError as e:
        failed(process_id, e, job)
    print(f"worker {process_id} saved again", flush=True)
    os._exit(0)


def restore(process_id: int, job: dict, sharding: NamedSharding, stop: Callable[..., None]) -> None:
    """Load the first save with shared reads, the victim stopping at `job["restore"]`; exit."""
    victim = process_id == job["victim"]
    if "read_timeout" in job:
        _read_once.TIMEOUT = job["read_timeout"]
    if victim and job.get("absent"):
        stop()  # never calls the load, but stays alive
    like = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}
    try:
        with stopped_at(job["restore"], stop, job) if victim else contextlib.nullcontext():
            loaded = eqx_ckpt.tree_deserialise_leaves(job["checkpoint"], like, read_once=True)
    except eqx_ckpt.CheckpointError as e:
        failed(process_id, e, job)
    assert np.asarray(loaded["w"].addressable_shards[0].data).tobytes() == value(1).tobytes()
    print(f"worker {process_id} loaded", flush=True)
    os._exit(0)


def stopped_at(point: str, stop: Callable[..., None], job: dict) -> contextlib.AbstractContextManager:
    """The victim's fault point armed with `stop`: `point`, or with `before`, the barrier `job["before"]`."""
    if "before" not in job:
        return _faults.armed(point, stop)

    def stopping(what: str, stage: str) -> None:
        if stage == job["before"]:
            stop()

    return _faults.armed("multihost.barrier", stopping)


def failed(process_id: int, error: Exception, job: dict) -> None:
    """Print `error`, report it, and exit with status 3 (process 0 once every other survivor has reported)."""
    print(f"worker {process_id} failed: {error}", flush=True)
    client = distributed.global_state.client
    client.key_value_set(f"test/failed/{process_id}", "")
    if process_id == 0:
        survivors = {str(i) for i in range(jax.process_count()) if i != job["victim"]}
        deadline = time.monotonic() + 30  # then the test fails on the missing output
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # (a wait the client ends early is waited again)
                if survivors <= {key.rsplit("/", 1)[-1] for key, _ in client.key_value_dir_get("test/failed/")}:
                    break
            time.sleep(0.1)
    os._exit(3)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
