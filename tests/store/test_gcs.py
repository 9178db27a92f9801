"""Checkpoints on a Google Cloud Storage-compatible server (gcp-storage-emulator
on 127.0.0.1), through TensorStore's own `gcs` driver, as test_s3.py does for S3."""

import re
from http import HTTPStatus

import equinox as eqx
import gcs_server
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import stores
import tensorstore as ts
from arrays import tree_equal

import eqx_ckpt


@pytest.fixture
def url(gcs, request):
    return f"gs://{gcs_server.BUCKET}/{request.node.name}/ckpt"


def _keys(url):
    """Every object under the checkpoint, relative to it."""
    bucket, _, path = url.removeprefix("gs://").partition("/")
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": path + "/"}).result()
    return sorted(k.decode() for k in store.list().result())


def _tree(step):
    return {
        "model": {"encoder": {"w": np.arange(24, dtype=np.float32).reshape(4, 6) + step, "b": jnp.full(6, step)}},
        "opt_state": {"mu": np.full((4, 6), 0.5 * step)},
        "step": step,
    }


def test_save_overwrite_load(url):
    first = _tree(1)
    eqx_ckpt.tree_serialise_leaves(url, first)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(url, first), first, typematch=True)
    assert "manifest.json" in _keys(url) and "packed.float32/zarr.json" in _keys(url)  # small leaves are packed

    second = _tree(2)
    eqx_ckpt.tree_serialise_leaves(url, second)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(url, first), second, typematch=True)
    # The overwrite went to the other data root and the old arrays were deleted,
    # by a range delete that left the new ones alone.
    keys = _keys(url)
    root = eqx_ckpt.Checkpoint(url)._manifest.data_root
    assert root.startswith("gen.") and f"{root}/packed.float32/zarr.json" in keys
    assert [k for k in keys if not k.startswith(f"{root}/")] == ["manifest.json"]
    assert eqx_ckpt.verify(url) == []

    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("`overwrite=False`")):
        eqx_ckpt.tree_serialise_leaves(url, first, overwrite=False)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(url, first), second, typematch=True)


def test_partial_lazy_and_skeleton_free_loads(url):
    tree = _tree(3)
    eqx_ckpt.tree_serialise_leaves(url, tree)
    like = eqx.filter_eval_shape(lambda: _tree(0))
    out = eqx_ckpt.tree_deserialise_leaves(url, like, where=lambda t: t["model"])
    assert tree_equal(out["model"], jax.tree.map(jnp.asarray, tree["model"]), typematch=True)
    assert out["opt_state"] == like["opt_state"]
    encoder = eqx_ckpt.tree_deserialise_leaves(url, _tree(0)["model"]["encoder"], prefix="model.encoder")
    assert tree_equal(encoder, tree["model"]["encoder"], typematch=True)

    ckpt = eqx_ckpt.Checkpoint(url)
    np.testing.assert_array_equal(ckpt["model.encoder.w"][1:3], tree["model"]["encoder"]["w"][1:3])
    assert tree_equal(ckpt.load(), tree, typematch=True)


def test_manager_on_gcs(url):
    manager = eqx_ckpt.CheckpointManager(url, max_to_keep=2)
    for step in range(4):
        manager.save(step, _tree(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert tree_equal(manager.restore(_tree(0)), _tree(3), typematch=True)
    # Retention deleted the objects of the steps it dropped, and only those.
    assert {k.split("/")[0] for k in _keys(url) if "/" in k} == {"step_00000002", "step_00000003"}


def test_a_rewritten_safetensors_object_is_reported_as_replaced(url):
    """Issue 40, item 1, on GCS: a tensor read at the old offsets of an object
    written again (another tensor first, or smaller) raises, never other bytes."""
    from safetensors.numpy import save

    bucket, _, path = url.removeprefix("gs://").partition("/")
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": path + "/"}).result()
    store.write(
        "model.safetensors", save({"a": np.arange(64, dtype=np.float32), "b": np.ones(64, np.float32)})
    ).result()
    ckpt = eqx_ckpt.Checkpoint(url)
    a, b = ckpt["a"], ckpt["b"]
    np.testing.assert_array_equal(np.asarray(a), np.arange(64, dtype=np.float32))
    store.write("model.safetensors", save({"_": np.zeros(64, np.float32), "a": np.zeros(64, np.float32)})).result()
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape("its file `model.safetensors` was rewritten")):
        np.asarray(a)
    store.write("model.safetensors", save({"b": np.ones(2, np.float32)})).result()
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape("its file `model.safetensors` was rewritten")):
        np.asarray(b)
    np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(url)["b"]), np.ones(2, np.float32))


@pytest.mark.parametrize("call", ["latest_step", "all_steps", "restore_or_initialise"])
def test_a_manager_in_a_bucket_that_does_not_exist_raises(gcs, call):
    """TensorStore's `gcs` driver lists nothing when GCS answers 404: a manager
    reported no steps, and `restore_or_initialise` would have started afresh."""
    manager = eqx_ckpt.CheckpointManager("gs://no-such-bucket/run")
    calls = {
        "latest_step": manager.latest_step,
        "all_steps": manager.all_steps,
        "restore_or_initialise": lambda: manager.restore_or_initialise(lambda: _tree(0)),
    }
    refused = re.escape(
        "Cannot list the files of 'gs://no-such-bucket/run': the bucket 'no-such-bucket' does not exist"
    )
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match=refused):
        calls[call]()


@pytest.mark.parametrize("status", [HTTPStatus.UNAUTHORIZED, HTTPStatus.FORBIDDEN], ids=["401", "403"])
def test_a_manager_whose_credentials_gcs_refuses_raises(url, status):
    """Credentials GCS does not accept (401), or without the permission (403):
    TensorStore's `gcs` driver lists nothing, and a manager of a run with steps
    reported none. It raises, naming GCS's answer."""
    manager = eqx_ckpt.CheckpointManager(url)
    manager.save(5, _tree(5))
    manager.wait_until_finished()
    fresh = eqx_ckpt.CheckpointManager(url)
    with gcs_server.Gate.refusing(status):
        for call in (fresh.latest_step, fresh.all_steps, lambda: fresh.restore_or_initialise(lambda: _tree(0))):
            with pytest.raises(eqx_ckpt.CheckpointStorageError, match="PERMISSION_DENIED") as caught:
                call()
            message = str(caught.value)
            assert f"would not serve the listing of its files of checkpoint {url!r}" in message, message
            assert "credentials" in message and "http_response_body" not in message, message
    assert fresh.latest_step() == 5


def test_an_empty_directory_in_a_bucket_has_no_steps(url):
    """The checks of an empty listing do not turn a new run into an error."""
    manager = eqx_ckpt.CheckpointManager(url)
    assert manager.latest_step() is None and manager.all_steps() == []
    assert tree_equal(manager.restore_or_initialise(lambda: _tree(0)), (None, _tree(0)), typematch=True)


def test_a_save_to_a_bucket_that_does_not_exist_says_so(gcs):
    """GCS answers a write into a bucket that is not there with 404: the save
    said "Check that the destination is writable and has free space"
    (a plain `CheckpointError`)."""
    with pytest.raises(eqx_ckpt.CheckpointStorageError, match=re.escape("'gs://no-such-bucket/run'")) as caught:
        eqx_ckpt.tree_serialise_leaves("gs://no-such-bucket/run", _tree(1))
    message = str(caught.value)
    assert "NOT_FOUND" in message and "so nothing was written" in message, message
    assert "Check that the bucket exists" in message and "free space" not in message, message


def test_every_manager_step_is_written_whole_here(url):
    stores.check_every_manager_step_is_whole(url)


def test_compressed_saves_round_trip_here(url):
    stores.check_compressed_saves_round_trip(url)


def test_the_shared_server_is_reset_to_an_empty_bucket(url, request):
    """The emulator serves every test of a worker (tests/conftest.py): its
    reset leaves nothing of a test for the next, objects, buckets, and a
    `Gate` refusing."""
    eqx_ckpt.tree_serialise_leaves(url, _tree(1))
    server = request.getfixturevalue("_gcs_server")
    from gcp_storage_emulator.handlers import buckets

    buckets.create_bucket("another-bucket", server._server._storage)
    gcs_server.Gate.status = HTTPStatus.FORBIDDEN
    server.reset()
    assert gcs_server.Gate.status is None
    assert sorted(server._server._storage.buckets) == [gcs_server.BUCKET]
    assert _keys(f"gs://{gcs_server.BUCKET}/") == []
