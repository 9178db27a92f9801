"""A model family for the tests of fine-tunes (tests/sources/): a base of
each kind (`BASES`, made by `_make_base`), its head-only fine-tune
(`_finetuned`), and what those tests compare and read with. The `family`
fixture (tests/sources/conftest.py) builds one of each kind."""

import json
import pathlib
from typing import Any, NamedTuple

import blake3
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from arrays import bits
from safetensors import safe_open

import eqx_ckpt


class Classifier(eqx.Module):
    """A model of the test's own: a load without `like` builds it only when trusted."""

    body: eqx.nn.MLP
    head: eqx.nn.Linear
    temperature: float = eqx.field(static=True)


def _model(seed: int) -> Classifier:
    one, two = jax.random.split(jax.random.key(seed))
    return Classifier(eqx.nn.MLP(3, 4, 5, 1, key=one), eqx.nn.Linear(4, 2, key=two), 0.5)


def _base_tree() -> dict[str, Any]:
    """Leaves of several kinds: float32 (the model), bfloat16, NumPy int32 and
    bool, a PRNG key, a Python int and float."""
    return {
        "model": _model(0),
        "embed": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4) / 4,
        "ids": np.arange(5, dtype=np.int32) * 7,
        "mask": np.array([True, False, True]),
        "key": jax.random.key(0),
        "step": 3,
        "lr": 0.25,
    }


# The leaves a head-only fine-tune changes, by dotted path.
CHANGED = ["model.head.bias", "model.head.weight", "step"]


def _finetuned(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` with a new head and step: its body, embeddings and the rest unchanged."""
    head = tree["model"].head
    model = eqx.tree_at(lambda m: (m.head.weight, m.head.bias), tree["model"], (head.weight + 1, head.bias - 0.5))
    return {**tree, "model": model, "step": 4}


# Where the base is: a published folder (one file, or in shards), or an
# eqx_ckpt checkpoint (its tiny leaves packed, or each in a folder of its own).
BASES = ["published", "sharded", "checkpoint", "checkpoint-unpacked"]


class Family(NamedTuple):
    kind: str
    base: pathlib.Path
    finetune: pathlib.Path
    base_tree: dict[str, Any]
    tree: dict[str, Any]

    @property
    def record_file(self) -> pathlib.Path:
        """The file whose sha256 pins the base."""
        return self.base / ("manifest.json" if self.kind.startswith("checkpoint") else "eqx_ckpt.json")


def _make_base(kind: str, path: pathlib.Path, tree: Any) -> None:
    if kind.startswith("checkpoint"):
        eqx_ckpt.tree_serialise_leaves(path, tree, overwrite=path.exists())
    else:
        eqx_ckpt.export_safetensors(path, tree, max_shard_size=200 if kind == "sharded" else "5GB")


def _record(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "eqx_ckpt.json").read_text())


def _leaves(folder: pathlib.Path) -> dict[str, dict[str, Any]]:
    return {leaf["path"]: leaf for leaf in _record(folder)["leaves"]}


def _tensors(folder: pathlib.Path) -> dict[str, bytes]:
    """Every tensor the folder's safetensors files hold, as the `safetensors`
    library reads them: name -> bytes."""
    found: dict[str, bytes] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            names = list(f.keys())
        parsed = dict(safetensors.deserialize(file.read_bytes()))
        assert sorted(parsed) == sorted(names)
        found.update({name: bytes(parsed[name]["data"]) for name in names})
    return found


def _stored_bytes(x: Any) -> bytes:
    """A leaf's bytes as an export stores them: a key's key data, a Python
    scalar as int64, float64 or bool."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x)).tobytes()
    if isinstance(x, bool):
        return np.bool_(x).tobytes()
    if isinstance(x, int):
        return np.int64(x).tobytes()
    if isinstance(x, float):
        return np.float64(x).tobytes()
    return np.asarray(x).tobytes()


def _digest(x: Any) -> str:
    return _blake3(_stored_bytes(x))


def _blake3(data: bytes) -> str:
    """The digest `eqx_ckpt.json` version 5 records: the BLAKE3 of its blocks' BLAKE3s."""
    blocks = b"".join(blake3.blake3(data[i : i + 2**20]).digest() for i in range(0, len(data), 2**20))
    return "blake3:" + blake3.blake3(blocks).hexdigest()


def _by_path(tree: Any) -> dict[str, Any]:
    """A tree's stored leaves (arrays and numbers) by the dotted paths eqx_ckpt names them by."""
    ckpt_names = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float)):
            continue
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        ckpt_names[".".join(parts)] = leaf
    return ckpt_names


def _assert_same(loaded: Any, expected: Any) -> None:
    """Equal as Equinox sees it, of the same structure, and bit for bit."""
    assert eqx.tree_equal(loaded, expected, typematch=True), "the loaded tree differs from the exported one"
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    assert [(jax.tree_util.keystr(p), bits(x)) for p, x in jax.tree_util.tree_leaves_with_path(loaded)] == [
        (jax.tree_util.keystr(p), bits(x)) for p, x in jax.tree_util.tree_leaves_with_path(expected)
    ]


def _like(tree: Any) -> Any:
    """What a test loads into: JAX arrays abstract, other leaves of their own
    type holding zeros, so that a load that read nothing fails."""

    def blank(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, np.ndarray):
            return np.zeros_like(x)
        if isinstance(x, (bool, int, float)):
            return type(x)(0)
        return x

    return jax.tree.map(blank, tree)


def _no_reads(faults) -> list[Any]:
    """Arm every point where a load reads stored bytes; the list of reads made."""
    reads: list[Any] = []
    faults(["load.read_stored", "safetensors.read_run", "pack.read_run"], lambda *a: reads.append(a))
    return reads
