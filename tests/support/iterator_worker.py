"""A training run fed by a Grain `DataLoader`, for tests/manage/test_iterators.py (not a test module).

Run as `python iterator_worker.py [OPTIONS] DIRECTORY STEPS OUT [TERM_AT]`. It
resumes from the latest step in DIRECTORY (the data loader's position
included), trains until STEPS, and writes the batches it took to
OUT/batches.json. With TERM_AT, it sends itself SIGTERM after taking the batch
of step TERM_AT, saves the step the manager stops at and stops, as a preempted
job does, printing `preempted at STEP`; else it writes its final model to
OUT/model and prints `finished`.

Options: `--process=I,N,PORT` makes it process I of a `jax.distributed` job of
N processes (coordinator on PORT of this machine). Each process then reads its
own shard of the records (Grain's `ShardOptions`), and its model is its own row
of a global array sharded over the processes, trained on its batches alone, so
that no collective is needed; its batches go to OUT/batches.I.json, and only
process 0 sends itself SIGTERM (the manager stops every process at the same
step). `--workers=K` reads with K Grain worker processes. `--kill-at=STEP`
makes it SIGKILL itself once it took the batch of step STEP. `--local=DIR`
saves every step to a local tier of its own (`{i}` in DIR is the process's
index: each process its own folder, as each host its own disk), and
`--every=K` copies every K-th step to DIRECTORY, and `--peers=P` sends each
process's part to P other processes (tests/manage/test_tier_processes.py);
the state then also has a `table` of 64 rows of 1024 floats a process.
`--die-in-exchange=STEP`: as the parts of step STEP move to their peers, a
process that is past the first window creates OUT/exchange.marker and waits
(for the test to kill the whole job mid-transfer).
`--peer-dies=STEP`: process 2 SIGKILLs itself past the first window of the
parts of step STEP moving to their peers; the others print `failed: <message>`
and exit with status 3.
`--absent=I`: process I never lists the steps (it sleeps until killed); the
others give up agreeing on them after 3 s, print `failed: <message>` and exit
with status 3.
`--die-in-commit=STEP`: process 1 SIGKILLs itself as it commits its part of
step STEP (the others have written theirs, and commit them); the others then
print `failed: <message>` and exit with status 3.
"""

import contextlib
import gc
import json
import os
import pathlib
import signal
import sys
import time

import equinox as eqx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_ckpt

OPTIMISER = optax.adam(1e-2)


class Scale(grain.transforms.Map):
    def map(self, element):
        return element * np.float32(0.5) + np.float32(1.0)


def loader(shard: tuple[int, int] = (0, 1), workers: int = 0) -> grain.DataLoader:
    """Ten records a process, shuffled, mapped and batched by four, over three epochs."""
    index, count = shard
    source = [np.arange(4, dtype=np.float32) + 10 * i for i in range(10 * count)]
    options = grain.sharding.ShardOptions(shard_index=index, shard_count=count, drop_remainder=True)
    sampler = grain.samplers.IndexSampler(len(source), shard_options=options, shuffle=True, seed=3, num_epochs=3)
    operations = [Scale(), grain.transforms.Batch(4)]
    return grain.DataLoader(data_source=source, sampler=sampler, operations=operations, worker_count=workers)


def fresh(workers: int = 0) -> dict:
    model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
    data = iter(loader(workers=workers))
    return {"model": model, "opt": OPTIMISER.init(eqx.filter(model, eqx.is_array)), "data": data}


@eqx.filter_jit
def _update(model, opt, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt = OPTIMISER.update(grads, opt, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt


def _step(state: dict, x: np.ndarray) -> dict:
    model, opt = _update(state["model"], state["opt"], jnp.asarray(x))
    return {"model": model, "opt": opt, "data": state["data"]}


# -- One process of several: each its own shard and its own row of the model --


def _sharding() -> NamedSharding:
    return NamedSharding(jax.make_mesh((jax.process_count(),), ("p",), devices=jax.devices()), P("p"))


def _rows(local: jax.Array) -> jax.Array:
    """The global array whose row `jax.process_index()` is `local` (one row, on this process's device)."""
    shape = (jax.process_count(), local.shape[-1])
    return jax.make_array_from_single_device_arrays(shape, _sharding(), [local])


def fresh_sharded(workers: int = 0, table: bool = False) -> dict:
    local = jax.device_put(jnp.zeros((1, 4), jnp.float32), jax.local_devices()[0])
    shard = (jax.process_index(), jax.process_count())
    state = {"w": _rows(local), "data": iter(loader(shard, workers))}
    if table:  # a leaf of 256 KiB a process: larger than a part's files besides its chunks
        state["table"] = _table(jnp.full((64, 1024), jax.process_index(), jnp.float32))
    return state


def _table(local: jax.Array) -> jax.Array:
    """The global array whose rows `64 * i` to `64 * (i + 1)` are process `i`'s `local`."""
    local = jax.device_put(local, jax.local_devices()[0])
    return jax.make_array_from_single_device_arrays((64 * jax.process_count(), 1024), _sharding(), [local])


@jax.jit
def _update_row(row, x):
    return row * 0.5 + jnp.mean(x, axis=0, keepdims=True) * 0.25


def _step_sharded(state: dict, x: np.ndarray) -> dict:
    (shard,) = state["w"].addressable_shards
    stepped = {"w": _rows(_update_row(shard.data, jnp.asarray(x))), "data": state["data"]}
    if "table" in state:
        (rows,) = state["table"].addressable_shards
        stepped["table"] = _table(_bump(rows.data))
    return stepped


@jax.jit
def _bump(rows):
    return rows + 1.0


def _die_in_commit(step: int):
    """Arms process 1 to be SIGKILLed as it writes the manifest of its local part of `step`."""
    from eqx_ckpt._base import _faults
    from eqx_ckpt._hosts import _multihost

    _multihost.SILENT_SECONDS = 2.0  # the others name it sooner

    def die(loc, name):
        if jax.process_index() == 1 and loc.display.rstrip("/").endswith(f"{step:08d}"):
            os.kill(os.getpid(), signal.SIGKILL)

    return _faults.armed("commit.manifest_write", die)


_saving = [-1]  # the step whose save runs


def _die_in_exchange(step: int, out: str):
    """Arms every process to stop past the first window of the parts of `step` moving to their peers."""
    from eqx_ckpt._base import _faults
    from eqx_ckpt._hosts import _exchange

    _exchange.WINDOW = 64 << 10  # (a part of several windows)

    def stop(start, length):
        if _saving[0] == step and start > 0:
            pathlib.Path(out, "exchange.marker").touch()
            time.sleep(600)  # until the test kills the job

    return _faults.armed("exchange.window", stop)


def _absent(index: int):
    """Process `index` sleeps (until killed); the others wait 3 s for it to agree on the steps."""
    from eqx_ckpt._manage import _tiers

    _tiers.AGREE_SECONDS = 3.0
    if jax.process_index() == index:
        time.sleep(600)
    return contextlib.nullcontext()


def _peer_dies(step: int):
    """Arms process 2 to be SIGKILLed past the first window of the parts of `step` moving to their peers."""
    from eqx_ckpt._base import _faults
    from eqx_ckpt._hosts import _exchange, _multihost

    _exchange.WINDOW = 64 << 10  # (a part of several windows)
    _multihost.SILENT_SECONDS = 2.0  # the others name it sooner

    def die(start, length):
        if _saving[0] == step and start > 0 and jax.process_index() == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    return _faults.armed("exchange.window", die)


def main(directory: str, steps: int, out: str, term_at: int | None, options: dict[str, str]) -> None:
    if "die-in-exchange" in options:
        with _die_in_exchange(int(options["die-in-exchange"]), out):
            _train(directory, steps, out, term_at, options)
        return
    failing = {"die-in-commit": _die_in_commit, "absent": _absent, "peer-dies": _peer_dies}
    armed = [arm(int(options[name])) for name, arm in failing.items() if name in options]
    if not armed:
        _train(directory, steps, out, term_at, options)
        return
    with armed[0]:
        try:
            _train(directory, steps, out, term_at, options)
        except eqx_ckpt.CheckpointError as e:
            print(f"failed: {e}", flush=True)
            if jax.process_index() == 0:
                time.sleep(2)  # the coordinator's process last: the others would abort once it is gone
            os._exit(3)  # not `jax.distributed`'s exit hook, which waits for the killed process


def _train(directory: str, steps: int, out: str, term_at: int | None, options: dict[str, str]) -> None:
    workers = int(options.get("workers", 0))
    sharded = "process" in options
    taken, stop = [], "finished"
    tiers = {}
    if "local" in options:
        tiers = {"local": options["local"].replace("{i}", str(jax.process_index()))}
        tiers["persistent_every"] = int(options.get("every", 1))
        tiers["peers"] = int(options.get("peers", 0))
        tiers["local_max_to_keep"] = int(options.get("keep", 2))
    with eqx_ckpt.CheckpointManager(directory, **tiers) as manager:
        state = fresh_sharded(workers, table="local" in options) if sharded else fresh(workers)
        latest = manager.latest_step()
        if latest is not None:
            state = manager.restore(state, step=latest)
        for step in range(0 if latest is None else latest + 1, steps):
            x = next(state["data"])
            if step == int(options.get("kill-at", -1)):
                if "peers" in options:
                    manager.wait_until_finished()  # (killed once the last step's parts reached their peers)
                os.kill(os.getpid(), signal.SIGKILL)  # no save, no exit work: the last committed step is all
            taken.append(x.tolist())
            state = _step_sharded(state, x) if sharded else _step(state, x)
            if step == term_at and jax.process_index() == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            if sharded:
                time.sleep(0.05)  # a step of a real job takes longer than the processes take to agree
            preempted = manager.reached_preemption(step)
            if preempted or step % 3 == 2:
                if "die-in-exchange" in options or "peer-dies" in options:
                    manager.wait_until_finished()  # (the move that stops is this step's, not the last one's)
                _saving[0] = step
                manager.save(step, state)
            if preempted:
                stop = f"preempted at {step}"
                break
        if "keep" in options:
            manager.wait_until_finished()
            print(f"steps {manager.all_steps()}", flush=True)
    name = f"batches.{jax.process_index()}.json" if sharded else "batches.json"
    pathlib.Path(out, name).write_text(json.dumps(taken))
    if stop == "finished":
        model = state["w"] if sharded else state["model"]
        if "table" in state:
            model = {"w": state["w"], "table": state["table"]}
        eqx_ckpt.tree_serialise_leaves(pathlib.Path(out, "model"), model)
    # Grain's worker processes are stopped before the interpreter's teardown
    # (their finalisers, run during it, find their modules emptied).
    del state
    gc.collect()
    print(stop, flush=True)


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    flags = dict(a.removeprefix("--").split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "process" in flags:
        index, count, port = map(int, flags["process"].split(","))
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index, initialization_timeout=60
        )
    if int(flags.get("workers", 0)):
        from absl import flags as absl_flags  # Grain's workers read its flags, which no `app.run` parsed

        absl_flags.FLAGS.mark_as_parsed()
    main(args[0], int(args[1]), args[2], int(args[3]) if len(args) > 3 else None, flags)
