"""The published layout: `export_safetensors` into a folder writes safetensors,
`eqx_ckpt.json` and a model card, and the folder loads everywhere a checkpoint
path is accepted, each leaf as it was, with no code from the folder."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import blake3
import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import places
import prefork
import pytest
import safetensors
from arrays import tree_equal
from safetensors import safe_open

import eqx_ckpt
from eqx_ckpt._ondisk._format import BLOCK_BYTES
from eqx_ckpt._ondisk._published import VERSION
from eqx_ckpt._tools._cli import main

SHARDS = {"single": "5GB", "sharded": 400}


def _tree():
    """Leaves of every kind the layout stores, and some it keeps as data only."""
    return {
        "model": eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, key=jax.random.key(0)),
        "embed": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
        "key": jax.random.key(7),
        "keys": jax.random.split(jax.random.key(3, impl="rbg"), 2),
        "i4": np.arange(-4, 4).astype(ml_dtypes.int4),
        "u2": np.arange(4).astype(ml_dtypes.uint2),
        "f8": np.linspace(-2, 2, 5).astype(ml_dtypes.float8_e4m3fnuz),
        "f8b": np.linspace(-2, 2, 5).astype(ml_dtypes.float8_e5m2),
        "c64": np.array([1 + 2j, -3j], np.complex64),
        "mask": np.array([True, False]),
        "scalar": np.float32(2.5),
        "step": 7,
        "lr": 0.25,
        "flag": True,
        "name": "not an array",
    }


@pytest.fixture(params=sorted(SHARDS))
def folder(request, tmp_path):
    out = tmp_path / "mlp"
    eqx_ckpt.export_safetensors(out, _tree(), max_shard_size=SHARDS[request.param], info={"description": "test"})
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 1) == (request.param == "sharded")
    return out


def _equal(a, b):
    return bool(tree_equal(a, b, typematch=True))


@pytest.mark.filterwarnings("ignore:.*without `trust` returns nested dicts:UserWarning")
def test_a_folder_loads_without_its_code_everywhere_a_checkpoint_does(folder):
    tree = _tree()
    ckpt = eqx_ckpt.Checkpoint(folder)
    assert ckpt.format == "safetensors" and ckpt.layout == "published"
    assert ckpt.info == {"description": "test"}
    assert ckpt.library_version == eqx_ckpt.__version__
    assert _equal(ckpt.load(trust=[]), tree)
    skeleton = ckpt.skeleton(trust=[])
    assert jax.tree.structure(skeleton) == jax.tree.structure(tree)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(folder, tree), tree)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(folder, skeleton), tree)
    assert _equal(eqx_ckpt.tree_deserialise_leaves(folder, None, trust=[]), tree)  # no `like`: rebuilt
    # Without `trust`: nested dicts and lists, each leaf as it was saved.
    nested = ckpt.load()
    assert isinstance(nested["model"]["layers"], list) and nested["step"] == 7
    np.testing.assert_array_equal(nested["i4"], tree["i4"])
    assert nested["i4"].dtype == ml_dtypes.int4 and nested["embed"].dtype == jnp.bfloat16


def test_partial_lazy_and_renamed_loads_of_a_folder(folder):
    tree = _tree()
    ckpt = eqx_ckpt.Checkpoint(folder)
    assert _equal(ckpt.load("model", trust=[]), tree["model"])
    layer = eqx_ckpt.tree_deserialise_leaves(folder, tree["model"].layers[1], prefix="model.layers.1")
    assert _equal(layer, tree["model"].layers[1])
    zeros = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else x, tree["model"])
    part = eqx_ckpt.tree_deserialise_leaves(folder, zeros, prefix="model", where=lambda m: m.layers[0])
    assert _equal(part.layers[0], tree["model"].layers[0]) and not np.any(part.layers[1].weight)
    lazy = eqx_ckpt.tree_deserialise_leaves(folder, tree, lazy=True)
    assert isinstance(lazy["key"], eqx_ckpt.LazyArray) and _equal(lazy["key"].read(), tree["key"])
    assert _equal(lazy["i4"].read(), tree["i4"]) and _equal(
        lazy["model"].layers[2].bias.read(), tree["model"].layers[2].bias
    )
    renamed = eqx_ckpt.tree_deserialise_leaves(
        folder, {"mlp": tree["model"]}, rename=[(r"^mlp\.", "model.")], missing="error"
    )
    assert _equal(renamed["mlp"], tree["model"])
    grown = eqx_ckpt.load_or_initialise(
        folder, lambda: {**tree, "head": jnp.ones(3)}, where=lambda t: {k: v for k, v in t.items() if k != "head"}
    )
    # (Loaded into `eqx.filter_eval_shape`'s skeleton: every array a JAX array.)
    assert _equal((grown["model"], grown["key"], grown["step"]), (tree["model"], tree["key"], 7))
    assert grown["i4"].dtype == ml_dtypes.int4 and np.array_equal(grown["i4"], tree["i4"])
    assert grown["head"].tolist() == [1.0] * 3


def test_the_safetensors_library_reads_every_tensor_bit_for_bit(folder):
    """Each tensor, as the `safetensors` library parses it (`deserialize`: its
    dtype name, shape and bytes), is the leaf's bytes: its dtype where
    safetensors names it, else as unsigned integers of its width, a key as its
    key data. Its NumPy front end reads the same values (except the F8 dtypes, which
    it does not read in safetensors 0.8: it asks for `np.float8_*`, which NumPy lacks)."""
    tree = _tree()
    found, read = {}, {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update({name: info for name, info in safetensors.deserialize(shard.read_bytes())})
        with safe_open(str(shard), framework="np") as f:
            read.update({n: np.asarray(f.get_tensor(n)) for n in f.keys() if not found[n]["dtype"].startswith("F8")})
    expected = {
        "embed": np.asarray(tree["embed"]),
        "key": np.asarray(jax.random.key_data(tree["key"])),
        "keys": np.asarray(jax.random.key_data(tree["keys"])),
        "i4": tree["i4"].view(np.uint8),
        "u2": tree["u2"].view(np.uint8),
        "f8": tree["f8"].view(np.uint8),
        "f8b": tree["f8b"],
        "c64": tree["c64"],
        "mask": tree["mask"],
        "scalar": np.asarray(tree["scalar"]),
        "step": np.asarray(7, np.int64),
        "lr": np.asarray(0.25, np.float64),
        "flag": np.asarray(True),
        "model.layers.0.weight": np.asarray(tree["model"].layers[0].weight),
    }
    for name, value in expected.items():
        assert found[name]["shape"] == list(value.shape), name
        assert bytes(found[name]["data"]) == value.tobytes(), name
        if name in read:
            assert read[name].dtype == value.dtype and read[name].tobytes() == value.tobytes(), name
    assert {found[n]["dtype"] for n in ("i4", "u2", "f8")} == {"U8"} and found["embed"]["dtype"] == "BF16"
    assert (found["key"]["dtype"], found["f8b"]["dtype"], found["c64"]["dtype"]) == ("U32", "F8_E5M2", "C64")
    assert "name" not in found and len(found) == 6 + len(expected) - 1  # three layers' weights and biases


def test_eqx_ckpt_json_holds_the_records_structure_and_info(folder):
    record = json.loads((folder / "eqx_ckpt.json").read_text())
    assert set(record) == {  # no `created`: a tree has no time of its own (issue 65 item 7)
        "format",
        "format_version",
        "block_bytes",
        "library_version",
        "leaf_count",
        "total_bytes",
        "info",
        "structure",
        "leaves",
    }
    said = (record["format"], record["format_version"], record["block_bytes"])
    assert said == ("eqx_ckpt.safetensors", VERSION, BLOCK_BYTES)
    assert record["info"] == {"description": "test"} and record["structure"]["t"] == "dict"
    leaves = {leaf["path"]: leaf for leaf in record["leaves"]}
    # Each leaf records the BLAKE3 of each MiB of its tensor's bytes, and its
    # digest is the BLAKE3 of those (issue 84: a slice checks its blocks; version 4 said SHA-256).
    stored = {}
    for file in folder.glob("*.safetensors"):
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        for name, entry in json.loads(data[8 : 8 + size]).items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                stored[name] = data[8 + size + start : 8 + size + end]
    assert sorted(stored) == sorted(leaves)
    for name, leaf in leaves.items():
        data = stored[name]
        blocks = b"".join(blake3.blake3(data[i : i + BLOCK_BYTES]).digest() for i in range(0, len(data), BLOCK_BYTES))
        assert leaf.pop("blocks") == blocks.hex(), name
        assert leaf.pop("digest") == "blake3:" + blake3.blake3(blocks).hexdigest(), name
    assert leaves["i4"] == {
        "path": "i4",
        "keypath": [["key", "i4"]],
        "type": "numpy",
        "shape": [8],
        "dtype": "int4",
        "stored_dtype": "uint8",
        "encoding": "view",
    }
    assert leaves["key"]["encoding"] == "key_data" and leaves["key"]["stored_shape"] == [2]
    assert leaves["model.layers.0.weight"]["keypath"] == [
        ["key", "model"],
        ["attr", "layers"],
        ["index", 0],
        ["attr", "weight"],
    ]
    assert leaves["step"]["type"] == "int" and record["leaf_count"] == len(leaves)
    assert record["total_bytes"] == sum(p.stat().st_size for p in folder.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("*.safetensors")
    )


def test_the_cards_snippet_works_as_written(folder, tmp_path):
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: eqx_ckpt\ntags:\n- jax\n- equinox\n---\n")
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert f'eqx_ckpt.Checkpoint("{folder.name}").load(trust=[])' in snippet  # by its name (issue 88.9)
    check = snippet + textwrap.dedent(
        """
        import equinox as eqx
        print(type(model["model"]).__name__, model["step"], eqx.tree_equal(model["model"].layers[0].weight,
              model["model"].layers[0].weight))
        """
    )
    run = prefork.run(["-c", check], cwd=folder.parent, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["MLP", "7", "True"]


def test_the_card_imports_the_classes_it_trusts(tmp_path):
    """A class of an importable module is imported and trusted by the snippet:
    run as written in a fresh process, it rebuilds the tree."""
    from eqx_ckpt._tools._card import model_card

    (tmp_path / "pkg_for_card.py").write_text(
        "import equinox as eqx, jax\n"
        "class Head(eqx.Module):\n    w: jax.Array\n    scale: float = eqx.field(static=True)\n"
    )
    code = textwrap.dedent(
        """
        import sys, jax.numpy as jnp, eqx_ckpt, pkg_for_card
        eqx_ckpt.export_safetensors("out", pkg_for_card.Head(jnp.ones(2), 0.5), code="pkg-for-card")
        print(open("out/README.md").read())
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr
    snippet = re.search(r"```python\n(.*?)```", run.stdout, re.S).group(1)
    assert "import pkg_for_card" in snippet and "trust=[pkg_for_card.Head]" in snippet
    assert "# The model's code: pip install pkg-for-card\n" in snippet
    assert "The model's code (its classes, for `trust`): `pip install pkg-for-card`.\n" in run.stdout
    assert "**Parameters:** 2, in floating-point arrays. 1 tensor, 8 B.\n" in run.stdout
    check = snippet + "print(type(model).__name__, model.scale, model.w.tolist())\n"
    run = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path)
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["Head", "0.5", "[1.0,", "1.0]"]
    # The name is the one parameter (the Hub's `hf://owner/name`, say).
    assert 'Checkpoint("hf://me/mlp").load(trust=[])' in model_card(
        "hf://me/mlp", structure={"t": "leaf"}, info={}, files=[]
    )


def _env(*paths):
    """The environment of a new process that runs a card's snippet. (The
    snippets of `_env()` run in a process forked from one that imported JAX,
    `prefork`, as `python -c` would: each imports eqx_ckpt itself.)"""
    root = str(places.ROOT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, *map(str, paths)]), "JAX_PLATFORMS": "cpu"}


def test_cli_lists_verifies_and_diffs_a_folder(folder, tmp_path, capsys):
    assert main(["ls", str(folder)]) == 0
    listing = capsys.readouterr().out
    assert "int4[8]" in listing and "key<fry>[]" in listing
    assert main(["info", str(folder)]) == 0
    info = capsys.readouterr().out
    assert "layout:          published" in info and f"library version: {eqx_ckpt.__version__}" in info
    assert 'info:            description="test"' in info
    assert main(["verify", str(folder)]) == 0
    assert "sound" in capsys.readouterr().out
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    assert main(["diff", str(folder), str(tmp_path / "ckpt")]) == 0
    assert "are equal" in capsys.readouterr().out
    changed = {**_tree(), "step": 8}
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", changed)
    assert main(["diff", str(folder), str(tmp_path / "ckpt")]) == 1


def _rewrite(folder, change):
    path = folder / "eqx_ckpt.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _leaf(record, path):
    return next(leaf for leaf in record["leaves"] if leaf["path"] == path)


def _nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = {
    "a dtype other than the tensor's": (
        lambda r: _leaf(r, "embed").update(dtype="float16"),
        "records the leaf 'embed' as stored float16[3, 4], but its tensor is bfloat16[3, 4]",
    ),
    "a leaf no file holds": (
        lambda r: (
            r["leaves"].append({**_leaf(r, "step"), "path": "ghost", "keypath": [["key", "ghost"]]}),
            r.update(leaf_count=20, total_bytes=r["total_bytes"] + 8),
        ),
        "eqx_ckpt.json records the leaf 'ghost', which no safetensors file holds",
    ),
    "a tensor it does not record": (
        lambda r: (r["leaves"].remove(_leaf(r, "step")), r.update(leaf_count=18, total_bytes=r["total_bytes"] - 8)),
        "eqx_ckpt.json does not record the tensor 'step' (1 in all)",
    ),
    "a miscounted leaf": (lambda r: r.update(leaf_count=18), "`leaf_count` 18 is not the 19 leaves it lists"),
    "a path that is not its key path": (
        lambda r: _leaf(r, "step").update(keypath=[["key", "other"]]),
        "`path` 'step' does not match its key path",
    ),
    "wrong totals": (lambda r: r.update(total_bytes=1), "`total_bytes` 1 is not the bytes of the leaves"),
    "another format": (lambda r: r.update(format="pickle"), 'it does not say `"format": "eqx_ckpt.safetensors"`'),
    "info that is not an object": (lambda r: r.update(info=[1]), "`info` is not a JSON object"),
    "info nested too deep": (lambda r: r.update(info={"a": _nested(40)}), "[0]` nests more than 32 levels deep"),
    "a structure that is not an object": (lambda r: r.update(structure="os:system"), "`structure` is neither"),
    "a key data shape that does not fit": (
        lambda r: _leaf(r, "key").update(stored_shape=[3]),
        "the key data of 'threefry2x32' keys of shape [] is uint32 of shape [2]",
    ),
    # The version says the hash: a digest of another is refused, never checked with the hash it names.
    "a SHA-256 digest in version 5": (
        lambda r: _leaf(r, "step").update(digest="sha256:" + _leaf(r, "step")["digest"].removeprefix("blake3:")),
        "the leaf 'step' has the digest 'sha256:",
    ),
    "version 4 with BLAKE3 digests": (
        lambda r: r.update(format_version=4),
        "not sha256:<64 hex digits>",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_eqx_ckpt_json_is_refused_naming_what_is_wrong(folder, case):
    change, message = HOSTILE[case]
    _rewrite(folder, change)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(message)):
        eqx_ckpt.Checkpoint(folder)
    problems = eqx_ckpt.verify(folder)
    assert len(problems) == 1 and message in str(problems[0])


def test_a_newer_eqx_ckpt_json_says_to_upgrade_and_is_not_damage(folder):
    """An `eqx_ckpt.json` of a newer version is a `CheckpointVersionError`, as a
    newer manifest is (issue 59, item 10): not damage, so no clean-up deletes it."""
    _rewrite(folder, lambda r: r.update(format_version=99))
    for call in (eqx_ckpt.Checkpoint, eqx_ckpt.verify):
        with pytest.raises(eqx_ckpt.CheckpointVersionError, match="says format version 99") as raised:
            call(folder)
        assert not isinstance(raised.value, eqx_ckpt.CorruptCheckpointError)
        assert "Upgrade eqx_ckpt as you installed it" in str(raised.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"{not json", "is invalid: it is not valid JSON ("),
        (b'{"format": "eqx_ckpt.safetensors", "format": "x"}', "duplicate JSON key 'format'"),
        (b'{"format": "eqx_ckpt.safetensors", "info": {"x": NaN}}', "NaN is not allowed"),
        # Far more containers than bytes allow (one in 3 bytes; the bound is one in
        # `MANIFEST_BYTES_PER_CONTAINER` = 6, plus 1000): 5 001 of them, 15 kB, are refused
        # by the same count as millions (15 MB of them took seconds to scan, for nothing more).
        (b"[" + b"{}," * 5_001 + b"{}]", "JSON containers (objects and arrays) in 15007 bytes, more than one"),
        (b"[" + b"[]," * 5_001 + b"[]]", "JSON containers (objects and arrays) in 15007 bytes, more than one"),
    ],
)
def test_eqx_ckpt_json_is_parsed_as_untrusted_input(folder, data, message):
    (folder / "eqx_ckpt.json").write_bytes(data)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(message)):
        eqx_ckpt.Checkpoint(folder)


def test_a_structure_naming_an_untrusted_class_builds_nothing(folder):
    def swap(record):
        record["structure"]["c"][record["structure"]["k"].index(["key", "model"])]["cls"] = "os:system"

    _rewrite(folder, swap)
    with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape("os:system")):
        eqx_ckpt.Checkpoint(folder).load(trust=[])
    # The arrays still load by name, into a `like`.
    assert _equal(eqx_ckpt.tree_deserialise_leaves(folder, _tree()), _tree())


HOSTILE_FOLDER = textwrap.dedent(
    """
    import json, pickle, sys
    import eqx_ckpt, equinox as eqx
    folder = sys.argv[1]
    seen = []
    sys.addaudithook(lambda event, args: seen.append((event, repr(args)[:300])))
    before = set(sys.modules)
    tree = eqx_ckpt.Checkpoint(folder).load(trust=[])
    eqx_ckpt.verify(folder)
    eqx_ckpt.Checkpoint(folder).skeleton(trust=[])
    new = sorted(set(sys.modules) - before)
    opened = [args for event, args in seen if event == "open"]
    imports = [args for event, args in seen if event == "import"]
    watched = ("exec", "pickle.find_class", "subprocess.Popen", "os.system")
    execs = [(event, args) for event, args in seen if event in watched]
    print(json.dumps({"new": new, "opened": opened, "imports": imports, "execs": execs, "step": tree["step"]}))
    """
)


def test_a_folder_with_code_pickles_and_remote_code_config_runs_none_of_it(folder, tmp_path):
    (folder / "evil_module.py").write_text("open('pwned', 'w').write('x')\n")
    (folder / "modeling_evil.py").write_text("open('pwned', 'w').write('x')\n")
    payload = b"cos\nsystem\n(S'touch pwned'\ntR."  # a pickle that runs a shell command when unpickled
    for name in ("pytorch_model.bin", "model.pkl", "optimizer.pt"):
        (folder / name).write_bytes(payload)
    (folder / "config.json").write_text(
        json.dumps({"auto_map": {"AutoModel": "modeling_evil.EvilModel"}, "trust_remote_code": True})
    )
    run = subprocess.run(
        [sys.executable, "-c", HOSTILE_FOLDER, str(folder)], capture_output=True, text=True, cwd=tmp_path, env=_env()
    )
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["step"] == 7 and not (tmp_path / "pwned").exists()
    assert not [m for m in found["new"] if "evil" in m or m in ("pickle", "torch")]
    assert not [i for i in found["imports"] if "evil" in i]
    suspicious = ("evil_module.py", "modeling_evil.py", "pytorch_model.bin", "model.pkl", "optimizer.pt", "config.json")
    assert not [o for o in found["opened"] if any(name in o for name in suspicious)]
    # Python runs code objects of its own (dataclasses, namedtuples); none of the folder's, and no pickle or shell.
    assert not [e for e in found["execs"] if e[0] != "exec" or "evil" in e[1] or str(folder) in e[1]]


def test_one_safetensors_file_by_its_path_is_written_alone(tmp_path):
    tree = _tree()
    del tree["i4"], tree["u2"], tree["f8"], tree["key"], tree["keys"]  # as a plain safetensors file stores them
    assert eqx_ckpt.export_safetensors(tmp_path / "one.safetensors", tree) == ["one.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors"]
    with pytest.raises(eqx_ckpt.CheckpointValueError, match="names its tensors but records no classes"):
        eqx_ckpt.Checkpoint(tmp_path / "one.safetensors").load(trust=[])


def test_rename_records_no_structure_and_loads_by_the_new_names(tmp_path):
    tree = _tree()
    eqx_ckpt.export_safetensors(tmp_path / "out", tree, rename=[(r"^model\.", "body.")])
    record = json.loads((tmp_path / "out" / "eqx_ckpt.json").read_text())
    assert record["structure"] is None and _leaf(record, "body.layers.0.weight")["keypath"][0] == ["key", "body"]
    assert "state = eqx_ckpt.Checkpoint(" in (tmp_path / "out" / "README.md").read_text()
    back = eqx_ckpt.tree_deserialise_leaves(tmp_path / "out", tree, rename=[(r"^model\.", "body.")])
    assert _equal(back, tree)
    assert eqx_ckpt.Checkpoint(tmp_path / "out")["i4"].dtype == ml_dtypes.int4
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("exported with leaves renamed or left out")):
        eqx_ckpt.Checkpoint(tmp_path / "out").load(trust=[])


def test_info_is_checked_before_anything_is_written(tmp_path):
    for info, error, message in [
        ([1], eqx_ckpt.CheckpointTypeError, "`info` must be a dict of JSON values"),
        ({"a": object()}, eqx_ckpt.CheckpointTypeError, "`info['a']` is a object"),
        ({"a": float("nan")}, eqx_ckpt.CheckpointTypeError, "`info['a']` is nan, which JSON cannot hold"),
        ({1: 2}, eqx_ckpt.CheckpointTypeError, "`info` has a key that is not a string"),
        ({"a": "x" * (1 << 20)}, eqx_ckpt.CheckpointValueError, "more than the 1048576 allowed"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            eqx_ckpt.export_safetensors(tmp_path / "out", {"w": jnp.ones(2)}, info=info)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_exported_keeps_its_structure_and_a_folder_re_exports(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    eqx_ckpt.export_safetensors(tmp_path / "a", eqx_ckpt.Checkpoint(tmp_path / "ckpt"), max_shard_size=300)
    eqx_ckpt.export_safetensors(tmp_path / "b", eqx_ckpt.Checkpoint(tmp_path / "a"))
    for out in ("a", "b"):
        assert _equal(eqx_ckpt.Checkpoint(tmp_path / out).load(trust=[]), _tree())


def test_cli_export_writes_the_published_layout_with_info(tmp_path, capsys):
    eqx_ckpt.tree_serialise_leaves(tmp_path / "ckpt", _tree())
    out = tmp_path / "out"
    assert (
        main(["export", str(tmp_path / "ckpt"), str(out), "--info", '{"description": "cli", "metrics": {"a": 1}}']) == 0
    )
    assert capsys.readouterr().out.split() == ["model.safetensors", "eqx_ckpt.json", "README.md"]
    assert eqx_ckpt.Checkpoint(out).info == {"description": "cli", "metrics": {"a": 1}}
    assert _equal(eqx_ckpt.Checkpoint(out).load(trust=[]), _tree())
    (out / "README.md").write_text("my own card")
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--no-card"]) == 0
    assert (out / "README.md").read_text() == "my own card" and eqx_ckpt.Checkpoint(out).info == {}
    for bad, message in [("{x", "`--info` must be a JSON object"), ("[1]", "`info` must be a dict of JSON values")]:
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "other"), "--info", bad]) == 2
        assert message in capsys.readouterr().err


def test_a_published_folder_over_http_reads_only_the_selected_tensors(tmp_path):
    """Rebuilt with no `like` over plain HTTP, and, in part, only the selected
    tensors' bytes, the headers, `eqx_ckpt.json` and one byte a file are read."""
    from http_server import RangeServer, serving_ranges

    tree = {"big": np.ones((1024, 512), np.float32), "small": {"w": np.arange(4.0, dtype=np.float32), "n": 3}}
    eqx_ckpt.export_safetensors(tmp_path / "out", tree, max_shard_size="1MB", info={"description": "over HTTP"})
    files = {f"out/{p.name}": p.read_bytes() for p in (tmp_path / "out").iterdir()}
    shards = [data for name, data in files.items() if name.endswith(".safetensors")]
    headers = sum(8 + int.from_bytes(data[:8], "little") + 1 for data in shards)
    record = len(files["out/eqx_ckpt.json"]) + len(files["out/model.safetensors.index.json"])
    with serving_ranges(files) as url:
        assert _equal(eqx_ckpt.Checkpoint(f"{url}/out/").load(trust=[]), tree)
        RangeServer.sent = 0
        part = eqx_ckpt.Checkpoint(f"{url}/out/").load("small", trust=[])
        assert _equal(part, tree["small"])
        assert RangeServer.sent <= headers + record + 4 * 4 + 8


def test_the_cards_trust_list_imports_what_it_can_and_names_what_it_cannot():
    """A script's class (`__main__`) and a name that is no module path (from a
    hostile record) are never imported by the snippet: it rebuilds the parts
    that need neither, and the card names the others."""
    from eqx_ckpt._tools._card import model_card

    structure = {
        "t": "object",
        "cls": "__main__:Net",
        "f": ["head", "act", "evil", "w"],
        "c": [
            {"t": "object", "cls": "mypkg.layers:Head.Inner", "f": ["w"], "c": [{"t": "leaf"}]},
            {"t": "value", "v": {"function": "jax._src.nn.functions:relu"}},
            {"t": "object", "cls": "os;import shutil:X", "f": ["w"], "c": [{"t": "leaf"}]},
            {"t": "leaf"},
        ],
    }
    card = model_card("hf://me/net", structure=structure, info={"name": "Net"}, files=["model.safetensors"])
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert snippet == (
        "import eqx_ckpt\nimport mypkg.layers\n\n"
        "# Parts of it need the model's code (see below). These rebuild without it.\n"
        'ckpt = eqx_ckpt.Checkpoint("hf://me/net")\n'
        'parts = {prefix: ckpt.load(prefix, trust=[mypkg.layers.Head.Inner]) for prefix in ["evil.w", "head", "w"]}\n'
    )
    assert "It needs `__main__.Net`, defined in the script that exported it" in card
    assert "- `(the root)`: `__main__.Net`, defined in a script (`__main__`)\n" in card
    assert "- `evil`: `os;import shutil.X`, which no `import` reaches\n" in card
    assert card.startswith("---\nlibrary_name: eqx_ckpt\n") and "\n# Net\n" in card


def _snippet(card: str) -> str:
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def test_the_card_loads_what_rebuilds_where_parts_need_the_models_code(tmp_path):
    """Issue 65 item 4: a tree holding a lambda (here in `eqx.nn.Lambda`) is
    exported with a `NeedsCodeWarning` naming each such part by its dotted
    path; the card's snippet, run as written in a fresh process, rebuilds the
    other parts (it once raised `CheckpointValueError`)."""
    model = eqx.nn.Sequential(
        [
            eqx.nn.Linear(2, 3, key=jax.random.key(0)),
            eqx.nn.Lambda(lambda x: x + 1),
            eqx.nn.Linear(3, 1, key=jax.random.key(1)),
        ]
    )
    with pytest.warns(eqx_ckpt.NeedsCodeWarning) as warned:
        eqx_ckpt.export_safetensors(tmp_path / "out", {"model": model, "act": lambda x: x, "step": 3})
    (message,) = [str(w.message) for w in warned]
    assert "`act`: a lambda, which a checkpoint cannot record as data" in message
    assert "`model.layers.1.fn`: a lambda" in message and warned[0].filename == __file__
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- `model.layers.1.fn`: a lambda, which a checkpoint cannot record as data\n" in card
    assert "model = eqx_ckpt.tree_deserialise_leaves(" in card  # the load into a `like`, with the code
    shown = "import json; print(json.dumps([sorted(parts), parts['model.layers.2'].weight.tolist(), parts['step']]))\n"
    run = prefork.run(["-c", _snippet(card) + shown], cwd=tmp_path, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    names, weight, step = json.loads(run.stdout)
    assert names == ["model.layers.0", "model.layers.2", "step"] and step == 3
    assert weight == np.asarray(model.layers[2].weight).tolist()
    # The warning is an error where asked, before any file is written.
    with warnings.catch_warnings():
        warnings.simplefilter("error", eqx_ckpt.NeedsCodeWarning)
        with pytest.raises(eqx_ckpt.NeedsCodeWarning, match=re.escape("`act`: a lambda")):
            eqx_ckpt.export_safetensors(tmp_path / "other", {"w": jnp.ones(2), "act": lambda x: x})
    assert not any((tmp_path / "other").iterdir())


def test_a_script_class_is_warned_of_and_its_card_loads_the_rest(tmp_path):
    """A class a script defines (`__main__`) cannot be imported by another
    program: the export warns (as called, from the script), and the snippet
    loads the parts of Equinox's classes."""
    script = textwrap.dedent(
        """
        import os, warnings, equinox as eqx, jax, eqx_ckpt
        class Net(eqx.Module):
            body: eqx.nn.Linear
            head: eqx.nn.Linear
        net = Net(eqx.nn.Linear(2, 2, key=jax.random.key(0)), eqx.nn.Linear(2, 1, key=jax.random.key(1)))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            eqx_ckpt.export_safetensors("out", net)
        print(warned[0].category.__name__, os.path.basename(warned[0].filename), warned[0].lineno)
        print(warned[0].message)
        """
    )
    (tmp_path / "script.py").write_text(script)
    run = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True, cwd=tmp_path, env=_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "NeedsCodeWarning script.py 9"
    assert "`(the root)`: `__main__.Net`, defined in a script (`__main__`)" in run.stdout
    card = (tmp_path / "out" / "README.md").read_text()
    check = _snippet(card) + "print(sorted(parts), type(parts['head']).__name__)\n"
    run = prefork.run(["-c", check], cwd=tmp_path, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["['body',", "'head']", "Linear"]


def test_the_cards_front_matter_and_options(tmp_path):
    """Issue 65 item 7: `license`, `base_model` and the metrics' names in the
    front matter, as YAML reads them; where the classes come from (`code`);
    the parameter count; bad options refused before anything is written."""
    import yaml

    tree = {"mlp": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "step": 7, "ids": jnp.arange(5)}
    info = {"metrics": {"val_loss": 0.0576, "top-1 | acc": 0.5}, "name": "Small"}
    eqx_ckpt.export_safetensors(
        tmp_path / "out", tree, info=info, license="apache-2.0", base_model="me/base", code="https://example.com/code"
    )
    card = (tmp_path / "out" / "README.md").read_text()
    head = yaml.safe_load(card.split("---\n")[1])
    assert head == {
        "library_name": "eqx_ckpt",
        "license": "apache-2.0",
        "base_model": "me/base",
        "tags": ["jax", "equinox"],
        "metrics": ["val_loss"],  # a name YAML could misread stays in the body only
    }
    count = 3 * 8 + 8 + 8 * 2 + 2  # the MLP's weights and biases, not `step` nor the integer `ids`
    assert f"**Parameters:** {count}, in floating-point arrays. 6 tensors," in card
    assert "The model's code (its classes, for `trust`): <https://example.com/code>.\n" in card
    assert "| val_loss | 0.0576 |\n| top-1 \\| acc | 0.5 |\n" in card
    eqx_ckpt.export_safetensors(tmp_path / "two", tree, license="other", base_model=["a/b", "c"], code="mypkg>=1")
    head = yaml.safe_load((tmp_path / "two" / "README.md").read_text().split("---\n")[1])
    assert head["base_model"] == ["a/b", "c"] and head["license"] == "other"
    for options, message in [
        ({"license": "MIT"}, "`license` must be a Hub license id such as 'apache-2.0'"),
        ({"license": "a\nb: c"}, "`license` must be a Hub license id"),
        ({"base_model": "hf://me/base@v1"}, "not 'hf://me/base@v1'. Drop `hf://` and any `@revision`."),
        (
            {"base_model": ["me/base", 3]},
            "`base_model` must be a Hub repository `owner/name` (or a list of them), not 3.",
        ),
        ({"code": "pip install x"}, "`code` must say where the model's classes come from"),
    ]:
        with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape(message)):
            eqx_ckpt.export_safetensors(tmp_path / "bad", tree, **options)
    assert not (tmp_path / "bad").exists()
