"""The one tolerant reader of ``.pitstop/directory.json`` (what ls, inspect, verify and gc
read of it): one parse, and each way the file can be wrong read as "nothing recorded", or
said in the words gc prints."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pitstop
from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.directory.records import read_record
from pitstop.core.errors import InvalidArgumentError
from pitstop.core.storage.local import LocalStorage


def _written(tmp_path, **kw):
    with pitstop.CheckpointManager(tmp_path, memory_tier=False, save_on_signals=None,
                                   keep_last=2, **kw) as mgr:
        mgr.save(1, {"w": np.ones(2)}).wait()
    return LocalStorage(str(tmp_path), create=False)


def _meta(tmp_path, text: str) -> LocalStorage:
    (tmp_path / ".pitstop").mkdir(exist_ok=True)
    (tmp_path / ".pitstop" / "directory.json").write_text(text)
    return LocalStorage(str(tmp_path), create=False)


def test_what_a_writer_recorded(tmp_path):
    record = read_record(_written(tmp_path, step_prefix="ckpt-", step_digits=0))
    doc = json.loads((tmp_path / ".pitstop" / "directory.json").read_text())
    assert record.present and not record.malformed and record.read_error is None
    assert record.naming() == Naming("ckpt-", 0)
    assert record.retention == [{"keep_last": 2}]
    assert record.directory_id == doc["directory_id"]
    assert record.tier_id() == (doc["directory_id"], None)
    assert not record.encrypted and record.skipped_line() is None


def test_no_file_records_nothing(tmp_path):
    record = read_record(LocalStorage(str(tmp_path), create=False))
    assert not record.present and record.doc is None
    assert record.naming() is DEFAULT and record.retention is None
    assert record.tier_id() == (None, None)


@pytest.mark.parametrize("text, problem", [
    ("{", "not valid JSON (or a key twice)"),
    ('{"directory_id": "a", "directory_id": "b"}', "not valid JSON (or a key twice)"),
    ("[1, 2]", "not a JSON object (found [1,2])"),
    ('{"directory_id": "a/b"}', 'no valid directory_id in it (found "a/b")'),
])
def test_a_damaged_file_reads_as_nothing_recorded(tmp_path, text, problem):
    record = read_record(_meta(tmp_path, text))
    assert record.present and record.naming() is DEFAULT and record.retention is None
    assert record.directory_id is None or record.directory_id == "a/b"
    assert record.tier_id() == (None, problem)


def test_an_invalid_naming_is_refused_not_guessed(tmp_path):
    record = read_record(_meta(tmp_path, '{"directory_id": "a", "naming": {"step_prefix": 5}}'))
    with pytest.raises(InvalidArgumentError):
        record.naming()


def test_skipped_saves_and_encryption(tmp_path):
    record = read_record(_meta(tmp_path, json.dumps(
        {"directory_id": "a", "encryption": {"key_id": "k"},
         "skipped": {"count": 2, "steps": [4, 6]}})))
    assert record.encrypted
    assert record.skipped_line().startswith("2 periodic saves skipped")
