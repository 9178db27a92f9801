"""Load what a checkpoint has; initialise only what it lacks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._base._progress import Progress
from .._load._deserialise import default_deserialise_filter_spec, deserialise
from .._load._load_plan import LoadOptions


def load_or_initialise(
    path: Any,
    init: Callable[[], PyTree],
    *,
    where: Callable[[PyTree], Any] | None = None,
    prefix: str | None = None,
    rename: Mapping[str, str] | Callable[[str], str] | Sequence[tuple[str, Any]] | None = None,
    strict: bool = False,
    cast: bool = False,
    transform: Any = None,
    progress: Progress = None,
    read_once: bool | None = None,
    token: str | None = None,
    base: Any = None,
) -> PyTree:
    """Build `init()`'s tree from a checkpoint, computing only the leaves the
    checkpoint does not have.

    The skeleton comes from `eqx.filter_eval_shape(init)` (nothing allocated).
    Every leaf the checkpoint has is loaded into it. Then `init` runs under
    `jax.jit` returning only the missing leaves, so the initial values of the
    loaded ones are never computed or held in memory. This is how a new head or
    adapter is added to a pretrained body.

    **Arguments:**

    - `path`: the checkpoint directory, or a kvstore URL.
    - `init`: a function of no arguments returning the tree (use
        `functools.partial` or a lambda to bind a model's arguments). It must be
        traceable by `jax.jit`, as any Equinox constructor is.
    - `where`, `prefix`, `rename`, `strict`, `cast`, `transform`, `progress`,
        `read_once`, `token`, `base`: as for [`eqx_ckpt.tree_deserialise_leaves`][]. The leaves `where` leaves
        out are initialised, as the missing ones are.

    **Returns:**

    The tree, every array leaf concrete.

    **Raises:**

    A [`eqx_ckpt.LeafError`][] if no leaf of `init()`'s tree is in the
    checkpoint: that is a forgotten `prefix=` (or the wrong checkpoint), not a
    fresh start. The error names the checkpoint's top-level keys.

    A `LeafError` if a leaf's shape changed. Where every leaf that changed is
    in sub-trees that changed as a whole (a head with more classes), it names
    them and prints the `where=` that loads the rest; with it, `init`
    initialises them.

    !!! warning

        `eqx.nn.State` keys its leaves by position, as Equinox flattens it: a
        stateful layer (`BatchNorm`) inserted before others in the new tree takes
        the statistics of the layer that used to sit there, and the last one is
        initialised. Save such state keyed by the layers' names instead (see
        [docs/values.md, "Stateful layers"](../values.md#stateful-layers)).

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        body = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        eqx_ckpt.tree_serialise_leaves("ckpt", {"body": body})
        make = lambda: {"body": eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(1)),
                        "head": eqx.nn.Linear(4, 3, key=jax.random.key(2))}
        model = eqx_ckpt.load_or_initialise("ckpt", make)   # body loaded, head initialised
        ```
    """
    options = LoadOptions(
        where=where,
        prefix=prefix,
        rename=rename,
        transform=transform,
        strict=strict,
        cast=cast,
        read_once=read_once,
        progress=progress,
        token=token,
        base=base,
        missing="keep",
    )
    return initialise_unloaded(path, init, default_deserialise_filter_spec, None, options)


def initialise_unloaded(
    path: Any,
    init: Callable[[], PyTree],
    filter_spec: Any,
    is_leaf: Callable[[Any], bool] | None,
    options: LoadOptions,
) -> PyTree:
    """`init()`'s tree loaded from `path` with the load's `options`, and the
    leaves the load left abstract (missing with `missing="keep"`, or outside
    `where`) computed by `init` alone."""
    loaded = deserialise(path, eqx.filter_eval_shape(init), filter_spec, is_leaf, options)
    leaves, treedef = jtu.tree_flatten(loaded)
    todo = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if todo:

        def missing_leaves() -> list[Any]:
            everything = jtu.tree_leaves(init())
            return [everything[i] for i in todo]

        # Leaves not returned are dead code to XLA: they are never computed.
        for i, value in zip(todo, jax.jit(missing_leaves)()):
            leaves[i] = value
    return jtu.tree_unflatten(treedef, leaves)
