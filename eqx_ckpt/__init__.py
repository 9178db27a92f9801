"""eqx_ckpt: Equinox checkpoints that know where each leaf lives."""

import importlib as _importlib
import os as _os
import sys as _sys
import types as _types

TYPE_CHECKING = False  # as `typing.TYPE_CHECKING` (type checkers know the name), without importing `typing`

# The public names, for readers and type checkers; at run time each is
# imported from the module `_PUBLIC` names (`__getattr__`): at once, below,
# except in `eqx-ckpt`, whose `import eqx_ckpt` imports no JAX (nor anything
# much), so that it takes Ctrl-C during its start-up as at any later moment.
if TYPE_CHECKING:
    __version__: str
    from ._base._errors import (
        CheckpointConnectionError as CheckpointConnectionError,
        CheckpointError as CheckpointError,
        CheckpointExistsError as CheckpointExistsError,
        CheckpointKeyError as CheckpointKeyError,
        CheckpointNotFoundError as CheckpointNotFoundError,
        CheckpointReplacedError as CheckpointReplacedError,
        CheckpointStorageError as CheckpointStorageError,
        CheckpointTypeError as CheckpointTypeError,
        CheckpointValueError as CheckpointValueError,
        CheckpointVersionError as CheckpointVersionError,
        CorruptCheckpointError as CorruptCheckpointError,
        IntegrityError as IntegrityError,
        LeafError as LeafError,
        UntrustedError as UntrustedError,
    )
    from ._base._handle import LeafHandle as LeafHandle
    from ._foreign._torch import torch_layout as torch_layout
    from ._load._checkpoint import Checkpoint as Checkpoint, skeleton as skeleton
    from ._load._deserialise import (
        default_deserialise_filter_spec as default_deserialise_filter_spec,
        materialise as materialise,
        tree_deserialise_leaves as tree_deserialise_leaves,
    )
    from ._load._lazy import LazyArray as LazyArray
    from ._load._rebuild import StaticFieldWarning as StaticFieldWarning
    from ._manage._initialise import load_or_initialise as load_or_initialise
    from ._manage._manager import CheckpointManager as CheckpointManager
    from ._manage._retention import RetentionWarning as RetentionWarning
    from ._save._serialise import (
        PendingSave as PendingSave,
        default_serialise_filter_spec as default_serialise_filter_spec,
        tree_serialise_leaves as tree_serialise_leaves,
    )
    from ._store._share import IntegrityWarning as IntegrityWarning
    from ._store._transaction import CommitWarning as CommitWarning
    from ._tools._card import NeedsCodeWarning as NeedsCodeWarning
    from ._tools._diff import CheckpointDiff as CheckpointDiff, diff as diff
    from ._tools._export import export_safetensors as export_safetensors
    from ._tools._merge import merge as merge
    from ._tools._migrate import convert_eqx_file as convert_eqx_file
    from ._tools._publish import push_to_hub as push_to_hub
    from ._tools._verify import Problem as Problem, verify as verify

_PUBLIC = _types.MappingProxyType(
    {
        "CheckpointConnectionError": "._base._errors",
        "CheckpointError": "._base._errors",
        "CheckpointExistsError": "._base._errors",
        "CheckpointKeyError": "._base._errors",
        "CheckpointNotFoundError": "._base._errors",
        "CheckpointReplacedError": "._base._errors",
        "CheckpointStorageError": "._base._errors",
        "CheckpointTypeError": "._base._errors",
        "CheckpointValueError": "._base._errors",
        "CheckpointVersionError": "._base._errors",
        "CorruptCheckpointError": "._base._errors",
        "IntegrityError": "._base._errors",
        "LeafError": "._base._errors",
        "UntrustedError": "._base._errors",
        "LeafHandle": "._base._handle",
        "torch_layout": "._foreign._torch",
        "Checkpoint": "._load._checkpoint",
        "skeleton": "._load._checkpoint",
        "default_deserialise_filter_spec": "._load._deserialise",
        "materialise": "._load._deserialise",
        "tree_deserialise_leaves": "._load._deserialise",
        "LazyArray": "._load._lazy",
        "StaticFieldWarning": "._load._rebuild",
        "load_or_initialise": "._manage._initialise",
        "CheckpointManager": "._manage._manager",
        "RetentionWarning": "._manage._retention",
        "PendingSave": "._save._serialise",
        "default_serialise_filter_spec": "._save._serialise",
        "tree_serialise_leaves": "._save._serialise",
        "IntegrityWarning": "._store._share",
        "CommitWarning": "._store._transaction",
        "NeedsCodeWarning": "._tools._card",
        "CheckpointDiff": "._tools._diff",
        "diff": "._tools._diff",
        "export_safetensors": "._tools._export",
        "merge": "._tools._merge",
        "convert_eqx_file": "._tools._migrate",
        "push_to_hub": "._tools._publish",
        "Problem": "._tools._verify",
        "verify": "._tools._verify",
    }
)
__all__ = sorted(_PUBLIC)  # `from eqx_ckpt import *` as before


def __getattr__(name: str) -> object:
    """The public name `name`: the first one used imports them all, as an
    eager `import eqx_ckpt` did (PEP 562)."""
    if name == "__version__":
        globals()[name] = _version()
        return globals()[name]
    if name not in _PUBLIC:
        raise AttributeError(f"module 'eqx_ckpt' has no attribute {name!r}")
    for public, module in _PUBLIC.items():
        globals()[public] = getattr(_importlib.import_module(module, __name__), public)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, "__version__"})


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("eqx_ckpt")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree that is not installed
        return "0+unknown"


del TYPE_CHECKING

# A program that imports eqx_ckpt gets every public name at once, as it always
# did: its heartbeat thread starts now (`_hosts._multihost`), so a process that
# dies before its first save is still named. `eqx-ckpt` alone imports them
# after its Ctrl-C handler is in place (`_tools._cli`).
# Whether this process is the `eqx-ckpt` program (its console script).
_PROGRAM = _os.path.basename((getattr(_sys, "argv", None) or [""])[0]) in ("eqx-ckpt", "eqx-ckpt.exe")
if not _PROGRAM:
    __getattr__("Checkpoint")
