"""A training run fed by a Grain `DataLoader`, for tests/manage/test_iterators.py (not a test module).

Run as `python iterator_worker.py DIRECTORY STEPS OUT [TERM_AT]`. It resumes
from the latest step in DIRECTORY (the data loader's position included), trains
until STEPS, and writes the batches it took to OUT/batches.json. With TERM_AT,
it sends itself SIGTERM after taking the batch of step TERM_AT, saves that step
and stops, as a preempted job does; else it writes its final model to OUT/model.
"""

import json
import os
import pathlib
import signal
import sys

import equinox as eqx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_ckpt

OPTIMISER = optax.adam(1e-2)


class Scale(grain.transforms.Map):
    def map(self, element):
        return element * np.float32(0.5) + np.float32(1.0)


def loader() -> grain.DataLoader:
    """Ten records, shuffled, mapped and batched by four, over three epochs."""
    source = [np.arange(4, dtype=np.float32) + 10 * i for i in range(10)]
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=3, num_epochs=3)
    return grain.DataLoader(data_source=source, sampler=sampler, operations=[Scale(), grain.transforms.Batch(4)])


def fresh() -> dict:
    model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
    return {"model": model, "opt": OPTIMISER.init(eqx.filter(model, eqx.is_array)), "data": iter(loader())}


@eqx.filter_jit
def _update(model, opt, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt = OPTIMISER.update(grads, opt, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt


def main(directory: str, steps: int, out: str, term_at: int | None) -> None:
    taken = []
    with eqx_ckpt.CheckpointManager(directory) as manager:
        state, latest = fresh(), manager.latest_step()
        if latest is not None:
            state = manager.restore(state, step=latest)
        for step in range(0 if latest is None else latest + 1, steps):
            x = next(state["data"])
            taken.append(x.tolist())
            model, opt = _update(state["model"], state["opt"], jnp.asarray(x))
            state = {"model": model, "opt": opt, "data": state["data"]}
            if step == term_at:
                os.kill(os.getpid(), signal.SIGTERM)
            preempted = manager.reached_preemption(step)
            if preempted or step % 3 == 2:
                manager.save(step, state)
            if preempted:
                break
    pathlib.Path(out, "batches.json").write_text(json.dumps(taken))
    if term_at is None:
        eqx_ckpt.tree_serialise_leaves(pathlib.Path(out, "model"), state["model"])
    print("preempted" if term_at is not None else "finished", flush=True)


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    args = sys.argv[1:]
    main(args[0], int(args[1]), args[2], int(args[3]) if len(args) > 3 else None)
