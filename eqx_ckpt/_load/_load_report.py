"""How a load says what does not match (what is checked is `_load_plan`'s).

Every problem of a plan is raised together as one `LeafError` (`Report`).
Where only whole sub-trees changed shape (a new head), it prints the `where=`
that loads the rest (`narrowed`). A load that matches nothing has its own
errors (`refuse_no_match`, `refuse_unmatched`)."""

from __future__ import annotations

import dataclasses
import keyword
import re
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu

from .._base import _keypath
from .._base._errors import CheckpointValueError, LeafError, describe_leaf, leaf_line
from .._base._location import Location
from .._ondisk._manifest import Manifest

# How many leaves a failed load names; the rest are counted. A forgotten
# `prefix=` on a large tree would otherwise print every leaf.
_SHOWN = 12
_SHOWN_UNEXPECTED = 8


class Report:
    """Every problem a load finds, raised together as one `LeafError`."""

    def __init__(self, loc: Location, *, cast: bool = False):
        self.loc = loc
        self.cast = cast
        self.lines: list[str] = []
        # Each line but the first says its leaf once: `dotted` (key path ...).
        self.short: list[str] = []
        self.kinds: set[str] = set()
        self.keypaths: list[tuple[Any, ...]] = []
        self.dotted: list[str] = []
        self.unexpected: list[str] = []
        # The first exception behind a problem (a `transform` that raised): the error chains it.
        self.cause: Exception | None = None
        # The leaves whose shape changed, and the `where` leaving them out, where one fits.
        self.reshaped: set[tuple[Any, ...]] = set()
        self.narrowing: Narrowing | None = None

    def add(self, kind: str, what: str, keypath: tuple[Any, ...] | None, stored: str) -> None:
        """A problem of the leaf of `like` at `keypath` (`None`: a stored leaf `like` lacks)."""
        self.lines.append("  - " + _clip(leaf_line(f"{kind}: {what}", keypath=keypath, dotted=stored)))
        self.short.append("  - " + _clip(f"{describe_leaf(keypath, stored)}: {kind}: {_EQUINOX.sub('', what)}"))
        self.kinds.add(kind)
        if keypath is not None:
            self.keypaths.append(keypath)
            if kind == "shape changed":
                self.reshaped.add(keypath)
        self.dotted.append(stored)

    def add_transform(
        self, keypath: tuple[Any, ...], stored: str | tuple[str, ...], problem: str, *, cause: Exception | None = None
    ) -> None:
        """A problem of a transformed leaf: `missing: ...`, or one of the transform
        (`cause`: the exception it raised)."""
        if self.cause is None:
            self.cause = cause
        kind, sep, what = problem.partition(": ")
        kind, what = (kind, what) if sep and kind == "missing" else ("transform", problem)
        self.add(kind, what, keypath, ", ".join(stored) if isinstance(stored, tuple) else stored)

    def raise_if_any(self) -> None:
        if not self.lines:
            return
        count = len(self.lines)
        # The first leaf in Equinox's words (code written against Equinox's
        # message matches it), the others each named once.
        shown = self.lines[:1] + self.short[1:_SHOWN]
        if count > _SHOWN:
            shown.append(f"  ... and {count - _SHOWN} more (the error's `dotted` attribute lists them all).")
        if self.unexpected and "missing" in self.kinds:
            extra = len(self.unexpected) - _SHOWN_UNEXPECTED
            shown.append(
                "Stored leaves that `like` lacks (perhaps the missing ones, renamed):\n"
                + "\n".join(
                    _clip(f"  + `{path}` (stored, not in `like`)") for path in self.unexpected[:_SHOWN_UNEXPECTED]
                )
                + (f"\n  ... and {extra} more." if extra > 0 else "")
            )
        error = LeafError(
            f"Cannot load checkpoint {self.loc.display!r} into `like`: {count} "
            f"lea{'f does' if count == 1 else 'ves do'} not match.\n" + "\n".join(shown) + "\n" + self._fixes(),
            path=self.loc.display,
            keypaths=self.keypaths,
            dotted=self.dotted,
        )
        if self.cause is not None:
            raise error from self.cause
        raise error

    def _fixes(self) -> str:
        if self.narrowing is not None and self.kinds == {"shape changed"}:
            return self.narrowing.fix()
        fixes = []
        if "missing" in self.kinds:
            fixes.append("`missing='keep'` keeps `like`'s value for missing leaves")
            fixes.append("`where=`/`prefix=`/`rename=` pick and map what is loaded")
        if "dtype changed" in self.kinds and not self.cast:
            fixes.append("`cast=True` converts dtypes (an error if a value would change beyond rounding)")
        if "shape changed" in self.kinds:
            fixes.append("shapes must match: build `like` with the saved shapes")
        if "unexpected" in self.kinds:
            fixes.append("`strict=False` allows stored leaves that `like` lacks")
        return ("To load anyway: " + "; ".join(fixes) + ".") if fixes else ""


# At most this many changed sub-trees are left out by a suggested `where`:
# more is another model, not a new head.
_NARROWED = 4


@dataclasses.dataclass(frozen=True)
class Narrowing:
    """The sub-trees of `like` that changed shape as a whole, and the `where`
    that loads every other selected leaf, as Python text a user can paste."""

    changed: list[str]
    selector: str

    def fix(self) -> str:
        many = len(self.changed) > 1
        names = ", ".join(f"`{c}`" for c in self.changed[:-1]) + " and " if many else ""
        names += f"`{self.changed[-1]}`"
        return (
            f"To load anyway: every leaf that changed shape is in {names}, "
            f"{'sub-trees that each' if many else 'a sub-tree that'} changed as a whole (a new head). "
            f"Load the rest with\n    where={self.selector}\n"
            f"`load_or_initialise` initialises what `where` leaves out; `tree_deserialise_leaves` keeps "
            f"`like`'s values there. Or build `like` with the saved shapes."
        )


def narrowed(leaves: Sequence[tuple[tuple[Any, ...], str]]) -> Narrowing | None:
    """The `where` that leaves out the sub-trees of `like` that changed shape as
    a whole. `leaves`: each leaf a load reads, in order, with its state:
    `"changed"` (shape), `"kept"` (selected, fits) or `"out"` (not selected).
    `None` where no such `where` fits (a weight changed but not its bias, too
    many sub-trees changed, a key with no Python spelling, nothing left)."""
    root = _Node()
    for keypath, state in leaves:
        root.add(keypath, state)
    changed: list[tuple[Any, ...]] = []
    if "kept" not in root.states or not root.changed_parts((), changed) or not 0 < len(changed) <= _NARROWED:
        return None
    kept = _sliced(root.kept_parts(()))
    var = "m" if all(isinstance(key, jtu.GetAttrKey) for key in root.children) else "t"
    spelt = [_spelt(var, part) for part in changed] + [_spelt(var, *run) for run in kept]
    shown = [text for text in spelt if text is not None]
    if len(shown) < len(spelt):
        return None
    parts = shown[len(changed) :]
    whole = parts[0].lstrip("*") if len(parts) == 1 else f"({', '.join(parts)})"
    return Narrowing(shown[: len(changed)], f"lambda {var}: {whole}")


class _Node:
    """A node of `like`, as far as the key paths of the leaves below it say."""

    __slots__ = ("children", "states")

    def __init__(self) -> None:
        self.children: dict[Any, _Node] = {}
        self.states: set[str] = set()

    def add(self, keypath: tuple[Any, ...], state: str) -> None:
        node = self
        node.states.add(state)
        for key in keypath:
            node = node.children.setdefault(key, _Node())
            node.states.add(state)

    def changed_parts(self, here: tuple[Any, ...], out: list[tuple[Any, ...]]) -> bool:
        """Add to `out` the largest sub-trees holding changed leaves and no kept
        one; `False` where a changed leaf sits beside a kept leaf (not a sub-tree)."""
        for key, child in self.children.items():
            if "changed" not in child.states:
                continue
            if "kept" in child.states:
                if not child.changed_parts((*here, key), out):
                    return False
                continue
            if not child.children and any(not c.children and "kept" in c.states for c in self.children.values()):
                return False
            out.append((*here, key))
        return True

    def kept_parts(self, here: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """The largest sub-trees holding kept leaves only, in order."""
        if self.states == {"kept"}:
            return [here]
        return [
            part
            for key, child in self.children.items()
            if "kept" in child.states
            for part in child.kept_parts((*here, key))
        ]


def _sliced(parts: list[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], int]]:
    """`parts` as `(key path, count)`: three or more consecutive items of one
    sequence as one slice from the first."""
    runs: list[list[tuple[Any, ...]]] = []
    for part in parts:
        if runs and _follows(runs[-1][-1], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return [item for run in runs for item in ([(run[0], len(run))] if len(run) >= 3 else [(p, 1) for p in run])]


def _follows(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether `b` is the item after `a` in one sequence."""
    keys = (a[-1], b[-1]) if a and b and a[:-1] == b[:-1] else ()
    return all(isinstance(k, jtu.SequenceKey) for k in keys) and bool(keys) and b[-1].idx == a[-1].idx + 1


def _spelt(var: str, keypath: tuple[Any, ...], count: int = 1) -> str | None:
    """The Python expression of the node at `keypath` of `var` (with `count` > 1:
    the starred slice of that many items from it); `None` where a key has no
    spelling (a flattened index, an odd dict key)."""
    text = var
    for key in keypath[:-1] if count > 1 else keypath:
        spelt = _key_text(key)
        if spelt is None:
            return None
        text += spelt
    if count > 1:
        start = keypath[-1].idx
        text = f"*{text}[{start or ''}:{start + count}]"
    return text


def _key_text(key: Any) -> str | None:
    if isinstance(key, jtu.GetAttrKey):
        name = key.name
        return f".{name}" if name.isidentifier() and not keyword.iskeyword(name) else None
    if isinstance(key, jtu.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, jtu.DictKey) and type(key.key) in (str, int):
        return f"[{key.key!r}]"
    return None


# Equinox's words before what changed, which a leaf's line after the first leaves out.
_EQUINOX = re.compile(r"^Deserialised leaf at path .*? has changed \w+ (?=from )")


def _clip(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else line[: limit - 5] + " ...]"


def refuse_no_match(
    wanted: Sequence[Any],
    custom: Sequence[tuple[Any, Any]],
    changed: Sequence[Any],
    manifest: Manifest,
    loc: Location,
    root: str,
) -> None:
    """A load that finds none of `like`'s leaves is almost always a forgotten
    `prefix=`, or the wrong checkpoint: never return `like` unchanged for it.
    `wanted`, `custom`, `changed`: the plans of the leaves the load reads,
    those custom filter specs read, and the transformed ones."""
    found = [*wanted, *(plan for plan, _ in custom)]
    if not wanted or changed or any(plan.record is not None for plan in found):
        return
    looked = ", ".join(f"`{plan.stored}`" for plan in wanted[:3]) + (", ..." if len(wanted) > 3 else "")
    below = keys_below(manifest, root)
    if not below:
        where, hint = "it holds no leaves", "Check the path."
    elif not root and below == [""]:
        where, hint = "it holds one array, saved as the whole tree", "Load it into a `like` that is one array leaf."
    elif not root:
        where = f"its top-level keys are {shown_keys(below)}"
        hint = f"If `like` is one part of what was saved, pass `prefix=` naming it (e.g. `prefix={below[0]!r}`)."
    elif below == [""]:
        parent = root.rpartition(".")[0]
        where = f"`prefix` {root!r} names one leaf, so `like` must be that leaf alone"
        hint = f"To load the sub-tree holding it, pass `prefix={parent!r}`." if parent else "Pass no `prefix`."
    else:
        where = f"its keys below `prefix` {root!r} are {shown_keys(below)}"
        hint = "Check `prefix=` and `rename=` against `Checkpoint(path).keys()`."
    raise LeafError(
        f"None of the {len(wanted)} leaves of `like` is in checkpoint {loc.display!r} "
        f"(looked for {looked}); {where}. {hint}",
        path=loc.display,
        keypaths=[plan.keypath for plan in wanted[:_SHOWN]],
        dotted=[plan.stored for plan in wanted],
    )


def keys_below(manifest: Manifest, root: str) -> list[str]:
    """The first segments of the paths below dotted `root`, sorted (`""`: `root` is a leaf)."""
    firsts = set()
    for leaf in manifest.leaves:
        if _keypath.is_within(leaf.path, root):
            rest = _keypath.split_dotted(_keypath.relative(leaf.path, root))
            firsts.add(rest[0] if rest else "")
    return sorted(firsts, key=_keypath.sort_key)


def shown_keys(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:20]) + (", ..." if len(keys) > 20 else "") if keys else "(none)"


@dataclasses.dataclass(frozen=True)
class Unmatched:
    """A key of a `rename` or `transform` mapping (`option`) that names no leaf of `like`."""

    option: str
    key: str
    # Whether the key is a name in the checkpoint (below `prefix`, or from its root).
    stored: bool
    # The leaves of `like` loaded from that stored name: the key to write instead.
    loaded_from: list[str]
    # The paths of `like` nearest to the key.
    near: list[str]


def refuse_unmatched(shown: Sequence[Unmatched], options: set[str], count: int, loc: Location) -> None:
    """Refuse a load whose `rename` or `transform` mappings (`options`) have `count`
    keys that name no leaf of `like` (`shown`: the first of them)."""
    which = " and ".join(f"`{option}`" for option in sorted(options))
    lines = [f"  - {_clip(_unmatched_line(u))}" for u in shown]
    if count > len(shown):
        lines.append(f"  ... and {count - len(shown)} more.")
    many = count > 1
    raise CheckpointValueError(
        f"Cannot load checkpoint {loc.display!r}: {count} key{'s' if many else ''} of {which} "
        f"name{'' if many else 's'} no leaf of `like`, so {'they' if many else 'it'} would silently apply to "
        f"nothing; nothing was read.\n"
        + "\n".join(lines)
        + "\nKeys of `rename` and `transform` are dotted paths of `like` (spelled as `Checkpoint(path).keys()` "
        "spells stored ones; a `rename` key may name a sub-tree); values of `rename` are paths in the checkpoint "
        "(below `prefix`). (Lists of rules and callables are not checked this way.)",
        path=loc.display,
    )


def _unmatched_line(u: Unmatched) -> str:
    line = f"`{u.option}` key `{u.key}` names no leaf of `like`"
    if u.stored:
        line += f": `{u.key}` is a name in the checkpoint; keys of `{u.option}` name leaves of `like`"
        line += ", its values name paths in the checkpoint" if u.option == "rename" else ""
        if u.loaded_from:
            line += f" ({', '.join(f'`{p}`' for p in u.loaded_from)} {'is' if len(u.loaded_from) == 1 else 'are'} "
            line += f"loaded from it: write `{u.loaded_from[0]}`)"
    return line + f". The nearest paths of `like`: {', '.join(f'`{p}`' for p in u.near) or '(none)'}."
