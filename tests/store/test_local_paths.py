"""`_local_paths`, the one place that lists a local folder or looks at a local
path, and `_storage.file_exists`, which asks whether a file is there without
reading it (issue 69, item 3)."""

import os

import pytest

import eqx_ckpt
from eqx_ckpt._base import _faults
from eqx_ckpt._base._errors import CorruptCheckpointError
from eqx_ckpt._base._location import location
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _local_paths, _storage


def test_local_stat_and_walk_read_a_folder_as_os_does(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "file").write_bytes(b"123")
    (tmp_path / "a" / "to_b").symlink_to(tmp_path / "a" / "b", target_is_directory=True)
    path = str(tmp_path / "a" / "to_b")
    assert _local_paths.local_stat(path).st_ino == os.stat(path).st_ino
    assert _local_paths.local_stat(path, follow=False).st_ino == os.lstat(path).st_ino
    with open(tmp_path / "a" / "b" / "file", "rb") as f:
        assert _local_paths.local_stat(f.fileno()).st_size == 3
    assert _local_paths.local_link(path) == str(tmp_path / "a" / "b")
    assert _local_paths.local_real_path(path) == os.path.realpath(tmp_path / "a" / "b")
    walked = [(os.path.relpath(root, tmp_path), sorted(f), n) for root, f, n in _local_paths.local_walk(str(tmp_path))]
    assert walked == [(".", ["a"], []), ("a", ["b", "to_b"], []), (os.path.join("a", "b"), [], ["file"])]
    assert [root for root, _, _ in _local_paths.local_walk(str(tmp_path), bottom_up=True)][-1] == str(tmp_path)
    assert list(_local_paths.local_walk(str(tmp_path / "missing"), strict=True)) == []
    with pytest.raises(OSError):
        _local_paths.local_stat(str(tmp_path / "missing"))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_exists_reads_no_bytes_of_the_file(tmp_path, where):
    """`exists` answers for a manifest of any size without reading it: a
    manifest past the size limit, which `read_file` refuses, is there."""
    loc = location(str(tmp_path) if where == "local" else f"memory://exists_{id(tmp_path)}/")
    assert not _storage.file_exists(loc, _format.MANIFEST)
    eqx_ckpt.tree_serialise_leaves(loc.display, {"w": 1.0})
    assert _storage.file_exists(loc, _format.MANIFEST)
    _storage.write_file(loc, "big.json", b"x" * 100)
    with pytest.raises(CorruptCheckpointError):
        _storage.read_file(loc, "big.json", limit=10)
    assert _storage.file_exists(loc, "big.json") and not _storage.file_exists(loc, "absent.json")
    fired = []
    with _faults.armed({"storage.read_file": lambda loc, name: fired.append(name)}):
        _storage.file_exists(loc, _format.MANIFEST)
    assert fired == [_format.MANIFEST]


def test_exists_refuses_a_linked_file_as_a_read_does(tmp_path):
    (tmp_path / "elsewhere.json").write_bytes(b"{}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / _format.MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    loc = location(str(tmp_path / "ckpt"))
    with pytest.raises(CorruptCheckpointError) as read:
        _storage.read_file(loc, _format.MANIFEST, limit=100)
    with pytest.raises(CorruptCheckpointError) as asked:
        _storage.file_exists(loc, _format.MANIFEST)
    assert str(asked.value) == str(read.value)


def test_a_small_file_read_under_a_large_limit_allocates_its_size(tmp_path):
    """A manifest is read under a limit of 256 MiB; the read allocates what the
    file holds, not the limit (every `Checkpoint(path)` opened read one)."""
    import tracemalloc

    (tmp_path / "small").write_bytes(b"x" * 1000)
    loc = location(str(tmp_path))
    tracemalloc.start()
    try:
        data, _ = _storage.read_file_stamped(loc, "small", limit=256 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data == b"x" * 1000 and peak < 2**20, peak
    with pytest.raises(CorruptCheckpointError, match="more than the 999"):
        _storage.read_file_stamped(loc, "small", limit=999)
