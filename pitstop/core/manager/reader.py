"""DirectoryReader: a checkpoint directory opened to read only (``load``, ``metadata``, the
steps it holds): its storage, its catalog and a :class:`CheckpointReader` per checkpoint;
no engine, no memory tier, no recovery, no lock. The exports and the CLI read through it,
and :class:`~pitstop.core.manager.CheckpointManager` is one, with a writer on top."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

from pitstop.core.arguments import open_directory, step_arg, wrap_os
from pitstop.core.directory.catalog import Catalog
from pitstop.core.directory.identity import (
    check_encryption,
    directory_kind,
    read_identity,
    resolve_naming,
)
from pitstop.core.directory.names import Naming
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleTargetError,
    UnsupportedFormatError,
)
from pitstop.core.format.crypto import ENV, Encryption
from pitstop.core.format.schema import Manifest
from pitstop.core.manager.options import ManagerOptions
from pitstop.core.restore.read import CheckpointReader, RestoreReport
from pitstop.core.runtime import supervised
from pitstop.core.save.lazy import fence_all
from pitstop.core.storage import Storage
from pitstop.core.storage.staged import StagedStorage
from pitstop.core.tree import FlatState, flatten

log = logging.getLogger("pitstop")


def _resolver() -> Callable[[Any], Any]:
    from pitstop.core.adapter import resolve
    return resolve




def _ambient_rank() -> tuple[int, int]:
    from pitstop.core.adapter import ambient_rank
    return ambient_rank()


class DirectoryReader:
    """A checkpoint directory opened to read: ``load()``, ``metadata()``, ``latest_step()``,
    ``all_steps()`` and ``checkpoint(step)`` (its :class:`CheckpointReader`), as a
    ``CheckpointManager(directory, read_only=True)`` reads them, without opening anything a
    writer needs. ``encryption``: the key of an encrypted directory (None: the
    PITSTOP_ENCRYPTION_KEY variable's, when it is set)."""

    def __init__(self, directory: str | os.PathLike[str] | Storage, *, encryption: Any = None,
                 step_prefix: str | None = None, step_digits: int | None = None,
                 distributed: Any = "auto", storage_options: Mapping[str, Any] | None = None
                 ) -> None:
        options = ManagerOptions(read_only=True, save_on_signals=None, encryption=encryption,
                                 step_prefix=step_prefix, step_digits=step_digits,
                                 distributed=distributed, storage_options=storage_options)
        options.check(directory)
        self._open_storage(directory, options, None, create=False)
        self._open_read_only(directory, options)
        self._tell_supervisor("open")

    def _open_storage(self, directory: Any, options: ManagerOptions, coord: Any, *,
                      create: bool) -> None:
        """The directory's storage, and what every reader of it holds (``coord``: the ranks
        of a writer's job, None for a reader)."""
        #: encryption at rest (:class:`pitstop.Encryption`); None: plaintext checkpoints
        self.encryption = options.encryption
        distributed, read_only = options.distributed, options.read_only
        durable, permissions = options.durable, options.permissions
        storage_options = options.storage_options
        #: (rank, ranks) of this process in its distributed job; (0, 1) alone. A read-only
        #: manager has no coordinator, but restores its own rank's part all the same
        self._rank_world = (coord.rank, coord.world_size) if coord else \
            _ambient_rank() if distributed is not False else (0, 1)
        self.storage = open_directory(
            directory, durable=durable, create=create,
            permissions=permissions,
            **({} if storage_options is None else {"storage_options": storage_options}))
        self.directory = self.storage.location
        self.read_only = read_only
        self._resolve = _resolver()
        #: checkpoints of a run abandoned by a restore of an older step, hidden until they
        #: are moved aside (a writer's: see CheckpointManager)
        self._abandoned: set[int] = set()
        self._warned: set[str] = set()
        self.retention = options.retention_policies()

    def _open_read_only(self, directory: Any, options: ManagerOptions) -> None:
        """How the directory is named, its id and encryption, its index: read, never written."""
        encryption, step_prefix, step_digits = (options.encryption, options.step_prefix,
                                                options.step_digits)
        retention_list = self.retention
        identity = read_identity(self.storage, required=False)
        self.directory_id = identity.directory_id if identity else ""
        #: how this directory names its checkpoints (recorded in .pitstop/directory.json)
        self.naming: Naming = resolve_naming(
            self.directory, identity.naming if identity else None, step_prefix, step_digits)
        # no identity (its .pitstop/ not copied along): what the checkpoints say; with a
        # key at hand, an encrypted checkpoint makes the directory encrypted whatever its
        # identity says (that file is anyone's to edit)
        kind = wrap_os(directory_kind, self.directory, self.storage, self.naming, identity,
                       encryption is not None or bool(os.environ.get(ENV)))
        if kind is not None and not self.directory_id:
            self.directory_id = kind.directory_id  # (its checkpoints' one id)
        if encryption is None and kind is not None and kind.encryption and \
                os.environ.get(ENV):
            # reading only (the export helpers, the CLI): the key from its variable
            encryption = self.encryption = Encryption()
        plain = encryption is not None and kind is not None and not kind.encryption \
            and any(self.naming.parse(n) is not None
                    for n in wrap_os(self.storage.list_checkpoints, self.directory))
        check_encryption(self.directory, kind, encryption, plain, writing=False)
        self._catalog = Catalog(self.storage, self.directory_id, retention_list,
                                read_only=True, naming=self.naming, encryption=encryption)
        wrap_os(self._catalog.reconcile, self.directory, write=False)

    # ================================================================== reading
    def latest_step(self) -> int | None:
        """The step ``restore()`` / ``load()`` would return: the newest committed step, or a
        newer one still being saved (they wait for it) or recovered from the memory tier."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._committed())

    def load(self, step: int | None = None, *, target: Any = None) -> Any:
        """The newest valid checkpoint (or ``step``) as a new object: a nested dict of numpy
        arrays and values, or with ``target`` an object of that structure (see
        :meth:`CheckpointManager.load <pitstop.core.manager.CheckpointManager.load>`)."""
        step = None if step is None else step_arg(step)
        if target is not None:
            return self._load_into(step, target)
        return self._load_from_disk(step)

    def metadata(self, step: int) -> Manifest:
        """The parsed manifest of one checkpoint (metrics, user metadata, arrays)."""
        return self._manifest_of(step_arg(step))

    def checkpoint(self, step: int) -> CheckpointReader:
        """The reader of the committed checkpoint of ``step`` (manifest parsed and checked)."""
        step = step_arg(step)
        if step not in self._committed(hidden=True):
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        return CheckpointReader(self.storage, self.naming.name(step), naming=self.naming,
                                encryption=self.encryption, directory_id=self.directory_id)

    def close(self) -> None:
        """Nothing to release (a reader holds no lock, buffer or thread); for symmetry."""

    def __enter__(self) -> DirectoryReader:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def _load_into(self, step: int | None, target: Any) -> Any:
        """``load(step, target=target)``: a fresh object of the target's structure."""
        fresh = _skeleton(target, self._resolve)
        restored, _report, flat = self._restore_into(fresh, step, True, detached=True)
        self._tell_supervisor("restore", step=restored)
        if restored is None:
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
        return flat.root

    def _load_from_disk(self, step: int | None) -> Any:
        """``load(step)`` from the committed checkpoints, newest valid first for None."""
        steps = self._committed(hidden=step is not None)
        if step is not None and step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} in {self.directory} (have: {steps[-10:]})")
        last: Exception | None = None
        vanished: list[int] = []
        for s in [step] if step is not None else self._newest_first(vanished):
            try:
                with self.storage.read_lease(self.naming.name(s)), _no_gc():
                    reader = CheckpointReader(self.storage, self.naming.name(s),
                                              naming=self.naming, encryption=self.encryption,
                                              directory_id=self.directory_id)
                    if step is None:  # the newest: never one of an abandoned run put back
                        self._catalog.check_replay(reader.manifest, reader.where)
                    self._use_rank(reader)
                    loaded = reader.load()
                self._tell_supervisor("restore", step=s)
                return loaded
            except (CorruptCheckpointError, UnsupportedFormatError) as e:
                if isinstance(e, CorruptCheckpointError):
                    self._distrust_previous()
                if step is not None:
                    gone = self._gone(step, e)
                    if gone is None:
                        raise
                    raise gone from e
                if s not in self._committed():
                    vanished.append(s)  # deleted meanwhile (another writer's retention)
                    continue
                warnings.warn(f"pitstop: skipping unreadable checkpoint: {e}", stacklevel=3)
                last = e
            except OSError as e:
                raise CheckpointError(f"cannot read {self._path(s)}: "
                                      f"{e}") from e
        if isinstance(last, UnsupportedFormatError):
            raise last
        if last is not None:
            raise CheckpointNotFoundError(
                f"no valid checkpoint in {self.directory}: every one failed to load (the "
                f"oldest tried: {last})") from last
        raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")

    def _manifest_of(self, step: int) -> Manifest:
        """The manifest of committed ``step`` (not found when it vanished meanwhile)."""
        if step not in self._committed(hidden=True):
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        try:
            return CheckpointReader(self.storage, self.naming.name(step), naming=self.naming,
                                    encryption=self.encryption,
                                    directory_id=self.directory_id).manifest
        except CorruptCheckpointError as e:
            gone = self._gone(step, e)
            if gone is None:
                raise
            raise gone from e

    def _restore_into(self, state: Any, step: int | None, strict: bool, *, detached: bool
                      ) -> tuple[int | None, RestoreReport | None, FlatState]:
        """The checkpoint of ``step`` (the newest valid one for None) put into ``state``;
        ``detached``: a state made for ``load(target=...)`` (the new root: ``flat.root``)."""
        fence_all()  # a lazy copy must read the state before the restore writes it
        with _no_gc():
            flat = wrap_os(flatten, self.directory, state, self._resolve)
            flat.detached = detached
            restored, report = self._restore_from_disk(flat, step, strict)
        return restored, report, flat

    def _gone(self, step: int, e: CheckpointError) -> CheckpointNotFoundError | None:
        """A checkpoint asked for by number that vanished before a byte of it was read
        (another process's retention or ``delete()`` between the listing and the read): not
        found, rather than "corrupt"; None when it is still there (or the target changed)."""
        if not isinstance(e, CorruptCheckpointError) or e.overwritten or \
                step in self._committed(hidden=True):
            return None
        return CheckpointNotFoundError(
            f"the checkpoint of step {step} in {self.directory} was deleted while it was "
            "being opened (by the writer's retention or delete(), in another process); "
            f"have: {self._committed(hidden=True)[-10:]}")

    def _restore_from_disk(self, flat: FlatState, step: int | None, strict: bool
                           ) -> tuple[int | None, RestoreReport | None]:
        if step is not None:
            steps = self._committed(hidden=True)
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no checkpoint of step {step} in {self.directory} (have: {steps[-10:]})")
            try:
                return step, self._restore_one(step, flat, strict)
            except CorruptCheckpointError as e:
                gone = self._gone(step, e)
                if gone is None:
                    raise
                raise gone from e
        newer: UnsupportedFormatError | None = None
        corrupt: list[CorruptCheckpointError] = []
        vanished: list[int] = []
        for s in self._newest_first(vanished):
            try:
                report = self._restore_one(s, flat, strict, newest=True)
            except CorruptCheckpointError as e:
                if not e.overwritten and s not in self._committed():
                    vanished.append(s)  # deleted meanwhile (another writer's retention)
                    continue
                msg = (f"pitstop: checkpoint {self._path(s)} is corrupt "
                       f"({e}); falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                corrupt.append(e)
                if not e.linked:
                    self._quarantine(s)
                continue
            except UnsupportedFormatError as e:
                # written by a newer pitstop: not corrupt, so never moved aside
                msg = (f"pitstop: cannot read checkpoint {self._path(s)} "
                       f"({e}); falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                newer = newer or e
                continue
            except IncompatibleTargetError as e:
                if corrupt and any(c.overwritten for c in corrupt):
                    # the target is no longer as it was: not an "unchanged" refusal
                    why = "\n".join(str(e).splitlines()[1:-1]) or str(e)
                    err = CorruptCheckpointError(
                        f"{corrupt[0]}\nThe previous checkpoint, step {s}, cannot complete the "
                        f"restore:\n{why}", checkpoint=corrupt[0].checkpoint,
                        key=corrupt[0].key, file=corrupt[0].file)
                    err.overwritten = sorted({k for c in corrupt for k in c.overwritten})
                    raise err from e
                raise
            leftover = sorted({k for c in corrupt for k in c.overwritten} - set(report.written))
            if leftover:
                err = CorruptCheckpointError(
                    f"restored step {s} after newer checkpoints failed verification, but these "
                    f"entries of the target still hold bytes of a corrupt checkpoint, as step {s} "
                    f"has no value for them: {_overwritten_keys(leftover)}. Restore into a "
                    "state that matches the saved one.", checkpoint=self.directory)
                err.overwritten = leftover
                raise err
            if corrupt and any(c.overwritten for c in corrupt):
                log.warning("pitstop: step %d overwrote everything the corrupt newer "
                            "checkpoint had written", s)
            return s, report
        if newer is not None:
            raise newer  # nothing older to use: never start from scratch silently
        if corrupt:
            # checkpoints existed but none is valid: starting from scratch must be the user's
            # decision, not a silent one
            written = _overwritten(corrupt)
            kept = sum(c.linked for c in corrupt)
            err = CorruptCheckpointError(
                f"no valid checkpoint in {self.directory}: all {len(corrupt)} failed "
                f"verification ({'; '.join(str(c) for c in corrupt[:3])}). " + (
                    f"They were moved aside as {self.naming.prefix}*.corrupt-*; restore() "
                    "again starts from scratch." if not kept else
                    f"{kept} of them hold a file with a second name (a hard link): left in "
                    "place, not moved aside. Break the links (remove the linked copy, or "
                    "replace it with one made by cp -a) and restore() again; the others "
                    f"were moved aside as {self.naming.prefix}*.corrupt-*.")
                + (f" The target already holds bytes of a corrupt checkpoint in: {written}; "
                   "rebuild it before training from scratch." if written else ""),
                checkpoint=self.directory)
            err.overwritten = sorted({k for c in corrupt for k in c.overwritten})
            raise err
        return None, None

    def _newest_first(self, vanished: list[int]) -> Iterator[int]:
        """Committed steps, newest first, for a restore or load of the newest. When the
        caller finds the step it tried deleted meanwhile (``vanished`` grows: another
        process's retention, after committing a newer one), the directory is listed again,
        so a reader never concludes there is nothing (or only an older step) to read."""
        tried: set[int] = set()
        again = 2
        while True:
            seen = len(vanished)
            new = False
            for s in reversed(self._committed()):
                if s in tried:
                    continue
                new = True
                tried.add(s)
                yield s
                if len(vanished) != seen:
                    break  # list again: newer steps may have been committed
            else:
                if new or not again:
                    return
                # nothing (new) listed: a listing is not atomic (the entries, then each
                # manifest), so one made while retention deleted the step it saw, after
                # committing one it did not see yet, comes back short; the next one sees it
                again -= 1

    def _restore_one(self, step: int, flat: FlatState, strict: bool,
                     checked: Callable[[CheckpointError | None], None] | None = None,
                     newest: bool = False) -> RestoreReport:
        name = self.naming.name(step)

        def read(storage: Any) -> RestoreReport:
            with self.storage.read_lease(name):
                reader = CheckpointReader(storage, name, naming=self.naming,
                                          encryption=self.encryption,
                                          directory_id=self.directory_id)
                if newest:  # never a checkpoint of an abandoned run put back in place
                    self._catalog.check_replay(reader.manifest, reader.where)
                self._use_rank(reader)
                return reader.restore_into(flat, strict, checked)

        staged = self._hold_staged(name)
        if staged is not None:
            # written from a staging buffer no save has taken since: read the data from it
            # (hash-verified against the committed manifest like any read); from disk if
            # that fails in any way
            buf, files = staged
            try:
                return read(StagedStorage(self.storage, name, buf.buf, files))
            except CorruptCheckpointError as e:
                log.warning("pitstop: the staging buffer step %d was written from no longer "
                            "matches the checkpoint (%s); reading it from %s instead",
                            step, e, self._path(step))
            except OSError:
                pass  # the same read from disk says what is wrong, below
            finally:
                self._release_staged(buf)
        try:
            return read(self.storage)
        except CorruptCheckpointError:
            self._distrust_previous()
            raise
        except OSError as e:
            raise CheckpointError(f"cannot read {self.storage.path_of(name)}: "
                                  f"{type(e).__name__}: {e}") from e

    def _hold_staged(self, name: str) -> tuple[Any, Any] | None:
        """The staging buffer ``name`` was written from, still unchanged (a writer's)."""
        return None

    def _release_staged(self, buf: Any) -> None:
        """Give back a buffer :meth:`_hold_staged` held."""

    def _distrust_previous(self) -> None:
        """A read found damaged bytes (a writer's next save then writes every array again)."""

    def report_restored(self, step: int | None) -> None:
        """Tell ``pitstop run`` (when the job runs under it) the step this job resumed from,
        None for a fresh start: for a face that restores by its own means (tf.train's
        ``CheckpointManager``, Keras's ``BackupAndRestore``). Never raises."""
        self._tell_supervisor("restore", step=step)

    def _tell_supervisor(self, event: str, **fields: Any) -> None:
        """Tell ``pitstop run`` (when the job runs under it) what this manager did; never
        raises (see :mod:`.supervised`)."""
        if os.environ.get(supervised.ENV):
            supervised.report(event, dir=self.directory, read_only=self.read_only,
                              rank=self._rank_world[0], **fields)

    def set_aside_corrupt(self, step: int) -> None:
        """Move the checkpoint of ``step``, found corrupt by a face's own read (tf.train's
        ``CheckpointManager``), aside as ``.corrupt-…`` (never deleted), so that a later
        save can reuse its step; a reader leaves it in place."""
        self._quarantine(step)

    def _quarantine(self, step: int) -> None:
        """Move a corrupt checkpoint aside (never deleted) so later saves can reuse its step."""
        name = self.naming.name(step)
        new = self._catalog.move_aside(step, "corrupt")
        if new is None:
            if not self.read_only:
                log.warning("pitstop: corrupt checkpoint %s stays in place", name)
            return
        log.warning("pitstop: moved corrupt checkpoint %s aside to %s", name, new)

    def _use_rank(self, reader: CheckpointReader) -> None:
        """Read a checkpoint written by several ranks as this rank's part of it: its own
        when the job has as many ranks; on another number of ranks, sharded arrays are
        resharded and replicated state is the same everywhere, and what differed between
        the saving ranks comes from saved rank ``rank % saved`` (said once, by name)."""
        m = reader.manifest
        if m.world == 1:
            return
        rank, world = self._rank_world
        src = rank if m.world == world else rank % m.world
        if m.world != world:
            specific = m.rank_specific()
            if specific:
                self._warn_once(
                    f"world:{m.step}:{world}",
                    f"pitstop: {reader.where} was saved by {m.world} ranks and is restored by "
                    f"{world}: sharded arrays are resharded and replicated ones are the same on "
                    f"every rank, but these entries differed between the saving ranks, and "
                    f"rank {rank} gets saved rank {src}'s: {_some_keys(specific)}")
        reader.manifest = m.view(src)

    def _warn_once(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("%s", text)
        warnings.warn(text, stacklevel=4)

    def _path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.storage.path_of(self.naming.name(step))

    def _committed(self, *, hidden: bool = False) -> list[int]:
        """Committed steps on disk; the abandoned run's ones (after a restore of an older
        step) only with ``hidden``, until the run's first step or save moves them aside."""
        steps = wrap_os(self._catalog.committed_steps, self.directory)
        if self._abandoned and not hidden:
            steps = [s for s in steps if s not in self._abandoned]
        return steps


def _skeleton(target: Any, resolve: Callable[[Any], Any]) -> Any:
    """A copy of ``target``'s containers (dicts, lists, tuples) and numpy arrays, for
    ``load(target=...)`` to fill without touching the target. An object an adapter handles
    is copied by the adapter's ``skeleton(obj, copy)`` where it has one (a JAX pytree node
    with numpy arrays inside, a mutable Flax NNX module), else shared (immutable ones are
    rebuilt anyway)."""
    def copy(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return np.empty_like(x)
        if type(x) is dict:
            return {k: copy(v) for k, v in x.items()}
        if type(x) is list:
            return [copy(v) for v in x]
        if type(x) is tuple:
            return tuple(copy(v) for v in x)
        if isinstance(x, tuple) and callable(getattr(type(x), "_make", None)):
            return type(x)._make(copy(v) for v in x)  # type: ignore[attr-defined]
        if isinstance(x, (*_PLAIN_VALUES, np.generic)):
            return x
        adapter = resolve(x)
        own = adapter.skeleton(x, copy) if adapter is not None else None
        if own is not None:
            return own  # a pytree node (a Flax nnx.State too) rebuilt by its adapter
        if isinstance(x, MutableMapping):  # OrderedDict, defaultdict ...
            items = {k: copy(v) for k, v in x.items()}
            try:
                factory = getattr(x, "default_factory", _NONE)
                cls: Any = type(x)
                return cls(items) if factory is _NONE else cls(factory, items)
            except Exception:  # noqa: BLE001 - a mapping built otherwise: shared
                return x
        return x

    return copy(target)


_PLAIN_VALUES = (bool, int, float, str, bytes, type(None))
_NONE = object()


def _some_keys(keys: list[str]) -> str:
    return ", ".join(map(repr, keys[:10])) + (f" (+{len(keys) - 10} more)"
                                              if len(keys) > 10 else "")


def _overwritten(errors: list[CorruptCheckpointError]) -> str:
    return _overwritten_keys(sorted({k for e in errors for k in e.overwritten}))


def _overwritten_keys(keys: list[str]) -> str:
    return ", ".join(map(repr, keys[:10])) + (f" (+{len(keys) - 10} more)"
                                              if len(keys) > 10 else "")



@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting goes on) for a short burst of
    allocations, so a large heap is not rescanned in the middle of a snapshot."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
