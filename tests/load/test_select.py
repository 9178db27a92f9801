"""Partial and remapped loads: `where`, `prefix`, `rename`, `missing`, `strict`."""

import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from arrays import tree_equal

import eqx_ckpt


class Net(eqx.Module):
    encoder: eqx.nn.MLP
    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key, head_size=2):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.MLP(4, 4, 8, 1, key=k1)
        self.embed = eqx.nn.Embedding(5, 4, key=k2)
        self.head = eqx.nn.Linear(4, head_size, key=k3)


@pytest.fixture
def packed_reads(faults):
    """The dotted paths of the packed leaves that loads read (fault point
    `pack.read_run`). (A partial load reads the runs of a pack that hold its
    leaves, at chunk granularity: test_pack.py.)"""
    read = []
    faults("pack.read_run", lambda loc, pack, paths: read.extend(paths))
    return read


def _save_net(path, seed=0):
    net = Net(jax.random.key(seed))
    eqx_ckpt.tree_serialise_leaves(path, net)
    return net


def _is_abstract(tree):
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree))


def _same_leaves(a, b):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(x is y for x, y in zip(leaves_a, leaves_b))


def test_where_single_node_loads_only_it(tmp_path):
    net = _save_net(tmp_path)
    like = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: m.encoder)
    assert tree_equal(loaded.encoder, net.encoder, typematch=True)
    assert _is_abstract(loaded.embed) and _is_abstract(loaded.head)
    assert _same_leaves(loaded.embed, like.embed)
    assert _same_leaves(loaded.head, like.head)


def test_where_tuple_of_nodes(tmp_path):
    net = _save_net(tmp_path)
    like = Net(jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: (m.encoder, m.embed))
    assert tree_equal(loaded.encoder, net.encoder, typematch=True)
    assert tree_equal(loaded.embed, net.embed, typematch=True)
    # Unselected concrete leaves are the very objects of `like`.
    assert loaded.head.weight is like.head.weight
    assert loaded.head.bias is like.head.bias
    assert not tree_equal(loaded.head, net.head)


def test_where_reads_nothing_outside_the_selection(tmp_path, packing, packed_reads):
    net = _save_net(tmp_path)
    if packing == "unpacked":
        shutil.rmtree(tmp_path / "head")
        shutil.rmtree(tmp_path / "encoder" / "layers" / "1")
    like = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: (m.embed, m.encoder.layers[0]))
    assert tree_equal(loaded.embed, net.embed, typematch=True)
    assert tree_equal(loaded.encoder.layers[0], net.encoder.layers[0], typematch=True)
    assert _is_abstract(loaded.head) and _is_abstract(loaded.encoder.layers[1])
    if packing == "packed":
        selected = ["embed.weight", "encoder.layers.0.bias", "encoder.layers.0.weight"]
        assert sorted(packed_reads) == selected
        return
    # The deleted folders really are needed by a full load: it fails on them.
    with pytest.raises(eqx_ckpt.IntegrityError, match=re.escape("`encoder.layers.1.")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: m.encoder)


def test_where_single_leaf(tmp_path):
    net = _save_net(tmp_path)
    like = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda m: m.head.bias)
    assert tree_equal(loaded.head.bias, net.head.bias, typematch=True)
    assert _is_abstract(loaded.head.weight)


def test_where_on_a_dict(tmp_path):
    tree = {"model": {"w": jnp.ones(3)}, "opt": {"mu": jnp.zeros(3)}, "step": 5}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    like = {"model": {"w": jnp.zeros(3)}, "opt": {"mu": jnp.full(3, 9.0)}, "step": 0}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda t: (t["model"], t["step"]))
    assert loaded["step"] == 5
    assert tree_equal(loaded["model"], tree["model"], typematch=True)
    assert loaded["opt"]["mu"] is like["opt"]["mu"]


def _train_state(seed):
    model = Net(jax.random.key(seed))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": 10}


def test_prefix_loads_a_bare_model_out_of_a_training_state(tmp_path, packing, packed_reads):
    state = _train_state(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, state)
    assert "opt_state.0.mu.encoder.layers.0.weight" in eqx_ckpt.Checkpoint(tmp_path)
    # The optimiser state is never read.
    if packing == "unpacked":
        shutil.rmtree(tmp_path / "opt_state")
    like = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model")
    assert tree_equal(loaded, state["model"], typematch=True)
    model = [k for k in eqx_ckpt.Checkpoint(tmp_path) if k.startswith("model.")]
    assert sorted(packed_reads) == (sorted(model) if packing == "packed" else [])


def test_prefix_with_where(tmp_path):
    state = _train_state(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, state)
    like = Net(jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model", where=lambda m: m.head)
    assert tree_equal(loaded.head, state["model"].head, typematch=True)
    assert _same_leaves(loaded.encoder, like.encoder)


def test_nested_prefix(tmp_path):
    state = _train_state(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, state)
    like = eqx.nn.Linear(4, 2, key=jax.random.key(3))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model.head")
    assert tree_equal(loaded, state["model"].head, typematch=True)


def test_unknown_prefix_lists_the_top_level_keys(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _train_state(0))
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("'model', 'opt_state', 'step'")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(1)}, prefix="modle")


@pytest.mark.parametrize("prefix", ["model/head", "model..head", "a.b c", 3])
def test_invalid_prefix(tmp_path, prefix):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"model": {"head": jnp.zeros(1)}})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="is not a dotted path"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": jnp.zeros(1)}, prefix=prefix)


def test_rename_mapping_renames_a_sub_tree(tmp_path):
    saved = {"body": {"layer": {"w": jnp.arange(3.0), "b": jnp.ones(2)}}, "extra": jnp.zeros(1)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"encoder": {"layer": {"w": jnp.zeros(3), "b": jnp.zeros(2)}}, "extra": jnp.full(1, 5.0)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, rename={"encoder": "body"})
    assert tree_equal(loaded["encoder"], saved["body"], typematch=True)
    # Unmapped paths pass through.
    assert tree_equal(loaded["extra"], saved["extra"], typematch=True)


def test_rename_longest_match_wins(tmp_path):
    saved = {"a": {"x": jnp.ones(1), "y": jnp.full(1, 2.0)}, "special": jnp.full(1, 3.0)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"m": {"x": jnp.zeros(1), "y": jnp.zeros(1)}}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, rename={"m": "a", "m.y": "special"})
    assert loaded["m"]["x"].item() == 1.0
    assert loaded["m"]["y"].item() == 3.0


def test_rename_callable_with_prefix(tmp_path):
    state = _train_state(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, state)
    like = {"mlp": eqx.filter_eval_shape(eqx.nn.MLP, 4, 4, 8, 1, key=jax.random.key(0))}
    seen = []

    def rename(path):
        seen.append(path)
        return path.replace("mlp", "encoder", 1)

    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model", rename=rename)
    assert tree_equal(loaded["mlp"], state["model"].encoder, typematch=True)
    assert "mlp.layers.0.weight" in seen


def test_rename_to_a_missing_path_is_reported_under_its_stored_name(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(1)})
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`nowhere`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"b": jnp.zeros(1)}, rename={"b": "nowhere"})


@pytest.mark.parametrize(
    "rename, message",
    [
        ({"a": ["x"]}, "both must be dotted paths"),
        ({"a": 3}, "both must be dotted paths"),
        (lambda p: 5, "it must return a dotted path"),
        (["a"], "`rename` rules must be `(pattern, replacement)` pairs"),
        (3, "must be a mapping, a callable or a list of `(pattern, replacement)` rules, not int"),
        ([("(", "x")], "`rename` rule '(' is not a regular expression"),
        ([("a", ())], "`rename` rule 'a' -> () gave () for `a`; it must return a dotted path"),
    ],
)
def test_invalid_rename(tmp_path, rename, message):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(1)})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.zeros(1)}, rename=rename)


def test_missing_keep_keeps_likes_leaf(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": jnp.arange(3.0)})
    head = jnp.full(2, 7.0)
    like = {"body": jnp.zeros(3), "head": head, "abstract": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(eqx_ckpt.LeafError, match="2 leaves do not match"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, missing="keep")
    assert tree_equal(loaded["body"], jnp.arange(3.0), typematch=True)
    assert loaded["head"] is head
    assert loaded["abstract"] is like["abstract"]


def test_missing_keep_still_reports_shape_changes(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"body": jnp.arange(3.0)})
    with pytest.raises(eqx_ckpt.LeafError, match="has changed shape"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"body": jnp.zeros(4), "head": jnp.zeros(1)}, missing="keep")


def test_strict_reports_unexpected_leaves(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(1), "b": {"c": jnp.zeros(2), "d": 1}})
    like = {"a": jnp.ones(1)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert loaded["a"].item() == 0.0
    with pytest.raises(eqx_ckpt.LeafError, match="2 leaves do not match") as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, strict=True)
    assert set(info.value.dotted) == {"b.c", "b.d"}
    assert "unexpected" in str(info.value)


def test_strict_with_prefix_only_looks_below_it(tmp_path):
    state = _train_state(0)
    eqx_ckpt.tree_serialise_leaves(tmp_path, state)
    like = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, prefix="model", strict=True)
    assert tree_equal(loaded, state["model"], typematch=True)
    small = eqx.tree_at(lambda m: m.head, like, None)
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`model.head.weight`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, small, prefix="model", strict=True)


def test_strict_reports_unexpected_together_with_missing(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"old": jnp.zeros(1)})
    with pytest.raises(eqx_ckpt.LeafError) as info:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"new": jnp.zeros(1)}, strict=True)
    assert set(info.value.dotted) == {"old", "new"}


def test_cast_with_partial_load(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.arange(3, dtype=jnp.int32), "b": jnp.ones(2)})
    like = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.int32)}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda t: t["a"], cast=True)
    assert tree_equal(loaded["a"], jnp.arange(3.0), typematch=True)
    assert loaded["b"] is like["b"]
    with pytest.raises(eqx_ckpt.LeafError, match="has changed dtype from float32 in `like` to int32"):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like, where=lambda t: t["a"])


@pytest.mark.parametrize(
    "where, message",
    [
        (lambda t: t["nope"], "`where` raised KeyError"),
        (lambda t: None, "`where` selected no leaves"),
        (lambda t: np.zeros(2), "`where` selected no leaves"),
    ],
)
def test_invalid_where(tmp_path, where, message):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.zeros(1)})
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"a": jnp.zeros(1)}, where=where)
