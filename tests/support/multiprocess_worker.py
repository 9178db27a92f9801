"""One of the JAX processes of `tests/hosts/test_multiprocess.py` (not a test module).

Run as `python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT`.
Every process builds the same global arrays (sharded over all processes'
devices), saves them together, and checks what it loads back on its own devices.
Prints `worker <id> ok` and exits 0 when every check passed.
"""

import contextlib
import os
import re
import sys
import time

START = time.perf_counter()  # the output shows how long the imports took (slow under load)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_platforms", "cpu")

import equinox as eqx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_ckpt  # noqa: E402
from eqx_ckpt._base import _faults  # noqa: E402

ROWS_COLS = (8, 4)


def global_value(scale: float) -> np.ndarray:
    return (np.arange(np.prod(ROWS_COLS), dtype=np.float32) * scale).reshape(ROWS_COLS)


def make_tree(mesh: jax.sharding.Mesh, scale: float) -> dict:
    value = global_value(scale)

    def place(spec: P) -> jax.Array:
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

    return {
        "sharded": place(P(("a", "b"))),  # 4 shards, one per device
        "half": place(P("a")),  # 2 shards, each on 2 devices (one per process)
        "replicated": place(P()),  # 1 shard on all 4 devices
        "small": {"table": np.arange(3, dtype=np.int32) + int(scale), "rate": 0.5 * scale},
        "step": 7 * int(scale),
    }


def check_loaded(loaded: dict, like: dict, scale: float) -> None:
    value = global_value(scale)
    for name in ("sharded", "half", "replicated"):
        array = loaded[name]
        assert array.sharding == like[name].sharding, (name, array.sharding)
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    rest = {"small": loaded["small"], "step": loaded["step"]}
    expected = {
        "small": {"table": np.arange(3, dtype=np.int32) + int(scale), "rate": 0.5 * scale},
        "step": 7 * int(scale),
    }
    assert eqx.tree_equal(rest, expected, typematch=True), rest


def abstract(tree: dict, mesh: jax.sharding.Mesh, specs: dict) -> dict:
    out = dict(tree)
    for name, spec in specs.items():
        out[name] = jax.ShapeDtypeStruct(ROWS_COLS, np.float32, sharding=NamedSharding(mesh, spec))
    return out


def check_partial_save(path: str, mesh: jax.sharding.Mesh, tree: dict) -> None:
    """A partial save by every process, into a checkpoint of `tree` at scale
    2: only `sharded` is replaced (the rest of the tree given is abstract),
    every other stored leaf kept."""
    eqx_ckpt.tree_serialise_leaves(path, make_tree(mesh, 2.0))
    new = abstract(make_tree(mesh, 3.0), mesh, {"half": P("a"), "replicated": P()})
    new["small"] = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), new["small"]
    )
    eqx_ckpt.tree_serialise_leaves(path, new, where=lambda t: t["sharded"])
    loaded = eqx_ckpt.tree_deserialise_leaves(path, tree)
    for name, scale in (("sharded", 3.0), ("half", 2.0), ("replicated", 2.0)):
        for shard in loaded[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), global_value(scale)[shard.index])
    expected = {"table": np.arange(3, dtype=np.int32) + 2, "rate": 1.0}
    assert eqx.tree_equal(loaded["small"], expected, typematch=True), loaded["small"]


def check_failure_elsewhere(process_id: int, path: str, tree: dict, name: str, point: str, failing: int = 1) -> None:
    """A failure in process `failing` (the fault point `point` raises there,
    named `name` in the error) fails the save in the other processes too, and
    process 0 removes what the save had written."""

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(f"broken {name}")

    if process_id != failing:
        broken: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        broken = _faults.armed(point, fail)
    try:
        with broken:
            eqx_ckpt.tree_serialise_leaves(path, tree)
    except (eqx_ckpt.CheckpointError, OSError) as e:
        expected = f"process {failing}: OSError: broken {name}" if process_id != failing else f"broken {name}"
        assert expected in str(e), str(e)
    else:
        raise AssertionError(f"a save whose {name} failed in process {failing} did not fail")
    if process_id == 0 and os.path.exists(path):  # which cleaned up before raising
        assert os.listdir(path) == [], os.listdir(path)


def check_different_trees(process_id: int, path: str, mesh: jax.sharding.Mesh) -> None:
    """Process 1 saves a tree with another leaf: every process refuses the save
    before anything is written (the slices of replicated leaves are dealt out
    from each process's own tree, so some would go unwritten)."""
    tree = make_tree(mesh, 1.0)
    if process_id == 1:
        tree = {**tree, "extra": np.zeros(3, np.float32)}
    try:
        eqx_ckpt.tree_serialise_leaves(path, tree)
    except eqx_ckpt.CheckpointError as e:
        assert "The processes did not save the same tree: process(es) [1] planned a save different" in str(e), str(e)
    else:
        raise AssertionError("a save of different trees in two processes did not fail")
    if process_id == 0 and os.path.exists(path):
        assert os.listdir(path) == [], os.listdir(path)


def file_writes() -> int:
    """How many files TensorStore has written in this process so far."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/write")
    return sum(value.get("value", 0) for metric in metrics for value in metric["values"])


def main(process_id: int, num_processes: int, port: int, path: str) -> None:
    print(f"worker {process_id} imported after {time.perf_counter() - START:.1f} s", flush=True)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=45,
    )
    assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices())
    tree = make_tree(mesh, 1.0)
    eqx_ckpt.tree_serialise_leaves(path, tree)
    # The same sharding as saved, then a different one (each process reads its regions).
    check_loaded(eqx_ckpt.tree_deserialise_leaves(path, tree), tree, 1.0)
    other = abstract(tree, mesh, {"sharded": P(None, ("b", "a")), "half": P("b", "a"), "replicated": P("b")})
    check_loaded(eqx_ckpt.tree_deserialise_leaves(path, other), other, 1.0)
    # Overwrite: process 0 picks the other data root, and the others follow it.
    before = file_writes()
    eqx_ckpt.tree_serialise_leaves(path, make_tree(mesh, 2.0), blocking=False).wait()
    print(f"worker {process_id} wrote {file_writes() - before} files", flush=True)
    check_loaded(eqx_ckpt.tree_deserialise_leaves(path, tree), tree, 2.0)
    # A failure in process 0 fails the save in every process, and none hangs.
    try:
        eqx_ckpt.tree_serialise_leaves(path, tree, overwrite=False)
    except eqx_ckpt.CheckpointError as e:
        expected = "overwrite=False" if process_id == 0 else "process 0: CheckpointExistsError"
        assert re.search(re.escape(expected), str(e)), str(e)
    else:
        raise AssertionError("a save with `overwrite=False` over a checkpoint did not fail")
    check_loaded(eqx_ckpt.tree_deserialise_leaves(path, tree), tree, 2.0)
    # Process 1 fails before the first barrier (its tree cannot be saved: once the
    # others waited an hour for it there), to join the transaction, or to open
    # the arrays to write; process 0 fails to create them (once the others
    # waited an hour for it at the stage `created`).
    check_failure_elsewhere(process_id, path + "_collect", tree, "build", "save.records")
    check_failure_elsewhere(process_id, path + "_join", tree, "join", "transaction.join")
    check_failure_elsewhere(process_id, path + "_write", tree, "open_array", "storage.open_array")
    check_failure_elsewhere(process_id, path + "_create", tree, "create_array", "storage.create_array", failing=0)
    check_different_trees(process_id, path + "_different", mesh)
    try:
        eqx_ckpt.tree_serialise_leaves(path + "_ocdbt", tree, layout="ocdbt")
    except eqx_ckpt.CheckpointValueError as e:
        assert "layout='ocdbt'" in str(e), str(e)
    else:
        raise AssertionError("an OCDBT save from several processes did not fail")
    check_partial_save(path + "_partial", mesh, tree)
    print(f"worker {process_id} ok after {time.perf_counter() - START:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
