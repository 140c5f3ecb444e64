"""One committed checkpoint, read: its manifest opened and authenticated, then loaded as new
arrays, verified, or restored into live objects (the four phases of :mod:`pitstop.core.restore`
in order); its arrays are read by :mod:`.stream`, hash-verified, from :mod:`.files`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    EncryptionKeyError,
    IncompatibleTargetError,
)
from pitstop.core.format.decoding import PARSE_FRAMES, deeper_than, load_json, on_fresh_stack
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.format.validate import parse
from pitstop.core.restore.apply import apply
from pitstop.core.restore.check import check
from pitstop.core.restore.data import read_data
from pitstop.core.restore.files import _FileSource, _os_error
from pitstop.core.restore.plan import RestorePlan, match
from pitstop.core.restore.report import RestoreReport
from pitstop.core.restore.stream import ArrayReader, nbytes_of
from pitstop.core.storage.local import MANIFEST
from pitstop.core.tree import FlatState, decode_value, unflatten


def _nothing(keys: list[str]) -> None:
    """``written`` of a read into new arrays (nothing live is written)."""


class ReadableStorage(Protocol):
    """What a reader needs of its storage: any :class:`Storage`, or the memory-tier buffer
    the manager verifies on recovery. ``open_reader(name, relpath) -> fd`` is optional."""

    def path_of(self, name: str, relpath: str = "") -> str: ...

    def read_bytes(self, name: str, relpath: str) -> bytes: ...

    def size(self, name: str, relpath: str) -> int: ...

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int: ...


def _directory_key_id(storage: Any) -> str | None:
    """The key id the directory's identity records (None: none, or unreadable)."""
    try:
        doc = load_json(storage.read_meta("directory.json") or b"null")
        return str(doc["encryption"]["key_id"])
    except Exception:  # noqa: BLE001 - no identity, no such method, malformed: no key id
        return None


def _key_id_of(data: bytes) -> str:
    """The key id an encrypted manifest names, for a message (at most 32 characters)."""
    try:
        return str(load_json(data)["encryption"]["key_id"])[:32]
    except Exception:  # noqa: BLE001
        return "?"


class CheckpointReader(ArrayReader):
    """One committed checkpoint ``name`` in ``storage``, a directory whose checkpoints are
    named by ``naming`` (its manifest must be of the step the name holds).

    ``encryption``: the key of an encrypted checkpoint (:class:`~pitstop.Encryption`); given,
    a plaintext checkpoint is refused as corrupt (it is not authenticated: an encrypted
    directory never holds one), unless ``plaintext_ok`` (the CLI reads both kinds).
    ``directory_id``: the directory's id; an encrypted checkpoint whose sealed manifest
    names another one (copied in from another run with the same key) is refused as
    corrupt."""

    def __init__(self, storage: ReadableStorage, name: str, *,
                 threads: int | None = None, naming: Naming = DEFAULT,
                 encryption: Any = None, plaintext_ok: bool = False,
                 directory_id: str | None = None) -> None:
        self.storage = storage
        self.name = name
        self.threads = threads if threads is not None else min(4, os.cpu_count() or 1)
        self._sources: dict[tuple[str, str], _FileSource] = {}
        self.where = storage.path_of(name)
        try:
            data = storage.read_bytes(name, MANIFEST)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: manifest.json is missing",
                                         checkpoint=self.where) from None
        except OSError as e:
            raise _os_error(self.where, MANIFEST, e) from None
        try:
            self.manifest: Manifest = parse(data, self.where, encryption, naming)
        except EncryptionKeyError:
            if encryption is None or _directory_key_id(storage) != encryption.key_id:
                raise
            # the directory's own key (its identity says so; writers use no other): a
            # manifest naming another key was not written here, or was changed (a rotted
            # key id): unauthenticated, like any corrupt checkpoint, so restore() falls back
            raise CorruptCheckpointError(
                f"{self.where}: its manifest names another key id ({_key_id_of(data)}) than "
                f"this directory's, {encryption.key_id} (the key given): it was copied in from "
                "elsewhere or its manifest was changed, so it is not authenticated",
                checkpoint=self.where, file=MANIFEST) from None
        #: decrypts the arrays of an encrypted checkpoint
        self._cipher: Any = None
        #: verify(progress=...): called with the bytes of each plain chunk read (see verify)
        self._on_bytes: Callable[[int], None] | None = None
        if self.manifest.encryption is not None:
            if directory_id and self.manifest.directory_id != directory_id:
                # (the id is under the manifest's MAC and in every segment's associated
                # data: only a checkpoint written for another directory names another one)
                raise CorruptCheckpointError(
                    f"{self.where}: an encrypted checkpoint of another directory (its sealed "
                    f"manifest names directory id {str(self.manifest.directory_id)[:64]}, "
                    f"this directory's is {directory_id}): copied in from another run with "
                    "the same key, so not this run's state. Read it from the run it came "
                    "from, or re-save it here (load() it and save() it)",
                    checkpoint=self.where, file=MANIFEST)
            self._cipher = encryption.cipher(self.manifest.encryption,
                                             self.manifest.directory_id, self.manifest.step)
        elif encryption is not None and not plaintext_ok:
            raise CorruptCheckpointError(
                f"{self.where}: not encrypted, but this manager encrypts (key id "
                f"{encryption.key_id}): an unencrypted checkpoint is not authenticated, so it "
                "is not trusted here (copied in or replaced). Read it without encryption= if "
                "you know where it came from", checkpoint=self.where, file=MANIFEST)
        named = naming.parse(name)
        if named is not None and named != self.manifest.step:
            # a checkpoint renamed or copied in under another step: never restore it as that
            raise CorruptCheckpointError(
                f"{self.where}: its manifest is of step {self.manifest.step}, but the "
                f"directory is named for step {named} (renamed, swapped or copied in); move "
                "it to the name of its own step", checkpoint=self.where, file=MANIFEST)

    def verify(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Read every array and check its hash (``pitstop verify``): every rank's part of a
        checkpoint that several ranks wrote. ``progress(done, total)`` (array bytes) is
        called as the reading goes on (a progress bar's): per chunk of a large array, per
        window of small ones."""
        self.check_files()
        runs, rest = self.plain_runs(list(self.manifest.arrays.items()))
        done = {(p.file, p.offset) for e in self.manifest.arrays.values() for p in e.parts
                if p.ref is None}
        extra = [(key, entry) for view in self.manifest.ranks
                 for key, entry in view.arrays.items()
                 if any((p.file, p.offset) not in done for p in entry.parts)]
        seen = [0]
        total = sum(e.length for run in runs for _, e in run) + sum(
            nbytes_of(e) for _, e in rest + extra)
        if progress is not None:
            def count(n: int) -> None:
                seen[0] += n
                progress(seen[0], total)
            progress(0, total)
        for run in runs:  # hashed straight from each window: nothing is made per array
            self.read_plain_run([(k, e, None) for k, e in run], _nothing)
            if progress is not None:
                count(sum(e.length for _, e in run))
        for key, entry in rest + extra:
            if progress is None:
                self.read_array(key, entry)
                continue
            before = seen[0]
            self._on_bytes = count
            try:
                self.read_array(key, entry)
            finally:
                self._on_bytes = None
            count(max(0, nbytes_of(entry) - (seen[0] - before)))  # compressed, encrypted

    # ------------------------------------------------------------------ whole checkpoint
    def load(self) -> Any:
        """A fresh nested structure of numpy arrays and values: the data files are checked
        and the memory the new arrays need is known to be there before any is made."""
        m = self.manifest
        self.check_files()
        self.check_memory()
        leaves: dict[str, Any] = {}

        def load_one(item: tuple[str, ArrayEntry]) -> None:
            key, entry = item
            try:
                leaves[key] = self.read_array(key, entry)
            except (ValueError, OverflowError) as e:  # e.g. an absurd shape
                raise CorruptCheckpointError(
                    f"{self.where}: array {key!r} cannot be made ({type(e).__name__}: {e})",
                    checkpoint=self.where, key=key, file=MANIFEST) from None
            except MemoryError:
                raise CheckpointError(
                    f"{self.where}: no memory left for array {key!r} ({nbytes_of(entry)} "
                    "bytes); restore() into existing arrays needs none") from None

        runs, rest = self.plain_runs(list(m.arrays.items()))

        def load(item: Any) -> None:
            if type(item[0]) is not list:
                load_one(item)
                return
            outs = []
            for key, entry in item[0]:  # small and valid (parse checked): np.empty cannot fail
                leaves[key] = out = np.empty(entry.shape, decode_dtype(entry.dtype))
                outs.append((key, entry, out))
            self.read_plain_run(outs, _nothing)

        jobs: list[Any] = [*rest, *((run, run[0][1]) for run in runs)]
        self.per_file(sorted(jobs, key=lambda kv: kv[-1].start), load)

        def rebuild() -> Any:
            leaves.update({k: decode_value(v) for k, v in m.values.items()})
            if m.structure is None:
                return leaves
            return unflatten(m.structure, leaves)

        try:
            if deeper_than(sys.getrecursionlimit() - PARSE_FRAMES):
                return on_fresh_stack(rebuild)  # (a deep caller: as in manifest.parse)
            return rebuild()
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: its structure or values in manifest.json are malformed "
                f"({type(e).__name__}: {e})", checkpoint=self.where, file=MANIFEST) from None

    def check_memory(self) -> None:
        """Refuse a load whose new arrays need more memory than the machine has available
        (saying how much), rather than fail inside numpy. A compressed entry declaring more
        than its stored frame decodes to is corruption, found here without reading it."""
        need = sum(nbytes_of(e) for e in self.manifest.arrays.values())
        have = available_memory()
        if have is None or need <= have:
            return
        self.check_frames()
        raise CheckpointError(
            f"{self.where}: loading it needs {need} bytes ({_gib(need)}) for new arrays, but "
            f"this machine has {have} bytes ({_gib(have)}) available. Restore into existing "
            "arrays with restore(), or load on a machine with more memory.")

    def restore_into(self, flat: FlatState, strict: bool = True,
                     checked: Callable[[CheckpointError | None], None] | None = None
                     ) -> RestoreReport:
        """Put this checkpoint back into the live objects of ``flat``: checked against the
        manifest and every adapter before a byte is written, then streamed into the live
        buffers (hash-verified), then values and adapters applied (see :mod:`pitstop.core.restore`).

        Mismatches raise :class:`IncompatibleTargetError` (``strict``) or are skipped and
        reported; the target is then unchanged. ``checked(error)`` is called once the
        checks are done (a multi-rank restore agrees there before any rank writes).
        """
        plan = RestorePlan(self, flat, strict)
        try:
            self.check_files()  # a manifest that lies about its files is corrupt, not a mismatch
            try:
                match(plan)
            except IncompatibleTargetError as e:
                self.check_frames(e.mismatched_keys)
                raise
            # every compressed array, restored or not: a frame header that contradicts its
            # entry is corruption found before a byte of the target is written
            self.check_frames()
            check(plan)
        except CheckpointError as e:
            if checked is not None:
                checked(e)  # the other ranks of a job learn it before they write anything
            raise
        if checked is not None:
            checked(None)  # raises when another rank refused: nothing is written then
        read_data(plan)
        apply(plan)
        return plan.report


def available_memory() -> int | None:
    """Bytes of memory this process could still get (MemAvailable plus free swap, at most a
    cgroup's limit), or None when it cannot tell."""
    have: int | None = None
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {line.split(b":")[0]: int(line.split()[1]) * 1024
                    for line in f if line.split()[1:2] and line.split()[1].isdigit()}
        if b"MemAvailable" in info:
            have = info[b"MemAvailable"] + info.get(b"SwapFree", 0)
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        try:
            have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    # a cgroup's limit caps it (its usage is not subtracted: much of it is page cache,
    # which the kernel reclaims; a false refusal would be worse than numpy's own error)
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            have = min(have, int(text))
        break
    return have


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


__all__ = ["CheckpointReader", "available_memory"]
