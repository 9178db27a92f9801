"""`_window.windowed`: one host-memory budget for every reader of a checkpoint."""

from __future__ import annotations

import equinox as eqx
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal
from hypothesis import given, settings

import eqx_ckpt
from eqx_ckpt._store import _window


class _Reads:
    """Jobs that record when each starts and finishes, and what was in flight."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.running: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []
        self.peaks: list[tuple[int, int]] = []  # (bytes, reads) in flight as each starts

    def jobs(self):
        for i, size in enumerate(self.sizes):
            self.events.append(("taken", i))
            yield i, size, lambda i=i: self.start(i)

    def start(self, i):
        self.running[i] = self.sizes[i]
        self.peaks.append((sum(self.running.values()), len(self.running)))
        self.events.append(("start", i))
        return lambda: self.finish(i)

    def finish(self, i):
        del self.running[i]
        self.events.append(("finish", i))
        return i * 10


def _run(reads, *, budget, max_reads=None, monkeypatch):
    monkeypatch.setattr(_window, "READ_BUDGET", budget)
    out = []
    for key, size, finish in _window.windowed(reads.jobs(), max_reads=max_reads):
        assert size == reads.sizes[key]
        out.append((key, finish()))
    return out


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 100), max_size=30),
    budget=st.integers(1, 150),
    max_reads=st.none() | st.integers(1, 5),
)
def test_reads_stay_within_the_budget_and_keep_their_order(sizes, budget, max_reads):
    with pytest.MonkeyPatch.context() as monkeypatch:
        reads = _Reads(sizes)
        out = _run(reads, budget=budget, max_reads=max_reads, monkeypatch=monkeypatch)
    assert out == [(i, i * 10) for i in range(len(sizes))]
    for (nbytes, count), size in zip(reads.peaks, sizes, strict=True):
        # Over the budget only when a single read is: it then runs alone.
        assert nbytes <= budget or count == 1
        assert max_reads is None or count <= max_reads
        assert nbytes >= size


def test_a_read_starts_only_when_there_is_room(monkeypatch):
    """Room for two reads of 40: the third is taken from the jobs, the first
    finishes, then the third starts; a read larger than the budget waits for all
    the others and runs alone. Nothing is taken from the jobs ahead of that."""
    reads = _Reads([40, 40, 40, 200, 10])
    _run(reads, budget=100, monkeypatch=monkeypatch)
    assert reads.events == [
        ("taken", 0),
        ("start", 0),
        ("taken", 1),
        ("start", 1),
        ("taken", 2),
        ("finish", 0),
        ("start", 2),
        ("taken", 3),
        ("finish", 1),
        ("finish", 2),
        ("start", 3),
        ("taken", 4),
        ("finish", 3),
        ("start", 4),
        ("finish", 4),
    ]
    reads = _Reads([1, 1, 1])
    _run(reads, budget=100, max_reads=2, monkeypatch=monkeypatch)
    assert reads.events.index(("start", 2)) > reads.events.index(("finish", 0))


@pytest.fixture
def watched(monkeypatch, faults):
    """Every use of the budget (fault point `window.open`, noted as 0) and every
    read started through it (`window.start`): how many reads were then in
    flight. The budget is one byte: one read at a time."""
    monkeypatch.setattr(_window, "READ_BUDGET", 1)
    calls = []
    faults({"window.open": lambda: calls.append(0), "window.start": calls.append})
    return calls


def test_every_reader_uses_the_one_budget(tmp_path, watched, packing):
    """A load, `materialise`, a transformed load, `verify` and `diff` all read
    through the budget: with room for one byte, one read at a time."""
    tree = {f"l{i}": jnp.full((i + 1, 3), i, jnp.float32) for i in range(6)} | {"big": jnp.ones((300, 300))}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", tree)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", tree | {"l0": jnp.ones((1, 3))})
    like = eqx.filter_eval_shape(lambda: tree)

    def check(what, run):
        watched.clear()
        run()
        assert watched, f"{what} read without the budget"
        assert all(in_flight <= 1 for in_flight in watched), what

    check("load", lambda: tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", like), tree))
    lazy = eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", like, lazy=True)
    check("materialise", lambda: eqx_ckpt.materialise(lazy))
    doubled = eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", like, transform={"big": lambda x: np.asarray(x) * 2})
    assert tree_equal(doubled["big"], tree["big"] * 2)
    check("transform", lambda: eqx_ckpt.tree_deserialise_leaves(tmp_path / "a", like, transform={"big": np.asarray}))
    check("verify", lambda: eqx_ckpt.verify(tmp_path / "a"))
    diffs = []
    check("diff", lambda: diffs.append(eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")))
    assert list(diffs[0].values) == ["l0"]
