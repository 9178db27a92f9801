"""What a model family's user is told is true and can be followed (issue 88,
points 1-4), tried as a new user would: a base on the Hub, a fine-tune of it,
the base pushed again with other values and its first commit deleted, a
local base moved away, and folders received whose record names a base a load
does not follow.

- `verify --with-base` says it read the base given and compared its leaves
  with the digests (not the pin); a base of other values is one problem.
- Every way the missing-base error names works when run as printed, only
  its placeholders (`BASE`, `OUT`, `OWNER/NAME`) filled in.
- A fine-tune whose recorded base is not followed is listed, described,
  verified (not sound) and partly loaded, as one whose base is missing.
- A push with `base=` returns what it stored and took (`report`)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex
import shutil
from typing import Any

import pytest
from families import Classifier, _assert_same, _base_tree, _finetuned, _like, _make_base

import eqx_ckpt
from eqx_ckpt._tools._cli import main

_HUB = importlib.util.find_spec("huggingface_hub") is not None


def _ways(message: str) -> list[str]:
    """The commands a message prints, in backticks, in order."""
    return re.findall(r"`(eqx-ckpt [^`]+)`", message)


def _filled(command: str, **places: str) -> list[str]:
    """`command`'s arguments after `eqx-ckpt`, its placeholders (and nothing else) replaced."""
    return [places.get(word, word) for word in shlex.split(command)[1:]]


# A local base moved away.


@pytest.mark.parametrize("kind", ["published", "checkpoint"])
def test_every_way_a_missing_local_base_names_works_as_printed(kind, tmp_path, capsys):
    tree = _base_tree()
    base, tuned = tmp_path / "base", _finetuned(tree)
    _make_base(kind, base, tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", tuned, base=base)
    copy = tmp_path / "shelf" / "copy"
    shutil.move(base, copy)
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError) as caught:
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tuned))
    message = str(caught.value)
    # What is missing is the folder, not a file of it.
    assert f"There is nothing at {str(base)!r}: no such folder (moved, renamed or deleted)." in message
    assert "manifest.json" not in message and "three ways work" in message
    assert eqx_ckpt.Checkpoint(tmp_path / "ft").base_missing == (
        f"There is nothing at {str(base)!r}: no such folder (moved, renamed or deleted)."
    )
    listed, export = _ways(message)
    # 1. The copy given.
    assert main(_filled(listed, BASE=str(copy))) == 0
    assert "base" in capsys.readouterr().out
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tuned), base=str(copy)), tuned)
    # 3. A copy that needs no base.
    out = tmp_path / "whole"
    assert main(_filled(export, BASE=str(copy), OUT=str(out))) == 0
    _assert_same(eqx_ckpt.Checkpoint(out).load(trust=[Classifier]), tuned)
    # 2. The copy put back where the record names the base.
    assert f"2. Put the copy back at {str(base)!r}" in message
    shutil.move(copy, base)
    _assert_same(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(tuned)), tuned)


# A recorded base a load does not follow.


def _recorded_base(folder: pathlib.Path, path: str) -> None:
    record = json.loads((folder / "eqx_ckpt.json").read_text())
    record["base"]["path"] = path
    (folder / "eqx_ckpt.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("recorded", "why"),
    [
        ("~/models/base", "it starts with `~` (a home folder)"),
        ("/models/base", "it is an absolute path"),
        ("s3://bucket/base/", "it is a URL"),
    ],
)
def test_a_finetune_whose_recorded_base_is_not_followed_shows_what_it_holds(recorded, why, tmp_path, capsys):
    tree = _base_tree()
    tuned = _finetuned(tree)
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    received = tmp_path / "received"
    eqx_ckpt.export_safetensors(received, tuned, base=tmp_path / "base")
    _recorded_base(received, recorded)
    shutil.rmtree(tmp_path / "base")
    said = f"its record names it as `{recorded}`, which a load does not follow on its own: {why}"
    ckpt = eqx_ckpt.Checkpoint(received)
    assert ckpt.base == recorded and ckpt.base_missing.startswith(said)
    assert "absolute" not in ckpt.base_missing or recorded.startswith("/")
    assert main(["ls", str(received)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^    weight +float32\[2,4\] .*  base$", out, flags=re.M) is None  # (the head is stored)
    assert f"The base cannot be reached: {said}" in out and "Only the 3 leaves stored here load without it." in out
    assert main(["info", str(received)]) == 0
    assert f"base missing:    {said}" in capsys.readouterr().out
    problems = eqx_ckpt.verify(received)
    assert [p.leaf for p in problems] == [None] and "not verified, since the base is not followed" in str(problems[0])
    assert main(["verify", str(received)]) == 1
    # The leaves it stores load bit for bit; one of the base's is the refusal, naming `base=`.
    head = eqx_ckpt.tree_deserialise_leaves(received, _like(tuned["model"].head), prefix="model.head")
    _assert_same(head, tuned["model"].head)
    with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape(why)):
        eqx_ckpt.tree_deserialise_leaves(received, _like(tuned))


# On the Hub.

FAMILY = """
body = {"w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512), "b": np.ones(512, np.float32)}
base = {"body": body, "head": np.zeros((512, 4), np.float32)}
tuned = {"body": body, "head": np.full((512, 6), 0.5, np.float32)}
"""


def _base() -> dict[str, Any]:
    """`FAMILY`'s base."""
    import numpy as np

    made: dict[str, Any] = {"np": np}
    exec(FAMILY, made)
    return made["base"]


@pytest.mark.skipif(not _HUB, reason="needs the `hub` extra (huggingface_hub)")
def test_a_family_on_the_hub_is_told_the_truth_and_each_way_works(tmp_path):
    import hub_server
    from hub_client import Client

    base = _base()
    old, wrong = tmp_path / "old-base", tmp_path / "wrong-base"
    eqx_ckpt.export_safetensors(old, base)  # a copy of the base kept on disk
    eqx_ckpt.export_safetensors(wrong, {**base, "body": {**base["body"], "w": base["body"]["w"] + 1}})
    with hub_server.serving() as (url, state):
        alice, bob, dave = (Client(url, tmp_path / who) for who in ("alice", "bob", "dave"))
        first = alice.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'alice/base'))")
        # 4. Bob's push says what it stored and took, logging or not.
        pushed = bob.run(
            FAMILY
            + """
commit = eqx_ckpt.push_to_hub(tuned, "bob/tuned", base="hf://alice/base")
plain = eqx_ckpt.push_to_hub(base, "bob/plain")
emit([commit, commit.report, commit.changed, isinstance(commit, str), len(commit), plain.report])
"""
        )
        assert re.fullmatch("[0-9a-f]{40}", pushed[0]) and pushed[2:5] == [True, True, 40] and pushed[5] is None
        assert pushed[1].startswith("stored 1 leaf, 12288 bytes (12.0 KiB); took 2 leaves"), pushed
        # Alice pushes the base again, other values in a leaf the fine-tune takes, and the first commit goes.
        alice.run(
            FAMILY + "base['body'] = {**body, 'b': body['b'] * 2}; emit(eqx_ckpt.push_to_hub(base, 'alice/base'))"
        )
        del state.repos["alice/base"].commits[first]

        # Dave, cold: the error, and each of its ways run as printed.
        name, _, message = dave.run(
            FAMILY + "emit(raised(lambda: eqx_ckpt.tree_deserialise_leaves('hf://bob/tuned', tuned)))"
        )
        assert name == "CheckpointNotFoundError" and "three ways work" in message, message
        assert "Load a revision" not in message  # (the base's own advice loads no fine-tune)
        listed, push, export = _ways(message)
        places = {"BASE": str(old), "OUT": str(tmp_path / "whole"), "OWNER/NAME": "dave/tuned"}
        done = dave.cli(*_filled(listed, **places))
        assert done.returncode == 0 and "base" in done.stdout, done.stderr
        done = dave.cli(*_filled(push, **places))
        assert done.returncode == 0, done.stderr
        assert "stored 2 leaves" in done.stderr, done.stderr  # the head, and the leaf the base no longer holds
        done = dave.cli(*_filled(export, **places))
        assert done.returncode == 0, done.stderr
        loads = dave.run(
            FAMILY
            + f"""
same = lambda got: bool(eqx.tree_equal(got, tuned, typematch=True))
emit([same(eqx_ckpt.tree_deserialise_leaves("hf://dave/tuned", tuned)),
      same(eqx_ckpt.tree_deserialise_leaves({str(tmp_path / "whole")!r}, tuned)),
      same(eqx_ckpt.tree_deserialise_leaves("hf://bob/tuned", tuned, base={str(old)!r}))])
"""
        )
        assert loads == [True, True, True]

        # 1. `verify --with-base` says what it read and compared, for a right base and a wrong one.
        done = dave.cli("verify", "hf://bob/tuned", "--with-base", str(old))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "at the version pinned" not in done.stdout
        assert (
            f"checked: the 2 leaves taken from its base, read from the base given, {str(old)!r}, against the digests "
            f"eqx_ckpt.json records of them (a base given is held to them; the base its record pins, "
            f"hf://alice/base@{first}, was not read)\n"
        ) in done.stdout
        done = dave.cli("verify", "hf://bob/tuned", "--with-base", str(wrong))
        assert done.returncode == 1 and done.stdout.rstrip().endswith(": 1 problem(s)"), done.stdout
        assert (
            f"the base given, {str(wrong)!r}, holds other values than when the fine-tune was exported: 1 of the 2 "
            f"leaves taken from it (`body.w`) holds other bytes"
        ) in done.stdout
        assert "a changed byte" not in done.stdout and "at the version pinned" not in done.stdout
