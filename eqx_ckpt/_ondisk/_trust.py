"""Which classes and functions a load without `like` may build: the trust list.

A structure record's `module:qualname` names are only ever looked up here, in
a table made from the objects the caller passed (`trust=`) and a default set
that JAX and Equinox own. Nothing is imported because a file named it, and
there is no process-global registry.

- A class or function object trusts itself.
- A module object trusts the classes and functions *defined* in it or its
  submodules (by their own `__module__`): not a module it imports (`os`), nor
  a function it imports from elsewhere.
- Every entry is filed under its own `__module__` and `__qualname__`, so the
  name in a file must equal the object's own name exactly.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._base import _state
from .._base._errors import CheckpointTypeError


def name_of(obj: Any) -> str | None:
    """The `module:qualname` a class or function is recorded under, or `None`.
    A lambda or nested function has one only where its own module holds it
    (Equinox's MLP's `_identity = lambda x: x` is `module:_identity`)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if "<" not in qualname:
        return f"{module}:{qualname}"
    if inspect.isclass(obj):
        return None
    # Only the function's own module, already imported: nothing is imported here.
    holder = sys.modules.get(module)
    names = [attr for attr, value in list(vars(holder).items()) if value is obj] if holder is not None else []
    return f"{module}:{min(names)}" if names else None


def python_name(name: str) -> str:
    """How a user writes the object recorded as `module:qualname` in Python."""
    module, _, qualname = name.partition(":")
    return f"{module}.{qualname}"


# What no trust reaches, even inside a trusted module: functions and classes
# that read or write files, open connections or run code. A model stores none of
# them. A hostile record naming one would reach the disk. (`jnp.load` is defined
# in `jax.numpy` as far as its `__module__` says, so `trust=[jax.numpy]` would
# otherwise trust it.)
_DENIED_MODULES = (
    "os", "posixpath", "io", "_io", "pathlib", "shutil", "subprocess", "pickle", "marshal", "socket", "tempfile",
    "importlib", "sys", "ctypes", "urllib", "http", "numpy.lib._npyio_impl", "numpy.lib.npyio", "numpy.lib.format",
    "numpy.lib._datasource", "jax._src.pickle_util", "jax._src.profiler", "jax.profiler", "jax._src.compilation_cache",
    "jax._src.lru_cache", "jax._src.lazy_loader", "jax._src.debugger",
)  # fmt: skip
# Functions that write or read files, by their own names, in modules otherwise trusted.
_DENIED_NAMES = (
    "jax._src.interpreters.mlir:dump_module_to_file", "jax._src.jaxpr_util:maybe_dump_jaxpr_to_file",
    "numpy._core._multiarray_umath:_load_from_filelike",
)  # fmt: skip
_DENIED_BUILTINS = ("open", "exec", "eval", "compile", "__import__", "input", "breakpoint")
_DENIED_ARRAY_IO = (
    "load", "save", "savez", "savez_compressed", "fromfile", "tofile", "loadtxt", "savetxt", "genfromtxt",
    "fromregex", "memmap", "open_memmap", "DataSource",
)  # fmt: skip


def is_denied(name: str) -> bool:
    """Whether the object recorded as `name` is one no trust reaches (`jnp.load`,
    `np.fromfile`, `open`, anything of `os` or `pickle`)."""
    module, _, qualname = name.partition(":")
    if name in _DENIED_NAMES or any(module == m or module.startswith(m + ".") for m in _DENIED_MODULES):
        return True
    if module == "builtins":
        return qualname in _DENIED_BUILTINS
    top = module.partition(".")[0]
    return top in ("numpy", "jax") and qualname.rpartition(".")[2] in _DENIED_ARRAY_IO


class Trust:
    """The objects a load may build, by recorded name.

    **Arguments:**

    - `objects`: classes, functions and modules (see the module docstring).
    - `defaults`: whether the default set (Equinox's `nn` layers and `State`,
        `jax.nn` and the elementwise `jax.numpy` functions) is trusted too.
    """

    def __init__(self, objects: Iterable[Any] = (), *, defaults: bool = True):
        if isinstance(objects, (str, bytes)) or not isinstance(objects, Iterable):
            raise CheckpointTypeError(
                "`trust` must be a list of class, function and module objects (`trust=[MyModel, optax]`), "
                f"not {type(objects).__name__}. Names as strings are never accepted: pass the objects."
            )
        self.table: dict[str, Any] = dict(_default_table()) if defaults else {}
        for obj in objects:
            if not isinstance(obj, types.ModuleType) and is_denied(name_of(obj) or ""):
                raise CheckpointTypeError(
                    f"`trust` holds {python_name(name_of(obj) or '')}, which reads or writes files or runs code: "
                    f"no load ever builds it, whatever `trust` says. A checkpoint that names it is not a model."
                )
            self.table.update({name: x for name, x in _entries(obj).items() if not is_denied(name)})

    def resolve(self, name: str) -> Any | None:
        """The trusted object recorded as `name`, or `None` if none is trusted."""
        return self.table.get(name)


def _entries(obj: Any) -> dict[str, Any]:
    if isinstance(obj, types.ModuleType):
        return _module_table(obj)
    name = name_of(obj)
    if name is None or not (inspect.isclass(obj) or callable(obj)):
        raise CheckpointTypeError(
            f"`trust` holds {obj!r}, which is not a class, function or module with a name a checkpoint can record "
            f"(a lambda or a function defined inside another has none). Pass classes, functions and modules."
        )
    return {name: obj, **_nested_classes(obj)}


def _nested_classes(cls: Any) -> dict[str, Any]:
    """The classes defined inside class `cls` (`Outer.Inner`), which it trusts too."""
    if not inspect.isclass(cls):
        return {}
    found = {}
    for value in list(vars(cls).values()):
        if inspect.isclass(value) and getattr(value, "__qualname__", "").startswith(cls.__qualname__ + "."):
            name = name_of(value)
            if name is not None and value.__module__ == cls.__module__:
                found[name] = value
                found.update(_nested_classes(value))
    return found


# Remembered per module object: walking a large package (optax) takes milliseconds,
# and a load may be asked for many times. Modules are never collected in practice.
@_state.memo(64)
def _module_table(module: types.ModuleType) -> dict[str, Any]:
    """Every class and function defined in `module` or its submodules."""
    prefix = module.__name__
    table: dict[str, Any] = {}
    for value in _walk(module, prefix):
        name = name_of(value)
        # Defined in `module` or a submodule (`name` starts with its `__module__`).
        if name is not None and name.startswith((prefix + ":", prefix + ".")):
            table[name] = value
            table.update(_nested_classes(value))
    return table


def _walk(module: types.ModuleType, prefix: str) -> Iterator[Any]:
    """The attributes of `module` and of every submodule reachable through
    attributes, submodules being modules named `prefix.<...>`."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for value in list(vars(current).values()):
            if isinstance(value, types.ModuleType):
                if value.__name__.startswith(prefix + "."):
                    stack.append(value)
            elif inspect.isclass(value) or callable(value):
                yield value


# The elementwise functions of `jax.numpy` trusted by default: activations and
# the functions models keep as fields.
_ELEMENTWISE = (
    "abs", "absolute", "arctan", "cos", "cosh", "exp", "exp2", "expm1", "log", "log1p", "log2", "negative",
    "reciprocal", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh", "maximum", "minimum", "add", "subtract",
    "multiply", "divide", "true_divide", "power", "erf", "round", "floor", "ceil", "clip", "logaddexp",
)  # fmt: skip


# Abstract bases of `eqx.nn` that no saved tree holds an instance of.
_ABSTRACT = ("StatefulLayer",)


@_state.memo(1)
def _default_table() -> dict[str, Any]:
    """The default trust: the concrete public classes of Equinox's `nn`, what
    its layers store as fields, `jax.nn`'s public functions and the elementwise
    functions of `jax.numpy`."""
    from equinox.nn import _mlp, _stateful

    objects: list[Any] = [
        value
        for attr, value in vars(eqx.nn).items()
        if inspect.isclass(value) and not attr.startswith("_") and attr not in _ABSTRACT
    ]
    objects += [
        value
        for attr, value in vars(jax.nn).items()
        if not attr.startswith("_") and callable(value) and not inspect.isclass(value)
    ]
    objects += [getattr(jnp, name) for name in _ELEMENTWISE if hasattr(jnp, name)]
    # What Equinox's layers store: `Pool`s `jax.lax.add`/`max`, `AdaptivePool`s
    # `jnp.mean`/`max`, `MLP` its `_identity`, a taken `StateIndex` `_Sentinel()`.
    objects += [jax.lax.add, jax.lax.max, jnp.mean, jnp.max]
    objects += [getattr(_mlp, name) for name in ("_identity",) if hasattr(_mlp, name)]
    objects += [getattr(_stateful, name) for name in ("_Sentinel",) if hasattr(_stateful, name)]
    return {name: obj for obj in objects if (name := name_of(obj)) is not None}
