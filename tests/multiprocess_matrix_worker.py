"""One of the JAX processes of the process matrix of `tests/test_multiprocess.py`
(not a test module).

Run as `python multiprocess_matrix_worker.py PROCESS_ID NUM_PROCESSES PORT JOB`,
`JOB` a JSON object:

- `devices`: CPU devices of this process; the mesh is every process's devices, in a row.
- `shape`: the float32 array's shape; its value is `value(shape, scale)`.
- `checkpoints`: `[[where, sharding, scale], ...]`, `where` a path or a kvstore
  spec dict, `sharding` one of `SHARDINGS`.
- `save`: whether to save each checkpoint before loading it back (else only load).

Each process loads every checkpoint with its sharding and checks, bit for bit,
the shards it holds. Prints `worker <id> ok` on success.
"""

import json
import sys

import jax

JOB = json.loads(sys.argv[4])
jax.config.update("jax_num_cpu_devices", JOB["devices"])
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_ckpt  # noqa: E402

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
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    shape = tuple(JOB["shape"])
    for where, name, scale in JOB["checkpoints"]:
        sharding = NamedSharding(mesh, SHARDINGS[name])
        full = value(shape, scale)
        if JOB["save"]:
            w = jax.make_array_from_callback(shape, sharding, lambda index, full=full: full[index])
            eqx_ckpt.tree_serialise_leaves(where, {"w": w})
        like = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}
        loaded = eqx_ckpt.tree_deserialise_leaves(where, like)["w"]
        assert loaded.sharding == sharding, (name, loaded.sharding)
        for shard in loaded.addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == np.float32 and got.tobytes() == full[shard.index].tobytes(), (name, shard.index)
    print(f"worker {process_id} ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
