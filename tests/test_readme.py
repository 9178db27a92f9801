"""The README's quick start runs as written, and its set-up commands are .ci/run's."""

import pathlib
import re

import equinox as eqx

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_quick_start_runs(tmp_path, monkeypatch):
    section = README[README.index("## Quick start") : README.index("## What you get")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert eqx.tree_equal(namespace["model"], namespace["state"]["model"], typematch=True)
    # Its leaves are small: packed, one zarr v3 array per dtype, with the manifest beside them.
    assert (tmp_path / "ckpt" / "packed.float32" / "zarr.json").is_file()
    assert (tmp_path / "ckpt" / "manifest.json").is_file()


def test_test_command_is_what_ci_runs():
    commands = re.findall(r"```bash\n(python3\.11 -m venv .*?)\n```", README)
    assert len(commands) == 2
    assert commands[0].endswith("eqx-ckpt demo")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
