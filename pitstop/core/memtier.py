"""The in-memory tier: the newest snapshot kept in shared memory so it outlives a crash.

The staging buffer of a save *is* a file in ``/dev/shm`` (``<prefix>-<slot>.buf``); beside
it ``<prefix>-<slot>.json`` describes it. The description is removed before a snapshot
overwrites the buffer and written ("sealed") once the persist thread has hashed every
array, so a torn or unhashed buffer is never described. A restarted job trusts a sealed
snapshot only when all of these hold:

* same host and same boot (hostname and ``/proc/sys/kernel/random/boot_id``);
* same checkpoint directory (real path and the directory's id);
* its step is newer than the newest committed checkpoint on disk;
* every array's bytes match the hash recorded at sealing.

Then it restores from memory and finishes persisting that snapshot. Everything else is
deleted. ``close()`` of the manager removes the tier's files.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import socket
from typing import Any

from .dtypes import decode_dtype, encode_dtype
from .snapshot import Layout, StagingBuffer
from .tree import encode_value

log = logging.getLogger("pitstop")


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def default_root() -> str | None:
    """``/dev/shm`` when it exists and is writable, else None (tier off)."""
    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


class MemoryTier:
    def __init__(self, root: str, directory: str, directory_id: str) -> None:
        self.root = root
        self.directory = os.path.realpath(directory)
        self.directory_id = directory_id
        # the real path is part of the name: a copied run directory keeps its directory_id,
        # and must not share (and truncate) the original's live buffers
        where = hashlib.sha1(self.directory.encode()).hexdigest()[:8]
        self.prefix = os.path.join(root, f"pitstop-{directory_id}-{where}")

    def meta_path(self, buf: StagingBuffer) -> str:
        assert buf.shm_path is not None
        return buf.shm_path[: -len(".buf")] + ".json"

    def invalidate(self, buf: StagingBuffer) -> None:
        """Called before a snapshot overwrites ``buf``."""
        try:
            os.unlink(self.meta_path(buf))
        except FileNotFoundError:
            pass

    def seal(self, buf: StagingBuffer, job: Any, hashes: dict[str, str], algorithm: str) -> None:
        meta = {
            "host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(),
            "directory": self.directory, "directory_id": self.directory_id,
            "step": job.step, "committed": False, "layout": buf.layout.to_json(),
            "hashes": hashes, "hash_algorithm": algorithm,
            "values": {k: encode_value(v, k) for k, v in job.values.items()},
            "structure": job.structure, "metrics": job.metrics,
            "user_metadata": job.user_metadata, "check_finite": job.check_finite,
        }
        self._write(self.meta_path(buf), meta)

    def mark_committed(self, buf: StagingBuffer) -> None:
        path = self.meta_path(buf)
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return
        meta["committed"] = True
        self._write(path, meta)

    def _write(self, path: str, meta: dict[str, Any]) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f, separators=(",", ":"))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ recovery
    def candidates(self) -> list[tuple[dict[str, Any], str]]:
        """Sealed snapshots of this directory, newest first (meta, buffer path)."""
        out = []
        for meta_path in glob.glob(f"{self.prefix}-*.json"):
            try:
                with open(meta_path) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            out.append((meta, meta_path[: -len(".json")] + ".buf"))
        out.sort(key=lambda mb: -int(mb[0].get("step", -1)))
        return out

    def trusted(self, meta: dict[str, Any], newest_committed: int | None) -> str | None:
        """None when ``meta`` may be used, else the reason it may not."""
        if meta.get("host") != socket.gethostname() or meta.get("boot_id") != boot_id():
            return "written on another host or before a reboot"
        if meta.get("directory") != self.directory or meta.get("directory_id") != self.directory_id:
            return "written for another checkpoint directory"
        if meta.get("committed"):
            return "already committed to disk"
        if newest_committed is not None and int(meta["step"]) <= newest_committed:
            return f"not newer than the committed step {newest_committed}"
        return None

    def open_buffer(self, meta: dict[str, Any], buf_path: str) -> StagingBuffer:
        """Map a recovered buffer (without truncating it) as a StagingBuffer."""
        layout = layout_from_json(meta["layout"])
        if os.path.getsize(buf_path) < layout.total:
            raise ValueError("memory-tier buffer is shorter than its layout")
        return StagingBuffer.attach(layout, buf_path)

    def remove_all(self, keep: set[str] | None = None) -> None:
        for path in glob.glob(f"{self.prefix}-*"):
            if keep and path in keep:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def layout_from_json(doc: dict[str, Any]) -> Layout:
    keys, shapes, dtypes, offsets, sizes = [], [], [], [], []
    for k, dt, shape, off, n in doc["arrays"]:
        keys.append(k)
        dtypes.append(decode_dtype(dt))
        shapes.append(tuple(shape))
        offsets.append(int(off))
        sizes.append(int(n))
    layout = Layout(tuple(keys), tuple(shapes), tuple(dtypes), tuple(offsets), tuple(sizes),
                    int(doc["total"]), tuple(doc.get("group_starts") or ([0] if keys else [])))
    assert all(encode_dtype(d) is not None for d in layout.dtypes)
    return layout
