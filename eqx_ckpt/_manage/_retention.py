"""Retention of a `CheckpointManager`: which steps its rules keep, and which it
may delete.

The rules apply only to the steps the manager governs: those saved under the
same rules (listed in `retention.json`), or every step with `adopt_steps=True`.
Of those, a step survives if any rule keeps it, if it is the latest or the one
just saved, or while lazy leaves of this process read from it. Steps the rules
would drop but that the manager does not govern stay: `Retention.apply` returns
them once, for the `RetentionWarning`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from .._base._errors import CorruptCheckpointError
from .._base._location import Location
from .._load import _lazy
from .._ondisk import _format, _manifest
from .._store import _storage
from ._steps import committed_steps, delete_step, primary, read_metrics, read_small_file

# A retention record lists steps: a million of them is still far below this.
_MAX_RETENTION_BYTES = 2**24


class RetentionWarning(UserWarning):
    """A `CheckpointManager` left in place what is not its own to delete, and
    names it. That is one of two things:

    - Steps its retention rules would drop but that were saved under other
      rules (by an earlier run with another `max_to_keep`, a manager without
      rules, or an older eqx_ckpt). `adopt_steps=True` applies the rules to them too.
    - Entries of its directory named like a step that no eqx_ckpt save wrote:
      a user's file, symbolic link, or folder of other files.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.CheckpointManager("run_adopted").save(0, {"w": jnp.zeros(2)})  # saved under no rules
        manager = eqx_ckpt.CheckpointManager("run_adopted", max_to_keep=1, adopt_steps=True)
        manager.save(1, {"w": jnp.ones(2)})  # deletes step 0 too: no RetentionWarning
        print(manager.all_steps())           # [1]
        ```
    """


RetentionWarning.__module__ = "eqx_ckpt"


@dataclasses.dataclass(frozen=True)
class Rules:
    """A manager's retention rules (see `CheckpointManager`'s arguments)."""

    max_to_keep: int | None
    keep_every: int | None
    best_n: int | None
    best_metric: str | None
    best_mode: str
    adopt_steps: bool

    def any(self) -> bool:
        """Whether any rule deletes steps (with none, nothing is deleted)."""
        return not (self.max_to_keep is None and self.keep_every is None and self.best_n is None)

    def record(self) -> dict[str, Any]:
        """The rules as the retention record writes them."""
        rules: dict[str, Any] = {"max_to_keep": self.max_to_keep, "keep_every": self.keep_every, "best_n": self.best_n}
        if self.best_n is not None:
            rules.update(best_metric=self.best_metric, best_mode=self.best_mode)
        return rules


class Retention:
    """The retention of the manager of the directory at `loc`: the steps it
    governs, known from its first save on, and the steps it began to save."""

    def __init__(self, loc: Location):
        self._loc = loc
        # The steps retention may delete (see `_governed`), read from the record once.
        self._recorded: set[int] | None = None
        # Every step this manager began to save: its own, even where an interrupt
        # after the commit came before retention recorded it.
        self._saving: set[int] = set()
        self._warned = False
        # Steps kept whatever the rules say: a local tier's step while it is
        # copied to the persistent tier (`_tiers`).
        self.held: set[int] = set()
        # Whether this process applies the rules: process 0, or each process
        # to its own local tier (`own`).
        self.own = False

    def begin(self, step: int, rules: Rules) -> None:
        """Before saving `step`: record that it is the manager's own, so that a
        process killed after the commit and before retention ran leaves a step
        the next manager with the same rules knows for its own (and prunes)."""
        self._saving.add(step)
        if not (self.own or primary()) or rules.adopt_steps or not rules.any():
            return
        try:
            governed = self._read(rules)
        except CorruptCheckpointError:
            return  # the save goes on; retention after its commit says what is wrong
        _write_record(self._loc, rules, sorted(governed | {step}))

    def apply(self, rules: Rules, saved: int | None) -> list[int]:
        """Delete the governed steps no rule keeps (never the one just `saved`),
        and record the ones left; the other steps the rules would drop, once."""
        if not rules.any() or not (self.own or primary()):
            return []
        steps = committed_steps(self._loc)
        governed = set(steps) if rules.adopt_steps else self._governed(steps, rules, saved)
        mine = [step for step in steps if step in governed]
        keep = self._keep(mine, rules, saved) | set(self.held)
        for step in mine:
            if step in keep:
                continue
            if _lazy.reads_from(self._loc.joined(_format.step_name(step))):
                # Lazy leaves of this process read from it (a fine-tuning loop's
                # frozen base): a later save deletes it, once they are gone.
                keep.add(step)
            else:
                delete_step(self._loc, step)
        self._recorded = {step for step in mine if step in keep}
        _write_record(self._loc, rules, sorted(self._recorded))
        if len(mine) == len(steps) or self._warned:
            return []
        keep = self._keep(steps, rules, saved)
        left = [step for step in steps if step not in governed and step not in keep]
        # Once, at the first save where the rules would drop one: a manager with
        # looser rules than the run it resumes finds none at its first save.
        self._warned = bool(left)
        return left

    def _governed(self, steps: list[int], rules: Rules, saved: int | None) -> set[int]:
        """The steps saved under these rules, by this manager or an earlier one
        (a resumed run): deleting any other needs the user's say (a run of 300
        steps opened with a tighter `max_to_keep` once lost 297 of them)."""
        return (self._read(rules) | self._saving | ({saved} if saved is not None else set())) & set(steps)

    def _read(self, rules: Rules) -> set[int]:
        """The steps the retention record lists under `rules`, read once, then kept here."""
        if self._recorded is None:
            record = _read_record(self._loc)
            self._recorded = set(record[1]) if record is not None and record[0] == rules.record() else set()
        return self._recorded

    def _keep(self, steps: list[int], rules: Rules, saved: int | None) -> set[int]:
        metrics = {step: read_metrics(self._loc, step) for step in steps} if rules.best_n else {}
        ranked = rank(metrics, rules.best_metric, rules.best_mode) if rules.best_n else []
        return _kept(steps, ranked, rules, saved=saved)


def rank(metrics: dict[int, dict[str, Any]], name: str | None, mode: str) -> list[int]:
    """Steps having metric `name`, best first; ties go to the later step."""
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * float(m[name]), -step) for step, m in metrics.items() if name in m and not math.isnan(m[name])]
    return [-negated for _, negated in sorted(scored)]


def _kept(steps: list[int], ranked: list[int], rules: Rules, *, saved: int | None = None) -> set[int]:
    """The union of what each rule keeps, plus the latest step and the step just
    `saved` (which may lie below others, after a rollback). `steps` is sorted;
    `ranked` lists steps best first."""
    keep = set(steps[-1:]) | ({saved} if saved is not None else set())
    if rules.max_to_keep is not None:
        keep.update(steps[-rules.max_to_keep :])
    if rules.keep_every is not None:
        keep.update(step for step in steps if step % rules.keep_every == 0)
    if rules.best_n is not None:
        keep.update(ranked[: rules.best_n])
    return keep


def recorded_best(loc: Location) -> tuple[str | None, str]:
    """The metric and mode the retention record at `loc` ranks by (a manager
    with `best_n` writes them); `(None, "min")` where it names none."""
    record = _read_record(loc)
    rules = record[0] if record is not None else {}
    metric, mode = rules.get("best_metric"), rules.get("best_mode", "min")
    if not isinstance(metric, str) or mode not in ("min", "max"):
        return None, "min"
    return metric, mode


def _read_record(loc: Location) -> tuple[dict[str, Any], list[int]] | None:
    """The rules and steps of the directory's retention record, if it has one."""
    fix = "Delete it: retention then leaves the steps saved so far in place (`adopt_steps=True` applies it to them)."
    return read_small_file(loc, _format.RETENTION, _MAX_RETENTION_BYTES, _record, what="retention record", fix=fix)


def _record(data: bytes) -> tuple[dict[str, Any], list[int]]:
    """The rules and steps in a retention record's bytes; raises `ValueError`,
    `KeyError` or `TypeError` for anything else."""
    body = _manifest.loads_file(data)
    rules, steps = body["rules"], body["steps"]
    if not isinstance(rules, dict) or not isinstance(steps, list):
        raise ValueError("unexpected content")
    if not all(type(step) is int and step >= 0 for step in steps):
        raise ValueError("a step is not a non-negative int")
    return rules, steps


def _write_record(loc: Location, rules: Rules, steps: list[int]) -> None:
    body = {"rules": rules.record(), "steps": sorted(steps)}
    _storage.write_file(loc, _format.RETENTION, json.dumps(body).encode())
