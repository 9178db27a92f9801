"""Checkpoints on an S3-compatible object store (moto, started on 127.0.0.1)."""

import json
import os
import re
import subprocess
import sys
import urllib.request

import equinox as eqx
import http_server
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import s3_server
import stores
import tensorstore as ts
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base._location import location
from eqx_ckpt._store import _lease, _storage


def _keys(s3, spec):
    """Every object under the checkpoint, relative to it."""
    bucket = ts.KvStore.open({**s3.spec(""), "path": ""}).result()
    prefix = spec["path"]
    return sorted(k.decode()[len(prefix) :] for k in bucket.list().result() if k.decode().startswith(prefix))


def _tree(step):
    return {
        "model": {
            "encoder": {
                "w": np.arange(24, dtype=np.float32).reshape(4, 6) + step,
                "b": jnp.full(6, step, dtype=jnp.int32),
            }
        },
        "opt_state": {"mu": np.full((4, 6), 0.5 * step)},
        "step": step,
    }


def test_url_and_spec_name_the_same_store(monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)  # (which adds `aws_credentials`: below)
    url = location("s3://eqx-ckpt-test/runs/a")
    spec = location({"driver": "s3", "bucket": "eqx-ckpt-test", "path": "runs/a", "endpoint": "http://127.0.0.1:9"})
    assert url.kvstore == {"driver": "s3", "bucket": "eqx-ckpt-test", "path": "runs/a/"}
    assert {k: v for k, v in spec.kvstore.items() if k != "endpoint"} == url.kvstore
    assert spec.display == "s3://eqx-ckpt-test/runs/a" and spec.local is None
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match="not a kvstore spec TensorStore understands"):
        location({"driver": "s3"})


_NO_SDK_NOISE = """
import sys
import eqx_ckpt
try:
    eqx_ckpt.Checkpoint(sys.argv[1])
except eqx_ckpt.CheckpointConnectionError as e:
    print(e)
"""


def test_keys_in_the_environment_are_used_without_the_sdks_errors_on_stderr(tmp_path, monkeypatch):
    """With the access keys in the environment and no `~/.aws` files, the AWS
    SDK's default chain printed five lines of its own errors (no config file,
    no credentials file) before eqx_ckpt's message. The keys are named as the
    credentials to use, so nothing but that message comes out."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env.update(
        HOME=str(tmp_path),  # no ~/.aws there
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_ENDPOINT_URL=http_server.refused_url("").rstrip("/"),
    )
    url = "s3://eqx-ckpt-test/run/ckpt"
    done = subprocess.run(
        [sys.executable, "-c", _NO_SDK_NOISE, url], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.stdout.startswith(f"Cannot reach {url!r}: "), (done.stdout, done.stderr)
    assert done.stderr == "", done.stderr
    # Only with both keys set, and a spec's own choice stays.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert location(url).kvstore["aws_credentials"] == {"type": "environment"}
    own = location({"driver": "s3", "bucket": "eqx-ckpt-test", "aws_credentials": {"type": "anonymous"}})
    assert own.kvstore["aws_credentials"] == {"type": "anonymous"}
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "aws_credentials" not in location(url).kvstore


def test_save_load_overwrite(s3, store):
    first = _tree(1)
    eqx_ckpt.tree_serialise_leaves(store, first)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, first), first, typematch=True)
    assert "manifest.json" in _keys(s3, store) and "saving.json" not in _keys(s3, store)
    assert "packed.float32/zarr.json" in _keys(s3, store)  # small leaves are packed, one array per dtype

    second = _tree(2)
    eqx_ckpt.tree_serialise_leaves(store, second)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, first), second, typematch=True)
    # The overwrite went to a new data root, and the old arrays were deleted
    # (delete_range over a prefix works on the object store).
    keys = _keys(s3, store)
    root = json.loads(ts.KvStore.open(store).result().read("manifest.json").result().value)["data_root"]
    assert f"{root}/packed.float32/zarr.json" in keys
    assert [k for k in keys if not k.startswith(f"{root}/")] == ["manifest.json"]

    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("`overwrite=False`")):
        eqx_ckpt.tree_serialise_leaves(store, first, overwrite=False)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, first), second, typematch=True)


def test_partial_load(store):
    tree = _tree(3)
    eqx_ckpt.tree_serialise_leaves(store, tree)
    like = eqx.filter_eval_shape(lambda: _tree(0))
    out = eqx_ckpt.tree_deserialise_leaves(store, like, where=lambda t: t["model"])
    # Loaded into an abstract skeleton, every leaf comes back as a jax.Array.
    assert tree_equal(out["model"], jax.tree.map(jnp.asarray, tree["model"]), typematch=True)
    assert out["opt_state"] == like["opt_state"] and out["step"] == like["step"]

    encoder = eqx_ckpt.tree_deserialise_leaves(store, _tree(0)["model"]["encoder"], prefix="model.encoder")
    assert tree_equal(encoder, tree["model"]["encoder"], typematch=True)


def test_checkpoint_inspection_and_lazy_reads(store):
    tree = _tree(4)
    eqx_ckpt.tree_serialise_leaves(store, tree)
    ckpt = eqx_ckpt.Checkpoint(store)
    assert sorted(ckpt.keys()) == ["model.encoder.b", "model.encoder.w", "opt_state.mu", "step"]
    w = ckpt["model.encoder.w"]
    assert (w.shape, w.dtype, w.nbytes) == ((4, 6), np.dtype(np.float32), 96)
    np.testing.assert_array_equal(w[1:3, 2:4], tree["model"]["encoder"]["w"][1:3, 2:4])
    lazy = eqx_ckpt.tree_deserialise_leaves(store, tree, lazy=True)
    assert isinstance(lazy["opt_state"]["mu"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), tree, typematch=True)


def test_not_a_checkpoint_is_never_written_into(s3, store):
    kv = ts.KvStore.open(store).result()
    kv.write("notes.txt", b"someone else's").result()
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match="is not an eqx_ckpt checkpoint"):
        eqx_ckpt.tree_serialise_leaves(store, _tree(1))
    assert _keys(s3, store) == ["notes.txt"]


def test_failed_writes_commit_nothing(s3, store):
    before = _tree(1)
    eqx_ckpt.tree_serialise_leaves(store, before)
    manifest = ts.KvStore.open(store).result().read("manifest.json").result().value
    s3.gate.refuse = True  # the server refuses every chunk PUT, with 403 AccessDenied
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match=re.escape("nothing was committed")) as info:
        eqx_ckpt.tree_serialise_leaves(store, _tree(2))
    assert "AccessDenied" in str(info.value) and "Check that you may write there" in str(info.value)
    assert not isinstance(info.value, eqx_ckpt.LeafError)
    s3.gate.reset()
    assert ts.KvStore.open(store).result().read("manifest.json").result().value == manifest
    assert not any(k.startswith("gen.") or k == "saving.json" for k in _keys(s3, store))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, before), before, typematch=True)


def _what_a_put_writes(path: str) -> str:
    """A pattern for the kind of file a PUT of `path` writes: its name, with
    any generated id in it (a save's data root, a lease's) matched by any."""
    if "/c/" in path or path.endswith("/c"):
        return "/c(/|$)"
    name = path.rsplit("/", 1)[-1]
    return re.sub(r"[0-9a-f]{6,}", "[0-9a-f]+", re.escape(name)) + "$"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_save_the_storage_refuses_at_any_write_is_a_storage_error(s3, store, blocking):
    """403 AccessDenied on each kind of file a save writes (the lease, group and
    array metadata, chunks, the manifest...), one at a time: a
    `CheckpointStorageError` (never a `LeafError`) and nothing committed."""
    before = _tree(1)
    eqx_ckpt.tree_serialise_leaves(store, before)
    s3.gate.puts.clear()
    eqx_ckpt.tree_serialise_leaves(store, before)
    kinds = sorted({_what_a_put_writes(path) for path in s3.gate.puts})
    assert {"/c(/|$)", "manifest\\.json$", "saving\\.json$", "zarr\\.json$"} <= set(kinds), kinds
    for kind in kinds:
        s3.gate.forbidden_puts = kind
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match="AccessDenied") as info:
            pending = eqx_ckpt.tree_serialise_leaves(store, _tree(2), blocking=blocking)
            if pending is not None:
                pending.wait()
        assert not isinstance(info.value, eqx_ckpt.LeafError), kind
        message = str(info.value)
        # What failed (the save as a whole, or the file that could not be written),
        # and what it left: nothing.
        assert "nothing was committed" in message or "so nothing was written" in message, (kind, message)
        named = {"manifest\\.json$": "manifest.json", "saving\\.json$": "saving.json"}.get(kind)
        if named is not None:
            assert f"Cannot write {named!r} in" in message, (kind, message)
        if named == "manifest.json":
            assert "any checkpoint there before is unchanged" in message, message
        assert store["path"] in message, (kind, message)
        s3.gate.reset()
        assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, before), before, typematch=True), kind
    eqx_ckpt.tree_serialise_leaves(store, _tree(2))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, _tree(2)), _tree(2), typematch=True)


@pytest.mark.parametrize(
    "refused",
    ["/manifest.json", "/big/c/", "/big/zarr.json", "/zarr.json"],
    ids=["manifest", "chunk", "leaf-metadata", "group-metadata"],
)
def test_storage_that_refuses_reads_is_a_storage_error_never_damage(s3, store, refused):
    """Expired credentials (403 AccessDenied on a read) once made a load raise an
    `IntegrityError` ("damaged") or a bare TensorStore error, and made `verify`
    report a sound checkpoint as damaged. The checkpoint is whole: a
    `CheckpointStorageError` naming what could not be read, from every call."""
    tree = {"w": np.arange(4, dtype=np.float32), "big": np.arange(300_000, dtype=np.float32)}
    eqx_ckpt.tree_serialise_leaves(store, tree)
    s3.gate.forbidden = store["path"] + refused.lstrip("/") if refused == "/zarr.json" else refused
    calls = {
        "load": lambda: eqx_ckpt.tree_deserialise_leaves(store, tree),
        "load_or_initialise": lambda: eqx_ckpt.load_or_initialise(store, lambda: tree),
        "verify": lambda: eqx_ckpt.verify(store),
    }
    if refused.endswith("zarr.json"):  # only `verify` reads the arrays' and groups' metadata
        calls = {"verify": calls["verify"]}
    what = {"/manifest.json": "'manifest.json'", "/big/c/": "leaf `big`"}.get(refused, repr(refused.lstrip("/")))
    for name, call in calls.items():
        with pytest.raises(eqx_ckpt.CheckpointStorageError, match="PERMISSION_DENIED") as info:
            call()
        message = str(info.value)
        assert not isinstance(info.value, (eqx_ckpt.IntegrityError, FileNotFoundError)), name
        assert f"would not serve {what} of checkpoint" in message, (name, message)
        assert "may well be whole" in message and "AccessDenied" in message, (name, message)
    s3.gate.reset()
    assert eqx_ckpt.verify(store) == []
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, tree), tree, typematch=True)


_KILLED_SAVE = """
import json, os, sys
import numpy as np
import eqx_ckpt
from eqx_ckpt._base import _faults

def write_conditional(loc, name):
    if name == "manifest.json":
        os._exit(17)  # killed after every array, before the manifest

tree = {"model": {"encoder": {"w": np.full((4, 3), 2.0, np.float32)}}}
with _faults.armed("commit.manifest_write", write_conditional):
    eqx_ckpt.tree_serialise_leaves(json.loads(sys.argv[1]), tree)
"""


def test_killed_save_is_invisible_and_its_lease_goes_stale(s3, store, monkeypatch):
    """A process killed after writing every array but before the manifest: no
    cleanup runs. Readers still see the previous checkpoint, whole; the next
    save waits until the dead writer's lease is stale, then clears its arrays."""
    before = _tree(1)
    eqx_ckpt.tree_serialise_leaves(store, before)
    result = subprocess.run([sys.executable, "-c", _KILLED_SAVE, json.dumps(store)], capture_output=True, text=True)
    assert result.returncode == 17, result.stderr
    keys = _keys(s3, store)
    dead = {k.split("/")[0] for k in keys if k.startswith("gen.")}
    assert len(dead) == 1 and "saving.json" in keys  # the new arrays were written...
    manifest = json.loads(ts.KvStore.open(store).result().read("manifest.json").result().value)
    assert manifest["data_root"] == ""  # ...but the manifest still points at the old ones
    assert sorted(eqx_ckpt.Checkpoint(store).keys()) == ["model.encoder.b", "model.encoder.w", "opt_state.mu", "step"]
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, before), before, typematch=True)

    # The next save waits `STALE_SECONDS` without a heartbeat, then takes over.
    monkeypatch.setattr(_lease, "STALE_SECONDS", 1.0)
    after = _tree(3)
    eqx_ckpt.tree_serialise_leaves(store, after)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, after), after, typematch=True)
    keys = _keys(s3, store)
    assert "saving.json" not in keys and not any(k.split("/")[0] in dead for k in keys)


def test_a_live_writer_in_another_process_is_refused(s3, store, monkeypatch):
    """Across processes an object store has no lock: the lease's heartbeat tells
    a live writer from a dead one. (The other process is stood in for by a lease
    this process does not know it holds.)"""
    eqx_ckpt.tree_serialise_leaves(store, _tree(1))
    monkeypatch.setattr(_lease, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(_lease, "STALE_SECONDS", 3.0)
    other, _ = _lease.acquire(location(store), "saving.json", what="save")
    # As if it were held elsewhere: forgotten by this process's record of the leases it holds.
    monkeypatch.delitem(_lease._held, next(key for key, lease in _lease._held.items() if lease is other))
    try:
        refused = r"Another save is writing to .*lock file is being renewed"
        with pytest.raises(eqx_ckpt.CheckpointExistsError, match=refused):
            eqx_ckpt.tree_serialise_leaves(store, _tree(2))
    finally:
        other.release()
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, _tree(0)), _tree(1), typematch=True)
    eqx_ckpt.tree_serialise_leaves(store, _tree(2))  # once released, saves go ahead
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, _tree(0)), _tree(2), typematch=True)


def test_remove_and_list_names(store):
    loc = location(store)
    kv = ts.KvStore.open(store).result()
    for key in ["a/zarr.json", "a/c/0", "ab/zarr.json", "a.txt", "b"]:
        kv.write(key, b"x").result()
    assert _storage.list_names(loc) == ["a", "a.txt", "ab", "b"]
    _storage.remove(loc, ["a", "b"])
    # "a" went with everything below it; "ab" and "a.txt" share its first letter and stayed.
    assert _storage.list_names(loc) == ["a.txt", "ab"]
    assert sorted(kv.list().result()) == [b"a.txt", b"ab/zarr.json"]


def test_remove_written_keeps_other_objects_under_the_same_prefix(store):
    loc = location(store)
    kv = ts.KvStore.open(store).result()
    ours = ["a/zarr.json", "a/w/zarr.json", "a/w/c/0/1", "a/w/c/2/0.__lock", "packed.int8/c/0"]
    theirs = ["a/README.txt", "a/w/c/notes", "ab/zarr.json", "packed.int8/why"]
    for key in ours + theirs:
        kv.write(key, b"x").result()
    _storage.remove_written(loc, ["a", "packed.int8"])
    # Only the files a save writes went; "ab" shares the prefix "a" and stayed.
    assert sorted(k.decode() for k in kv.list().result()) == sorted(theirs)


@pytest.mark.usefixtures("unpacked")  # the leaves have folders (here, prefixes) of their own
def test_an_overwrite_keeps_a_users_object_in_an_old_folder(s3, store):
    eqx_ckpt.tree_serialise_leaves(store, _tree(1))
    kv = ts.KvStore.open(store).result()
    kv.write("model/README.txt", b"mine").result()
    eqx_ckpt.tree_serialise_leaves(store, _tree(2))
    root = json.loads(kv.read("manifest.json").result().value)["data_root"]
    assert [k for k in _keys(s3, store) if not k.startswith(f"{root}/")] == ["manifest.json", "model/README.txt"]
    assert kv.read("model/README.txt").result().value == b"mine"
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, _tree(0)), _tree(2), typematch=True)


def test_manager_on_s3(s3, store):
    manager = eqx_ckpt.CheckpointManager(store, max_to_keep=2)
    for step in range(4):
        manager.save(step, _tree(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert tree_equal(manager.restore(_tree(0)), _tree(3), typematch=True)
    # Retention deleted the objects of the steps it dropped.
    assert {k.split("/")[0] for k in _keys(s3, store) if "/" in k} == {"step_00000002", "step_00000003"}


HUGE = 10**12


def _make_absurd(store, *, huge_chunks):
    """A checkpoint whose manifest and zarr.json both claim leaf `a` holds 10^12
    float32 (4 TB), digest recomputed: what a hostile upload could look like."""
    import manifests

    eqx_ckpt.tree_serialise_leaves(store, {"a": np.ones(1000, np.float32), "b": np.arange(3)})
    kv = ts.KvStore.open(store).result()
    chunks = [HUGE] if huge_chunks else [1000]
    body = json.loads(kv.read("manifest.json").result().value)
    (leaf,) = [leaf for leaf in body["leaves"] if leaf["path"] == "a"]
    leaf.update(shape=[HUGE], stored_shape=[HUGE], chunks=chunks)
    body["total_bytes"] += 4 * (HUGE - 1000)
    kv.write("manifest.json", manifests.sign(body)).result()
    metadata = json.loads(kv.read("a/zarr.json").result().value)
    metadata["shape"] = [HUGE]
    metadata["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    kv.write("a/zarr.json", json.dumps(metadata)).result()


@pytest.mark.usefixtures("unpacked")  # `a` has a folder (here, keys) of its own to claim 4 TB
def test_absurd_shape_is_refused_before_any_allocation(store):
    # Without the memory bound, TensorStore's failed allocation aborted the whole
    # process (std::bad_alloc): an object store has no files to count first.
    _make_absurd(store, huge_chunks=False)
    ckpt = eqx_ckpt.Checkpoint(store)
    assert ckpt["a"].shape == (HUGE,)
    refused = r"Leaf `a` in checkpoint .*: reading (this region|it) needs 4000000000000 bytes .* Nothing was read"
    with pytest.raises(eqx_ckpt.IntegrityError, match=refused):
        np.asarray(ckpt["a"])
    with pytest.raises(eqx_ckpt.IntegrityError, match=refused):
        like = {"a": jax.ShapeDtypeStruct((HUGE,), jnp.float32), "b": np.zeros(3, int)}
        eqx_ckpt.tree_deserialise_leaves(store, like)
    # A small region is still read; the chunks beyond the first are missing.
    assert np.array_equal(ckpt["a"][:10], np.ones(10, np.float32))
    with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `a`.*is damaged or incomplete"):
        ckpt["a"][990:1010]
    assert [p.leaf for p in eqx_ckpt.verify(store)] == ["a"]
    # The other leaves still load.
    assert np.array_equal(eqx_ckpt.tree_deserialise_leaves(store, {"b": np.zeros(3, int)})["b"], np.arange(3))


@pytest.mark.usefixtures("unpacked")
def test_absurd_chunk_is_refused_on_open(store):
    _make_absurd(store, huge_chunks=True)
    ckpt = eqx_ckpt.Checkpoint(store)
    refused = r"Leaf `a` .*reading one of its chunks needs 4000000000000 bytes"
    with pytest.raises(eqx_ckpt.IntegrityError, match=refused):
        ckpt["a"][:10]
    (problem,) = eqx_ckpt.verify(store)
    assert problem.leaf == "a" and "one of its chunks" in problem.message


def test_a_huge_manifest_is_refused_without_downloading_it(s3, store):
    eqx_ckpt.tree_serialise_leaves(store, {"w": jnp.ones(3)})
    limit = 2**20
    kvstore = ts.KvStore.open(store).result()
    kvstore.write("manifest.json", b" " * (limit + 10)).result()
    where = location(store)
    s3.gate.gets.clear()
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(f"holds more than {limit} bytes")):
        _storage.read_file(where, "manifest.json", limit=limit)
    manifest_gets = [rng for path, rng in s3.gate.gets if path.endswith("/manifest.json")]
    assert manifest_gets == [f"bytes={limit}-{limit}"]
    # A file within the limit is read whole.
    kvstore.write("small.json", b"{}").result()
    assert _storage.read_file(where, "small.json", limit=limit) == b"{}"
    assert _storage.read_file(where, "absent.json", limit=limit) is None


@pytest.mark.usefixtures("unpacked")  # a folder (here, keys) per leaf, and a group above each
def test_verify_checks_the_group_metadata(s3, store):
    eqx_ckpt.tree_serialise_leaves(store, _tree(1))
    assert eqx_ckpt.verify(store) == []
    kvstore = ts.KvStore.open(store).result()
    kvstore.write("zarr.json", json.dumps({"zarr_format": 3, "node_type": "array"})).result()
    kvstore.delete_range(ts.KvStore.KeyRange("model/zarr.json", "model/zarr.json\0")).result()
    kvstore.write("model/encoder/zarr.json", b"\x00\xff garbage").result()
    kvstore.write("opt_state/zarr.json", b" " * (2**20 + 10)).result()
    s3.gate.gets.clear()
    problems = eqx_ckpt.verify(store)
    assert [p.leaf for p in problems] == [None] * 4
    assert [p.message.split(" Loads do not read it")[0] for p in problems] == [
        "The zarr group metadata 'zarr.json' is not the zarr v3 group eqx_ckpt writes (node_type: 'array' "
        "instead of 'group').",
        f"The zarr group metadata 'model/zarr.json' is missing from {location(store).display!r}.",
        "The zarr group metadata 'model/encoder/zarr.json' is not valid JSON.",
        f"The file 'opt_state/zarr.json' of checkpoint {location(store).display!r} holds more than 1048576 bytes, "
        f"so it was not read. The checkpoint is damaged or was not written by eqx_ckpt; do not load it.",
    ]
    # The oversized file was never downloaded: only the byte past the limit was asked for.
    assert [rng for path, rng in s3.gate.gets if path.endswith("/opt_state/zarr.json")] == ["bytes=1048576-1048576"]
    # Loads never read them.
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, _tree(0)), _tree(1), typematch=True)


def test_a_save_to_a_bucket_that_does_not_exist_says_so(store):
    """A create-if-absent write to a missing bucket gets no generation back, as a
    write that lost a race does: the save once said another writer held the
    checkpoint (`CheckpointExistsError`). It is a storage error naming the bucket."""
    missing = {**store, "bucket": "no-such-bucket"}
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match=re.escape("'s3://no-such-bucket/")) as caught:
        eqx_ckpt.tree_serialise_leaves(missing, {"w": np.ones(3, np.float32)})
    assert not isinstance(caught.value, eqx_ckpt.CheckpointExistsError)
    assert "NoSuchBucket" in str(caught.value) and "nothing was written" in str(caught.value)
    assert "http_response_body" not in str(caught.value)
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match="NoSuchBucket"):
        eqx_ckpt.CheckpointManager(missing).save(0, {"w": np.ones(3, np.float32)})


@pytest.mark.parametrize(
    "where, error, said",
    [
        ({"bucket": "no-such-bucket"}, eqx_ckpt.CheckpointStorageError, "NoSuchBucket"),
        ({"endpoint": "http://127.0.0.1:9"}, eqx_ckpt.CheckpointConnectionError, "Cannot reach"),
    ],
    ids=["missing-bucket", "unreachable"],
)
def test_a_manager_that_cannot_list_its_directory_raises_never_reports_no_steps(store, where, error, said):
    """A listing that fails is not an empty run: `restore_or_initialise` would
    start training afresh. It was TensorStore's bare message
    (`NOT_FOUND: NoSuchBucket`, `ABORTED: All 3 retry attempts failed`)."""
    manager = eqx_ckpt.CheckpointManager({**store, **where})
    with pytest.raises(error, match=said) as caught:
        manager.latest_step()
    assert "http_response_body" not in str(caught.value)
    with pytest.raises(error, match=said):
        manager.all_steps()


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_rewritten_safetensors_object_is_reported_as_replaced(store, layout):
    """Issue 40, item 1, on an object store: every byte-range read of a tensor
    is checked against the generation (ETag) its file's header was read at."""
    from safetensors.numpy import save

    old = {"a": np.arange(6, dtype=np.float32), "b": np.full(4, 2.0, np.float32)}
    # Another tensor first: at the old offsets of `b` are now other bytes.
    new = {"_": np.full(3, 9.0, np.float32), "a": old["a"] + 1, "b": old["b"] - 1}
    kv = ts.KvStore.open(store).result()
    name = "model.safetensors" if layout == "single" else "model-00001-of-00001.safetensors"
    if layout == "sharded":
        index = {"metadata": {}, "weight_map": dict.fromkeys(old, name)}
        kv.write("model.safetensors.index.json", json.dumps(index).encode()).result()
    kv.write(name, save(old)).result()
    ckpt = eqx_ckpt.Checkpoint(store)
    a, b = ckpt["a"], ckpt["b"]
    np.testing.assert_array_equal(np.asarray(a), old["a"])
    lazy = eqx_ckpt.tree_deserialise_leaves(store, {"b": np.zeros(4, np.float32)}, lazy=True)
    kv.write(name, save(new)).result()
    for read in (lambda: np.asarray(a), lambda: b[1:], lambda: eqx_ckpt.materialise(lazy)):
        with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape(f"its file `{name}` was rewritten")):
            read()
    if layout == "single":
        np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(store)["b"]), new["b"])


def test_a_safetensors_object_rewritten_smaller_is_replaced_not_truncated(store):
    """A range past the end of the new object carries no generation to compare:
    the short read makes the reader check the object's generation."""
    from safetensors.numpy import save

    kv = ts.KvStore.open(store).result()
    kv.write("model.safetensors", save({"a": np.arange(64, dtype=np.float32), "b": np.ones(64, np.float32)})).result()
    b = eqx_ckpt.Checkpoint(store)["b"]
    kv.write("model.safetensors", save({"b": np.ones(2, np.float32)})).result()
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape("its file `model.safetensors` was rewritten")):
        np.asarray(b)


def test_an_orbax_checkpoint_saved_again_is_reported_as_replaced(store, tmp_path):
    """Issue 40, item 1, on S3: orbax's files (saved locally, then uploaded as
    a sync would) replaced by those of its next save."""
    ocp = pytest.importorskip("orbax.checkpoint")
    kv = ts.KvStore.open(store).result()

    def save_and_upload(tree):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            checkpointer.save(tmp_path / "orbax", args=ocp.args.PyTreeSave(tree), force=True)
        for file in sorted(p for p in (tmp_path / "orbax").rglob("*") if p.is_file()):
            kv.write(file.relative_to(tmp_path / "orbax").as_posix(), file.read_bytes()).result()

    save_and_upload({"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.float32)})
    ckpt = eqx_ckpt.Checkpoint(store)
    assert ckpt.format == "orbax"
    w = ckpt["w"]
    np.testing.assert_array_equal(np.asarray(w), np.arange(6, dtype=np.float32))
    save_and_upload({"w": np.arange(6, dtype=np.float32) + 1, "b": np.ones(2, np.float32)})
    with pytest.raises(
        eqx_ckpt.CheckpointReplacedError, match=re.escape("its file `_CHECKPOINT_METADATA` was rewritten")
    ):
        np.asarray(w)
    np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(store)["w"]), np.arange(6, dtype=np.float32) + 1)


def test_an_unreachable_endpoint_fails_within_seconds_with_a_connection_message(store):
    """TensorStore's own retries (32 attempts, up to 32 s apart) made a save,
    a load or a manager's listing against an endpoint that refuses connections
    hang for minutes, and the save's error advised freeing disk space. eqx_ckpt's
    retries fail within seconds (the child process must finish in 60 s),
    with `CheckpointConnectionError` saying to check the URL."""
    endpoint = http_server.refused_url("").rstrip("/")
    spec = {k: v for k, v in store.items() if k != "s3_request_retries"} | {"endpoint": endpoint}
    raised = http_server.raised(
        f"""
        import numpy as np
        import eqx_ckpt
        spec = {spec!r}
        CALLS = {{
            "save": lambda: eqx_ckpt.tree_serialise_leaves(spec, {{"w": np.ones(3, np.float32)}}),
            "load": lambda: eqx_ckpt.tree_deserialise_leaves(spec, {{"w": np.ones(3, np.float32)}}),
            "latest_step": lambda: eqx_ckpt.CheckpointManager(spec).latest_step(),
        }}
        """,
        timeout=60,
    )
    assert sorted(raised) == ["latest_step", "load", "save"]
    display = location(spec).display
    for call, error in raised.items():
        assert error["type"] == "eqx_ckpt.CheckpointConnectionError", (call, error)
        message = error["message"]
        assert "Could not connect to server" in message and "Check the URL (host name and port)" in message, call
        assert display in message and "free space" not in message, (call, message)


def test_a_save_that_loses_the_endpoint_midway_says_to_check_the_url(store, faults):
    """The server goes away after the save began (its lease written): the
    error is a `CheckpointConnectionError` saying to check the URL, not to
    free disk space; the checkpoint before stays."""
    before = _tree(1)
    eqx_ckpt.tree_serialise_leaves(store, before)
    lost = ValueError("ABORTED: All 5 retry attempts failed: CURL error Could not connect to server [curl_code='7']")
    faults("storage.create_array", lost)
    with pytest.raises(eqx_ckpt.CheckpointConnectionError, match=re.escape("nothing was committed")) as caught:
        eqx_ckpt.tree_serialise_leaves(store, _tree(2))
    assert "Check the URL (host name and port)" in str(caught.value) and "free space" not in str(caught.value)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(store, before), before, typematch=True)


@pytest.mark.parametrize("call", ["latest_step", "all_steps", "restore_or_initialise"])
def test_a_manager_with_wrong_credentials_raises_a_storage_error(s3, store, monkeypatch, call):
    """moto checking credentials, as S3 does: a key it does not know is refused
    (403 InvalidAccessKeyId). A manager's listing raises eqx_ckpt's
    `CheckpointStorageError` saying so, never TensorStore's bare
    `PERMISSION_DENIED` nor "no steps" (`restore_or_initialise` would start afresh)."""
    manager = eqx_ckpt.CheckpointManager(store)
    manager.save(4, _tree(4))
    manager.wait_until_finished()
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto now checks every request
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    fresh = eqx_ckpt.CheckpointManager(store)
    calls = {
        "latest_step": fresh.latest_step,
        "all_steps": fresh.all_steps,
        "restore_or_initialise": lambda: fresh.restore_or_initialise(lambda: _tree(0)),
    }
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match="PERMISSION_DENIED") as caught:
        calls[call]()
    message = str(caught.value)
    assert "InvalidAccessKeyId" in message and location(store).display in message, message
    assert "credentials" in message and "http_response_body" not in message, message


def test_every_manager_step_is_written_whole_here(store):
    stores.check_every_manager_step_is_whole(store)


def test_compressed_saves_round_trip_here(store):
    stores.check_compressed_saves_round_trip(store)


def test_the_shared_server_is_reset_to_an_empty_bucket(s3, store):
    """The server serves every test of a worker (tests/conftest.py): its reset
    leaves nothing of a test for the next, objects, buckets, the gate's
    refusals and its records of requests."""
    eqx_ckpt.tree_serialise_leaves(store, _tree(1))
    urllib.request.urlopen(urllib.request.Request(f"{s3.endpoint}/another-bucket", method="PUT")).close()
    assert s3.gate.puts and _keys(s3, store)
    s3.gate.refuse, s3.gate.forbidden, s3.gate.forbidden_puts = True, "/never-read", "/never-written"
    s3.gate.open.clear()
    s3.reset()
    assert (s3.gate.refuse, s3.gate.forbidden, s3.gate.forbidden_puts, s3.gate.open.is_set()) == (False, "", "", True)
    assert (s3.gate.gets, s3.gate.puts) == ([], [])
    with urllib.request.urlopen(s3.endpoint) as listing:
        buckets = re.findall(r"<Name>([^<]*)</Name>", listing.read().decode())
    assert buckets == [s3_server.BUCKET]
    assert list(ts.KvStore.open({**s3.spec(""), "path": ""}).result().list().result()) == []
