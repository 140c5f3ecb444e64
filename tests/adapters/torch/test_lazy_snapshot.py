"""snapshot="lazy": parameters and optimizer state are copied after save() returns, on the
copy threads, and every optimizer step (and the manager's next call, and a fork) waits for
that copy. Race tests hold the copy back with the ``before_lazy_copy`` hook and wait for the
state they need (``lazy_fence``: a fence found the copy unfinished); nothing sleeps."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

import pitstop
from pitstop.core.save import lazy

torch = pytest.importorskip("torch")

WAIT = 60  # seconds: only a guard against a hang, never a speed assertion


class Gate:
    """Holds every lazy copy of ``mgr`` back until :meth:`open`; ``fenced`` is set when a
    fence finds a copy unfinished."""

    def __init__(self, mgr: pitstop.CheckpointManager) -> None:
        self.release = threading.Event()
        self.fenced = threading.Event()
        self.held = threading.Event()
        mgr.hooks["before_lazy_copy"] = self._hold
        mgr.hooks["lazy_fence"] = lambda step: self.fenced.set()

    def _hold(self, step: int) -> None:
        self.held.set()
        assert self.release.wait(WAIT), "the test never let the copy go"

    def open(self) -> None:
        self.release.set()


def make(tmp_path, **kw) -> pitstop.CheckpointManager:
    opts = dict(save_on_signals=None, memory_tier=False, snapshot="lazy")
    opts.update(kw)
    return pitstop.CheckpointManager(tmp_path / "ckpt", **opts)


def trained(bn: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 128)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(128))
    layers.append(torch.nn.Linear(128, 128))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(16, 128)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()  # gradients ready for the next step
    return model, opt, x


def values(model, opt) -> dict[str, np.ndarray]:
    out = {f"model/{k}": v.detach().clone().numpy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for name, v in s.items():
            out[f"opt/state/{i}/{name}"] = v.clone().numpy()
    return out


def assert_saved(mgr, step: int, expected: dict[str, np.ndarray]) -> None:
    got = mgr.load(step)
    for key, want in expected.items():
        node = got
        for part in key.split("/"):
            node = node[part] if part in node else node[int(part)]
        np.testing.assert_array_equal(np.asarray(node), want, err_msg=key)


def in_thread(fn) -> tuple[threading.Thread, list]:
    errors: list = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_saved_bytes_are_the_values_at_save_though_the_optimizer_steps_at_once(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    gate = Gate(mgr)
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert handle.stats.lazy_bytes > 0
    assert gate.held.wait(WAIT)
    t, errors = in_thread(opt.step)
    assert gate.fenced.wait(WAIT)  # the step waits for the copy ...
    for k, p in model.state_dict().items():  # ... and has not touched a parameter
        np.testing.assert_array_equal(p.numpy(), before[f"model/{k}"])
    gate.open()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    assert not np.array_equal(model[0].weight.detach().numpy(), before["model/0.weight"])
    stats = handle.result()
    assert stats.fence_wait_s > 0 and stats.lazy_copy_s > 0
    assert_saved(mgr, 1, before)
    mgr.close()


def test_buffers_the_next_forward_updates_are_saved_as_at_save(tmp_path):
    model, opt, x = trained(bn=True)
    mgr = make(tmp_path)
    gate = Gate(mgr)
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert gate.held.wait(WAIT)
    model(x)  # training mode: BatchNorm updates its running statistics in place
    assert not np.array_equal(model[1].running_mean.numpy(), before["model/1.running_mean"])
    gate.open()
    handle.wait()
    assert_saved(mgr, 1, before)
    mgr.close()


def test_gradscaler_step_waits_for_the_copy(tmp_path):
    model, opt, x = trained()
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    mgr = make(tmp_path)
    gate = Gate(mgr)
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt, "scaler": scaler})
    assert gate.held.wait(WAIT)
    t, errors = in_thread(lambda: scaler.step(opt))
    assert gate.fenced.wait(WAIT)
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), before["model/0.weight"])
    gate.open()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    scaler.update()
    handle.wait()
    assert_saved(mgr, 1, before)
    mgr.close()


def test_an_in_place_write_during_the_copy_fails_that_save_and_later_saves_are_eager(
        tmp_path, caplog):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    gate = Gate(mgr)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert gate.held.wait(WAIT)
    with torch.no_grad():
        model[0].weight.mul_(2)  # outside the contract: not inside optimizer.step()
    gate.open()
    with caplog.at_level(logging.WARNING, logger="pitstop"), \
            pytest.raises(pitstop.CheckpointWriteError, match=r"'model/0\.weight'.*in place"):
        handle.wait()
    assert mgr.all_steps() == []
    assert sum("eagerly" in r.getMessage() for r in caplog.records) == 1  # one message
    mgr.hooks.clear()
    h2 = mgr.save(2, {"model": model, "opt": opt})
    assert h2.stats.lazy_bytes == 0
    h2.wait()
    mgr.wait()  # the failure was reported once, by the handle
    mgr.close()


def test_an_in_place_write_after_the_copy_but_before_the_step_fails_that_save(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    commit = threading.Event()
    mgr.hooks["before_commit"] = lambda step: commit.wait(WAIT)
    handle = mgr.save(1, {"model": model, "opt": opt})
    copies = lazy.pending()
    assert copies
    for copy in copies:
        assert copy.done.wait(WAIT)
    opt.state[model[1].weight]["exp_avg"].add_(1)  # no optimizer step: no fence
    commit.set()
    with pytest.raises(pitstop.CheckpointWriteError, match=r"exp_avg.*in place"):
        handle.wait()
    mgr.close()


def test_a_failure_of_the_lazy_copy_is_reported_once_and_frees_the_buffer(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)

    def boom(step):
        raise RuntimeError("copy thread trouble")

    mgr.hooks["before_lazy_copy"] = boom
    mgr.save(1, {"model": model, "opt": opt})
    opt.step()  # the fence does not raise: the failure is the manager's to report
    with pytest.raises(pitstop.CheckpointWriteError, match="copy thread trouble"):
        mgr.wait()
    mgr.wait()  # once
    del mgr.hooks["before_lazy_copy"]
    before = values(model, opt)
    mgr.save(2, {"model": model, "opt": opt}).wait()  # the staging buffer is free again
    assert_saved(mgr, 2, before)
    assert mgr.all_steps() == [2]
    mgr.close()


def test_close_right_after_a_lazy_save_waits_for_the_copy(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    gate = Gate(mgr)
    before = values(model, opt)
    mgr.save(1, {"model": model, "opt": opt})
    t, errors = in_thread(mgr.close)
    assert gate.fenced.wait(WAIT)
    assert t.is_alive()
    gate.open()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    reader = pitstop.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert_saved(reader, 1, before)


def test_restore_right_after_a_lazy_save_waits_for_the_copy(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    state = {"model": model, "opt": opt}
    mgr.save(1, state).wait()
    v1 = values(model, opt)
    opt.step()
    v2 = values(model, opt)
    gate = Gate(mgr)
    handle = mgr.save(2, state)
    assert gate.held.wait(WAIT)
    t, errors = in_thread(lambda: mgr.restore(state, step=1))
    assert gate.fenced.wait(WAIT)
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), v2["model/0.weight"])
    gate.open()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    handle.wait()
    assert_saved(mgr, 2, v2)  # the restore wrote only after the copy read
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), v1["model/0.weight"])
    mgr.close()


def test_fork_right_after_a_lazy_save_waits_for_the_copy_and_the_child_does_not_hang(
        tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path)
    gate = Gate(mgr)
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert gate.held.wait(WAIT)

    def let_go():  # the fork's fence finds the copy held back: let it go
        if gate.fenced.wait(WAIT):
            gate.open()

    t = threading.Thread(target=let_go, daemon=True)
    t.start()
    copies = lazy.pending()
    assert copies and not any(c.done.is_set() for c in copies)
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's left to wait for
        os._exit(0 if not lazy.pending() else 3)
    assert all(c.done.is_set() for c in copies)  # the fork waited for the copy
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    t.join(WAIT)
    handle.wait()
    assert_saved(mgr, 1, before)
    mgr.close()


def test_the_default_is_eager(tmp_path):
    model, opt, _x = trained()
    mgr = pitstop.CheckpointManager(tmp_path / "ckpt", save_on_signals=None, memory_tier=False)
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert handle.stats.lazy_bytes == 0 and not lazy.pending()
    with torch.no_grad():
        model[0].weight.mul_(2)  # right after save(): the snapshot is already taken
    handle.wait()
    assert_saved(mgr, 1, before)
    mgr.close()


def test_numpy_state_is_copied_eagerly_under_lazy(tmp_path):
    mgr = make(tmp_path)
    w = np.arange(100_000, dtype=np.float32)
    handle = mgr.save(1, {"w": w, "buf": torch.arange(10_000.0)})
    assert handle.stats.lazy_bytes == 0
    w += 1
    handle.wait()
    np.testing.assert_array_equal(mgr.load(1)["w"], np.arange(100_000, dtype=np.float32))
    mgr.close()


def test_a_synchronous_manager_copies_eagerly_and_bad_modes_are_refused(tmp_path):
    model, opt, _x = trained()
    mgr = make(tmp_path, async_save=False)
    assert mgr.save(1, {"model": model, "opt": opt}).stats.lazy_bytes == 0
    mgr.close()
    with pytest.raises(pitstop.InvalidArgumentError, match="snapshot must be"):
        make(tmp_path, snapshot="deferred")


def test_a_fence_that_cannot_be_installed_steps_aside_with_one_warning(tmp_path, monkeypatch,
                                                                       caplog):
    from pitstop.adapters.torch import _leaf

    def no_hook() -> None:
        raise AttributeError("this torch has no register_optimizer_step_pre_hook")

    monkeypatch.setattr(_leaf.TensorLeaf, "lazy_guard", staticmethod(no_hook))
    model, opt, _x = trained()
    mgr = make(tmp_path)
    before = values(model, opt)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        h1 = mgr.save(1, {"model": model, "opt": opt})
        opt.step()
        h2 = mgr.save(2, {"model": model, "opt": opt})
    assert h1.stats.lazy_bytes == 0 and h2.stats.lazy_bytes == 0 and not lazy.pending()
    h2.wait()
    assert_saved(mgr, 1, before)
    assert sum("steps aside" in r.getMessage() for r in caplog.records) == 1
    mgr.close()


def test_the_memory_tier_describes_a_lazy_snapshot_only_once_it_is_copied(tmp_path):
    model, opt, _x = trained()
    (tmp_path / "shm").mkdir()
    mgr = make(tmp_path, memory_tier=str(tmp_path / "shm"))
    tier = mgr._engine.tier
    gate = Gate(mgr)
    written = threading.Event()
    proceed = threading.Event()
    mgr.hooks["before_write"] = lambda step: (written.set(), proceed.wait(WAIT))
    before = values(model, opt)
    handle = mgr.save(1, {"model": model, "opt": opt})
    assert gate.held.wait(WAIT)
    assert 1 not in {int(meta["step"]) for meta, _p in tier.candidates()}
    gate.open()
    assert written.wait(WAIT)  # copied, hashed, sealed; not yet written
    assert 1 in {int(meta["step"]) for meta, _p in tier.candidates()}
    proceed.set()
    handle.wait()
    assert_saved(mgr, 1, before)
    mgr.close()


def test_a_parameter_by_itself_is_copied_lazily_a_plain_tensor_eagerly(tmp_path):
    mgr = make(tmp_path)
    p = torch.nn.Parameter(torch.randn(64, 64))  # 16 KiB: the smallest copied lazily
    t = torch.randn(64, 64)
    handle = mgr.save(1, {"p": p, "t": t})
    assert handle.stats.lazy_bytes == p.numel() * 4
    handle.wait()
    mgr.close()


def test_lazy_saves_on_two_ranks(tmp_path):
    from pathlib import Path

    from dist_helpers import run_world
    from dist_worker import dec

    d = tmp_path / "ck"
    got = run_world("world_lazy", 2, tmp_path, {"dir": str(d)},
                    worker=Path(__file__).with_name("dist_save_worker.py"), timeout=90)
    for r in got:
        assert r["lazy_bytes"] > 0
        assert r["second"]["type"] == "CheckpointWriteError", r["second"]
        assert r["steps"] == [1]
    assert "'model/weight' was written in place" in got[1]["second"]["message"]
    with pitstop.CheckpointManager(d, read_only=True) as reader:
        saved = reader.load(1)["model"]["weight"]
    np.testing.assert_array_equal(saved, dec(got[0]["before"]).numpy())


def test_a_save_failed_by_a_write_before_the_step_never_comes_back_from_the_memory_tier(
        tmp_path):
    """The failure says the saved bytes might mix old and new values: that snapshot must
    not be recovered from shared memory after a crash either (it was described and sealed
    there once its copy ended, before the write was seen)."""
    model, opt, _x = trained()
    (tmp_path / "shm").mkdir()
    mgr = make(tmp_path, memory_tier=str(tmp_path / "shm"))
    tier = mgr._engine.tier
    commit = threading.Event()
    mgr.hooks["before_commit"] = lambda step: commit.wait(WAIT)
    handle = mgr.save(1, {"model": model, "opt": opt})
    for copy in lazy.pending():
        assert copy.done.wait(WAIT)
    with torch.no_grad():
        model[0].weight.mul_(2)  # outside the contract, seen only before the commit
    commit.set()
    with pytest.raises(pitstop.CheckpointWriteError, match=r"'model/0\.weight'.*in place"):
        handle.wait()
    assert 1 not in {int(meta["step"]) for meta, _p in tier.candidates()}
    mgr.close()
