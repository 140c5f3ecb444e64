"""One file written atomically beside its integrity record (pitstop.core.storage.sidecar), as
the Keras face's ModelCheckpoint uses it, without a framework: a fill function writes bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from pitstop.core.storage import sidecar

KW = {"record_suffix": ".rec", "record_format": "test-integrity"}


def _write(path: Path, data: bytes, info: dict | None = None) -> None:
    def fill(tmp: str) -> None:
        assert os.path.dirname(tmp) == str(path.parent) and tmp != str(path)
        with open(tmp, "wb") as f:
            f.write(data)

    sidecar.write_with_record(str(path), fill, info=info, **KW)


def test_written_file_verifies_and_holds_the_info(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.bin"
    _write(path, b"payload" * 1000, {"epoch": 3})
    assert path.read_bytes() == b"payload" * 1000
    body = sidecar.verify_with_record(path, writer_name="the test", **KW)
    assert body["bytes"] == 7000 and body["epoch"] == 3 and body["file"] == "m.bin"
    assert sorted(os.listdir(path.parent)) == ["m.bin", "m.bin.rec"]  # no temporary left


def test_a_tampered_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    _write(path, b"abcdef")
    path.write_bytes(b"abcdeX")
    with pytest.raises(CorruptCheckpointError, match="does not match its integrity record"):
        sidecar.verify_with_record(path, writer_name="the test", **KW)


def test_a_record_of_another_format_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    _write(path, b"abcdef")
    rec = Path(str(path) + ".rec")
    body = json.loads(rec.read_text())
    body["format"] = "something-else"
    rec.write_text(json.dumps(body))
    with pytest.raises(CorruptCheckpointError, match="not a valid pitstop integrity record"):
        sidecar.verify_with_record(path, writer_name="the test", **KW)


def test_a_missing_record_names_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    _write(path, b"abcdef")
    os.unlink(str(path) + ".rec")
    with pytest.raises(CheckpointNotFoundError, match="it was not written by the test, or"):
        sidecar.verify_with_record(path, writer_name="the test", **KW)
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        sidecar.verify_with_record(tmp_path / "none.bin", writer_name="the test", **KW)


def test_a_failed_fill_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    _write(path, b"old")

    def broken(tmp: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        sidecar.write_with_record(str(path), broken, **KW)
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.bin.rec"]
    assert sidecar.verify_with_record(path, writer_name="the test", **KW)["bytes"] == 3


def test_remove_with_record_deletes_both(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    _write(path, b"abc")
    sidecar.remove_with_record(str(path), record_suffix=".rec")
    assert os.listdir(tmp_path) == []
    sidecar.remove_with_record(str(path), record_suffix=".rec")  # already gone: no error


def test_a_dead_writers_temporary_is_removed_a_live_ones_stays(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = os.path.basename(sidecar._tmp_name(str(tmp_path / "m.weights.h5"), (".weights.h5",)))
    assert mine.endswith(".pitstop-tmp.weights.h5")
    theirs = mine.replace(f".{os.getpid()}-", f".{dead.pid}-")
    for name in (mine, theirs, "m.bin"):
        (tmp_path / name).write_bytes(b"x")
    assert sidecar.remove_stale_temporaries(str(tmp_path)) == [theirs]
    assert sorted(os.listdir(tmp_path)) == sorted([mine, "m.bin"])
