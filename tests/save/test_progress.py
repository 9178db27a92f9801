"""Progress: callbacks with running counts, a tqdm bar only on a terminal."""

import fcntl
import io
import itertools
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_ckpt
from eqx_ckpt._base import _progress
from eqx_ckpt._load import _read
from eqx_ckpt._ondisk import _format
from eqx_ckpt._save import _records
from eqx_ckpt._store import _window
from eqx_ckpt._tools._cli import main


def _tree():
    return {
        "model": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.zeros(4), "empty": np.zeros((0, 3), np.float32)},
        "opt": [np.arange(5, dtype=np.int32), np.ones((2, 2), np.float16)],
        "step": 7,
    }


class Calls(list):
    def __call__(self, *counts):
        self.append(counts)

    def check(self, leaves, nbytes):
        """Monotone running counts with fixed totals, ending at the totals."""
        assert self, "the callback was never called"
        assert {(c[1], c[3]) for c in self} == {(leaves, nbytes)}
        for before, after in itertools.pairwise(self):
            assert after[0] >= before[0] and after[2] >= before[2]
        assert (self[-1][0], self[-1][2]) == (leaves, nbytes)


def test_callbacks_of_save_load_verify_diff(tmp_path):
    tree = _tree()
    saved = Calls()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree, progress=saved)
    stored = eqx_ckpt.Checkpoint(tmp_path / "a").total_bytes
    # Every leaf (the scalar `step` and the empty array too); bytes as stored.
    saved.check(6, stored)
    assert stored == 12 * 4 + 4 * 4 + 5 * 4 + 4 * 2 + 8

    loaded = Calls()
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", tree, progress=loaded)
    assert tree_equal(out, tree, typematch=True)
    loaded.check(6, stored)

    verified = Calls()
    assert eqx_ckpt.verify(tmp_path / "a", progress=verified) == []
    verified.check(6, stored)

    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", {**tree, "step": 8})
    compared = Calls()
    assert list(eqx_ckpt.diff(tmp_path / "a", tmp_path / "b", progress=compared)) == ["! step: values differ"]
    compared.check(6, stored)


def test_callbacks_of_lazy_reads_and_the_manager(tmp_path, monkeypatch):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree)
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", tree, lazy=True)
    # Scalars come back as values even when lazy: only the arrays are left to read.
    arrays = [x for x in jax.tree.leaves(lazy, is_leaf=eqx_ckpt._load._lazy.is_lazy) if eqx_ckpt._load._lazy.is_lazy(x)]
    assert 0 < len(arrays) < 6
    read = Calls()
    assert tree_equal(eqx_ckpt.materialise(lazy, progress=read), tree, typematch=True)
    read.check(len(arrays), sum(x.nbytes for x in arrays))
    # With a window smaller than any leaf, reads finish one by one, in order.
    monkeypatch.setattr(_window, "READ_BUDGET", 1)
    read = Calls()
    assert tree_equal(eqx_ckpt.materialise(lazy, progress=read), tree, typematch=True)
    assert [c[0] for c in read] == list(range(1, len(arrays) + 1))

    manager = eqx_ckpt.CheckpointManager(tmp_path / "runs")
    saved = Calls()
    manager.save(1, tree, progress=saved)
    saved.check(6, eqx_ckpt.Checkpoint(tmp_path / "runs" / "step_00000001").total_bytes)


def _steps_within(calls, total):
    """The distinct byte counts strictly between 0 and `total`: bytes reported
    while the one leaf was still being written or read."""
    return sorted({c[2] for c in calls if 0 < c[2] < total})


@pytest.mark.parametrize("store", ["local", "memory"])
def test_a_large_leaf_moves_in_steps(tmp_path, monkeypatch, request, store):
    """Issue 40, item 13: progress moved per leaf, so one 2 GB leaf jumped from
    0 to 100%. Bytes are now counted as chunk files are written (on a local
    disk) and as chunks or slabs are read (every store), in increasing steps
    that end at the total, with the leaf counted once, at the end."""
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2**16)  # 32 chunks of 64 KiB
    monkeypatch.setattr(_read, "SLAB_BYTES", 2**18)  # TensorStore reads it in 8 slabs
    tree = {"w": np.arange(2**19, dtype=np.float32)}  # 2 MiB: in a folder of its own, not packed
    total = tree["w"].nbytes
    path = str(tmp_path) if store == "local" else f"memory://progress/{request.node.name}/"
    saved = Calls()
    eqx_ckpt.tree_serialise_leaves(path, tree, progress=saved)
    saved.check(1, total)
    if store == "local":  # elsewhere TensorStore writes every byte at the commit
        assert len(_steps_within(saved, total)) >= 8, saved
        assert [c[0] for c in saved] == [0] * (len(saved) - 1) + [1]
    loaded = Calls()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(path, tree, progress=loaded), tree, typematch=True)
    loaded.check(1, total)
    assert len(_steps_within(loaded, total)) >= 7, loaded
    assert [c[0] for c in loaded] == [0] * (len(loaded) - 1) + [1]
    # Placed over 4 devices, each device's region counts as it lands.
    sharding = NamedSharding(jax.make_mesh((4,), ("x",), devices=jax.devices("cpu")), P("x"))
    like = {"w": jax.ShapeDtypeStruct(tree["w"].shape, tree["w"].dtype, sharding=sharding)}
    placed = Calls()
    out = eqx_ckpt.tree_deserialise_leaves(path, like, progress=placed)
    assert out["w"].sharding == sharding and np.array_equal(np.asarray(out["w"]), tree["w"])
    placed.check(1, total)
    assert _steps_within(placed, total) == [total // 4, total // 2, 3 * total // 4], placed


@pytest.mark.parametrize("store", ["local", "memory"])
def test_packed_leaves_count_up_from_one(tmp_path, request, store):
    """Issue 51: the first call of a save of 20 small leaves reported 18 of 20
    (every leaf of a pack at once). The leaves of a pack land together and are
    counted a few at a time: "n of N" starts near 1, grows by small steps and
    ends at N, in a save (eqx_ckpt's own writes on a local disk, TensorStore's
    elsewhere), a load and a verify."""
    tree = {f"l{i}": np.full(4, i, np.float32) if i % 3 else np.full(5, i, np.int32) for i in range(20)}
    path = str(tmp_path) if store == "local" else f"memory://progress/{request.node.name}/"
    nbytes = sum(x.nbytes for x in tree.values())
    saved, loaded = Calls(), Calls()
    eqx_ckpt.tree_serialise_leaves(path, tree, progress=saved)
    assert {eqx_ckpt.Checkpoint(path).record(key).pack is not None for key in tree} == {True}
    out = eqx_ckpt.tree_deserialise_leaves(path, tree, progress=loaded)
    assert tree_equal(out, tree, typematch=True)
    jobs = [saved, loaded]
    if store == "local":
        verified = Calls()
        assert eqx_ckpt.verify(path, progress=verified) == []
        jobs.append(verified)
    for calls in jobs:
        calls.check(20, nbytes)
        assert [c[0] for c in calls] == list(range(1, 21)), calls


def test_packed_leaves_count_as_their_chunk_files_land(tmp_path, monkeypatch, faults):
    """A pack of several chunk files: while its second file is held back, the
    leaves of the first are already counted, the others not yet."""
    # Leaves of 64 bytes (packed on 64-byte boundaries), files of 256: 4 leaves a file.
    monkeypatch.setattr(_records, "PACK_CHUNK_BYTES", 256)
    tree = {f"l{i}": np.full(16, i, np.float32) for i in range(20)}
    calls = Calls()
    seen = []

    def hold_back(directory, key):
        if directory.startswith("packed.") and key == "c/1":
            deadline = time.monotonic() + 30
            while not (calls and calls[-1][0] >= 4) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # time for any count the held-back file must stop
            seen.append(calls[-1][0] if calls else 0)

    faults("local_write.chunk", hold_back)
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree, progress=calls)
    pack = eqx_ckpt.Checkpoint(tmp_path).record("l0").pack
    assert pack is not None and pack.size >= 5 * pack.chunk
    assert seen == [4], (seen, calls)
    calls.check(20, 20 * 64)


def test_bytes_within_leaves_reach_a_callback_in_steps(monkeypatch):
    """Partial counts are throttled to `1 / PARTIAL_STEPS` of the job; a leaf done is always reported."""
    calls = Calls()
    tracker = _progress.Tracker(calls, leaves=2, nbytes=256 * 100, what="test")
    part = tracker.within(256 * 60)
    for _ in range(60):
        part(256)  # 60 steps of exactly 1/100 of the job: each reported
    monkeypatch.setattr(_progress, "PARTIAL_STEPS", 4)
    tracker = _progress.Tracker(calls := Calls(), leaves=2, nbytes=400, what="test")
    part = tracker.within(300)
    for _ in range(30):
        part(10)
    assert [c[2] for c in calls] == [100, 200, 300]
    part(50)  # beyond the leaf: not counted
    tracker.advance(leaves=1, nbytes=part.rest())
    tracker.advance(leaves=1, nbytes=100)
    assert [c[:3] for c in calls[-2:]] == [(1, 2, 300), (2, 2, 400)]


def test_progress_false_and_bad_values(tmp_path, monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(), progress=False)
    assert eqx_ckpt.verify(tmp_path, progress=False) == []
    assert terminal.getvalue() == ""
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("`progress` must be `None`")):
        eqx_ckpt.verify(tmp_path, progress="yes")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what was written to it."""

    def isatty(self):
        return True


def test_bar_on_a_terminal_for_large_jobs_only(tmp_path, monkeypatch):
    tree = {f"leaf{i}": np.full(3, i, np.float32) for i in range(12)}
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    # Below the thresholds: no bar, even on a terminal.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "small", tree)
    assert terminal.getvalue() == ""

    monkeypatch.setattr(_progress, "MIN_LEAVES", 10)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "large", tree)
    shown = terminal.getvalue()
    assert "save" in shown and "12/12 leaves" in shown and "144/144" in shown
    terminal.truncate(0)
    eqx_ckpt.tree_deserialise_leaves(tmp_path / "large", tree)
    assert "load" in terminal.getvalue() and "12/12 leaves" in terminal.getvalue()

    # `True` shows a bar whatever the size.
    terminal.truncate(0)
    eqx_ckpt.verify(tmp_path / "small", progress=True)
    assert "verify" in terminal.getvalue() and "12/12 leaves" in terminal.getvalue()


def test_quiet_when_stderr_is_not_a_terminal(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(_progress, "MIN_LEAVES", 1)
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert eqx_ckpt.verify(tmp_path) == []
    assert main(["verify", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert err == "" and out == f"{tmp_path}: sound\n"


def test_cli_bar_on_a_real_terminal(tmp_path):
    """`eqx-ckpt verify` with its stderr on a pseudo-terminal, as in a shell: a
    checkpoint of `MIN_LEAVES` leaves shows the bar; stdout stays clean."""
    tree = {f"leaf{i}": np.full(2, i % 100, np.int8) for i in range(_progress.MIN_LEAVES)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    exe = shutil.which("eqx-ckpt", path=os.path.dirname(sys.executable)) or "eqx-ckpt"
    leader, follower = pty.openpty()
    # A terminal of 120 columns (a fresh pseudo-terminal has none, and tqdm draws to the width).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    shown = []

    def read_terminal():
        # Read while the command runs: a full terminal buffer would block its writes.
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command closed the terminal
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        done = subprocess.run(
            [exe, "verify", str(tmp_path)], stderr=follower, stdout=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(follower)
        reader.join(timeout=60)
        os.close(leader)
    text = b"".join(shown).decode()
    assert done.returncode == 0 and done.stdout == f"{tmp_path}: sound\n"
    assert text.startswith("\rverify:") and "verify: 100%" in text
    assert f"{_progress.MIN_LEAVES}/{_progress.MIN_LEAVES} leaves" in text
