"""How leaves are read: large leaves in slabs into aligned buffers, and a bounded
window of bytes in flight."""

import mmap
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import in_a_mapping, tree_equal

import eqx_ckpt
from eqx_ckpt._load import _read
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _memory, _window


@pytest.fixture
def small_slabs(monkeypatch, unpacked):
    # Exercise the slab path with small arrays: 1 KiB chunks, 4 KiB slabs. They
    # stand for large leaves, so each has a folder of its own (is not packed).
    monkeypatch.setattr(_format, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(_read, "SLAB_BYTES", 4096)


def test_large_leaves_round_trip_through_slabs(tmp_path, small_slabs):
    tree = {
        "jax": jnp.arange(100 * 37, dtype=jnp.float32).reshape(100, 37),
        "numpy": np.arange(3 * 999, dtype=np.int64).reshape(999, 3),
        "bf16": jnp.linspace(0, 1, 5000, dtype=jnp.bfloat16),
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert len(list((tmp_path / "jax" / "c").iterdir())) > 4  # several chunks, several slabs
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, eqx.filter_eval_shape(lambda: tree) | {"numpy": tree["numpy"]})
    assert tree_equal(out, tree, typematch=True)
    # The JAX array adopted the aligned buffer: no second copy was made.
    assert out["jax"].unsafe_buffer_pointer() % 64 == 0


def test_slab_buffers_from_the_threshold_on_are_mapped_memory(tmp_path, small_slabs, monkeypatch):
    """A leaf read in slabs of `FRESH_MIN_BYTES` or more goes into fresh mapped
    memory (NumPy's own asks for huge pages, which stalled copies when the page
    cache was full): the values are the same, a NumPy leaf's array lives in a
    mapping, and a JAX array adopts its page-aligned buffer."""
    monkeypatch.setattr(_memory, "FRESH_MIN_BYTES", 8192)
    tree = {
        # On the CPU, whose arrays can adopt a host buffer (an accelerator's are copied to it).
        "jax": jax.device_put(jnp.arange(100 * 37, dtype=jnp.float32).reshape(100, 37), jax.devices("cpu")[0]),
        "numpy": np.arange(3 * 999).reshape(999, 3),
    }
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(out, tree, typematch=True)
    assert in_a_mapping(out["numpy"])
    assert out["jax"].unsafe_buffer_pointer() % mmap.PAGESIZE == 0


def test_slab_reads_cast_when_asked(tmp_path, small_slabs):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones((64, 64), jnp.float32)})
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros((64, 64), jnp.bfloat16)}, cast=True)
    assert tree_equal(out, {"w": jnp.ones((64, 64), jnp.bfloat16)}, typematch=True)


def test_damage_in_a_later_slab_names_the_leaf(tmp_path, small_slabs):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": jnp.ones((64, 64), jnp.float32)})
    chunks = sorted(
        (tmp_path / "w" / "c").rglob("*"),
        key=lambda p: [int(x) for x in p.relative_to(tmp_path / "w" / "c").parts if x.isdigit()],
    )
    last = [p for p in chunks if p.is_file()][-1]
    data = bytearray(last.read_bytes())
    data[3] ^= 1
    last.write_bytes(bytes(data))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`w`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros((64, 64), jnp.float32)})


def test_a_small_window_still_loads_everything_in_order(tmp_path, monkeypatch, packing):
    monkeypatch.setattr(_window, "READ_BUDGET", 1)  # one leaf in flight at a time
    tree = {f"l{i}": jnp.full((i + 1, 3), i, jnp.int32) for i in range(12)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, eqx.filter_eval_shape(lambda: tree))
    assert tree_equal(out, tree, typematch=True)


def _put_cases():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    return [
        base,
        base.astype(ml_dtypes.bfloat16),
        base.astype(np.int8),
        base > 10,
        (base + 1j).astype(np.complex64),
        np.zeros((0, 3), np.float16),
        np.array(3.5, np.float32),
        np.arange(5, dtype=np.int64),  # not kept as it is without x64: `device_put`'s way
        base[:, ::2],  # not contiguous: `device_put`'s way
    ]


def _same_arrays(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b)
        assert (a.shape, a.dtype, a.weak_type, a.sharding, a.committed) == (
            b.shape,
            b.dtype,
            b.weak_type,
            b.sharding,
            b.committed,
        )
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("placed", [False, True], ids=["default-device", "single-device-sharding"])
def test_put_gives_what_device_put_gives(x64, placed):
    """`_read.put` calls JAX's internal `batched_device_put` where it can: its
    arrays must be those `jax.device_put` makes, one case at a time and in a batch."""
    assert _read.FAST_PUT is not None, "the fast path is not in use with this JAX"
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]) if placed else None
    with jax.enable_x64(x64):
        cases = _put_cases()
        for case in cases:
            _same_arrays(_read.put([case], sharding), jax.device_put([case], sharding))
        fast = cases[:7]
        _same_arrays(_read.put(fast, sharding), jax.device_put(fast, sharding))
    assert _read.FAST_PUT is not None


def test_put_makes_one_aval_per_shape_and_dtype(faults):
    # One each took 5 us a leaf, as much as the rest of the call, for ten
    # thousand leaves of a few shapes.
    made = []
    faults("read.aval", lambda *a: made.append(a))
    hosts = [np.full((2, 3), i, np.float32) for i in range(4)] + [np.arange(5, dtype=np.int32)] * 3
    _same_arrays(_read.put(hosts, None), jax.device_put(hosts))
    assert sorted(made, key=str) == [((2, 3), np.dtype(np.float32)), ((5,), np.dtype(np.int32))]


def test_put_falls_back_to_device_put_for_good_when_the_internal_call_fails(monkeypatch, faults):
    def changed(*args, **kwargs):
        raise TypeError("batched_device_put() takes 4 positional arguments")

    monkeypatch.setattr(_read, "FAST_PUT", _read.FAST_PUT)  # the fast path back after the test
    faults("read.batched_put", changed)
    cases = _put_cases()[:7]
    _same_arrays(_read.put(cases, None), jax.device_put(cases))
    assert _read.FAST_PUT is None


def test_put_honours_a_default_device():
    device = jax.devices("cpu")[-1]
    with jax.default_device(device):
        (value,) = _read.put([np.ones(3, np.float32)], None)
    assert value.devices() == {device}
