"""Concurrency scenarios counted in trials (benchmarks/reliability/concurrency.py) at a
reduced count, and the defects they found, kept as deterministic tests of their own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pitstop  # noqa: E402
from benchmarks.reliability import concurrency  # noqa: E402
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


# ------------------------------------------------------------------ the scenarios, reduced

SEED = int(os.environ.get("PITSTOP_TORTURE_SEED", int.from_bytes(os.urandom(3), "little")))


def _run(name: str, trials: int, tmp_path: Path):
    res = concurrency.SCENARIOS[name](trials, SEED, tmp_path)
    print(res.line(), f"(seed {SEED})")
    assert res.failures == 0, (f"seed {SEED} (PITSTOP_TORTURE_SEED={SEED} repeats it):\n"
                               + "\n".join(res.details))
    assert res.trials == trials
    return res


def test_restore_during_retention_is_exact_or_clear(tmp_path):
    res = _run("restore_during_retention", 3, tmp_path)
    assert res.counts["exact_reads"] > 0 and res.counts["retention_deletions"] > 0


def test_two_writers_one_refused_then_taking_over(tmp_path):
    res = _run("two_writers", 3, tmp_path)
    assert res.counts["refused_while_alive"] == 3 and res.counts["took_over"] == 3


def test_a_reader_sees_only_committed_checkpoints_while_the_writer_saves(tmp_path):
    res = _run("reader_while_writer_saves", 3, tmp_path)
    assert res.counts["exact_reads"] > 0 and res.counts["retention_deletions"] > 0


def test_restore_while_the_same_step_is_in_flight(tmp_path):
    res = _run("restore_while_same_step_in_flight", 8, tmp_path)
    assert res.counts["held_in_flight"] == 8
    assert res.counts["read_only_not_found_in_flight"] == 8


class _RetainWhileListing(LocalStorage):
    """A reader's storage whose next listing is torn as another process makes it torn:
    the entries are read, then the writer commits a newer step and its retention deletes
    the listed one, then each listed entry's manifest is checked (LocalStorage's listing)."""

    then = None

    def list_checkpoints(self):
        entries = os.listdir(self.location)
        then, self.then = self.then, None
        if then is not None:
            then()
        return [e for e in entries if not e.startswith(".")
                and os.path.isfile(os.path.join(self.location, e, "manifest.json"))]


@pytest.mark.parametrize("call", ["restore", "load"])
def test_a_listing_torn_by_retention_never_reads_as_an_empty_directory(tmp_path, call):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, keep_last=1, memory_tier=False,
                                   save_on_signals=None) as writer:
        writer.save(0, {"w": np.zeros(4)}).result(timeout=60)
        storage = _RetainWhileListing(d, create=False)
        with pitstop.CheckpointManager(storage, read_only=True) as reader:
            storage.then = lambda: writer.save(1, {"w": np.ones(4)}).result(timeout=60)
            target = {"w": np.full(4, 7.0)}
            if call == "restore":
                assert reader.restore(target) == 1  # not None: "nothing to resume"
            else:
                target = reader.load()
            np.testing.assert_array_equal(target["w"], np.ones(4))
            assert storage.then is None


class _RetainAfterReadingEntries(LocalStorage):
    """Between reading the directory's entries and checking their manifests, the writer
    commits a newer step and its retention deletes the listed one (another process)."""

    then = None

    def _entries(self):
        entries = super()._entries()
        then, self.then = self.then, None
        if then is not None:
            then()
        return entries


def test_a_listing_made_while_retention_deletes_is_never_short(tmp_path):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, keep_last=1, memory_tier=False,
                                   save_on_signals=None) as writer:
        writer.save(0, {"w": np.zeros(4)}).result(timeout=60)
        storage = _RetainAfterReadingEntries(d, create=False)
        with pitstop.CheckpointManager(storage, read_only=True) as reader:
            storage.then = lambda: writer.save(1, {"w": np.ones(4)}).result(timeout=60)
            assert reader.all_steps() == [1]  # not []: step 0 gone, step 1 not yet seen
            assert storage.then is None
