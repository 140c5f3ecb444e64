"""`pitstop diff` on real checkpoints: what differs, by how much, and the exit status."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import pitstop
from pitstop.cli import main
from pitstop.cli.diff import compare_arrays


def _state() -> dict:
    return {
        "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                  "b": np.ones(4, ml_dtypes.bfloat16)},
        "opt": {"m": np.zeros(5, np.int32)},
        "epoch": 1,
    }


def _save(d, step: int, state: dict, **opts) -> None:
    with pitstop.CheckpointManager(d, memory_tier=False, async_save=False,
                                   save_on_signals=None, **opts) as mgr:
        mgr.save(step, state, metrics={"loss": 1.0 / step}).wait()


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_identical_reads_no_array_bytes(tmp_path, capsys):
    """Equal stored hashes short-circuit: data files garbled in place (same size) are never
    read, so the diff still says identical."""
    _save(tmp_path / "a", 1, _state())
    _save(tmp_path / "b", 1, _state())
    for run_dir in ("a", "b"):
        for f in (tmp_path / run_dir / "step_0000000001").glob("data-*.bin"):
            f.write_bytes(b"\xff" * f.stat().st_size)
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert (rc, err) == (0, "")
    assert "3 arrays (3 by stored hash, not read), 1 values" in out
    assert out.rstrip().endswith("identical")


def test_one_changed_element_exact_figures(tmp_path, capsys):
    a = _state()
    _save(tmp_path / "run", 1, a)
    a["model"]["w"][1, 2] = 8.0  # was 6: abs 2, rel 1/3
    a["epoch"] = 2
    _save(tmp_path / "run", 2, a)
    rc, out, err = run(capsys, "diff", tmp_path / "run", "--step", 1, "--step", 2)
    assert (rc, err) == (1, "")
    assert "differs: model/w (float32 [3, 4]): 1 of 12 elements (8.33%), max abs 2, " \
        "max rel 0.333333" in out
    assert "value: epoch: 1 -> 2" in out
    assert "metrics: loss=1" in out and "metrics: loss=0.5" in out
    rc, out, _ = run(capsys, "diff", tmp_path / "run", "--step", 1, "--step", 2, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["arrays"] == [{"key": "model/w", "type": "float32 [3, 4]",
                                          "elements": 12, "differ": 1, "max_abs": 2.0,
                                          "max_rel": 2 / 6, "nonfinite": 0}]
    assert doc["values"] == [{"key": "epoch", "a": 1, "b": 2}]
    # one run directory without --step: its two newest, older as A
    rc, out, _ = run(capsys, "diff", tmp_path / "run")
    assert rc == 1 and "A: " in out and "step_0000000001 (step 1" in out.splitlines()[0]
    # a checkpoint's own path against the run directory's newest
    rc, out, _ = run(capsys, "diff", tmp_path / "run" / "step_0000000002", tmp_path / "run")
    assert rc == 0 and out.rstrip().endswith("identical")


def test_keys_dtypes_shapes_and_tolerances(tmp_path, capsys):
    a = _state()
    _save(tmp_path / "a", 3, a)
    b = _state()
    del b["opt"]["m"]
    b["opt"]["v"] = np.ones(2)
    b["model"]["b"] = np.ones(4, np.float32)          # dtype change
    b["model"]["w"] = b["model"]["w"] + 1e-4          # small change everywhere
    _save(tmp_path / "b", 3, b)
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1
    assert "only in A: opt/m (int32 [5])" in out
    assert "only in B: opt/v (float64 [2])" in out
    assert "changed type: model/b: bfloat16 [4] -> float32 [4]" in out
    assert "differs: model/w (float32 [3, 4]): 12 of 12 elements" in out
    b["model"]["b"] = a["model"]["b"]
    b["opt"] = a["opt"]
    _save(tmp_path / "c", 3, b)
    assert run(capsys, "diff", tmp_path / "a", tmp_path / "c")[0] == 1
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "c", "--atol", "1e-3")
    assert rc == 0 and "|b - a| <= 0.001 + 0 * |a|" in out
    assert run(capsys, "diff", tmp_path / "a", tmp_path / "c", "--rtol", "1e-7")[0] == 1


def test_compare_arrays_nan_inf_and_exactness():
    a = np.array([np.nan, 0.0, np.inf, 1.0, 2.0], np.float32)
    b = np.array([np.nan, -0.0, np.inf, np.nan, 2.5], np.float32)
    d = compare_arrays(a, b, None, None)  # bitwise: -0.0 differs from 0.0; NaN == NaN
    assert (d.differ, d.nonfinite, d.max_abs, d.max_rel) == (3, 1, 0.5, 0.25)
    d = compare_arrays(a, b, 0.0, 0.0)    # numeric: -0.0 == 0.0
    assert (d.differ, d.nonfinite) == (2, 1)
    s = compare_arrays(np.array(["x", "y"]), np.array(["x", "z"]), None, None)
    assert (s.differ, s.max_abs) == (1, None)
    i = compare_arrays(np.array([0, 5], np.int64), np.array([3, 5], np.int64), None, None)
    assert (i.differ, i.max_abs, i.max_rel) == (1, 3.0, float("inf"))


def test_incremental_and_compressed_checkpoints_compare_by_value(tmp_path, capsys):
    s = _state()
    with pitstop.CheckpointManager(tmp_path / "inc", memory_tier=False, async_save=False,
                                   save_on_signals=None, incremental=True) as mgr:
        mgr.save(1, s).wait()
        s["opt"]["m"][0] = 9
        mgr.save(2, s).wait()  # model/* referenced in step 1
    _save(tmp_path / "z", 2, s, compression="zstd")
    rc, out, _ = run(capsys, "diff", tmp_path / "inc", tmp_path / "z")
    assert rc == 0, out
    assert "3 arrays, 1 values" in out  # compressed vs plain: read and compared
    rc, out, _ = run(capsys, "diff", tmp_path / "inc", "--step", 1, "--step", 2)
    assert rc == 1 and "2 arrays (2 by stored hash" in out and "differs: opt/m" in out


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    _save(tmp_path / "a", 1, _state())
    _save(tmp_path / "b", 1, _state())
    ck = tmp_path / "b" / "step_0000000001"
    # corrupt B's bytes (A's differ, so they are read): exit 2, not 1 ("differ")
    a = _state()
    a["model"]["w"][0, 0] = 100
    _save(tmp_path / "c", 1, a)
    for f in ck.glob("data-*.bin"):
        f.write_bytes(b"\x00" * f.stat().st_size)
    rc, out, err = run(capsys, "diff", tmp_path / "c", tmp_path / "b")
    assert rc == 2 and err.startswith("pitstop: B: ") and "hash mismatch" in err
    assert err.count("\n") == 1
    (ck / "manifest.json").write_text("{not json")
    rc, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 2 and err.startswith("pitstop: B: ") and err.count("\n") == 1
    rc, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "nope")
    assert rc == 2 and "no such directory" in err
    rc, _, err = run(capsys, "diff", tmp_path / "a", "--step", 1)
    assert rc == 2 and "give a second --step" in err
    rc, _, err = run(capsys, "diff", tmp_path / "a" / "step_0000000001")
    assert rc == 2 and "is one checkpoint (step 1): give B" in err
    rc, _, err = run(capsys, "diff", tmp_path / "a")
    assert rc == 2 and "has 1 checkpoint(s)" in err
    rc, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "c", "--atol", "-1")
    assert rc == 2 and "--atol -1.0" in err


@pytest.mark.parametrize("with_key", [True, False])
def test_encrypted_needs_the_key(tmp_path, capsys, monkeypatch, with_key):
    monkeypatch.setenv("PITSTOP_ENCRYPTION_KEY", "ab" * 32)
    _save(tmp_path / "e", 1, _state(), encryption=pitstop.Encryption())
    _save(tmp_path / "p", 1, _state())
    import pitstop.cli.common as cli
    monkeypatch.setattr(cli, "_KEY", [])
    if not with_key:
        monkeypatch.delenv("PITSTOP_ENCRYPTION_KEY")
    rc, out, err = run(capsys, "diff", tmp_path / "e", tmp_path / "p")
    if with_key:
        assert (rc, err) == (0, "") and "3 arrays, 1 values" in out
    else:
        assert rc == 2 and "PITSTOP_ENCRYPTION_KEY" in err and err.count("\n") == 1


def test_large_plain_arrays_are_compared_chunk_by_chunk(tmp_path, capsys, monkeypatch):
    """Arrays over STREAM_MIN are read a chunk at a time from both sides (made small here):
    the same figures as a whole read, and a changed byte is still caught by the hash."""
    import pitstop.cli.diff as diff_mod

    rng = np.random.default_rng(7)
    a = {"w": rng.standard_normal(1000).astype(np.float32), "n": np.arange(10)}
    _save(tmp_path / "a", 1, a)
    b = {"w": a["w"].copy(), "n": a["n"]}
    b["w"][[3, 500, 999]] += np.float32(0.25)
    _save(tmp_path / "b", 1, b)
    _, whole, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    monkeypatch.setattr(diff_mod, "STREAM_MIN", 64)
    monkeypatch.setattr(diff_mod, "CHUNK", 7)  # chunks that do not divide 1000
    rc, streamed, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1 and streamed == whole and "3 of 1000 elements" in streamed
    ck = tmp_path / "b" / "step_0000000001"
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["w"]
    path = ck / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 2000] ^= 0x10
    path.write_bytes(bytes(data))
    rc, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 2 and err.startswith("pitstop: B: ") and "hash mismatch" in err
