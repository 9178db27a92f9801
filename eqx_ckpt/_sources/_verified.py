"""The verifying reader: the one place every checked byte of a source goes
through, which knows what each byte of a leaf must hash to.

What is checked depends on what the source records of a leaf:

- **Block digests** (a published folder's `eqx_ckpt.json`, version 4 on): a
  read of a region reads the whole blocks around it, each checked before a
  byte is returned (`Region`). A safetensors folder's tensors are opened so
  (`tensors`), locally, on an object store, from the Hub or a mirror; a leaf a
  fine-tune takes from its base is read so against the fine-tune's digests
  (`taken`), whatever the base is.
- **A whole-leaf digest** (every published folder): a leaf read whole is
  hashed as it is read (`DigestCheck`, `Checks` for a load of many, `whole`
  for a transformed leaf's stored arrays), and compared once it is all read;
  `verify` hashes each leaf so (`stored_digest`).
- **Chunk checksums** (an eqx_ckpt checkpoint): each chunk carries its own,
  which the storage layer checks as it decodes it; nothing is added here
  (`checker` is `None`).

A leaf whose bytes differ is an `IntegrityError` naming the leaf, the first
block that differs (or the digests) and the source, or the base it is taken from.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base import _threads
from .._base._errors import IntegrityError, from_file, option, stored_leaf_error
from .._foreign import _safetensors
from .._ondisk import _digests, _published
from .._ondisk._format import LeafRecord
from .._ondisk._manifest import Manifest
from .._store import _storage
from ._source import Base, Opener, Source

# A leaf's digest is taken over reads of about this many bytes (rows of it).
DIGEST_SLAB_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Region:
    """What each byte of one leaf must hash to, block by block: its recorded
    block digests (`blocks`, which name the leaf and the source read), and
    where a fine-tune takes the leaf from (`taken`; `""`: its own files)."""

    blocks: _digests.Blocks
    taken: str = ""

    def covering(self, start: int, end: int) -> tuple[int, int]:
        """The bytes of the whole blocks that hold bytes `start` to `end`."""
        return self.blocks.covering(start, end)

    def check(self, data: Any, start: int) -> None:
        """Check the bytes `data` of whole blocks from byte `start` (`covering`),
        else raise `IntegrityError` naming the first block that differs."""
        self.blocks.check(data, start, taken=self.taken)


def block_digests(manifest: Manifest, record: LeafRecord, source: str) -> _digests.Blocks | None:
    """The recorded block digests of the leaf `record` (`None`: none recorded), read from `source`."""
    found, algorithm = manifest.blocks.get(record.path), manifest.block_algorithm
    if found is None or algorithm is None:  # (a record of block digests names their hash)
        return None
    return _digests.Blocks(found, record.nbytes, record.path, source, algorithm, recorded_block(manifest, record))


def region(manifest: Manifest, record: LeafRecord, source: str, *, taken: str = "") -> Region | None:
    """The check of regions of the leaf `record` read from `source` (as messages
    name it), or `None` where `manifest` records no block digests of it."""
    blocks = block_digests(manifest, record, source)
    return None if blocks is None else Region(blocks, taken)


def tensors(found: _safetensors.Tensors) -> Opener:
    """The opener of a safetensors folder's tensors, each read checked against
    the block digests its `eqx_ckpt.json` records (`region`), where it does."""
    regions = functools.partial(region, found.manifest)
    return lambda record: found.opener(record, regions)


def taken(
    source: Source, base: Base, record: LeafRecord, opened: _storage.Future | _storage.Mapped
) -> _storage.Future | _storage.Mapped:
    """`opened`, the base's array of a leaf the fine-tune `source` takes from
    it, its reads checked against the fine-tune's block digests where it
    records them: each run of rows read from the base's rows holding the whole
    blocks around it (`_checked_rows`)."""
    checked = region(source.manifest, record, source.loc.display, taken=_from(base, record))
    return opened if checked is None else _storage.ready(_checked_rows(opened.result(), record, checked))


def whole(source: Source, record: LeafRecord, finish: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """`finish` (a read of the whole leaf `record`, started), checked against
    its recorded digest once it returns, where `source` records one."""
    check = checker(source, record)
    if check is None:
        return finish

    def checked() -> np.ndarray:
        array = finish()
        check(array)
        check.result()
        return array

    return checked


def digest(data: Any, record: LeafRecord) -> _digests.Digested:
    """The digests an export records of the stored bytes `data` of the leaf
    `record` (`_digests`, in the hash and blocks of the version it writes)."""
    return _digests.of(data, _published.BLOCK_ALGORITHMS[_published.VERSION], export_block(record))


def export_block(record: LeafRecord) -> int:
    """The bytes of each block of the leaf `record` that an export records:
    whole rows of at most `_digests.BLOCK_BYTES` (`_published.leaf_block`)."""
    return _published.leaf_block(record, _digests.BLOCK_BYTES)


def stored_digest(source: Source, record: LeafRecord, *, like: str, block: int) -> _digests.Digested:
    """The digests of the leaf `record` of `source` as it is stored (a PRNG
    key's key data, a viewed dtype's unsigned integers), of the kind of the
    digest `like` (blocks of `block` bytes in the hash it names, or an older
    record's xxh3-128), read in slabs of rows so a large leaf never needs its
    size in memory twice."""
    store = source.open(record).result()
    hasher = _hasher(like, block)
    shape = tuple(record.stored_shape)
    if not shape or shape[0] == 0:
        hasher.update(_raw(store.read().result()))
    else:
        row = max(1, math.prod(shape[1:]) * store.numpy_dtype.itemsize)
        step = max(1, DIGEST_SLAB_BYTES // row)
        for start in range(0, shape[0], step):
            end = min(start + step, shape[0])
            hasher.update(_raw(store[start:end].read().result()))
    return hasher.finish()


class _Xxh3:
    """An older record's whole-leaf xxh3-128, fed as `_digests.Hasher` is."""

    def __init__(self) -> None:
        import xxhash

        self.hasher = xxhash.xxh3_128()

    def update(self, data: Any) -> None:
        self.hasher.update(data)

    def finish(self) -> _digests.Digested:
        return _digests.Digested(_digests.XXH3 + self.hasher.hexdigest())


def _hasher(like: str, block: int) -> _digests.Hasher | _Xxh3:
    algorithm = _digests.algorithm_of(like)
    return _Xxh3() if algorithm is None else _digests.Hasher(algorithm, block)


def strength(manifest: Manifest) -> str:
    """What the digests `manifest` records check, as `verify` and `info` say it."""
    return _digests.strength(manifest.block_bytes, manifest.block_algorithm, manifest.row_blocks)


def recorded_block(manifest: Manifest, record: LeafRecord) -> int:
    """The bytes of each block of the digests `manifest` records of the leaf
    `record`: its own size, as the record says it (a folder of another size
    than an export writes now loads), or from version 6 on the whole rows of
    the leaf it holds."""
    most = manifest.block_bytes or _digests.BLOCK_BYTES
    return _published.leaf_block(record, most) if manifest.row_blocks else most


def _raw(array: np.ndarray) -> memoryview:
    """An array's bytes in C order (a bfloat16's too: as bytes, not as a buffer of its dtype)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class DigestCheck:
    """The check of one leaf's stored bytes against its recorded digest: fed
    slabs of rows in order (`update`, then `done`), or called with the whole
    leaf. `result` waits for it, raising `IntegrityError` on a mismatch.

    It hashes on a thread of its own (`_hashing`) while the reader reads the
    next leaves: the reader mostly waits for storage. Block digests (SHA-256 or
    BLAKE3, which release the GIL) are hashed from there on the pool of `_digests`."""

    def __init__(self, source: Source, record: LeafRecord, expected: str):
        self.source, self.record, self.expected = source, record, expected
        self.hasher = _hasher(expected, recorded_block(source.manifest, record))
        self.finished: concurrent.futures.Future[None] | None = None

    def update(self, array: np.ndarray) -> None:
        _hashing().submit(self.hasher.update, _raw(array))

    def done(self) -> None:
        self.finished = _hashing().submit(self._compare)

    def __call__(self, array: np.ndarray) -> None:
        self.update(array)
        self.done()

    def result(self) -> None:
        assert self.finished is not None, "a digest check waited for before its leaf was read"
        self.finished.result()

    def hashed(self, found: _digests.Digested) -> None:
        """Compare the digests `found` of the leaf's bytes, hashed as they were read (`Checks.feeding`)."""
        self.finished = concurrent.futures.Future()
        try:
            self._compare(found)
        except IntegrityError as e:
            self.finished.set_exception(e)
        else:
            self.finished.set_result(None)

    def _compare(self, found: _digests.Digested | None = None) -> None:
        found = self.hasher.finish() if found is None else found
        if found.digest != self.expected:
            raise _mismatch(self.source, self.record, found, self.expected)


def _hashing() -> _threads.Pool:
    """The thread digests are fed from: one, so each leaf's slabs are hashed
    in the order they were read."""
    return _threads.pool("eqx_ckpt-digest", 1)


class Checks:
    """The digest checks of one read of many leaves (`_reader.read_now`), each
    started as its leaf is read, all waited for before the values are returned."""

    def __init__(self, source: Source):
        self.source = source
        self.started: list[DigestCheck] = []
        # The leaves being hashed as they are read: each one's feed and place in it.
        self.fed: dict[str, tuple[_digests.Feed, int]] = {}

    def feeding(self, leaves: list[tuple[LeafRecord, int]]) -> Callable[[np.ndarray, int], None] | None:
        """How a run of `leaves` (each with the offset of its bytes in the run),
        read from a local file, is hashed by the thread that reads it, a piece
        at a time while the piece is in that core's cache (`_digests.Feed`);
        `None` where none of them records block digests. Their digests are
        compared as the run is placed (`__call__`)."""
        spans, paths = [], []
        for record, offset in sorted(leaves, key=lambda leaf: leaf[1]):
            expected = self.source.manifest.digests.get(record.path)
            algorithm = None if expected is None else _digests.algorithm_of(expected)
            if algorithm is not None and record.path not in self.fed:
                block = recorded_block(self.source.manifest, record)
                spans.append(_digests.Span(offset, record.nbytes, algorithm, block))
                paths.append(record.path)
        if not spans:
            return None
        feed = _digests.Feed(spans)
        self.fed.update((path, (feed, i)) for i, path in enumerate(paths))
        return feed.filled

    def for_record(self, record: LeafRecord) -> DigestCheck | None:
        check = checker(self.source, record)
        if check is not None:
            self.started.append(check)
        return check

    def __call__(self, record: LeafRecord, array: np.ndarray) -> None:
        check = self.for_record(record)
        fed = self.fed.pop(record.path, None)
        if check is not None and fed is not None:
            check.hashed(fed[0].digested(fed[1]))
        elif check is not None:
            check(array)

    def wait(self) -> None:
        """Raise the first leaf's `IntegrityError`, in the order they were read."""
        for check in self.started:
            check.result()


def checker(source: Source, record: LeafRecord) -> DigestCheck | None:
    """The check of the leaf `record` against its recorded digest, or `None`
    where there is none (an eqx_ckpt checkpoint's chunks carry checksums)."""
    expected = source.manifest.digests.get(record.path)
    return None if expected is None else DigestCheck(source, record, expected)


def _mismatch(source: Source, record: LeafRecord, found: _digests.Digested, expected: str) -> IntegrityError:
    family = source.manifest.family
    taken = None if family is None else family.references.get(record.path)
    blocks = block_digests(source.manifest, record, source.loc.display)
    if blocks is not None and found.blocks:  # the first block that differs, as a slice names it
        return _digests.mismatch(
            blocks, _digests.first_differing(found.blocks, blocks.digests), taken=_from(source.base, record)
        )
    if taken is not None and source.base is not None:
        why = (
            f"it is taken from the base {source.base.display!r} (its leaf {from_file(repr(taken))}), whose "
            f"bytes are not the ones the fine-tune was made from"
        )
        fix = (
            "The base holds other values than it did when the fine-tune was exported (rewritten, or another "
            f"model under its name). Load the fine-tune with the base it was made from "
            f"({option('`base=`', '`--with-base`')}), or load a standalone export of it."
        )
    else:
        why = "its bytes in the fine-tune's own files are not the ones recorded"
        fix = "The folder is damaged or was edited: restore it from a good copy (`eqx-ckpt verify` lists every leaf)."
    return stored_leaf_error(
        IntegrityError,
        f"{why} (xxh3-128 {found.digest.removeprefix(_digests.XXH3)[:16]}... read, "
        f"{expected.removeprefix(_digests.XXH3)[:16]}... recorded in {_published.NAME}), so nothing "
        f"was loaded.",
        dotted=record.path,
        path=source.loc.display,
        fix=fix,
    )


def _from(base: Base | None, record: LeafRecord) -> str:
    """Where a fine-tune takes the leaf `record` from, as messages say it (`""`: its own files)."""
    if base is None or record.path not in base.references:
        return ""
    return f"the base {base.display!r} (its leaf {from_file(repr(base.references[record.path]))})"


def _checked_rows(inner: _storage.Array, record: LeafRecord, region: Region) -> _storage.Array:
    """The array `inner` of the leaf `record`, read in runs of rows
    (`record.chunks`), each from the rows of `inner` holding the whole blocks
    around it, checked by `region` before it is used."""
    dtype = inner.numpy_dtype
    shape = tuple(record.stored_shape)
    row = math.prod(shape[1:]) * dtype.itemsize

    def read(rows: tuple[int, int] | None, array: np.ndarray) -> _storage.Future:
        lo, hi = rows if rows is not None and row else (0, shape[0] if shape else 1)
        first, end = region.covering(lo * row, hi * row) if shape else region.covering(0, dtype.itemsize)
        # The base's rows holding those blocks (all of it, for a scalar or an empty row).
        start, stop = (first // row, min(shape[0], -(-end // row))) if shape and row else (0, 0)
        promise, done = _storage.pending()

        def fill(future: Any) -> None:
            try:
                data = _raw(future.result())
                skip = first - start * row
                region.check(data[skip : skip + end - first], first)
                wanted = lo * row - start * row
                array[...] = np.frombuffer(data[wanted : wanted + array.nbytes], dtype).reshape(array.shape)
                promise.set_result(None)
            except Exception as e:
                promise.set_exception(e)

        (inner[start:stop] if stop > start else inner).read().add_done_callback(fill)
        return done

    return _storage.virtual_array(read, dtype=dtype, shape=shape, chunks=record.chunks)
