"""Every row of docs/migration.md's Hugging Face Trainer table, differentially: the same
scenario through ``transformers.Trainer``'s own checkpoints and through
``pitstop.integrations.hf.Trainer``, comparing the checkpoints kept, the best one, and what a
resume starts from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import Begin, Data, Net  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from pitstop.integrations.hf import Trainer  # noqa: E402

#: eval_score by evaluation (one every 2 steps): the best (lowest) is the 2nd, at step 4
SCORES = [0.5, 0.1, 0.4, 0.3]


def _run(cls: type, out: Path, resume=None, max_steps: int = 8, callbacks=()):
    calls = []

    def metrics(_pred):
        calls.append(1)
        return {"score": SCORES[(len(calls) - 1) % len(SCORES)]}

    torch.manual_seed(3)
    args = transformers.TrainingArguments(
        str(out), max_steps=max_steps, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=2, save_total_limit=2, eval_strategy="steps", eval_steps=2,
        load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=3)
    extra = {"pitstop_options": {"durable": False, "memory_tier": False}} \
        if cls is Trainer else {}
    begin = Begin()
    trainer = cls(model=Net(), args=args, train_dataset=Data(), eval_dataset=Data(8),
                  compute_metrics=metrics, callbacks=[begin, *callbacks], **extra)
    trainer.train(resume_from_checkpoint=resume)
    kept = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-") and "." not in n)
    return trainer, begin, kept


def test_save_steps_total_limit_and_best_keep_their_meaning(tmp_path: Path) -> None:
    hf, _, hf_kept = _run(transformers.Trainer, tmp_path / "hf")
    ps, _, ps_kept = _run(Trainer, tmp_path / "ps")
    assert ps_kept == hf_kept == ["checkpoint-4", "checkpoint-8"]   # the best and the newest
    assert os.path.basename(ps.state.best_model_checkpoint) == \
        os.path.basename(hf.state.best_model_checkpoint) == "checkpoint-4"
    assert ps.state.best_metric == hf.state.best_metric == 0.1
    # get_last_checkpoint names pitstop's newest too, a path resume_from_checkpoint takes
    assert os.path.basename(get_last_checkpoint(str(tmp_path / "ps"))) == "checkpoint-8"


@pytest.mark.parametrize("resume", ["path", True])
def test_a_resume_starts_where_the_trainers_own_does(tmp_path: Path, resume) -> None:
    starts = {}
    for name, cls in (("hf", transformers.Trainer), ("ps", Trainer)):
        out = tmp_path / name
        _run(cls, out, max_steps=6)
        again = str(out / "checkpoint-6") if resume == "path" else True
        trainer, begin, kept = _run(cls, out, resume=again, max_steps=10)
        starts[name] = (begin.step, begin.logged, trainer.state.global_step, kept)
    assert starts["ps"] == starts["hf"]
    assert starts["ps"][0] == 6


def test_a_stateful_callbacks_state_comes_back_as_with_the_trainers_own(tmp_path: Path
                                                                         ) -> None:
    """EarlyStoppingCallback (an ExportableState): its patience counter at the checkpoint."""
    counters = {}
    for name, cls in (("hf", transformers.Trainer), ("ps", Trainer)):
        out = tmp_path / name
        first = transformers.EarlyStoppingCallback(early_stopping_patience=5)
        _run(cls, out, max_steps=6, callbacks=[first])   # scores 0.5, 0.1, 0.4: one worse
        stop = transformers.EarlyStoppingCallback(early_stopping_patience=5)
        _run(cls, out, resume=str(out / "checkpoint-6"), max_steps=7, callbacks=[stop])
        counters[name] = (first.early_stopping_patience_counter,
                          stop.early_stopping_patience_counter)
    assert counters["ps"] == counters["hf"], counters
    assert counters["ps"] == (1, 1)      # saved at 1, back at 1 after the resume
