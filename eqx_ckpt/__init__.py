"""eqx_ckpt: Equinox checkpoints that know where each leaf lives."""

import importlib.metadata as _metadata

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
from ._tools._migrate import convert_eqx_file as convert_eqx_file
from ._tools._publish import push_to_hub as push_to_hub
from ._tools._verify import Problem as Problem, verify as verify

try:
    __version__ = _metadata.version("eqx_ckpt")
except _metadata.PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"
