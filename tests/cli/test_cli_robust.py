"""The `pitstop` command never prints a traceback (issue 9.8).

Every command runs over every broken directory we could think of; each must end with a sane
exit status (0 fine, 1 only for a checkpoint that fails verification, 2 anything else) and,
when it fails, one ``pitstop: ...`` line per problem on stderr. Then the cases users
reported, one by one, with the message they should see.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from entry_point import run_commands

import pitstop
from pitstop.cli import build_parser, main
from pitstop.core.directory.names import step_name
from pitstop.core.runtime.host import boot_id
from pitstop.core.save import memtier

COMMANDS: list[tuple[str, ...]] = [
    ("ls",),
    ("inspect",),
    ("inspect", "--json"),
    ("verify",),
    ("verify", "--all"),
    ("gc",),
    ("gc", "--dry-run"),
]
ROOT = Path(__file__).resolve().parents[2]


# ====================================================================== helpers
@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A healthy directory: checkpoints of steps 10 and 20 (memory tier off)."""
    d = tmp_path_factory.mktemp("template") / "run"
    with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None) as mgr:
        for step in (10, 20):
            mgr.save(
                step,
                {"w": np.arange(16.0) * step, "epoch": step // 10},
                metrics={"loss": 1.0 / step},
            ).wait()
    return d


def run(capsys, *argv: object) -> tuple[int, str, str]:
    rc = main([os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def ck(d: Path, step: int) -> Path:
    return d / step_name(step)


def directory_id(d: Path) -> str:
    return json.loads((d / ".pitstop" / "directory.json").read_text())["directory_id"]


def tier_name(shm: Path, d: Path, ident: str | None = None) -> str:
    """``pitstop-<directory_id>-<8 hex of sha1(realpath)>``: the memory-tier files' stem."""
    ident = ident or directory_id(d)
    where = hashlib.sha1(os.path.realpath(d).encode()).hexdigest()[:8]
    name = f"pitstop-{ident}-{where}"
    assert os.path.basename(memtier.MemoryTier(str(shm), str(d), ident).prefix) == name
    return name


def tier_meta(d: Path, **fields) -> dict:
    meta = {
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "directory": os.path.realpath(d),
        "directory_id": directory_id(d),
        "step": 30,
        "committed": False,
        # a well-formed description of a snapshot of one float64 array of 8 elements
        "layout": {"total": 64, "group_starts": [0], "arrays": [["w", "<f8", [8], 0, 64]]},
        "values": {},
        "structure": {},
        "hashes": None,
    }
    meta.update(fields)
    return meta


def write_tier(shm: Path, d: Path, slot: int, meta: object, *, raw: bytes | None = None) -> None:
    name = tier_name(shm, d)
    (shm / f"{name}-{slot}.buf").write_bytes(b"\0" * 64)
    (shm / f"{name}-{slot}.json").write_bytes(raw if raw is not None else json.dumps(meta).encode())


def v10_manifest(d: Path, step: int, **changes) -> None:
    """Rewrite a manifest as an unsealed format 1.0 one (no manifest_hash) with ``changes``:
    the only way to get odd field values past the seal of format 1.1."""
    path = ck(d, step) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_hash", None)
    doc["format_version"] = "1.0"
    doc.update(changes)
    path.write_text(json.dumps(doc))


# ====================================================================== broken directories
# Each builder gets a healthy copy ``d`` of the template, the memory-tier root ``shm`` and a
# scratch directory ``outside``; it breaks something and returns the DIR argument.
Builder = Callable[[Path, Path, Path], Path]
BROKEN: dict[str, Builder] = {}


def broken(fn: Builder) -> Builder:
    BROKEN[fn.__name__] = fn
    return fn


@broken
def missing(d, shm, outside):
    return d.parent / "no-such-dir"


@broken
def missing_parent_is_a_file(d, shm, outside):
    (d.parent / "afile").write_text("x")
    return d.parent / "afile" / "run"


@broken
def a_regular_file(d, shm, outside):
    (d.parent / "notes.txt").write_text("not a directory")
    return d.parent / "notes.txt"


@broken
def a_dangling_symlink(d, shm, outside):
    os.symlink(d.parent / "gone", d.parent / "link")
    return d.parent / "link"


@broken
def a_single_checkpoint_given(d, shm, outside):
    return ck(d, 20)


@broken
def empty_dir(d, shm, outside):
    e = d.parent / "empty"
    e.mkdir()
    return e


@broken
def without_pitstop_dir(d, shm, outside):
    shutil.rmtree(d / ".pitstop")
    return d


@broken
def pitstop_dir_is_a_file(d, shm, outside):
    shutil.rmtree(d / ".pitstop")
    (d / ".pitstop").write_text("x")
    return d


@broken
def directory_json_list(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_text("[1, 2]")
    return d


@broken
def directory_json_invalid(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_text('{"directory_id": ')
    return d


@broken
def directory_json_binary(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_bytes(b"\xff\xfe\x00\x01garbage\x80")
    return d


@broken
def directory_json_deeply_nested(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_text("[" * 200_000)
    return d


@broken
def directory_json_null_id(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_text('{"directory_id": null}')
    return d


@broken
def directory_json_id_with_glob_and_slash(d, shm, outside):
    (d / ".pitstop" / "directory.json").write_text('{"directory_id": "*/../*"}')
    (shm / "pitstop-victim-0.buf").write_bytes(b"keep me")
    return d


@broken
def directory_json_is_a_directory(d, shm, outside):
    (d / ".pitstop" / "directory.json").unlink()
    (d / ".pitstop" / "directory.json").mkdir()
    return d


@broken
def index_json_list(d, shm, outside):
    (d / ".pitstop" / "index.json").write_text("[1, 2]")
    return d


@broken
def index_json_invalid(d, shm, outside):
    (d / ".pitstop" / "index.json").write_text("{not json")
    return d


@broken
def index_json_binary(d, shm, outside):
    (d / ".pitstop" / "index.json").write_bytes(os.urandom(64) + b"\xff")
    return d


@broken
def lock_is_a_directory(d, shm, outside):
    lock = d / ".pitstop" / "lock"
    if lock.exists():
        lock.unlink()
    lock.mkdir()
    return d


@broken
def manifest_invalid_json(d, shm, outside):
    (ck(d, 20) / "manifest.json").write_text("{not json")
    return d


@broken
def manifest_truncated(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return d


@broken
def manifest_empty(d, shm, outside):
    (ck(d, 20) / "manifest.json").write_bytes(b"")
    return d


@broken
def manifest_not_utf8(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"loss"', b'"lo\xff\xfe"'))
    return d


@broken
def manifest_binary(d, shm, outside):
    (ck(d, 20) / "manifest.json").write_bytes(bytes(range(256)) * 4)
    return d


@broken
def manifest_json_list(d, shm, outside):
    (ck(d, 20) / "manifest.json").write_text("[1, 2]")
    return d


@broken
def manifest_deeply_nested(d, shm, outside):
    (ck(d, 20) / "manifest.json").write_text("[" * 200_000)
    return d


@broken
def manifest_symlink_outside(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    target = outside / "manifest.json"
    target.write_bytes(path.read_bytes())  # a valid manifest, but not inside the checkpoint
    path.unlink()
    path.symlink_to(target)
    return d


@broken
def manifest_symlink_inside(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    data_file = next(p for p in ck(d, 20).iterdir() if p.name != "manifest.json")
    path.unlink()
    path.symlink_to(data_file.name)  # binary data where the manifest should be
    return d


@broken
def manifest_symlink_to_another_checkpoint(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    path.unlink()
    path.symlink_to(ck(d, 10) / "manifest.json")
    return d


@broken
def manifest_symlink_dangling(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    path.unlink()
    path.symlink_to(outside / "nothing-here.json")
    return d


@broken
def manifest_symlink_loop(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    path.unlink()
    path.symlink_to("manifest.json")
    return d


@broken
def manifest_is_a_directory(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    path.unlink()
    path.mkdir()
    return d


@broken
def manifest_missing(d, shm, outside):
    (ck(d, 20) / "manifest.json").unlink()
    return d


@broken
def manifest_v10_bad_fields(d, shm, outside):
    v10_manifest(
        d,
        20,
        created_unix=1e300,
        hash_algorithm="no-such-hash",
        writer={"pitstop": None},
        metrics={"loss": {"$float": "nan"}},
    )
    return d


@broken
def manifest_v10_nan_time(d, shm, outside):
    path = ck(d, 20) / "manifest.json"
    v10_manifest(d, 20)
    path.write_text(path.read_text().replace('"created_unix": ', '"created_unix": NaN, "x": '))
    return d


@broken
def data_file_missing(d, shm, outside):
    for p in ck(d, 20).iterdir():
        if p.name != "manifest.json":
            p.unlink()
    return d


@broken
def data_file_is_a_directory(d, shm, outside):
    for p in ck(d, 20).iterdir():
        if p.name != "manifest.json":
            p.unlink()
            p.mkdir()
    return d


@broken
def checkpoint_is_a_file(d, shm, outside):
    shutil.rmtree(ck(d, 20))
    ck(d, 20).write_text("a file where a checkpoint should be")
    return d


@broken
def every_checkpoint_is_a_file(d, shm, outside):
    for step in (10, 20):
        shutil.rmtree(ck(d, step))
        ck(d, step).write_text("x")
    return d


@broken
def unpadded_step_name(d, shm, outside):
    shutil.copytree(ck(d, 20), d / "step_5")
    return d


@broken
def only_unpadded_step_names(d, shm, outside):
    shutil.move(ck(d, 10), d / "step_10")
    shutil.move(ck(d, 20), d / "step_0020")
    return d


@broken
def moved_aside(d, shm, outside):
    shutil.copytree(ck(d, 20), d / f"{step_name(30)}.corrupt-1700000000-ab12")
    shutil.copytree(ck(d, 20), d / f"{step_name(40)}.abandoned-1700000001-cd34")
    return d


@broken
def entry_name_not_utf8(d, shm, outside):
    (d / os.fsdecode(b"step_\xff\xfe")).write_text("x")
    (d / os.fsdecode(b"\xe9t\xe9")).mkdir()
    return d


@broken
def tmp_leftover_is_a_file_or_link(d, shm, outside):
    (d / ".tmp-step_0000000030-1a2b3c4d").write_text("x")
    (d / ".tmp-step_0000000040-2a2b3c4d").symlink_to(outside)
    return d


@broken
def meta_tmp_is_a_directory(d, shm, outside):
    (d / ".pitstop" / "index.json.tmp-1a2b3c4d").mkdir()
    return d


@broken
def memtier_step_null(d, shm, outside):
    write_tier(shm, d, 0, tier_meta(d, step=None))
    return d


@broken
def memtier_step_not_a_number(d, shm, outside):
    write_tier(shm, d, 0, tier_meta(d, step="thirty"))
    write_tier(shm, d, 1, tier_meta(d, step=True))
    write_tier(shm, d, 2, tier_meta(d, step=[1]))
    return d


@broken
def memtier_fields_missing(d, shm, outside):
    write_tier(shm, d, 0, {})
    write_tier(shm, d, 1, {"step": 99})
    return d


@broken
def memtier_fields_wrong_types(d, shm, outside):
    write_tier(
        shm,
        d,
        0,
        tier_meta(d, host=None, boot_id=5, directory=["x"], directory_id={}, committed="no"),
    )
    return d


@broken
def memtier_description_not_a_dict(d, shm, outside):
    write_tier(shm, d, 0, [1, 2])
    write_tier(shm, d, 1, None)
    write_tier(shm, d, 2, "step")
    return d


@broken
def memtier_description_garbage(d, shm, outside):
    write_tier(shm, d, 0, None, raw=b"{not json")
    write_tier(shm, d, 1, None, raw=b"\xff\xfe\x80binary")
    write_tier(shm, d, 2, None, raw=b"[" * 200_000)
    return d


@broken
def memtier_description_is_a_directory(d, shm, outside):
    name = tier_name(shm, d)
    (shm / f"{name}-0.json").mkdir()
    (shm / f"{name}-0.buf").write_bytes(b"\0")
    (shm / f"{name}-1.buf").mkdir()
    (shm / f"{name}-1.json").write_text(json.dumps(tier_meta(d, step=99)))
    return d


@broken
def memtier_recoverable_and_lookalikes(d, shm, outside):
    name = tier_name(shm, d)
    write_tier(shm, d, 0, tier_meta(d, step=99))
    for odd in ("0.buf.bak", "notes.txt", "1.json~", "0.bufx", "x-0.buf", "-0.buf", "0.buf.tmp.1"):
        (shm / f"{name}-{odd}").write_text("not pitstop's")
    return d


CASES = sorted(BROKEN)


@pytest.fixture
def world(tmp_path, template) -> Iterator[tuple[Path, Path, Path]]:
    d = tmp_path / "run"
    shutil.copytree(template, d, symlinks=True)
    shm = tmp_path / "shm"
    shm.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    yield d, shm, outside


def _check(cmd: tuple[str, ...], rc: int, out: str, err: str) -> None:
    what = f"pitstop {' '.join(cmd)}: rc={rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in out + err, what
    assert "internal error" not in err, what  # the last-resort handler must not be needed
    assert rc in (0, 1, 2), what
    if rc == 1:  # reserved for a checkpoint that fails verification
        assert cmd[0] in ("verify", "inspect"), what
    if rc != 0:
        lines = err.splitlines()
        assert lines, what
        assert all(line.startswith("pitstop: ") for line in lines), what
    if cmd == ("inspect", "--json") and rc != 0:
        assert out == "", what  # nothing half-printed


@pytest.mark.parametrize("case", CASES)
def test_every_command_over_every_broken_directory(case, world, capsys):
    d, shm, outside = world
    target = BROKEN[case](d, shm, outside)
    for cmd in COMMANDS:
        extra = ("--memory-tier", shm) if cmd[0] == "gc" else ()
        rc, out, err = run(capsys, cmd[0], target, *cmd[1:], *extra)
        _check(cmd, rc, out, err)
    # look-alikes and other directories' files are never touched
    assert (
        shm / "pitstop-victim-0.buf"
    ).exists() or case != "directory_json_id_with_glob_and_slash"


def test_every_command_as_a_subprocess_prints_no_traceback(world):
    """The console entry point itself (stdout not a terminal, a non-UTF-8 name to print,
    an ASCII locale), every command run by ``python -m pitstop.cli``'s own code (in one
    interpreter: tests/cli/entry_point.py)."""
    d, shm, outside = world
    entry_name_not_utf8(d, shm, outside)
    manifest_not_utf8(d, shm, outside)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LC_ALL": "C", "PYTHONIOENCODING": "ascii"}
    argvs = [[cmd[0], str(d), *cmd[1:], *(["--memory-tier", str(shm)] if cmd[0] == "gc" else [])]
             for cmd in COMMANDS]
    # a bad argument: one line naming the subcommand; a forced progress bar on an ASCII
    # stderr: drawn in ASCII, and the verdict lines unchanged
    more = [(["inspect", str(d), "--step", "x"], 2),
            (["verify", str(d), "--all", "--progress"], 1)]
    results = run_commands(argvs + [argv for argv, _ in more], env=env)
    for cmd, (rc, out, err) in zip(COMMANDS, results, strict=False):
        _check(cmd, rc, out, err)
    for (argv, code), (rc, out, err) in zip(more, results[len(argvs):], strict=True):
        assert "Traceback" not in out + err and rc == code, (argv, rc, out, err)
        if code == 2:
            assert out == "" and err == (
                "pitstop inspect: --step: invalid int value: 'x'; see `pitstop inspect "
                "--help`\n")
        else:
            assert "100%" in err and "\\u" not in err
            assert "pitstop: " in err.splitlines()[-1], err  # (after the bar)
            assert all(ln.startswith("step ") for ln in out.splitlines()[:-1]), out


# ====================================================================== the reported cases
def test_a_regular_file_is_not_a_directory(world, capsys):
    d, shm, outside = world
    target = a_regular_file(d, shm, outside)
    for cmd in COMMANDS:
        rc, out, err = run(capsys, cmd[0], target, *cmd[1:])
        assert rc == 2 and out == ""
        assert (
            err == f"pitstop: {target}: not a directory (a regular file); give the "
            "checkpoint directory, the one that holds .pitstop/ and the step_* checkpoints\n"
        )
    rc, _, err = run(capsys, "ls", d.parent / "no-such-dir")
    assert rc == 2 and "no such directory" in err


def test_a_single_checkpoint_given_is_read_and_gc_names_its_parent(world, capsys):
    d, *_ = world
    rc, out, err = run(capsys, "verify", ck(d, 20))
    assert rc == 0 and "step 20: ok" in out, err
    rc, _, err = run(capsys, "gc", ck(d, 20), "--dry-run")
    assert rc == 2 and f"give the directory that holds it: pitstop gc {d}" in err, err


def test_empty_directory_and_one_without_pitstop(world, capsys):
    d, shm, outside = world
    e = empty_dir(d, shm, outside)
    rc, out, _ = run(capsys, "ls", e)
    assert rc == 0 and "0 checkpoints" in out and "not a pitstop checkpoint directory" in out
    rc, _, err = run(capsys, "inspect", e)
    assert rc == 2 and "no committed checkpoint" in err
    rc, _, err = run(capsys, "gc", e, "--memory-tier", shm)
    assert rc == 2 and "not a pitstop checkpoint directory (no .pitstop/ inside)" in err


@pytest.mark.parametrize(
    "case",
    [
        "manifest_symlink_outside",
        "manifest_symlink_inside",
        "manifest_not_utf8",
        "manifest_truncated",
        "manifest_deeply_nested",
    ],
)
def test_a_bad_manifest_fails_verification_and_inspect(case, world, capsys):
    d, shm, outside = world
    BROKEN[case](d, shm, outside)
    rc, out, _ = run(capsys, "verify", d, "--all")
    assert rc == 1 and "step 10: ok" in out
    assert "step 20: CORRUPT" in out or "step 20: UNREADABLE" in out
    for args in (("inspect",), ("inspect", "--json")):
        rc, out, err = run(capsys, args[0], d, *args[1:])
        assert rc == 1 and out == "" and err.startswith("pitstop: ") and "step_0000000020" in err
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0 and "unreadable" in out
    # the healthy older one still inspects
    rc, out, _ = run(capsys, "inspect", d, "--step", "10", "--json")
    assert rc == 0 and json.loads(out)["step"] == 10


def test_symlinked_manifest_outside_is_named(world, capsys):
    d, shm, outside = world
    manifest_symlink_outside(d, shm, outside)
    rc, out, err = run(capsys, "inspect", d, "--json")
    assert rc == 1 and out == "" and "points outside checkpoint" in err


def test_inspect_json_validates_before_printing(world, capsys):
    d, shm, outside = world
    path = ck(d, 20) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["step"] = 21  # valid JSON, but the seal no longer matches
    path.write_text(json.dumps(doc))
    rc, out, err = run(capsys, "inspect", d, "--json")
    assert rc == 1 and out == "" and "manifest hash mismatch" in err
    # a manifest that is not UTF-8 (yet a JSON parser could read as UTF-16) is refused too
    v10_manifest(d, 10)
    p10 = ck(d, 10) / "manifest.json"
    p10.write_bytes(p10.read_text().encode("utf-16"))
    rc, out, err = run(capsys, "inspect", d, "--step", "10", "--json")
    assert rc == 1 and out == "" and "UTF-8" in err


def test_inspect_json_prints_the_raw_bytes(world, capsys):
    d, *_ = world
    rc, out, _ = run(capsys, "inspect", d, "--json")
    assert rc == 0
    assert out == (ck(d, 20) / "manifest.json").read_text() + "\n"


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "8M") -> Iterator[None]:
    """A small tmpfs at ``path`` (skips the test where mounting is not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount_ro(path: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")


def test_gc_on_a_read_only_directory(tmp_path, template, capsys):
    mnt = tmp_path / "ro"
    shm = tmp_path / "shm"
    shm.mkdir()
    with tmpfs(mnt):
        d = mnt / "run"
        shutil.copytree(template, d)
        (d / ".tmp-step_0000000030-1a2b3c4d").mkdir()
        _remount_ro(mnt)
        rc, out, err = run(capsys, "gc", d, "--memory-tier", shm)
        assert rc == 2 and out == ""
        assert err.startswith(f"pitstop: {d}: ") and "read-only file system" in err
        assert err.count("\n") == 1
        # a dry run still lists, and says why nothing could be removed anyway
        rc, out, err = run(capsys, "gc", d, "--dry-run", "--memory-tier", shm)
        assert rc == 0 and "would remove .tmp-step_0000000030-1a2b3c4d" in out
        assert "read-only" in out
        # reading works as before
        assert run(capsys, "verify", d, "--all")[0] == 0
        assert run(capsys, "ls", d)[0] == 0


def test_gc_reports_memory_tier_files_it_could_not_remove(world, capsys):
    d, _, outside = world
    shm = outside / "shm"
    with tmpfs(shm):
        write_tier(shm, d, 0, tier_meta(d, step=None))
        _remount_ro(shm)
        rc, out, err = run(capsys, "gc", d, "--memory-tier", shm)
        assert rc == 2 and "could not remove" in err and "read-only file system" in err.lower()
        assert (shm / f"{tier_name(shm, d)}-0.json").exists()


def test_gc_with_an_unreadable_directory_json_leaves_the_memory_tier_alone(world, capsys):
    d, shm, outside = world
    write_tier(shm, d, 0, tier_meta(d, step=None))
    (d / ".tmp-step_0000000030-1a2b3c4d").mkdir()
    (d / ".pitstop" / "directory.json").write_text("[1, 2]")
    rc, out, err = run(capsys, "gc", d, "--memory-tier", shm)
    assert rc == 2 and "removed .tmp-step_0000000030-1a2b3c4d" in out
    assert err.startswith(f"pitstop: {d}/.pitstop/directory.json: ") and "left alone" in err
    assert len(list(shm.iterdir())) == 2


def test_gc_memory_tier_step_null_is_stale(world, capsys):
    d, shm, outside = world
    memtier_step_null(d, shm, outside)
    write_tier(shm, d, 1, tier_meta(d, step=99))  # recoverable: kept
    name = tier_name(shm, d)
    rc, out, _ = run(capsys, "gc", d, "--memory-tier", shm)
    assert rc == 0 and "snapshot of step 99" in out
    assert sorted(p.name for p in shm.iterdir()) == [f"{name}-1.buf", f"{name}-1.json"]


def test_gc_memory_tier_leaves_look_alikes(world, capsys):
    d, shm, outside = world
    name = tier_name(shm, d)
    odd = [
        f"{name}-{s}"
        for s in (
            "0.buf.bak",
            "notes.txt",
            "1.json~",
            "0.bufx",
            "x-0.buf",
            "-0.buf",
            "0.buf.tmp.1",
            "0.buf.tmp2",
            "0.buf.tmp",
            "0.json.tmp.x",
            "00x.buf",
        )
    ]
    for o in odd:
        (shm / o).write_text("not pitstop's")
    ours = [f"{name}-{s}" for s in ("0.buf", "0.json", "3.json.tmp", "12.buf")]
    (shm / ours[0]).write_bytes(b"\0" * 8)
    (shm / ours[1]).write_text(json.dumps(tier_meta(d, step=20, committed=True)))
    (shm / ours[2]).write_text("{")
    (shm / ours[3]).write_bytes(b"\0")
    rc, out, _ = run(capsys, "gc", d, "--memory-tier", shm, "--dry-run")
    assert rc == 0
    assert sorted(
        line.split()[-1] for line in out.splitlines() if "would remove /" in line
    ) == sorted(str(shm / o) for o in ours)
    assert run(capsys, "gc", d, "--memory-tier", shm)[0] == 0
    assert sorted(p.name for p in shm.iterdir()) == sorted(odd)


def test_gc_memory_tier_that_does_not_exist(world, capsys):
    d, _, outside = world
    rc, _, err = run(capsys, "gc", d, "--memory-tier", outside / "nope")
    assert rc == 2 and "--memory-tier" in err and "no such directory" in err


def test_gc_leaves_files_and_links_named_like_leftovers(world, capsys):
    # pitstop's leftovers in DIR are directories (.pitstop/'s are files): a file or a link
    # that merely has the name is not pitstop's, is listed as such and left alone
    d, shm, outside = world
    tmp_leftover_is_a_file_or_link(d, shm, outside)
    meta_tmp_is_a_directory(d, shm, outside)
    (d / ".tmp-step_0000000050-3a2b3c4d").mkdir()
    (d / ".pitstop" / "index.json.tmp-4a2b3c4d").write_text("{")
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0
    assert (
        "not pitstop's: .tmp-step_0000000030-1a2b3c4d, .tmp-step_0000000040-2a2b3c4d, "
        ".pitstop/index.json.tmp-1a2b3c4d (left alone)"
    ) in out
    rows = [ln for ln in out.splitlines() if "incomplete: interrupted" in ln]
    assert len(rows) == 2  # a save's (of step 50) and a .pitstop/ file's (no step)
    assert rows[0].split()[0] == "50" and ".tmp-step_0000000050-3a2b3c4d" in rows[0]
    assert rows[1].split()[0] == "-" and ".pitstop/index.json.tmp-4a2b3c4d" in rows[1]
    assert f"`pitstop gc {d}` removes it" in out
    rc, out, err = run(capsys, "gc", d, "--memory-tier", shm)
    assert rc == 0 and err == ""
    assert "removed .tmp-step_0000000050-3a2b3c4d" in out
    assert "removed .pitstop/index.json.tmp-4a2b3c4d" in out
    assert not (d / ".tmp-step_0000000050-3a2b3c4d").exists()
    assert not (d / ".pitstop" / "index.json.tmp-4a2b3c4d").exists()
    for n in (
        ".tmp-step_0000000030-1a2b3c4d",
        ".tmp-step_0000000040-2a2b3c4d",
        ".pitstop/index.json.tmp-1a2b3c4d",
    ):
        assert os.path.lexists(d / n) and n not in out
    assert outside.exists()  # a link's target is never followed


# ====================================================================== names
def test_unpadded_step_names_are_foreign(world, capsys):
    d, shm, outside = world
    unpadded_step_name(d, shm, outside)
    (d / "step_0000000030x").mkdir()
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0 and "2 checkpoints" in out
    assert "not pitstop's: step_0000000030x, step_5 (left alone;" in out
    rows = [line for line in out.splitlines() if line.lstrip("* ").split(" ")[0].isdigit()]
    assert [r.lstrip("* ").split()[0] for r in rows] == ["10", "20"]
    rc, _, err = run(capsys, "inspect", d, "--step", "5")
    assert rc == 2 and "no checkpoint of step 5" in err and "step_5 is not pitstop's" in err
    rc, out, _ = run(capsys, "verify", d, "--all")
    assert rc == 0 and "step 5" not in out
    rc, out, _ = run(capsys, "gc", d, "--memory-tier", shm)
    assert rc == 0 and (d / "step_5" / "manifest.json").exists()


def test_only_unpadded_names_means_no_checkpoint(world, capsys):
    d, shm, outside = world
    only_unpadded_step_names(d, shm, outside)
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0 and "0 checkpoints" in out and "not pitstop's: step_0020, step_10" in out
    for cmd in (("inspect",), ("verify",), ("verify", "--all")):
        rc, _, err = run(capsys, cmd[0], d, *cmd[1:])
        assert rc == 2 and "no committed checkpoint" in err


def test_ls_shows_moved_aside_checkpoints(world, capsys):
    d, shm, outside = world
    moved_aside(d, shm, outside)
    corrupt = f"{step_name(30)}.corrupt-1700000000-ab12"
    abandoned = f"{step_name(40)}.abandoned-1700000001-cd34"
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0 and "2 checkpoints" in out
    line = next(x for x in out.splitlines() if corrupt in x)
    assert line.split()[0] == "30" and "corrupt: moved aside" in line
    line = next(x for x in out.splitlines() if abandoned in x)
    assert line.split()[0] == "40" and "abandoned: moved aside" in line
    line = next(x for x in out.splitlines() if x.startswith("corrupt: "))
    assert "failing verification" in line and "never restores or deletes" in line \
        and "by hand" in line
    line = next(x for x in out.splitlines() if x.startswith("abandoned: "))
    assert "rolled back" in line and "never restores or deletes" in line and "by hand" in line
    assert "not pitstop's" not in out
    rc, out, _ = run(capsys, "verify", d, "--all")
    assert rc == 0 and "step 30" not in out and "step 40" not in out
    assert run(capsys, "gc", d, "--memory-tier", shm)[0] == 0
    assert (d / corrupt).exists() and (d / abandoned).exists()


def test_ls_shows_pitstop_named_entries_that_are_not_checkpoints(world, template, capsys):
    d, shm, outside = world
    checkpoint_is_a_file(d, shm, outside)
    (d / step_name(30)).mkdir()
    rc, out, _ = run(capsys, "ls", d)
    assert rc == 0 and "1 checkpoint" in out
    assert f"{step_name(20)}: a file, not a checkpoint directory" in out
    assert f"{step_name(30)}: no manifest.json" in out
    for case in ("manifest_symlink_loop", "manifest_symlink_dangling", "manifest_is_a_directory"):
        shutil.rmtree(d)
        shutil.copytree(template, d)
        BROKEN[case](d, shm, outside)
        rc, out, _ = run(capsys, "ls", d)
        assert rc == 0 and "1 checkpoint" in out, case
        assert f"{step_name(20)}: manifest.json is not a regular file" in out, case
        rc, out, _ = run(capsys, "verify", d, "--all")  # what a restore sees: only step 10
        assert rc == 0 and "step 10: ok" in out and "step 20" not in out, case


# ====================================================================== gc --help
def test_gc_help_says_what_it_deletes_and_what_never(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gc", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in (
        ".tmp-<name>-<8 hex>",
        ".pitstop/<file>.tmp-<8 hex>",
        "/dev/shm",
        "--drop-recoverable",
        "newer than the newest committed step",
        "never deletes",
        "committed",
        ".corrupt-",
        ".abandoned-",
        "whose name pitstop did not make",
    ):
        assert phrase in text, phrase


def test_names_come_from_core():
    import pitstop.cli.common as cli
    from pitstop.core.directory import names

    assert cli.Naming is names.Naming and cli.DEFAULT is names.DEFAULT
    assert not hasattr(cli, "_STEP") and not hasattr(cli, "_QUARANTINED")


def test_uuid_shaped_directory_id_is_used(world):
    d, *_ = world
    ident = directory_id(d)
    assert uuid.UUID(hex=ident)  # what the manager writes, and what gc accepts
