"""One of the JAX processes of the process matrix of `tests/hosts/test_multiprocess.py`
(not a test module).

Run as `python multiprocess_matrix_worker.py PROCESS_ID NUM_PROCESSES PORT JOB`,
`JOB` a JSON object:

- `devices`: CPU devices of this process; the mesh is every process's devices, in a row.
- `shape`: the float32 array's shape; its value is `value(shape, scale)`.
- `checkpoints`: `[[where, sharding, scale], ...]`, `where` a path or a kvstore
  spec dict, `sharding` one of `SHARDINGS`.
- `save`: whether to save each checkpoint before loading it back (else only load).
- `read_once`: the `read_once` of each load; every checkpoint is loaded once
  with each value given (default `[None]`). With `gloo` false, the processes
  run without JAX's CPU collectives (gloo, by default). After each load a process
  prints `worker <id> read <n> bytes for <name> read_once=<value>`: what it
  read from storage (TensorStore's count, for files or S3). Without gloo, a
  load that raises prints `worker <id> refused read_once=<value>: <message>`.
- `chunk_bytes`: when not null, `_format.CHUNK_BYTES` for the saves, and
  `_sharding.SPLIT_BYTES` 0 (a replicated array of several chunks is cut
  between the processes, whatever its size).
- `state` (instead of the above): a path, where every process saves
  `arrays.replicated_state()` (each leaf held by every process, on a mesh
  `("proc", "local")` of every process's devices) and loads it back. It prints
  `worker <id> wrote <n> bytes` (TensorStore's count for the save) and `worker
  <id> slices <json>`, the regions it wrote of each leaf it took a share of
  (fault point `save.slices`), `{dotted path: [[[start, stop], ...], ...]}`.
  With `slice_on_device`, each process cuts its slices out of the shards on
  the device (`_sharding.SLICE_ON_DEVICE`), as on an accelerator.

Each process loads every checkpoint with its sharding and checks, bit for bit,
the shards it holds. Prints `worker <id> ok` on success.
"""

import json
import sys

import arrays
import jax

JOB = json.loads(sys.argv[4])
jax.config.update("jax_num_cpu_devices", JOB["devices"])
jax.config.update("jax_platforms", "cpu")
if not JOB.get("gloo", True):  # JAX's default is gloo
    jax.config.update("jax_cpu_collectives_implementation", None)

import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_ckpt  # noqa: E402
from eqx_ckpt._base import _faults  # noqa: E402
from eqx_ckpt._hosts import _sharding  # noqa: E402
from eqx_ckpt._ondisk import _format  # noqa: E402

SHARDINGS = {"rows": P("x", None), "columns": P(None, "x"), "replicated": P()}


def value(shape: tuple[int, ...], scale: int) -> np.ndarray:
    """Distinct float32 values, `scale` telling one checkpoint's from another's."""
    return (np.arange(np.prod(shape), dtype=np.float32) + np.float32(scale * 0.25)).reshape(shape)


def main(process_id: int, num_processes: int, port: int) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=90,
    )
    assert jax.process_count() == num_processes and jax.local_device_count() == JOB["devices"]
    if "state" in JOB:
        save_state(process_id, JOB["state"])
        print(f"worker {process_id} ok", flush=True)
        return
    if JOB.get("chunk_bytes"):
        _format.CHUNK_BYTES, _sharding.SPLIT_BYTES = JOB["chunk_bytes"], 0
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    shape = tuple(JOB["shape"])
    for where, name, scale in JOB["checkpoints"]:
        sharding = NamedSharding(mesh, SHARDINGS[name])
        full = value(shape, scale)
        if JOB["save"]:
            w = jax.make_array_from_callback(shape, sharding, lambda index, full=full: full[index])
            eqx_ckpt.tree_serialise_leaves(where, {"w": w}, compression=JOB.get("compression"))
        like = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}
        for read_once in JOB.get("read_once", [None]):
            before = bytes_read()
            try:
                loaded = eqx_ckpt.tree_deserialise_leaves(where, like, read_once=read_once)["w"]
            except eqx_ckpt.CheckpointError as e:
                if JOB.get("gloo", True):
                    raise
                print(f"worker {process_id} refused read_once={read_once}: {e}", flush=True)
                continue
            print(
                f"worker {process_id} read {bytes_read() - before} bytes for {name} read_once={read_once}", flush=True
            )
            assert loaded.sharding == sharding, (name, loaded.sharding)
            for shard in loaded.addressable_shards:
                got = np.asarray(shard.data)
                assert got.dtype == np.float32 and got.tobytes() == full[shard.index].tobytes(), (name, shard.index)
    print(f"worker {process_id} ok", flush=True)


def state_tree(mesh: Mesh) -> tuple[dict, dict]:
    """`arrays.replicated_state()` placed on `mesh`, and its values."""
    values = arrays.replicated_state()

    def place(name: str, value: np.ndarray) -> jax.Array:
        sharding = NamedSharding(mesh, P(None, "local") if name == "columns" else P())
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return {group: {name: place(name, v) for name, v in leaves.items()} for group, leaves in values.items()}, values


def save_state(process_id: int, path: str) -> None:
    """Save the replicated state, report what this process wrote, and check
    every leaf's local shards bit for bit after a load."""
    _format.CHUNK_BYTES, _sharding.SPLIT_BYTES = arrays.STATE_CHUNK_BYTES, arrays.STATE_SPLIT_BYTES
    _sharding.SLICE_ON_DEVICE = JOB.get("slice_on_device")
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("proc", "local"))
    tree, values = state_tree(mesh)
    taken = {}

    def took(path: str, regions: list) -> None:
        taken[path] = [[s.indices(n)[:2] for s, n in zip(index, shape_of[path])] for index in regions]

    shape_of = {f"{g}.{n}": v.shape for g, leaves in values.items() for n, v in leaves.items()}
    before = bytes_written()
    with _faults.armed("save.slices", took):
        eqx_ckpt.tree_serialise_leaves(path, tree)
    print(f"worker {process_id} wrote {bytes_written() - before} bytes", flush=True)
    print(f"worker {process_id} slices {json.dumps(taken)}", flush=True)
    for read_once in (False, True):
        before = bytes_read()
        loaded = eqx_ckpt.tree_deserialise_leaves(path, tree, read_once=read_once)
        print(f"worker {process_id} read {bytes_read() - before} bytes for state read_once={read_once}", flush=True)
        for group, leaves in values.items():
            for name, value in leaves.items():
                array = loaded[group][name]
                assert array.sharding == tree[group][name].sharding, (group, name)
                for shard in array.addressable_shards:
                    got = np.asarray(shard.data)
                    assert got.dtype == value.dtype and got.tobytes() == value[shard.index].tobytes(), (group, name)


def bytes_read() -> int:
    """How many bytes TensorStore has read from files or S3 in this process so far."""
    metrics = [
        metric
        for name in ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/kvstore/s3/bytes_read")
        for metric in ts.experimental_collect_matching_metrics(name)
    ]
    return sum(value.get("value", 0) for metric in metrics for value in metric["values"])


def bytes_written() -> int:
    """How many bytes TensorStore has written to files in this process so far."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_written")
    return sum(value.get("value", 0) for metric in metrics for value in metric["values"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
