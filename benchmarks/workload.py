"""The benchmark workloads: an Equinox transformer-like model and its optax Adam
state, float32, built with random values so compression gains nothing unfair."""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

ALIGN = 64
# Private anonymous memory (`mmap.mmap(-1, n)` alone maps shared memory, shmem).
PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big the model is: `layers` blocks of width `width`, a `vocab`-row
    embedding and output head."""

    layers: int
    width: int
    vocab: int

    @property
    def param_count(self) -> int:
        d = self.width
        block = 12 * d * d + 13 * d  # qkv, out, fc1, fc2 weights and biases, two LayerNorms
        return self.layers * block + 2 * self.vocab * d + self.vocab + 2 * d


# large: ~1.04 GB of params, ~3.1 GB with Adam, 808 leaves.
# small: ~55 MB of params, ~165 MB with Adam, 1204 leaves.
# many: 9988 leaves of a few KB each.
PRESETS = {
    "large": Sizes(layers=22, width=960, vocab=8192),
    "small": Sizes(layers=33, width=176, vocab=4096),
    "many": Sizes(layers=277, width=32, vocab=256),
    "tiny": Sizes(layers=2, width=16, vocab=32),
}


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.qkv = eqx.nn.Linear(width, 3 * width, key=k1)
        self.out = eqx.nn.Linear(width, width, key=k2)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, 4 * width, key=k3)
        self.fc2 = eqx.nn.Linear(4 * width, width, key=k4)


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, sizes: Sizes, key: jax.Array):
        keys = jax.random.split(key, sizes.layers + 2)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.width, key=keys[0])
        self.blocks = [Block(sizes.width, k) for k in keys[2:]]
        self.ln_f = eqx.nn.LayerNorm(sizes.width)
        self.head = eqx.nn.Linear(sizes.width, sizes.vocab, key=keys[1])


def make_state(sizes: Sizes) -> dict[str, Any]:
    """The training state `{"model": ..., "opt_state": ...}` (traced, for shapes)."""
    model = Transformer(sizes, jax.random.key(0))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
    return {"model": model, "opt_state": opt_state}


def skeleton(sizes: Sizes) -> dict[str, Any]:
    """The abstract state: `jax.ShapeDtypeStruct` leaves, nothing allocated."""
    return eqx.filter_eval_shape(make_state, sizes)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array whose data starts on a page (so a 64-byte)
    boundary, so `jax.device_put` can use it without copying.

    Anonymous `mmap` rather than `np.empty`: NumPy asks for transparent huge pages
    on large arrays, and on a machine whose memory is full of page cache the
    kernel compacts memory to find them, which made a 3 GB read 1.5-4x slower here.
    A private mapping, not `mmap`'s default shared one (shmem, slower to fault
    in: see `eqx_ckpt/_store/_local_read.py`), as eqx_ckpt's reader uses.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=PRIVATE), dtype).reshape(shape)


def concrete(sizes: Sizes, seed: int = 0) -> dict[str, Any]:
    """The state with random values: normal floats, an int step counter."""
    rng = np.random.default_rng(seed)

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        host = aligned_empty(leaf.shape, leaf.dtype)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            rng.standard_normal(out=host.reshape(-1), dtype=host.dtype)
        else:
            host[...] = 1000
        return jax.device_put(host)

    return jax.tree.map(fill, skeleton(sizes))


def params_skeleton(like: dict[str, Any]) -> Any:
    return like["model"]


def array_leaves(tree: Any) -> list[tuple[str, Any]]:
    """(dotted path, leaf) for every array leaf, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(dotted(path), leaf) for path, leaf in flat if hasattr(leaf, "shape")]


def dotted(path: tuple[Any, ...]) -> str:
    """A key path as `model.blocks.0.qkv.weight` (safetensors tensor names)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key).strip(".[]'\""))
    return ".".join(parts)


def state_bytes(tree: Any) -> int:
    return sum(
        int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize for _, leaf in array_leaves(tree)
    )
