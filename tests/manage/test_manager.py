"""`CheckpointManager`: steps on disk, retention, interrupted saves, async saves, restore."""

import gc
import inspect
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import places
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._base import _faults, _location, _progress
from eqx_ckpt._ondisk import _format
from eqx_ckpt._store import _storage


def _state(seed=0):
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(seed))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": seed}


def _tree(value):
    return {"w": jnp.full((2,), float(value)), "n": value}


def _save_all(manager, losses):
    for step, loss in losses.items():
        manager.save(step, _tree(step), metrics={"loss": loss})


def _listing(path):
    """The directory's names, less the retention record a manager with rules keeps
    (`test_retention_deletes_no_step_saved_under_other_rules` checks it)."""
    return sorted(p.name for p in path.iterdir() if p.name != "retention.json")


def test_round_trip_and_layout(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    state = _state(7)
    manager.save(42, state, metrics={"loss": np.float32(0.5), "epoch": 3, "ok": True})
    assert _listing(tmp_path / "run") == ["step_00000042"]  # the metrics are in its manifest
    assert (tmp_path / "run" / "step_00000042" / "manifest.json").is_file()
    assert manager.step_path(42) == str(tmp_path / "run" / "step_00000042")
    assert manager.all_steps() == [42] and manager.latest_step() == 42
    assert manager.metrics(42) == {"loss": 0.5, "epoch": 3, "ok": True}
    assert type(manager.metrics(42)["epoch"]) is int
    restored = manager.restore(eqx.filter_eval_shape(_state, 1))
    assert tree_equal(restored, state, typematch=True)
    # The step's folder is an ordinary checkpoint.
    assert "model.layers.0.weight" in eqx_ckpt.Checkpoint(manager.step_path(42))


def test_step_path_names_the_step_after_the_working_directory_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manager = eqx_ckpt.CheckpointManager("run")
    manager.save(1, _state(1))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    # It once gave "run/step_00000001" back: relative to a directory left since.
    assert manager.step_path(1) == str(tmp_path / "run" / "step_00000001")
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(manager.step_path(1), _state(0)), _state(1), typematch=True)
    manager.close()


def test_large_steps_sort_by_number(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    for step in (123_456_789, 5, 99_999_999):
        manager.save(step, _tree(1))
    assert manager.all_steps() == [5, 99_999_999, 123_456_789]
    assert (tmp_path / "step_123456789").is_dir()


def test_no_policy_keeps_everything(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    _save_all(manager, {step: 1.0 for step in range(6)})
    assert manager.all_steps() == list(range(6))


def test_max_to_keep(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=2)
    _save_all(manager, {step: 1.0 for step in range(5)})
    assert manager.all_steps() == [3, 4]
    # The deleted steps' folders are gone, not just their manifests.
    assert _listing(tmp_path) == ["step_00000003", "step_00000004"]


def test_keep_every_keeps_multiples_and_the_latest(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, keep_every=3)
    _save_all(manager, {step: 1.0 for step in range(8)})
    assert manager.all_steps() == [0, 3, 6, 7]


@pytest.mark.parametrize("mode, kept, best", [("min", [1, 4, 5], 1), ("max", [0, 2, 5], 2)])
def test_best_n(tmp_path, mode, kept, best):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1, best_n=2, best_metric="loss", best_mode=mode)
    _save_all(manager, {0: 5.0, 1: 1.0, 2: 9.0, 3: 3.0, 4: 2.0, 5: 4.0})
    assert manager.all_steps() == kept
    assert manager.best_step() == best


def test_policies_keep_the_union(tmp_path):
    manager = eqx_ckpt.CheckpointManager(
        tmp_path, max_to_keep=2, keep_every=4, best_n=1, best_metric="acc", best_mode="max"
    )
    accuracy = {0: 0.1, 1: 0.2, 2: 0.9, 3: 0.3, 4: 0.4, 5: 0.5, 6: 0.6, 7: 0.7, 9: 0.0, 10: 0.0}
    for step, acc in accuracy.items():
        manager.save(step, _tree(step), metrics={"acc": acc})
    # last two: 9, 10; every 4th: 0, 4; best accuracy: 2.
    assert manager.all_steps() == [0, 2, 4, 9, 10]
    assert manager.best_step() == 2


def test_best_step_ignores_missing_and_nan_and_prefers_later_ties(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, best_metric="loss")
    assert manager.best_step() is None
    manager.save(0, _tree(0))
    manager.save(1, _tree(1), metrics={"loss": float("nan")})
    manager.save(2, _tree(2), metrics={"other": 0.0})
    assert manager.best_step() is None
    manager.save(3, _tree(3), metrics={"loss": 2.0})
    manager.save(4, _tree(4), metrics={"loss": jnp.float32(2.0)})
    manager.save(5, _tree(5), metrics={"loss": 3.0})
    assert manager.best_step() == 4
    assert math.isnan(manager.metrics(1)["loss"])
    assert manager.metrics(0) == {}
    # Non-finite values are kept as strings, so the manifest stays standard JSON.
    text = (tmp_path / "step_00000001" / "manifest.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c))["metrics"] == {"loss": "nan"}


def test_best_n_never_keeps_nan(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1, best_n=1, best_metric="loss")
    _save_all(manager, {0: float("nan"), 1: 3.0, 2: float("nan")})
    assert manager.all_steps() == [1, 2]


def test_best_step_needs_a_metric(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("best_metric=")):
        manager.best_step()


def test_best_step_of_an_evaluators_manager_ranks_by_the_recorded_metric(tmp_path):
    """Issue 59, item 13: an evaluator's manager (no rules of its own) had to
    be told `best_metric=` again, though `retention.json` records it."""
    with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=5, best_n=1, best_metric="acc", best_mode="max") as trainer:
        for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
            trainer.save(step, _tree(step), metrics={"acc": acc, "loss": float(step)})
    evaluator = eqx_ckpt.CheckpointManager(tmp_path)
    assert evaluator.best_step() == 2  # "max", as recorded: the lowest acc would be step 1
    # Its own metric wins.
    assert eqx_ckpt.CheckpointManager(tmp_path, best_metric="loss").best_step() == 1
    message = f"neither this manager nor the retention record of {str(tmp_path / 'other')!r} names one"
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
        eqx_ckpt.CheckpointManager(tmp_path / "other").best_step()


def test_interrupted_step_folder_is_not_a_step_and_is_cleaned_up(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=5)
    manager.save(1, _tree(1), metrics={"loss": 1.0})
    manager.close()
    # What a process killed mid-save leaves: arrays, no manifest (and, from
    # version 1, metrics files beside steps).
    (tmp_path / "step_00000002" / "w").mkdir(parents=True)
    (tmp_path / "step_00000002" / "w" / "zarr.json").write_text("{}")
    (tmp_path / "step_00000002.metrics.json").write_text('{"step": 2, "metrics": {"loss": 0.0}}')
    (tmp_path / "step_00000007.metrics.json").write_text('{"step": 7, "metrics": {}}')
    fresh = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=5, best_metric="loss")
    assert fresh.all_steps() == [1] and fresh.latest_step() == 1 and fresh.best_step() == 1
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape("no committed step 2")):
        fresh.restore(_tree(0), step=2)
    fresh.save(3, _tree(3))
    assert _listing(tmp_path) == ["step_00000001", "step_00000003"]
    # The interrupted step can be saved again.
    fresh.save(2, _tree(2))
    assert fresh.all_steps() == [1, 2, 3]


def test_a_users_file_named_like_a_steps_metrics_is_left_alone(tmp_path):
    """Only a metrics file a version 1 manager wrote (`{"step": N, "metrics":
    {...}}`) is removed with its step or as a leftover; a user's file of that
    name (other JSON, text, a link, a folder) stays, named in a warning."""
    outside = tmp_path / "outside.json"
    outside.write_text('{"step": 4, "metrics": {}}')
    run = tmp_path / "run"
    run.mkdir()
    users = {
        "step_00000003.metrics.json": '{"notes": "lr sweep, keep"}',
        "step_00000005.metrics.json": "plain notes",
        "step_00000006.metrics.json": '{"step": 5, "metrics": {}}',  # another step's number: not this file's
    }
    for name, text in users.items():
        (run / name).write_text(text)
    (run / "step_00000004.metrics.json").symlink_to(outside)
    (run / "step_00000008.metrics.json").mkdir()
    (run / "step_00000009.metrics.json").write_text('{"step": 9, "metrics": {"loss": 1.0}}')  # version 1's
    manager = eqx_ckpt.CheckpointManager(run, max_to_keep=1)
    with pytest.warns(eqx_ckpt.RetentionWarning) as warned:
        manager.save(1, _tree(1))
    message = str(warned[0].message)
    for name in [*users, "step_00000004.metrics.json", "step_00000008.metrics.json"]:
        assert f"{name!r} (a file that is not a metrics file an eqx_ckpt manager wrote)" in message
    assert "step_00000009" not in message
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == sorted(
        [*users, "step_00000004.metrics.json", "step_00000008.metrics.json", "step_00000001"]
    )
    assert all((run / name).read_text() == text for name, text in users.items())
    assert outside.read_text() == '{"step": 4, "metrics": {}}'
    # A step saved, then deleted by retention, beside a user's file of its metrics' name: the file stays.
    (run / "step_00000002.metrics.json").write_text("mine")
    with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape("'step_00000002.metrics.json' (a file that is")):
        manager.save(2, _tree(2))
    manager.save(3, _tree(3))
    assert manager.all_steps() == [3]
    assert (run / "step_00000002.metrics.json").read_text() == "mine"
    manager.close()


def test_save_whose_filter_spec_raises_leaves_nothing(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(1, _tree(1))

    def broken(handle, x):
        raise ValueError("no space for this leaf")

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("no space for this leaf")):
        manager.save(2, _tree(2), metrics={"loss": 0.0}, filter_spec=broken)
    assert manager.all_steps() == [1]
    assert _listing(tmp_path) == ["step_00000001"]
    assert tree_equal(manager.restore(_tree(0)), _tree(1), typematch=True)
    manager.save(2, _tree(2))
    assert manager.all_steps() == [2]


def test_async_saves(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=2, blocking=False)
    trees = {}
    for step in range(4):
        trees[step] = {"w": jnp.arange(3.0) + step}
        assert manager.save(step, trees[step], metrics={"loss": float(step)}) is None
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
    for step in (2, 3):
        assert tree_equal(manager.restore({"w": jnp.zeros(3)}, step), trees[step], typematch=True)
    manager.wait_until_finished()  # nothing in flight: a no-op


def test_async_error_surfaces_on_next_save_and_leaves_nothing(tmp_path, faults):
    manager = eqx_ckpt.CheckpointManager(tmp_path, blocking=False)
    manager.save(0, _tree(0))
    manager.wait_until_finished()

    def commit_failing_for_step_1(loc):
        if loc.display.endswith("step_00000001"):
            raise OSError("disk full")

    faults("transaction.commit", commit_failing_for_step_1)
    manager.save(1, _tree(1), metrics={"loss": 1.0})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("disk full")):
        manager.save(2, _tree(2))
    assert manager.all_steps() == [0]
    assert _listing(tmp_path) == ["step_00000000"]
    # The error was reported once; saving goes on.
    manager.save(2, _tree(2))
    manager.wait_until_finished()
    assert manager.all_steps() == [0, 2]


def test_async_error_surfaces_on_wait(tmp_path, faults):
    manager = eqx_ckpt.CheckpointManager(tmp_path, blocking=False)
    faults("transaction.commit", OSError("disk full"))
    manager.save(5, _tree(5))
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("disk full")):
        manager.wait_until_finished()
    assert manager.all_steps() == [] and _listing(tmp_path) == []


def test_context_manager_waits(tmp_path):
    with eqx_ckpt.CheckpointManager(tmp_path, blocking=False) as manager:
        manager.save(3, _tree(3))
    assert eqx_ckpt.CheckpointManager(tmp_path).all_steps() == [3]


def test_restore_options(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    state = _state(3)
    manager.save(10, state)
    fresh = _state(0)
    # `prefix`: the model alone, without an optimiser skeleton.
    model = manager.restore(eqx.filter_eval_shape(lambda: _state(0)["model"]), prefix="model")
    assert tree_equal(model, state["model"], typematch=True)
    # `where`: only the model is read; the rest stays as in `like`.
    partial = manager.restore(fresh, where=lambda t: t["model"])
    assert tree_equal(partial["model"], state["model"], typematch=True)
    assert tree_equal(partial["opt_state"], fresh["opt_state"], typematch=True)
    assert partial["step"] == 0
    # `rename`, `lazy`, `missing`, `strict`, `cast` reach the loader.
    renamed = manager.restore({"body": {"w": jnp.zeros((8, 3))}}, rename={"body.w": "model.layers.0.weight"})
    assert tree_equal(renamed["body"]["w"], state["model"].layers[0].weight)
    lazy = manager.restore(
        {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}, rename={"w": "model.layers.0.bias"}, lazy=True
    )
    assert isinstance(lazy["w"], eqx_ckpt.LazyArray)
    assert np.array_equal(np.asarray(lazy["w"]), state["model"].layers[0].bias)
    kept = manager.restore({"step": 0, "extra": jnp.ones(2)}, missing="keep")
    assert kept["step"] == 3 and tree_equal(kept["extra"], jnp.ones(2))
    assert tree_equal(manager.restore(fresh["model"], prefix="model", strict=True), state["model"])
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`opt_state.0.count`")):
        manager.restore({"step": 0}, strict=True)
    like = {"w": jnp.zeros((8, 3), jnp.bfloat16)}
    cast = manager.restore(like, rename={"w": "model.layers.0.weight"}, cast=True)
    assert tree_equal(cast["w"], state["model"].layers[0].weight.astype(jnp.bfloat16), typematch=True)


def test_restore_filter_spec_and_is_leaf(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.save(0, {"a": jnp.ones(2), "b": jnp.ones(2)})
    keep_b = {"a": eqx_ckpt.default_deserialise_filter_spec, "b": lambda handle, x: x}
    out = manager.restore({"a": jnp.zeros(2), "b": jnp.zeros(2)}, filter_spec=keep_b)
    assert tree_equal(out, {"a": jnp.ones(2), "b": jnp.zeros(2)}, typematch=True)


@pytest.mark.parametrize("method", ["restore", "restore_or_initialise"])
def test_restore_takes_every_load_option_with_its_default(method):
    """Issue 40, items 5 and 6: `restore(like, progress=False)` was a TypeError
    and `transform` was not passed; `restore_or_initialise` took no option at all."""
    loads = inspect.signature(eqx_ckpt.tree_deserialise_leaves).parameters
    options = {name: p.default for name, p in loads.items() if name not in ("path", "like")}
    if method == "restore_or_initialise":
        # Its skeleton always comes from `init`: the options of a load without `like` have no meaning there.
        del options["trust"], options["check_init"]
    params = inspect.signature(getattr(eqx_ckpt.CheckpointManager, method)).parameters
    ours = {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert ours == options


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what was written to it."""

    def isatty(self):
        return True


def test_restore_honours_progress_and_transform(tmp_path, monkeypatch):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    saved = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    manager.save(0, saved)
    like = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(_progress, "MIN_LEAVES", 1)  # every load is large enough for a bar
    assert tree_equal(manager.restore(like, progress=False), saved, typematch=True)
    assert terminal.getvalue() == ""
    manager.restore(like)
    assert "load" in terminal.getvalue() and "2/2 leaves" in terminal.getvalue()
    calls = []
    manager.restore(like, progress=lambda *counts: calls.append(counts))
    total = eqx_ckpt.Checkpoint(manager.step_path(0)).total_bytes
    assert calls and calls[-1] == (2, 2, total, total)
    # `transform`, eager and lazy.
    transform = {"w": np.transpose}
    out = manager.restore({"w": jnp.zeros((3, 2))}, transform=transform)
    assert tree_equal(out, {"w": saved["w"].T}, typematch=True)
    lazy = manager.restore({"w": jnp.zeros((3, 2))}, transform=transform, lazy=True)
    assert isinstance(lazy["w"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), {"w": saved["w"].T}, typematch=True)


def _with_ema(state):
    """The state with an exponential moving average of the model's arrays."""
    ema = jax.tree_util.tree_map(lambda x: x * 0.5, eqx.filter(state["model"], eqx.is_array))
    return {**state, "ema": ema}


def test_restore_or_initialise_resumes_a_state_that_gained_leaves(tmp_path):
    """Issue 40, item 6: after an EMA was added to the state, resuming failed with
    an error advising `missing='keep'`, which `restore_or_initialise` refused."""
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    saved = _state(1)
    manager.save(5, saved)
    init = lambda: _with_ema(_state(0))
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`ema.layers.0.weight`")) as info:
        manager.restore_or_initialise(init)
    assert "`missing='keep'` keeps `like`'s value for missing leaves" in str(info.value)
    step, state = manager.restore_or_initialise(init, missing="keep")
    # The EMA is `init`'s; everything else is the step's, bit for bit.
    assert step == 5
    assert tree_equal(state, {**saved, "ema": init()["ema"]}, typematch=True)
    assert not tree_equal(state["ema"], _with_ema(saved)["ema"])


def test_restore_or_initialise_honours_the_load_options(tmp_path, monkeypatch):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    w = jnp.arange(6.0).reshape(2, 3)
    manager.save(0, {"model": {"w": w}, "extra": jnp.ones(2)})
    # `prefix`, `rename`, `transform`, `cast`.
    init = lambda: {"weight": jnp.zeros((3, 2), jnp.bfloat16)}
    options = {"prefix": "model", "rename": {"weight": "w"}, "transform": {"weight": np.transpose}}
    step, out = manager.restore_or_initialise(init, **options, cast=True)
    assert step == 0 and tree_equal(out, {"weight": w.T.astype(jnp.bfloat16)}, typematch=True)
    # `where`: the leaves it leaves out are `init`'s.
    init = lambda: {"model": {"w": jnp.full((2, 3), 9.0)}, "extra": jnp.full(2, 5.0)}
    _, out = manager.restore_or_initialise(init, where=lambda t: t["model"])
    assert tree_equal(out, {"model": {"w": w}, "extra": jnp.full(2, 5.0)}, typematch=True)
    # So are those a custom `filter_spec` does not load.
    keep_extra = {"model": eqx_ckpt.default_deserialise_filter_spec, "extra": lambda handle, x: x}
    _, out = manager.restore_or_initialise(init, filter_spec=keep_extra)
    assert tree_equal(out, {"model": {"w": w}, "extra": jnp.full(2, 5.0)}, typematch=True)
    # `strict`, `lazy`, `progress`.
    init = lambda: {"model": {"w": jnp.zeros((2, 3))}}
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`extra`")):
        manager.restore_or_initialise(init, strict=True)
    _, out = manager.restore_or_initialise(init, lazy=True)
    assert isinstance(out["model"]["w"], eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(out), {"model": {"w": w}}, typematch=True)
    calls = []
    manager.restore_or_initialise(init, progress=lambda *counts: calls.append(counts))
    assert calls and calls[-1][:2] == (1, 1)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(_progress, "MIN_LEAVES", 1)
    manager.restore_or_initialise(init, progress=False)
    assert terminal.getvalue() == ""


def test_unknown_steps(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    assert manager.all_steps() == [] and manager.latest_step() is None
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape("no committed step in")):
        manager.restore(_tree(0))
    _save_all(manager, {2: 1.0, 4: 1.0})
    message = f"There is no committed step 3 in {str(tmp_path / 'run')!r}; the committed steps are [2, 4]."
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError, match=re.escape(message)):
        manager.restore(_tree(0), step=3)
    with pytest.raises(FileNotFoundError, match=re.escape("steps are [2, 4]")):
        manager.metrics(3)


def test_saving_a_step_twice(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.save(1, _tree(1), metrics={"loss": 1.0})
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape("Step 1 already exists")):
        manager.save(1, _tree(5), metrics={"loss": 0.0})
    assert manager.metrics(1) == {"loss": 1.0}
    assert tree_equal(manager.restore(_tree(0)), _tree(1), typematch=True)

    # A failed overwrite keeps the old step whole: arrays and metrics.
    def broken(handle, x):
        raise OSError("broken disk")

    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("broken disk")):
        manager.save(1, _tree(5), metrics={"loss": 0.5}, overwrite=True, filter_spec=broken)
    assert manager.metrics(1) == {"loss": 1.0}
    assert tree_equal(manager.restore(_tree(0)), _tree(1), typematch=True)
    manager.save(1, _tree(5), metrics={"loss": 0.0}, overwrite=True)
    assert manager.metrics(1) == {"loss": 0.0}
    assert tree_equal(manager.restore(_tree(0)), _tree(5), typematch=True)


def test_other_files_are_never_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    for name in ("step_5", "step_000000001", "step_00000001.bak", "logs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "step_00000001.metrics.json.bak").write_text("{}")
    before = _listing(tmp_path)
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1)
    assert manager.all_steps() == []
    _save_all(manager, {1: 1.0, 2: 1.0, 3: 1.0})
    assert _listing(tmp_path) == sorted([*before, "step_00000003"])
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_restore_or_initialise(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    step, state = manager.restore_or_initialise(lambda: _state(0))
    assert step is None and tree_equal(state, _state(0), typematch=True)
    manager.save(3, _state(1))
    manager.save(8, _state(2))
    step, state = eqx_ckpt.CheckpointManager(tmp_path).restore_or_initialise(lambda: _state(0))
    assert step == 8 and tree_equal(state, _state(2), typematch=True)


def test_kvstore_url(tmp_path):
    manager = eqx_ckpt.CheckpointManager("memory://manager_test/run/", max_to_keep=1, best_n=1, best_metric="loss")
    _save_all(manager, {0: 2.0, 1: 1.0, 2: 3.0, 3: 4.0})
    assert manager.all_steps() == [1, 3] and manager.metrics(1) == {"loss": 1.0}
    assert tree_equal(manager.restore(_tree(0), step=1), _tree(1), typematch=True)


def test_invalid_arguments(tmp_path):
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("pass `best_metric`")):
        eqx_ckpt.CheckpointManager(tmp_path, best_n=2)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`best_mode` must be 'min' or 'max'")):
        eqx_ckpt.CheckpointManager(tmp_path, best_metric="acc", best_mode="maximum")
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`max_to_keep` must be a positive int")):
        eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=0)
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("A step must be an int, not bool")):
        manager.save(True, _tree(1))
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("non-negative")):
        manager.save(-1, _tree(1))
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("Metric 'loss' of step 1")):
        manager.save(1, _tree(1), metrics={"loss": jnp.ones(2)})
    assert _listing(tmp_path) == []


def test_edited_metrics_are_detected(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.save(1, _tree(1), metrics={"loss": 1.0})
    manifest = tmp_path / "step_00000001" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"loss": 1.0', '"loss": 0.1'))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("its digest does not match")):
        manager.metrics(1)


def test_a_failed_overwrite_keeps_the_steps_metrics(tmp_path):
    # The metrics commit with the step (they are in its manifest): an overwrite
    # that fails, or is killed, leaves the old step with its old metrics.
    manager = eqx_ckpt.CheckpointManager(tmp_path, best_metric="loss")
    manager.save(1, _tree(1), metrics={"loss": 5.0})
    manager.save(2, _tree(2), metrics={"loss": 3.0})
    with _faults.armed("transaction.commit", OSError("disk full")):
        with pytest.raises(eqx_ckpt.LeafError, match=re.escape("disk full")):
            manager.save(1, _tree(7), metrics={"loss": 0.5}, overwrite=True)
    assert manager.metrics(1) == {"loss": 5.0} and manager.best_step() == 2
    assert tree_equal(manager.restore(_tree(0), step=1), _tree(1), typematch=True)
    manager.save(1, _tree(7), metrics={"loss": 0.5}, overwrite=True)
    assert manager.metrics(1) == {"loss": 0.5} and manager.best_step() == 1


def test_integer_scalars_are_steps(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.save(jnp.int32(46), _tree(1))
    manager.save(np.int64(47), _tree(2))
    manager.save(jnp.array(48, jnp.uint8), _tree(3))
    assert manager.all_steps() == [46, 47, 48]
    assert type(manager.latest_step()) is int
    assert tree_equal(manager.restore(_tree(0), step=jnp.int32(47)), _tree(2))
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("A step must be an int")):
        manager.save(jnp.float32(49), _tree(1))
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("A step must be an int")):
        manager.save(jnp.arange(2), _tree(1))


def test_a_file_is_not_a_manager_directory(tmp_path):
    (tmp_path / "file").write_text("hello")
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("is a file, not a directory")):
        eqx_ckpt.CheckpointManager(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "hello"


def test_rollback_drops_the_abandoned_steps(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=3)
    for step in (100, 200, 300):
        manager.save(step, _tree(step), metrics={"loss": float(step)})
    state = manager.restore(_tree(0), step=200)
    assert manager.delete_steps_after(200) == [300]
    assert manager.latest_step() == 200
    for step in (210, 220, 230):
        manager.save(step, state)
    assert manager.all_steps() == [210, 220, 230]
    assert manager.latest_step() == 230
    assert _listing(tmp_path) == ["step_00000210", "step_00000220", "step_00000230"]


def test_a_step_saved_below_the_latest_is_not_deleted_at_once(tmp_path):
    # Steps are ordered by number: without a rollback the higher ones stay, but
    # the step just saved is never the one retention deletes.
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=2)
    for step in (100, 200, 300):
        manager.save(step, _tree(step))
    assert manager.all_steps() == [200, 300]
    manager.save(210, _tree(210))
    assert manager.all_steps() == [210, 300]
    assert manager.latest_step() == 300
    manager.save(400, _tree(400))
    assert manager.all_steps() == [300, 400]


def test_an_interrupt_after_an_asynchronous_save_went_to_the_background_never_removes_it(tmp_path, faults):
    """A Ctrl-C landing after `save` handed the step to its background thread
    (here: as the inner save returns) once made the manager remove the step
    folder while that thread was still writing it; the thread then committed a
    step without its arrays. Forced order: the removal, if any, runs just
    before the background thread writes the manifest."""
    import threading

    from eqx_ckpt._save import _background

    undone, at_commit = threading.Event(), threading.Event()

    def undo(step):
        at_commit.wait(10)
        undone.set()

    def save_returned(step, pending):
        if pending is not None:
            raise KeyboardInterrupt

    def write_conditional(loc, name):
        if name == "manifest.json" and threading.current_thread() is not threading.main_thread():
            at_commit.set()
            undone.wait(2)  # with the fix, nothing is undone

    faults("manager.undo", undo)
    faults("manager.save_returned", save_returned)
    faults("commit.manifest_write", write_conditional)
    tree = {"w": jnp.arange(1000.0), "big": jnp.ones(400_000)}
    manager = eqx_ckpt.CheckpointManager(tmp_path, blocking=False)
    with pytest.raises(KeyboardInterrupt):
        manager.save(7, tree)
    for pending in list(_background._PENDING):
        pending.wait()
    assert not undone.is_set()
    manager.close()
    fresh = eqx_ckpt.CheckpointManager(tmp_path)
    assert fresh.all_steps() == [7]
    loaded = fresh.restore({"w": jnp.zeros(1000), "big": jnp.zeros(400_000)})
    assert tree_equal(loaded, tree, typematch=True)
    assert eqx_ckpt.verify(fresh.step_path(7)) == []


def test_a_script_that_leaves_its_manager_open_exits_quietly(tmp_path):
    """The lease is released at the end of the process without a word on
    stderr (once, "Exception ignored in: <function Lease.__del__ ...>")."""
    import subprocess
    import sys

    script = (
        "import jax.numpy as jnp, eqx_ckpt, sys\n"
        "m = eqx_ckpt.CheckpointManager(sys.argv[1], max_to_keep=2)\n"
        "m.save(0, {'w': jnp.ones(3)})\n"
        "m.save(1, {'w': jnp.ones(3)}, metrics={'loss': jnp.mean(jnp.ones(4, jnp.bfloat16))})\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert eqx_ckpt.CheckpointManager(tmp_path).all_steps() == [0, 1]


def test_a_step_deleted_between_the_check_and_the_read_is_not_found_not_a_bare_os_error(tmp_path, faults):
    """Another process's retention deletes a step's manifest first; between the
    reader's check for the file and its `open` it once escaped as a bare
    `FileNotFoundError`."""
    import os

    manager = eqx_ckpt.CheckpointManager(tmp_path)
    manager.save(0, {"w": jnp.ones(3)})
    manager.close()
    deleted = []

    def delete(path):  # as the other process's retention does, just after the check
        if path.endswith(os.path.join("step_00000000", "manifest.json")):
            os.unlink(path)
            deleted.append(path)

    faults("storage.file_found", delete)
    with pytest.raises(eqx_ckpt.CheckpointError):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "step_00000000", {"w": jnp.zeros(3)})
    assert deleted  # the race was made, not missed


def test_a_link_or_a_file_named_like_a_step_is_never_a_step(tmp_path):
    """Retention once followed a link `step_00000000 -> another run's
    checkpoint` and deleted that checkpoint's manifest; a user's file named
    `step_00000009` was deleted as an interrupted save."""
    other = tmp_path / "other_run"
    eqx_ckpt.tree_serialise_leaves(other, {"w": np.arange(3.0)})
    before = sorted(p.name for p in other.iterdir())
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "step_00000000").symlink_to(other, target_is_directory=True)
    (directory / "step_00000009").write_text("a user's notes")
    manager = eqx_ckpt.CheckpointManager(directory, max_to_keep=1)
    assert manager.all_steps() == []
    with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape("'step_00000000' (a symbolic link); 'step_0000")):
        manager.save(1, {"w": np.full(3, 1.0)})
    manager.save(2, {"w": np.full(3, 2.0)})
    assert manager.all_steps() == [2]
    steps = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000000", "step_00000002", "step_00000009"]
    assert sorted(p.name for p in other.iterdir()) == before
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(other, {"w": np.zeros(3)}), {"w": np.arange(3.0)})
    assert (directory / "step_00000009").read_text() == "a user's notes"
    with pytest.raises(eqx_ckpt.CheckpointNotFoundError):
        manager.restore({"w": np.zeros(3)}, step=0)


def test_saves_from_two_threads_take_turns(tmp_path):
    """One manager, two threads saving different steps: the second once removed
    the first's step folder as an interrupted save, and the first failed."""
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    inside, errors = threading.Event(), []

    def slow(*_):
        inside.set()
        time.sleep(0.05)

    def save(step, **options):
        try:
            manager.save(step, {f"l{i}": np.full(4, float(step)) for i in range(20)}, **options)
        except Exception as e:
            errors.append(e)

    first = threading.Thread(target=save, args=(1,), kwargs={"progress": slow})
    first.start()
    assert inside.wait(timeout=30)  # the first save is writing
    second = threading.Thread(target=save, args=(2,))
    second.start()
    first.join()
    second.join()
    assert errors == [] and manager.all_steps() == [1, 2]
    for step in (1, 2):
        restored = manager.restore({f"l{i}": np.zeros(4) for i in range(20)}, step=step)
        assert tree_equal(restored, {f"l{i}": np.full(4, float(step)) for i in range(20)}, typematch=True)


_EARLIER_RUNS = {
    # How the 40 steps already in the directory were saved: by a manager without
    # rules, under looser rules, or under the same rules by an eqx_ckpt older than
    # the retention record (a local directory: the record is removed by hand).
    "no rules": {},
    "other rules": {"max_to_keep": 100},
    "no record": {"max_to_keep": 3},
}


@pytest.mark.parametrize(
    "store, earlier", [(store, earlier) for earlier in _EARLIER_RUNS for store in ("local", "memory")][:-1]
)
def test_retention_deletes_no_step_saved_under_other_rules(tmp_path, request, store, earlier):
    """Issue 40, item 14: a manager opened with a tighter `max_to_keep` on a run
    of many steps deleted all but the last at its first save. Now retention
    applies to the steps saved under its own rules; the others stay, and each
    manager warns once, naming those the rules would drop."""
    directory = str(tmp_path / "run") if store == "local" else f"memory://retention/{request.node.name}/"
    with eqx_ckpt.CheckpointManager(directory, **_EARLIER_RUNS[earlier]) as before:
        for step in range(40):
            before.save(step, _tree(step))
    if earlier == "no record":
        (tmp_path / "run" / "retention.json").unlink()
    old = eqx_ckpt.CheckpointManager(directory).all_steps()
    manager = eqx_ckpt.CheckpointManager(directory, max_to_keep=3)
    message = "Retention left {} step(s) in {!r} that were saved under other retention rules (or none) in place: {}"
    left = old[:-2]  # the rules, applied to every step, would keep the last two and the new one
    shown = str(left) if len(left) <= 12 else f"[0, 1, 2, 3, 4, ..., 33, 34, 35, 36, 37] ({len(left)} steps)"
    with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape(message.format(len(left), directory, shown))):
        manager.save(40, _tree(40))
    assert manager.all_steps() == [*old, 40]
    # Its own steps follow its rules; the warning is not repeated (warnings are errors here).
    for step in (41, 42, 43):
        manager.save(step, _tree(step))
    assert manager.all_steps() == [*old, 41, 42, 43]
    manager.close()
    # Resumed with the same rules, the run's own steps are still its own; the others stay.
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=3) as resumed:
        with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape(f"Retention left {len(old)} step(s)")):
            resumed.save(44, _tree(44))
        assert resumed.all_steps() == [*old, 42, 43, 44]
    # Asked to, retention applies to every step.
    with eqx_ckpt.CheckpointManager(directory, max_to_keep=3, adopt_steps=True) as adopting:
        adopting.save(45, _tree(45))
        assert adopting.all_steps() == [43, 44, 45]
    assert tree_equal(eqx_ckpt.CheckpointManager(directory).restore(_tree(0)), _tree(45), typematch=True)
    if store == "local":
        record = json.loads((tmp_path / "run" / "retention.json").read_text())
        assert record == {"rules": {"max_to_keep": 3, "keep_every": None, "best_n": None}, "steps": [43, 44, 45]}


def test_a_resumed_run_with_the_same_rules_applies_them_to_its_earlier_steps(tmp_path):
    """A job restarted after a preemption, with the same rules, neither warns
    nor keeps its earlier run's steps beyond what the rules keep."""
    rules = dict(max_to_keep=2, best_n=1, best_metric="loss")
    with eqx_ckpt.CheckpointManager(tmp_path, **rules) as manager:
        _save_all(manager, {0: 1.0, 1: 0.5, 2: 2.0, 3: 3.0})
        assert manager.all_steps() == [1, 2, 3]
    with eqx_ckpt.CheckpointManager(tmp_path, **rules) as resumed:
        resumed.save(4, _tree(4), metrics={"loss": 0.1})
        assert resumed.all_steps() == [3, 4]
    # The metric's name is part of the rules: ranked by another metric, the steps are not its own.
    with eqx_ckpt.CheckpointManager(tmp_path, **{**rules, "best_metric": "acc"}) as other:
        with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape("in place: [3]")):
            other.save(5, _tree(5), metrics={"acc": 1.0})
        assert other.all_steps() == [3, 4, 5]


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        '{"rules": {}, "steps": [-1]}',
        '{"steps": []}',
        # Read by the one parser of untrusted JSON (`_manifest.loads_file`): a
        # record nested past Python's recursion once crashed the save with
        # RecursionError, and one naming `steps` twice let the last win.
        "[" * 100_000,
        '{"rules": {}, "steps": [0], "steps": []}',
    ],
    ids=["not-json", "negative-step", "no-rules", "nested-too-deep", "duplicate-key"],
)
def test_an_invalid_retention_record_is_a_clear_error(tmp_path, content):
    with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        manager.save(0, _tree(0))
    (tmp_path / "retention.json").write_text(content)
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1)
    with pytest.warns(eqx_ckpt.CommitWarning, match=re.escape("The retention record 'retention.json' in")):
        manager.save(1, _tree(1))
    assert manager.all_steps() == [0, 1]


def test_an_asynchronous_save_warns_of_steps_left_in_place_too(tmp_path):
    with eqx_ckpt.CheckpointManager(tmp_path) as before:
        for step in range(5):
            before.save(step, _tree(step))
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1, blocking=False)
    with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape("Retention left 5 step(s)")):
        manager.save(5, _tree(5))
        manager.save(6, _tree(6))
        manager.wait_until_finished()
    assert manager.all_steps() == [0, 1, 2, 3, 4, 6]
    manager.close()


def test_a_step_committed_before_retention_ran_is_still_the_runs_own(tmp_path):
    """A process stopped after a step's commit and before retention recorded
    it (a kill, or an interrupt during the clean-up): the next manager with the
    same rules prunes that step as its own, instead of keeping it, with a
    warning, as another run's (a crash campaign saw three steps under
    `max_to_keep=2`)."""
    with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1) as first:
        first.save(0, _tree(0))
        with _faults.armed("storage.remove_written", KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
            first.save(1, _tree(1))
        assert first.all_steps() == [0, 1]  # committed; retention never ran
    with warnings.catch_warnings():
        warnings.simplefilter("error", eqx_ckpt.RetentionWarning)
        with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1) as resumed:
            resumed.save(2, _tree(2))
            assert resumed.all_steps() == [2]


# A manager's save of step 1 killed just before its commit, after every array
# was written (step 0 is committed): what a preemption leaves.
_KILLED_STEP = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import eqx_ckpt
    from eqx_ckpt._base import _faults

    def write_conditional(loc, name):
        if name == "manifest.json" and loc.display.endswith("step_00000001"):
            os._exit(17)

    manager = eqx_ckpt.CheckpointManager(sys.argv[1], max_to_keep=2)
    manager.save(0, {"w": np.zeros(3), "big": np.zeros((512, 1024))})
    with _faults.armed("commit.manifest_write", write_conditional):
        manager.save(1, {"w": np.ones(3), "big": np.ones((512, 1024))})
    """
)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_only_what_a_save_wrote_is_cleaned_from_entries_named_like_steps(tmp_path):
    """Issue 51, item 2: a user's folder `step_00000005/` holding only their
    notes was removed by a manager's first save as an interrupted save. Now
    only what a save writes is cleaned; a file, a link, or a folder holding
    anything else stays as it is, named once in a warning; and saving a step
    whose name such an entry holds is refused."""
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _KILLED_STEP, str(run)], capture_output=True, text=True)
    assert killed.returncode == 17, killed.stderr
    left = _files(run / "step_00000001")
    assert "saving.json" in left and "big/zarr.json" in left and "big/c/0/0" in left, sorted(left)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "data.txt").write_text("not the manager's")
    (run / "step_00000003").write_text("a user's file")
    (run / "step_00000004").symlink_to(outside, target_is_directory=True)
    (run / "step_00000005").mkdir()
    (run / "step_00000005" / "notes.txt").write_text("my notes")
    (run / "step_00000007" / "big" / "c").mkdir(parents=True)  # an interrupted save's arrays, and a user's file
    (run / "step_00000007" / "big" / "zarr.json").write_text("{}")
    (run / "step_00000007" / "README").write_text("the user's")
    users = {name: _files(run / name) for name in ("step_00000005", "step_00000007")}
    manager = eqx_ckpt.CheckpointManager(run, max_to_keep=2)
    expected = (
        f"{str(run)!r} holds 4 entries named like a step that no eqx_ckpt save wrote: 'step_00000003' (a file); "
        f"'step_00000004' (a symbolic link); 'step_00000005' (a folder holding 'notes.txt', which no eqx_ckpt "
        f"save writes); 'step_00000007' (a folder holding 'README', which no eqx_ckpt save writes). The manager "
        f"leaves them alone (it never lists, restores or deletes them); move or rename them"
    )
    with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape(expected)):
        manager.save(2, {"w": np.full(3, 2.0)})
    assert not (run / "step_00000001").exists()  # the killed save's leftovers
    assert manager.all_steps() == [0, 2]
    manager.save(6, {"w": np.full(3, 6.0)})  # warned once (warnings are errors here)
    with pytest.raises(
        eqx_ckpt.CheckpointExistsError,
        match=re.escape(f"{str(run / 'step_00000004')!r} is a symbolic link, not a step of this manager, so step 4"),
    ):
        manager.save(4, {"w": np.full(3, 4.0)})
    folder = f"{str(run / 'step_00000005')!r} is a folder holding 'notes.txt', which no eqx_ckpt save writes, not a"
    with pytest.raises(eqx_ckpt.CheckpointExistsError, match=re.escape(folder)):
        manager.save(5, {"w": np.full(3, 5.0)})
    assert manager.all_steps() == [2, 6]
    assert (run / "step_00000003").read_text() == "a user's file"
    assert (run / "step_00000004").is_symlink() and _files(outside) == {"data.txt": b"not the manager's"}
    assert {name: _files(run / name) for name in users} == users
    assert tree_equal(manager.restore({"w": np.zeros(3)}), {"w": np.full(3, 6.0)}, typematch=True)


@pytest.mark.parametrize(
    ("key", "ours"),
    [
        ("saving.json", True),  # the journal
        ("saving.json.__lock", True),
        ("manifest.json.__lock", True),
        ("zarr.json", True),
        ("big/c/0/0", True),
        ("gen.0123456789abcdef/packed.float32/c/3", True),
        ("notes.txt", False),
        ("manifest.json.bak", False),
        ("big/notes", False),
        ("model/saving.json", False),
    ],
)
def test_the_files_an_interrupted_save_leaves(key, ours):
    assert _format.left_by_a_save(key) is ours


def test_a_deletion_cut_short_is_cleaned_on_an_object_store_and_a_users_object_stays(request):
    """The same on a store without folders: a step's prefix holding a user's
    object stays; what retention's deletion, cut short after the manifest,
    left is cleaned by the next save."""
    url = f"memory://leftovers/{request.node.name}/"
    with eqx_ckpt.CheckpointManager(url, max_to_keep=1) as manager:
        manager.save(0, {"w": np.zeros(3)})

        def cut_short(loc, names):
            if "step_00000000" in names:
                raise KeyboardInterrupt

        with _faults.armed("storage.remove", cut_short), pytest.raises(KeyboardInterrupt):
            manager.save(1, {"w": np.ones(3)})  # retention deleted step 0's manifest, not its arrays
    run = _location.location(url)
    assert [key for key in _storage.list_keys(run) if key.startswith("step_00000000/")] == [
        "step_00000000/packed.float64/c/0",
        "step_00000000/packed.float64/zarr.json",
        "step_00000000/zarr.json",
    ]
    _storage.write_file(run.joined("step_00000005"), "notes.txt", b"my notes")
    with eqx_ckpt.CheckpointManager(url, max_to_keep=1) as manager:
        with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape("'step_00000005' (a folder holding 'notes.txt'")):
            manager.save(2, {"w": np.full(3, 2.0)})
        assert manager.all_steps() == [2]
    keys = _storage.list_keys(run)
    assert not any(key.startswith("step_00000000/") for key in keys)
    assert _storage.read_file(run.joined("step_00000005"), "notes.txt", limit=100) == b"my notes"


def test_a_manager_with_looser_rules_warns_once_when_earlier_steps_become_droppable(tmp_path):
    """Issue 51, item 8: a run saved with `max_to_keep=2`, resumed with 5: the
    earlier steps the new rules keep at first are not droppable then, and the
    warning that they stay for ever came never. It comes at the first save
    where the rules would drop one, once."""
    with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=2) as first:
        for step in range(4):
            first.save(step, _tree(step))
    assert first.all_steps() == [2, 3]
    with eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=5) as looser:
        for step in (4, 5, 6):
            looser.save(step, _tree(step))  # the last five are every step: nothing to warn of yet
        message = "Retention left 1 step(s) in {!r} that were saved under other retention rules (or none) in place: [2]"
        with pytest.warns(eqx_ckpt.RetentionWarning, match=re.escape(message.format(str(tmp_path)))):
            looser.save(7, _tree(7))
        looser.save(8, _tree(8))  # steps 2 and 3 droppable now: not repeated (warnings are errors here)
        assert looser.all_steps() == [2, 3, 4, 5, 6, 7, 8]


def test_a_step_lazy_leaves_read_from_outlives_retention_until_they_are_gone(tmp_path):
    """Issue 51, item 3: a fine-tuning loop restored a step lazily (the frozen
    base stays lazy) and saved later steps with `max_to_keep=1`; the first
    save's retention deleted the restored step, and the next save of the lazy
    base raised a `CheckpointReplacedError` saying the step had been replaced.
    Now retention keeps a step while lazy leaves of this process read from it,
    and deletes it at the first save after they are gone."""
    base = eqx.nn.MLP(600, 600, 8, 1, key=jax.random.key(0))  # a leaf of its own (1.4 MB), and packed ones
    head = jnp.zeros(4)
    manager = eqx_ckpt.CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(1, {"base": base, "head": head})
    like = {"base": eqx.filter_eval_shape(lambda: base), "head": jax.ShapeDtypeStruct((4,), jnp.float32)}
    restored = manager.restore(like, lazy=True)
    frozen, head = restored["base"], eqx_ckpt.materialise(restored["head"])
    assert isinstance(frozen.layers[0].weight, eqx_ckpt.LazyArray)
    del restored
    for step in (2, 3, 4):
        head = head + 1.0  # training the head only
        manager.save(step, {"base": frozen, "head": head})
        assert manager.all_steps() == [1, step]
        saved = manager.restore({"base": base, "head": jnp.zeros(4)}, step=step)
        assert tree_equal(saved, {"base": base, "head": jnp.full(4, float(step - 1))}, typematch=True)
    assert tree_equal(eqx_ckpt.materialise(frozen), base, typematch=True)
    del frozen
    gc.collect()
    manager.save(5, {"base": base, "head": head})
    assert manager.all_steps() == [5]
    assert not (tmp_path / "step_00000001").exists()


def test_lazy_leaves_of_a_step_deleted_by_hand_say_it_was_deleted(tmp_path):
    """A step deleted under lazy leaves (`delete_steps_after`, which deletes what
    it is asked to) is named as deleted, not as replaced by a newer save."""
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, {"w": np.full(3, float(step))})
    lazy = manager.restore({"w": np.zeros(3)}, step=2, lazy=True)
    assert manager.delete_steps_after(1) == [2]
    expected = f"Checkpoint {manager.step_path(2)!r} was deleted after it was opened (by hand, by `delete_steps_after`"
    with pytest.raises(eqx_ckpt.CheckpointReplacedError, match=re.escape(expected)):
        eqx_ckpt.materialise(lazy)


def test_local_entry_reads_a_path_as_os_path_does(tmp_path):
    """`_storage.local_entry`, which the manager's step scan, orbax's and
    safetensors' listings and `verify` use for every local path, tells a file,
    a folder, a link to each, a broken link and a missing name apart exactly as
    `os.path` does (issue 61: they called `os.path` themselves)."""
    (tmp_path / "file").write_bytes(b"12345")
    (tmp_path / "folder").mkdir()
    (tmp_path / "to_file").symlink_to(tmp_path / "file")
    (tmp_path / "to_folder").symlink_to(tmp_path / "folder", target_is_directory=True)
    (tmp_path / "broken").symlink_to(tmp_path / "nothing")
    for name in ("file", "folder", "to_file", "to_folder", "broken", "nothing", "file/below"):
        path = str(tmp_path / name)
        entry = _storage.local_entry(path)
        expected = (os.path.lexists(path), os.path.exists(path), os.path.islink(path), os.path.isdir(path))
        assert (entry.found, entry.exists, entry.link, entry.folder) == expected, name
        assert entry.file == os.path.isfile(path), name
        if entry.file:
            assert entry.size == 5 and entry.identity == (os.stat(path).st_dev, os.stat(path).st_ino), name
    assert _storage.local_names(str(tmp_path)) == ["broken", "file", "folder", "to_file", "to_folder"]


def test_the_manager_page_documents_every_keyword_of_save_with_its_default():
    """Issue 88: docs/manager.md listed no `compression=` (nor `layout`,
    `staging_bytes`, `progress`) on the manager's `save`."""
    page = (places.ROOT / "docs" / "manager.md").read_text()
    line = re.search(r"^- `save\((.*)\)`:$", page, re.M)
    assert line is not None
    signature = inspect.signature(eqx_ckpt.CheckpointManager.save)
    for name, parameter in signature.parameters.items():
        if parameter.default is inspect.Parameter.empty:
            continue
        value = parameter.default
        default = getattr(value, "__name__", None) or (json.dumps(value) if isinstance(value, str) else repr(value))
        assert f"{name}={default}" in line[1], name
        if name not in ("metrics", "overwrite"):  # (said in the text; the others in the table)
            assert f"| `{name}` | `{default}` |" in page, name
