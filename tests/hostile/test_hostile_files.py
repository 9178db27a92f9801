"""Hostile files: a named pipe (FIFO) or a socket where a checkpoint holds a
file is refused with an eqx_ckpt error naming the checkpoint and the file,
and never hangs a load. Opening a FIFO waits for a writer, forever.

Each load runs in a child process with a timeout, so that a hang fails the
test instead of hanging the suite. One child tries every case of a test in
turn, and says which case it starts before it starts it: a hang names its case.
"""

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import places
import prefork
import pytest
from safetensors.numpy import save_file

import eqx_ckpt
import eqx_ckpt._save._records

ROOT = places.ROOT
# Seconds for every case of one test together: a hang is a failure, not a stalled suite.
TIMEOUT = 60

_WORKER = """
import json
import numpy as np
import eqx_ckpt

def attempt(path):
    try:
        ckpt = eqx_ckpt.Checkpoint(path)
        for key in ckpt:
            value = ckpt[key]
            np.asarray(value) if isinstance(value, eqx_ckpt.LazyArray) else value
        ckpt.load()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return ["ok", ""]

for name, path in json.loads(CASES):
    print("START " + name, flush=True)
    print("RESULT " + json.dumps([name, *attempt(path)]), flush=True)
"""


def _outcomes(cases: dict[str, pathlib.Path]) -> dict[str, list[str]]:
    """Each case's path loaded in one child process: its error's class and message (or "ok")."""
    code = _WORKER.replace("CASES", repr(json.dumps([[name, str(path)] for name, path in cases.items()])))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), str(places.SUPPORT)])}
    try:
        done = prefork.run(["-c", code], env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        started = [line[len("START ") :] for line in out.splitlines() if line.startswith("START ")]
        pytest.fail(f"the load of {started[-1] if started else 'the first case'!r} hung for {TIMEOUT} s")
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return {name: [kind, message] for name, kind, message in results}


def _special(path: pathlib.Path, kind: str) -> None:
    """Put a FIFO or a socket in place of the file at `path`."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return
    # Bound by its name in its own folder: a socket's path may hold only about 100 bytes.
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with contextlib.closing(socket.socket(socket.AF_UNIX)) as server:
            server.bind(path.name)
    finally:
        os.chdir(here)


_SAID = {"fifo": "is a named pipe (FIFO), not a regular file", "socket": "is a socket, not a regular file"}


def _check(outcomes: dict[str, list[str]], expected: dict[str, tuple[pathlib.Path, str, str]], kind: str) -> None:
    """Each case refused with its error class, naming the checkpoint and the file (`name`)."""
    assert sorted(outcomes) == sorted(expected)
    for case, (checkpoint, name, error) in expected.items():
        got, message = outcomes[case]
        assert got == error, (case, got, message)
        assert _SAID[kind] in message, (case, message)
        assert repr(str(checkpoint)) in message and repr(name) in message, (case, message)


def _copy(source: pathlib.Path, where: pathlib.Path) -> pathlib.Path:
    where.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if source.is_dir() else shutil.copy)(source, where)
    return where


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Sound checkpoints of each kind that hold files, each left as written."""
    root = tmp_path_factory.mktemp("sound")
    # A leaf over 1 MiB (read by eqx_ckpt itself), small ones in packs.
    tree = {"big": np.ones(2**19, np.float32), "a": np.arange(10, dtype=np.float32), "n": 3}
    eqx_ckpt.tree_serialise_leaves(root / "packed", tree)
    with pytest.MonkeyPatch.context() as patch:  # small leaves in folders of their own, read by TensorStore
        patch.setattr(eqx_ckpt._save._records, "PACK_BYTES", -1)
        eqx_ckpt.tree_serialise_leaves(root / "unpacked", {"mid": np.ones(1000, np.float32), "n": 3})
    eqx_ckpt.tree_serialise_leaves(root / "ocdbt", {"mid": np.ones(1000, np.float32), "n": 3}, layout="ocdbt")
    (root / "plain").mkdir()
    save_file({"w": np.ones(4, np.float32)}, root / "plain" / "model.safetensors")
    save_file({"w": np.ones(4, np.float32)}, root / "direct.safetensors")
    small = {"w": np.ones(400, np.float32), "v": np.zeros(300, np.float32), "key": jax.random.key(0)}
    eqx_ckpt.export_safetensors(root / "published", small)
    eqx_ckpt.export_safetensors(root / "sharded", small, max_shard_size=1000)
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    return root


# (checkpoint, file in it, the error): a file of a leaf's own folder or pack is
# that leaf's damage (`IntegrityError`, as a link there is); any other file the
# checkpoint's (`CorruptCheckpointError`).
FILES = {
    "manifest": ("packed", "manifest.json", "CorruptCheckpointError"),
    "large leaf's chunk (read by eqx_ckpt)": ("packed", "big/c/0", "IntegrityError"),
    "pack's chunk": ("packed", "packed.float32/c/0", "IntegrityError"),
    "pack's zarr.json": ("packed", "packed.float32/zarr.json", "IntegrityError"),
    "leaf's chunk (read by TensorStore)": ("unpacked", "mid/c/0", "IntegrityError"),
    "leaf's zarr.json": ("unpacked", "mid/zarr.json", "IntegrityError"),
    "scalar's one chunk": ("unpacked", "n/c", "IntegrityError"),
    "OCDBT manifest": ("ocdbt", "ocdbt.db/manifest.ocdbt", "CorruptCheckpointError"),
    "OCDBT data file": ("ocdbt", "ocdbt.db/d/*", "CorruptCheckpointError"),
    "safetensors file of a folder": ("plain", "model.safetensors", "CorruptCheckpointError"),
    "safetensors file named directly": ("direct.safetensors", "", "CorruptCheckpointError"),
    "published file": ("published", "model.safetensors", "CorruptCheckpointError"),
    "published eqx_ckpt.json": ("published", "eqx_ckpt.json", "CorruptCheckpointError"),
    "index": ("sharded", "model.safetensors.index.json", "CorruptCheckpointError"),
    "shard": ("sharded", "model-00002-of-*.safetensors", "CorruptCheckpointError"),
}
# A socket cannot be opened at all: a few of each way a file is reached.
SOCKETS = ["manifest", "large leaf's chunk (read by eqx_ckpt)", "leaf's chunk (read by TensorStore)", "shard"]


def _planted(checkpoints: pathlib.Path, tmp_path: pathlib.Path, kind: str, names: list[str]) -> tuple[dict, dict]:
    """A copy of the checkpoint of each case, its file replaced: the paths to
    load, and what each must raise (`_check`)."""
    paths, expected = {}, {}
    for i, case in enumerate(names):
        top, file, error = FILES[case]
        copy = _copy(checkpoints / top, tmp_path / str(i) / top)
        target = (sorted(copy.glob(file))[0] if "*" in file else copy / file) if file else copy
        _special(target, kind)
        paths[case] = copy
        name = os.path.relpath(target, copy) if file else target.name
        expected[case] = (copy, name, error)
    return paths, expected


def test_a_fifo_in_place_of_any_file_is_refused_and_never_hangs(checkpoints, tmp_path):
    paths, expected = _planted(checkpoints, tmp_path, "fifo", sorted(FILES))
    _check(_outcomes(paths), expected, "fifo")


def test_a_socket_in_place_of_a_file_is_refused(checkpoints, tmp_path):
    paths, expected = _planted(checkpoints, tmp_path, "socket", SOCKETS)
    _check(_outcomes(paths), expected, "socket")


def test_a_link_to_a_regular_file_still_loads_and_a_link_to_a_fifo_does_not(checkpoints, tmp_path):
    """A link is followed where it is today (a safetensors folder: the Hugging
    Face cache's snapshots link to their blobs); what it leads to must be a
    regular file."""
    outside = _copy(checkpoints / "plain" / "model.safetensors", tmp_path / "blob")
    os.mkfifo(tmp_path / "pipe")
    for name, target in (("linked", outside), ("to_fifo", tmp_path / "pipe")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").symlink_to(target)
    outcomes = _outcomes({"linked": tmp_path / "linked", "to_fifo": tmp_path / "to_fifo"})
    assert outcomes["linked"] == ["ok", ""]
    kind, message = outcomes["to_fifo"]
    assert kind == "CorruptCheckpointError" and _SAID["fifo"] in message and "'model.safetensors'" in message


def test_a_fifo_in_an_orbax_checkpoint_is_refused(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"w": np.ones((64, 8), np.float32), "b": np.arange(4)}
    expected_files = {"ocdbt": ["_METADATA", "manifest.ocdbt", "d/*"], "zarr": ["w/zarr.json", "w/c/0/0"]}
    paths, expected = {}, {}
    for layout, files in expected_files.items():
        sound = tmp_path / f"sound_{layout}"
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=layout == "ocdbt", use_zarr3=True)) as c:
            c.save(sound, args=ocp.args.PyTreeSave(tree))
        for i, file in enumerate(files):
            copy = _copy(sound, tmp_path / f"{layout}_{i}")
            target = sorted(copy.glob(file))[0]
            _special(target, "fifo")
            paths[f"{layout} {file}"] = copy
            expected[f"{layout} {file}"] = (copy, os.path.relpath(target, copy), "CorruptCheckpointError")
    _check(_outcomes(paths), expected, "fifo")


def test_the_worker_reads_a_sound_checkpoint_of_each_kind(checkpoints):
    """(So that a refusal above is the planted file's, not the worker's.)"""
    tops = sorted({top for top, _, _ in FILES.values()})
    assert _outcomes({top: checkpoints / top for top in tops}) == {top: ["ok", ""] for top in tops}


def test_the_worker_names_a_case_that_hangs(tmp_path, monkeypatch):
    """A hang fails the test, naming the case, within the timeout."""
    monkeypatch.setattr(
        sys.modules[__name__],
        "_WORKER",
        textwrap.dedent("""
            import json, time
            for name, path in json.loads(CASES):
                print("START " + name, flush=True)
                time.sleep(3600)
        """),
    )
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT", 3)
    with pytest.raises(pytest.fail.Exception, match="'stuck' hung for 3 s"):
        _outcomes({"stuck": tmp_path})
