"""Which of a directory's memory-tier files ``pitstop gc`` removes: only regular files the
tier names (``<prefix>-<slot>.buf|.json[.tmp]``), and never a snapshot the next manager on
the directory would recover, unless asked to drop it."""

from __future__ import annotations

import json
import os
import socket

from pitstop.core.runtime.host import boot_id
from pitstop.core.save.memtier import MemoryTier
from pitstop.core.save.tier_files import stale_files


def _tier(tmp_path):
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    tier = MemoryTier(str(shm), str(run), "abc123")
    stem = os.path.basename(tier.prefix)
    meta = {"host": socket.gethostname(), "boot_id": boot_id(),
            "directory": os.path.realpath(run), "directory_id": "abc123",
            "layout": {"total": 8, "group_starts": [0], "arrays": [["w", "<f8", [1], 0, 8]]},
            "values": {}, "structure": {}, "hashes": None}
    for slot, step in ((0, 3), (1, 9)):  # slot 0: older than the newest committed step
        (shm / f"{stem}-{slot}.json").write_text(json.dumps({**meta, "step": step}))
        (shm / f"{stem}-{slot}.buf").write_bytes(b"\0" * 8)
    (shm / f"{stem}-2.json.tmp").write_text("{")
    (shm / f"{stem}-3.buf.bak").write_bytes(b"")  # a look-alike: not a name the tier makes
    (shm / f"{stem}-4.buf").mkdir()  # not a regular file
    (shm / "pitstop-other-0badcafe-0.buf").write_bytes(b"")  # another directory's
    return tier, shm, stem


def test_stale_files_keep_the_recoverable_snapshot(tmp_path):
    tier, shm, stem = _tier(tmp_path)
    doomed, kept = stale_files(tier, 5, drop_recoverable=False)
    assert sorted(os.path.basename(p) for p in doomed) == [
        f"{stem}-0.buf", f"{stem}-0.json", f"{stem}-2.json.tmp"]
    assert len(kept) == 1 and kept[0].startswith(str(shm / f"{stem}-1.buf"))
    assert "snapshot of step 9, newer than the newest committed step" in kept[0]


def test_drop_recoverable_and_a_newer_commit(tmp_path):
    tier, _shm, stem = _tier(tmp_path)
    every = [f"{stem}-{n}" for n in ("0.buf", "0.json", "1.buf", "1.json", "2.json.tmp")]
    doomed, kept = stale_files(tier, 5, drop_recoverable=True)
    assert sorted(os.path.basename(p) for p in doomed) == every and kept == []
    doomed, kept = stale_files(tier, 9, drop_recoverable=False)  # step 9 committed since
    assert sorted(os.path.basename(p) for p in doomed) == every and kept == []
