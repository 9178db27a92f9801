"""`LeafHandle`: what a filter spec receives for one leaf's storage location."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from ._errors import LeafError, leaf_message


class LeafHandle:
    """The storage location of one leaf, given to a `filter_spec` in place of
    Equinox's file object.

    **Attributes:**

    - `keypath`: the leaf's key path, as `jax.tree_util.tree_flatten_with_path` gives it.
    - `path`: its dotted path in the checkpoint (`model.layers.0.weight`).
    - `checkpoint`: the checkpoint path, as given.

    A serialising filter spec calls `handle.write(value)` while it runs (later,
    the save has begun without that value: a `LeafError`); a deserialising one
    calls `handle.read(like)`. The default filter specs do exactly that for
    array-like leaves.

    !!! example

        Save only the leaves under `model`, naming the others as they go by:

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        def only_model(handle, x):
            if handle.path.startswith("model."):
                handle.write(x)
            else:
                print("skipped", handle.keystr)   # skipped ['cache']

        eqx_ckpt.tree_serialise_leaves("ckpt", {"model": {"w": jnp.ones(2)}, "cache": jnp.zeros(9)}, only_model)
        ```
    """

    def __init__(
        self,
        keypath: tuple[Any, ...],
        path: str,
        checkpoint: str,
        *,
        write: Callable[[LeafHandle, Any], None] | None = None,
        read: Callable[[Any], Any] | None = None,
    ):
        self.keypath = keypath
        self.path = path
        self.checkpoint = checkpoint
        self._write = write
        self._read = read

    def __repr__(self) -> str:
        return f"LeafHandle({self.path!r} in {self.checkpoint!r})"

    def write(self, value: Any) -> None:
        """Save `value` (an array or scalar) at this leaf's location."""
        if self._write is None:
            raise self.error("cannot write here: this handle belongs to a load.")
        self._write(self, value)

    def read(self, like: Any) -> Any:
        """Load the stored leaf as the type, shape and dtype of `like`."""
        if self._read is None:
            raise self.error("cannot read here: this handle belongs to a save.")
        return self._read(like)

    def error(self, what: str, fix: str = "") -> LeafError:
        """A `LeafError` about this leaf, in the library's message format."""
        message = leaf_message(what, keypath=self.keypath, dotted=self.path, path=self.checkpoint, fix=fix)
        return LeafError(message, path=self.checkpoint, keypaths=[self.keypath], dotted=[self.path])

    @property
    def keystr(self) -> str:
        return jtu.keystr(self.keypath)
