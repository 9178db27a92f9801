"""A fine-tune whose base is missing (issue 75, item 2): it still opens, and
`ls`, `info` and `verify` describe what it stores, marking the leaves taken
from the base and saying why the base cannot be reached; `verify` checks its
own leaves and says the others were not verified (not sound). A load of only
the leaves it stores (`prefix`, `where`, lazily too) reads them bit for bit
and never opens the base. A load that needs the base is the missing-base
error before anything is read, and `load_or_initialise` never takes it for a
fresh start. For each kind of local base, and for an `hf://` base whose
commit is gone from the local Hub server (`hub_server`)."""

from __future__ import annotations

import importlib.util
import re
import shutil

import jax
import numpy as np
import pytest
from families import (
    CHANGED,
    Classifier,
    _assert_same,
    _base_tree,
    _by_path,
    _finetuned,
    _like,
    _make_base,
    _model,
    _no_reads,
)

import eqx_ckpt
from eqx_ckpt._tools._cli import main

MISSING = "There is nothing at"


def _taken(tree) -> list[str]:
    return sorted(set(_by_path(tree)) - set(CHANGED))


def test_ls_and_info_describe_a_finetune_whose_base_is_missing(family, capsys):
    assert main(["ls", str(family.finetune)]) == 0
    present = capsys.readouterr().out
    assert "cannot be reached" not in present
    shutil.rmtree(family.base)
    ckpt = eqx_ckpt.Checkpoint(family.finetune)
    taken = _taken(family.tree)
    assert sorted(ckpt) == sorted(_by_path(family.tree))
    assert sorted(ckpt.from_base()) == taken and ckpt.base == str(family.base)
    assert ckpt.base_missing.startswith(MISSING) and str(family.base) in ckpt.base_missing
    assert main(["ls", str(family.finetune)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Every leaf as when the base is there, the taken ones marked; then why the base cannot be reached.
    assert lines[:-1] == present.splitlines()
    assert (
        lines[-1] == f"The base cannot be reached: {ckpt.base_missing} Only the 3 leaves stored here load without it."
    )
    assert sum(line.endswith("  base") for line in lines) == len(taken)
    # Values: those stored here, never one of the base's.
    assert main(["ls", "--values", str(family.finetune)]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"^step .* = 4$", listed, flags=re.M) and re.search(r"^lr .*  base$", listed, flags=re.M)
    assert main(["info", str(family.finetune)]) == 0
    out = capsys.readouterr().out
    assert f"base:            {family.base}\n" in out and f"{len(taken)} read from the base" in out
    assert f"base missing:    {ckpt.base_missing} Only the 3 leaves stored here load.\n" in out


def test_the_reason_keeps_a_base_path_that_holds_a_full_stop(tmp_path):
    """`base_missing` is the first sentence of the base's error, found after
    the path it quotes: a folder named "v1. final" is not cut at its ". "."""
    base, tree = tmp_path / "v1. final", _base_tree()
    _make_base("checkpoint", base, tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=base)
    shutil.rmtree(base)
    why = eqx_ckpt.Checkpoint(tmp_path / "ft").base_missing
    assert why == f"There is nothing at {str(base)!r}: no such folder (moved, renamed or deleted)."


def test_verify_checks_the_leaves_stored_and_says_the_others_were_not(family, capsys):
    shutil.rmtree(family.base)
    problems = eqx_ckpt.verify(family.finetune)
    taken = _taken(family.tree)
    assert [p.leaf for p in problems] == [None]
    said = problems[0].message
    assert said.startswith(f"the {len(taken)} leaves taken from its base (`{taken[0]}`, ")
    assert "were not verified, since the base cannot be found; the 3 stored here were." in said
    assert "which cannot be found" in said and "three ways work" in said
    assert problems.checked == (
        "every leaf stored here, against the digests eqx_ckpt.json records of it "
        "(blake3 per block of whole rows, up to 128 KiB)",
    )
    assert main(["verify", str(family.finetune)]) == 1
    out = capsys.readouterr().out
    assert "were not verified" in out and out.rstrip().endswith("1 problem(s)")
    # A changed byte of a leaf it stores is still found.
    file = sorted(family.finetune.glob("*.safetensors"))[-1]
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF  # (a byte of its last tensor)
    file.write_bytes(bytes(data))
    damaged = eqx_ckpt.verify(family.finetune)
    assert damaged[0].leaf is None and [p.leaf for p in damaged[1:]] in [[leaf] for leaf in CHANGED]
    assert "a changed byte" in damaged[1].message


def _head(tree):
    return lambda t: t["model"].head


def test_a_load_of_the_leaves_stored_needs_no_base(family, faults):
    """Bit for bit with the base deleted; then with a base changed since (whose
    open is an error), to show that the base is never opened."""
    tree, head = family.tree, family.tree["model"].head
    for gone in ("deleted", "changed"):
        if gone == "deleted":
            shutil.rmtree(family.base)
        else:
            _make_base(family.kind, family.base, {**family.base_tree, "ids": family.base_tree["ids"] + 1})
        like = _like(tree)
        loaded = eqx_ckpt.tree_deserialise_leaves(family.finetune, like, where=_head(tree))
        _assert_same(loaded["model"].head, head)
        assert jax.tree.leaves(loaded["model"].body) == jax.tree.leaves(like["model"].body)  # (left as `like`)
        _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(head), prefix="model.head"), head)
        lazy = eqx_ckpt.tree_deserialise_leaves(family.finetune, like, where=_head(tree), lazy=True)
        _assert_same(eqx_ckpt.materialise(lazy["model"].head), head)
        assert eqx_ckpt.tree_deserialise_leaves(family.finetune, {"step": 0}, where=lambda t: t["step"]) == {"step": 4}
        if gone == "deleted":
            ckpt = eqx_ckpt.Checkpoint(family.finetune)
            weight = np.asarray(head.weight)
            assert np.array_equal(ckpt.load(prefix="model.head.weight"), weight)
            assert np.array_equal(ckpt["model.head.weight"][:1], weight[:1])
            _assert_same(ckpt.load(prefix="model.head", trust=[Classifier]), head)
            with pytest.warns(UserWarning, match="without `trust` returns nested dicts"):
                lazily = ckpt.load(prefix="model.head", lazy=True)
            assert np.array_equal(eqx_ckpt.materialise(lazily)["weight"], weight)
    # A load that needs a leaf of the base fails before anything is read.
    reads = _no_reads(faults)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="that base has changed since"):
        eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(tree), where=lambda t: (t["model"].head, t["lr"]))
    assert reads == []


def test_load_or_initialise_never_takes_a_missing_base_for_a_fresh_start(family):
    shutil.rmtree(family.base)
    fresh = {**family.tree, "model": _model(9)}
    with pytest.raises(
        eqx_ckpt.CheckpointNotFoundError, match=re.escape(f"{str(family.base)!r}, which cannot be found")
    ):
        eqx_ckpt.load_or_initialise(family.finetune, lambda: fresh)
    # With `where` inside the leaves it stores: those loaded, the rest initialised.
    loaded = eqx_ckpt.load_or_initialise(family.finetune, lambda: fresh, where=_head(fresh))
    _assert_same(loaded["model"].head, family.tree["model"].head)
    _assert_same(loaded["model"].body, fresh["model"].body)


def test_an_export_that_needs_a_missing_base_writes_nothing(family, tmp_path):
    """A standalone copy needs every leaf: the missing-base error comes before
    the destination is made, as every refused export's does. A standalone
    export of the leaves stored here alone needs no base."""
    shutil.rmtree(family.base)
    out = tmp_path / "standalone"
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match="three ways work"):
        eqx_ckpt.export_safetensors(out, eqx_ckpt.Checkpoint(family.finetune), standalone=True)
    assert not out.exists()
    assert main(["export", "--standalone", str(family.finetune), str(out)]) == 2
    assert not out.exists()
    eqx_ckpt.export_safetensors(out, eqx_ckpt.Checkpoint(family.finetune), prefix="model.head", standalone=True)
    _assert_same(eqx_ckpt.Checkpoint(out).load(trust=[Classifier]), family.tree["model"].head)


# An `hf://` base whose commit is gone from the server, and not in the cache.

_HUB = importlib.util.find_spec("huggingface_hub") is not None

_STORED_LOADS = """
path = "hf://me/tuned"
head = eqx_ckpt.tree_deserialise_leaves(path, tuned["head"], prefix="head")
where = eqx_ckpt.tree_deserialise_leaves(path, tuned, where=lambda t: t["head"])
lazy = eqx_ckpt.materialise(eqx_ckpt.tree_deserialise_leaves(path, tuned, where=lambda t: t["head"], lazy=True))
emit([bool(eqx.tree_equal(got, want, typematch=True)) for got, want in
      ((head, tuned["head"]), (where["head"], tuned["head"]), (lazy["head"], tuned["head"]))])
"""


@pytest.mark.skipif(not _HUB, reason="needs the `hub` extra (huggingface_hub)")
def test_an_hf_finetune_whose_base_commit_is_gone_is_described_and_partly_loaded(tmp_path):
    import hub_server
    from hub_client import FAMILY, Client

    with hub_server.serving() as (url, state):
        client = Client(url, tmp_path / "hf")
        commit = str(client.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'me/base'))"))
        client.run(FAMILY + "emit(eqx_ckpt.push_to_hub(tuned, 'me/tuned', base='hf://me/base'))")
        client.run(FAMILY + "base['head'] = base['head'] + 1; emit(eqx_ckpt.push_to_hub(base, 'me/base'))")
        del state.repos["me/base"].commits[commit]
        client = Client(url, tmp_path / "fresh")  # (a cache that never held the base: the push read it)
        state.requests.clear()
        assert client.run(FAMILY + _STORED_LOADS) == [True] * 3
        assert not [r for r in state.requests if "me/base" in r], state.requests
        gone = f"hf://me/base@{commit}: the server no longer gives this commit"
        why = client.run("emit(eqx_ckpt.Checkpoint('hf://me/tuned').base_missing)")
        assert why.startswith(gone), why
        listed = client.cli("ls", "hf://me/tuned")
        assert listed.returncode == 0 and f"The base cannot be reached: {gone}" in listed.stdout, listed.stderr
        assert re.search(r"^  w +float32\[512,512\] .*  base$", listed.stdout, flags=re.M), listed.stdout
        assert re.search(r"^head +float32\[512,6\] +[0-9.]+ KiB$", listed.stdout, flags=re.M), listed.stdout
        verified = client.cli("verify", "hf://me/tuned")
        assert verified.returncode == 1 and "were not verified" in verified.stdout, verified.stderr
        name, _, message = client.run(
            FAMILY + "emit(raised(lambda: eqx_ckpt.tree_deserialise_leaves('hf://me/tuned', tuned)))"
        )
        assert name == "CheckpointNotFoundError" and f"its base hf://me/base@{commit}, which cannot be found" in message
        assert "three ways work" in message
