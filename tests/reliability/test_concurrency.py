"""Concurrency scenarios counted in trials (benchmarks/reliability/concurrency.py) at a
reduced count, and the defects they found, kept as deterministic tests of their own."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pitstop  # noqa: E402
from pitstop.core.storage.local import LocalStorage  # noqa: E402


class _RetainAfterListing(LocalStorage):
    """A reader's storage: right after its next listing, ``then()`` runs (the writer commits
    a newer step and its retention deletes the one just listed), as another process would
    between the reader's listing and its read."""

    then = None

    def list_checkpoints(self):
        names = super().list_checkpoints()
        then, self.then = self.then, None
        if then is not None:
            then()
        return names


@pytest.mark.parametrize("call", ["restore", "load"])
def test_a_reader_never_finds_nothing_when_retention_deletes_what_it_listed(tmp_path, call):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, keep_last=1, memory_tier=False,
                                   save_on_signals=None) as writer:
        writer.save(0, {"w": np.zeros(4)}).result(timeout=60)

        def commit_and_retain():
            writer.save(1, {"w": np.ones(4)}).result(timeout=60)
            assert writer.all_steps() == [1]  # step 0, just listed by the reader, is gone

        storage = _RetainAfterListing(d, create=False)
        with pitstop.CheckpointManager(storage, read_only=True) as reader:
            storage.then = commit_and_retain
            if call == "restore":
                target = {"w": np.full(4, 7.0)}
                assert reader.restore(target) == 1
                got = target
            else:
                got = reader.load()
            np.testing.assert_array_equal(got["w"], np.ones(4))
        assert storage.then is None  # the writer did come between


@pytest.mark.parametrize("call", ["restore", "load", "metadata"])
def test_a_step_deleted_while_a_reader_opens_it_is_not_found_not_corrupt(tmp_path, call):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, keep_last=1, memory_tier=False,
                                   save_on_signals=None) as writer:
        writer.save(0, {"w": np.zeros(4)}).result(timeout=60)
        storage = _RetainAfterListing(d, create=False)
        with pitstop.CheckpointManager(storage, read_only=True) as reader:
            storage.then = lambda: writer.save(1, {"w": np.ones(4)}).result(timeout=60)
            target = {"w": np.full(4, 7.0)}
            with pytest.raises(pitstop.CheckpointNotFoundError, match="deleted while"):
                if call == "restore":
                    reader.restore(target, step=0)
                elif call == "load":
                    reader.load(0)
                else:
                    reader.metadata(0)
            assert storage.then is None
            np.testing.assert_array_equal(target["w"], np.full(4, 7.0))  # untouched
            assert reader.all_steps() == [1]
