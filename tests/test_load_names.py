"""Names the user gives that match nothing are errors, for every source format:
a key of a `rename` or `transform` mapping that names no leaf of `like` (a typo,
or the stored name, as load errors name leaves) once loaded a square weight
untransposed, or kept an embedding at its random initial value, without a word
(issue 40)."""

import json
import re

import equinox as eqx
import numpy as np
import pytest
from safetensors.numpy import save_file

import eqx_ckpt

# Square, so a skipped transpose is no shape error.
EMBED = np.arange(16, dtype=np.float32).reshape(4, 4)
PROJ = np.arange(9, dtype=np.float32).reshape(3, 3) * 10
STORED = {"model.embed_tokens": EMBED, "model.proj": PROJ, "step": np.array(3, np.int32)}


def _eqx_ckpt(path):
    tree = {"model": {"embed_tokens": EMBED, "proj": PROJ}, "step": STORED["step"]}
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return path


def _safetensors(path):
    path = path.with_suffix(".safetensors")
    save_file(STORED, str(path), metadata={"format": "pt"})
    return path


def _hf(directory):
    """Hugging Face's sharded layout: `model-0000i-of-00002.safetensors` + index."""
    directory.mkdir()
    weight_map = {}
    for i, names in enumerate((["model.embed_tokens"], ["model.proj", "step"]), 1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: STORED[n] for n in names}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.nbytes for t in STORED.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _orbax(path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"model": {"embed_tokens": EMBED, "proj": PROJ}, "step": STORED["step"]}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return path


def _like():
    return {"embed": np.zeros((4, 4), np.float32), "proj": np.zeros((3, 3), np.float32)}


# Where each leaf of `like` is stored, below `prefix="model"`.
RENAME = {"embed": "embed_tokens"}


@pytest.fixture(params=[_eqx_ckpt, _safetensors, _hf, _orbax], ids=["eqx_ckpt", "safetensors", "hf", "orbax"])
def source(request, tmp_path):
    path = request.param(tmp_path / "ckpt")
    assert eqx_ckpt.Checkpoint(path).keys() >= {"model.embed_tokens", "model.proj"}
    return path


class TestNamesThatMatchNothing:
    def test_a_transform_key_with_a_typo_is_refused_by_name(self, source):
        with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
            eqx_ckpt.tree_deserialise_leaves(
                source, _like(), prefix="model", rename=RENAME, transform={"prj": np.transpose}, missing="keep"
            )
        message = str(info.value)
        assert re.search(re.escape("1 key of `transform` names no leaf of `like`"), message)
        said = "`transform` key `prj` names no leaf of `like`. The nearest paths of `like`: `proj`."
        assert re.search(re.escape(said), message)
        assert "a name in the checkpoint" not in message

    @pytest.mark.parametrize(("key", "leaf"), [("model.proj", "proj"), ("embed_tokens", "embed")])
    def test_a_transform_keyed_by_the_stored_name_is_refused_and_says_so(self, source, key, leaf):
        with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
            eqx_ckpt.tree_deserialise_leaves(
                source, _like(), prefix="model", rename=RENAME, transform={key: np.transpose}
            )
        said = (
            f"`transform` key `{key}` names no leaf of `like`: `{key}` is a name in the checkpoint; "
            f"keys of `transform` name leaves of `like` (`{leaf}` is loaded from it: write `{leaf}`)"
        )
        assert re.search(re.escape(said), str(info.value))

    @pytest.mark.parametrize("missing", ["keep", "error"])
    def test_a_rename_key_naming_nothing_is_refused_whatever_missing_says(self, source, missing):
        with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
            eqx_ckpt.tree_deserialise_leaves(
                source, _like(), prefix="model", rename={"emb": "embed_tokens"}, missing=missing
            )
        message = str(info.value)
        said = "`rename` key `emb` names no leaf of `like`. The nearest paths of `like`: `embed`."
        assert re.search(re.escape(said), message)
        assert re.search(re.escape("values of `rename` are paths in the checkpoint"), message)
        # Both mappings' keys that match nothing, in one error.
        with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
            eqx_ckpt.tree_deserialise_leaves(
                source, _like(), rename={"model.embed_tokens": "x"}, transform={"prj": np.transpose}, missing=missing
            )
        message = str(info.value)
        assert re.search(re.escape("2 keys of `rename` and `transform` name no leaf of `like`"), message)
        assert re.search(re.escape("`model.embed_tokens` is a name in the checkpoint; keys of `rename`"), message)
        assert re.search(re.escape("`transform` key `prj` names no leaf"), message)

    def test_keys_naming_leaves_and_sub_trees_of_like_load_the_right_values(self, source):
        loaded = eqx_ckpt.tree_deserialise_leaves(
            source, _like(), prefix="model", rename=RENAME, transform={"proj": np.transpose}
        )
        assert eqx.tree_equal(loaded, {"embed": EMBED, "proj": PROJ.T}, typematch=True)
        # A `rename` key naming a sub-tree; a `transform` key of a leaf `where` leaves out.
        like = {"enc": {"embed_tokens": np.zeros((4, 4), np.float32), "proj": np.ones((3, 3), np.float32)}}
        loaded = eqx_ckpt.tree_deserialise_leaves(
            source,
            like,
            rename={"enc": "model"},
            where=lambda t: t["enc"]["embed_tokens"],
            transform={"enc.proj": np.transpose},
        )
        assert eqx.tree_equal(loaded, {"enc": {"embed_tokens": EMBED, "proj": like["enc"]["proj"]}}, typematch=True)
        # Rule lists are not checked: a rule that matches nothing is fine.
        loaded = eqx_ckpt.tree_deserialise_leaves(
            source,
            _like(),
            prefix="model",
            rename=[("^emb$", "nowhere"), ("^embed$", "embed_tokens")],
            transform=[("prj", np.transpose)],
        )
        assert eqx.tree_equal(loaded, {"embed": EMBED, "proj": PROJ}, typematch=True)


KERNEL = np.arange(6, dtype=np.float32).reshape(2, 3)
FLAX = {"params/Dense_0/kernel": KERNEL, "params/Dense_0/bias": np.ones(3, np.float32)}


def _flax_source(kind, tmp_path):
    """Tensors named as Flax names them, `params/Dense_0/kernel`, in format `kind`."""
    if kind == "safetensors":
        save_file(FLAX, str(tmp_path / "flax.safetensors"))
        return tmp_path / "flax.safetensors"
    if kind == "hf":
        eqx_ckpt.export_safetensors(tmp_path / "hf", FLAX, max_shard_size=4)
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
        return tmp_path / "hf"
    if kind == "orbax":
        ocp = pytest.importorskip("orbax.checkpoint")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "orbax", FLAX)
        return tmp_path / "orbax"
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", FLAX)
    return tmp_path / "ckpt"


@pytest.mark.parametrize("kind", ["safetensors", "hf", "orbax", "eqx_ckpt"])
@pytest.mark.parametrize(
    "rename",
    [
        {"w": "params/Dense_0/kernel", "b": "params/Dense_0/bias"},
        [(r"^w$", "params/Dense_0/kernel"), (r"^b$", "params/Dense_0/bias")],
        lambda path: {"w": "params/Dense_0/kernel", "b": "params/Dense_0/bias"}[path],
        {"w": "params%2FDense_0%2Fkernel", "b": "params%2FDense_0%2Fbias"},
    ],
    ids=["mapping", "rules", "callable", "dotted"],
)
def test_rename_targets_may_be_stored_names_as_the_file_spells_them(tmp_path, kind, rename):
    """A stored name holding `/` is listed escaped (`params%2FDense_0%2Fkernel`);
    a `rename` to `params/Dense_0/kernel`, the name as the file spells it, was
    refused as "not a dotted path"."""
    path = _flax_source(kind, tmp_path)
    assert "params%2FDense_0%2Fkernel" in eqx_ckpt.Checkpoint(path)
    like = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    out = eqx_ckpt.tree_deserialise_leaves(path, like, rename=rename)
    expected = {"w": KERNEL, "b": np.ones(3, np.float32)}
    assert eqx.tree_equal(out, expected, typematch=True)
    # A name that matches nothing is still an error naming it, never nothing loaded.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("params%2FDense_1%2Fkernel")):
        eqx_ckpt.tree_deserialise_leaves(path, {"w": like["w"]}, rename={"w": "params/Dense_1/kernel"})


def test_an_export_names_a_tensor_as_the_file_spells_it(tmp_path):
    eqx_ckpt.export_safetensors(tmp_path / "out.safetensors", {"w": KERNEL}, rename={"w": "params/Dense_0/kernel"})
    from safetensors.numpy import load_file

    assert list(load_file(tmp_path / "out.safetensors")) == ["params/Dense_0/kernel"]
