"""Migration: turn an Equinox `.eqx` file into an eqx_ckpt checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from ._errors import CheckpointError, CheckpointNotFoundError, LeafError
from ._serialise import tree_serialise_leaves


def convert_eqx_file(
    eqx_path: str | os.PathLike[str],
    ckpt_path: Any,
    like: PyTree,
    *,
    filter_spec: Any = eqx.default_deserialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
    overwrite: bool = False,
) -> PyTree:
    """Convert a file written by `equinox.tree_serialise_leaves` into an eqx_ckpt
    checkpoint, keyed by path.

    An `.eqx` file is the leaves' bytes one after another, with no names: it can
    only be read back into the tree it was saved from. So `like` must have that
    tree's structure (concrete, or abstract from `eqx.filter_eval_shape`). The file
    is read with `equinox.tree_deserialise_leaves(eqx_path, like)`, and the result
    written with [`eqx_ckpt.tree_serialise_leaves`][]. From then on, any part of it
    can be loaded by path.

    **Arguments:**

    - `eqx_path`: the `.eqx` file.
    - `ckpt_path`: the checkpoint directory (or kvstore URL) to write.
    - `like`: the tree the file was saved from, or its `eqx.filter_eval_shape`.
    - `filter_spec`, `is_leaf`: how Equinox reads the file, as for
        `equinox.tree_deserialise_leaves` (pass the ones matching a custom save).
    - `overwrite`: replace a checkpoint already at `ckpt_path`. By default that is
        an error, so a conversion never destroys anything.

    **Returns:**

    The tree read from the `.eqx` file (what was written).

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        make = lambda: eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
        eqx.tree_serialise_leaves("model.eqx", make())
        eqx_ckpt.convert_eqx_file("model.eqx", "model_ckpt", eqx.filter_eval_shape(make))
        model = eqx_ckpt.tree_deserialise_leaves("model_ckpt", eqx.filter_eval_shape(make))
        ```
    """
    eqx_path = os.fspath(eqx_path)
    if not os.path.isfile(eqx_path):
        raise CheckpointNotFoundError(
            f"There is no Equinox file at {eqx_path!r}. `eqx_path` must be a file written "
            f"by `equinox.tree_serialise_leaves`.",
            path=eqx_path,
        )
    try:
        tree = eqx.tree_deserialise_leaves(eqx_path, like, filter_spec, is_leaf)
    except CheckpointError:
        raise
    except Exception as e:
        raise LeafError(
            f"Equinox could not read {eqx_path!r} into `like` ({type(e).__name__}: {e}). An "
            f"`.eqx` file holds no names, so `like` must be exactly the tree it was saved "
            f"from: the same structure, leaf order, shapes and dtypes.",
            path=eqx_path,
        ) from e
    tree_serialise_leaves(ckpt_path, tree, overwrite=overwrite)
    return tree
