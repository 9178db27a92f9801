"""`Checkpoint(path)`: look inside a checkpoint without reading its arrays."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from . import _keypath, _source
from ._errors import CheckpointKeyError
from ._lazy import LazyArray
from ._manifest import LeafRecord

_SCALARS = ("bool", "int", "float", "complex", "numpy_scalar")


class Checkpoint(Mapping[str, Any]):
    """A committed checkpoint, opened without reading any array.

    A read-only mapping from dotted key (sorted) to [`eqx_ckpt.LazyArray`][], or,
    for a scalar leaf, its value (read when looked up).

    **Arguments:**

    - `path`: the checkpoint directory or kvstore URL; or a `.safetensors`
        file, a Hugging Face directory of safetensors shards, or an orbax
        PyTree checkpoint (see `docs/interop.md`).

    **Attributes:**

    - `total_bytes`, `created`, `library_version`, `format_version`, `format`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"model": {"w": jnp.ones((2, 3))}, "step": 7})
        ckpt = eqx_ckpt.Checkpoint("ckpt")
        print(list(ckpt))                 # ['model.w', 'step']
        print(ckpt["model.w"].shape)      # (2, 3)
        print(ckpt["step"])               # 7
        ```
    """

    def __init__(self, path: Any):
        self._source = _source.open_source(path)
        self._loc = self._source.loc
        self._manifest = self._source.manifest
        self._data = self._source.data
        self._records = dict(sorted(self._manifest.by_path().items()))

    @property
    def path(self) -> str:
        return self._loc.display

    @property
    def total_bytes(self) -> int:
        return self._manifest.total_bytes

    @property
    def created(self) -> str:
        return self._manifest.created

    @property
    def library_version(self) -> str:
        return self._manifest.library_version

    @property
    def layout(self) -> str:
        """`"directories"` (one folder per leaf) or `"ocdbt"` (one key-value store)."""
        return self._manifest.layout

    @property
    def format(self) -> str:
        """`"eqx_ckpt"`, or the format of another source: `"safetensors"`, `"orbax"`."""
        return self._source.format

    @property
    def format_version(self) -> int:
        return self._manifest.format_version

    def record(self, key: str) -> LeafRecord:
        """The manifest record of one leaf (shape, dtype, stored dtype, chunks...)."""
        try:
            return self._records[key]
        except KeyError:
            raise CheckpointKeyError(self._missing(key), path=self.path) from None

    def _missing(self, key: str) -> str:
        close = [k for k in self._records if k.startswith(key.split(".")[0])][:5]
        hint = f" Keys starting alike: {close}." if close else ""
        return f"{key!r} is not a leaf of checkpoint {self.path!r}.{hint} `Checkpoint(path).keys()` lists them all."

    def __getitem__(self, key: str) -> Any:
        lazy = LazyArray(self._data, self.record(key), opener=self._source.opener)
        if self._records[key].type in _SCALARS:
            value = lazy[()]
            return value.item() if self._records[key].type != "numpy_scalar" else value[()]
        return lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self)} leaves, {self.total_bytes} bytes)"

    def tree(self) -> dict[str, Any]:
        """The saved tree as nested dicts of dotted segments, with a
        `"shape dtype"` description at each leaf (never reads arrays)."""
        out: dict[str, Any] = {}
        for path, record in self._records.items():
            parts = _keypath.split_dotted(path)
            if not parts:
                return {"": describe(record)}
            node = out
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = describe(record)
        return out


def describe(record: LeafRecord) -> str:
    shape = ",".join(str(n) for n in record.shape)
    stored = (
        "" if record.stored_dtype == record.dtype or record.type == "prng_key" else f" (stored {record.stored_dtype})"
    )
    return f"{record.dtype}[{shape}]{stored}"


def skeleton(fn: Callable[..., PyTree], *args: Any, **kwargs: Any) -> PyTree:
    """The abstract tree `fn(*args, **kwargs)` would return, allocating nothing:
    `eqx.filter_eval_shape`. Array leaves are `jax.ShapeDtypeStruct`s.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        like = eqx_ckpt.skeleton(eqx.nn.Linear, 1024, 1024, key=jax.random.key(0))
        ```
    """
    return eqx.filter_eval_shape(fn, *args, **kwargs)
