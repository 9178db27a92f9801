"""Progress of long jobs (saves, loads, verify, diff): a tqdm bar on a terminal,
or the caller's callback.

Every job that moves many bytes takes `progress=`:

- `None` (the default): a bar on stderr when stderr is a terminal and the job is
    large (`MIN_BYTES` or `MIN_LEAVES`); nothing otherwise, so logs and pipes stay
    clean.
- `True`: a bar on stderr whatever the size (still only on a terminal).
- `False`: nothing.
- a callable: called as `progress(leaves_done, leaves_total, bytes_done,
    bytes_total)` as work is done, with running counts that only grow and end
    equal to the totals.

Bytes are counted a chunk file or a slab at a time, so one large leaf moves
the bar in steps. Such partial counts reach a callback in steps of at least
`1 / PARTIAL_STEPS` of the job's bytes (a leaf done, at once); leaves that land
together (a pack's) are counted at most `1 / PARTIAL_STEPS` of them a call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from ._errors import CheckpointTypeError

Callback: TypeAlias = Callable[[int, int, int, int], Any]
Progress: TypeAlias = bool | Callback | None

# A job is large enough for a bar from this many bytes or leaves.
MIN_BYTES = 256 * 2**20
MIN_LEAVES = 2000
# Bytes done within leaves reach a callback in steps of at least this fraction of the job.
PARTIAL_STEPS = 256


class Tracker:
    """Running counts of one job, shown as a bar or passed to a callback. A lock
    guards the counts, so that any thread may report; the callback runs outside it."""

    def __init__(self, progress: Progress, *, leaves: int, nbytes: int, what: str):
        self.leaves_total, self.bytes_total = leaves, nbytes
        self.leaves_done = self.bytes_done = 0
        self._called_at, self._step = 0, nbytes // PARTIAL_STEPS
        self._lock = threading.Lock()
        progress = _check(progress)
        self._callback = progress if callable(progress) and not isinstance(progress, bool) else None
        self._bar: Any = None
        if self._callback is None and _wants_bar(progress, leaves, nbytes):
            from tqdm import tqdm

            self._bar = tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=what, file=sys.stderr)
            self._bar.set_postfix_str(f"0/{leaves} leaves", refresh=False)

    def advance(self, *, leaves: int = 0, nbytes: int = 0) -> None:
        if not leaves and not nbytes:
            return
        with self._lock:
            self.leaves_done += leaves
            self.bytes_done += nbytes
            counts = (self.leaves_done, self.leaves_total, self.bytes_done, self.bytes_total)
            if self._bar is not None:
                self._bar.set_postfix_str(f"{counts[0]}/{counts[1]} leaves", refresh=False)
                self._bar.update(nbytes)
            # Bytes within a leaf are reported in steps; a leaf done, at once.
            call = bool(leaves) or self.bytes_done - self._called_at >= max(self._step, 1)
            if call:
                self._called_at = self.bytes_done
        if call and self._callback is not None:
            self._callback(*counts)

    def count_leaves(self, sizes: Sequence[int]) -> None:
        """Report leaves done, of `sizes` bytes each (0 where reported within it),
        a few at a time, so that "n of N" counts up through a pack's leaves."""
        step = max(1, self.leaves_total // PARTIAL_STEPS)
        for i in range(0, len(sizes), step):
            part = sizes[i : i + step]
            self.advance(leaves=len(part), nbytes=sum(part))

    def within(self, nbytes: int) -> _Within:
        """A function reporting bytes done within one leaf of `nbytes`, never more
        than it has; `rest()` gives what it left to report."""
        return _Within(self, nbytes)

    def describe(self, what: str) -> None:
        """Rename the bar, and show its counts now (a save says it is committing)."""
        if self._bar is not None:
            self._bar.set_description_str(what, refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wants_bar(progress: Progress, leaves: int, nbytes: int) -> bool:
    if progress is False or not _is_terminal():
        return False
    return progress is True or nbytes >= MIN_BYTES or leaves >= MIN_LEAVES


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def _check(progress: Any) -> Progress:
    """`progress` itself, once it is known to be one of the accepted kinds."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise CheckpointTypeError(
        f"`progress` must be `None` (a bar on a terminal for large jobs), `True`, `False`, or a callable "
        f"`(leaves_done, leaves_total, bytes_done, bytes_total)`, not {type(progress).__name__}."
    )


class _Within:
    __slots__ = ("_left", "_tracker")

    def __init__(self, tracker: Tracker, nbytes: int):
        self._tracker, self._left = tracker, nbytes

    def __call__(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._left)
        self._left -= nbytes
        self._tracker.advance(nbytes=nbytes)

    def rest(self) -> int:
        return self._left
