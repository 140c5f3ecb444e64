"""Crash torture at a reduced count (``benchmarks/reliability/crash.py``): a job that saves
every step is SIGKILLed in each phase of a save (snapshot, hash, write, commit, retention)
and of its own restart (restore), and at random moments, with and without the memory tier.
Every restart restores a step at least as new as the last one reported committed, exactly as
saved; no leftovers survive the next start; every checkpoint on disk is exact; nothing of
the run stays in /dev/shm after a clean close."""

from __future__ import annotations

import pytest

from benchmarks.reliability import crash

TRIALS = 24  # twelve per run directory: each aimed phase at least once in each
SEED = 1234


@pytest.mark.timeout(400)
def test_sigkill_in_every_phase_never_loses_or_corrupts_a_committed_checkpoint(tmp_path):
    res = crash.run_trials(TRIALS, SEED, tmp_path, elems=1 << 20)  # 16 MiB per checkpoint
    print(res.line())
    assert res.trials == TRIALS
    assert res.failures == 0, f"seed {SEED}:\n" + "\n".join(res.details)
    c = res.counts
    for phase in ("snapshot", "commit", "retention", "restore"):
        assert c.get(f"killed_in_{phase}", 0) > 0, f"no kill landed in {phase}: {c}"
    assert c.get("killed_in_hash", 0) + c.get("killed_in_write", 0) > 0, c
    assert c.get("killed_in_retention_deleting", 0) > 0, c
    assert c.get("kills_random_delay", 0) > 0 and c.get("commits", 0) > 0, c
    # the restarts' own restores were judged, and so was every checkpoint on disk
    assert c.get("restores_checked_by_the_job", 0) > 0 and c.get("checkpoints_checked", 0) > 0, c
    if crash.shm_ok():
        # the memory tier gave back snapshots newer than any reported commit
        assert c.get("restored_newer_than_reported", 0) > 0, c


def test_where_a_kill_landed_is_read_from_the_jobs_progress_lines():
    lines = ["B restore -1", "E restore 4 0.1", "ready 5", "B snapshot 5", "E snapshot 5",
             "B hash 5", "B write 5", "B snapshot 6"]
    assert crash.landed(lines) == ["snapshot", "write"]
    lines += ["B commit 5", "B retention 5", "B delete 3"]
    assert crash.landed(lines) == ["retention", "retention_deleting", "snapshot"]
    lines += ["C 5", "E snapshot 6"]
    assert crash.landed(lines) == []
    assert crash.landed(["B restore -1"]) == ["restore"]
