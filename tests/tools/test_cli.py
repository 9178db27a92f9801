"""The `eqx-ckpt` command, run as a user runs it: each run a new process.

Most runs are `python -m eqx_ckpt._tools._cli` forked from a template process
that already imported JAX (`prefork`: the same `main`, a second less per run);
the installed console script itself runs in `test_help_everywhere`, the S3
tests (`AWS_ENDPOINT_URL` in its own environment) and the closed-pipe test,
so the entry point stays tested."""

import functools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import equinox as eqx
import http_server
import jax
import jax.numpy as jnp
import numpy as np
import places
import prefork
import pytest
import s3_server
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._load._checkpoint import human
from eqx_ckpt._tools._cli import main

EXE = shutil.which("eqx-ckpt", path=os.path.dirname(sys.executable)) or "eqx-ckpt"


def run(*args, check_code=None, timeout=120, installed=False):
    """`eqx-ckpt ARGS` in a new process, in this process's environment and
    folder: the installed console script with `installed`, else `python -m
    eqx_ckpt._tools._cli ARGS` forked from a template (`prefork`)."""
    if installed:
        done = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    else:
        done = prefork.run(["-m", "eqx_ckpt._tools._cli", *map(str, args)], env=dict(os.environ), timeout=timeout)
    if check_code is not None:
        assert done.returncode == check_code, (done.stdout, done.stderr)
    return done


@pytest.fixture(autouse=True, scope="module")
def _template():
    """The template process started at once: its imports overlap the first test's set-up."""
    prefork.start(dict(os.environ))


def _save(path):
    tree = {"model": {"w": jnp.ones((3, 4)), "b": np.zeros(4, np.float16)}, "step": 7, "a.b": jnp.ones(2)}
    eqx_ckpt.tree_serialise_leaves(path, tree)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    _save(path)
    return path


def test_ls_is_a_sorted_tree_with_sizes(ckpt):
    out = run("ls", ckpt, check_code=0).stdout.splitlines()
    names = [line.split()[0] for line in out[:-1]]
    assert names == ["a%2Eb", "model/", "b", "w", "step"]
    assert out[2].split()[1:] == ["float16[4]", "8", "B"]
    assert out[3].split()[1:] == ["float32[3,4]", "48", "B"]
    assert out[-1] == "4 leaves, 72 B"


def test_ls_depth_limits_levels(ckpt):
    out = run("ls", ckpt, "--depth", "1", check_code=0).stdout.splitlines()
    assert [line.split()[0] for line in out[:-1]] == ["a%2Eb", "model/", "step"]


def test_info_reports_format_and_counts(ckpt):
    out = run("info", ckpt, check_code=0).stdout
    assert "eqx_ckpt 5" in out
    assert f"library version: {eqx_ckpt.__version__}" in out
    assert "leaves:          4" in out
    assert "bytes:           72 " in out


def test_info_of_another_format_prints_no_empty_lines(tmp_path):
    """A safetensors file records no library version or creation time: those
    lines were printed empty."""
    import safetensors.numpy

    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, str(path))
    out = run("info", path, check_code=0).stdout
    assert "format:          safetensors" in out and "leaves:          1" in out
    assert "library version" not in out and "created" not in out
    assert all(line.split(":", 1)[1].strip() for line in out.splitlines()), out


def test_missing_checkpoint_exits_2_with_message(tmp_path):
    done = run("ls", tmp_path / "nope", check_code=2)
    assert "no eqx_ckpt checkpoint" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unreachable_server_exits_2_within_seconds():
    """Once `eqx-ckpt info http://localhost:1/x` never returned: TensorStore
    retried the refused connection for a quarter of an hour."""
    url = http_server.refused_url("ckpt")
    start = time.monotonic()
    done = run("info", url, check_code=2)
    assert time.monotonic() - start < 60
    assert done.stderr.startswith(f"eqx-ckpt info: Cannot reach {url!r}: "), done.stderr
    assert "Traceback" not in done.stderr


def test_verify_of_storage_that_fails_to_serve_exits_2_not_1(tmp_path, capsys):
    """A server error on the chunk files says nothing about the checkpoint:
    `verify` once reported each leaf as damaged (exit 1)."""
    _save(tmp_path / "ckpt")

    class Failing(http_server.Files):
        def do_GET(self):
            if "/c/" in self.path or self.path.endswith("/c"):
                self.send_error(500)
                return
            super().do_GET()

    with http_server.serve(functools.partial(Failing, directory=str(tmp_path))) as url:
        assert main(["verify", f"{url}/ckpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eqx-ckpt verify: The storage would not serve "), err
    assert "[HTTP code 500]" in err and "may well be whole" in err and "damaged" not in err
    assert main(["verify", str(tmp_path / "ckpt")]) == 0


def test_help_everywhere(capsys):
    """The installed command's help (a process of its own), then each command's
    (the same parser, in this process)."""
    assert "Exit codes" in run("--help", check_code=0, installed=True).stdout
    for command in ("ls", "info", "verify", "diff", "export", "push", "demo"):
        assert main([command, "--help"]) == 0
        assert "usage: eqx-ckpt " + command in capsys.readouterr().out


def test_bad_arguments_exit_2():
    assert main(["frobnicate"]) == 2
    assert main([]) == 2


def test_demo_runs_end_to_end(tmp_path):
    out = run("demo", "--dir", tmp_path / "demo", "--steps", "5", check_code=0).stdout
    assert "Full load into an eqx.filter_eval_shape skeleton" in out
    assert "equal to what was saved: True" in out
    assert "Data pipeline resumed from its saved position {'seed': 0, 'epoch': 0, 'position': 160}: " in out
    assert "the next batches are the same: True" in out
    assert "Params-only load (prefix='model'" in out
    rebuilt = "Load without the model's code (Checkpoint(path).load('model', trust=[])): a MLP, equal to the trained"
    assert f"{rebuilt} model: True." in out
    assert "equal to the trained model: True" in out
    # The MLP's small leaves are packed: one zarr v3 array per stored dtype, and the manifest.
    demo = pathlib.Path(tmp_path) / "demo"
    assert (demo / "packed.float32" / "zarr.json").is_file() and (demo / "manifest.json").is_file()
    leaves = json.loads((demo / "manifest.json").read_text())["leaves"]
    assert next(leaf for leaf in leaves if leaf["path"] == "model.layers.0.weight")["pack"] == "packed.float32"
    listed = run("ls", tmp_path / "demo", check_code=0).stdout
    assert "opt_state/" in listed and "step" in listed


def _chunk_file(path, leaf):
    """The (first) chunk file holding `leaf`: its pack's, or its own folder's."""
    record = next(r for r in json.loads((path / "manifest.json").read_text())["leaves"] if r["path"] == leaf)
    chunks = path / record.get("pack", leaf.replace(".", "/")) / "c"
    return chunks if chunks.is_file() else min(p for p in chunks.rglob("*") if p.is_file())  # a 0-d leaf: `c`


def test_verify_sound_then_damaged_names_the_leaf(tmp_path, packing):
    ckpt = tmp_path / "ckpt"
    _save(ckpt)
    done = run("verify", ckpt, check_code=0)
    assert done.stdout.strip().endswith(": sound")
    chunk = _chunk_file(ckpt, "model.w")
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    done = run("verify", ckpt, check_code=1)
    assert "model.w" in done.stdout
    # A damaged chunk of a pack is a problem of every leaf in it (`a.b` is float32 too).
    assert ("1 problem(s)" if packing == "unpacked" else "2 problem(s)") in done.stdout


def test_verify_detects_a_deleted_chunk(tmp_path, packing):
    ckpt = tmp_path / "ckpt"
    _save(ckpt)
    _chunk_file(ckpt, "step").unlink()
    done = run("verify", ckpt, check_code=1)
    assert "step" in done.stdout


def test_verify_reports_damaged_group_metadata(ckpt):
    (ckpt / "zarr.json").write_bytes(b"\x00garbage")
    done = run("verify", ckpt, check_code=1)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("The zarr group metadata 'zarr.json' is not valid JSON. Loads do not read it")
    assert lines[-1] == f"{ckpt}: 1 problem(s)"


def test_diff_exit_codes_and_lines(tmp_path, ckpt):
    other = tmp_path / "other"
    tree = {"model": {"w": jnp.ones((3, 4)), "b": np.ones(4, np.float16)}, "step": 7, "new": jnp.zeros(1)}
    eqx_ckpt.tree_serialise_leaves(other, tree)
    assert run("diff", ckpt, ckpt, check_code=0).stdout == (
        f"{ckpt} and {ckpt} are equal: the same leaves, dtypes, shapes, values and structure.\n"
    )
    lines = run("diff", ckpt, other, check_code=1).stdout.splitlines()
    assert any(line.startswith("- a%2Eb") for line in lines)
    assert any(line.startswith("+ new") for line in lines)
    assert any(line.startswith("! model.b") for line in lines)
    assert not any("model.w" in line for line in lines)
    assert run("diff", ckpt, tmp_path / "missing", check_code=2).stderr


def test_kvstore_spec_as_json(tmp_path, ckpt):
    spec = json.dumps({"driver": "file", "path": ckpt.as_posix()})
    out = run("ls", spec, check_code=0).stdout
    assert out.splitlines()[-1] == "4 leaves, 72 B"
    assert "not a JSON kvstore spec" in run("info", "{nope", check_code=2).stderr


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"eqx-ckpt {eqx_ckpt.__version__}\n"
    import importlib.metadata

    assert eqx_ckpt.__version__ == importlib.metadata.version("eqx_ckpt")


def test_info_and_ls_escape_terminal_control_characters(ckpt, capsys):
    import manifests

    body = json.loads((ckpt / "manifest.json").read_text())
    body["created"] = "2026\x1b[2J\x1b]0;pwned\x07"
    body["library_version"] = "0.1\r\x1b[31m"
    (ckpt / "manifest.json").write_bytes(manifests.sign(body))
    assert main(["info", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "created:         2026\\x1b[2J\\x1b]0;pwned\\x07" in out
    assert "library version: 0.1\\r\\x1b[31m" in out
    assert main(["ls", str(ckpt)]) == 0
    assert "\x1b" not in capsys.readouterr().out


def test_ls_on_a_manager_directory_lists_its_steps(tmp_path, capsys):
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    for step in (2, 10):
        manager.save(step, {"w": jnp.ones(3)}, metrics={"loss": step / 4})
    assert main(["ls", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "2", "1", "leaves", "12", "B", "loss=0.5"]
    assert lines[1].split() == ["step", "10", "1", "leaves", "12", "B", "loss=2.5"]
    assert lines[2].startswith("2 steps in a CheckpointManager directory")
    assert main(["ls", str(tmp_path / "nothing")]) == 2
    assert "no eqx_ckpt checkpoint" in capsys.readouterr().err


def test_ls_on_a_manager_directory_of_compressed_steps_shows_the_bytes_stored(tmp_path, capsys):
    """Issue 88: the sizes shown were the arrays' alone, however small the
    files. (Steps that are not compressed show one size: the test above.)"""
    with eqx_ckpt.CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save(step, {"w": jnp.zeros((256, 256))}, metrics={"loss": 1 / step}, compression="zstd")
    stored = [eqx_ckpt.Checkpoint(manager.step_path(step)).stored_bytes for step in (1, 2)]
    assert all(n < 256 * 256 * 4 // 10 for n in stored)
    assert main(["ls", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line, n, loss in zip(lines, stored, ("1", "0.5")):
        assert line.split(None, 3)[3] == f"leaves  256.0 KiB ({human(n)} stored)  loss={loss}", line


def test_verify_of_a_manager_directory_reports_each_step_and_exits_1_if_one_is_damaged(tmp_path):
    """Issue 51, item 4: `eqx-ckpt verify runs/exp1` said there was no
    checkpoint there, while `eqx-ckpt ls` listed its steps."""
    run_dir = tmp_path / "run"
    with eqx_ckpt.CheckpointManager(run_dir) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": np.full(3, float(step)), "big": np.full((600, 600), float(step), np.float32)})
    lines = run("verify", run_dir, check_code=0).stdout.splitlines()
    verdict = f"{run_dir}: 3 steps in a CheckpointManager directory, sound"
    assert lines == ["step 1: sound", "step 2: sound", "step 3: sound", verdict]
    chunk = run_dir / "step_00000002" / "big" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    lines = run("verify", run_dir, check_code=1).stdout.splitlines()
    # The damaged file first (issue 59, item 12), then each step.
    assert lines[0] == "1 damaged file, used by 1 leaf in 1 step:"
    assert lines[1] == f"  {chunk}: 1 leaf in step 2; the first says:"
    assert lines[2].startswith(f"    step 2: big: Leaf `big` in checkpoint {str(run_dir / 'step_00000002')!r}: ")
    assert lines[3] == "Every leaf that uses a damaged file is damaged: restore it from a good copy."
    assert lines[4:] == [
        "step 1: sound",
        "step 2: 1 leaf in the damaged files above: big",
        "step 2: 1 problem(s)",
        "step 3: sound",
        f"{run_dir}: 3 steps in a CheckpointManager directory, 1 damaged: [2]",
    ]


def test_verify_of_damage_that_steps_share_leads_with_the_damaged_file(tmp_path, monkeypatch):
    """Issue 59, item 12: one flipped bit in a pack chunk that six steps share
    printed 294 lines and no summary. It leads with the one damaged file, the
    leaves and steps it damages, and stays bounded."""
    run_dir = tmp_path / "run"
    base = {f"layer{i}": {"w": np.full((30, 30), i, np.float32), "b": np.zeros(30, np.float32)} for i in range(20)}
    with eqx_ckpt.CheckpointManager(run_dir, max_to_keep=10) as manager:
        for step in range(6):  # the float32 pack is unchanged: every step shares its chunk file
            manager.save(step, {**base, "head": np.full(10, step, np.float16)})
    chunk = run_dir / "step_00000000" / "packed.float32" / "c" / "0"
    assert chunk.stat().st_nlink == 6
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    monkeypatch.chdir(tmp_path)  # the path as the user gave it, relative
    lines = run("verify", "run", check_code=1).stdout.splitlines()
    assert lines[0] == "1 damaged file, used by 40 leaves in 6 steps:"
    assert lines[1] == "  run/step_00000000/packed.float32/c/0: 40 leaves in steps 0, 1, 2, 3, 4, 5; the first says:"
    assert lines[2].startswith("    step 0: layer0.b: its pack 'packed.float32' is damaged: ") and "Digest" in lines[2]
    assert lines[3] == (
        "Every leaf that uses a damaged file is damaged (steps share unchanged chunk files: see docs/manager.md): "
        "restore it from a good copy."
    )
    named = "layer0.b, layer0.w, layer1.b, layer1.w, layer10.b and 35 more"
    for step in range(6):
        assert lines[4 + 2 * step : 6 + 2 * step] == [
            f"step {step}: 40 leaves in the damaged files above: {named}",
            f"step {step}: 40 problem(s)",
        ]
    assert lines[16:] == ["run: 6 steps in a CheckpointManager directory, 6 damaged: [0, 1, 2, 3, 4, 5]"]
    problems = eqx_ckpt.verify(run_dir)
    assert len(problems) == 240 and {p.file for p in problems} != {None}
    [(file, group)] = problems.damaged_files()
    assert os.path.samefile(file, chunk) and len(group) == 240


def test_demo_refuses_bad_arguments_before_training(tmp_path, capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "give a positive number, not 0" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(["demo", "--dir", str(tmp_path / "full"), "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not an empty directory" in err and "Trained" not in err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["notes.txt"]


def test_ls_values_prints_small_leaves(tmp_path):
    path = tmp_path / "ckpt"
    tree = {
        "big": np.arange(17.0, dtype=np.float32),
        "small": np.arange(3, dtype=np.int32),
        "lr": 0.25,
        "step": 7,
        "momentum": np.float64(0.1),
    }
    eqx_ckpt.tree_serialise_leaves(path, tree)
    lines = run("ls", "--values", path, check_code=0).stdout.splitlines()
    assert lines[0].split() == ["big", "float32[17]", "68", "B"]
    assert lines[1].split() == ["lr", "float64[]", "8", "B", "=", "0.25"]
    # A NumPy scalar prints as its value (it printed `np.float64(0.1)`).
    assert lines[2].split() == ["momentum", "float64[]", "8", "B", "=", "0.1"]
    assert lines[3].endswith("= [0, 1, 2]") and lines[4].endswith("B  = 7")
    assert "=" not in run("ls", path, check_code=0).stdout


def test_verify_and_diff_keep_their_answer_when_the_reader_goes_away(tmp_path):
    """`eqx-ckpt verify damaged | head -1` exited 0 ("sound") and `diff a b | head -1`
    0 ("equal") once the pipe closed; with `set -o pipefail` a script concluded
    that a damaged checkpoint was sound. Here the reader goes away before the
    command writes a line, so its every write meets the closed pipe. (The
    commands print a bounded report in one write at the end: a reader that
    took the first line would close the pipe after the last write.)"""
    for name, value in (("a", 0.0), ("b", 1.0)):
        eqx_ckpt.tree_serialise_leaves(tmp_path / name, {f"k{i}": np.full(3, value + i) for i in range(3)})
    shutil.copytree(tmp_path / "a", tmp_path / "damaged")
    (tmp_path / "damaged" / "packed.float64" / "c" / "0").unlink()
    commands = (["verify", tmp_path / "damaged"], ["diff", tmp_path / "a", tmp_path / "b"])
    processes = []  # (the two at once: neither depends on the other)
    for args in commands:
        processes.append(subprocess.Popen([EXE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        processes[-1].stdout.close()  # the reader goes away at once
    for args, process in zip(commands, processes):
        assert process.wait(timeout=120) == 1, (args, process.stderr.read())
        assert process.stderr.read() == b"", args  # no traceback of the broken pipe
        process.stderr.close()


def test_ls_of_a_file_says_there_is_no_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    done = run("ls", tmp_path / "notes.txt", check_code=2)
    # Says what the path is, and nothing about interrupted saves (issue 51, item 8).
    assert done.stderr == (
        f"eqx-ckpt ls: '{tmp_path / 'notes.txt'}' is not a checkpoint eqx_ckpt reads. It is a file; an eqx_ckpt "
        f"checkpoint is a directory.\n"
    ), done.stderr
    assert "CheckpointManager" not in done.stderr


def test_ls_reaches_an_s3_server_through_aws_endpoint_url(s3, monkeypatch, capsys):
    """The CLI's one way to an S3-compatible server, as `ls --help` and
    docs/storage.md say: `AWS_ENDPOINT_URL`. (TensorStore does not read it: an
    `s3://` URL went to AWS, and waited out its retries there.) The help is
    the parser's, in this process (`test_help_everywhere` runs the installed
    command's); the two `ls` runs are the installed command's."""
    s3_server.credentials(monkeypatch)
    eqx_ckpt.tree_serialise_leaves(s3.spec("cli/ckpt/"), {"w": np.arange(6, dtype=np.float32), "step": 3})
    assert main(["ls", "--help"]) == 0
    assert "AWS_ENDPOINT_URL" in capsys.readouterr().out
    assert "AWS_ENDPOINT_URL" in (places.ROOT / "docs" / "storage.md").read_text()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    done = run("ls", f"s3://{s3_server.BUCKET}/cli/ckpt", check_code=0, timeout=60, installed=True)
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["step", "w"] and lines[-1] == "2 leaves, 32 B", done.stdout
    # `AWS_ENDPOINT_URL_S3` wins, as for the AWS tools.
    monkeypatch.setenv("AWS_ENDPOINT_URL", http_server.refused_url("").rstrip("/"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    run("ls", f"s3://{s3_server.BUCKET}/cli/ckpt", check_code=0, timeout=60, installed=True)


def test_ls_of_an_unreachable_s3_endpoint_exits_2_within_seconds(monkeypatch):
    """An endpoint that refuses connections: exit 2 with a connection message,
    within the subprocess's timeout (it once hung on TensorStore's default retries:
    32 attempts, up to 32 s apart)."""
    s3_server.credentials(monkeypatch)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", http_server.refused_url("").rstrip("/"))
    url = f"s3://{s3_server.BUCKET}/run/ckpt"
    done = run("ls", url, check_code=2, timeout=60, installed=True)
    # (TensorStore's AWS library may log lines of its own before it.)
    assert f"\neqx-ckpt ls: Cannot reach '{url}': " in "\n" + done.stderr, done.stderr
    assert "curl_code='7'" in done.stderr and "Check the URL" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _claim_a_newer_format(path):
    """Make the checkpoint at `path` claim the next format version, as a newer eqx_ckpt would write it."""
    from eqx_ckpt._ondisk._format import FORMAT_VERSION

    manifest = path / "manifest.json"
    text, count = re.subn(r'"format_version": [0-9]+', f'"format_version": {FORMAT_VERSION + 1}', manifest.read_text())
    assert count == 1
    manifest.write_text(text)
    return FORMAT_VERSION + 1


def test_verify_of_a_newer_format_exits_2_not_1(tmp_path, ckpt):
    """Issue 59, item 10: a checkpoint of a newer format was a
    `CorruptCheckpointError`, and `verify` exited 1 ("damaged"): a clean-up
    script could delete a sound checkpoint."""
    version = _claim_a_newer_format(ckpt)
    done = run("verify", ckpt, check_code=2)
    assert done.stdout == ""
    assert done.stderr.startswith(f"eqx-ckpt verify: The manifest of checkpoint {str(ckpt)!r} says format version ")
    assert f"version {version}, which is not one this eqx_ckpt reads" in done.stderr
    assert "nothing is wrong with the checkpoint" in done.stderr and "git pull" in done.stderr
    assert "pip install -U" not in done.stderr and "damaged" not in done.stderr
    # In a manager's directory: the other steps are verified, that one is not damage.
    run_dir = tmp_path / "run"
    with eqx_ckpt.CheckpointManager(run_dir) as manager:
        for step in (1, 2):
            manager.save(step, {"w": np.full(3, float(step))})
    _claim_a_newer_format(run_dir / "step_00000002")
    lines = run("verify", run_dir, check_code=2).stdout.splitlines()
    assert lines[0] == "step 1: sound"
    assert lines[1].startswith("not checked: Step 2 was not checked: The manifest of checkpoint ")
    verdict = "1 step in a CheckpointManager directory, sound; 1 of a newer format, not checked: [2]"
    assert lines[2] == f"{run_dir}: {verdict}"
    problems = eqx_ckpt.verify(run_dir)
    assert problems == [] and problems.newer == (2,) and problems.steps == (1,)


class _Activation(eqx.Module):
    linear: eqx.nn.Linear
    act: Any


def test_ls_types_names_what_a_save_could_not_record(tmp_path, monkeypatch):
    """Issue 59, item 9: `ls --types` promised that a load would rebuild a
    tree holding a lambda (it then failed), and a lambda as the whole tree was
    never named."""
    monkeypatch.chdir(tmp_path)
    eqx_ckpt.tree_serialise_leaves("net", _Activation(eqx.nn.Linear(2, 2, key=jax.random.key(0)), lambda x: x))
    lines = run("ls", "net", "--types", check_code=0).stdout.splitlines()
    assert lines[0] == "equinox.nn._linear.Linear  (trusted by default)  at linear"
    assert lines[1] == f"{__name__}._Activation  (needs trust)  at (the root)"
    assert lines[2] == "not recorded: act  (a lambda: the save could not record it as data)"
    with pytest.raises(eqx_ckpt.CheckpointValueError) as raised:
        eqx_ckpt.Checkpoint("net").load(trust=[_Activation])
    # What the listing says a load will say is what it says.
    assert lines[3] == (
        f"Checkpoint(path).load(trust=[{__name__}._Activation]) cannot rebuild it: it raises CheckpointValueError: "
        f"{raised.value}"
    )
    assert len(lines) == 4 and "rebuilds it" not in "\n".join(lines)
    eqx_ckpt.tree_serialise_leaves("bare", lambda x: x)
    lines = run("ls", "bare", "--types", check_code=0).stdout.splitlines()
    assert lines[0] == "not recorded: (the root)  (a lambda: the save could not record it as data)"
    with pytest.raises(eqx_ckpt.CheckpointValueError) as raised:
        eqx_ckpt.Checkpoint("bare").load(trust=[])
    assert lines[1:] == [
        f"Checkpoint(path).load(trust=[]) cannot rebuild it: it raises CheckpointValueError: {raised.value}"
    ]
    assert eqx_ckpt.Checkpoint("net").unrecordable() == {"act": "a lambda"}


def _run_dir(tmp_path):
    with eqx_ckpt.CheckpointManager(tmp_path / "run", max_to_keep=3) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": np.full(3, float(step)), "act": jax.nn.relu}, metrics={"loss": 1 / (step + 2)})
    return tmp_path / "run"


def test_info_diff_and_ls_types_of_a_manager_directory_say_what_it_is(tmp_path, monkeypatch):
    """Issue 59, item 11: `info` and `diff` of a manager's directory said there
    was no checkpoint ("a save that was interrupted"), and `ls --types` of one
    listed its steps, ignoring `--types`."""
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run("info", "run", check_code=0).stdout.splitlines() == [
        "run is a CheckpointManager directory of 3 steps (1, 2, 3), not one checkpoint.",
        "`eqx-ckpt info run/step_00000003` describes the latest; `eqx-ckpt ls run` lists them all.",
    ]
    done = run("diff", "run", "run/step_00000001", check_code=2)
    assert done.stdout == "" and done.stderr == (
        "eqx-ckpt diff: run is a CheckpointManager directory of 3 steps (1, 2, 3), not one checkpoint: `eqx-ckpt "
        "diff` compares two checkpoints, such as two of its steps: `eqx-ckpt diff run/step_00000002 "
        "run/step_00000003`.\n"
    )
    assert "interrupted" not in run("diff", "run/step_00000001", "run", check_code=2).stderr
    lines = run("ls", "run", "--types", check_code=0).stdout.splitlines()
    assert lines == [
        "run is a CheckpointManager directory of 3 steps (1, 2, 3); the latest, run/step_00000003:",
        "jax._src.nn.functions.relu  (trusted by default)  at act",
        "Checkpoint(path).load(trust=[]) rebuilds it: every class and function is trusted by default.",
    ]


def test_ls_of_a_manager_directory_rounds_metrics_and_names_paths_as_given(tmp_path, monkeypatch):
    """Issue 59, item 13: metrics printed with 16 digits, and the step to list
    by an absolute path when a relative one was given."""
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    lines = run("ls", "run", check_code=0).stdout.splitlines()
    assert [line.split()[-1] for line in lines[:3]] == ["loss=0.333333", "loss=0.25", "loss=0.2"]
    assert lines[3] == "3 steps in a CheckpointManager directory; `eqx-ckpt ls run/step_00000003` lists one"


def test_diff_prints_magnitudes_and_totals_bounded(tmp_path):
    """Issue 59, item 13: `diff` of two steps printed one line per leaf, with
    no totals and no magnitudes."""
    a = {f"k{i:02d}": np.full(4, 1.0, np.float32) for i in range(60)}
    b = {f"k{i:02d}": np.full(4, 1.0 + (i < 55) * 0.5, np.float32) for i in range(60)}
    a["w"], b["w"] = np.array([3.0, 4.0], np.float32), np.array([3.0, 4.5], np.float32)
    a["gone"], b["new"], b["k59"] = np.ones(2, np.float32), np.ones(2, np.float32), np.ones(3, np.float32)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", a)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", b)
    lines = run("diff", tmp_path / "a", tmp_path / "b", check_code=1).stdout.splitlines()
    assert lines[0] == "- gone"
    assert lines[1] == "! k00: values differ (max |a-b| 0.5, |a-b|/|a| 0.5)"
    assert len(lines) == 52 and lines[50] == "... and 9 more differences (`eqx_ckpt.diff` returns them all)"
    assert lines[51] == (
        "61 leaves in both: 4 equal, 56 with other values (888 B of 952 B compared), 1 of another shape, dtype or "
        "type; 1 added, 1 removed"
    )
    changes = eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")
    assert "! w: values differ (max |a-b| 0.5, |a-b|/|a| 0.1)" in changes.lines(magnitudes=True)
    assert changes.magnitudes["w"] == (0.5, 0.1)
    assert list(changes)[1] == "! k00: values differ"  # iterating stays as it was


def _ranked_run(path) -> None:
    """A manager's directory of 3 steps, the best (by `val_loss`) the second."""
    with eqx_ckpt.CheckpointManager(path, max_to_keep=3, best_n=1, best_metric="val_loss") as manager:
        for step, loss in [(1, 0.5), (2, 0.0576), (3, 0.25)]:
            manager.save(step, {"w": np.full(3, float(step))}, metrics={"val_loss": loss})


def test_push_of_a_manager_directory_names_its_steps_and_the_best(tmp_path, monkeypatch, capsys):
    """Issue 65 item 6: `eqx-ckpt push` of a manager's directory said there was
    no checkpoint. It names the steps to push: the latest, the best by the
    metric the run ranked steps by, or `--step N` / `--best`. (Before any
    Hub call: the hint needs no `huggingface_hub`.)"""
    _ranked_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["push", "run", "me/model"]) == 2
    assert capsys.readouterr().err == (
        "eqx-ckpt push: run is a CheckpointManager directory of 3 steps (1, 2, 3), not one checkpoint: push one of "
        "its steps, e.g. `eqx-ckpt push run/step_00000003 me/model` (the latest), `run/step_00000002` (the best: "
        "val_loss=0.0576), or pass `--step N` or `--best`.\n"
    )
    assert main(["push", "run", "me/model", "--step", "7"]) == 2
    assert "run is a CheckpointManager directory of 3 steps (1, 2, 3), and no step 7: pass one of them." in (
        capsys.readouterr().err
    )
    assert main(["push", "run", "me/model", "--step", "1", "--best"]) == 2  # one or the other
    # Without a metric that ranks them: the latest, or `--step N`.
    _run_dir(tmp_path / "plain")
    assert main(["push", "plain/run", "me/model"]) == 2
    err = capsys.readouterr().err
    assert "`eqx-ckpt push plain/run/step_00000003 me/model` (the latest), or pass `--step N`." in err
    assert main(["push", "plain/run", "me/model", "--best"]) == 2
    assert "`best_step()` needs to know which metric ranks steps" in capsys.readouterr().err


def _endless_demo(tmp_path: pathlib.Path, then: str) -> subprocess.Popen:
    """`eqx-ckpt demo` training for ever, started as its console script starts
    it (the program, by its name; Ctrl-C Python's), with the code `then` run
    once its imports are done, just before the command."""
    argv = [EXE, "demo", "--steps", "100000000", "--dir", str(tmp_path / "demo")]
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"sys.argv = {argv!r}\n"
        "from eqx_ckpt._tools._cli import main\n"
        f"{then}"
        "sys.exit(main())\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("after", [0.2, 3.0])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, after):
    """Issue 75: Ctrl-C printed a traceback. A real SIGINT to the program, `after`
    seconds past its imports: 0.2 lands while JAX compiles the first training
    step, 3.0 in the training. The child is the console script's own code, with
    a line once the imports are done. Issue 88: the program ends at once with
    130 after its own exit work; a normal interpreter exit crashed (SIGSEGV) in
    jaxlib's client teardown while an interrupted compile still ran."""
    process = _endless_demo(tmp_path, "print('ready', flush=True)\n")
    try:
        assert process.stdout.readline() == "ready\n"
        time.sleep(after)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
        process.communicate()
    assert (process.returncode, err) == (130, "eqx-ckpt demo: interrupted\n"), out


def test_ctrl_c_landing_in_a_garbage_collector_callback_still_ends_the_command(tmp_path):
    """Issue 88: a Ctrl-C whose interrupt was raised inside a garbage
    collector's callback (JAX keeps one) was printed as "Exception ignored"
    and lost: `eqx-ckpt demo` trained on. The signal here lands just there,
    every time: a callback sends SIGINT to its own process and runs on, so the
    handler raises inside it. The command still ends with its one line and 130."""
    process = _endless_demo(
        tmp_path,
        "import gc\n"
        "armed = [True]\n"
        "def interrupted_here(phase, info):\n"
        "    if armed and phase == 'start' and 'optax' in sys.modules:  # (in the command: its training)\n"
        "        armed.clear()\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "        for _ in range(10000): pass  # (the handler runs here, inside the callback)\n"
        "gc.callbacks.insert(0, interrupted_here)\n",
    )
    try:
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
        process.communicate()
    assert (process.returncode, err) == (130, "eqx-ckpt demo: interrupted\n"), out


def test_ls_types_suggests_a_private_modules_public_package(tmp_path, monkeypatch):
    """Issue 88.7e: an optax state's classes live in `optax._src`; `ls --types`
    suggests `trust=[optax]`, which works when followed as printed."""
    import optax

    monkeypatch.chdir(tmp_path)
    params = {"w": jnp.ones((2, 3))}
    state = {"params": params, "opt": optax.adam(1e-3).init(params)}
    eqx_ckpt.tree_serialise_leaves("run", state)
    lines = run("ls", "run", "--types", check_code=0).stdout.splitlines()
    assert any(line.startswith("optax._src.") and "(needs trust)" in line for line in lines), lines
    assert lines[-1] == "Checkpoint(path).load(trust=[optax]) rebuilds it (import them first)."
    rebuilt = eqx_ckpt.Checkpoint("run").load(trust=[optax])
    assert tree_equal(rebuilt, state, typematch=True)


def _python_start() -> float:
    """Seconds Python takes to start and end here, now: `eqx-ckpt`'s own code
    runs a few hundredths of a second later (after `import eqx_ckpt`, which
    imports no JAX)."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.monotonic() - began


@pytest.mark.parametrize("moment", [0.1, 0.5, 1.0, 2.0])
def test_ctrl_c_during_start_up_prints_one_line_and_exits_130(tmp_path, moment):
    """Issue 88, point 5: Ctrl-C in a command's first second or two (its
    imports of JAX) printed a traceback and exited -2, or blamed jaxlib's
    extension. A real SIGINT to the installed console script at several
    moments of its start-up (the first no earlier than its own code runs:
    Python's start-up is Python's); later, in its work, is the test above's."""
    start = _python_start()
    first = start + (max(0.1, 3 * start) if moment == 0.1 else moment)
    command = [EXE, "demo", "--steps", "100000000", "--dir", str(tmp_path / "demo")]
    # Ctrl-C's default, as in a terminal (a shell's background job inherits SIGINT ignored), set by a
    # small Python that then becomes the program: a `preexec_fn` would fork this JAX-holding process.
    trampoline = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", trampoline, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(first)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()  # (one the signal did not end would train on for hours)
        process.communicate()  # (its pipes closed here, not left to a later test's collector)
    assert process.returncode == 130, (out, err)
    assert "Traceback" not in err and re.fullmatch(r"eqx-ckpt( demo)?: interrupted\n", err), err


def test_export_of_a_manager_directory_takes_step_and_best_as_push_does(tmp_path, monkeypatch, capsys):
    """Issue 88, point 6: `eqx-ckpt export` of a manager's directory said there
    was no checkpoint, where `push`, `ls`, `info`, `diff` and `verify` know
    one. It takes `--step N` and `--best` as `push` does, and without either
    names the steps to export."""
    _ranked_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "run", "out"]) == 2
    assert capsys.readouterr().err == (
        "eqx-ckpt export: run is a CheckpointManager directory of 3 steps (1, 2, 3), not one checkpoint: export one "
        "of its steps, e.g. `eqx-ckpt export run/step_00000003 out` (the latest), `run/step_00000002` (the best: "
        "val_loss=0.0576), or pass `--step N` or `--best`.\n"
    )
    assert not (tmp_path / "out").exists()
    assert main(["export", "run", "best", "--best"]) == 0
    assert main(["export", "run", "first", "--step", "1"]) == 0
    assert np.asarray(eqx_ckpt.Checkpoint("best")["w"]).tolist() == [2.0] * 3
    assert np.asarray(eqx_ckpt.Checkpoint("first")["w"]).tolist() == [1.0] * 3
    assert eqx_ckpt.Checkpoint("best").info["metrics"] == {"val_loss": 0.0576}
    capsys.readouterr()
    assert main(["export", "run", "out", "--step", "7"]) == 2
    assert "run is a CheckpointManager directory of 3 steps (1, 2, 3), and no step 7: pass one of them." in (
        capsys.readouterr().err
    )
    assert main(["export", "run", "out", "--step", "1", "--best"]) == 2  # one or the other
