"""Migration: turn an Equinox `.eqx` file into an eqx_ckpt checkpoint."""

from __future__ import annotations

import io
import math
import os
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._base import _keypath, _tree
from .._base._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, LeafError, leaf_line
from .._ondisk import _dtypes
from .._save._serialise import tree_serialise_leaves
from .._store import _storage


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
    is read leaf by leaf as `equinox.tree_deserialise_leaves(eqx_path, like)` reads
    it, and the result written with [`eqx_ckpt.tree_serialise_leaves`][]. From then
    on, any part of it can be loaded by path.

    Values are never changed on the way. These are errors, and nothing is written:

    - a 64-bit leaf into a JAX `like` leaf while JAX's 64-bit mode is off (a
        NumPy one keeps it);
    - a stored value of another kind than a Python scalar `like` leaf (`2.5`
        into `0`, `7` into `False`);
    - a `like` that describes fewer leaves than the file holds (or more);
    - a damaged record.

    No pickle is ever read.

    **Arguments:**

    - `eqx_path`: the `.eqx` file.
    - `ckpt_path`: the checkpoint directory (or kvstore URL) to write.
    - `like`: the tree the file was saved from, or its `eqx.filter_eval_shape`.
    - `filter_spec`, `is_leaf`: how to read the file, as for
        `equinox.tree_deserialise_leaves` (pass the ones matching a custom save).
        A custom `filter_spec` reads its own leaves, checked against `like` as
        Equinox checks them.
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
    if not _storage.local_entry(eqx_path).file:
        raise CheckpointNotFoundError(
            f"There is no Equinox file at {eqx_path!r}. `eqx_path` must be a file written "
            f"by `equinox.tree_serialise_leaves`.",
            path=eqx_path,
        )
    leaves, treedef = _tree.flatten(like, is_leaf)
    specs = _tree.leaf_specs(filter_spec, like, is_leaf, what="like", count=len(leaves))
    # The file named, exactly: Equinox would open `weights.eqx` when given `weights`.
    with _storage.open_local_file(eqx_path) as f:
        out = [_read_leaf(f, eqx_path, keypath, leaf, spec) for (keypath, leaf), spec in zip(leaves, specs)]
        rest = _storage.local_remaining(f)
    if rest:
        raise LeafError(
            f"{eqx_path!r} holds {rest} more bytes after the last leaf of `like`: the file holds more "
            f"than `like` describes, and converting would drop the rest. {_LIKE_FIX}",
            path=eqx_path,
        )
    tree = jtu.tree_unflatten(treedef, out)
    tree_serialise_leaves(ckpt_path, tree, overwrite=overwrite)
    return tree


_LIKE_FIX = (
    "An `.eqx` file holds no names, so `like` must be exactly the tree it was saved from: "
    "the same structure, leaf order, leaf types, shapes and dtypes. Nothing was written."
)
# `np.save` writes headers of about a hundred bytes; NumPy's own limit is 10000.
_MAX_HEADER = 2**16


def _error(what: str, keypath: Any, eqx_path: str, *, fix: str = _LIKE_FIX) -> LeafError:
    dotted = _keypath.dotted(keypath)
    message = leaf_line(what, keypath=keypath, dotted=dotted, where=f" of Equinox file {eqx_path!r}")
    return LeafError(f"{message} {fix}", path=eqx_path, keypaths=[keypath], dotted=[dotted])


def _corrupt(what: str, keypath: Any, eqx_path: str) -> CorruptCheckpointError:
    message = leaf_line(what, keypath=keypath, dotted=_keypath.dotted(keypath), where=f" of Equinox file {eqx_path!r}")
    return CorruptCheckpointError(f"{message} The file is damaged or was not written by Equinox.", path=eqx_path)


def _read_leaf(f: io.BufferedReader, eqx_path: str, keypath: Any, leaf: Any, spec: Any) -> Any:
    """The next value of the file for `leaf`, as Equinox's reader would give it,
    but exactly as stored or an error: never wrapped, rounded or coerced."""
    if spec is not eqx.default_deserialise_filter_spec:
        return _read_custom(f, eqx_path, keypath, leaf, spec)
    kind = _dtypes.like_type(leaf)
    if kind is None:  # not an array: Equinox keeps `like`'s leaf and reads nothing
        return leaf
    array = _read_array(f, eqx_path, keypath, leaf, kind)
    try:
        return _dtypes.to_result(array, leaf)
    except ValueError as e:
        raise _error(f"`like` holds a Python {kind}, which cannot hold it exactly: {e}.", keypath, eqx_path) from None


def _read_array(f: io.BufferedReader, eqx_path: str, keypath: Any, leaf: Any, kind: str) -> np.ndarray:
    """The next `.npy` record, checked against `leaf` before its data is read
    (never a pickle: object arrays are refused)."""
    remaining = _storage.local_remaining(f)
    if remaining == 0:
        raise _error("the file ends before this leaf: `like` describes more leaves than it holds.", keypath, eqx_path)
    try:
        read_header = _HEADER_READERS.get(np.lib.format.read_magic(f))
        if read_header is None:
            raise ValueError("an unknown `.npy` format version")
        shape, fortran, dtype = read_header(f, max_header_size=_MAX_HEADER)
    except ValueError as e:
        raise _corrupt(f"its record is not a NumPy array ({e}).", keypath, eqx_path) from None
    if dtype.hasobject or any(n < 0 for n in shape):
        raise _corrupt(f"its record declares {dtype} of shape {shape}, which is never read.", keypath, eqx_path)
    target = getattr(leaf, "dtype", None)
    if dtype.kind == "V" and dtype.fields is None and isinstance(target, np.dtype) and target.kind == "V":
        # NumPy writes bfloat16 and float8 arrays as raw bytes ('V2', 'V1').
        dtype = target if target.itemsize == dtype.itemsize else dtype
    _check(dtype, shape, leaf, kind, keypath, eqx_path)
    nbytes = math.prod(shape) * dtype.itemsize
    data = bytearray(nbytes) if nbytes <= remaining else None
    if data is None or f.readinto(data) != nbytes:
        raise _corrupt(f"the file ends inside its {dtype} data of shape {shape}.", keypath, eqx_path)
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


_HEADER_READERS = types.MappingProxyType(
    {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
)


def _check(dtype: np.dtype, shape: tuple[int, ...], leaf: Any, kind: str, keypath: Any, eqx_path: str) -> None:
    """Raise unless the stored array can replace `leaf` with its values unchanged."""
    stored = f"the file holds {dtype} data of shape {shape}"
    if kind in _dtypes.SCALAR_KINDS:
        if shape != () or dtype.kind not in _dtypes.SCALAR_KINDS[kind]:
            raise _error(f"{stored} but `like` holds a Python {kind}.", keypath, eqx_path)
    elif kind in ("jax", "prng_key") and _dtypes.x64_missing(dtype):
        raise _error(
            f"{_dtypes.x64_message(dtype)}.",
            keypath,
            eqx_path,
            fix="Enable it (`jax.config.update('jax_enable_x64', True)`) before converting, or give a "
            "NumPy `like` leaf of that dtype, which keeps its values. Nothing was written.",
        )
    elif (shape, dtype.name) != _dtypes.expected(leaf):
        want_shape, want_dtype = _dtypes.expected(leaf)
        raise _error(f"{stored} but `like` holds {want_dtype} of shape {want_shape}.", keypath, eqx_path)


def _read_custom(f: io.BufferedReader, eqx_path: str, keypath: Any, leaf: Any, spec: Any) -> Any:
    """A custom `filter_spec`'s value, checked against `leaf` as Equinox checks it."""
    try:
        new = spec(f, leaf)
    except CheckpointError:
        raise
    except Exception as e:
        raise _error(f"`filter_spec` could not read it ({type(e).__name__}: {e}).", keypath, eqx_path) from e
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        same = isinstance(new, jax.Array) and (new.shape, new.dtype) == (leaf.shape, leaf.dtype)
    else:
        same = type(new) is type(leaf) and (
            not isinstance(new, np.ndarray) or (new.shape, new.dtype) == (leaf.shape, leaf.dtype)
        )
    if not same:
        raise _error(f"`filter_spec` returned {_shown(new)}, where `like` holds {_shown(leaf)}.", keypath, eqx_path)
    return new


def _shown(x: Any) -> str:
    """A leaf's type, and its dtype and shape if it has them: never its values."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{type(x).__name__} of {x.dtype} and shape {x.shape}"
    return type(x).__name__
