"""Incremental checkpoints (``incremental=True``): arrays whose bytes did not change since the
manager's previous commit are referenced, not written again; every kept step restores
exactly; retention never deletes bytes a kept checkpoint references (and deletes the holder
once none does); references never chain; a missing or damaged holder is a named error and
restore falls back; older readers refuse the format with "upgrade"."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest

import pitstop
from pitstop.cli import main
from pitstop.core.directory.names import step_name
from pitstop.core.format import validate as validate_mod
from pitstop.core.format.seal import seal
from pitstop.core.format.validate import parse

N = 8
FROZEN = ("w0", "w2", "w3", "w4", "w6", "w7")  # the backbone; w1 and w5 train
SIZE = 16384  # float32 elements: 64 KiB per array


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    kw.setdefault("durable", False)
    kw.setdefault("writer_threads", 2)
    kw.setdefault("incremental", True)
    return pitstop.CheckpointManager(directory, **kw)


def state_of(step: int, frozen_seed: int = 0) -> dict:
    """Arrays w0..w7: the frozen ones depend on ``frozen_seed`` only, the others on ``step``."""
    out: dict = {"step": step}
    for i in range(N):
        k = f"w{i}"
        seed = (frozen_seed, i) if k in FROZEN else (1000 + step, i)
        out[k] = np.random.default_rng(seed).standard_normal(SIZE).astype(np.float32)
    return out


def blank() -> dict:
    return {"step": -1, **{f"w{i}": np.zeros(SIZE, np.float32) for i in range(N)}}


def same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for i in range(N):
        k = f"w{i}"
        assert got[k].tobytes() == want[k].tobytes(), f"{k} differs (step {want['step']})"


def data_bytes(d, step: int) -> int:
    ck = os.path.join(d, step_name(step))
    return sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck)
               if f.startswith("data-"))


def manifest_of(d, step: int) -> dict:
    return json.loads((d / step_name(step) / "manifest.json").read_text())


def steps_on_disk(d) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step_") and "." not in n)


def rewrite(d, step: int, edit) -> None:
    """Change a committed manifest and seal it again (what only a bug or an attacker with
    the hash algorithm could do): the reader's own checks must catch it."""
    p = d / step_name(step) / "manifest.json"
    doc = json.loads(p.read_text())
    del doc["manifest_hash"]
    edit(doc)
    p.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode(), doc["hash_algorithm"]))


def check_no_chains(d) -> None:
    """Every reference names a checkpoint that holds the file itself (in its own files)."""
    for s in steps_on_disk(d):
        doc = manifest_of(d, s)
        for k, e in doc["arrays"].items():
            if "ref" in e:
                holder = json.loads((d / e["ref"] / "manifest.json").read_text())
                assert e["file"] in holder["files"], (s, k, e)
                assert "ref" not in holder["arrays"][k], f"step {s}: {k} chains"
                assert doc["refs"][e["ref"]][e["file"]] == holder["files"][e["file"]]


# =========================================================================== the basics
def test_frozen_backbone_writes_only_what_changed_and_every_step_restores(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        for s in range(1, 5):
            h = mgr.save(s, state_of(s))
            h.wait()
            want = 0 if s == 1 else len(FROZEN) * SIZE * 4
            assert h.stats.reused_bytes == want
        full, per_array = data_bytes(d, 1), SIZE * 4
        assert full >= N * per_array
        for s in (2, 3, 4):
            # the two trained arrays, plus at most a page of padding per data file
            assert 2 * per_array <= data_bytes(d, s) <= 2 * per_array + 2 * 4096
            doc = manifest_of(d, s)
            assert doc["format_version"] == "4.0"
            assert set(doc["refs"]) == {step_name(1)}
            assert {k for k, e in doc["arrays"].items() if e.get("ref")} == set(FROZEN)
        assert manifest_of(d, 1)["format_version"] == "1.1"
        check_no_chains(d)
        for s in range(1, 5):
            t = blank()
            assert mgr.restore(t, step=s) == s
            same(t, state_of(s))
    with open_mgr(d, read_only=True) as ro:
        for s in range(1, 5):
            got = ro.load(step=s)
            same(got, state_of(s))


def test_off_by_default_and_validated(tmp_path):
    with open_mgr(tmp_path / "a", incremental=False) as mgr:
        mgr.save(1, state_of(1)).wait()
        mgr.save(2, state_of(2)).wait()
    assert "refs" not in manifest_of(tmp_path / "a", 2)
    with pytest.raises(pitstop.InvalidArgumentError, match="incremental must be True or False"):
        open_mgr(tmp_path / "b", incremental="yes")


def test_keep_last_1_keeps_the_holder_while_referenced_then_deletes_it(tmp_path):
    d = tmp_path / "run"
    deleted: list[int] = []
    with open_mgr(d, keep_last=1) as mgr:
        mgr.hooks["before_delete"] = deleted.append
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
        # step 1 holds the frozen arrays step 3 reads: kept, a valid checkpoint of its own
        assert steps_on_disk(d) == [1, 3] and deleted == [2]
        assert mgr.all_steps() == [1, 3]
        index = json.loads((d / ".pitstop" / "index.json").read_text())["checkpoints"]
        assert index["3"]["refs"] == [1] and index["1"]["refs"] == []
        # a pitstop from before references honours "protected" (and ignores "held"): its
        # retention, were it to run here, would not delete the holder either
        assert index["1"]["protected"] is True and index["1"]["held"] is True
        assert index["3"]["protected"] is False and "held" not in index["3"]
        same(mgr.load(step=1), state_of(1))
        # the backbone changes (unfrozen): step 4 writes everything, references nothing, and
        # both older ones go, the referencing one (3) before the one it references (1)
        mgr.save(4, state_of(4, frozen_seed=1)).wait()
        assert "refs" not in manifest_of(d, 4)
        assert steps_on_disk(d) == [4] and deleted == [2, 3, 1]
        index = json.loads((d / ".pitstop" / "index.json").read_text())["checkpoints"]
        assert index["4"]["protected"] is False
        mgr.save(5, state_of(5, frozen_seed=1)).wait()
        assert steps_on_disk(d) == [4, 5]
        assert set(manifest_of(d, 5)["refs"]) == {step_name(4)}
        t = blank()
        assert mgr.restore(t) == 5
        same(t, state_of(5, frozen_seed=1))


def test_a_referencing_checkpoint_retention_cannot_delete_keeps_what_it_references(tmp_path):
    """Deletion goes newest first; one that stays (being read, a failed deletion) keeps the
    checkpoint it references: no listed checkpoint ever loses its referenced bytes."""
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
    with open_mgr(d, keep_last=1) as mgr:
        real = mgr.storage.delete_if_unread
        mgr.storage.delete_if_unread = lambda name: False if name == step_name(3) else \
            real(name)  # step 3 is being read
        mgr.save(4, state_of(4, frozen_seed=1)).wait()
        assert steps_on_disk(d) == [1, 3, 4]  # 2 went; 1 stays while 3 does
        same(mgr.load(step=3), state_of(3))
        mgr.storage.delete_if_unread = real
        mgr.save(5, state_of(5, frozen_seed=1)).wait()
        assert steps_on_disk(d) == [4, 5]


def test_references_never_chain_when_arrays_change_at_different_times(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = tmp_path / "run"
    state = state_of(1)
    history = {}
    with open_mgr(d, keep_last=2) as mgr:
        for s in range(1, 9):
            for k in rng.sample([f"w{i}" for i in range(N)], rng.randrange(0, 4)):
                state[k] = state[k] + np.float32(1)
            state["step"] = s
            mgr.save(s, state).wait()
            history[s] = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                          for k, v in state.items()}
        check_no_chains(d)
        for s in steps_on_disk(d):
            t = blank()
            assert mgr.restore(t, step=s) == s, f"seed {seed}"
            same(t, history[s])
        # every referenced holder is still there, and every kept one is restorable
        for s in steps_on_disk(d):
            for holder in manifest_of(d, s).get("refs", {}):
                assert (d / holder / "manifest.json").exists(), f"seed {seed}"


def test_dtype_or_shape_change_of_a_key_writes_it(tmp_path):
    d = tmp_path / "run"
    st = state_of(1)
    with open_mgr(d) as mgr:
        mgr.save(1, st).wait()
        st2 = dict(st, step=2, w0=st["w0"].view(np.int32), w2=st["w2"].reshape(128, 128))
        h = mgr.save(2, st2)
        h.wait()
        arrays = manifest_of(d, 2)["arrays"]
        assert "ref" not in arrays["w0"] and "ref" not in arrays["w2"]
        assert arrays["w3"]["ref"] == step_name(1)
        assert h.stats.reused_bytes == (N - 2) * SIZE * 4  # w1 and w5 did not change either
        got = mgr.load(step=2)
        assert got["w0"].dtype == np.int32 and got["w2"].shape == (128, 128)
        assert got["w0"].tobytes() == st["w0"].tobytes()


def test_compressed_references_restore_exactly(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, compression="zstd+shuffle") as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
        doc = manifest_of(d, 3)
        w0 = doc["arrays"]["w0"]
        assert w0["ref"] == step_name(1) and w0["codec"].startswith("zstd")
        check_no_chains(d)
        t = blank()
        assert mgr.restore(t) == 3
        same(t, state_of(3))


def test_a_restart_writes_in_full_then_incrementally_again(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(1, state_of(1)).wait()
        mgr.save(2, state_of(2)).wait()
    with open_mgr(d) as mgr:
        t = blank()
        assert mgr.restore(t) == 2
        same(t, state_of(2))
        h = mgr.save(3, state_of(3))
        h.wait()
        assert h.stats.reused_bytes == 0 and "refs" not in manifest_of(d, 3)
        mgr.save(4, state_of(4)).wait()
        assert set(manifest_of(d, 4)["refs"]) == {step_name(3)}


# =========================================================================== damage
def holder_run(d) -> None:
    """Steps 1, 2, 3: the backbone changes at step 2, so step 3 references step 2."""
    with open_mgr(d) as mgr:
        mgr.save(1, state_of(1)).wait()
        mgr.save(2, state_of(2, frozen_seed=1)).wait()
        mgr.save(3, state_of(3, frozen_seed=1)).wait()
    assert set(manifest_of(d, 3)["refs"]) == {step_name(2)}


def test_a_missing_holder_file_is_named_and_restore_falls_back(tmp_path):
    d = tmp_path / "run"
    holder_run(d)
    w0 = manifest_of(d, 3)["arrays"]["w0"]
    os.remove(d / step_name(2) / w0["file"])
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(blank(), step=3)
        text = str(info.value)
        assert step_name(3) in text and step_name(2) in text and "'w0'" in text
        assert "falls back" in text
        t = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.restore(t) == 1
        same(t, state_of(1))


def test_a_corrupt_holder_byte_is_a_hash_mismatch_naming_the_holder(tmp_path):
    d = tmp_path / "run"
    holder_run(d)
    w3 = manifest_of(d, 3)["arrays"]["w3"]
    p = d / step_name(2) / w3["file"]
    data = bytearray(p.read_bytes())
    data[w3["offset"] + 5] ^= 0x40
    p.write_bytes(bytes(data))
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="hash mismatch") as info:
            mgr.load(step=3)
        assert step_name(2) in str(info.value) and "'w3'" in str(info.value)
        t = blank()
        with pytest.warns(UserWarning):
            assert mgr.restore(t) == 1
        same(t, state_of(1))


@pytest.mark.parametrize("how", ["restore", "load"])
def test_a_save_after_a_read_found_a_corrupt_holder_writes_in_full(tmp_path, how):
    """A read of step N that finds the bytes N references in its holder damaged (a hash
    mismatch) leaves the manager knowing it: the next save must write those arrays again,
    never reference the damaged bytes (a fresh save that could never be restored)."""
    d = tmp_path / "run"
    with open_mgr(d, keep_last=5) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
        w3 = manifest_of(d, 3)["arrays"]["w3"]
        p = d / w3["ref"] / w3["file"]
        data = bytearray(p.read_bytes())
        data[w3["offset"] + 5] ^= 0x40
        p.write_bytes(bytes(data))
        with pytest.raises(pitstop.CorruptCheckpointError, match="hash mismatch"):
            if how == "restore":
                mgr.restore(blank(), step=3)
            else:
                mgr.load(step=3)
        mgr.save(4, state_of(4)).wait()
        assert "refs" not in manifest_of(d, 4)
        t = blank()
        assert mgr.restore(t, step=4) == 4
        same(t, state_of(4))


def test_a_referencing_checkpoint_copied_alone_says_its_holder_is_missing(tmp_path):
    """load() of a directory holding only a copy of an incremental checkpoint (its holder
    left behind) says why nothing loads, not just "no valid checkpoint"."""
    d = tmp_path / "run"
    with open_mgr(d, keep_last=1) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).wait()
    e = tmp_path / "copy"
    shutil.copytree(d / step_name(2), e / step_name(2))
    with pitstop.CheckpointManager(e, read_only=True) as r:
        with pytest.warns(UserWarning), \
                pytest.raises(pitstop.CheckpointNotFoundError, match="step_0000000001"):
            r.load()


def test_deleting_a_referenced_checkpoint_is_refused(tmp_path):
    d = tmp_path / "run"
    holder_run(d)
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CheckpointError, match="referenced by step 3"):
            mgr.delete(2)
        mgr.delete(3)
        mgr.delete(2)
        assert mgr.all_steps() == [1]


def test_a_rolled_back_run_never_references_the_checkpoints_it_moved_aside(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
        t = blank()
        assert mgr.restore(t, step=1) == 1
        with pytest.warns(UserWarning, match="abandoned"):
            mgr.save(2, state_of(2)).wait()
        assert steps_on_disk(d) == [1, 2]
        assert "refs" not in manifest_of(d, 2)  # what it knew (step 3) was moved aside
        mgr.save(3, state_of(3)).wait()
        assert set(manifest_of(d, 3)["refs"]) == {step_name(2)}
        t = blank()
        assert mgr.restore(t) == 3
        same(t, state_of(3))


def test_retention_keeps_what_a_checkpoint_moved_aside_as_abandoned_references(tmp_path):
    """A rollback moves the abandoned run's checkpoints aside and pitstop says it keeps them:
    one that references an older checkpoint's bytes must stay restorable, so retention keeps
    that holder while the abandoned checkpoint is there, and deletes it once it is gone."""
    d = tmp_path / "run"
    with open_mgr(d, keep_last=3) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, state_of(s)).wait()
        assert set(manifest_of(d, 4)["refs"]) == {step_name(1)}
        assert mgr.restore(blank(), step=2) == 2
        with pytest.warns(UserWarning, match="abandoned"):
            mgr.save(3, state_of(3, frozen_seed=1)).wait()
        for s in (4, 5, 6):
            mgr.save(s, state_of(s, frozen_seed=1)).wait()
        # 1: kept for the abandoned step 4; 3: the new run's holder
        assert mgr.all_steps() == [1, 3, 4, 5, 6]
        aside = sorted(n for n in os.listdir(d) if ".abandoned-" in n)
        assert len(aside) == 2
        # the abandoned checkpoint is still whole: copied back, it restores exactly
        e = tmp_path / "back"
        shutil.copytree(d / step_name(1), e / step_name(1))
        shutil.copytree(d / aside[-1], e / step_name(4))
        with pitstop.CheckpointManager(e, read_only=True) as r:
            t = blank()
            assert r.restore(t, step=4) == 4
            same(t, state_of(4))
        with pytest.raises(pitstop.CheckpointError, match="abandoned"):
            mgr.delete(1)  # asked for: refused while an abandoned checkpoint reads from it
        # once the abandoned checkpoints are deleted, the holder goes at the next retention
        for n in aside:
            shutil.rmtree(d / n)
        mgr.save(7, state_of(7, frozen_seed=1)).wait()
        assert steps_on_disk(d) == [3, 5, 6, 7]


# =========================================================================== format
def test_older_readers_refuse_with_upgrade_and_refs_are_validated(tmp_path, monkeypatch):
    d = tmp_path / "run"
    holder_run(d)
    data = (d / step_name(3) / "manifest.json").read_bytes()
    with monkeypatch.context() as m:
        m.setattr(validate_mod, "MAJOR", 3)  # a reader from before incremental checkpoints
        with pytest.raises(pitstop.UnsupportedFormatError, match="Upgrade pitstop"):
            parse(data, "x")
    bad = [
        # a ref the manifest's refs do not list
        lambda doc: doc["arrays"]["w0"].update(ref=step_name(1)),
        # a referenced name that is no checkpoint name at all
        lambda doc: doc.update(refs={"../other": doc["refs"][step_name(2)]}),
        # the checkpoint itself, and a newer one: references only ever go back in time
        lambda doc: doc.update(refs={step_name(3): doc["refs"][step_name(2)]}) or [
            e.update(ref=step_name(3)) for e in doc["arrays"].values() if "ref" in e],
        lambda doc: doc.update(refs={step_name(9): doc["refs"][step_name(2)]}) or [
            e.update(ref=step_name(9)) for e in doc["arrays"].values() if "ref" in e],
        # a file the referenced checkpoint's listing does not have
        lambda doc: doc["arrays"]["w0"].update(file="data-007.bin"),
        # past the end of the referenced file
        lambda doc: doc["arrays"]["w0"].update(offset=1 << 30),
    ]
    for i, edit in enumerate(bad):
        case = tmp_path / f"bad{i}"
        shutil.copytree(d, case)
        rewrite(case, 3, edit)
        with open_mgr(case, read_only=True) as ro:
            with pytest.raises(pitstop.CorruptCheckpointError):
                ro.load(step=3)


def test_manifest_with_references_matches_the_json_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from pathlib import Path
    schema = json.loads((Path(__file__).resolve().parents[3] / "docs" /
                         "manifest.schema.json").read_text())
    d = tmp_path / "run"
    holder_run(d)
    validator = jsonschema.Draft202012Validator(schema)
    doc = manifest_of(d, 3)
    assert not sorted(validator.iter_errors(doc), key=str)
    assert not validator.is_valid(dict(doc, format_version="3.0"))
    assert not validator.is_valid(dict(doc, refs={"../x": {"data-000.bin": {"length": 1}}}))


# =========================================================================== stepping aside
def test_encryption_steps_aside_with_one_warning(tmp_path, caplog):
    key = pitstop.Encryption(lambda: bytes(range(32)))
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        with pytest.warns(UserWarning, match="incremental=True steps aside: the checkpoints "
                          "are encrypted"):
            mgr = open_mgr(tmp_path / "run", encryption=key)
        with mgr:
            for s in (1, 2, 3):
                h = mgr.save(s, state_of(s))
                h.wait()
                assert h.stats.reused_bytes == 0
            t = blank()
            assert mgr.restore(t) == 3
            same(t, state_of(3))
    said = [r for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(said) == 1
    assert manifest_of(tmp_path / "run", 3)["format_version"] == "3.0"


# =========================================================================== index, CLI, storage
def test_an_index_without_refs_is_rebuilt_from_the_manifests(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
    p = d / ".pitstop" / "index.json"
    doc = json.loads(p.read_text())
    for e in doc["checkpoints"].values():
        del e["refs"]  # as an older pitstop wrote it
    p.write_text(json.dumps(doc))
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(4, state_of(4)).wait()  # written in full (a new manager): 3 and 2 go
        assert steps_on_disk(d) == [4]
        mgr.save(5, state_of(5)).wait()
        assert steps_on_disk(d) == [4, 5]
    with open_mgr(d) as mgr:  # one that refs 4 and is not yet in the index: read from disk
        pass
    assert json.loads(p.read_text())["checkpoints"]["5"]["refs"] == [4]


def test_cli_ls_inspect_and_verify(tmp_path, capsys):
    d = tmp_path / "run"
    holder_run(d)
    rc = main(["verify", "--all", str(d)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    rc = main(["ls", str(d)])
    out, _ = capsys.readouterr()
    assert rc == 0 and "step 2 holds data referenced by step 3" in out
    rc = main(["inspect", str(d)])
    out, _ = capsys.readouterr()
    assert rc == 0 and f"{step_name(2)}/data-" in out and "incremental" in out
    w0 = manifest_of(d, 3)["arrays"]["w0"]
    os.remove(d / step_name(2) / w0["file"])
    rc = main(["verify", str(d)])
    out, err = capsys.readouterr()
    assert rc != 0 and step_name(2) in out + err


def test_object_storage(tmp_path):
    url = f"memory://pitstop-incr-{os.getpid()}-{random.randrange(1 << 30)}"
    with open_mgr(url, keep_last=1) as mgr:
        for s in (1, 2, 3):
            h = mgr.save(s, state_of(s))
            h.wait()
        assert h.stats.reused_bytes == len(FROZEN) * SIZE * 4
        assert mgr.all_steps() == [1, 3]
        t = blank()
        assert mgr.restore(t) == 3
        same(t, state_of(3))
        mgr.save(4, state_of(4, frozen_seed=1)).wait()
        assert mgr.all_steps() == [4]


@pytest.mark.filterwarnings("ignore:pitstop. incremental=True steps aside")
def test_multi_rank_saves_step_aside_with_one_warning_per_rank(tmp_path, caplog):
    import threading
    from collections import defaultdict
    from concurrent.futures import ThreadPoolExecutor

    from pitstop.core.runtime.coordination import CoordinationError, Coordinator

    class Hub(Coordinator):
        """Two ranks as two threads of this process (as tests/core/runtime/test_coordination.py)."""

        def __init__(self, shared: dict, rank: int) -> None:
            self.shared, self.rank, self.world_size, self.timeout_s = shared, rank, 2, 20.0
            self.seq: dict = defaultdict(int)

        def all_gather(self, data: bytes, *, what: str, channel: str = "control") -> list:
            key = (channel, self.seq[channel])
            self.seq[channel] += 1
            cond, rounds = self.shared["cond"], self.shared["rounds"]
            with cond:
                rounds[key][self.rank] = data
                cond.notify_all()
                if not cond.wait_for(lambda: len(rounds[key]) == 2, self.timeout_s):
                    raise CoordinationError(f"{what}: timed out")
                return [rounds[key][r] for r in range(2)]

    shared = {"cond": threading.Condition(), "rounds": defaultdict(dict)}
    d = tmp_path / "run"

    def job(rank: int) -> None:
        with pitstop.CheckpointManager(d, distributed=Hub(shared, rank), incremental=True,
                                       memory_tier=False, save_on_signals=None) as mgr:
            for s in (1, 2):
                assert mgr.save(s, state_of(s)).result().reused_bytes == 0

    with caplog.at_level(logging.WARNING, logger="pitstop"):
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(job, r) for r in range(2)]:
                f.result(timeout=60)
    said = [r for r in caplog.records if "incremental=True steps aside: this job saves "
            "with several ranks" in r.getMessage()]
    assert len(said) == 2  # one per rank's manager
    assert "refs" not in manifest_of(d, 2)
    with open_mgr(d, read_only=True) as ro:
        same(ro.load(step=2), state_of(2))
