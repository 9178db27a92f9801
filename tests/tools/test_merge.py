"""`merge` and `eqx-ckpt merge`: each method against a plain NumPy reference
on whole arrays, the accounting of every leaf, determinism, `where`,
non-float and bfloat16 leaves, and a merge that never holds whole inputs."""

import json
import math
import re
import tracemalloc

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_ckpt
from eqx_ckpt._ondisk import _format
from eqx_ckpt._tools import _merge
from eqx_ckpt._tools._cli import main

F32 = np.float32


# An MLP's shape, made once: its leaves come from NumPy (no JAX computation to compile).
MLP = eqx.filter_eval_shape(eqx.nn.MLP, 4, 3, 8, 2, key=jax.random.key(0))


def _model(seed, dtype=np.float32):
    """A small model: an MLP, an embedding, integer and boolean arrays, a scalar."""
    rng = np.random.default_rng(seed)
    # (float64 as NumPy arrays, which keep it without x64.)
    wrap = np.asarray if dtype == np.float64 else jnp.asarray
    normal = lambda shape: wrap(rng.standard_normal(shape, F32).astype(dtype))
    mlp = jax.tree.map(lambda x: normal(x.shape) if isinstance(x, jax.ShapeDtypeStruct) else x, MLP)
    return {
        "model": mlp,
        "emb": normal((40, 6)),
        "count": jnp.asarray(np.arange(5, dtype=np.int32) + seed),
        "mask": np.array([seed % 2 == 0, True]),
        "step": 3 + seed,
    }


def _saved(tmp_path, seeds, dtype=np.float32):
    paths = []
    for seed in seeds:
        path = tmp_path / f"in{seed}"
        eqx_ckpt.tree_serialise_leaves(path, _model(seed, dtype))
        paths.append(path)
    return paths


def _arrays(path):
    ckpt = eqx_ckpt.Checkpoint(path)
    return {k: np.asarray(v) for k, v in ckpt.items()}


FLOAT_KEYS = [f"model.layers.{i}.{p}" for i in range(3) for p in ("bias", "weight")] + ["emb"]


def _check(out, reference, inputs, *, exact=True, rtol=0.0, atol=0.0):
    """Every float leaf of `out` equals `reference(xs)`; every other leaf is the first input's."""
    got, ins = _arrays(out), [_arrays(p) for p in inputs]
    assert sorted(got) == sorted(ins[0])
    for key in got:
        if key in FLOAT_KEYS:
            want = reference(key, [x[key].astype(F32) for x in ins]).astype(ins[0][key].dtype)
            assert got[key].dtype == want.dtype, key
            if exact:
                assert got[key].tobytes() == want.tobytes(), key
            else:
                np.testing.assert_allclose(got[key].astype(F32), want.astype(F32), rtol=rtol, atol=atol, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], ins[0][key])


def _weighted(xs, ws):
    total = F32(ws[0]) * xs[0]
    for x, w in zip(xs[1:], ws[1:]):
        total = total + F32(w) * x
    return total


def test_linear_and_task_arithmetic_bit_for_bit(tmp_path):
    a, b, c, base = _saved(tmp_path, [0, 1, 2, 3])
    ws = [0.5, 0.3, 0.2]
    eqx_ckpt.merge(tmp_path / "lin", [a, b, c], method="linear", weights=ws)
    divisor = F32(0) + F32(0.5) + F32(0.3) + F32(0.2)
    _check(tmp_path / "lin", lambda k, xs: _weighted(xs, ws) / divisor, [a, b, c])

    eqx_ckpt.merge(tmp_path / "ta", [a, b], method="task_arithmetic", weights=[1.0, -0.5], base=base)
    bases = _arrays(base)
    _check(
        tmp_path / "ta",
        lambda k, xs: bases[k] + _weighted([x - bases[k] for x in xs], [1.0, -0.5]),
        [a, b],
    )
    # The result is a model, as a save of the first input: rebuilt without `like`, and into `like`.
    rebuilt = eqx_ckpt.Checkpoint(tmp_path / "lin").load(trust=[])
    assert isinstance(rebuilt["model"], eqx.nn.MLP) and rebuilt["step"] == 3
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "lin", _model(0))
    assert jax.tree.structure(loaded) == jax.tree.structure(_model(0))
    metrics = eqx_ckpt.Checkpoint(tmp_path / "ta").metrics
    assert metrics["merge_method"] == "task_arithmetic" and metrics["merge_weights"] == "[1.0, -0.5]"
    assert [p.rpartition("/")[2] for p in json.loads(metrics["merge_inputs"])] == ["in0", "in1"]
    assert metrics["merge_base"].endswith("in3")


def _ties_reference(xs, base, ws, density, *, drop=None):
    """TIES (Yadav et al. 2023) on whole arrays: trim each difference to its
    `int(density * n)` largest magnitudes (all those equal to the last kept),
    elect the sign of the weighted sum, average the agreeing weighted values.
    With `drop` (DARE), the random drop replaces the trim and nothing is averaged."""
    deltas = [x - base for x in xs]
    if drop is None:
        kept = []
        for d in deltas:
            k = max(1, int(density * d.size))
            threshold = np.sort(np.abs(d).reshape(-1))[::-1][k - 1]
            kept.append(np.where(np.abs(d) >= threshold, d, F32(0)))
    else:
        kept = [d * m / F32(density) for d, m in zip(deltas, drop)]
    weighted = [F32(w) * d for d, w in zip(kept, ws)]
    majority = np.where(sum(weighted[1:], weighted[0]) >= 0, F32(1), F32(-1))
    agree = [np.sign(w) == majority for w in weighted]
    total = sum((w * a for w, a in zip(weighted, agree)), np.zeros_like(base))
    if drop is not None:
        return base + total
    divisor = sum((F32(w) * a for w, a in zip(ws, agree)), np.zeros_like(base))
    divisor[divisor == 0] = 1
    return base + total / divisor


def test_ties_matches_numpy(tmp_path):
    a, b, c, base = _saved(tmp_path, [0, 1, 2, 3])
    ws = [1.0, 0.7, 0.4]
    eqx_ckpt.merge(tmp_path / "out", [a, b, c], method="ties", weights=ws, base=base, density=0.3)
    bases = _arrays(base)
    reference = lambda k, xs: _ties_reference(xs, bases[k], ws, 0.3)
    # Same operations in the same order: equal to the last bit but for sums NumPy may pair differently.
    _check(tmp_path / "out", reference, [a, b, c], exact=False, rtol=1e-6, atol=1e-7)


def _splitmix_kept(seed, size, density):
    """DARE's drops as docs/sharing.md defines them: SplitMix64 of each index."""
    mask = (1 << 64) - 1
    out = np.empty(size, bool)
    for i in range(size):
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out[i] = (z >> 11) < int(density * 2**53)
    return out


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
def test_dare_matches_numpy(tmp_path, method):
    a, b, base = _saved(tmp_path, [0, 1, 3])
    ws, density = [0.6, 0.9], 0.4
    eqx_ckpt.merge(tmp_path / "out", [a, b], method=method, weights=ws, base=base, density=density, key=7)
    bases = _arrays(base)
    from eqx_ckpt._tools._merge_methods import seed

    def reference(k, xs):
        drops = [_splitmix_kept(seed(7, k, i), xs[0].size, density).reshape(xs[0].shape) for i in range(2)]
        if method == "dare_ties":
            return _ties_reference(xs, bases[k], ws, density, drop=drops)
        return bases[k] + _weighted([(x - bases[k]) * m / F32(density) for x, m in zip(xs, drops)], ws)

    _check(tmp_path / "out", reference, [a, b], exact=False, rtol=1e-6, atol=1e-7)
    # About `density` of the differences are kept.
    kept = _splitmix_kept(seed(7, "emb", 0), 240, density).mean()
    assert abs(kept - density) < 0.1


def _slerp_reference(x0, x1, t):
    """mergekit's `slerp` on flattened float32 vectors (the angle in float64)."""
    a, b = x0.astype(np.float64).reshape(-1), x1.astype(np.float64).reshape(-1)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    dot = float(a @ b) / (na * nb)
    if abs(dot) > 0.9995:
        s0, s1 = 1 - t, t
    else:
        theta = math.acos(dot)
        s0, s1 = math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
    return F32(s0) * x0 + F32(s1) * x1


def test_slerp_matches_numpy_and_is_linear_when_parallel(tmp_path):
    a, b = _saved(tmp_path, [0, 1])
    eqx_ckpt.merge(tmp_path / "out", [a, b], method="slerp", t=0.3)
    _check(tmp_path / "out", lambda k, xs: _slerp_reference(*xs, 0.3), [a, b], exact=False, rtol=1e-5, atol=1e-6)
    # A model and twice itself are parallel: a linear blend, 1.3 times the first.
    twice = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) * 2) if eqx.is_inexact_array(x) else x, _model(0))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "twice", twice)
    eqx_ckpt.merge(tmp_path / "par", [a, tmp_path / "twice"], method="slerp", t=0.3)
    got, first = _arrays(tmp_path / "par"), _arrays(a)
    np.testing.assert_allclose(got["emb"], F32(0.7) * first["emb"] + F32(0.3) * 2 * first["emb"], rtol=1e-6)


def test_published_folder_and_fine_tune_inputs(tmp_path):
    a, b = _saved(tmp_path, [0, 1])
    eqx_ckpt.export_safetensors(tmp_path / "pub", eqx_ckpt.Checkpoint(b))
    eqx_ckpt.merge(tmp_path / "one", [a, b], method="linear")
    eqx_ckpt.merge(tmp_path / "two", [a, tmp_path / "pub"], method="linear")
    one, two = _arrays(tmp_path / "one"), _arrays(tmp_path / "two")
    assert all(one[k].tobytes() == two[k].tobytes() for k in one)
    # A published folder first: its structure record is the result's.
    eqx_ckpt.merge(tmp_path / "first", [tmp_path / "pub", a], method="linear")
    rebuilt = eqx_ckpt.Checkpoint(tmp_path / "first").load(trust=[])
    assert jax.tree.structure(rebuilt) == jax.tree.structure(eqx_ckpt.Checkpoint(b).load(trust=[]))
    # A fine-tune of the published `b` that stores only what changed, read with its base.
    tuned = _model(1)
    tuned["emb"] = tuned["emb"] + 1
    eqx_ckpt.tree_serialise_leaves(tmp_path / "tuned", tuned)
    eqx_ckpt.export_safetensors(tmp_path / "ft", eqx_ckpt.Checkpoint(tmp_path / "tuned"), base=tmp_path / "pub")
    taken = eqx_ckpt.Checkpoint(tmp_path / "ft").from_base()
    assert "emb" not in taken and "model.layers.0.weight" in taken
    eqx_ckpt.merge(tmp_path / "three", [a, tmp_path / "tuned"], method="linear")
    eqx_ckpt.merge(tmp_path / "four", [a, tmp_path / "ft"], method="linear")
    three, four = _arrays(tmp_path / "three"), _arrays(tmp_path / "four")
    assert all(three[k].tobytes() == four[k].tobytes() for k in three)


def test_every_mismatch_listed_at_once_and_nothing_written(tmp_path):
    (a,) = _saved(tmp_path, [0])
    other = _model(1)
    other["emb"] = other["emb"][:, :5]  # another shape
    other["model"] = eqx.tree_at(lambda m: m.layers[0].bias, other["model"], jnp.asarray(np.zeros(8, np.float16)))
    other["extra"] = np.ones(2, F32)
    del other["count"]
    eqx_ckpt.tree_serialise_leaves(tmp_path / "other", other)
    with pytest.raises(eqx_ckpt.LeafError) as caught:
        eqx_ckpt.merge(tmp_path / "out", [a, tmp_path / "other"], method="linear")
    message = str(caught.value)
    for key in ("emb", "model.layers.0.bias", "count", "extra"):
        assert re.search(rf"`{re.escape(key)}`", message), key
    assert "float32[40, 6]" in message and "4 differ" in message and "nothing was written" in message
    assert sorted(caught.value.dotted) == ["count", "emb", "extra", "model.layers.0.bias"]
    assert not (tmp_path / "out").exists()
    # A base lacking a merged leaf is named too.
    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", {"emb": np.zeros((40, 6), F32)})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`model.layers.2.weight`")):
        eqx_ckpt.merge(tmp_path / "out", [a, a], method="task_arithmetic", base=tmp_path / "base")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"method": "mean"}, "`method` must be one of"),
        ({"method": "ties", "density": 0.5}, "needs `base`"),
        ({"method": "ties", "base": "b"}, "needs `density`"),
        ({"method": "linear", "t": 0.5}, "`t` is not used"),
        ({"method": "linear", "weights": [1.0]}, "a list of 2 numbers"),
        ({"method": "linear", "weights": [1.0, -1.0]}, "sum of `weights`"),
        ({"method": "slerp"}, "needs `t`"),
        ({"method": "dare_ties", "base": "b", "density": 1.5}, "in \\(0, 1\\]"),
    ],
)
def test_options_checked_first(tmp_path, options, error):
    with pytest.raises((eqx_ckpt.CheckpointValueError, eqx_ckpt.CheckpointTypeError), match=error):
        eqx_ckpt.merge(tmp_path / "out", ["x", "y"], **options)
    assert not (tmp_path / "out").exists()


def _leaf_files(path):
    return {
        p.relative_to(path): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def test_same_bytes_twice_whatever_the_budget(tmp_path, monkeypatch):
    a, b, base = _saved(tmp_path, [0, 1, 3])
    options = dict(method="dare_ties", base=base, density=0.5, key=jax.random.key(3))
    eqx_ckpt.merge(tmp_path / "one", [a, b], **options)
    monkeypatch.setattr(_merge, "BLOCK_ELEMENTS", 16)  # many blocks a leaf
    eqx_ckpt.merge(tmp_path / "two", [a, b], **options, staging_bytes=1024)
    assert _leaf_files(tmp_path / "one") == _leaf_files(tmp_path / "two")
    ties = dict(method="ties", base=base, density=0.2)
    eqx_ckpt.merge(tmp_path / "three", [a, b], **ties)
    monkeypatch.setattr(_merge, "BLOCK_ELEMENTS", 1 << 18)
    eqx_ckpt.merge(tmp_path / "four", [a, b], **ties)
    assert _leaf_files(tmp_path / "three") == _leaf_files(tmp_path / "four")
    # Published inputs, read by windows of the fewest whole blocks (each the
    # rows that 128 KiB holds: a window of 64 bytes is smaller): the same bytes.
    for path in (a, b, base):
        eqx_ckpt.export_safetensors(tmp_path / f"pub-{path.name}", eqx_ckpt.Checkpoint(path))
    monkeypatch.setattr(_merge, "BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(_merge, "WINDOW_BYTES", 64)
    published = [tmp_path / f"pub-{p.name}" for p in (a, b)]
    eqx_ckpt.merge(tmp_path / "five", published, **{**ties, "base": tmp_path / f"pub-{base.name}"})
    five, three = _arrays(tmp_path / "five"), _arrays(tmp_path / "three")
    assert sorted(five) == sorted(three) and all(five[k].tobytes() == three[k].tobytes() for k in five)


@pytest.mark.parametrize("method", ["ties", "dare_ties", "slerp", "linear"])
def test_same_bytes_whatever_the_threads(tmp_path, monkeypatch, method):
    """Blocks made one task each on three threads, the next leaf read ahead,
    or everything on one thread in order: the same bytes."""
    a, b, base = _saved(tmp_path, [0, 1, 3], dtype=ml_dtypes.bfloat16)
    options = {"method": method, "t": 0.3} if method == "slerp" else {"method": method}
    if method in ("ties", "dare_ties"):
        options.update(base=base, density=0.4, weights=[0.6, -1.5])
    monkeypatch.setattr(_merge, "BLOCK_ELEMENTS", 8)  # many blocks a leaf, each task one
    monkeypatch.setattr(_merge, "TASK_BLOCKS", 1)
    monkeypatch.setattr(_merge, "MERGE_THREADS", 3)
    eqx_ckpt.merge(tmp_path / "threads", [a, b], **options)
    monkeypatch.setattr(_merge, "MERGE_THREADS", 1)
    monkeypatch.setattr(_merge, "READ_AHEAD", False)
    monkeypatch.setattr(_merge, "TASK_BLOCKS", 1 << 20)
    eqx_ckpt.merge(tmp_path / "one", [a, b], **options)
    assert _leaf_files(tmp_path / "threads") == _leaf_files(tmp_path / "one")


def test_an_empty_leaf_is_merged(tmp_path):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"in{i}")
        eqx_ckpt.tree_serialise_leaves(paths[-1], {"empty": np.zeros((0, 4), F32), "w": np.full((3, 4), i, F32)})
    eqx_ckpt.merge(tmp_path / "out", paths[1:], method="ties", base=paths[0], density=0.5)
    got = _arrays(tmp_path / "out")
    assert got["empty"].shape == (0, 4) and got["w"].shape == (3, 4)


def test_a_damaged_input_read_ahead_fails_the_merge(tmp_path):
    """A chunk file damaged in a leaf read while the one before it is made:
    the merge fails naming it, and writes nothing."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"in{i}")
        eqx_ckpt.tree_serialise_leaves(paths[-1], {k: rng.standard_normal((512, 1024), F32) for k in "abc"})
    chunk = next((paths[1] / eqx_ckpt.Checkpoint(paths[1]).record("b").directory).rglob("c/*/*"))
    damaged = bytearray(chunk.read_bytes())
    damaged[0] ^= 0xFF
    chunk.write_bytes(bytes(damaged))
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`b`")):
        eqx_ckpt.merge(tmp_path / "out", paths[1:], method="ties", base=paths[0], density=0.5)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_where_merges_only_the_selected_subtrees(tmp_path):
    a, b = _saved(tmp_path, [0, 1])
    other = _model(1)
    other["emb"] = other["emb"][:3]  # outside the selection: not accounted for
    eqx_ckpt.tree_serialise_leaves(b, other)
    eqx_ckpt.merge(tmp_path / "out", [a, b], method="linear", where="model.layers.0")
    eqx_ckpt.merge(tmp_path / "fn", [a, b], method="linear", where=lambda t: t["model"]["layers"][0])
    # As a selector of the model is written: keys as attributes, as a Module's fields.
    eqx_ckpt.merge(tmp_path / "attr", [a, b], method="linear", where=lambda m: (m.model.layers[0],))
    got, first, second = _arrays(tmp_path / "out"), _arrays(a), _arrays(b)
    for key in got:
        if key.startswith("model.layers.0."):
            want = (F32(1) * first[key] + F32(1) * second[key]) / F32(2)
            assert got[key].tobytes() == want.tobytes()
        else:
            assert got[key].tobytes() == first[key].tobytes(), key
    assert _leaf_files(tmp_path / "out") == _leaf_files(tmp_path / "fn") == _leaf_files(tmp_path / "attr")
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="names no leaf"):
        eqx_ckpt.merge(tmp_path / "no", [a, b], method="linear", where="decoder")
    with pytest.raises(
        eqx_ckpt.CheckpointValueError, match=r"AttributeError: the node has no key 'decoder' \(its keys: `count`, "
    ):
        eqx_ckpt.merge(tmp_path / "no", [a, b], method="linear", where=lambda m: m.decoder)
    assert not (tmp_path / "no").exists()


def test_bfloat16_inputs_merge_in_float32(tmp_path):
    a, b = _saved(tmp_path, [0, 1], dtype=ml_dtypes.bfloat16)
    calls = []
    progress = lambda *counts: calls.append(counts)
    eqx_ckpt.merge(tmp_path / "out", [a, b], method="linear", weights=[0.25, 0.75], progress=progress)
    # The save's progress counts the result's leaves and bytes, to their totals.
    leaves, leaves_total, nbytes, bytes_total = calls[-1]
    assert (leaves, nbytes) == (leaves_total, bytes_total) == (10, eqx_ckpt.Checkpoint(a).total_bytes)
    got = _arrays(tmp_path / "out")
    assert got["emb"].dtype == ml_dtypes.bfloat16
    divisor = F32(0) + F32(0.25) + F32(0.75)
    _check(tmp_path / "out", lambda k, xs: _weighted(xs, [0.25, 0.75]) / divisor, [a, b])


def test_never_holds_whole_inputs(tmp_path, monkeypatch, faults):
    """Three inputs of 8 MiB (one leaf of 4 MiB in chunks of 1 MiB, four of
    1 MiB) and a base merged with a 1 MiB staging budget: NumPy's peak is
    one leaf of the result, its copy as written, one chunk of each input and
    the base, and a few blocks of 256 KiB: 10.2 MiB, and up to 2 MiB more
    when the merge threads' blocks and the next leaf's read-ahead meet
    (12.2 MiB seen). Reading the large leaf whole from the inputs and the
    base would hold 20 MiB with the result. The save stages one leaf at a
    time."""
    monkeypatch.setattr(_merge, "BLOCK_ELEMENTS", 1 << 16)
    monkeypatch.setattr(_format, "CHUNK_BYTES", 2**20)  # the large leaf in four chunk files
    rng = np.random.default_rng(0)
    paths = []
    for i in range(3):
        tree = {
            "big": rng.standard_normal((1024, 1024), F32),
            "rest": [rng.standard_normal((512, 512), F32) for _ in range(4)],
        }
        eqx_ckpt.tree_serialise_leaves(tmp_path / f"in{i}", tree)
        paths.append(tmp_path / f"in{i}")
        del tree
    staged = []
    tracemalloc.start()
    try:
        # From the save's start: opening a checkpoint reads its manifest into a
        # buffer of the largest size allowed (256 MiB, mostly never touched).
        faults("save.records", lambda loc: tracemalloc.reset_peak())
        faults("save.staged", lambda held, budget: staged.append(held))
        eqx_ckpt.merge(tmp_path / "out", paths, method="ties", base=paths[0], density=0.5, staging_bytes=2**20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 15 * 2**20, peak / 2**20
    assert max(staged) <= 4 * 2**20
    assert eqx_ckpt.Checkpoint(tmp_path / "out")["big"].shape == (1024, 1024)


def test_command_line(tmp_path, capsys):
    a, b, base = _saved(tmp_path, [0, 1, 3])
    out = tmp_path / "out"
    options = ["--method", "ties", "--base", str(base), "--density", "0.5", "--weights", "1", "0.5"]
    code = main(["merge", str(out), str(a), str(b), *options])
    assert code == 0, capsys.readouterr()
    eqx_ckpt.merge(tmp_path / "api", [a, b], method="ties", base=base, density=0.5, weights=[1, 0.5])
    assert _leaf_files(out) == _leaf_files(tmp_path / "api")
    assert main(["merge", str(tmp_path / "x"), str(a), "--method", "slerp", "--t", "0.5"]) != 0
    assert "two inputs" in capsys.readouterr().err


@pytest.mark.parametrize(("dtype", "acc"), [(np.float16, np.float32), (np.float64, np.float64)])
def test_float16_upcast_float64_kept(tmp_path, dtype, acc):
    a, b, base = _saved(tmp_path, [0, 1, 3], dtype=dtype)
    eqx_ckpt.merge(tmp_path / "lin", [a, b], method="linear", weights=[0.3, 0.7])
    eqx_ckpt.merge(tmp_path / "ties", [a, b], method="ties", base=base, density=0.5, weights=[0.3, 0.7])
    got, ties, x, y, z = (_arrays(p)["emb"] for p in (tmp_path / "lin", tmp_path / "ties", a, b, base))
    x, y, z = x.astype(acc), y.astype(acc), z.astype(acc)
    w0, w1 = acc(0.3), acc(0.7)
    assert got.dtype == dtype and got.tobytes() == ((w0 * x + w1 * y) / (acc(0) + w0 + w1)).astype(dtype).tobytes()
    # TIES in `acc`: the trim, the election and the mean, on whole arrays.
    deltas = []
    for d in (x - z, y - z):
        threshold = np.sort(np.abs(d).reshape(-1))[::-1][int(0.5 * d.size) - 1]
        deltas.append(np.where(np.abs(d) >= threshold, d, acc(0)))
    weighted = [w0 * deltas[0], w1 * deltas[1]]
    sign = np.where(weighted[0] + weighted[1] >= 0, acc(1), acc(-1))
    agree = [np.sign(w) == sign for w in weighted]
    divisor = w0 * agree[0] + w1 * agree[1]
    divisor[divisor == 0] = 1
    want = (z + (weighted[0] * agree[0] + weighted[1] * agree[1]) / divisor).astype(dtype)
    assert ties.dtype == dtype
    np.testing.assert_allclose(ties.astype(acc), want.astype(acc), rtol=1e-3 if dtype == np.float16 else 1e-12)


def test_a_merges_card_names_its_base_models_as_a_merge(tmp_path):
    """An export of a merge lists the base models it is given in the relation
    `merge` (the Hub's model tree draws them as the merge's parents); local
    inputs are no Hub repositories, so a card given none lists none."""
    a, b = _saved(tmp_path, [0, 1])
    eqx_ckpt.merge(tmp_path / "merged", [a, b], method="linear")
    eqx_ckpt.export_safetensors(tmp_path / "named", tmp_path / "merged", base_model=["me/a", "me/b"])
    front = (tmp_path / "named" / "README.md").read_text().split("\n---\n")[0]
    assert 'base_model:\n- "me/a"\n- "me/b"\nbase_model_relation: merge\ntags:' in front, front
    eqx_ckpt.export_safetensors(tmp_path / "plain", tmp_path / "merged")
    front = (tmp_path / "plain" / "README.md").read_text().split("\n---\n")[0]
    assert "base_model" not in front and "- merge" in front, front
