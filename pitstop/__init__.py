"""pitstop: checkpoints for training jobs — near-free saves, exact resumes.

>>> import pitstop
>>> with pitstop.CheckpointManager("runs/exp1", save_every_steps=500, keep_last=3) as mgr:
...     start = mgr.restore(state)          # None on a fresh run
...     ...
"""

from pitstop._version import __version__

# (importing pitstop.adapters wires the builtin frameworks' lazy loading into core's registry)
from pitstop.adapters.rng import RNG
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DirectoryLockedError,
    EncryptionKeyError,
    IncompatibleTargetError,
    InvalidArgumentError,
    StepExistsError,
    UnsupportedFormatError,
    UnsupportedStateError,
)
from pitstop.core.format.crypto import Encryption
from pitstop.core.manager import CheckpointManager
from pitstop.core.policy import (
    AnyOf,
    AutoInterval,
    EveryNSteps,
    EverySeconds,
    KeepAll,
    KeepBest,
    KeepEverySteps,
    KeepLast,
    OnImprovement,
    OnSteps,
)
from pitstop.core.runtime.coordination import CoordinationError
from pitstop.core.save.handles import SaveHandle, SaveStats

__all__ = [
    "CheckpointManager", "SaveHandle", "SaveStats", "RNG", "Encryption", "EncryptionKeyError",
    "CheckpointError", "CorruptCheckpointError", "IncompatibleTargetError", "InvalidArgumentError",
    "UnsupportedFormatError", "DirectoryLockedError", "CheckpointNotFoundError",
    "StepExistsError", "CheckpointWriteError", "UnsupportedStateError", "CoordinationError",
    "EveryNSteps", "EverySeconds", "OnImprovement", "OnSteps", "AutoInterval", "AnyOf",
    "KeepLast", "KeepEverySteps", "KeepBest", "KeepAll",
    "__version__",
]


def __getattr__(name: str) -> object:
    """Short, lazy aliases: ``pitstop.torch`` is ``pitstop.adapters.torch`` (imported on use)."""
    if name == "torch":
        import importlib
        return importlib.import_module("pitstop.adapters.torch")
    raise AttributeError(f"module 'pitstop' has no attribute {name!r}")
