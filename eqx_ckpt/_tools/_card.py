"""The model card (`README.md`) of a published folder: what the Hugging Face Hub
shows, with front matter naming the library, and a load snippet that works as
written.

The snippet's one parameter is the name the model is loaded by
(`model_card(name_or_path, ...)`). That is the folder's path for a local
export, or `hf://owner/name` for a published repository.

Its `trust` list names the classes and functions of the structure record that
the default trust does not cover (`_trust`). Each is imported from its own
module. One defined in a script (`__main__`) cannot be imported, and the card
says so.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._ondisk import _published, _trust

README = "README.md"
FRONT_MATTER = "---\nlibrary_name: eqx_ckpt\ntags:\n- jax\n- equinox\n---\n"


def model_card(name_or_path: str, *, structure: Any, info: dict[str, Any], files: list[str]) -> str:
    """The text of `README.md` for a folder of the published layout loaded as
    `name_or_path`.

    The folder holds `files`. Its tree has the `structure` record (or `None`)
    and the user's `info`."""
    title = info.get("name") if isinstance(info.get("name"), str) else _title(name_or_path)
    description = info.get("description") if isinstance(info.get("description"), str) else ""
    parts = [FRONT_MATTER, f"# {title}\n"]
    if description:
        parts.append(description.strip() + "\n")
    parts.append(
        "An Equinox model published by eqx_ckpt (`pip install eqx_ckpt`): its arrays as "
        f"safetensors (tensor names are dotted key paths), its tree's structure in `{_published.NAME}`. It loads "
        "without its code: no file of it is imported, run or unpickled, and only the classes you trust are built.\n"
    )
    parts.append("## Load it\n\n```python\n" + snippet(name_or_path, structure) + "```\n")
    undefined = _unimportable(structure)
    if undefined:
        names = ", ".join(f"`{_trust.python_name(n)}`" for n in undefined)
        parts.append(
            f"It needs {names}, defined in the script that exported it: define them, and add them to `trust`.\n"
        )
    parts.append(
        'A part of it, reading only the selected tensors\' bytes: `.load("<dotted prefix>", trust=[...])`, or '
        f"`eqx_ckpt.tree_deserialise_leaves({json.dumps(name_or_path)}, like, where=...)` into a model of your own.\n"
    )
    parts.append("## Files\n\n" + "".join(f"- `{name}`\n" for name in files))
    if info:
        parts.append("## Metadata\n\n```json\n" + json.dumps(info, indent=2, sort_keys=True) + "\n```\n")
    return "\n".join(parts)


def snippet(name_or_path: str, structure: Any) -> str:
    """Python that loads the model named `name_or_path` (see the module docstring)."""
    if structure is None:
        return (
            "import eqx_ckpt\n\n"
            "# It records no structure (exported with `rename`): nested dicts of arrays.\n"
            f"state = eqx_ckpt.Checkpoint({json.dumps(name_or_path)}).load()\n"
        )
    names = [n for n in needed(structure) if n not in _unimportable(structure)]
    modules = sorted({n.partition(":")[0] for n in names})
    trusted = ", ".join(_trust.python_name(n) for n in names)
    lines = ["import eqx_ckpt"] + [f"import {module}" for module in modules] + [""]
    if not names:
        lines.append("# Equinox's layers and JAX's functions are trusted by default.")
    lines.append(f"model = eqx_ckpt.Checkpoint({json.dumps(name_or_path)}).load(trust=[{trusted}])")
    return "\n".join(lines) + "\n"


def needed(structure: Any) -> list[str]:
    """The names of the classes and functions the `structure` record builds
    that the default trust does not hold, sorted."""
    found: set[str] = set()
    _collect(structure, found)
    default = _trust.Trust([])
    return sorted(n for n in found if default.resolve(n) is None)


def _collect(node: Any, found: set[str]) -> None:
    # A record's objects are its nodes and tagged values; a dict in it is one of those.
    if isinstance(node, dict):
        for key in ("cls", "function", "enum"):
            if isinstance(node.get(key), str):
                found.add(node[key])
        for value in node.values():
            _collect(value, found)
    elif isinstance(node, list):
        for value in node:
            _collect(value, found)


def _unimportable(structure: Any) -> list[str]:
    if structure is None:
        return []
    return [n for n in needed(structure) if n.startswith("__main__:") or "<" in n]


def _title(name_or_path: str) -> str:
    name = name_or_path.rstrip("/").split("@")[0]
    return os.path.basename(name) or name
