"""The `hf://` loader as untrusted input: a hostile repository or Hub server
writes nothing outside the cache, hangs nothing and exhausts nothing.

Each test serves hostile answers from the local Hub server (`hub_server.Hostile`:
model info rewritten, headers and bytes replaced, answers delayed or dripped)
to loads run in fresh processes (`test_hub.Client`), and asserts only eqx_ckpt
errors, no file written outside `HF_HOME`, bounded time and memory."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import random
import time

import hub_server
import pytest
from hub_client import Client

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)

# The code the loads run: `attempt(path)` loads `path` whole (`whole=False`: opens
# it, reading by ranges) and says what it raised, its time and its peak memory.
_ATTEMPT = """
import resource, time
def attempt(path, whole=True):
    like = {"w": jax.ShapeDtypeStruct((4096,), jnp.uint8)}
    start = time.perf_counter()
    said = raised(lambda: eqx_ckpt.tree_deserialise_leaves(path, like) if whole else eqx_ckpt.Checkpoint(path))
    return [said, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024]
"""


def safetensors(tensors: dict[str, bytes]) -> bytes:
    """A safetensors file of `uint8` tensors."""
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(tensors.values())


def model(repo: str) -> bytes:
    """A file of one 4 KiB tensor `w` (an LFS file for the server), its bytes
    the repository's own (the server applies a repository's hostility to the
    blobs it holds)."""
    return safetensors({"w": hashlib.sha256(repo.encode()).digest() * 128})


@pytest.fixture
def hub(hub_session, tmp_path):
    """A client whose `HF_HOME` is `tmp_path/home/hf` (`outside` lists what
    appeared elsewhere under `tmp_path`), and the state of the Hub server
    (tests/conftest.py), new and empty for this test."""
    (tmp_path / "home").mkdir()
    state = hub_session.reset()
    yield Client(hub_session.url, tmp_path / "home" / "hf"), state
    hub_session.reset()


def outside(tmp_path: pathlib.Path) -> list[str]:
    """The files under `tmp_path` but outside `HF_HOME` (nothing a load may write)."""
    home = tmp_path / "home" / "hf"
    found = []
    for base, _, names in os.walk(tmp_path):
        for name in names:
            path = pathlib.Path(base, name)
            if home not in path.parents:
                found.append(str(path.relative_to(tmp_path)))
    return found


def run(client: Client, calls: list[str], **env: str) -> list:
    """`attempt(...)` of each call, in one process."""
    return client.run(_ATTEMPT + f"emit([{', '.join(calls)}])", **env)


def is_eqx_error(said: list | None, kind: str = "CheckpointError") -> bool:
    return said is not None and kind in said[1] and "\x1b" not in said[2] and len(said[2]) < 4000


def test_a_servers_etag_or_commit_header_writes_nothing_outside_the_cache(hub, tmp_path):
    """`ETag`, `X-Linked-Etag` and `X-Repo-Commit` name cache files in
    huggingface_hub: a hostile one is refused before anything is written, on
    a whole load and on a range read."""
    client, state = hub
    escapes = "../../../../outside_blob"
    hostile = {
        "etag": {"ETag": f'"{escapes}"', "X-Linked-Etag": f'"{escapes}"'},
        "linked": {"X-Linked-Etag": f'W/"{escapes}"'},
        "commit": {"X-Repo-Commit": "../../../../outside_commit"},
        "escape": {"X-Repo-Commit": "\x1b[2J" + "a" * 39},
    }
    for name, headers in hostile.items():
        state.put_files(
            f"bad/{name}", {"model.safetensors": model(f"bad/{name}"), "small.safetensors": safetensors({"w": b"1"})}
        )
        state.hostile[f"bad/{name}"] = hub_server.Hostile(headers=headers)
    calls = [f"attempt('hf://bad/{n}')" for n in hostile] + [f"attempt('hf://bad/{n}', False)" for n in hostile]
    results = run(client, calls)
    for (said, _, _), call in zip(results, calls):
        assert is_eqx_error(said, "CheckpointStorageError"), (call, said)
    assert outside(tmp_path) == []


def test_model_info_values_are_checked_before_use(hub):
    """A commit, a file name, a size or a digest of the model info that is not
    what the Hub writes is a `CheckpointStorageError` naming it, escaped. A
    model info listing no sizes (a mirror's) is read from the tree listing
    instead, whose values are checked the same way."""
    client, state = hub

    def sibling(key: str, value: object):
        def rewrite(info: dict) -> dict:
            info["siblings"] = [{**s, key: value} for s in info["siblings"]]
            return info

        return rewrite

    def info_sha(info: dict) -> dict:
        return {**info, "sha": "\x1b]0;forged\x07" + "b" * 30}

    def lfs(info: dict) -> dict:
        info["siblings"] = [{**s, "lfs": {"sha256": "../x", "size": 1, "pointerSize": 1}} for s in info["siblings"]]
        return info

    def big(entry: dict) -> dict:
        return {**entry, "size": "big"}

    state.put_files("me/nosize", {"model.safetensors": model("me/nosize")})
    state.hostile["me/nosize"] = hub_server.Hostile(info=sibling("size", None))
    state.put_files("bad/tree", {"model.safetensors": model("bad/tree")})
    state.hostile["bad/tree"] = hub_server.Hostile(info=sibling("size", None), tree=big)
    rewrites = {
        "size": sibling("size", "big"),
        "name": sibling("rfilename", "../../model.safetensors"),
        "blob": sibling("blobId", "../../x"),
        "lfs": lfs,
        "sha": info_sha,
    }
    for name, rewrite in rewrites.items():
        state.put_files(f"bad/{name}", {"model.safetensors": model(f"bad/{name}")})
        state.hostile[f"bad/{name}"] = hub_server.Hostile(info=rewrite)
    results = run(client, [f"attempt('hf://bad/{n}', False)" for n in [*rewrites, "tree"]])
    for name, (said, _, _) in zip([*rewrites, "tree"], results):
        assert is_eqx_error(said, "CheckpointStorageError"), (name, said)
    assert "the size 'big' for `model.safetensors`" in results[-1][0][2]
    assert run(client, ["attempt('hf://me/nosize', False)"])[0][0] is None


def test_names_the_library_refuses_are_value_errors(hub):
    """A repository name huggingface_hub refuses is the user's mistake, said so."""
    client, _ = hub
    results = run(client, ["attempt('hf://a--b/c', False)", "attempt('hf://me/x y', False)"])
    for said, _, _ in results:
        assert said is not None and "CheckpointError" in said[1] and "after 3 tries" not in said[2], said


def test_tensors_are_counted_before_headers_are_parsed(hub):
    """Two shards of 70,000 tiny tensors each (more than `MAX_TENSORS` in all)
    are refused before a header is parsed; and a tensor name of 1 MiB is not
    echoed whole."""
    client, state = hub
    shards = {f"model-{i:05d}-of-00002.safetensors": {f"s{i}.t{j}": b"\0" for j in range(70_000)} for i in range(2)}
    index = {"weight_map": {t: f for f, tensors in shards.items() for t in tensors}}
    files = {f: safetensors(t) for f, t in shards.items()}
    state.put_files("bad/many", {**files, "model.safetensors.index.json": json.dumps(index).encode()})
    long = "x" * 2**20
    body = safetensors({"w": b"\0" * 8})
    state.put_files("bad/long", {"model.safetensors": body.replace(b'"w"', b'"' + long.encode() + b'"', 1)})
    (many, took, _), (named, _, _) = run(client, ["attempt('hf://bad/many', False)", "attempt('hf://bad/long')"])
    assert is_eqx_error(many, "CorruptCheckpointError") and "tensors allowed" in many[2], many
    assert took < 60
    assert is_eqx_error(named), named


def test_small_files_are_refused_by_their_listed_size_before_any_read(hub):
    """An index or an `eqx_ckpt.json` the Hub lists larger than eqx_ckpt reads
    is refused without a byte of it fetched."""
    client, state = hub

    def listed(name: str, size: int):
        def rewrite(info: dict) -> dict:
            for s in info["siblings"]:
                if s["rfilename"] == name:
                    s["size"] = size
            return info

        return rewrite

    index = json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode()
    state.put_files(
        "bad/index", {"model-00001-of-00001.safetensors": model("bad/index"), "model.safetensors.index.json": index * 4}
    )
    state.hostile["bad/index"] = hub_server.Hostile(info=listed("model.safetensors.index.json", 127 * 2**20))
    state.put_files("bad/record", {"model.safetensors": model("bad/record"), "eqx_ckpt.json": b"{}"})
    state.hostile["bad/record"] = hub_server.Hostile(info=listed("eqx_ckpt.json", 270 * 2**20))
    results = run(client, ["attempt('hf://bad/index')", "attempt('hf://bad/record')"])
    for said, _, _ in results:
        assert is_eqx_error(said, "CorruptCheckpointError") and "listed at" in said[2], said
    fetched = [r for r in state.requests if "/resolve/" in r and r.startswith("GET")]
    assert not [r for r in fetched if "index.json" in r or "eqx_ckpt.json" in r], fetched


def test_an_index_naming_other_files_downloads_nothing(hub):
    """An index naming a pickle, code or a configuration as its shards is
    refused before anything is downloaded."""
    client, state = hub
    others = ["pytorch_model.bin", "modeling_evil.py", "config.json"]
    for i, other in enumerate(others):
        index = json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors", "v": other}}).encode()
        files = {
            "model-00001-of-00001.safetensors": model(f"bad/other{i}"),
            "model.safetensors.index.json": index,
            other: b"x" * 2048,
        }
        state.put_files(f"bad/other{i}", files)
    results = run(client, [f"attempt('hf://bad/other{i}')" for i in range(len(others))])
    for said, _, _ in results:
        assert is_eqx_error(said, "CorruptCheckpointError") and "no safetensors files" in said[2], said
    assert not [r for r in state.requests if any(o in r for o in others)]


def test_an_index_naming_more_shards_than_allowed_reads_and_downloads_none(hub):
    """An index naming more than `MAX_SHARDS` shards is refused before a shard
    is read or downloaded: ten thousand shards of one tensor took minutes to
    open, a request or more each."""
    from eqx_ckpt._ondisk._format import MAX_SHARDS

    client, state = hub
    count = MAX_SHARDS + 1
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    files = {name: safetensors({f"t{i}": b"\0"}) for i, name in enumerate(names)}
    index = json.dumps({"weight_map": {f"t{i}": name for i, name in enumerate(names)}}).encode()
    state.put_files("bad/shards", {**files, "model.safetensors.index.json": index})
    results = run(client, ["attempt('hf://bad/shards', False)", "attempt('hf://bad/shards')"])
    for said, took, _ in results:
        assert is_eqx_error(said, "CorruptCheckpointError"), said
        assert f"names {count} shards, more than the {MAX_SHARDS} eqx_ckpt reads" in said[2], said
        assert took < 60
    assert not [r for r in state.requests if "/resolve/" in r and "-of-" in r]


def test_range_answers_are_exactly_the_bytes_asked_for(hub):
    """A range answered gzip-encoded (a bomb), or with more bytes than asked,
    is refused with an eqx_ckpt error, in bounded memory. One answered with
    the whole file (a server ignoring `Range`) is not taken as the range: the
    file is downloaded whole into the cache, then read there."""
    client, state = hub
    answers = {"bomb": {"bomb": 64 * 2**20}, "longer": {"extra": b"x" * 64}, "ignored": {"ignore_range": True}}
    for name, options in answers.items():
        state.put_files(f"bad/{name}", {"model.safetensors": model(f"bad/{name}")})
        state.hostile[f"bad/{name}"] = hub_server.Hostile(**options)  # type: ignore[arg-type]
    results = run(client, [f"attempt('hf://bad/{n}', False)" for n in answers])
    for name, (said, _, _) in zip(answers, results[:2]):
        assert is_eqx_error(said, "CheckpointStorageError"), (name, said)
    assert results[0][2] < 1500  # MiB of peak RSS
    assert results[2][0] is None and list((client.home / "hub" / "models--bad--ignored").rglob("*.safetensors"))


def test_a_stalled_or_dripping_server_is_a_connection_error_within_seconds(hub):
    """A server that never answers, or drips a byte a second, is a
    `CheckpointConnectionError` within seconds of `HF_HUB_DOWNLOAD_TIMEOUT`;
    a `Retry-After: 3600` is honoured for seconds, not an hour."""
    client, state = hub
    state.put_files("bad/silent", {"model.safetensors": model("bad/silent")})
    state.hostile["bad/silent"] = hub_server.Hostile(stall=float("inf"))
    state.put_files("bad/silentfile", {"model.safetensors": model("bad/silentfile")})
    state.hostile["bad/silentfile"] = hub_server.Hostile(stall=float("inf"), on="resolve/")
    state.put_files("bad/drip", {"model.safetensors": model("bad/drip")})
    state.hostile["bad/drip"] = hub_server.Hostile(drip=0.5)
    state.put_files("me/limited", {"model.safetensors": model("me/limited")})
    state.fail(r"^HEAD /me/limited/resolve/", 429, times=1, headers={"Retry-After": "3600"})
    names = ["bad/silent", "bad/silentfile", "bad/drip"]
    results = run(
        client, [f"attempt('hf://{n}')" for n in names] + ["attempt('hf://me/limited')"], HF_HUB_DOWNLOAD_TIMEOUT="2"
    )
    for name, (said, took, _) in zip(names, results):
        assert is_eqx_error(said, "CheckpointConnectionError"), (name, said)
        assert took < 20, (name, took)
    said, took, _ = results[-1]
    assert said is None and took < 20, (said, took)


def test_bytes_that_are_not_the_commits_are_refused_on_a_whole_load(hub, tmp_path):
    """Other bytes of the same size, served or swapped into the cache, and a
    snapshot entry turned into a link out of the cache, are refused."""
    client, state = hub
    state.put_files("bad/served", {"model.safetensors": model("bad/served")})
    state.hostile["bad/served"] = hub_server.Hostile(body=lambda path, data: data[:-1] + bytes([data[-1] ^ 1]))
    state.put_files("me/swapped", {"model.safetensors": model("me/swapped")})
    state.put_files("me/linked", {"model.safetensors": model("me/linked")})
    first = run(client, ["attempt('hf://bad/served')", "attempt('hf://me/swapped')", "attempt('hf://me/linked')"])
    assert is_eqx_error(first[0][0], "CorruptCheckpointError") and "SHA-256" in first[0][0][2], first[0]
    assert first[1][0] is None and first[2][0] is None, first
    cache = client.home / "hub"
    (blob,) = (cache / "models--me--swapped" / "blobs").iterdir()
    held = model("me/swapped")
    blob.write_bytes(held[:-1] + bytes([held[-1] ^ 1]))
    (entry,) = (cache / "models--me--linked" / "snapshots").glob("*/model.safetensors")
    (tmp_path / "elsewhere.safetensors").write_bytes(model("me/linked"))
    entry.unlink()
    entry.symlink_to(tmp_path / "elsewhere.safetensors")
    again = run(client, ["attempt('hf://me/swapped')", "attempt('hf://me/linked')"])
    assert is_eqx_error(again[0][0], "CorruptCheckpointError") and "SHA-256" in again[0][0][2], again
    assert is_eqx_error(again[1][0], "CorruptCheckpointError") and "out of the cache" in again[1][0][2], again


def _fuzzed(rng: random.Random) -> hub_server.Hostile:
    """A random hostile model info or file header."""
    values = [
        None,
        -1,
        2**70,
        "big",
        "",
        "../x",
        "/etc/passwd",
        "\x1b[31m",
        "a" * 5000,
        [],
        {},
        "0" * 40,
        "f" * 64,
        1.5,
        True,
    ]
    keys = ["sha", "siblings"]
    sibling_keys = ["rfilename", "size", "blobId", "lfs"]
    headers = ["ETag", "X-Linked-Etag", "X-Repo-Commit", "X-Linked-Size", "Content-Range", "Location", "Retry-After"]
    kind = rng.choice(["info", "sibling", "header"])
    value = rng.choice(values)
    if kind == "info":
        key = rng.choice(keys)
        return hub_server.Hostile(info=lambda info: {**info, key: value})
    if kind == "sibling":
        key = rng.choice(sibling_keys)
        return hub_server.Hostile(info=lambda info: {**info, "siblings": [{**s, key: value} for s in info["siblings"]]})
    text = value if isinstance(value, str) and value.isprintable() and len(value) < 200 else "../../outside"
    return hub_server.Hostile(headers={rng.choice(headers): text})


def test_fuzzed_model_info_and_headers_give_only_eqx_ckpt_errors(hub, tmp_path):
    """Random hostile model infos and headers: each load loads or raises an
    eqx_ckpt error, in bounded time and memory, and nothing is written outside
    `HF_HOME`."""
    client, state = hub
    rng = random.Random(66)
    cases = 12
    for i in range(cases):
        state.put_files(f"fuzz/r{i}", {"model.safetensors": model(f"fuzz/r{i}")})
        state.hostile[f"fuzz/r{i}"] = _fuzzed(rng)
    start = time.monotonic()
    results = run(client, [f"attempt('hf://fuzz/r{i}', {i % 2 == 0})" for i in range(cases)])
    for i, (said, took, rss) in enumerate(results):
        assert said is None or is_eqx_error(said), (i, said)
        assert took < 30 and rss < 2000, (i, took, rss)
    assert time.monotonic() - start < 120
    assert outside(tmp_path) == []


def test_a_users_own_hub_calls_are_not_checked(hub):
    """The checks are eqx_ckpt's, for its own requests: a user's own
    `huggingface_hub` calls, from another thread while an eqx_ckpt load waits
    on the server and after it, get what the server answers (an ETag that is
    no blob id, a range answered whole), which eqx_ckpt refuses for itself."""
    client, state = hub
    state.put_files("slow/model", {"model.safetensors": model("slow/model")})
    # (Its first request stalled, the revision's: the user's calls are made
    # meanwhile; the load's later requests are answered at once.)
    state.hostile["slow/model"] = hub_server.Hostile(on="GET /api/models/slow/model/revision/main", stall=2.5)
    for repo in ("user/files", "own/files"):
        state.put_files(repo, {"small.safetensors": safetensors({"w": b"1"})})
        state.hostile[repo] = hub_server.Hostile(headers={"ETag": '"no-blob-id"'}, ignore_range=True)
    code = """
import threading, huggingface_hub
def users_calls():
    path = huggingface_hub.hf_hub_download("user/files", "small.safetensors")
    url = huggingface_hub.hf_hub_url("user/files", "small.safetensors")
    ranged = huggingface_hub.get_session().get(url, headers={"Range": "bytes=0-3"})
    return [os.path.getsize(path), ranged.status_code]
loaded = []
loading = threading.Thread(target=lambda: loaded.append(attempt("hf://slow/model")[0]))
loading.start()
while not loading.is_alive():
    pass
during = users_calls() + [loading.is_alive()]
loading.join()
after = users_calls()
emit([during, loaded, after, attempt("hf://own/files")[0]])
"""
    during, loaded, after, own = client.run(_ATTEMPT + code)
    assert during[2] is True, "the user's calls ended after the load"
    assert during[:2] == after == [len(safetensors({"w": b"1"})), 200]
    assert loaded == [None]
    assert is_eqx_error(own, "CheckpointStorageError"), own
