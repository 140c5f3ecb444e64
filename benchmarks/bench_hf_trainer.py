"""The training-thread stall of a Hugging Face Trainer save: the Trainer's own
(``torch.save`` of the model, optimizer, scheduler and RNG into ``checkpoint-N``) against
pitstop.integrations.hf.Trainer's (a snapshot; the write goes on in the background), on the
same model and state, interleaved in one process so disk drift cancels.

    python benchmarks/bench_hf_trainer.py --layers 4 --width 512 --saves 3

It prints, per Trainer, the median time the training loop waited in ``_save_checkpoint``
(the stall), the median step time of the steps without a save, the state size, and the
ratio of the Trainer's stall to pitstop's. Not part of the test run (minutes long).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from transformers import Trainer as HFTrainer

from pitstop.integrations.hf import Trainer as PitstopTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.last)


def timed(base: type) -> type:
    class Timed(base):
        stalls: list[float] = []

        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.stalls.append(time.perf_counter() - t0)
    return Timed


def run(base: type, opts: argparse.Namespace, out: str) -> tuple[list[float], list[float], int]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=8, vocab_size=4096,
                        n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    steps = opts.saves * opts.every
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=2,
                             save_strategy="steps", save_steps=opts.every, report_to="none",
                             use_cpu=True, disable_tqdm=True, logging_strategy="no")
    times = StepTimes()
    cls = timed(base)
    cls.stalls = []
    extra = {"pitstop_options": {"memory_tier": False}} if base is PitstopTrainer else {}
    trainer = cls(model=model, args=args, train_dataset=Tokens(256, 64, 4096),
                  callbacks=[times], **extra)
    trainer.train()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    saved_steps = {opts.every * (i + 1) - 1 for i in range(opts.saves)}
    plain = [t for i, t in enumerate(times.times) if i not in saved_steps]
    return cls.stalls, plain, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--every", type=int, default=4)
    opts = p.parse_args()
    rows = {}
    for base in (HFTrainer, PitstopTrainer, HFTrainer, PitstopTrainer):
        with tempfile.TemporaryDirectory() as out:
            stalls, plain, nbytes = run(base, opts, out)
        name = "pitstop" if base is PitstopTrainer else "transformers"
        rows.setdefault(name, ([], [], nbytes))
        rows[name][0].extend(stalls)
        rows[name][1].extend(plain)
    print(f"state: {rows['pitstop'][2] / 2**20:.0f} MiB (weights + Adam moments)")
    for name, (stalls, plain, _) in rows.items():
        print(f"{name:13s} save stall median {statistics.median(stalls):.3f} s, "
              f"step without a save median {statistics.median(plain):.3f} s")
    ratio = statistics.median(rows["transformers"][0]) / statistics.median(rows["pitstop"][0])
    print(f"stall_ratio (Trainer's own / pitstop's): {ratio:.1f}")


if __name__ == "__main__":
    main()
