"""The storage seam: a short interface with capability flags.

Call order during a save (the engine guarantees it):

1. ``begin(name)`` returns a :class:`Transaction` for one checkpoint directory ``name``.
2. ``txn.open_write(relpath)`` several times, possibly from several threads; each returned
   writer receives ``write(buffer)`` calls and one ``close()`` (which makes the bytes durable
   when ``durable`` is set).
3. ``txn.commit(manifest_bytes)`` publishes the checkpoint atomically: after it returns,
   readers see a complete checkpoint, before it they see nothing. ``txn.abort()`` instead
   removes everything the transaction wrote.

Reads go through ``read_into(name, relpath, offset, out)``, ``read_bytes`` and ``size``.
``list_checkpoints()`` names committed checkpoints only. ``delete(name)`` removes one
committed checkpoint. ``cleanup_incomplete()`` removes what interrupted transactions left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming


class Writer(ABC):
    @abstractmethod
    def write(self, data: Any) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class Transaction(ABC):
    name: str
    location: str
    #: what other ranks pass to :meth:`Storage.join` to write into this transaction
    token: str | None = None

    @abstractmethod
    def open_write(self, relpath: str, direct: bool = False) -> Writer:
        """A writer for one new file. ``direct`` is a hint: the caller passes page-aligned
        buffers whose lengths are page multiples, so the bytes may bypass the page cache;
        the writer's ``direct`` attribute says whether they do."""

    @abstractmethod
    def commit(self, manifest: bytes) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def done(self) -> None:
        """Another rank's part (see :meth:`Storage.join`), once the leader committed."""
        return None


class Storage(ABC):
    """Where checkpoints live. Implementations: :class:`LocalStorage` (default)."""

    #: commit is an atomic rename (POSIX) rather than a commit marker written last.
    atomic_rename: bool = False
    #: ``Writer.close`` makes data durable (fsync).
    durable: bool = False
    #: a process-exclusive lock can be taken on the location.
    supports_locking: bool = False

    location: str

    @abstractmethod
    def begin(self, name: str) -> Transaction: ...

    @abstractmethod
    def list_checkpoints(self) -> list[str]: ...

    @abstractmethod
    def read_bytes(self, name: str, relpath: str) -> bytes: ...

    @abstractmethod
    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        """Fill the writable buffer ``out`` from ``offset``; returns the number of bytes read."""

    @abstractmethod
    def size(self, name: str, relpath: str) -> int: ...

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def cleanup_incomplete(self, naming: Naming = DEFAULT) -> list[str]:
        """Remove what interrupted transactions of checkpoints named by ``naming`` left;
        returns what was removed."""

    @abstractmethod
    def read_meta(self, relpath: str) -> bytes | None:
        """Read a small directory-level file (index, identity); None when absent."""

    @abstractmethod
    def write_meta(self, relpath: str, data: bytes, *, durable: bool = True) -> None:
        """Atomically replace a small directory-level file (fsynced unless ``durable`` is
        False: for derived data that can be rebuilt from the checkpoints themselves)."""

    def join(self, name: str, token: str) -> Transaction:
        """Another rank's part of the transaction ``begin(name)`` made on the leader (its
        ``token``): ``open_write`` adds files to it; ``abort`` removes this part's files;
        only the leader commits."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot hold a checkpoint written by several ranks")

    def delete_if_unread(self, name: str) -> bool:
        """Delete ``name`` unless a reader holds it; backends without read leases just delete."""
        self.delete(name)
        return True

    def read_lease(self, name: str) -> AbstractContextManager[None]:
        """Held while a checkpoint is read, so retention leaves it alone (no-op by default)."""
        return nullcontext()

    def move_aside(self, name: str, reason: str) -> str | None:
        """Move a checkpoint out of the listing, keeping its bytes (``reason``: "corrupt",
        "abandoned"; see :mod:`pitstop.core.directory.names`); returns the new name, or None when this
        backend cannot (it then stays where it is)."""
        return None

    def lock(self) -> Any:
        raise NotImplementedError("this storage cannot be locked")

    def path_of(self, name: str, relpath: str = "") -> str:
        return f"{self.location}/{name}/{relpath}".rstrip("/")
