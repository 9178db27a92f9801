# ruff: noqa: E402  (the imports below come after the bytecode cache is set)
import contextlib
import os
import sys
import tempfile

# Bytecode in one cache outside the checkout, written even where the
# environment says not to write it: the test command installs without
# compiling (`pip install --no-compile`: 37 s of the install), and this
# process, its workers and the hundreds of processes tests start compile each
# module they import once, for all of them, instead of every one compiling
# its source again (a second a process). The code they run is the same.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
sys.pycache_prefix = os.environ.setdefault(
    "PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "eqx_ckpt-tests-pycache")
)

import gcs_server
import hub_server
import jax
import prefork
import pytest
import s3_server
from hub_client import Client

from eqx_ckpt._base import _faults

# What JAX compiles in those processes (the same small models' programs,
# in hundreds of them: most of a docs page's seconds) is kept in one
# persistent cache beside it, every program however fast it compiled: a later
# process loads it instead of compiling it again. A size limit has JAX lock
# the cache's files, so that no process reads an entry another is still
# writing. Under xdist the workers use it too: they start after the
# controller ran this file, with these variables in their environment (a
# cold cache made a whole run 540 s, a warm one 454 s). A pytest run without
# workers does not (JAX read its settings at the import above). A test that
# sets a cache of its own keeps it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "eqx_ckpt-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2**31))

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


# The local servers: each started once per session (one per xdist worker), and
# reset before and after each test that asks for it, so that no test sees
# anything of another's: objects and buckets, repositories, injected failures,
# hostile answers, held or refused writes, records of requests and counts.


@pytest.fixture(scope="session")
def _s3_server():
    with s3_server.running() as server:
        yield server


@pytest.fixture
def s3(_s3_server):
    """The moto S3 server (tests/support/s3_server.py), holding only an empty bucket."""
    _s3_server.reset()
    yield _s3_server
    _s3_server.reset()  # (also: never leave a save of a failed test blocked in the server)


@pytest.fixture
def store(s3, monkeypatch, request):
    """A fresh checkpoint location (kvstore spec) in the bucket."""
    s3_server.credentials(monkeypatch)
    return s3.spec(f"{request.node.name}/ckpt/")


@pytest.fixture(scope="session")
def _gcs_server():
    with gcs_server.running() as server:
        yield server


@pytest.fixture
def gcs(_gcs_server, monkeypatch):
    """The GCS emulator's URL (tests/support/gcs_server.py), holding only an
    empty bucket, TensorStore pointed at it for this test."""
    _gcs_server.reset()
    _gcs_server.environ(monkeypatch)
    yield _gcs_server.url
    _gcs_server.reset()


@pytest.fixture(scope="session")
def hub_session():
    """The local Hub server (tests/support/hub_server.py); tests take it through `hub`."""
    server = hub_server.Server()
    yield server
    server.stop()


@pytest.fixture
def hub(hub_session, tmp_path):
    """A `hub_client.Client` whose Hub cache is `tmp_path/hf`, and the state of
    the Hub server, new and empty for this test."""
    state = hub_session.reset()
    yield Client(hub_session.url, tmp_path / "hf"), state
    hub_session.reset()


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
