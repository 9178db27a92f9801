"""The public namespace: every name imports, errors live in `eqx_ckpt`."""

import dataclasses
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import hub_server
import numpy as np
import places
import pytest
from disk import snapshot

import eqx_ckpt

PUBLIC = sorted(name for name in dir(eqx_ckpt) if not name.startswith("_"))
CORE = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointTypeError",
    "CheckpointValueError",
    "CorruptCheckpointError",
    "IntegrityError",
    "LazyArray",
    "LeafError",
    "LeafHandle",
    "default_deserialise_filter_spec",
    "default_serialise_filter_spec",
    "load_or_initialise",
    "materialise",
    "skeleton",
    "tree_deserialise_leaves",
    "tree_serialise_leaves",
    "export_safetensors",
    "torch_layout",
]
BUILTINS = {
    "CheckpointNotFoundError": FileNotFoundError,
    "CheckpointConnectionError": ConnectionError,
    "CheckpointStorageError": OSError,
    "CheckpointExistsError": FileExistsError,
    "CheckpointTypeError": TypeError,
    "CheckpointValueError": ValueError,
    "CorruptCheckpointError": ValueError,
    "CheckpointVersionError": ValueError,
    "CheckpointKeyError": KeyError,
    "LeafError": RuntimeError,
    "IntegrityError": RuntimeError,
}


def test_version():
    assert isinstance(eqx_ckpt.__version__, str)
    assert eqx_ckpt.__version__.count(".") >= 2


def test_core_names_are_public():
    assert set(CORE) <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_imports(name):
    module = importlib.import_module("eqx_ckpt")
    value = getattr(module, name)
    assert value is not None
    exec(f"from eqx_ckpt import {name}", {})
    if inspect.isclass(value) or inspect.isfunction(value):
        assert inspect.getdoc(value), f"eqx_ckpt.{name} has no docstring"


# An environment as a plain `pip install eqx_ckpt` leaves it: `crc32c` installed,
# `google_crc32c` not, where numcodecs (0.16.4 on) warns on its own import.
_WITHOUT_GOOGLE_CRC32C = """
import importlib.util
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == "google_crc32c" else found(name, *args)
import {module}
"""


@pytest.mark.parametrize("module", ["numcodecs", "eqx_ckpt"])
def test_importing_eqx_ckpt_prints_nothing(module):
    """`import eqx_ckpt` prints nothing, also where numcodecs warns about a
    CRC32C codec eqx_ckpt never uses (the `numcodecs` case shows the test
    reaches that warning)."""
    code = _WITHOUT_GOOGLE_CRC32C.format(module=module)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if module == "numcodecs":
        assert "crc32c usage is deprecated" in run.stderr
    else:
        assert run.stderr == ""


def test_exceptions():
    errors = [getattr(eqx_ckpt, n) for n in PUBLIC if inspect.isclass(getattr(eqx_ckpt, n))]
    errors = [e for e in errors if issubclass(e, BaseException) and not issubclass(e, Warning)]
    assert eqx_ckpt.CheckpointError in errors
    for error in errors:
        assert error.__module__ == "eqx_ckpt", error
        assert issubclass(error, eqx_ckpt.CheckpointError)
        assert repr(error).startswith("<class 'eqx_ckpt.")
    for name, builtin in BUILTINS.items():
        assert issubclass(getattr(eqx_ckpt, name), builtin), name
    # A newer format is no damage (issue 59, item 10).
    assert not issubclass(eqx_ckpt.CheckpointVersionError, eqx_ckpt.CorruptCheckpointError)


def test_key_error_message_is_not_quoted():
    error = eqx_ckpt.CheckpointKeyError("'a.b' is not a leaf", path="ckpt")
    assert str(error) == "'a.b' is not a leaf"
    assert error.path == "ckpt"


def _examples(value):
    """The ```python blocks of a docstring (dedented)."""

    doc = inspect.getdoc(value) or ""
    return [textwrap.dedent(block) for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S)]


def _documented():
    """Every public name, and every public method or property of a public class."""
    for name in PUBLIC:
        value = getattr(eqx_ckpt, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        yield name, value
        if inspect.isclass(value) and not issubclass(value, BaseException):
            for attr, member in vars(value).items():
                if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    yield f"{name}.{attr}", member


@pytest.mark.parametrize("name", [name for name in PUBLIC if not name.startswith("__")])
def test_every_public_name_has_an_example(name):
    value = getattr(eqx_ckpt, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        assert _examples(value), f"eqx_ckpt.{name} has no ```python example in its docstring"


_WITH_EXAMPLES = {name: value for name, value in _documented() if _examples(value)}


# Examples that reach the Hugging Face Hub: run in a fresh process against the
# local Hub server (tests/support/hub_server.py), which huggingface_hub must know at import.
_HUB = {"push_to_hub"}


@pytest.mark.parametrize("name", sorted(_WITH_EXAMPLES))
def test_docstring_examples_run(name, tmp_path, monkeypatch, capsys):
    value = _WITH_EXAMPLES[name]
    monkeypatch.chdir(tmp_path)
    if name in _HUB:
        _run_against_the_hub(_examples(value), tmp_path)
        return
    for example in _examples(value):
        exec(compile(example, f"<docstring of eqx_ckpt.{name}>", "exec"), {"__name__": "__example__"})


def _run_against_the_hub(examples: list[str], tmp_path) -> None:
    if importlib.util.find_spec("huggingface_hub") is None:
        pytest.skip("needs the `hub` extra (huggingface_hub)")
    root = str(places.ROOT)
    with hub_server.serving() as (url, _):
        env = {
            **os.environ,
            "HF_ENDPOINT": url,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_TOKEN": "writer",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": root,
        }
        for example in examples:
            done = subprocess.run([sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr


_FLAGS = {
    "strict": lambda path, value: eqx_ckpt.tree_deserialise_leaves(path, {"a": np.zeros(3)}, strict=value),
    "lazy": lambda path, value: eqx_ckpt.tree_deserialise_leaves(path, {"a": np.zeros(3)}, lazy=value),
    "overwrite": lambda path, value: eqx_ckpt.tree_serialise_leaves(path, {"a": np.ones(3)}, overwrite=value),
    "blocking": lambda path, value: eqx_ckpt.tree_serialise_leaves(path, {"a": np.ones(3)}, blocking=value),
    "Checkpoint.load lazy": lambda path, value: eqx_ckpt.Checkpoint(path).load(lazy=value),
    "manager blocking": lambda path, value: eqx_ckpt.CheckpointManager(path / "run", blocking=value),
    "manager adopt_steps": lambda path, value: eqx_ckpt.CheckpointManager(path / "run", adopt_steps=value),
    "manager overwrite": lambda path, value: eqx_ckpt.CheckpointManager(path / "run").save(1, {}, overwrite=value),
    # `diff(values=None)` once said that two checkpoints with different values were equal.
    "values": lambda path, value: eqx_ckpt.diff(path, path, values=value),
    "listing values": lambda path, value: eqx_ckpt.Checkpoint(path).listing(values=value),
}


@pytest.mark.parametrize("flag", sorted(_FLAGS))
@pytest.mark.parametrize("value", ["no", "False", 0, None])
def test_a_yes_or_no_option_takes_only_a_bool(tmp_path, flag, value):
    # A string is truthy: `strict="no"` once meant strict, `overwrite="no"` replaced.
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": np.arange(3.0)})
    before = snapshot(tmp_path)
    expected = rf"`{flag.split()[-1]}` must be `True` or `False` \(.*\), not {value!r}"
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=expected):
        _FLAGS[flag](tmp_path, value)
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run")} == before
    _FLAGS[flag](tmp_path, np.True_)  # a NumPy bool is a bool


def test_checkpoint_load_names_its_key_argument_when_given_a_skeleton(tmp_path):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": np.arange(3.0)})
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=r"dotted path .* not dict\. To load into a skeleton"):
        eqx_ckpt.Checkpoint(tmp_path).load({"a": np.zeros(3)})


@pytest.mark.parametrize("option", ["depth", "max_rows"])
@pytest.mark.parametrize("value", ["1", -1, 1.5, True])
def test_listing_counts_are_ints(tmp_path, option, value):
    eqx_ckpt.tree_serialise_leaves(tmp_path, {"a": np.arange(3.0)})
    with pytest.raises(eqx_ckpt.CheckpointTypeError, match=rf"`{option}` must be an int of at least 0 or None"):
        eqx_ckpt.Checkpoint(tmp_path).listing(**{option: value})


def test_push_to_hub_writes_its_signature_once():
    """`push_to_hub` makes one options value of its keywords (`PushOptions`,
    its `export` an `ExportOptions`), which `_publish.publish` takes whole:
    every keyword is a field of one of them, with the same default (so a
    keyword named otherwise, or defaulting otherwise, cannot silently not
    reach the push)."""
    import inspect

    from eqx_ckpt._tools import _export, _publish

    fields = {f.name: f.default for f in dataclasses.fields(_export.ExportOptions)}
    fields |= {f.name: f.default for f in dataclasses.fields(_publish.PushOptions) if f.name != "export"}
    fields["metadata"] = fields.pop("info")  # (the push's `metadata` is the export's `info`)
    pushed = inspect.signature(eqx_ckpt.push_to_hub).parameters
    keywords = {n: p.default for n, p in pushed.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {n: fields.get(n, "not an option") for n in keywords} == keywords
    assert list(inspect.signature(_publish.publish).parameters) == ["tree_or_checkpoint_path", "options"]


def test_the_names_type_checkers_see_are_the_names_imported_on_first_use():
    """`import eqx_ckpt` imports its public names on first use (`_PUBLIC`,
    issue 88.5); type checkers read them from an `if TYPE_CHECKING:` block. The
    two lists are one: each name from the same module."""
    import ast

    source = pathlib.Path(eqx_ckpt.__file__).read_text()
    (block,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    seen = {
        alias.asname: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert all(
        alias == name
        for alias, name in ((a.asname, a.name) for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names)
    )
    assert seen == dict(eqx_ckpt._PUBLIC)
    assert sorted(seen) == eqx_ckpt.__all__
