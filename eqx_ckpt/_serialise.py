"""`tree_serialise_leaves`: one zarr array per leaf, then the manifest."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxtyping import PyTree

from . import _commit, _dtypes, _io, _layout, _manifest, _multihost, _tree, _write
from ._errors import CheckpointError, CheckpointValueError, LeafError, leaf_message
from ._handle import LeafHandle
from ._manifest import LeafRecord
from ._progress import Progress, Tracker
from ._spec import Location, location


def default_serialise_filter_spec(handle: LeafHandle, x: Any) -> None:
    """Default filter specification for serialising a leaf.

    **Arguments:**

    - `handle`: the leaf's storage location, a [`eqx_ckpt.LeafHandle`][].
    - `x`: the leaf.

    **Returns:**

    Nothing. JAX arrays (PRNG key arrays included), NumPy arrays and scalars, and
    Python `bool`/`int`/`float`/`complex` are written; every other leaf is skipped.

    !!! example

        Skip the JAX arrays and save the rest:

        ```python
        import jax, jax.numpy as jnp, numpy as np
        import eqx_ckpt

        def spec(handle, x):
            if not isinstance(x, jax.Array):
                eqx_ckpt.default_serialise_filter_spec(handle, x)

        eqx_ckpt.tree_serialise_leaves("ckpt", (jnp.ones(2), np.ones(2)), spec)
        ```
    """
    if _dtypes.leaf_type(x) is not None:
        handle.write(x)


_IN_FLIGHT: dict[str, PendingSave] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class PendingSave:
    """A save still being written. Returned by `tree_serialise_leaves(...,
    blocking=False)` once every array is safe on the host.

    Call `wait()` to block until the checkpoint is committed; it raises any error
    the background writes hit (and then nothing was committed). A later save to
    the same path waits for this one to finish before it starts writing.
    """

    def __init__(self, run: Callable[[], None], destination: str = ""):
        self._error: BaseException | None = None
        self._destination = destination
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True, name="eqx_ckpt-save")
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[destination] = self
        self._thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # re-raised by `wait`
            self._error = e
        finally:
            with _IN_FLIGHT_LOCK:
                if _IN_FLIGHT.get(self._destination) is self:
                    del _IN_FLIGHT[self._destination]

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until committed; raise the save's error if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def tree_serialise_leaves(
    path: Any,
    pytree: PyTree,
    filter_spec: Any = default_serialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    overwrite: bool = True,
    blocking: bool = True,
    cast: Callable[[str, np.dtype], Any] | dict[Any, Any] | None = None,
    layout: str = "directories",
    progress: Progress = None,
) -> PendingSave | None:
    """Save the leaves of a PyTree as a checkpoint directory.

    Every array leaf becomes its own zarr v3 array in a folder named after its key
    path (`model.layers.0.weight` -> `model/layers/0/weight/`); a `manifest.json`
    written last commits the checkpoint.

    **Arguments:**

    - `path`: the checkpoint directory (`str` or `pathlib.Path`), or a TensorStore
        kvstore URL (`memory://`, `file://`, `s3://`, `gs://`), or a kvstore spec `dict` (for an
        S3 `endpoint` and other options a URL cannot carry; see `docs/storage.md`).
    - `pytree`: the PyTree whose leaves are saved.
    - `filter_spec`: how to save each leaf: a callable `(handle, leaf) -> None`
        or a PyTree prefix of `pytree` of them. The default saves arrays and
        scalars and skips every other leaf. (See
        [`eqx_ckpt.default_serialise_filter_spec`][].)
    - `is_leaf`: called on every node of `pytree`; where it returns `True` the
        node is treated as a leaf.
    - `overwrite`: replace an existing checkpoint at `path` (atomically: the old
        one stays loadable until the new one is committed). With `False`, an
        existing checkpoint is an error.
    - `blocking`: with `False`, return a [`eqx_ckpt.PendingSave`][] as soon as
        every array is safe on the host; writing and committing go on in the
        background. Call its `wait()` before relying on the checkpoint. A later
        save to the same `path` first waits for this one.
    - `cast`: store some arrays in another dtype: a mapping from dtype to dtype
        (`{jnp.float32: jnp.bfloat16}`) or a callable `(dotted_path, dtype) ->
        dtype | None`. The manifest records both dtypes. A load into `like`
        leaves of either dtype needs no `cast=True`.
    - `layout`: `"directories"` (one folder per leaf, readable by any zarr v3
        tool) or `"ocdbt"` (every array in one TensorStore OCDBT database: a few
        files instead of two per leaf, for trees of many small leaves; one
        process only). Loads need not be told. See docs/scaling.md.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and the save is large; `False` hides it, `True`
        shows it whatever the size, and a callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)` as each
        leaf's data is handed to TensorStore; the commit that makes them durable
        follows.

    With `jax.distributed` initialised, call this in every process with the same
    tree: each process writes its own shards, and the checkpoint is committed once,
    after all have finished.

    **Returns:**

    `None`, or a `PendingSave` when `blocking=False`.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
        eqx_ckpt.tree_serialise_leaves("mlp_ckpt", model)
        ```
    """
    loc = location(path)
    _layout.check(layout)
    cast_fn = _write.cast_function(cast)
    pending = _collect(loc, pytree, filter_spec, is_leaf, cast_fn)
    group = _multihost.Group()
    if layout == "ocdbt" and group.count > 1:
        raise CheckpointValueError(
            f"`layout='ocdbt'` is not supported with {group.count} JAX processes: one "
            f"OCDBT database has a single writer. Save with `layout='directories'`.",
            path=loc.display,
        )
    _wait_for_earlier(loc)
    nbytes = sum(piece.nbytes for p in pending for _, piece in p.pieces)
    tracker = Tracker(progress, leaves=len(pending), nbytes=nbytes, what="save")
    tx = _begin(group, loc, overwrite=overwrite, layout=layout, paths=[p.record.path for p in pending])
    try:
        commits, early = _write.start_writes(tx, pending, group, copy=not blocking, tracker=tracker), None
    except BaseException as e:
        tracker.close()
        if group.count == 1:
            _commit.abort(tx)
            if isinstance(e, CheckpointError) or not isinstance(e, Exception):
                raise
            # A full disk while creating the arrays, say: not TensorStore's bare message.
            raise LeafError(
                f"Saving checkpoint {loc.display!r} failed, and nothing was committed: {e}", path=loc.display
            ) from e
        # The other processes must still learn of it, at the next barrier.
        commits, early = [], e

    finish = functools.partial(_finish, tx, group, [p.record for p in pending], commits, early)
    if blocking:
        with tracker:
            tracker.describe("save: committing")
            finish()
        return None
    tracker.close()
    return PendingSave(finish, _destination(loc))


def _finish(
    tx: _commit.Transaction,
    group: _multihost.Group,
    records: list[LeafRecord],
    commits: list[Any],
    error: BaseException | None,
) -> None:
    """Wait until every process's data is durable, then commit once (process 0);
    on any failure, process 0 deletes what the save wrote and all raise."""
    error = _write.wait_all(commits, error)
    # Each process makes its own writes durable; only then may process 0 commit.
    error = error or _write.attempt(lambda: _io.flush(tx.data))
    error = group.sync("written", error)
    if error is None and group.primary:
        manifest = _manifest.new_manifest(records, tx.target, tx.layout)
        error = _write.attempt(lambda: _commit.commit(tx, manifest))
    error = group.sync("committed", error)
    if error is None:
        return
    if group.primary:
        _commit.abort(tx)
    if isinstance(error, CheckpointError):
        raise error
    display = tx.loc.display
    message = f"Saving checkpoint {display!r} failed, and nothing was committed: {error}"
    raise LeafError(message, path=display) from error


def _destination(loc: Location) -> str:
    return json.dumps(loc.kvstore, sort_keys=True)


def _wait_for_earlier(loc: Location) -> None:
    """Wait for a background save to the same destination (its error, if any, is
    raised by its own `wait()`, not here)."""
    with _IN_FLIGHT_LOCK:
        earlier = _IN_FLIGHT.get(_destination(loc))
    if earlier is not None:
        earlier._thread.join()


def _begin(
    group: _multihost.Group, loc: Location, *, overwrite: bool, layout: str, paths: list[str]
) -> _commit.Transaction:
    """Process 0 begins the transaction; the others then join it."""
    if group.primary:
        try:
            tx = _commit.begin(loc, overwrite=overwrite, layout=layout, paths=paths)
        except BaseException as e:
            group.sync("begin", e)
            raise
        group.sync("begin", None)  # only this process can fail at `begin`, and it did not
        error = group.sync("joined", None)
        if error is not None:
            _commit.abort(tx)
            raise error
        return tx
    error = group.sync("begin", None)
    if error is not None:
        raise error
    try:
        tx = _commit.join(loc)
    except BaseException as e:
        group.sync("joined", e)
        raise
    error = group.sync("joined", None)
    if error is not None:
        raise error
    return tx


def _collect(loc: Location, pytree: Any, filter_spec: Any, is_leaf: Any, cast: Any) -> list[_write.Pending]:
    """Run the filter specs over the tree; nothing is written yet, so a bad leaf
    leaves the destination untouched."""
    flat, _ = _tree.flatten(pytree, is_leaf)
    specs = _tree.leaf_specs(filter_spec, pytree, is_leaf)
    paths = _tree.check_unique([keypath for keypath, _ in flat], checkpoint=loc.display)
    pending: list[_write.Pending] = []

    def write(handle: LeafHandle, value: Any) -> None:
        pending.append(_write.prepare(handle, value, cast))

    for (keypath, leaf), dotted, spec in zip(flat, paths, specs, strict=True):
        handle = LeafHandle(keypath, dotted, loc.display, write=write)
        try:
            spec(handle, leaf)
        except CheckpointError:
            raise
        except Exception as e:
            what = f"the filter spec raised {type(e).__name__}: {e}"
            message = leaf_message(what, keypath=keypath, dotted=dotted, path=loc.display)
            raise LeafError(
                f"Error at leaf with path {keypath!r}. {message}", path=loc.display, keypaths=[keypath], dotted=[dotted]
            ) from e
    return pending
