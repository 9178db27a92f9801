"""`_staging.Batch`: a save's leaves sorted by where they are written, freed
while the writes are in flight."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import pytest

from eqx_ckpt._base import _tree
from eqx_ckpt._base._location import location
from eqx_ckpt._save import _records, _serialise, _staging


def test_a_freed_batch_is_empty_and_refuses_to_give_records():
    """Once freed, a batch holds nothing and asking for its records is an
    internal error, never an empty manifest."""
    leaves = [jnp.arange(n, dtype=jnp.float32) for n in (3, 5000, 7)]
    flat_leaves, names = _tree.flatten_named({f"x{i}": x for i, x in enumerate(leaves)}, None)
    spec = _serialise.default_serialise_filter_spec
    pending = _records.build(location("memory://batch"), flat_leaves, names, [spec] * 3, None, default=spec)
    del flat_leaves
    _records.assign([p.record for p in pending], [p.pieces for p in pending])
    flat = [((), x) for x in leaves]
    batch = _staging.Batch(pending, made=flat)
    assert [r.path for r in batch.records()] == ["x0", "x1", "x2"]
    assert batch.packs and batch.nbytes == sum(x.nbytes for x in leaves)
    # Nothing is made host yet (`_staging` does it as the writes reach each piece).
    assert all(p.pieces[0][1] is x for p, x in zip(pending, leaves, strict=True))
    arrays = [weakref.ref(x) for x in leaves]
    del leaves
    batch.free()
    # The save's own lists are emptied with it (`pending` is the batch's).
    assert batch.pending == [] and pending == [] and batch.own == [] and batch.packs == [] and flat == []
    gc.collect()
    assert all(array() is None for array in arrays)  # nothing else held the leaves
    with pytest.raises(RuntimeError, match="after they were freed"):
        batch.records()
