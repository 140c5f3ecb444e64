"""The manager and the reader of a checkpoint directory: :class:`CheckpointManager` (the
face users type), its options (:class:`ManagerOptions`) and :class:`DirectoryReader`, which
only reads (what the exports and the CLI open). These are the package's public names."""

from pitstop.core.directory.names import step_name
from pitstop.core.manager.manager import CheckpointManager
from pitstop.core.manager.options import ManagerOptions
from pitstop.core.manager.reader import DirectoryReader
from pitstop.core.runtime.signals import CONTINUE_SIGNALS, DEFAULT_SIGNALS

__all__ = ["CheckpointManager", "DirectoryReader", "ManagerOptions", "step_name",
           "DEFAULT_SIGNALS", "CONTINUE_SIGNALS"]
