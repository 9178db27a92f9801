"""The README's quick start runs as written, its set-up commands are .ci/run's,
and the outputs it shows are the library's own. (tests/docs/test_doc_examples.py runs
every python block of the README, in order.)"""

import re

import equinox as eqx
import jax
import places
import pytest
from arrays import tree_equal

import eqx_ckpt
from eqx_ckpt._tools._cli import main

ROOT = places.ROOT
README = (ROOT / "README.md").read_text()


@pytest.fixture
def quick_start(tmp_path, monkeypatch) -> dict:
    """The quick start run in an empty working directory: its namespace."""
    section = README[README.index("## Quick start") : README.index("## What you get")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def _shown(after: str) -> str:
    """The lines the README shows after the line `after`, up to a blank line or the fence."""
    start = README.index(after + "\n") + len(after) + 1
    return re.split(r"\n\n|\n```", README[start:], maxsplit=1)[0] + "\n"


def test_quick_start_runs(quick_start, tmp_path):
    namespace = quick_start
    assert tree_equal(namespace["model"], namespace["state"]["model"], typematch=True)
    # Its leaves are small: packed, one zarr v3 array per dtype, with the manifest beside them.
    assert (tmp_path / "ckpt" / "packed.float32" / "zarr.json").is_file()
    assert (tmp_path / "ckpt" / "manifest.json").is_file()


def test_test_command_is_what_ci_runs():
    commands = re.findall(r"```bash\n(python3\.11 -m venv .*?)\n```", README)
    assert len(commands) == 2
    assert commands[0].endswith("eqx-ckpt demo")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_the_leaf_error_shown_is_the_real_message(quick_start):
    """The README's `LeafError`: the quick start's model loaded into a `like` whose
    last layer grew to 3 outputs and which gained a head without bias."""

    class Grown(eqx.Module):
        layers: tuple
        head: eqx.nn.Linear

        def __init__(self, key):
            self.layers = eqx.nn.MLP(4, 3, 8, 1, key=key).layers
            self.head = eqx.nn.Linear(3, 3, use_bias=False, key=key)

    like = eqx.filter_eval_shape(Grown, jax.random.key(0))
    with pytest.raises(eqx_ckpt.LeafError) as raised:
        eqx_ckpt.tree_deserialise_leaves("ckpt", like, prefix="model")
    message = f"eqx_ckpt.LeafError: {raised.value}\n"
    assert message.count("\n  - ") == 3
    assert _shown("```\n" + message.partition("\n")[0]) == message.partition("\n")[2]


def test_the_info_shown_is_the_real_output(quick_start, capsys):
    """`eqx-ckpt info ckpt` of the quick start's checkpoint, as the README shows
    it (the creation time aside)."""
    assert main(["info", "ckpt"]) == 0
    output = capsys.readouterr().out
    shown = _shown("$ eqx-ckpt info ckpt")
    created = re.compile(r"^created: +\S+$", re.M)
    assert created.search(output) and created.search(shown)
    assert created.sub("created:", output) == created.sub("created:", shown)
