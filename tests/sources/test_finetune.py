"""Fine-tuning from a shared model: a model whose head changed shape is told
the `where=` that loads the rest, and loads without warnings about the head it
left out (issue 65 item 3).

Each test runs against an eqx_ckpt checkpoint and a published folder
(`export_safetensors`), which `hf://` paths read by the same code once opened
(docs/sharing.md, "Fine-tune a shared model", runs that against the local Hub
server)."""

from __future__ import annotations

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import places
import pytest
from arrays import tree_equal

import eqx_ckpt

ROOT = places.ROOT


class Classifier(eqx.Module):
    body: eqx.nn.MLP
    head: eqx.nn.Linear


def _classifier(classes: int, seed: int = 0) -> Classifier:
    keys = jax.random.split(jax.random.key(seed))
    return Classifier(eqx.nn.MLP(8, 16, 16, 1, key=keys[0]), eqx.nn.Linear(16, classes, key=keys[1]))


def _mlp(classes: int, seed: int = 0, depth: int = 2) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, classes, 16, depth, key=jax.random.key(seed))


def _two_heads(classes: int, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 3)
    return {
        "body": eqx.nn.MLP(8, 16, 16, 1, key=keys[0]),
        "heads": {"a": eqx.nn.Linear(16, classes, key=keys[1]), "b": eqx.nn.Linear(16, classes, key=keys[2])},
    }


@pytest.fixture(params=["eqx_ckpt", "published"])
def publish(request, tmp_path):
    """Saves a tree as an eqx_ckpt checkpoint, or exports it as a published
    folder (what `push_to_hub` uploads), and returns the path to load."""

    def save(tree):
        path = tmp_path / request.param
        if request.param == "eqx_ckpt":
            eqx_ckpt.tree_serialise_leaves(path, tree)
        else:
            eqx_ckpt.export_safetensors(path, tree)
        return path

    return save


def _selector(message: str) -> str:
    """The `where=` the error prints on a line of its own, as a user copies it."""
    found = re.findall(r"^    where=(lambda .*)$", message, re.M)
    assert len(found) == 1, message
    return found[0]


@pytest.mark.parametrize(
    ("make", "changed", "where", "kept"),
    [
        (_classifier, "`m.head`, a sub-tree that", "lambda m: m.body", lambda m: m.body),
        (_mlp, "`m.layers[2]`, a sub-tree that", "lambda m: (m.layers[0], m.layers[1])", lambda m: m.layers[:2]),
        (
            lambda classes, seed=0: _mlp(classes, seed, depth=4),
            "`m.layers[4]`, a sub-tree that",
            "lambda m: m.layers[:4]",
            lambda m: m.layers[:4],
        ),
        (
            _two_heads,
            "`t['heads']`, a sub-tree that",
            "lambda t: t['body']",
            lambda t: t["body"],
        ),
    ],
    ids=["classifier", "mlp", "deep-mlp", "dict"],
)
def test_a_new_head_is_named_and_the_printed_where_loads_the_rest(publish, make, changed, where, kept):
    """A 4-class model loaded into a 6-class one: the error names the sub-tree
    that changed and prints a `where=` that, pasted, loads everything else
    (`load_or_initialise` initialising the head, `tree_deserialise_leaves`
    keeping `like`'s), with no warning about the head it left out."""
    trained = make(4)
    path = publish(trained)
    new = lambda: make(6, seed=1)
    for load in (
        lambda **kw: eqx_ckpt.load_or_initialise(path, new, **kw),
        lambda **kw: eqx_ckpt.tree_deserialise_leaves(path, new(), **kw),
    ):
        with pytest.raises(eqx_ckpt.LeafError) as info:
            load()
        message = str(info.value)
        assert re.search(re.escape(f"To load anyway: every leaf that changed shape is in {changed} changed"), message)
        assert re.search(re.escape(f"\n    where={where}\n`load_or_initialise` initialises what `where`"), message)
        assert "shapes must match" not in message
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model = load(where=eval(_selector(message)))
        assert [str(w.message) for w in record] == []
        assert tree_equal(kept(model), kept(trained), typematch=True)
        assert tree_equal(model, eqx.tree_at(kept, new(), kept(trained)), typematch=True)


def test_a_manager_restore_prints_the_where_too(tmp_path):
    """`restore` and `restore_or_initialise` go through the same report: the
    `where=` they print, pasted, restores the body and initialises the head."""
    manager = eqx_ckpt.CheckpointManager(tmp_path)
    try:
        manager.save(0, _classifier(4))
        manager.wait_until_finished()
        new = lambda: _classifier(6, seed=1)
        for restore in (
            lambda **kw: manager.restore(new(), **kw),
            lambda **kw: manager.restore_or_initialise(new, **kw)[1],
        ):
            with pytest.raises(eqx_ckpt.LeafError) as info:
                restore()
            assert _selector(str(info.value)) == "lambda m: m.body"
            model = restore(where=eval(_selector(str(info.value))))
            assert tree_equal(model, eqx.tree_at(lambda m: m.body, new(), _classifier(4).body), typematch=True)
    finally:
        manager.close()


def test_several_changed_sub_trees_are_each_named(publish):
    path = publish({"body": _mlp(16), "a": eqx.nn.Linear(16, 4, key=jax.random.key(1)), "b": jnp.ones((4, 16))})
    new = {"body": _mlp(16, seed=2), "a": eqx.nn.Linear(16, 6, key=jax.random.key(3)), "b": jnp.zeros((6, 16))}
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(path, new)
    message = str(info.value)
    assert re.search(re.escape("is in `t['a']` and `t['b']`, sub-trees that each changed as a whole"), message)
    assert _selector(message) == "lambda t: t['body']"


def test_the_where_given_is_narrowed_not_widened(publish):
    """With `where=` already given, the printed one selects what it selected,
    less the changed sub-tree, and nothing outside it."""
    path = publish(_mlp(4, depth=3))
    like = eqx.filter_eval_shape(_mlp, 6, depth=3)
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(path, like, where=lambda m: (m.layers[1].weight, m.layers[3]))
    assert _selector(str(info.value)) == "lambda m: m.layers[1].weight"


@pytest.mark.parametrize(
    ("saved", "like", "fix"),
    [
        # A weight that changed beside a bias that did not: another layer, not a new head.
        (
            lambda: {"body": _mlp(16), "head": eqx.nn.Linear(16, 4, key=jax.random.key(0))},
            lambda: {"body": _mlp(16), "head": eqx.nn.Linear(12, 4, key=jax.random.key(0))},
            "To load anyway: shapes must match: build `like` with the saved shapes.",
        ),
        # Every leaf changed: nothing would load.
        (
            lambda: {"head": jnp.ones((4, 16))},
            lambda: {"head": jnp.ones((6, 16))},
            "To load anyway: shapes must match: build `like` with the saved shapes.",
        ),
        # Another kind of mismatch beside the shape: the message as it was.
        (
            lambda: {"body": _mlp(16), "head": jnp.ones((4, 16))},
            lambda: {"body": _mlp(16), "head": jnp.ones((6, 16)), "new": jnp.ones(2)},
            "To load anyway: `missing='keep'` keeps `like`'s value for missing leaves; "
            "`where=`/`prefix=`/`rename=` pick and map what is loaded; "
            "shapes must match: build `like` with the saved shapes.",
        ),
    ],
    ids=["weight-not-bias", "everything", "missing-too"],
)
def test_other_mismatches_keep_their_message(publish, saved, like, fix):
    # (Trees built by the test, not when the module is collected: in every worker.)
    path = publish(saved())
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(fix) + "$") as info:
        eqx_ckpt.tree_deserialise_leaves(path, like())
    assert "where=lambda" not in str(info.value)


def test_static_fields_warn_only_for_what_was_loaded(publish):
    """A static field of a part the load read still warns; those of the parts
    `where` left out (the new head, and the root that holds it) do not."""
    key = jax.random.key(0)
    path = publish({"attn": eqx.nn.MultiheadAttention(4, 16, key=key), "head": eqx.nn.Linear(16, 4, key=key)})
    like = {"attn": eqx.nn.MultiheadAttention(8, 16, key=key), "head": eqx.nn.Linear(16, 6, key=key)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        eqx_ckpt.tree_deserialise_leaves(path, like, where=lambda t: t["attn"])
    messages = [str(w.message) for w in record]
    assert any(re.search(re.escape("static field `attn.num_heads` is 8, but the"), m) for m in messages)
    assert all(re.search(re.escape("static field `attn."), m) for m in messages), messages


def _static_change(tmp_path):
    """A checkpoint (and a manager step) of an attention layer with 4 heads, and
    a make with 8: every load of it warns."""
    key = jax.random.key(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", {"attn": eqx.nn.MultiheadAttention(4, 16, key=key)})
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    manager.save(0, {"attn": eqx.nn.MultiheadAttention(4, 16, key=key)})
    manager.wait_until_finished()
    return manager, lambda: {"attn": eqx.nn.MultiheadAttention(8, 16, key=key)}


def test_the_static_field_warning_points_at_the_callers_line(tmp_path):
    manager, make = _static_change(tmp_path)
    calls = {
        "tree_deserialise_leaves": lambda: eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt", make()),
        "load_or_initialise": lambda: eqx_ckpt.load_or_initialise(tmp_path / "ckpt", make),
        "restore": lambda: manager.restore(make()),
        "restore_or_initialise": lambda: manager.restore_or_initialise(make),
    }
    try:
        for name, call in calls.items():
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                call()
            assert record and {w.category for w in record} == {eqx_ckpt.StaticFieldWarning}, name
            line = call.__code__.co_firstlineno
            assert {(w.filename, w.lineno) for w in record} == {(__file__, line)}, name
    finally:
        manager.close()


def test_the_docs_show_the_message_a_load_gives(tmp_path):
    """docs/sharing.md, "Fine-tune a shared model", shows the error its load
    gives (from its second leaf on: the lines that name no checkpoint and
    shorten nothing), as the same model published to a folder gives it."""
    page = (ROOT / "docs" / "sharing.md").read_text()
    section = page[page.index("## Fine-tune a shared model") :]
    shown = re.search(r"```text\n(.*?)```", section, re.S)
    assert shown is not None
    tail = shown.group(1)[shown.group(1).index("  - `layers.2.bias`") :].rstrip("\n")
    eqx_ckpt.export_safetensors(tmp_path / "pub", eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0)))
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape(tail) + "$"):
        eqx_ckpt.load_or_initialise(tmp_path / "pub", lambda: eqx.nn.MLP(4, 6, 16, 2, key=jax.random.key(1)))
