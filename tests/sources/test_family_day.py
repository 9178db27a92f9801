"""A model family's day on the Hub, as issue 75 tells it, in one scenario.

Alice trains a base and pushes it. Bob loads it cold and pushes three
fine-tunes against it (`base=`): a new head, a full fine-tune, and a LoRA-style
wrapper. Carol loads them cold. Alice pushes the base again, and its first
commit is gone from the server. Carol (her cache warm) and Dave (cold) load
the fine-tunes; Bob stores the head again against the base as it is now.
Then Erin loads everything through a mirror that answers as olah does.

Every task must work at the first try and every load is bit for bit
(`typematch`). Each person is a new process with a cache of their own, against
the local Hub server (`hub_server`, through `hub_client.Client`); what JAX
compiles to make and compare the family is compiled once, not by every
process (`compiled`: its persistent compilation cache)."""

from __future__ import annotations

import importlib.util
import json

import hub_server
import pytest
from hub_client import Client

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)

# The family: an Equinox model (its dropout's two scalars are leaves), its
# head-only, full and LoRA-style fine-tunes, made the same way in every process.
FAMILY = """
import logging
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("eqx_ckpt").addHandler(handler)
logging.getLogger("eqx_ckpt").setLevel(logging.INFO)

def make(key, out=4):
    k1, k2 = jax.random.split(key)
    body, head = eqx.nn.Linear(256, 256, key=k1), eqx.nn.Linear(256, out, key=k2)
    return {"body": body, "drop": eqx.nn.Dropout(0.1), "head": head}

base = make(jax.random.key(0))
head = eqx.tree_at(lambda m: m["head"], base, make(jax.random.key(1), out=6)["head"])
full = jax.tree.map(lambda x: x + 0.5 if eqx.is_inexact_array(x) else x, base)
lora = {**base, "body": {"frozen": base["body"], "a": jnp.full((256, 8), 0.25), "b": jnp.zeros((8, 256))}}
TUNED = {"head": head, "full": full, "lora": lora}
same = lambda got, want: bool(eqx.tree_equal(got, want, typematch=True))
skeleton = lambda tree: eqx.filter_eval_shape(lambda: tree)
"""

_LOAD_ALL = """
emit({name: [same(eqx_ckpt.tree_deserialise_leaves("hf://bob/" + name, skeleton(want)), want),
             same(eqx_ckpt.materialise(eqx_ckpt.Checkpoint("hf://bob/" + name).load(lazy=True, trust=[])), want)]
      for name, want in TUNED.items()})
"""


def _files(state: hub_server.Hub, repo: str) -> set[str]:
    """The files of `repo` at the head of its main branch."""
    return set(state.repos[repo].commits[state.repos[repo].branches["main"]])


def _record(state: hub_server.Hub, repo: str) -> dict:
    """The `eqx_ckpt.json` of `repo` at the head of its main branch."""
    files = state.repos[repo].commits[state.repos[repo].branches["main"]]
    return json.loads(state.blobs[files["eqx_ckpt.json"]])


def test_a_family_day_works_at_the_first_try(hub, tmp_path, compiled):
    url, state = hub
    people = ("alice", "bob", "carol", "dave", "erin")
    alice, bob, carol, dave, erin = (Client(url, tmp_path / who, compiled=compiled) for who in people)

    first = alice.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'alice/base'))")

    # Bob: the base cold, then three fine-tunes against it, each saying what it stored and took.
    pushed = bob.run(
        FAMILY
        + """
got = eqx_ckpt.tree_deserialise_leaves("hf://alice/base", skeleton(base))
said.clear()
for name, tree in TUNED.items():
    eqx_ckpt.push_to_hub(tree, "bob/" + name, base="hf://alice/base")
emit([same(got, base), said])
"""
    )
    assert pushed[0] is True
    head_said, full_said, lora_said = pushed[1]
    assert head_said.startswith("hf://bob/head: stored 2 leaves, 6168 bytes (6.0 KiB); took 4 leaves")
    assert "standalone" in full_said, full_said  # a few bytes from the base are not worth depending on it
    assert lora_said.startswith("hf://bob/lora: stored 2 leaves") and "took 6 leaves" in lora_said, lora_said
    assert _record(state, "bob/head")["base"] == {"path": "hf://alice/base", "revision": first}
    assert _record(state, "bob/lora")["base"]["revision"] == first
    assert "base" not in _record(state, "bob/full")
    # No tool that does not know families takes a fine-tune for a whole model.
    for repo, kept, none in (
        ("bob/head", "finetune", "model"),
        ("bob/lora", "finetune", "model"),
        ("bob/full", "model", "finetune"),
    ):
        files = _files(state, repo)
        assert f"{kept}.safetensors" in files and f"{none}.safetensors" not in files, (repo, files)
    taken = {leaf["path"]: leaf["base"] for leaf in _record(state, "bob/lora")["leaves"] if "base" in leaf}
    frozen = {"body.frozen.weight": "body.weight", "body.frozen.bias": "body.bias"}  # the base's, re-wrapped
    assert taken == {**frozen, **{p: p for p in ("drop.p", "drop.inference", "head.weight", "head.bias")}}

    # Carol, cold: every fine-tune, whole and lazy; and the CLI.
    assert carol.run(FAMILY + _LOAD_ALL) == {name: [True, True] for name in ("head", "full", "lora")}
    listed = carol.cli("ls", "hf://bob/head")
    assert listed.returncode == 0 and "head/" in listed.stdout, listed.stderr

    # Alice pushes the base again (the same weights, a new card), and its first commit is gone.
    second = alice.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'alice/base', license='mit'))")

    assert second != first
    del state.repos["alice/base"].commits[first]

    # Carol's cache holds the first commit: every load as before, online.
    assert carol.run(FAMILY + _LOAD_ALL) == {name: [True, True] for name in ("head", "full", "lora")}

    # Dave, cold: the standalone fine-tune loads; the others say the three ways, and the first works.
    dave_day = dave.run(
        FAMILY
        + """
error = raised(lambda: eqx_ckpt.Checkpoint("hf://bob/head").load())
own = eqx_ckpt.tree_deserialise_leaves("hf://bob/head", skeleton(head["head"]), prefix="head")
missing = eqx_ckpt.Checkpoint("hf://bob/head").base_missing
with_base = eqx_ckpt.tree_deserialise_leaves("hf://bob/head", skeleton(head), base="hf://alice/base")
lora_with_base = eqx_ckpt.Checkpoint("hf://bob/lora", base="hf://alice/base").load(trust=[])
standalone = eqx_ckpt.tree_deserialise_leaves("hf://bob/full", skeleton(full))
emit([error, same(own, head["head"]), missing, same(standalone, full), same(with_base, head),
      same(lora_with_base, lora)])
"""
    )
    error, own, missing, full_loaded, with_base, lora_with_base = dave_day
    assert error[0] == "CheckpointNotFoundError" and "three ways work" in error[2], error
    assert missing and "no longer gives this commit" in missing, missing
    assert own and full_loaded and with_base and lora_with_base
    # What the fine-tune stores is described, and verified, without its base.
    listed, info = dave.cli("ls", "hf://bob/head"), dave.cli("info", "hf://bob/head")
    assert listed.returncode == 0 and "head/" in listed.stdout and "The base cannot be reached" in listed.stdout
    assert info.returncode == 0 and "base missing:" in info.stdout, info
    verified = dave.cli("verify", "hf://bob/head")
    assert verified.returncode == 1 and "not verified" in verified.stdout + verified.stderr, verified

    # Bob stores the head again against the base as it is now; Dave loads it plainly.
    bob.run(FAMILY + "emit(eqx_ckpt.push_to_hub(head, 'bob/head', base='hf://alice/base'))")
    assert _record(state, "bob/head")["base"]["revision"] == second
    assert dave.run(FAMILY + "emit(same(eqx_ckpt.Checkpoint('hf://bob/head').load(trust=[]), head))")

    # Erin, cold, through a mirror (no file metadata, `Range` ignored, 401 for a missing revision).
    bob.run(FAMILY + "emit(eqx_ckpt.push_to_hub(lora, 'bob/lora', base='hf://alice/base'))")
    state.mirror = True
    assert erin.run(FAMILY + _LOAD_ALL) == {name: [True, True] for name in ("head", "full", "lora")}


@pytest.fixture
def hub():
    with hub_server.serving() as served:
        yield served
