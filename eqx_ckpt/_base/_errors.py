"""Exception classes, and the one helper that formats messages about leaves."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import jax.tree_util as jtu
import numpy as np


class CheckpointError(Exception):
    """Base class of every error eqx_ckpt raises for something a user can cause.

    Each error is also an instance of the fitting built-in exception, so
    `except FileNotFoundError` and the like keep working.

    **Attributes:**

    - `path`: the checkpoint the error is about, as given, or `None`.

    !!! example

        ```python
        import eqx_ckpt

        try:
            eqx_ckpt.Checkpoint("no_such_checkpoint")
        except eqx_ckpt.CheckpointError as e:   # every error eqx_ckpt raises
            print(type(e).__name__, e.path)     # CheckpointNotFoundError no_such_checkpoint
        ```
    """

    path: str | None = None

    def __init__(self, message: str, *, path: Any = None):
        super().__init__(message)
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        # `KeyError.__str__` would show the message in quotes.
        return str(self.args[0]) if self.args else ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__:  # eqx_ckpt's own, as tracebacks and the docs name them (not a user's)
            cls.__module__ = "eqx_ckpt"


CheckpointError.__module__ = "eqx_ckpt"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint at the path.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        try:
            eqx_ckpt.tree_deserialise_leaves("not_saved_yet", {"w": jnp.zeros(2)})
        except FileNotFoundError as e:          # also a CheckpointNotFoundError
            print(e)
        ```
    """


class CheckpointStorageError(CheckpointError, OSError):
    """The storage would not serve the checkpoint, or take a save.

    It refused (forbidden, unauthenticated, a local file's permissions, a
    read-only or full disk), failed once its retries were spent, or could not
    be reached ([`eqx_ckpt.CheckpointConnectionError`][], a subclass). The
    checkpoint may well be whole: this is neither an `IntegrityError` nor a
    `CheckpointNotFoundError`, and [`eqx_ckpt.verify`][] raises it instead of
    reporting damage. A save it stops commits nothing (an overwritten
    checkpoint stays as it was). Check access, space and the storage, then try
    again.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        try:                                    # expired credentials would raise it too
            eqx_ckpt.tree_deserialise_leaves("http://127.0.0.1:1/ckpt", {"w": jnp.zeros(2)})
        except eqx_ckpt.CheckpointStorageError as e:
            print(type(e).__name__)             # CheckpointConnectionError: nothing listens on port 1
        ```
    """


class CheckpointConnectionError(CheckpointStorageError, ConnectionError):
    """The storage could not be reached (a refused connection, an unresolved
    host name, a time-out). The checkpoint may well be there, so this is not a
    `CheckpointNotFoundError`: code that starts afresh on `FileNotFoundError`
    does not start afresh on it. Check the URL and the server, then try again.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        try:                                    # nothing listens on port 1
            eqx_ckpt.tree_deserialise_leaves("http://127.0.0.1:1/ckpt", {"w": jnp.zeros(2)})
        except ConnectionError as e:            # also a CheckpointConnectionError, within seconds
            print(e)
        ```
    """


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The destination holds a checkpoint (with `overwrite=False`), or other files.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(2)})
        try:
            eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.zeros(2)}, overwrite=False)
        except eqx_ckpt.CheckpointExistsError as e:
            print(e)
        ```
    """


class CheckpointTypeError(CheckpointError, TypeError):
    """An argument has the wrong type, such as a file object instead of a path.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        with open("model.eqx", "wb") as f:
            try:
                eqx_ckpt.tree_serialise_leaves(f, {"w": jnp.ones(2)})
            except TypeError as e:              # pass a directory path instead
                print(e)
        ```
    """


class UntrustedError(CheckpointTypeError):
    """A checkpoint asks for something a load does not do unless told to.

    - A load without `like` would build a class or function that `trust` does
      not hold. Nothing was imported or run. The message names each one, the
      key paths that use it, and the `trust=[...]` to pass.
    - A fine-tune names a base that is not followed on its own (neither an
      `hf://` base nor a folder beside it). Nothing there was opened. The
      message names the fine-tune, the base, and the `base=` to pass.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt


        class Net(eqx.Module):
            linear: eqx.nn.Linear


        eqx_ckpt.tree_serialise_leaves("net_ckpt", Net(eqx.nn.Linear(2, 2, key=jax.random.key(0))))
        try:
            eqx_ckpt.Checkpoint("net_ckpt").load(trust=[])
        except eqx_ckpt.UntrustedError as e:
            print(e)                            # ... pass `trust=[__main__.Net]` ...
        net = eqx_ckpt.Checkpoint("net_ckpt").load(trust=[Net])
        ```
    """


class CheckpointValueError(CheckpointError, ValueError):
    """An argument has a value that cannot be used, such as an unknown option.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(2)})
        try:
            eqx_ckpt.tree_deserialise_leaves("ckpt", {"w": jnp.zeros(2)}, missing="ignore")
        except ValueError as e:
            print(e)                            # `missing` must be 'error' or 'keep', ...
        ```
    """


class CorruptCheckpointError(CheckpointError, ValueError):
    """The manifest is unreadable, invalid, edited or hostile.

    !!! example

        ```python
        import pathlib
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(2)})
        manifest = pathlib.Path("ckpt/manifest.json")
        manifest.write_text(manifest.read_text().replace('"w"', '"v"'))   # an edit
        try:
            eqx_ckpt.Checkpoint("ckpt")
        except eqx_ckpt.CorruptCheckpointError as e:
            print(e)                            # ... its digest does not match its content ...
        ```
    """


class CheckpointVersionError(CheckpointError, ValueError):
    """A newer eqx_ckpt wrote the checkpoint, in a format this one does not read.
    It is not damaged: not a `CorruptCheckpointError`, and `eqx-ckpt verify`
    exits 2 on it, not 1 (so a clean-up script deleting damage keeps it).
    Upgrade eqx_ckpt to read it.

    !!! example

        ```python
        import eqx_ckpt

        try:
            eqx_ckpt.Checkpoint("ckpt_from_a_newer_eqx_ckpt")
        except eqx_ckpt.CheckpointVersionError as e:   # not damage: upgrade
            print(e)
        except eqx_ckpt.CheckpointNotFoundError:
            pass
        ```
    """


class CheckpointReplacedError(CheckpointError, RuntimeError):
    """The checkpoint was replaced by a newer save, or deleted (the message says
    which), after a `Checkpoint`, a lazy load or a running load opened it.
    Nothing of the newer save was returned. Open or load it again to read it.

    A safetensors file or Hugging Face directory rewritten (by `safetensors`,
    or `export_safetensors` into it) raises it too, as does an orbax
    checkpoint saved again.

    !!! example

        ```python
        import numpy as np
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": np.zeros(3)})
        old = eqx_ckpt.Checkpoint("ckpt")["w"]          # a lazy leaf of this save
        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": np.ones(3)})
        try:
            np.asarray(old)
        except eqx_ckpt.CheckpointReplacedError:
            print(np.asarray(eqx_ckpt.Checkpoint("ckpt")["w"]))   # [1. 1. 1.]
        ```
    """


class CheckpointKeyError(CheckpointError, KeyError):
    """A dotted key is not in the checkpoint.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"model": {"w": jnp.ones(2)}})
        try:
            eqx_ckpt.Checkpoint("ckpt")["model.v"]
        except KeyError as e:
            print(e)                            # 'model.v' is not a leaf of checkpoint 'ckpt'. ...
        ```
    """


class LeafError(CheckpointError, RuntimeError):
    """One or more leaves cannot be saved, are missing, or differ from `like`
    in shape, dtype or type.

    **Attributes:**

    - `path`: the checkpoint.
    - `keypaths`: the key paths (tuples of JAX keys) of the leaves concerned.
    - `dotted`: their dotted paths in the checkpoint.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"encoder": {"w": jnp.ones(2)}})
        try:
            eqx_ckpt.tree_deserialise_leaves("ckpt", {"encoder": {"w": jnp.ones(2), "b": jnp.zeros(2)}})
        except eqx_ckpt.LeafError as e:     # also a RuntimeError, as Equinox raises
            print(e.dotted)                 # ('encoder.b',)
        ```
    """

    keypaths: tuple[tuple[Any, ...], ...] = ()
    dotted: tuple[str, ...] = ()

    def __init__(
        self,
        message: str,
        *,
        path: Any = None,
        keypaths: Sequence[tuple[Any, ...]] = (),
        dotted: Sequence[str] = (),
    ):
        super().__init__(message, path=path)
        self.keypaths = tuple(tuple(k) for k in keypaths)
        self.dotted = tuple(dotted)


class IntegrityError(LeafError):
    """A leaf's stored bytes or metadata fail their integrity check.

    !!! example

        ```python
        import pathlib
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(3)})
        chunk = pathlib.Path("ckpt/packed.float32/c/0")
        data = bytearray(chunk.read_bytes())
        data[0] ^= 0xFF                         # one flipped bit of storage
        chunk.write_bytes(bytes(data))
        try:
            eqx_ckpt.tree_deserialise_leaves("ckpt", {"w": jnp.zeros(3)})
        except eqx_ckpt.IntegrityError as e:
            print(e.dotted)                     # ('w',)
        ```
    """


_Leaf = TypeVar("_Leaf", bound=LeafError)


def describe_leaf(keypath: tuple[Any, ...] | None, dotted: str) -> str:
    """How every message names a leaf: its dotted path and its `keystr`."""
    if keypath is None:
        return f"`{dotted or '<root>'}`"
    shown = jtu.keystr(keypath) if keypath else "<root>"
    return f"`{dotted or '<root>'}` (key path {shown})"


def leaf_line(what: str, *, keypath: tuple[Any, ...] | None, dotted: str, where: str = "") -> str:
    """One leaf and what is wrong with it. A leaf with a key path starts with
    Equinox's own words (`Error at leaf with path ...`), so that code matching
    Equinox's messages keeps matching."""
    if keypath is None:
        return f"Leaf {describe_leaf(None, dotted)}{where}: {what}"
    return f"Error at leaf with path {keypath!r}: leaf {describe_leaf(keypath, dotted)}{where}: {what}"


def leaf_message(
    what: str,
    *,
    keypath: tuple[Any, ...] | None,
    dotted: str,
    path: Any,
    fix: str = "",
) -> str:
    """One leaf: what differs, where, in which checkpoint, and the fix."""
    message = leaf_line(what, keypath=keypath, dotted=dotted, where=f" in checkpoint {str(path)!r}")
    if fix:
        message += f" {fix}"
    return message


def stored_leaf_error(cls: type[_Leaf], what: str, *, dotted: str, path: Any, fix: str = "") -> _Leaf:
    """A `cls` about one stored leaf, known by its dotted path only."""
    message = leaf_message(what, keypath=None, dotted=dotted, path=path, fix=fix)
    return cls(message, path=path, dotted=[dotted])


def check_flag(name: str, value: Any, meaning: str) -> bool:
    """`value` of the option `name` as a `bool` (a truthy string such as `"no"` is refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise CheckpointTypeError(f"`{name}` must be `True` or `False` ({meaning}), not {value!r}.")
    return bool(value)


# The most characters of one string from a file that a message shows.
MAX_SHOWN = 200


def from_file(text: Any, limit: int = MAX_SHOWN) -> str:
    """A string read from a file (a name, a key, a reason), as every message and
    CLI line shows it: control characters escaped (`\\n`, `\\x1b`), so that no
    file can forge a line, and at most `limit` characters, ending in `...`.

    !!! example

        ```python
        from eqx_ckpt._base._errors import from_file

        print(from_file("os:system\\npass `trust=[os]`."))   # os:system\\npass `trust=[os]`.
        ```
    """
    text = text if isinstance(text, str) else repr(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Whether messages are being made for `eqx-ckpt` (`command_line`), so name its flags, not keywords.
_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("eqx_ckpt_command_line", default=False)


def option(keyword: str, flag: str) -> str:
    """How a message names an option: as the Python `keyword` (`` `base=` ``),
    or, while `eqx-ckpt` runs a command (`command_line`), as its `flag` (`` `--base` ``)."""
    return flag if _COMMAND_LINE.get() else keyword


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Messages made in this block (in this thread) name `eqx-ckpt`'s flags (`option`)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def shown_names(names: Sequence[str], most: int = 5) -> str:
    """The first `most` of `names` (read from files: `from_file`) in backticks, then how many more."""
    listed = ", ".join(f"`{from_file(n)}`" for n in names[:most])
    return listed + (f" and {len(names) - most} more" if len(names) > most else "")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_level() -> int:
    """The `stacklevel` of the first frame outside eqx_ckpt (and `contextlib`'s
    decorators), for a warning given by this function's caller."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level
