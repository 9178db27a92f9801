import contextlib

import jax
import prefork
import pytest
import s3_server

from eqx_ckpt._base import _faults

# Several CPU devices, so sharded saves and loads are tested for real on one
# machine; strict promotion, so no test passes by an accidental dtype promotion.
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Matrix products in full float32 on an accelerator too (a GPU's default, TF32,
# misses the 1e-5 that tests comparing a model's outputs with PyTorch's ask).
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _prefork_templates():
    """The template processes `prefork` started (tests/sources/test_hub.py), ended with the session."""
    yield
    prefork.close()


# The S3 tests (test_s3.py, test_async.py) share one moto server per module.
@pytest.fixture(scope="module")
def s3():
    with s3_server.running() as server:
        yield server


@pytest.fixture
def store(s3, monkeypatch, request):
    """A fresh checkpoint location (kvstore spec) in the bucket."""
    s3_server.credentials(monkeypatch)
    s3.gate.reset()
    yield s3.spec(f"{request.node.name}/ckpt/")
    s3.gate.reset()  # never leave a save of a failed test blocked in the server


@pytest.fixture
def unpacked(monkeypatch):
    """Every leaf in a folder of its own (no packs), for tests of that layout."""
    import eqx_ckpt._save._records

    monkeypatch.setattr(eqx_ckpt._save._records, "PACK_BYTES", -1)


@pytest.fixture(params=["packed", "unpacked"])
def packing(request):
    """Run a test over both layouts: small leaves packed (the default), and every
    leaf in a folder of its own. The value is the layout's name."""
    if request.param == "unpacked":
        request.getfixturevalue("unpacked")
    return request.param


@pytest.fixture
def faults():
    """`faults(points, action)`: arm fault points (`eqx_ckpt._base._faults.armed`)
    until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda points, action=None: stack.enter_context(_faults.armed(points, action))
