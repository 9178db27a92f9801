"""Other formats without silent wrong values (issue 40), checked once for every
source format (eqx_ckpt, a safetensors file, a Hugging Face sharded directory,
orbax):

- names the user gives that match nothing are errors: a key of a `rename` or
  `transform` mapping that names no leaf of `like` (a typo, or the stored name,
  as load errors name leaves) once loaded a square weight untransposed, or kept
  an embedding at its random initial value, without a word;
- a source rewritten by its own writer after it was opened is reported as
  replaced (`CheckpointReplacedError`): lazy leaves of a safetensors file or a
  Hugging Face directory once read the new file's bytes at the old offsets
  (another tensor's values), and a healthy orbax checkpoint saved again was
  reported as damaged;
- `torch_layout`'s module rules mean the same paths for stock layers and for
  leaves outside them, also when `like` is a `(model, state)` tuple."""

import functools
import json
import re

import equinox as eqx
import numpy as np
import pytest
from arrays import tree_equal
from layers import NormAndGain
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


def _orbax(path, **options):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"model": {"embed_tokens": EMBED, "proj": PROJ}, "step": STORED["step"]}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return path


# orbax's other layout: a zarr3 array per leaf, in folders named by its keys.
_ORBAX_FOLDERS = {"use_ocdbt": False, "use_zarr3": True}


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
        assert tree_equal(loaded, {"embed": EMBED, "proj": PROJ.T}, typematch=True)
        # A `rename` key naming a sub-tree; a `transform` key of a leaf `where` leaves out.
        like = {"enc": {"embed_tokens": np.zeros((4, 4), np.float32), "proj": np.ones((3, 3), np.float32)}}
        loaded = eqx_ckpt.tree_deserialise_leaves(
            source,
            like,
            rename={"enc": "model"},
            where=lambda t: t["enc"]["embed_tokens"],
            transform={"enc.proj": np.transpose},
        )
        assert tree_equal(loaded, {"enc": {"embed_tokens": EMBED, "proj": like["enc"]["proj"]}}, typematch=True)
        # Rule lists are not checked: a rule that matches nothing is fine.
        loaded = eqx_ckpt.tree_deserialise_leaves(
            source,
            _like(),
            prefix="model",
            rename=[("^emb$", "nowhere"), ("^embed$", "embed_tokens")],
            transform=[("prj", np.transpose)],
        )
        assert tree_equal(loaded, {"embed": EMBED, "proj": PROJ}, typematch=True)


# What each source is replaced with: other values, and a tensor stored first,
# so that the old offsets of a safetensors file point at other bytes.
NEW = {"a.first": np.full((5, 5), 7.0, np.float32), "model.embed_tokens": EMBED + 100, "model.proj": PROJ - 100}
NEW_STEP = np.array(4, np.int32)
NEW_TREE = {
    "a": {"first": NEW["a.first"]},
    "model": {"embed_tokens": NEW["model.embed_tokens"], "proj": NEW["model.proj"]},
    "step": NEW_STEP,
}


def _replace_eqx_ckpt(path):
    eqx_ckpt.tree_serialise_leaves(path, NEW_TREE)


def _replace_safetensors_file(path):
    save_file({**NEW, "step": NEW_STEP}, str(path))


def _replace_hf_by_export(directory):
    # Two shards again (of other sizes), as `export_safetensors` writes them.
    names = eqx_ckpt.export_safetensors(directory, NEW_TREE, max_shard_size=120)
    assert len(names) > 2


def _replace_hf_shard(directory):
    # The shard holding `model.proj` rewritten by safetensors, the index as it was.
    shard = {"model.proj": NEW["model.proj"], "step": NEW_STEP, "a.first": NEW["a.first"]}
    save_file(shard, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})


def _replace_orbax(path, **options):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(NEW_TREE), force=True)


REPLACEMENTS = {
    "eqx_ckpt": (_eqx_ckpt, _replace_eqx_ckpt),
    "safetensors": (_safetensors, _replace_safetensors_file),
    "hf-export": (_hf, _replace_hf_by_export),
    "hf-shard": (_hf, _replace_hf_shard),
    "orbax": (_orbax, _replace_orbax),
    "orbax-folders": (functools.partial(_orbax, **_ORBAX_FOLDERS), functools.partial(_replace_orbax, **_ORBAX_FOLDERS)),
}


@pytest.fixture(params=list(REPLACEMENTS))
def replaced(request, tmp_path):
    """A source, a function that rewrites it with its own writer, and which one it is."""
    make, replace = REPLACEMENTS[request.param]
    path = make(tmp_path / "ckpt")
    return path, lambda: replace(path), request.param


def _said_replaced(path):
    return pytest.raises(
        eqx_ckpt.CheckpointReplacedError, match=f"{re.escape(repr(str(path)))} was replaced .* Open or load it again"
    )


class TestReplacedSources:
    def test_a_lazy_leaf_of_a_replaced_source_raises_never_other_bytes(self, replaced):
        path, replace, kind = replaced
        ckpt = eqx_ckpt.Checkpoint(path)
        read_before, unread = ckpt["model.proj"], ckpt["model.embed_tokens"]
        np.testing.assert_array_equal(np.asarray(read_before), PROJ)
        lazy = eqx_ckpt.tree_deserialise_leaves(path, _like(), prefix="model", rename=RENAME, lazy=True)
        replace()
        for read in (
            lambda: np.asarray(read_before),
            lambda: read_before[1:],
            lambda: np.asarray(unread),
            lambda: unread.read(),
            lambda: eqx_ckpt.materialise(lazy),
            lambda: np.asarray(lazy["proj"]),
        ):
            with _said_replaced(path):
                read()
        # The new source is sound: opened again, it reads the new values (a
        # rewritten shard leaves the other one's tensor as it was).
        fresh = eqx_ckpt.tree_deserialise_leaves(path, _like(), prefix="model", rename=RENAME)
        embed = EMBED if kind == "hf-shard" else NEW["model.embed_tokens"]
        assert tree_equal(fresh, {"embed": embed, "proj": NEW["model.proj"]}, typematch=True)
        np.testing.assert_array_equal(np.asarray(eqx_ckpt.Checkpoint(path)["model.proj"]), NEW["model.proj"])

    def test_a_source_replaced_while_an_eager_load_runs_raises(self, replaced):
        path, replace, _ = replaced
        calls = []

        def progress(*counts):
            # The first report of the load's progress, while it runs.
            if not calls:
                replace()
            calls.append(counts)

        with _said_replaced(path):
            eqx_ckpt.tree_deserialise_leaves(path, _like(), prefix="model", rename=RENAME, progress=progress)
        assert calls

    def test_a_directory_exported_onto_itself_reads_the_old_files_then_reports_them_replaced(self, tmp_path):
        """The export docs/interop.md supports (`export_safetensors(d, Checkpoint(d))`)
        reads every leaf from the old files; afterwards the `Checkpoint` it read
        from, and lazy leaves opened before, are of files that are gone."""
        path = _hf(tmp_path / "ckpt")
        ckpt = eqx_ckpt.Checkpoint(path)
        lazy = eqx_ckpt.tree_deserialise_leaves(path, _like(), prefix="model", rename=RENAME, lazy=True)
        # One shard per tensor now: `model.proj` is at another offset of another file.
        names = eqx_ckpt.export_safetensors(path, ckpt, max_shard_size=36, metadata={"format": "pt"})
        assert names[:3] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        for read in (lambda: np.asarray(ckpt["model.proj"]), lambda: eqx_ckpt.materialise(lazy)):
            with _said_replaced(path):
                read()
        fresh = eqx_ckpt.tree_deserialise_leaves(path, _like(), prefix="model", rename=RENAME)
        assert tree_equal(fresh, {"embed": EMBED, "proj": PROJ}, typematch=True)


def _nested(flat):
    tree = {}
    for name, value in flat.items():
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _save_flat(kind, path, flat):
    """`flat` (tensor name -> array) saved as `kind` saves it; the path to load."""
    if kind == "eqx_ckpt":
        eqx_ckpt.tree_serialise_leaves(path, _nested(flat))
    elif kind == "safetensors":
        path = path.with_suffix(".safetensors")
        save_file(flat, str(path))
    elif kind == "hf":
        eqx_ckpt.export_safetensors(path, _nested(flat), max_shard_size=24)
        assert (path / "model.safetensors.index.json").is_file()
    else:
        ocp = pytest.importorskip("orbax.checkpoint")
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(_nested(flat)))
    return path


class TestTorchLayoutRules:
    """Issue 40, item 4, from every source: `torch_layout`'s rules mean the
    same paths for a stock layer and a leaf outside layers of `(model, state)`."""

    @pytest.mark.parametrize("kind", ["eqx_ckpt", "safetensors", "hf", "orbax"])
    def test_a_bare_parameter_beside_a_batch_norm_is_loaded_by_its_rule(self, tmp_path, kind):
        state_dict = {
            "bn.weight": EMBED[0, :3] + 1,
            "bn.bias": EMBED[1, :3],
            "bn.running_mean": EMBED[2, :3],
            "bn.running_var": EMBED[3, :3] + 1,
            "scale": PROJ[0],
        }
        path = _save_flat(kind, tmp_path / "torch", state_dict)
        make = lambda: eqx.nn.make_with_state(NormAndGain)()
        like = eqx.filter_eval_shape(make)
        rename, transform = eqx_ckpt.torch_layout(like, rename=[(r"^norm$", "bn"), (r"^gain$", "scale")])
        model, state = eqx_ckpt.load_or_initialise(path, make, rename=rename, transform=transform)
        # Once the gain kept its initial value (-1) without a word.
        np.testing.assert_array_equal(np.asarray(model.gain), PROJ[0])
        np.testing.assert_array_equal(np.asarray(model.norm.weight), state_dict["bn.weight"])
        mean, var = state.get(model.norm.ema_state_index)
        np.testing.assert_array_equal(np.asarray(mean), state_dict["bn.running_mean"])
        np.testing.assert_array_equal(np.asarray(var), state_dict["bn.running_var"])
        # The whole tuple's spelling matches no path inside the model: refused, whatever the source.
        with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("('^0\\\\.gain$', 'scale')")):
            eqx_ckpt.torch_layout(like, rename=[(r"^norm$", "bn"), (r"^0\.gain$", "scale")])


@pytest.mark.parametrize("kind", ["safetensors", "hf"])
def test_a_safetensors_file_rewritten_while_it_is_opened_is_replaced_not_damaged(tmp_path, faults, kind):
    """Its header's length read from one version and its header from the next
    once was a healthy file reported damaged (or a header misread)."""
    path = (_safetensors if kind == "safetensors" else _hf)(tmp_path / "ckpt")
    # Another tensor first: the new header is longer than the old one.
    shard = path if kind == "safetensors" else path / "model-00002-of-00002.safetensors"
    rewrite = lambda loc, files: save_file(
        {"a.first": NEW["a.first"], "model.proj": PROJ, "step": NEW_STEP}, str(shard)
    )
    faults("safetensors.read_headers", rewrite)
    with pytest.raises(
        eqx_ckpt.CheckpointReplacedError,
        match=re.escape(
            f"The safetensors file {shard.name!r} of {str(path)!r} was rewritten while it was being opened"
        ),
    ):
        eqx_ckpt.Checkpoint(path)


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
    assert tree_equal(out, expected, typematch=True)
    # A name that matches nothing is still an error naming it, never nothing loaded.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("params%2FDense_1%2Fkernel")):
        eqx_ckpt.tree_deserialise_leaves(path, {"w": like["w"]}, rename={"w": "params/Dense_1/kernel"})


def test_an_export_names_a_tensor_as_the_file_spells_it(tmp_path):
    eqx_ckpt.export_safetensors(tmp_path / "out.safetensors", {"w": KERNEL}, rename={"w": "params/Dense_0/kernel"})
    from safetensors.numpy import load_file

    assert list(load_file(tmp_path / "out.safetensors")) == ["params/Dense_0/kernel"]
