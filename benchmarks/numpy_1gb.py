"""A quick check of a 1 GB tree: eqx_ckpt against `numpy.save`/`numpy.load` of the
same bytes (one `.npy` file per leaf, each fsynced), warm page cache, 3 runs.

    .venv/bin/python -m benchmarks.numpy_1gb
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_ckpt

RESULTS = pathlib.Path(__file__).parent / "results"


def _tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        f"layer{i}": {
            "w": jnp.asarray(rng.standard_normal((2048, 2048), dtype=np.float32)),
            "b": jnp.asarray(rng.standard_normal(2048, dtype=np.float32)),
        }
        for i in range(64)
    }


def _numpy_save(tree: dict, directory: pathlib.Path) -> None:
    directory.mkdir()
    for name, layer in tree.items():
        for key, array in layer.items():
            with open(directory / f"{name}.{key}.npy", "wb") as f:
                np.save(f, np.asarray(array))
                f.flush()
                os.fsync(f.fileno())


def _numpy_load(directory: pathlib.Path) -> dict:
    return {path.name: jnp.asarray(np.load(path)) for path in directory.iterdir()}


def main(repeats: int = 3) -> None:
    tree = _tree()
    like = eqx.filter_eval_shape(lambda: tree)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    RESULTS.mkdir(exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(dir=RESULTS))
    times: dict[str, list[float]] = {"eqx_ckpt save": [], "eqx_ckpt load": [], "numpy.save": [], "numpy.load": []}
    try:
        for rep in range(repeats):
            path = base / f"ckpt{rep}"
            start = time.perf_counter()
            eqx_ckpt.tree_serialise_leaves(path, tree)
            times["eqx_ckpt save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            loaded = jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(path, like))
            times["eqx_ckpt load"].append(time.perf_counter() - start)
            if not eqx.tree_equal(loaded, tree):
                raise SystemExit("eqx_ckpt loaded different values")
            del loaded
            npy = base / f"npy{rep}"
            start = time.perf_counter()
            _numpy_save(tree, npy)
            times["numpy.save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(_numpy_load(npy))
            times["numpy.load"].append(time.perf_counter() - start)
            shutil.rmtree(path)
            shutil.rmtree(npy)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{len(jax.tree.leaves(tree))} leaves, {nbytes / 1e9:.2f} GB, {repeats} runs")
    for name, values in times.items():
        best, median = min(values), sorted(values)[len(values) // 2]
        print(f"{name:14s} min {best:.2f} s  median {median:.2f} s  ({nbytes / best / 1e9:.2f} GB/s at best)")


if __name__ == "__main__":
    main()
