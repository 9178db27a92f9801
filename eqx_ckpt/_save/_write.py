"""Waiting for a save's writes: the futures that the location's writer
(`_storage.chunk_files(loc).writer`, `_store/_writers.py`) started and
`_staging.start_writes` put in `out`, and the arrays' creations. The save
waits for them all (`wait_all`, which keeps the first error), or lets them
settle before an abort deletes what they wrote (`settle`); `attempt` and
`settle` are `_interrupts`' own, named here for the save's modules."""

from __future__ import annotations

from typing import Any

from .._base._interrupts import attempt, settle

__all__ = ["attempt", "settle", "wait_all"]


def wait_all(futures: list[Any], error: BaseException | None) -> BaseException | None:
    """Wait for every future; the first error (or `error`, if given)."""
    for future in futures:
        error = error or attempt(future.result)
    return error
