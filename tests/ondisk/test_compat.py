"""Old checkpoints keep loading: every fixture under tests/fixtures/ (one per
format version, each written by the code that introduced that version, with
tests/fixtures/make_fixture.py) loads bit for bit with today's eqx_ckpt, is
listed, verified, read lazily and in part; and a checkpoint of a newer format
than this eqx_ckpt knows is refused, saying to upgrade. A new format's fixture
is picked up by its folder alone."""

import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
from typing import Any

import jax
import numpy as np
import places
import prefork
import pytest
from arrays import bits, tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk._format import FORMAT_VERSION

FIXTURES = places.FIXTURES
FOLDERS = sorted(FIXTURES.glob("format_*"), key=lambda p: int(p.name.removeprefix("format_")))
# The published layout's fixtures (`export_safetensors` into a folder), one per version of its `eqx_ckpt.json`:
# an export (its files in the folder), or from version 2 a model family (`base/`, and `finetune/` exported
# against it); from version 4 (block digests), where both say one version, both.
PUBLISHED = sorted(FIXTURES.glob("published_*"), key=lambda p: int(p.name.removeprefix("published_")))
EXPORTS = [p for p in PUBLISHED if (p / "eqx_ckpt.json").is_file()]
FAMILIES = [p for p in PUBLISHED if (p / "finetune" / "eqx_ckpt.json").is_file()]

_spec = importlib.util.spec_from_file_location("make_fixture", FIXTURES / "make_fixture.py")
assert _spec is not None and _spec.loader is not None
make_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixture)

# Every stored leaf's dotted path, in the order `jax.tree.leaves` gives them:
# the documented spellings (docs/format.md, "Leaf directories: escaping").
KEYS = [
    "big",
    "containers.0.0",
    "containers.1.0",
    "empty.jax",
    "empty.numpy",
    "escaped.a%2Eb",
    "escaped.c%2Fd",
    "escaped.%E6%9D%83%E9%87%8D",
    "int_keys.%i-1",
    "int_keys.%i3",
    "keys.many",
    "keys.one",
    "model.layers.0.weight",
    "model.layers.0.bias",
    "model.layers.1.weight",
    "model.layers.1.bias",
    "scalars.bool",
    "scalars.complex",
    "scalars.float",
    "scalars.int",
    "scalars.large_int",
    "scalars.np_f64",
    "scalars.np_i8",
    "small.bf16",
    "small.bool",
    "small.c64",
    "small.f32",
    "small.f8",
    "small.i8",
    "small.np_f64",
    "small.u32",
    "small.u4",
    "special.bf16",
    "special.f32",
]


def _version(folder: pathlib.Path) -> int:
    return int(folder.name.removeprefix("format_"))


def _digests() -> dict[str, str]:
    return {
        str(p.relative_to(FIXTURES)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(FIXTURES.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module", autouse=True)
def fixtures_untouched():
    """No test may change a fixture: they are what old code wrote, and cannot be made again."""
    before = _digests()
    yield
    assert _digests() == before


@pytest.fixture(params=FOLDERS, ids=[p.name for p in FOLDERS])
def fixture(request) -> pathlib.Path:
    return request.param


def _stored(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _allbits(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), bits(x)) for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_loaded(loaded: Any, expected: Any) -> None:
    """Equal as Equinox sees it (NaNs aside, which never equal themselves), and bit for bit."""
    assert tree_equal({**loaded, "special": None}, {**expected, "special": None}, typematch=True), (
        "the loaded tree differs from the saved one"
    )
    assert _allbits(loaded) == _allbits(expected)


def test_every_format_version_has_a_fixture():
    # A format change adds its fixture (see docs/format.md, "Compatibility").
    assert [_version(p) for p in FOLDERS] == list(range(1, FORMAT_VERSION + 1))


def test_the_fixture_is_the_version_its_folder_names(fixture):
    manifest = json.loads((fixture / "manifest.json").read_text())
    assert manifest["format_version"] == _version(fixture)
    assert eqx_ckpt.Checkpoint(fixture).format_version == _version(fixture)


def test_the_fixture_holds_what_its_format_wrote(fixture):
    """Representative: a large leaf in a folder of its own, small ones packed
    where the format packs (version 3 on), in folders of their own before;
    from version 6, every array compressed (`make_fixture.py --compressed`)."""
    big = (fixture / "big" / "c" / "0" / "0").stat().st_size
    manifest = json.loads((fixture / "manifest.json").read_text())
    if _version(fixture) >= 6:
        assert {p["compression"] for p in manifest["packs"]} == {"blosc-lz4"}
        assert [r["compression"] for r in manifest["leaves"] if r["path"] == "big"] == ["blosc-lz4"]
        assert 0 < big < make_fixture.PACK_BYTES  # its bytes compress
    else:
        assert big > make_fixture.PACK_BYTES
    packs = sorted(p.name for p in fixture.glob("packed.*"))
    if _version(fixture) >= 3:
        assert {"packed.bfloat16", "packed.float32", "packed.uint32", "packed.uint8"} <= set(packs)
        assert not (fixture / "small").exists()
    else:
        assert packs == []
        assert (fixture / "small" / "u4" / "zarr.json").is_file()
        assert (fixture / "escaped" / "a%2Eb" / "zarr.json").is_file()
    records = {leaf["path"]: leaf for leaf in json.loads((fixture / "manifest.json").read_text())["leaves"]}
    if _version(fixture) <= 4:  # written with TensorStore 0.1.86, which has no uint4: its bytes as uint8
        assert records["small.u4"]["encoding"] == "view"
    assert records["keys.many"]["encoding"] == "key_data"


def test_it_loads_bit_for_bit(fixture):
    like = make_fixture.like()
    assert not tree_equal(like["scalars"], make_fixture.expected()["scalars"])  # so a load that reads nothing fails
    loaded = eqx_ckpt.tree_deserialise_leaves(fixture, like)
    _assert_loaded(loaded, make_fixture.expected())


def test_it_rebuilds_without_like_from_format_5_on(fixture):
    """From format 5 a checkpoint records its structure: it loads with no
    skeleton at all, every class and function trusted by default; before, the
    load says there is no record and points to `like`."""
    ckpt = eqx_ckpt.Checkpoint(fixture)
    if _version(fixture) < 5:
        with pytest.raises(eqx_ckpt.CheckpointValueError, match=f"written in format version {_version(fixture)}"):
            ckpt.load(trust=[])
        return
    if _version(fixture) >= 7:  # an iterator cannot be rebuilt without its code: the rest can
        loaded = {key: ckpt.load(key, trust=[]) for key in make_fixture.expected()}
    else:
        loaded = ckpt.load(trust=[])
    _assert_loaded(loaded, make_fixture.expected())
    assert jax.tree.structure(loaded) == jax.tree.structure(make_fixture.expected())


def test_its_iterator_states_load_from_format_7_on(fixture):
    """From format 7 the fixture holds iterator states (`make_fixture.py
    --iterators`): each is put back into the iterator of `like`, as saved."""
    pipeline = {key: make_fixture.Position(None) for key in make_fixture.iterator_states()}
    like = {**make_fixture.like(), "pipeline": pipeline}
    if _version(fixture) < 7:
        with pytest.raises(eqx_ckpt.LeafError, match="its iterator state is not in the checkpoint"):
            eqx_ckpt.tree_deserialise_leaves(fixture, like)
        return
    loaded = eqx_ckpt.tree_deserialise_leaves(fixture, like)
    _assert_loaded({k: v for k, v in loaded.items() if k != "pipeline"}, make_fixture.expected())
    assert {k: it.state for k, it in loaded["pipeline"].items()} == make_fixture.iterator_states()


def test_checkpoint_lists_and_reads_every_key(fixture):
    ckpt = eqx_ckpt.Checkpoint(fixture)
    assert sorted(ckpt) == sorted(KEYS) and len(ckpt) == len(KEYS)
    leaves = [x for x in jax.tree.leaves(make_fixture.expected()) if _stored(x)]
    for key, leaf in zip(KEYS, leaves, strict=True):
        value = ckpt[key]
        value = value.read() if isinstance(value, eqx_ckpt.LazyArray) else value
        assert bits(value) == bits(leaf), key


def test_verify_finds_it_sound(fixture):
    problems = eqx_ckpt.verify(fixture)
    assert problems == [] and problems.unchecked == ()


def test_a_lazy_load_reads_it(fixture):
    expected = make_fixture.expected()
    lazy = eqx_ckpt.tree_deserialise_leaves(fixture, make_fixture.like(), lazy=True)
    assert isinstance(lazy["big"], eqx_ckpt.LazyArray) and isinstance(lazy["small"]["u4"], eqx_ckpt.LazyArray)
    assert np.asarray(lazy["big"][3:5, 7]).tobytes() == np.asarray(expected["big"][3:5, 7]).tobytes()
    assert np.asarray(lazy["special"]["f32"][1:4]).tobytes() == expected["special"]["f32"][1:4].tobytes()
    _assert_loaded(eqx_ckpt.materialise(lazy), expected)


def test_a_partial_load_reads_only_the_selection(fixture):
    like, expected = make_fixture.like(), make_fixture.expected()
    loaded = eqx_ckpt.tree_deserialise_leaves(fixture, like, where=lambda t: (t["model"], t["escaped"]))
    assert _allbits(loaded["model"]) == _allbits(expected["model"])
    assert _allbits(loaded["escaped"]) == _allbits(expected["escaped"])
    # Everything else is `like`'s own leaf, unread.
    assert loaded["big"] is like["big"] and tree_equal(loaded["scalars"], like["scalars"], typematch=True)


def test_a_load_by_prefix_reads_a_sub_tree(fixture):
    like, expected = make_fixture.like(), make_fixture.expected()
    model = eqx_ckpt.tree_deserialise_leaves(fixture, like["model"], prefix="model")
    assert tree_equal(model, expected["model"], typematch=True)
    escaped = eqx_ckpt.tree_deserialise_leaves(fixture, like["escaped"]["权重"], prefix="escaped.%E6%9D%83%E9%87%8D")
    assert bits(escaped) == bits(expected["escaped"]["权重"])


def _newer(tmp_path: pathlib.Path) -> tuple[pathlib.Path, int]:
    """A copy of the newest fixture whose manifest claims the next format version."""
    copy = tmp_path / "newer"
    shutil.copytree(FOLDERS[-1], copy)
    manifest = copy / "manifest.json"
    text, count = re.subn(
        r'"format_version":\s*[0-9]+', f'"format_version": {FORMAT_VERSION + 1}', manifest.read_text()
    )
    assert count == 1
    manifest.write_text(text)
    return copy, FORMAT_VERSION + 1


def test_a_newer_format_says_to_upgrade(tmp_path):
    """Issue 59, item 10: it was a `CorruptCheckpointError` (and `verify` a
    problem: damage, to a clean-up script), and its `pip install -U eqx_ckpt`
    is not how README installs."""
    newer, version = _newer(tmp_path)
    message = re.escape(
        f"format version {version}, which is not one this eqx_ckpt reads (up to {FORMAT_VERSION}): a newer "
        f"eqx_ckpt wrote it, and nothing is wrong with the checkpoint. Upgrade eqx_ckpt as you installed it (from "
        f"its source checkout, as README does: `git pull`, then `pip install -c constraints.txt -e .` there)"
    )
    for attempt in (
        lambda: eqx_ckpt.Checkpoint(newer),
        lambda: eqx_ckpt.tree_deserialise_leaves(newer, make_fixture.like()),
        lambda: eqx_ckpt.verify(newer),
    ):
        with pytest.raises(eqx_ckpt.CheckpointVersionError, match=message) as raised:
            attempt()
        assert not isinstance(raised.value, eqx_ckpt.CorruptCheckpointError)
    readme = (places.ROOT / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e " in readme and "pip install -U" not in readme


def test_a_newer_format_is_never_saved_over(tmp_path):
    newer, version = _newer(tmp_path)
    before = sorted((p.relative_to(newer), p.read_bytes()) for p in newer.rglob("*") if p.is_file())
    with pytest.raises(eqx_ckpt.CheckpointVersionError, match=re.escape(f"format version {version}, which is not one")):
        eqx_ckpt.tree_serialise_leaves(newer, {"w": np.ones(3, np.float32)})
    assert sorted((p.relative_to(newer), p.read_bytes()) for p in newer.rglob("*") if p.is_file()) == before


@pytest.fixture(params=EXPORTS, ids=[p.name for p in EXPORTS])
def published(request) -> pathlib.Path:
    return request.param


@pytest.fixture(params=FAMILIES, ids=[p.name for p in FAMILIES])
def family(request) -> pathlib.Path:
    return request.param


def test_every_published_layout_version_has_a_fixture():
    from eqx_ckpt._ondisk._published import VERSION

    assert [int(p.name.removeprefix("published_")) for p in PUBLISHED] == list(range(1, VERSION + 1))
    # Each holds an export or a family, never neither; a fine-tune is what version 2 added, and
    # its files' own names what version 3 did.
    assert sorted(set(EXPORTS + FAMILIES)) == PUBLISHED and FAMILIES and EXPORTS
    assert [int(p.name.removeprefix("published_")) for p in FAMILIES] == list(range(2, VERSION + 1))


def test_the_published_fixture_loads_bit_for_bit(published):
    """A folder `export_safetensors` wrote loads as it was, into a `like` and
    rebuilt without one, its metadata as exported, and verifies sound."""
    expected = make_fixture.published_expected()
    assert len(list(published.glob("model-*-of-*.safetensors"))) == 2
    _assert_loaded(eqx_ckpt.tree_deserialise_leaves(published, make_fixture.published_like()), expected)
    ckpt = eqx_ckpt.Checkpoint(published)
    loaded = ckpt.load(trust=[])
    _assert_loaded(loaded, expected)
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    assert ckpt.info == make_fixture.PUBLISHED_INFO
    lazy = eqx_ckpt.tree_deserialise_leaves(published, make_fixture.published_like(), lazy=True)
    assert np.asarray(lazy["small"]["u4"]).tobytes() == expected["small"]["u4"].tobytes()
    problems = eqx_ckpt.verify(published)
    version = int(published.name.removeprefix("published_"))
    if version < 4:
        assert problems == [] and "Safetensors files hold no checksums" in problems.unchecked[0]
    else:  # every leaf against its block digests (SHA-256, then BLAKE3); a slice reads and checks its blocks
        said = {4: "sha256 per 1 MiB block", 5: "blake3 per 1 MiB block"}.get(version)
        said = said or "blake3 per block of whole rows, up to 128 KiB"
        assert problems == [] and problems.unchecked == () and said in problems.checked[0]
        large = max(ckpt, key=lambda k: ckpt[k].nbytes if hasattr(ckpt[k], "nbytes") else 0)
        assert ckpt[large].nbytes > 2**20
        rows = np.asarray(ckpt[large][1:3]) if ckpt[large].ndim else np.asarray(ckpt[large])
        assert rows.tobytes() == np.asarray(ckpt[large])[1:3].tobytes()


def _run_card_snippet(folder: pathlib.Path, expected: str) -> None:
    """The load snippet of `folder`'s card, run from the repository's root (the
    path it names): it loads a tree of the structure `make_fixture.<expected>()` has."""
    snippet = re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S).group(1)
    check = snippet + "import jax; print(sorted(model), jax.tree.structure(model) == jax.tree.structure(EXPECTED))\n"
    setup = "import importlib.util as u, sys; s = u.spec_from_file_location('m', 'tests/fixtures/make_fixture.py'); "
    # (its structure alone: traced abstractly, not computed, which compiled for seconds in every process)
    setup += "m = u.module_from_spec(s); s.loader.exec_module(m); import equinox as eqx\n"
    setup += f"EXPECTED = eqx.filter_eval_shape(m.{expected})\n"
    root = FIXTURES.parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    # (a new process forked from one that imported JAX, `prefork`: the snippet imports eqx_ckpt itself)
    run = prefork.run(["-c", setup + check], env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("True")


def test_the_published_fixtures_card_snippet_runs_as_written(published):
    _run_card_snippet(published, "published_expected")


def test_the_family_fixture_holds_what_its_version_wrote(family):
    """A fine-tune stored against its base: the base by a relative path pinned
    by the sha256 of its `eqx_ckpt.json`, only the changed leaves in its
    safetensors, each other leaf naming the base's leaf with its bytes. In
    version 2 they are in `model.safetensors`; from version 3 in
    `finetune.safetensors`, whose metadata names the base."""
    from safetensors import safe_open

    finetune, base = family / "finetune", family / "base"
    record = json.loads((finetune / "eqx_ckpt.json").read_text())
    version = int(family.name.removeprefix("published_"))
    assert record["format_version"] == version in (2, 3, 4, 5, 6)
    stem = "model" if version == 2 else "finetune"
    assert sorted(p.name for p in finetune.glob("*.safetensors*")) == [f"{stem}.safetensors"]
    with safe_open(str(finetune / f"{stem}.safetensors"), framework="np") as f:
        metadata = f.metadata() or {}
    if version >= 3:
        assert metadata["eqx_ckpt.base"] == "../base" and "eqx_ckpt.base_revision" not in metadata
        assert (
            metadata["eqx_ckpt.standalone"]
            == f"eqx-ckpt export --standalone tests/fixtures/{family.name}/finetune <folder>"
        )
        assert "not a whole model" in metadata["eqx_ckpt.fine_tune"]
    else:
        assert metadata == {}
    sha256 = hashlib.sha256((base / "eqx_ckpt.json").read_bytes()).hexdigest()
    assert record["base"] == {"path": "../base", "sha256": sha256}
    assert json.loads((base / "eqx_ckpt.json").read_text())["format_version"] == (1 if version < 4 else version)
    stored = []
    for file in sorted(finetune.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            stored += list(f.keys())
    assert sorted(stored) == make_fixture.FAMILY_STORED
    taken = {leaf["path"]: leaf["base"] for leaf in record["leaves"] if "base" in leaf}
    assert sorted(taken) == sorted(leaf["path"] for leaf in record["leaves"] if leaf["path"] not in stored)
    assert taken["adapter.w"] == "small.f32" and taken["special.f32"] == "special.f32"
    if version < 4:
        assert all(re.fullmatch("xxh3-128:[0-9a-f]{32}", leaf["digest"]) for leaf in record["leaves"])
    else:  # block digests, the base's leaves' too (issue 84): SHA-256 in version 4, then BLAKE3
        algorithm = "sha256" if version == 4 else "blake3"
        assert all(re.fullmatch(f"{algorithm}:[0-9a-f]{{64}}", leaf["digest"]) for leaf in record["leaves"])
        assert all(re.fullmatch("([0-9a-f]{64})*", leaf["blocks"]) for leaf in record["leaves"])
    assert len(list(base.glob("model-*-of-*.safetensors"))) == 2


def test_the_family_fixture_loads_bit_for_bit(family):
    """The fine-tune loads as it was, its base's leaves read from the base
    beside it: into a `like`, rebuilt without one, lazily and in part; the base
    loads as itself; both verify sound."""
    finetune, base = family / "finetune", family / "base"
    expected = make_fixture.family_finetune_expected()
    _assert_loaded(eqx_ckpt.tree_deserialise_leaves(finetune, make_fixture.family_like()), expected)
    ckpt = eqx_ckpt.Checkpoint(finetune)
    loaded = ckpt.load(trust=[])
    _assert_loaded(loaded, expected)
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    assert ckpt.info == {"description": "The fine-tune of the family fixture."}
    lazy = eqx_ckpt.tree_deserialise_leaves(finetune, make_fixture.family_like(), lazy=True)
    assert np.asarray(lazy["special"]["f32"][1:4]).tobytes() == expected["special"]["f32"][1:4].tobytes()
    assert np.asarray(ckpt["small.u4"]).tobytes() == expected["small"]["u4"].tobytes()
    _assert_loaded(eqx_ckpt.materialise(lazy), expected)
    model = eqx_ckpt.tree_deserialise_leaves(finetune, make_fixture.family_like()["model"], prefix="model")
    assert tree_equal(model, expected["model"], typematch=True)
    like = make_fixture.family_like()
    part = eqx_ckpt.tree_deserialise_leaves(finetune, like, where=lambda t: (t["adapter"], t["keys"]))
    assert _allbits(part["adapter"]) == _allbits(expected["adapter"])
    assert _allbits(part["keys"]) == _allbits(expected["keys"])
    assert part["model"].layers[1].weight is like["model"].layers[1].weight and part["scalars"]["int"] == 0
    base_expected = make_fixture.family_base_expected()
    _assert_loaded(
        eqx_ckpt.tree_deserialise_leaves(base, jax.tree.map(make_fixture.blank, base_expected)), base_expected
    )
    for folder in (finetune, base):  # every leaf against its recorded digest, the base's too
        problems = eqx_ckpt.verify(folder)
        assert problems == [] and problems.unchecked == () and "digest" in problems.checked[0]
    assert "is there, at the version pinned" in eqx_ckpt.verify(finetune).checked[1]


def test_the_family_fixtures_card_snippet_runs_as_written(family):
    card = (family / "finetune" / "README.md").read_text()
    assert "it holds only the leaves that differ from its base, `../base`" in card
    _run_card_snippet(family / "finetune", "family_finetune_expected")
