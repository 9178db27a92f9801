"""A commit the Hub's cache holds loads from the cache, online or not (issue
75, item 1): a fine-tune whose base's pinned commit is gone from the server
loads bit for bit, its base's files checked against their digests; a cache
lacking a file of that commit, or holding a damaged one, is an error saying
so. Against the local Hub server (`hub_server`), each load in a new process
(`test_hub.Client`). Small downloads show no progress bar of huggingface_hub."""

from __future__ import annotations

import importlib.util
import pathlib

import hub_server
import pytest
from hub_client import FAMILY, Client, push

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)

# Every way the fine-tune loads: whole, lazily, by `prefix` and by `where`,
# each compared bit for bit (`typematch`); then the base by its pinned commit.
_LOADS = (
    FAMILY
    + """
path = "hf://me/tuned"
whole = eqx_ckpt.Checkpoint(path).load(trust=[])
lazy = eqx_ckpt.materialise(eqx_ckpt.Checkpoint(path).load(lazy=True, trust=[]))
body = eqx_ckpt.tree_deserialise_leaves(path, tuned["body"], prefix="body")
where = eqx_ckpt.tree_deserialise_leaves(path, tuned, where=lambda t: t["body"]["w"])
pinned = eqx_ckpt.Checkpoint("hf://me/base@" + BASE).load(trust=[])
emit([bool(eqx.tree_equal(got, want, typematch=True)) for got, want in
      ((whole, tuned), (lazy, tuned), (body, tuned["body"]), (where, tuned), (pinned, base))])
"""
)


def _family(client: Client, state: hub_server.Hub) -> str:
    """Push the base and a fine-tune against it; load the fine-tune whole
    (filling the cache); push the base again (all in one process) and delete
    its first commit from the server. Returns that commit."""
    commit, loaded, again = client.run(
        FAMILY
        + """
commit = eqx_ckpt.push_to_hub(base, 'me/base')
eqx_ckpt.push_to_hub(tuned, 'me/tuned', base='hf://me/base')
loaded = bool(eqx.tree_equal(eqx_ckpt.Checkpoint('hf://me/tuned').load(), tuned))
base['head'] = base['head'] + 1
emit([commit, loaded, eqx_ckpt.push_to_hub(base, 'me/base')])
"""
    )
    assert loaded
    assert state.repos["me/base"].branches["main"] == again
    del state.repos["me/base"].commits[commit]
    assert state.repos["me/base"].branches["main"] != commit
    return commit


def _blob(home: pathlib.Path, repo: str, name: str) -> pathlib.Path:
    """The cache's blob of `name` in the (single) snapshot of `repo`."""
    (link,) = (home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").glob(f"*/{name}")
    return link.resolve()


def test_a_base_whose_commit_is_gone_loads_from_the_cache_online(hub_family):
    """The issue's day: the base's pinned commit gone from the server, every
    load of the fine-tune online reads the base from the cache, bit for bit,
    asking the server nothing about the base; so does the base by its commit."""
    client, state, commit = hub_family
    state.requests.clear()
    assert client.run(_LOADS.replace("BASE", repr(commit))) == [True] * 5
    assert not [r for r in state.requests if "me/base" in r], state.requests
    assert client.run(_LOADS.replace("BASE", repr(commit)), HF_HUB_OFFLINE="1") == [True] * 5


def test_a_cache_lacking_a_file_of_a_gone_commit_says_both(hub_family, tmp_path):
    """A file of the gone commit missing from the cache: the error says the
    server no longer gives the commit and names what the cache lacks, whole
    or by byte ranges (a lazy load); nothing is loaded. The fine-tune still
    opens, saying why its base cannot be reached (tests/sources/test_family_missing.py)."""
    client, _, commit = hub_family
    (link,) = (tmp_path / "hf" / "hub" / "models--me--base" / "snapshots").glob("*/model.safetensors")
    link.unlink()
    said = {}
    for load in ("eqx_ckpt.Checkpoint('hf://me/tuned').load()", "eqx_ckpt.Checkpoint('hf://me/tuned').load(lazy=True)"):
        name, classes, message = said[load] = client.run(f"emit(raised(lambda: {load}))")
        assert name == "CheckpointNotFoundError" and "FileNotFoundError" in classes, message
        assert f"its base hf://me/base@{commit}, which cannot be found" in message
        assert f"hf://me/base@{commit}: the server no longer gives this commit" in message, message
        assert "the local cache" in message and "so it cannot be loaded" in message
    whole = said["eqx_ckpt.Checkpoint('hf://me/tuned').load()"]  # (that load, in its own process above)
    assert "lacks `model.safetensors` of it" in whole[2]
    why = client.run("emit(eqx_ckpt.Checkpoint('hf://me/tuned').base_missing)")
    assert why.startswith(f"hf://me/base@{commit}: the server no longer gives this commit"), why


def test_a_damaged_cached_file_of_a_gone_commit_is_refused_by_its_digest(hub_family, tmp_path):
    """A cached file of the base changed on disk, its size kept: refused by the
    digest the cache recorded for it, naming the file; nothing is loaded."""
    client, _, commit = hub_family
    blob = _blob(tmp_path / "hf", "me/base", "model.safetensors")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    name, _, message = client.run("emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/tuned').load()))")
    assert name == "CorruptCheckpointError", message
    assert f"hf://me/base@{commit}: `model.safetensors` has the SHA-256" in message
    assert f"but the cache recorded {blob.name} at {commit}" in message and "hf cache rm" in message


def test_a_gone_commit_never_cached_is_named_as_gone(hub, tmp_path):
    """A commit the server no longer gives, and the cache never held: the
    error says so, not that the revision is misspelled."""
    client, state = hub
    commit, _ = client.run(  # (the two pushes in one process)
        FAMILY + "commit = eqx_ckpt.push_to_hub(base, 'me/base')\n"
        "base['head'] = base['head'] + 1; emit([commit, eqx_ckpt.push_to_hub(base, 'me/base')])"
    )
    del state.repos["me/base"].commits[commit]
    name, _, message = client.run(f"emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/base@{commit}')))")
    assert name == "CheckpointNotFoundError"
    assert message.startswith(f"hf://me/base@{commit}: the server no longer gives this commit")
    assert "does not hold the files a load of it reads" in message and "list_repo_refs('me/base')" in message


@pytest.fixture
def hub_family(hub):
    client, state = hub
    return client, state, _family(client, state)


def test_small_downloads_show_no_bar_of_huggingface_hub(hub, tmp_path):
    """`info`, `ls` and a load of small files show no bar of huggingface_hub's
    (issue 75: bars for sub-second reads); a download of `MIN_BYTES` does, as
    eqx_ckpt's own bars do. Its bars are forced on here (`TQDM_POSITION=-1`),
    as a terminal would show them."""
    client, _ = hub
    push(client, "me/repo", 1.0, tmp_path)
    code = """
        import contextlib, io
        from eqx_ckpt._base import _progress

        def shown(task):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                task()
            return err.getvalue()

        quiet = [shown(lambda: repr(eqx_ckpt.Checkpoint("hf://me/repo"))), shown(eqx_ckpt.Checkpoint("hf://me/repo").load)]
        _progress.MIN_BYTES = 1
        emit(quiet + [shown(lambda: eqx_ckpt.Checkpoint("hf://me/repo").load())])
    """
    info, load, large = client.run(code, HF_HUB_DISABLE_PROGRESS_BARS=None, TQDM_POSITION="-1")
    assert info == load == ""
    assert "Fetching" in large
    for command in ("ls", "info"):
        done = client.cli(command, "hf://me/repo", HF_HUB_DISABLE_PROGRESS_BARS=None, TQDM_POSITION="-1")
        assert done.returncode == 0 and "8" in done.stdout and done.stderr == ""
