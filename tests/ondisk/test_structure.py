"""Loading without the model's code (issue 49): every save records its tree's
structure as data, and `Checkpoint.load(trust=...)`, `skeleton`, a load with
`like=None` and `CheckpointManager.restore` rebuild it with the real classes,
from a trust list only: nothing a file names is ever imported or called."""

import collections
import dataclasses
import enum
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import manifests
import numpy as np
import optax
import places
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._tools._cli import main

KEYS = jax.random.split(jax.random.key(0), 8)


class Block(eqx.Module):
    """A transformer block of a user's, with static fields of several kinds."""

    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    name: str = eqx.field(static=True)
    widths: tuple = eqx.field(static=True)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        x = jax.vmap(self.norm)(x)
        return jax.vmap(self.out)(self.attention(x, x, x))


def _block():
    return Block(
        eqx.nn.Embedding(11, 8, key=KEYS[0]),
        eqx.nn.LayerNorm(8),
        eqx.nn.MultiheadAttention(2, 8, key=KEYS[1]),
        eqx.nn.Linear(8, 8, key=KEYS[2]),
        2,
        "block-0",
        (8, (2, 3)),
    )


class Pair(collections.namedtuple("Pair", ["first", "second"])):
    pass


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


class Tagged(eqx.Module):
    weight: jax.Array
    colour: Colour = eqx.field(static=True)
    dtype: object = eqx.field(static=True)
    scale: float = eqx.field(static=True)


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, final_activation=jnp.tanh, key=KEYS[3])


def _tree():
    mlp = _mlp()
    batch_norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
    return {
        "mlp": mlp,
        "conv": eqx.nn.Conv2d(3, 4, 3, padding=((1, 1), (2, 2)), key=KEYS[4]),
        "block": _block(),
        "bn": (batch_norm, state),
        "seq": eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=KEYS[5]), eqx.nn.Lambda(jax.nn.relu)]),
        "opt": optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array)),
        "keys": jax.random.split(KEYS[6], 3),
        "containers": {"list": [1, None, (2.5, True)], "pair": Pair(np.arange(3.0), "text"), "none": None},
        "numbers": {"np": np.arange(4, dtype=np.int16), "np_scalar": np.float32(2.5), "int": 7, "complex": 1 + 2j},
        "tagged": Tagged(jnp.ones(2), Colour.BLUE, np.dtype("bfloat16"), float("inf")),
        "ints": {3: jnp.zeros(2), 10: "ten"},
        "string": "hello",
    }


TRUST = [Block, Pair, Tagged, Colour, optax]


def test_a_saved_tree_comes_back_with_its_own_classes(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    loaded = eqx_ckpt.Checkpoint(tmp_path).load(trust=TRUST)
    assert tree_equal(loaded, tree, typematch=True)
    assert jax.tree.structure(loaded) == jax.tree.structure(tree)
    tokens = jnp.arange(5)
    assert tree_equal(loaded["block"](tokens), tree["block"](tokens))
    x = jnp.ones(3)
    assert tree_equal(loaded["mlp"](x), tree["mlp"](x))
    assert loaded["mlp"].activation is jax.nn.gelu and loaded["seq"].layers[1].fn is jax.nn.relu
    image = jnp.ones((3, 6, 6))
    assert tree_equal(loaded["conv"](image), tree["conv"](image))
    batch_norm, state = loaded["bn"]
    ours = jax.vmap(batch_norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(jnp.ones((5, 4)), state)
    theirs = jax.vmap(tree["bn"][0], axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        jnp.ones((5, 4)), tree["bn"][1]
    )
    assert tree_equal(ours, theirs)


def test_every_way_of_loading_without_like_agrees(tmp_path):
    tree = _tree()
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    one_call = eqx_ckpt.tree_deserialise_leaves(tmp_path, trust=TRUST)
    assert tree_equal(one_call, tree, typematch=True)
    skeleton = ckpt.skeleton(trust=TRUST)
    assert skeleton["mlp"].layers[0].weight == jax.ShapeDtypeStruct((8, 3), jnp.float32)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, skeleton), tree, typematch=True)
    # The skeleton is a `like` for every other load option.
    only_mlp = eqx_ckpt.tree_deserialise_leaves(tmp_path, skeleton, where=lambda t: t["mlp"])
    assert tree_equal(only_mlp["mlp"], tree["mlp"], typematch=True)
    assert only_mlp["conv"].weight == skeleton["conv"].weight
    lazy = ckpt.load(trust=TRUST, lazy=True)
    assert isinstance(lazy["mlp"].layers[0].weight, eqx_ckpt.LazyArray)
    assert tree_equal(eqx_ckpt.materialise(lazy), tree, typematch=True)
    # A sub-tree by dotted prefix, everywhere.
    assert tree_equal(ckpt.load("mlp", trust=[]), tree["mlp"], typematch=True)
    assert tree_equal(ckpt.skeleton("block.attention"), eqx.filter_eval_shape(lambda: tree["block"].attention))
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, prefix="mlp"), tree["mlp"], typematch=True)
    # Without `trust`, `Checkpoint.load` keeps giving nested dicts.
    assert isinstance(ckpt.load()["mlp"], dict)


def test_a_skeleton_holds_no_data_and_numpy_and_scalars_keep_their_types(tmp_path):
    tree = {"np": np.arange(10**6, dtype=np.float32), "int": 3, "f": 2.5, "np_scalar": np.int8(4), "key": KEYS[0]}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    skeleton = eqx_ckpt.Checkpoint(tmp_path).skeleton()
    assert skeleton["np"].strides == (0,) and skeleton["np"].shape == (10**6,) and not skeleton["np"].flags.writeable
    assert (skeleton["int"], skeleton["f"], skeleton["np_scalar"]) == (0, 0.0, np.int8(0))
    assert type(skeleton["f"]) is float and type(skeleton["np_scalar"]) is np.int8
    assert skeleton["key"].dtype == KEYS[0].dtype
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path).load(trust=[]), tree, typematch=True)


def test_an_untrusted_class_is_named_with_its_paths_and_the_trust_to_pass(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree())
    with pytest.raises(eqx_ckpt.UntrustedError) as info:
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    message = str(info.value)
    assert f"{__name__}:Block (at `block`)" in message
    assert "optax._src.transform:ScaleByAdamState (at `opt.0`)" in message
    assert f"{__name__}:Tagged (at `tagged`)" in message
    assert f"{__name__}:Colour (at `tagged.colour`)" in message
    assert "nothing was imported or run" in message
    exact = [f"{__name__}.{name}" for name in ("Block", "Colour", "Pair", "Tagged")]
    # optax's classes by the public name `optax` holds them under, not `optax._src...`.
    exact = sorted([*exact, "optax.EmptyState", "optax.ScaleByAdamState"])
    assert f"pass `trust=[{', '.join(exact)}]`" in message
    assert f"or trust their packages: `trust=[optax, {__name__}]`" in message
    assert isinstance(info.value, TypeError)
    # What a load would need, before any load.
    untrusted = eqx_ckpt.Checkpoint(tmp_path).types(trust=[])
    assert untrusted[f"{__name__}:Block"] == ["block"]
    assert f"{__name__}:Pair" in untrusted and "equinox.nn._mlp:MLP" not in untrusted
    assert eqx_ckpt.Checkpoint(tmp_path).types(trust=TRUST) == {}
    assert eqx_ckpt.Checkpoint(tmp_path).types()["equinox.nn._mlp:MLP"] == ["mlp", "opt.0.mu", "opt.0.nu"]


def test_a_module_trusts_what_it_defines_not_what_it_imports(tmp_path):
    """`trust=[optax]` finds optax's states (defined in its submodules), but a
    name of a module optax merely imports is not reachable through it."""
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"opt": optax.adam(1e-3).init({"w": jnp.ones(2)})})
    assert isinstance(eqx_ckpt.Checkpoint(tmp_path).load(trust=[optax])["opt"][0], optax.ScaleByAdamState)
    _edit_structure(tmp_path, lambda s: s["c"][0]["c"][1].update(cls="jax.numpy:ndarray"))
    with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape("jax.numpy:ndarray (at `opt.1`)")):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[optax])


def test_functions_are_recorded_by_name_and_rebuilt_only_when_trusted(tmp_path):
    model = eqx.nn.Sequential([eqx.nn.Lambda(_double), eqx.nn.Lambda(jnp.exp)])
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape(f"{__name__}:_double (at `layers.0.fn`)")):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    loaded = eqx_ckpt.Checkpoint(tmp_path).load(trust=[_double])
    assert loaded.layers[0].fn is _double and loaded.layers[1].fn is jnp.exp


def _double(x):
    return 2 * x


def test_what_cannot_be_recorded_never_fails_the_save_and_is_named_on_load(tmp_path):
    def make_closure():
        scale = 3.0
        return lambda x: scale * x

    tree = {"good": _mlp(), "odd": eqx.nn.Lambda(make_closure()), "thing": {"obj": object()}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert tree_equal(ckpt.load("good", trust=[]), tree["good"], typematch=True)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("cannot rebuild `odd.fn`")) as info:
        ckpt.load(trust=[])
    assert "a lambda" in str(info.value) and "pass `like`" in str(info.value)
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("an object of class builtins.object")):
        ckpt.skeleton("thing")
    # With a skeleton for that part, the rest still loads as ever.
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, tree), tree, typematch=True)


class Grown(eqx.Module):
    weight: jax.Array
    depth: int = eqx.field(static=True)


# The same class edited after the save, three ways.
class GrownWider(eqx.Module):
    weight: jax.Array
    depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True)


class GrownWithDefault(eqx.Module):
    weight: jax.Array
    depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True, default=16)


class Shrunk(eqx.Module):
    weight: jax.Array


def test_a_class_whose_fields_changed_is_an_error_naming_both_lists(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"m": Grown(jnp.ones(2), 3)})
    _rename_class(tmp_path, GrownWider)
    with pytest.raises(eqx_ckpt.CheckpointTypeError) as info:
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[GrownWider])
    message = str(info.value)
    assert f"saved `m` as a {__name__}.GrownWider with the fields ['weight', 'depth']" in message
    assert "now has the fields ['weight', 'depth', 'width'] (['width'] are new and have no default)" in message
    _rename_class(tmp_path, GrownWithDefault)
    loaded = eqx_ckpt.Checkpoint(tmp_path).load(trust=[GrownWithDefault])["m"]
    assert (type(loaded), loaded.depth, loaded.width) == (GrownWithDefault, 3, 16)
    _rename_class(tmp_path, Shrunk)
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("(the saved ['depth'] are gone)")):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[Shrunk])


def _rename_class(path: pathlib.Path, new: type) -> None:
    """The manifest as if the class saved at `m` had been `new` (a test's
    stand-in for a class edited between the save and the load)."""
    _edit_structure(path, lambda s: s["c"][0].update(cls=f"{__name__}:{new.__qualname__}"))


class Checked(eqx.Module):
    weight: jax.Array

    def __init__(self, weight):
        raise AssertionError("a rebuild never runs __init__")

    def __check_init__(self):
        if self.weight.shape != (2,):
            raise ValueError("weight must have shape (2,)")


def test_no_init_runs_and_check_init_runs_only_when_asked(tmp_path):
    model = object.__new__(Checked)
    object.__setattr__(model, "weight", jnp.ones(3))
    eqx_ckpt.tree_serialise_leaves(tmp_path, model)
    loaded = eqx_ckpt.Checkpoint(tmp_path).load(trust=[Checked])
    assert tree_equal(loaded, model, typematch=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        eqx_ckpt.Checkpoint(tmp_path).skeleton(trust=[Checked], check_init=True)


def test_a_partial_save_updates_the_record_of_the_replaced_sub_tree(tmp_path):
    tree = {"body": _mlp(), "head": eqx.nn.Linear(2, 2, key=KEYS[0])}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    new = {"body": eqx.filter_eval_shape(_mlp), "head": Block.__new__(Block)}
    new["head"] = _block()
    eqx_ckpt.tree_serialise_leaves(tmp_path, new, where=lambda t: t["head"])
    loaded = eqx_ckpt.Checkpoint(tmp_path).load(trust=[Block])
    assert tree_equal(loaded, {"body": tree["body"], "head": new["head"]}, typematch=True)


def test_asynchronous_incremental_and_manager_saves_record_the_structure(tmp_path):
    manager = eqx_ckpt.CheckpointManager(tmp_path / "run")
    tree = {"model": _block(), "step": 1}
    manager.save(1, tree)
    manager.save(2, eqx.tree_at(lambda t: t["step"], tree, 2), blocking=False) if _takes_blocking(manager) else None
    manager.wait_until_finished()
    last = manager.latest_step()
    assert tree_equal(manager.restore(step=1, trust=[Block]), tree, typematch=True)
    assert manager.restore(step=last, trust=[Block])["step"] == last
    pending = eqx_ckpt.tree_serialise_leaves(tmp_path / "async", tree, blocking=False)
    pending.wait()
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "async").load(trust=[Block]), tree, typematch=True)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "async", tree)  # an incremental overwrite
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path / "async").load(trust=[Block]), tree, typematch=True)


def _takes_blocking(manager) -> bool:
    import inspect

    return "blocking" in inspect.signature(manager.save).parameters


def test_diff_reports_a_changed_hyperparameter_and_function(tmp_path):
    a = eqx.nn.MLP(2, 2, 4, 1, key=KEYS[0])
    b = eqx.tree_at(lambda m: m.activation, a, jax.nn.gelu)
    eqx_ckpt.tree_serialise_leaves(tmp_path / "a", {"m": a, "lr": "1e-3"})
    eqx_ckpt.tree_serialise_leaves(tmp_path / "b", {"m": b, "lr": "3e-4"})
    changes = eqx_ckpt.diff(tmp_path / "a", tmp_path / "b")
    assert changes.structure == (
        ("lr", "'1e-3' -> '3e-4'"),
        ("m.activation", "jax._src.nn.functions.relu -> jax._src.nn.functions.gelu"),
    )
    assert "* m.activation: jax._src.nn.functions.relu -> jax._src.nn.functions.gelu" in list(changes)
    assert not changes.values and len(changes) == 2
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    eqx_ckpt.tree_serialise_leaves(tmp_path / "c", {"m": eqx.nn.MLP(2, 2, 4, 2, key=KEYS[0]), "lr": "1e-3"})
    assert ("m.depth", "1 -> 2") in eqx_ckpt.diff(tmp_path / "a", tmp_path / "c", values=False).structure


def test_ls_types_lists_what_a_load_needs(tmp_path, capsys):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"block": _block(), "mlp": _mlp()})
    assert main(["ls", "--types", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{__name__}.Block  (needs trust)  at block\n" in out
    assert "equinox.nn._mlp.MLP  (trusted by default)  at mlp\n" in out
    assert f"Checkpoint(path).load(trust=[{__name__}.Block]) rebuilds it" in out


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_formats_say_they_record_no_structure(tmp_path, version):
    fixture = places.FIXTURES / f"format_{version}"
    if not fixture.exists():
        pytest.skip(f"no fixture of format {version} in this checkout")
    shutil.copytree(fixture, tmp_path / "ckpt")
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=rf"written in format version {version}, before eqx"):
        ckpt.load(trust=[])
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("Pass a skeleton as `like`")):
        eqx_ckpt.tree_deserialise_leaves(tmp_path / "ckpt")
    assert isinstance(ckpt.load(), dict)  # nested dicts, as ever


def test_another_format_says_it_records_no_classes(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="it is a safetensors checkpoint, which names its tensors"):
        eqx_ckpt.Checkpoint(tmp_path / "m.safetensors").skeleton()


def test_a_model_loads_in_a_fresh_process_that_never_runs_its_code(tmp_path):
    """The documented story: train and save; then a process with the class's
    definition but no call of its constructor (nor of any function making a
    model) loads it with `trust=[MyModel]` and runs it."""
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            import equinox as eqx, jax, pathlib

            class MyModel(eqx.Module):
                layers: list
                scale: float = eqx.field(static=True)

                def __init__(self, key, scale):
                    pathlib.Path("init_ran").write_text("yes")
                    self.layers = [eqx.nn.Linear(3, 8, key=key), eqx.nn.Linear(8, 1, key=key)]
                    self.scale = scale

                def __call__(self, x):
                    return self.scale * self.layers[1](jax.nn.relu(self.layers[0](x)))
            """
        )
    )
    train = """
        import equinox as eqx, jax, jax.numpy as jnp, numpy as np, eqx_ckpt
        from mymodels import MyModel
        model = MyModel(jax.random.key(0), 0.5)
        grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(3)) ** 2))(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        eqx_ckpt.tree_serialise_leaves("ckpt", model)
        np.save("expected.npy", np.asarray(model(jnp.arange(3.0))))
    """
    load = """
        import sys, jax.numpy as jnp, numpy as np, eqx_ckpt
        import mymodels
        model = eqx_ckpt.Checkpoint("ckpt").load(trust=[mymodels.MyModel])
        assert np.array_equal(np.asarray(model(jnp.arange(3.0))), np.load("expected.npy"))
        print(type(model).__name__, model.scale)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), JAX_PLATFORMS="cpu")
    for script in (train, load):
        (tmp_path / "init_ran").unlink(missing_ok=True)
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MyModel 0.5"
    assert not (tmp_path / "init_ran").exists()  # the load never ran the constructor


# -- The structure record is untrusted input ---------------------------------------------------


def _edit_structure(path: pathlib.Path, edit) -> None:
    """Edit a checkpoint's structure record as an attacker would, the manifest signed again."""
    body = json.loads((path / "manifest.json").read_text())
    record = json.loads(body["structure"])
    result = edit(record)
    body["structure"] = json.dumps(result if result is not None else record)
    (path / "manifest.json").write_bytes(manifests.sign(body))


def _leaf_node():
    return {"t": "leaf"}


def _object(cls, fields, children):
    return {"t": "object", "cls": cls, "f": fields, "c": children}


def _value(v):
    return {"t": "value", "v": v}


def _dict_w(others, w=None):
    """A dict node holding the stored leaf `w` and the nodes `others`."""
    items = {"w": w or _leaf_node(), **others}
    return {"t": "dict", "k": [["key", k] for k in items], "c": list(items.values())}


@dataclasses.dataclass
class DictData(dict):
    x: int = 0


def _nested_value(depth):
    v = 1
    for _ in range(depth):
        v = {"tuple": [v]}
    return v


def _nested_list(depth):
    node = {"t": "none"}
    for _ in range(depth):
        node = {"t": "list", "c": [node]}
    return node


UNTRUSTED, CORRUPT, CHANGED = eqx_ckpt.UntrustedError, eqx_ckpt.CorruptCheckpointError, eqx_ckpt.CheckpointTypeError

# Each is the whole structure record of a checkpoint of `{"w": <array>}`:
# (the error it must raise, what its message says).
HOSTILE = {
    "os-system": (_value({"function": "os:system"}), UNTRUSTED, "os:system (at `(the root)`)"),
    "builtins-eval": (_value({"function": "builtins:eval"}), UNTRUSTED, "builtins:eval"),
    "subprocess-popen": (_object("subprocess:Popen", ["args"], [_value("ls")]), UNTRUSTED, "subprocess:Popen"),
    "module-not-imported": (_object("antigravity_xyz.sub:Thing", [], []), UNTRUSTED, "antigravity_xyz.sub:Thing"),
    "function-of-a-module-not-imported": (
        _value({"function": "not_imported_xyz:run"}),
        UNTRUSTED,
        "not_imported_xyz:run",
    ),
    "reduce-shaped": (
        _object("builtins:object", ["args"], [_value({"function": "os:system"})]),
        UNTRUSTED,
        "builtins:object",
    ),
    "enum-untrusted": (_value({"enum": "signal:Signals", "name": "SIGKILL"}), UNTRUSTED, "signal:Signals"),
    "namedtuple-untrusted": (
        {"t": "namedtuple", "cls": "collections:OrderedDict", "f": [], "c": []},
        UNTRUSTED,
        "collections:OrderedDict",
    ),
    "node-untrusted": (
        {"t": "node", "cls": "jax.tree_util:Partial", "aux": None, "k": [], "c": []},
        UNTRUSTED,
        "jax.tree_util:Partial",
    ),
    "function-as-class": (
        _object("jax._src.nn.functions:relu", [], []),
        CORRUPT,
        "names a function where a class belongs",
    ),
    "class-as-enum": (
        _value({"enum": "equinox.nn._linear:Linear", "name": "weight"}),
        CORRUPT,
        "is not an enum",
    ),
    "wrong-fields": (
        _object("equinox.nn._linear:Linear", ["nope"], [{"t": "none"}]),
        CHANGED,
        "that class now has the fields",
    ),
    "duplicate-field": (
        _object("equinox.nn._linear:Linear", ["weight", "weight"], [_leaf_node(), _leaf_node()]),
        CORRUPT,
        "lists a field twice",
    ),
    "field-not-identifier": (
        _object("equinox.nn._linear:Linear", ["a b"], [{"t": "none"}]),
        CORRUPT,
        "one identifier per child",
    ),
    "namedtuple-not-a-namedtuple": (
        {"t": "namedtuple", "cls": "equinox.nn._linear:Linear", "f": [], "c": []},
        CORRUPT,
        "is not a namedtuple",
    ),
    "unknown-kind": ({"t": "pickle", "c": []}, CORRUPT, "the node kind 'pickle' is not one"),
    "kind-not-a-string": ({"t": 5}, CORRUPT, "has no kind"),
    "not-an-object": ([1, 2, 3], CORRUPT, "has no kind"),
    "extra-field": ({"t": "none", "x": 1}, CORRUPT, "a `none` node has the fields"),
    "children-not-a-list": ({"t": "list", "c": "abc"}, CORRUPT, "children are not a list"),
    "keys-mismatch": ({"t": "dict", "k": [], "c": [_leaf_node()]}, CORRUPT, "not one key per child"),
    "key-malformed": ({"t": "dict", "k": [["key", 5]], "c": [_leaf_node()]}, CORRUPT, "key is malformed"),
    "key-repr": (
        {"t": "dict", "k": [["key_repr", "object()"]], "c": [_leaf_node()]},
        CORRUPT,
        "is not one a save",
    ),
    "leaf-without-record": (
        {"t": "dict", "k": [["key", "other"]], "c": [_leaf_node()]},
        CORRUPT,
        "the manifest has none",
    ),
    "value-unknown-tag": (_value({"pickle": "gASV"}), CORRUPT, "is not one a save records"),
    "value-void-dtype": (_value({"dtype": "V1000000000"}), CORRUPT, "is not one a save records"),
    "numpy-of-a-list": (_value({"numpy": ["float32", {"list": [1, 2]}]}), CORRUPT, "holds no number"),
    "numpy-overflow": (_value({"numpy": ["int8", 10**6]}), CORRUPT, "does not hold"),
    "dict-value-unsortable-keys": (
        _dict_w({"v": _value({"dict": [[None, None], [False, None]]})}),
        CORRUPT,
        "the tree it builds cannot be flattened",
    ),
    "numpy-float-overflow": (_value({"numpy": ["float32", 3.4028235677973366e38]}), CORRUPT, "does not hold"),
    "float-tag": (_value({"float": "1e309x"}), CORRUPT, "is not one a save records"),
    "jnp-type": (_value({"jnp_type": "void"}), CORRUPT, "is not one a save records"),
    "huge-string": (_value("x" * (2**20 + 1)), CORRUPT, "longer than any saved value"),
    "huge-class-name": (_object("a:" + "b" * 2000, [], []), CORRUPT, "is not `module:qualname`"),
    "class-name-without-colon": (_object("os.system", [], []), CORRUPT, "is not `module:qualname`"),
    "deep-value": (_value(_nested_value(40)), CORRUPT, "nests deeper than any saved value"),
    "unrecordable-without-reason": ({"t": "unrecordable", "why": 5}, CORRUPT, "does not say why"),
    "deep-tree": (_nested_list(300), CORRUPT, "larger or deeper than any saved tree"),
    # Issue 59: each of these crashed with a Python error, or passed.
    "complex-of-strings": (_value({"complex": ["a", "b"]}), CORRUPT, "is not one a save records"),
    "complex-of-nulls": (_value({"complex": [None, None]}), CORRUPT, "is not one a save records"),
    "complex-of-a-huge-int": (_value({"complex": [10**400, 0]}), CORRUPT, "is not one a save records"),
    "dict-value-list-key": (_value({"dict": [[{"list": [1]}, 2]]}), CORRUPT, "no dict can hold"),
    "dict-value-dict-key": (_value({"dict": [[{"dict": []}, 2]]}), CORRUPT, "no dict can hold"),
    "dict-value-tuple-of-list-key": (_value({"dict": [[{"tuple": [{"list": []}]}, 2]]}), CORRUPT, "no dict can"),
    "dict-value-duplicate-key": (_value({"dict": [["a", 1], ["a", 2]]}), CORRUPT, "names a key twice"),
    "dict-node-mixed-keys": (
        {"t": "dict", "k": [["key", "w"], ["key_int", 1]], "c": [_leaf_node(), {"t": "none"}]},
        CORRUPT,
        "mixes string and integer keys",
    ),
    "dict-node-duplicate-key": (
        {"t": "dict", "k": [["key", "w"], ["key", "w"]], "c": [_leaf_node(), {"t": "none"}]},
        CORRUPT,
        "names a key twice",
    ),
    "class-as-function": (
        {"t": "dict", "k": [["key", "w"], ["key", "f"]], "c": [_leaf_node(), _value({"function": "os:system"})]},
        UNTRUSTED,
        "os:system (at `f`)",
    ),
    "trusted-class-as-function": (
        _dict_w({"f": _value({"function": "equinox.nn._linear:Linear"})}),
        CORRUPT,
        "invalid at `f`: 'equinox.nn._linear:Linear' names a class where a function belongs",
    ),
    "module-as-node": (
        _dict_w({"m": {"t": "node", "cls": "equinox.nn._linear:Linear", "aux": None, "k": [], "c": []}}),
        CORRUPT,
        "invalid at `m`: the dataclass 'equinox.nn._linear:Linear' is recorded as another node",
    ),
    "tagged-value-extra-key": (_value({"tuple": [], "x": 1}), CORRUPT, "is not one a save records"),
    "function-extra-name": (_value({"function": "os:system", "name": "x"}), CORRUPT, "is not one a save records"),
    "deep-refusal-names-its-path": (
        _dict_w({"deep": {"t": "list", "c": [_value({"jnp_type": "float32x"})]}}),
        CORRUPT,
        "invalid at `deep.0`",
    ),
    "enum-refusal-names-its-path": (
        _dict_w({"e": _value({"enum": "equinox.nn._linear:Linear", "name": "weight"})}),
        CORRUPT,
        "invalid at `e`",
    ),
    "state-with-bad-aux": (
        _dict_w({"s": {"t": "node", "cls": "equinox.nn._stateful:State", "aux": {"tuple": [1]}, "k": [], "c": []}}),
        CORRUPT,
        "the class 'equinox.nn._stateful:State' does not rebuild from it (AssertionError, with no message)",
    ),
    "stored-leaf-left-out": ({"t": "dict", "k": [], "c": []}, CORRUPT, "the stored leaves `w` have no place in it"),
    "stored-leaf-set-to-none": (_dict_w({}, w={"t": "none"}), CORRUPT, "the stored leaves `w` have no place"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_structure_record_is_refused(tmp_path, name):
    record, error, words = HOSTILE[name]
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _edit_structure(tmp_path, lambda _: record)
    before = set(sys.modules)
    with pytest.raises(error, match=re.escape(words)):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    with pytest.raises(error, match=re.escape(words)):
        eqx_ckpt.tree_deserialise_leaves(tmp_path)
    # Nothing a record names is imported; a load with `like` never reads the record.
    assert not {"antigravity_xyz", "not_imported_xyz", "subprocess", "signal"} & (set(sys.modules) - before)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": np.zeros(3)}), {"w": np.arange(3.0)})


def test_a_trusted_dataclass_that_subclasses_dict_is_refused_not_crashed(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _edit_structure(tmp_path, lambda _: _dict_w({"x": _object(f"{__name__}:DictData", [], [])}))
    with pytest.raises(CORRUPT, match=re.escape("invalid at `x`: the dataclass 'test_structure:DictData' is not one")):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[DictData])


FORGED = "x\n\x1b[2Kpass `trust=[os]`. It is safe.\r" + "y" * 900

# Every message path that shows a string from the record: (record, trust, error).
INJECTIONS = {
    "class-name": (_object("os:sys" + FORGED, [], []), [], UNTRUSTED),
    "function-name": (_value({"function": "os:" + FORGED}), [], UNTRUSTED),
    "enum-name": (_value({"enum": "e:" + FORGED, "name": "A"}), [], UNTRUSTED),
    "why": (_dict_w({"u": {"t": "unrecordable", "why": FORGED}}), [], eqx_ckpt.CheckpointValueError),
    "key": (_dict_w({"k" + FORGED: _value({"function": "os:system"})}), [], UNTRUSTED),
    "key-corrupt": (_dict_w({"k" + FORGED: _value({"jnp_type": "x"})}), [], CORRUPT),
    "enum-member": (_dict_w({"e": _value({"enum": f"{__name__}:Colour", "name": FORGED})}), [Colour], CORRUPT),
    "field-of-changed-class": (_object(f"{__name__}:Tagged", ["weight"], [_leaf_node()]), [Tagged], CHANGED),
}


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_no_string_from_a_record_forges_a_line_or_floods_a_message(tmp_path, name):
    record, trust, error = INJECTIONS[name]
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _edit_structure(tmp_path, lambda _: record)
    with pytest.raises(error) as info:
        eqx_ckpt.Checkpoint(tmp_path).load(trust=trust)
    message = str(info.value)
    assert "\x1b" not in message and "\r" not in message
    assert not any(line.startswith("pass `trust=[os]`") or "\x1b" in line for line in message.splitlines())
    assert len(message) < 3000


def test_ls_types_shows_a_forged_class_name_on_its_own_line_and_bounded(tmp_path, capsys):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _edit_structure(tmp_path, lambda _: _dict_w({"k" + FORGED: _object("os:sys" + FORGED, [], [])}))
    assert main(["ls", "--types", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2 and not any(line.startswith("pass `trust=[os]`") for line in lines)
    assert all(line.isprintable() for line in lines) and len(out) < 1000


def test_fuzzed_strings_in_a_record_never_reach_a_message_raw(tmp_path):
    from hypothesis import HealthCheck, given, settings, strategies as st

    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", {"w": np.arange(3.0)})
    texts = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=300)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(INJECTIONS)), texts)
    def check(name, text):
        record = json.loads(json.dumps(INJECTIONS[name][0]).replace(json.dumps(FORGED)[1:-1], json.dumps(text)[1:-1]))
        target = tmp_path / "fuzzed"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp_path / "base", target)
        _edit_structure(target, lambda _: record)
        try:
            eqx_ckpt.Checkpoint(target).load(trust=INJECTIONS[name][1])
        except eqx_ckpt.CheckpointError as e:
            lines = str(e).splitlines()
            assert all(line.isprintable() for line in lines), str(e)
            assert len(str(e)) < 3000

    check()


def test_a_hostile_file_imports_nothing_in_a_fresh_process(tmp_path):
    """`sys.modules` before and after opening records that name modules this
    process has not imported: none of them appears."""
    for name in ("module-not-imported", "function-of-a-module-not-imported", "subprocess-popen", "enum-untrusted"):
        eqx_ckpt.tree_serialise_leaves(tmp_path / name, {"w": np.arange(3.0)})
        _edit_structure(tmp_path / name, lambda _, n=name: HOSTILE[n][0])
    script = textwrap.dedent(
        """
        import sys, eqx_ckpt
        names = ["module-not-imported", "function-of-a-module-not-imported", "subprocess-popen", "enum-untrusted"]
        watched = {"antigravity_xyz", "not_imported_xyz", "subprocess", "signal"}
        before = watched & set(sys.modules)
        for name in names:
            ckpt = eqx_ckpt.Checkpoint(name)
            ckpt.types()
            try:
                ckpt.load(trust=[])
            except eqx_ckpt.UntrustedError:
                pass
        print(sorted((watched & set(sys.modules)) - before))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _raw_structure(path: pathlib.Path, text: bytes) -> None:
    """Put `text` as the structure record, byte for byte, and sign the manifest
    again (its digest is the sha256 of every byte before it: docs/format.md)."""
    import hashlib

    data = (path / "manifest.json").read_bytes()
    start = data.index(b'"structure": ') + len(b'"structure": ')
    data = data[:start] + json.dumps(text.decode()).encode() + data[data.index(b',\n"leaves": ') :]
    head = data[: data.rindex(b',\n"digest": ')]
    (path / "manifest.json").write_bytes(
        head + b',\n"digest": "sha256:' + hashlib.sha256(head).hexdigest().encode() + b'"}\n'
    )


def test_a_record_nested_ten_thousand_deep_is_refused(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    depth = 10**4  # deeper is refused by the container count before parsing
    _raw_structure(tmp_path, b'{"t":"list","c":[' * depth + b'{"t":"none"}' + b"]}" * depth)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)  # the record is read only by a load that rebuilds
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("structure record of checkpoint")) as info:
        ckpt.load(trust=[])
    assert "it is not valid JSON" in str(info.value)
    assert tree_equal(eqx_ckpt.tree_deserialise_leaves(tmp_path, {"w": np.zeros(3)}), {"w": np.arange(3.0)})


def test_a_record_of_ten_million_nodes_is_refused_before_it_is_parsed(tmp_path):
    import psutil

    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _raw_structure(tmp_path, b'{"t":"list","c":[' + b'{"t":"none"},' * (10**7 - 1) + b'{"t":"none"}]}')
    rss = psutil.Process().memory_info().rss
    # The manifest holds the record as one string; a rebuild counts its containers against its one leaf.
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="for a tree of 1 stored leaves"):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    # Parsed, ten million objects would have taken gigabytes.
    assert psutil.Process().memory_info().rss - rss < 600 * 2**20


def test_a_record_far_larger_than_its_leaves_warrant_is_refused_before_it_is_parsed(tmp_path):
    """Half a million `None` nodes for a tree of four stored leaves: refused by
    the count of its containers, before any of it is parsed or walked (a walk
    took seconds). The record does not even end as JSON: parsed, it would be
    refused as invalid JSON instead. The message says why: how many are
    allowed, and for how many leaves."""
    from eqx_ckpt._load import _rebuild

    eqx_ckpt.tree_serialise_leaves(tmp_path, {k: np.arange(3.0) for k in "abcd"})
    _raw_structure(tmp_path, b'{"t":"list","c":[' + b'{"t":"none"},' * (500_000 - 1) + b'{"t":"none"}]')
    with pytest.raises(eqx_ckpt.CorruptCheckpointError) as info:
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    cap = _rebuild.node_cap(4)
    assert cap == 4 * _rebuild.NODES_PER_LEAF + _rebuild.NODES_BASE < 500_000
    said = str(info.value)
    assert f"structure record of checkpoint {str(tmp_path)!r}" in said and "valid JSON" not in said
    assert f"it holds more than the {cap} JSON containers (objects and arrays) allowed for a tree of 4 stored " in said
    assert f"({_rebuild.NODES_PER_LEAF} a stored leaf and {_rebuild.NODES_BASE} more" in said
    # A load with `like` reads no record: the leaves load.
    got = eqx_ckpt.tree_deserialise_leaves(tmp_path, {k: np.zeros(3) for k in "abcd"})
    assert tree_equal(got, {k: np.arange(3.0) for k in "abcd"})


class _Tokeniser(eqx.Module):
    embed: np.ndarray
    vocab: dict = eqx.field(static=True)


def test_a_static_vocabulary_of_thousands_beside_few_leaves_still_rebuilds(tmp_path):
    """The room beside the stored leaves (`NODES_BASE`) holds a vocabulary of
    20,000 entries, as a dict of strings in the tree (about 40,000
    containers) and as a static field."""
    from eqx_ckpt._load import _rebuild

    vocab = {f"token{i}": f"piece{i}" for i in range(20_000)}
    trees = {
        "in the tree": {"w": np.arange(3.0), "b": np.ones(2, np.float32), "vocab": vocab},
        "a static field": _Tokeniser(np.arange(6.0).reshape(2, 3), {k: i for i, k in enumerate(vocab)}),
    }
    for name, tree in trees.items():
        path = tmp_path / name.replace(" ", "_")
        eqx_ckpt.tree_serialise_leaves(path, tree)
        body = json.loads((path / "manifest.json").read_text())
        containers = body["structure"].count("{") + body["structure"].count("[")
        assert 20_000 < containers <= _rebuild.node_cap(len(body["leaves"])), name
        assert tree_equal(eqx_ckpt.Checkpoint(path).load(trust=[_Tokeniser]), tree, typematch=True), name


def _records():
    from hypothesis import strategies as st

    names = st.sampled_from(
        [
            "os:system",
            "equinox.nn._linear:Linear",
            "builtins:eval",
            "x",
            "a:b:c",
            f"{__name__}:Block",
            f"{__name__}:DictData",
            "enum:Enum",
        ]
    )
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=5),
    )
    values = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.dictionaries(
                st.sampled_from(
                    ["tuple", "list", "dict", "float", "complex", "numpy", "dtype", "function", "enum", "name"]
                ),
                inner,
                max_size=2,
            ),
            st.lists(inner, max_size=3),
            # The insides of tagged values: pairs of a dict value (any key), parts of a complex.
            st.builds(lambda pairs: {"dict": pairs}, st.lists(st.lists(inner, min_size=2, max_size=2), max_size=3)),
            st.builds(lambda parts: {"complex": parts}, st.lists(inner, min_size=2, max_size=2)),
            st.builds(lambda v, dt: {"numpy": [dt, v]}, inner, st.sampled_from(["int8", "float32", "complex64"])),
        ),
        max_leaves=8,
    )
    kinds = st.sampled_from(
        ["leaf", "none", "value", "dict", "list", "tuple", "namedtuple", "object", "node", "unrecordable", "?"]
    )
    # Records whose shape is right but for one value or one dict node's keys,
    # so that the fuzzing reaches what is checked inside them.
    dict_keys = st.lists(
        st.tuples(st.sampled_from(["key", "key_int"]), st.sampled_from(["w", "a", 0, 1])).map(list), max_size=3
    )
    well_formed = st.one_of(
        values.map(lambda v: _dict_w({"v": _value(v)})),
        dict_keys.map(lambda keys: _dict_w({"d": {"t": "dict", "k": keys, "c": [{"t": "none"}] * len(keys)}})),
        st.tuples(names, values).map(
            lambda p: _dict_w({"n": {"t": "node", "cls": p[0], "aux": p[1], "k": [], "c": []}})
        ),
    )
    return well_formed | st.recursive(
        st.fixed_dictionaries({"t": kinds}, optional={"v": values, "why": scalars}),
        lambda inner: st.fixed_dictionaries(
            {"t": kinds},
            optional={
                "c": st.lists(inner, max_size=3),
                # Dict keys of every kind, mixed and repeated.
                "k": st.lists(
                    st.one_of(
                        st.tuples(st.sampled_from(["key", "key_int"]), st.sampled_from(["w", "a", 0, 1])).map(list),
                        st.lists(
                            st.one_of(
                                st.sampled_from(["key", "key_int", "index", "attr", "flat", "key_repr"]), scalars
                            ),
                            min_size=2,
                            max_size=2,
                        ),
                    ),
                    max_size=3,
                ),
                "f": st.lists(st.sampled_from(["weight", "bias", "x", "a b"]), max_size=3),
                "cls": names,
                "aux": values,
                "v": values,
            },
        ),
        max_leaves=12,
    )


def test_fuzzed_structure_records_give_only_clear_errors(tmp_path):
    from hypothesis import HealthCheck, given, settings

    eqx_ckpt.tree_serialise_leaves(tmp_path / "base", {"w": np.arange(3.0)})

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_records())
    def check(record):
        target = tmp_path / "fuzzed"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp_path / "base", target)
        _edit_structure(target, lambda _: record)
        ckpt = eqx_ckpt.Checkpoint(target)
        trusted = [Block, DictData, eqx.nn.Linear]
        for attempt in (lambda: ckpt.load(trust=[]), ckpt.types, lambda: ckpt.skeleton(trust=trusted)):
            try:
                attempt()
            except eqx_ckpt.CheckpointError:
                pass

    check()


def test_checkpoint_load_takes_prefix_as_the_spec_names_it(tmp_path):
    tree = {"model": _mlp(), "step": 3}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert tree_equal(ckpt.load(prefix="model", trust=[]), tree["model"], typematch=True)
    assert tree_equal(ckpt.load(prefix="model"), ckpt.load("model"))
    with pytest.warns(DeprecationWarning, match=re.escape("`key` is now called `prefix`")):
        assert tree_equal(ckpt.load(key="model"), ckpt.load("model"))
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=re.escape("`Checkpoint.load`'s `prefix` must be a dotted")):
        ckpt.load(3)


def test_a_number_too_large_for_a_float_is_refused_not_read_as_inf(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    _raw_structure(tmp_path, b'{"t":"dict","k":[["key","w"],["key","s"]],"c":[{"t":"leaf"},{"t":"value","v":1e400}]}')
    with pytest.raises(CORRUPT, match=re.escape("it is not valid JSON (the number 1e400 is too large for a float")):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[])


def test_a_manifest_of_millions_of_empty_lists_is_refused_before_it_is_parsed(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"w": np.arange(3.0)})
    body = json.loads((tmp_path / "manifest.json").read_text())
    body["metrics"] = {"junk": [[]] * 10**5}
    (tmp_path / "manifest.json").write_bytes(manifests.sign(body))
    with pytest.raises(CORRUPT, match=re.escape("JSON containers (objects and arrays) in")):
        eqx_ckpt.Checkpoint(tmp_path)


def test_a_large_static_vocabulary_beside_one_leaf_still_rebuilds(tmp_path, monkeypatch):
    """The container count is tied to the stored leaves: a dict of stored
    integers with more containers (two each) than the part of the bound that
    is not (`_rebuild.NODES_BASE`), beside one array. (The bound's fixed part
    is lowered for the test: at its real 200,000, the 101,000 scalar leaves
    took 50 s to save and load, and the rule is the same.)"""
    from eqx_ckpt._load import _rebuild

    monkeypatch.setattr(_rebuild, "NODES_BASE", 4_000)
    tree = {"w": np.arange(3.0), "vocab": {f"t{i}": i for i in range(_rebuild.NODES_BASE // 2 + 1_000)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path).load(trust=[]), tree, typematch=True)


def test_format_md_names_the_version_saves_write():
    """docs/format.md's list of versions ends with the ones a save writes."""
    from eqx_ckpt._ondisk._format import COMPRESSED_VERSION, FORMAT_VERSION, UNCOMPRESSED_VERSION

    text = (places.ROOT / "docs" / "format.md").read_text()
    found = re.findall(
        r"saves write\s+version (\d+),\s+or (\d+) where they compress,\s+or (\d+) where they hold an iterator", text
    )
    assert found == [(str(UNCOMPRESSED_VERSION), str(COMPRESSED_VERSION), str(FORMAT_VERSION))]


def test_the_default_trust_holds_concrete_public_classes_and_what_layers_store():
    """No abstract base, bare `eqx.Module` or private helper is trusted by
    default: only public names, and the few private objects layers store."""
    import inspect

    from eqx_ckpt._ondisk._trust import _default_table

    stored = {"equinox.nn._mlp:_identity", "equinox.nn._stateful:_Sentinel"}
    modules = (eqx.nn, jax.nn, jnp, jax.lax)
    for name, obj in _default_table().items():
        if name in stored:
            continue
        attr = name.partition(":")[2]
        assert not attr.startswith("_") and any(vars(m).get(attr) is obj for m in modules), name
        assert not (inspect.isclass(obj) and inspect.isabstract(obj)), name
    names = set(_default_table())
    assert {"equinox.nn._sequential:StatefulLayer", "equinox._module._module:Module"}.isdisjoint(names)
    assert not any(":_" in name for name in names - stored)


@pytest.mark.parametrize(
    "layer",
    [
        eqx.nn.MaxPool1d(2),
        eqx.nn.AvgPool2d(2),
        eqx.nn.AdaptiveAvgPool1d(3),
        eqx.nn.AdaptiveMaxPool2d((2, 2)),
    ],
    ids=type,
)
def test_pooling_layers_load_with_the_default_trust(tmp_path, layer):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"pool": layer})
    assert tree_equal(eqx_ckpt.Checkpoint(tmp_path).load(trust=[]), {"pool": layer}, typematch=True)


def test_a_like_with_other_static_fields_warns_naming_the_path_and_both_values(tmp_path):
    """The record says `num_heads=4`; a skeleton built with 8 loads with a
    warning naming the key path and both values, silenced by its class."""
    key = jax.random.key(0)
    saved = {"attn": eqx.nn.MultiheadAttention(4, 16, key=key)}
    eqx_ckpt.tree_serialise_leaves(tmp_path, saved)
    like = {"attn": eqx.nn.MultiheadAttention(8, 16, key=key)}
    with pytest.warns(eqx_ckpt.StaticFieldWarning) as record:
        loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    messages = [str(w.message) for w in record]
    assert any("static field `attn.num_heads` is 8, but the checkpoint recorded 4" in m for m in messages)
    assert loaded["attn"].num_heads == 8  # `like`'s value: the warning says so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=eqx_ckpt.StaticFieldWarning)
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    # The same static values, or a load without `like`, say nothing.
    eqx_ckpt.tree_deserialise_leaves(tmp_path, saved)
    eqx_ckpt.Checkpoint(tmp_path).load(trust=[])
    # Under a prefix, the path is the whole one.
    with pytest.warns(eqx_ckpt.StaticFieldWarning) as record:
        eqx_ckpt.tree_deserialise_leaves(tmp_path, like["attn"], prefix="attn")
    assert any("static field `attn.num_heads` is 8" in str(w.message) for w in record)


def _renamed_block(field: str) -> type:
    """A transformer block class whose MLP field is called `field`, filed
    under one name (`RenamedBlock`) whatever the field: the class before and
    after a rename."""
    cls = type("RenamedBlock", (eqx.Module,), {"__annotations__": {field: eqx.nn.MLP}, "__module__": __name__})
    cls.__qualname__ = "RenamedBlock"
    return cls


@pytest.mark.parametrize("blocks", [True, False], ids=["in-a-list-of-blocks", "at-a-named-path"])
def test_a_renamed_field_suggests_the_rename_that_loads_the_trained_values(tmp_path, blocks):
    """`ff` renamed `mlp`: the error suggests the `rename` (never `missing='keep'`,
    which would leave the layers freshly initialised), and that `rename`, as
    printed, loads the trained values."""
    old, new = _renamed_block("ff"), _renamed_block("mlp")
    keys = jax.random.split(jax.random.key(0), 3)
    make = lambda cls, name, key: cls(**{name: eqx.nn.MLP(2, 2, 4, 1, key=key)})
    trained = [make(old, "ff", k) for k in keys[:2]] if blocks else {"head": make(old, "ff", keys[0])}
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"blocks": trained})
    with pytest.raises(eqx_ckpt.CheckpointTypeError) as info:
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[new])
    message = str(info.value)
    assert "missing='keep'" in message and "would leave them freshly initialised" in message
    printed = re.search(r"`(rename=.*?)` \(", message).group(1)
    rename = eval(printed.removeprefix("rename="))  # the suggestion, exactly as printed
    fresh = [make(new, "mlp", keys[2]) for _ in range(2)] if blocks else {"head": make(new, "mlp", keys[2])}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path, {"blocks": fresh}, rename=rename)
    mlps = lambda tree, name: [
        getattr(b, name) for b in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (old, new)))
    ]
    assert tree_equal(mlps(loaded, "mlp"), mlps({"blocks": trained}, "ff"), typematch=True)


class Summed(eqx.Module):
    weight: jax.Array

    def __check_init__(self):
        # Array code, as `eqx.filter_eval_shape` allows: traced, never given a ShapeDtypeStruct.
        if jnp.sum(self.weight).shape != () or self.weight.shape[0] > 2:
            raise ValueError("weight is too long")


def test_check_init_runs_traced_and_its_refusal_names_the_class_and_path(tmp_path):
    good = {"layers": [Summed(jnp.ones(2))]}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "good", good)
    skeleton = eqx_ckpt.Checkpoint(tmp_path / "good").skeleton(trust=[Summed], check_init=True)
    assert tree_equal(skeleton, eqx.filter_eval_shape(lambda: good), typematch=True)
    loaded = eqx_ckpt.Checkpoint(tmp_path / "good").load(trust=[Summed], check_init=True)
    assert tree_equal(loaded, good, typematch=True)
    bad = object.__new__(Summed)  # past its own check, as a hostile or old file may hold
    object.__setattr__(bad, "weight", jnp.ones(3))
    eqx_ckpt.tree_serialise_leaves(tmp_path / "bad", {"layers": [bad]})
    with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
        eqx_ckpt.Checkpoint(tmp_path / "bad").load(trust=[Summed], check_init=True)
    message = str(info.value)
    assert "`__check_init__` of Summed refused the rebuilt `layers.0`" in message
    assert "ValueError: weight is too long" in message


@pytest.mark.parametrize(
    ("module", "io"),
    [(jnp, jnp.load), (jnp, jnp.fromfile), (np, np.load), (np, np.fromfile), (np, np.memmap), (np, np.save)],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_no_trust_reaches_file_reading_functions(tmp_path, module, io):
    """`jnp.load` says it is defined in `jax.numpy` (JAX sets its `__module__`),
    so `trust=[jax.numpy]` would reach it: I/O functions are denied in every
    trust, module or object, and a record naming one is untrusted."""
    from eqx_ckpt._ondisk._trust import Trust, name_of

    name = name_of(io)
    assert Trust([module]).resolve(name) is None
    assert Trust([module]).resolve(name_of(module.add)) is module.add  # the rest of the module stays trusted
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match="reads or writes files or runs code"):
        Trust([io])
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"f": jnp.tanh})
    _edit_structure(tmp_path, lambda s: s["c"][0]["v"].update(function=name))
    with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape(name)):
        eqx_ckpt.Checkpoint(tmp_path).load(trust=[module])


def test_every_eqx_nn_layer_rebuilds_with_trust_empty_or_is_a_documented_exception(tmp_path):
    """Walks `eqx.nn`: every public class has a constructor in `tests/support/nn_layers.py`
    (a layer a future Equinox adds fails here, named), rebuilds exactly with
    `trust=[]`, or is an exception docs/structure.md states with its reason."""
    import inspect

    import nn_layers

    classes = sorted(n for n, v in vars(eqx.nn).items() if inspect.isclass(v) and not n.startswith("_"))
    covered = {name.partition(" ")[0] for name in nn_layers.LAYERS} | set(nn_layers.ABSTRACT)
    assert [n for n in classes if n not in covered] == [], "eqx.nn classes with no entry in tests/support/nn_layers.py"
    docs = (places.ROOT / "docs" / "structure.md").read_text()
    rebuilt = 0
    for i, (name, make) in enumerate(nn_layers.LAYERS.items()):
        tree = make()
        eqx_ckpt.tree_serialise_leaves(tmp_path / str(i), tree)
        if name in nn_layers.EXCEPTIONS:
            assert f"`{name}`" in docs and nn_layers.EXCEPTIONS[name] in docs, name
            with pytest.raises(eqx_ckpt.CheckpointValueError, match="cannot rebuild"):
                eqx_ckpt.Checkpoint(tmp_path / str(i)).load(trust=[])
            continue
        again = eqx_ckpt.Checkpoint(tmp_path / str(i)).load(trust=[])
        assert jax.tree.structure(again) == jax.tree.structure(tree), name
        # Bitwise, NaN-holding buffers included.
        assert all(
            type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tree))
        ), name
        rebuilt += 1
    assert rebuilt == len(nn_layers.LAYERS) - len(nn_layers.EXCEPTIONS)
