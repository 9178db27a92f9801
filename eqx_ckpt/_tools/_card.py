"""The model card (`README.md`) of a published folder: the Hub's front matter,
what the model is, and a load snippet that works as written.

The snippet trusts what the default trust does not cover (`_trust`). Parts
that no trust rebuilds (`needs`: what the save could not record as data, what
a fresh process cannot import) make an export warn (`NeedsCodeWarning`). The
snippet then rebuilds the largest parts without them (`rebuildable`), and the
card shows the load into a `like` (docs/interop.md, "The model card").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from .._base import _keypath
from .._base._errors import CheckpointError, CheckpointTypeError, CheckpointValueError, caller_level, from_file
from .._base._location import HUB_SCHEME, location
from .._load import _rebuild
from .._load._checkpoint import Checkpoint, human
from .._ondisk import _manifest, _published, _structure, _trust
from .._ondisk._format import CARD, LeafRecord
from .._sources import _hub
from .._store import _storage

# Shown by name in the snippet, at most; more parts load as nested dicts.
MAX_PARTS = 16
# Parts named in a warning, at most.
SHOWN = 10
# The most of a card a re-export reads for the license and base models it names.
_CARD_BYTES = 2**20
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
# A pip requirement or a URL (which the card writes as `<url>`: no `<` or `>` in it).
_CODE = re.compile(r"(?!https?://[^<>]*[<>])[^\s`'\"\\]{1,300}")
# The `metrics` a merge records (`_merge._metrics`), and the most of an input's name a card shows.
MERGE_PREFIX = "merge_"
MERGE_SHOWN = 300
# Metric names written into the front matter (quoted): others are in the body only.
_METRIC = re.compile(r"[A-Za-z0-9_./-]{1,100}")
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
    """What a load without `like` of a structure record needs: `trust`, the
    classes and functions outside the default trust (by `module:qualname`,
    sorted) with the dotted paths using each; `code`, the parts that need the
    model's code (by dotted path, sorted) with what each is (escaped)."""

    trust: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    code: dict[str, str] = dataclasses.field(default_factory=dict)


def needs(structure: Any, where: str) -> Needs:
    """What a load without `like` of `structure` (a record, or `None`) needs,
    checked as a load checks it (`where` names it in an error)."""
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
    """Whether a fresh process can import the object recorded as `name`: not
    from a script (`__main__`), nor under `<locals>`."""
    module, _, qualname = name.partition(":")
    return module != "__main__" and bool(_IDENTIFIERS.fullmatch(module)) and bool(_IDENTIFIERS.fullmatch(qualname))


def in_script(name: str) -> bool:
    """Whether the object recorded as `name` was defined in a script (`__main__`)."""
    return name.partition(":")[0] == "__main__"


def warn(found: Needs, name_or_path: str) -> None:
    """Warn of the parts of `found` that need the model's code, if any."""
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
    warnings.warn(message, NeedsCodeWarning, stacklevel=caller_level())


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


@dataclasses.dataclass(frozen=True)
class About:
    """What a card says beyond the files: the export's checked `license`, `base_model` and `code`."""

    license: str | None = None
    base_model: tuple[str, ...] = ()
    code: str | None = None


def about(*, license: Any, base_model: Any, code: Any) -> About:
    """The card's options, checked: each is written into the card as it is."""
    if license is not None and not (isinstance(license, str) and _LICENSE.fullmatch(license)):
        raise CheckpointValueError(
            f"`license` must be a Hub license id such as 'apache-2.0', 'mit' or 'other', in lower case "
            f"(https://huggingface.co/docs/hub/repositories-licenses), not {license!r}."
        )
    models = (base_model,) if isinstance(base_model, str) else tuple(base_model or ())
    for model in models:
        if not isinstance(model, str) or not _REPO.fullmatch(model):
            fix = (
                " Drop `hf://` and any `@revision`."
                if isinstance(model, str) and ("://" in model or "@" in model)
                else ""
            )
            raise CheckpointValueError(
                f"`base_model` must be a Hub repository `owner/name` (or a list of them), not {model!r}.{fix}"
            )
    if code is not None and not (isinstance(code, str) and _CODE.fullmatch(code)):
        raise CheckpointValueError(
            f"`code` must say where the model's classes come from: a pip requirement ('mypkg', "
            f"'git+https://github.com/me/mypkg') or a URL, with no spaces or quotes, not {code!r}."
        )
    return About(license, models, code)


def model_card(
    name_or_path: str,
    *,
    structure: Any,
    info: dict[str, Any],
    files: list[str],
    records: Sequence[LeafRecord] = (),
    about: About = About(),
    found: Needs | None = None,
    base: str | None = None,
    stored: Sequence[LeafRecord] | None = None,
) -> str:
    """The text of `README.md` for a folder of the published layout loaded as
    `name_or_path`, holding `files`, tensors of the leaf `records` (`stored`:
    those it holds itself, where a fine-tune takes the others from `base`).
    `found` is `needs(structure, ...)` where already known."""
    found = needs(structure, name_or_path) if found is None else found
    title = info.get("name") if isinstance(info.get("name"), str) else _title(name_or_path)
    description = info.get("description") if isinstance(info.get("description"), str) else ""
    metrics: dict[str, Any] = info["metrics"] if isinstance(info.get("metrics"), dict) else {}
    merged = merge_section(metrics)
    if merged:  # (what `merge` recorded is said there, not as measured metrics)
        about = dataclasses.replace(about, base_model=merged_from(about.base_model, metrics))
        metrics = {k: v for k, v in metrics.items() if not (isinstance(k, str) and k.startswith(MERGE_PREFIX))}
    parts = [front_matter(about, metrics, merged=bool(merged)), f"# {title}\n"]
    if description:
        parts.append(description.strip() + "\n")
    parts.append(
        "An Equinox model published by eqx_ckpt (`pip install eqx_ckpt`): its arrays as "
        f"safetensors (tensor names are dotted key paths), its tree's structure in `{_published.NAME}`. It loads "
        "without its code: no file of it is imported, run or unpickled, and only the classes you trust are built.\n"
    )
    if records:
        parts.append(_size(records, records if stored is None else stored))
    if base is not None:
        parts.append(
            f"It is a fine-tune stored as what changed: it holds only the leaves that differ from its base, "
            f"`{base}`, and every load reads the others from there (for a Hub base through the Hub's cache), pinned "
            f"to that version. The load below needs nothing more; to make a copy that needs no base, run "
            f"`eqx-ckpt export --standalone {name_or_path} <folder>`.\n"
        )
    if merged:
        parts.append(merged)
    parts.append("## Load it\n\n```python\n" + snippet(name_or_path, structure, about=about, found=found) + "```\n")
    parts += _load_notes(name_or_path, about, found)
    if metrics:
        parts.append("## Metrics\n\n| metric | value |\n|---|---|\n" + "".join(_row(k, v) for k, v in metrics.items()))
    parts.append("## Files\n\n" + "".join(f"- `{name}`\n" for name in files))
    if info:
        parts.append("## Metadata\n\n```json\n" + json.dumps(info, indent=2, sort_keys=True) + "\n```\n")
    return "\n".join(parts)


def kept(ckpt: Checkpoint, about: About) -> About:
    """`about` with what the card of `ckpt` says that `about` leaves out (its
    license, its base models), so that a re-export keeps them. Values read
    are checked as `about` checks them; others are left out."""
    license, models, key = None, [], ""
    text = _card_text(ckpt)
    for line in text.split("\n---", 1)[0].split("\n")[1:] if text.startswith("---\n") else []:
        key, value = (key, line[2:]) if line.startswith("- ") else line.partition(":")[::2]
        value = value.strip().strip('"')
        if key == "license" and _LICENSE.fullmatch(value):
            license = value
        elif key == "base_model" and _REPO.fullmatch(value):
            models.append(value)
    return About(about.license or license, about.base_model or tuple(models), about.code)


def _card_text(ckpt: Checkpoint) -> str:
    """The card of the published folder `ckpt` reads (from the Hub at its
    commit), or `""` where there is none to read."""
    source = ckpt._source
    if ckpt.format == "eqx_ckpt":  # (a README.md of its own is no card of the model)
        return ""
    try:
        if source.pinned is None:
            data = _storage.read_file(source.loc, CARD, limit=_CARD_BYTES)
        elif CARD in source.pinned.files():
            folder, _ = _hub.download(source.pinned, [CARD])
            data = _storage.read_file(location(folder), CARD, limit=_CARD_BYTES)
        else:
            data = None
    except CheckpointError:  # (offline, without it in the cache: a card without them)
        return ""
    return "" if data is None else data.decode("utf-8", "replace")


def merge_section(metrics: dict[str, Any]) -> str:
    """The card's "Merge" section, from the `metrics` that `merge` records
    (`merge_method`, `merge_inputs`, ...): the method, each input (an `hf://`
    one at its commit) with its weight, and the options. `""` where they are
    not there, or not as `merge` writes them."""
    method, inputs = metrics.get("merge_method"), _merge_inputs(metrics)
    try:
        weights = _manifest.loads_file(metrics.get("merge_weights") or "null")
    except ValueError:
        return ""
    if not isinstance(method, str) or inputs is None:
        return ""
    if not (isinstance(weights, list) and len(weights) == len(inputs)):
        weights = None
    options = [
        f"{name} {_code(metrics[MERGE_PREFIX + name])}"
        for name in ("base", "density", "t", "key")
        if MERGE_PREFIX + name in metrics
    ]
    said = f": {', '.join(options)}" if options else ""
    rows = "".join(
        f"| {_code(name)} |" + (f" {_cell(json.dumps(weights[i]))} |" if weights else "") + "\n"
        for i, name in enumerate(inputs)
    )
    header = "| input | weight |\n|---|---:|\n" if weights else "| input |\n|---|\n"
    return (
        f"## Merge\n\nA merge of {len(inputs)} models by {_code(method, 100)}, made by `eqx_ckpt.merge`{said}. "
        f"The same inputs and options give the same bytes.\n\n{header}{rows}"
    )


def _merge_inputs(metrics: dict[str, Any]) -> list[str] | None:
    """The inputs `merge` recorded in `metrics` (`merge_inputs`), or `None`
    where they are not there as it writes them."""
    inputs = metrics.get("merge_inputs")
    try:
        inputs = _manifest.loads_file(inputs) if isinstance(inputs, str) else None
    except ValueError:
        return None
    return inputs if isinstance(inputs, list) and all(isinstance(i, str) for i in inputs) else None


def merged_from(models: Sequence[str], metrics: dict[str, Any]) -> tuple[str, ...]:
    """The models a merge's card names as its `base_model`: `models` (those
    the caller named), then the Hub repository of each `hf://` input and base
    that `merge` recorded in `metrics` (read as a load reads the path), once
    each, in that order."""
    found = list(models)
    for name in [*(_merge_inputs(metrics) or []), metrics.get(MERGE_PREFIX + "base")]:
        try:
            hub = location(name).hub if isinstance(name, str) and name.startswith(HUB_SCHEME) else None
        except CheckpointTypeError:  # (not a Hub path a load reads: not named)
            hub = None
        if hub is not None and _REPO.fullmatch(hub.repo) and hub.repo not in found:
            found.append(hub.repo)
    return tuple(found)


def front_matter(about: About, metrics: dict[str, Any], *, merged: bool = False) -> str:
    """The card's YAML front matter, the metadata the Hub reads (`merged`: a
    merge's, tagged `merge`, its base models in the relation `merge`, which
    the Hub draws as the merge's parents in its model tree). Values are
    quoted: YAML would read `no` or `1.0` as a boolean or a number."""
    lines = ["---", "library_name: eqx_ckpt"]
    if about.license is not None:
        lines.append(f'license: "{about.license}"')
    if len(about.base_model) == 1:
        lines.append(f'base_model: "{about.base_model[0]}"')
    elif about.base_model:
        lines += ["base_model:"] + [f'- "{model}"' for model in about.base_model]
    if merged and about.base_model:
        lines.append("base_model_relation: merge")
    lines += ["tags:", "- jax", "- equinox"] + (["- merge"] if merged else [])
    names = [name for name in metrics if _METRIC.fullmatch(name)]
    if names:
        lines += ["metrics:"] + [f'- "{name}"' for name in names]
    return "\n".join([*lines, "---"]) + "\n"


def snippet(name_or_path: str, structure: Any, *, about: About = About(), found: Needs | None = None) -> str:
    """Python that loads the model named `name_or_path` (see the module docstring)."""
    name = json.dumps(name_or_path)
    if structure is None:
        return _as_dicts(name, "It records no structure (exported with `rename`): nested dicts of arrays.")
    found = needs(structure, name_or_path) if found is None else found
    parts = rebuildable(structure, found.code) if found.code else [""]
    if not parts or len(parts) > MAX_PARTS:
        return _as_dicts(name, "Parts of it need the model's code (see below): its arrays as nested dicts.")
    names = [n for n, paths in found.trust.items() if importable(n) and _used(paths, parts)]
    lines = ["import eqx_ckpt"] + [f"import {module}" for module in sorted({n.partition(":")[0] for n in names})]
    lines.append("")
    if found.code:
        lines.append("# Parts of it need the model's code (see below). These rebuild without it.")
    if about.code is not None and names:
        lines.append(f"# The model's code: {_code_source(about.code)}")
    if not names:
        lines.append("# Equinox's layers and JAX's functions are trusted by default.")
    trust = "trust=[" + ", ".join(_trust.python_name(n) for n in names) + "]"
    if not found.code:
        lines.append(f"model = eqx_ckpt.Checkpoint({name}).load({trust})")
    else:
        lines.append(f"ckpt = eqx_ckpt.Checkpoint({name})")
        if len(parts) == 1:
            lines.append(f"part = ckpt.load({json.dumps(parts[0])}, {trust})")
        else:
            lines.append(f"parts = {{prefix: ckpt.load(prefix, {trust}) for prefix in {json.dumps(parts)}}}")
    return "\n".join(lines) + "\n"


def _as_dicts(name: str, comment: str) -> str:
    """A snippet loading the model named `name` (as JSON) as nested dicts of arrays."""
    return f"import eqx_ckpt\n\n# {comment}\nstate = eqx_ckpt.Checkpoint({name}).load()\n"


def _load_notes(name_or_path: str, about: About, found: Needs) -> list[str]:
    """What the card says below the snippet: the code, the parts that need it,
    and the load of a part into a model of one's own."""
    notes = []
    if about.code is not None:
        notes.append(f"The model's code (its classes, for `trust`): {_code_source(about.code, markdown=True)}.\n")
    script = [n for n in found.trust if in_script(n)]
    if script:
        names = ", ".join(f"`{_trust.python_name(n)}`" for n in script)
        notes.append(
            f"It needs {names}, defined in the script that exported it: define them, and add them to `trust`.\n"
        )
    if found.code:
        code = list(found.code.items())
        listed = "".join(f"- `{path or '(the root)'}`: {why}\n" for path, why in code[:MAX_PARTS])
        more = f"- and {len(code) - MAX_PARTS} more\n" if len(code) > MAX_PARTS else ""
        notes.append("These parts cannot be rebuilt without the model's code:\n\n" + listed + more)
        notes.append(
            "With that code, all of it loads into a skeleton the code makes (`make_model` stands for it):\n\n"
            "```python\nimport equinox as eqx\n\n"
            f"like = eqx.filter_eval_shape(make_model)\n"
            f"model = eqx_ckpt.tree_deserialise_leaves({json.dumps(name_or_path)}, like)\n```\n"
        )
    notes.append(
        'A part of it, reading only the selected tensors\' bytes: `.load("<dotted prefix>", trust=[...])`, or '
        f"`eqx_ckpt.tree_deserialise_leaves({json.dumps(name_or_path)}, like, where=...)` into a model of your own.\n"
    )
    return notes


def parameters(records: Iterable[LeafRecord]) -> int:
    """The elements of the floating-point (and complex) arrays among `records`:
    a model's parameter count. Scalars, integers and PRNG keys are left out."""
    return sum(math.prod(r.shape) for r in records if r.type in ("jax", "numpy") and r.dtype.startswith(_INEXACT))


_INEXACT = ("float", "bfloat", "complex")


def _size(records: Sequence[LeafRecord], stored: Sequence[LeafRecord]) -> str:
    """The model's parameters (of every leaf), and the tensors its files hold."""
    count = parameters(records)
    total = sum(r.nbytes for r in stored)
    short = _short(count)
    shown = f"{count:,}" + (f" ({short})" if short != str(count) else "")
    tensors = f"{len(stored)} tensor" + "s" * (len(stored) != 1)
    here = "" if len(stored) == len(records) else " in its files (the others are its base's)"
    return f"**Parameters:** {shown}, in floating-point arrays. {tensors}{here}, {human(total)}.\n"


def _short(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _row(name: Any, value: Any) -> str:
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"| {_cell(name)} | {_cell(shown)} |\n"


def _cell(text: Any, limit: int = 100) -> str:
    """Text as one cell of a Markdown table: one line, no `|`, bounded."""
    return from_file(str(text), limit).replace("|", "\\|")


def _code(text: Any, limit: int = MERGE_SHOWN) -> str:
    """Text as code in a line or a cell of a Markdown table (no backquote in it)."""
    return "`" + _cell(text, limit).replace("`", "'") + "`"


def _code_source(code: str, *, markdown: bool = False) -> str:
    if re.match(r"https?://", code):
        return f"<{code}>" if markdown else code
    return f"`pip install {code}`" if markdown else f"pip install {code}"


def _used(paths: list[str], parts: list[str]) -> bool:
    return any(_keypath.is_within(path, part) for path in paths for part in parts)


def _title(name_or_path: str) -> str:
    name = name_or_path.rstrip("/").split("@")[0]
    return os.path.basename(name) or name
