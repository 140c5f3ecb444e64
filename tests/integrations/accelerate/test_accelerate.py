"""pitstop.integrations.accelerate in one process: the migration of accelerator.save_state
folders, the rows of docs/migration.md (the same scenario through accelerate's own
save_state/load_state and through Checkpointing, compared), and a user's mistakes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402

import pitstop  # noqa: E402
from pitstop.integrations.accelerate import (  # noqa: E402
    Checkpointing,
    import_accelerate_checkpoint,
)


class Counter:
    """An object of the user's, given to register_for_checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = sd["seen"]


class Counted(torch.utils.data.TensorDataset):
    """A dataset that counts the samples read from it."""

    reads = 0

    def __getitem__(self, i):
        Counted.reads += 1
        return super().__getitem__(i)


def make(project: Path | None = None, *, seed: int = 0, hidden: int = 16, total_limit=None,
         sampler=None):
    """A fresh Accelerator (accelerate's singletons reset) with a prepared model, AdamW,
    a StepLR, a shuffled loader and a registered Counter."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                  total_limit=total_limit) if project else None
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, project_config=config)
    set_seed(seed)
    data = Counted(torch.randn(24, 4), torch.randn(24, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Dropout(0.1),
                                torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=sampler is None,
                                     sampler=sampler)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, dl, sched, counter


def train(acc, model, opt, dl, sched, counter, ckpt=None) -> None:
    """One epoch (6 batches, 3 optimizer steps)."""
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.seen += 1
        if ckpt is not None:
            ckpt.step()


def snapshot(acc, model, opt, sched, counter) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "counter": counter.seen, "rng": torch.get_rng_state().clone(), "step": acc.step}


def assert_same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for pid, st in a["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][pid][name]), (pid, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]
    assert a["counter"] == b["counter"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["step"] == b["step"]


def test_save_state_and_checkpointing_restore_the_same_values(tmp_path: Path) -> None:
    """Rows 'accelerator.save_state()' / 'load_state()' / 'total_limit' of docs/migration.md:
    the same training, saved four times by each; what each keeps and restores."""
    kept = {}
    restored = {}
    for tool in ("accelerate", "pitstop"):
        objs = make(tmp_path / tool, total_limit=2)
        acc = objs[0]
        ckpt = Checkpointing(acc, save_every_steps=100) if tool == "pitstop" else None
        for _ in range(4):
            train(*objs, ckpt=ckpt)
            if ckpt is None:
                acc.save_state()
            else:
                ckpt.save_state()
        want = snapshot(acc, objs[1], objs[2], objs[4], objs[5])
        if ckpt is not None:
            ckpt.close()
        fresh = make(tmp_path / tool, seed=1, total_limit=2)
        if tool == "accelerate":
            fresh[0].load_state()  # the newest of checkpoints/checkpoint_N
            kept[tool] = sorted(p.name for p in (tmp_path / tool / "checkpoints").iterdir())
        else:
            with Checkpointing(fresh[0]) as again:
                assert again.restore() == 12 and again.global_step == 12
                kept[tool] = again.manager.all_steps()
        restored[tool] = snapshot(fresh[0], fresh[1], fresh[2], fresh[4], fresh[5])
        assert_same(want, restored[tool])
    # (the values differ between the two: pitstop's loader shuffles by (seed, epoch))
    assert kept == {"accelerate": ["checkpoint_2", "checkpoint_3"], "pitstop": [9, 12]}


def test_import_of_a_save_state_folder_resumes(tmp_path: Path) -> None:
    """Row 'an existing checkpoints/checkpoint_N folder': imported, then restored into fresh
    objects as accelerate's own load_state restores it."""
    objs = make(tmp_path / "acc")
    train(*objs)
    objs[0].save_state()
    want = snapshot(objs[0], objs[1], objs[2], objs[4], objs[5])
    folder = tmp_path / "acc" / "checkpoints" / "checkpoint_0"
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= {p.name for p in folder.iterdir()}
    assert import_accelerate_checkpoint(folder, tmp_path / "runs", step=3) == 3
    with pytest.raises(pitstop.StepExistsError):
        import_accelerate_checkpoint(folder, tmp_path / "runs", step=3)
    fresh = make(seed=3)
    with Checkpointing(fresh[0], tmp_path / "runs") as ckpt:
        assert ckpt.restore(strict=False) == 3   # no loader position in such a folder
        assert ckpt.global_step == 3
        got = snapshot(fresh[0], fresh[1], fresh[2], fresh[4], fresh[5])
    assert_same(want, got)


def test_a_users_mistakes_get_errors_that_say_what_to_do(tmp_path: Path) -> None:
    objs = make(tmp_path / "acc")
    train(*objs)
    objs[0].save_state()
    with pytest.raises(pitstop.UnsupportedStateError, match="import_accelerate_checkpoint"):
        Checkpointing(objs[0])  # {project_dir}/checkpoints holds accelerate's checkpoint_0
    with pytest.raises(pitstop.CheckpointNotFoundError, match="random_states"):
        import_accelerate_checkpoint(tmp_path / "acc", tmp_path / "runs", step=0)
    with pytest.raises(ValueError, match="needs a directory"):
        Checkpointing(make()[0])
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 24, 24)
    with Checkpointing(make(sampler=weighted)[0], tmp_path / "w"):
        pass  # any sampler: ResumableLoader.from_loader keeps it (tests/adapters/torch)

    objs = make()
    with Checkpointing(objs[0], tmp_path / "runs", save_every_steps=100) as ckpt:
        train(*objs, ckpt=ckpt)
        ckpt.save().wait()
        with pytest.raises(pitstop.CheckpointNotFoundError, match="not a checkpoint of"):
            ckpt.load_state(tmp_path / "acc" / "checkpoints" / "checkpoint_0")
        assert ckpt.load_state(Path(ckpt.directory) / "step_0000000003") == 3
    wider = make(hidden=32)  # restore into another model: refused before a byte is written
    before = {k: v.clone() for k, v in wider[1].state_dict().items()}
    with Checkpointing(wider[0], tmp_path / "runs") as ckpt:
        with pytest.raises(pitstop.IncompatibleTargetError):
            ckpt.restore()
    for k, v in wider[1].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_loop_that_breaks_out_goes_on_with_the_next_batch(tmp_path: Path) -> None:
    """The shard reads a batch ahead; breaking out of the loop must not lose that batch."""
    acc, *_ = objs = make()
    dl = objs[3]
    with Checkpointing(acc, tmp_path / "runs"):
        whole = [x for x, _ in dl]
        first = []
        for i, (x, _) in enumerate(dl):
            first.append(x)
            if i == 2:
                break
        rest = [x for x, _ in dl]
        again = [x for x, _ in dl]
    assert len(whole) == len(again) == 6 and len(first) == 3 and len(rest) == 3
    assert not torch.equal(torch.cat(whole), torch.cat(first + rest))  # epoch 1 reshuffled
    order = torch.cat(first + rest)
    assert sorted(order[:, 0].tolist()) == sorted(torch.cat(whole)[:, 0].tolist())


def test_skip_first_batches_resumes_another_order_pitstop_the_same(
        tmp_path: Path) -> None:
    """Row 'skip_first_batches' of docs/migration.md (and accelerate#2016): stopped after 3
    of an epoch's 6 batches and resumed, accelerate's recipe (save_state, load_state,
    skip_first_batches) yields the last 3 batches of another permutation; pitstop's yields
    the uninterrupted epoch's. Neither reads the skipped samples of a map-style dataset
    (accelerate skips indices; it re-reads only an IterableDataset's batches)."""
    def first_three(dl):
        got = []
        for i, (x, _) in enumerate(dl):
            got.append(x)
            if i == 2:
                return got
        raise AssertionError("the epoch has 6 batches")

    results = {}
    for tool in ("accelerate", "pitstop"):
        objs = make()
        if tool == "pitstop":
            Checkpointing(objs[0], tmp_path / "reference").close()  # the same loader
        whole = [x for x, _ in objs[3]]  # epoch 0, uninterrupted (the reference)
        objs = make()
        ckpt = Checkpointing(objs[0], tmp_path / tool) if tool == "pitstop" else None
        got = first_three(objs[3])
        if ckpt is None:
            objs[0].save_state(str(tmp_path / tool))
        else:
            ckpt.save().wait()
            ckpt.close()
        fresh = make()
        Counted.reads = 0
        if tool == "accelerate":
            fresh[0].load_state(str(tmp_path / tool))
            rest = [x for x, _ in fresh[0].skip_first_batches(fresh[3], 3)]
        else:
            with Checkpointing(fresh[0], tmp_path / tool) as again:
                again.restore()
                rest = [x for x, _ in fresh[3]]
        results[tool] = ([torch.equal(a, b) for a, b in zip(whole, got + rest, strict=True)],
                         Counted.reads)
    assert results["accelerate"] == ([True] * 3 + [False] * 3, 12)
    assert results["pitstop"] == ([True] * 6, 12)


def test_a_stateful_dataloader_resumes_the_same_epoch(tmp_path: Path) -> None:
    """DataLoaderConfiguration(use_stateful_dataloader=True): torchdata's loader inside the
    shard is replaced as a plain one is; the resumed epoch is the uninterrupted one's.
    accelerate's own save_state / load_state of the same loader resumes another order."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from accelerate import DataLoaderConfiguration

    def stateful():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True))
        set_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 4))
        model, dl = acc.prepare(torch.nn.Linear(4, 1),
                                torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return acc, dl

    acc, dl = stateful()
    Checkpointing(acc, tmp_path / "reference").close()
    whole = [x for (x,) in dl]
    acc, dl = stateful()
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        got = []
        for i, (x,) in enumerate(dl):
            got.append(x)
            if i == 2:
                ckpt.save().wait()
                break
    acc, dl = stateful()
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        assert ckpt.restore() == 0
        got += [x for (x,) in dl]
    assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(whole, got, strict=True))

    acc, dl = stateful()  # the same through accelerate alone
    whole = [x for (x,) in dl]
    acc, dl = stateful()
    own = []
    for i, (x,) in enumerate(dl):
        own.append(x)
        if i == 2:
            acc.save_state(str(tmp_path / "own"))
            break
    acc, dl = stateful()
    acc.load_state(str(tmp_path / "own"))
    own += [x for (x,) in dl]
    assert [torch.equal(a, b) for a, b in zip(whole, own, strict=True)] == [True] * 3 + [False] * 3


def test_objects_prepared_after_checkpointing_are_saved_too(tmp_path: Path) -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        Checkpointing(acc, tmp_path / "runs")
    first = acc.prepare(torch.nn.Linear(2, 2))
    with Checkpointing(acc, tmp_path / "runs") as ckpt:
        second = acc.prepare(torch.nn.Linear(3, 3))  # prepared later
        ckpt.save().wait()
        saved = ckpt.manager.load(0)
    assert set(saved) >= {"model", "model_1"}
    assert torch.equal(torch.from_numpy(saved["model_1"]["weight"]), second.weight.detach())
    assert torch.equal(torch.from_numpy(saved["model"]["weight"]), first.weight.detach())


def test_a_resumable_loader_given_to_prepare_keeps_its_sampler(tmp_path: Path) -> None:
    """A ResumableLoader (torch.md's loader) given to prepare(): accelerate rebuilds a plain
    DataLoader around its sampler; the integration resumes it with that sampler's seed."""
    from pitstop.adapters.torch import ResumableLoader

    def prepared():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True)
        data = torch.utils.data.TensorDataset(torch.arange(24.0).view(24, 1))
        model, dl = acc.prepare(torch.nn.Linear(1, 1),
                                ResumableLoader(data, batch_size=4, shuffle=True, seed=7))
        return acc, dl

    acc, dl = prepared()
    Checkpointing(acc, tmp_path / "reference").close()
    whole = torch.cat([x for (x,) in dl])
    assert not torch.equal(whole, torch.arange(24.0).view(24, 1))  # shuffled, seed 7
    acc, dl = prepared()
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        got = [x for _, (x,) in zip(range(2), dl, strict=False)]
        ckpt.save().wait()
    acc, dl = prepared()
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        ckpt.restore()
        got += [x for (x,) in dl]
    assert torch.equal(torch.cat(got), whole)


def test_pitstops_triggers_and_accelerates_save_state_side_by_side(tmp_path: Path,
                                                                   caplog) -> None:
    """nonfinite_guard skips a step whose loss is NaN; an accelerator.save_state() into the
    same {project_dir}/checkpoints does not block the resume from pitstop's checkpoints."""
    objs = make(tmp_path / "p")
    with Checkpointing(objs[0], save_every_steps=1, nonfinite_guard=True) as ckpt:
        ckpt.step(metrics={"loss": float("nan")})
        ckpt.step(metrics={"loss": 1.0})
        ckpt.wait()
        assert ckpt.manager.all_steps() == [2]
    objs[0].save_state()  # accelerate's own, beside pitstop's step_2
    fresh = make(tmp_path / "p")
    with Checkpointing(fresh[0]) as ckpt:
        assert ckpt.restore() == 2
    assert "also holds accelerator.save_state folders (checkpoint_0)" in caplog.text


def test_another_sampler_under_a_stateful_loader_resumes_exactly(tmp_path: Path) -> None:
    """A WeightedRandomSampler under DataLoaderConfiguration(use_stateful_dataloader=True):
    the loader inside the shard is replaced (ResumableLoader.from_loader keeps the sampler),
    and the resumed epoch goes on with the uninterrupted one's batches."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from accelerate import DataLoaderConfiguration

    def weighted():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True))
        data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=torch.Generator()
                                                          .manual_seed(0)))
        sampler = torch.utils.data.WeightedRandomSampler([1.0] * 24, 24)
        model, dl = acc.prepare(torch.nn.Linear(4, 1), torch.utils.data.DataLoader(
            data, batch_size=4, sampler=sampler))
        return acc, dl

    acc, dl = weighted()
    with Checkpointing(acc, tmp_path / "whole"):
        whole = [x for (x,) in dl]
    acc, dl = weighted()
    got = []
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        for i, (x,) in enumerate(dl):
            got.append(x)
            if i == 2:
                ckpt.save().wait()
                break
    acc, dl = weighted()
    with Checkpointing(acc, tmp_path / "run") as ckpt:
        assert ckpt.restore() == 0
        got += [x for (x,) in dl]
    assert len(whole) == 6 and all(torch.equal(a, b) for a, b in zip(whole, got, strict=True))


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(_Boom.target),))


def test_import_runs_no_code_from_the_folder(tmp_path: Path) -> None:
    """A random_states_0.pkl that would run code when unpickled is refused, unrun."""
    objs = make(tmp_path / "acc")
    objs[0].save_state()
    folder = tmp_path / "acc" / "checkpoints" / "checkpoint_0"
    _Boom.target = str(tmp_path / "ran")
    torch.save({"step": 0, "random_state": _Boom()}, folder / "random_states_0.pkl")
    with pytest.raises(pitstop.CorruptCheckpointError, match="weights_only"):
        import_accelerate_checkpoint(folder, tmp_path / "runs", step=0)
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("step_*"))


def test_accelerates_resume_recipe_kept_in_the_loop_does_not_skip_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A loop migrated from accelerate that keeps its resume recipe
    (``accelerator.skip_first_batches(dl, resume_step)`` after the restore) trains on the
    rest of the uninterrupted epoch, not on the tail of accelerate's own permutation (an
    untracked loader whose batches differ: before the fix, samples seen twice or never)."""
    objs = make()
    ckpt = Checkpointing(objs[0], tmp_path / "runs")
    whole = [x for x, _ in objs[3]]  # epoch 0 of this loader, uninterrupted
    ckpt.close()
    objs = make()
    with Checkpointing(objs[0], tmp_path / "runs") as ckpt:
        for i, _ in enumerate(objs[3]):
            if i == 2:
                break
        ckpt.save().wait()  # three batches handed out
    acc, *_ = fresh = make()
    with Checkpointing(acc, tmp_path / "runs") as again:
        again.restore()
        with caplog.at_level("WARNING", logger="pitstop"):
            rest = [x for x, _ in acc.skip_first_batches(fresh[3], 3)]
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(whole[3:], rest,
                                                                     strict=True))
    assert "already starts at the next batch" in caplog.text


def test_a_save_at_an_epochs_last_step_runs_the_code_after_that_epoch_on_resume(
        tmp_path: Path) -> None:
    """Saved at an epoch's last optimizer step (inside the loop), a resume iterates that
    epoch once more, empty, so what the loop does after it (a scheduler stepped per epoch)
    runs for it as in the uninterrupted run; the weights then end bitwise equal."""

    def run(stop: int | None = None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        model, opt, dl, sched = acc.prepare(model, opt, torch.utils.data.DataLoader(
            data, batch_size=4, shuffle=True), sched)
        with Checkpointing(acc, tmp_path / "run", save_every_steps=3) as ckpt:
            ckpt.restore()
            for _epoch in range(dl.iteration, 3):  # 10 batches, 3 optimizer steps an epoch
                for x, y in dl:
                    with acc.accumulate(model):
                        acc.backward(torch.nn.functional.mse_loss(model(x), y))
                        opt.step()
                        opt.zero_grad()
                    ckpt.step()
                    if ckpt.global_step == stop and acc.sync_gradients:
                        return None  # stopped at step 4: the newest save is step 3's
                sched.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    whole = run()
    shutil.rmtree(tmp_path / "run")
    assert run(stop=4) is None
    assert torch.equal(run(), whole)
