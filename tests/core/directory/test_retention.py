"""Retention keeps exactly what each policy says, never the newest, deletes only after a
commit, survives restarts (with or without a usable index), and never deletes anything
pitstop did not write."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

import pitstop
from pitstop.core.manager import step_name

N = 50


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    kw.setdefault("durable", False)  # retention logic, not fsync, is under test here
    return pitstop.CheckpointManager(directory, **kw)


def state_of(step: int) -> dict:
    return {"w": np.full(16, step, np.int64), "step": step}


def loss_of(step: int) -> float:
    # distinct, non-monotonic values so "best" is neither the oldest nor the newest
    return float((step * 37) % 101) + step / 1000


def expected(saved: list[int], *, last=None, every=None, best=None, mode="min") -> set[int]:
    """What the issue says must remain after saving ``saved`` in order (a reference model
    written independently of pitstop.core.policy)."""
    keep = {max(saved)}
    if last:
        keep |= set(sorted(saved)[-last:])
    if every:
        keep |= {s for s in saved if s % every == 0}
    if best:
        ranked = sorted(saved, key=lambda s: loss_of(s) if mode == "min" else -loss_of(s))
        keep |= set(ranked[:best])
    return keep


POLICIES = {
    "keep_last=3": dict(last=3),
    "keep_last=1": dict(last=1),
    "keep_every_steps=10": dict(every=10),
    "keep_best=3 min": dict(best=3, mode="min"),
    "keep_best=2 max": dict(best=2, mode="max"),
    "last=2 + every=7 + best=2": dict(last=2, every=7, best=2, mode="min"),
    "last=5 + best=1 max": dict(last=5, best=1, mode="max"),
}


def manager_kwargs(p: dict) -> dict:
    kw = {}
    if p.get("last"):
        kw["keep_last"] = p["last"]
    if p.get("every"):
        kw["keep_every_steps"] = p["every"]
    if p.get("best"):
        kw.update(keep_best=p["best"], best_metric="loss", best_mode=p.get("mode", "min"))
    return kw


def listing(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_keeps_exactly_what_it_says_over_50_saves(tmp_path, name):
    p = POLICIES[name]
    d = tmp_path / "run"
    saved: list[int] = []
    with open_mgr(d, **manager_kwargs(p)) as mgr:
        for s in range(N):
            mgr.save(s, state_of(s), metrics={"loss": loss_of(s)}).result(timeout=30)
            saved.append(s)
            assert set(mgr.all_steps()) == expected(saved, **p), f"{name}: after step {s}"
        kept = mgr.all_steps()
        for s in kept:  # what is kept is intact
            t = {"w": np.zeros(16, np.int64), "step": -1}
            assert mgr.restore(t, step=s) == s and (t["w"] == s).all() and t["step"] == s
    # nothing but checkpoints and pitstop's own metadata in the directory
    assert listing(d) == sorted([".pitstop"] + [step_name(s) for s in kept])


def test_newest_is_kept_even_when_it_is_the_worst(tmp_path):
    with open_mgr(tmp_path / "run", keep_best=1, best_metric="loss") as mgr:
        mgr.save(0, state_of(0), metrics={"loss": 0.1}).result(timeout=30)
        for s in range(1, 6):
            mgr.save(s, state_of(s), metrics={"loss": 10.0 + s}).result(timeout=30)
            assert mgr.all_steps() == [0, s]
        # a save without the metric at all is kept as the newest, too
        mgr.save(6, state_of(6)).result(timeout=30)
        assert mgr.all_steps() == [0, 6]


def test_deletion_happens_only_after_the_next_commit(tmp_path):
    d = tmp_path / "run"
    seen: dict[str, list[int]] = {}
    with open_mgr(d, keep_last=1) as mgr:
        def spy(where):
            def hook(step):  # what is committed on disk (all_steps() names saves under way too)
                seen.setdefault(f"{where}:{step}", mgr._committed())
            return hook
        mgr.hooks["before_write"] = spy("write")
        mgr.hooks["before_commit"] = spy("commit")
        for s in range(5):
            mgr.save(s, state_of(s)).result(timeout=30)
        for s in range(1, 5):
            assert seen[f"write:{s}"] == [s - 1]
            assert seen[f"commit:{s}"] == [s - 1]  # all data written, still not deleted

        # a save that fails before its commit deletes nothing
        def fail(step):
            raise OSError(28, "No space left on device")
        mgr.hooks["before_commit"] = fail
        h = mgr.save(5, state_of(5))
        with pytest.raises(pitstop.CheckpointWriteError):
            h.result(timeout=30)
        assert mgr.all_steps() == [4]
        mgr.wait()  # reported once, by the handle
        del mgr.hooks["before_commit"]
        mgr.save(6, state_of(6)).result(timeout=30)
        assert mgr.all_steps() == [6]
    assert not [e for e in listing(d) if e.startswith(".tmp-")]


def test_a_checkpoint_being_read_is_not_deleted(tmp_path):
    with open_mgr(tmp_path / "run", keep_last=1) as mgr:
        mgr.save(0, state_of(0)).result(timeout=30)
        with mgr.storage.read_lease(step_name(0)):
            mgr.save(1, state_of(1)).result(timeout=30)
            assert mgr.all_steps() == [0, 1]
        mgr.save(2, state_of(2)).result(timeout=30)
        assert mgr.all_steps() == [2]


def _fill(d, steps, **kw):
    with open_mgr(d, **kw) as mgr:
        for s in steps:
            mgr.save(s, state_of(s), metrics={"loss": loss_of(s)}).result(timeout=30)


@pytest.mark.parametrize("index", ["kept", "deleted", "garbage bytes", "empty", "json list",
                                   "wrong types", "other directory"])
def test_restart_applies_the_same_policy_from_what_is_on_disk(tmp_path, index):
    d = tmp_path / "run"
    _fill(d, range(30))  # no retention yet: all 30 kept
    idx = d / ".pitstop" / "index.json"
    assert idx.exists()
    if index == "deleted":
        idx.unlink()
    elif index == "garbage bytes":
        idx.write_bytes(os.urandom(64))
    elif index == "empty":
        idx.write_bytes(b"")
    elif index == "json list":
        idx.write_text("[1, 2, 3]")
    elif index == "wrong types":
        doc = json.loads(idx.read_text())
        doc["checkpoints"]["3"] = {"metrics": 5, "ours": True}
        idx.write_text(json.dumps(doc))
    elif index == "other directory":
        doc = json.loads(idx.read_text())
        doc["directory_id"] = "someone-else"
        for info in doc["checkpoints"].values():
            info["ours"] = False
        idx.write_text(json.dumps(doc))
    p = dict(last=3, every=10, best=2, mode="min")
    saved = list(range(30))
    with open_mgr(d, **manager_kwargs(p)) as mgr:
        assert mgr.all_steps() == saved  # opening alone deletes nothing
        for s in range(30, 35):
            mgr.save(s, state_of(s), metrics={"loss": loss_of(s)}).result(timeout=30)
            saved.append(s)
            assert set(mgr.all_steps()) == expected(saved, **p), (index, s)
    # and once more after another restart, with the index the second manager wrote
    with open_mgr(d, **manager_kwargs(p)) as mgr:
        mgr.save(35, state_of(35), metrics={"loss": loss_of(35)}).result(timeout=30)
        saved.append(35)
        assert set(mgr.all_steps()) == expected(saved, **p)


def _foreign_checkpoint(tmp_path, step: int) -> str:
    """A committed checkpoint written by another run (another directory_id)."""
    other = tmp_path / f"other-run-{step}"
    with open_mgr(other) as mgr:
        mgr.save(step, {"w": np.full(16, -step, np.int64), "step": -step}).result(timeout=30)
    return str(other / step_name(step))


def _snapshot_tree(path) -> dict[str, bytes]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def test_never_deletes_what_it_did_not_write(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    # things that are not ours, placed before the first manager opens the directory
    shutil.copytree(_foreign_checkpoint(tmp_path, 5), d / step_name(5))
    shutil.copytree(_foreign_checkpoint(tmp_path, 1000), d / step_name(1000))  # newer than ours
    (d / step_name(3)).mkdir()
    (d / step_name(3) / "weights.bin").write_bytes(b"not pitstop's")
    (d / step_name(7)).mkdir()
    (d / step_name(7) / "manifest.json").write_bytes(b"{garbage")
    (d / "notes.txt").write_text("keep me")
    (d / "subdir").mkdir()
    (d / "subdir" / "x").write_text("x")
    (d / ".hidden").write_text("h")
    (d / ".tmp-mine").mkdir()
    (d / ".tmp-mine" / "f").write_text("user data, not a pitstop temporary")
    (d / (step_name(9) + ".bak")).mkdir()
    (d / "step_12").mkdir()
    foreign_before = {e: _snapshot_tree(d / e) if (d / e).is_dir() else (d / e).read_bytes()
                      for e in os.listdir(d)}

    ours = [s for s in range(10, 10 + N)]
    with open_mgr(d, keep_every_steps=7) as mgr:
        for s in ours[:25]:
            mgr.save(s, state_of(s)).result(timeout=30)
            # our newest is kept even though a foreign checkpoint has a higher step
            assert s in mgr.all_steps()
        # copied in while a manager is running
        shutil.copytree(_foreign_checkpoint(tmp_path, 8), d / step_name(8))
        foreign_before[step_name(8)] = _snapshot_tree(d / step_name(8))
    with open_mgr(d, keep_every_steps=7) as mgr:  # a restart rebuilds "ours" from manifests
        for s in ours[25:]:
            mgr.save(s, state_of(s)).result(timeout=30)
        mine = {s for s in mgr.all_steps() if s >= 10 and s != 1000}
    assert mine == {s for s in ours if s % 7 == 0} | {ours[-1]}
    for e, before in foreign_before.items():
        after = _snapshot_tree(d / e) if (d / e).is_dir() else (d / e).read_bytes()
        assert after == before, f"{e} was changed or deleted"


def test_index_claiming_a_replaced_checkpoint_does_not_make_it_deletable(tmp_path):
    d = tmp_path / "run"
    _fill(d, range(5))
    # someone replaces step 2 with another run's checkpoint while no manager runs;
    # the index still lists step 2 as pitstop's own
    shutil.rmtree(d / step_name(2))
    shutil.copytree(_foreign_checkpoint(tmp_path, 2), d / step_name(2))
    before = _snapshot_tree(d / step_name(2))
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(5, state_of(5)).result(timeout=30)
        assert mgr.all_steps() == [2, 5]
        mgr.save(6, state_of(6)).result(timeout=30)
        assert mgr.all_steps() == [2, 6]
    assert _snapshot_tree(d / step_name(2)) == before


def test_nonfinite_and_missing_metrics_never_count_as_best(tmp_path):
    with open_mgr(tmp_path / "run", keep_best=2, best_metric="loss") as mgr:
        losses = {0: 5.0, 1: float("nan"), 2: 3.0, 3: float("-inf"), 4: None, 5: 4.0, 6: 9.0}
        for s, v in losses.items():
            mgr.save(s, state_of(s), metrics={} if v is None else {"loss": v}).result(timeout=30)
        assert mgr.all_steps() == [2, 5, 6]


def test_a_committed_save_is_reported_committed_when_bookkeeping_fails(tmp_path, caplog):
    """Index or retention trouble after the commit is a warning, retried at the next commit;
    the save's handle says committed."""
    d = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="pitstop")
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(0, state_of(0)).result(timeout=30)
        index = d / ".pitstop" / "index.json"
        index.unlink()
        index.mkdir()  # a real failure: the index cannot be replaced by a file
        stats = mgr.save(1, state_of(1)).result(timeout=30)  # does not raise
        assert stats.committed
        assert any("step 1 is committed" in r.getMessage() and "retried" in r.getMessage()
                   for r in caplog.records)
        mgr.wait()  # nothing to report: the save did not fail
        index.rmdir()
        mgr.save(2, state_of(2)).result(timeout=30)
        assert json.loads(index.read_text())["checkpoints"].keys() == {"2"}
        assert mgr.all_steps() == [2]
    assert listing(d) == sorted([".pitstop", step_name(2)])


def test_retention_of_a_symlinked_step_leaves_no_dangling_link(tmp_path):
    """A step moved to another disk and symlinked back: retention removed the link's
    contents through ``rmtree`` (which refuses a link, errors ignored), leaving a
    ``.tmp-deleting-…`` link for ever; neither the next writer nor ``pitstop gc`` removed it.
    Now the link alone goes (its target is never deleted through it), and a link left by
    an older version is removed by the next writer and by gc."""
    import pitstop.cli
    d = tmp_path / "run"
    elsewhere = tmp_path / "other_disk"
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(1, state_of(1)).wait()
        shutil.move(d / step_name(1), elsewhere)
        os.symlink(elsewhere, d / step_name(1))
        mgr.save(2, state_of(2)).wait()
    assert sorted(os.listdir(d)) == [".pitstop", step_name(2)]
    assert (elsewhere / "manifest.json").exists()  # never deleted through the link
    # links an older version left (one dangling): the next writer removes them, and gc
    for name in (".tmp-deleting-step_0000000001-0123abcd",
                 ".tmp-deleting-step_0000000003-0123abcd"):
        os.symlink(elsewhere if "01-" in name else tmp_path / "gone", d / name)
    open_mgr(d, keep_last=1).close()
    assert sorted(os.listdir(d)) == [".pitstop", step_name(2)]
    os.symlink(tmp_path / "gone", d / ".tmp-deleting-step_0000000004-0123abcd")
    assert pitstop.cli.main(["gc", str(d)]) == 0
    assert sorted(os.listdir(d)) == [".pitstop", step_name(2)]
    assert (elsewhere / "manifest.json").exists()
