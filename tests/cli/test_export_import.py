"""`pitstop export` / `pitstop import` on real files: npz, safetensors, torch.save, DCP.

(TensorFlow: tests/adapters/tf/test_cli_convert.py; Orbax: tests/adapters/jax/test_cli_orbax.py.)"""

from __future__ import annotations

import json
import os
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest

import pitstop
from pitstop.cli import main
from pitstop.interop.detect import detect


def _state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "model": {"w": rng.standard_normal((8, 4), dtype=np.float32),
                  "b": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)},
        "opt": {"step": np.array(3, np.int64), "lr": 0.01, "betas": (0.9, 0.99)},
        "epoch": 2,
        "name/with slash": np.ones(2, np.int8),
    }


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, memory_tier=False, async_save=False,
                                   save_on_signals=None) as mgr:
        mgr.save(7, _state(), metrics={"loss": 0.5}).wait()
    return d


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("fmt,ext", [("npz", ".npz"), ("safetensors", ".safetensors"),
                                     ("torch", ".pt")])
def test_export_import_round_trip_is_identical(run_dir, tmp_path, capsys, monkeypatch, fmt,
                                               ext):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "export", run_dir, "--to", fmt)
    assert (rc, err) == (0, ""), err
    first, *notes = out.splitlines()
    assert first == f"exported 4 arrays (146 B) of step 7 of {run_dir} to run-step7{ext} ({fmt})"
    assert len(notes) == (0 if fmt == "npz" else 1), notes  # what the file does not keep
    assert detect(f"run-step7{ext}") == fmt
    rc, out, err = run(capsys, "import", f"run-step7{ext}", tmp_path / "back",
                       *(["--step", "7"] if fmt == "torch" else []))
    assert (rc, err) == (0, ""), err
    assert out == f"imported 4 arrays (146 B) from run-step7{ext} as step 7 of " \
        f"{tmp_path / 'back'}\n"
    rc, out, err = run(capsys, "diff", run_dir, tmp_path / "back")
    assert rc == 0, out + err
    # never overwritten: the file without --force, the step of DEST at all
    rc, _, err = run(capsys, "export", run_dir, "--to", fmt)
    assert rc == 2 and "already exists; pass --force" in err
    assert run(capsys, "export", run_dir, "--to", fmt, "--force")[0] == 0
    rc, _, err = run(capsys, "import", f"run-step7{ext}", tmp_path / "back", "--step", 7)
    assert rc == 2 and "already has a checkpoint of step 7" in err and err.count("\n") == 1


def test_npz_layout_reads_with_numpy_alone(run_dir, tmp_path, capsys):
    out = tmp_path / "x.npz"
    assert run(capsys, "export", run_dir / "step_0000000007", "--to", "npz", "-o", out)[0] == 0
    with np.load(out, allow_pickle=False) as z:
        assert sorted(z.files) == ["__pitstop__", "model/b", "model/w", "name~1with slash",
                                   "opt/step"]
        meta = json.loads(str(z["__pitstop__"]))
        assert meta["step"] == 7 and meta["values"] == {
            "opt/lr": 0.01, "opt/betas": {"$tuple": [0.9, 0.99]}, "epoch": 2}
        assert meta["dtypes"] == {"model/b": "bfloat16"}
        assert z["model/b"].dtype == np.uint16
        np.testing.assert_array_equal(z["model/b"].view(ml_dtypes.bfloat16),
                                      _state()["model"]["b"])
    # the tree comes back as saved: a tuple stays a tuple
    rc, _, _ = run(capsys, "import", out, tmp_path / "back")
    assert rc == 0
    with pitstop.CheckpointManager(tmp_path / "back", read_only=True) as mgr:
        assert mgr.load(7)["opt"]["betas"] == (0.9, 0.99)
    # --key: the entry's own names
    rc, _, _ = run(capsys, "export", run_dir, "--to", "npz", "--key", "model", "-o",
                   tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as z:
        assert sorted(z.files) == ["__pitstop__", "b", "w"]
    rc, _, err = run(capsys, "export", run_dir, "--to", "npz", "--key", "nope", "-o",
                     tmp_path / "n.npz")
    assert rc == 2 and "no entry 'nope'" in err and not (tmp_path / "n.npz").exists()
    # a plain np.savez file imports too: its names as key paths
    np.savez(tmp_path / "plain.npz", **{"a/b": np.arange(3), "c": np.zeros(2)})
    assert run(capsys, "import", tmp_path / "plain.npz", tmp_path / "plain")[0] == 0
    with pitstop.CheckpointManager(tmp_path / "plain", read_only=True) as mgr:
        got = mgr.load(0)
    assert got["a"]["b"].tolist() == [0, 1, 2] and got["c"].tolist() == [0, 0]


def test_torch_file_import_restores_into_a_real_model(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 4},
               tmp_path / "ckpt.pth")
    assert detect(str(tmp_path / "ckpt.pth")) == "torch"
    rc, out, err = run(capsys, "import", tmp_path / "ckpt.pth", tmp_path / "run", "--step", 4)
    assert (rc, err) == (0, "") and "as step 4 of" in out
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        state = {"model": fresh, "optimizer": fresh_opt, "epoch": 0}
        assert mgr.restore(state) == 4
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 0.01
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])


def test_dcp_directory_imports(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor([1, 2], dtype=torch.int32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    assert detect(str(tmp_path / "dcp")) == "dcp"
    rc, out, err = run(capsys, "import", tmp_path / "dcp", tmp_path / "run")
    assert (rc, err) == (0, "") and out.startswith("imported 2 arrays (32 B)")
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        got = mgr.load(0)
    assert got["w"].tolist() == state["w"].tolist() and got["n"].dtype == np.int32


def test_bad_inputs_are_one_line_exit_2(run_dir, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    cases = [
        (["export", run_dir, "--to", "xml"], "unknown format"),
        (["export", run_dir, "--to", "tf"], "cannot write native TensorFlow"),
        (["export", tmp_path / "nope", "--to", "npz"], "no such directory"),
        (["export", run_dir, "--to", "npz", "--step", 3], "no checkpoint of step 3"),
        (["import", tmp_path / "missing.pt", tmp_path / "d"], "no such file or directory"),
        (["import", text, tmp_path / "d"], "cannot tell the format of"),
        (["import", text, tmp_path / "d", "--from", "torch"], "torch.load cannot read"),
        (["import", text, tmp_path / "d", "--from", "npz"], "not an .npz file"),
        (["import", text, tmp_path / "d", "--from", "safetensors"], "not a readable"),
        (["import", text, tmp_path / "d", "--from", "xml"], "unknown format"),
        (["import", text, not_dir / "sub", "--from", "npz"], "is a file"),
        (["import", text, not_dir, "--from", "npz"], "not a directory"),
    ]
    for argv, says in cases:
        rc, out, err = run(capsys, *argv)
        assert rc == 2, (argv, out, err)
        assert err.startswith("pitstop: ") and says in err and err.count("\n") == 1, (argv, err)
        assert "Traceback" not in err
    assert not (tmp_path / "d").exists()
    # a garbled npz and safetensors: one line too
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04" + b"\0" * 40)
    (tmp_path / "bad.safetensors").write_bytes((10 ** 6).to_bytes(8, "little") + b'{"a": 1}')
    for f in ("bad.npz", "bad.safetensors"):
        rc, _, err = run(capsys, "import", tmp_path / f, tmp_path / "d", "--from",
                         f.split(".")[1])
        assert rc == 2 and err.count("\n") == 1 and f in err


def test_detect_formats(tmp_path):
    with zipfile.ZipFile(tmp_path / "w.zip", "w") as zf:
        zf.writestr("w/data.pkl", b"")
    assert detect(str(tmp_path / "w.zip")) == "torch"
    np.savez(tmp_path / "a.npz", x=np.zeros(1))
    assert detect(str(tmp_path / "a.npz")) == "npz"
    (tmp_path / "orb" / "3").mkdir(parents=True)
    (tmp_path / "orb" / "3" / "_CHECKPOINT_METADATA").write_text("{}")
    assert detect(str(tmp_path / "orb")) == "orbax"
    (tmp_path / "tf.index").write_bytes(b"")
    assert detect(str(tmp_path / "tf")) == "tf"
    os.mkdir(tmp_path / "empty")
    assert detect(str(tmp_path / "empty")) is None
