"""Migration helpers: torch.save / DCP -> pitstop, pitstop -> torch.save / safetensors."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import pitstop  # noqa: E402
from pitstop.adapters.torch.convert import (  # noqa: E402
    export_safetensors,
    export_torch_save,
    import_dcp,
    import_torch_save,
)
from pitstop.core.tree import decode_value  # noqa: E402


# ----------------------------------------------------------------------------- helpers
def _bytes_of_tensor(t: Any) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _bytes_of_array(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """``got`` (numpy or torch tree) equals ``want`` (torch or numpy tree) bit for bit."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        t, a = (want, got) if isinstance(want, torch.Tensor) else (got, want)
        if isinstance(a, torch.Tensor):
            assert a.dtype == t.dtype, path
            assert tuple(a.shape) == tuple(t.shape), path
            assert _bytes_of_tensor(a) == _bytes_of_tensor(t), path
            return
        assert isinstance(a, np.ndarray), (path, type(a))
        assert str(a.dtype) == str(t.dtype).removeprefix("torch."), (path, a.dtype, t.dtype)
        assert tuple(a.shape) == tuple(t.shape), path
        assert _bytes_of_array(a) == _bytes_of_tensor(t), path
        return
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, path
        assert got.shape == want.shape and _bytes_of_array(got) == _bytes_of_array(want), path
        return
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), path
        assert list(got.keys()) == list(want.keys()), (path, list(got), list(want))
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}/{i}")
        return
    assert type(got) is type(want) and got == want, (path, got, want)


def _training_state() -> dict[str, Any]:
    """A small model + AdamW after one step + epoch, and odd dtypes/layouts next to them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    wide = torch.randn(3, 4)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "extra": {
            "bf16": torch.randn(2, 3).to(torch.bfloat16),
            "fp8": torch.randn(4).to(torch.float8_e4m3fn),
            "column": wide[:, 1],               # a non-contiguous view into a larger storage
            "transposed": wide.t(),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(7, dtype=torch.int64),
        },
        "config": {"name": "run-1", "betas": (0.9, 0.99), "milestones": [10, 20], "note": None},
    }


def _load(directory: Any, step: int | None = None) -> Any:
    with pitstop.CheckpointManager(directory, save_on_signals=None, memory_tier=False) as mgr:
        assert step is None or step in mgr.all_steps()
        return mgr.load(step)


# ----------------------------------------------------------------------------- imports
def test_import_torch_save_is_bit_exact(tmp_path):
    state = _training_state()
    torch.save(state, tmp_path / "ckpt.pt")

    assert import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 100,
                             metrics={"loss": 0.5}) == 100

    with pitstop.CheckpointManager(tmp_path / "run") as mgr:  # the plain user path
        assert mgr.all_steps() == [100]
        loaded = mgr.load()
        assert mgr.metadata(100).metrics == {"loss": 0.5}
    assert_same(loaded, state)
    assert list(loaded["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert loaded["extra"]["bf16"].dtype == ml_dtypes.bfloat16

    # one entry of the file, and a second import never overwrites a committed step
    import_torch_save(tmp_path / "ckpt.pt", tmp_path / "model_only", 0, key="model")
    assert_same(_load(tmp_path / "model_only"), state["model"])
    with pytest.raises(pitstop.StepExistsError):
        import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 100)


def _dcp_save(state: Any, where: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        dcp.save(state, checkpoint_id=where)
    assert not torch.distributed.is_initialized()


def test_import_dcp_is_bit_exact(tmp_path):
    state = _training_state()
    state["by_id"] = {5: torch.arange(3)}
    _dcp_save(state, tmp_path / "dcp")

    assert import_dcp(tmp_path / "dcp", tmp_path / "run", 7) == 7

    loaded = _load(tmp_path / "run", 7)
    # DCP stores dict keys as strings; only an optimizer's state ids are turned back to ints
    assert list(loaded["optimizer"]["state"]) == [0, 1, 2, 3]
    assert list(loaded["by_id"]) == ["5"]
    assert_same(loaded, dict(state, by_id={"5": state["by_id"][5]}))


def _model_and_optimizer() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: Any, opt: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("source", ["torch_save", "dcp"])
def test_imported_checkpoint_resumes_training_exactly(tmp_path, source):
    model, opt = _model_and_optimizer()
    _train(model, opt, 2, seed=1)
    old = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}
    if source == "torch_save":
        torch.save(old, tmp_path / "ckpt.pt")
        import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 2)
    else:
        _dcp_save(old, tmp_path / "dcp")
        import_dcp(tmp_path / "dcp", tmp_path / "run", 2)
    _train(model, opt, 2, seed=2)  # the run that was never interrupted

    model2, opt2 = _model_and_optimizer()  # a fresh process: empty optimizer state
    state = {"model": model2, "optimizer": opt2, "epoch": 0}
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None,
                                   memory_tier=False) as mgr:
        assert mgr.restore(state) == 2
    assert state["epoch"] == 3
    _train(model2, opt2, 2, seed=2)
    assert_same(model2.state_dict(), model.state_dict())
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


class NotAWeight:  # module level, so torch.save can pickle it
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize("bad, key, words", [
    ({"dtype": torch.float32}, "meta/dtype", "torch.dtype"),
    ({"seen": {1, 2}}, "meta/seen", "sets"),
    ({"sparse": torch.eye(2).to_sparse()}, "meta/sparse", "sparse"),
])
def test_import_refuses_what_it_cannot_convert_naming_the_key(tmp_path, bad, key, words):
    torch.save({"model": {"w": torch.ones(2)}, "meta": bad}, tmp_path / "bad.pt")
    with pytest.raises(pitstop.UnsupportedStateError) as e:
        import_torch_save(tmp_path / "bad.pt", tmp_path / "run", 1)
    assert repr(key) in str(e.value) and words in str(e.value)
    assert not (tmp_path / "run").exists() or not _steps(tmp_path / "run")


def test_import_refuses_arbitrary_objects_without_running_them(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "obj": NotAWeight()}, tmp_path / "obj.pt")
    with pytest.raises(pitstop.UnsupportedStateError, match="weights_only"):
        import_torch_save(tmp_path / "obj.pt", tmp_path / "run", 1)


def _steps(directory: Any) -> list[int]:
    with pitstop.CheckpointManager(directory, read_only=True) as mgr:
        return mgr.all_steps()


# ----------------------------------------------------------------------------- exports
def _numpy_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "model": {"0.weight": rng.standard_normal((3, 4), dtype=np.float32),
                  "0.bias": rng.standard_normal(3, dtype=np.float32)},
        "optimizer": {"state": {0: {"step": np.array(2.0, np.float32),
                                    "exp_avg": rng.standard_normal((3, 4)).astype(np.float16)}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]},
        "extra": {"bf16": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
                  "fp8": rng.standard_normal(4).astype(ml_dtypes.float8_e5m2),
                  "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
                  "mask": np.array([True, False])},
        "epoch": 4,
        "name": "run-1",
    }


def _save_numpy(directory: Any, step: int, state: Any) -> None:
    with pitstop.CheckpointManager(directory, save_on_signals=None, memory_tier=False) as mgr:
        mgr.save(step, state).wait()


def test_export_torch_save_loads_with_weights_only(tmp_path):
    state = _numpy_state()
    _save_numpy(tmp_path / "run", 5, state)
    _save_numpy(tmp_path / "run", 9, {"other": np.zeros(1)})

    assert export_torch_save(tmp_path / "run", tmp_path / "out.pt", step=5) == 5
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(state, out)
    assert out["extra"]["bf16"].dtype == torch.bfloat16
    assert out["extra"]["fp8"].dtype == torch.float8_e5m2

    # the newest step by default; key= gives a state dict a model loads directly
    assert export_torch_save(tmp_path / "run", tmp_path / "newest.pt") == 9
    assert list(torch.load(tmp_path / "newest.pt", weights_only=True)) == ["other"]
    export_torch_save(tmp_path / "run", tmp_path / "model.pt", step=5, key="model")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert_same(state["model"]["0.weight"], model[0].weight)


def test_export_safetensors_names_arrays_by_key_path_and_keeps_values(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = _numpy_state()
    _save_numpy(tmp_path / "run", 5, state)

    assert export_safetensors(tmp_path / "run", tmp_path / "out.safetensors") == 5
    tensors = load_file(tmp_path / "out.safetensors")
    assert sorted(tensors) == sorted([
        "model/0.weight", "model/0.bias", "optimizer/state/0/step", "optimizer/state/0/exp_avg",
        "extra/bf16", "extra/fp8", "extra/ids", "extra/mask"])
    assert_same(state["model"]["0.weight"], tensors["model/0.weight"])
    assert_same(state["optimizer"]["state"][0]["exp_avg"], tensors["optimizer/state/0/exp_avg"])
    for k in ("bf16", "fp8", "ids", "mask"):
        assert_same(state["extra"][k], tensors[f"extra/{k}"])

    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    doc = json.loads(meta["pitstop"])
    assert doc["step"] == 5 and doc["format_version"] == 1
    values = {k: decode_value(v) for k, v in doc["values"].items()}
    assert values == {"optimizer/param_groups": state["optimizer"]["param_groups"],
                      "epoch": 4, "name": "run-1"}
    assert values["optimizer/param_groups"][0]["betas"] == (0.9, 0.999)  # tuples survive

    export_safetensors(tmp_path / "run", tmp_path / "model.safetensors", key="model")
    assert sorted(load_file(tmp_path / "model.safetensors")) == ["0.bias", "0.weight"]


def test_exports_refuse_dtypes_the_target_cannot_hold(tmp_path):
    pytest.importorskip("safetensors")
    _save_numpy(tmp_path / "run", 1, {"ok": np.ones(2, np.float32),
                                      "waves": np.ones(2, np.complex128)})
    _save_numpy(tmp_path / "run", 2, {"labels": np.array(["a", "bc"])})
    with pytest.raises(pitstop.UnsupportedStateError, match="'waves'.*complex128"):
        export_safetensors(tmp_path / "run", tmp_path / "a.safetensors", step=1)
    with pytest.raises(pitstop.UnsupportedStateError, match="'labels'"):
        export_torch_save(tmp_path / "run", tmp_path / "b.pt", step=2)
    assert not (tmp_path / "a.safetensors").exists() and not (tmp_path / "b.pt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary files left behind


# ----------------------------------------------------------------------------- wrapped models
@pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")
@pytest.mark.parametrize("wrap", ["DataParallel", "compile", "compile(DataParallel)"])
def test_import_gives_wrapped_models_the_keys_a_live_save_would(tmp_path, wrap):
    """A file saved from a DDP/DataParallel or torch.compile'd model has ``module.`` /
    ``_orig_mod.`` keys; a live save drops them, and so does the import: the checkpoint
    restores into a plain and into a compiled model."""
    model, opt = _model_and_optimizer()
    _train(model, opt, 1, seed=1)
    wrapped = {"DataParallel": lambda m: torch.nn.DataParallel(m),
               "compile": torch.compile,
               "compile(DataParallel)": lambda m: torch.compile(torch.nn.DataParallel(m))}[wrap]
    sd = wrapped(model).state_dict()
    assert all(k.startswith(("module.", "_orig_mod.")) for k in sd)
    torch.save({"model": sd, "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 1)

    from pitstop.adapters.torch import unwrap_module

    for target in (_model_and_optimizer()[0], torch.compile(_model_and_optimizer()[0])):
        for p in target.parameters():
            p.data.zero_()
        opt2 = torch.optim.AdamW(target.parameters(), lr=1e-2)
        with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None,
                                       memory_tier=False) as mgr:
            assert mgr.restore({"model": target, "optimizer": opt2}) == 1  # strict
        assert_same(unwrap_module(target).state_dict(), model.state_dict())
        assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


def test_module_keys_are_cleaned_only_in_module_state_dicts(tmp_path):
    state = {"model": {"module.w": torch.ones(2), "module.b": torch.zeros(1)},
             "config": {"module.name": "kept"},           # values, not a module state dict
             "mixed": {"module.w": torch.ones(1), "w": torch.ones(1)}}  # not all prefixed
    torch.save(state, tmp_path / "ckpt.pt")
    import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 0)
    loaded = _load(tmp_path / "run")
    assert list(loaded["model"]) == ["w", "b"]
    assert loaded["config"] == {"module.name": "kept"}
    assert list(loaded["mixed"]) == ["module.w", "w"]


def test_export_safetensors_names_are_the_models_own(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"enc/dec": torch.nn.Linear(2, 2), "a~b": torch.nn.Linear(2, 1)})
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None,
                                   memory_tier=False) as mgr:
        mgr.save(1, {"model": model}).wait()
    export_safetensors(tmp_path / "run", tmp_path / "m.safetensors", key="model")
    tensors = load_file(tmp_path / "m.safetensors")
    assert sorted(tensors) == sorted(model.state_dict())  # 'enc/dec.weight', 'a~b.bias', ...
    other = torch.nn.ModuleDict({"enc/dec": torch.nn.Linear(2, 2), "a~b": torch.nn.Linear(2, 1)})
    other.load_state_dict(tensors)  # strict: every name matches
    assert_same(other.state_dict(), model.state_dict())
    export_safetensors(tmp_path / "run", tmp_path / "all.safetensors")
    assert "model/enc/dec.weight" in load_file(tmp_path / "all.safetensors")


@pytest.mark.parametrize("export", ["torch_save", "safetensors"])
def test_export_of_a_missing_key_names_the_available_ones(tmp_path, export):
    pytest.importorskip("safetensors")
    _save_numpy(tmp_path / "run", 5, _numpy_state())
    fn = export_torch_save if export == "torch_save" else export_safetensors
    with pytest.raises(pitstop.CheckpointError, match=r"'modle'.*'epoch', 'extra', 'model'"):
        fn(tmp_path / "run", tmp_path / "out", key="modle")
    with pytest.raises(pitstop.CheckpointError, match=r"'model/nope'.*'0\.bias', '0\.weight'"):
        fn(tmp_path / "run", tmp_path / "out", key="model/nope")
    assert not (tmp_path / "out").exists()


def test_import_of_a_missing_key_names_the_available_ones(tmp_path):
    torch.save({"model": {"w": torch.ones(1)}, "epoch": 1}, tmp_path / "ckpt.pt")
    with pytest.raises(pitstop.CheckpointError, match=r"'state_dict'.*'epoch', 'model'"):
        import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 0, key="state_dict")


def test_import_into_an_existing_step_says_so_and_nothing_else(tmp_path, caplog):
    torch.save({"w": torch.ones(2)}, tmp_path / "ckpt.pt")
    import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 3)
    caplog.clear()
    with caplog.at_level("DEBUG", logger="pitstop"):
        with pytest.raises(pitstop.StepExistsError, match="step 3.*another step") as e:
            import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 3)
        with pytest.raises(pitstop.StepExistsError):
            import_dcp(tmp_path / "no-dcp-needed", tmp_path / "run", 3)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "during training" not in text, text
    assert "run" in str(e.value)


def test_import_refusal_reads_without_terminal_colour_codes(tmp_path):
    torch.save({"obj": NotAWeight()}, tmp_path / "obj.pt")
    with pytest.raises(pitstop.UnsupportedStateError) as e:
        import_torch_save(tmp_path / "obj.pt", tmp_path / "run", 1)
    msg = str(e.value)
    assert "\x1b" not in msg and "NotAWeight" in msg, msg


def test_import_of_a_file_torch_cannot_read_is_a_checkpoint_error(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(pitstop.CheckpointError, match="junk.pt"):
        import_torch_save(tmp_path / "junk.pt", tmp_path / "run", 1)
    with pytest.raises(pitstop.CheckpointNotFoundError, match="missing.pt"):
        import_torch_save(tmp_path / "missing.pt", tmp_path / "run", 1)


def test_export_to_a_folder_that_does_not_exist_is_a_checkpoint_error(tmp_path):
    _save_numpy(tmp_path / "run", 1, {"w": np.ones(2, np.float32)})
    with pytest.raises(pitstop.CheckpointWriteError, match="no-such-dir"):
        export_torch_save(tmp_path / "run", tmp_path / "no-such-dir" / "out.pt")


# ----------------------------------------------------------------------------- DCP's losses
def _multisteplr_run() -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1)


def _lrs(model: Any, opt: Any, sched: Any, n: int = 6) -> list[float]:
    out = []
    for _ in range(n):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_import_dcp_gives_multisteplr_its_int_milestones(tmp_path):
    """DCP stores {3: 1, 6: 1} as {"3": 1, "6": 1}: a MultiStepLR loaded with those never
    decays again. The import gives the ints back, and the resumed schedule is the original."""
    model, opt, sched = _multisteplr_run()
    _lrs(model, opt, sched, 2)
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
               "scheduler": sched.state_dict()}, tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", tmp_path / "run", 2)
    assert _load(tmp_path / "run")["scheduler"]["milestones"] == {3: 1, 6: 1}
    want = _lrs(model, opt, sched)

    model2, opt2, sched2 = _multisteplr_run()
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None,
                                   memory_tier=False) as mgr:
        mgr.restore({"model": model2, "optimizer": opt2, "scheduler": sched2})
    assert sched2.milestones == sched.milestones and list(sched2.milestones) == [3, 6]
    assert _lrs(model2, opt2, sched2) == want


@pytest.mark.parametrize("make", ["sgd_stepped", "adam_not_stepped"])
def test_import_dcp_of_an_optimizer_without_state_restores_into_the_same(tmp_path, make):
    """DCP does not store an empty dict: the ``state`` of an SGD without momentum, or of any
    optimizer before its first step, is gone from the directory; the import puts it back."""
    def build():
        model, _ = _model_and_optimizer()
        if make == "sgd_stepped":
            return model, torch.optim.SGD(model.parameters(), lr=0.1)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = build()
    if make == "sgd_stepped":
        _train(model, opt, 1, seed=1)
    assert opt.state_dict()["state"] == {}
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", tmp_path / "run", 1)
    assert _load(tmp_path / "run")["optimizer"]["state"] == {}

    model2, opt2 = build()
    opt2.param_groups[0]["lr"] = 5.0
    with pitstop.CheckpointManager(tmp_path / "run", save_on_signals=None,
                                   memory_tier=False) as mgr:
        assert mgr.restore({"model": model2, "optimizer": opt2}) == 1  # strict
    assert opt2.param_groups[0]["lr"] == 0.1
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    assert_same(model2.state_dict(), model.state_dict())


# ----------------------------------------------------------------------------- module. prefix
class Wrapper(torch.nn.Module):
    """A plain model whose only child is really named ``module`` (EMA / adapter wrappers)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("source", ["torch_save", "dcp"])
def test_a_stripped_module_prefix_is_said_and_strip_prefixes_keeps_it(tmp_path, caplog, source):
    w = Wrapper()
    if source == "torch_save":
        torch.save({"model": w.state_dict()}, tmp_path / "w.pt")
        importer = import_torch_save
        where = tmp_path / "w.pt"
    else:
        _dcp_save({"model": w.state_dict()}, tmp_path / "dcp")
        importer, where = import_dcp, tmp_path / "dcp"
    with caplog.at_level("WARNING", logger="pitstop"):
        importer(where, tmp_path / "stripped", 1)
    (record,) = [r for r in caplog.records if "strip_prefixes" in r.getMessage()]
    text = record.getMessage()
    assert "'module.'" in text and "'model'" in text and "'module.weight' -> 'weight'" in text
    assert sorted(_load(tmp_path / "stripped")["model"]) == ["bias", "weight"]

    caplog.clear()
    with caplog.at_level("WARNING", logger="pitstop"):
        importer(where, tmp_path / "kept", 1, strip_prefixes=())
    assert not caplog.records
    target = Wrapper()
    with pitstop.CheckpointManager(tmp_path / "kept", save_on_signals=None,
                                   memory_tier=False) as mgr:
        assert mgr.restore({"model": target}) == 1  # strict: the keys as saved
    assert_same(target.state_dict(), w.state_dict())


@pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")
def test_compiled_keys_are_cleaned_without_a_warning(tmp_path, caplog):
    model, _ = _model_and_optimizer()
    torch.save({"model": torch.compile(model).state_dict()}, tmp_path / "c.pt")
    with caplog.at_level("WARNING", logger="pitstop"):
        import_torch_save(tmp_path / "c.pt", tmp_path / "run", 1)
    assert not caplog.records  # "_orig_mod." is never a real submodule's name
    assert sorted(_load(tmp_path / "run")["model"]) == sorted(model.state_dict())
