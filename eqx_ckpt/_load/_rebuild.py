"""A saved tree rebuilt from its structure record (`_structure`), with no code of the model's.

The record is untrusted input, read in three passes:

1. **Check** (`_Check`): every node and value well formed and within limits;
   every class, function and enum named is collected with the key paths that
   use it. Nothing is built, imported or called.
2. **Trust** (`_trust.Trust`): every name resolved among the trusted objects;
   one error names all that are not.
3. **Build** (`_Build`): containers as themselves; a dataclass-style object
   (`eqx.Module`) by `object.__new__` and `object.__setattr__` of its fields,
   as `jax.tree_util.tree_unflatten` does for Equinox, so no `__init__`,
   `__post_init__` or `__check_init__` runs (unless `check_init=True` asks for
   the last); a namedtuple by `tuple.__new__`; another registered node by its
   own unflatten function. Each stored leaf becomes `abstract`'s stand-in.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import operator
import re
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from .._base import _faults, _gc, _keypath, _state, _tree
from .._base._errors import (
    CheckpointError,
    CheckpointKeyError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    UntrustedError,
    caller_level,
    from_file,
)
from .._ondisk import _iterators, _structure
from .._ondisk._dtypes import is_known_dtype
from .._ondisk._format import LeafRecord, dtype_from_name
from .._ondisk._manifest import Manifest, encode_structure, loads_file, too_many_containers
from .._ondisk._trust import Trust, python_name

# Limits on an untrusted record, far beyond any model's. Its JSON containers
# are counted before it is parsed, so a record far larger than its stored
# leaves warrant is refused before any of it is walked. It may hold at most
# `NODES_PER_LEAF` a stored leaf (a saved tree has 4 to 17 a leaf),
# `NODES_BASE` more (static values: room for a vocabulary of about 190,000
# strings), and never more than `MAX_NODES`.
MAX_NODES = 5_000_000
NODES_PER_LEAF = 100
NODES_BASE = 200_000
MAX_NAME = 1_000
MAX_STRING = 1 << 20
_NAME_KINDS = ("object", "namedtuple", "node")


def no_record(manifest: Manifest, where: str) -> CheckpointValueError:
    """The error of a load without `like` from a checkpoint that records no
    structure: another format's (its layout names it), or an older eqx_ckpt's."""
    if manifest.layout == "published":
        why = "it was exported with leaves renamed or left out (`rename`), so its eqx_ckpt.json records no structure"
    elif manifest.layout in ("safetensors", "orbax"):  # the layouts other formats are read into
        why = f"it is a {manifest.layout} checkpoint, which names its tensors but records no classes"
    else:
        why = (
            f"it was written in format version {manifest.format_version}, before eqx_ckpt recorded structure "
            f"(format 5, eqx_ckpt 0.2)"
        )
    return CheckpointValueError(
        f"Checkpoint {where!r} cannot be rebuilt without the model's code: {why}. Pass a skeleton as `like` "
        f"instead: `eqx_ckpt.tree_deserialise_leaves({where!r}, like)` with "
        f"`like = eqx.filter_eval_shape(make_model, ...)`; `Checkpoint(path).load()` without `trust` gives "
        f"nested dicts.",
        path=where,
    )


def record_of(manifest: Manifest, where: str) -> Any:
    """The structure record of `manifest` parsed (`None`: it has none), refused
    first past `node_cap` containers or JSON's nesting limit."""
    text = manifest.structure
    if text is None:
        return None
    cap = node_cap(len(manifest.leaves))
    why = too_many_containers(text, cap)
    if why is not None:
        allowed = f"{NODES_PER_LEAF} a stored leaf and {NODES_BASE} more, {MAX_NODES} at most"
        raise _corrupt(where, "", f"{why} for a tree of {len(manifest.leaves)} stored leaves ({allowed})")
    try:
        return loads_file(text)
    except ValueError as e:
        raise _corrupt(where, "", str(e)) from None


def node_cap(stored: int) -> int:
    """The most JSON containers a structure record of `stored` stored leaves may hold."""
    return min(MAX_NODES, NODES_PER_LEAF * stored + NODES_BASE)


def subtree(manifest: Manifest, prefix: str, where: str) -> dict[str, Any]:
    """The record node at dotted `prefix` (checked only as far as the way
    there); `no_record`'s error where the manifest has no record."""
    node = record_of(manifest, where)
    if node is None:
        raise no_record(manifest, where)
    here = ""
    for segment in _keypath.split_dotted(prefix) if prefix else ():
        found = None
        for key, child in _structure.children(_checked_shape(node, where, here)):
            if _keypath.stored_segment(*_checked_key(key, where, here)) == segment:
                found = child
                break
        if found is None:
            raise CheckpointKeyError(
                f"Checkpoint {where!r} has no sub-tree `{prefix}` in its saved structure (no node `{segment}` "
                f"under `{here or '(the root)'}`). `Checkpoint(path).keys()` lists the saved leaves.",
                path=where,
            )
        node, here = found, _keypath.join_dotted(here, segment)
    return _checked_shape(node, where, here)


def names(node: dict[str, Any], prefix: str, where: str) -> dict[str, list[str]]:
    """Every class, function and enum the sub-tree `node` names, with the dotted
    paths that use each (the record checked on the way)."""
    return _Check(where).walk(node, prefix).names


def unrecordable(node: dict[str, Any], prefix: str, where: str) -> dict[str, str]:
    """The parts of the sub-tree `node` a save could not record (a lambda, a
    closure), by dotted path, each with why (the record checked on the way)."""
    return _Check(where).walk(node, prefix).unrecordable


def unrecordable_error(where: str, path: str, why: str) -> CheckpointValueError:
    """What a load without `like` says of a part a save could not record."""
    return CheckpointValueError(
        f"Checkpoint {where!r} cannot rebuild `{from_file(path) or '(the root)'}` without the model's code: "
        f"when it was saved, that part was {from_file(why)}, which a checkpoint cannot record as data. Load "
        f"it with a skeleton: pass `like` (for example `eqx.filter_eval_shape(make_model, ...)`), or "
        f"rebuild another sub-tree with `prefix=`.",
        path=where,
    )


def skeleton(
    manifest: Manifest,
    prefix: str,
    trust: Trust,
    *,
    where: str,
    check_init: bool = False,
) -> Any:
    """The sub-tree at `prefix` rebuilt (see the module docstring)."""
    node = subtree(manifest, prefix, where)
    needed = names(node, prefix, where)
    _require_trusted(needed, trust, where)
    tree = _Build(trust, where).node(node, prefix)
    tree = _fill(tree, prefix, manifest.by_path(), where)
    if check_init:
        _check_inits(tree, prefix, where)
    return tree


def _check_inits(tree: Any, prefix: str, where: str) -> None:
    """Run every Equinox module's `__check_init__`s as Equinox does after
    `__init__` (base classes first), under `jax.eval_shape` so `jnp.sum(self.w)`
    works on the abstract arrays; what one raises is a `CheckpointValueError`."""
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    dynamic, static = eqx.partition(tree, is_abstract, is_leaf=is_abstract)
    jax.eval_shape(lambda d: _run_check_inits(eqx.combine(d, static), prefix, where), dynamic)


def _run_check_inits(tree: Any, prefix: str, where: str) -> None:
    stack = [(prefix, tree)]
    while stack:
        path, node = stack.pop()
        children = jtu.tree_flatten_with_path(node, is_leaf=functools.partial(operator.is_not, node))[0]
        if len(children) == 1 and children[0][1] is node:
            continue  # a leaf
        stack.extend((_keypath.join_dotted(path, _keypath.dotted(keypath)), child) for keypath, child in children)
        if not isinstance(node, eqx.Module):
            continue
        for klass in reversed(type(node).__mro__):
            check = vars(klass).get("__check_init__")
            try:
                if check is not None:
                    check(node)
            except Exception as e:
                raise CheckpointValueError(
                    f"Checkpoint {where!r}: `__check_init__` of {type(node).__qualname__} refused the rebuilt "
                    f"`{path or '(the root)'}` ({type(e).__name__}: {str(e)[:300]}). The checkpoint's values "
                    f"fail the class's own check: load with `check_init=False` only if you trust them.",
                    path=where,
                ) from e


def _require_trusted(needed: dict[str, list[str]], trust: Trust, where: str) -> None:
    missing = {name: paths for name, paths in needed.items() if trust.resolve(name) is None}
    if not missing:
        return
    lines = []
    for name, paths in sorted(missing.items()):
        shown = ", ".join(f"`{from_file(p) or '(the root)'}`" for p in paths[:3])
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        lines.append(f"  {from_file(name)} (at {shown}{more})")
    exact = ", ".join(sorted({from_file(_public_name(name)) for name in missing}))
    packages = ", ".join(sorted({from_file(_package(name)) for name in missing}))
    raise UntrustedError(
        f"Checkpoint {where!r} holds classes or functions that are not trusted, so it was not rebuilt "
        f"(nothing was imported or run):\n" + "\n".join(lines) + f"\nIf you trust them, import them and pass "
        f"`trust=[{exact}]`"
        + (f", or trust their packages: `trust=[{packages}]`" if packages != exact else "")
        + " (a module trusts every class and function defined in it and its submodules).",
        path=where,
    )


def _public_name(name: str) -> str:
    """How a user writes the object recorded as `name`: by its top-level package
    where that holds the very same object (`optax.ScaleByAdamState`), else by its
    own module. Only the `vars` of modules imported already are looked in."""
    module, _, qualname = name.partition(":")
    top = module.partition(".")[0]
    holder, package = sys.modules.get(module), sys.modules.get(top)
    if top != module and holder is not None and package is not None:
        found = vars(holder).get(qualname)
        if found is not None and vars(package).get(qualname) is found:
            return f"{top}.{qualname}"
    return python_name(name)


def _package(name: str) -> str:
    """The top-level package of the object recorded as `name` (a script's own
    classes stay as they are: `__main__` is not a package to trust whole)."""
    module = name.partition(":")[0]
    return python_name(name) if module == "__main__" else module.partition(".")[0]


class _Check:
    """The first pass: shapes, limits, and the names used (see the module docstring)."""

    def __init__(self, where: str):
        self.where, self.count = where, 0
        self.names: dict[str, list[str]] = {}
        self.unrecordable: dict[str, str] = {}

    def bad(self, path: str, why: str) -> CorruptCheckpointError:
        return _corrupt(self.where, path, why)

    def walk(self, node: Any, path: str) -> _Check:
        stack = [(node, path, 0)]
        while stack:
            current, here, level = stack.pop()
            self.count += 1
            if self.count > MAX_NODES or level > _structure.MAX_DEPTH + 1:
                raise self.bad(here, "it is larger or deeper than any saved tree can be")
            current = _checked_shape(current, self.where, here)
            kind = current["t"]
            if kind in _NAME_KINDS:
                self.name(current["cls"], here)
            if kind == "unrecordable":
                self.unrecordable[here] = current["why"]
            if kind in ("value", "node"):
                self.value(current["v" if kind == "value" else "aux"], here, 0)
            segments = []
            for key, child in _structure.children(current):
                segment = _keypath.stored_segment(*_checked_key(key, self.where, here))
                segments.append(segment)
                stack.append((child, _keypath.join_dotted(here, segment), level + 1))
            if kind == "dict":
                self.dict_keys(current["k"], segments, here)
        return self

    def dict_keys(self, keys: list[Any], segments: list[str], path: str) -> None:
        """A dict node's keys: all strings or all integers (JAX sorts them), each once."""
        if len({kind for kind, _ in keys}) > 1:
            raise self.bad(path, "a dict node mixes string and integer keys, which no saved dict can")
        if len(set(segments)) != len(segments):
            raise self.bad(path, "a dict node names a key twice")

    def name(self, name: Any, path: str) -> None:
        if type(name) is not str or len(name) > MAX_NAME or name.count(":") != 1:
            raise self.bad(path, f"the class name {from_file(name, 80)!r} is not `module:qualname`")
        self.names.setdefault(name, []).append(path)

    def value(self, v: Any, path: str, depth: int) -> None:
        self.count += 1
        if depth > _structure.MAX_VALUE_DEPTH or self.count > MAX_NODES:
            raise self.bad(path, "a value nests deeper than any saved value can")
        if v is None or type(v) in (bool, int, float):
            return
        if type(v) is str:
            if len(v) > MAX_STRING:
                raise self.bad(path, f"a string of {len(v)} characters is longer than any saved value")
            return
        tag = next(iter(v), None) if type(v) is dict else None
        if tag is None or set(v) != ({tag, "name"} if tag == "enum" else {tag}):
            raise self.bad(path, f"the value {_peek(v)} is not one a save records")
        self._tagged(tag, v, path, depth)

    def _tagged(self, tag: str, v: dict[str, Any], path: str, depth: int) -> None:
        body = v[tag]
        if tag in ("tuple", "list") and type(body) is list:
            for item in body:
                self.value(item, path, depth + 1)
        elif tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            for pair in body:
                if not _hashable(pair[0]):
                    raise self.bad(path, f"the dict value {_peek(v)} has a key {_peek(pair[0])} no dict can hold")
                self.value(pair[0], path, depth + 1)
                self.value(pair[1], path, depth + 1)
        elif tag == "complex" and type(body) is list and len(body) == 2 and all(map(_is_part, body)):
            pass
        elif tag == "numpy" and type(body) is list and len(body) == 2 and _is_dtype(body[0]):
            if type(body[1]) not in (bool, int, float) and not (type(body[1]) is dict and set(body[1]) <= _SCALAR_TAGS):
                raise self.bad(path, f"the NumPy scalar {_peek(v)} holds no number")
            self.value(body[1], path, depth + 1)
        elif tag in ("dtype", "scalar_type", "jnp_type") and _is_dtype(body):
            pass
        elif tag == "float" and body in ("nan", "inf", "-inf"):
            pass
        elif tag in ("function", "enum") and (tag == "function" or type(v.get("name")) is str):
            self.name(body, path)
        else:
            raise self.bad(path, f"the value {_peek(v)} is not one a save records")


def _checked_shape(node: Any, where: str, path: str) -> dict[str, Any]:
    """`node` if its own fields are well formed (not its children's)."""
    if type(node) is not dict or type(node.get("t")) is not str:
        raise _corrupt(where, path, f"the node {_peek(node)} has no kind")
    kind = node["t"]
    fields = _FIELDS.get(kind)
    if fields is None:
        raise _corrupt(where, path, f"the node kind {kind[:40]!r} is not one a save records")
    if set(node) != fields:
        raise _corrupt(where, path, f"a `{kind}` node has the fields {sorted(node)[:8]}, not {sorted(fields)}")
    if "c" in fields and type(node["c"]) is not list:
        raise _corrupt(where, path, f"a `{kind}` node's children are not a list")
    if kind in ("dict", "node") and (type(node["k"]) is not list or len(node["k"]) != len(node["c"])):
        raise _corrupt(where, path, f"a `{kind}` node has not one key per child")
    if kind in ("namedtuple", "object"):
        _check_fields(node, where, path)
    if kind == "unrecordable" and type(node["why"]) is not str:
        raise _corrupt(where, path, "an unrecordable node does not say why")
    return node


def _check_fields(node: dict[str, Any], where: str, path: str) -> None:
    f = node["f"]
    if type(f) is not list or len(f) != len(node["c"]) or not all(type(x) is str and x.isidentifier() for x in f):
        raise _corrupt(where, path, "a node's fields are not one identifier per child")
    if len(set(f)) != len(f):
        raise _corrupt(where, path, f"a node of class {from_file(node['cls'])!r} lists a field twice")


_FIELDS = types.MappingProxyType(
    {
        "leaf": frozenset({"t"}),
        "none": frozenset({"t"}),
        "value": frozenset({"t", "v"}),
        "unrecordable": frozenset({"t", "why"}),
        "dict": frozenset({"t", "k", "c"}),
        "list": frozenset({"t", "c"}),
        "tuple": frozenset({"t", "c"}),
        "namedtuple": frozenset({"t", "cls", "f", "c"}),
        "object": frozenset({"t", "cls", "f", "c"}),
        "node": frozenset({"t", "cls", "aux", "k", "c"}),
    }
)


def _checked_key(key: Any, where: str, path: str) -> tuple[str, Any]:
    try:
        _keypath.check_json([key])
    except ValueError as e:
        raise _corrupt(where, path, f"a child's key is malformed ({e})") from None
    if key[0] in ("key_repr", "other"):
        raise _corrupt(where, path, f"a child's key {_peek(key)} is not one a save records")
    return key[0], key[1]


_SCALAR_TAGS = frozenset({"float", "complex"})


def _is_part(x: Any) -> bool:
    """Whether `x` is the real or imaginary part of a recorded `complex`: a
    finite float, an integer a float holds, or `{"float": "nan" | "inf" | "-inf"}`."""
    if type(x) is float or (type(x) is int and abs(x) < 2**1000):
        return True
    return type(x) is dict and set(x) == {"float"} and x["float"] in ("nan", "inf", "-inf")


def _hashable(key: Any) -> bool:
    """Whether the value `key` (checked by `_Check.value` next) builds an
    object a dict can hold as a key: a scalar, or a tuple of such."""
    if key is None or type(key) in (bool, int, float, str):
        return True
    if type(key) is not dict or not key:
        return False
    tag = next(iter(key))
    if tag == "tuple":
        return type(key[tag]) is list and all(map(_hashable, key[tag]))
    return tag not in ("list", "dict")


def _is_dtype(name: Any) -> bool:
    return type(name) is str and is_known_dtype(name)


def _peek(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _corrupt(where: str, path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"The structure record of checkpoint {where!r} is invalid at `{from_file(path) or '(the root)'}`: {why}. The "
        f"checkpoint is damaged or was not written by eqx_ckpt; do not rebuild it (a load with `like` does "
        f"not read the structure record).",
        path=where,
    )


# A stored leaf's place in the rebuilt tree, filled by `_fill`.
_SLOT = object()


class _Build:
    """The third pass: objects made from a checked record of trusted names."""

    def __init__(self, trust: Trust, where: str):
        self.trust, self.where = trust, where

    def node(self, node: dict[str, Any], path: str) -> Any:
        kind = node["t"]
        if kind == "leaf":
            return _SLOT
        if kind == "none":
            return None
        if kind == "value":
            return self.value(node["v"], path)
        if kind == "unrecordable":
            raise unrecordable_error(self.where, path, node["why"])
        built = [
            self.node(child, _keypath.join_dotted(path, _keypath.stored_segment(*key)))
            for key, child in _structure.children(node)
        ]
        if kind == "dict":
            return {key[1]: child for key, child in zip(node["k"], built)}
        if kind == "list":
            return built
        if kind == "tuple":
            return tuple(built)
        return self._custom(node, built, path)

    def _custom(self, node: dict[str, Any], built: list[Any], path: str) -> Any:
        cls = self.trust.resolve(node["cls"])
        kind, name = node["t"], from_file(node["cls"])
        if not inspect.isclass(cls):
            raise _corrupt(self.where, path, f"{name!r} names a function where a class belongs")
        if kind == "namedtuple":
            return self._namedtuple(cls, node, built, path)
        if kind == "object":
            return self._object(cls, node, built, path)
        if dataclasses.is_dataclass(cls):
            # Its own unflatten would take `__module__`, `__doc__`... from `aux`.
            raise _corrupt(self.where, path, f"the dataclass {name!r} is recorded as another node, not an `object`")
        aux = self.value(node["aux"], path)
        one_level: Any = jtu.tree_structure(0)
        try:
            treedef = one_level.from_node_data_and_children(jtu.default_registry, (cls, aux), [one_level] * len(built))
            return treedef.unflatten(built)
        except Exception as e:  # a class not registered, or aux it refuses: the record does not fit the class
            # Some unflatten functions raise with no message (`State`'s `assert`): name the error then.
            why = from_file(f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__}, with no message")
            raise _corrupt(self.where, path, f"the class {name!r} does not rebuild from it ({why})") from None

    def _namedtuple(self, cls: type, node: dict[str, Any], built: list[Any], path: str) -> Any:
        fields = getattr(cls, "_fields", None)
        if not (issubclass(cls, tuple) and isinstance(fields, tuple)):
            raise _corrupt(self.where, path, f"{from_file(node['cls'])!r} is not a namedtuple class")
        values = dict(zip(node["f"], built))
        defaults = getattr(cls, "_field_defaults", {})
        self._same_fields(node, list(fields), set(defaults), path)
        return tuple.__new__(cls, [values[f] if f in values else defaults[f] for f in fields])

    def _object(self, cls: type, node: dict[str, Any], built: list[Any], path: str) -> Any:
        name = from_file(node["cls"])
        if not dataclasses.is_dataclass(cls):
            raise _corrupt(self.where, path, f"{name!r} is not a dataclass-style class (such as `eqx.Module`)")
        if cls.__new__ is not object.__new__ and not issubclass(cls, eqx.Module):
            # A dataclass that subclasses `dict` or `tuple` is made by its base, not by `object.__new__`.
            raise _corrupt(self.where, path, f"the dataclass {name!r} is not one a save records as an `object`")
        fields = dataclasses.fields(cls)
        defaulted = {f.name for f in fields if _has_default(f)}
        self._same_fields(node, [f.name for f in fields], defaulted, path)
        values = dict(zip(node["f"], built))
        obj = object.__new__(cls)
        for f in fields:
            object.__setattr__(obj, f.name, values[f.name] if f.name in values else _default(f))
        return obj

    def _same_fields(self, node: dict[str, Any], now: list[str], defaulted: set[str], path: str) -> None:
        recorded = node["f"]
        extra = [f for f in recorded if f not in now]
        lacking = [f for f in now if f not in recorded and f not in defaulted]
        if extra or lacking:
            raise CheckpointTypeError(
                f"Checkpoint {self.where!r} saved `{path or '(the root)'}` as a {from_file(python_name(node['cls']))} "
                f"with the fields {recorded}, but that class now has the fields {now}"
                + (f" (the saved {extra} are gone" if extra else " (")
                + (f"{'; ' if extra else ''}{lacking} are new and have no default)" if lacking else ")")
                + ". The class changed since the save: load with the class as it was, or "
                + _remedy(path, extra, [f for f in now if f not in recorded]),
                path=self.where,
            )

    def value(self, v: Any, path: str) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        tag = next(iter(v))
        body = v[tag]
        if tag in ("tuple", "list"):
            items = [self.value(x, path) for x in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict":
            out = {self.value(k, path): self.value(x, path) for k, x in body}
            if len(out) != len(body):
                raise _corrupt(self.where, path, f"the dict value {_peek(v)} names a key twice")
            return out
        if tag == "complex":
            return complex(self.value(body[0], path), self.value(body[1], path))
        if tag == "float":
            return float(body)
        return self._named_value(tag, v, body, path)

    def _named_value(self, tag: str, v: dict[str, Any], body: Any, path: str) -> Any:
        if tag == "dtype":
            return dtype_from_name(body)
        if tag == "scalar_type":
            return dtype_from_name(body).type
        if tag == "jnp_type":
            found = getattr(jax.numpy, body, None)
            if not isinstance(found, _structure.JNP_TYPE):
                raise _corrupt(self.where, path, f"`jax.numpy` has no scalar type {body!r}")
            return found
        if tag == "numpy":
            try:
                with np.errstate(over="raise", invalid="raise"):  # a float past float32's range: refused, not inf
                    return dtype_from_name(body[0]).type(self.value(body[1], path))
            except (OverflowError, TypeError, ValueError, FloatingPointError) as e:
                raise _corrupt(self.where, path, f"the NumPy scalar {_peek(v)} does not hold ({e})") from None
        obj = self.trust.resolve(body)
        if tag == "enum":
            # Only an enum's own lookup: `obj[...]` on any other class could run its code.
            if not isinstance(obj, enum.EnumMeta) or v["name"] not in obj.__members__:
                raise _corrupt(self.where, path, f"{from_file(body)!r} is not an enum with a member {_peek(v['name'])}")
            return obj.__members__[v["name"]]
        if inspect.isclass(obj) or not callable(obj):
            raise _corrupt(self.where, path, f"{from_file(body)!r} names a class where a function belongs")
        return obj


def _remedy(path: str, gone: list[str], new: list[str]) -> str:
    """What to load a changed class with. As many fields gone as new were likely
    renamed: then the `rename` from the new paths to the saved ones, as rules
    over every index of a repeated layer (`blocks.0`, `blocks.1`...), since
    `missing='keep'` would leave them freshly initialised without a word."""
    if gone and len(gone) == len(new):
        segments = _keypath.split_dotted(path) if path else []
        groups = 0
        pattern, replacement = ["^"], []
        for segment in segments:
            if segment.isdigit():
                groups += 1
                pattern.append(r"(\d+)\.")
                replacement.append(f"\\{groups}.")
            else:
                pattern.append(re.escape(segment) + r"\.")
                replacement.append(segment + ".")
        head, to = "".join(pattern), "".join(replacement)
        if groups:
            rules = ", ".join(f"(r'{head}{re.escape(n)}(?=\\.|$)', r'{to}{g}')" for n, g in zip(new, gone))
            spelt = f"rename=[{rules}]"
        else:
            prefix = "".join(replacement)
            spelt = "rename={" + ", ".join(f"'{prefix}{n}': '{prefix}{g}'" for n, g in zip(new, gone)) + "}"
        return (
            f"if {gone} were renamed {new}, pass a skeleton of the new class as `like` with `{spelt}` "
            f"(`eqx_ckpt.tree_deserialise_leaves(path, like, {spelt})`), which loads the saved values "
            f"into the new fields (`missing='keep'` would leave them freshly initialised)."
        )
    return "pass a skeleton of the new class as `like`" + (
        " (with `missing='keep'` for the new fields, which keep `like`'s values)." if new and not gone else "."
    )


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field[Any]) -> Any:
    factory: Any = f.default_factory
    return f.default if f.default is not dataclasses.MISSING else factory()


def _fill(tree: Any, prefix: str, records: dict[str, LeafRecord], where: str) -> Any:
    """`tree` with each stored leaf's place given its `abstract` leaf, by dotted path."""
    try:
        flat, treedef = jtu.tree_flatten_with_path(tree)
    except (TypeError, ValueError) as e:  # a value where no save puts one: a dict JAX cannot sort the keys of
        raise _corrupt(where, prefix, f"the tree it builds cannot be flattened ({from_file(str(e))})") from None
    paths = _tree.names_from_keypaths([keypath for keypath, _ in flat]).paths
    leaves, placed = [], set()
    for path, (_, leaf) in zip(paths, flat):
        if leaf is _SLOT:
            full = _keypath.join_dotted(prefix, path)
            record = records.get(full)
            if record is None:
                raise _corrupt(where, full, "the structure shows a stored leaf here, and the manifest has none")
            placed.add(full)
            leaf = abstract(record)
        leaves.append(leaf)
    # A stored leaf the record leaves out (or puts a value in place of) would be dropped without a word.
    below = [p for p in records if p not in placed and (not prefix or p == prefix or p.startswith(prefix + "."))]
    if below:
        shown = ", ".join(f"`{from_file(p)}`" for p in sorted(below)[:3]) + (" and more" if len(below) > 3 else "")
        raise _corrupt(where, prefix, f"the stored leaves {shown} have no place in it")
    return jtu.tree_unflatten(treedef, leaves)


def abstract(record: LeafRecord) -> Any:
    """A stand-in for a stored leaf, holding no data, that a load reads as saved:
    a `jax.ShapeDtypeStruct` for a JAX array or PRNG key, a zero-strided
    read-only array for a NumPy one (so the load gives NumPy back), a zero of
    its type for a scalar."""
    if record.type == "jax":
        return jax.ShapeDtypeStruct(record.shape, dtype_from_name(record.dtype))
    if record.type == "prng_key":
        return jax.ShapeDtypeStruct(record.shape, _key_dtype(record.impl))
    if record.type == "numpy":
        return np.broadcast_to(np.zeros((), dtype_from_name(record.dtype)), record.shape)
    if record.type == "numpy_scalar":
        return dtype_from_name(record.dtype).type(0)
    return {"bool": bool, "int": int, "float": float, "complex": complex}[record.type]()


@_state.memo(16)
def _key_dtype(impl: str) -> Any:
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


class StaticFieldWarning(UserWarning):
    """A load into a `like` whose static fields (hyperparameters such as
    `num_heads`) differ from those the checkpoint recorded: the arrays load,
    but the model computes with `like`'s values. Silence it with
    `warnings.filterwarnings("ignore", category=eqx_ckpt.StaticFieldWarning)`.

    !!! example

        ```python
        import warnings
        import eqx_ckpt

        # Loading into a `like` built with other hyperparameters is meant here:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=eqx_ckpt.StaticFieldWarning)
        ```
    """


StaticFieldWarning.__module__ = "eqx_ckpt"


@_gc.gc_paused()  # as a load is: the record of a large `like` makes many objects
def static_differences(
    manifest: Manifest,
    leaves: list[Any],
    named: _tree.Names,
    prefix: str,
    where: str,
    read: Callable[[], Sequence[bool | None]] | None = None,
) -> list[str]:
    """The `StaticFieldWarning` messages of loading `like` at `prefix`: each
    static field of a part the load read that differs from the record's at the
    same key path and class. `read()` (asked only where one differs; `None`:
    every leaf was read) says for each leaf of `like` whether the load read it.
    The caller warns once the load succeeded."""
    if manifest.structure is None or not isinstance(prefix, str):
        return []  # a `prefix` that is not a string is the plan's error to raise
    # An iterator is saved as its state, not as an array: the save recorded it as not stored.
    iterators = set(_iterators.found(leaves))
    mine = _structure.record(named.treedef, leaves, [i not in iterators for i in range(len(leaves))], named.records)
    if not prefix and encode_structure(mine) == manifest.structure:
        return []  # the record `like` makes is the stored one: nothing to parse or compare
    _faults.fire("load.structure_compared", where)
    try:
        stored = subtree(manifest, prefix, where)
        names(stored, prefix, where)
    except CheckpointError:
        return []  # a load with `like` does not need the record: its problems are the rebuild's
    found: list[tuple[str, str]] = []
    _compare(stored, mine, prefix, found)
    flags = read() if found and read is not None else ()
    left_out = _left_out(named.paths, flags) if False in flags else None
    messages = []
    for path, change in found:
        # Only a value beside a value, under the same class: a static field.
        relative = path[len(prefix) + 1 :] if prefix else path
        if left_out is not None and left_out(relative):
            continue
        try:
            pair = (_structure.at(stored, relative)["t"], _structure.at(mine, relative)["t"])
        except KeyError:
            continue
        if pair == ("value", "value"):
            before, _, after = change.partition(" -> ")
            messages.append(
                f"Loaded checkpoint {where!r} into a `like` whose static field `{path}` is {after}, but the "
                f"checkpoint recorded {before}: the arrays loaded, and the model computes with {after}. Build "
                f"`like` with {before}, or load without `like` (`Checkpoint(path).load()`)."
            )
    return messages


def _left_out(paths: list[str], read: Sequence[bool | None]) -> Callable[[str], bool]:
    """Whether the static field at a dotted path of `like` describes a part the
    load left out (`where`, `missing="keep"`): the nearest node above it with
    leaves a load reads holds one it did not read (a new head's `out_features`)."""
    unread: dict[str, bool] = {}  # node -> whether it holds a leaf left unread
    for path, was in zip(paths, read):
        if was is not None:
            parts = _keypath.split_dotted(path)
            for n in range(len(parts) + 1):
                node = ".".join(parts[:n])
                unread[node] = unread.get(node, False) or not was

    def left_out(field: str) -> bool:
        parts = _keypath.split_dotted(field)
        for n in range(len(parts) - 1, -1, -1):
            node = ".".join(parts[:n])
            if node in unread:
                return unread[node]
        return False

    return left_out


def warn_static(messages: list[str]) -> None:
    """Give each of `messages` as a `StaticFieldWarning` at the user's line."""
    for message in messages:
        warnings.warn(message, StaticFieldWarning, stacklevel=caller_level())


def differences(a: Manifest, b: Manifest, where_a: str, where_b: str) -> list[tuple[str, str]]:
    """Where the saved structures of `a` and `b` differ other than in their
    stored leaves (which `diff` compares): `(dotted path, "before -> after")`
    pairs, none where either records no structure."""
    if a.structure is None or b.structure is None:
        return []
    record_a, record_b = record_of(a, where_a), record_of(b, where_b)
    names(_checked_shape(record_a, where_a, ""), "", where_a)
    names(_checked_shape(record_b, where_b, ""), "", where_b)
    out: list[tuple[str, str]] = []
    _compare(_iterators_as_leaves(record_a, a, b), _iterators_as_leaves(record_b, b, a), "", out)
    return out


def _iterators_as_leaves(record: dict[str, Any], manifest: Manifest, other: Manifest) -> dict[str, Any]:
    """`record` with each iterator `other` has not at its path as a stored
    leaf: `diff` says it was added, removed or changed. (The save records an
    iterator as a part it could not record.)"""
    theirs = {it.path for it in other.iterators}
    for path in (it.path for it in manifest.iterators if it.path not in theirs):
        try:
            record = _structure.replaced(record, path, {"t": "leaf"})
        except (KeyError, ValueError, TypeError):  # (a record that does not reach it: compared as it is)
            continue
    return record


def _compare(a: dict[str, Any], b: dict[str, Any], path: str, out: list[tuple[str, str]]) -> None:
    if (a["t"], a.get("cls")) != (b["t"], b.get("cls")) or a.get("f") != b.get("f"):
        if a["t"] != "leaf" or b["t"] != "leaf":
            out.append((path, f"{_shown(a)} -> {_shown(b)}"))
        return
    if a["t"] in ("value", "unrecordable") or a.get("aux") != b.get("aux"):
        if a != b:
            out.append((path, f"{_shown(a)} -> {_shown(b)}"))
        return
    kids_a = {_keypath.stored_segment(*key): child for key, child in _structure.children(a)}
    kids_b = {_keypath.stored_segment(*key): child for key, child in _structure.children(b)}
    for segment in sorted(set(kids_a) | set(kids_b), key=_keypath.sort_key):
        here = _keypath.join_dotted(path, segment)
        if segment in kids_a and segment in kids_b:
            _compare(kids_a[segment], kids_b[segment], here, out)
        elif not _holds_leaves(kids_a.get(segment) or kids_b[segment]):
            # A sub-tree with stored leaves is `diff`'s added or removed leaves.
            out.append((here, "only in the second" if segment in kids_b else "only in the first"))


def _holds_leaves(node: dict[str, Any]) -> bool:
    found: list[bool] = []
    _structure.walk(node, lambda _, n: found.append(n["t"] == "leaf"))
    return any(found)


def _shown(node: dict[str, Any]) -> str:
    """A record node in a few words."""
    kind = node["t"]
    if kind == "value":
        text = _value_text(node["v"])
    elif kind == "unrecordable":
        text = f"(not recorded: {node['why']})"
    elif kind in _NAME_KINDS:
        text = python_name(node["cls"]) + (f" {node['aux']!r}" if kind == "node" else "")
    else:
        text = {"leaf": "a stored leaf", "none": "None"}.get(kind, kind)
    return from_file(text, 80)


def _value_text(v: Any) -> str:
    if v is None or type(v) in (bool, int, float, str):
        return repr(v)
    tag, body = next(iter(v.items()))
    if tag in ("tuple", "list"):
        inner = ", ".join(_value_text(x) for x in body) + ("," if tag == "tuple" and len(body) == 1 else "")
        return f"({inner})" if tag == "tuple" else f"[{inner}]"
    if tag in ("function", "enum"):
        return python_name(body) + (f".{v['name']}" if tag == "enum" else "")
    return f"{tag} {body!r}"
