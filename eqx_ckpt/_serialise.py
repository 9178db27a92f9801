"""`tree_serialise_leaves`: one zarr array per leaf, then the manifest."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from . import (
    _dtypes,
    _durable,
    _gc,
    _keypath,
    _layout,
    _lease,
    _manifest,
    _memory,
    _multihost,
    _pack,
    _storage_errors,
    _transaction,
    _tree,
    _untrusted,
    _write,
)
from ._errors import CheckpointError, CheckpointValueError, LeafError, check_flag, leaf_message
from ._handle import LeafHandle
from ._lazy import LazyArray
from ._location import Location, location
from ._progress import Progress, Tracker


def default_serialise_filter_spec(handle: LeafHandle, x: Any) -> None:
    """Default filter specification for serialising a leaf.

    **Arguments:**

    - `handle`: the leaf's storage location, a [`eqx_ckpt.LeafHandle`][].
    - `x`: the leaf.

    **Returns:**

    Nothing. JAX arrays (PRNG key arrays included), NumPy arrays and scalars,
    Python `bool`/`int`/`float`/`complex`, and the [`eqx_ckpt.LazyArray`][]
    leaves of a lazily loaded tree (with their values) are written; every other
    leaf is skipped. An abstract leaf (`jax.ShapeDtypeStruct`, as
    `eqx.filter_eval_shape` gives) has no value to save and is an error.

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
    if isinstance(x, jax.ShapeDtypeStruct):
        raise handle.error(
            f"it is abstract ({x.dtype}{list(x.shape)}, as `eqx.filter_eval_shape` gives): it has no value to save.",
            "Save a concrete tree, or skip abstract leaves with a `filter_spec`.",
        )
    if _dtypes.leaf_type(x) is not None or isinstance(x, LazyArray):
        handle.write(x)


class PendingSave:
    """A save still being written. Returned by `tree_serialise_leaves(...,
    blocking=False)` once every array is safe on the host.

    Call `wait()` to block until the checkpoint is committed; it raises any error
    the background writes hit (and then nothing was committed). A later save to
    the same path waits for this one to finish before it starts. A program that
    ends with saves in flight waits for them before it exits (and says so on
    stderr), so a script's last checkpoint is never lost.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        pending = eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(1000)}, blocking=False)
        # ... training goes on while the arrays are written ...
        pending.wait()                      # committed (or the save's error is raised)
        assert pending.done()
        ```
    """

    def __init__(self, run: Callable[[], None], *, wraps: PendingSave | None = None):
        # `wraps`: a save this one waits for and finishes (a manager's retention
        # after its step's save): the two are one save to the user.
        self._error: BaseException | None = None
        self._outer: PendingSave | None = None
        # Not a daemon: the interpreter waits for it at exit, while TensorStore
        # can still finish the writes.
        self._thread = threading.Thread(target=self._run, args=(run,), name="eqx_ckpt-save")
        # The thread waits until `start` has returned here: running at once, it
        # would hold the GIL, and the caller would wait a switch interval (5 ms)
        # to get it back.
        self._started = threading.Event()
        # Set when the save has finished. Waited on, never `Thread.join`: an
        # interrupted join in Python 3.11 can mark the running thread as
        # finished, and every later wait (the exit's too) returned at once.
        self._finished = threading.Event()
        try:
            with _PENDING_LOCK:
                _PENDING.add(self)
                if wraps is not None:
                    wraps._outer = self
            self._thread.start()
        except BaseException:
            if self._thread.ident is None:  # interrupted before the thread began
                with _PENDING_LOCK:
                    _PENDING.discard(self)
            raise
        finally:
            self._started.set()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            self._started.wait(timeout=1.0)  # bounded: an interrupt could come between
            run()
        except BaseException as e:  # re-raised by `wait`
            self._error = e
        finally:
            with _PENDING_LOCK:
                _PENDING.discard(self)
            self._finished.set()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._finished.is_set()

    def wait(self) -> None:
        """Block until committed; raise the save's error if it failed."""
        self._finished.wait()
        if self._error is not None:
            raise self._error


_PENDING: set[PendingSave] = set()
_PENDING_LOCK = threading.Lock()


def _wait_at_exit() -> None:
    """Finish the saves still in flight, and say so: a script whose last line
    starts an asynchronous save must not lose it."""
    with _PENDING_LOCK:
        # A save wrapped by another (a manager's) is waited for through it.
        pending = [save for save in _PENDING if save._outer is None or save._outer not in _PENDING]
    if not pending:
        return
    print(f"eqx_ckpt: waiting for {len(pending)} checkpoint save(s) to commit before exiting.", file=sys.stderr)
    for save in pending:
        save._finished.wait()
        if save._error is not None:
            print(f"eqx_ckpt: a checkpoint save failed: {save._error}", file=sys.stderr)


# Run when the interpreter starts to shut down, before it joins other threads and
# before `concurrent.futures` (registered earlier, run later) refuses new work.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_wait_at_exit)


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
        every array is safe on the host (NumPy arrays are copied; a `jax.Array`
        needs no copy); with the default `filter_spec`, the leaf records,
        creating, writing and committing all go on in the background, and an
        error (a leaf that cannot be saved, say) is raised by its `wait()`.
        Call `wait()` before relying on the checkpoint. A later save to the
        same `path` first waits for this one.
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
    return save(
        location(path), pytree, filter_spec, is_leaf,
        overwrite=overwrite, blocking=blocking, cast=cast, layout=layout, progress=progress,
    )  # fmt: skip


# A save makes many small objects and frees them again: Python's cyclic
# collector, triggered by their count, would walk them all repeatedly.
@_gc.gc_paused()
def save(
    loc: Location,
    pytree: PyTree,
    filter_spec: Any = default_serialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    overwrite: bool = True,
    blocking: bool = True,
    cast: Any = None,
    layout: str = "directories",
    metrics: dict[str, Any] | None = None,
    progress: Progress = None,
    handoff: Handoff | None = None,
) -> PendingSave | None:
    """`tree_serialise_leaves`, with `metrics` committed in the manifest.
    `handoff`: tells the caller, after any exception, whether an asynchronous
    save went on in the background (a `CheckpointManager` must not remove what
    that save is writing)."""
    group = _multihost.Group()
    # Every process reaches this first barrier, even one whose tree is bad, so
    # that a failure anywhere fails the save everywhere at once.
    pending: list[_write.Pending] = []
    held: Callable[[], tuple[list[Any], _tree.Names]] | None = None
    error: BaseException | None = None
    try:
        _layout.check(layout)
        overwrite = check_flag("overwrite", overwrite, "whether to replace a checkpoint already there")
        blocking = check_flag("blocking", blocking, "`False` saves in the background")
        cast_fn = _write.cast_function(cast)
        if not blocking and group.count == 1:
            held = _hold(pytree, filter_spec, is_leaf)
        if held is None:
            # A custom filter spec is given every leaf's key path (in its `handle`).
            custom = filter_spec is not default_serialise_filter_spec
            leaves, names = _tree.flatten_named(pytree, is_leaf, keypaths=custom)
            specs = _tree.leaf_specs(filter_spec, pytree, is_leaf, count=len(leaves))
            pending = _collect(loc, leaves, names, specs, cast_fn)
            if group.count == 1:
                _assign_packs(pending)
            if not blocking:
                _write.private_copies(pending)
        if layout == "ocdbt" and group.count > 1:
            raise CheckpointValueError(
                f"`layout='ocdbt'` is not supported with {group.count} JAX processes: one "
                f"OCDBT database has a single writer. Save with `layout='directories'`.",
                path=loc.display,
            )
    except Exception as e:
        error = e
    error = group.sync("prepared", error)
    if error is not None:
        raise error
    options: dict[str, Any] = dict(overwrite=overwrite, layout=layout, metrics=metrics, progress=progress)
    exclusive = _lease.acquire_exclusive(loc)
    handoff = handoff if handoff is not None else Handoff()
    tx: _transaction.Transaction | None = None
    tracker: Tracker | None = None
    try:
        if held is not None:
            # Every array is safe on the host already: the records, the transaction and
            # the writes all happen in the background.
            run = functools.partial(_prepare_and_write, loc, group, held, cast_fn, **options)
            return _start_background(run, exclusive, handoff)
        batch = _write.Batch(pending, made=[leaves, names.paths, names.records])
        tx, tracker = _begin_save(loc, group, batch, **options)
        run = functools.partial(_write_and_commit, tx, group, batch, metrics=metrics, tracker=tracker)
        if blocking:
            with tracker:
                run()
            exclusive.release()
            return None
        # Every array is safe on the host already (a jax.Array's host data never
        # changes; NumPy arrays were copied): everything else happens in the background.
        return _start_background(functools.partial(_with_tracker, tracker, run), exclusive, handoff)
    except BaseException:
        # A failure, or an interrupt between any two lines: unless a background
        # thread has taken the save over, what was begun is undone (or, once
        # committed, left whole) and the destination handed back, so that nothing
        # kept alive by this exception's traceback holds the lease.
        if handoff.take_back():
            if tx is not None:
                _stop(tx, group)
            if tracker is not None:
                tracker.close()
            exclusive.release()
        raise


def _hold(pytree: Any, filter_spec: Any, is_leaf: Any) -> Callable[[], tuple[list[Any], _tree.Names]] | None:
    """For an asynchronous save with the default filter spec, what the caller
    must wait for: every leaf's host data held (NumPy arrays copied, each
    `jax.Array`'s host data taken, so that a later donation or change cannot
    reach the save). Returns what the background calls for the leaves and
    their names. `None` when the tree needs the caller's thread: a custom
    filter spec or `is_leaf`, or a leaf whose error should be raised at once.

    The key paths are the structure's, never the caller's tree's (which the
    caller may change once this returns): rebuilt in the background from the
    structure when its nodes rebuild without code of the user's
    (`_tree.names_from_structure`), else taken here (a custom node's constructor
    must not run in the background, on arrays the caller may have deleted by
    then). Ten thousand leaves flatten in 11 ms, and in 19 ms with their key
    paths."""
    if filter_spec is not default_serialise_filter_spec or is_leaf is not None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(pytree)
    keypaths = None
    if not _tree.rebuilds_plainly(treedef):
        keypaths = [keypath for keypath, _ in _tree.flatten(pytree, None)[0]]
    held: list[Any] = []
    copied: list[int] = []  # NumPy leaves, copied once all are found
    kinds, one_device = _write.array_kind, jax.sharding.SingleDeviceSharding
    try:
        for x in leaves:
            kind = kinds(type(x))
            if kind == "jax":
                if type(x.sharding) is one_device:
                    # The common leaf, kept short (the caller waits for ten
                    # thousand of these): its host view, made a `Held` later.
                    try:
                        held.append(np.asarray(x))
                        continue
                    except TypeError:
                        pass  # a PRNG key array, whose key data is held below
                x = _write.hold(x, True)
            elif kind == "numpy" or (kind == "ndarray" and not isinstance(x, np.ma.MaskedArray)):
                copied.append(len(held))
            elif kind in ("ndarray", "abstract"):  # a masked array's error is raised at once
                return None
            held.append(x)
        for i, copy in zip(copied, _memory.private_copies([held[i] for i in copied]), strict=True):
            held[i] = copy
    except Exception:
        return None  # a leaf that cannot be held (a deleted array): the caller's thread names it

    def flat() -> tuple[list[Any], _tree.Names]:
        names = _tree.names_from_keypaths(keypaths) if keypaths is not None else _tree.names_from_structure(treedef)
        out = []
        for x, data in zip(leaves, held, strict=True):
            if type(data) is np.ndarray and kinds(type(x)) == "jax":
                data = _write.Held(x, x, [((), data)])
            out.append(data)
        return out, names

    return flat


def _default_or_held(handle: LeafHandle, x: Any) -> None:
    if isinstance(x, _write.Held):
        handle.write(x)
    else:
        default_serialise_filter_spec(handle, x)


@_gc.gc_paused()  # as `save` is, for the part of it that runs here
def _prepare_and_write(
    loc: Location,
    group: _multihost.Group,
    held: Callable[[], tuple[list[Any], _tree.Names]],
    cast: Any,
    **options: Any,
) -> None:
    """The background part of an asynchronous save whose leaves were held (`_hold`)."""
    leaves, names = held()
    pending = _collect(loc, leaves, names, [_default_or_held] * len(leaves), cast)
    _assign_packs(pending)
    batch = _write.Batch(pending, made=[leaves, names.paths, names.records])
    tx, tracker = _begin_save(loc, group, batch, **options)
    with tracker:
        _write_and_commit(tx, group, batch, metrics=options["metrics"], tracker=tracker)


def _assign_packs(pending: list[_write.Pending]) -> None:
    _pack.assign([p.record for p in pending], [p.pieces for p in pending])


def _begin_save(
    loc: Location,
    group: _multihost.Group,
    batch: _write.Batch,
    *,
    overwrite: bool,
    layout: str,
    metrics: dict[str, Any] | None,
    progress: Progress,
) -> tuple[_transaction.Transaction, Tracker]:
    if layout == "directories":
        _untrusted.check_path_lengths(loc, [p.record for p in batch.own])
    tracker = Tracker(progress, leaves=len(batch.pending), nbytes=batch.nbytes, what="save")
    try:
        with _storage_errors.explained(loc, "Saving checkpoint"):
            packs = [pack.name for pack, _ in batch.packs]
            paths = [p.record.path for p in batch.own]
            tx = _begin(group, loc, overwrite=overwrite, layout=layout, paths=paths, packs=packs)
    except BaseException:
        tracker.close()
        raise
    return tx, tracker


def _with_tracker(tracker: Tracker, run: Callable[[], None]) -> None:
    with tracker:
        run()


def _start_background(run: Callable[[], None], exclusive: _lease.Claim, handoff: Handoff) -> PendingSave:
    """Run `run` in a new thread, which owns the save once it claims `handoff`;
    until then, the caller's `handoff.take_back()` undoes it instead."""
    # The collector stays paused from the caller's part to the background part
    # (the pause is adopted by the background thread, or ended by whichever
    # side owns the save): enabled in between, it would walk the objects just
    # made before the caller gets its thread back (10 ms of an asynchronous
    # save of ten thousand leaves).
    pause = _gc.GcPause()
    try:
        pause.begin(None)  # until the background thread adopts it, or either side ends it
        exclusive.hand_over()
        handoff.begun = True
        return PendingSave(functools.partial(_in_background, run, exclusive, handoff, pause))
    except BaseException:
        if handoff.take_back():
            pause.resume()
        raise


def _in_background(run: Callable[[], None], exclusive: _lease.Claim, handoff: Handoff, pause: _gc.GcPause) -> None:
    if not handoff.claim():
        pause.resume()
        return  # the caller took the save back before this thread began
    try:
        pause.adopt()
        run()
    finally:
        exclusive.release()
        pause.resume()


class Handoff:
    """Who finishes an asynchronous save: the background thread, once it
    begins, or the caller, if it is interrupted before then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = ""
        self.begun = False  # whether a background thread was (about to be) started

    def claim(self) -> bool:
        with self._lock:
            self._owner = self._owner or "background"
            return self._owner == "background"

    def take_back(self) -> bool:
        with self._lock:
            self._owner = self._owner or "caller"
            return self._owner == "caller"

    def in_background(self) -> bool:
        """Whether, once `save` has returned or raised, its background thread owns
        the save (or will when it starts): it commits it or removes what it
        wrote, and nothing else may."""
        with self._lock:
            return self.begun and self._owner != "caller"


def _write_and_commit(
    tx: _transaction.Transaction,
    group: _multihost.Group,
    batch: _write.Batch,
    *,
    metrics: dict[str, Any] | None,
    tracker: Tracker,
) -> None:
    """Write every array, make it durable, then commit once (process 0). Before
    the commit, any failure or interrupt deletes what this save wrote; after it,
    nothing undoes the save."""
    commits: list[Any] = []
    error: BaseException | None = None
    encoded: list[bytes] = []
    try:
        try:
            writing = _write.start_writes(tx, batch, group, tracker=tracker, out=commits)
        except Exception as e:
            error, writing = e, []
        if error is None and group.primary:
            # While the data is being written (the manifest of ten thousand
            # leaves takes about 25 ms to encode).
            error = _write.attempt(lambda: encoded.append(_manifest_bytes(tx, batch, metrics)))
        batch.free()
        _write.follow(writing, tracker)
        tracker.describe("save: committing")
        error = _write.wait_all(commits, error)
        # Each process makes its own writes durable; only then may process 0 commit.
        error = error or _write.attempt(lambda: _durable.flush(tx.data))
        error = group.sync("written", error)
        if error is None and group.primary:
            tx.written()
            error = _write.attempt(lambda: tx.commit(encoded[0]))
        error = group.sync("committed", error)
        if error is None:
            if group.primary:
                # Inside the `try`: an interrupt from here on still leaves the
                # checkpoint whole and hands the lease back (`_stop`).
                tx.clean()
            return
    except BaseException:
        # An interrupt (KeyboardInterrupt, SystemExit): undo only what is not committed.
        _write.settle(commits)
        _stop(tx, group)
        raise
    _write.settle(commits)
    _stop(tx, group)
    if isinstance(error, CheckpointError):
        raise error
    display = tx.loc.display
    message = f"Saving checkpoint {display!r} failed, and nothing was committed: {error}"
    refused = _storage_errors.write_refusal(error)
    if refused is not None:
        # The storage would not take the save: no leaf is at fault.
        message = message.rstrip(". ") + (
            ". Check that you may write there (credentials, permissions), that it has free space and that the "
            "storage works, then save again."
        )
        raise refused(message, path=display) from error
    raise LeafError(message, path=display) from error


def _manifest_bytes(tx: _transaction.Transaction, batch: _write.Batch, metrics: dict[str, Any] | None) -> bytes:
    packs = [pack for pack, _ in batch.packs]
    manifest = _manifest.new_manifest(
        batch.records(), tx.target, tx.layout, commit=tx.commit_id, metrics=metrics, packs=packs
    )
    return manifest.to_bytes()


def _stop(tx: _transaction.Transaction, group: _multihost.Group) -> None:
    if not group.primary:
        return
    if tx.state in (_transaction.State.COMMITTED, _transaction.State.CLEANED):
        tx.leave()
    else:
        tx.abort()


def _begin(
    group: _multihost.Group, loc: Location, *, overwrite: bool, layout: str, paths: list[str], packs: list[str]
) -> _transaction.Transaction:
    """Process 0 begins the transaction; the others then join it."""
    if group.primary:
        try:
            tx = _transaction.begin(loc, overwrite=overwrite, layout=layout, paths=paths, packs=packs)
        except BaseException as e:
            group.sync("begin", e)
            raise
        group.sync("begin", None)  # only this process can fail at `begin`, and it did not
        error = group.sync("joined", None)
        if error is not None:
            tx.abort()
            raise error
        return tx
    error = group.sync("begin", None)
    if error is not None:
        raise error
    try:
        tx = _transaction.join(loc)
    except BaseException as e:
        group.sync("joined", e)
        raise
    error = group.sync("joined", None)
    if error is not None:
        raise error
    return tx


def _collect(loc: Location, leaves: list[Any], names: _tree.Names, specs: list[Any], cast: Any) -> list[_write.Pending]:
    """Run the filter specs over the leaves; nothing is written yet, so a bad leaf
    leaves the destination untouched."""
    paths, records = names.paths, names.records
    _tree.check_unique(names, checkpoint=loc.display)
    primary = jax.process_index() == 0
    # What the default spec does with the common leaf, without the calls between
    # (in one loop when every leaf has the default spec).
    defaults = [spec is default_serialise_filter_spec or spec is _default_or_held for spec in specs]
    commons = None
    if cast is None and all(defaults):
        commons = _write.plain_leaves(leaves, paths, records, primary)
        if not any(common is None for common in commons):
            return commons  # type: ignore[return-value]
    record_of = dict(zip(paths, records))
    pending: list[_write.Pending] = []

    written: set[str] = set()
    collecting = True  # until the specs have run: `pending` is then the save's, and final

    def write(handle: LeafHandle, value: Any) -> None:
        if not collecting:
            raise handle.error(
                "`handle.write` was called after the filter spec returned: the save has already "
                "begun (or finished) with what the filter spec wrote while it ran, without this value.",
                "Call `handle.write` inside the filter spec, while `tree_serialise_leaves` runs it.",
            )
        if handle.path in written:
            raise handle.error(
                "the filter spec wrote it twice; a checkpoint holds one value per leaf.",
                "Call `handle.write` once for each leaf (or not at all, to leave it out).",
            )
        written.add(handle.path)
        keypath = record_of.get(handle.path) or _keypath.to_json(handle.keypath)
        pending.append(_write.prepare(handle, value, cast, primary=primary, keypath=keypath))

    try:
        for i, (leaf, dotted, record, spec) in enumerate(zip(leaves, paths, records, specs, strict=True)):
            default = defaults[i]
            try:
                if cast is None and default:
                    common = commons[i] if commons is not None else _write.plain(leaf, dotted, record, primary)
                    if common is not None:
                        pending.append(common)
                        continue
                handle = LeafHandle(names.keypath(i), dotted, loc.display, write=write)
                if default and _is_array(leaf):
                    pending.append(_write.prepare(handle, leaf, cast, primary=primary, keypath=record))
                else:
                    spec(handle, leaf)
            except CheckpointError:
                raise
            except Exception as e:
                raise _leaf_failed(e, loc, names.keypath(i), dotted, leaf) from e
    finally:
        # A handle kept past this point (and written through later) must not
        # add a leaf the manifest would list and no write would store.
        collecting = False
    return pending


def _leaf_failed(error: Exception, loc: Location, keypath: tuple[Any, ...], dotted: str, leaf: Any) -> LeafError:
    """The error of a leaf that could not be prepared (the filter spec raised)."""
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        what = (
            "it is a deleted `jax.Array` (deleted, or donated to a function compiled with "
            "`donate_argnums`): its values are gone."
        )
        fix = "Save the arrays before they are donated, or save the ones the donating function returned."
    else:
        what, fix = f"the filter spec raised {type(error).__name__}: {error}", ""
    message = leaf_message(what, keypath=keypath, dotted=dotted, path=loc.display, fix=fix)
    return LeafError(message, path=loc.display, keypaths=[keypath], dotted=[dotted])


def _is_array(x: Any) -> bool:
    """Whether the default spec writes `x` as it is: a NumPy or JAX array, or a
    held one (a tracer too: writing it raises the error it should)."""
    return type(x) is np.ndarray or type(x) is _write.Held or isinstance(x, jax.Array)
