"""`tree_serialise_leaves`: collect -> plan -> write -> commit.

Each step is one function here (`_collect`, `_plan`, `_write_all`, `_commit`);
docs/architecture.md, "The story of a save", names the module behind each.
An asynchronous save returns once its arrays are safe on the host
(`_background`); with the default filter spec it plans in the background too.

With several JAX processes, each runs this story with the same tree and writes
the pieces it holds (`_multihost.writes`, `_sharding`); process 0 alone runs
the transaction, creates the arrays and writes the manifest. They meet at six
barriers (`Stages`, through `_multihost.Group.sync`), each of which carries any
process's error to all:

1. `prepared`: every process planned the same save (`_multihost.differing`);
2. `begin`: process 0 has begun the transaction...
3. `joined`: ...and every other process has joined it;
4. `created`: process 0 has created the arrays; the others open them;
5. `written`: every process has written and synced its pieces; process 0
   commits...
6. `committed`: ...and, once every process knows it did, cleans up.

A save of one process (`Stages.alone`) is a group of one. Only such a save
packs small leaves, plans in the background, shares chunk files with an
earlier save, writes chunk files itself, or uses the OCDBT layout (one
database has a single writer).

A process's own part of a local tier's step (`SaveOptions.part`) is a save of
its own directory: every process begins, creates and commits its own, and
the processes meet only at stage 1 (every part's manifest then records every
process's iterator states) and at stages 5 and 6, so that a part is committed
in each process only where every process wrote its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .._base import _faults, _gc, _interrupts, _keypath, _tree
from .._base._errors import (
    CheckpointConnectionError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTypeError,
    CheckpointValueError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IntegrityError,
    LeafError,
    check_flag,
)
from .._base._handle import LeafHandle
from .._base._location import Location, location, writable
from .._base._progress import Progress, Tracker
from .._hosts import _multihost
from .._load._lazy import LazyArray
from .._ondisk import _dtypes, _format, _iterators, _layout, _manifest, _structure
from .._sources import _source
from .._store import _chunk_files, _durable, _lease, _share, _storage_errors, _transaction, _untrusted
from . import _background, _partial, _records, _staging
from ._background import Handoff, PendingSave


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
    if _dtypes.leaf_type(x) is not None or isinstance(x, (LazyArray, _records.Unread)):
        handle.write(x)


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """A save's options, made once where the save is asked for, then passed
    whole. The first eight and `compression` are `tree_serialise_leaves`' own.
    Only a `CheckpointManager` passes the others: `metrics` (committed in the
    manifest); `handoff` (whether an asynchronous save went on in the
    background); `follows` (the previous step, whose unchanged chunk files
    this save shares where the destination holds none); `followed` (a later
    save follows this one: record each chunk file's digest, `_share`).
    A merge passes `structure` (the structure record to commit, made from the
    paths of the leaves written) and `keypaths` (each leaf's key path record,
    by dotted path): its first input's, whose tree it saves as nested dicts.
    A tiered manager with several processes passes `part`: the save is this
    process's own part of a local step (see the module docstring)."""

    overwrite: Any = True
    blocking: Any = True
    cast: Any = None
    layout: str = "directories"
    progress: Progress = None
    where: Callable[[PyTree], Any] | None = None
    share: Any = True
    staging_bytes: int | None = None
    metrics: dict[str, Any] | None = None
    handoff: Handoff | None = None
    follows: Location | None = None
    followed: bool = False
    compression: Any = None
    structure: Callable[[set[str]], Any] | None = None
    keypaths: Mapping[str, list[list[Any]]] | None = None
    part: bool = False


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
    where: Callable[[PyTree], Any] | None = None,
    share: bool = True,
    staging_bytes: int | None = None,
    compression: bool | str | None = None,
) -> PendingSave | None:
    """Save the leaves of a PyTree as a checkpoint directory.

    Every array leaf is stored as a zarr v3 array, found by its key path:

    - a large leaf in a folder of its own named after it
      (`model.layers.0.weight` -> `model/layers/0/weight/`);
    - leaves of at most 1 MiB packed, several to one zarr v3 array per dtype,
      at offsets the manifest records (see
      [docs/format.md](../format.md#small-leaves-packs)).

    A `manifest.json` written last commits the checkpoint.

    **Arguments:**

    - `path`: the checkpoint directory (`str` or `pathlib.Path`), or a TensorStore
        kvstore URL (`memory://`, `file://`, `s3://`, `gs://`), or a kvstore spec `dict` (for an
        S3 `endpoint` and other options a URL cannot carry; see [docs/storage.md](../storage.md)). An `s3://`
        location without an `endpoint` uses `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` when set.
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
        needs no copy). With the default `filter_spec`, all the rest goes on in
        the background, and an error (a leaf that cannot be saved, say) is
        raised by its `wait()`. Call `wait()` before relying on the checkpoint.
        A later save to the same `path` first waits for this one.
    - `cast`: store some arrays in another dtype: a mapping from dtype to dtype
        (`{jnp.float32: jnp.bfloat16}`) or a callable `(dotted_path, dtype) ->
        dtype | None`. The manifest records both dtypes. A load into `like`
        leaves of either dtype needs no `cast=True`. Values change only by
        rounding to a narrower float: a float with a fraction into an integer
        dtype, an integer that does not fit, NaN or infinity into an integer
        are errors naming the leaf, and nothing is written.
    - `layout`: `"directories"` (one folder per leaf, readable by any zarr v3
        tool) or `"ocdbt"` (every array in one TensorStore OCDBT database: a few
        files instead of two per leaf, for trees of many small leaves; one
        process only). Loads need not be told. See [docs/scaling.md](../scaling.md).
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and the save is large; `False` hides it, `True`
        always shows it. A callable is called as `progress(leaves_done,
        leaves_total, bytes_done, bytes_total)` as the bytes are written (on a
        local disk a chunk file at a time; elsewhere as each leaf's data is
        handed to TensorStore); the durable commit follows.
    - `where`: a partial save. A callable that picks nodes of `pytree`, as in
        `eqx.tree_at` (`where=lambda t: t["head"]`, or a tuple of nodes): the
        stored sub-tree at each picked node's path is replaced by that node
        (whose structure may differ), and every other stored leaf is kept. The
        rest of `pytree` is never looked at (it may be abstract). The checkpoint
        at `path` must exist; the save is atomic like any overwrite. See
        [docs/format.md](../format.md#incremental-and-partial-saves).
    - `share`: an overwrite on a local disk shares the chunk files whose bytes
        did not change with the checkpoint it replaces (hard links; see
        [docs/format.md](../format.md#incremental-and-partial-saves)); with
        `False`, every chunk is written in full and no file is shared.
    - `staging_bytes`: the most host memory, in bytes, the save stages at a
        time. Each piece of a leaf (a `jax.Array`'s data copied to the host, a
        cast, a shard's slice) is made as the writes reach it and freed once
        written. By default a quarter of this machine's memory (at least 64
        MiB; at most 1 GiB in a process with an accelerator). A piece larger
        than the budget is staged alone. An asynchronous save also holds what
        keeps the caller's arrays safe (see `blocking`). See
        [docs/scaling.md](../scaling.md#host-memory-of-a-save).
    - `compression`: compress every chunk losslessly, with one of zarr v3's own
        codecs (written in each array's `zarr.json`, so zarr tools still read
        it): `"blosc-lz4"` (or `True`), `"blosc-zstd"` or `"zstd"`. Off by
        default (`None`). Reading it needs an eqx_ckpt that knows format
        version 6. See [docs/format.md](../format.md#compression).

    With `jax.distributed` initialised, call this in every process with the same
    tree: each writes its own shards, and the checkpoint is committed once all have finished.

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
    options = SaveOptions(
        overwrite=overwrite,
        blocking=blocking,
        cast=cast,
        layout=layout,
        progress=progress,
        where=where,
        share=share,
        staging_bytes=staging_bytes,
        compression=compression,
    )
    return save(writable(location(path), "`tree_serialise_leaves`"), pytree, filter_spec, is_leaf, options)


# A save makes many small objects and frees them again: Python's cyclic
# collector, triggered by their count, would walk them all repeatedly.
@_gc.gc_paused()
def save(
    loc: Location,
    pytree: PyTree,
    filter_spec: Any,
    is_leaf: Callable[[Any], bool] | None,
    options: SaveOptions,
) -> PendingSave | None:
    """`tree_serialise_leaves` at `loc`, with its (or a manager's step's) `options`."""
    stages = Stages(part=options.part)
    share = check_flag("share", options.share, "`False` writes every chunk in full")
    overwrite, blocking, cast, budget, planned, expected, iterators = _collect_and_plan(
        loc, stages, pytree, filter_spec, is_leaf, options
    )
    begin: dict[str, Any] = dict(overwrite=overwrite, layout=options.layout, progress=options.progress)
    exclusive = _lease.acquire_exclusive(loc)
    handoff = options.handoff if options.handoff is not None else Handoff()
    tx: _transaction.Transaction | None = None
    tracker: Tracker | None = None
    how = _Save(stages, options.metrics, options.follows, share, options.followed, budget, iterators)
    try:
        if not isinstance(planned, _staging.Batch):  # held leaves: planned in the background too
            compression = compression_of(options.compression)
            run = functools.partial(_plan_write_and_commit, loc, how, planned, cast, compression, **begin)
        else:
            check = None if expected is None else functools.partial(_partial.check_unreplaced, commit=expected)
            tx, tracker = _begin(loc, stages, planned, check=check, **begin)
            run = functools.partial(_write_and_commit, tx, how, planned, tracker)
            if blocking:
                run()
                exclusive.release()
                return None
        # Every array is safe on the host already (a jax.Array's host data never
        # changes; NumPy arrays were copied): everything else happens in the background.
        return _background.start(run, exclusive, handoff)
    except BaseException as e:
        # A failure, or an interrupt between any two lines: unless a background
        # thread has taken the save over, what was begun is undone (or, once
        # committed, left whole) and the destination handed back, so that nothing
        # kept alive by this exception's traceback holds the lease.
        if handoff.take_back():
            if tx is not None:
                stages.stop(functools.partial(_stop, tx))
            if tracker is not None:
                tracker.close()
            exclusive.release()
        refused = getattr(planned, "refused", None)
        if isinstance(e, IntegrityError) and refused is not None:
            raise refused(e) from e
        raise


def _collect_and_plan(
    loc: Location,
    stages: Stages,
    pytree: PyTree,
    filter_spec: Any,
    is_leaf: Callable[[Any], bool] | None,
    options: SaveOptions,
) -> tuple[
    bool,
    bool,
    Callable[[str, np.dtype], Any] | None,
    int,
    _staging.Batch | _background.HeldLeaves,
    str | None,
    list[_iterators.IteratorRecord],
]:
    """The options checked (returned as `save` uses them), then the leaves
    collected and planned, or held to be planned in the background
    (`_background.hold_tree`); for a partial save (`where`), the commit
    of the checkpoint whose leaves it keeps; last, the iterator states, taken
    now (`_iterators`). Every process then meets the others at the first
    stage, whatever its outcome, and gives process 0 its iterator states."""
    planned: _staging.Batch | _background.HeldLeaves | None = None
    expected: str | None = None
    error: BaseException | None = None
    captured: _iterators.Captured = []
    kept: tuple[_iterators.IteratorRecord, ...] = ()
    try:
        _layout.check(options.layout)
        overwrite = check_flag("overwrite", options.overwrite, "whether to replace a checkpoint already there")
        blocking = check_flag("blocking", options.blocking, "`False` saves in the background")
        cast = _records.cast_function(options.cast)
        compression = compression_of(options.compression)
        reserved = _chunk_files.compressing_bytes() if compression else 0  # within the budget
        budget = max(_staging.budget(options.staging_bytes) - reserved, 1)
        plan = functools.partial(
            _plan, loc, stages, private=not blocking, step=options.followed, compression=compression
        )
        if options.where is not None:
            default = default_serialise_filter_spec
            partial = _partial.collect(
                loc, pytree, options.where, filter_spec, is_leaf, cast, overwrite=overwrite, default=default
            )
            try:
                planned = plan(partial.leaves, partial.names, partial.specs, partial.cast, structure=partial.structure)
            except IntegrityError as e:
                raise partial.kept_damaged(e, loc) from e
            partial.keep_chunks(planned.pending)
            # A kept leaf is read as the save stages it: found damaged then, the refusal says so too.
            planned.refused = functools.partial(partial.kept_damaged, loc=loc)
            expected, kept = partial.commit, partial.iterators
            captured = _states(loc, partial.leaves[: partial.new], partial.names.paths, partial.names.keypath)
        elif not blocking and stages.alone and filter_spec is default_serialise_filter_spec and is_leaf is None:
            planned = _background.hold_tree(pytree)  # planned in the background
            if planned is not None:
                flat = jax.tree_util.tree_leaves(pytree)
                captured = _states(loc, flat, None, lambda i: _tree.flatten(pytree, None)[0][i][0])
        if planned is None:
            leaves, names, specs = _collect(pytree, filter_spec, is_leaf)
            captured = _states(loc, leaves, names.paths, names.keypath)
            if options.keypaths is not None:
                names.records = [options.keypaths.get(p, r) for p, r in zip(names.paths, names.records, strict=True)]
            planned = plan(leaves, names, specs, cast, structure=options.structure)
    except Exception as e:
        error = e
    texts = stages.prepared(error, planned, layout=options.layout, loc=loc, states=_iterators.to_text(captured))
    assert planned is not None
    iterators = _iterators.records(texts, stages.processes, kept, loads=_manifest.loads_file) if stages.primary else []
    return overwrite, blocking, cast, budget, planned, expected, iterators


def _states(
    loc: Location, leaves: list[Any], paths: list[str] | None, keypath: Callable[[int], tuple[Any, ...]]
) -> _iterators.Captured:
    """This process's state of every iterator among `leaves`, named by their
    dotted `paths` (made from `keypath` where `None`), taken now."""
    at = _iterators.found(leaves)
    keypaths = [keypath(i) for i in at]
    dotted = [paths[i] for i in at] if paths is not None else [_keypath.dotted(k) for k in keypaths]
    return _iterators.capture([leaves[i] for i in at], keypaths, dotted, checkpoint=loc.display)


def compression_of(value: Any) -> str:
    """The `compression` option as one of `_format.COMPRESSIONS`, or "" for none."""
    if value is None or value is False:
        return ""
    if value is True:
        return _format.DEFAULT_COMPRESSION
    if isinstance(value, str) and value in _format.COMPRESSIONS:
        return value
    names = ", ".join(f'"{name}"' for name in _format.COMPRESSIONS)
    error = CheckpointValueError if isinstance(value, str) else CheckpointTypeError
    raise error(f"`compression` must be None, True or one of {names}, not {value!r}.")


def _collect(
    pytree: PyTree, filter_spec: Any, is_leaf: Callable[[Any], bool] | None
) -> tuple[list[Any], _tree.Names, list[Any]]:
    """The leaves of `pytree`, their names, and each one's filter spec."""
    # A custom filter spec is given every leaf's key path (in its `handle`).
    custom = filter_spec is not default_serialise_filter_spec
    leaves, names = _tree.flatten_named(pytree, is_leaf, keypaths=custom)
    return leaves, names, _tree.leaf_specs(filter_spec, pytree, is_leaf, count=len(leaves))


def _plan(
    loc: Location,
    stages: Stages,
    leaves: list[Any],
    names: _tree.Names,
    specs: list[Any],
    cast: Callable[[str, np.dtype], Any] | None,
    *,
    private: bool,
    structure: Callable[[set[str]], Any] | None = None,
    step: bool = False,
    compression: str = "",
) -> _staging.Batch:
    """What the save writes: each leaf's record and host pieces (from the
    filter specs, or a kept `_records.Plan`), the packs of small leaves, and
    the structure record (a partial save's made by `structure`). `private`:
    protect the data from an asynchronous save's caller (`_staging.protect`);
    `step`: a manager's step, packed in chunks small enough to share."""
    default = default_serialise_filter_spec
    # Records kept from a save of this structure serve a save of one process, not cast, not partial.
    keeps = stages.alone and cast is None and structure is None
    kept = functools.partial(_records.reuse, names, leaves, specs, default=default)
    plan = kept(for_steps=step, compression=compression) if keeps else None
    if plan is not None:
        _faults.fire("save.records", loc)
        _faults.fire("save.records_reused", loc)
        arrays = plan.arrays(leaves)
        pending = [_records.Pending(r, [((), x)], n) for r, x, n in zip(plan.records, arrays, plan.nbytes, strict=True)]
    else:
        pending = _records.build(
            loc, leaves, names, specs, cast, default=default, compression=compression, part=stages.part
        )
        if stages.alone:
            records, pieces = [p.record for p in pending], [p.pieces for p in pending]
            _records.assign(records, pieces, for_steps=step, compression=compression)
        if keeps:
            plan = _records.remember(names, leaves, pending, for_steps=step, compression=compression)
    if private:
        _staging.protect(pending)
    if structure is not None:
        record = structure({p.record.path for p in pending})
    else:
        # A leaf is written once at most, by its own name: as many written as named is every one.
        count = len(names.paths)
        stored = {p.record.path for p in pending} if len(pending) != count else None
        saved = [True] * count if stored is None else [path in stored for path in names.paths]
        record = _structure.record(names.treedef, leaves, saved, names.records)
    return _staging.Batch(pending, made=[leaves, names.paths, names.records], structure=record, plan=plan)


@_gc.gc_paused()  # as `save` is, for the part of it that runs here
def _plan_write_and_commit(
    loc: Location,
    how: _Save,
    held: _background.HeldLeaves,
    cast: Callable[[str, np.dtype], Any] | None,
    compression: str,
    **options: Any,
) -> None:
    """The background part of an asynchronous save whose leaves were held (`_background.hold_tree`)."""
    _faults.fire("save.held", loc)
    leaves, names = held()
    specs = [default_serialise_filter_spec] * len(leaves)
    batch = _plan(
        loc, how.stages, leaves, names, specs, cast, private=False, step=how.followed, compression=compression
    )
    tx, tracker = _begin(loc, how.stages, batch, **options)
    _write_and_commit(tx, how, batch, tracker)


def _begin(
    loc: Location,
    stages: Stages,
    batch: _staging.Batch,
    *,
    overwrite: bool,
    layout: str,
    progress: Progress,
    check: Callable[[_transaction.Transaction], None] | None = None,
) -> tuple[_transaction.Transaction, Tracker]:
    """Begin the transaction with every process (`check` may refuse it), and the progress report."""
    if layout == "directories":
        _untrusted.check_path_lengths(loc, [p.record for p in batch.own])
    packs, paths = [pack.name for pack, _ in batch.packs], [p.record.path for p in batch.own]

    def begin() -> _transaction.Transaction:  # aborted where `check` refuses it
        tx = _transaction.begin(loc, overwrite=overwrite, layout=layout, paths=paths, packs=packs)
        if check is not None:
            try:
                check(tx)
            except BaseException:
                tx.abort()
                raise
        return tx

    tracker = Tracker(progress, leaves=len(batch.pending), nbytes=batch.nbytes, what="save")
    try:
        with _storage_errors.explained(loc, "Saving checkpoint"):
            tx = stages.begin(begin, functools.partial(_transaction.join, loc))
    except BaseException:
        tracker.close()
        raise
    return tx, tracker


def _write_and_commit(tx: _transaction.Transaction, how: _Save, batch: _staging.Batch, tracker: Tracker) -> None:
    """Write every array, make it durable, then commit once (`Stages`). Before
    the commit, any failure or interrupt deletes what this save wrote; after it,
    nothing undoes the save. The progress report (`tracker`) ends with it."""
    with tracker:
        commits: list[Any] = []
        stages = how.stages
        try:
            error, encoded = _write_all(tx, how, batch, tracker, commits)
            error = stages.commit(error, functools.partial(_commit, tx, encoded), tx.clean)
            if error is None:
                return
        except BaseException:
            # An interrupt (KeyboardInterrupt, SystemExit): undo only what is not committed.
            _interrupts.settle(commits)
            stages.stop(functools.partial(_stop, tx))
            raise
        _interrupts.settle(commits)
        stages.stop(functools.partial(_stop, tx))
        if isinstance(error, CheckpointError):
            raise error
        display = tx.loc.display
        message = f"Saving checkpoint {display!r} failed, and nothing was committed: {error}"
        refused = _storage_errors.write_refusal(error)
        if refused is CheckpointConnectionError:
            raise refused(f"{message.rstrip('. ')}. {_storage_errors.REACH}", path=display) from error
        if refused is not None:
            # The storage would not take the save: no leaf is at fault.
            message = message.rstrip(". ") + (
                ". Check that you may write there (credentials, permissions), that it has free space and that the "
                "storage works, then save again."
            )
            raise refused(message, path=display) from error
        raise LeafError(message, path=display) from error


def _write_all(
    tx: _transaction.Transaction, how: _Save, batch: _staging.Batch, tracker: Tracker, out: list[Any]
) -> tuple[BaseException | None, list[bytes]]:
    """Create the arrays, write this process's pieces within the staging
    budget (`_staging`) and make them durable, while the process that commits
    encodes the manifest; the first error, and the manifest's bytes. Puts in
    `out` the futures an abort must wait for."""
    error: BaseException | None = None
    encoded: list[bytes] = []
    stages = how.stages
    try:
        share = how.share and stages.alone
        base = _base(tx, how.follows) if share else None
        _faults.fire("save.start_writes", tx.loc)
        data = tx.data
        opens = stages.create(
            functools.partial(_staging.create, data, batch), functools.partial(_staging.open_arrays, data, batch)
        )
        save = _chunk_files.Save(stages.processes, tx.layout, base, share and how.followed)
        writing = _staging.start_writes(data, batch, opens, save, budget=how.staging, tracker=tracker, out=out)
    except Exception as e:
        error, writing = e, None
    if error is None and stages.primary:
        # Encoded while the data is written: for many leaves, a noticeable part of a save.
        error = _interrupts.attempt(lambda: encoded.append(_manifest_bytes(tx, batch, how)))
    batch.free()
    if writing is not None:
        if error is not None:
            writing.stop()
        followed = writing.follow(tracker)
        error = error or followed
    tracker.describe("save: committing")
    error = _interrupts.wait_all(out, error)
    # Each process makes its own writes durable; only then may process 0 commit.
    error = error or _interrupts.attempt(lambda: _durable.flush(tx.data))
    return error, encoded


class _Save(NamedTuple):
    """What the steps of one save after its plan share: its `Stages`, four of
    `SaveOptions`' fields, `staging`, its staging budget in bytes, and the
    `iterators`' states the manifest records (process 0's; empty elsewhere)."""

    stages: Stages
    metrics: dict[str, Any] | None
    follows: Location | None
    share: bool
    followed: bool
    staging: int
    iterators: list[_iterators.IteratorRecord]


def _base(tx: _transaction.Transaction, follows: Location | None) -> _share.Base | None:
    """The checkpoint whose chunk files this save may share: the one it
    replaces, else the one it `follows` (a manager's previous step: none
    where it is gone or its manifest is damaged, and that save is written in
    full). A failure to read it is the save's."""
    if tx.old is not None:
        return _base_at(tx.loc, tx.old)
    if follows is None:
        return None
    try:
        return _base_at(follows, None)
    except (CorruptCheckpointError, CheckpointVersionError, CheckpointNotFoundError):
        return None


def _base_at(loc: Location, manifest: _manifest.Manifest | None) -> _share.Base | None:
    """The checkpoint at `loc` (whose manifest is `manifest`, if read) as a
    base, opened as a load opens it; `None` where its chunk files cannot be
    shared (the OCDBT layout, or chunk files off a local disk)."""
    if manifest is not None and manifest.layout != "directories":
        return None

    def opened() -> tuple[Location, _manifest.Manifest] | None:
        source = _source.checkpoint(loc, manifest)
        return None if source is None else (source.data, source.manifest)

    return _chunk_files.chunk_files(loc).base(opened)


def _commit(tx: _transaction.Transaction, encoded: list[bytes]) -> BaseException | None:
    """Commit the manifest (`encoded`), written last in one conditional write; its error."""
    tx.written()
    return _interrupts.attempt(lambda: tx.commit(encoded[0]))


def _manifest_bytes(tx: _transaction.Transaction, batch: _staging.Batch, how: _Save) -> bytes:
    packs = [pack for pack, _ in batch.packs]
    manifest = _manifest.new_manifest(
        batch.records(),
        tx.target,
        tx.layout,
        commit=tx.commit_id,
        metrics=how.metrics,
        packs=packs,
        structure=batch.structure,
        iterators=how.iterators,
    )
    _faults.fire("commit.manifest_encode", tx.loc)
    plan = batch.plan
    if plan is None:
        return manifest.to_bytes()
    if plan.text is None:
        plan.text = _manifest.leaves_text(manifest.leaves)
    return manifest.to_bytes(leaves=plan.text)


def _stop(tx: _transaction.Transaction) -> None:
    """End the transaction: undo what was not committed, or leave what was."""
    if tx.state in (_transaction.State.COMMITTED, _transaction.State.CLEANED):
        tx.leave()
    else:
        tx.abort()


class Stages:
    """The processes saving one checkpoint (`_multihost.Group`), and the
    stages at which they meet."""

    def __init__(self, *, part: bool = False) -> None:
        self.part = part and jax.process_count() > 1
        self._group = _multihost.Group("part" if self.part else "save")

    @property
    def alone(self) -> bool:
        """Whether this is a save of one process (see the module docstring)."""
        return self._group.count == 1

    @property
    def processes(self) -> int:
        return self._group.count

    def prepared(
        self, error: BaseException | None, planned: Any, *, layout: str, loc: Location, states: str
    ) -> dict[int, str]:
        """Stage 1: raise the first error of any process (`error`: this one's),
        or say that they planned different saves; else every process's
        iterator `states` (`_iterators.to_text`), by index, for process 0."""
        if error is None and layout == "ocdbt" and not self.alone:
            error = CheckpointValueError(
                f"`layout='ocdbt'` is not supported with {self._group.count} JAX processes: one "
                f"OCDBT database has a single writer. Save with `layout='directories'`.",
                path=loc.display,
            )
        plan = _plan_digest(planned) if not self.alone and isinstance(planned, _staging.Batch) else None
        error = self._group.sync("prepared", error, plan, shared=states)
        if error is not None:
            raise error
        return self._group.gathered("prepared", states) if self.primary else {}

    def begin(
        self, begin: Callable[[], _transaction.Transaction], join: Callable[[], _transaction.Transaction]
    ) -> _transaction.Transaction:
        """Stages 2 and 3: the transaction, begun by process 0 (`begin`), joined
        by the others (`join`); aborted once one has failed to join."""
        group = self._group
        if self.part:
            return begin()
        if not group.primary:
            self._meet("begin", lambda: (None, None))
            return self._meet("joined", lambda: (join(), None))
        try:
            tx = begin()
        except BaseException as e:
            group.sync("begin", e)
            raise
        # Only this process can fail at `begin`, and it did not; a process lost
        # here is this one's error at `joined`, once `tx` can be aborted.
        group.sync("begin", None)
        error = group.sync("joined", None)
        if error is not None:
            tx.abort()
            raise error
        return tx

    def create(
        self,
        create: Callable[[], tuple[list[Any], BaseException | None]],
        open_arrays: Callable[[], list[Any]],
    ) -> list[Any]:
        """Stage 4: the futures of the opened arrays, created by process 0
        (`create`), opened by the others once they exist (`open_arrays`)."""
        if self.part:
            value, error = create()
            if error is not None:
                raise error
            return value
        if self._group.primary:
            return self._meet("created", create)
        self._meet("created", lambda: (None, None))
        return open_arrays()

    def _meet(self, stage: str, run: Callable[[], tuple[Any, BaseException | None]]) -> Any:
        """`run()`'s value, once every process has reached `stage`; raises the
        first error of any (`run`'s second value is this one's)."""
        try:
            value, error = run()
        except BaseException as e:  # the others wait for it at `stage`
            self._group.sync(stage, e)
            raise
        error = self._group.sync(stage, error)
        if error is not None:
            raise error
        return value

    @property
    def primary(self) -> bool:
        """Whether this process writes the manifest and commits: process 0, or each of a part."""
        return self.part or self._group.primary

    def commit(
        self,
        error: BaseException | None,
        commit: Callable[[], BaseException | None],
        clean: Callable[[], None],
    ) -> BaseException | None:
        """Stages 5 and 6: process 0 commits once every process has written
        (`error`: this one's failure), and cleans up once every process knows it
        did; the first error of any process."""
        group = self._group
        error = group.sync("written", error)
        if error is None and self.primary:
            error = commit()
        error = group.sync("committed", error)
        if error is None and self.primary:
            # Inside the caller's `try`: an interrupt from here on still leaves the
            # checkpoint whole and hands the lease back (`stop`).
            clean()
        return error

    def stop(self, stop: Callable[[], None]) -> None:
        """After a failure, or once the save is over: process 0 (each, for a part) ends the transaction."""
        if self.primary:
            stop()


def _plan_digest(batch: _staging.Batch) -> str:
    """What a save planned, in a few bytes: every record's path, stored shape,
    dtype and chunk grid, in order."""
    digest = hashlib.sha256()
    for p in batch.pending:
        r = p.record
        digest.update(repr((r.path, r.stored_shape, r.stored_dtype, tuple(r.chunks))).encode())
    return digest.hexdigest()
