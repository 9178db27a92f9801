"""The public namespace: every name imports, errors live in `eqx_ckpt`."""

import importlib
import inspect
import re
import textwrap

import pytest

import eqx_ckpt

PUBLIC = sorted(name for name in dir(eqx_ckpt) if not name.startswith("_"))
CORE = [
    "Checkpoint", "CheckpointError", "CheckpointExistsError", "CheckpointKeyError", "CheckpointNotFoundError",
    "CheckpointTypeError", "CheckpointValueError", "CorruptCheckpointError", "IntegrityError", "LazyArray",
    "LeafError", "LeafHandle", "default_deserialise_filter_spec", "default_serialise_filter_spec",
    "load_or_initialise", "materialise", "skeleton", "tree_deserialise_leaves", "tree_serialise_leaves",
    "export_safetensors", "torch_layout",
]  # fmt: skip
BUILTINS = {
    "CheckpointNotFoundError": FileNotFoundError,
    "CheckpointExistsError": FileExistsError,
    "CheckpointTypeError": TypeError,
    "CheckpointValueError": ValueError,
    "CorruptCheckpointError": ValueError,
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


def test_exceptions():
    errors = [getattr(eqx_ckpt, n) for n in PUBLIC if inspect.isclass(getattr(eqx_ckpt, n))]
    errors = [e for e in errors if issubclass(e, BaseException)]
    assert eqx_ckpt.CheckpointError in errors
    for error in errors:
        assert error.__module__ == "eqx_ckpt", error
        assert issubclass(error, eqx_ckpt.CheckpointError)
        assert repr(error).startswith("<class 'eqx_ckpt.")
    for name, builtin in BUILTINS.items():
        assert issubclass(getattr(eqx_ckpt, name), builtin), name


def test_key_error_message_is_not_quoted():
    error = eqx_ckpt.CheckpointKeyError("'a.b' is not a leaf", path="ckpt")
    assert str(error) == "'a.b' is not a leaf"
    assert error.path == "ckpt"


@pytest.mark.parametrize("name", ["export_safetensors", "torch_layout"])
def test_interop_examples_run(name, tmp_path, monkeypatch):
    doc = inspect.getdoc(getattr(eqx_ckpt, name))
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(textwrap.dedent(code), f"eqx_ckpt.{name}", "exec"), {})
    assert any(p.suffix == ".safetensors" for p in tmp_path.rglob("*"))
