"""Named fault points: the one seam through which tests inject faults into I/O.

Each point is a call `_faults.fire("<name>", *args)` at one step of a save or
a load. A test arms it (`armed`, or the `faults` fixture of
`tests/conftest.py`) to raise there, or to run a callback with the point's
arguments. Disarmed, a point costs a call and one global lookup. Points are
named by what happens, not where, so code can move without its tests changing.

Points fire in whatever thread reaches them: the caller's, or one of
eqx_ckpt's (`eqx_ckpt-io`, `-save`, `-write`, `-open`, `-read`, `-lease`).
Arming is seen by every thread at once; a callback that cares checks
`threading.current_thread()`. What each point passes, and when: `DESCRIBED`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from . import _state

# An exception (instance or class) to raise at a point, or a callback called
# with the point's arguments.
Action = BaseException | type[BaseException] | Callable[..., object]


# Each point: the arguments it passes, then where and when it fires.
DESCRIBED: Mapping[str, str] = types.MappingProxyType(
    {
        # A save's plan (`_records`, `_background`, `_serialise`, `_staging`)
        "save.records": "(loc): a save starts making its leaves' records (running the filter specs), before anything "
        "is written.",
        "save.records_reused": "(loc): a save takes, as they are, the records a save of the same structure and leaves "
        "kept (`_records.Plan`), after `save.records`.",
        "save.leaf_record": "(path): one leaf's record and host pieces are made the general way (a PRNG key, a "
        "sharded array, a scalar, a cast; the common leaf's short branch does not pass here).",
        "save.slices": "(path, regions): a process of a multi-process save took its share of the leaf at `path`, one "
        "spread over several processes (sharded, or replicated): `regions`, the regions it writes (tuples of slices; "
        "none when the others write it all). `_sharding.slices` says who writes what.",
        "save.array_kind": "(cls): what a leaf of type `cls` is, asked (of every type of the tree as an asynchronous "
        "save holds it, and per leaf later).",
        "save.held": "(loc): the background thread of an asynchronous save whose leaves were held starts its plan, "
        "transaction and writes.",
        "save.pinned_copies": "(arrays): a save on an accelerator copies `arrays` into pinned host memory "
        "(`_memory.pinned`; a blocking one only on a GPU, piece by piece within its staging budget: "
        "`_memory.PINNED_SAVE_COPIES`); an exception raised here makes it copy through the CPU device instead.",
        "save.device_copies": "(arrays): an asynchronous save on a GPU copies `arrays` on their devices, before "
        "this process has pinned memory for them (`_memory.on_device`); an exception raised here makes it copy them "
        "into pinned memory instead.",
        "save.copied": "(pending): the host data of the NumPy leaves of `pending` (the save's leaves) was copied, as "
        "an asynchronous save with a custom filter spec does in the caller's thread.",
        "save.start_writes": "(loc): a save starts creating and writing its arrays; an exception raised here is the "
        "write's.",
        "save.staged": "(nbytes, budget): the host bytes a save has staged and not yet written changed, to `nbytes`, "
        "within its staging budget of `budget` bytes (`_staging`: a write larger than the budget is staged alone, "
        "when nothing else is).",
        "save.records_freed": "(): a save freed its records and host views (once the manifest was encoded, its writes "
        "still in flight).",
        # Storage (`_storage`)
        "storage.open": "(loc): a TensorStore kvstore is opened, before every small file read, written, listed or "
        "deleted through TensorStore (a lease file too).",
        "storage.read_file": "(loc, name): a small file (a manifest) is read for a load.",
        "storage.file_found": "(path): on a local disk, that file was found, before it is opened (another process may "
        "delete it between the two).",
        "storage.read_generation": "(loc, name): the manifest is read, with its generation, as a save begins.",
        "storage.list": "(loc): the top-level entries of a checkpoint are listed.",
        "storage.transaction": "(): the TensorStore transaction that stages a save's writes through TensorStore is "
        "made.",
        "storage.create_array": "(loc): a zarr array (a leaf's, or a pack's) is created.",
        "storage.open_array": "(loc, record): a stored leaf's array is opened through TensorStore (to read or verify "
        "it; in a multi-process save, to write into the array process 0 created).",
        "storage.open_pack": "(loc, pack): a pack's array is opened through TensorStore (to read or verify its "
        "leaves).",
        "storage.remove": "(loc, names): top-level entries are deleted whole (what an aborted save created, a "
        "manager's dropped step).",
        "storage.remove_written": "(loc, names): what saves wrote under the top-level entries `names` is deleted "
        "(after a commit, the arrays of the checkpoint it replaced).",
        "storage.delete_file": "(loc, name): one small file is deleted (a manager deleting a step's manifest first).",
        # Commit (`_transaction`, `_lease`, `_interrupts`)
        "lease.acquire": "(loc, name): a save (or a manager) takes a directory's lease.",
        "transaction.begin": "(loc): a save begins its transaction (before the lease).",
        "transaction.join": "(loc): a process other than process 0 of a multi-process save joins process 0's "
        "transaction.",
        "transaction.commit": "(loc): a save commits (before its lease is checked and its manifest written).",
        "commit.manifest_write": "(loc, name): the manifest's conditional write, before it is started (then its "
        "directory is synced: `sync.directory`).",
        "commit.manifest_encode": "(loc): process 0 encodes the manifest, while the arrays are being written; an "
        "exception raised here is the encoding's.",
        "commit.manifest_written": "(loc, written): the manifest's conditional write returned (`written`: whether it "
        "landed), in the helper thread, before the save records whether it committed (an exception raised here loses "
        "that record).",
        "interrupts.queue": "(job): a job is about to be handed to the helper thread that signals never reach (an "
        "interrupt raised here has queued nothing).",
        "interrupts.queued": "(job): the job was handed over (an interrupt raised here has queued it).",
        # Durability (`_durable`)
        "sync.flush": "(loc): before a commit, everything a save wrote to a local disk is made durable.",
        "sync.file": "(path): one file or directory is fsynced.",
        "sync.file_system": "(path): the file system holding `path` is synced (`syncfs`, a flush of many files).",
        "sync.directory": "(path): a directory's entries are made durable (after the manifest landed, a lease file "
        "written).",
        "sync.create_directory": "(loc): a local directory and its missing parents are created, durably.",
        # Chunk files on a local disk (`_local_write`, `_local_read`)
        "local_write.chunk": "(directory, key): a chunk writer thread starts on chunk file `key` of array `directory`.",
        "local_write.chunk_bytes": "(fd): that file is created, its bytes about to be written; an `OSError` raised "
        "here is reported as the write's, naming the file.",
        "local_write.unbuffered": "(fd): the file is written past the page cache.",
        "share.verify": "(path): an incremental save reads the chunk file `path` of the checkpoint it follows whole, "
        "to verify it before sharing it: once per process per file (`_share`).",
        "share.link": "(source, path): an incremental save is about to make chunk file `path` a hard link to "
        "`source`, the same bytes in the checkpoint it follows (`_share`).",
        "share.written": "(path): the chunk file `path`, just written (by a `CheckpointManager` step, or compared "
        "by a plain overwrite), is recorded with its xxh3-128, so a next save sharing it need not read it (`_share`).",
        "local_read.check_files": "(directory): a load checks the folder and chunk files of array `directory` (in a "
        "thread of its own for a whole leaf).",
        "local_read.start_reads": "(path, keys): the reads of those chunk files are started in the reader threads.",
        "local_read.read": "(fd, offset): a reader thread reads one step of a chunk file, or a run of a safetensors "
        "file on a local disk (`_chunk_files.read_local_range`); an `OSError` raised here is reported as the read's.",
        "local_read.crc": "(key): a chunk's joined crc32c is compared with its stored one.",
        "digests.filled": "(end): a reader thread read a run of a published folder's safetensors file on a local "
        "disk up to its byte `end`, and hashes the whole blocks below it (`_digests.Feed`); an exception raised here "
        "is reported as the read's.",
        # Several processes (`_multihost`)
        "multihost.barrier": '(what, stage): a process reaches barrier `stage` of a save (`what`: "save"; a save of '
        'one process passes each stage too) or of a restore that shares reads ("restore"), before it tells the others '
        "it has.",
        # A load (`_reader`, `_deserialise`, `_read_once`, `_untrusted`, `_pack`, `_window`, `_read`, `_lazy`,
        # `_tree`, `_rebuild`)
        "load.read_stored": "(loc): a load has planned every leaf (filter specs and transforms run) and starts "
        "reading stored leaves through `_reader.read_leaves`; so do a skeleton-less `Checkpoint.load`, a lazy leaf "
        "read whole, and `materialise` (once per checkpoint it reads from).",
        "load.structure_compared": "(where): a load with `like` parses the stored structure record of checkpoint "
        "`where` to compare its static fields with `like`'s (`_rebuild`), because the record `like` makes differs "
        "from it.",
        "load.read_once": "(path, regions): a process of a multi-process restore that shares reads (`_read_once`) "
        "read its slices `regions` (tuples of `(start, stop)` per axis) of the leaf at dotted `path` from storage, "
        "before the barrier that precedes the all-gather (only for a leaf it reads a slice of).",
        "load.pinned_view": "(shape): a load through the pool's buffers in pinned memory "
        "(`_memory.PINNED_LOAD_BUFFERS`) sends one to its device, to be viewed there as rows of `shape`.",
        "load.pinned_pool": "(nbytes): a load allocates one buffer of `nbytes` of the pool it reads large leaves "
        "through onto a GPU (`_memory.PINNED_LOAD_POOL`, `_reader`), once per process; an exception raised here makes "
        "it load them the usual way.",
        "memory.map": "(nbytes): `nbytes` of private memory are about to be mapped (`_memory.fresh_bytes`): a large "
        "leaf's read buffer, and on a save a large copy or a write's staging buffer; an exception raised here is the "
        "allocation's.",
        "untrusted.scan": "(directory): a load checks the files of a folder on a local disk (a leaf's, and each "
        "folder below it) for links and sizes.",
        "pack.read_run": "(loc, pack, paths): a run of a pack holding the leaves `paths` starts being read (after "
        "a failed run, each leaf alone, to find the damaged one; by `verify`, each chunk as a run).",
        "window.open": "(): a reader starts taking its reads through the one host-memory budget (every reader passes "
        "here).",
        "window.start": "(in_flight): a read starts within the one host-memory budget, `in_flight` reads (itself "
        "included) then running.",
        "read.aval": "(shape, dtype): `_read.put`'s fast path makes the abstract value of a shape and dtype (once for "
        "each in one call).",
        "read.batched_put": "(hosts): that path is about to place `hosts` with JAX's internal call; an exception "
        "raised here is the call's (`put` falls back to `jax.device_put`, for good: `_read.FAST_PUT` becomes `None`).",
        "nested.load": "(data, key): a load without a skeleton nests the leaves at or below `key` as containers.",
        "tree.name_by_structure": "(treedef): a tree's leaves are named from its structure (its nodes rebuilt around "
        "numbers), not its key paths.",
        # The manager (`_manager`)
        "manager.save_returned": "(step, pending): a manager's save of `step` returned (`pending`: its `PendingSave`, "
        "or `None` once committed), before the manager takes it over; an interrupt raised here is one after the save "
        "went to the background.",
        "manager.undo": "(step): after a failed save, the manager is about to remove the step folder it created, "
        "unless it holds a committed checkpoint.",
        "tiers.copy_file": "(step, name): a manager's background copy of `step` from its local tier to its "
        "persistent directory is about to write the file `name` there (the manifest last); an exception raised here "
        "is that write's first attempt's.",
        "exchange.window": "(start, length): the processes of a tiered manager with `peers` are about to move one "
        "window of a part's bytes (`length` bytes from byte `start`) to its peer, or back, by one collective.",
        # A push to the Hub (`_hub`)
        "hub.commit": "(repo, revision): a push is about to make its commit to `repo` (at branch `revision`, or "
        "the default one: `None`), the repository and the branch made already.",
        # Other formats (`_safetensors`)
        "safetensors.read_headers": "(loc, files): a safetensors source is being opened: each file's header length "
        "was read, its header is read next.",
        "safetensors.read_run": "(loc, file, start, end): a load starts the one range read of a run of adjacent small "
        "tensors of `file` (bytes `start` to `end`).",
    }
)
POINTS = frozenset(DESCRIBED)


# The armed points; empty when nothing is armed.
_ARMED: _state.Table[str, Callable[..., object]] = _state.table("faults.armed", len(POINTS), "refuse")


def fire(point: str, *args: Any) -> None:
    """Reached at fault point `point` (one of `POINTS`): run what a test armed
    there, if anything, with `args`."""
    if _ARMED:
        action = _ARMED.get(point)
        if action is not None:
            action(*args)


@contextlib.contextmanager
def armed(points: str | Iterable[str] | Mapping[str, Action], action: Action | None = None) -> Iterator[None]:
    """Arm fault points for the duration of the block.

    **Arguments:**

    - `points`: a point's name, several names (each gets `action`), or a mapping
      from names to their actions.
    - `action`: an exception (instance or class), raised where the point fires,
      or a callable, called there with the point's arguments (it may raise).

    A point armed already gets its previous action back after the block,
    however it ends.
    """
    if isinstance(points, Mapping):
        actions = dict(points)
    elif action is None:
        raise ValueError("A fault point needs an action: an exception to raise, or a callable.")
    else:
        actions = dict.fromkeys([points] if isinstance(points, str) else points, action)
    unknown = sorted(set(actions) - POINTS)
    if unknown:
        raise ValueError(f"Unknown fault points {unknown}; the points are {sorted(POINTS)}.")
    with _ARMED.lock:
        previous = {name: _ARMED.get(name) for name in actions}
        _ARMED.update({name: _callable(a) for name, a in actions.items()})
    try:
        yield
    finally:
        with _ARMED.lock:
            for name, before in previous.items():
                if before is None:
                    _ARMED.pop(name, None)
                else:
                    _ARMED[name] = before


def _callable(action: Action) -> Callable[..., object]:
    if isinstance(action, BaseException) or (isinstance(action, type) and issubclass(action, BaseException)):
        error = action

        def raise_it(*args: object) -> None:
            raise error

        return raise_it
    return action
