"""Bytes moved from process to process of a `jax.distributed` job by JAX's own
transfer server (`jax.experimental.transfer`): a tiered manager's parts, to
their peers and back (`_peers`).

No network service of eqx_ckpt's own, and no collective: each process starts
one JAX transfer server, publishes its address through the coordination
service, and a receiver pulls each window of bytes (a `uint8` array on the
sender's device) from its sender. Not being a collective, a move may run in a
background thread beside the training step's collectives. A sender publishes
a window once its receivers took the one before (`_TAKEN`), so at most two
windows of each stream are in memory at once.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from .._base import _faults, _state, _threads
from .._base._errors import CheckpointError
from . import _multihost

# The bytes of one pull (a stream takes several).
WINDOW = 16 << 20

# How long a receiver waits for a window, and a sender for its receivers to
# take one, in seconds.
TRANSFER_SECONDS = 300.0

# The address this process's transfer server is reached at by the others:
# `None` for the address this process reaches the job's coordinator from.
ADDRESS: str | None = None


class Stream(NamedTuple):
    """One stream of a move: `size` bytes from process `sender` to process `receiver`."""

    sender: int
    receiver: int
    size: int


def move(
    name: str,
    streams: list[Stream],
    addresses: Mapping[int, str],
    fill: Callable[[Stream, int, memoryview], None],
    take: Callable[[Stream, int, memoryview], None],
) -> BaseException | None:
    """Move every stream this process sends or receives, a window at a time:
    `fill(stream, offset, view)` gives a window it sends, `take(stream,
    offset, view)` a window it received (a view valid during the call).
    `name` is unique to this move in the job; `addresses`, every process's
    `address()`. Neither `fill` nor `take` may raise: they keep their
    errors. The first error of this process's transfers, or `None`."""
    me, client = jax.process_index(), _multihost._client()
    mine = [s for s in streams if s.sender == me]
    theirs = [s for s in streams if s.receiver == me]
    windows = max((-(-s.size // WINDOW) for s in mine + theirs), default=0)
    error: BaseException | None = None
    for k in range(windows):
        for stream in mine:
            error = error or _publish(name, stream, k, fill)
        for stream in theirs:
            error = error or _pull(name, stream, k, addresses, take, client)
        if k:
            error = error or _taken(name, mine, k - 1)
        if error is not None:
            break
    if windows and error is None:
        error = _taken(name, mine, windows - 1)
    if error is not None:  # the others stop waiting for this process's windows
        why = _multihost._describe(error)
        client.key_value_set(_abandoned(name), f"process {me} gave up the move ({why})", allow_overwrite=True)
    return error


def address() -> str:
    """Where the other processes reach this process's transfer server."""
    return _server()[1]


@_state.memo(1)
def _server() -> tuple[Any, str]:
    """This process's transfer server (started once), and its address."""
    from jax.experimental import transfer

    host = ADDRESS or _own_host()
    server = transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])
    return server, server.address()


def _own_host() -> str:
    """The address this process reaches the job's coordinator from."""
    from jax._src import distributed

    coordinator = distributed.global_state.coordinator_address or "127.0.0.1:0"
    host, _, port = coordinator.rpartition(":")
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port or 0)))
        return s.getsockname()[0]


def _uuid(name: str, stream: Stream, k: int) -> int:
    digest = hashlib.sha256(f"{name}/{stream.sender}/{stream.receiver}/{k}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _window(stream: Stream, k: int) -> tuple[int, int]:
    start = k * WINDOW
    return start, max(0, min(WINDOW, stream.size - start))


def _publish(
    name: str, stream: Stream, k: int, fill: Callable[[Stream, int, memoryview], None]
) -> BaseException | None:
    """Offer window `k` of `stream` to its receiver."""
    start, length = _window(stream, k)
    if not length:
        return None
    try:
        row = np.zeros(length, np.uint8)
        fill(stream, start, row.data)
        _faults.fire("exchange.window", start, length)
        array = jax.device_put(row, jax.local_devices()[0])
        _server()[0].await_pull(_uuid(name, stream, k), [array], timeout=_deadline())
        _multihost._client().key_value_set(_key(_OFFERED, name, stream, k), "")
    except Exception as e:
        return e
    return None


def _pull(
    name: str,
    stream: Stream,
    k: int,
    addresses: Mapping[int, str],
    take: Callable[[Stream, int, memoryview], None],
    client: Any,
) -> BaseException | None:
    """Take window `k` of `stream` from its sender, once offered (`_OFFERED`), and say so (`_TAKEN`)."""
    start, length = _window(stream, k)
    if not length:
        return None
    try:
        _faults.fire("exchange.window", start, length)
        offered = _key(_OFFERED, name, stream, k)
        silent = _multihost.wait_key(offered, stream.sender, TRANSFER_SECONDS, _abandoned(name))
        if silent is not None:
            raise CheckpointError(silent)
        connection = _connection(addresses[stream.sender])
        like = jax.ShapeDtypeStruct((length,), np.uint8, sharding=_own_device())
        # Pulled in a thread of its own, so that a sender that dies meanwhile is named within seconds.
        pulling = _threads.pool("eqx_ckpt-pull", 4).submit(
            connection.pull, _uuid(name, stream, k), [like], timeout=_deadline()
        )
        silent = _multihost.wait_done(pulling, stream.sender, TRANSFER_SECONDS, _abandoned(name))
        if silent is not None:
            raise CheckpointError(silent)
        (array,) = pulling.result()
        take(stream, start, np.asarray(array).data)
        client.key_value_set(_key(_TAKEN, name, stream, k), "")
    except Exception as e:
        where = f"Bytes {start} to {start + length} of process {stream.sender}'s part"
        return CheckpointError(f"{where} did not arrive: {e}")
    return None


def _taken(name: str, streams: list[Stream], k: int) -> BaseException | None:
    """Wait until each receiver of `streams` took its window `k` (if it has one)."""
    for stream in streams:
        if not _window(stream, k)[1]:
            continue
        silent = _multihost.wait_key(_key(_TAKEN, name, stream, k), stream.receiver, TRANSFER_SECONDS, _abandoned(name))
        if silent is not None:
            return CheckpointError(f"The bytes this process sent were not all taken: {silent}.")
    return None


# The coordination service's keys of a move: a window offered by its sender, taken by its receiver.
_OFFERED, _TAKEN = "offered", "taken"


def _abandoned(name: str) -> str:
    """The key a process sets once it gives a move up: the others stop waiting for it."""
    return f"eqx_ckpt/{name}/abandoned"


def _key(what: str, name: str, stream: Stream, k: int) -> str:
    return f"eqx_ckpt/{name}/{what}/{stream.sender}/{stream.receiver}/{k}"


@_state.memo(64)
def _connection(address: str) -> Any:
    return _server()[0].connect(address)


def _own_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _deadline() -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=TRANSFER_SECONDS)
