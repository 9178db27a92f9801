"""`load_or_initialise`: the checkpoint's leaves are loaded, only the others computed."""

import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt


def _body(seed):
    return eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(seed))


def _make(body_seed=1, head_seed=2):
    return {"body": _body(body_seed), "head": eqx.nn.Linear(4, 3, key=jax.random.key(head_seed))}


def test_body_loaded_head_initialised(tmp_path):
    body = _body(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": body})
    model = eqx_ckpt.load_or_initialise(tmp_path, _make)
    # The body is the checkpoint's, not what `init` would have made.
    assert tree_equal(model["body"], body, typematch=True)
    assert not tree_equal(model["body"], _make()["body"])
    # The head is exactly what `init` makes.
    assert tree_equal(model["head"], _make()["head"], typematch=True)
    for leaf in jax.tree_util.tree_leaves(model):
        assert not isinstance(leaf, jax.ShapeDtypeStruct)
    assert model["head"](model["body"](jnp.ones(4))).shape == (3,)


def test_loaded_leaves_are_never_computed(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": jnp.full(5, 3.0)})
    calls = {"body": 0, "head": 0}

    def counted(name, shape):
        def host():
            calls[name] += 1
            return np.full(shape, -1.0, np.float32)

        return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32))

    init = lambda: {"body": counted("body", (5,)), "head": counted("head", (2,))}
    model = eqx_ckpt.load_or_initialise(tmp_path, init)
    assert calls == {"body": 0, "head": 1}
    assert tree_equal(model, {"body": jnp.full(5, 3.0), "head": jnp.full(2, -1.0)}, typematch=True)


def test_everything_loaded_runs_nothing(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(2)})

    def init():
        def host():
            raise AssertionError("init was run")

        return {"a": jax.pure_callback(host, jax.ShapeDtypeStruct((2,), jnp.float32))}

    assert tree_equal(eqx_ckpt.load_or_initialise(tmp_path, init), {"a": jnp.ones(2)}, typematch=True)


def test_prefix_and_rename(tmp_path):
    body = _body(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"encoder": body}, "step": 3})
    model = eqx_ckpt.load_or_initialise(tmp_path, _make, prefix="model", rename={"body": "encoder"})
    assert tree_equal(model["body"], body, typematch=True)
    assert tree_equal(model["head"], _make()["head"], typematch=True)


def test_where_and_progress(tmp_path):
    """The leaves `where` leaves out are initialised, as the missing ones are."""
    body, head = _body(0), eqx.nn.Linear(4, 3, key=jax.random.key(7))
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": body, "head": head})
    calls = []
    model = eqx_ckpt.load_or_initialise(
        tmp_path, _make, where=lambda m: m["body"], progress=lambda *counts: calls.append(counts)
    )
    assert tree_equal(model, {"body": body, "head": _make()["head"]}, typematch=True)
    body_leaves = len(jax.tree_util.tree_leaves(eqx.filter(body, eqx.is_array)))
    assert calls and calls[-1][:2] == (body_leaves, body_leaves)


def test_shape_change_is_still_an_error(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": _body(0), "head": eqx.nn.Linear(4, 5, key=jax.random.key(0))})
    with pytest.raises(eqx_ckpt.LeafError, match="has changed shape"):
        eqx_ckpt.load_or_initialise(tmp_path, _make)


def test_strict_reports_leaves_init_lacks(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": _body(0), "old_head": jnp.zeros(3)})
    eqx_ckpt.load_or_initialise(tmp_path, _make)
    with pytest.raises(eqx_ckpt.LeafError, match=r"`old_head`"):
        eqx_ckpt.load_or_initialise(tmp_path, _make, strict=True)


_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import eqx_ckpt

    n = int(sys.argv[2])

    def peak_rss():
        # VmHWM belongs to this process image. `resource.getrusage`'s ru_maxrss
        # would carry over the high-water mark of the (large) test process that
        # forked this one, hiding what happens here.
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def init():
        # Materialising this body would take several times its size.
        body = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
        return {"body": {"w": body}, "head": jnp.ones(8)}

    jax.block_until_ready(jax.jit(lambda: jnp.ones(8))())
    before = peak_rss()
    out = jax.block_until_ready(eqx_ckpt.load_or_initialise(sys.argv[1], init))
    growth = peak_rss() - before
    assert float(out["body"]["w"][12345]) == 1.0 and float(out["head"][0]) == 1.0
    print(growth)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_of_load_or_initialise(tmp_path):
    """A ~400 MB body: loading it holds the body once plus two slabs in flight
    (about 1.2x); computing `init`'s body as well would add at least another 1x
    (and `jax.random.normal` needs several times that while it runs)."""
    n = 100_000_000
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": {"w": np.ones(n, np.float32)}})
    body_bytes = 4 * n
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
        # On the CPU: an accelerator's runtime adds host memory of its own to a first copy.
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.split()[-1])
    assert growth < 1.5 * body_bytes, f"peak RSS grew by {growth / body_bytes:.2f}x the body size"


def test_a_checkpoint_matching_nothing_is_an_error_not_a_fresh_start(tmp_path):
    make = lambda: eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": make(), "step": 3})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("its top-level keys are 'model', 'step'")) as info:
        eqx_ckpt.load_or_initialise(tmp_path, make)
    assert "`prefix='model'`" in str(info.value)
    model = eqx_ckpt.load_or_initialise(tmp_path, make, prefix="model")
    assert tree_equal(model, make(), typematch=True)
