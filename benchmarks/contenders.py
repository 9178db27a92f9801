"""The formats compared, each behind the same four operations.

`save(path, state)` returns once the data is durable (on disk, fsynced);
`load(path, like)` returns the state as JAX arrays; `load_params(path, like)`
returns only `like["model"]` from the params + Adam checkpoint; `open_lazy(path)`
opens a checkpoint without reading its arrays (only formats that can).
`save_async(path, state)` (eqx_ckpt only) starts a save that goes on in the
background and returns an object whose `wait()` blocks until it is committed.

orbax and safetensors are imported only by their own contender, so the smoke test
runs without them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import numpy as np

from . import workload

READ_THREADS = 4
PREAD_PIECE = 16 * 2**20


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path` (for formats that do not)."""
    targets = [path] if os.path.isfile(path) else []
    for root, _dirs, files in os.walk(path):
        targets += [os.path.join(root, f) for f in files] + [root]
    targets.append(os.path.dirname(os.path.abspath(path)))
    for target in targets:
        _fsync(target)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class EqxCkpt:
    name = "eqx_ckpt"
    suffix = ""

    def __init__(self, staging_bytes: int | None = None, compression: str | None = None) -> None:
        import eqx_ckpt

        self.lib = eqx_ckpt
        # A save's staging budget and compression; `None`: the library's default (not passed).
        given = {"staging_bytes": staging_bytes, "compression": compression}
        self.options = {k: v for k, v in given.items() if v is not None}

    def save(self, path: str, state: Any) -> None:
        self.lib.tree_serialise_leaves(path, state, **self.options)

    def save_async(self, path: str, state: Any) -> Any:
        """`blocking=False`: returns a `PendingSave` once every array is safe on
        the host; the writes and the commit go on in a background thread."""
        return self.lib.tree_serialise_leaves(path, state, blocking=False, **self.options)

    def load(self, path: str, like: Any) -> Any:
        return self.lib.tree_deserialise_leaves(path, like)

    def load_params(self, path: str, like: Any) -> Any:
        return self.lib.tree_deserialise_leaves(path, like["model"], prefix="model")

    def open_lazy(self, path: str) -> Any:
        return len(self.lib.Checkpoint(path))


class Equinox:
    """`eqx.tree_serialise_leaves`: one file, leaves one after another."""

    name = "equinox"
    suffix = ".eqx"

    def save(self, path: str, state: Any) -> None:
        eqx.tree_serialise_leaves(path, state)
        fsync_tree(path)

    def load(self, path: str, like: Any) -> Any:
        return eqx.tree_deserialise_leaves(path, like)

    def load_params(self, path: str, like: Any) -> Any:
        # The file is read in flattening order and "model" sorts first, so loading
        # into the model alone reads its leaves and stops.
        return eqx.tree_deserialise_leaves(path, {"model": like["model"]})["model"]


class Orbax:
    """orbax-checkpoint `StandardCheckpointer` on the array leaves (`eqx.filter`)."""

    name = "orbax"
    suffix = ""

    def __init__(self) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp

    def save(self, path: str, state: Any) -> None:
        with self.ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.abspath(path), eqx.filter(state, eqx.is_array))
            ckptr.wait_until_finished()
        fsync_tree(path)

    def _abstract(self, like: Any) -> Any:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        arrays = eqx.filter(like, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), arrays)

    def load(self, path: str, like: Any) -> Any:
        with self.ocp.StandardCheckpointer() as ckptr:
            arrays = ckptr.restore(os.path.abspath(path), self._abstract(like))
        return eqx.combine(arrays, like)

    def load_params(self, path: str, like: Any) -> Any:
        # A partial restore: only the "model" subtree is asked for.
        ocp = self.ocp
        target = {"model": self._abstract(like["model"])}
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        args = ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)
        with ocp.PyTreeCheckpointer() as ckptr:
            arrays = ckptr.restore(os.path.abspath(path), args=args)
        return eqx.combine(arrays["model"], like["model"])


class Safetensors:
    """safetensors' NumPy API with dotted tensor names; loaded arrays go to JAX
    with `jnp.asarray` (what `safetensors.flax` does)."""

    name = "safetensors"
    suffix = ".safetensors"

    def __init__(self) -> None:
        import safetensors.numpy

        self.lib = safetensors

    def save(self, path: str, state: Any) -> None:
        from safetensors.numpy import save_file

        save_file({name: np.asarray(leaf) for name, leaf in workload.array_leaves(state)}, path)
        fsync_tree(path)

    def _read(self, path: str, like: Any, prefix: str) -> Any:
        import jax.numpy as jnp
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            names = [prefix + name for name, _ in workload.array_leaves(like)]
            leaves = [jnp.asarray(f.get_tensor(name)) for name in names]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)

    def load(self, path: str, like: Any) -> Any:
        return self._read(path, like, "")

    def load_params(self, path: str, like: Any) -> Any:
        return self._read(path, like["model"], "model.")

    def open_lazy(self, path: str) -> Any:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            return len(list(f.keys()))


class Raw:
    """The physical reference: the arrays' bytes back to back in one file, written
    with `writev` + `fsync`, read with parallel `pread` into 64-byte-aligned
    buffers that `jax.device_put` adopts without copying."""

    name = "raw"
    suffix = ".bin"

    def save(self, path: str, state: Any) -> None:
        buffers = [memoryview(np.asarray(leaf)).cast("B") for _, leaf in workload.array_leaves(state)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _writev_all(fd, buffers)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync(os.path.dirname(os.path.abspath(path)))

    def load(self, path: str, like: Any) -> Any:
        return self._read(path, like)

    def load_params(self, path: str, like: Any) -> Any:
        # The model's leaves come first in the file.
        return self._read(path, like["model"])

    def _read(self, path: str, like: Any) -> Any:
        leaves = [leaf for _, leaf in workload.array_leaves(like)]
        hosts = [workload.aligned_empty(leaf.shape, leaf.dtype) for leaf in leaves]
        pieces: list[tuple[int, memoryview]] = []
        offset = 0
        for host in hosts:
            view = memoryview(host.reshape(-1)).cast("B")
            for start in range(0, len(view), PREAD_PIECE):
                pieces.append((offset + start, view[start : start + PREAD_PIECE]))
            offset += len(view)
        fd = os.open(path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                list(pool.map(lambda p: _pread_all(fd, p[1], p[0]), pieces))
        finally:
            os.close(fd)
        return jax.tree.unflatten(jax.tree.structure(like), [jax.device_put(h) for h in hosts])


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    """Write every buffer, in order, in as few `writev` calls as the kernel allows."""
    pending = [b for b in buffers if len(b)]
    while pending:
        written = os.writev(fd, pending[:1024])
        while written and pending:
            if written >= len(pending[0]):
                written -= len(pending.pop(0))
            else:
                pending[0] = pending[0][written:]
                written = 0


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"unexpected end of file at offset {offset}")
        view, offset = view[n:], offset + n


CONTENDERS: dict[str, Callable[[], Any]] = {
    "eqx_ckpt": EqxCkpt,
    "equinox": Equinox,
    "orbax": Orbax,
    "safetensors": Safetensors,
    "raw": Raw,
}
