"""Loads through a mirror that answers less than the Hub (issue 75, item 6):
the local Hub server answering as olah 0.5.4 does (`hub_server.Hub.mirror`: a
model info without file sizes or digests, byte ranges answered with the
whole file, a missing revision answered 401). Every load, whole, partial,
lazy, a fine-tune with its base and a second one offline, is bit for bit
through it as through the Hub; ranges ignored are said in one line per
repository. Each load runs in a new process (`test_hub.Client`)."""

from __future__ import annotations

import importlib.util

import pytest
from hub_client import FAMILY, Client

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)

# Partial and lazy loads first (a cache that holds nothing yet: byte ranges),
# then whole ones; each compared bit for bit, with the lines logged.
_LOADS = (
    FAMILY
    + """
import logging
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("eqx_ckpt").addHandler(handler)
same = lambda got, want: bool(eqx.tree_equal(got, want, typematch=True))
body = eqx_ckpt.tree_deserialise_leaves("hf://me/tuned", tuned["body"], prefix="body")
where = eqx_ckpt.tree_deserialise_leaves("hf://me/tuned@main", tuned, where=lambda t: t["head"])
rows = eqx_ckpt.Checkpoint("hf://me/base")["body.w"][3:5]
lazy = eqx_ckpt.materialise(eqx_ckpt.Checkpoint("hf://me/tuned").load(lazy=True, trust=[]))
whole = eqx_ckpt.Checkpoint("hf://me/tuned").load(trust=[])
emit([[same(body, tuned["body"]), same(where, tuned), same(np.asarray(rows), base["body"]["w"][3:5]),
       same(lazy, tuned), same(whole, tuned), same(eqx_ckpt.Checkpoint("hf://me/base").load(), base)], said])
"""
)


@pytest.mark.parametrize("mirror", [False, True], ids=["hub", "mirror"])
def test_every_load_through_a_mirror_is_bit_for_bit(hub, tmp_path, mirror):
    client, state = hub
    client.run(  # (the two pushes in one process)
        FAMILY + "eqx_ckpt.push_to_hub(base, 'me/base')\n"
        "emit(eqx_ckpt.push_to_hub(tuned, 'me/tuned', base='hf://me/base'))"
    )
    state.mirror = mirror
    fresh = Client(client.url, tmp_path / "fresh")
    loaded, said = fresh.run(_LOADS)
    assert loaded == [True] * 6
    if mirror:  # one line per repository read, saying why, then whole files
        assert len(said) == 2, said
        assert all("answers a byte range of" in line and "it ignores `Range`" in line for line in said)
        assert sorted(line.split("`Range`. ")[1][:13] for line in said) == ["hf://me/base@", "hf://me/tuned"], said
    else:
        assert said == []
    offline = FAMILY + "emit(bool(eqx.tree_equal(eqx_ckpt.Checkpoint('hf://me/tuned').load(), tuned, typematch=True)))"
    assert fresh.run(offline, HF_HUB_OFFLINE="1") is True


@pytest.mark.parametrize("mirror", [False, True], ids=["hub", "mirror"])
def test_a_missing_revision_is_never_called_a_missing_repository(hub, mirror):
    """A mirror answers a revision it lacks with 401: the repository answers,
    so it is a missing (or unauthorised) revision, not a missing repository."""
    client, state = hub
    state.put_files("me/there", {"README.md": b"a card"})
    state.mirror = mirror
    name, _, message = client.run("emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/there@v9')))")
    assert name == "CheckpointNotFoundError"
    said = (
        "the server answered HTTP 401 for the revision 'v9' of a repository it holds" if mirror else "has no revision"
    )
    assert message.startswith("hf://me/there@v9: ") and said in message and "list_repo_refs('me/there')" in message
    name, _, message = client.run("emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/absent@v9')))")
    assert name == "CheckpointNotFoundError" and "there is no such repository" in message
