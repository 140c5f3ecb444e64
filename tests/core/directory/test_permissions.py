"""Owner-only modes for everything pitstop creates, and a memory tier that trusts only its
own user's files.

Modes: every directory pitstop creates (the run directory and missing parents, ``.pitstop``,
checkpoint and temporary directories) is 0o700 and every file 0o600 by default, read off
the real file system during and after a save, a restore, a memory-tier recovery and a CLI
gc; ``permissions=`` sets them exactly, ``permissions=None`` lets the umask decide.

Tier trust: a description or buffer another user owns, that others may write, or that is a
symlink is never used (one warning naming it and its owner) and never removed; a file or
symlink planted at one of the tier's names is never written through. Foreign files are made
with ``os.chown`` (the suite runs as root), and one test runs a real unprivileged process
(uid 65534) as the other user.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from contextlib import nullcontext

import numpy as np
import pytest
from test_memtier import (  # the crash-in-the-middle-of-a-persist child, one definition
    SHM,
    assert_is_state,
    crash_during_persist,
    shm_prefix,
    state_of,
    tier_files,
    zero_state,
)

import pitstop
import pitstop.cli
from pitstop.core.save.memtier import MemoryTier
from pitstop.core.storage import LocalStorage

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs "
                               "root (os.chown / os.setuid); this process is not root")
needs_shm = pytest.mark.skipif(not os.access(SHM, os.W_OK), reason="no writable /dev/shm")


@pytest.fixture
def cleanup_shm():
    """Ids of directories whose tier files (whoever owns them) are removed after the test."""
    idents: list[str] = []
    yield idents
    for ident in idents:
        for f in tier_files(ident):
            os.unlink(f)


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def modes(root) -> dict[str, int]:
    """Relative path -> permission bits of ``root`` and everything below it (not followed)."""
    root = str(root)
    out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def assert_modes(root, dir_mode: int, file_mode: int, skip: tuple[str, ...] = ()) -> None:
    root = str(root)
    wrong = {}
    for rel, mode in modes(root).items():
        if rel in skip:
            continue
        want = dir_mode if os.path.isdir(os.path.join(root, rel)) else file_mode
        if mode != want:
            wrong[rel] = f"{mode:o} (want {want:o})"
    assert not wrong, wrong


def _save_restore(run, **kw) -> dict[str, int]:
    """Two saves (retention deletes the first), a restore; returns the modes a temporary
    checkpoint directory had mid-save (read by the before_write hook)."""
    seen: dict[str, int] = {}
    with pitstop.CheckpointManager(run, save_on_signals=None, keep_last=1, **kw) as mgr:
        def peek(step: int) -> None:
            for e in os.listdir(run):
                if e.startswith(".tmp-"):
                    seen.update({f"{e}/{k}": v for k, v in modes(os.path.join(run, e)).items()})
        mgr.hooks["before_commit"] = peek  # the data files are written, the manifest not
        mgr.save(1, state_of(1)).wait()
        mgr.save(2, state_of(2), metrics={"loss": 1.0}).wait()
        if mgr.pool.shm_prefix:  # the memory tier's files while the manager holds them
            for f in tier_files(mgr.directory_id):
                seen[f] = stat.S_IMODE(os.lstat(f).st_mode)
        target = zero_state()
        assert mgr.restore(target) == 2
        assert_is_state(target, 2)
    assert seen, "the hook saw no temporary checkpoint directory"
    return seen


def test_everything_a_save_and_restore_create_is_owner_only(tmp_path, umask):
    before = stat.S_IMODE(os.stat(tmp_path).st_mode)
    run = tmp_path / "runs" / "exp1"  # pitstop creates both
    seen = _save_restore(run)
    for name, mode in seen.items():  # a temporary checkpoint (dir and files), tier files
        want = 0o700 if name.endswith("/.") else 0o600
        assert mode == want, (name, oct(mode))
    assert_modes(tmp_path / "runs", 0o700, 0o600)
    names = set(modes(run))
    assert {".pitstop/lock", ".pitstop/index.json", ".pitstop/directory.json",
            "step_0000000002/manifest.json"} <= names, names
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == before  # the user's: untouched


def test_a_directory_the_user_made_keeps_its_mode(tmp_path, umask):
    run = tmp_path / "mine"
    run.mkdir()
    os.chmod(run, 0o755)
    _save_restore(run, memory_tier=False)
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o755
    assert_modes(run, 0o700, 0o600, skip=(".",))


def test_permissions_none_follows_the_umask(tmp_path, umask):
    umask(0o027)
    _save_restore(tmp_path / "run", permissions=None, memory_tier=False)
    assert_modes(tmp_path / "run", 0o750, 0o640)


def test_permissions_asked_for_are_given_exactly_whatever_the_umask(tmp_path, umask):
    umask(0o077)
    _save_restore(tmp_path / "run", permissions=0o750, memory_tier=False)
    assert_modes(tmp_path / "run", 0o750, 0o640)


@pytest.mark.parametrize("bad", [0o600, 0o1777, -1, True, "0700", 0o70])
def test_a_permissions_value_pitstop_cannot_work_with_is_refused(tmp_path, bad):
    with pytest.raises(pitstop.InvalidArgumentError, match="permissions"):
        pitstop.CheckpointManager(tmp_path / "run", permissions=bad)
    assert not (tmp_path / "run").exists()


@needs_shm
@ROOT_ONLY
def test_tier_recovery_and_gc_keep_owner_only_and_foreign_tier_files_are_never_trusted(
        tmp_path, cleanup_shm, umask, caplog):
    run = tmp_path / "run"
    ident = crash_during_persist(run, [1], 2)  # a real snapshot of step 2, SIGKILLed
    cleanup_shm.append(ident)
    prefix = shm_prefix(run, ident)
    desc, buf = f"{prefix}-0.json", f"{prefix}-0.buf"
    assert {f: stat.S_IMODE(os.lstat(f).st_mode) for f in tier_files(ident)} == \
        {desc: 0o600, buf: 0o600}

    # the CLI's gc: removes the interrupted save's leftovers, keeps the recoverable snapshot
    os.unlink(run / ".pitstop" / "lock")  # gc takes the lock: it creates the file anew
    assert pitstop.cli.main(["gc", str(run)]) == 0
    assert os.path.exists(desc) and os.path.exists(buf)
    assert_modes(run, 0o700, 0o600)

    tier = MemoryTier(SHM, str(run), ident)
    original = open(desc, "rb").read()
    outside = tmp_path / "elsewhere.json"
    shutil.copy(desc, outside)

    def untrusted(change, undo, words: str) -> None:
        caplog.clear()
        change()
        try:
            with caplog.at_level(logging.WARNING, logger="pitstop"):
                assert MemoryTier(SHM, str(run), ident).candidates() == []
            warned = [r.getMessage() for r in caplog.records if desc in r.getMessage()]
            assert len(warned) == 1 and words in warned[0], warned
        finally:
            undo()

    untrusted(lambda: os.chown(desc, NOBODY, NOBODY), lambda: os.chown(desc, 0, 0),
              f"uid {NOBODY}")
    untrusted(lambda: os.chmod(desc, 0o620), lambda: os.chmod(desc, 0o600), "writable by")

    def to_symlink() -> None:
        os.unlink(desc)
        os.symlink(outside, desc)

    def back() -> None:
        if os.path.lexists(desc):
            os.unlink(desc)
        with open(desc, "wb") as f:
            f.write(original)
        os.chmod(desc, 0o600)
    untrusted(to_symlink, back, "symlink")

    # a buffer another user owns is never mapped, even under a trusted description
    os.chown(buf, NOBODY, NOBODY)
    [(meta, path)] = tier.candidates()
    with pytest.raises(PermissionError, match=f"uid {NOBODY}"):
        tier.open_buffer(meta, path)
    # ... and a manager neither recovers it nor removes another user's file
    with pitstop.CheckpointManager(run, save_on_signals=None) as mgr:
        assert mgr.all_steps() == [1]
    assert os.path.exists(buf) and os.lstat(buf).st_uid == NOBODY
    os.chown(buf, 0, 0)
    if not os.path.exists(desc):  # (the manager dropped its own description of it: put back)
        back()

    # the same files, this user's again: recovered (the refusals above were of a good snapshot)
    with pitstop.CheckpointManager(run, save_on_signals=None) as mgr:
        target = zero_state()
        assert mgr.restore(target) == 2
        assert_is_state(target, 2)
    assert_modes(run, 0o700, 0o600)
    assert tier_files(ident) == []


@needs_shm
@pytest.mark.parametrize("slot_file", ["-0.buf", "-0.json.tmp"])
def test_a_symlink_planted_at_a_tier_name_is_never_written_through(tmp_path, slot_file, caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None) as mgr:
        planted = mgr._engine.tier.prefix + slot_file
        os.symlink(victim, planted)
        try:
            with caplog.at_level(logging.WARNING, logger="pitstop"), \
                    pytest.warns(UserWarning) if slot_file == "-0.buf" else nullcontext():
                mgr.save(1, state_of(1)).wait()
            assert mgr.all_steps() == [1]  # the save goes on (the tier steps aside)
            assert f"memory-tier file {planted} is in the way" in caplog.text, caplog.text
        finally:
            assert os.path.islink(planted)  # not replaced, not followed
            os.unlink(planted)
    assert victim.read_bytes() == b"precious"


@needs_shm
@ROOT_ONLY
def test_another_users_file_at_the_buffer_name_is_left_alone(tmp_path, caplog):
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None) as mgr:
        planted = mgr._engine.tier.prefix + "-0.buf"
        with open(planted, "wb") as f:
            f.write(b"theirs")
        os.chown(planted, NOBODY, NOBODY)
        try:
            with caplog.at_level(logging.WARNING, logger="pitstop"), pytest.warns(UserWarning):
                mgr.save(1, state_of(1)).wait()
            assert mgr.all_steps() == [1]
            assert "not pitstop's to replace" in caplog.text and "uid 65534" in caplog.text
        finally:
            with open(planted, "rb") as f:
                assert f.read() == b"theirs"
            os.unlink(planted)


_NOBODY_CHILD = textwrap.dedent("""
    import json, os, sys
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    run, tier_buf = sys.argv[1], sys.argv[2]
    with open(sys.argv[3]) as f:
        plant = json.load(f)
    refused = []
    for what, call in [("list the run directory", lambda: os.listdir(run)),
                       ("read the index", lambda: open(run + "/.pitstop/index.json").read()),
                       ("read a checkpoint", lambda: os.listdir(run + "/step_0000000001")),
                       ("read the tier buffer", lambda: open(tier_buf, "rb").read(1))]:
        try:
            call()
        except PermissionError:
            refused.append(what)
    for path, data in plant.items():  # the other user plants a 'newer snapshot'
        with open(path, "wb") as f:
            f.write(bytes.fromhex(data))
        os.chmod(path, 0o600)
    print(json.dumps(refused))
""")


@needs_shm
@ROOT_ONLY
def test_an_unprivileged_user_can_read_nothing_and_plant_nothing(tmp_path, cleanup_shm,
                                                                 caplog):
    base = tempfile.mkdtemp(prefix="pitstop-perm-")  # world-traversable, unlike tmp_path
    os.chmod(base, 0o755)
    run = os.path.join(base, "run")
    try:
        ident = crash_during_persist(run, [1], 2)
        cleanup_shm.append(ident)
        prefix = shm_prefix(run, ident)
        # the other user plants a copy of a genuine description and buffer (as if it had
        # learnt them) under another slot: it would be recovered, were it trusted
        plant = {f"{prefix}-1{ext}": open(f"{prefix}-0{ext}", "rb").read().hex()
                 for ext in (".json", ".buf")}
        os.unlink(f"{prefix}-0.json")  # (root's own snapshot: gone)
        os.unlink(f"{prefix}-0.buf")
        plan = os.path.join(base, "plant.json")
        with open(plan, "w") as f:
            json.dump(plant, f)
        os.chmod(plan, 0o644)
        with pitstop.CheckpointManager(run, save_on_signals=None) as mgr:  # tier buffer live
            mgr.save(3, state_of(3)).wait()
            r = subprocess.run([sys.executable, "-c", _NOBODY_CHILD, run,
                                f"{prefix}-0.buf", plan],
                               capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == ["list the run directory", "read the index",
                                        "read a checkpoint", "read the tier buffer"]
        planted = sorted(plant)
        assert all(os.lstat(p).st_uid == NOBODY for p in planted)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pitstop"):
            with pitstop.CheckpointManager(run, save_on_signals=None) as mgr:
                assert mgr.all_steps() == [1, 3]
                target = zero_state()
                assert mgr.restore(target) == 3  # not the planted step 2
        assert f"{prefix}-1.json" in caplog.text and "uid 65534" in caplog.text
        assert all(os.path.exists(p) for p in planted)  # another user's: left alone

        # the same bytes owned by this user would have been recovered (the plant was good)
        for p in planted:
            os.chown(p, 0, 0)
        shutil.rmtree(os.path.join(run, "step_0000000003"))
        with pitstop.CheckpointManager(run, save_on_signals=None) as mgr:
            target = zero_state()
            assert mgr.restore(target) == 2
            assert_is_state(target, 2)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_user_given_storage_object_is_not_affected(tmp_path, umask):
    """``permissions`` is the manager's way to make its LocalStorage; a Storage given as
    the directory keeps its own setting (here: the umask)."""
    umask(0o022)
    storage = LocalStorage(str(tmp_path / "run"), permissions=None)
    with pitstop.CheckpointManager(storage, save_on_signals=None, memory_tier=False) as mgr:
        mgr.save(1, {"w": np.ones(3)}).wait()
    assert_modes(tmp_path / "run", 0o755, 0o644)
