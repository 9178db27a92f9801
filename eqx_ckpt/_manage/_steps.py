"""Step folders of a `CheckpointManager`: scanning, metrics, deleting a step, and
what an interrupted save left (and what is the user's). Which steps retention
keeps is `_retention`'s."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from .._base._errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError
from .._base._location import Location
from .._ondisk import _dtypes, _format, _manifest
from .._ondisk._format import MANIFEST
from .._store import _storage
from .._store._transaction import read_manifest

_MAX_METRICS_BYTES = 2**20

_T = TypeVar("_T")


def primary() -> bool:
    """Whether this process writes and deletes the manager's own files: with several
    JAX processes, process 0 alone does (each writes its shards of a step)."""
    return jax.process_index() == 0


def check_step(step: Any) -> int:
    """A step as an `int`: Python, NumPy and 0-d JAX integers are accepted (a
    training loop's step counter is often a `jnp.int32`)."""
    if isinstance(step, jax.Array) and not isinstance(step, jax.core.Tracer) and step.ndim == 0:
        if jax.numpy.issubdtype(step.dtype, jax.numpy.integer):
            step = int(step)
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        raise CheckpointTypeError(
            f"A step must be an int, not {type(step).__name__} ({step!r}); Python and NumPy ints and "
            f"0-d JAX integer arrays are accepted."
        )
    if step < 0:
        raise CheckpointValueError(f"A step must be non-negative, not {step}.")
    return int(step)


def scan(loc: Location) -> dict[int, bool]:
    """Every step folder of the manager's own naming, and whether it is
    committed. On a local disk a file or a symbolic link of that name is a
    user's, never listed, restored or deleted (retention deleting a manifest
    through a link once destroyed a checkpoint outside the directory)."""
    local = loc.local
    if local is not None:

        def folder(name: str) -> bool:
            entry = _storage.local_entry(os.path.join(local, name))
            return entry.folder and not entry.link

        return {
            step: _storage.local_entry(os.path.join(local, name, MANIFEST)).file
            for name in _storage.list_names(loc)
            if (step := _format.parse_step(name)) is not None and folder(name)
        }
    keys = _storage.list_keys(loc)
    found: dict[int, bool] = {}
    for key in keys:
        head, _, rest = key.partition("/")
        step = _format.parse_step(head)
        if step is not None and rest:
            found[step] = found.get(step, False) or rest == MANIFEST
    return found


def committed_steps(loc: Location) -> list[int]:
    """The committed steps of the manager's directory at `loc`, sorted."""
    return sorted(step for step, committed in scan(loc).items() if committed)


def clean_interrupted(loc: Location, state: dict[int, bool], *, own: bool = False) -> list[tuple[str, str]]:
    """Remove what interrupted saves left: step folders without a manifest
    that hold only files a save writes, and metrics files a version 1 manager
    wrote without a committed step. The entries named like a step that are not
    the manager's to remove stay, and are returned as `(name, what it is)`.
    Process 0 does, or each process in a directory of its `own`."""
    if not (own or primary()):
        return []
    names = _storage.list_names(loc)
    stale, foreign = [], _not_folders(loc, names)
    for step in sorted(step for step, committed in state.items() if not committed):
        name = _format.step_name(step)
        others = [f for f in _storage.list_files(loc.joined(name)) if not _format.left_by_a_save(f)]
        if others:
            foreign.append((name, f"a folder holding {_some(others)}, which no eqx_ckpt save writes"))
        else:
            stale.append(name)
    for name in names:
        owner = _format.parse_metrics_name(name)
        if owner is not None and not state.get(owner, False):
            if written_metrics(loc, owner):
                stale.append(name)
            else:
                foreign.append((name, "a file that is not a metrics file an eqx_ckpt manager wrote"))
    _storage.remove(loc, stale)
    return sorted(foreign)


def written_metrics(loc: Location, step: int) -> bool:
    """Whether `step_<step>.metrics.json` in `loc` is what a version 1 manager
    wrote there (and so the manager's to delete): `_metrics_file_values` reads
    it, and it is not a link."""
    name = _format.metrics_name(step)
    if loc.local is not None:
        entry = _storage.local_entry(os.path.join(loc.local, name))
        if entry.link or entry.folder:
            return False
    # A failure to read is the caller's (a save's error, or retention's warning), never a verdict.
    data = _storage.read_file(loc, name, limit=_MAX_METRICS_BYTES)
    if data is None:
        return False
    try:
        _metrics_file_values(data, step)
    except (ValueError, KeyError, TypeError):  # what version 1 never wrote: not ours
        return False
    return True


def _not_folders(loc: Location, names: list[str]) -> list[tuple[str, str]]:
    """The files and symbolic links named like a step, on a local disk (`scan`
    never counts them as steps)."""
    if loc.local is None:
        return []
    found = []
    for name in names:
        entry = _storage.local_entry(os.path.join(loc.local, name))
        if _format.parse_step(name) is not None and (entry.link or not entry.folder):
            found.append((name, "a symbolic link" if entry.link else "a file"))
    return found


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


def metrics_values(step: int, metrics: Mapping[str, Any] | None, directory: str) -> dict[str, Any]:
    """The metrics as stored in the step's manifest; non-finite values are spelt
    as strings, so the manifest stays standard JSON."""
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise CheckpointTypeError(f"`metrics` must be a mapping from name to number, not {type(metrics).__name__}.")
    values: dict[str, Any] = {}
    for name, value in metrics.items():
        array = np.asarray(value)
        if _dtypes.is_floating(array.dtype):  # bfloat16 and float8 too (NumPy kind 'V')
            array = array.astype(np.float64)
        if not isinstance(name, str) or array.ndim != 0 or array.dtype.kind not in "biuf":
            raise CheckpointTypeError(
                f"Metric {name!r} of step {step} (for {directory!r}) must be named by a "
                f"str and be a real number (Python, NumPy or 0-d JAX scalar), not {value!r}."
            )
        number = array.item()
        values[name] = number if math.isfinite(number) else str(number)
    return values


def read_metrics(loc: Location, step: int) -> dict[str, Any]:
    """A committed step's metrics: from its manifest, or, for a step saved by
    version 1, from the file beside it."""
    manifest = read_manifest(loc.joined(_format.step_name(step)))
    if manifest is not None and manifest.format_version >= 2:
        return {k: float(v) if isinstance(v, str) else v for k, v in manifest.metrics.items()}
    fix = f"Delete it to keep step {step} without metrics."
    name, parse = _format.metrics_name(step), lambda data: _metrics_file_values(data, step)
    values = read_small_file(loc, name, _MAX_METRICS_BYTES, parse, what="metrics file", fix=fix)
    return {} if values is None else values


def read_small_file(
    loc: Location, name: str, limit: int, parse: Callable[[bytes], _T], *, what: str, fix: str
) -> _T | None:
    """What `parse` makes of the manager's file `name` in `loc` (at most `limit`
    bytes), or `None` where there is none. A file `parse` rejects is a
    `CorruptCheckpointError` naming it (`what`) and saying the `fix`."""
    data = _storage.read_file(loc, name, limit=limit)
    if data is None:
        return None
    try:
        return parse(data)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"The {what} {name!r} in {loc.display!r} is invalid ({e}). {fix}",
            path=loc.display,
        ) from None


def _metrics_file_values(data: bytes, step: int) -> dict[str, Any]:
    """The metrics of step `step` in `data`, a metrics file as version 1 wrote
    it; raises `ValueError`, `KeyError` or `TypeError` for anything else."""
    body = _manifest.loads_file(data)
    values = body["metrics"]
    if len(data) > _MAX_METRICS_BYTES or body["step"] != step or not isinstance(values, dict):
        raise ValueError("unexpected content")
    if not all(isinstance(v, (bool, int, float, str)) for v in values.values()):
        raise ValueError("a metric is not a number")
    return {str(k): float(v) if isinstance(v, str) else v for k, v in values.items()}


def show_steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 12:
        return str(steps)
    return f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-5:]))}] ({len(steps)} steps)"


def delete_step(loc: Location, step: int) -> None:
    """Delete a committed step of the manager's directory at `loc`: the
    manifest first, so that the step is gone at once even if the deletion of
    its arrays is interrupted."""
    _storage.delete_file(loc.joined(_format.step_name(step)), MANIFEST)
    metrics = [_format.metrics_name(step)] if written_metrics(loc, step) else []
    _storage.remove(loc, [_format.step_name(step), *metrics])
