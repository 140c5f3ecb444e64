"""pitstop.integrations.hf.Trainer keeps the Trainer's conventions (issue 29): a checkpoint
named by path, ``resume_from_checkpoint=True`` on a new directory, ``load_best_model_at_end``
with ``save_total_limit``, a directory of the Trainer's own checkpoints, and misuse (an
unknown path, another model) refused with what to do. In-process, a tiny model, no workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import Begin, Data, Net  # noqa: E402

import pitstop  # noqa: E402
from pitstop.integrations.hf import Trainer  # noqa: E402


def _args(out: Path, **kw) -> transformers.TrainingArguments:
    base = dict(max_steps=6, per_device_train_batch_size=4, save_strategy="steps",
                save_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                disable_tqdm=True, seed=3)
    base.update(kw)
    return transformers.TrainingArguments(str(out), **base)


def _trainer(out: Path, cls: type = Trainer, model: torch.nn.Module | None = None, **kw):
    torch.manual_seed(3)
    begin = Begin()
    extra = {"pitstop_options": {"durable": False, "memory_tier": False}} \
        if issubclass(cls, Trainer) else {}
    trainer = cls(model=model or Net(), args=_args(out, **kw), train_dataset=Data(),
                  eval_dataset=Data(8), callbacks=[begin], **extra)
    return trainer, begin


def test_resume_from_the_path_of_a_checkpoint_it_named(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path)
    first.train()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    again, begin = _trainer(tmp_path)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert begin.step == 4 and begin.logged == [1, 2, 3, 4]
    assert again.state.global_step == 6


def test_true_on_a_new_directory_starts_from_scratch(tmp_path: Path) -> None:
    trainer, begin = _trainer(tmp_path / "new", max_steps=2)
    trainer.train(resume_from_checkpoint=True)      # the Trainer's own raises ValueError here
    assert begin.step == 0 and trainer.state.global_step == 2


def test_a_path_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path, max_steps=2)
    first.train()
    again, _ = _trainer(tmp_path)
    with pytest.raises(pitstop.CheckpointNotFoundError, match="checkpoint-99.*steps there: "
                                                              r"\[2\]"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-99"))


def test_a_checkpoint_of_another_model_is_refused_untouched(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path, max_steps=2)
    first.train()
    other = Net(hidden=6)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    again, _ = _trainer(tmp_path, model=other)
    with pytest.raises(pitstop.IncompatibleTargetError, match="model/net.0.weight") as e:
        again.train(resume_from_checkpoint=True)
    assert "another model" in "".join(getattr(e.value, "__notes__", []))
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was changed by a refused restore"


def test_load_best_model_at_end_with_save_total_limit(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, max_steps=8, eval_strategy="steps", eval_steps=2,
                          load_best_model_at_end=True, metric_for_best_model="loss",
                          greater_is_better=True, save_total_limit=1)
    trainer.train()
    best = trainer.state.best_global_step
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    # save_total_limit=1 with a best: the Trainer keeps only the best one at the end
    assert [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")] == \
        [f"checkpoint-{best}"]
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr:
        saved = mgr.load(best)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, torch.as_tensor(saved["model"][k])), k


def test_a_directory_of_the_trainers_own_checkpoints(tmp_path: Path) -> None:
    native, _ = _trainer(tmp_path, cls=transformers.Trainer, max_steps=4)
    native.train()                                   # the Trainer's checkpoint-2, checkpoint-4
    hf_files = sorted(os.listdir(tmp_path / "checkpoint-4"))
    moved, begin = _trainer(tmp_path, max_steps=8)
    moved.train(resume_from_checkpoint=True)         # first start: the Trainer's newest
    assert begin.step == 4 and begin.logged == [1, 2, 3, 4]
    assert moved.state.global_step == 8
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [6, 8]
    assert sorted(os.listdir(tmp_path / "checkpoint-4")) == hf_files   # left as they were
    again, begin = _trainer(tmp_path, max_steps=10)
    again.train(resume_from_checkpoint=True)         # then pitstop's, the newer
    assert begin.step == 8


def test_the_first_loss_logged_after_a_resume_averages_the_same_steps(tmp_path: Path) -> None:
    """logging_steps=4, a resume from step 6: the loss logged at step 8 averages steps 5-8,
    as in the uninterrupted run (the Trainer's own resume restarts the running sum at 6)."""
    def logged(t):
        return [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]

    whole, _ = _trainer(tmp_path / "whole", max_steps=8, logging_steps=4)
    whole.train()
    cut, _ = _trainer(tmp_path / "cut", max_steps=8, logging_steps=4)
    cut.train()
    resumed, begin = _trainer(tmp_path / "cut", max_steps=8, logging_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-6"))
    assert begin.step == 6
    assert logged(resumed) == logged(whole), (logged(resumed), logged(whole))


def test_a_checkpoint_of_another_output_dir_by_path(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path / "a", max_steps=4)
    first.train()
    before = sorted(os.listdir(tmp_path / "a"))
    other, begin = _trainer(tmp_path / "b", max_steps=6)
    other.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert begin.step == 4
    assert sorted(os.listdir(tmp_path / "a")) == before        # only read
    with pitstop.CheckpointManager(tmp_path / "b", read_only=True) as mgr:
        assert mgr.all_steps() == [6]


class Poison(transformers.TrainerCallback):
    """The weights turn NaN at the end of step 3 (a diverged run)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))


def test_the_nan_guard_keeps_a_diverged_run_from_being_saved(tmp_path: Path,
                                                             caplog) -> None:
    diverged, _ = _trainer(tmp_path, max_steps=6)
    diverged.add_callback(Poison())
    with caplog.at_level("WARNING", logger="pitstop"):
        diverged.train()
    assert "step 4 not saved: an array holds NaN or Inf" in caplog.text
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [2]                       # steps 4 and 6 were NaN
    again, begin = _trainer(tmp_path, max_steps=6)
    again.train(resume_from_checkpoint=True)
    assert begin.step == 2
    assert all(torch.isfinite(p).all() for p in again.model.parameters())


def test_an_output_dir_of_a_pitstop_run_of_another_naming_is_refused(tmp_path: Path) -> None:
    with pitstop.CheckpointManager(tmp_path) as mgr:           # step_0000000001
        mgr.save(1, {"w": torch.zeros(2)}).wait()
    trainer, _ = _trainer(tmp_path, max_steps=2)
    with pytest.raises(pitstop.InvalidArgumentError) as e:
        trainer.train()
    assert "give the Trainer another output_dir" in "".join(e.value.__notes__)


def test_a_stateful_callback_added_on_a_resume(tmp_path: Path) -> None:
    """transformers.Trainer's save raises KeyError for an ExportableState callback that the
    resumed checkpoint did not have; pitstop's records it from then on."""
    kw = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
              metric_for_best_model="loss")
    first, _ = _trainer(tmp_path, max_steps=2, **kw)
    first.train()
    again, _ = _trainer(tmp_path, max_steps=4, **kw)
    again.add_callback(transformers.EarlyStoppingCallback(early_stopping_patience=3))
    again.train(resume_from_checkpoint=True)
    assert "EarlyStoppingCallback" in again.state.stateful_callbacks


class OwnLoader(Trainer):
    """A subclass that builds its own ResumableLoader (pitstop does not track it)."""

    def get_train_dataloader(self):
        from pitstop.adapters.torch import ResumableLoader

        return ResumableLoader(self.train_dataset, batch_size=4, shuffle=True, seed=0,
                               collate_fn=self.data_collator)


def test_a_loader_of_your_own_is_skipped_as_the_trainer_skips_it(tmp_path: Path) -> None:
    def logged(t):
        return [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]

    whole, _ = _trainer(tmp_path / "whole", cls=OwnLoader, max_steps=6)
    whole.train()
    cut, _ = _trainer(tmp_path / "cut", cls=OwnLoader, max_steps=6)
    cut.train()
    resumed, begin = _trainer(tmp_path / "cut", cls=OwnLoader, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-4"))
    assert begin.step == 4
    assert logged(resumed) == logged(whole)
