"""The in-memory tier: the newest snapshot kept in shared memory so it outlives a crash.

The staging buffer of a save *is* a file in ``/dev/shm`` (``<prefix>-<slot>.buf``); beside
it ``<prefix>-<slot>.json`` describes it. The description is removed before a snapshot
overwrites the buffer, written again as soon as the copy is complete (before ``save()``
returns: "described", without hashes), and rewritten with every array's hash once the
persist thread has hashed them ("sealed"). A torn buffer is never described. A restarted
job trusts a described snapshot only when all of these hold:

* same host and same boot (hostname and ``/proc/sys/kernel/random/boot_id``): a process
  crash cannot tear a tmpfs copy that was complete, a reboot empties the tmpfs;
* same checkpoint directory (real path and the directory's id);
* its step is newer than the newest committed checkpoint on disk;
* when it is sealed, every array's bytes match the hash recorded at sealing (an unsealed
  one is hashed at recovery).

Then it restores from memory and finishes persisting that snapshot. Everything else is
deleted. ``close()`` of the manager removes the tier's files.

Trust in the file itself: /dev/shm is shared by every user of the machine, so a tier file
(description or buffer) is read only when it is a regular file (never a symlink) owned by
this process's user and writable by nobody else (:func:`untrusted_file`); any other is
skipped with one warning naming it and its owner, and cleanup leaves it alone. The tier creates its
files owner-only (0o600) with ``O_EXCL | O_NOFOLLOW``, so a file or symlink another user
planted at one of its names is never written through.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging
import math
import os
import re
import socket
from typing import Any

from pitstop.core.format.dtypes import decode_dtype, encode_dtype
from pitstop.core.runtime.host import boot_id
from pitstop.core.save.shmfiles import (
    create_owned,
    owner_name,  # noqa: F401 - the cli names owners with memtier.owner_name
    untrusted_file,
)
from pitstop.core.save.snapshot import Layout, StagingBuffer
from pitstop.core.tree import encode_value

log = logging.getLogger("pitstop")


def default_root() -> str | None:
    """``/dev/shm`` when it exists and is writable, else None (tier off)."""
    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


class MemoryTier:
    def __init__(self, root: str, directory: str, directory_id: str, part: str = "") -> None:
        self.root = root
        # (an object store's URL names it as it is: no local path can stand for it)
        self.directory = directory if _is_url(directory) else os.path.realpath(directory)
        self.directory_id = directory_id
        #: which rank's part of a multi-rank job's state these snapshots hold ("" alone)
        self.part = part
        self._host = socket.gethostname()
        self._boot = boot_id()
        self._layout_cache: tuple[Any, str] = (None, "")
        self._structure_cache: tuple[Any, str | None] = (None, None)
        #: path -> the description this process wrote there last (mark_committed starts
        #: from it)
        self._texts: dict[str, str] = {}
        # the real path is part of the name: a copied run directory keeps its directory_id,
        # and must not share (and truncate) the original's live buffers
        where = hashlib.sha1((self.directory + part).encode()).hexdigest()[:8]
        self.prefix = os.path.join(root, f"pitstop-{directory_id}-{where}")
        #: the untrusted tier files already warned about (one warning each)
        self._warned: set[str] = set()

    def read_description(self, path: str, quiet: bool = False) -> Any:
        """The JSON of the description at ``path``, or None when it is gone, unreadable, or
        not trusted (:func:`untrusted_file`: warned once, naming the file and its owner) or
        not a JSON object;
        an unreadable one is warned about unless ``quiet``."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None  # removed meanwhile (its writer is overwriting the buffer)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink: O_NOFOLLOW refused it
                self._untrusted(path, os.lstat(path) if os.path.lexists(path) else None)
            elif not quiet:
                log.warning("pitstop: ignoring memory-tier description %s: unreadable (%s)",
                            path, type(e).__name__)
            return None
        try:
            st = os.fstat(fd)
            if untrusted_file(st) is not None:
                self._untrusted(path, st)
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                meta = json.loads(f.read())
            if not isinstance(meta, dict):
                if not quiet:
                    log.warning("pitstop: ignoring memory-tier description %s: not an object",
                                path)
                return None
            return meta
        except (OSError, ValueError, RecursionError) as e:
            if not quiet:
                log.warning("pitstop: ignoring memory-tier description %s: unreadable (%s)",
                            path, type(e).__name__)
            return None
        finally:
            os.close(fd)

    def _untrusted(self, path: str, st: os.stat_result | None) -> None:
        if path in self._warned:
            return
        self._warned.add(path)
        why = untrusted_file(st) if st is not None else "it is a symlink"
        log.warning("pitstop: ignoring memory-tier file %s: %s. The memory tier only trusts "
                    "regular files its own user owns and no one else can write; remove it "
                    "if it is not yours to keep.", path, why)

    def _own(self, path: str) -> bool:
        """``path`` (not followed) is this user's to remove: owned by this process's user."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if st.st_uid != os.geteuid():
            self._untrusted(path, st)
            return False
        return True

    def meta_path(self, buf: StagingBuffer) -> str:
        assert buf.shm_path is not None
        return buf.shm_path[: -len(".buf")] + ".json"

    def invalidate(self, buf: StagingBuffer) -> None:
        """Called before a snapshot overwrites ``buf``. Another user's file at the
        description's name (planted: the names are listed in /dev/shm) is left alone, never
        removed, and does not fail the save: in a sticky /dev/shm its unlink would raise
        EPERM, and as root it would remove another user's file (the description is then
        not written: :meth:`_write_text` refuses to replace it)."""
        path = self.meta_path(buf)
        if not self._own(path):
            return  # gone (nothing to do), or another user's (warned once by _own)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def describe(self, buf: StagingBuffer, job: Any) -> None:
        """The snapshot in ``buf`` is complete: describe it (no hashes yet). Called on the
        training thread before ``save()`` returns, so it is kept cheap: the layout's JSON is
        made once per layout."""
        self._write_meta(buf, job, None, None)

    def seal(self, buf: StagingBuffer, job: Any, hashes: dict[str, str], algorithm: str) -> None:
        """Add every array's hash to the description (the persist thread, after hashing)."""
        self._write_meta(buf, job, hashes, algorithm)

    def _write_meta(self, buf: StagingBuffer, job: Any, hashes: dict[str, str] | None,
                    algorithm: str | None) -> None:
        # the layout's JSON once per layout, the structure's while it stays equal (one item
        # per array: 100,000 small tensors made it a third of the training thread's stall).
        # Each cache is one (object, text) pair, swapped whole: the training thread
        # (describe) and the persist thread (seal) both come here
        layout_of, layout_json = self._layout_cache
        if layout_of is not buf.layout:
            layout_json = json.dumps(buf.layout.to_json(), separators=(",", ":"))
            self._layout_cache = (buf.layout, layout_json)
        structure = job.structure
        structure_of, structure_json = self._structure_cache
        if structure_json is None or not (structure is structure_of
                                          or structure == structure_of):
            structure_json = json.dumps(structure, separators=(",", ":"))
            self._structure_cache = (structure, structure_json)
        head = {
            "host": self._host, "boot_id": self._boot, "pid": os.getpid(),
            "directory": self.directory, "directory_id": self.directory_id,
            "part": self.part, "step": job.step, "committed": False,
            "hashes": hashes, "hash_algorithm": algorithm,
            "values": job.values,
            # encoded as in the manifest: bytes, tuples, non-str keys and non-finite floats
            # are JSON only so, and come back as they were saved when recovered
            "metrics": encode_value(job.metrics),
            "user_metadata": encode_value(job.user_metadata), "check_finite": job.check_finite,
            "created_unix": job.created_unix,
            # (the manifest's writer["frameworks"] when a restart persists this snapshot)
            "frameworks": getattr(job, "frameworks", None) or {},
            # (the manifest's layouts: a recovered sharded array is placed as it was saved)
            "layouts": getattr(job, "layouts", None) or {},
        }
        text = json.dumps(head, separators=(",", ":"))
        path = self.meta_path(buf)
        text = (text[:-1] + ',"structure":' + structure_json + ',"layout":' + layout_json
                + "}")
        self._write_text(path, text)
        self._texts[path] = text

    def mark_committed(self, buf: StagingBuffer) -> None:
        path = self.meta_path(buf)
        last = self._texts.pop(path, None)
        if last is not None and self._own(path):
            # the description this process wrote last (the seal): marked committed from
            # its text, without reading back and re-encoding one entry per array. Every
            # string in it is JSON-escaped, so only the key itself reads ',"committed":false,'
            self._write_text(path, last.replace(',"committed":false,',
                                                   ',"committed":true,', 1))
            return
        meta = self.read_description(path)
        if not isinstance(meta, dict):
            return
        meta["committed"] = True
        self._write(path, meta)

    def _write(self, path: str, meta: dict[str, Any]) -> None:
        self._write_text(path, json.dumps(meta, separators=(",", ":")))

    def _write_text(self, path: str, text: str) -> None:
        tmp = path + ".tmp"
        if os.path.lexists(path) and not self._own(path):
            # another user's file in the way: never replaced (as root rename would)
            raise OSError(errno.EEXIST, f"memory-tier file {path} is in the way and not "
                          "pitstop's to replace (another user's)", path)
        with os.fdopen(create_owned(tmp, os.O_WRONLY), "w") as f:
            f.write(text)
        try:
            os.replace(tmp, path)
        except OSError:
            os.unlink(tmp)  # (ours: made just now) e.g. EPERM from a sticky /dev/shm
            raise

    # ------------------------------------------------------------------ recovery
    def candidates(self) -> list[tuple[dict[str, Any], str]]:
        """Described snapshots of this directory, newest first (meta, buffer path): under
        this directory's own prefix, and under the prefix of a path this directory was
        moved from (same id; the path it was written for no longer exists)."""
        out = []
        for meta_path in self._descriptions():
            if not _SLOT.match(meta_path[meta_path.rindex("-"):]):
                continue
            meta = self.read_description(meta_path)
            if meta is None:
                continue  # gone, unreadable, untrusted or not an object (said by the read)
            out.append((meta, meta_path[: -len(".json")] + ".buf"))
        out.sort(key=lambda mb: -_step_of(mb[0]))
        return out

    def _descriptions(self) -> list[str]:
        own = glob.glob(f"{glob.escape(self.prefix)}-*.json")
        moved = []
        for path in glob.glob(os.path.join(glob.escape(self.root),
                                           f"pitstop-{glob.escape(self.directory_id)}-*.json")):
            if path.startswith(self.prefix + "-"):
                continue
            meta = self.read_description(path, quiet=True)
            if not isinstance(meta, dict):
                continue
            written_for, part = meta.get("directory"), meta.get("part", "")
            if isinstance(written_for, str) and not _is_url(written_for) and \
                    not os.path.exists(written_for) and part == self.part:
                moved.append(path)
        return own + moved

    def trusted(self, meta: dict[str, Any], newest_committed: int | None) -> str | None:
        """None when ``meta`` may be used, else the reason it may not."""
        why = malformed(meta)
        if why is not None:
            return why
        if meta.get("host") != socket.gethostname() or meta.get("boot_id") != boot_id():
            return "written on another host or before a reboot"
        if meta.get("directory_id") != self.directory_id:
            return "written for another checkpoint directory"
        if meta.get("part", "") != self.part:
            return "another rank's part of the state"
        if meta.get("directory") != self.directory and (
                not isinstance(meta.get("directory"), str) or _is_url(meta["directory"])
                or os.path.exists(meta["directory"])):
            # a copy of this directory (same id) elsewhere: never use or touch its snapshot;
            # only a directory that was moved here (its old path is gone) takes it over
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

    def files(self) -> list[str]:
        """This directory's tier files (also those written under a path it was moved from):
        only names the tier itself makes."""
        out = [p for p in glob.glob(f"{glob.escape(self.prefix)}-*")
               if FILE_NAME.match(p[len(self.prefix):]) and self._own(p)]
        for meta_path in self._descriptions():
            if not meta_path.startswith(self.prefix + "-"):
                base = meta_path[: -len(".json")]
                out += [x for x in (base + ".buf", meta_path) if self._own(x)]
        return sorted(set(out))

    def remove_all(self, keep: set[str] | None = None) -> None:
        for path in self.files():
            if keep and path in keep:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                # (a directory made under a tier file's name, a read-only /dev/shm): not a
                # file the tier can use or remove; opening the directory still works
                if path in self._warned:
                    continue
                self._warned.add(path)
                log.warning("pitstop: cannot remove memory-tier file %s (%s); remove it by "
                            "hand", path, e.strerror or type(e).__name__)


_SLOT = re.compile(r"^-\d+\.json$")
#: every file name the tier makes below its prefix (buffer, description, its temporary):
#: ``-<slot>.buf``, ``-<slot>.json``, ``-<slot>.json.tmp`` (groups: the slot, the kind)
FILE_NAME = re.compile(r"^-(\d+)\.(buf|json|json\.tmp)$")


def _is_url(location: str) -> bool:
    from pitstop.core.storage import is_url
    return is_url(location)


def _step_of(meta: dict[str, Any]) -> int:
    step = meta.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def malformed(meta: Any) -> str | None:
    """Why a tier description cannot be used as one, or None when its fields are sound."""
    if not isinstance(meta, dict):
        return "not a description"
    if _step_of(meta) < 0:
        return f"its step {meta.get('step')!r} is not a non-negative integer"
    for key, kind in (("layout", dict), ("values", dict), ("structure", (dict, int)),
                      ("hashes", (dict, type(None)))):
        if not isinstance(meta.get(key), kind):
            return f"its {key!r} is missing or malformed"
    if meta.get("hashes") is not None and not isinstance(meta.get("hash_algorithm"), str):
        return "its 'hash_algorithm' is missing"
    if meta.get("hashes") is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta["hashes"].items()):
        return "its 'hashes' are not strings"
    try:
        layout_from_json(meta["layout"])
    except ValueError as e:
        return f"its layout is malformed ({e})"
    return None


def layout_from_json(doc: Any) -> Layout:
    """The layout a tier description records, checked before anything is mapped with it:
    distinct keys, known dtypes, sane shapes, each array's bytes (its shape times its
    itemsize) inside the buffer's total; ValueError otherwise."""
    from pitstop.core.format.schema import MAX_BYTES, MAX_NDIM

    if not isinstance(doc, dict) or not isinstance(doc.get("arrays"), list):
        raise ValueError("it has no list of arrays")
    total = doc.get("total")
    if type(total) is not int or not 0 <= total <= MAX_BYTES:
        raise ValueError(f"total {str(total)[:40]} is not a byte count")
    keys, shapes, dtypes, offsets, sizes = [], [], [], [], []
    for item in doc["arrays"]:
        if not isinstance(item, list) or len(item) != 5:
            raise ValueError(f"array entry {str(item)[:60]} is not [key, dtype, shape, "
                             "offset, length]")
        k, dt, shape, off, n = item
        if not isinstance(k, str) or not isinstance(dt, (str, list)) or \
                not isinstance(shape, list) or len(shape) > MAX_NDIM or \
                not all(type(x) is int and 0 <= x <= MAX_BYTES for x in [*shape, off, n]):
            raise ValueError(f"array entry {str(item)[:60]} is malformed")
        try:
            dtype = decode_dtype(dt)
            encode_dtype(dtype)
        except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad descriptor
            raise ValueError(f"array {k!r}: dtype {str(dt)[:40]} is not one pitstop "
                             f"reads ({type(e).__name__})") from None
        if n != math.prod(shape) * dtype.itemsize or off + n > total:
            raise ValueError(f"array {k!r}: {n} bytes at {off} do not hold its shape "
                             f"{shape[:8]} of {dtype} inside the buffer's {total} bytes")
        keys.append(k)
        dtypes.append(dtype)
        shapes.append(tuple(shape))
        offsets.append(off)
        sizes.append(n)
    if len(set(keys)) != len(keys):
        raise ValueError("an array is listed twice")
    starts = doc.get("group_starts") or ([0] if keys else [])
    if not isinstance(starts, list) or not all(type(x) is int for x in starts) or \
            (keys and starts[:1] != [0]) or starts != sorted(set(starts)) or \
            any(not 0 <= x < max(1, len(keys)) for x in starts):
        raise ValueError(f"group_starts {str(starts)[:40]} are not ascending array indices")
    return Layout(tuple(keys), tuple(shapes), tuple(dtypes), tuple(offsets), tuple(sizes),
                  total, tuple(starts))
