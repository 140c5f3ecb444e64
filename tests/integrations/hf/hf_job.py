"""A Hugging Face Trainer job for the kill/resume test: ``python hf_job.py OUT_DIR``.

A tiny GPT-2 built from a config, dropout on, a shuffled map-style dataset read by two
worker processes, gradient accumulation 2, the default linear schedule with warm-up, a save
every 2 steps. It prints ``loss <global_step> <micro> <hex>`` for every micro-batch (the loss
``training_step`` returns, before the Trainer averages it for the log) and ``step <n>`` once
step ``n`` ended, so a test can kill it after a known step; at the end it writes the final
weights and optimizer state to ``OUT_DIR/final.pt``. ``native``: the plain
``transformers.Trainer`` with its own checkpoints (the migration test's first run).
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from pitstop.integrations.hf import Trainer

MAX_STEPS = int(os.environ.get("HF_JOB_STEPS", "14"))


def say(line: str) -> None:
    # one write per line: print writes the text and its newline apart, and stderr (the same
    # FIFO, unbuffered) gets pitstop's log records from its save thread in between
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 40, length: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        say(f"step {state.global_step}")


def recording(base: type) -> type:
    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._micro = getattr(self, "_micro", 0) + 1
            say(f"loss {self.state.global_step} {self._micro % 2} {loss.item().hex()}")
            return loss
    return Recording


def main(out: str) -> None:
    args = TrainingArguments(
        out, max_steps=MAX_STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, warmup_steps=3, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="steps", save_steps=2, save_total_limit=2, dataloader_num_workers=2,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=7)
    torch.manual_seed(7)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)
    trainer = recording(Trainer)(model=model, args=args, train_dataset=Tokens(),
                                 callbacks=[Progress()])
    trainer.train(resume_from_checkpoint=True)
    if trainer.state.global_step == MAX_STEPS:
        opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
            else trainer.optimizer
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "log": [h for h in trainer.state.log_history if "loss" in h]},
                   os.path.join(out, "final.pt"))
        say("done")


if __name__ == "__main__":
    main(sys.argv[1])
