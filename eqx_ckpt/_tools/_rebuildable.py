"""What a load without `like` of an exported tree needs, read from its
structure record: the classes to trust, and the parts no trust rebuilds
(what the save could not record as data, and what a fresh process cannot
import), which an export warns of (`NeedsCodeWarning`) and the model card
works around (`rebuildable`; docs/sharing.md, "Parts that need the model's
code").
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any

from .._base import _keypath
from .._base._errors import from_file
from .._load import _rebuild
from .._ondisk import _structure, _trust

# Parts named in a warning, at most.
SHOWN = 10
_IDENTIFIERS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class NeedsCodeWarning(UserWarning):
    """An export or a push holds parts that a load without `like` cannot
    rebuild without the model's code.

    Such a part is a lambda, a closure, an instance of a class defined inside a
    function, or a class or function defined in a script (`__main__`). The
    warning names each by its dotted key path. The model card's snippet then
    rebuilds the other parts (`prefix=`), and shows the load into a `like`
    that the model's code makes. To publish a model that rebuilds without its
    code, define those parts in an importable module.

    !!! example

        ```python
        import warnings
        import eqx_ckpt

        # An export that cannot be rebuilt without its code is then an error:
        warnings.simplefilter("error", eqx_ckpt.NeedsCodeWarning)
        ```
    """


NeedsCodeWarning.__module__ = "eqx_ckpt"


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a load without `like` of a structure record needs.

    - `trust`: the classes and functions outside the default trust, by
        `module:qualname`, sorted, each with the dotted paths that use it.
    - `code`: the parts that need the model's code, by dotted path, sorted,
        each with what it is (text from a checkpoint escaped).
    """

    trust: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    code: dict[str, str] = dataclasses.field(default_factory=dict)


def needs(structure: Any, where: str) -> Needs:
    """What a load without `like` of the tree of `structure` (a record, or
    `None`) needs; the record is checked as a load checks it, `where` naming
    it in an error."""
    if structure is None:
        return Needs()
    default = _trust.Trust([])
    names = _rebuild.names(structure, "", where)
    trust = {n: names[n] for n in sorted(names) if default.resolve(n) is None}
    code = {
        path: f"{from_file(why)}, which a checkpoint cannot record as data"
        for path, why in _rebuild.unrecordable(structure, "", where).items()
    }
    for name, paths in trust.items():
        if not importable(name):
            where_defined = "defined in a script (`__main__`)" if in_script(name) else "which no `import` reaches"
            for path in paths:
                code.setdefault(path, f"`{from_file(_trust.python_name(name))}`, {where_defined}")
    return Needs(trust, {path: code[path] for path in sorted(code, key=_keypath.sort_key)})


def importable(name: str) -> bool:
    """Whether a fresh process can import the object recorded as `name`: its
    module is a module path other than a script's (`__main__`), its qualname
    a path of identifiers (no `<locals>`)."""
    module, _, qualname = name.partition(":")
    return module != "__main__" and bool(_IDENTIFIERS.fullmatch(module)) and bool(_IDENTIFIERS.fullmatch(qualname))


def in_script(name: str) -> bool:
    """Whether the object recorded as `name` was defined in a script (`__main__`)."""
    return name.partition(":")[0] == "__main__"


def warn(found: Needs, name_or_path: str) -> None:
    """Warn of the parts of `found` that need the model's code, each by its
    dotted path; nothing where there are none."""
    if not found.code:
        return
    lines = [f"  `{path or '(the root)'}`: {why}" for path, why in list(found.code.items())[:SHOWN]]
    if len(found.code) > SHOWN:
        lines.append(f"  and {len(found.code) - SHOWN} more")
    message = (
        f"`Checkpoint({from_file(name_or_path)!r}).load(trust=[...])` cannot rebuild these parts without the "
        f"model's code:\n" + "\n".join(lines) + "\nThe model card shows the loads that work: the other parts "
        "(`prefix=`), and all of it into a `like`. To publish a model that rebuilds without its code, define "
        "these parts in an importable module."
    )
    warnings.warn(message, NeedsCodeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside eqx_ckpt: the user's call
    of `export_safetensors` or `push_to_hub`, whichever it was."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def rebuildable(structure: dict[str, Any], code: Iterable[str]) -> list[str]:
    """The largest sub-trees of `structure` that hold stored leaves and none of
    the parts at the dotted paths `code`, by dotted path, sorted."""
    leaves: list[str] = []
    _structure.walk(structure, lambda path, node: leaves.append(path) if node["t"] == "leaf" else None)
    tainted, holding = _above(code), _above(leaves)
    found, stack = [], [("", structure)]
    while stack:
        here, node = stack.pop()
        if here not in holding:
            continue
        if here not in tainted:
            found.append(here)
            continue
        for key, child in _structure.children(node):
            stack.append((_keypath.join_dotted(here, _keypath.stored_segment(*key)), child))
    return sorted(found, key=_keypath.sort_key)


def _above(paths: Iterable[str]) -> set[str]:
    """Every dotted path in `paths`, and every path above one (`""` too)."""
    found: set[str] = set()
    for path in paths:
        segments = _keypath.split_dotted(path)
        found.update(".".join(segments[:i]) for i in range(len(segments) + 1))
    return found
