"""Modules, optimizers, schedulers, GradScaler, wrapped modules and strict semantics."""

from __future__ import annotations

import collections
import socket
import warnings

import pytest
import torch
from torch import nn
from torch_helpers import same_bits

import pitstop
from pitstop.adapters.torch import TensorLeaf, unwrap_module

# torch.compile's import of dynamo warns about torch.jit; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def train(model, opt, sched=None, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def assert_same_module(a: nn.Module, b: nn.Module) -> None:
    sa, sb = unwrap_module(a).state_dict(), unwrap_module(b).state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert same_bits(sa[k], sb[k]), k


def assert_same_optimizer(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            w = sb["state"][i][k]
            assert same_bits(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


def test_module_capture_is_by_reference_with_state_dict_keys():
    model = make_model()
    from pitstop.adapters.torch._adapter import ModuleAdapter
    tree = ModuleAdapter().capture(model)
    assert list(tree) == list(model.state_dict())
    assert all(isinstance(v, TensorLeaf) for v in tree.values())
    assert tree["0.weight"].tensor.data_ptr() == model[0].weight.data_ptr()


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.Adagrad, dict(lr=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
], ids=lambda x: getattr(x, "__name__", ""))
def test_module_and_optimizer_round_trip_into_fresh_objects(manager, opt_cls, kwargs):
    """The target optimizer has not stepped (empty state): its state is rebuilt from the
    checkpoint and ends up as tensors of the right dtype and device, bit-exact."""
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    opt.param_groups[0]["my_extra"] = 3.5  # extra hyper-parameters survive too
    train(model, opt)
    mgr = manager()
    mgr.save(3, {"model": model, "opt": opt})

    model2 = make_model(seed=9)
    opt2 = opt_cls(model2.parameters(), **{**kwargs, "lr": 123.0})
    assert mgr.restore({"model": model2, "opt": opt2}) == 3
    assert_same_module(model, model2)
    assert_same_optimizer(opt, opt2)
    assert opt2.param_groups[0]["my_extra"] == 3.5
    # training continues identically
    train(model, opt, seed=5)
    train(model2, opt2, seed=5)
    assert_same_module(model, model2)
    assert_same_optimizer(opt, opt2)


def test_optimizer_state_is_restored_in_place_when_present(manager):
    model, model2 = make_model(), make_model(1)
    opt, opt2 = torch.optim.Adam(model.parameters()), torch.optim.Adam(model2.parameters())
    train(model, opt)
    train(model2, opt2, seed=7)
    mgr = manager()
    mgr.save(1, {"opt": opt})
    live = opt2.state[model2[0].weight]["exp_avg"]
    mgr.restore({"opt": opt2})
    assert opt2.state[model2[0].weight]["exp_avg"] is live  # same tensor, new bytes
    assert_same_optimizer(opt, opt2)


def test_schedulers_and_grad_scaler(manager):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.update(new_scale=77.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
    train(model, opt, sched, steps=5)
    plateau.step(1.0)
    state = {"opt": opt, "sched": sched, "scaler": scaler, "plateau": plateau}
    mgr = manager()
    mgr.save(5, state)
    lrs = []
    for _ in range(6):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])

    model2 = make_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.SequentialLR(
        opt2, [torch.optim.lr_scheduler.LinearLR(opt2, start_factor=0.1, total_iters=3),
               torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)], milestones=[3])
    scaler2 = torch.amp.GradScaler("cpu")
    plateau2 = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2, patience=1)
    mgr.restore({"opt": opt2, "sched": sched2, "scaler": scaler2, "plateau": plateau2})
    assert scaler2.get_scale() == 77.0 and scaler2.state_dict() == scaler.state_dict()
    assert plateau2.state_dict() == plateau.state_dict()
    lrs2 = []
    for _ in range(6):
        sched2.step()
        lrs2.append(opt2.param_groups[0]["lr"])
    assert lrs2 == lrs


def test_tensor_learning_rate_and_tensor_values_in_scheduler_state(manager):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    train(model, opt, sched, steps=2)
    mgr = manager()
    mgr.save(2, {"opt": opt, "sched": sched})
    model2 = make_model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=torch.tensor(0.01))
    sched2 = torch.optim.lr_scheduler.ExponentialLR(opt2, gamma=0.5)
    mgr.restore({"opt": opt2, "sched": sched2})
    assert torch.equal(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])
    assert sched2.last_epoch == 2


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.note = {"calls": 0}

    def get_extra_state(self):
        return dict(self.note)

    def set_extra_state(self, state):
        self.note = dict(state)


def test_module_extra_state(manager):
    m = WithExtra()
    m.note["calls"] = 41
    mgr = manager()
    mgr.save(1, {"m": m})
    m2 = WithExtra()
    mgr.restore({"m": m2})
    assert m2.note == {"calls": 41}
    assert torch.equal(m2.lin.weight, m.lin.weight)


def test_strict_reports_unwrapped_key_names(manager):
    model = make_model()
    mgr = manager()
    mgr.save(1, {"model": model})
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3),
                          nn.Linear(3, 3))
    with pytest.raises(pitstop.IncompatibleTargetError) as e:
        mgr.restore({"model": torch.compile(other)})
    msg = str(e.value)
    assert "model/3.weight" in msg and "model/4.weight" in msg and "_orig_mod" not in msg
    r = mgr.restore({"model": other}, strict=False)
    assert sorted(r.missing_keys) == ["model/4.bias", "model/4.weight"]
    assert sorted(r.mismatched_keys) == ["model/3.bias", "model/3.weight"]
    assert r.unexpected_keys == []
    assert torch.equal(other[0].weight, model[0].weight)  # what matched was loaded
    r = mgr.restore({"model": nn.Sequential(nn.Linear(4, 8))}, strict=False)
    assert "model/1.running_mean" in r.unexpected_keys


def test_compiled_module_keys_are_the_plain_modules(manager):
    model = make_model()
    compiled = torch.compile(model)
    mgr = manager()
    mgr.save(1, {"model": compiled})
    keys = set(mgr.metadata(1).arrays)
    assert keys == {f"model/{k}" for k in model.state_dict()}
    plain = make_model(seed=3)
    mgr.restore({"model": plain})  # a compiled run resumes uncompiled, and back
    assert_same_module(model, plain)
    again = torch.compile(make_model(seed=4))
    mgr.restore({"model": again})
    assert_same_module(model, again)


@pytest.fixture
def gloo_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_wrapped_module(manager, gloo_group):
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    train(ddp, opt)
    mgr = manager()
    mgr.save(3, {"model": ddp, "opt": opt})
    assert {k for k in mgr.metadata(3).arrays if k.startswith("model/")} == {
        f"model/{k}" for k in model.state_dict()}
    plain = make_model(seed=2)
    opt2 = torch.optim.AdamW(plain.parameters(), lr=0.01)
    mgr.restore({"model": plain, "opt": opt2})
    assert_same_module(model, plain)
    assert_same_optimizer(opt, opt2)
    ddp2 = nn.parallel.DistributedDataParallel(make_model(seed=5))
    mgr.restore({"model": ddp2}, strict=False)
    assert_same_module(model, ddp2)


def test_torch_generator_objects(manager):
    g = torch.Generator().manual_seed(123)
    torch.rand(5, generator=g)
    mgr = manager()
    mgr.save(1, {"g": g})
    expected = torch.rand(10, generator=g)
    g2 = torch.Generator().manual_seed(0)
    mgr.restore({"g": g2})
    assert torch.equal(torch.rand(10, generator=g2), expected)


def test_load_gives_numpy_and_the_checkpoint_has_no_pickle(manager, tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt)
    mgr = manager()
    mgr.save(1, {"model": model, "opt": opt, "rng": pitstop.RNG()})
    loaded = mgr.load()
    assert loaded["model"]["0.weight"].shape == (8, 4)
    assert sorted(loaded["opt"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys stay ints
    for f in (tmp_path / "ckpt").rglob("*"):
        if f.is_file():
            assert b"\x80\x04\x95" not in f.read_bytes()[:4096]  # no pickle protocol 4 header


class CopyingStateDict(nn.Module):
    """A module whose state_dict hook hands out copies (not views) of its tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self._register_state_dict_hook(
            lambda mod, sd, prefix, local: {k: v.clone() for k, v in sd.items()})


def test_state_dict_hooks_that_copy_still_restore(manager):
    m = CopyingStateDict()
    mgr = manager()
    mgr.save(1, {"m": m})
    m2 = CopyingStateDict()
    mgr.restore({"m": m2})
    assert torch.equal(m2.lin.weight, m.lin.weight) and torch.equal(m2.lin.bias, m.lin.bias)


def test_lazy_module_before_its_first_forward_says_what_to_do(manager):
    with pytest.raises(pitstop.UnsupportedStateError, match="forward pass"):
        manager().save(1, {"m": nn.LazyLinear(3)})


Best = collections.namedtuple("Best", "step loss")


class Steps(list):
    """A list subclass with an attribute."""


class Tracker:
    """A user object whose state holds typed containers, tensors inside some of them."""

    def __init__(self):
        self.seen = collections.defaultdict(list)
        self.counts = collections.Counter()
        self.order = collections.OrderedDict(a=1)
        self.best = Best(0, torch.tensor(9.0))
        self.steps = Steps()
        self.steps.unit = "it"

    def state_dict(self):
        return {"seen": self.seen, "counts": self.counts, "order": self.order,
                "best": self.best, "steps": self.steps, "w": torch.ones(2)}

    def load_state_dict(self, sd):
        self.seen, self.counts, self.order = sd["seen"], sd["counts"], sd["order"]
        self.best, self.steps = sd["best"], sd["steps"]


def test_stateful_objects_keep_their_container_types(manager):
    """Counter, defaultdict (with its factory), OrderedDict, namedtuples and list subclasses
    come back as themselves, as the object's own load_state_dict expects them."""
    t = Tracker()
    t.seen["x"].append(2)
    t.counts["y"] += 3
    t.order["b"] = 2
    t.best = Best(5, torch.tensor(0.5))
    t.steps[:] = [1, 2]
    mgr = manager()
    mgr.save(1, {"tracker": t})
    t2 = Tracker()
    mgr.restore({"tracker": t2})
    assert type(t2.seen) is collections.defaultdict and t2.seen.default_factory is list
    assert t2.seen == {"x": [2]}
    t2.seen["new"].append(1)  # the factory still works
    assert type(t2.counts) is collections.Counter and t2.counts.most_common(1) == [("y", 3)]
    assert type(t2.order) is collections.OrderedDict and list(t2.order) == ["a", "b"]
    assert type(t2.best) is Best and t2.best.step == 5 and float(t2.best.loss) == 0.5
    assert type(t2.steps) is Steps and t2.steps == [1, 2] and t2.steps.unit == "it"


def test_multisteplr_milestones_stay_a_counter(manager):
    """MultiStepLR keeps its milestones in a Counter; its closed form (``step(epoch)``) needs
    ``Counter.elements``."""
    def build():
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)

    opt, sched = build()
    for _ in range(3):
        opt.step()
        sched.step()
    mgr = manager()
    mgr.save(3, {"opt": opt, "sched": sched})
    opt2, sched2 = build()
    mgr.restore({"opt": opt2, "sched": sched2})
    assert type(sched2.milestones) is collections.Counter
    assert sched2.milestones == sched.milestones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates step(epoch)
        sched.step(5)
        sched2.step(5)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_a_stateful_object_given_a_whole_checkpoint_state_gets_its_int_keys_back():
    """Where the core hands the checkpoint's subtree whole (its layout differs from the live
    one), a dict that lost its int keys (DCP stores keys as strings) gets the live keys, and
    the containers the live types (JSON kept dicts and tuples only)."""
    from pitstop.adapters.torch._adapter import StatefulAdapter

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1)
    tree = {**sched.state_dict(), "milestones": {"3": 1, "6": 1}, "last_epoch": 2}
    StatefulAdapter().apply(sched, tree)
    assert type(sched.milestones) is collections.Counter
    assert sched.milestones == collections.Counter({3: 1, 6: 1})
    lrs = []
    for _ in range(5):
        opt.step()
        sched.step()
        lrs.append(round(opt.param_groups[0]["lr"], 6))
    assert lrs == [0.1, 0.1, 0.1, 0.01, 0.01]


def test_a_whole_checkpoint_state_gets_the_live_container_types(manager):
    from pitstop.adapters.torch._adapter import StatefulAdapter

    t = Tracker()
    t.seen["x"].append(2)
    t.counts["y"] += 3
    t.best = Best(5, torch.tensor(0.5))
    mgr = manager()
    mgr.save(1, {"tracker": t})
    whole = mgr.load()["tracker"]  # plain dicts, a plain tuple, a list, numpy arrays
    assert type(whole["counts"]) is dict and type(whole["best"]) is tuple
    t2 = Tracker()
    StatefulAdapter().apply(t2, whole)
    assert type(t2.seen) is collections.defaultdict and t2.seen.default_factory is list
    assert type(t2.counts) is collections.Counter and t2.counts == {"y": 3}
    assert type(t2.best) is Best and float(t2.best.loss) == 0.5
    assert type(t2.steps) is Steps and t2.steps.unit == "it"


def test_refusals_of_a_stream_loader_and_a_meta_tensor_give_advice_that_works(tmp_path):
    """A plain DataLoader over an IterableDataset was told "use ResumableLoader", which then
    refuses that dataset; a meta tensor was told ".dequantize(), .to_padded_tensor(0)"
    (quantized and nested fixes). Each now gets the fix that fits it, and the advised one
    (the dataset's own state_dict, in the state) really resumes."""
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __init__(self) -> None:
            self.pos = 0

        def __iter__(self):
            return iter(range(self.pos, 10))

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, sd) -> None:
            self.pos = sd["pos"]

    with pitstop.CheckpointManager(tmp_path / "run", memory_tier=False,
                                   save_on_signals=None) as mgr:
        with pytest.raises(pitstop.CheckpointError) as info:
            mgr.save(1, {"loader": DataLoader(Stream())})
        msg = str(info.value)
        assert "ResumableLoader" not in msg and "IterableDataset" in msg, msg
        assert "state_dict()" in msg and "StatefulDataLoader" in msg, msg
        with pytest.raises(pitstop.CheckpointError) as info:
            mgr.save(1, {"w": torch.empty(3, device="meta")})
        msg = str(info.value)
        assert "dequantize" not in msg and "to_padded_tensor" not in msg, msg
        assert "to_empty" in msg, msg
        stream = Stream()
        stream.pos = 4
        mgr.save(2, {"data": stream}).wait()  # the advice: the dataset's own state
        back = Stream()
        assert mgr.restore({"data": back}) == 2 and list(back) == [4, 5, 6, 7, 8, 9]
