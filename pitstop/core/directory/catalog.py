"""What a manager knows of its directory's checkpoints: the index of committed ones with
their metrics, retention applied after each commit, and checkpoints moved aside.

The index (``.pitstop/index.json``) is derived from the manifests and rebuilt where it is
stale, so writing it costs no fsync. Bookkeeping after a commit never fails the save it
follows: trouble there is a warning, and the next commit tries again. The directory's
identity is :mod:`pitstop.core.directory.identity`; what retention records and how it is
explained, :mod:`pitstop.core.directory.retention`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from pitstop.core.directory.identity import sealed_sections
from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.directory.retention import aside_refs, held_aside_by, referencing
from pitstop.core.errors import CheckpointError
from pitstop.core.format.schema import Manifest
from pitstop.core.format.validate import peek_header
from pitstop.core.policy import CheckpointInfo, RetentionPolicy, to_delete
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage import Storage

log = logging.getLogger("pitstop")

INDEX = "index.json"

_STEP = re.compile(r"^(0|[1-9][0-9]{0,17})$")


def parse_index(raw: bytes, directory_id: str) -> dict[int, CheckpointInfo]:
    """The entries of an ``index.json``; ValueError (or TypeError, KeyError) for anything
    this pitstop would not have written: the index is a cache, so a doubtful one is rebuilt
    from the manifests rather than trusted in part."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("directory_id") != directory_id:
        raise ValueError("the index of another directory")
    entries = doc["checkpoints"]
    if not isinstance(entries, dict):
        raise TypeError("its checkpoints are not an object")
    known: dict[int, CheckpointInfo] = {}
    for s, d in entries.items():
        if not _STEP.fullmatch(s) or not isinstance(d, dict):
            raise ValueError(f"entry {s[:40]!r} is not a step's")
        metrics = d.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(_metric(v) for v in metrics.values()):
            raise TypeError(f"metrics of step {s} are not names of numbers, strings, bools")
        flags = [d.get("ours", False), d.get("protected", False), d.get("held", False)]
        if not all(type(f) is bool for f in flags) or \
                d.get("all_finite") not in (None, True, False):
            raise TypeError(f"flags of step {s} are not booleans")
        refs = d.get("refs")
        if refs is not None and not (isinstance(refs, list) and all(
                type(r) is int and 0 <= r < int(s) for r in refs)):
            raise TypeError(f"refs of step {s} are not older steps")
        # ("held": protected only for pitstop before format 4, which knows no references)
        known[int(s)] = CheckpointInfo(int(s), metrics, flags[0], d.get("all_finite"),
                                       flags[1] and not flags[2],
                                       None if refs is None else tuple(refs))
    return known


def _index_entry(i: CheckpointInfo, held: bool) -> dict[str, Any]:
    """One checkpoint's entry in index.json; ``held``: another one references its data."""
    d: dict[str, Any] = {"metrics": i.metrics, "ours": i.ours, "all_finite": i.all_finite,
                         "protected": i.protected}
    if i.refs is not None:
        d["refs"] = list(i.refs)
    if held and not i.protected:
        # marked protected for a pitstop from before references, whose retention would
        # delete it; "held" says it is not protected otherwise
        d["protected"] = d["held"] = True
    return d


def _metric(v: Any) -> bool:
    """A metric value as ``clean_metrics`` lets one be saved (an int within float range)."""
    if type(v) is int:
        return abs(v) < 1 << 1023
    return v is None or type(v) in (float, str, bool)


class Catalog:
    """The index of committed checkpoints, retention and moving checkpoints aside."""

    def __init__(self, storage: Storage, directory_id: str, retention: list[RetentionPolicy],
                 *, read_only: bool, naming: Naming = DEFAULT,
                 on_save: Callable[[Any], None] | None = None, encryption: Any = None) -> None:
        self.storage = storage
        #: the key of an encrypted directory's manifests
        self.encryption = encryption
        self.naming = naming
        self.directory_id = directory_id
        self.retention = retention
        self.read_only = read_only
        self.on_save = on_save
        self.index: dict[int, CheckpointInfo] = {}
        self.lock = threading.RLock()
        #: test hooks: "before_delete"(step), right before retention deletes a checkpoint
        self.hooks: dict[str, Callable[..., Any]] = {}
        #: the index write or retention failed after a commit: retried at the next one
        self.dirty = False
        #: called with a checkpoint's name when it leaves the directory (deleted, moved
        #: aside): the engine never references it again (incremental checkpoints)
        self.on_removed: Callable[[str], None] | None = None
        #: a checkpoint moved aside as abandoned may be in the directory (seen in a listing,
        #: or moved aside here): retention then checks what those reference (see _retain)
        self.aside_seen = False
        #: an abandoned checkpoint's name -> the checkpoints its manifest references
        self._aside_refs: dict[str, tuple[str, ...]] = {}
        #: the writer's skipped periodic saves (pitstop.core.save.skips.SkippedSaves), recorded in
        #: directory.json after each commit that follows new ones
        self.skips: Any = None

    # ------------------------------------------------------------------ listing
    def committed_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (only names pitstop makes)."""
        out = []
        aside = False
        for name in self.storage.list_checkpoints():
            step = self.naming.parse(name)
            if step is not None:
                out.append(step)
            elif ".abandoned-" in name:
                aside = True
        self.aside_seen = aside
        return sorted(out)

    def held_aside(self) -> dict[str, tuple[str, ...]]:
        """The checkpoints moved aside as abandoned (a rollback) that are still in the
        directory, each with the checkpoints whose data its manifest references: pitstop
        keeps those (it says so when it moves them aside), so the holders they read from
        stay too, until they are deleted."""
        out: dict[str, tuple[str, ...]] = {}
        for entry in self.storage.list_checkpoints():
            base, sep, _rest = entry.rpartition(".abandoned-")
            if not sep or self.naming.parse(base) is None:
                continue
            refs = self._aside_refs.get(entry)
            if refs is None:
                refs = self._aside_refs[entry] = aside_refs(self.storage, entry)
            out[entry] = refs
        self.aside_seen = bool(out)
        return out

    def reconcile(self, write: bool) -> None:
        """Load what retention knows; rebuild entries from manifests where it is stale."""
        try:
            raw = self.storage.read_meta(INDEX)
        except OSError as e:
            if write:
                raise
            log.warning("pitstop: cannot read %s/.pitstop/%s (%s); reading the manifests "
                        "instead", self.storage.location, INDEX, e)
            raw = None
        known: dict[int, CheckpointInfo] = {}
        if raw is not None:
            try:
                known = parse_index(raw, self.directory_id)
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError,
                    RecursionError) as e:
                log.warning("pitstop: %s/.pitstop/%s is unreadable (%s); rebuilding it from "
                            "the manifests", self.storage.location, INDEX, e)
                known = {}
        index: dict[int, CheckpointInfo] = {}
        for s in self.committed_steps():
            if s in known and known[s].refs is not None:
                index[s] = known[s]
                continue
            try:
                m = CheckpointReader(self.storage, self.naming.name(s), naming=self.naming,
                                     encryption=self.encryption,
                                     directory_id=self.directory_id).manifest
            except CheckpointError as e:
                log.warning("pitstop: cannot read checkpoint of step %d: %s", s, e)
                # (an entry of an index from before references: kept as it was, with none)
                index[s] = dataclasses.replace(known[s], refs=()) if s in known else \
                    CheckpointInfo(s, {}, ours=False)
                continue
            old = known.get(s)
            index[s] = CheckpointInfo(s, m.metrics, ours=m.directory_id == self.directory_id
                                      and bool(self.directory_id), all_finite=m.all_finite,
                                      protected=old.protected if old else False,
                                      refs=self.refs_of(m))
        with self.lock:
            self.index = index
            if write and index != known:
                self._write_index()

    def _write_index(self) -> None:
        held = {r for i in self.index.values() for r in (i.refs or ())}
        doc = {"directory_id": self.directory_id, "checkpoints": {
            str(s): _index_entry(i, s in held) for s, i in sorted(self.index.items())}}
        # derived from the manifests (rebuilt when stale), so it costs no fsync
        self.storage.write_meta(INDEX, json.dumps(doc, allow_nan=True).encode(), durable=False)

    # ------------------------------------------------------------------ after a commit
    def committed(self, manifest: Manifest, name: str, stats: Any) -> list[int]:
        """Persist thread, after a commit: index, then retention, then ``on_save``; the steps
        retention deleted (the other ranks of a job forget them: see the engine)."""
        info = CheckpointInfo(step=manifest.step, metrics=manifest.metrics, ours=True,
                              all_finite=manifest.all_finite, refs=self.refs_of(manifest))
        removed: list[int] = []
        with self.lock:
            before = set(self.index)
            self.index[manifest.step] = info
            if not self.read_only:  # (another rank than the leader: the leader keeps it)
                try:
                    self._retain()
                    self._write_index()
                    if self.dirty:
                        log.info("pitstop: index and retention are up to date again")
                    self.dirty = False
                except Exception as e:  # noqa: BLE001 - never the save's failure
                    self.dirty = True
                    log.warning("pitstop: step %d is committed, but updating %s/.pitstop/%s "
                                "or applying retention failed (%s: %s); retried at the next "
                                "commit", manifest.step, self.storage.location, INDEX,
                                type(e).__name__, e)
            removed = sorted(before - set(self.index))
            if self.skips is not None and not self.read_only:
                self.skips.record(self.storage)  # (never raises)
        if self.on_save is not None:
            try:
                self.on_save(stats)
            except Exception:  # noqa: BLE001
                log.exception("pitstop: on_save callback failed")
        return removed

    def refs_of(self, m: Manifest) -> tuple[int, ...]:
        """The steps whose data manifest ``m`` references (incremental checkpoints)."""
        steps = (self.naming.parse(h) for h in m.refs)
        return tuple(sorted(s for s in steps if s is not None))

    def referencing(self, step: int, among: Any = None) -> list[int]:
        """The checkpoints (of ``among``, by default every listed one) that reference data
        ``step`` holds: while one of them stays, ``step`` stays too."""
        with self.lock:
            return referencing(step, self.index, self.index if among is None else among)

    def _retain(self) -> None:
        doomed = to_delete(list(self.index.values()), self.retention)
        aside: dict[str, tuple[str, ...]] | None = None
        # newest first: a checkpoint is deleted before the older ones it references, so a
        # crash between two deletions never leaves one whose referenced bytes are gone; one
        # that stays (referenced, being read, a failed deletion) keeps what it references
        for s in sorted(doomed, reverse=True):
            users = self.referencing(s)
            if users:
                log.info("pitstop: retention keeps step %d: it holds data referenced by step "
                         "%s", s, ", ".join(map(str, users)))
                continue
            if self.aside_seen:
                if aside is None:
                    aside = self.held_aside()
                name = self.naming.name(s)
                kept_by = held_aside_by(name, aside)
                if kept_by:
                    log.info("pitstop: retention keeps step %d: it holds data referenced by "
                             "%s (moved aside by a rollback; delete it to let step %d go)",
                             s, ", ".join(kept_by), s)
                    continue
            if not self._written_here(s):
                # the index said ours, the directory says otherwise (copied in, replaced)
                old = self.index[s]
                self.index[s] = CheckpointInfo(s, old.metrics, False, old.all_finite,
                                               old.protected)
                log.warning("pitstop: retention leaves %s alone: this manager did not "
                            "write it", self.storage.path_of(self.naming.name(s)))
                continue
            hook = self.hooks.get("before_delete")
            if hook is not None:
                hook(s)
            try:
                if self.storage.delete_if_unread(self.naming.name(s)):
                    del self.index[s]
                    self._removed(s)
                    log.info("pitstop: retention deleted step %d", s)
                else:
                    log.info("pitstop: retention keeps step %d for now: it is being read", s)
            except FileNotFoundError:
                del self.index[s]
                self._removed(s)
            except OSError as e:  # one failed deletion must not stop the others
                log.warning("pitstop: retention could not delete step %d: %s", s, e)

    def check_replay(self, manifest: Manifest, where: str) -> None:
        """Refuse an encrypted checkpoint saved before a checkpoint of an older step that is
        in the directory: a run only saves growing steps, except after a rollback, which
        moves the newer checkpoints aside (``.abandoned-``); one of those renamed back into
        place is such a checkpoint. Each save records its place in the directory's order
        (``seq``, under the manifest's MAC); older checkpoints without one are not compared."""
        seq = (manifest.encryption or {}).get("seq")
        if type(seq) is not int:
            return
        for name, section in sealed_sections(self.storage, self.naming, aside=False):
            step, later = self.naming.parse(name), section.get("seq")
            if step is not None and step < manifest.step and type(later) is int and later > seq:
                from pitstop.core.errors import CorruptCheckpointError
                raise CorruptCheckpointError(
                    f"{where}: step {manifest.step} was saved before step {step} "
                    f"({self.storage.path_of(name)}), which continues from an older step: it "
                    "belongs to a run that a rollback abandoned (moved aside as .abandoned- "
                    "and put back), so it is not this run's newest state: the newest one saved after it is "
                    f"restored instead. restore(step={manifest.step}) still reads it, if it "
                    "is what you mean to continue from", checkpoint=where, file="manifest.json")

    def _written_here(self, step: int) -> bool:
        """True when the checkpoint's own manifest names this directory's id (checked right
        before retention deletes it: pitstop never deletes what it did not write)."""
        if self.encryption is None:
            head = self._header(step)
            if head is not None:
                return bool(self.directory_id) and head["directory_id"] == self.directory_id
        try:
            m = CheckpointReader(self.storage, self.naming.name(step), naming=self.naming,
                                 encryption=self.encryption).manifest
        except (CheckpointError, OSError):
            return False
        return bool(self.directory_id) and m.directory_id == self.directory_id

    def _header(self, step: int) -> dict[str, Any] | None:
        """The leading fields of a plaintext checkpoint's manifest, seal checked, when they
        are of the step its name holds; ``{"directory_id": None}`` (not ours) when it cannot
        be read or its seal fails; None when only a whole parse can tell (see
        :func:`~pitstop.core.format.validate.peek_header`)."""
        from pitstop.core.storage.local import MANIFEST
        name = self.naming.name(step)
        try:
            head = peek_header(self.storage.read_bytes(name, MANIFEST),
                               self.storage.path_of(name))
        except (CheckpointError, OSError):
            return {"directory_id": None}
        if head is not None and self.naming.parse(name) not in (None, head["step"]):
            return {"directory_id": None}  # renamed or copied in under another step
        return head

    def delete(self, step: int) -> None:
        """Delete one committed checkpoint this directory's runs wrote (an explicit request:
        ``CheckpointManager.delete``); raises when it may not or cannot."""
        name = self.naming.name(step)
        where = self.storage.path_of(name)
        users = self.referencing(step)
        if users:
            raise CheckpointError(
                f"{where} holds data referenced by step {', '.join(map(str, users))} "
                "(incremental checkpoints: arrays unchanged since it are stored once, in it); "
                f"delete step {users[-1]} first, or keep it: retention deletes it once no "
                "kept checkpoint references it")
        aside = held_aside_by(name, self.held_aside()) if self.aside_seen else []
        if aside:
            raise CheckpointError(
                f"{where} holds data referenced by {', '.join(aside)} (an incremental "
                "checkpoint a rollback moved aside, which pitstop keeps); delete that first "
                "if you no longer need it, or keep both")
        if not self._written_here(step):
            raise CheckpointError(
                f"{where} was not written by this directory's runs (its manifest names "
                "another directory, or it cannot be read); pitstop deletes only its own "
                "checkpoints. Remove it by hand if you mean to.")
        try:
            deleted = self.storage.delete_if_unread(name)
        except FileNotFoundError:
            deleted = True
        except OSError as e:
            raise CheckpointError(f"could not delete {where}: {e}") from e
        if not deleted:
            raise CheckpointError(
                f"{where} is being read (a restore, `pitstop verify`...) in another process; "
                "try again when it is done")
        self._forget(step)

    def _forget(self, step: int) -> None:
        """Drop a step that left the directory from the index (written now, or at the next
        commit when that fails)."""
        self._removed(step)
        with self.lock:
            self.index.pop(step, None)
            if self.read_only:
                return  # another rank than the leader: the leader writes the index
            try:
                self._write_index()
            except OSError as e:
                self.dirty = True
                log.warning("pitstop: could not update the index: %s", e)

    def _removed(self, step: int) -> None:
        if self.on_removed is not None:
            self.on_removed(self.naming.name(step))

    def forget(self, step: int) -> None:
        """Another rank than the leader: the leader removed ``step`` (moved it aside or
        deleted it), so this rank's index drops it too."""
        self._forget(step)

    # ------------------------------------------------------------------ moving aside
    def move_aside(self, step: int, reason: str) -> str | None:
        """Move a checkpoint out of the listing, whole ("corrupt", "abandoned"); returns its
        new name, or None when it stays (read-only, or a storage that cannot move it)."""
        if self.read_only:
            return None
        name = self.naming.name(step)
        users = self.referencing(step)
        if users and reason == "corrupt":
            # the checkpoints referencing it read their unchanged arrays from it: moving it
            # would break them too (each is checked, and moved aside, on its own)
            log.warning("pitstop: %s stays in place: it holds data referenced by step %s",
                        self.storage.path_of(name), ", ".join(map(str, users)))
            return None
        try:
            new = self.storage.move_aside(name, reason)
        except FileNotFoundError:
            new = None
        except OSError as e:
            log.warning("pitstop: could not move %s aside: %s", self.storage.path_of(name), e)
            return None
        if new is not None and reason == "abandoned":
            self.aside_seen = True
        self._forget(step)
        return new

    # ------------------------------------------------------------------ queries
    def best_so_far(self, metric: str | None, mode: str) -> float | None:
        if metric is None:
            return None
        vals = [i.metrics.get(metric) for i in self.index.values()]
        nums = [float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v)]
        if not nums:
            return None
        return min(nums) if mode == "min" else max(nums)

    def finite_steps(self) -> list[int]:
        with self.lock:
            return sorted(s for s, i in self.index.items() if i.all_finite)


__all__ = ["Catalog", "parse_index"]
