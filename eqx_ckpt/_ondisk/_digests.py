"""The digests a published folder records of each leaf (`_published`, version 4 on).

A leaf's stored bytes (C order, as safetensors holds them) are cut into blocks
of `_format.BLOCK_BYTES` (the last one shorter). Each block's digest is
recorded, and the leaf's digest is the digest of those block digests, one
after the other. The hash is the one of the record's version
(`_published.BLOCK_ALGORITHMS`): SHA-256 in version 4, BLAKE3 from version 5.
A forger who controls the bytes (a base, a mirror, a folder passed along)
cannot make other bytes match either.

A read of a region reads the whole blocks covering it and checks each one
(`Blocks.check`) before returning a byte; a whole read checks every block
(`Hasher`). Both hashes release the GIL on large buffers, so blocks are hashed
on a pool of threads (`eqx_ckpt-blocks`, a thread a core), in parallel with
the reads. Each block is hashed by one thread, never with BLAKE3's own threads
(`max_threads`): measured, those split each block over the cores the pool
already keeps busy, for more CPU and less throughput (docs/benchmarks.md,
"BLAKE3 per 1 MiB block (issue 84)"). A region of one or two blocks (a
slice's) is hashed by the thread that read it: the hand-off to the pool
cost about what hashing a block does.

Earlier versions recorded one xxh3-128 per leaf, which catches accidents, not
forgery; they are still read (`XXH3`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import blake3
import xxhash

from .._base import _faults, _threads
from .._base._errors import IntegrityError, stored_leaf_error
from ._format import BLOCK_BYTES


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A hash of block digests: its `name` (a digest's prefix before the `:`,
    and what `strength` says), as messages name it (`shown`), and `new(data)`,
    its hasher of a buffer (both release the GIL on large buffers)."""

    name: str
    shown: str
    new: Callable[[Any], Any]

    @property
    def prefix(self) -> str:
        return self.name + ":"

    def digest(self, data: Any) -> bytes:
        return bytes(self.new(data).digest())


SHA256 = Algorithm("sha256", "SHA-256", hashlib.sha256)
BLAKE3 = Algorithm("blake3", "BLAKE3", blake3.blake3)
XXH3 = "xxh3-128:"
# Both hashes' digests are 32 bytes.
SIZE = 32
# Bytes hashed by one task of the pool (whole blocks of them): a task per
# block would cost more in the pool than in the hash for small blocks. In
# bytes, not blocks, so that a record's block size does not change the tasks.
_TASK_BYTES = 8 * 2**20
# A region of at most this many blocks (a slice's) is hashed here: the pool's
# hand-off costs about what hashing one block does.
_BLOCKS_HERE = 2


@dataclasses.dataclass(frozen=True)
class Digested:
    """A leaf's recorded `digest` (`blake3:` or `sha256:`, or before version 4
    `xxh3-128:`, and hex digits) and its blocks' digests, one after the other
    (`b""` before version 4)."""

    digest: str
    blocks: bytes = b""


def strength(block: int, algorithm: Algorithm | None, rows: bool) -> str:
    """What a record's digests check, as `verify` and `info` say it (`block`: its
    block size, `algorithm` its hash; 0 and `None` for a record of one xxh3-128
    a leaf; `rows`: blocks of whole rows, of at most `block` bytes)."""
    if not block or algorithm is None:
        return "xxh3-128 per leaf (an earlier version: checks accidents, not forgery)"
    size = f"{block // 2**20} MiB" if block >= 2**20 else f"{block // 2**10} KiB"
    return f"{algorithm.name} per block of whole rows, up to {size}" if rows else f"{algorithm.name} per {size} block"


def leaf_block(shape: Sequence[int], itemsize: int, most: int = BLOCK_BYTES) -> int:
    """The bytes of each block of a leaf of `shape` and `itemsize`, in a record
    of blocks of whole rows (version 6 on): as many whole rows as `most` bytes
    hold, so that the reader's run of rows of a leaf (`_safetensors._chunks`)
    is one block, and a slice reads and hashes no byte beyond its runs. A row
    longer than `most` is cut into blocks of `most`."""
    row = math.prod(shape[1:]) * itemsize if len(shape) else itemsize
    return most if not row or row > most else most // row * row


def algorithm_of(digest: str) -> Algorithm | None:
    """The hash of the block digests a leaf's recorded `digest` is the root of
    (`None`: an older record's xxh3-128)."""
    return next((h for h in (BLAKE3, SHA256) if digest.startswith(h.prefix)), None)


def root(blocks: bytes, algorithm: Algorithm) -> str:
    """The digest of a leaf whose blocks have the digests `blocks`."""
    return algorithm.prefix + algorithm.new(blocks).hexdigest()


def count(nbytes: int, block: int = BLOCK_BYTES) -> int:
    """How many blocks `nbytes` bytes are cut into."""
    return -(-nbytes // block)


def of(data: Any, algorithm: Algorithm, block: int = BLOCK_BYTES) -> Digested:
    """The digests of the bytes `data` (a buffer)."""
    hasher = Hasher(algorithm, block)
    hasher.update(data)
    return hasher.finish()


def xxh3(data: Any) -> Digested:
    """The digest an eqx_ckpt of `eqx_ckpt.json` version 3 and earlier recorded."""
    return Digested(XXH3 + xxhash.xxh3_128_hexdigest(data))


def _pool() -> _threads.Pool:
    return _threads.pool("eqx_ckpt-blocks", max(1, os.cpu_count() or 1))


def _hash(view: memoryview, block: int, algorithm: Algorithm) -> bytes:
    return b"".join(algorithm.digest(view[i : i + block]) for i in range(0, len(view), block))


def _spread(view: memoryview, block: int, algorithm: Algorithm) -> bytes:
    """The digests of the blocks of `view`, hashed on every core: a share of
    whole blocks to each thread of the pool but one, the first share here (a
    slice's two blocks take the time of one)."""
    blocks = count(len(view), block)
    if blocks <= _BLOCKS_HERE:
        return _hash(view, block, algorithm)
    step = max(1, count(blocks, min(blocks, _pool().threads))) * block
    rest = [_pool().submit(_hash, view[i : i + step], block, algorithm) for i in range(step, len(view), step)]
    return _hash(view[:step], block, algorithm) + b"".join(future.result() for future in rest)


class Hasher:
    """The block digests of bytes fed in order (`update`, any lengths), whole
    blocks hashed on the pool as they come; `finish` waits for them."""

    def __init__(self, algorithm: Algorithm, block: int = BLOCK_BYTES):
        self.algorithm, self.block = algorithm, block
        self.partial = bytearray()
        self.parts: list[concurrent.futures.Future[bytes] | bytes] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self.partial:
            taken = view[: self.block - len(self.partial)]
            self.partial += taken
            view = view[len(taken) :]
            if len(self.partial) < self.block:
                return
            self.parts.append(self.algorithm.digest(self.partial))
            self.partial = bytearray()
        whole = len(view) - len(view) % self.block
        step = self.block * max(1, _TASK_BYTES // self.block)
        for i in range(0, whole, step):
            # (the view keeps the caller's buffer alive until it is hashed)
            self.parts.append(_pool().submit(_hash, view[i : min(i + step, whole)], self.block, self.algorithm))
        self.partial += view[whole:]

    def finish(self) -> Digested:
        if self.partial:
            self.parts.append(self.algorithm.digest(self.partial))
            self.partial = bytearray()
        blocks = b"".join(p if isinstance(p, bytes) else p.result() for p in self.parts)
        return Digested(root(blocks, self.algorithm), blocks)


class Span(NamedTuple):
    """One leaf's bytes in a buffer that holds several (`Feed`): from `start`,
    `nbytes` of them, cut into blocks of `block` bytes hashed by `algorithm`."""

    start: int
    nbytes: int
    algorithm: Algorithm
    block: int


class Feed:
    """The block digests of leaves laid out in one buffer (`spans`, in the order
    of their bytes), taken as the buffer fills: `filled(buffer, end)` hashes,
    in the calling thread, each block whose bytes all lie below `end`. A file
    read in pieces is so hashed by the thread that read it, each piece while it
    is still in that core's cache (docs/benchmarks.md, "Hashed as read (issue 84)")."""

    def __init__(self, spans: list[Span]):
        self.spans = spans
        self.blocks = [bytearray() for _ in spans]
        self.done = [0] * len(spans)  # each span's bytes hashed
        self.first = 0  # the first span not hashed whole

    def filled(self, buffer: Any, end: int) -> None:
        _faults.fire("digests.filled", end)
        view = memoryview(buffer).cast("B")
        for i in range(self.first, len(self.spans)):
            start, nbytes, algorithm, block = self.spans[i]
            if start >= end and nbytes:
                break
            done, ready = self.done[i], min(nbytes, end - start)
            # Its whole blocks below `end`, and its last one once it is all there.
            upto = nbytes if ready == nbytes else done + max(0, ready - done) // block * block
            if upto > done:
                self.blocks[i] += _hash(view[start + done : start + upto], block, algorithm)
                self.done[i] = upto
            if self.done[i] == nbytes and i == self.first:
                self.first += 1

    def digested(self, i: int) -> Digested:
        """The digests of span `i`, once the buffer holds all of it."""
        _, nbytes, algorithm, _ = self.spans[i]
        assert self.done[i] == nbytes, "a leaf's digests asked for before its bytes were all read"
        blocks = bytes(self.blocks[i])
        return Digested(root(blocks, algorithm), blocks)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The recorded block digests of one leaf of `nbytes` bytes, known as
    `leaf` (its dotted path) in the source `source` (as messages name it), with
    how to check a range of its bytes (`algorithm`: the record's)."""

    digests: bytes
    nbytes: int
    leaf: str
    source: str
    algorithm: Algorithm
    block: int = BLOCK_BYTES

    def covering(self, start: int, end: int) -> tuple[int, int]:
        """The bytes of the whole blocks that hold bytes `start` to `end`."""
        first = start - start % self.block
        last = min(self.nbytes, count(end, self.block) * self.block) if end > start else first
        return first, max(first, last)

    def check(self, data: Any, start: int, *, taken: str = "") -> None:
        """Check the bytes `data` of whole blocks from byte `start` (`covering`);
        else `IntegrityError` naming the leaf, the first block that differs and
        the source (`taken`: where a fine-tune takes the leaf from)."""
        view = memoryview(data).cast("B")
        first = start // self.block
        found = _spread(view, self.block, self.algorithm)
        expected = self.digests[first * SIZE : first * SIZE + len(found)]
        if found == expected:
            return
        raise mismatch(self, first + first_differing(found, expected), taken=taken)


def first_differing(found: bytes, expected: bytes) -> int:
    """The index of the first block whose digest in `found` is not the one in `expected`."""
    return next((i for i in range(0, len(found), SIZE) if found[i : i + SIZE] != expected[i : i + SIZE]), 0) // SIZE


def mismatch(blocks: Blocks, index: int, *, taken: str = "") -> IntegrityError:
    """The error of a block of a leaf whose bytes are not those recorded."""
    lo = index * blocks.block
    hi = min(lo + blocks.block, blocks.nbytes)
    why = f"it is taken from {taken}, whose bytes are not the ones the fine-tune was made from" if taken else ""
    error = stored_leaf_error(
        IntegrityError,
        f"{why or 'its bytes are not those recorded'}: block {index} (bytes {lo} to {hi} of the leaf) differs "
        f"from its {blocks.algorithm.shown} digest in the record, a changed byte. Nothing of it was returned.",
        dotted=blocks.leaf,
        path=blocks.source,
        fix="The bytes were changed after the record was written (a rewritten file, a mirror serving other "
        "bytes, a base that is not the one pinned). Get the files again from where they were published, or "
        "run `eqx-ckpt verify` to list every leaf that differs.",
    )
    error.block = index  # type: ignore[attr-defined]  # (`verify` words its own problem)
    return error
