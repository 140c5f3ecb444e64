"""The exceptions pitstop raises. Every one derives from :class:`CheckpointError`."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error pitstop raises on purpose."""


class InvalidArgumentError(CheckpointError, ValueError):
    """A bad argument to a pitstop call (a step that is not an int, a metric that is not a
    number, ...). Also a ``ValueError``, so code that catches either keeps working."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes or manifest do not match what was committed (hash, size, schema).

    ``overwritten`` lists the target's entries that a restore had already written when the
    corruption was found (empty when it was found before any byte reached the target).
    """

    def __init__(self, message: str, *, checkpoint: str | None = None, key: str | None = None,
                 file: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.key = key
        self.file = file
        self.overwritten: list[str] = []
        #: refused for a file with a second name (a hard link), not for its bytes: such a
        #: checkpoint is left in place, never moved aside as corrupt
        self.linked = False


class IncompatibleTargetError(CheckpointError):
    """The object to restore into does not match the checkpoint (keys, shapes or dtypes)."""

    def __init__(self, message: str, *, missing: list[str] | None = None,
                 unexpected: list[str] | None = None,
                 mismatched: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing_keys = list(missing or [])
        self.unexpected_keys = list(unexpected or [])
        self.mismatched_keys = list(mismatched or [])


class UnsupportedFormatError(CheckpointError):
    """The manifest was written by a newer, incompatible pitstop (unknown major format version)."""


class DirectoryLockedError(CheckpointError):
    """Another live writer holds the checkpoint directory."""


class CheckpointNotFoundError(CheckpointError):
    """The requested step (or any checkpoint at all) does not exist in the directory."""


class StepExistsError(CheckpointError):
    """A committed checkpoint of this step already exists; pitstop never overwrites one silently."""


class CheckpointWriteError(CheckpointError):
    """A save failed in the background (disk full, permission, I/O). Committed checkpoints are intact."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.path = path


class UnsupportedStateError(CheckpointError):
    """A state leaf pitstop cannot save without pickle (an object array, an unknown object)."""


class EncryptionKeyError(CheckpointError):
    """An encrypted checkpoint or directory was opened without its key, or with another key.
    Nothing was read or written; the checkpoint is intact (never moved aside as corrupt)."""
