"""One of the JAX processes of `tests/test_multiprocess.py::test_processes_save_one_array_sharded_by_rows`
(not a test module).

Run as `python multiprocess_rows_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT`. Every
process has one CPU device; together they hold one 16 MiB array sharded by rows,
save it, and check the rows they load back. Prints `worker <id> ok` on success.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_ckpt  # noqa: E402

SHAPE = (4096, 1024)  # 16 MiB of float32


def value() -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)


def main(process_id: int, num_processes: int, port: int, path: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=90,
    )
    mesh = jax.make_mesh((num_processes,), ("rows",), devices=jax.devices())
    sharding = NamedSharding(mesh, P("rows"))
    full = value()
    w = jax.make_array_from_callback(SHAPE, sharding, lambda index: full[index])
    eqx_ckpt.tree_serialise_leaves(path, {"w": w})
    like = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}
    loaded = eqx_ckpt.tree_deserialise_leaves(path, like)["w"]
    for shard in loaded.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    print(f"worker {process_id} ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
