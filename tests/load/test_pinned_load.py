"""A load through the pool of reused host buffers (`_memory.PINNED_LOAD_POOL`,
`_reader`; issue 60), switched on here for JAX's CPU devices, which have the
`pinned_host` memory kind a GPU has. On by default for GPUs alone
(`_memory.PINNED_PLATFORMS`); `tests/hosts/test_gpu.py` runs it there."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base import _state
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _memory

# The pinned paths as JAX's CPU devices take them; on an accelerator the state
# would be placed on it, and tests/hosts/test_gpu.py runs these paths there.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="simulates the pinned paths on CPU devices")

P = jax.sharding.PartitionSpec
BUFFER = 256 << 10


def _pool_on(monkeypatch, pinned: bool):
    monkeypatch.setattr(_memory, "PINNED_LOAD_BUFFERS", pinned)
    monkeypatch.setattr(_format, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", (2, BUFFER))
    monkeypatch.setattr(_memory, "PINNED_PLATFORMS", _memory.PINNED_PLATFORMS | {"cpu"})
    _state.reset("memory.load_pools")
    return lambda: _memory.load_pool()


@pytest.fixture(params=["host", "pinned"])
def pool(monkeypatch, request):
    """The pool on: 2 buffers of 256 KiB, chunks of 64 KiB (a leaf of 1 MiB
    or more is read a few chunks at a time); a fresh pool for each test. Its
    buffers page-aligned host memory, or pinned (`_memory.PINNED_LOAD_BUFFERS`)."""
    return _pool_on(monkeypatch, request.param == "pinned")


@pytest.fixture
def pinned_pool(monkeypatch):
    """`pool`, its buffers pinned."""
    return _pool_on(monkeypatch, True)


def _tree() -> dict[str, jax.Array]:
    key = jax.random.key(1)
    return {
        "rows": jax.random.normal(key, (1024, 512)),  # 2 MiB: 8 buffers' worth
        "cols": jnp.arange(600 * 1024, dtype=jnp.int32).reshape(600, 1024),  # 2.3 MiB, an edge chunk
        "replicated": jax.random.normal(jax.random.key(2), (300, 1024)),
        "half": jax.random.normal(jax.random.key(3), (1024, 700)).astype(jnp.bfloat16),
        "one": jnp.arange(2**19, dtype=jnp.float32),
        "small": jnp.arange(12.0).reshape(3, 4),  # packed
    }


def _placed(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The tree where the load puts it: sharded over the 4 CPU devices
    three ways, and on one device."""
    mesh = jax.make_mesh((4,), ("x",))
    specs = {"rows": P("x"), "cols": P(None, "x"), "replicated": P(), "half": P("x")}
    return {
        k: jax.device_put(x, jax.sharding.NamedSharding(mesh, specs[k])) if k in specs else x for k, x in tree.items()
    }


def _equal(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> bool:
    """`eqx.tree_equal(..., typematch=True)` leaf by leaf (leaves on different
    devices cannot be compared in one)."""
    return a.keys() == b.keys() and all(bool(tree_equal(a[k], b[k], typematch=True)) for k in a)


@pytest.mark.parametrize("compression", [None, "blosc-lz4"])
def test_a_load_through_the_pool_is_bit_for_bit_each_device_given_its_region(tmp_path, pool, faults, compression):
    tree = _placed(_tree())
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree, compression=compression)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    allocated = []
    faults(["load.pinned_pool"], allocated.append)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like)
    assert _equal(out, tree)
    assert allocated == [BUFFER, BUFFER] and pool().allocations == 2
    for k in ("rows", "cols", "replicated", "half"):
        assert out[k].sharding == tree[k].sharding
        for got, want in zip(out[k].addressable_shards, tree[k].addressable_shards, strict=True):
            assert got.device == want.device and got.index == want.index
            assert got.data.shape == want.data.shape
            np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
    # A second load reuses the pool's buffers: none allocated.
    again = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like)
    assert _equal(again, tree)
    assert allocated == [BUFFER, BUFFER] and pool().allocations == 2


@pytest.mark.parametrize("like", ["array", "shape"])
def test_a_leaf_on_one_device_is_placed_through_the_pool_as_the_usual_way_places_it(tmp_path, pool, monkeypatch, like):
    tree = {"w": jax.random.normal(jax.random.key(0), (2048, 256))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    shaped = {"w": jax.ShapeDtypeStruct((2048, 256), jnp.float32)} if like == "shape" else tree
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", shaped)
    assert tree_equal(out, tree, typematch=True)
    assert pool().allocations == 2
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", None)
    usual = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", shaped)
    assert out["w"].sharding == usual["w"].sharding and out["w"].committed == usual["w"].committed


def test_a_pool_that_cannot_be_allocated_loads_the_usual_way(tmp_path, pool, faults):
    tree = _placed(_tree())
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    faults(["load.pinned_pool"], MemoryError("no pinned memory"))
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree)
    assert _equal(out, tree)
    assert pool().allocations == 0


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_a_leaf_bound_for_host_memory_loads_the_usual_way(tmp_path, pool, kind):
    tree = {"w": jax.random.normal(jax.random.key(0), (2048, 256))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    like = {"w": jax.device_put(tree["w"], tree["w"].sharding.with_memory_kind(kind))}
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", like)
    assert out["w"].sharding.memory_kind == kind
    assert tree_equal(out, like, typematch=True)
    assert pool().allocations == 0


def test_the_pool_is_on_for_gpus_and_not_for_cpus(tmp_path, faults, monkeypatch):
    """By default the pool is set and meant for GPUs alone: a load onto CPU
    devices here allocates none of its buffers."""
    assert _memory.PINNED_LOAD_POOL is not None
    assert "gpu" in _memory.PINNED_PLATFORMS and "cpu" not in _memory.PINNED_PLATFORMS
    _state.reset("memory.load_pools")
    allocated: list[int] = []
    faults(["load.pinned_pool"], allocated.append)
    tree = {"w": jax.random.normal(jax.random.key(0), (2048, 256))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree, typematch=True)
    assert allocated == [] and _memory._LOAD_POOLS == {}


def test_a_damaged_chunk_read_through_the_pool_names_the_leaf(tmp_path, pool):
    tree = {"w": jax.random.normal(jax.random.key(0), (2048, 256))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    (chunk,) = [p for p in (tmp_path / "ckpt").rglob("c/5/0")]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    message = (
        "Leaf `w` in checkpoint '"
        + str(tmp_path / "ckpt")
        + "': it is damaged or incomplete: its chunk file 'w/c/5/0' fails its crc32c checksum"
    )
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape(message)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree)
    assert pool().allocations == 2  # read through the pool


def test_a_damaged_chunk_amid_reads_ahead_leaves_the_pool_fit_for_the_next_load(tmp_path, pool, monkeypatch):
    """With 4 buffers the reads run 3 buffers ahead of the copies: a chunk
    that fails its checksum while later ones are being read is an error
    naming the leaf, and once every read under way has ended the pool's
    buffers serve the next load bit for bit."""
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", (4, BUFFER))
    tree = {"w": jax.random.normal(jax.random.key(0), (2048, 256))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "bad", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "good", {"w": -tree["w"]})
    (chunk,) = [p for p in (tmp_path / "bad").rglob("c/9/0")]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("its chunk file 'w/c/9/0' fails its crc32c")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "bad", tree)
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "good", tree)
    assert tree_equal(out, {"w": -tree["w"]}, typematch=True)
    assert pool().allocations == 4


def test_arrays_deleted_or_donated_after_a_load_leave_the_pool_fit_for_the_next(tmp_path, pool, monkeypatch):
    """A leaf of one buffer is handed to the caller as the pool copied it;
    the caller may delete or donate it, and the next load reusing that
    buffer neither waits on it nor fails."""
    monkeypatch.setattr(_memory, "PINNED_LOAD_POOL", (2, 4 << 20))
    tree = {"a": jnp.arange(2**19, dtype=jnp.float32), "b": jnp.ones((512, 1024)), "c": -jnp.ones((256, 1024))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    first = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree)
    assert pool().allocations == 2
    first["a"].delete()
    jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)({"b": first["b"], "c": first["c"]})
    for _ in range(2):
        out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree)
        assert tree_equal(out, tree, typematch=True)


_PEAK = """
import json, resource, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import eqx_ckpt
from eqx_ckpt._store import _memory
if sys.argv[2] == "on":
    _memory.PINNED_LOAD_POOL = (2, 4 << 20)
    _memory.PINNED_PLATFORMS = _memory.PINNED_PLATFORMS | {"cpu"}
mesh = jax.make_mesh((4,), ("x",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
import jax.numpy as jnp
like = {f"w{i}": jax.ShapeDtypeStruct((4096, 2048), jnp.float32, sharding=sharding) for i in range(8)}
jnp.zeros(4).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = eqx_ckpt.tree_deserialise_leaves(sys.argv[1], like)
jax.block_until_ready(out)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
pool = _memory.load_pool()
print(json.dumps({"added": peak - before, "allocations": pool.allocations if pool else 0}))
"""


def test_host_memory_of_a_load_through_the_pool_is_the_state_and_the_pool(tmp_path):
    """A state of 256 MiB (8 leaves of 32 MiB, sharded over 4 CPU devices)
    loaded through a pool of 8 MiB: the peak memory added is the state
    itself (on CPU devices, host memory), a device's region of one leaf
    joined from its slabs (8 MiB), and the pool, plus a margin (the runtime,
    XLA's compile of the joins); never a host copy of the state beside it.
    (Measured: 314 MiB added; 473 MiB through the usual way, which reads a
    sharded leaf's regions through TensorStore. The state is saved in chunks
    of 1 MiB.)"""
    save = (
        "import sys, jax.numpy as jnp, eqx_ckpt; from eqx_ckpt._ondisk import _format; _format.CHUNK_BYTES = 1 << 20; "
    )
    save += "eqx_ckpt.tree_serialise_leaves(sys.argv[1], "
    save += "{f'w{i}': jnp.full((4096, 2048), i, jnp.float32) for i in range(8)})"
    subprocess.run([sys.executable, "-c", save, str(tmp_path / "ckpt")], check=True)
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "ckpt"), "on"], check=True, capture_output=True, text=True
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    state, pool, region, margin = 256 << 20, 8 << 20, 8 << 20, 64 << 20
    assert measured["allocations"] == 2
    assert measured["added"] <= state + pool + region + margin, measured


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.int32, jnp.uint16, jnp.bool_]
)
def test_pinned_buffers_send_a_leaf_for_one_device_by_one_copy_viewed_there(tmp_path, pinned_pool, faults, dtype):
    """With the pool's buffers in pinned memory, a leaf bound whole for the
    first device goes there as the buffer's bytes, cut and viewed as its
    dtype on the device (a bool leaf, which no view gives, the usual way);
    bit for bit, the next load reusing the buffers too."""
    viewed: list[tuple[int, ...]] = []
    faults(["load.pinned_view"], viewed.append)
    values = jax.random.normal(jax.random.key(0), (12000, 100)) * 50  # 1.2 MiB or more: not packed
    tree = {"w": (values > 0) if dtype == jnp.bool_ else values.astype(dtype), "v": jnp.arange(7.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    for _ in range(2):
        out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree)
        assert tree_equal(out, tree, typematch=True)
        assert out["w"].sharding == tree["w"].sharding
    assert pinned_pool().allocations == 2 and pinned_pool().pinned
    if dtype == jnp.bool_:
        assert viewed == []
    else:  # every row, each load, a buffer's rows at a time
        assert sum(rows for rows, _ in viewed) == 2 * 12000 and {cols for _, cols in viewed} == {100}


def test_a_pool_in_huge_pages_faulted_in_at_once_loads_bit_for_bit(tmp_path, pool, monkeypatch):
    """`_memory.POOL_HUGE_PAGES`: the buffers asked for in huge pages and
    written once each by a few threads as the pool is made."""
    monkeypatch.setattr(_memory, "POOL_HUGE_PAGES", True)
    tree = _placed(_tree())
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", tree)
    for _ in range(2):
        assert _equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", tree), tree)
    assert pool().allocations == 2
