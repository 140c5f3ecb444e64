"""Bad input found by hand, each kept as a test: a manifest edited *and resealed* (as an
attacker or a buggy tool would: its ``manifest_hash`` recomputed with ``seal.seal``),
a FIFO or a symlink where a data file should be. Every one is a clear
:class:`CorruptCheckpointError` naming the checkpoint and the key or file, through
``load()``, ``restore()``, ``verify()`` and ``pitstop verify``; ``restore()`` / ``load()`` of
the latest fall back to the previous checkpoint; nothing hangs, nothing allocates what the
manifest claims before the claim is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import pitstop
from pitstop.core.format.seal import seal
from pitstop.core.manager import step_name
from pitstop.core.restore import read as reader_mod
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage.local import LocalStorage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def state_of(step: int) -> dict:
    return {"w": np.arange(1000, dtype="f4") * step,
            "v": {"x": 1.5 * step, "b": b"hi", "t": (step, "s")}}


def blank() -> dict:
    return {"w": np.zeros(1000, "f4"), "v": {"x": 0.0, "b": b"", "t": (0, "")}}


def open_mgr(d, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(d, **kw)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Two committed steps, raw and compressed; each test copies one."""
    out = {}
    for kind, kw in (("raw", {}), ("zstd", {"compression": "zstd"})):
        d = tmp_path_factory.mktemp("tpl") / kind
        with open_mgr(d, **kw) as mgr:
            for s in (1, 2):
                mgr.save(s, state_of(s)).result(timeout=60)
        out[kind] = d
    return out


def ck(d, step: int = 2) -> str:
    return os.path.join(d, step_name(step))


def edit(d, fn, step: int = 2) -> None:
    """Change the manifest of ``step`` with ``fn(doc)`` and reseal it (a valid hash)."""
    path = os.path.join(ck(d, step), "manifest.json")
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    del doc["manifest_hash"]
    fn(doc)
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode(), doc["hash_algorithm"]))


def data_file(d, step: int = 2) -> str:
    return next(os.path.join(ck(d, step), n) for n in sorted(os.listdir(ck(d, step)))
                if n != "manifest.json")


# --------------------------------------------------------------------------- the defects
def huge_shape_raw(d):
    def fn(doc):
        e = doc["arrays"]["w"]
        e["shape"], e["length"] = [10**15], 4 * 10**15
        doc["files"][e["file"]]["length"] = e["offset"] + e["length"]
    edit(d, fn)
    return "data-000.bin", "the manifest recorded"


def huge_shape_zstd(d):
    edit(d, lambda doc: doc["arrays"]["w"].update(shape=[10**15]))
    return "w", "decodes to"


def fifo_data_file(d):
    p = data_file(d)
    os.unlink(p)
    os.mkfifo(p)
    return os.path.basename(p), "FIFO"


def structure_missing_leaf(d):
    edit(d, lambda doc: doc.update(structure={"$d": [["zz", 0]]}))
    return "zz", "structure"


def structure_not_a_list(d):
    edit(d, lambda doc: doc.update(structure={"$d": 5}))
    return "<root>", "structure"


def float_abc(d):
    edit(d, lambda doc: doc["values"].update({"v/x": {"$float": "abc"}}))
    return "v/x", "$float"


def dict_5(d):
    edit(d, lambda doc: doc["values"].update({"v/t": {"$dict": 5}}))
    return "v/t", "$dict"


def bytes_not_base64(d):
    edit(d, lambda doc: doc["values"].update({"v/b": {"$bytes": "!!!"}}))
    return "v/b", "base64"


def symlink_outside(d):
    p = data_file(d)
    outside = os.path.join(os.path.dirname(d), f"outside-{os.path.basename(d)}.bin")
    shutil.move(p, outside)  # the right bytes, but outside the checkpoint
    os.symlink(outside, p)
    return os.path.basename(p), "outside"


def dotdot_file_name(d):
    def fn(doc):
        name = next(iter(doc["files"]))
        doc["files"]["../" + name] = doc["files"].pop(name)
        for e in doc["arrays"].values():
            e["file"] = "../" + name
    edit(d, fn)
    return "../data-", "plain file name"


def offset_negative(d):
    edit(d, lambda doc: doc["arrays"]["w"].update(offset=-4096))
    return None, "offset"


def dtype_lie(d):
    edit(d, lambda doc: doc["arrays"]["w"].update(dtype="<f8"))  # twice the bytes it has
    return "w", "bytes"


DEFECTS = [huge_shape_raw, huge_shape_zstd, fifo_data_file, structure_missing_leaf,
           structure_not_a_list, float_abc, dict_5, bytes_not_base64, symlink_outside,
           dotdot_file_name, offset_negative, dtype_lie]


def template_for(defect) -> str:
    return "zstd" if defect is huge_shape_zstd else "raw"


def names_it(err: pitstop.CorruptCheckpointError, what: str | None, text: str) -> None:
    """The error names the checkpoint, the key or file, and what is wrong; one message."""
    msg = str(err)
    assert step_name(2) in msg and err.checkpoint and step_name(2) in err.checkpoint
    if what is not None:
        assert what in msg, msg
        assert what in f"{err.key} {err.file}" or what.startswith("../"), (err.key, err.file)
    assert text in msg, msg


@pytest.mark.timeout(60)  # a FIFO opened for reading blocks forever: this must not
@pytest.mark.parametrize("defect", DEFECTS, ids=lambda f: f.__name__)
def test_a_bad_checkpoint_is_corrupt_everywhere_and_the_previous_one_is_used(
        templates, tmp_path, defect):
    d = tmp_path / "run"
    shutil.copytree(templates[template_for(defect)], d, symlinks=True)
    what, text = defect(d)

    storage = LocalStorage(str(d), create=False)
    with pytest.raises(pitstop.CorruptCheckpointError) as info:
        CheckpointReader(storage, step_name(2)).verify()
    names_it(info.value, what, text)

    with open_mgr(d, read_only=True) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.load(step=2)
        names_it(info.value, what, text)
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(blank(), step=2)
        names_it(info.value, what, text)
        # the latest: skipped loudly, the previous one loaded
        with pytest.warns(UserWarning, match=step_name(2)):
            loaded = mgr.load()
        np.testing.assert_array_equal(loaded["w"], state_of(1)["w"])
        assert loaded["v"] == state_of(1)["v"]
    with open_mgr(d) as mgr:
        target = blank()
        with pytest.warns(UserWarning, match=step_name(2)):
            assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["w"], state_of(1)["w"])
        assert target["v"] == state_of(1)["v"]
        assert mgr.all_steps() == [1]  # moved aside, never deleted
    assert any(n.startswith(step_name(2) + ".corrupt-") for n in os.listdir(d))


def test_the_cli_says_corrupt_in_one_line_without_a_traceback(templates, tmp_path):
    """``pitstop verify`` and ``inspect`` of every defect: exit 1, one clear line on stderr
    naming the checkpoint; run in one process through the console script's ``main``, and
    once as ``python -m pitstop.cli``."""
    dirs = []
    for defect in DEFECTS:
        d = tmp_path / defect.__name__
        shutil.copytree(templates[template_for(defect)], d, symlinks=True)
        defect(d)
        dirs.append(str(d))
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from pitstop.cli import main
        out = []
        for d in sys.argv[1:]:
            for args in (["verify", d, "--all"], ["verify", d], ["inspect", d]):
                o, e = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                    rc = main(args)
                out.append([args, rc, o.getvalue(), e.getvalue()])
        print(json.dumps(out))
    """)
    p = subprocess.run([sys.executable, "-c", script, *dirs], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    for args, rc, out, err in json.loads(p.stdout):
        assert rc == 1, (args, out, err)
        assert "Traceback" not in out + err and "internal error" not in err, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pitstop: "), (args, err)
        if args[0] == "verify":
            assert "step 1: ok" in out or "--all" not in args, (args, out)
            assert "step 2: CORRUPT" in out, (args, out)
        else:
            assert step_name(2) in err, (args, err)
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "verify", dirs[1]],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "step 2: CORRUPT (file data-000.bin, tensor w)" in p.stdout, p.stdout
    assert "decodes to 4000 bytes" in p.stdout


def test_load_refuses_more_than_the_memory_available_saying_how_much(templates, tmp_path,
                                                                      monkeypatch):
    """A checkpoint whose arrays need more memory than the machine has: load() says how
    many bytes, instead of numpy's MemoryError; it is not corrupt, so nothing is skipped
    or moved. restore() into existing arrays needs no new memory and still works."""
    d = tmp_path / "run"
    shutil.copytree(templates["raw"], d)
    monkeypatch.setattr(reader_mod, "available_memory", lambda: 1000)
    with open_mgr(d) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to step 1: it is not corrupt
            with pytest.raises(pitstop.CheckpointError) as info:
                mgr.load()
        assert not isinstance(info.value, pitstop.CorruptCheckpointError)
        assert "needs 4000 bytes" in str(info.value) and "1000 bytes" in str(info.value)
        assert step_name(2) in str(info.value)
        target = blank()
        assert mgr.restore(target) == 2
        np.testing.assert_array_equal(target["w"], state_of(2)["w"])
        assert mgr.all_steps() == [1, 2]


def test_a_compressed_entry_claiming_too_much_is_corrupt_even_when_memory_is_short(
        templates, tmp_path, monkeypatch):
    """With too little memory, a compressed entry whose frame decodes to less than its
    declared shape is found corrupt (and skipped) from its frame header alone."""
    d = tmp_path / "run"
    shutil.copytree(templates["zstd"], d)
    huge_shape_zstd(d)
    monkeypatch.setattr(reader_mod, "available_memory", lambda: 10**9)
    with open_mgr(d, read_only=True) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="decodes to 4000 bytes"):
            mgr.load(step=2)
        with pytest.warns(UserWarning, match=step_name(2)):
            assert mgr.load()["v"] == state_of(1)["v"]


@pytest.mark.timeout(60)
def test_a_fifo_manifest_is_not_listed_and_never_blocks_a_reader(templates, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(templates["raw"], d)
    os.unlink(os.path.join(ck(d), "manifest.json"))
    os.mkfifo(os.path.join(ck(d), "manifest.json"))
    storage = LocalStorage(str(d), create=False)
    with pytest.raises(pitstop.CorruptCheckpointError, match="FIFO"):
        CheckpointReader(storage, step_name(2))
    with open_mgr(d, read_only=True) as mgr:
        assert mgr.all_steps() == [1]  # without a manifest file it is not committed


def test_a_symlink_inside_the_checkpoint_is_still_read(templates, tmp_path):
    """Only links that leave the checkpoint are refused: one data file linked to another
    name inside it (a copy tool's doing) reads as before."""
    d = tmp_path / "run"
    shutil.copytree(templates["raw"], d)
    p = data_file(d)
    os.rename(p, os.path.join(ck(d), "elsewhere.bin"))
    os.symlink("elsewhere.bin", p)
    with open_mgr(d, read_only=True) as mgr:
        np.testing.assert_array_equal(mgr.load()["w"], state_of(2)["w"])


@pytest.mark.parametrize("name", ["../x.bin", "/etc/passwd", "a/b.bin", "x\x00.bin", ".."])
def test_file_names_are_plain_names_inside_the_checkpoint(templates, tmp_path, name):
    d = tmp_path / "run"
    shutil.copytree(templates["raw"], d)

    def fn(doc):
        old = next(iter(doc["files"]))
        doc["files"][name] = doc["files"].pop(old)
        doc["arrays"]["w"]["file"] = name
    edit(d, fn)
    with pytest.raises(pitstop.CorruptCheckpointError, match="plain file name") as info:
        CheckpointReader(LocalStorage(str(d), create=False), step_name(2))
    assert info.value.file == name
