"""Hostile files given to the torch import helpers never run code, and real DCP checkpoints
still import bit for bit through the restricted ``.metadata`` unpickler.

Each payload's ``__reduce__`` would run ``os.system("touch <marker>")``: the test first shows
the payload is live (plain ``pickle.loads`` creates the marker), then that the import refuses
it with a ``CheckpointError`` naming the file and the refused global, and that the marker is
still absent.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import pitstop  # noqa: E402
from pitstop.adapters.torch.convert import (  # noqa: E402
    DCP_METADATA_GLOBALS,
    import_dcp,
    import_torch_save,
    read_dcp_metadata,
)


class Payload:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _dcp_save(state: Any, where: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group
        dcp.save(state, checkpoint_id=where)


def _committed(directory: Path) -> list[int]:
    if not directory.exists():
        return []
    with pitstop.CheckpointManager(directory, read_only=True, save_on_signals=None) as mgr:
        return mgr.all_steps()


def _live(payload: bytes, marker: Path) -> None:
    """The payload really runs its command when plain pickle reads it (else the refusal
    below would prove nothing); the marker is removed again."""
    pickle.loads(payload)
    assert marker.exists(), "the payload did not run under plain pickle"
    marker.unlink()


def _metadata_with_payload_inside(real: bytes, marker: Path) -> bytes:
    """A real DCP Metadata with the payload hidden in its planner data (deep in the tree)."""
    md = pickle.loads(real)
    md.planner_data["w"] = Payload(marker)
    return pickle.dumps(md)


@pytest.mark.parametrize("where", ["top", "nested"])
def test_malicious_dcp_metadata_is_refused_and_never_runs(tmp_path, where):
    marker = tmp_path / "MARKER"
    _dcp_save({"w": torch.arange(4.0)}, tmp_path / "dcp")
    meta = tmp_path / "dcp" / ".metadata"
    payload = pickle.dumps(Payload(marker)) if where == "top" else \
        _metadata_with_payload_inside(meta.read_bytes(), marker)
    _live(payload, marker)
    meta.write_bytes(payload)

    with pytest.raises(pitstop.UnsupportedStateError) as e:
        import_dcp(tmp_path / "dcp", tmp_path / "run", 1)
    text = str(e.value)
    assert str(meta) in text and "system" in text and "restricted unpickler" in text, text
    assert not marker.exists()
    assert _committed(tmp_path / "run") == []


def test_malicious_torch_save_file_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"model": {"w": torch.ones(2)}, "evil": Payload(marker)}, tmp_path / "ckpt.pt")
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False)  # live under a plain load
    assert marker.exists()
    marker.unlink()

    with pytest.raises(pitstop.UnsupportedStateError) as e:
        import_torch_save(tmp_path / "ckpt.pt", tmp_path / "run", 1)
    assert str(tmp_path / "ckpt.pt") in str(e.value) and "system" in str(e.value)
    assert not marker.exists()
    assert _committed(tmp_path / "run") == []


def test_malicious_dcp_bytes_entry_is_refused_and_never_runs(tmp_path):
    """A DCP non-tensor entry is a torch.save blob DCP would read with weights_only=False."""
    marker = tmp_path / "MARKER"
    _dcp_save({"w": torch.ones(2), "evil": Payload(marker)}, tmp_path / "dcp")
    assert not marker.exists()  # saving ran nothing
    with pytest.raises(pitstop.UnsupportedStateError, match="'evil'.*weights_only"):
        import_dcp(tmp_path / "dcp", tmp_path / "run", 1)
    assert not marker.exists()
    assert _committed(tmp_path / "run") == []


@pytest.mark.parametrize("data, error", [
    (b"", pitstop.CorruptCheckpointError),
    (b"\x80\x04\x95garbage", pitstop.CorruptCheckpointError),
    (pickle.dumps({"not": "metadata"}), pitstop.UnsupportedStateError),
    (pickle.dumps(collections.Counter(a=1)), pitstop.UnsupportedStateError),
])
def test_a_metadata_file_that_is_not_dcp_metadata_is_a_clear_error(tmp_path, data, error):
    with pytest.raises(error, match="x/.metadata"):
        read_dcp_metadata(data, "x/.metadata")


def _globals_of(data: bytes) -> set[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return seen


def _states() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [3, 5])
    return {
        "plain": {"w": torch.randn(3, 4), "b": torch.randn(4)},
        "training": {"model": model.state_dict(), "optim": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": 3},
        "values": {"w": torch.ones(2), "name": "run-7", "blob": b"\x00\xffraw",
                   "mixed": [1, 2.5, None, "x"], "pair": (1, "a"), "flag": True},
        "dtypes": {"bf16": torch.randn(3).bfloat16(), "i8": torch.arange(5, dtype=torch.int8),
                   "bool": torch.tensor([True, False]),
                   "fp8": torch.randn(4).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.0),
                   "empty": torch.empty(0, 3), "f64": torch.randn(2, dtype=torch.float64),
                   "channels_last": torch.randn(1, 2, 3, 3).to(
                       memory_format=torch.channels_last)},
        "ordered": collections.OrderedDict(a=torch.ones(2), b=5),
    }


def _same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, np.ndarray), (path, type(got))
        assert tuple(got.shape) == tuple(want.shape), path
        assert str(got.dtype) == str(want.dtype).removeprefix("torch."), (path, got.dtype)
        raw = want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert np.ascontiguousarray(got).reshape(-1).view(np.uint8).tobytes() == raw, path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), path
        for k, v in want.items():
            _same(got[k] if k in got else got[str(k)], v, f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{path}/{i}")
    else:
        assert got == want and type(got) is type(want), (path, got, want)


def test_real_dcp_checkpoints_import_bit_exact_through_the_restricted_unpickler(tmp_path):
    for i, (name, state) in enumerate(_states().items()):
        src = tmp_path / f"dcp-{name}"
        _dcp_save(state, src)
        data = (src / ".metadata").read_bytes()
        # every global a real .metadata names is allowed (a dtype by its torch attribute)
        extra = {g for g in _globals_of(data) if g not in DCP_METADATA_GLOBALS
                 and not (g[0] == "torch" and isinstance(getattr(torch, g[1]), torch.dtype))}
        assert not extra, (name, extra)
        assert any(op.name == "STACK_GLOBAL" for op, _a, _p in pickletools.genops(data))

        assert import_dcp(src, tmp_path / "run", i) == i
        with pitstop.CheckpointManager(tmp_path / "run", read_only=True,
                                       save_on_signals=None) as mgr:
            got = mgr.load(i)
        if name == "training":  # DCP keeps no int keys; import_dcp gives the optimizer's back
            state["optim"] = dict(state["optim"])
        _same(got, dict(state), name)


def test_a_dcp_checkpoint_missing_its_data_is_a_checkpoint_error(tmp_path):
    """DCP wraps a reader's error in its own CheckpointException (a BaseException): the
    import says what is wrong as a CheckpointError instead."""
    _dcp_save({"w": torch.ones(2)}, tmp_path / "dcp")
    for f in (tmp_path / "dcp").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(pitstop.CorruptCheckpointError, match="dcp.*complete"):
        import_dcp(tmp_path / "dcp", tmp_path / "run", 1)
    with pytest.raises(pitstop.CheckpointNotFoundError, match="no DCP checkpoint"):
        import_dcp(tmp_path / "nothing", tmp_path / "run", 1)
