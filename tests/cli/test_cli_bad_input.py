"""The CLI on manifests edited as an attacker or a buggy tool would (resealed): what it
prints from a manifest cannot forge output lines or drive the terminal; every refusal is
one ``pitstop: ...`` line on stderr, exit 1, no traceback, no hang."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from entry_point import run_commands

import pitstop
from pitstop.core.format.seal import seal
from pitstop.core.manager import step_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("tpl") / "run"
    with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": np.arange(10, dtype="f4") * s, "v": s}).result(timeout=60)
    return d


def edited(template, tmp_path, fn, name="run"):
    d = tmp_path / name
    shutil.copytree(template, d)
    path = os.path.join(d, step_name(2), "manifest.json")
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    del doc["manifest_hash"]
    fn(doc)
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode(), "xxh3-128"))
    return str(d)


def cli(*commands: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of each ``pitstop COMMAND``, run by the entry point in one
    interpreter of its own (tests/cli/entry_point.py): real streams, no terminal."""
    results = run_commands([list(c) for c in commands], cwd=ROOT, timeout=60)
    for c, (_, _, err) in zip(commands, results, strict=True):
        assert "Traceback" not in err, (c, err)
    return results


FORGED = "w\nstep 2: ok (forged)\x1b]0;title\x07\x1b[2J\u202e"


def rename_w(bad_hash: bool):
    def fn(doc):
        doc["arrays"][FORGED] = doc["arrays"].pop("w")
        doc["structure"]["$d"] = [[FORGED if k == "w" else k, v] for k, v in doc["structure"]["$d"]]
        if bad_hash:
            doc["arrays"][FORGED]["hash"] = "0" * 32
        doc["metrics"] = {"lo\nss": "\x1b[2J", "a": 1.5}
        doc["writer"]["host"] = "h\x1b[31m\nstep 1: ok"
    return fn


def clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
    assert "(forged)" not in "\n".join(line for line in text.splitlines()
                                       if line.startswith("step 2: ok")), text
    assert not any(line.startswith("step 1: ok") and "pitstop" not in line and "verified"
                   not in line for line in text.splitlines()), text


@pytest.mark.parametrize("bad_hash", [False, True])
def test_what_a_manifest_says_is_printed_escaped_on_its_line(template, tmp_path, bad_hash):
    """Keys, metric names and the writer's host were printed raw: a key holding a newline
    and "step 2: ok" forged a verify line for a corrupt checkpoint, and escape sequences
    reached the terminal (colours, the window title, clearing the screen)."""
    d = edited(template, tmp_path, rename_w(bad_hash))
    commands = (("inspect", d), ("ls", d), ("verify", d, "--all"))
    for args, (rc, out, err) in zip(commands, cli(*commands), strict=True):
        clean(out + err)
        if args[0] == "inspect":  # escaped, not dropped
            assert "lo\\nss=\\x1b[2J" in out and "w\\nstep 2: ok (forged)" in out, out
        if args[0] == "verify":
            assert rc == (1 if bad_hash else 0), (args, out, err)
            if bad_hash:
                line = next(x for x in out.splitlines() if x.startswith("step 2:"))
                assert "CORRUPT" in line and "tensor w\\nstep 2: ok (forged)" in line, line
                assert len(err.strip().splitlines()) == 1 and err.startswith("pitstop: ")


@pytest.mark.parametrize("what, value, text", [
    ("format_version", 1, "bad format_version"),
    ("user_metadata", "NaN", "not valid JSON"),
])
def test_a_refused_manifest_is_one_line_exit_1(template, tmp_path, what, value, text):
    def fn(doc):
        doc[what] = {"a": "NAN_HERE"} if value == "NaN" else value
    d = edited(template, tmp_path, fn)
    if value == "NaN":
        path = os.path.join(d, step_name(2), "manifest.json")
        with open(path, "rb") as f:
            body = f.read()
        body = body[:body.index(b',"manifest_hash"')] + b"}"
        with open(path, "wb") as f:
            f.write(seal(body.replace(b'"NAN_HERE"', b"NaN"), "xxh3-128"))
    (rc, out, err), verified = cli(("inspect", d), ("verify", d, "--all"))
    assert rc == 1 and err.startswith("pitstop: ") and len(err.strip().splitlines()) == 1
    assert text in err, err
    rc, out, err = verified
    assert rc == 1 and "step 1: ok" in out and "step 2: CORRUPT" in out and text in out, out
