"""Which eqx_ckpt modules a behaviour runs (not a test module): the honest count
of docs/architecture.md, "Files per behaviour", checked by
`tests/package/test_architecture.py::test_files_per_behaviour_are_counted_from_the_code`.

Run as `python behaviour_worker.py run BEHAVIOUR FOLDER [PROCESS_ID PORT]`, after
`python behaviour_worker.py setup ROOT BEHAVIOUR...`. `setup` writes what each
behaviour starts from (into `ROOT/BEHAVIOUR`), all in one process of its own,
so that no thread pool of eqx_ckpt's exists before `run` starts profiling. `run` imports
eqx_ckpt, then profiles every thread while the behaviour runs, and writes one
JSON list to `modules.json` in its folder: the modules one of whose functions
ran. A module's import (its `<module>` code) is not counted, nor are `_errors`, `_faults` and `_format`
(the exception classes, the fault points and the on-disk names, which the map
counts as helpers).
"""

import json
import os
import pathlib
import signal
import sys
import threading

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_platforms", "cpu")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eqx_ckpt  # noqa: E402
from eqx_ckpt import Checkpoint as _public_names  # noqa: E402, F401  (imports them all, outside the traces: `import eqx_ckpt` is lazy)

PACKAGE = pathlib.Path(eqx_ckpt.__file__).resolve().parent
HELPERS = {"_errors", "_faults", "_format"}


def state(scale: float = 1.0) -> dict:
    """A model (one leaf large enough for an array of its own, the rest packed),
    a Python scalar and a step."""
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    return {
        "model": jax.tree.map(lambda x: x * scale if eqx.is_array(x) else x, model),
        "big": jnp.full((512, 1024), scale, jnp.float32),
        "rate": 0.5 * scale,
        "step": 3,
    }


def setup(name: str, folder: str) -> None:
    ckpt = os.path.join(folder, "ckpt")
    if name in ("overwrite", "partial_load", "verify", "rebuild"):
        eqx_ckpt.tree_serialise_leaves(ckpt, state())
    elif name == "foreign_load":
        from safetensors.numpy import save_file

        save_file({"a.weight": np.ones((4, 4), np.float32), "b": np.arange(3, dtype=np.int32)}, ckpt + ".safetensors")
    elif name == "share":
        with eqx_ckpt.CheckpointManager(os.path.join(folder, "run")) as manager:
            manager.save(0, state())


def run(name: str, folder: str) -> None:
    ckpt = os.path.join(folder, "ckpt")
    if name in ("save", "overwrite"):
        eqx_ckpt.tree_serialise_leaves(ckpt, state(2.0))
    elif name == "async_save":
        eqx_ckpt.tree_serialise_leaves(ckpt, state(2.0), blocking=False).wait()
    elif name == "partial_load":
        like = eqx.filter_eval_shape(state)
        eqx_ckpt.tree_deserialise_leaves(ckpt, like, where=lambda s: s["model"])
    elif name == "foreign_load":
        like = {"a": {"weight": jax.ShapeDtypeStruct((4, 4), jnp.float32)}, "b": jax.ShapeDtypeStruct((3,), jnp.int32)}
        eqx_ckpt.tree_deserialise_leaves(ckpt + ".safetensors", like)
    elif name == "share":
        with eqx_ckpt.CheckpointManager(os.path.join(folder, "run")) as manager:
            manager.save(1, state())
    elif name == "verify":
        problems = eqx_ckpt.verify(ckpt)
        assert not problems, problems
    elif name == "rebuild":
        eqx_ckpt.Checkpoint(ckpt).load(trust=[])
    elif name == "preemption":
        with eqx_ckpt.CheckpointManager(os.path.join(folder, "run")) as manager:
            for step in range(3):
                if step == 1:
                    signal.raise_signal(signal.SIGTERM)
                if manager.reached_preemption(step):
                    manager.save(step, state())
                    break
    else:
        raise SystemExit(f"unknown behaviour {name!r}")


def run_processes(name: str, folder: str, process_id: int, port: int) -> None:
    """The behaviours of several processes: two, with two CPU devices each."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("a",), devices=jax.devices())
    value = np.arange(64, dtype=np.float32).reshape(8, 8)

    def tree(spec: P) -> dict:
        sharding = NamedSharding(mesh, spec)
        return {"w": jax.make_array_from_callback(value.shape, sharding, lambda index: value[index]), "step": 1}

    ckpt = os.path.join(folder, "ckpt")
    if name == "multi_save":
        with profiled() as modules:
            eqx_ckpt.tree_serialise_leaves(ckpt, tree(P("a")))
    else:
        eqx_ckpt.tree_serialise_leaves(ckpt, tree(P("a")))
        like = eqx.filter_eval_shape(lambda: tree(P()))
        with profiled() as modules:
            eqx_ckpt.tree_deserialise_leaves(ckpt, like, read_once=True)
    if process_id == 0:
        report(folder, modules)


def report(folder: str, modules: set[str]) -> None:
    """Write the modules to `modules.json` in the behaviour's folder: not to
    stdout, where Gloo's own C++ lines land too (one once came last and the
    test read it as the result)."""
    pathlib.Path(folder, "modules.json").write_text(json.dumps(sorted(modules)))


class profiled:
    """Record the eqx_ckpt modules whose functions run, in every thread, while
    the block runs."""

    def __enter__(self) -> set[str]:
        self.modules: set[str] = set()
        files: dict[str, str | None] = {}

        def hook(frame, event, arg):
            code = frame.f_code
            if event != "call" or code.co_name == "<module>":
                return
            stem = files.get(code.co_filename, "")
            if stem == "":
                path = pathlib.Path(code.co_filename)
                stem = path.stem if PACKAGE in path.resolve().parents else None
                files[code.co_filename] = stem
            if stem is not None and not stem.startswith("__") and stem not in HELPERS:
                self.modules.add(stem)

        self.hook = hook
        threading.setprofile(hook)
        sys.setprofile(hook)
        return self.modules

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


if __name__ == "__main__":
    phase, name, folder = sys.argv[1:4]
    if phase == "setup":
        root, names = sys.argv[2], sys.argv[3:]
        for each in names:
            setup(each, os.path.join(root, each))
    elif len(sys.argv) > 4:
        process_id, port = int(sys.argv[4]), int(sys.argv[5])
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
        )
        run_processes(name, folder, process_id, port)
    else:
        with profiled() as modules:
            run(name, folder)
        report(folder, modules)
