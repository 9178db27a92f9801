"""`_records`: the short branch for the common leaf gives exactly what the
general way gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from arrays import values

from eqx_ckpt import LeafHandle, _records, _staging

DTYPES = [
    np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
    np.int8, np.int32, np.uint16, np.int64, np.bool_, np.complex64,
]  # fmt: skip
SHAPES = [(), (0,), (3,), (4, 5), (2, 0, 3), (1, 1, 1, 7)]


def _never_cast(path: str, dtype: np.dtype) -> None:
    """A `cast` that changes nothing, so `_prepare` goes the general way."""
    return None


def _both(x):
    handle = LeafHandle((jax.tree_util.DictKey("w"),), "w", "ckpt")
    short = _records._prepare(handle, x, None, primary=True)
    general = _records._prepare(handle, x, _never_cast, primary=True)
    return short, general


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
def test_short_path_gives_the_general_record(dtype, shape, as_jax):
    x = values(shape, dtype)
    if as_jax:
        if np.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
            pytest.skip("64-bit jax arrays need x64")
        x = jax.device_put(x)
    short, general = _both(x)
    assert short.record == general.record
    assert len(short.pieces) == len(general.pieces) == 1
    assert short.pieces[0][0] == general.pieces[0][0] == ()
    (a,), (b,) = [_staging.host(p[1]) for p in short.pieces], [_staging.host(p[1]) for p in general.pieces]
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_short_path_is_not_taken_for_other_leaves():
    """Keys, big-endian arrays and arrays of more than 32 dimensions go the
    general way (key data, byte order, the rank error)."""
    key = jax.random.key(0)
    short, general = _both(key)
    assert short.record == general.record and short.record.type == "prng_key"
    swapped = values((3,), np.float32).astype(">f4")
    short, general = _both(swapped)
    assert short.record == general.record
    assert _staging.host(short.pieces[0][1]).tobytes() == _staging.host(general.pieces[0][1]).tobytes()
    with pytest.raises(RuntimeError, match="dimensions"):
        _records._prepare(LeafHandle((), "w", "ckpt"), np.zeros((1,) * 33, np.float32), None, primary=True)


def test_one_loop_over_every_leaf_gives_what_each_leaf_gives_alone():
    """`_common`, which a save runs over the whole tree, works the record's
    fixed part out once per (dtype, shape): leaves sharing one but of another
    kind, held leaves, a big-endian copy, keys and a deleted array (`None`: the
    general way names it) must each come out as it makes them alone."""
    deleted = jnp.arange(4.0)
    deleted.delete()
    x = values((4,), np.float32)
    leaves = [
        x, jax.device_put(x), x.astype(">f4"), jax.random.key(0), deleted,
        _records.Held(jax.device_put(x), None, [((), x)]), values((2, 3), np.int8),
        jnp.asarray(x, jnp.bfloat16), x[None], 3.0, values((4,), np.float16),
    ]  # fmt: skip
    paths = [f"x{i}" for i in range(len(leaves))]
    keypaths = [[["key", p]] for p in paths]
    for primary in (True, False):
        together = _records._common(leaves, paths, keypaths, primary)
        alone = [_records._common([x], [p], [k], primary)[0] for x, p, k in zip(leaves, paths, keypaths, strict=True)]
        assert [p is None for p in together] == [p is None for p in alone]
        # Another process writes nothing, so it never reads the deleted array.
        assert [i for i, p in enumerate(together) if p is None] == ([3, 4, 9] if primary else [3, 9])
        for a, b in zip(together, alone, strict=True):
            if a is not None:
                assert a.record == b.record
                assert [(i, _staging.host(v).tobytes()) for i, v in a.pieces] == [
                    (i, _staging.host(v).tobytes()) for i, v in b.pieces
                ]
        kinds = [p.record.type for p in together if p is not None]
        deleted_kind = [] if primary else ["jax"]
        assert kinds == ["numpy", "jax", "numpy", *deleted_kind, "jax", "numpy", "jax", "numpy", "numpy"]
        assert all(p.pieces == [] for p in together if p is not None and p.record.path != "x5") is not primary


def test_a_traced_leaf_is_refused_on_the_short_path_too():
    handle = LeafHandle((jax.tree_util.DictKey("w"),), "w", "ckpt")

    @jax.jit
    def f(x):
        with pytest.raises(RuntimeError, match="traced value"):
            _records._prepare(handle, x, None, primary=True)
        return x

    f(jnp.ones(3))


def test_other_processes_write_no_pieces():
    short = _records._prepare(LeafHandle((), "w", "ckpt"), jnp.ones(3), None, primary=False)
    assert short.pieces == [] and short.record.shape == (3,)


def test_kinds_are_remembered_by_type():
    """`array_kind` decides by type, once per type: what `_common` (the short
    branch) and an asynchronous save's hold both ask."""

    class Sub(np.ndarray):
        pass

    tracers = []
    jax.jit(lambda x: tracers.append(type(x)) or x)(jnp.ones(2))
    kinds = {
        np.ndarray: "numpy", Sub: "ndarray", type(jnp.ones(2)): "jax", tracers[0]: "abstract",
        jax.ShapeDtypeStruct: "abstract", int: "other", str: "other",
    }  # fmt: skip
    for cls, kind in kinds.items():
        assert _records.array_kind(cls) == kind
        assert _records._KINDS[cls] == kind
    handle = LeafHandle((jax.tree_util.DictKey("w"),), "w", "ckpt")
    assert _records._common([np.arange(3.0).view(Sub)], ["w"], [[["key", "w"]]], True) == [None]
    assert _records._common([jnp.ones(2)], ["w"], [[["key", "w"]]], True)[0].record.type == "jax"
    assert _records._prepare(handle, np.arange(3.0).view(Sub), None, primary=True).record.type == "numpy"
