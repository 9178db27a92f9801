"""Resource faults during a save: a full disk (at every point of a save), a file
size limit, a read-only destination, and a destination that refuses writes.
Each gives a clear eqx_ckpt error; the old checkpoint stays exactly loadable,
and nothing of the failed save is left half-committed.

A full disk and a read-only file system are real ones: a small tmpfs mounted for
the test (which needs root; otherwise the test is skipped). The file size limit
(`RLIMIT_FSIZE`, in a subprocess) needs no privilege. Tests run as root here, so
`chmod` cannot deny a write: the immutable attribute (`chattr +i`) does.
"""

import collections
import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import textwrap

import numpy as np
import prefork
import pytest
from arrays import tree_equal

import eqx_ckpt

PAGE = 4096


def _tree(generation: int, size: int = 100) -> dict:
    return {
        "w": np.full(size, generation, np.float32),
        "layers": [np.arange(10, dtype=np.int32) + generation for _ in range(3)],
        "step": generation,
    }


def _loads_as(path, generation: int, size: int = 100) -> bool:
    loaded = eqx_ckpt.tree_deserialise_leaves(path, _tree(0, size))
    return bool(tree_equal(loaded, _tree(generation, size), typematch=True)) and eqx_ckpt.verify(path) == []


def _committed_entries(path: pathlib.Path) -> set[str]:
    """What a committed checkpoint may hold at its top level: no `saving.json`,
    no second data root."""
    root = eqx_ckpt.Checkpoint(path)._manifest.data_root
    names = set(os.listdir(path))
    # A first save writes at the top level: `_tree`'s small leaves are packed, one array per dtype.
    first = {"manifest.json", "zarr.json", "packed.float32", "packed.int32", "packed.int64"}
    return names - ({"manifest.json", root} if root else first)


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs, mounted for the test."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _free(path: pathlib.Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def test_disk_full_at_every_point_of_a_save(small_fs):
    """Leave 0, 1, 2... pages free, then overwrite: the save runs out of space at
    every file it writes in turn (arrays, metadata, manifest), until it fits."""
    path = small_fs / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _tree(0))
    old, outcomes, failed_at = 0, collections.Counter(), set()
    for pages in range(40):
        filler = small_fs / "filler"
        filler.unlink(missing_ok=True)
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, _free(small_fs) - pages * PAGE))
        try:
            eqx_ckpt.tree_serialise_leaves(path, _tree(old + 1))
        except eqx_ckpt.CheckpointError as e:
            assert "No space left on device" in str(e) and str(path) in str(e)
            # The storage's fault, whichever file it was: never a leaf's.
            assert isinstance(e, eqx_ckpt.CheckpointStorageError) and isinstance(e, OSError), repr(e)
            written = re.findall(r"(manifest\.json|saving\.json|zarr\.json|/c\b)", str(e))
            failed_at.add(written[0].replace("/c", "a chunk") if written else "elsewhere")
            assert _loads_as(path, old), f"old checkpoint damaged with {pages} pages free"
            outcomes["failed, old intact"] += 1
        else:
            assert _loads_as(path, old + 1)
            # A save clears whatever a failed one left in the unused data root.
            assert _committed_entries(path) == set(), f"leftovers after a save with {pages} pages free"
            old += 1
            outcomes["saved"] += 1
    print(f"disk full sweep: {dict(outcomes)}, failed writing {sorted(failed_at)}")
    # The sweep ran out of space at the commit itself, not only before it.
    assert "manifest.json" in failed_at
    assert outcomes["failed, old intact"] >= 5 and outcomes["saved"] >= 1


def test_disk_full_on_first_save(small_fs):
    path = small_fs / "ckpt"
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match=r"No space left on device.*free space"):
        eqx_ckpt.tree_serialise_leaves(path, _tree(1, size=2**20))
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        eqx_ckpt.Checkpoint(path)
    assert os.listdir(path) == []
    eqx_ckpt.tree_serialise_leaves(path, _tree(2))
    assert _loads_as(path, 2)


def test_file_size_limit(tmp_path):
    # RLIMIT_FSIZE needs no privilege: every write past the limit fails (EFBIG).
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree(0))
    script = textwrap.dedent(
        f"""
        import resource, signal, numpy as np, eqx_ckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            eqx_ckpt.tree_serialise_leaves({str(tmp_path / "ckpt")!r}, {{"w": np.ones(2**18, np.float32)}})
        except eqx_ckpt.CheckpointError as e:
            print("refused:", type(e).__name__, e)
        """
    )
    # (Forked from a template with JAX imported, `prefork`: the limit is the child's own.)
    run = prefork.run(["-c", script], env=dict(os.environ), timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("refused: CheckpointStorageError") and "File too large" in run.stdout
    assert _loads_as(tmp_path / "ckpt", 0)
    assert _committed_entries(tmp_path / "ckpt") == set()


def test_read_only_destination(small_fs):
    path = small_fs / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _tree(0))
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        # Refused before anything is written: the message says so.
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match="Read-only file system") as info:
            eqx_ckpt.tree_serialise_leaves(path, _tree(1))
        assert "so nothing was written" in str(info.value)
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match="Read-only file system") as info:
            eqx_ckpt.tree_serialise_leaves(small_fs / "new", _tree(1))
        assert "so nothing was written" in str(info.value)
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match="Read-only file system") as info:
            eqx_ckpt.tree_serialise_leaves(path, _tree(1), blocking=False).wait()
        assert not isinstance(info.value, eqx_ckpt.LeafError)
        assert "so nothing was written" in str(info.value)
        # Reading needs no write access.
        assert _loads_as(path, 0)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert _committed_entries(path) == set()
    eqx_ckpt.tree_serialise_leaves(path, _tree(2))
    assert _loads_as(path, 2)


@contextlib.contextmanager
def _unwritable(path: pathlib.Path):
    """Deny writes into `path`: `chmod` for an ordinary user, the immutable
    attribute for root (whom `chmod` does not stop)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            path.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without `chattr`: no way to deny a write here")
    result = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"this file system has no immutable attribute: {result.stderr.decode().strip()}")
    try:
        yield "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_permission_denied(tmp_path):
    path = tmp_path / "ckpt"
    eqx_ckpt.tree_serialise_leaves(path, _tree(0))
    before = sorted(os.listdir(path))
    with _unwritable(path) as reason:
        with pytest.raises(eqx_ckpt.CheckpointError, match=reason):
            eqx_ckpt.tree_serialise_leaves(path, _tree(1))
        assert _loads_as(path, 0)
        assert sorted(os.listdir(path)) == before
    eqx_ckpt.tree_serialise_leaves(path, _tree(2))
    assert _loads_as(path, 2)
