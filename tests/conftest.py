import jax
import pytest
import s3_server

# Several CPU devices, so sharded saves and loads are tested for real on one
# machine; strict promotion, so no test passes by an accidental dtype promotion.
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")


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
