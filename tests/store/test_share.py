"""Sharing never spreads damage (issue 51): a save decides that a chunk equals
the base's by a 128-bit hash of the bytes, after verifying the base's file
against its own checksum (once per process), so a damaged base file is never
linked again and a change that keeps a chunk's crc32c is written."""

import collections
import os
import re
import threading

import crc32c
import jax
import numpy as np
import pytest
from arrays import tree_equal
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_ckpt
from eqx_ckpt._base import _faults
from eqx_ckpt._base._location import location
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _local_write, _transaction

# Each kind of file a save may share, as (the leaves stored in it, its name in the data root).
KINDS = {
    "large leaf": (("big",), "big/c/0/0"),
    "pack chunk": (("small.a", "small.b"), "packed.float32/c/0"),
    "chunk of a multi-chunk leaf": (("multi",), "multi/c/1/0"),
    "chunk of a sharded leaf": (("sharded",), "sharded/c/2/0"),
}
# How a warning names the array of each kind's file.
WHAT = {"large leaf": "leaf `big`", "pack chunk": "pack `packed.float32` (small leaves)"}
WHAT["chunk of a multi-chunk leaf"] = "leaf `multi`"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # 2 MiB chunks: `big` is one chunk file, `multi` three.
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2 << 20)


def _tree(head=0.0):
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu")[:4])
    sharded = rng.standard_normal((64, 8192), dtype=np.float32)  # 2 MiB, a chunk per shard
    return {
        "big": rng.standard_normal((72, 4096), dtype=np.float32),  # 1.1 MiB: an array of its own
        "multi": rng.standard_normal((384, 4096), dtype=np.float32),  # 6 MiB: three chunks
        "sharded": jax.device_put(sharded, NamedSharding(mesh, P("x"))),
        "small": {"a": np.arange(5, dtype=np.float32), "b": np.ones(7, np.float32)},  # packed
        "head": {"w": np.full((72, 4096), head, np.float32)},
    }


def _root(ckpt):
    manifest = _transaction.read_manifest(location(str(ckpt)))
    return os.path.join(str(ckpt), manifest.data_root) if manifest.data_root else str(ckpt)


def _file(ckpt, name):
    return os.path.join(_root(ckpt), *name.split("/"))


def _chunk_inodes(ckpt, leaf):
    folder = os.path.join(_root(ckpt), leaf)
    return {
        os.path.relpath(os.path.join(r, n), folder): os.lstat(os.path.join(r, n)).st_ino
        for r, _, names in os.walk(folder)
        for n in names
        if n != _format.ZARR_JSON
    }


def _flip(path, *, keep_mtime=False):
    """Flip one bit in the middle of a chunk file's data bytes. `keep_mtime`:
    as damage on the disk itself does (no write through the file system)."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)[0]
        f.seek(before.st_size // 2)
        f.write(bytes([byte ^ 0x10]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif os.stat(path).st_mtime_ns == before.st_mtime_ns:
        # A write within the file system's timestamp granularity of the last
        # one keeps the time; a later write moves it, which this models.
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))


def _loads_bit_for_bit(ckpt, tree):
    loaded = eqx_ckpt.tree_deserialise_leaves(ckpt, tree)
    assert tree_equal(loaded, tree, typematch=True)
    pairs = zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(tree), strict=True)
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in pairs)
    assert eqx_ckpt.verify(ckpt) == []


def _damaged_leaves(ckpt):
    return sorted(problem.leaf for problem in eqx_ckpt.verify(ckpt))


class _Saves:
    """Saves of one tree to one place: a checkpoint overwritten, or a manager's steps."""

    def __init__(self, tmp_path, where):
        self.where, self.ckpt, self.step = where, tmp_path / "ckpt", -1
        self.manager = eqx_ckpt.CheckpointManager(tmp_path / "run") if where == "manager" else None

    def save(self, tree):
        """Save `tree`; the checkpoint it is in."""
        if self.manager is None:
            eqx_ckpt.tree_serialise_leaves(self.ckpt, tree)
            return self.ckpt
        self.step += 1
        self.manager.save(self.step, tree)
        return self.manager.step_path(self.step)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("where", ["overwrite", "manager"])
def test_a_save_over_a_damaged_file_writes_it_anew(tmp_path, kind, where):
    """The repair path: the same good state saved again over a checkpoint
    with one flipped bit (an overwrite, a manager's next step) writes the
    damaged chunk anew, with a warning naming it, and shares the rest."""
    leaves, name = KINDS[kind]
    tree, saves = _tree(), _Saves(tmp_path, where)
    saves.save(tree)
    old = saves.save(tree)  # shares, and verifies what it shares
    damaged = _file(old, name)
    inode = os.stat(damaged).st_ino
    kept = {f"{leaf}/{key}": i for leaf in ("big", "multi") for key, i in _chunk_inodes(old, leaf).items()}
    _flip(damaged)
    if kind in WHAT:
        why = f"{os.path.relpath(damaged, tmp_path)}' of {WHAT[kind]}, in the checkpoint this save follows, fails its "
        with pytest.warns(eqx_ckpt.IntegrityWarning, match=re.escape(why + "crc32c checksum")):
            new = saves.save(tree)
    else:  # written through TensorStore, never shared: nothing to warn about
        new = saves.save(tree)
    _loads_bit_for_bit(new, tree)
    written = os.stat(_file(new, name))
    assert written.st_ino != inode and written.st_nlink == 1
    # Every other chunk file is still shared.
    after = {f"{leaf}/{key}": i for leaf in ("big", "multi") for key, i in _chunk_inodes(new, leaf).items()}
    assert {k for k in kept if after[k] == kept[k]} == set(kept) - {name}
    if saves.manager is not None:
        assert _damaged_leaves(old) == list(leaves)  # the old step keeps its damage, and says so
        saves.manager.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_partial_save_keeping_a_damaged_leaf_is_refused(tmp_path, kind):
    leaves, name = KINDS[kind]
    tree = _tree()
    ckpt = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(ckpt, tree)
    _flip(_file(ckpt, name))
    commit, entries = _transaction.read_manifest(location(str(ckpt))).commit, sorted(os.listdir(ckpt))
    message = f"This save with `where` keeps that leaf as it is stored in {str(ckpt)!r}, so it was refused"
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(message)) as caught:
        eqx_ckpt.tree_serialise_leaves(ckpt, _tree(head=1.0), where=lambda t: t["head"])
    assert len(caught.value.dotted) == 1 and caught.value.dotted[0] in leaves
    assert re.match(re.escape(f"Leaf `{caught.value.dotted[0]}` in checkpoint "), str(caught.value))
    # The checkpoint is as it was: the same commit, no new data root, the same damage.
    assert _transaction.read_manifest(location(str(ckpt))).commit == commit
    assert sorted(os.listdir(ckpt)) == entries
    assert _damaged_leaves(ckpt) == list(leaves)
    top = {leaf.split(".")[0] for leaf in leaves}
    sound = {k: v for k, v in tree.items() if k not in top}
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(ckpt, sound), sound, typematch=True)


def _same_crc32c(data, bit):
    """`data` (bytes) with bit `bit` flipped and 4 bytes right after it
    changed so that the crc32c stays the same: crc32c is affine over GF(2)
    (for one length, crc(x ^ d) = crc(x) ^ crc(d) ^ crc(zeros)), so the change
    `d` must satisfy crc(d) == crc(zeros), 32 linear equations in the 32 bits
    of those bytes."""
    zeros = crc32c.crc32c(bytes(len(data)))

    def effect(bits):
        d = bytearray(len(data))
        for b in bits:
            d[b // 8] ^= 1 << (b % 8)
        return crc32c.crc32c(bytes(d)) ^ zeros

    first = (bit // 8 + 1) * 8
    free = list(range(first, first + 32))
    target = effect([bit])
    # Gaussian elimination over GF(2): rows (effect of a set of free bits, that set as a mask).
    rows = [(effect([b]), 1 << j) for j, b in enumerate(free)]
    basis = []
    for value, mask in rows:
        for pivot_value, pivot_mask in basis:
            if value ^ pivot_value < value:
                value, mask = value ^ pivot_value, mask ^ pivot_mask
        if value:
            basis.append((value, mask))
            basis.sort(reverse=True)
    chosen = 0
    for pivot_value, pivot_mask in basis:
        if target ^ pivot_value < target:
            target, chosen = target ^ pivot_value, chosen ^ pivot_mask
    assert target == 0, "these 32 bits reach every crc32c change"
    d = bytearray(len(data))
    for b in [bit] + [free[j] for j in range(32) if chosen >> j & 1]:
        d[b // 8] ^= 1 << (b % 8)
    return bytes(x ^ y for x, y in zip(data, d, strict=True))


@pytest.mark.parametrize("where", ["overwrite", "manager"])
def test_a_change_that_keeps_the_crc32c_is_written(tmp_path, where):
    tree = _tree()
    old = tree["big"].tobytes()
    new = _same_crc32c(old, bit=len(old) * 4 + 3)  # a bit in the middle of the leaf
    assert new != old and len(new) == len(old) and crc32c.crc32c(new) == crc32c.crc32c(old)
    changed = {**tree, "big": np.frombuffer(new, np.float32).reshape(tree["big"].shape)}
    if where == "overwrite":
        first = second = tmp_path / "ckpt"
        eqx_ckpt.tree_serialise_leaves(first, tree)
        before = _chunk_inodes(first, "big")
        eqx_ckpt.tree_serialise_leaves(second, changed)
    else:
        with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
            manager.save(0, tree)
            manager.save(1, changed)
            first, second = manager.step_path(0), manager.step_path(1)
        before = _chunk_inodes(first, "big")
        _loads_bit_for_bit(first, tree)
    assert not set(before.values()) & set(_chunk_inodes(second, "big").values())
    _loads_bit_for_bit(second, changed)


def _counting(run):
    """A count of the files a fault point names, by their path in `run`, and its callback."""
    counts = collections.Counter()
    lock = threading.Lock()

    def count(path):
        with lock:
            counts[os.path.relpath(path, run)] += 1

    return counts, count


def _chunk_files(ckpt):
    """The chunk files of a checkpoint that eqx_ckpt wrote itself, which are
    those it may share (not the sharded leaf's: TensorStore writes them), by
    their path in the checkpoint's parent folder."""
    root = _root(ckpt)
    return {
        os.path.relpath(os.path.join(r, n), os.path.dirname(str(ckpt)))
        for r, _, names in os.walk(root)
        for n in names
        if n not in (_format.ZARR_JSON, _format.MANIFEST) and os.path.relpath(r, root).split(os.sep)[0] != "sharded"
    }


def _steps_counted(manager, trees, *, first=0):
    """Save `trees` as steps `first`, `first + 1`, ...; for each, the files it
    read back (`share.verify`) and those it recorded as written (`share.written`)."""
    reads, records = [], []
    for step, tree in enumerate(trees, start=first):
        read, count_read = _counting(manager.directory)
        wrote, count_written = _counting(manager.directory)
        with _faults.armed("share.verify", count_read), _faults.armed("share.written", count_written):
            manager.save(step, tree)
        reads.append(dict(read))
        records.append(dict(wrote))
    return reads, records


def test_a_training_loops_steps_read_no_base_file_back(tmp_path):
    """A manager's first step records every chunk file it writes, though it
    has nothing to follow; so its second step, as every later one, reads no
    file back: it finds each unchanged file recorded and links it, and
    records the changed ones it writes."""
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        reads, records = _steps_counted(manager, [_tree(head=float(step)) for step in range(4)])
        paths = [manager.step_path(step) for step in range(4)]
    assert reads == [{}, {}, {}, {}]
    # Every chunk file the first step wrote itself, each once.
    first = _chunk_files(paths[0])
    assert records[0] == {name: 1 for name in first}
    assert {name.split("/", 1)[1] for name in first} >= {"big/c/0/0", "multi/c/1/0", "packed.float32/c/0"}
    for step in (1, 2, 3):  # only the changed chunk is written, and recorded
        assert records[step] == {os.path.relpath(_file(paths[step], "head/w/c/0/0"), tmp_path / "run"): 1}
    big = [os.stat(_file(p, "big/c/0/0")) for p in paths]
    assert len({s.st_ino for s in big}) == 1 and big[0].st_nlink == 4  # one file, shared by every step
    for leaf in ("multi", "packed.float32"):
        assert len({tuple(sorted(_chunk_inodes(p, leaf).items())) for p in paths}) == 1, leaf
    heads = [_chunk_inodes(p, "head/w") for p in paths]
    assert len({i for h in heads for i in h.values()}) == 4  # changed at every step: written anew
    for step, path in enumerate(paths):
        _loads_bit_for_bit(path, _tree(head=float(step)))


def test_a_resumed_run_reads_each_file_of_its_last_step_once(tmp_path):
    """Steps this process did not write (a run resumed, here written without
    sharing, which records nothing) are read back once each, by the first
    step that follows them, to verify them before they are shared; the steps
    after that read nothing."""
    with eqx_ckpt.CheckpointManager(tmp_path / "run", share=False) as manager:
        _, records = _steps_counted(manager, [_tree()])
        assert records == [{}]
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        reads, _ = _steps_counted(manager, [_tree(head=1.0), _tree(head=2.0)], first=1)
        paths = [manager.step_path(step) for step in range(3)]
    assert reads[0] == {name: 1 for name in _chunk_files(paths[0])}
    assert reads[1] == {}
    big = [os.stat(_file(p, "big/c/0/0")) for p in paths]
    assert len({s.st_ino for s in big}) == 1 and big[0].st_nlink == 3
    for step, path in enumerate(paths):
        _loads_bit_for_bit(path, _tree(head=float(step)))


def test_a_plain_save_with_no_base_hashes_nothing(tmp_path):
    """A `tree_serialise_leaves` into a new place records no digest (it hashes
    nothing: no later save is known to follow it); an overwrite records those
    it compared and wrote, and reads back each file it shares once."""
    ckpt = tmp_path / "ckpt"
    fired = []
    with _faults.armed(["share.verify", "share.written", "share.link"], lambda *args: fired.append(args)):
        eqx_ckpt.tree_serialise_leaves(ckpt, _tree())
    assert fired == []
    counts, count = _counting(tmp_path)
    with _faults.armed("share.written", count):
        eqx_ckpt.tree_serialise_leaves(ckpt, _tree(head=1.0))
    assert dict(counts) == {os.path.relpath(_file(ckpt, "head/w/c/0/0"), tmp_path): 1}
    _loads_bit_for_bit(ckpt, _tree(head=1.0))


@pytest.mark.parametrize("where", ["overwrite", "manager"])
def test_large_chunks_whose_start_changed(tmp_path, monkeypatch, where):
    """A large chunk whose first bytes differ from the base's is written
    without a comparison. An overwrite then hashes nothing of it (an
    overwrite where everything changed stays cheap); a manager's step hashes
    it as it is written, so the step after it reads nothing back."""
    monkeypatch.setattr(_local_write, "UNBUFFERED_FROM", 1 << 20)  # `big` and `multi`'s chunks are large
    tree, changed = _tree(), jax.tree_util.tree_map(lambda x: x + 1, _tree())
    large = {"big/c/0/0", "multi/c/0/0", "multi/c/1/0", "multi/c/2/0", "head/w/c/0/0"}
    if where == "overwrite":
        ckpt = tmp_path / "ckpt"
        eqx_ckpt.tree_serialise_leaves(ckpt, tree)
        counts, count = _counting(tmp_path)
        with _faults.armed("share.written", count):
            eqx_ckpt.tree_serialise_leaves(ckpt, changed)
        recorded = {name.split("/", 2)[2] for name in counts}
        assert recorded and not recorded & large, recorded  # the others were compared, so recorded
        _loads_bit_for_bit(ckpt, changed)
        return
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        reads, records = _steps_counted(manager, [tree, changed, changed])
        paths = [manager.step_path(step) for step in range(3)]
    assert reads == [{}, {}, {}]
    assert records[1] == {name: 1 for name in _chunk_files(paths[1])}  # every file changed
    assert records[2] == {}  # nothing changed: every file linked
    for name in large:
        assert os.stat(_file(paths[1], name)).st_ino == os.stat(_file(paths[2], name)).st_ino
        assert os.stat(_file(paths[0], name)).st_ino != os.stat(_file(paths[1], name)).st_ino
    _loads_bit_for_bit(paths[2], changed)


@pytest.mark.parametrize("finds", ["verify", "load", "slice", "diff"])
def test_a_file_a_read_finds_damaged_is_verified_again(tmp_path, finds):
    """Damage that keeps a file's size and modification time (the disk's own,
    not a write) is not seen by the record of verified files; once `verify`,
    a load, a slice of a lazy leaf or `diff` names it (every reader of a
    region of a stored leaf: `_read.start_region`), the next step reads the
    file again, and writes the chunk anew."""
    tree = _tree()
    counts, count = _counting(tmp_path / "run")
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(0, tree)
        manager.save(1, tree)  # verifies step 0's files, and links them
        damaged = _file(manager.step_path(1), "big/c/0/0")
        _flip(damaged, keep_mtime=True)
        if finds == "verify":
            assert _damaged_leaves(manager.step_path(1)) == ["big"]
        else:
            read = {
                "load": lambda: eqx_ckpt.tree_deserialise_leaves(manager.step_path(1), tree),
                "slice": lambda: eqx_ckpt.Checkpoint(manager.step_path(1))["big"][:1],
                "diff": lambda: eqx_ckpt.diff(manager.step_path(1), manager.step_path(0)),
            }[finds]
            with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("Leaf `big` in checkpoint")):
                read()
        why = f"{os.path.relpath(damaged, tmp_path)}' of leaf `big`, in the checkpoint this save follows, fails"
        with _faults.armed("share.verify", count), pytest.warns(eqx_ckpt.IntegrityWarning, match=re.escape(why)):
            manager.save(2, tree)
        assert dict(counts) == {"step_00000001/big/c/0/0": 1}
        written = os.stat(_file(manager.step_path(2), "big/c/0/0"))
        assert written.st_ino != os.stat(damaged).st_ino and written.st_nlink == 1
        _loads_bit_for_bit(manager.step_path(2), tree)


def _all_links(directory):
    return sorted(
        os.path.relpath(os.path.join(r, n), directory)
        for r, _, names in os.walk(directory)
        for n in names
        if os.lstat(os.path.join(r, n)).st_nlink > 1
    )


def test_share_false_writes_every_chunk(tmp_path):
    tree = _tree()
    fired = []
    with _faults.armed(["share.verify", "share.link"], lambda *args: fired.append(args)):
        ckpt = tmp_path / "ckpt"
        eqx_ckpt.tree_serialise_leaves(ckpt, tree)
        before = _chunk_inodes(ckpt, "big")
        eqx_ckpt.tree_serialise_leaves(ckpt, tree, share=False)
        assert not set(before.values()) & set(_chunk_inodes(ckpt, "big").values())
        with eqx_ckpt.CheckpointManager(tmp_path / "run", share=False) as manager:
            assert manager.share is False
            for step in range(2):
                manager.save(step, tree)
            manager.save(1, tree, overwrite=True)  # an overwrite of a step shares nothing either
    assert fired == []
    assert _all_links(tmp_path) == []
    _loads_bit_for_bit(ckpt, tree)
    _loads_bit_for_bit(manager.step_path(1), tree)


def test_share_must_be_a_bool(tmp_path):
    message = "`share` must be `True` or `False` (`False` writes every chunk"
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape(message)):
        eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"w": np.ones(3)}, share="no")
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape(message)):
        eqx_ckpt.CheckpointManager(tmp_path / "run", share=1)
    assert os.listdir(tmp_path) == []
