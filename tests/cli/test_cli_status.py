"""`pitstop ls` says what retention keeps and why, `inspect` names the frameworks that wrote
the state, `verify` shows progress on a terminal only, every --help ends with an example and
every bad argument is one line (for every subcommand build_parser() has, also those added
later)."""

from __future__ import annotations

import argparse
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pitstop
from pitstop.cli import build_parser, main
from pitstop.core.directory.names import step_name

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def rows(out: str) -> dict[int, str]:
    """step -> the STATUS (and METRICS) of its committed row in `pitstop ls` output."""
    got = {}
    for line in out.splitlines():
        cells = line.lstrip("* ").split("  ")
        if cells[0].strip().isdigit() and "moved aside" not in line and \
                "incomplete" not in line:
            got[int(cells[0])] = line
    return got


def open_mgr(d, **kw) -> pitstop.CheckpointManager:
    return pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None, **kw)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ====================================================================== ls and retention
class EveryOther:
    """A user's own retention policy: ls cannot evaluate it, and says so."""

    def keep(self, checkpoints):
        return {c.step for c in checkpoints if c.step % 2 == 0}


def test_ls_says_why_retention_keeps_each_checkpoint(tmp_path, capsys):
    d = tmp_path / "run"
    w = lambda s: {"w": np.full(8, s, np.float32)}  # noqa: E731
    with open_mgr(d, keep_last=2, keep_every_steps=200, keep_best=1, best_metric="loss") as mgr:
        for s, loss in ((100, 0.9), (150, 0.1), (200, 0.8), (250, 0.7), (300, 0.6)):
            mgr.save(s, w(s), metrics={"loss": loss}).wait()
    rc, out, err = run(capsys, "ls", d)
    assert rc == 0 and err == ""
    assert "retention: keep_last=2, keep_every_steps=200, keep_best=1 by loss (min)" in out
    got = rows(out)
    assert sorted(got) == [150, 200, 250, 300]  # 100: deleted by retention
    assert "kept: best loss" in got[150]
    assert "kept: every 200" in got[200]
    # the next pass runs after the next save: 250 leaves the newest-2 window then
    assert "kept until the next save (newest 2)" in got[250]
    assert "kept: newest 2" in got[300]
    assert got[300].startswith("*")

    # the next writer keeps less: its retention is recorded when it opens, and ls says
    # which checkpoints its next pass deletes (it has not saved yet)
    with open_mgr(d, keep_last=1):
        pass
    rc, out, _ = run(capsys, "ls", d)
    assert "retention: keep_last=1" in out
    got = rows(out)
    assert all("deleted at the next save" in got[s] for s in (150, 200, 250))
    assert "kept until the next save (newest 1)" in got[300]

    # a checkpoint the user protected in the index, and a policy ls cannot evaluate
    index = json.loads((d / ".pitstop" / "index.json").read_text())
    index["checkpoints"]["200"]["protected"] = True
    (d / ".pitstop" / "index.json").write_text(json.dumps(index))
    with open_mgr(d, keep_last=1, retention=[EveryOther()]):
        pass
    rc, out, _ = run(capsys, "ls", d)
    assert f"{__name__}.EveryOther" in out.splitlines()[1]
    got = rows(out)
    assert "kept: protected" in got[200]
    assert f"kept unless {__name__}.EveryOther deletes it" in got[150]

    # a directory whose writer recorded nothing (an older pitstop)
    ident = json.loads((d / ".pitstop" / "directory.json").read_text())
    del ident["retention"]
    (d / ".pitstop" / "directory.json").write_text(json.dumps(ident))
    rc, out, _ = run(capsys, "ls", d)
    assert "retention: policy unknown" in out
    assert all(line.rstrip().split("  ")[-2].strip() == "committed" or "committed" in line
               for line in rows(out).values())


def test_ls_shows_every_kind_of_entry_and_one_checkpoint_by_its_path(tmp_path, capsys):
    d = tmp_path / "run"
    with open_mgr(d, keep_last=1, incremental=True) as mgr:
        big = np.arange(64, dtype=np.float32)
        mgr.save(1, {"big": big, "w": np.zeros(4, np.float32)}).wait()
        mgr.save(2, {"big": big, "w": np.ones(4, np.float32)}).wait()  # big: referenced
        mgr.save(3, {"big": big, "w": np.full(4, 3, np.float32)}).wait()
    (d / ".tmp-step_0000000004-1a2b3c4d").mkdir()  # an interrupted save
    assert sorted(os.listdir(d)) == [".pitstop", ".tmp-step_0000000004-1a2b3c4d",
                                     step_name(1), step_name(3)]  # 2: deleted by retention
    shutil.copytree(d / step_name(3), d / f"{step_name(2)}.corrupt-1700000000-ab12")
    bad = d / step_name(5)  # a committed checkpoint whose manifest cannot be read
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    rc, out, err = run(capsys, "ls", d)
    assert rc == 0 and err == ""
    assert out.startswith(f"{d}: 3 checkpoints\nretention: keep_last=1\n"), out
    table = out.splitlines()[2:8]
    assert [ln.lstrip("* ").split()[0] for ln in table[1:]] == ["1", "2", "3", "4", "5"]
    # incremental: 3 reads big from 1 (the next save replaces 3; whether it reads big
    # from 1 too, ls cannot know)
    assert "kept until the next save (referenced by step 3)" in table[1]
    assert "corrupt: moved aside (step_0000000002.corrupt-1700000000-ab12)" in table[2]
    assert "kept until the next save (newest 1)" in table[3]
    assert "incomplete: interrupted save (.tmp-step_0000000004-1a2b3c4d)" in table[4]
    assert table[5].startswith("*") and "unreadable: " in table[5]
    for note in ("incomplete: left by an interrupted save", "corrupt: moved aside after",
                 "unreadable: its manifest cannot be read"):
        assert note in out

    rc, out, err = run(capsys, "ls", d / step_name(3))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{d / step_name(3)}: the checkpoint of step 3 (`pitstop ls {d}` lists all 3)"
    assert [ln.lstrip("* ").split()[0] for ln in lines[3:]] == ["3"]
    assert "kept until the next save (newest 1)" in lines[3]

    rc, _, err = run(capsys, "gc", d / step_name(3))  # gc: the one-line hint, as before
    assert rc == 2 and len(err.splitlines()) == 1 and f"pitstop gc {d}" in err


def test_ls_reads_the_recorded_retention_on_an_object_store(capsys):
    u = f"memory://pitstop-ls-{os.getpid()}"
    with open_mgr(u, keep_last=1) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": np.full(4, s, np.float32)}).wait()
    with open_mgr(u, keep_last=1, keep_every_steps=1):
        pass
    rc, out, err = run(capsys, "ls", u)
    assert rc == 0 and err == ""
    assert "retention: keep_last=1, keep_every_steps=1" in out
    assert "kept: every 1" in rows(out)[2]


# ====================================================================== inspect
def test_inspect_names_the_frameworks_that_wrote_the_state(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2), "x": np.zeros(3)}).wait()
        mgr.save(2, {"x": np.zeros(3)}).wait()
    writer = json.loads((d / step_name(1) / "manifest.json").read_text())["writer"]
    assert writer["frameworks"] == {"torch": torch.__version__, "numpy": np.__version__}
    rc, out, _ = run(capsys, "inspect", d, "--step", 1)
    assert rc == 0
    assert (f"  written by: torch {torch.__version__}, numpy {np.__version__} (pitstop "
            f"{pitstop.__version__} on {writer['host']}, pid {os.getpid()})") in out
    rc, out, _ = run(capsys, "inspect", d)
    assert rc == 0 and f"  written by: numpy {np.__version__} (pitstop" in out

    # a manifest of an older pitstop, without frameworks (unsealed 1.0: its writer edited)
    path = d / step_name(2) / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("manifest_hash")
    doc["format_version"] = "1.0"
    del doc["writer"]["frameworks"]
    path.write_text(json.dumps(doc))
    rc, out, err = run(capsys, "inspect", d)
    assert rc == 0, err
    assert "(frameworks not recorded: an older pitstop)" in out


# ====================================================================== verify progress
@pytest.fixture
def ckdir(tmp_path) -> Path:
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": np.arange(300_000, dtype=np.float32) + s}).wait()
    return d


def test_verify_progress_only_on_a_terminal(ckdir, capsys):
    rc, out, err = run(capsys, "verify", ckdir, "--all")  # stderr captured: no terminal
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["step 1: ok", "step 2: ok"]
    rc, out2, err = run(capsys, "verify", ckdir, "--all", "--progress")
    assert rc == 0 and "100%" in err and "1.2/1.2 MB" in err
    assert [ln.split(" (")[0] for ln in out2.splitlines()] == ["step 1: ok", "step 2: ok"]

    # the console script with stderr on a terminal (a pty), stdout a pipe
    master, slave = pty.openpty()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pitstop.cli", "verify", str(ckdir), "--step", "2"],
            stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm"})
        os.close(slave)
        slave = -1
        shown = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the writer side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)
    assert r.returncode == 0 and r.stdout.startswith("step 2: ok ("), r.stdout
    assert b"step 2" in shown and b"100%" in shown, shown


# ====================================================================== help and errors
def test_every_help_ends_with_an_example():
    parser = build_parser()
    for name, p in [("", parser), *subparsers(parser).items()]:
        text = p.format_help().rstrip("\n").splitlines()
        assert "example:" in text, (name, text[-5:])
        example = text[text.index("example:") + 1:]
        assert example and all(ln.startswith("  pitstop ") for ln in example), (name, example)


def test_every_bad_argument_is_one_line(capsys):
    cases = [(["inspect", "x", "--step", "x"],
              "pitstop inspect: --step: invalid int value: 'x'; see `pitstop inspect --help`"),
             ([], "pitstop: the following arguments are required: COMMAND; see `pitstop "
              "--help`"),
             (["ls", "a", "b"], "pitstop ls: unrecognized arguments: b; see `pitstop ls "
              "--help`")]
    cases += [([name, "--no-such-option"], f"pitstop {name}: ")
              for name in subparsers(build_parser())]
    for argv, want in cases:
        try:
            rc = main(argv)
        except SystemExit as e:  # (argparse's exit, through ArgumentParser.error)
            rc = e.code
        out, err = capsys.readouterr()
        assert rc == 2 and out == "", (argv, rc, out)
        assert len(err.splitlines()) == 1 and err.startswith(want), (argv, err)
        assert err.rstrip().endswith("--help`"), (argv, err)
