"""Encryption at rest, attacked as a user would: a directory whose .pitstop/ was lost, the
import helpers into an encrypted directory, odd arrays at the segment boundaries, replays and
downgrades of manifests, refused writers, retention, the command line with real key files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pitstop
from pitstop.core.format import crypto
from pitstop.core.format.seal import seal

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
ROOT = Path(__file__).resolve().parents[3]
SEG = 64 << 10


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    monkeypatch.setattr(crypto, "SEGMENT", SEG)
    monkeypatch.delenv(crypto.ENV, raising=False)


def mgr(d, key: bytes | None = KEY, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("save_on_signals", None)
    kw.setdefault("memory_tier", False)
    return pitstop.CheckpointManager(
        d, encryption=None if key is None else pitstop.Encryption(lambda: key), **kw)


def small(step: int) -> dict:
    return {"w": np.arange(8.0) + step, "step": step}


def saved(d, steps=(1, 2), key: bytes | None = KEY, **kw) -> None:
    with mgr(d, key, **kw) as m:
        for s in steps:
            m.save(s, small(s)).wait()


def step_dir(d, s: int) -> Path:
    return Path(d) / f"step_{s:010d}"


def tree(d) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file())


def test_checkpoints_whose_identity_was_lost_keep_their_kind(tmp_path, monkeypatch):
    """A sync tool that skips dotfiles (or `cp -r step_*`) leaves checkpoints without
    .pitstop/directory.json. Before the fix a writer without a key then opened the directory
    and wrote plaintext checkpoints next to the encrypted ones, a keyed writer did the
    reverse in a plaintext one, and a reader with PITSTOP_ENCRYPTION_KEY set said "set
    PITSTOP_ENCRYPTION_KEY" (it did not look for the key without an identity)."""
    d = tmp_path / "secret"
    saved(d)
    shutil.rmtree(d / ".pitstop")
    before = tree(d)
    with pytest.raises(pitstop.EncryptionKeyError, match="never writes plaintext"):
        mgr(d, key=None)
    with pytest.raises(pitstop.EncryptionKeyError, match="not its key"):
        mgr(d, key=OTHER)
    assert [p for p in tree(d) if not p.startswith(".pitstop")] == before
    assert not (d / ".pitstop" / "directory.json").exists()
    with pytest.raises(pitstop.EncryptionKeyError, match=crypto.ENV):
        mgr(d, key=None, read_only=True)
    monkeypatch.setenv(crypto.ENV, KEY.hex())
    with pitstop.CheckpointManager(d, read_only=True, save_on_signals=None) as m:
        assert m.load(2)["step"] == 2
    with mgr(d) as m:  # the right key: a new identity, encrypted
        assert m.restore({"w": np.zeros(8), "step": 0}) == 2
        m.save(3, small(3)).wait()
    assert json.loads((d / ".pitstop" / "directory.json").read_text())["encryption"]
    # the reverse: a plaintext directory without its identity takes no encrypted checkpoint
    p = tmp_path / "plain"
    saved(p, key=None)
    shutil.rmtree(p / ".pitstop")
    with pytest.raises(pitstop.EncryptionKeyError, match="holds unencrypted checkpoints"):
        mgr(p)
    saved(p, steps=(3,), key=None)  # still a plaintext directory for a plaintext writer


def test_import_torch_save_into_an_encrypted_directory(tmp_path, monkeypatch):
    """Before the fix: refused even with PITSTOP_ENCRYPTION_KEY set, telling the user to
    "pass encryption=", which import_torch_save has no way to take. It now takes the key as
    the export helpers do, and the imported checkpoint is encrypted."""
    torch = pytest.importorskip("torch")
    from pitstop.adapters.torch import export_safetensors, import_torch_save
    d = tmp_path / "secret"
    saved(d, steps=(1,))
    src = tmp_path / "m.pt"
    torch.save({"w": torch.arange(5.0)}, src)
    with pytest.raises(pitstop.EncryptionKeyError, match=crypto.ENV):
        import_torch_save(src, d, 5)  # no key: refused, nothing written
    assert not step_dir(d, 5).exists()
    monkeypatch.setenv(crypto.ENV, KEY.hex() + "\n")  # as $(cat secret-file) leaves it
    assert import_torch_save(src, d, 5) == 5
    doc = json.loads((step_dir(d, 5) / "manifest.json").read_bytes())
    assert doc["encryption"]["key_id"] == pitstop.Encryption(lambda: KEY).key_id
    with mgr(d, read_only=True) as m:
        assert m.load(5)["w"].tolist() == [0, 1, 2, 3, 4]
    assert export_safetensors(d, tmp_path / "o.safetensors") == 5
    # a plaintext directory stays plaintext with the variable set
    p = tmp_path / "plain"
    import_torch_save(src, p, 1)
    assert "encryption" not in json.loads((step_dir(p, 1) / "manifest.json").read_bytes())


@pytest.mark.parametrize("compression", [None, "zstd+shuffle"])
def test_odd_arrays_at_segment_boundaries_round_trip(tmp_path, compression):
    import ml_dtypes
    rng = np.random.default_rng(0)
    base = rng.standard_normal((200, 90)).astype(np.float32)
    state = {"zero": np.zeros((0, 5), np.float32), "scalar": np.array(3.5),
             "bool": rng.random(1001) > 0.5, "noncontig": base[:, ::3],
             "bf16": rng.standard_normal(777).astype(ml_dtypes.bfloat16),
             "fortran": np.asfortranarray(base[:50, :40]),
             "exact": rng.integers(0, 255, SEG, dtype=np.uint8),
             "plus1": rng.integers(0, 255, SEG + 1, dtype=np.uint8),
             "minus1": rng.integers(0, 255, SEG - 1, dtype=np.uint8),
             "two": rng.integers(0, 255, 2 * SEG, dtype=np.uint8),
             "zeros_plus1": np.zeros(SEG + 1, np.uint8)}
    with mgr(tmp_path, compression=compression, writer_threads=2) as m:
        m.save(1, state).wait()
    live = {k: np.zeros_like(v) for k, v in state.items()}
    with mgr(tmp_path) as m:
        assert m.restore(live) == 1
        loaded = m.load(1)
    for k, v in state.items():
        for got in (live[k], loaded[k]):
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(v).tobytes(), k


def test_replayed_checkpoint_and_downgraded_manifest_are_refused(tmp_path):
    """An older checkpoint copied whole under a newer step's name, and a manifest stripped of
    its encryption section and MAC, resealed as a plaintext one: restore() refuses both and
    falls back, without a key nothing is trusted either."""
    saved(tmp_path, steps=(1, 2))
    shutil.copytree(step_dir(tmp_path, 1), step_dir(tmp_path, 3))
    p = step_dir(tmp_path, 2) / "manifest.json"
    doc = json.loads(p.read_bytes())
    doc.pop("manifest_mac")
    doc.pop("encryption")
    doc["format_version"] = "2.0"
    for e in doc["arrays"].values():
        e["codec"] = "none"
    p.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode(), doc["hash_algorithm"]))
    with mgr(tmp_path) as m, pytest.warns(UserWarning):
        t = {"w": np.zeros(8), "step": 0}
        assert m.restore(t) == 1 and t["w"].tolist() == small(1)["w"].tolist()
    with pytest.raises(pitstop.EncryptionKeyError):
        mgr(tmp_path, key=None, read_only=True)


def test_refused_writers_change_nothing_and_retention_works(tmp_path):
    saved(tmp_path, steps=(1, 2, 3), keep_last=2)
    before = tree(tmp_path)
    for key in (None, OTHER):
        for _ in range(2):  # the lock of a refused writer is released at once
            with pytest.raises(pitstop.EncryptionKeyError):
                mgr(tmp_path, key=key, keep_last=1)
    assert tree(tmp_path) == before
    os.remove(tmp_path / ".pitstop" / "index.json")  # rebuilt from encrypted manifests
    with mgr(tmp_path, keep_last=2) as m:
        assert m.all_steps() == [2, 3]
        m.save(4, small(4)).wait()
        assert m.all_steps() == [3, 4]
        m.delete(3)
        assert m.all_steps() == [4] and m.metadata(4).step == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pitstop", "step_0000000004"]


def test_cli_with_a_key_file_newline_wrong_key_and_no_key(tmp_path):
    saved(tmp_path, steps=(1,))
    env = {k: v for k, v in os.environ.items() if k != crypto.ENV}

    def cli(*args, key=None):
        e = env if key is None else {**env, crypto.ENV: key}
        r = subprocess.run([sys.executable, "-m", "pitstop.cli", *args, str(tmp_path)], env=e,
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert "Traceback" not in r.stderr and KEY.hex() not in r.stdout + r.stderr
        return r

    ok = cli("inspect", key=f"  {KEY.hex()}\n")
    assert ok.returncode == 0 and "key id" in ok.stdout, ok
    wrong = cli("inspect", key=OTHER.hex())
    assert wrong.returncode == 2 and "not its key" in wrong.stderr, wrong
    none = cli("ls")
    assert none.returncode == 0 and "unreadable" in none.stdout and crypto.ENV in none.stdout
    # a malformed key: one line and status 2, as inspect and verify (before the fix, ls
    # repeated the key's error on every row as "unreadable" and exited 0)
    bad = cli("ls", key="not-a-key")
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad


def test_reader_with_a_key_on_a_plaintext_directory_says_so(tmp_path):
    """Before the fix: a read-only manager given a key on a plaintext directory refused each
    checkpoint as corrupt ("no valid checkpoint ... all 2 failed verification"); they are
    fine, the key is what does not fit."""
    saved(tmp_path, key=None)
    with pytest.raises(pitstop.EncryptionKeyError, match="without encryption="):
        mgr(tmp_path, read_only=True)
    with mgr(tmp_path, key=None, read_only=True) as m:
        assert m.load()["step"] == 2
    empty = tmp_path / "empty"
    mgr(empty, key=None).close()
    with mgr(empty, read_only=True) as m:  # nothing to misread: allowed, as before
        assert m.all_steps() == []


def test_refused_writer_leaves_an_interrupted_save_alone(tmp_path):
    """Before the fix, a writer refused for its key (none, or another) first removed the
    leftovers of interrupted saves: a refused writer now changes nothing; the next writer
    with the key removes them as before."""
    saved(tmp_path, steps=(1,))
    leftover = tmp_path / ".tmp-step_0000000002-ba05f1c8"
    leftover.mkdir()
    (leftover / "data-000.bin").write_bytes(b"x" * 100)
    for key in (None, OTHER):
        with pytest.raises(pitstop.EncryptionKeyError):
            mgr(tmp_path, key=key)
        assert leftover.exists()
    mgr(tmp_path).close()
    assert not leftover.exists()


def test_a_bad_key_is_not_in_the_locals_a_traceback_shows(monkeypatch):
    """Error reporters (Sentry, rich, pytest -l, TracebackException(capture_locals=True))
    show each frame's locals. Before the fix a callback returning the key as hex text, or a
    variable holding a near-key ("0x" + hex, 63 digits, unpadded base64), stayed in the
    frames of Encryption.__init__/_parse_text; and repr() of the half-made Encryption raised
    AttributeError (key_id unset), which broke those reporters."""
    import base64
    import traceback
    monkeypatch.setenv("K1", "0x" + KEY.hex())
    monkeypatch.setenv("K2", KEY.hex()[:63])
    monkeypatch.setenv("K3", base64.b64encode(KEY).decode().rstrip("="))
    for make in (lambda: pitstop.Encryption(lambda: KEY.hex()),  # type: ignore[return-value]
                 lambda: pitstop.Encryption(lambda: KEY[:31]),
                 lambda: pitstop.Encryption(env="K1"), lambda: pitstop.Encryption(env="K2"),
                 lambda: pitstop.Encryption(env="K3")):
        with pytest.raises(pitstop.InvalidArgumentError) as e:
            make()
        te = traceback.TracebackException.from_exception(e.value, capture_locals=True)
        shown = "\n".join(str(f.locals) for f in te.stack if "pitstop" in f.filename)
        for form in (KEY.hex()[:40], base64.b64encode(KEY).decode()[:40]):
            assert form not in shown, (form, shown)
        assert not re.search(r"x1c\\*x1d\\*x1e", shown), shown  # KEY[:31]'s repr


def test_a_changed_key_id_is_corrupt_and_restore_falls_back(tmp_path):
    """Before the fix, one character of the newest manifest's key id changed (bit rot, an
    edit), or a checkpoint copied in from a run with another key, made restore() raise
    EncryptionKeyError "not its key" for the directory's own key and resume nothing. In a
    directory whose identity records the key given, such a checkpoint is not authenticated:
    corrupt, moved aside, and the previous one restored. A bare reader without the
    identity's key still says "not its key"."""
    saved(tmp_path, steps=(1, 2))
    p = step_dir(tmp_path, 2) / "manifest.json"
    kid = pitstop.Encryption(lambda: KEY).key_id
    p.write_bytes(p.read_bytes().replace(kid.encode(), ("0" if kid[0] != "0" else "1").encode()
                                         + kid[1:].encode()))
    with mgr(tmp_path) as m, pytest.warns(UserWarning, match="another key id"):
        t = {"w": np.zeros(8), "step": 0}
        assert m.restore(t) == 1
    assert not step_dir(tmp_path, 2).exists()
    other = tmp_path / "other"
    saved(other, steps=(1,), key=OTHER)
    from pitstop.core.restore.read import CheckpointReader
    from pitstop.core.storage.local import LocalStorage
    with pytest.raises(pitstop.EncryptionKeyError, match="not its key"):
        CheckpointReader(LocalStorage(str(other)), "step_0000000001",
                         encryption=pitstop.Encryption(lambda: KEY))


def plant_plaintext(d, s: int, tmp: Path) -> None:
    """What someone who can write the directory but has no key can do: a plaintext newest
    checkpoint, its manifest naming the directory's id, resealed with a plain hash."""
    evil = tmp / f"evil{s}"
    saved(evil, steps=(s,), key=None)
    ident = json.loads((Path(d) / ".pitstop" / "directory.json").read_text())["directory_id"] \
        if (Path(d) / ".pitstop" / "directory.json").exists() else None
    shutil.copytree(step_dir(evil, s), step_dir(d, s))
    p = step_dir(d, s) / "manifest.json"
    doc = json.loads(p.read_bytes())
    doc.pop("manifest_hash")
    doc["directory_id"] = ident
    doc["values"]["step"] = 666
    p.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode(), doc["hash_algorithm"]))


@pytest.mark.parametrize("downgrade", ["identity edited", ".pitstop removed"])
def test_a_plaintext_checkpoint_planted_in_a_downgraded_directory_is_refused(
        tmp_path, monkeypatch, downgrade):
    """Before the fix: with "encryption" removed from .pitstop/directory.json (or .pitstop/
    deleted) and a plaintext newest step planted, a read-only manager with
    PITSTOP_ENCRYPTION_KEY set restored the planted state and `pitstop verify` said ok (exit
    0); a keyed writer refused the directory as "holds unencrypted checkpoints". An
    encrypted checkpoint in the directory now makes it encrypted whatever that file says."""
    d = tmp_path / "run"
    saved(d, steps=(1, 2))
    ident = d / ".pitstop" / "directory.json"
    if downgrade == "identity edited":
        doc = json.loads(ident.read_text())
        doc.pop("encryption")
        ident.write_text(json.dumps(doc))
    else:
        shutil.rmtree(d / ".pitstop")
    plant_plaintext(d, 3, tmp_path)
    monkeypatch.setenv(crypto.ENV, KEY.hex())
    t = {"w": np.zeros(8), "step": 0}
    with pitstop.CheckpointManager(d, read_only=True, save_on_signals=None,
                                   memory_tier=False) as m, pytest.warns(UserWarning):
        assert m.restore(t) == 2 and t["step"] == 2
    r = subprocess.run([sys.executable, "-m", "pitstop.cli", "verify", str(d), "--all"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "step 3: CORRUPT" in r.stdout, r
    assert "step 2: ok" in r.stdout, r
    with mgr(d) as m, pytest.warns(UserWarning):  # a writer with the key: encrypted again
        assert m.restore(t) == 2
        m.save(4, small(4)).wait()
    assert json.loads(ident.read_text())["encryption"]["key_id"] == \
        pitstop.Encryption(lambda: KEY).key_id


def test_an_encrypted_checkpoint_of_another_run_with_the_same_key_is_refused(tmp_path):
    """Before the fix: the newest checkpoint of another run sharing the key, copied in under
    the next step's name, restored without complaint (the reader never compared the sealed
    manifest's directory id with the directory's). Refused now, by restore() (which falls
    back) and by verify; a directory whose .pitstop/ was lost and whose encrypted
    checkpoints name two ids is refused whole rather than guessed."""
    a, b = tmp_path / "a", tmp_path / "b"
    saved(a, steps=(1, 2))
    saved(b, steps=(3,))
    shutil.copytree(step_dir(b, 3), step_dir(a, 3))
    t = {"w": np.zeros(8), "step": 0}
    with mgr(a, read_only=True) as m, pytest.warns(UserWarning, match="another directory"):
        assert m.restore(t) == 2 and t["w"].tolist() == small(2)["w"].tolist()
    env = {**os.environ, crypto.ENV: KEY.hex()}
    r = subprocess.run([sys.executable, "-m", "pitstop.cli", "verify", str(a), "--step", "3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 1 and "another directory" in r.stdout + r.stderr, r
    shutil.rmtree(a / ".pitstop")
    with pytest.raises(pitstop.CheckpointError, match="2 directory ids"):
        mgr(a, read_only=True)
    with pytest.raises(pitstop.CheckpointError, match="2 directory ids"):
        mgr(a)
    shutil.rmtree(step_dir(a, 3))
    with mgr(a) as m:  # one id: adopted, so the run's own checkpoints still restore
        assert m.restore(t) == 2
        m.save(3, small(3)).wait()
    assert m.all_steps() == [1, 2, 3]


def test_a_checkpoint_of_an_abandoned_run_put_back_in_place_is_refused(tmp_path):
    """Before the fix: after a rollback (restore(step=1), then a save of step 2), the
    abandoned run's step 3, moved aside as .abandoned-, renamed back into place was
    restored as the newest state (same directory, same step: everything it is bound to
    holds). Each encrypted save records its place in the directory's order (seq, under
    the MAC), so a checkpoint saved before a checkpoint of an older step is refused, and
    the newest one saved after it restored; restore(step=3) still reads it on purpose."""
    saved(tmp_path, steps=(1, 2, 3))
    t = {"w": np.zeros(8), "step": 0}
    with mgr(tmp_path) as m:
        assert m.restore(t, step=1) == 1
        m.save(2, small(2) | {"step": 22}).wait()  # the new run: 2 and 3 moved aside
    aside = sorted(p for p in tmp_path.iterdir() if ".abandoned-" in p.name)
    assert [p.name.split(".")[0] for p in aside] == ["step_0000000002", "step_0000000003"]
    aside[1].rename(step_dir(tmp_path, 3))
    with mgr(tmp_path, read_only=True) as m, pytest.warns(UserWarning, match="abandoned"):
        assert m.restore(t) == 2 and t["step"] == 22
        assert m.load()["step"] == 22
        assert m.load(3)["step"] == 3
    with mgr(tmp_path) as m, pytest.warns(UserWarning, match="abandoned"):
        assert m.restore(t) == 2 and t["step"] == 22
        m.save(3, small(3) | {"step": 33}).wait()  # the run goes on: a later seq
    with mgr(tmp_path) as m:
        assert m.restore(t) == 3 and t["step"] == 33


def test_a_hard_link_backup_of_a_live_run_leaves_its_checkpoints_in_place(tmp_path):
    """`cp -al run backup` (rsnapshot, rsync --link-dest) gives every file of the live run a
    second name. Its checkpoints are refused (a linked file can change under them), but they
    are not corrupt: restore() moved each aside as .corrupt- and said a second restore()
    starts from scratch, so a restart loop silently began again at step 0. They stay in
    place, restore() says why and how, and once the links are broken the run resumes."""
    run = tmp_path / "run"
    saved(run, steps=(1, 2))
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-al", str(run), str(backup)], check=True)
    for _ in range(2):  # a restart loop: the second try must not start from scratch
        with mgr(run, read_only=True) as m, pytest.warns(UserWarning, match="2 names"):
            with pytest.raises(pitstop.CorruptCheckpointError, match="hard link.*left in place"):
                m.restore(small(0))
    # a writer cannot tell where its saves come in the order (seq) from manifests it cannot
    # read: it numbered the next save 1, below step 2's, and once the links were broken that
    # save was refused as a replay (moved aside, step 2 restored). Now it says so at open.
    with pytest.raises(pitstop.CheckpointError, match="2 names.*cannot tell where"):
        mgr(run)
    assert sorted(p.name for p in run.iterdir()) == [".pitstop", "step_0000000001",
                                                      "step_0000000002"]
    shutil.rmtree(backup)
    saved(run, steps=(3,))
    state = small(0)
    with mgr(run) as m:
        assert m.restore(state) == 3
    assert state["step"] == 3


def test_a_hard_link_backup_leaves_a_multi_rank_run_in_place(tmp_path):
    """The same backup of a 2-rank plaintext run (an encrypted writer does not open while
    its manifests are linked): the leader moved each checkpoint aside as corrupt and said a
    second restore() starts from scratch."""
    from thread_ranks import ranks
    run = tmp_path / "run"

    def job(rank, coord):
        with mgr(run, None, distributed=coord) as m:
            m.save(1, {**small(1), "mine": np.full(4, rank)}).wait()

    ranks(2, job)
    subprocess.run(["cp", "-al", str(run), str(tmp_path / "backup")], check=True)

    def resume(rank, coord):
        with mgr(run, None, distributed=coord) as m:
            try:
                m.restore({**small(0), "mine": np.zeros(4, int)})
            except pitstop.CorruptCheckpointError as e:
                return str(e)
        return None

    with pytest.warns(UserWarning, match="2 names"):
        said = ranks(2, resume)
    assert all(s and "left in place" in s for s in said), said
    assert sorted(p.name for p in run.iterdir()) == [".pitstop", "step_0000000001"]
