"""`LazyArray`: a stored leaf that is read only when asked, and `materialise`."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _dtypes, _io, _read
from ._manifest import LeafRecord
from ._spec import Location


class LazyArray:
    """A leaf of a checkpoint that has not been read yet.

    It knows its `shape`, `dtype`, `ndim`, `size` and `nbytes` without reading.
    `np.asarray(x)` reads it all; `x[i:j]` reads only that region (a NumPy
    array); `x.read()` reads it as the type of the `like` leaf it stands for (a
    JAX array placed with `like`'s sharding, a NumPy array, or a scalar), and
    [`eqx_ckpt.materialise`][] does that for every lazy leaf of a tree at once.

    A `LazyArray` is not a JAX array: `eqx.is_array` is `False` for it, so
    `eqx.filter` treats it as static, and passing it to a `jax.jit`-ted function
    raises. Materialise first.
    """

    __slots__ = ("_like", "_loc", "_opener", "_record", "_store")

    def __init__(self, loc: Location, record: LeafRecord, like: Any = None, *, opener: Any = None):
        self._loc = loc
        self._record = record
        self._like = like
        self._store: Any = None
        # How a leaf of another format (safetensors, orbax) is opened; see `_source`.
        self._opener = opener

    # Unhashable on purpose: `jax.jit` would otherwise try to treat it as static.
    __hash__ = None  # type: ignore[assignment]

    @property
    def path(self) -> str:
        """The dotted path of the leaf in its checkpoint."""
        return self._record.path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._record.shape)

    @property
    def dtype(self) -> Any:
        if self._record.type == "prng_key":
            return self._record.dtype
        return _dtypes.dtype_from_name(self._record.dtype)

    @property
    def ndim(self) -> int:
        return len(self._record.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._record.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes as stored (for PRNG keys, those of their key data)."""
        return self._record.nbytes

    def __repr__(self) -> str:
        return f"LazyArray({self.path!r}, shape={self.shape}, dtype={self._record.dtype})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d LazyArray")
        return self.shape[0]

    def _open(self) -> Any:
        if self._store is None:
            try:
                opened = self._opener(self._record) if self._opener else _io.open_array(self._loc, self._record)
                self._store = opened.result()
            except Exception as e:
                raise _io.leaf_io_error(e, self._record, self._loc, "open") from e
        return self._store

    def __getitem__(self, index: Any) -> np.ndarray:
        """Read only the region `index` selects (basic indexing: ints and slices)."""
        index = _numpy_index(index, self.shape)
        store = self._open()
        per_element = self._record.nbytes // max(self.size, 1)
        _io.refuse_beyond_memory(self._loc, self._record, _region_size(index) * per_element, "this region")
        if self._record.type == "prng_key":
            index = index if isinstance(index, tuple) else (index,)
            # The key data is the last stored axis; a second `...` would be an error.
            index += (slice(None),) if any(i is Ellipsis for i in index) else (Ellipsis, slice(None))
        try:
            array = store[index].read().result()
        except Exception as e:
            raise _io.leaf_io_error(e, self._record, self._loc, "read") from e
        array = _dtypes.decode(array, self._record)
        # A leaf cast on save reads back in the dtype it was saved from, as `dtype` says.
        if self._record.type != "prng_key" and array.dtype != self.dtype:
            array = array.astype(self.dtype)
        return array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self[...]
        return array if dtype is None else array.astype(dtype)

    def start(self) -> Any:
        """Start reading; the returned function waits and gives the value."""
        like = self._like if self._like is not None else jax.ShapeDtypeStruct(self.shape, self.dtype)
        target = np.dtype(like.dtype) if _dtypes.like_type(like) in ("jax", "numpy", "numpy_scalar") else None
        return _read.start(self._open(), self._loc, self._record, like, dtype=target)

    def read(self) -> Any:
        """Read the whole leaf, as the type of the `like` leaf it stands for."""
        return self.start()()


def _numpy_index(index: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`index` with NumPy's meaning made explicit: TensorStore reads negative and
    out-of-range bounds as literal coordinates, NumPy counts them from the end and
    clips them. Returns one entry per axis (plus any `None`s), no `...`."""
    items = list(index) if isinstance(index, tuple) else [index]
    axes = sum(1 for item in items if item is not None and item is not Ellipsis)
    if axes > len(shape):
        raise IndexError(f"too many indices for a LazyArray of shape {shape}")
    if sum(1 for item in items if item is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    out: list[Any] = []
    for item in items:
        if item is Ellipsis:
            out.extend([slice(None)] * (len(shape) - axes))
        else:
            out.append(item)
    out.extend([slice(None)] * (len(shape) - sum(1 for item in out if item is not None)))
    axis = 0
    for i, item in enumerate(out):
        if item is None:
            continue
        n = shape[axis]
        axis += 1
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            # An empty NumPy slice (stop before start) is an empty interval.
            stop = max(stop, start) if step > 0 else min(stop, start)
            out[i] = slice(start, stop, step)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of bounds for axis {axis - 1} with size {n}")
            out[i] = int(item) % n
    return tuple(out)


def _region_size(index: tuple[Any, ...]) -> int:
    """How many elements a normalised index (see `_numpy_index`) selects."""
    lengths = [len(range(item.start, item.stop, item.step)) for item in index if isinstance(item, slice)]
    return math.prod(lengths)


def is_lazy(x: Any) -> bool:
    return isinstance(x, LazyArray)


def materialise(tree: PyTree) -> PyTree:
    """Read every [`eqx_ckpt.LazyArray`][] of a tree, all at once.

    **Arguments:**

    - `tree`: any PyTree; its lazy leaves are read concurrently, others are kept.

    **Returns:**

    The tree with every lazy leaf replaced by its value.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(3)})
        lazy = eqx_ckpt.tree_deserialise_leaves("ckpt", {"w": jnp.zeros(3)}, lazy=True)
        tree = eqx_ckpt.materialise(lazy)
        ```
    """
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_lazy)
    finishers = [leaf.start() if is_lazy(leaf) else None for leaf in leaves]
    values = [finish() if finish is not None else leaf for leaf, finish in zip(leaves, finishers)]
    return jtu.tree_unflatten(treedef, values)
