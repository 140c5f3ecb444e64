"""`pitstop diff`, `export` and `import` used the way torch.save / DCP / tf.train / Orbax users
use them, and misuse them: each test here is a defect a user met (see its docstring)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import s3_server
from thread_ranks import ranks

import pitstop
from pitstop.cli import main

#: the S3 test server's fixtures (tests/s3_server.py: one server for the session), by name
bucket, moto, s3env = (s3_server.bucket, s3_server.moto, s3_server.s3env)

def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _save_ranks(d: Path, n: int, state_of: Any, step: int = 1) -> None:
    """One checkpoint saved by ``n`` ranks (threads), rank r saving ``state_of(r)``."""

    def job(rank: int, coord: Any) -> None:
        with pitstop.CheckpointManager(d, distributed=coord, async_save=False,
                                       save_on_signals=None, memory_tier=False) as mgr:
            mgr.save(step, state_of(rank)).wait()

    ranks(n, job)


def test_diff_compares_every_ranks_own_state(tmp_path, capsys):
    """A user diffed two 2-rank checkpoints whose rank 1 held different per-rank state (its
    RNG stream, its sampler position): `pitstop diff` said "identical", exit 0, because it
    compared rank 0's view only."""
    _save_ranks(tmp_path / "a", 2, lambda r: {"w": np.ones(4), "mine": np.full(3, r),
                                              "info": {"pos": r}})
    _save_ranks(tmp_path / "b", 2, lambda r: {"w": np.ones(4), "mine": np.full(3, 5 * r),
                                              "info": {"pos": 5 * r}})
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "a")
    assert (rc, err) == (0, "") and out.rstrip().endswith("identical")
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert (rc, err) == (1, ""), out + err
    assert "differs: mine (rank 1) (int64 [3]): 3 of 3 elements (100%), max abs 4" in out
    assert "value: info (rank 1): {\"pos\":1} -> {\"pos\":5}" in out
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--json")
    doc = json.loads(out)
    assert [a["key"] for a in doc["arrays"]] == ["mine (rank 1)"]
    assert doc["ranks"] == {"a": 2, "b": 2}
    # one rank's save of rank 0's state: not the same checkpoint
    with pitstop.CheckpointManager(tmp_path / "c", async_save=False, save_on_signals=None,
                                   memory_tier=False) as mgr:
        mgr.save(1, {"w": np.ones(4), "mine": np.full(3, 0), "info": {"pos": 0}}).wait()
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert (rc, err) == (1, "") and "ranks: A was written by 2, B by 1" in out, out
    assert out.rstrip().endswith("different: 1 different number of ranks")


def _save(d: Path, step: int, state: dict, **opts: Any) -> None:
    with pitstop.CheckpointManager(d, memory_tier=False, async_save=False,
                                   save_on_signals=None, **opts) as mgr:
        mgr.save(step, state).wait()


def test_export_never_writes_over_the_run_directorys_own_files(tmp_path, capsys):
    """`pitstop export runs/a --to npz -o runs/a/step_0000000001/manifest.json --force` (a
    slip of tab completion) replaced the checkpoint's own manifest with the npz: the
    checkpoint being exported was destroyed, exit 0."""
    d = tmp_path / "a"
    _save(d, 1, {"w": np.arange(3.0)})
    own = d / "step_0000000001"
    for out in [own / "manifest.json", own / "model.npz", d / ".pitstop" / "x.npz", d]:
        rc, _out, err = run(capsys, "export", d, "--to", "npz", "-o", out, "--force")
        assert rc == 2 and err.count("\n") == 1 and "inside the run directory, only beside" in err, (out, err)
    rc, out, err = run(capsys, "verify", d)
    assert (rc, err) == (0, ""), out + err
    assert not (own / "model.npz").exists()
    # beside the checkpoints, in the run directory itself: a plain file, allowed
    assert run(capsys, "export", d, "--to", "npz", "-o", d / "exp.npz")[0] == 0


def test_import_over_an_existing_step_names_the_commands_option(tmp_path, capsys):
    """`pitstop import model.pt runs/a` when runs/a has step 0 told the user to import
    "under another step (step=...)": the Python keyword, not the command's --step."""
    torch = __import__("pytest").importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    assert run(capsys, "import", tmp_path / "model.pt", tmp_path / "a")[0] == 0
    rc, _out, err = run(capsys, "import", tmp_path / "model.pt", tmp_path / "a")
    assert rc == 2 and err.count("\n") == 1 and "already has a checkpoint of step 0" in err
    assert "step=" not in err and "--step" in err, err


def test_import_of_a_keras_file_says_it_is_not_supported(tmp_path, capsys):
    """A Keras user ran `pitstop import model.weights.h5 runs/a` and was told "cannot tell
    the format; give --from (one of torch, dcp, ...)", then `--from keras`: "unknown
    format". Neither said that Keras files are not imported, nor what to do instead."""
    import zipfile
    (tmp_path / "m.weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    with zipfile.ZipFile(tmp_path / "m.keras", "w") as zf:
        zf.writestr("metadata.json", "{}")
        zf.writestr("config.json", "{}")
        zf.writestr("model.weights.h5", b"\x89HDF\r\n\x1a\n")
    for argv in (["m.weights.h5"], ["m.keras"], ["m.weights.h5", "--from", "keras"]):
        argv = [tmp_path / argv[0], tmp_path / "a", *argv[1:]]
        rc, _out, err = run(capsys, "import", *argv)
        assert rc == 2 and err.count("\n") == 1, err
        assert "Keras" in err and "not supported" in err and "load_weights" in err, err
    assert not (tmp_path / "a").exists()


def test_export_of_a_multi_rank_checkpoint_says_what_it_leaves_out(tmp_path, capsys):
    """A 2-rank checkpoint exported to npz held only rank 0's per-rank state (rank 1's RNG
    stream, sampler position were dropped), and the command's output said nothing of it."""
    _save_ranks(tmp_path / "a", 2, lambda r: {"w": np.ones(4), "mine": np.full(3, r),
                                              "info": {"pos": r}})
    rc, out, err = run(capsys, "export", tmp_path / "a", "--to", "npz", "-o", tmp_path / "x.npz")
    assert (rc, err) == (0, "")
    assert "written by 2 ranks: exported rank 0's view; 2 key(s) hold other values on " \
        "other ranks, not exported: info, mine" in out, out
    rc, out, err = run(capsys, "export", tmp_path / "a", "--to", "npz", "--key", "w",
                       "-o", tmp_path / "w.npz")
    assert (rc, err) == (0, "") and "ranks" not in out, out


def test_advice_names_the_commands_options_not_python_keywords(tmp_path, capsys):
    """A DDP state dict import warned "import again with strip_prefixes=() to keep the
    keys as saved", and a complex array's safetensors export said "export it with
    export_torch_save": advice for the Python API that no option of the command takes."""
    import logging

    torch = __import__("pytest").importorskip("torch")
    torch.save({"module.weight": torch.ones(2), "module.bias": torch.zeros(1)},
               tmp_path / "ddp.pt")
    logs: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(record.getMessage())

    grab = Grab(logging.WARNING)
    logging.getLogger("pitstop").addHandler(grab)
    try:
        assert run(capsys, "import", tmp_path / "ddp.pt", tmp_path / "a")[0] == 0
    finally:
        logging.getLogger("pitstop").removeHandler(grab)
    assert len(logs) == 1 and "'module.weight' -> 'weight'" in logs[0], logs
    assert "strip_prefixes" not in logs[0] and "--keep-prefixes" in logs[0], logs
    rc, out, err = run(capsys, "import", tmp_path / "ddp.pt", tmp_path / "b",
                       "--keep-prefixes")
    assert (rc, err) == (0, ""), err
    with pitstop.CheckpointManager(tmp_path / "b", read_only=True) as mgr:
        assert sorted(mgr.load(0)) == ["module.bias", "module.weight"]
    _save(tmp_path / "c", 1, {"z": np.ones(2, np.complex128)})
    rc, _out, err = run(capsys, "export", tmp_path / "c", "--to", "safetensors",
                        "-o", tmp_path / "c.safetensors")
    assert rc == 2 and err.count("\n") == 1 and "'z'" in err, err
    assert "export_torch_save" not in err and "--to torch" in err, err


def test_every_dtype_export_writes_to_safetensors_imports_back(tmp_path, capsys):
    """`pitstop export --to safetensors` wrote complex64 and the fnuz float8 types (the
    running safetensors stores them), and `pitstop import` of that very file then said
    "tensor 'z' has dtype 'C64', which numpy cannot hold"."""
    import ml_dtypes
    __import__("pytest").importorskip("safetensors")
    state = {"z": np.array([1 + 2j, -0.5j], np.complex64),
             "e4": np.array([1.0, -2.0], ml_dtypes.float8_e4m3fnuz),
             "e5": np.array([0.5, 4.0], ml_dtypes.float8_e5m2fnuz),
             "u": np.array([7, 2 ** 31], np.uint32)}
    _save(tmp_path / "a", 1, state)
    rc, _out, err = run(capsys, "export", tmp_path / "a", "--to", "safetensors",
                        "-o", tmp_path / "a.safetensors")
    if rc == 2 and "safetensors cannot store" in err:  # an older safetensors: refused by name
        __import__("pytest").skip(err)
    assert (rc, err) == (0, "")
    rc, _out, err = run(capsys, "import", tmp_path / "a.safetensors", tmp_path / "b")
    assert (rc, err) == (0, ""), err
    rc, out, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert (rc, err) == (0, ""), out


def test_import_refuses_a_step_its_directory_cannot_index(tmp_path, capsys):
    """`pitstop import model.npz runs/a --step 99999999999999999999` committed step 10**20;
    every later command on runs/a then warned that .pitstop/index.json was unreadable
    ("entry '99999999999999999999' is not a step's") and rebuilt it, each time."""
    np.savez(tmp_path / "m.npz", w=np.ones(2))
    rc, _out, err = run(capsys, "import", tmp_path / "m.npz", tmp_path / "a",
                        "--step", 10 ** 20)
    assert rc == 2 and err.count("\n") == 1 and "--step 100000000000000000000" in err, err
    assert not (tmp_path / "a").exists()
    big = 10 ** 18 - 1  # the largest step the index holds
    assert run(capsys, "import", tmp_path / "m.npz", tmp_path / "a", "--step", big)[0] == 0
    rc, out, err = run(capsys, "ls", tmp_path / "a")
    assert (rc, err) == (0, ""), err


def test_a_missing_key_names_the_option(tmp_path, capsys):
    """`pitstop import m.npz runs/a --key nope` answered "Pass one of them as key=, or
    key=None for everything": Python words for a command-line user."""
    np.savez(tmp_path / "m.npz", w=np.ones(2))
    rc, _out, err = run(capsys, "import", tmp_path / "m.npz", tmp_path / "a", "--key", "nope")
    assert rc == 2 and err.count("\n") == 1 and "entries there: 'w'" in err, err
    assert "key=" not in err and "--key" in err, err
    _save(tmp_path / "b", 1, {"w": np.ones(2)})
    rc, _out, err = run(capsys, "export", tmp_path / "b", "--to", "npz", "--key", "nope",
                        "-o", tmp_path / "b.npz")
    assert rc == 2 and err.count("\n") == 1 and "key=" not in err, err


def test_import_into_a_directory_a_job_is_writing_says_what_to_do(tmp_path, capsys):
    """`pitstop import m.npz runs/live` while a training job held runs/live answered "Use
    one CheckpointManager per directory, or open it with read_only=True to only restore":
    advice for code, not for someone importing a file."""
    np.savez(tmp_path / "m.npz", w=np.ones(2))
    with pitstop.CheckpointManager(tmp_path / "live", save_on_signals=None, memory_tier=False):
        rc, _out, err = run(capsys, "import", tmp_path / "m.npz", tmp_path / "live",
                            "--step", 5)
    assert rc == 2 and err.count("\n") == 1 and "in use by another writer" in err, err
    assert "read_only" not in err and "once that job has stopped" in err, err


def test_import_into_an_encrypted_directory_without_the_key(tmp_path, capsys, monkeypatch):
    """`pitstop import m.npz runs/enc` without PITSTOP_ENCRYPTION_KEY answered "set
    PITSTOP_ENCRYPTION_KEY to its key and pass encryption=pitstop.Encryption() to read it":
    the second half is for code; the command needs the variable only."""
    import pitstop.cli.common as cli
    monkeypatch.setenv("PITSTOP_ENCRYPTION_KEY", "ab" * 32)
    _save(tmp_path / "enc", 1, {"w": np.ones(2)}, encryption=pitstop.Encryption())
    np.savez(tmp_path / "m.npz", w=np.zeros(2))
    monkeypatch.setattr(cli, "_KEY", [])
    monkeypatch.delenv("PITSTOP_ENCRYPTION_KEY")
    rc, _out, err = run(capsys, "import", tmp_path / "m.npz", tmp_path / "enc", "--step", 2)
    assert rc == 2 and err.count("\n") == 1 and "set PITSTOP_ENCRYPTION_KEY" in err, err
    assert "encryption=" not in err, err
    # with the key: imported, and encrypted like the directory's own checkpoints
    monkeypatch.setattr(cli, "_KEY", [])
    monkeypatch.setenv("PITSTOP_ENCRYPTION_KEY", "ab" * 32)
    rc, _out, err = run(capsys, "import", tmp_path / "m.npz", tmp_path / "enc", "--step", 2)
    assert (rc, err) == (0, ""), err
    assert b"encryption" in (tmp_path / "enc" / "step_0000000002" / "manifest.json").read_bytes()


def test_a_refused_torch_file_is_not_told_to_allowlist_its_classes(tmp_path, capsys):
    """`pitstop import` of {"model": sd, "args": argparse.Namespace(...)} (the common
    torch.save of a training script) relayed torch's advice: "Please use
    torch.serialization.add_safe_globals([argparse.Namespace]) ... to allowlist this
    global": nothing the command (or pitstop's import) can take."""
    import argparse
    torch = __import__("pytest").importorskip("torch")
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)},
               tmp_path / "train.pt")
    rc, _out, err = run(capsys, "import", tmp_path / "train.pt", tmp_path / "a")
    assert rc == 2 and err.count("\n") == 1, err
    assert "argparse.Namespace" in err and "model.state_dict()" in err, err
    assert "add_safe_globals" not in err and "allowlist" not in err, err



def test_a_torch_file_pitstop_cannot_hold_is_one_line(tmp_path):
    """A torch.save file with a complex32 tensor: the refusal came after three lines of
    torch's own "ComplexHalf support is experimental" UserWarning on stderr (torch warns
    once per process: the command runs in a process of its own here)."""
    import subprocess
    import sys
    import warnings
    torch = __import__("pytest").importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"ch": torch.ones(2, dtype=torch.complex32)}, tmp_path / "c.pt")
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "import", tmp_path / "c.pt",
                        tmp_path / "a"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).parents[3])
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "'ch'" in p.stderr and "complex32" in p.stderr, p.stderr


def test_export_says_what_the_format_does_not_keep(tmp_path, capsys):
    """A torch.save export of step 7 with metrics {"loss": 0.5}: the file has neither the
    step nor the metrics, and `pitstop import` of it then wrote step 0 with no metrics;
    nothing said so at export."""
    torch = __import__("pytest").importorskip("torch")
    with pitstop.CheckpointManager(tmp_path / "a", memory_tier=False, async_save=False,
                                   save_on_signals=None) as mgr:
        mgr.save(7, {"w": np.ones(2)}, metrics={"loss": 0.5}).wait()
    rc, out, err = run(capsys, "export", tmp_path / "a", "--to", "torch", "-o", tmp_path / "a.pt")
    assert (rc, err) == (0, "")
    assert out.splitlines()[1] == "note: a torch.save file does not keep the step (7: " \
        "pitstop import it with --step 7) or the metrics (loss)", out
    assert torch.load(tmp_path / "a.pt", weights_only=True)["w"].tolist() == [1.0, 1.0]
    rc, out, err = run(capsys, "export", tmp_path / "a", "--to", "safetensors",
                       "-o", tmp_path / "a.safetensors")
    assert (rc, err) == (0, "")
    assert out.splitlines()[1] == "note: a .safetensors file does not keep the metrics (loss)"
    rc, out, err = run(capsys, "export", tmp_path / "a", "--to", "npz", "-o", tmp_path / "a.npz")
    assert (rc, err) == (0, "") and "note" not in out  # npz keeps both


def test_import_of_a_pitstop_directory_says_what_it_is(tmp_path, capsys):
    """`pitstop import runs/old runs/new` (a pitstop run directory, or one of its
    checkpoints, as SRC) answered "cannot tell the format; give --from (one of torch,
    dcp, ...)", as if it were some unknown file."""
    _save(tmp_path / "old", 3, {"w": np.ones(2)})
    for src in (tmp_path / "old", tmp_path / "old" / "step_0000000003"):
        rc, _out, err = run(capsys, "import", src, tmp_path / "new")
        assert rc == 2 and err.count("\n") == 1 and "already a pitstop" in err, err
    assert not (tmp_path / "new").exists()


def test_import_into_memory_storage_is_refused(tmp_path, capsys):
    """`pitstop import m.npz memory://run` said "imported 1 arrays ... as step 0 of
    memory://run", exit 0: the in-process memory file system vanished with the command."""
    np.savez(tmp_path / "m.npz", w=np.ones(2))
    rc, out, err = run(capsys, "import", tmp_path / "m.npz", "memory://probe/run")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "memory://" in err, out + err


def test_import_into_an_encrypted_bucket_with_its_key(tmp_path, capsys, monkeypatch, bucket):
    """`PITSTOP_ENCRYPTION_KEY=... pitstop import m.npz s3://b/enc --step 5` (an encrypted
    run directory in a bucket, the right key set) failed: "is encrypted; set
    PITSTOP_ENCRYPTION_KEY to its key", because the npz/safetensors import looked for the
    directory's key on local paths only (a torch.save import of the same worked).
    (``bucket``: a new bucket on the session's S3 test server, its environment set.)"""
    import pitstop.cli.common as cli
    monkeypatch.setenv("PITSTOP_ENCRYPTION_KEY", "ab" * 32)
    monkeypatch.setattr(cli, "_KEY", [])
    url = f"s3://{bucket}/enc"
    with pitstop.CheckpointManager(url, memory_tier=False, save_on_signals=None,
                                   encryption=pitstop.Encryption()) as mgr:
        mgr.save(1, {"w": np.ones(2)}).wait()
    np.savez(tmp_path / "m.npz", w=np.zeros(2))
    rc, out, err = run(capsys, "import", tmp_path / "m.npz", url, "--step", 5)
    assert (rc, err) == (0, ""), err
    assert out.endswith(f"as step 5 of {url}\n"), out  # (encrypted: the manager
    # never writes plaintext into an encrypted directory)
