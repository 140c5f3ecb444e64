"""import_deepspeed / `pitstop import`: a directory of engine.save_checkpoint becomes a
pitstop checkpoint that engine_state restores to the engine DeepSpeed saved."""

from __future__ import annotations

import os
import pickle

import ds_helpers as h
import pytest
import torch

import pitstop
from pitstop.cli import main
from pitstop.integrations.deepspeed import engine_state
from pitstop.interop.deepspeed import import_deepspeed


class _NoSave:
    def restore(self, state):
        return None

    def step(self, step, state, metrics=None):
        return None


@pytest.fixture(scope="module")
def saved(ds_dist, tmp_path_factory):
    """A ZeRO-1 engine trained 3 steps and saved by DeepSpeed itself, with its state then."""
    root = tmp_path_factory.mktemp("ds")
    engine, loader = h.build(1)
    h.train(engine, loader, _NoSave(), {}, 3)
    engine.save_checkpoint(str(root / "ds"), client_state={"epoch": 2, "note": "x"})
    return root / "ds", h.snapshot(engine)


def test_import_restores_the_engine_deepspeed_saved(saved, tmp_path):
    """docs/migration.md's DeepSpeed rows, side by side: DeepSpeed's own load_checkpoint
    and pitstop's import + restore give the engine DeepSpeed saved, bit for bit."""
    src, want = saved
    assert (src / "latest").read_text().strip() == "global_step3"
    assert import_deepspeed(src, tmp_path / "run") == 2  # the index of the last step run
    engine, _ = h.build(1, seed=5)
    client: dict = {}
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.restore({"engine": engine_state(engine, client_state=client)}) == 2
    h.assert_same(want, h.snapshot(engine))
    assert client == {"epoch": 2, "note": "x"}

    theirs, _ = h.build(1, seed=6)
    path, their_client = theirs.load_checkpoint(str(src))
    assert path is not None and {k: their_client[k] for k in client} == client
    got = h.snapshot(theirs)
    # DeepSpeed does not save micro_steps (it restarts at 0); pitstop keeps the saved run's
    assert got.pop("counters")[:3].tolist() == want["counters"][:3].tolist()
    h.assert_same({k: v for k, v in want.items() if k != "counters"}, got)


def test_cli_import_and_wrong_places(saved, tmp_path, capsys):
    src, _ = saved
    assert main(["import", str(src), str(tmp_path / "cli"), "--step", "7"]) == 0
    assert "as step 7" in capsys.readouterr().out
    with pytest.raises(pitstop.StepExistsError):
        import_deepspeed(src, tmp_path / "cli", 7)
    with pytest.raises(pitstop.CheckpointNotFoundError, match="save_dir"):
        import_deepspeed(src / "global_step3" / "..", tmp_path / "x", tag="global_step9")
    with pytest.raises(pitstop.CheckpointNotFoundError, match="no DeepSpeed checkpoint"):
        import_deepspeed(tmp_path, tmp_path / "y")


def test_a_hostile_pickle_is_refused(saved, tmp_path):
    """A model file whose pickle would run code: refused, nothing run, nothing written."""
    src, _ = saved
    bad = tmp_path / "bad" / "global_step1"
    bad.mkdir(parents=True)
    (tmp_path / "bad" / "latest").write_text("global_step1")

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    torch.save({"module": {"w": torch.zeros(1)}, "x": Boom()},
               bad / "mp_rank_00_model_states.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(pitstop.UnsupportedStateError, match="does not unpickle"):
        import_deepspeed(tmp_path / "bad", tmp_path / "z")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "z").exists()


def test_import_of_stage_0(ds_dist, tmp_path):
    """ZeRO off: the optimizer is in the model file; tag= picks a checkpoint, a tag folder
    itself imports too."""
    engine, loader = h.build(0)
    h.train(engine, loader, _NoSave(), {}, 2)
    engine.save_checkpoint(str(tmp_path / "ds"), tag="first")
    want = h.snapshot(engine)
    h.train(engine, loader, _NoSave(), {}, 3)
    engine.save_checkpoint(str(tmp_path / "ds"))  # global_step3, now the latest
    assert import_deepspeed(tmp_path / "ds", tmp_path / "run", tag="first") == 1
    assert import_deepspeed(tmp_path / "ds" / "global_step3", tmp_path / "run") == 2
    fresh, _ = h.build(0, seed=4)
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.restore({"engine": engine_state(fresh)}, step=1) == 1
    h.assert_same(want, h.snapshot(fresh))
