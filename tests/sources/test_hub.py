"""Publishing to and loading from the Hugging Face Hub (`push_to_hub`, `hf://`
paths), against a local server answering the Hub's HTTP API (`hub_server`).

Every Hub call runs in a new process whose `HF_ENDPOINT` points at the
server (huggingface_hub reads it, `HF_HOME` and `HF_HUB_DISABLE_XET` at import),
with a cache of its own per test. Each is forked from a template process that
imported JAX and the other libraries once (`prefork`), and is otherwise as new
as one `python -c` starts."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import threading

import equinox as eqx
import hub_server
import jax
import jax.numpy as jnp
import numpy as np
import places
import pytest
from arrays import tree_equal
from hub_client import FAMILY, Client, push, tree

import eqx_ckpt
from eqx_ckpt._ondisk._published import VERSION

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)
_LOAD = """
like = eqx_ckpt.Checkpoint({local!r}).load()
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
got = eqx_ckpt.tree_deserialise_leaves({path!r}, like)
emit(jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), got))
"""

# `load(path)`: `_LOAD`'s load, a function (for several loads in one process).
_LOADER = """
like = eqx_ckpt.Checkpoint({local!r}).load()
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
def load(path):
    got = eqx_ckpt.tree_deserialise_leaves(path, like)
    return jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), got)
"""


def _as_lists(tree: dict) -> object:
    return jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), tree)


def test_publish_then_load_by_name_in_a_fresh_process(hub, tmp_path):
    """Published by one process, loaded by another by name: the same values,
    the commit `push_to_hub` returned is the one `Checkpoint.revision` names."""
    client, state = hub
    commit = push(client, "me/model", 1.0, tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert state.repos["me/model"].branches["main"] == commit
    # The load and the open in one more process.
    got, opened = client.run(
        _LOADER.format(local=str(tmp_path / "local-1.0"))
        + "c = eqx_ckpt.Checkpoint('hf://me/model@main')\n"
        + "emit([load('hf://me/model'), [c.revision, c.path, sorted(c)]])"
    )
    assert got == _as_lists(tree(1.0))
    assert opened == [commit, f"hf://me/model@{commit}", sorted(eqx_ckpt.Checkpoint(tmp_path / "local-1.0"))]


def test_publish_then_load_with_trust_never_runs_the_constructor(hub, tmp_path):
    """A Module published by one process is rebuilt by another from the repo's
    `eqx_ckpt.json` with `load(trust=[...])`: its constructor never runs (it
    raises there), and the result equals the original, types included."""
    client, _ = hub
    (tmp_path / "mine.py").write_text(
        textwrap.dedent("""
        import equinox as eqx, jax, jax.numpy as jnp
        class Head(eqx.Module):
            proj: eqx.nn.Linear
            scale: jax.Array
            act: str = eqx.field(static=True)
            def __init__(self):
                self.proj, self.scale, self.act = eqx.nn.Linear(8, 2, key=jax.random.key(1)), jnp.full(2, 0.5), "gelu"
    """)
    )
    commit = client.run("""
        sys.path.insert(0, ".")
        import mine as layers
        model = {"net": layers.Head(), "mlp": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "step": 7}
        eqx_ckpt.tree_serialise_leaves("original", model)
        emit(eqx_ckpt.push_to_hub(model, "me/trusted", metadata={"description": "a test", "lr": 0.1}))
    """)
    same = client.run(f"""
        sys.path.insert(0, ".")
        import mine as layers
        def refuse(*args, **kwargs):
            raise AssertionError("the constructor ran")
        layers.Head.__init__ = refuse
        eqx.nn.MLP.__init__ = refuse
        trust = [layers.Head]
        ckpt = eqx_ckpt.Checkpoint("hf://me/trusted")
        loaded = ckpt.load(trust=trust)
        original = eqx_ckpt.Checkpoint("original").load(trust=trust)
        emit([bool(eqx.tree_equal(loaded, original, typematch=True)), type(loaded["net"]).__name__,
              ckpt.revision == {commit!r}, ckpt.info, raised(layers.Head)[2],
              raised(lambda: eqx.nn.MLP(1, 1, 1, 1))[2]])
    """)
    ran = "the constructor ran"  # as calling them shows
    assert same == [True, "Head", True, {"description": "a test", "lr": 0.1}, ran, ran]


def test_load_equals_the_original_with_typematch(hub, tmp_path):
    """`eqx.tree_equal(..., typematch=True)` of the loaded tree and the original, in the process that loads."""
    client, _ = hub
    local = str(tmp_path / "local-1.0")
    eqx_ckpt.tree_serialise_leaves(local, tree(1.0))
    same = client.run(f"""
        eqx_ckpt.push_to_hub({local!r}, "me/typed")  # (the push in the same process)
        original = eqx_ckpt.Checkpoint({local!r}).load()
        like = eqx.filter_eval_shape(lambda: original)
        got = eqx_ckpt.tree_deserialise_leaves("hf://me/typed", like)
        emit(bool(eqx.tree_equal(got, original, typematch=True)))
    """)
    assert same is True


def test_publish_twice_then_load_the_first_revision(hub, tmp_path):
    """A commit pins what loads: the first push's values at its commit, the
    second's at `main`; and a repository opened at `main` keeps reading the
    commit it was opened at while another push lands."""
    client, _ = hub
    local = {scale: str(tmp_path / f"local-{scale}") for scale in (1.0, 2.0)}
    for scale, path in local.items():
        eqx_ckpt.tree_serialise_leaves(path, tree(scale))
    # The two pushes in one process; the two loads in one more.
    first, second = client.run(f"""
        first = eqx_ckpt.push_to_hub({local[1.0]!r}, "me/twice")
        emit([first, eqx_ckpt.push_to_hub({local[2.0]!r}, "me/twice")])
    """)
    assert first != second
    at_first, at_main = client.run(
        _LOADER.format(local=local[1.0]) + f"emit([load('hf://me/twice@{first}'), load('hf://me/twice@main')])"
    )
    assert at_first == _as_lists(tree(1.0)), "the first push's commit"
    assert at_main == _as_lists(tree(2.0)), "main, after the second push"
    # Opened at `main` (second), then a third push: the open checkpoint still reads the second.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "local-3.0", tree(3.0))
    got = client.run(f"""
        ckpt = eqx_ckpt.Checkpoint("hf://me/twice@main")
        third = eqx_ckpt.push_to_hub({str(tmp_path / "local-3.0")!r}, "me/twice")
        emit([ckpt.revision, third != ckpt.revision, np.asarray(ckpt["head"], np.float32).tolist()])
    """)
    assert got[:2] == [second, True]
    assert got[2] == np.asarray(tree(2.0)["head"], np.float32).tolist()


def test_a_partial_load_downloads_only_the_selected_tensors(hub, tmp_path):
    """`prefix=` reads the headers and the selected tensors' bytes by ranges: the
    bytes the server sent are at most 1.1x those, and nothing is cached whole."""
    client, state = hub
    push(client, "me/partial", 1.0, tmp_path)
    before = state.sent.get("", 0)
    got = client.run("""
        ckpt_like = {"w": jax.ShapeDtypeStruct((128, 64), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.int32)}
        got = eqx_ckpt.tree_deserialise_leaves("hf://me/partial", ckpt_like, prefix="blocks.1")
        emit([np.asarray(got["w"]).tolist(), np.asarray(got["b"]).tolist()])
    """)
    assert got == [np.full((128, 64), 2.0).tolist(), list(range(64))]
    sent = state.sent[""] - before
    (blob,) = [data for data in state.blobs.values() if data[:8] and len(data) > 50_000]
    header = 8 + int.from_bytes(blob[:8], "little") + 2  # the length, the header, the probe past the last tensor
    selected = 128 * 64 * 4 + 64 * 4
    assert sent <= 1.1 * (selected + header), (sent, selected, header, len(blob))
    assert len(blob) > 3 * (selected + header)  # a whole download would have been far more
    cached = list((tmp_path / "hf").rglob("*.safetensors"))
    assert cached == []


def test_a_second_load_needs_no_network(tmp_path):
    """Loaded whole once, a repository loads again from the Hub's cache with the
    server stopped, and with `HF_HUB_OFFLINE=1`; a lazy load too."""
    with hub_server.serving() as (url, _):
        client = Client(url, tmp_path / "hf")
        commit = push(client, "me/cached", 1.0, tmp_path)
        load = _LOAD.format(local=str(tmp_path / "local-1.0"), path="hf://me/cached")
        assert client.run(load) == _as_lists(tree(1.0))
    # The port is closed now: nothing answers.
    assert client.run(load) == _as_lists(tree(1.0))
    assert client.run(load, HF_HUB_OFFLINE="1") == _as_lists(tree(1.0))
    lazy = client.run(
        "c = eqx_ckpt.Checkpoint('hf://me/cached@main'); emit([c.revision, np.asarray(c['blocks.2.w']).tolist()])"
    )
    assert lazy == [commit, np.full((128, 64), 3.0).tolist()]


def _raised(client: Client, path: str, **env: str | None) -> list:
    got = client.run(f"emit(raised(lambda: eqx_ckpt.Checkpoint({path!r})))", **env)
    assert got is not None
    return got


def test_a_missing_repo_or_revision_is_named(hub, tmp_path):
    client, _ = hub
    push(client, "me/there", 1.0, tmp_path)
    absent, no_revision = client.run(
        "emit([raised(lambda: eqx_ckpt.Checkpoint('hf://me/absent')),"
        " raised(lambda: eqx_ckpt.Checkpoint('hf://me/there@v9'))])"  # (both in one process)
    )
    name, mro, message = absent
    assert name == "CheckpointNotFoundError" and "FileNotFoundError" in mro, absent
    assert message.startswith("hf://me/absent@main: there is no such repository")
    name, _, message = no_revision
    assert name == "CheckpointNotFoundError", no_revision
    assert message.startswith(re.escape("hf://me/there@v9: the repository has no revision 'v9'").replace("\\", ""))


def test_private_and_gated_repos_need_a_token_with_access(hub, tmp_path):
    client, state = hub
    files = {"model.safetensors": _safetensors_bytes(tmp_path)}
    state.put_files("team/private", files, private=True, readers={"reader"})
    state.put_files("team/gated", files, gated=True, readers={"reader"})
    # A process for each token; the stranger's two reads in one, the reader's two in one.
    private = "raised(lambda: eqx_ckpt.Checkpoint('hf://team/private'))"
    gated = "raised(lambda: eqx_ckpt.Checkpoint('hf://team/gated'))"
    refused = {
        None: client.run(f"emit([{private}, None])", HF_TOKEN=None),
        "stranger": client.run(f"emit([{private}, {gated}])", HF_TOKEN="stranger"),
    }
    for token, (private_said, _) in refused.items():
        name, _, message = private_said
        said = "none was given" if token is None else "one was given"
        assert name == "CheckpointNotFoundError", token
        assert message.startswith(
            f"hf://team/private@main: there is no such repository, or it is private and the token ({said}) "
            "has no access"
        ), token
    name, mro, message = refused["stranger"][1]
    assert name == "CheckpointStorageError" and "OSError" in mro
    assert message.startswith("hf://team/gated@main: the repository is gated")
    private, gated = client.run(
        "emit([sorted(eqx_ckpt.Checkpoint('hf://team/private')), sorted(eqx_ckpt.Checkpoint('hf://team/gated'))])",
        HF_TOKEN="reader",
    )
    assert private == ["w"], "the private repository, read with access"
    assert gated == ["w"], "the gated repository, read with access"


def test_no_network_says_so_with_the_cache_hint(tmp_path):
    with hub_server.serving() as (url, _):
        client = Client(url, tmp_path / "hf")
    name, mro, message = _raised(client, "hf://me/never-fetched")
    assert name == "CheckpointConnectionError" and "ConnectionError" in mro
    assert "the Hub cannot be reached, and the local cache" in message and "HF_HUB_OFFLINE=1" in message
    name, _, message = _raised(client, "hf://me/never-fetched", HF_HUB_OFFLINE="1")
    assert name == "CheckpointConnectionError"
    assert message.startswith("hf://me/never-fetched@main: offline mode is on (`HF_HUB_OFFLINE=1`)")


def test_server_errors_are_retried_then_named(hub, tmp_path):
    """A download that fails twice with 503 is retried by huggingface_hub and
    loads; so does a revision asked while the Hub answers 503 twice (eqx_ckpt
    asks again); a model info answered 429 or 500 every time is named with its
    status. (eqx_ckpt's wait between its tries, `_hub.RETRY_SECONDS`, is a
    hundredth of a second here: the tries are the same.)"""
    client, state = hub
    push(client, "me/flaky", 1.0, tmp_path)
    quick = "import eqx_ckpt._sources._hub\neqx_ckpt._sources._hub.RETRY_SECONDS = 0.01\n"
    state.fail(r"^(HEAD|GET) /me/flaky/resolve/", 503, times=2)
    got = client.run(quick + _LOAD.format(local=str(tmp_path / "local-1.0"), path="hf://me/flaky"))
    assert got == _as_lists(tree(1.0))
    assert sum(1 for r in state.requests if re.match(r"(HEAD|GET) /me/flaky/resolve/", r)) >= 3
    state.fail(r"^GET /api/models/me/flaky", 503, times=2)
    got = client.run(quick + _LOAD.format(local=str(tmp_path / "local-1.0"), path="hf://me/flaky"))
    assert got == _as_lists(tree(1.0))
    for status, said in ((429, "rate limited (HTTP 429)"), (500, "failed (HTTP 500)")):
        # (huggingface_hub resolves a branch from its cache while the Hub answers 5xx;
        # the files' listing is then asked for, and fails, by commit.)
        state.failures.clear()
        state.fail(r"^GET /api/models/me/flaky", status, times=6)
        name, _, message = client.run(quick + "emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/flaky')))")
        assert name == "CheckpointStorageError"
        assert message.startswith(f"hf://me/flaky@main: the Hub {said}")


def _safetensors_bytes(tmp_path: pathlib.Path, tensors: dict | None = None) -> bytes:
    folder = tmp_path / f"st-{len(list(tmp_path.iterdir()))}"
    eqx_ckpt.export_safetensors(folder, tensors or {"w": jnp.arange(6, dtype=jnp.float32)})
    return (folder / "model.safetensors").read_bytes()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_many_small_shards_open_in_one_request_each_and_load_the_same(hub, tmp_path):
    """A small shard whose size the Hub lists is read whole when the folder is
    opened (its length, header and end in one request, not three), and its
    tensors load as the safetensors library reads them."""
    from safetensors.numpy import save_file

    client, state = hub
    folder = tmp_path / "shards"
    folder.mkdir()
    weight_map = {}
    for i in range(40):
        name = f"model-{i + 1:05d}-of-00040.safetensors"
        save_file({f"layers.{i}.weight": np.full((2, 3), i, np.float32)}, folder / name)
        weight_map[f"layers.{i}.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    state.put_files("org/shards", {p.name: p.read_bytes() for p in folder.iterdir()})
    before = len(state.requests)
    keys = client.run("emit(sorted(eqx_ckpt.Checkpoint('hf://org/shards').keys()))")
    opened = [r for r in state.requests[before:] if "/resolve/" in r and "-of-" in r]
    assert keys == sorted(weight_map) and len(opened) == 40, opened
    got = client.run(
        "emit(jax.tree.map(lambda x: np.asarray(x).tolist(), eqx_ckpt.Checkpoint('hf://org/shards').load()))"
    )
    assert got == jax.tree.map(lambda x: np.asarray(x).tolist(), eqx_ckpt.Checkpoint(folder).load())


def test_a_repo_with_no_model_says_what_it_holds(hub, tmp_path):
    client, state = hub
    state.put_files(
        "me/torch",
        {
            "pytorch_model.bin": pickle.dumps(_Evil()),
            "modeling_mine.py": b"open('PWNED', 'w')\n",
            "config.json": b'{"auto_map": {"AutoModel": "modeling_mine.Model"}}',
            "weights/model.safetensors": b"x" * 16,
        },
    )
    name, _, message = _raised(client, "hf://me/torch")
    assert name == "CheckpointNotFoundError"
    assert message.startswith("hf://me/torch@") and "holds no model eqx_ckpt reads" in message
    assert "pickled or framework weights (`pytorch_model.bin`), which eqx_ckpt never reads" in message
    assert "Python code (`modeling_mine.py`), which eqx_ckpt never runs" in message
    assert "folders (`weights`" in message
    assert not any("pytorch_model.bin" in r or "modeling_mine" in r or "config.json" in r for r in state.requests)


def test_nothing_from_a_repo_is_imported_run_or_unpickled(hub, tmp_path):
    """A repository holding a pickle, a `.py` file and a hostile config beside
    its weights: the weights load, and nothing else is downloaded, opened,
    imported or unpickled (an audit hook in the loading process)."""
    client, state = hub
    state.put_files(
        "me/hostile",
        {
            "model.safetensors": _safetensors_bytes(tmp_path),
            "pytorch_model.bin": pickle.dumps(_Evil()),
            "modeling_evil.py": b"open('PWNED', 'w')\n",
            "__init__.py": b"open('PWNED', 'w')\n",
            "config.json": b'{"auto_map": {"AutoModel": "modeling_evil.Model"}, "trust_remote_code": true}',
        },
    )
    got = client.run("""
        seen = []
        home = os.environ["HF_HOME"]
        def audit(event, args):
            if event == "pickle.find_class":
                seen.append([event, ""])
            if event not in ("open", "exec", "import"):
                return
            named = args[0].co_filename if event == "exec" else args[0]
            named = named if isinstance(named, str) else ""
            if "modeling_evil" in named or "pytorch_model" in named or (
                    home in named and ("config.json" in named or "__init__.py" in named)):
                seen.append([event, named])
        sys.addaudithook(audit)
        like = {"w": jax.ShapeDtypeStruct((6,), jnp.float32)}
        got = eqx_ckpt.tree_deserialise_leaves("hf://me/hostile", like)
        part = eqx_ckpt.tree_deserialise_leaves("hf://me/hostile", like, where=lambda t: t["w"])
        emit([np.asarray(got["w"]).tolist(), np.asarray(part["w"]).tolist(), "modeling_evil" in sys.modules,
              seen, os.path.exists("PWNED")])
    """)
    assert got == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 2 + [False, [], False]
    assert not (tmp_path / "PWNED").exists()
    fetched = [r for r in state.requests if "/resolve/" in r]
    assert fetched and all("model.safetensors" in r for r in fetched)
    assert not [
        p
        for p in (tmp_path / "hf").rglob("*")
        if p.is_file() and p.name != "model.safetensors" and "snapshots" in str(p)
    ]


def test_a_hostile_structure_record_names_a_class_that_is_never_imported(hub, tmp_path):
    """`eqx_ckpt.json` naming a class of the repository's own code: the load
    without a `like` refuses it (it is not in the trust list), and the module
    is never imported, nor its file fetched."""
    client, state = hub
    folder = tmp_path / "published"
    eqx_ckpt.export_safetensors(folder, eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    record = json.loads((folder / "eqx_ckpt.json").read_text())
    record["structure"]["cls"] = "modeling_evil:Model"
    state.put_files(
        "me/record",
        {
            "model.safetensors": (folder / "model.safetensors").read_bytes(),
            "eqx_ckpt.json": json.dumps(record).encode(),
            "modeling_evil.py": b"open('PWNED', 'w')\n",
        },
    )
    got = client.run("""
        imported = []
        def audit(event, args):
            if event == "import" and isinstance(args[0], str) and "evil" in args[0]:
                imported.append(args[0])
        sys.addaudithook(audit)
        error = raised(lambda: eqx_ckpt.Checkpoint("hf://me/record").load(trust=[]))
        emit([error[0], error[2], imported, "modeling_evil" in sys.modules, os.path.exists("PWNED")])
    """)
    assert got[0] == "UntrustedError" and "modeling_evil:Model" in got[1]
    assert got[2:] == [[], False, False]
    assert not any("modeling_evil" in r for r in state.requests)


def test_a_damaged_cached_file_is_refused(hub, tmp_path):
    """A file of the cache that is not the size the Hub lists (damaged on disk
    since it was downloaded) is refused, naming it and the fix."""
    client, _ = hub
    local = str(tmp_path / "local-1.0")
    eqx_ckpt.tree_serialise_leaves(local, tree(1.0))
    # The push and the load that fills the cache in one process.
    client.run(f"eqx_ckpt.push_to_hub({local!r}, 'me/damaged')\n" + _LOAD.format(local=local, path="hf://me/damaged"))
    (blob,) = [p for p in (tmp_path / "hf").rglob("blobs/*") if p.stat().st_size > 50_000]
    with open(blob, "r+b") as f:
        f.truncate(blob.stat().st_size - 4)
    name, _, message = _raised(client, "hf://me/damaged")
    assert name == "CorruptCheckpointError"
    assert "`model.safetensors` was downloaded as" in message and "hf cache rm" in message


def test_a_branch_and_a_private_repo_are_published(hub, tmp_path):
    """`revision=` commits to a branch (made from `main`), leaving `main` as it
    was; `private=True` makes a repository only its token reads."""
    client, state = hub
    local = {scale: str(tmp_path / f"local-{scale}") for scale in (1.0, 2.0)}
    for scale, path in local.items():
        eqx_ckpt.tree_serialise_leaves(path, tree(scale))
    # The two pushes in one process; the loads and the private push in one more.
    main, dev = client.run(f"""
        main = eqx_ckpt.push_to_hub({local[1.0]!r}, "me/branched")
        emit([main, eqx_ckpt.push_to_hub({local[2.0]!r}, "me/branched", revision="dev", commit_message="try")])
    """)
    assert state.repos["me/branched"].branches == {"main": main, "dev": dev}
    on_dev, on_main, secret = client.run(
        _LOADER.format(local=local[1.0])
        + f"""
eqx_ckpt.push_to_hub({local[1.0]!r}, "me/secret", private=True)
emit([load("hf://me/branched@dev"), load("hf://me/branched"), load("hf://me/secret")])
"""
    )
    assert on_dev == _as_lists(tree(2.0))
    assert on_main == _as_lists(tree(1.0))
    assert state.repos["me/secret"].private
    name, _, _ = _raised(client, "hf://me/secret", HF_TOKEN=None)
    assert name == "CheckpointNotFoundError"
    assert secret == _as_lists(tree(1.0))


def test_load_or_initialise_loads_by_name(hub, tmp_path):
    client, _ = hub
    eqx_ckpt.tree_serialise_leaves(tmp_path / "local-1.0", tree(1.0))
    got = client.run(f"""
        eqx_ckpt.push_to_hub({str(tmp_path / "local-1.0")!r}, "me/init")  # (the push in the same process)
        local = eqx_ckpt.Checkpoint({str(tmp_path / "local-1.0")!r}).load()
        loaded = eqx_ckpt.load_or_initialise("hf://me/init", lambda: jax.tree.map(jnp.zeros_like, local))
        emit(jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), loaded))
    """)
    assert got == _as_lists(tree(1.0))


def test_a_plain_hugging_face_repo_and_a_subfolder_load_by_name(hub, tmp_path):
    """A repository of plain safetensors (Hugging Face names, no `eqx_ckpt.json`),
    in a subfolder, loads into a `like` with `rename`, as a local folder does."""
    client, state = hub
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = _safetensors_bytes(tmp_path, {"model": {"proj": {"weight": weight, "bias": np.ones(3, np.float32)}}})
    state.put_files("org/plain", {"text/encoder/model.safetensors": data, "README.md": b"# plain\n"})
    got = client.run("""
        like = eqx.filter_eval_shape(eqx.nn.Linear, 4, 3, key=jax.random.key(0))
        linear = eqx_ckpt.tree_deserialise_leaves("hf://org/plain@main/text/encoder", like,
                                                  rename=[(r"(weight|bias)", r"model.proj.\\1")])
        emit([np.asarray(linear.weight).tolist(), np.asarray(linear.bias).tolist(),
              eqx_ckpt.Checkpoint("hf://org/plain/text/encoder").path])
    """)
    assert got[:2] == [weight.tolist(), [1.0, 1.0, 1.0]]
    assert re.fullmatch(r"hf://org/plain@[0-9a-f]{40}/text/encoder", got[2])


def test_the_cli_pushes_lists_verifies_and_diffs(hub, tmp_path):
    """The push in a process of its own; the commands after it (which name the
    commit it printed) in one more (`Client.clis`)."""
    client, _ = hub
    eqx_ckpt.tree_serialise_leaves(tmp_path / "local", tree(1.0))
    pushed = client.cli("push", str(tmp_path / "local"), "me/cli", "--message", "first")
    assert pushed.returncode == 0, pushed.stderr
    (url,) = pushed.stdout.split()
    assert re.fullmatch(r"hf://me/cli@[0-9a-f]{40}", url)
    listed, info, verified, same, missing, again = client.clis(
        ["ls", "hf://me/cli"],
        ["info", url],
        ["verify", url],
        ["diff", url, str(tmp_path / "local")],
        ["ls", "hf://me/nothing"],
        ["push", str(tmp_path / "local"), "me/cli"],
    )
    assert listed.returncode == 0 and "blocks" in listed.stdout and "embed" in listed.stdout, listed.stderr
    assert info.returncode == 0 and f"path:            {url}" in info.stdout and "safetensors" in info.stdout
    assert f"revision:        {url.rpartition('@')[2]}" in info.stdout
    assert verified.returncode == 0 and verified.stdout.strip().endswith("sound"), verified.stdout + verified.stderr
    assert same.returncode == 0, same.stdout + same.stderr
    assert missing.returncode == 2 and "hf://me/nothing@main: there is no such repository" in missing.stderr
    assert again.returncode == 0 and again.stdout.split()[0] == url, again.stderr
    assert "(unchanged: the repository held this export already; nothing committed)" in again.stdout


def test_every_cli_command_that_reads_takes_a_token(hub, tmp_path):
    """A private repository, no `HF_TOKEN`: `ls`, `info`, `verify`, `diff`,
    `export` and `push` (of a published model) read it with `--token`. Each
    command runs without the token, then with it, in a process of its own
    (`Client.clis`: the run without a token first, so that none is left)."""
    client, _ = hub
    eqx_ckpt.tree_serialise_leaves(tmp_path / "local", tree(1.0))
    pushed = client.cli(
        "push", str(tmp_path / "local"), "me/private-cli", "--private", "--token", "writer", HF_TOKEN=None
    )
    assert pushed.returncode == 0, pushed.stderr
    url, token = "hf://me/private-cli", ["--token", "writer"]
    for args in (
        ["ls", url],
        ["info", url],
        ["verify", url],
        ["diff", url, str(tmp_path / "local")],
        ["export", url, str(tmp_path / "exported")],
        ["push", url, "me/private-copy", "--private"],
    ):
        refused, done = client.clis(args, [*args, *token], HF_TOKEN=None)
        assert refused.returncode == 2 and "there is no such repository, or it is private" in refused.stderr, args
        assert done.returncode == 0, (args, done.stdout, done.stderr)


def test_hub_paths_are_parsed_without_the_hub(tmp_path):
    from eqx_ckpt._base._location import Hub, location

    eqx_ckpt.tree_serialise_leaves(tmp_path / "local", {"w": jnp.ones(2)})
    assert eqx_ckpt.Checkpoint(tmp_path / "local").revision is None  # only a Hub repository has one

    loc = location("hf://me/model@refs%2Fpr%2F1/sub/folder")
    assert loc.hub == Hub("me/model", "refs/pr/1", "sub/folder/") and loc.kvstore == {} and loc.local is None
    assert location("hf://me/model").hub == Hub("me/model", None, "")
    assert location("hf://me/model/sub").hub == Hub("me/model", None, "sub/")
    assert location(tmp_path / "local").hub is None
    for bad in ("hf://me", "hf://me/model@", "hf://me/model/../x"):
        with pytest.raises(eqx_ckpt.CheckpointTypeError, match="hf://owner/name"):
            location(bad)


def test_huggingface_hub_is_imported_only_for_the_hub():
    """`import eqx_ckpt` never imports huggingface_hub; without it, a Hub call says what to install."""
    code = """
import sys
import eqx_ckpt
assert "huggingface_hub" not in sys.modules
eqx_ckpt.tree_serialise_leaves("local_ckpt_unused", {"w": 1.0}) if False else None
sys.modules["huggingface_hub"] = None  # as if it were not installed
for call in (lambda: eqx_ckpt.Checkpoint("hf://me/model"), lambda: eqx_ckpt.push_to_hub({"w": 1.0}, "me/model")):
    try:
        call()
    except ImportError as e:
        print(e)
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(places.ROOT)},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all('pip install "eqx_ckpt[hub]"' in line for line in lines)


def test_a_cache_snapshot_may_link_only_to_its_own_blobs(tmp_path):
    """In the Hub's cache, a snapshot's files are links to the repository's
    `blobs/`, which a load follows; a link anywhere else (here `eqx_ckpt.json`
    to a file outside the cache) is refused as in any checkpoint."""
    published = tmp_path / "published"
    eqx_ckpt.export_safetensors(published, {"w": jnp.arange(3.0)})
    repo = tmp_path / "hub" / "models--me--linked"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("model.safetensors", "eqx_ckpt.json"):
        blob = repo / "blobs" / f"blob-{name}"
        blob.write_bytes((published / name).read_bytes())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    loaded = eqx_ckpt.Checkpoint(snapshot).load(trust=[])
    assert tree_equal(loaded, {"w": jnp.arange(3.0)}, typematch=True)
    (snapshot / "eqx_ckpt.json").unlink()
    (snapshot / "eqx_ckpt.json").symlink_to(published / "eqx_ckpt.json")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("'eqx_ckpt.json' in checkpoint")):
        eqx_ckpt.Checkpoint(snapshot)


# --- A model's life after its first push (issue 65) ---


def _files_at(state: hub_server.Hub, repo: str, revision: str = "main") -> list[str]:
    entry = state.repos[repo]
    return sorted(entry.commits[state.resolve(entry, revision) or ""])


def test_a_push_with_another_layout_replaces_the_old_one_in_one_commit(hub, tmp_path):
    """Pushed as shards, then as one file: the commit deletes the index and the
    shards (a user's own file stays), and the name loads the new model."""
    client, state = hub
    sharded = push(client, "me/relaid", 1.0, tmp_path, max_shard_size="20KB")
    held = _files_at(state, "me/relaid")
    assert "model.safetensors.index.json" in held and len([n for n in held if n.endswith(".safetensors")]) > 2
    state.put_files("me/relaid", {"notes.txt": b"mine", "sub/model.safetensors": b"not ours"})
    single = push(client, "me/relaid", 2.0, tmp_path)
    assert single != sharded
    assert _files_at(state, "me/relaid") == [
        "README.md",
        "eqx_ckpt.json",
        "model.safetensors",
        "notes.txt",
        "sub/model.safetensors",
    ]
    assert len(state.repos["me/relaid"].commits) == 4  # made, sharded, the user's files, single: one commit each
    # The two loads and the verify in one process.
    on_main, at_sharded, problems = client.run(
        _LOADER.format(local=str(tmp_path / "local-1.0"))
        + f"emit([load('hf://me/relaid'), load('hf://me/relaid@{sharded}'), list(eqx_ckpt.verify('hf://me/relaid'))])"
    )
    assert on_main == _as_lists(tree(2.0)), "main: the single file"
    assert at_sharded == _as_lists(tree(1.0)), "the sharded push's commit"
    assert problems == []


def test_a_folder_holding_two_layouts_is_refused_naming_both(hub, tmp_path):
    """An index and its shards beside a `model.safetensors` (a repository
    another tool left so): no load picks one; verify says so too."""
    client, state = hub
    push(client, "me/both", 1.0, tmp_path, max_shard_size="20KB")
    state.put_files("me/both", {"model.safetensors": _safetensors_bytes(tmp_path)})
    calls = ("eqx_ckpt.Checkpoint('hf://me/both')", "eqx_ckpt.Checkpoint('hf://me/both').load()")
    *errors, problems = client.run(  # (the two reads and the verify in one process)
        "emit(["
        + "".join(f"raised(lambda: {call}), " for call in calls)
        + "[p.message for p in eqx_ckpt.verify('hf://me/both')]])"
    )
    for call, (name, _, message) in zip(calls, errors):
        assert name == "CorruptCheckpointError", call
        assert (
            "holds two safetensors layouts at once: the index `model.safetensors.index.json` and the single "
            "file `model.safetensors`" in message
        ), call
    assert len(problems) == 1 and "two safetensors layouts" in problems[0]


def test_the_same_push_twice_commits_nothing_and_returns_the_commit(hub, tmp_path):
    """An export is deterministic: the second push of the same checkpoint finds
    every file there, makes no commit, and returns the commit holding them."""
    client, state = hub
    first = push(client, "me/same", 1.0, tmp_path)
    commits, asked = len(state.repos["me/same"].commits), len(state.requests)
    assert push(client, "me/same", 1.0, tmp_path) == first
    assert len(state.repos["me/same"].commits) == commits
    assert not any(r.startswith(("POST /api/models/me/same/commit/", "PUT ")) for r in state.requests[asked:])


def test_checkpoint_load_fills_the_cache_and_then_needs_no_network(tmp_path):
    """`Checkpoint("hf://...").load(trust=...)`, the from_pretrained of eqx_ckpt:
    the first downloads into the Hub's cache, a second sends no file bytes, and
    with the server gone and offline mode on it loads from the cache."""
    load = """
        c = eqx_ckpt.Checkpoint('hf://me/main-call')
        emit(jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), c.load(trust=[])))
    """
    with hub_server.serving() as (url, state):
        client = Client(url, tmp_path / "hf")
        push(client, "me/main-call", 1.0, tmp_path)
        assert client.run(load) == _as_lists(tree(1.0))
        assert list((tmp_path / "hf").rglob("*.safetensors"))  # in the cache
        before = state.sent.get("", 0)
        assert client.run(load) == _as_lists(tree(1.0))
        assert state.sent.get("", 0) == before
    assert client.run(load, HF_HUB_OFFLINE="1") == _as_lists(tree(1.0))
    assert client.run(load) == _as_lists(tree(1.0))  # the port closed: nothing answers


def test_a_partly_cached_repository_offline_says_what_is_missing(tmp_path):
    """Offline, a cache holding only the card (one file downloaded by hand), or
    a download that lost a shard, is no empty repository: the error names what
    the cache lacks and says to connect once. (Online, the pushes and the
    downloads in one process; offline, both loads in one more.)"""
    local = str(tmp_path / "local")
    eqx_ckpt.tree_serialise_leaves(local, tree(1.0))
    with hub_server.serving() as (url, _):
        client = Client(url, tmp_path / "hf")
        client.run(f"""
            import huggingface_hub
            eqx_ckpt.push_to_hub({local!r}, "me/card-only")
            eqx_ckpt.push_to_hub({local!r}, "me/lost-shard", max_shard_size="20KB")
            huggingface_hub.hf_hub_download("me/card-only", "README.md")
            emit(str(eqx_ckpt.Checkpoint("hf://me/lost-shard").load() is not None))
        """)
    (shard,) = [p for p in (tmp_path / "hf").rglob("model-00002-of-*.safetensors") if "lost-shard" in str(p)]
    shard.unlink()
    card_only, lost_shard = client.run(
        "emit([raised(lambda: eqx_ckpt.Checkpoint('hf://me/card-only')),"
        " raised(lambda: eqx_ckpt.Checkpoint('hf://me/lost-shard').load())])",
        HF_HUB_OFFLINE="1",
    )
    name, classes, message = card_only
    assert name == "CheckpointConnectionError" and "CheckpointNotFoundError" not in classes
    assert "offline mode is on (`HF_HUB_OFFLINE=1`)" in message
    assert "it holds only `README.md` of it, not its weights" in message and "Connect once" in message
    name, _, message = lost_shard
    assert name == "CheckpointConnectionError"
    assert re.search(r"it lacks `model-00002-of-\d+\.safetensors`", message) and "Connect once" in message


def test_verify_checks_every_file_against_the_hubs_digest(hub, tmp_path):
    """A cached file whose bytes changed (same size) is refused by a whole load
    (tests/hostile/test_hub_hostile.py), and `verify("hf://...")` names it by the
    SHA-256 the Hub lists."""
    client, _ = hub
    local = str(tmp_path / "local-1.0")
    eqx_ckpt.tree_serialise_leaves(local, tree(1.0))
    checked = client.run(  # (the push and the first verify in one process)
        f"eqx_ckpt.push_to_hub({local!r}, 'me/digest')\n"
        "p = eqx_ckpt.verify('hf://me/digest'); emit([list(p), list(p.checked), list(p.unchecked)])"
    )
    assert checked[0] == [] and checked[2] == []
    # Each file against the Hub's digest, then each leaf against the digest eqx_ckpt.json records (issue 67).
    assert [line.split(":")[0] for line in checked[1][:2]] == ["`eqx_ckpt.json`", "`model.safetensors`"]
    assert "`model.safetensors`: its SHA-256 is the one the Hub lists at " in checked[1][1]
    assert checked[1][2:] == [
        "every leaf's bytes, against the digests eqx_ckpt.json records of it "
        "(blake3 per block of whole rows, up to 128 KiB)"
    ]
    (blob,) = [p for p in (tmp_path / "hf").rglob("blobs/*") if p.stat().st_size > 50_000]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    problems = client.run("emit([p.message for p in eqx_ckpt.verify('hf://me/digest')])")
    assert len(problems) == 1
    assert "`model.safetensors`" in problems[0] and "SHA-256" in problems[0] and "the Hub lists" in problems[0]


def test_every_load_entry_takes_a_token(hub, tmp_path):
    """A private repository, no `HF_TOKEN`: each load entry reads it with
    `token=`, and without one says the repository is not found or private."""
    client, _ = hub
    push(client, "me/secret", 1.0, tmp_path, private=True)
    local = str(tmp_path / "local-1.0")
    got = client.run(
        f"""
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eqx_ckpt.Checkpoint({local!r}).load())
        a = eqx_ckpt.tree_deserialise_leaves("hf://me/secret", like, token="writer")
        b = eqx_ckpt.Checkpoint("hf://me/secret", token="writer").load()
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
        c = eqx_ckpt.load_or_initialise("hf://me/secret", zeros, token="writer")
        d = eqx_ckpt.tree_deserialise_leaves("hf://me/secret", like["blocks"][0], prefix="blocks.0", token="writer")
        v = list(eqx_ckpt.verify("hf://me/secret", token="writer"))
        same = [bool(eqx.tree_equal(x, a, typematch=True)) for x in (b, c)]
        emit([same, np.asarray(d["w"]).tolist()[0][:2], v, raised(lambda: eqx_ckpt.Checkpoint("hf://me/secret"))[0]])
        """,
        HF_TOKEN=None,
    )
    assert got == [[True, True], [1.0, 1.0], [], "CheckpointNotFoundError"]


def test_hugging_face_habits_get_a_hint(tmp_path, monkeypatch):
    """`owner/name` with no such local folder asks whether `hf://owner/name` was
    meant; a save or a manager given an `hf://` path points at `push_to_hub`;
    `load()` without `trust` of a published model that records its classes
    warns once, at the caller's line, with the `trust` that rebuilds it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        eqx_ckpt.CheckpointNotFoundError,
        match=re.escape("did you mean the Hugging Face Hub repository `hf://me/model`?"),
    ):
        eqx_ckpt.Checkpoint("me/model")
    for write in (
        lambda: eqx_ckpt.tree_serialise_leaves("hf://me/model", {"w": jnp.ones(2)}),
        lambda: eqx_ckpt.CheckpointManager("hf://me/model"),
    ):
        with pytest.raises(
            eqx_ckpt.CheckpointValueError, match=re.escape("a Hub repository is written only by a push, in one commit")
        ) as raised:
            write()
        assert "eqx_ckpt.push_to_hub(tree_or_path, 'me/model')" in str(raised.value)
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    eqx_ckpt.export_safetensors(tmp_path / "mlp", model)  # a published model, as `hf://` loads one
    with pytest.warns(UserWarning, match=re.escape("pass `.load(trust=[])` (the default trust covers them)")) as said:
        state = eqx_ckpt.Checkpoint(tmp_path / "mlp").load()
    assert [w.filename for w in said] == [__file__]
    assert isinstance(state, dict)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_ckpt.Checkpoint(tmp_path / "mlp").load()  # once per checkpoint
        assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "mlp").load(trust=[]), model, typematch=True)


def test_the_hub_extra_takes_a_range_and_the_constraints_pin_it():
    """`eqx_ckpt[hub]` installs beside libraries that need another
    huggingface_hub 2.x (transformers takes >=1.31,<3): a range, not a pin;
    the constraints file keeps the version the tests ran with."""
    import tomllib

    extras = tomllib.loads((places.ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    hub_specs = [s for extra in extras.values() for s in extra if s.startswith("huggingface_hub")]
    assert hub_specs and all(s == "huggingface_hub>=2.4,<3" for s in hub_specs)
    pins = [
        line
        for line in (places.ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("huggingface_hub")
    ]
    assert pins == [f"huggingface_hub=={importlib.metadata.version('huggingface_hub')}"]


def test_a_new_users_day_with_a_published_model(tmp_path):
    """The whole life of a model, each step at the first try, as a new user
    writes it: train with the step manager, push the best step's model, push
    it again laid out otherwise, reload it by name, fine-tune it with a new
    head (the printed `where=` pasted), push the fine-tune, and load both
    offline, with the server gone."""
    with hub_server.serving() as (url, state):
        client = Client(url, tmp_path / "hf")
        day = client.run(
            """
            import re, warnings
            warnings.simplefilter("error")
            key = jax.random.key(0)
            make4 = lambda: eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(1))
            make6 = lambda: eqx.nn.MLP(8, 6, 32, 2, key=jax.random.key(2))
            model = make4()
            with eqx_ckpt.CheckpointManager("run", best_metric="loss", best_n=1) as manager:
                for step in range(3):
                    model = jax.tree.map(lambda x: x * 0.9 if eqx.is_array(x) else x, model)
                    manager.save(step, {"model": model, "step": step}, metrics={"loss": 1.0 / (step + 1)})
                manager.wait_until_finished()
                best = manager.best_step()
                trained = manager.restore({"model": make4(), "step": 0}, step=best)["model"]
            first = eqx_ckpt.push_to_hub(trained, "me/classifier", max_shard_size="4KB")
            again = eqx_ckpt.push_to_hub(trained, "me/classifier")   # one file now: the shards go
            loaded = eqx_ckpt.Checkpoint("hf://me/classifier").load(trust=[])
            try:
                eqx_ckpt.load_or_initialise("hf://me/classifier", make6)
                where_text = None
            except eqx_ckpt.LeafError as e:
                where_text = re.search(r"where=(lambda .*)", str(e))[1]
            tuned = eqx_ckpt.load_or_initialise("hf://me/classifier", make6, where=eval(where_text))
            tuned_commit = eqx_ckpt.push_to_hub(tuned, "me/classifier-6")
            shared = eqx_ckpt.Checkpoint("hf://me/classifier-6").load(trust=[])   # as a colleague loads it
            assert eqx.tree_equal(shared, tuned, typematch=True)
            emit([first != again, bool(eqx.tree_equal(loaded, trained, typematch=True)), where_text,
                  bool(eqx.tree_equal(tuned.layers[:2], trained.layers[:2])), tuned.layers[2].weight.shape[0],
                  tuned_commit])
            """
        )
        assert day[:5] == [True, True, "lambda m: (m.layers[0], m.layers[1])", True, 6]
        files = sorted(state.repos["me/classifier"].commits[state.repos["me/classifier"].branches["main"]])
        assert files == ["README.md", "eqx_ckpt.json", "model.safetensors"]
    offline = client.run(
        """
        a = eqx_ckpt.Checkpoint("hf://me/classifier").load(trust=[])
        b = eqx_ckpt.Checkpoint("hf://me/classifier-6").load(trust=[])
        emit([type(a).__name__, b.layers[2].weight.shape[0], eqx_ckpt.Checkpoint("hf://me/classifier-6").revision])
        """,
        HF_HUB_OFFLINE="1",
    )
    assert offline == ["MLP", 6, day[5]]


@pytest.mark.parametrize(
    "repo, fix",
    [
        ("hf://me/model", "not a Hub path ('hf://me/model'): pass `repo_id=\"me/model\"`."),
        ("me/model@v2", 'not with a revision (\'me/model@v2\'): pass `repo_id="me/model", revision="v2"`.'),
        ("hf://me/model@v2", 'not a Hub path (\'hf://me/model@v2\'): pass `repo_id="me/model", revision="v2"`.'),
    ],
)
def test_a_repo_id_holding_a_path_or_revision_is_refused_before_any_export(repo, fix):
    """Issue 65 item 6: `repo_id` is `owner/name`; `hf://` or `@revision` says
    what to pass instead, before the export (which would refuse this
    abstract tree) and before any Hub call."""
    abstract = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    message = f"`repo_id` must be the repository's `owner/name`, {fix}"
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
        eqx_ckpt.push_to_hub(abstract, repo)


def _card_of(state, repo: str, commit: str) -> str:
    return state.blobs[state.repos[repo].commits[commit]["README.md"]].decode()


def test_the_cli_pushes_a_managers_best_step_as_its_model_with_the_card_options(hub, tmp_path):
    """Issue 65 items 6 and 7: `eqx-ckpt push DIR --best --prefix model` pushes
    the model of the best step, without its optimiser state, and the card
    holds the step's metrics, `--license`, `--base-model` and `--code`;
    `--metadata` values are JSON where they parse. The card's snippet loads
    it, run as written in a fresh process."""
    client, state = hub
    models = {step: eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(step)) for step in (1, 2, 3)}
    with eqx_ckpt.CheckpointManager(tmp_path / "run", max_to_keep=3, best_n=1, best_metric="val_loss") as manager:
        for step, loss in [(1, 0.5), (2, 0.0576), (3, 0.25)]:
            state_of_step = {"model": models[step], "opt_state": {"mu": jnp.zeros(5)}, "step": step}
            manager.save(step, state_of_step, metrics={"val_loss": loss})
    options = ["--best", "--prefix", "model", "--license", "mit", "--base-model", "me/base", "--code", "mypkg"]
    options += ["--metadata", "lr=0.001", "--metadata", "run=abc", "--metadata", "sizes=[1, 2]", "--revision", "dev"]
    pushed = client.cli("push", str(tmp_path / "run"), "me/best", *options)
    assert pushed.returncode == 0, pushed.stderr
    # Issue 88: it says which step it pushed, and why that one.
    assert f"eqx-ckpt: pushing step 2 of {tmp_path / 'run'} (the best: val_loss=0.0576)\n" in pushed.stderr
    commit = pushed.stdout.split("@")[1].strip()
    card = _card_of(state, "me/best", commit)
    assert card.startswith(
        '---\nlibrary_name: eqx_ckpt\nlicense: "mit"\nbase_model: "me/base"\ntags:\n- jax\n- equinox\n'
        'metrics:\n- "val_loss"\n---\n'
    )
    assert "| val_loss | 0.0576 |\n" in card and "`pip install mypkg`" in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert 'eqx_ckpt.Checkpoint("hf://me/best@dev").load(trust=[])' in snippet
    got = client.run(
        snippet
        + """
        ckpt = eqx_ckpt.Checkpoint("hf://me/best@dev")
        emit([type(model).__name__, np.asarray(model.layers[0].weight).tolist(), sorted(ckpt)[:2], ckpt.info])
        """.replace("\n        ", "\n")
    )
    assert got[0] == "MLP" and got[1] == np.asarray(models[2].layers[0].weight).tolist()
    assert got[2] == ["layers.0.bias", "layers.0.weight"]
    assert got[3] == {"lr": 0.001, "run": "abc", "sizes": [1, 2], "metrics": {"val_loss": 0.0576}}


def test_a_push_warns_of_the_parts_that_need_the_code_and_its_card_loads_the_rest(hub, tmp_path):
    """Issue 65 item 4: a tree holding a lambda was published, and the card's
    own snippet raised `CheckpointValueError`. The push warns, naming the
    part, and the snippet, run as written, loads the parts that rebuild."""
    client, state = hub
    got = client.run("""
        import warnings
        tree = {"mlp": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "act": lambda x: x}
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            commit = eqx_ckpt.push_to_hub(tree, "me/lambda")
        emit([commit, [(w.category.__name__, os.path.basename(w.filename), str(w.message)) for w in warned]])
    """)
    commit, warned = got
    assert [(name, file) for name, file, _ in warned] == [("NeedsCodeWarning", "<string>")]
    assert "`Checkpoint('hf://me/lambda').load(trust=[...])` cannot rebuild" in warned[0][2]
    assert "`act`: a lambda, which a checkpoint cannot record as data" in warned[0][2]
    snippet = re.search(r"```python\n(.*?)```", _card_of(state, "me/lambda", commit), re.S).group(1)
    assert client.run(snippet + "emit([type(part).__name__, len(part.layers)])\n") == ["MLP", 2]


def test_a_tag_names_the_pushed_commit(hub, tmp_path):
    """`tag=` tags the commit holding the export: `hf://...@tag` loads it. The
    same push tagged again keeps the tag; a tag that names another commit is
    not moved, and says so."""
    client, state = hub
    commit = push(client, "me/tagged", 1.0, tmp_path, tag="v1.0")
    assert state.repos["me/tagged"].tags == {"v1.0": commit}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "local-2.0", tree(2.0), overwrite=True)
    # The load by the tag and the two pushes after it in one more process.
    opened, again, (name, _, message) = client.run(f"""
        opened = eqx_ckpt.Checkpoint('hf://me/tagged@v1.0').revision
        again = eqx_ckpt.push_to_hub({str(tmp_path / "local-1.0")!r}, 'me/tagged', tag='v1.0')
        emit([opened, again,
              raised(lambda: eqx_ckpt.push_to_hub({str(tmp_path / "local-2.0")!r}, 'me/tagged', tag='v1.0'))])
    """)
    assert opened == commit, "the tag loads"
    assert again == commit, "unchanged, the tag already on it"
    assert name == "CheckpointValueError"
    assert message.startswith(f"hf://me/tagged: the tag 'v1.0' names another commit ({commit}), so it was not moved")
    assert state.repos["me/tagged"].tags == {"v1.0": commit}


def _family_trees() -> tuple[dict, dict]:
    """`FAMILY`'s base (a 1 MiB body, a head) and its head-only fine-tune (a new head of another shape)."""
    made: dict = {"np": np}
    exec(FAMILY, made)
    return made["base"], made["tuned"]


def test_a_fine_tune_pushed_against_its_base_uploads_what_changed_and_loads_through_the_cache(hub, tmp_path):
    """Issue 67: `base=` uploads only the changed head; a fresh process loads
    the fine-tune whole through the Hub's cache (its base too), bit for bit,
    then again offline; the card links the base for the Hub's model tree. The
    base pushed again later is not what the fine-tune loads: it is pinned to
    the base's commit, never a mix of two models."""
    client, state = hub
    base_commit = client.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'me/base'))")
    before = state.received
    client.run(FAMILY + "emit(eqx_ckpt.push_to_hub(tuned, 'me/tuned', base='hf://me/base'))")
    _, tuned = _family_trees()
    assert state.received - before <= tuned["head"].nbytes + 2**20  # the target: the changed leaves + 1 MiB
    assert state.received - before < tuned["body"]["w"].nbytes  # the body was not uploaded
    fresh = Client(client.url, tmp_path / "other_cache")
    load = FAMILY + (
        "got = eqx_ckpt.Checkpoint('hf://me/tuned').load(trust=[])\n"
        "c = eqx_ckpt.Checkpoint('hf://me/tuned')\n"
        "emit([bool(eqx.tree_equal(got, tuned, typematch=True)), c.base, sorted(c.from_base()),"
        " np.asarray(c['body.w'][3, :2]).tolist()])"
    )
    expected = [True, f"hf://me/base@{base_commit}", ["body.b", "body.w"], [1536.0, 1537.0]]
    # The online load and the card's download in one process.
    online, card = fresh.run(
        load.replace("emit(", "loaded = (")
        + "\nimport huggingface_hub\n"
        + "emit([loaded, open(huggingface_hub.hf_hub_download('me/tuned', 'README.md')).read()])"
    )
    assert online == expected
    assert fresh.run(load, HF_HUB_OFFLINE="1") == expected  # the base's files are in the cache too
    assert 'base_model: "me/base"' in card and "holds only the leaves that differ from its base" in card
    client.run(FAMILY + "base['body']['w'] = base['body']['w'] + 1; emit(eqx_ckpt.push_to_hub(base, 'me/base'))")
    assert Client(client.url, tmp_path / "third_cache").run(load) == expected


_FINETUNE_LOADS = (
    FAMILY
    + """
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tuned)
lazy = eqx_ckpt.tree_deserialise_leaves('hf://me/tuned', like, lazy=True)
part = eqx_ckpt.tree_deserialise_leaves('hf://me/tuned', like, where=lambda t: t['head'])
body = eqx_ckpt.tree_deserialise_leaves('hf://me/tuned', like['body'], prefix='body')
whole = eqx_ckpt.tree_deserialise_leaves('hf://me/tuned', like)
c = eqx_ckpt.Checkpoint('hf://me/tuned')
same = [eqx.tree_equal(eqx_ckpt.materialise(lazy), tuned), eqx.tree_equal(part['head'], tuned['head']),
        eqx.tree_equal(body, tuned['body']), eqx.tree_equal(whole, tuned), eqx.tree_equal(c.load(), tuned)]
emit([[bool(x) for x in same], c.base, [p.message for p in eqx_ckpt.verify('hf://me/tuned')]])
"""
)


def test_a_fine_tunes_files_on_the_hub_say_what_they_hold_and_a_push_whole_deletes_them(hub, tmp_path):
    """Issue 75: a fine-tune pushed against its base is `finetune.safetensors`,
    labelled with its base and the command that makes a standalone copy; it
    loads by every load. Pushed whole, the repository holds `model.safetensors`
    and not the fine-tune's file; pushed against the base again, the reverse.
    A repository holding both is refused, naming both."""
    client, state = hub
    base_commit, tuned_commit = client.run(
        FAMILY + "emit([eqx_ckpt.push_to_hub(base, 'me/base'),"
        " eqx_ckpt.push_to_hub(tuned, 'me/tuned', base='hf://me/base')])"
    )
    assert state.repos["me/tuned"].branches["main"] == tuned_commit
    assert _files_at(state, "me/tuned") == ["README.md", "eqx_ckpt.json", "finetune.safetensors"]
    read = (
        "import huggingface_hub\nfrom safetensors import safe_open\n"
        "with safe_open(huggingface_hub.hf_hub_download('me/tuned', 'finetune.safetensors'), 'np') as f:\n"
        "    read = [f.metadata(), raised(lambda: huggingface_hub.hf_hub_download('me/tuned', 'model.safetensors'))]\n"
    )
    (metadata, missing), loads = client.run(
        read + _FINETUNE_LOADS.replace("emit(", "loads = (") + "emit([read, loads])"
    )
    assert metadata == {
        "eqx_ckpt.fine_tune": (
            "This file holds only the tensors of a fine-tune that differ from its base. It is not a whole model: "
            "eqx_ckpt reads the other tensors from the base."
        ),
        "eqx_ckpt.base": "hf://me/base",
        "eqx_ckpt.base_revision": base_commit,
        "eqx_ckpt.standalone": "eqx-ckpt export --standalone hf://me/tuned <folder>",
    }
    assert "EntryNotFoundError" in missing[1]  # a loader that looks for a whole model finds none
    assert loads == [[True] * 5, f"hf://me/base@{base_commit}", []]
    shown = client.clis(["ls", "hf://me/tuned"], ["info", "hf://me/tuned"])  # (in one process)
    for done, (command, said) in zip(shown, (("ls", "head"), ("info", f"hf://me/base@{base_commit}"))):
        assert done.returncode == 0 and said in done.stdout, (command, done.stdout, done.stderr)
    # Each push with the loads after it in one process, which loads what the server holds then.
    push_and_load = _FINETUNE_LOADS.replace("emit(", "loads = (") + "emit([commit, loads])"
    push_and_load = push_and_load.replace(FAMILY, FAMILY + "commit = eqx_ckpt.push_to_hub(tuned, 'me/tuned'OPTIONS)\n")
    whole, loads = client.run(push_and_load.replace("OPTIONS", ""))
    assert _files_at(state, "me/tuned", whole) == ["README.md", "eqx_ckpt.json", "model.safetensors"]
    assert loads == [[True] * 5, None, []]
    against, loads = client.run(push_and_load.replace("OPTIONS", ", base='hf://me/base'"))
    assert state.repos["me/tuned"].branches["main"] == against
    assert _files_at(state, "me/tuned") == ["README.md", "eqx_ckpt.json", "finetune.safetensors"]
    assert loads[:2] == [[True] * 5, f"hf://me/base@{base_commit}"]
    state.put_files("me/tuned", {"model.safetensors": _safetensors_bytes(tmp_path)})
    name, _, message = client.run("emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/tuned')))")
    assert name == "CorruptCheckpointError"
    said = "holds two safetensors layouts at once: the single files `model.safetensors` and `finetune.safetensors`"
    assert said in message


def test_a_fine_tune_from_the_hub_reads_no_base_outside_the_hub(hub, tmp_path):
    """What a repository names is untrusted: a fine-tune on the Hub whose
    record names a local base is refused before anything is read there; and a
    push of a fine-tune made against a local base is refused, naming the fixes."""
    client, state = hub
    base, tuned = _family_trees()
    eqx_ckpt.export_safetensors(tmp_path / "base", base)
    eqx_ckpt.export_safetensors(tmp_path / "tuned", tuned, base=tmp_path / "base")
    state.put_files("me/hostile", {p.name: p.read_bytes() for p in (tmp_path / "tuned").iterdir()})
    # The load and the two refused pushes in one process (run in tmp_path).
    loaded, pushed, given = client.run(
        "emit([raised(lambda: eqx_ckpt.Checkpoint('hf://me/hostile').load()),"
        f" raised(lambda: eqx_ckpt.push_to_hub({str(tmp_path / 'tuned')!r}, 'me/tuned')),"
        f" raised(lambda: eqx_ckpt.push_to_hub({str(tmp_path / 'tuned')!r}, 'me/tuned', base='base'))])"
    )
    assert loaded[0] == "UntrustedError" and "may take its base only from the Hub" in loaded[2], loaded
    error = pushed
    assert error[0] == "CheckpointValueError" and "`standalone=True`" in error[2] and "Push the base first" in error[2]
    assert f"stored against the base {str(tmp_path / 'base')!r}, which is not on the Hub" in error[2]
    error = given
    assert "stored against the base 'base', which is not on the Hub" in error[2]  # as given, not via a temporary folder
    standalone = f"emit(eqx_ckpt.push_to_hub({str(tmp_path / 'tuned')!r}, 'me/tuned', standalone=True))"
    client.run(standalone)
    got = client.run(
        FAMILY + "c = eqx_ckpt.Checkpoint('hf://me/tuned'); emit([c.base, bool(eqx.tree_equal(c.load(), tuned))])"
    )
    assert got == [None, True]


def test_a_fine_tune_is_pushed_and_made_standalone_from_the_cli_and_its_missing_base_is_named(hub, tmp_path):
    """`eqx-ckpt push --base` uploads what changed, `eqx-ckpt export
    --standalone hf://...` writes every leaf; a base whose repository is gone
    is a `CheckpointNotFoundError` naming the base at its pinned commit."""
    client, state = hub
    base_commit = client.run(
        FAMILY + f"eqx_ckpt.tree_serialise_leaves({str(tmp_path / 'ckpt')!r}, tuned)\n"
        "emit(eqx_ckpt.push_to_hub(base, 'me/base'))"
    )
    # The three commands in one process (`Client.clis`).
    options = ["--base", "hf://me/base", "--license", "mit", "--metadata", "description=A head."]
    pushed, exported, nothere = client.clis(
        ["push", str(tmp_path / "ckpt"), "me/tuned", *options],
        ["export", "--standalone", "hf://me/tuned", str(tmp_path / "whole")],
        ["push", str(tmp_path / "ckpt"), "me/other", "--base", "hf://me/nothere"],
    )
    assert pushed.returncode == 0, pushed.stderr
    base, tuned = _family_trees()
    taken = base["body"]["w"].nbytes + base["body"]["b"].nbytes
    assert pushed.stderr.strip() == (
        f"eqx-ckpt: stored 1 leaf, {tuned['head'].nbytes} bytes (12.0 KiB); took 2 leaves, {taken} bytes "
        f"(1.0 MiB) from the base hf://me/base@{base_commit}."
    )
    assert exported.returncode == 0, exported.stderr
    assert nothere.returncode == 2
    assert "The base given as `--base` ('hf://me/nothere') cannot be found" in nothere.stderr
    assert json.loads((tmp_path / "whole" / "eqx_ckpt.json").read_text())["format_version"] == VERSION
    # The standalone copy keeps the card's metadata (issue 75, item 5).
    assert json.loads((tmp_path / "whole" / "eqx_ckpt.json").read_text())["info"] == {"description": "A head."}
    front = (tmp_path / "whole" / "README.md").read_text().split("\n---", 1)[0]
    assert 'license: "mit"' in front and 'base_model: "me/base"' in front
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "whole").load(), tuned)
    del state.repos["me/base"]
    error = Client(client.url, tmp_path / "fresh").run(
        "emit(raised(lambda: eqx_ckpt.Checkpoint('hf://me/tuned').load()))"
    )
    assert error[0] == "CheckpointNotFoundError"
    assert f"the others are read from its base hf://me/base@{base_commit}, which cannot be found" in error[2]


def test_a_cached_hub_base_given_as_a_checkpoint_is_pinned_by_its_repository_and_commit(hub, tmp_path):
    """`base=Checkpoint("hf://...")` whose files the cache holds (so it reads
    them from a cache folder) once raised a bare `KeyError`: the record names
    the repository and commit, as for a base given as a path."""
    client, _ = hub
    commit = client.run(FAMILY + "emit(eqx_ckpt.push_to_hub(base, 'me/base'))")
    folder = str(tmp_path / "tuned")
    client.run(
        FAMILY + "eqx_ckpt.Checkpoint('hf://me/base').load()\n"  # the cache now holds it
        f"eqx_ckpt.export_safetensors({folder!r}, tuned, base=eqx_ckpt.Checkpoint('hf://me/base')); emit(0)"
    )
    assert json.loads((tmp_path / "tuned" / "eqx_ckpt.json").read_text())["base"] == {
        "path": "hf://me/base",
        "revision": commit,
    }


_FIRST_PUSH = """
from eqx_ckpt._base import _faults
def push():
    eqx_ckpt.push_to_hub({{"w": np.arange(600, dtype=np.float32)}}, {repo!r})
def interrupted():
    try:
        with _faults.armed("hub.commit", KeyboardInterrupt):
            push()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
emit([raised(push), interrupted()])
"""


def test_a_first_push_that_fails_before_its_commit_deletes_the_repository_it_made(hub, tmp_path):
    """Issue 88: an interrupted first push left an empty repository. A push that
    made the repository deletes it when the commit fails, or is interrupted
    (Ctrl-C reaches the caller as itself); one into a repository that was there
    keeps it."""
    client, state = hub
    state.fail(r"^POST /api/models/me/new/commit/", 400, times=1)
    failed, interrupted = client.run(_FIRST_PUSH.format(repo="me/new"))
    assert failed[0] == "CheckpointStorageError" and "HTTP 400" in failed[2], failed
    assert "created" not in failed[2], failed
    assert interrupted == "KeyboardInterrupt"
    assert "me/new" not in state.repos
    assert state.requests.count("DELETE /api/repos/delete") == 2
    # A repository that was there before the push is left as it was, empty or not.
    state.put_files("me/old", {})
    state.fail(r"^POST /api/models/me/old/commit/", 400, times=1)
    failed, interrupted = client.run(_FIRST_PUSH.format(repo="me/old"))
    assert failed[0] == "CheckpointStorageError" and interrupted == "KeyboardInterrupt"
    assert "me/old" in state.repos and state.requests.count("DELETE /api/repos/delete") == 2


def test_a_first_push_that_cannot_delete_its_empty_repository_says_how_to(hub, tmp_path):
    client, state = hub
    state.fail(r"^POST /api/models/me/new/commit/", 400, times=1)
    state.fail(r"^DELETE /api/repos/delete", 403, times=1)
    failed, _ = client.run(_FIRST_PUSH.format(repo="me/new"))
    assert failed[0] == "CheckpointStorageError", failed
    assert "HTTP 400" in failed[2] and "created the repository hf://me/new, which is still empty" in failed[2]
    assert "huggingface_hub.delete_repo('me/new')" in failed[2]
    # The next push (the deletion no longer refused) commits into the repository left.
    assert re.fullmatch(r"[0-9a-f]{40}", str(client.run("emit(eqx_ckpt.push_to_hub({'w': np.ones(3)}, 'me/new'))")))
    assert "me/new" in state.repos


def test_a_cold_load_downloads_the_structure_record_once(hub, tmp_path):
    """Issue 88: a cold `Checkpoint("hf://...").load()` downloaded
    `eqx_ckpt.json` twice (read by the open, then again into the cache)."""
    client, state = hub
    commit = push(client, "me/model", 1.0, tmp_path)
    oid = state.repos["me/model"].commits[commit]["eqx_ckpt.json"]
    state.sent.clear()
    got = client.run(
        "emit(jax.tree.map(lambda x: np.asarray(x, np.float32).tolist(), eqx_ckpt.Checkpoint('hf://me/model').load()))"
    )
    assert got == _as_lists(tree(1.0))
    record = len(state.blobs[oid])
    assert state.sent.get(oid, 0) + state.sent.get("eqx_ckpt.json", 0) == record, (state.sent, record)


def test_the_shared_server_is_reset_to_an_empty_hub(hub, hub_session):
    """The Hub server serves every test of a worker (tests/conftest.py): its
    reset leaves nothing of a test for the next, repositories, failures,
    hostile answers, the mirror mode and the counts; a request still being
    answered keeps to the state it began with."""
    import urllib.error
    import urllib.request

    _, state = hub
    state.put_files("me/left", {"a.txt": b"left"})
    state.fail("GET /api/models/me/other", 503)
    entered, release = threading.Event(), threading.Event()

    def held(info: dict) -> dict:  # (the model info's answer waits here, in the server)
        entered.set()
        release.wait(30)
        return info

    state.hostile["me/left"] = hub_server.Hostile(info=held)
    state.mirror = True
    with urllib.request.urlopen(f"{hub_session.url}/me/left/resolve/main/a.txt") as answer:
        assert answer.read() == b"left"
    assert state.requests and state.sent
    stalled: list = []

    def ask() -> None:
        with urllib.request.urlopen(f"{hub_session.url}/api/models/me/left/revision/main") as answer:
            stalled.append(answer.status)

    asking = threading.Thread(target=ask)
    asking.start()
    assert entered.wait(30)
    new = hub_session.reset()
    release.set()
    asking.join()
    assert stalled == [200] and new is hub_session.hub and new is not state
    assert (new.repos, new.blobs, new.failures, new.hostile, new.mirror) == ({}, {}, [], {}, False)
    assert (new.sent, new.ranges, new.received, new.requests) == ({}, [], 0, [])
    assert new.storage == state.storage
    for path in ("/api/models/me/left", "/api/models/me/other"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(hub_session.url + path)
        refused.value.close()  # (its answer holds the connection)
        assert refused.value.code == 404, path
