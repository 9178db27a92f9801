"""`CheckpointManager`: one checkpoint per training step, retention, and resume.

On disk, in the manager's directory:

    step_00000042/                 a complete eqx_ckpt checkpoint (manifest.json last)
    step_00000042.metrics.json     its metrics, written before the save begins

A step exists only once `step_<step>/manifest.json` does, so a save interrupted at
any moment is never reported. Such leftovers are removed by the next save.
Anything else in the directory is never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from . import _io
from ._deserialise import default_deserialise_filter_spec, tree_deserialise_leaves
from ._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from ._manifest import MANIFEST
from ._serialise import PendingSave, default_serialise_filter_spec, tree_serialise_leaves
from ._spec import location
from ._steps import (
    _MAX_METRICS_BYTES,
    _check_step,
    _clean_interrupted,
    _kept,
    _metrics_json,
    _metrics_name,
    _primary,
    _rank,
    _read_metrics,
    _scan,
    _show,
    _undo,
    step_name,
)


class CheckpointManager:
    """Saves a training run as one checkpoint per step, keeps only the ones the
    retention rules ask for, and restores any of them.

    **Arguments:**

    - `directory`: the folder holding the steps (created on the first save), or a
        kvstore URL. One manager at a time should write to it.
    - `max_to_keep`: keep the `max_to_keep` most recent steps.
    - `keep_every`: also keep every step with `step % keep_every == 0`.
    - `best_n`: also keep the `best_n` steps with the best value of `best_metric`.
    - `best_metric`: the name of the metric (passed to `save`) that ranks steps, for
        `best_n` and `best_step()`.
    - `best_mode`: `"min"` (the default: lower is better, as for a loss) or `"max"`.
    - `blocking`: with `False`, `save` returns once the arrays are safe on the host,
        and the writing, the commit and the deletion of old steps go on in the
        background. The next `save` (or `wait_until_finished()`) waits for it, and
        raises its error if it failed.

    A step survives if any rule keeps it, and the latest step always survives.
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
    ):
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every), ("best_n", best_n)):
            if value is not None and (type(value) is not int or value < 1):
                raise CheckpointValueError(f"`{name}` must be a positive int or None, not {value!r}.")
        if best_n is not None and best_metric is None:
            raise CheckpointValueError("`best_n` ranks steps by a metric: pass `best_metric`, the name of one.")
        if best_mode not in ("min", "max"):
            raise CheckpointValueError(f"`best_mode` must be 'min' or 'max', not {best_mode!r}.")
        self._loc = location(directory)
        self.max_to_keep, self.keep_every, self.best_n = max_to_keep, keep_every, best_n
        self.best_metric, self.best_mode, self.blocking = best_metric, best_mode, blocking
        self._pending: PendingSave | None = None
        self._pending_step: int | None = None

    @property
    def directory(self) -> str:
        """The directory, as given."""
        return self._loc.display

    def __repr__(self) -> str:
        options = ("max_to_keep", "keep_every", "best_n", "best_metric", "best_mode", "blocking")
        shown = "".join(f", {name}={getattr(self, name)!r}" for name in options if getattr(self, name) is not None)
        return f"CheckpointManager({self.directory!r}{shown})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            self.wait_until_finished()
        except Exception:
            # An error already on its way out of the `with` block matters more.
            if error is None:
                raise

    def step_path(self, step: int) -> str:
        """The path of a step's checkpoint (for `eqx_ckpt.Checkpoint`, or `eqx-ckpt ls`).

        **Arguments:**

        - `step`: the step.

        **Returns:**

        The path, as a string, whether or not the step exists.
        """
        return self._loc.joined(step_name(_check_step(step))).display

    def all_steps(self) -> list[int]:
        """The committed steps, sorted. A save in flight or interrupted is not one."""
        return sorted(step for step, committed in _scan(self._loc).items() if committed)

    def latest_step(self) -> int | None:
        """The highest committed step, or `None` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the best value of `best_metric` (ties go to the
        later step; steps without the metric, or where it is NaN, are never best),
        or `None` if no step has it."""
        if self.best_metric is None:
            raise CheckpointValueError(
                "`best_step()` needs to know which metric ranks steps: create the "
                "manager with `best_metric=` (and `best_mode=` if higher is better)."
            )
        ranked = _rank(self._all_metrics(self.all_steps()), self.best_metric, self.best_mode)
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with a committed step (`{}` if none were given).

        **Arguments:**

        - `step`: the step.

        **Returns:**

        A dict from metric name to number.
        """
        self._require(_check_step(step))
        return _read_metrics(self._loc, step)

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
    ) -> None:
        """Save `pytree` as step `step`, then delete the steps no rule keeps.

        **Arguments:**

        - `step`: a non-negative int.
        - `pytree`: what to save (typically `{"model": ..., "opt_state": ...}`).
        - `metrics`: an optional mapping from name to number (Python, NumPy or
            0-d JAX scalar), stored beside the step; `best_metric` is looked up here.
        - `filter_spec`, `is_leaf`, `cast`, `layout`, `progress`: as for
            [`eqx_ckpt.tree_serialise_leaves`][].
        - `overwrite`: replace the step if it already exists (atomically: the old
            one stays loadable until the new one is committed). By default, saving
            a step twice is an error.

        **Returns:**

        `None`. With `blocking=False`, the save goes on in the background; see
        `wait_until_finished()`.

        **Raises:**

        The error of the previous background save, if it failed (this save is then
        not started); otherwise any error `tree_serialise_leaves` raises.
        """
        self.wait_until_finished()
        step = _check_step(step)
        record = _metrics_json(step, metrics, self.directory)
        state = _scan(self._loc)
        _clean_interrupted(self._loc, state)
        if state.get(step) and not overwrite:
            raise CheckpointExistsError(
                f"Step {step} already exists in {self.directory!r}. Pass `overwrite=True` "
                f"to replace it, or save under another step.",
                path=self.directory,
            )
        # Before the save begins, so that a committed step always has its metrics.
        previous = _io.read_file(self._loc, _metrics_name(step), limit=_MAX_METRICS_BYTES) if state.get(step) else None
        if _primary():
            _io.ensure_directory(self._loc)
            _io.write_file(self._loc, _metrics_name(step), record)
        undo = lambda: _undo(self._loc, step, bool(state.get(step)), previous) if _primary() else None
        target = self._loc.joined(step_name(step))
        try:
            pending = tree_serialise_leaves(
                target,
                pytree,
                filter_spec,
                is_leaf,
                overwrite=overwrite,
                blocking=self.blocking,
                cast=cast,
                layout=layout,
                progress=progress,
            )
        except BaseException:
            undo()
            raise
        if pending is None:
            self._apply_retention()
            return

        def finish() -> None:
            try:
                pending.wait()
            except BaseException:
                undo()
                raise
            self._apply_retention()

        self._pending, self._pending_step = PendingSave(finish), step

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) has committed and old steps are
        deleted. Raises that save's error if it failed; nothing of it was committed,
        and its leftovers are removed."""
        pending, self._pending, self._pending_step = self._pending, None, None
        if pending is None:
            return
        try:
            pending.wait()
        except BaseException:
            _clean_interrupted(self._loc, _scan(self._loc))
            raise

    def restore(
        self,
        like: PyTree,
        step: int | None = None,
        *,
        filter_spec: Any = default_deserialise_filter_spec,
        is_leaf: Callable[[Any], bool] | None = None,
        where: Callable[[PyTree], Any] | None = None,
        prefix: str | None = None,
        rename: Mapping[str, str] | Callable[[str], str] | None = None,
        missing: str = "error",
        strict: bool = False,
        cast: bool = False,
        lazy: bool = False,
    ) -> PyTree:
        """Load a step into `like`.

        **Arguments:**

        - `like`: the skeleton, concrete or abstract (`eqx.filter_eval_shape`).
        - `step`: the step to load; the latest committed one by default.
        - `filter_spec`, `is_leaf`, `where`, `prefix`, `rename`, `missing`, `strict`,
            `cast`, `lazy`: as for [`eqx_ckpt.tree_deserialise_leaves`][]; for
            instance `prefix="model"` loads only the model of a
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
            self._require(_check_step(step))
        return tree_deserialise_leaves(
            self._loc.joined(step_name(step)), like, filter_spec, is_leaf,
            where=where, prefix=prefix, rename=rename, missing=missing, strict=strict, cast=cast, lazy=lazy,
        )  # fmt: skip

    def restore_or_initialise(self, init: Callable[[], PyTree]) -> tuple[int | None, PyTree]:
        """Resume from the latest step, or start afresh if there is none.

        **Arguments:**

        - `init`: a function of no arguments building the initial tree (the same
            tree `save` is given). When there is a step, it is only traced, with
            `eqx.filter_eval_shape`, to get the skeleton to load into: no initial
            value is computed.

        **Returns:**

        `(step, tree)`: the latest step and the tree loaded from it, or `(None,
        init())` if nothing was saved yet.

        !!! example

            ```python
            step, state = manager.restore_or_initialise(make_state)
            start = 0 if step is None else step + 1
            ```
        """
        step = self.latest_step()
        if step is None:
            return None, init()
        return step, self.restore(eqx.filter_eval_shape(init), step)

    def _require(self, step: int) -> None:
        steps = self.all_steps()
        if step in steps:
            return
        hint = ""
        if step == self._pending_step:
            hint = " Its save is still in progress: call `wait_until_finished()` first."
        raise CheckpointNotFoundError(
            f"There is no committed step {step} in {self.directory!r}; the committed steps are {_show(steps)}.{hint}",
            path=self.directory,
        )

    def _all_metrics(self, steps: list[int]) -> dict[int, dict[str, Any]]:
        return {step: _read_metrics(self._loc, step) for step in steps}

    def _apply_retention(self) -> None:
        """Delete the committed steps no rule keeps: the manifest first, so that a
        step disappears at once even if the deletion is interrupted."""
        if (self.max_to_keep is None and self.keep_every is None and self.best_n is None) or not _primary():
            return
        steps = self.all_steps()
        ranked = _rank(self._all_metrics(steps), self.best_metric, self.best_mode) if self.best_n else []
        keep = _kept(steps, ranked, max_to_keep=self.max_to_keep, keep_every=self.keep_every, best_n=self.best_n)
        for step in steps:
            if step not in keep:
                _io.delete_file(self._loc.joined(step_name(step)), MANIFEST)
                _io.remove(self._loc, [step_name(step), _metrics_name(step)])
