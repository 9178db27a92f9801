"""`CheckpointManager`: one checkpoint per training step, retention, and resume.

A step (`step_<step>/`, its metrics in its manifest) exists only once its
manifest does, so an interrupted save is never reported; the next save of the
manager holding the lease (`manager.json`) removes what it left. Anything else
in the directory is never touched (docs/manager.md, "On-disk layout").
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from .._base import _faults
from .._base._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointValueError,
    CorruptCheckpointError,
    IntegrityError,
    check_flag,
)
from .._base._location import Location, location, writable
from .._base._progress import Progress
from .._foreign import _orbax
from .._hosts import _multihost
from .._load._deserialise import default_deserialise_filter_spec, deserialise
from .._load._load_plan import LoadOptions
from .._ondisk._format import MANAGER_LEASE, metrics_name as _metrics_name, step_name
from .._save import _serialise
from .._save._serialise import PendingSave, default_serialise_filter_spec
from .._store import _durable, _lease, _storage, _storage_errors
from .._store._share import IntegrityWarning
from .._store._transaction import CommitWarning
from . import _initialise, _peers, _preemption, _tiers
from ._retention import Retention, RetentionWarning, Rules, rank, recorded_best
from ._steps import (
    check_step,
    clean_interrupted,
    committed_steps,
    delete_step,
    metrics_values,
    primary,
    read_metrics,
    scan,
    show_steps,
    written_metrics,
)


def _check_peers(peers: int, stride: int) -> None:
    """Check that `peers` copies, `stride` apart, go to as many other processes."""
    count = jax.process_count()
    if count == 1:
        raise CheckpointValueError(
            f"`peers={peers}`: peers are other JAX processes, which hold copies of each process's part of a local "
            f"step, and this job has one process. Pass `peers=0`: the persistent tier holds the steps it copies."
        )
    shifts = _peers.shifts(peers, stride, count)
    if 0 in shifts or len(set(shifts)) != peers:
        raise CheckpointValueError(
            f"`peers={peers}` with `peer_stride={stride}` and {count} JAX process(es): each process's part would "
            f"not go to {peers} other processes ({', '.join(f'+{s}' for s in shifts)}, modulo {count}). Give "
            f"fewer `peers` than processes, and a `peer_stride` none of whose first {peers} multiples is a "
            f"multiple of {count}."
        )


def _outcome(save: PendingSave | None) -> BaseException | None:
    """Wait for a local tier's save in the background (if any); its error, or `None`."""
    if save is not None:
        try:
            save.wait()
        except BaseException as e:
            return e
    return None


def _one_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """A manager method that runs while no other thread runs one (`_lock`)."""

    @functools.wraps(method)
    def run(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class CheckpointManager:
    """Saves a training run as one checkpoint per step, keeps only the ones the
    retention rules ask for, and restores any of them.

    **Arguments:**

    - `directory`: the folder holding the steps (created on the first save), or a
        kvstore URL. One manager at a time writes to it. From its first `save`
        until `close()` (or the end of a `with` block, or of the process), a
        manager holds the directory's lease. A second manager's `save` (a job
        launched twice) then raises `CheckpointExistsError` instead of
        deleting the first one's steps. Restoring needs no lease.
    - `max_to_keep`: keep the `max_to_keep` highest steps (steps are ordered by
        number, as in orbax; see `delete_steps_after` to roll back).
    - `keep_every`: also keep every step with `step % keep_every == 0`.
    - `best_n`: also keep the `best_n` steps with the best value of `best_metric`.
    - `best_metric`: the name of the metric (passed to `save`) that ranks steps, for
        `best_n` and `best_step()`.
    - `best_mode`: `"min"` (the default: lower is better, as for a loss) or `"max"`.
    - `blocking`: with `False`, `save` returns once the arrays are safe on the host,
        and the writing, the commit and the deletion of old steps go on in the
        background. The next `save` (or `wait_until_finished()`) waits for it, and
        raises its error if it failed.
    - `adopt_steps`: with `True`, the retention rules apply to every step in the
        directory. By default they apply only to the steps saved under the same
        rules (by this manager, or an earlier one with the same rules: a resumed
        run); other steps stay, and a [`eqx_ckpt.RetentionWarning`][] names
        those the rules would drop (see [docs/manager.md, "Steps saved under
        other rules"](../manager.md#steps-saved-under-other-rules)).
    - `share`: on a local disk, each step shares the chunk files whose bytes
        did not change with the newest committed step (hard links, verified
        before they are shared; see [docs/manager.md](../manager.md)). With
        `False`, every step writes all of its chunks in full.
    - `local`: a directory on this host (a RAM disk such as `/dev/shm`, or a
        local disk) for a second, faster tier. Every step is saved there, and
        `save` waits only for that; every `persistent_every`-th step is then
        copied from it to `directory` in the background. With several JAX
        processes, each passes a directory on its own host, and saves its own
        part of each step there. See [docs/manager.md,
        "Tiers"](../manager.md#tiers).
    - `persistent_every`: with `local`, copy the steps with
        `step % persistent_every == 0` (and the step saved after
        `reached_preemption` answered `True`) to `directory`; every step by
        default.
    - `local_max_to_keep`: with `local`, how many of the newest steps the local
        tier keeps (besides a step still being copied); the retention rules
        above apply to `directory`.
    - `peers`: with several JAX processes and `local`, how many other
        processes hold a copy of each process's part of every local step, so
        that a host replaced by an empty one fetches its part from a peer
        (sent by JAX's collectives; see [docs/manager.md,
        "Peers"](../manager.md#peers)). `0` (the default): none.
    - `peer_stride`: process `i`'s copies go to processes `i + peer_stride`,
        `i + 2 * peer_stride`, ... (modulo their number). Set it to the number
        of processes on each host, so that every copy is on another host.

    A step survives if any rule keeps it. These always survive:

    - the latest (highest) step;
    - the step just saved;
    - the steps that live lazy leaves of this process read from
        (`restore(..., lazy=True)`), until they are gone.

    With none of `max_to_keep`, `keep_every` and `best_n` given, nothing is deleted.
    Old steps are deleted only after the new one has committed.

    With several JAX processes, every process creates a manager on the same
    (shared) directory and calls `save` with the same arguments, as for
    `tree_serialise_leaves`; process 0 alone writes metrics and deletes steps.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        manager = eqx_ckpt.CheckpointManager("run", max_to_keep=2, best_n=1, best_metric="loss")
        for step, loss in enumerate([3.0, 1.0, 2.0, 4.0]):
            manager.save(step, {"w": jnp.full(3, float(step))}, metrics={"loss": loss})
        print(manager.all_steps())   # [1, 2, 3]: step 1 is the best, 2 and 3 the last two
        state = manager.restore({"w": jnp.zeros(3)}, step=manager.best_step())
        ```
    """

    def __init__(
        self,
        directory: Any,
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        best_n: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        blocking: bool = True,
        adopt_steps: bool = False,
        share: bool = True,
        local: Any = None,
        persistent_every: int | None = None,
        local_max_to_keep: int = _tiers.LOCAL_KEEP,
        peers: int = 0,
        peer_stride: int = 1,
    ):
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every), ("best_n", best_n)):
            if value is not None and (type(value) is not int or value < 1):
                raise CheckpointValueError(f"`{name}` must be a positive int or None, not {value!r}.")
        if best_n is not None and best_metric is None:
            raise CheckpointValueError("`best_n` ranks steps by a metric: pass `best_metric`, the name of one.")
        if best_mode not in ("min", "max"):
            raise CheckpointValueError(f"`best_mode` must be 'min' or 'max', not {best_mode!r}.")
        self._loc = writable(location(directory), "A `CheckpointManager`")
        here = self._loc.local
        entry = None if here is None else _storage.local_entry(here)
        if entry is not None and entry.found and not entry.folder:
            what = "a broken symbolic link" if entry.link else "a file"
            raise CheckpointValueError(
                f"{self.directory!r} is {what}, not a directory: a CheckpointManager keeps one "
                f"folder per step in a directory. Give the path of a directory (it is created on the first save).",
                path=self.directory,
            )
        if here is not None and (orbax := _orbax.manager_steps(here)) and not any(scan(self._loc)):
            # It would report no steps, and its first save would start a new run beside orbax's.
            raise CheckpointValueError(
                f"{self.directory!r} is not an eqx_ckpt CheckpointManager's directory.{orbax} To save an "
                f"eqx_ckpt run, give the CheckpointManager another directory.",
                path=self.directory,
            )
        self.max_to_keep, self.keep_every, self.best_n = max_to_keep, keep_every, best_n
        blocking = check_flag("blocking", blocking, "`False` saves in the background")
        self.best_metric, self.best_mode, self.blocking = best_metric, best_mode, blocking
        self.adopt_steps = check_flag("adopt_steps", adopt_steps, "`True` applies retention to every step")
        self.share = check_flag("share", share, "`False` writes every chunk of every step in full")
        self._retention = Retention(self._loc)
        self._left_alone: set[str] = set()  # entries named like a step that no save wrote, warned of once
        self._pending: PendingSave | None = None
        self._pending_step: int | None = None
        # Saves and deletions from several threads take turns (a second thread's
        # save once cleaned the first's step folder away as an interrupted save).
        self._lock = threading.RLock()
        self._lease: _lease.Lease | None = None
        self._preemption = _preemption.Preemption()
        self._followed: set[int] = set()  # the steps `wait_for_new_step` returned
        # Whether this is a local tier's manager of one process of several: each
        # process then saves, keeps and deletes its own part of each step here.
        self._own_part = False
        self._init_tiers(local, persistent_every, local_max_to_keep, peers, peer_stride)

    def _init_tiers(self, local: Any, every: int | None, keep: int, peers: int, stride: int) -> None:
        for name, value in (("persistent_every", every), ("local_max_to_keep", keep), ("peer_stride", stride)):
            if value is not None and (type(value) is not int or value < 1):
                raise CheckpointValueError(f"`{name}` must be a positive int, not {value!r}.")
        if type(peers) is not int or peers < 0:
            raise CheckpointValueError(f"`peers` must be a non-negative int, not {peers!r}.")
        if local is None:
            if every is not None:
                raise CheckpointValueError(
                    "`persistent_every` says how often steps of the local tier are copied to `directory`: pass "
                    "`local=` (a directory on this host) too."
                )
            if peers:
                raise CheckpointValueError("`peers` hold copies of a local tier's steps: pass `local=` too.")
        elif peers:
            _check_peers(peers, stride)
        self.persistent_every = None if local is None else (every or 1)
        self.local_max_to_keep, self.peers, self.peer_stride = keep, peers, stride
        # The local tier: a manager of its own (saves, leases, retention), or None.
        self._local: CheckpointManager | None = None
        # With several processes, the local steps whole across every process's
        # tier: agreed at the first listing (`_tiers.agree`), then each step saved.
        self._parts = local is not None and jax.process_count() > 1
        self._whole: set[int] | None = None
        self._routes: dict[int, list[_peers.Route]] = {}  # with `peers`: where each process's part of each is
        if local is not None:
            _tiers.check_local(local, self._loc)
            self._local = CheckpointManager(local, max_to_keep=keep, blocking=self.blocking, share=self.share)
            self._local._own_part = self._local._retention.own = self._parts
            if self._parts:  # (its steps lack the other processes' regions: reads check their chunk files)
                self._local._loc = dataclasses.replace(self._local._loc, part=True)
        self._upload: PendingSave | None = None  # the persistent copy in flight, or the last one
        self._replication: PendingSave | None = None  # with `peers`, the move of a step's parts to them
        self._upload_error: BaseException | None = None  # a failed copy's error, raised once
        self._preempted_step: int | None = None  # the step `reached_preemption` answered True for

    @property
    def local(self) -> str | None:
        """The local tier's directory (`local=`), or `None`."""
        return None if self._local is None else self._local.directory

    @property
    def directory(self) -> str:
        """The directory, as given."""
        return self._loc.display

    def __repr__(self) -> str:
        # (`local` and `persistent_every` are None without a local tier: not shown)
        options = "max_to_keep keep_every best_n best_metric best_mode blocking local persistent_every".split()
        shown = "".join(f", {name}={getattr(self, name)!r}" for name in options if getattr(self, name) is not None)
        return f"CheckpointManager({self.directory!r}{shown})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            self.close()
        except Exception:
            # An error already on its way out of the `with` block matters more.
            if error is None:
                raise

    def close(self) -> None:
        """Wait for the background save (if any), give up the directory's lease
        so that another manager may write to it (saving again takes it back),
        and put back the SIGTERM handler `reached_preemption` replaced."""
        with self._lock:
            try:
                self.wait_until_finished()
            finally:
                try:
                    if self._pending is None and self._uploading() is None:  # never while a save still writes
                        lease, self._lease = self._lease, None
                        if lease is not None:
                            lease.release()
                finally:
                    try:
                        if self._local is not None:
                            self._local.close()
                    finally:
                        self._preemption.close()

    def _primary(self) -> bool:
        """Whether this process writes and deletes the manager's own files:
        process 0, or every process in its own part of a local tier."""
        return self._own_part or primary()

    def _hold_directory(self) -> None:
        """Take the directory's lease (once): only one manager writes here."""
        if self._lease is None and self._primary():
            _durable.ensure_directory(self._loc)
            self._lease, _ = _lease.acquire(self._loc, MANAGER_LEASE, what="CheckpointManager", journal=False)

    def step_path(self, step: int) -> str:
        """The path of a step's checkpoint (for `eqx_ckpt.Checkpoint`, or `eqx-ckpt ls`).

        **Arguments:**

        - `step`: the step.

        **Returns:**

        The path, as a string, whether or not the step exists. For a local
        directory it is absolute: the manager's, resolved when it was created,
        so that an `os.chdir` since changes nothing. Else it is the URL.
        """
        loc = self._step_loc(check_step(step))
        return loc.display if loc.local is None else loc.local

    def _step_loc(self, step: int) -> Location:
        """Where `step` is read from: the local tier if it holds it, committed, else `directory`."""
        return self._tier_of(step).joined(step_name(step))

    def _tier_of(self, step: int) -> Location:
        """The manager directory `step` is read from: the local tier's if it holds it, committed, else `directory`."""
        if self._local is not None:
            own = self._local.all_steps()
            if step in own and step in self._local_steps(own):
                return self._local_loc()
        return self._loc

    def _local_steps(self, own: list[int] | None = None) -> list[int]:
        """The steps committed in the local tier (`own`: this process's tier's,
        if listed already); with several processes, those whole there:
        committed in every process's part (`_tiers.agree`)."""
        assert self._local is not None
        steps = self._local.all_steps() if own is None else own
        if not self._parts:
            return steps
        if self._whole is None and self.peers:
            self._routes = _peers.agree(self._local_loc(), steps, _tiers.AGREE_SECONDS)
            self._whole = set(self._routes)
        elif self._whole is None:
            self._whole = _tiers.agree(steps, self._loc)
        if self.peers:  # (whole with the peers' copies, held here or not)
            if len(steps) >= self.local_max_to_keep:
                # Every process's local retention dropped the steps older than these.
                for step in [s for s in self._whole if s < steps[0]]:
                    self._whole.discard(step)
                    self._routes.pop(step, None)
            return sorted(self._whole)
        return [step for step in steps if step in self._whole]

    def all_steps(self) -> list[int]:
        """The committed steps, sorted. A save in flight or interrupted is not one.
        With a local tier: the steps committed in either tier (with several
        processes, in every process's local tier: the first call, in every
        process, agrees on them)."""
        steps = committed_steps(self._loc)
        if self._local is not None:
            steps = sorted(set(steps) | set(self._local_steps()))
        return steps

    def tier_steps(self) -> dict[str, list[int]]:
        """The committed steps of each tier, sorted: `{"local": [...],
        "persistent": [...]}` (without a local tier, only `"persistent"`)."""
        steps = {"persistent": committed_steps(self._loc)}
        if self._local is not None:
            steps = {"local": self._local.all_steps(), **steps}
        return steps

    def latest_step(self) -> int | None:
        """The highest committed step, or `None` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the best value of `best_metric` (ties go to the
        later step; steps without the metric, or where it is NaN, are never best),
        or `None` if no step has it.

        A manager created without `best_metric` (an evaluator's) ranks by the
        metric and mode of the run that saved here with `best_n`."""
        metric, mode = self.best_metric, self.best_mode
        if metric is None:
            metric, mode = recorded_best(self._loc)
        if metric is None:
            raise CheckpointValueError(
                f"`best_step()` needs to know which metric ranks steps, and neither this manager nor the retention "
                f"record of {self.directory!r} names one (a run that saves with `best_n=` records it): create the "
                f"manager with `best_metric=` (and `best_mode=` if higher is better)."
            )
        metrics = {step: self._metrics(step) for step in self.all_steps()}
        ranked = rank(metrics, metric, mode)
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with a committed step (`{}` if none were given).

        **Arguments:**

        - `step`: the step.

        **Returns:**

        A dict from metric name to number.
        """
        self._require(check_step(step))
        return self._metrics(step)

    def _metrics(self, step: int) -> dict[str, Any]:
        return read_metrics(self._tier_of(step), step)

    @_one_at_a_time
    def save(
        self,
        step: int,
        pytree: PyTree,
        metrics: Mapping[str, Any] | None = None,
        *,
        filter_spec: Any = default_serialise_filter_spec,
        is_leaf: Callable[[Any], bool] | None = None,
        cast: Any = None,
        layout: str = "directories",
        overwrite: bool = False,
        progress: Any = None,
        staging_bytes: int | None = None,
        compression: bool | str | None = None,
    ) -> None:
        """Save `pytree` as step `step`, then delete the steps no rule keeps.

        **Arguments:**

        - `step`: a non-negative int (Python, NumPy, or a 0-d JAX integer array).
        - `pytree`: what to save (typically `{"model": ..., "opt_state": ...}`).
        - `metrics`: an optional mapping from name to number (Python, NumPy or
            0-d JAX scalar), stored in the step's manifest (so they commit with it);
            `best_metric` is looked up here.
        - `filter_spec`, `is_leaf`, `cast`, `layout`, `progress`, `staging_bytes`,
            `compression`: as for [`eqx_ckpt.tree_serialise_leaves`][]. Steps
            share unchanged chunk files compressed the same way.
        - `overwrite`: replace the step if it already exists (atomically: the old
            one stays loadable until the new one is committed). By default, saving
            a step twice is an error.

        **Returns:**

        `None`. With `blocking=False`, the save goes on in the background; see
        `wait_until_finished()`.

        **Raises:**

        The error of the previous background save, if it failed (this save is then
        not started); otherwise any error `tree_serialise_leaves` raises. With a
        local tier, also the error of a persistent copy that failed since the
        last call that raised one (this save is then not started either).
        """
        if self._local is not None:
            tiered = {"filter_spec": filter_spec, "is_leaf": is_leaf, "cast": cast, "layout": layout}
            tiered.update(overwrite=overwrite, progress=progress, staging_bytes=staging_bytes)
            self._save_tiered(step, pytree, metrics, compression=compression, **tiered)
            return
        self.wait_until_finished()
        step = check_step(step)
        overwrite = check_flag("overwrite", overwrite, "whether to replace a step already there")
        values = metrics_values(step, metrics, self.directory)
        with _storage_errors.explained(self._loc, f"Saving step {step} to"):
            state = self._tidy(step)
            if state.get(step) and not overwrite:
                raise CheckpointExistsError(
                    f"Step {step} already exists in {self.directory!r}. Pass `overwrite=True` "
                    f"to replace it, or save under another step.",
                    path=self.directory,
                )
            # The metrics go into the step's manifest: a leftover file of version 1 is stale now.
            if state.get(step) and self._primary() and written_metrics(self._loc, step):
                _storage.remove(self._loc, [_metrics_name(step)])
            self._retention.begin(step, self._rules())
        handoff = _serialise.Handoff()
        # The newest committed step: unchanged chunk files are shared with it
        # (`_share`); the next step follows this one (`followed`), even a first
        # step with nothing to follow.
        before = max((s for s, committed in state.items() if committed and s != step), default=None)
        follows = None if before is None else self._loc.joined(step_name(before))
        try:
            options = _serialise.SaveOptions(
                overwrite=overwrite,
                blocking=self.blocking,
                cast=cast,
                layout=layout,
                progress=progress,
                share=self.share,
                staging_bytes=staging_bytes,
                compression=compression,
                metrics=values,
                handoff=handoff,
                follows=follows,
                followed=True,
                part=self._own_part,
            )
            pending = _serialise.save(self._loc.joined(step_name(step)), pytree, filter_spec, is_leaf, options)
            _faults.fire("manager.save_returned", step, pending)
        except CheckpointExistsError:
            raise  # another writer's save: nothing of it is ours to remove
        except BaseException:
            # An interrupt once the save went to the background (as `save` returned):
            # that thread commits it or removes what it wrote; removing the step
            # folder under it could leave a committed step without its arrays.
            if not handoff.in_background():
                self._undo(step)
            raise
        if pending is None:
            self._apply_retention(step)
            return

        def finish() -> None:
            try:
                pending.wait()
            except BaseException:
                self._undo(step)
                raise
            self._apply_retention(step)

        self._pending, self._pending_step = PendingSave(finish, wraps=pending), step

    def _save_tiered(self, step: Any, pytree: PyTree, metrics: Any, **options: Any) -> None:
        """Save to the local tier; if `step` is due, copy it to `directory` in the background."""
        self._raise_upload_error()
        step = check_step(step)
        assert self._local is not None and self.persistent_every is not None
        with _storage_errors.explained(self._loc, f"Saving step {step} to"):
            self._hold_directory()  # taken here, in the caller's thread: a second run's save fails at once
        own = self._local.all_steps()
        if self._parts and step in own and step not in self._local_steps(own):
            # This process's part of a step some other process's part is missing
            # from (a save that failed there): never restored, so replaced.
            options["overwrite"] = True
        self._local.save(step, pytree, metrics, **options)
        if self._whole is not None:
            self._whole.add(step)
        if step % self.persistent_every == 0 or step == self._preempted_step:
            self._start_upload(step)
        if self.peers:
            self._replicate(step)

    def _start_upload(self, step: int) -> None:
        """Copy the local `step` to `directory` in the background, once its local save is done."""
        assert self._local is not None
        local_save = self._local._pending
        self._local._retention.held.add(step)  # the local step stays while it is copied
        self._finish_upload()  # one copy at a time: a link slower than the saves holds training here
        # Made here, in the same order in every process, so that their copies meet at the same barriers.
        group = _multihost.Group("copy") if self._parts else None

        def upload() -> None:
            failed = _outcome(local_save)
            if failed is not None and group is None:
                return  # the local save failed: the manager raises its error; there is nothing to copy
            try:  # (with a group, the other processes learn of a failed local save at the copy's first barrier)
                self._copy_to_persistent(step, group, failed)
            except Exception as e:
                raise _tiers.upload_error(step, self._local_loc(), self._loc, e) from e

        self._upload = PendingSave(upload)

    def _replicate(self, step: int) -> None:
        """With `peers`: in the background, once this process's part of `step`
        is committed, send it to its peers and keep theirs (one step at a time)."""
        assert self._local is not None
        local, local_save = self._local, self._local._pending
        local._retention.held.add(step)  # the local step stays until it is sent
        self._finish_replication()
        # Made here, in the same order in every process, so that their moves meet at the same barriers.
        group = _multihost.Group("peers")

        def replicate() -> None:
            failed = _outcome(local_save)  # the manager raises it; the others learn it at the first barrier
            try:
                ids = _peers.replicate(self._local_loc(), step, self.peers, self.peer_stride, group, failed)
            except Exception as e:
                if e is failed:
                    return
                raise CheckpointError(
                    f"Step {step} was saved to the local tiers, but sending the parts to their peers failed: "
                    f"{str(e).rstrip('.')}. Each part stays in its own process's tier, with no copy elsewhere."
                ) from e
            finally:
                local._retention.held.discard(step)
            self._routes[step] = [_peers.Route(index, part, True) for index, part in enumerate(ids)]
            _peers.tidy(self._local_loc(), local.all_steps())

        self._replication = PendingSave(replicate)

    def _finish_replication(self) -> None:
        """Wait for the move of a step's parts to their peers (if any), and keep its error."""
        replication, self._replication = self._replication, None
        self._keep_error(replication)

    def _local_loc(self) -> Location:
        assert self._local is not None
        return self._local._loc

    def _copy_to_persistent(
        self, step: int, group: _multihost.Group | None = None, failed: BaseException | None = None
    ) -> None:
        """In the upload's thread: copy the committed local `step` to
        `directory`, then apply retention there. With several processes
        (`group`), process 0 prepares `directory` and each process copies its
        part (`_tiers.copy_parts`); `failed`: this process's local save's error."""
        assert self._local is not None
        try:
            error = failed
            if error is None and self._primary():
                try:
                    state = self._tidy(step)
                    if state.get(step):
                        delete_step(self._loc, step)  # saved again (`overwrite=True`): the local tier holds the new one
                    self._retention.begin(step, self._rules())
                except Exception as e:
                    error = e
            if group is not None:
                error = group.sync("prepared", error)
            if error is not None:
                raise error
            # On a local disk, chunk files equal to the newest step's are shared with it.
            before = max((s for s in committed_steps(self._loc) if s != step), default=None)
            previous = None if before is None or not self.share else self._loc.joined(step_name(before))
            source, target = self._local_loc().joined(step_name(step)), self._loc.joined(step_name(step))
            if group is None:
                _tiers.copy_step(source, target, step, previous)
            else:
                _tiers.copy_parts(source, target, step, previous, group)
        except BaseException:
            self._undo(step)
            raise
        held = self._local._retention.held
        held.difference_update([s for s in list(held) if s <= step])
        self._apply_retention(step)
        with self._local._lock:  # the local steps this copy held go now, not at the next save
            self._local._apply_retention()

    def _uploading(self) -> PendingSave | None:
        """The persistent copy (or the move to the peers) still in flight, if any."""
        for upload in (self._upload, self._replication):
            if upload is not None and not upload.done():
                return upload
        return None

    def _finish_upload(self) -> None:
        """Wait for the persistent copy (if any), and keep its error for `_raise_upload_error`."""
        upload, self._upload = self._upload, None
        self._keep_error(upload)

    def _keep_error(self, work: PendingSave | None) -> None:
        """Wait for a copy or move in the background (if any); its error is raised by `_raise_upload_error`."""
        if work is not None:
            try:
                work.wait()
            except Exception as e:
                self._upload_error = self._upload_error or e

    def _raise_upload_error(self) -> None:
        """Raise (once) the error of a persistent copy (or a move to the peers) that failed and has finished."""
        if self._upload is not None and self._upload.done():
            self._finish_upload()
        if self._replication is not None and self._replication.done():
            self._finish_replication()
        error, self._upload_error = self._upload_error, None
        if error is not None:
            raise error

    def _tidy(self, step: int) -> dict[int, bool]:
        """Before saving `step`: take the directory's lease, remove what
        interrupted saves left, and warn (once each) of the entries named like
        a step that no save wrote. Returns `scan`'s answer."""
        self._hold_directory()
        if self._lease is not None:
            self._lease.check()
        state = scan(self._loc)
        foreign = clean_interrupted(self._loc, state, own=self._own_part)
        for name, what in foreign:
            if name == step_name(step):
                raise CheckpointExistsError(
                    f"{self._loc.joined(name).display!r} is {what}, not a step of this manager, so step {step} was "
                    f"not saved. Move or rename it, or save under another step.",
                    path=self.directory,
                )
        new = [(name, what) for name, what in foreign if name not in self._left_alone]
        if new:
            self._left_alone.update(name for name, _ in new)
            warnings.warn(
                f"{self.directory!r} holds {len(new)} entr{'y' if len(new) == 1 else 'ies'} named like a step that "
                f"no eqx_ckpt save wrote: {'; '.join(f'{name!r} ({what})' for name, what in new)}. The manager "
                f"leaves them alone (it never lists, restores or deletes them); move or rename them to keep those "
                f"names for its steps.",
                RetentionWarning,
                stacklevel=4,
            )
        return state

    def _undo(self, step: int) -> None:
        """After a failed save: a step folder this save created, and that holds
        no committed checkpoint, goes. A committed step is never deleted here."""
        _faults.fire("manager.undo", step)
        if self._primary() and not scan(self._loc).get(step, False):
            _storage.remove(self._loc, [step_name(step)])

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) has committed and old steps are
        deleted. Raises that save's error if it failed (then nothing of it was
        committed, and its leftovers are removed). With a local tier, also wait
        for the copy of a step to `directory`, and raise its error if it failed."""
        with self._lock:
            if self._local is not None:
                self._local.wait_until_finished()
                self._finish_upload()
                self._finish_replication()
                self._raise_upload_error()
            pending = self._pending
            if pending is None:
                return
            try:
                pending.wait()
            finally:
                # Forgotten once finished, its error raised once; an interrupt
                # while it runs leaves it in flight, and still this manager's:
                # the next save must wait for it, not clean its folder away.
                if pending.done():
                    self._pending, self._pending_step = None, None

    def reached_preemption(self, step: int) -> bool:
        """Whether the training loop should save `step` and exit, because this
        process, or any process of a `jax.distributed` job, was sent SIGTERM (as
        preemptible TPU and GPU fleets do, before a grace period ends).

        Call it once per step, with the same steps in every process. It answers
        `True` at the same `step` in every process: alone, from the first call
        after the signal; with several, at the first step after the highest any
        process has reached, agreed by a background thread through JAX's
        coordination service (no round trip per step; the call after a signal
        may wait at one barrier). The first call, from the main thread, installs
        the manager's SIGTERM handler. It only raises a flag: a previous Python
        handler still runs after it, the default action (ending the process)
        does not. `close()` puts the previous handler back.

        **Arguments:**

        - `step`: the loop's step (an int, as for `save`).

        **Returns:**

        `True` once the loop should save this step and exit; `False` before.

        !!! example

            ```python
            import signal
            import jax.numpy as jnp
            import eqx_ckpt

            with eqx_ckpt.CheckpointManager("run_preemptible") as manager:
                step, state = manager.restore_or_initialise(lambda: {"w": jnp.zeros(3)})
                start = 0 if step is None else step + 1
                for step in range(start, 1000):
                    state = {"w": state["w"] + 1}
                    if step == 5:
                        signal.raise_signal(signal.SIGTERM)   # what the fleet sends
                    if manager.reached_preemption(step):
                        manager.save(step, state)             # then exit; a relaunch resumes here
                        break
            print(manager.all_steps())   # [5]
            ```
        """
        step = check_step(step)
        reached = self._preemption.reached(step)
        if reached:
            self._preempted_step = step  # with a local tier, its save is copied to `directory` too
        return reached

    def wait_for_new_step(self, after: int | None = None, timeout: float | None = None) -> int | None:
        """Wait for a committed step newer than `after`: an evaluator's loop beside
        a training run (another process, or a thread, with a manager of its own
        on the same directory).

        The directory is listed every 10 ms at first, then less often, up to
        once a second. A save in flight, interrupted, or deleted is never returned.

        **Arguments:**

        - `after`: the last step the caller has seen; `None` for any step.
        - `timeout`: give up after this many seconds; `None` to wait for ever.

        **Returns:**

        The lowest committed step above `after` (so an evaluator that falls
        behind still sees every step the retention rules keep), or `None` if
        there was none before `timeout`.

        Retention in the training run may delete the step before the caller
        restores it: `restore` then raises
        [`eqx_ckpt.CheckpointNotFoundError`][], saying so and naming the steps
        kept; catch it and wait again (the next step is newer).

        !!! example

            ```python
            import jax.numpy as jnp
            import eqx_ckpt

            trainer = eqx_ckpt.CheckpointManager("run_followed", max_to_keep=2)
            evaluator = eqx_ckpt.CheckpointManager("run_followed")
            for step in (10, 20):
                trainer.save(step, {"w": jnp.full(3, float(step))})
            seen = None
            while (step := evaluator.wait_for_new_step(after=seen, timeout=0.5)) is not None:
                try:
                    state = evaluator.restore({"w": jnp.zeros(3)}, step=step)
                except eqx_ckpt.CheckpointNotFoundError:
                    pass                      # deleted by the trainer's retention meanwhile
                seen = step
            print(seen)   # 20
            ```
        """
        after = None if after is None else check_step(after)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise CheckpointValueError(f"`timeout` must be a non-negative number of seconds or None, not {timeout!r}.")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _FIRST_POLL
        while True:
            newer = [step for step in self.all_steps() if after is None or step > after]
            if newer:
                self._followed.add(newer[0])
                return newer[0]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            time.sleep(delay if left is None else min(delay, left))
            delay = min(2 * delay, _LAST_POLL)

    def restore(
        self,
        like: PyTree = None,
        step: int | None = None,
        *,
        filter_spec: Any = default_deserialise_filter_spec,
        is_leaf: Callable[[Any], bool] | None = None,
        where: Callable[[PyTree], Any] | None = None,
        prefix: str | None = None,
        rename: Mapping[str, str] | Callable[[str], str] | Sequence[tuple[str, Any]] | None = None,
        missing: str = "error",
        strict: bool = False,
        cast: bool = False,
        lazy: bool = False,
        transform: Any = None,
        progress: Progress = None,
        trust: Iterable[Any] = (),
        check_init: bool = False,
        read_once: bool | None = None,
        token: str | None = None,
        base: Any = None,
    ) -> PyTree:
        """Load a step into `like`.

        **Arguments:**

        - `like`: the skeleton, concrete or abstract (`eqx.filter_eval_shape`).
            `None` (the default) rebuilds the step's own tree from its structure
            record, with the classes `trust` names beyond the default set
            (`manager.restore(step=5, trust=[MyModel, optax])`; see
            [`eqx_ckpt.Checkpoint.skeleton`][]).
        - `step`: the step to load; the latest committed one by default.
        - `filter_spec`, `is_leaf`, `where`, `prefix`, `rename`, `missing`, `strict`,
            `cast`, `lazy`, `transform`, `progress`, `trust`, `check_init`, `read_once`, `token`,
            `base`: every option of [`eqx_ckpt.tree_deserialise_leaves`][], with its meaning and default;
            for instance `prefix="model"` loads only the model of a
            `{"model": ..., "opt_state": ...}` step.

        **Returns:**

        `like`, with the loaded leaves.

        **Raises:**

        [`eqx_ckpt.CheckpointNotFoundError`][] if the step is not committed (or there
        is no step at all), naming the steps there are.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"There is no committed step in {self.directory!r} to restore. Save one "
                    f"first, or use `restore_or_initialise(init)` to start afresh.",
                    path=self.directory,
                )
        else:
            step = check_step(step)
            self._require(step)
        options = LoadOptions(
            where=where,
            prefix=prefix,
            rename=rename,
            transform=transform,
            missing=missing,
            strict=strict,
            cast=cast,
            lazy=lazy,
            read_once=self._reads_once(read_once),
            progress=progress,
            trust=trust,
            check_init=check_init,
            token=token,
            base=base,
        )
        try:
            return self._load_nearest(step, lambda loc: deserialise(loc, like, filter_spec, is_leaf, options))
        except (CheckpointError, OSError) as e:
            # Retention (this manager's, or that of the one saving here) deleted
            # the step while it was read: say so, not what the read tripped on.
            steps = self.all_steps()
            if step in steps:
                raise
            raise CheckpointNotFoundError(
                f"Step {step} was deleted from {self.directory!r} while it was being restored (by the retention "
                f"rules of the manager saving there), so nothing of it is returned; the committed steps now are "
                f"{show_steps(steps)}. Restore one of them.",
                path=self.directory,
            ) from e

    def restore_or_initialise(
        self,
        init: Callable[[], PyTree],
        *,
        filter_spec: Any = default_deserialise_filter_spec,
        is_leaf: Callable[[Any], bool] | None = None,
        where: Callable[[PyTree], Any] | None = None,
        prefix: str | None = None,
        rename: Mapping[str, str] | Callable[[str], str] | Sequence[tuple[str, Any]] | None = None,
        missing: str = "error",
        strict: bool = False,
        cast: bool = False,
        lazy: bool = False,
        transform: Any = None,
        progress: Progress = None,
        read_once: bool | None = None,
        token: str | None = None,
        base: Any = None,
    ) -> tuple[int | None, PyTree]:
        """Resume from the latest step, or start afresh if there is none.

        **Arguments:**

        - `init`: a function of no arguments building the initial tree (the same
            tree `save` is given). When there is a step, it is only traced
            (`eqx.filter_eval_shape`) for the skeleton to load into, and computes
            under `jax.jit` only the leaves the load leaves out (see `missing`),
            as [`eqx_ckpt.load_or_initialise`][] does.
        - `filter_spec`, `is_leaf`, `where`, `prefix`, `rename`, `missing`, `strict`,
            `cast`, `lazy`, `transform`, `progress`, `read_once`, `token`, `base`: every option
            of [`eqx_ckpt.tree_deserialise_leaves`][], with its meaning and default.
            `missing="keep"` resumes a state that gained leaves since the step was
            saved (an EMA of the weights, a new head): those leaves get `init`'s
            values. Leaves `where` does not select get `init`'s values too.

        **Returns:**

        `(step, tree)`: the latest step and the tree loaded from it, or `(None,
        init())` if nothing was saved yet.

        !!! example

            ```python
            import jax.numpy as jnp
            import eqx_ckpt

            def make_state():
                return {"w": jnp.zeros(3), "step": 0}

            manager = eqx_ckpt.CheckpointManager("run_resume")
            step, state = manager.restore_or_initialise(make_state)   # (None, make_state())
            start = 0 if step is None else step + 1
            manager.save(start, state)
            step, state = manager.restore_or_initialise(make_state)   # (0, the saved state)
            ```
        """
        step = self.latest_step()
        if step is None:
            return None, init()
        options = LoadOptions(
            where=where,
            prefix=prefix,
            rename=rename,
            transform=transform,
            missing=missing,
            strict=strict,
            cast=cast,
            lazy=lazy,
            read_once=self._reads_once(read_once),
            progress=progress,
            token=token,
            base=base,
        )
        return step, self._load_nearest(
            step, lambda loc: _initialise.initialise_unloaded(loc, init, filter_spec, is_leaf, options)
        )

    def _reads_once(self, read_once: bool | None) -> bool | None:
        """`read_once` for a restore: never shared between the processes of a
        tiered manager, each of which may read its part from its own tier."""
        if not self._parts:
            return read_once
        if read_once:
            raise CheckpointValueError(
                f"`read_once=True` shares reads between the processes, but each process of a manager with a local "
                f"tier (`local={self.local!r}`) reads its own part, from its own tier. Restore with "
                f"`read_once=None` or `False`.",
                path=self.directory,
            )
        return False

    def _load_nearest(self, step: int, load: Callable[[Location], PyTree]) -> PyTree:
        """`load(loc)` of `step` from the nearest tier that holds it. A local
        step that fails its checks (or that its storage would not serve) is
        never returned: the persistent one is loaded instead, if there is one.
        With several processes, where any process's part fails, every process
        loads the persistent one: each returns the same step, from one tier."""
        tier = self._tier_of(step)
        loc = tier.joined(step_name(step))
        if step in self._routes:  # (only whole steps, pruned by the listing that chose `step`)
            # Every process's part, moved from a peer to the process it is missing from.
            loc = _peers.fetch(self._local_loc(), step, self._routes[step])
        elif tier is self._loc:
            return load(loc)
        error: BaseException | None = None
        try:
            tree = load(loc)
        except (IntegrityError, CorruptCheckpointError, CheckpointNotFoundError, CheckpointStorageError) as e:
            error = e
        if self._parts:
            error = _multihost.Group("restore", timeout=_tiers.AGREE_SECONDS).sync("loaded", error)
        if error is None:
            return tree
        if step not in committed_steps(self._loc):
            raise error
        warnings.warn(
            f"Step {step} of the local tier ({loc.display!r}) could not be loaded ({error}); it was loaded from "
            f"the persistent tier ({self.directory!r}) instead.",
            IntegrityWarning,
            stacklevel=3,  # the caller of `restore` or `restore_or_initialise`
        )
        return load(self._loc.joined(step_name(step)))

    def _require(self, step: int) -> None:
        steps = self.all_steps()
        if step in steps:
            return
        hint = ""
        if step == self._pending_step:
            hint = " Its save is still in progress: call `wait_until_finished()` first."
        elif step in self._followed:
            hint = (
                " It was committed (`wait_for_new_step` returned it), and has been deleted since by the retention "
                "rules of the manager saving there: restore the step `wait_for_new_step` returns at once, or "
                "skip to a newer one."
            )
        raise CheckpointNotFoundError(
            f"There is no committed step {step} in {self.directory!r}; the committed steps are "
            f"{show_steps(steps)}.{hint}",
            path=self.directory,
        )

    @_one_at_a_time
    def delete_steps_after(self, step: int) -> list[int]:
        """Roll back: delete every committed step after `step`.

        Steps are ordered by number, as in orbax. After restoring an earlier step
        to train again from it (after a loss spike, a bug), delete the later
        steps of the abandoned run, so that `latest_step()` and retention follow
        the new run.

        **Arguments:**

        - `step`: the step to keep as the latest (it need not exist).

        **Returns:**

        The steps deleted, sorted.

        !!! example

            ```python
            import jax.numpy as jnp
            import eqx_ckpt

            manager = eqx_ckpt.CheckpointManager("run_rollback", max_to_keep=3)
            for step in (100, 200, 300):
                manager.save(step, {"w": jnp.full(2, float(step))})
            state = manager.restore({"w": jnp.zeros(2)}, step=200)
            manager.delete_steps_after(200)         # [300]
            manager.save(210, state)
            print(manager.latest_step())           # 210
            ```
        """
        step = check_step(step)
        self.wait_until_finished()
        with _storage_errors.explained(self._loc, "Deleting steps from"):
            self._hold_directory()  # deleting steps is writing: one manager at a time
        later = [s for s in self.all_steps() if s > step]
        if self._primary():
            for s in committed_steps(self._loc):
                if s > step:
                    delete_step(self._loc, s)
        if self._local is not None:
            self._local.delete_steps_after(step)
        return later

    def _apply_retention(self, saved: int | None = None) -> None:
        """After a step committed: delete the steps no rule keeps. A failure here is
        a warning (the new step is saved; the next save retries the deletion)."""
        try:
            left = self._retention.apply(self._rules(), saved)
        except Exception as e:
            warnings.warn(
                f"Step saved in {self.directory!r}, but deleting the steps the retention rules drop failed ({e}); "
                f"the next save tries again.",
                CommitWarning,
                stacklevel=3,
            )
            return
        if left:
            warnings.warn(
                f"Retention left {len(left)} step(s) in {self.directory!r} that were saved under other "
                f"retention rules (or none) in place: {show_steps(left)}. This manager's rules apply to the steps "
                f"saved under them; to apply them to every step, create the manager with `adopt_steps=True`.",
                RetentionWarning,
                stacklevel=3,
            )

    def _rules(self) -> Rules:
        return Rules(self.max_to_keep, self.keep_every, self.best_n, self.best_metric, self.best_mode, self.adopt_steps)


# `wait_for_new_step` lists the directory after this many seconds, then twice
# as long each time, up to the last.
_FIRST_POLL, _LAST_POLL = 0.01, 1.0
