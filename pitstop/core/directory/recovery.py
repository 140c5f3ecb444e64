"""Recovering a crashed job's newest snapshot from the memory tier.

At construction the manager looks for a snapshot this directory's previous writer left in
shared memory (see :mod:`pitstop.core.save.memtier` for when one is trusted). A trusted one is
verified (or, if the writer died before sealing it, hashed now), adopted as a staging
buffer, restored from directly by ``restore()`` / ``load()``, and persisted to disk in the
background like any save. From the moment it is adopted it counts as the newest step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.format.schema import SHARD_MARK, ArrayEntry, Manifest, group_pieces
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.save.engine import Engine
from pitstop.core.save.handles import SaveHandle, SaveStats
from pitstop.core.save.memtier import MemoryTier, malformed
from pitstop.core.save.persist import PersistJob, buffer_is_finite
from pitstop.core.save.snapshot import StagingBuffer, StagingPool
from pitstop.core.tree import decode_value

log = logging.getLogger("pitstop")


@dataclass
class Recovered:
    """A snapshot recovered from the memory tier, persisting in the background."""

    buffer: StagingBuffer
    reader: CheckpointReader
    step: int
    handle: SaveHandle


def recoverable_steps(tier: MemoryTier, newest_committed: int | None) -> set[int]:
    """The steps of the trusted snapshots :func:`recover` would consider (not yet verified)."""
    return {int(meta["step"]) for meta, _p in tier.candidates()
            if tier.trusted(meta, newest_committed) is None}


def discard(tier: MemoryTier, newest_committed: int | None) -> None:
    """Remove the tier files a killed job left for a manager opened with
    ``memory_tier=False``: it never reads them, and nothing else would ever remove them.
    A snapshot newer than what is committed (a save that had returned) is named in a
    warning, with how to recover it instead."""
    lost = sorted(recoverable_steps(tier, newest_committed))
    files = tier.files()
    if not files:
        return
    if lost:
        log.warning("pitstop: memory_tier=False: removed the memory-tier snapshot of step(s) "
                    "%s that a killed job left in %s, newer than the newest committed step %s; "
                    "open the directory with memory_tier=True (the default) to recover such a "
                    "snapshot instead", ", ".join(map(str, lost)), tier.root, newest_committed)
    tier.remove_all()


def recover(tier: MemoryTier, pool: StagingPool, engine: Engine,
            newest_committed: int | None, only: set[int] | None = None) -> list[Recovered]:
    """Adopt every trusted snapshot of ``tier`` newer than what is committed (oldest first;
    with ``max_in_flight`` > 1 a crash can leave several, each a save that had returned),
    submit their persists, and delete the rest. ``only``: the steps a multi-rank job's
    ranks all hold (the others are deleted)."""
    keep: set[str] = set()
    recovered: list[Recovered] = []
    for meta, buf_path in reversed(tier.candidates()):  # oldest first: commit in order
        why = tier.trusted(meta, newest_committed)
        if why is None and only is not None and meta["step"] not in only:
            why = "not every rank of the job holds this step"
        if why is not None:
            # a malformed description is damage (or tampering): said louder than a stale one
            (log.warning if malformed(meta) is not None else log.info)(
                "pitstop: ignoring memory-tier snapshot %s: %s", buf_path, why)
            continue
        if any(r.step == meta["step"] for r in recovered):
            continue
        try:
            buf = tier.open_buffer(meta, buf_path)
            # (encoded as in a manifest; an older pitstop's plain JSON decodes to itself)
            metrics = decode_value(meta.get("metrics") or {})
            user_metadata = decode_value(meta.get("user_metadata") or {})
            hashes = meta["hashes"]
            algorithm = meta["hash_algorithm"] if hashes is not None else engine.hash_algorithm
            if hashes is None:
                # described (complete) but not sealed: the writer died while hashing it
                hashes = engine.hash_all(buf)
            reader = CheckpointReader(
                _BufferStorage(buf, _tier_manifest(meta, hashes, algorithm, metrics,
                                                   user_metadata), buf_path),
                "memory-tier")
            if meta["hashes"] is not None:
                reader.verify()
            if meta.get("check_finite") and not buffer_is_finite(buf):
                # the non-finite guard would have skipped it: never resume from it
                raise ValueError("an array holds NaN or Inf (non-finite guard)")
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("pitstop: memory-tier snapshot of step %s is unusable: %s",
                        meta.get("step"), e)
            continue
        step = int(meta["step"])
        log.warning("pitstop: found step %d in the memory tier, newer than the newest "
                    "committed step %s: restoring from memory and persisting it",
                    step, newest_committed)
        pool.adopt(buf)
        buf.step = step
        keep |= {buf_path, buf_path[: -len(".buf")] + ".json"}
        handle = SaveHandle(step, SaveStats(step=step, bytes=buf.layout.total,
                                            arrays=len(buf.layout.keys)))
        job = PersistJob(step=step, buffer=buf, values=meta["values"], structure=meta["structure"],
                         metrics=metrics, handle=handle,
                         user_metadata=user_metadata, hashes=hashes,
                         check_finite=bool(meta.get("check_finite")),
                         created_unix=_created(meta), frameworks=_frameworks(meta),
                         layouts=_layouts(meta))
        job.release_buffer = False  # restore() may still read it; released by the manager
        engine.submit(job)
        recovered.append(Recovered(buf, reader, step, handle))
    tier.remove_all(keep=keep)
    return recovered


def _created(meta: dict[str, Any]) -> float:
    """When the recovered snapshot's save() was called (0.0 from an older pitstop)."""
    t = meta.get("created_unix")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def _frameworks(meta: dict[str, Any]) -> dict[str, str]:
    """The frameworks the snapshot's save recorded (none from an older pitstop, or when
    the description holds something else)."""
    fw = meta.get("frameworks")
    if isinstance(fw, dict) and all(isinstance(k, str) and isinstance(v, str)
                                    for k, v in fw.items()):
        return dict(fw)
    return {}


def _layouts(meta: dict[str, Any]) -> dict[str, Any]:
    """The layouts the snapshot's save recorded (none from an older pitstop)."""
    layouts = meta.get("layouts")
    if isinstance(layouts, dict):
        return {k: v for k, v in layouts.items() if isinstance(k, str) and isinstance(v, dict)}
    return {}


def _tier_manifest(meta: dict[str, Any], hashes: dict[str, str], algorithm: str,
                   metrics: Any, user_metadata: Any) -> bytes:
    """A manifest describing a memory-tier buffer, so the normal reader can verify it."""
    m = Manifest(step=int(meta["step"]), hash_algorithm=algorithm,
                 structure=meta["structure"], values=meta["values"],
                 metrics=metrics, directory_id=meta.get("directory_id"),
                 created_unix=_created(meta), user_metadata=user_metadata)
    layout = meta["layout"]
    m.files["shm.buf"] = int(layout["total"])
    for k, dt, shape, off, n in layout["arrays"]:
        m.arrays[k] = ArrayEntry(dtype=dt, shape=list(shape), file="shm.buf", offset=int(off),
                                 length=int(n), hash=hashes[k])
    if any(SHARD_MARK in k for k in m.arrays):
        m.arrays = group_pieces(m.arrays)
    m.layouts = {k: v for k, v in _layouts(meta).items() if k in m.arrays}
    return m.to_bytes()


class _BufferStorage:
    """Just enough of the Storage interface to read a memory-tier buffer with the reader."""

    def __init__(self, buf: StagingBuffer, manifest: bytes, location: str) -> None:
        self.buf = buf
        self.manifest = manifest
        self.location = location

    def path_of(self, name: str, relpath: str = "") -> str:
        return f"memory tier {self.location}"

    def read_bytes(self, name: str, relpath: str) -> bytes:
        return self.manifest

    def size(self, name: str, relpath: str) -> int:
        return int(self.buf.buf.size)

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        view = memoryview(out).cast("B")
        src = self.buf.buf[offset:offset + len(view)]
        view[: len(src)] = src.data
        return len(src)


__all__ = ["Recovered", "recover"]
