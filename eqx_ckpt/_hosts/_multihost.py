"""Several JAX processes taking part in one save or one restore: the group,
its barriers, and who writes which leaf.

A save's stages (`_serialise.Stages`), and a restore that reads each byte once
(`_read_once`), each make a `Group` and meet at its barriers (`Group.sync`):
keys of the coordination service of `jax.distributed`, not device
collectives, so that the CPU backend needs none, each process's error
reaches the others, and an asynchronous save's thread cannot interleave with
the training step's collectives.

Between one-second waits at a barrier, the heartbeat of a process that has not
arrived is checked (`_Heartbeat`), so that one killed outright is found within
`SILENT_SECONDS` and named, whether it died inside the group or before it
joined it: the coordination service has no quicker answer (docs/scaling.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
import threading
import time
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._base import _faults, _threads
from .._base._errors import CheckpointError
from ._sharding import on_one_device

# A barrier waits this long for the slowest process: it covers writing that
# process's whole share of a checkpoint.
TIMEOUT_MS = 60 * 60 * 1000

# Every process bumps its heartbeat key this often, from a thread of its own...
HEARTBEAT_SECONDS = 1.0
# ...and one whose heartbeat has not moved for this long, while the others wait
# for it at a barrier, is taken for dead (killed, crashed, its machine gone).
# Long enough for a process busy in code that holds the GIL (the thread then
# cannot run); short enough that the others stop within seconds.
SILENT_SECONDS = 10.0

# One wait for a process's barrier key, between checks of its heartbeat.
_WAIT_MS = 1000

# Saves (and restores that share reads, a tiered manager's saves of its parts,
# its copies of them, its agreements on them and its moves of them between
# peers) are numbered in the order each process makes
# them. That order is the same in every process, so the n-th save's barriers
# have the same names everywhere.
_KINDS = ("save", "restore", "part", "copy", "tiers", "peers")
_numbers = types.MappingProxyType({what: itertools.count() for what in _KINDS})


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
    """The processes taking part in one save or restore (`what`); a barrier
    waits `timeout` seconds for the slowest (`TIMEOUT_MS` by default)."""

    def __init__(self, what: str = "save", timeout: float | None = None) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()
        self.what = what
        self._name = f"eqx_ckpt/{what}/{next(_numbers[what])}" if self.count > 1 else ""
        self._timeout = TIMEOUT_MS / 1000 if timeout is None else timeout
        self._lost: CheckpointError | None = None
        self._passed = ""  # the last stage every process reached
        if self.count > 1:
            # A process that dies after this is said to have died inside the
            # save or restore; one that never sets it, never to have joined it.
            client = _client()
            _Heartbeat.start(client, self.index)
            client.key_value_set(f"{self._name}/entered/{self.index}", "")

    @property
    def primary(self) -> bool:
        return self.index == 0

    @property
    def name(self) -> str:
        """The group's name, unique in the job ("" for one process)."""
        return self._name

    def sync(
        self, stage: str, error: BaseException | None, plan: str | None = None, *, shared: str | None = None
    ) -> BaseException | None:
        """Wait until every process has reached `stage`; this process's `error`,
        else one naming the processes that failed or stopped answering, or
        differ in their `plan` (a digest: `differing`), else `None`. `shared`:
        a text every process gives, which process 0 then reads (`gathered`)."""
        _faults.fire("multihost.barrier", self.what, stage)
        if self.count == 1:
            return error
        if self._lost is not None:  # a process died at an earlier stage: nobody else will arrive
            return error or self._lost
        client = _client()
        _Heartbeat.start(client, self.index)
        key = f"{self._name}/{stage}"
        if plan is not None:  # before this process's barrier key: whoever passes the barrier sees it
            client.key_value_set(f"{key}-plan/{self.index}", plan)
        if shared is not None:
            client.key_value_set(f"{key}-shared/{self.index}", shared)
        client.key_value_set(f"{key}/{self.index}", "" if error is None else _describe(error))
        self._lost = _wait(client, key, self.count, _Stage(self.what, stage, self._timeout, self._name, self._passed))
        if error is not None or self._lost is not None:
            return error or self._lost
        self._passed = stage
        failed = sorted((int(k.rsplit("/", 1)[-1]), v) for k, v in client.key_value_dir_get(f"{key}/") if v)
        if failed:
            lines = "\n".join(f"  - process {i}: {message}" for i, message in failed)
            doing, outcome = _FAILED[self.what]
            return CheckpointError(f"{doing} failed in {len(failed)} other process(es), so {outcome}:\n{lines}")
        if plan is None:
            return None
        return differing(
            {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(f"{key}-plan/")}, self.count
        )

    def gathered(self, stage: str, own: str) -> dict[int, str]:
        """Every process's `shared` text of `stage` (this process's is `own`), by index."""
        if self.count == 1:
            return {0: own}
        texts = _client().key_value_dir_get(f"{self._name}/{stage}-shared/")
        return {int(k.rsplit("/", 1)[-1]): v for k, v in texts}


def differing(plans: dict[int, str], count: int) -> CheckpointError | None:
    """The error, the same in every process, of a save whose processes planned
    different saves (`plans`: digests by index), where a slice of a replicated
    leaf would go unwritten; else `None`."""
    digests = [plans.get(index) for index in range(count)]
    others = [index for index in range(1, count) if digests[index] != digests[0]]
    if not others:
        return None
    return CheckpointError(
        f"The processes did not save the same tree: process(es) {others} planned a save different from process "
        f"0's (other leaves, shapes, dtypes or chunks), so nothing was written. Every process must call the save "
        f"with the same tree, in the same order."
    )


class _Stage(NamedTuple):
    """A barrier of a save or a restore (`what`) in its group's keys (`group`),
    after the stage every process `passed`."""

    what: str
    name: str
    timeout: float
    group: str
    passed: str


def _wait(client: Any, key: str, count: int, stage: _Stage) -> CheckpointError | None:
    """Wait for every process's key under `key`; the error naming the processes
    that stopped answering, or did not arrive within the stage's time-out."""
    deadline = time.monotonic() + stage.timeout
    silence = _Silence(client)
    for index in range(count):
        while True:
            try:
                client.blocking_key_value_get(f"{key}/{index}", _WAIT_MS)
                break
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
            if silence.dead(index):
                return _lost(client, index, count, stage)
            if time.monotonic() > deadline:
                return _late(client, key, count, stage)
    return None


def _late(client: Any, key: str, count: int, stage: _Stage) -> CheckpointError:
    """The error of a barrier that some processes, still running, did not reach in time."""
    arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(f"{key}/")}
    missing = [index for index in range(count) if index not in arrived]
    call = _CALLS[stage.what]
    who = f"Process {missing[0]}" if len(missing) == 1 else f"Processes {', '.join(map(str, missing))}"
    still = "it is" if len(missing) == 1 else "they are"
    return CheckpointError(
        f"{who} of {count} did not reach stage {stage.name!r} of the {_NOUNS[stage.what]} within {stage.timeout:g} s, "
        f"although {still} still running. {_outcome(stage)} Every process must call the {call}, in the same order."
    )


def _lost(client: Any, index: int, count: int, stage: _Stage) -> CheckpointError:
    """The error of a barrier that process `index`, its heartbeat stopped, will never reach."""
    silent = f"no heartbeat for {SILENT_SECONDS:g} s while the others waited for it at stage {stage.name!r}"
    if _has(client, f"{stage.group}/entered/{index}"):
        where = f"after stage {stage.passed!r}" if stage.passed else "before its first stage"
        what = f"stopped answering during the {_NOUNS[stage.what]}, {where} ({silent}): it was killed or crashed"
    else:
        call = _BEFORE[stage.what]
        what = (
            f"never joined the {_NOUNS[stage.what]}: it stopped answering before it began it ({silent}). It was "
            f"killed or crashed before it called {call}"
        )
    return CheckpointError(
        f"Process {index} of {count} {what}, so this {_NOUNS[stage.what]} cannot finish. {_outcome(stage)} Its own log "
        f"says why it stopped; `jax.distributed` ends the remaining processes too once its own heartbeat times out."
    )


def _has(client: Any, key: str) -> bool:
    try:
        client.key_value_try_get(key)
    except Exception:  # NOT_FOUND
        return False
    return True


def _outcome(stage: _Stage) -> str:
    """What a save, restore, copy or agreement that stopped at `stage` left."""
    if stage.what == "restore":
        return "Nothing was loaded."
    if stage.what == "tiers":
        return "No step was chosen."
    if stage.what == "peers":
        return "The parts each process committed in its own local tier are unchanged."
    if stage.what == "part" and stage.name == "committed":
        return (
            "Each other process committed its own part in its own local tier; the step is restored from there "
            "only where every process's part is."
        )
    if stage.what == "copy":
        if stage.name == "committed":
            return "Process 0 may have committed the step there: list the persistent tier's steps to see."
        return "Nothing of the step was committed in the persistent tier; the local tiers keep it."
    if stage.name == "committed":
        return "Process 0 may have committed it: load the checkpoint to see which save it holds."
    return "Nothing was committed: the checkpoint saved before is unchanged."


# How each kind of group's errors speak of it: its name, what failed and what
# that left, what every process must call, and what a process that never
# joined had not reached.
_NOUNS = types.MappingProxyType(
    {
        "save": "save",
        "restore": "restore",
        "part": "save",
        "copy": "copy",
        "tiers": "agreement",
        "peers": "move of parts between peers",
    }
)
_FAILED = types.MappingProxyType(
    {
        "save": ("Saving", "nothing was committed"),
        "part": ("Saving", "nothing was committed"),
        "restore": ("Loading", "nothing was loaded"),
        "copy": ("Copying a local step to the persistent tier", "nothing of it was committed there"),
        "tiers": ("Listing the local tier's steps", "no step was chosen"),
        "peers": ("Moving parts of a local step between peers", "no copy it made is kept"),
    }
)
_CALLS = types.MappingProxyType(
    {
        "save": "save with the same tree",
        "part": "save with the same tree",
        "restore": "load with the same `like`",
        "copy": "save of each step, with managers of the same `persistent_every`",
        "tiers": "first listing of its tiered manager's steps (`all_steps`, `latest_step`, `restore`...)",
        "peers": "save and restore of the same steps, with managers of the same `peers`",
    }
)
_BEFORE = types.MappingProxyType(
    {
        "save": "the save, or as the save started",
        "part": "the save, or as the save started",
        "restore": "the load, or in the load before its shared reads",
        "copy": "the save of the step, or as its copy started",
        "tiers": "the manager's first listing of its steps",
        "peers": "the save or restore of the step",
    }
)


def wait_key(key: str, index: int, timeout: float, abandoned: str = "") -> str | None:
    """Wait for `key` of the coordination service, which process `index` sets;
    `None` once it is there, else why not (`_waited`)."""
    client = _client()

    def ready() -> bool:
        try:
            client.blocking_key_value_get(key, _WAIT_MS)
        except Exception as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            return False
        return True

    return _waited(ready, index, timeout, abandoned)


def wait_done(future: concurrent.futures.Future[Any], index: int, timeout: float, abandoned: str = "") -> str | None:
    """Wait for `future`, work that needs process `index`; `None` once it is
    done (its outcome is the caller's to take), else why not (`_waited`)."""

    def ready() -> bool:
        done, _ = concurrent.futures.wait([future], timeout=_WAIT_MS / 1000)
        return bool(done)

    return _waited(ready, index, timeout, abandoned)


def _waited(ready: Callable[[], bool], index: int, timeout: float, abandoned: str) -> str | None:
    """Call `ready` (which waits a little) until it is true; else why not:
    process `index` stopped answering (silent for `SILENT_SECONDS`), the key
    `abandoned` was set (its text says why), or `timeout` seconds passed."""
    client = _client()
    silence, deadline = _Silence(client), time.monotonic() + timeout
    while not ready():
        if abandoned and _has(client, abandoned):  # (its text bounded, as every process's error it shows)
            return str(client.key_value_try_get(abandoned))[:_SHOWN]
        if silence.dead(index):
            silent = f"no heartbeat for {SILENT_SECONDS:g} s"
            return f"process {index} stopped answering ({silent}): it was killed or crashed"
        if time.monotonic() > deadline:
            return f"process {index} did not answer within {timeout:g} s"
    return None


class _Silence:
    """When each process's heartbeat was last seen to change (by this process's clock)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._seen: dict[int, tuple[str, float]] = {}

    def dead(self, index: int) -> bool:
        """Whether process `index` has been silent for `SILENT_SECONDS`. One
        never seen beating (its JAX backend not yet started: `_Heartbeat`) is not
        judged: it may be alive and on its way."""
        try:
            beat = self._client.key_value_try_get(_Heartbeat.key(index))
        except Exception:
            return False
        now = time.monotonic()
        last = self._seen.get(index)
        if last is None or last[0] != beat:
            self._seen[index] = (beat, now)
            return False
        return now - last[1] > SILENT_SECONDS


class _Heartbeat:
    """This process's heartbeat: a thread, started when eqx_ckpt is imported,
    bumps a key every `HEARTBEAT_SECONDS`. It ends where JAX's backend started
    without `jax.distributed` (which can then no longer start). A process
    forked after the import (a data loader's worker, a pre-forking server's
    child) starts one of its own (`_forked`)."""

    _started: threading.Thread | None = None
    _stop = threading.Event()
    _lock = threading.Lock()
    # The client and this process's index, once known: given by a group
    # (`start`), or else found in `jax.distributed`'s state.
    _given: tuple[Any, int] | None = None

    @staticmethod
    def key(index: int) -> str:
        return f"eqx_ckpt/alive/{index}"

    @classmethod
    def watch(cls) -> None:
        with cls._lock:
            if cls._started is not None:
                return
            # (Read here: a thread that imports can deadlock an import.)
            run = functools.partial(cls._run, *_jax_state())
            # Stopped at exit before `jax.distributed` shuts its client down (`_threads`).
            cls._started = _threads.thread("eqx_ckpt-heartbeat", run, stop=cls._stop.set)
            cls._started.start()

    @classmethod
    def start(cls, client: Any, index: int) -> None:
        """Beat with `client` as process `index`, a first beat now: seen before
        this process's first barrier key."""
        if cls._given is None:
            client.key_value_set(cls.key(index), "0", allow_overwrite=True)
            cls._given = (client, index)
        cls.watch()

    @classmethod
    def _run(cls, state: Any, backends_started: Callable[[], bool]) -> None:
        count = 0
        while not cls._stop.wait(HEARTBEAT_SECONDS):
            # Read before the client: `initialize` sets that first. JAX's backend
            # starts after `initialize` returns, with the client connected: a
            # call on a client still connecting could stop it from connecting.
            started = backends_started()
            joined = started and state.client is not None and (state.num_processes or 1) > 1
            given = cls._given or ((state.client, state.process_id) if joined else None)
            if given is None:
                if started:
                    return  # one process: `jax.distributed.initialize` refuses to run once a backend has started
                continue
            count += 1
            try:
                given[0].key_value_set(cls.key(given[1]), str(count), allow_overwrite=True)
            except Exception:
                return  # the coordination service is gone (shut down, or process 0 died)

    @classmethod
    def _forked(cls) -> None:
        """In a forked child: a fork carries no thread over, so the child
        watches for a `jax.distributed` of its own. A child of a process that
        had joined one (its client, copied, is not the child's) never beats:
        a parent that dies is then named, not hidden by its child's beats."""
        cls._started, cls._given = None, None
        cls._stop, cls._lock = threading.Event(), threading.Lock()
        state, _ = _jax_state()
        if state.client is None:
            cls.watch()


class _NoDistributed(NamedTuple):
    """`jax.distributed`'s state where it cannot be read: no client, one process."""

    client: Any = None
    num_processes: int = 1
    process_id: int = 0


def _jax_state() -> tuple[Any, Callable[[], bool]]:
    """`jax.distributed`'s state, and whether JAX's backend has started. A JAX
    without these private names: no client and never (the first beat then
    comes with this process's first group, `_Heartbeat.start`, as before
    issue 59)."""
    try:
        from jax._src import distributed, xla_bridge

        return distributed.global_state, xla_bridge.backends_are_initialized
    except (ImportError, AttributeError):
        return _NoDistributed(), lambda: False


_Heartbeat.watch()
os.register_at_fork(after_in_child=_Heartbeat._forked)


# The most characters of another process's error a message shows.
_SHOWN = 2000


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:_SHOWN] or type(error).__name__


def writes(x: Any, primary: bool | None = None) -> bool:
    """Whether this process writes (its pieces of) leaf `x`: a `jax.Array`
    spread over several processes is written by each that addresses shards of
    it; anything else, by process 0. `primary`: whether this is process 0,
    when the caller knows (asking JAX for every leaf is slow: docs/benchmarks.md)."""
    if isinstance(x, jax.Array) and not on_one_device(x) and not x.is_fully_addressable:
        return True
    return jax.process_index() == 0 if primary is None else primary
