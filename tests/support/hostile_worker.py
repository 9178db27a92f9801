"""Load hostile checkpoints under a memory limit; used by tests/hostile/test_hostile.py.

Usage: python hostile_worker.py CHECKPOINT... (the test calls `main` in a process
forked by `prefork`, which has JAX imported).

Imports everything and warms up first, then caps the address space at what the
process uses plus `HEADROOM`, so any attempt to allocate a hostile shape fails.
For each checkpoint it tries a full load into a small `like`, reading every
entry of `Checkpoint(path)`, and `verify`, and prints one JSON line per
checkpoint: the outcome of each ("ok" or the exception's class and module).
A crash (the allocator aborting) shows as a missing line and a bad exit status.
"""

import json
import resource
import sys
import tempfile

import jax
import numpy as np

import eqx_ckpt

HEADROOM = 1536 * 2**20


def like():
    return {"a": np.zeros(1000, np.float32), "k": jax.random.key(1), "n": 0}


def outcome(action) -> str:
    try:
        action()
    except BaseException as e:
        return f"{type(e).__module__}.{type(e).__name__}"
    return "ok"


def read_all(path) -> None:
    ckpt = eqx_ckpt.Checkpoint(path)
    for key in ckpt:
        value = ckpt[key]
        np.asarray(value) if isinstance(value, eqx_ckpt.LazyArray) else value


def main(paths: list[str]) -> None:
    # Warm up every code path once, so the cap only limits the hostile data.
    with tempfile.TemporaryDirectory() as sound:
        eqx_ckpt.tree_serialise_leaves(sound, {"a": np.ones(1000, np.float32), "k": jax.random.key(0), "n": 1})
        eqx_ckpt.tree_deserialise_leaves(sound, like())
        read_all(sound)
        assert eqx_ckpt.verify(sound) == []
    status = open("/proc/self/status").read()
    size = int(status.split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))
    for path in paths:
        print(json.dumps(attempt(path)), flush=True)


def attempt(path: str) -> dict[str, str]:
    return {
        "path": path,
        "load": outcome(lambda: eqx_ckpt.tree_deserialise_leaves(path, like())),
        "lazy": outcome(lambda: eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(path, like(), lazy=True))),
        "checkpoint": outcome(lambda: read_all(path)),
        "verify": outcome(lambda: _raise_if_problems(eqx_ckpt.verify(path))),
    }


def _raise_if_problems(problems) -> None:
    if problems:
        raise eqx_ckpt.CorruptCheckpointError("; ".join(str(p) for p in problems))


if __name__ == "__main__":
    main(sys.argv[1:])
