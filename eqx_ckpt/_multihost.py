"""Several JAX processes saving one checkpoint: who writes what, and when.

With `jax.distributed` initialised, every process calls `tree_serialise_leaves`
with the same tree, in the same order (as for any collective). Each process
writes the shards it can address; process 0 alone runs the transaction (destination
checks, `saving.json`), creates the arrays' metadata and writes the manifest.

The processes meet at barriers of the distributed runtime's coordination service,
not at device collectives: that needs no collective support from the backend
(CPU included), carries each process's error to the others, so that a failure
anywhere fails the save everywhere instead of hanging it, and is safe from the
background thread of an asynchronous save, where a device collective could
interleave with the training step's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax

from . import _transaction
from ._errors import CheckpointError
from ._location import Location
from ._sharding import on_one_device

# A barrier waits this long for the slowest process: it covers writing that
# process's whole share of a checkpoint.
TIMEOUT_MS = 60 * 60 * 1000

# Saves are numbered in the order each process makes them, which is the same in
# every process, so the n-th save's barriers have the same names everywhere.
_saves = itertools.count()


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CheckpointError(
            f"jax.process_count() is {jax.process_count()} but `jax.distributed` has no "
            f"client, so the processes cannot agree on a commit. Call "
            f"`jax.distributed.initialize(...)` in every process before saving."
        )
    return client


class Group:
    """The processes taking part in one save (one process: every step is local)."""

    def __init__(self) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()
        self._name = f"eqx_ckpt/save/{next(_saves)}" if self.count > 1 else ""

    @property
    def primary(self) -> bool:
        """Whether this process runs the transaction (process 0)."""
        return self.index == 0

    def sync(self, stage: str, error: BaseException | None) -> BaseException | None:
        """Wait until every process has reached `stage`; return this process's
        `error`, or else an error saying which other processes failed (or `None`)."""
        if self.count == 1:
            return error
        client = _client()
        key = f"{self._name}/{stage}"
        client.key_value_set(f"{key}/{self.index}", "" if error is None else _describe(error))
        client.wait_at_barrier(key, TIMEOUT_MS)
        if error is not None:
            return error
        failed = sorted((int(k.rsplit("/", 1)[-1]), v) for k, v in client.key_value_dir_get(f"{key}/") if v)
        if not failed:
            return None
        lines = "\n".join(f"  - process {i}: {message}" for i, message in failed)
        return CheckpointError(f"Saving failed in {len(failed)} other process(es), so nothing was committed:\n{lines}")


def begin(
    group: Group,
    loc: Location,
    *,
    overwrite: bool,
    layout: str,
    paths: list[str],
    packs: list[str],
    check: Callable[[_transaction.Transaction], None] | None = None,
) -> _transaction.Transaction:
    """Process 0 begins the transaction, and runs `check` on it (which may
    refuse it: the transaction is aborted); the others then join it."""
    if group.primary:
        try:
            tx = _transaction.begin(loc, overwrite=overwrite, layout=layout, paths=paths, packs=packs)
            if check is not None:
                try:
                    check(tx)
                except BaseException:
                    tx.abort()
                    raise
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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000] or type(error).__name__


def writes(x: Any, primary: bool | None = None) -> bool:
    """Whether this process writes (its pieces of) leaf `x`.

    A `jax.Array` spread over several processes is written shard by shard, by the
    processes that address them. Anything else (NumPy arrays, scalars, arrays on
    one process's devices) every process holds a copy of, and process 0 writes.
    """
    # `primary`: whether this is process 0, when the caller knows (asking JAX
    # costs 10 us, three times a leaf before it was passed in).
    if isinstance(x, jax.Array) and not on_one_device(x) and not x.is_fully_addressable:
        return True
    return jax.process_index() == 0 if primary is None else primary
