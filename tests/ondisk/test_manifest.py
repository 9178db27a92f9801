"""The manifest: what it records, and that a damaged or hostile one is refused."""

import hashlib
import json
import math
import re

import jax
import jax.numpy as jnp
import manifests
import numpy as np
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _manifest


def _save(path):
    tree = {
        "model": {"layers": [{"weight": jnp.ones((2, 3)), "bias": jnp.zeros(2, jnp.bfloat16)}]},
        "key": jax.random.key(0),
        "np": np.arange(3, dtype=np.int64),
        "lr": 0.1,
        "flag": True,
        "f8": jnp.ones(4, jnp.float8_e4m3),
        "skipped": "text",
    }
    eqx_ckpt.tree_serialise_leaves(path, tree)
    return tree


def _itemsize(name):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, name)).itemsize


def _body(path):
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path, edit):
    """Edit the manifest and re-sign it, as an attacker could."""
    body = _body(path)
    edit(body)
    (path / "manifest.json").write_bytes(manifests.sign(body))


def test_manifest_lists_every_leaf(tmp_path):
    _save(tmp_path)
    body = _body(tmp_path)
    assert body["format"] == "eqx_ckpt"
    assert body["format_version"] == 5
    assert body["library_version"] == eqx_ckpt.__version__
    assert body["digest"].startswith("sha256:")
    leaves = {leaf["path"]: leaf for leaf in body["leaves"]}
    assert sorted(leaves) == ["f8", "flag", "key", "lr", "model.layers.0.bias", "model.layers.0.weight", "np"]
    assert body["leaf_count"] == 7
    weight = leaves["model.layers.0.weight"]
    assert weight["type"] == "jax" and weight["shape"] == [2, 3] and weight["dtype"] == "float32"
    assert weight["keypath"] == [["key", "model"], ["key", "layers"], ["index", 0], ["key", "weight"]]
    assert leaves["model.layers.0.bias"]["dtype"] == "bfloat16"
    assert leaves["np"]["type"] == "numpy" and leaves["np"]["dtype"] == "int64"
    assert leaves["lr"]["type"] == "float" and leaves["lr"]["dtype"] == "float64" and leaves["lr"]["shape"] == []
    assert leaves["flag"]["type"] == "bool"
    assert leaves["key"]["type"] == "prng_key" and leaves["key"]["impl"]
    assert leaves["key"]["stored_shape"] == [2] and leaves["key"]["stored_dtype"] == "uint32"
    assert leaves["f8"]["dtype"] == "float8_e4m3" and leaves["f8"]["encoding"] == "view"
    stored = [
        (leaf.get("stored_shape", leaf["shape"]), leaf.get("stored_dtype", leaf["dtype"])) for leaf in leaves.values()
    ]
    assert body["total_bytes"] == sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in stored) == 73
    # What equals its default is left out: a plain float32 leaf packed as one chunk.
    assert set(weight) == {"path", "keypath", "type", "shape", "dtype", "pack", "offset"}
    assert set(leaves["key"]) - set(weight) == {"stored_shape", "stored_dtype", "encoding", "impl"}
    # Every leaf is small: packed, one array per stored dtype.
    assert weight["pack"] == "packed.float32" and weight["offset"] == 0
    assert [pack["name"] for pack in body["packs"]] == sorted({leaf["pack"] for leaf in body["leaves"]})
    assert next(p for p in body["packs"] if p["name"] == "packed.float32") == {
        "name": "packed.float32",
        "dtype": "float32",
        "shape": [6],
        "chunks": [6],
    }


def test_edited_manifest_is_detected(tmp_path):
    _save(tmp_path)
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text.replace('"float32"', '"float16"', 1))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="digest does not match") as info:
        eqx_ckpt.Checkpoint(tmp_path)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b["leaves"][0].update(path="../../etc"), "does not match its key path"),
        (lambda b: b["leaves"][0].update(keypath=[["key", "../../etc"]], path="../../etc"), "does not match"),
        (lambda b: b["leaves"][0].update(keypath=[["key", "/abs"]], path="/abs"), "does not match"),
        (lambda b: b["leaves"][0].update(shape=[2**40, 2**40], stored_shape=[2**40, 2**40]), "2**53 elements"),
        (lambda b: b["leaves"][0].update(shape=[-1]), "non-negative"),
        (lambda b: b["leaves"][0].update(shape="big"), "must be a list"),
        (lambda b: b["leaves"][0].update(dtype="object"), "unknown dtype"),
        (lambda b: b["leaves"][0].update(stored_dtype="|O"), "unknown stored dtype"),
        (lambda b: b["leaves"][0].update(type="pickle"), "unknown leaf type"),
        (lambda b: b["leaves"][0].update(chunks=[0]), "positive size"),
        (lambda b: b.update(data_root="../elsewhere"), "data root"),
        (lambda b: b.update(leaves={}), "not a list"),
        (lambda b: b["leaves"].append(dict(b["leaves"][0])), "listed twice"),
    ],
)
def test_hostile_manifest_is_refused(tmp_path, edit, message):
    _save(tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(message)):
        eqx_ckpt.Checkpoint(tmp_path)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError):
        eqx_ckpt.tree_deserialise_leaves(tmp_path, {"f8": jnp.zeros(4, jnp.float8_e4m3)}, where=lambda t: t["f8"])


def test_json_from_any_file_is_refused_in_the_same_words(tmp_path):
    """One parser reads the JSON of every file (`_manifest.loads_file`), so the
    same fault reads alike in a manifest and in a safetensors header, and a
    header of millions of tiny containers is refused before it is parsed, as
    a manifest is (issue 61, item 2: each had a parser and wording of its own)."""
    said = "it is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(f"is invalid: {said}.")):
        eqx_ckpt.Checkpoint(tmp_path / "ckpt")
    header = b"{not json"
    (tmp_path / "bad.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(
        eqx_ckpt.CorruptCheckpointError, match=re.escape(f"the header of 'bad.safetensors' is invalid: {said}.")
    ):
        eqx_ckpt.Checkpoint(tmp_path / "bad.safetensors")
    header = b"[" + b"[]," * 1_000_000 + b"[]]"
    (tmp_path / "tiny.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    tiny = "the header of 'tiny.safetensors' is invalid: it holds 1000002 JSON containers (objects and arrays) in"
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(tiny)):
        eqx_ckpt.Checkpoint(tmp_path / "tiny.safetensors")


def test_non_json_and_foreign_manifests(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="not valid JSON"):
        eqx_ckpt.Checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "orbax"}))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="eqx_ckpt"):
        eqx_ckpt.Checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "eqx_ckpt", "format": "eqx_ckpt"}')
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="duplicate"):
        eqx_ckpt.Checkpoint(tmp_path)


def test_manifest_round_trips_through_parse(tmp_path):
    _save(tmp_path)
    data = (tmp_path / "manifest.json").read_bytes()
    parsed = _manifest.parse(data, where="x")
    assert parsed.to_bytes() == data
    assert parsed.by_path()["model.layers.0.weight"].directory == "model/layers/0/weight"


def test_a_leaf_inside_a_leaf_is_refused_whatever_sits_between(tmp_path):
    # `a-x` sorts between `a` and `a.c`: a check of sorted neighbours misses `a.c`.
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": jnp.ones(1), "a-x": jnp.ones(1), "b": {"c": jnp.ones(1)}})

    def nest(body):
        leaf = next(item for item in body["leaves"] if item["path"] == "b.c")
        leaf.update(path="a.c", keypath=[["key", "a"], ["key", "c"]])

    _rewrite(tmp_path, nest)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape("leaf 'a.c' lies inside leaf 'a'")):
        eqx_ckpt.Checkpoint(tmp_path)


def test_version_4_digest_covers_the_files_bytes_and_comes_last(tmp_path):
    tree = _save(tmp_path)
    path = tmp_path / "manifest.json"
    data = path.read_bytes()
    head, tail = data.rsplit(b',\n"digest": "', 1)
    assert tail == b"sha256:" + hashlib.sha256(head).hexdigest().encode() + b'"}\n'
    # Whitespace after the closing brace changes nothing.
    path.write_bytes(data + b"\n  \n")
    assert eqx_ckpt.verify(tmp_path) == []
    # The same content with its digest moved (valid JSON, digest of the content
    # as versions 1-3 computed it) is refused: version 4 hashes the bytes.
    body = _body(tmp_path)
    body["digest"] = _manifest._digest(body)
    path.write_text(json.dumps(dict(reversed(list(body.items())))))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="does not end with its digest"):
        eqx_ckpt.Checkpoint(tmp_path)
    # One byte changed anywhere before the digest is refused.
    path.write_bytes(data.replace(b'"created": "', b'"created": "1', 1))
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="digest does not match"):
        eqx_ckpt.Checkpoint(tmp_path)
    del tree


@pytest.mark.parametrize("version", [1, 2, 3])
def test_manifests_of_earlier_versions_still_load(tmp_path, version, unpacked):
    tree = _save(tmp_path)
    body = _body(tmp_path)
    del body["packs"]
    if version == 1:
        body.pop("commit"), body.pop("metrics")
    (tmp_path / "manifest.json").write_bytes(manifests.as_version(body, version))
    ckpt = eqx_ckpt.Checkpoint(tmp_path)
    assert ckpt.format_version == version and eqx_ckpt.verify(tmp_path) == []
    like = {k: v for k, v in tree.items() if k != "skipped"}
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, like)
    assert tree_equal(out["model"], like["model"], typematch=True) and out["lr"] == 0.1
    # Their group metadata is what saves wrote then too, and is checked.
    (tmp_path / "model" / "zarr.json").unlink()
    [problem] = eqx_ckpt.verify(tmp_path)
    assert problem.message.startswith("The zarr group metadata 'model/zarr.json' is missing")


@pytest.mark.parametrize("value", [True, 1.0, [1], {"1": 1}, None], ids=repr)
def test_a_key_equal_to_one_already_checked_is_still_checked(tmp_path, value):
    """Parsing remembers the keys it has checked; a later key whose value equals
    a remembered one (`true == 1`) but has another type is refused all the same."""
    tree = {"a": [np.zeros(2, np.float32), np.ones(2, np.float32)], "b": [np.zeros(3, np.float32)] * 2}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)

    def edit(body):
        (leaf,) = [leaf for leaf in body["leaves"] if leaf["path"] == "b.1"]
        leaf["keypath"] = [["key", "b"], ["index", value]]

    _rewrite(tmp_path, edit)
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"leaf #3 \('b\.1'\): key .* needs an integer"):
        eqx_ckpt.Checkpoint(tmp_path)


@pytest.mark.parametrize(
    "key", ["poids_été", "权重", 2**70, -(2**64), "\ud800x"], ids=["latin", "cjk", "int_2_70", "int_-2_64", "surrogate"]
)
def test_a_key_orjson_cannot_encode_or_writes_as_utf8_round_trips(tmp_path, key):
    """Leaf records are encoded by orjson, in UTF-8; the keys it refuses (integers
    beyond 64 bits, strings that are not valid Unicode) fall back to the standard
    encoder. Either way the manifest parses back to the same bytes and the leaf loads."""
    tree = {"a": {key: np.arange(3, dtype=np.float32)}, "other": {"b": np.ones(2, np.int32)}}
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    data = (tmp_path / "manifest.json").read_bytes()
    assert _manifest.parse(data, where="x").to_bytes() == data
    if isinstance(key, str) and not key.startswith("\ud800"):
        assert key.encode() in data  # written in UTF-8, not escaped
    else:
        assert json.dumps(key).encode() in data  # the standard encoder's spelling
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(out, tree, typematch=True)
    assert eqx_ckpt.verify(tmp_path) == []


@pytest.mark.parametrize("count", [0, 1, _manifest._BATCH, _manifest._BATCH + 1, 2 * _manifest._BATCH + 3])
def test_records_encoded_in_batches_make_one_line_per_leaf(tmp_path, count):
    """Leaf records are encoded a batch at a time (the memory of one batch is
    reused for the next): across batch edges the manifest still has one line
    per leaf, in order, and the digest covers every byte. A key orjson refuses
    in the last batch makes only that batch fall back to the standard encoder."""
    tree = {f"leaf{i:04d}": np.full(2, i, np.int32) for i in range(count)}
    bad = 2**70
    if count > _manifest._BATCH:
        tree["zz"] = {bad: np.ones(1, np.float32)}  # sorts last: in the last batch
        tree["a_été"] = np.zeros(1, np.int8)  # sorts first: in the first batch
    eqx_ckpt.tree_serialise_leaves(tmp_path, tree)
    data = (tmp_path / "manifest.json").read_bytes()
    lines = [line.removeprefix(b'"leaves": [') for line in data.split(b"\n")]
    leaf_lines = [line for line in lines if line.startswith(b'{"path":')]
    body = json.loads(data)
    assert len(body["leaves"]) == len(leaf_lines) == len(jax.tree.leaves(tree))
    assert [json.loads(line.rstrip(b",").removesuffix(b"]"))["path"] for line in leaf_lines] == [
        leaf["path"] for leaf in body["leaves"]
    ]
    assert _manifest.parse(data, where="x").to_bytes() == data
    assert body["digest"] == "sha256:" + hashlib.sha256(data[: data.rindex(b',\n"digest"')]).hexdigest()
    if count > _manifest._BATCH:
        assert json.dumps(str(bad)).encode()[1:-1] in data  # the standard encoder's spelling of the big key
        assert "a_été".encode() in data  # the first batch, by orjson, is UTF-8 still
    out = eqx_ckpt.tree_deserialise_leaves(tmp_path, tree)
    assert tree_equal(out, tree, typematch=True)


def test_a_newer_manifest_is_not_called_damaged(tmp_path):
    """A manifest of a newer format is a `CheckpointVersionError`, never a
    `CorruptCheckpointError` (issue 59, item 10: a clean-up script that deletes
    damaged checkpoints must not delete a sound one written by a newer eqx_ckpt)."""
    _save(tmp_path)
    _rewrite(tmp_path, lambda b: b.update(format_version=99))
    with pytest.raises(eqx_ckpt.CheckpointVersionError, match="Upgrade eqx_ckpt as you installed it") as info:
        eqx_ckpt.Checkpoint(tmp_path)
    assert not isinstance(info.value, eqx_ckpt.CorruptCheckpointError)


def test_the_structure_texts_are_those_of_the_json_encoders():
    """A save encodes its structure record part by part, each shared part once
    (`_manifest.structure_texts`): the text is `orjson`'s of the whole record,
    and the string the manifest holds is `orjson`'s of that text, byte for byte,
    as the whole-record encoding gave them (an integer beyond 64 bits: the
    standard encoder's)."""
    import orjson

    from eqx_ckpt._ondisk import _manifest

    leaf = {"t": "leaf"}
    block = {"t": "object", "cls": "m:B", "f": ["a", 'b\u00e9"\\\n\x01'], "c": [leaf, {"t": "value", "v": 1.0}]}
    records = [
        {"t": "dict", "k": ["x", "y\u2028"], "c": [{"t": "list", "c": [block, block, leaf]}, {"c": [block]}]},
        leaf,
        {"t": "list", "c": []},
        {"c": []},
        {"t": "node", "c": [leaf], "aux": None},
        {"t": "list", "c": [block, {"t": "value", "v": 2**70}]},
    ]
    for record in records:
        text, string = _manifest.structure_texts(record)
        try:
            whole = orjson.dumps(record).decode()
        except orjson.JSONEncodeError:
            whole = json.dumps(record, allow_nan=False, separators=(",", ":"))
        assert text == whole == _manifest.encode_structure(record)
        assert string == orjson.dumps(whole)
        assert json.loads(json.loads(string)) == record


def _newer_layouts(body):
    """A manifest of version 99 written in ways this version's are not: no
    trailing digest and its fields in another order; its digest after the
    JSON, outside it; its version last, behind the leaves."""
    body = dict(body, format_version=99)
    digest = body.pop("digest")
    reordered = json.dumps({key: body[key] for key in reversed(list(body))}, indent=2).encode()
    trailer = json.dumps(body).encode() + b"\n" + digest.encode() + b"\n"
    last = dict(body)
    last["format_version"] = last.pop("format_version")
    return {"reordered": reordered, "trailer": trailer, "version_last": json.dumps(last).encode() + b"\x00"}


@pytest.mark.parametrize("layout", ["reordered", "trailer", "version_last"])
def test_a_newer_manifest_in_another_layout_is_refused_by_its_version(tmp_path, capsys, layout):
    """Issue 88, point 8: a manifest of a newer format that did not end as this
    version's do was called damaged ("it does not end with its digest"). Its
    version is read first, and only its version: every reader says
    `CheckpointVersionError`, and `verify` exits 2, not 1."""
    from eqx_ckpt._tools._cli import main

    tree = _save(tmp_path)
    (tmp_path / "manifest.json").write_bytes(_newer_layouts(_body(tmp_path))[layout])
    for read in (
        lambda: eqx_ckpt.Checkpoint(tmp_path),
        lambda: eqx_ckpt.tree_deserialise_leaves(tmp_path, tree),
        lambda: eqx_ckpt.tree_deserialise_leaves(tmp_path),
    ):
        with pytest.raises(eqx_ckpt.CheckpointVersionError, match="format version 99") as info:
            read()
        assert not isinstance(info.value, eqx_ckpt.CorruptCheckpointError)
    capsys.readouterr()
    for command, code in (("ls", 2), ("info", 2), ("verify", 2)):
        assert main([command, str(tmp_path)]) == code, command
        out, err = capsys.readouterr()
        assert "format version 99" in out + err and "damaged" not in err, (command, out, err)


def test_only_the_top_level_version_is_read_before_the_digest():
    """The version read first is the top-level `format_version` only: one in
    a nested object or a string does not count, and the rest of an edited
    file is still judged (a current version with a broken digest is damage)."""
    assert _manifest.declared_version(b'{"format": "eqx_ckpt", "format_version": 5, "x": 1}') == 5
    nested = b'{"m": {"format_version": 99}, "s": "\\"format_version\\": 98", "format_version": 4}'
    assert _manifest.declared_version(nested) == 4
    assert _manifest.declared_version(b'{"m": {"format_version": 99}}') is None
    with pytest.raises(eqx_ckpt.CorruptCheckpointError, match="does not end with its digest"):
        _manifest.parse(b'{"format": "eqx_ckpt", "format_version": 5, "m": {"format_version": 99}}', where="x")
