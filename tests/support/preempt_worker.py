"""A preemptible training run, for tests/manage/test_preemption.py (not a test module).

Run as `python preempt_worker.py [OPTIONS] DIRECTORY STEPS [PROCESS_ID NUM_PROCESSES PORT]`
(with the last three, one of the processes of a `jax.distributed` job on this
machine). It prints `ready` once imported and waits for a line on stdin (or,
with `--go=PATH`, for the file PATH to exist), so a parent can start the next
run while this one trains. Then it trains a small
Equinox MLP with optax's Adam, a PRNG key and a data position (batch `i` is a
function of `i` alone) for STEPS steps, resuming from the latest step in
DIRECTORY, as a preemptible job does:

    step, state = manager.restore_or_initialise(make_state)
    for step in range(start, STEPS):
        state = train_step(state)
        preempted = manager.reached_preemption(step)
        if preempted or <a periodic save>: manager.save(step, state)
        if preempted: exit

It prints `step S` after asking about step S, then `preempted at S` or
`finished`. As `python preempt_worker.py [OPTIONS] --trainer DIRECTORY STEPS`, it is the
run an evaluator follows instead (`trainer`).

Options (given as arguments, not variables of the environment, so that the
test's `prefork` template serves every launch): with `--die-at=STEP:PROCESS`,
process PROCESS kills itself with SIGKILL in the middle of saving step STEP
(before that step's commit in process 0, while joining it in the others): a
process dying outright. With `--slow=PROCESS`, that process's steps take 0.2 s
instead of 0.03 s, so the others run ahead and wait for it in their next save.
`--heartbeat=SECONDS` replaces `jax.distributed`'s heartbeat time-out (10 s
here): how long the others take to notice a process that died.
"""

import contextlib
import os
import signal
import sys
import time

import crash_worker
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_ckpt
from eqx_ckpt._base import _faults

EVERY = 4  # a periodic save every EVERY steps
OPTIMISER = optax.adam(1e-2)


def make_state() -> dict:
    model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(1))
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "key": jax.random.key(2), "data": 0}


def batch(position: int) -> tuple[np.ndarray, np.ndarray]:
    """The data stream: batch `position`, the same in every run."""
    rng = np.random.default_rng(position)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    return x, np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)


@eqx.filter_jit
def _update(model, opt_state, key, x, y):
    key, noise = jax.random.split(key)
    x = x + 0.01 * jax.random.normal(noise, x.shape)

    def loss(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    grads = eqx.filter_grad(loss)(model)
    updates, opt_state = OPTIMISER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, key


def train_step(state: dict) -> dict:
    x, y = batch(state["data"])
    model, opt_state, key = _update(state["model"], state["opt_state"], state["key"], x, y)
    return {"model": model, "opt_state": opt_state, "key": key, "data": state["data"] + 1}


def _die_while_saving(step: int) -> None:
    process = jax.process_index()
    point = "commit.manifest_write" if process == 0 else "transaction.join"

    def die(*args: object) -> None:
        if _saving == step:
            print(f"process {process} dies saving step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    _armed.enter_context(_faults.armed(point, die))


_saving = -1  # the step being saved
_armed = contextlib.ExitStack()  # the fault point stays armed until the process dies


def train(directory: str, steps: int, options: dict[str, str]) -> None:
    global _saving
    die = options.get("die-at")
    if die is not None and int(die.split(":")[1]) == jax.process_index():
        _die_while_saving(int(die.split(":")[0]))
    slow = options.get("slow")
    pace = 0.2 if slow is not None and int(slow) == jax.process_index() else 0.03
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=2) as manager:
        step, state = manager.restore_or_initialise(make_state)
        start = 0 if step is None else step + 1
        assert state["data"] == start, (state["data"], start)
        print(f"resumed from {step}", flush=True)
        for step in range(start, steps):
            state = train_step(state)
            if jax.process_count() > 1:
                time.sleep(pace)  # a step of a real job takes longer than the processes take to agree
            preempted = manager.reached_preemption(step)
            print(f"step {step}", flush=True)
            if preempted or step % EVERY == EVERY - 1 or step == steps - 1:
                _saving = step
                manager.save(step, state)
            if preempted:
                print(f"preempted at {step}", flush=True)
                return
    print("finished", flush=True)


def trainer(directory: str, steps: int) -> None:
    """A run that an evaluator follows: every step saved in the background,
    the last two kept; each a tree whose every value depends on the step (so
    that a mix of two steps, or a partial one, is seen)."""
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=2, blocking=False) as manager:
        for step in range(steps):
            manager.save(step, crash_worker.tree(step))
    print("finished", flush=True)


def main(argv: list[str]) -> None:
    options = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    argv = [a for a in argv if not (a.startswith("--") and "=" in a)]
    jax.config.update("jax_platforms", "cpu")
    print("ready", flush=True)
    if "go" in options:
        while not os.path.exists(options["go"]):
            time.sleep(0.005)
    else:
        sys.stdin.readline()
    if argv[0] == "--trainer":
        trainer(argv[1], int(argv[2]))
        return
    if len(argv) > 2:
        process, count, port = map(int, argv[2:5])
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=count,
            process_id=process,
            initialization_timeout=60,
            # A process that died is noticed by the others after this long.
            heartbeat_timeout_seconds=int(options.get("heartbeat", 10)),
        )
    train(argv[0], int(argv[1]), options)


if __name__ == "__main__":
    main(sys.argv[1:])
