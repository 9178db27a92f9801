"""The main job end to end: train, save, list, reload; what `eqx-ckpt demo` runs."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._base._errors import CheckpointExistsError, CheckpointValueError
from .._load._checkpoint import Checkpoint, human
from .._load._deserialise import tree_deserialise_leaves
from .._save._serialise import tree_serialise_leaves
from .._store import _storage


def _make_model(key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 1, width_size=64, depth=2, key=key)


class _Batches:
    """The data pipeline: minibatches of `size` of `count` samples' indices,
    reshuffled each epoch, with the `get_state`/`set_state` of a Grain
    iterator, so that a save records its position and a load puts it back."""

    def __init__(self, count: int = 256, size: int = 32, seed: int = 0):
        self.count, self.size, self.seed = count, size, seed
        self.epoch, self.position = 0, 0

    def __next__(self) -> np.ndarray:
        if self.position + self.size > self.count:
            self.epoch, self.position = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        self.position += self.size
        return order[self.position - self.size : self.position]

    def get_state(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"this pipeline shuffles with seed {self.seed}, the saved one with {state['seed']}")
        self.epoch, self.position = state["epoch"], state["position"]


def _train(steps: int, say: Callable[[str], None]) -> dict[str, Any]:
    import optax

    key_data, key_model = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_data, (256, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    model = _make_model(key_model)
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))

    data = _Batches(len(x))

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x[batch]) - y[batch]) ** 2))(model)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    first = None
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, jnp.asarray(next(data)))
        first = float(loss) if first is None else first
    say(
        f"Trained an MLP with optax.adam for {steps} steps on minibatches of synthetic data: "
        f"loss {first:.4f} -> {float(loss):.4f}."
    )
    return {"model": model, "opt_state": opt_state, "step": steps, "data": data}


def _occupied(directory: str) -> bool:
    """Whether something is at `directory` other than an empty folder."""
    entry = _storage.local_entry(directory)
    return entry.exists and (not entry.folder or bool(_storage.local_names(directory)))


def run(directory: str | None = None, *, steps: int = 50, say: Callable[[str], None] = print) -> int:
    """Train, save `{"model", "opt_state", "step", "data"}` (`data`: the
    pipeline's position), list it, reload it into a skeleton (resuming the
    data) and a params-only skeleton, and check each. Returns an exit code."""
    if type(steps) is not int or steps < 1:
        raise CheckpointValueError(f"The demo trains for `steps` steps: give a positive number, not {steps!r}.")
    if directory is not None and _occupied(directory):
        raise CheckpointExistsError(
            f"{directory!r} exists and is not an empty directory; the demo saves a new checkpoint there. "
            f"Give a new or empty directory, or leave `--dir` out to use a temporary one.",
            path=directory,
        )
    directory = directory or tempfile.mkdtemp(prefix="eqx_ckpt_demo_")
    state = _train(steps, say)
    start = time.perf_counter()
    tree_serialise_leaves(directory, state)
    ckpt = Checkpoint(directory)
    say(f"Saved {len(ckpt)} leaves ({human(ckpt.total_bytes)}) to {directory} in {time.perf_counter() - start:.2f} s:")
    say(ckpt.listing())

    like = {**eqx.filter_eval_shape(_train_skeleton, steps), "data": _Batches()}
    loaded = tree_deserialise_leaves(directory, like)
    data = loaded.pop("data")
    full_ok = bool(eqx.tree_equal(loaded, {k: v for k, v in state.items() if k != "data"}, typematch=True))
    say(
        f"Full load into an eqx.filter_eval_shape skeleton: read {human(ckpt.total_bytes)}, "
        f"equal to what was saved: {full_ok}."
    )
    # The data pipeline's position came back with the run: a resumed run
    # takes the batches the saved one would have taken next.
    resumed = data.get_state()
    data_ok = all(np.array_equal(next(data), next(state["data"])) for _ in range(3))
    say(f"Data pipeline resumed from its saved position {resumed}: the next batches are the same: {data_ok}.")

    model_like = eqx.filter_eval_shape(_make_model, jax.random.key(0))
    model = tree_deserialise_leaves(directory, model_like, prefix="model")
    params_bytes = sum(ckpt.record(k).nbytes for k in ckpt if k.startswith("model."))
    params_ok = bool(eqx.tree_equal(model, state["model"], typematch=True))
    say(
        f"Params-only load (prefix='model', no optimiser skeleton): read {human(params_bytes)} "
        f"of {human(ckpt.total_bytes)}, equal to the trained model: {params_ok}."
    )
    x = jnp.ones(8)
    say(f"The reloaded model runs: model(ones(8)) = {float(model(x)[0]):.4f}.")
    # No skeleton at all: the MLP rebuilt from the structure the save recorded
    # (eqx.nn's layers and jax.nn's functions are trusted by default).
    rebuilt = ckpt.load("model", trust=[])
    rebuilt_ok = bool(eqx.tree_equal(rebuilt, state["model"], typematch=True))
    say(
        f"Load without the model's code (Checkpoint(path).load('model', trust=[])): a {type(rebuilt).__name__}, "
        f"equal to the trained model: {rebuilt_ok}."
    )
    say(f"Checkpoint left at {directory}; try `eqx-ckpt ls {directory}` and `eqx-ckpt verify {directory}`.")
    return 0 if full_ok and data_ok and params_ok and rebuilt_ok else 1


def _train_skeleton(steps: int) -> dict[str, Any]:
    import optax

    model = _make_model(jax.random.key(0))
    opt_state = optax.adam(1e-2).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": steps}
