"""Peers: copies of each process's part of a local step, held by other
processes (`CheckpointManager(..., peers=K, peer_stride=S)`), so that a host
replaced by an empty one fetches its part back from a peer instead of reading
the persistent tier (docs/manager.md, "Peers").

In each process's local tier, `peers/step_<step>/` holds:

- `parts.json`: the id of every process's part of the step, by the index of
  the process that saved it;
- `<id>/`: a copy of another process's part (its files, the manifest last:
  a copy without one is not committed).

A part's id is a digest of its files' names: of what it holds (each leaf's
chunk files are named by their region), not of the process that held it.

The bytes move by JAX's collectives (`_exchange`). What a peer sends is
untrusted: `_Incoming` checks every name and size before it writes a byte,
computes the id again from the names received, and writes only inside the
part's folder; a part is then loaded as any checkpoint is, every chunk checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax

from .._base._errors import CheckpointError
from .._base._location import Location
from .._hosts import _exchange, _multihost
from .._ondisk._format import MANIFEST, PARTS, PEERS, parse_step, step_name
from .._ondisk._manifest import loads_file
from .._store import _storage
from . import _tiers

# Bounds on what a peer may announce: the header of a part's stream, and its
# number of files.
_MAX_HEADER = 16 << 20
_MAX_FILES = 1 << 20
_ID = re.compile(r"[0-9a-f]{32}")


class Route(NamedTuple):
    """Where a process's part of a step comes from: the process `holder`
    holds the part `id` as its own step (`own`) or as a copy (not `own`)."""

    holder: int
    id: str
    own: bool


def part_id(names: Iterable[str]) -> str:
    """The id of a part whose files are `names`."""
    listed = "\n".join(sorted(name for name in names if name != MANIFEST))
    return hashlib.sha256(listed.encode()).hexdigest()[:32]


def folder(local: Location, step: int) -> Location:
    """The local tier's folder of `step`'s peer copies and `parts.json`."""
    return local.joined(PEERS).joined(step_name(step))


def shifts(peers: int, stride: int, count: int) -> list[int]:
    """How far each of a part's `peers` copies is sent: to `index + shift`."""
    return [(k * stride) % count for k in range(1, peers + 1)]


class _Outgoing:
    """A part's files as one stream: 8 bytes giving the header's length, the
    header (JSON: the part's id, its step, each file's name and size, the
    manifest last), then each file's bytes. Read once, in order (`read`)."""

    def __init__(self, loc: Location, step: int):
        names = _tiers.step_files(loc)
        assert loc.local is not None
        files = []
        for name in [*names, MANIFEST]:
            entry = _storage.local_entry(os.path.join(loc.local, *name.split("/")))
            if not entry.file or entry.link:  # (a step of the local tier holds regular files only)
                raise CheckpointError(
                    f"{name!r} of step {step} in {loc.display!r} is {'missing' if not entry.found else 'no file'}: "
                    f"this process's part of the step cannot be sent to its peers.",
                    path=loc.display,
                )
            files.append((name, entry.size))
        self.id = part_id(names)
        header = json.dumps({"id": self.id, "step": step, "files": files}).encode()
        self._loc, self._files = loc, files
        self.size = 8 + len(header) + sum(size for _, size in files)
        self._pieces = self._produce(len(header).to_bytes(8, "little") + header)
        self._piece, self._at = memoryview(b""), 0  # the piece being sent, and how much of it went
        self.error: BaseException | None = None

    def _produce(self, head: bytes) -> Iterator[bytes]:
        yield head
        for name, size in self._files:
            data = _storage.read_file(self._loc, name, limit=size)
            if data is None or len(data) != size:
                raise CheckpointError(f"{name!r} of {self._loc.display!r} changed while it was sent to a peer.")
            yield data

    def fill(self, offset: int, out: memoryview) -> None:
        """Fill `out` with the next bytes (from `offset`, where the last fill
        ended); left as it is (zeros) after an error, kept in `error`."""
        done = 0
        while done < len(out) and self.error is None:
            if self._at == len(self._piece):
                try:
                    self._piece, self._at = memoryview(next(self._pieces)), 0
                except StopIteration:
                    return
                except Exception as e:
                    self.error = e
                    return
            count = min(len(out) - done, len(self._piece) - self._at)
            out[done : done + count] = self._piece[self._at : self._at + count]
            done, self._at = done + count, self._at + count


class _Incoming:
    """A part received from a peer (`who`), checked, written into
    `folder/<id>/`, its manifest last (`finish`). Its errors are kept, not
    raised (`_exchange.move`), and the bytes after one are dropped."""

    def __init__(self, where: Location, step: int, announced: dict[str, Any], who: str):
        self._where, self._step, self._who = where, step, who
        self._id, self._size = announced["id"], announced["size"]
        self._buffer = bytearray()  # the header, until it is read
        self._file = bytearray()  # the file being received
        self._files: list[tuple[str, int]] | None = None
        self._manifest: bytes | None = None
        self._writes: list[Any] = []  # the files' writes, waited for before the manifest's
        self.error: BaseException | None = None
        self._received = 0

    def take(self, offset: int, data: memoryview) -> None:
        """The next bytes of the stream (from `offset`); errors kept in `error`."""
        if self.error is not None:
            return
        try:
            self._received += len(data)
            if self._files is None:
                data = self._read_header(data)
            if self._files is not None:
                self._write_files(data)
        except Exception as e:
            self.error = e

    def _read_header(self, data: memoryview) -> memoryview:
        """Take the header's bytes from `data`; once it is whole, check it.
        The bytes of `data` after it."""
        if len(self._buffer) < 8:
            count = 8 - len(self._buffer)
            self._buffer += data[:count]
            data = data[count:]
            if len(self._buffer) < 8:
                return data
        length = int.from_bytes(self._buffer[:8], "little")
        if length > _MAX_HEADER or 8 + length > self._size:
            raise self._refused(f"its header would be {length} bytes long")
        count = 8 + length - len(self._buffer)
        self._buffer += data[:count]
        data = data[count:]
        if len(self._buffer) < 8 + length:
            return data
        files = _checked_files(loads_file(bytes(self._buffer[8 : 8 + length])), self._step, self._id, self._refused)
        if 8 + length + sum(size for _, size in files) != self._size:
            raise self._refused("its files' sizes do not add up to the bytes it announced")
        _storage.remove(self._where, [self._id])  # what an interrupted copy of it left
        self._files, self._buffer = files, bytearray()
        return data

    def _write_files(self, data: memoryview) -> None:
        """Take `data` into the files being received, writing each once whole."""
        assert self._files is not None
        while self._files:
            name, size = self._files[0]
            count = min(size - len(self._file), len(data))
            if not self._file and count == size:  # the whole file in this window: copied once
                whole, data = bytes(data[:count]), data[count:]
            else:
                self._file += data[:count]
                data = data[count:]
                if len(self._file) < size:
                    return
                whole, self._file = bytes(self._file), bytearray()
            self._files.pop(0)
            if name == MANIFEST:
                self._manifest = whole
            else:  # (not made durable one by one: the manifest's write, last, is)
                self._writes += _storage.start_writes(self._where.joined(self._id), {name: whole}, synced=False)
        if len(data):
            raise self._refused("it sent more bytes than its files hold")

    def finish(self) -> BaseException | None:
        """Commit the copy (its manifest, written last); the first error, if any."""
        if self.error is None and (self._manifest is None or self._received != self._size):
            self.error = self._refused(f"it sent {self._received} of the {self._size} bytes it announced")
        try:
            for write in self._writes:
                _storage.result(write)
            if self.error is None:
                _storage.write_file(self._where.joined(self._id), MANIFEST, self._manifest or b"")
        except Exception as e:
            self.error = self.error or e
        return self.error

    def _refused(self, why: str) -> CheckpointError:
        return CheckpointError(
            f"The copy of part {self._id} of step {self._step} that {self._who} sent was refused: {why}. Nothing "
            f"of it is kept.",
            path=self._where.display,
        )


def _checked_files(header: Any, step: int, expected: str, refused: Any) -> list[tuple[str, int]]:
    """The files a peer's header lists, each name and size checked, the manifest last."""
    if not isinstance(header, dict) or header.get("step") != step or header.get("id") != expected:
        raise refused(f"its header is not that of part {expected} of step {step}")
    files = header.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= _MAX_FILES:
        raise refused("its header lists no files, or too many")
    checked: list[tuple[str, int]] = []
    for entry in files:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise refused("a file of its header is not a name and a size")
        name, size = entry
        if type(size) is not int or not 0 <= size < 2**48 or not _safe_name(name):
            raise refused(f"it names the file {name[:200]!r} of {size!r} bytes")
        checked.append((name, size))
    names = [name for name, _ in checked]
    if names[-1] != MANIFEST or len(set(names)) != len(names) or part_id(names) != expected:
        raise refused(f"its files are not those of part {expected}")
    return checked


def _safe_name(name: str) -> bool:
    """Whether `name` is a relative path inside the part's folder."""
    parts = name.split("/")
    return 0 < len(name) <= 1024 and all(
        part not in ("", ".", "..") and "\\" not in part and all(ord(c) >= 32 for c in part) for part in parts
    )


# -- Moves: every process calls each, in the same order ---------------------------------------------------


def replicate(
    local: Location, step: int, peers: int, stride: int, group: _multihost.Group, failed: BaseException | None = None
) -> list[str]:
    """Send this process's committed part of `step` to its `peers` (the
    processes `shifts` away), and take theirs; record every part's id
    (`parts.json`). The ids of the parts, by process index. No collective:
    it may run in a background thread (`group`: made in the caller's).
    `failed`: this process's save of the part failed so (raised here, once
    the others know it)."""
    error: BaseException | None = failed
    announced: dict[str, Any] = {}
    own = local.joined(step_name(step))
    try:
        if error is None:
            announced = {**_announce(_Outgoing(own, step)), "address": _exchange.address()}
    except Exception as e:
        error = e
    error = group.sync("listed", error, shared=json.dumps(announced))
    if error is not None:
        raise error
    listed = _listed(group.gathered("listed", json.dumps(announced)), range(group.count))
    ids = [listed[index]["id"] for index in range(group.count)]
    try:
        _storage.write_file(folder(local, step), PARTS, json.dumps({"step": step, "parts": ids}).encode())
    except Exception as e:
        error = e
    count, me = group.count, group.index
    streams = [
        _exchange.Stream(index, (index + shift) % count, listed[index]["size"])
        for shift in shifts(peers, stride, count)
        for index in range(count)
    ]
    sends = {s.receiver: own for s in streams if s.sender == me}
    announced_by = {stream: listed[stream.sender] for stream in streams}
    error = _move(group.name, step, announced_by, sends, folder(local, step)) or error
    error = group.sync("received", error)
    if error is not None:
        raise error
    return ids


def _announce(outgoing: _Outgoing) -> dict[str, Any]:
    return {"id": outgoing.id, "size": outgoing.size}


def _listed(texts: dict[int, str], indices: Iterable[int]) -> dict[int, dict[str, Any]]:
    """What each process of `indices` announced of the part it sends (its id, size and address), checked."""
    listed = {}
    for index in indices:
        try:
            value = loads_file(texts.get(index, ""))
        except ValueError:
            value = None
        if not (isinstance(value, dict) and isinstance(value.get("id"), str) and _ID.fullmatch(value["id"])):
            raise CheckpointError(f"Process {index} announced no part to send its peers ({texts.get(index)!r:.200}).")
        if type(value.get("size")) is not int or not 0 < value["size"] < 2**48:
            raise CheckpointError(f"Process {index} announced a part of {value.get('size')!r:.50} bytes.")
        if not isinstance(value.get("address"), str) or len(value["address"]) > 256:
            raise CheckpointError(f"Process {index} announced no address to take its part from.")
        listed[index] = value
    return listed


def _move(
    name: str,
    step: int,
    streams: dict[_exchange.Stream, dict[str, Any]],
    sends: dict[int, Location],
    into: Location,
) -> BaseException | None:
    """Move the parts of `streams` (each with what its sender announced: the
    part's id, size and the sender's address): this process sends the part
    at `sends[receiver]` to each of its receivers, and receives into `into`
    each part sent to it. The first error."""
    me = jax.process_index()
    outgoing: dict[int, _Outgoing] = {}
    error: BaseException | None = None
    for receiver, loc in sends.items():
        try:
            outgoing[receiver] = _Outgoing(loc, step)
        except Exception as e:
            error = error or e
    mine = [(stream, said) for stream, said in streams.items() if stream.receiver == me]
    incoming = {stream: _Incoming(into, step, said, f"process {stream.sender}") for stream, said in mine}

    def fill(stream: _exchange.Stream, offset: int, out: memoryview) -> None:
        if stream.receiver in outgoing:
            outgoing[stream.receiver].fill(offset, out)

    def take(stream: _exchange.Stream, offset: int, data: memoryview) -> None:
        incoming[stream].take(offset, data)

    addresses = {stream.sender: said["address"] for stream, said in streams.items()}
    error = _exchange.move(name, list(streams), addresses, fill, take) or error
    for sent in outgoing.values():
        error = error or sent.error
    for received in incoming.values():
        finished = received.finish()  # (its writes waited for, whatever happened)
        error = error or finished
    return error


def fetch(local: Location, step: int, routes: list[Route]) -> Location:
    """Move each process's part of `step` to it from the process that holds
    it (`routes`, `agree`'s), where that is another; where this process's
    part now is (its own step folder, or a copy in `folder(local, step)`)."""
    group, me = _multihost.Group("peers"), jax.process_index()
    needs = [(route.holder, index) for index, route in enumerate(routes) if route.holder != index]
    if needs:
        sends = {receiver: _held(local, step, routes[receiver]) for holder, receiver in needs if holder == me}
        error: BaseException | None = None
        announced: dict[str, Any] = {"address": _exchange.address(), "parts": {}}
        try:
            for receiver, loc in sends.items():
                announced["parts"][str(receiver)] = _announce(_Outgoing(loc, step))
        except Exception as e:
            error = e
        error = group.sync("listed", error, shared=json.dumps(announced))
        if error is not None:
            raise error
        listed = _fetched(group.gathered("listed", json.dumps(announced)), needs, routes)
        streams = {_exchange.Stream(h, r, listed[r]["size"]): listed[r] for h, r in needs}
        error = _move(group.name, step, streams, sends, folder(local, step))
        error = group.sync("received", error)
        if error is not None:
            raise error
    route = routes[me]
    return _held(local, step, route) if route.holder == me else folder(local, step).joined(route.id)


def _fetched(texts: dict[int, str], needs: list[tuple[int, int]], routes: list[Route]) -> dict[int, dict[str, Any]]:
    """What each holder announced of each part it sends (by receiver), checked against `routes`."""
    out = {}
    for holder, receiver in needs:
        try:
            value = loads_file(texts.get(holder, ""))
            announced = {**value["parts"][str(receiver)], "address": value["address"]}
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"Process {holder} did not announce the part of process {receiver}.") from None
        checked = _listed({receiver: json.dumps(announced)}, [receiver])[receiver]
        if checked["id"] != routes[receiver].id:
            raise CheckpointError(f"Process {holder} announced part {checked['id']}, not {routes[receiver].id}.")
        out[receiver] = checked
    return out


def _held(local: Location, step: int, route: Route) -> Location:
    """Where the process holding a part (`route.holder`) keeps it."""
    return local.joined(step_name(step)) if route.own else folder(local, step).joined(route.id)


def agree(local: Location, own: list[int], timeout: float) -> dict[int, list[Route]]:
    """The local steps whole across every process's tier and its peers'
    copies, each with where each process's part comes from: its own tier
    where it holds the part, else the first process that does."""
    group = _multihost.Group("tiers", timeout=timeout)
    mine = json.dumps(holdings(local, own)._asdict())
    error = group.sync("listed", None, shared=mine)
    if error is not None:
        raise error
    return routes([_holdings_of(text) for _, text in sorted(group.gathered("listed", mine).items())])


class Holdings(NamedTuple):
    """What a process's local tier holds, by step: the id of its own part
    (`own`), the ids of its committed copies of peers' parts (`held`), and
    the ids of every process's part (`parts`, its `parts.json`)."""

    own: dict[int, str]
    held: dict[int, list[str]]
    parts: dict[int, Any]


def holdings(local: Location, own: list[int]) -> Holdings:
    """This process's `Holdings`; `own`: its committed steps."""
    held = Holdings({}, {}, {})
    for step in own:
        held.own[step] = part_id(_tiers.step_files(local.joined(step_name(step))))
    for name in _storage.list_names(local.joined(PEERS)):
        found = parse_step(name)
        if found is None:
            continue
        step, where = found, folder(local, found)
        ids = [n for n in _storage.list_names(where) if _ID.fullmatch(n)]
        held.held[step] = [i for i in ids if _storage.file_exists(where.joined(i), MANIFEST)]
        held.parts[step] = _parts_of(_storage.read_file(where, PARTS, limit=1 << 24))
    return held


def _parts_of(data: bytes | None) -> Any:
    """The ids a `parts.json` lists (`None` where it is missing or damaged: the step is then not whole)."""
    try:
        value = None if data is None else loads_file(data)
    except ValueError:
        return None
    return value.get("parts") if isinstance(value, dict) else None


def _holdings_of(text: str) -> Holdings:
    """A process's `Holdings`, as another process sent them, checked."""
    try:
        value = loads_file(text)
        own, held, parts = ({int(step): v for step, v in value[kind].items()} for kind in Holdings._fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"A process listed its local tier as {text[:200]!r}: is it another eqx_ckpt?") from None
    return Holdings(own, held, parts)


def routes(listings: list[Holdings]) -> dict[int, list[Route]]:
    """`agree`'s answer from every process's `Holdings` (by index)."""
    count, whole = len(listings), {}
    for step in sorted({step for listing in listings for step in listing.parts}):
        parts = {json.dumps(listing.parts[step]) for listing in listings if step in listing.parts}
        ids = loads_file(parts.pop()) if len(parts) == 1 else None
        if not isinstance(ids, list) or len(ids) != count:
            continue  # saved by another number of processes, or their records differ: never whole
        found = [_route(listings, step, index, part) for index, part in enumerate(ids)]
        if all(route is not None for route in found):
            whole[step] = [route for route in found if route is not None]
    return whole


def _route(listings: list[Holdings], step: int, index: int, part: Any) -> Route | None:
    """Where process `index`'s part of `step` (`part`) comes from, or `None`."""
    for holder in [index, *(h for h in range(len(listings)) if h != index)]:
        listing = listings[holder]
        if listing.own.get(step) == part:
            return Route(holder, part, True)
        held = listing.held.get(step)
        if isinstance(held, list) and part in held:
            return Route(holder, part, False)
    return None


def tidy(local: Location, keep: Iterable[int]) -> None:
    """Remove the peer copies and records of the steps not in `keep`."""
    kept = {step_name(step) for step in keep}
    stale = [name for name in _storage.list_names(local.joined(PEERS)) if name not in kept]
    if stale:
        _storage.remove(local.joined(PEERS), stale)
