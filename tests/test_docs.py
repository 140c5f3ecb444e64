"""The documentation runs: every code block of README.md and docs/*.md is run or checked.

Rules the pages follow (and this file enforces). A fenced block's info string says what it is;
an info string not listed here fails the test, so a typo cannot switch a block off.

* ``python`` runs. The blocks of one page run in order, in one namespace, in a fresh
  temporary working directory. A block that raises fails the test, naming the page and the
  block's line.
* ``console`` runs too, in the same directory, after the blocks above it: each line that
  starts with ``$ `` is a command for bash (``pitstop`` and ``python`` on PATH, this
  checkout's ``pitstop`` imported); the lines after it, up to the next ``$ `` line, are its
  stdout and stderr together. ``...`` matches any text (also across lines, as doctest's
  ELLIPSIS); trailing whitespace is ignored. A last line ``[exit N]`` asserts the exit
  status; without one it must be 0.
  Each ``$ `` line runs in a new bash: one that only changes the shell (``cd``, ``export``,
  ``VAR=x``) fails; join it to the command that needs it.
* ``LANG excerpt=PATH`` (any LANG) is a piece of a file of the repository: its lines must
  occur in PATH, in order and one after another, compared without indentation and with runs
  of spaces as one; a line ``...`` skips any number of lines of the file.
* ``sh`` shows commands that take too long to run here (benchmarks, ``make``, ``torchrun``).
  Each line is checked: ``python FILE --options`` (FILE exists and names each ``--option``),
  ``make TARGET`` (the Makefile has the target), ``torchrun ... FILE`` (FILE exists).
* ``text output=PATH``: a recorded output of the program PATH (a benchmark, minutes long):
  each snake_case name in it (a scenario, a counter) occurs in PATH's directory's sources.
* ``text tree=DIR``: a directory listing of DIR (two spaces an indent level): every entry
  exists.
* ``text keys=PATH``: a fragment of a JSON document: every quoted ``"key":`` occurs in PATH
  (the manifest's JSON Schema).
* ``text diagram``: a drawing, not code (at most two per page).
* ``json`` parses, and must be the manifest of ``<!-- manifest: PATH -->`` right before it:
  the manifest the page's code wrote to ``PATH`` (apart from time, ids, host and pid).
* Hidden code, for what a block needs but a reader does not (a model class, a dataset, a
  manager opened elsewhere), sits in an HTML comment that GitHub does not render::

      <!-- setup
      code
      -->

  It runs at its place in the page, in the page's namespace. ``<!-- check ... -->`` is the
  same, placed after a block to assert what the block's comments claim.
* A block (or its setup) that imports torch runs only where torch imports.
* Code the rules above would not see fails the test: a ``~~~`` or four-backtick fence, one
  never closed or indented four spaces, an indented code block, an HTML comment other than
  setup, check and manifest (a typo would hide code that never runs), an excerpt with no
  lines, a redundant ``[exit 0]``, a block guarded by ``if __name__ == "__main__"`` (the
  page's namespace is not ``__main__``: its body would never run).

Relative links between pages must resolve (files and ``#anchors``), docs/index.md must link
every page, and every public name has a line in the quickstart (torch's in torch.md).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

import pitstop
from pitstop.core import adapter as registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_COMMENT = re.compile(r"<!--(?P<body>.*?)-->", re.S)
_TORCH = re.compile(r"^\s*(import torch\b|from torch\b|(import|from) pitstop\.adapters\.torch\b)",
                    re.M)
HAS_TORCH = importlib.util.find_spec("torch") is not None
#: a page that uses TensorFlow runs in a pytest process of its own: TensorFlow and the triton
#: that torch imports crash when one process loads both (see tests/conftest.py); so does a
#: page that uses JAX, which reads its device count (XLA_FLAGS) once per process
_TF = re.compile(r"^\s*(import tensorflow\b|import keras\b|from pitstop\.adapters\.tf\b)", re.M)
_JAX = re.compile(r"^\s*(import jax\b|from jax\b|from pitstop\.adapters\.jax\b)", re.M)
HAS_TF = importlib.util.find_spec("tensorflow") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
#: the host devices a JAX page sees (its sharding examples use a mesh of them)
JAX_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
#: manifest members that differ on every save (time, identity, writer, the self-hash)
VOLATILE = ("created_unix", "directory_id", "writer", "manifest_hash")


@dataclass
class Item:
    kind: str  # "run", "console", "hidden", "manifest", "json", or a checked kind (SHOWN)
    line: int
    code: str = ""
    arg: str = ""


#: blocks that are shown, not run: each is checked against the file it names
SHOWN = {"excerpt", "sh", "output", "tree", "keys", "diagram"}
_TEXT_KINDS = ("output", "tree", "keys")


def _kind(info: list[str], where: str) -> tuple[str, str]:
    """What a fenced block with this info string is: (kind, argument); raises on anything else."""
    lang, words = (info[0] if info else ""), info[1:]
    if len(words) == 1 and words[0].startswith("excerpt="):
        return "excerpt", words[0].split("=", 1)[1]
    if lang == "python" and not words:
        return "run", ""
    if lang == "console" and not words:
        return "console", ""
    if lang == "json" and not words:
        return "json", ""
    if lang == "sh" and not words:
        return "sh", ""
    if lang == "text" and words == ["diagram"]:
        return "diagram", ""
    if lang == "text" and len(words) == 1 and words[0].split("=")[0] in _TEXT_KINDS \
            and "=" in words[0]:
        kind, arg = words[0].split("=", 1)
        return kind, arg
    raise AssertionError(
        f"{where}: unknown info string ```{' '.join(info)}: use ```python, ```console, "
        "```LANG excerpt=PATH, ```sh, ```json (after a manifest comment), or ```text with "
        "output=PATH, tree=DIR, keys=PATH or diagram (see tests/test_docs.py)")


def items(page: Path) -> list[Item]:
    """The page's blocks and test comments, in page order."""
    text = page.read_text()
    found: list[tuple[int, Item]] = []
    fences = list(_FENCE.finditer(text))
    spans = [(m.start(), m.end()) for m in fences]
    for m in fences:
        line = text.count("\n", 0, m.start()) + 1
        info = m.group("info").strip().split()
        body = _dedent(m.group("body"), len(m.group("indent")))
        kind, arg = _kind(info, f"{page.name}:{line}")
        if kind == "run" and re.search(r"""__name__\s*==\s*["']__main__""", body):
            # the page's namespace is not __main__: the guarded code would never run
            raise AssertionError(f"{page.name}:{line}: a block with `if __name__ == "
                                 "\"__main__\"`: the test would skip its body; call it")
        found.append((m.start(), Item(kind, line + 1, body, arg)))
    comments = []
    inline = [(m.start(), m.end()) for m in re.finditer(r"`[^`\n]+`", text)
              if not any(a <= m.start() < b for a, b in spans)]
    for m in _COMMENT.finditer(text):
        if any(a <= m.start() < b for a, b in spans + inline):
            continue  # a comment inside a code block or `inline code` is code
        comments.append((m.start(), m.end()))
        body = m.group("body")
        line = text.count("\n", 0, m.start()) + 1
        head, _, rest = body.lstrip(" ").partition("\n")
        word = head.split(":")[0].strip()
        if word in ("setup", "check") and head.strip() == word:
            found.append((m.start(), Item("hidden", line + 1, rest)))
        elif word == "manifest" and ":" in head:
            found.append((m.start(), Item("manifest", line, arg=head.split(":", 1)[1].strip())))
        else:
            # a typo (`<!-- stup`, `<!-- setup x = 1 -->`) would hide code that never runs
            raise AssertionError(
                f"{page.name}:{line}: an HTML comment that is not `<!-- setup` or `<!-- check` "
                "(then a line break and code) or `<!-- manifest: PATH -->`: it hides text "
                "that nothing checks")
    _untested_code(page, text, spans + comments)
    return [it for _, it in sorted(found, key=lambda t: t[0])]


_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")


def _untested_code(page: Path, text: str, spans: list[tuple[int, int]]) -> None:
    """Code the fence pattern above does not see is code no test runs or checks: a ~~~ or
    ```` fence, an unclosed fence, a fence indented four spaces, an indented code block."""
    blank = "".join(ch if ch == "\n" else " " for ch in text)
    rest = "".join(blank[a:b] if any(s <= a < e for s, e in spans) else text[a:b]
                   for a, b in _pieces(text, spans))
    lines = rest.split("\n")
    context = ""  # the last line that is not blank and not indented four spaces
    for i, ln in enumerate(lines):
        where = f"{page.name}:{i + 1}"
        if re.match(r"^\s*(```|~~~)", ln):
            raise AssertionError(
                f"{where}: a code fence the test does not read (~~~, four backticks, indented "
                "four spaces, or never closed): use ```INFO ... ``` at the start of the line")
        if re.match(r"^( {4,}|\t)\S", ln) and i and not lines[i - 1].strip() \
                and not _LIST_ITEM.match(context):
            raise AssertionError(
                f"{where}: an indented code block (four spaces after a blank line) is code the "
                "test does not run or check: make it a fenced block (see tests/test_docs.py)")
        if ln.strip() and not re.match(r"^( {4,}|\t)", ln):
            context = ln


def _pieces(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``text`` cut at every start and end of ``spans``, in order."""
    cuts = sorted({0, len(text), *(a for a, _ in spans), *(b for _, b in spans)})
    return list(zip(cuts, cuts[1:], strict=False))


def _dedent(body: str, indent: int) -> str:
    return "".join(ln[indent:] if ln[:indent].isspace() else ln
                   for ln in body.splitlines(keepends=True))


def _uses_torch(code: str) -> bool:
    return bool(_TORCH.search(code))


def _run(page: Path, item: Item, ns: dict) -> None:
    code = "\n" * (item.line - 1) + item.code  # tracebacks point at the page's own lines
    try:
        exec(compile(code, str(page.relative_to(ROOT)), "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a block fail too
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
        pytest.fail(f"{page.relative_to(ROOT)}: the block at line {item.line} raised "
                    f"{type(e).__name__}: {e}\n{tb}", pytrace=False)


# ------------------------------------------------------------------------- console blocks
_EXIT = re.compile(r"^\[exit (?P<n>\d+)\]$")
_SHELL_STATE = re.compile(r"^\s*((cd|export|unset|set|source|alias|pushd|popd|ulimit|umask)\b"
                          r"|\.\s|\w+=\S*\s*$)")


def console_commands(code: str) -> list[tuple[int, str, str, int]]:
    """A console block's commands: (line offset in the block, command, expected output, status)."""
    out: list[tuple[int, str, str, int]] = []
    for i, ln in enumerate(code.splitlines()):
        if ln.startswith("$ "):
            if _SHELL_STATE.match(ln[2:]) and not re.search(r"&&|;|\|", ln):
                # each command runs in a bash of its own: a reader's shell keeps this, the
                # test's does not, and the commands after it would run differently
                raise AssertionError(
                    f"line {i + 1} of a console block: `{ln[2:]}` changes only the shell it runs "
                    "in, and each `$ ` line runs in a new one: join it to the command that "
                    "needs it (`cd d && ...`, `VAR=x pitstop ...`)")
            out.append((i, ln[2:], "", 0))
        elif not out:
            if ln.strip():
                raise AssertionError(f"line {i + 1} of a console block comes before any `$ ` line")
        else:
            j, cmd, exp, _ = out[-1]
            out[-1] = (j, cmd, exp + ln + "\n", 0)
    for k, (j, cmd, exp, _) in enumerate(out):
        lines = exp.rstrip().splitlines()
        m = _EXIT.match(lines[-1].strip()) if lines else None
        if m:
            if int(m.group("n")) == 0:
                raise AssertionError(f"line {j + 1} of a console block: `[exit 0]` is what a "
                                     "command without an `[exit N]` line asserts; drop it")
            out[k] = (j, cmd, "\n".join(lines[:-1]), int(m.group("n")))
    return out


def _normal(text: str) -> str:
    return "\n".join(ln.rstrip() for ln in text.splitlines()).strip("\n")


def output_matches(expected: str, got: str) -> bool:
    """doctest's ELLIPSIS: ``...`` in ``expected`` matches any text, also across lines; a
    line that is only ``...`` matches any number of whole lines, none included."""
    lines = _normal(expected).split("\n") if _normal(expected) else []
    pattern, started = "", False
    for i, ln in enumerate(lines):
        if ln == "...":
            if not started:
                pattern += r"(?:.*?\n)?" if i + 1 < len(lines) else ".*?"
            elif not pattern.endswith(r"(?:\n.*?)?"):
                pattern += r"(?:\n.*?)?"
            continue
        pattern += ("\n" if started else "") + ".*?".join(map(re.escape, ln.split("...")))
        started = True
    return re.fullmatch(pattern, _normal(got), re.S) is not None


def _console_env(bindir: Path) -> dict[str, str]:
    """`pitstop` is this checkout's command; `python` the interpreter running the tests."""
    shim = bindir / "pitstop"
    if not shim.exists():
        bindir.mkdir(parents=True, exist_ok=True)
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pitstop.cli "$@"\n')
        shim.chmod(0o755)
    env = dict(os.environ)
    for k in ("COLUMNS", "LINES"):
        env.pop(k, None)  # the command's tables are as wide as in a pipe
    env["PATH"] = os.pathsep.join([str(bindir), str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _console(page: Path, item: Item, bindir: Path) -> None:
    env = _console_env(bindir)
    for offset, cmd, expected, status in console_commands(item.code):
        r = subprocess.run(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, text=True, env=env, timeout=300)
        if r.returncode != status or not output_matches(expected, r.stdout):
            pytest.fail(f"{page.relative_to(ROOT)}:{item.line + offset}: $ {cmd}\n"
                        f"expected (exit {status}):\n{expected}\n"
                        f"got (exit {r.returncode}):\n{r.stdout}", pytrace=False)


# ------------------------------------------------------------------------- shown blocks
def _squash(line: str) -> str:
    return " ".join(line.split())


def excerpt_problem(code: str, path: str) -> str | None:
    """None when ``code``'s lines occur in the file ``path`` (see the module's docstring)."""
    src = ROOT / path
    if not src.is_file():
        return f"excerpt of {path}: no such file"
    have = [s for s in map(_squash, src.read_text().splitlines()) if s]
    if not [ln for ln in map(_squash, code.splitlines()) if ln and ln != "..."]:
        return f"excerpt of {path}: no lines to check"
    at, segment = 0, []
    for ln in [*map(_squash, code.splitlines()), "..."]:
        if ln != "...":
            segment += [ln] if ln else []
            continue
        if segment:
            found = next((i for i in range(at, len(have) - len(segment) + 1)
                          if have[i:i + len(segment)] == segment), None)
            if found is None:
                return (f"excerpt of {path}: these lines are not in it, in this order:\n"
                        + "\n".join(segment))
            at, segment = found + len(segment), []
    return None


def sh_problems(code: str) -> list[str]:
    """What is wrong with an ``sh`` block's command lines (see the module's docstring)."""
    import shlex
    bad = []
    for ln in code.splitlines():
        words = shlex.split(ln, comments=True)
        if not words:
            continue
        if words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1:
            script = ROOT / words[1]
            if not script.is_file():
                bad.append(f"{ln}: no file {words[1]}")
                continue
            src = script.read_text()
            bad += [f"{ln}: {words[1]} has no option {w.split('=')[0]}" for w in words[2:]
                    if w.startswith("--") and f'"{w.split("=")[0]}"' not in src]
        elif words[0] == "make":
            makefile = (ROOT / "Makefile").read_text()
            bad += [f"{ln}: the Makefile has no target {w}" for w in words[1:]
                    if not re.search(rf"^{re.escape(w)}\s*:", makefile, re.M)]
        elif words[0] == "torchrun":
            scripts = [w for w in words if w.endswith(".py")]
            if not scripts or not (ROOT / scripts[-1]).is_file():
                bad.append(f"{ln}: no script file")
        else:
            bad.append(f"{ln}: not a command the test can check (python FILE, make, torchrun); "
                       "make it a ```console block")
    return bad


_SNAKE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def _quoted(word: str, text: str) -> bool:
    return f'"{word}"' in text or f"'{word}'" in text


def _built(name: str, text: str) -> bool:
    """A counter the program names with an f-string: ``f"killed_in_{phase}"`` for
    ``killed_in_hash``, ``f"{kind}_{...}"`` with ``kind`` ``"swap"`` and ``'detected'``."""
    cuts = [i for i in range(1, len(name)) if name[i] == "_"]
    return any(name[:i + 1] + "{" in text or (_quoted(name[:i], text) and _quoted(name[i + 1:], text))
               for i in cuts)


def output_problems(code: str, path: str) -> list[str]:
    """Names in a recorded output that its program's sources do not have."""
    src = ROOT / path
    if not src.exists():
        return [f"output of {path}: no such file"]
    tree = src if src.is_dir() else src.parent
    text = "\n".join(f.read_text() for f in sorted(tree.rglob("*.py")))
    bad = []
    for name in sorted(set(_SNAKE.findall(code))):
        if name not in text and not _built(name, text):
            bad.append(f"output of {path}: {name!r} is in no source under {tree.relative_to(ROOT)}")
    return bad


def tree_problems(code: str, path: str) -> list[str]:
    """Entries of a directory listing that do not exist."""
    bad, stack = [], []
    base = ROOT / path
    if not base.is_dir():
        return [f"tree={path}: no such directory"]
    for ln in code.splitlines():
        if not ln.strip():
            continue
        depth = (len(ln) - len(ln.lstrip(" "))) // 2
        words = ln.split()
        names = words if all(re.fullmatch(r"[\w.]+\.py", w) for w in words) else words[:1]
        stack[depth:] = [names[0].rstrip("/")]
        if depth == 0:
            if names[0].rstrip("/") != base.name:
                bad.append(f"tree={path}: the listing starts with {names[0]}")
            continue
        for n in names:
            where = base.joinpath(*stack[1:-1], n.rstrip("/"))
            if not where.exists():
                bad.append(f"tree={path}: {where.relative_to(ROOT)} does not exist")
    return bad


def keys_problems(code: str, path: str) -> list[str]:
    src = ROOT / path
    if not src.is_file():
        return [f"keys={path}: no such file"]
    text = src.read_text()
    if not re.search(r'"([A-Za-z_][\w-]*)"\s*:', code):
        return [f"keys={path}: no \"key\": in the block, nothing to check"]
    return [f"keys={path}: no {k!r} in it" for k in re.findall(r'"([A-Za-z_][\w-]*)"\s*:', code)
            if not re.fullmatch(r"step_\d+", k)  # a checkpoint's name, not a key
            if f'"{k}"' not in text]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def shown_problems(page: Path) -> list[str]:
    """Every block that is shown, not run, checked against what it shows."""
    bad = []
    page_items = items(page)
    diagrams = 0
    for prev, it in zip([None, *page_items], page_items, strict=False):
        where = f"{_rel(page)}:{it.line}"
        if it.kind in SHOWN | {"console", "json"} and not it.code.strip():
            bad.append(f"{where}: an empty ```{it.kind} block shows and proves nothing")
        elif it.kind == "excerpt":
            problem = excerpt_problem(it.code, it.arg)
            bad += [f"{where}: {problem}"] if problem else []
        elif it.kind == "sh":
            bad += [f"{where}: {p}" for p in sh_problems(it.code)]
        elif it.kind == "output":
            bad += [f"{where}: {p}" for p in output_problems(it.code, it.arg)]
        elif it.kind == "tree":
            bad += [f"{where}: {p}" for p in tree_problems(it.code, it.arg)]
        elif it.kind == "keys":
            bad += [f"{where}: {p}" for p in keys_problems(it.code, it.arg)]
        elif it.kind == "diagram":
            diagrams += 1
        elif it.kind == "json" and (prev is None or prev.kind != "manifest"):
            bad.append(f"{where}: a ```json block is a manifest the page wrote (a "
                       "`<!-- manifest: PATH -->` comment right before it) or an excerpt")
        elif it.kind == "console":
            try:
                console_commands(it.code)
            except AssertionError as e:
                bad.append(f"{where}: {e}")
    if diagrams > 2:
        bad.append(f"{_rel(page)}: {diagrams} ```text diagram blocks; at most 2")
    return bad


def _check_manifest(page: Path, path: str, doc_text: str, line: int) -> None:
    where = f"{page.relative_to(ROOT)}:{line}"
    doc = json.loads(doc_text)
    real_path = Path(path) / "manifest.json"
    assert real_path.is_file(), f"{where}: the page's code wrote no {real_path}"
    real = json.loads(real_path.read_text())
    assert list(doc) == list(real), f"{where}: members differ: {list(doc)} vs {list(real)}"
    for k in VOLATILE:
        assert type(doc[k]) is type(real[k]), (where, k)
    for name, entry in real["files"].items():
        # a file written with O_DIRECT is padded to whole 4096-byte pages; written buffered
        # (a file system without O_DIRECT) it ends with its last array
        got = doc["files"].get(name, {}).get("length")
        padded = -(-entry["length"] // 4096) * 4096
        assert got in (entry["length"], padded), (where, name, got, entry["length"])
    assert list(doc["files"]) == list(real["files"]), where
    for k in real:
        if k not in VOLATILE and k != "files":
            assert doc[k] == real[k], f"{where}: {k!r} is {doc[k]!r}; pitstop wrote {real[k]!r}"


def _close_managers(ns: dict) -> None:
    for v in list(ns.values()):
        if isinstance(v, pitstop.CheckpointManager):
            try:
                v.close()
            except pitstop.CheckpointError:
                pass


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = page.read_text()
    own = _TF.search(text) or _JAX.search(text)
    if own and os.environ.get("PITSTOP_DOCS_PAGE") != page.name:
        if _TF.search(text) and not HAS_TF:
            pytest.skip(f"{page.name}: needs tensorflow")
        if _JAX.search(text) and not HAS_JAX:
            pytest.skip(f"{page.name}: needs jax")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"{Path(__file__).resolve()}::test_code_blocks_run[{page.name}]"],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
            env=dict(os.environ, PITSTOP_DOCS_PAGE=page.name,
                     **(JAX_ENV if _JAX.search(text) else {})))
        assert r.returncode == 0, f"{page.name} (own process):\n{r.stdout[-20000:]}\n{r.stderr[-3000:]}"
        return
    page_items = items(page)
    bindir = tmp_path / "bin"
    tmp_path = tmp_path / "page"
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": f"docs_{page.stem}"}
    pending_manifest: tuple[str, int] | None = None
    try:
        for item in page_items:
            if item.kind == "hidden":
                if _uses_torch(item.code) and not HAS_TORCH:
                    pytest.skip(f"{page.name}: needs torch from line {item.line}")
                _run(page, item, ns)
            elif item.kind == "run":
                if _uses_torch(item.code) and not HAS_TORCH:
                    pytest.skip(f"{page.name}: needs torch from line {item.line}")
                _run(page, item, ns)
            elif item.kind == "console":
                _console(page, item, bindir)
            elif item.kind == "manifest":
                pending_manifest = (item.arg, item.line)
            elif item.kind == "json":
                json.loads(item.code)  # every JSON example parses
                if pending_manifest is not None:
                    _check_manifest(page, pending_manifest[0], item.code, pending_manifest[1])
                    pending_manifest = None
        assert pending_manifest is None, f"{page.name}: a manifest comment without a json block"
    finally:
        _close_managers(ns)
        # adapters the page registered (its classes live in the page's namespace); the ones
        # pitstop registered meanwhile (torch's, imported on first use) stay
        registry._adapters[:] = [a for a in registry._adapters
                                 if not type(getattr(a, "inner", a)).__module__.startswith("docs_")]
        ns.clear()
        gc.collect()


def test_shown_blocks_match_their_sources() -> None:
    """Excerpts, command lines, recorded outputs, listings: each checked against its source."""
    bad = [p for page in PAGES for p in shown_problems(page)]
    assert not bad, "\n".join(bad)


def test_every_python_block_is_valid_python() -> None:
    """Every python block and hidden setup compiles, also on a page whose blocks are skipped
    (torch, TensorFlow or JAX missing); excerpts are checked against their files instead."""
    for page in PAGES:
        for it in items(page):
            if it.kind in ("run", "hidden"):
                compile("\n" * (it.line - 1) + it.code, page.name, "exec")


# ------------------------------------------------------------------------- links
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The page without fenced code blocks, inline code and HTML comments."""
    text = _FENCE.sub("", text)
    text = _COMMENT.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out: set[str] = set()
    for m in _HEADING.finditer(_FENCE.sub("", page.read_text())):
        # GitHub keeps `_` (save_every_steps); `*` and backticks go with the punctuation
        title = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group("title"))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n, base = 0, slug
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def test_anchors_are_githubs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# `save_every_steps` and *more*\n\n## From `torch.save` / `torch.load`\n\n"
                    "## A [link](x.md) here\n\n## A\n\n## A\n")
    assert anchors(page) == {"save_every_steps-and-more", "from-torchsave--torchload",
                             "a-link-here", "a", "a-1"}


def test_relative_links_resolve() -> None:
    bad = []
    for page in PAGES:
        for m in _LINK.finditer(_prose(page.read_text())):
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


def test_named_files_and_tests_exist() -> None:
    """A file of the repository or a test named in `inline code` (the README's proofs name
    tests) exists: a renamed test or file cannot leave a claim pointing at nothing."""
    sources = "\n".join(f.read_text() for d in ("tests", "pitstop/testing")  # the shipped suite
                         for f in (ROOT / d).rglob("*.py"))
    bad = []
    for page in PAGES:
        text = _COMMENT.sub("", _FENCE.sub("", page.read_text()))
        for m in re.finditer(r"`((?:tests|benchmarks|pitstop|examples)/[^`\s:]+)[^`]*`", text):
            if not (ROOT / m.group(1)).exists():
                bad.append(f"{page.name}: {m.group(1)} does not exist")
        for m in re.finditer(r"`(test_\w+)`", text):
            if not re.search(rf"^\s*(async )?def {m.group(1)}\b", sources, re.M):
                bad.append(f"{page.name}: no test {m.group(1)} under tests/")
    assert not bad, "\n".join(bad)


def test_index_lists_every_page() -> None:
    index = _prose((DOCS / "index.md").read_text())
    linked = {m.group("target").partition("#")[0] for m in _LINK.finditer(index)}
    pages = {p.name for p in DOCS.iterdir() if p.is_file() and p.name != "index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"


def test_public_names_are_documented() -> None:
    """Every public name has a line in the quickstart; the torch ones in torch.md."""
    quick = (DOCS / "quickstart.md").read_text()
    missing = [n for n in pitstop.__all__ if n != "__version__" and n not in quick]
    assert not missing, f"docs/quickstart.md never mentions {missing}"
    if HAS_TORCH:
        import pitstop.adapters.torch as pt
        page = (DOCS / "torch.md").read_text()
        internal = {"TensorLeaf", "numpy_dtype", "torch_dtype"}  # adapter-writer helpers
        missing = [n for n in pt.__all__ if n not in internal and n not in page]
        assert not missing, f"docs/torch.md never mentions {missing}"
    # the TensorFlow names, read from the source (importing TensorFlow here would put it in
    # the same process as torch; see tests/conftest.py)
    tf_all = _literal_all(ROOT / "pitstop" / "adapters" / "tf" / "__init__.py")
    page = (DOCS / "tf.md").read_text()
    missing = [n for n in tf_all if n not in {"VariableLeaf"} and n not in page]
    assert not missing, f"docs/tf.md never mentions {missing}"
    keras_all = _literal_all(ROOT / "pitstop" / "adapters" / "keras" / "__init__.py")
    page = (DOCS / "keras.md").read_text()
    missing = [n for n in keras_all if n not in {"KerasVariableLeaf"} and n not in page]
    assert not missing, f"docs/keras.md never mentions {missing}"
    jax_all = _literal_all(ROOT / "pitstop" / "adapters" / "jax" / "__init__.py")
    page = (DOCS / "jax.md").read_text()
    missing = [n for n in jax_all if n not in {"JaxArrayLeaf", "JaxAdapter"} and n not in page]
    assert not missing, f"docs/jax.md never mentions {missing}"


def _literal_all(path: Path) -> list[str]:
    import ast
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


# ------------------------------------------------------------------------- the static site
def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`make docs`: mkdocs builds every page offline; a link mkdocs cannot follow fails it
    (about a second)."""
    pytest.importorskip("mkdocs")
    # not -q: mkdocs's --strict counts only the warnings it logs, and -q logs none (a broken
    # anchor passed here while `make docs` failed on it)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if f" {p.name}" not in nav]
    assert not missing, f"mkdocs.yml's nav does not list {missing}"
    assert (tmp_path / "site" / "cli" / "index.html").is_file()


# ------------------------------------------------------------------------- the harness itself
def test_a_block_that_raises_fails_the_test(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n```python\nraise ValueError('boom')\n```\n")
    found = items(page)
    assert [it.kind for it in found] == ["run", "run"]
    ns: dict = {}
    _run(ROOT / "README.md", found[0], ns)
    assert ns["x"] == 1
    with pytest.raises(pytest.fail.Exception, match="ValueError: boom"):
        _run(ROOT / "README.md", found[1], ns)


def test_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- setup\ny = 2\n-->\n\n```python excerpt=Makefile\ndemo: $(STAMP)\n```\n\n"
                    "<!-- manifest: d/step_0000000001 -->\n\n```json\n{}\n```\n\n"
                    "```console\n$ true\n```\n\n```sh\nmake demo\n```\n\n"
                    "```text diagram\na -> b\n```\n\n```text tree=pitstop\npitstop/\n```\n")
    assert [(it.kind, it.arg) for it in items(page)] == [
        ("hidden", ""), ("excerpt", "Makefile"), ("manifest", "d/step_0000000001"),
        ("json", ""), ("console", ""), ("sh", ""), ("diagram", ""), ("tree", "pitstop")]
    assert shown_problems(page) == []
    # a typo, an unmarked language, the old no-run marker: each fails, none switches a block off
    for info in ("python norun", "python no-run", "py", "bash", "text", "text tree", "consol",
                 "python excerpt", "json excerpt"):
        page.write_text(f"```{info}\nx = 1\n```\n")
        with pytest.raises(AssertionError, match="unknown info string"):
            items(page)
    page.write_text("```json\n{}\n```\n")
    assert "manifest the page wrote" in shown_problems(page)[0]


def test_code_the_harness_would_not_see_fails(tmp_path: Path) -> None:
    """Every way to write code that no test runs or checks fails the test instead."""
    page = tmp_path / "page.md"
    refused = {
        "~~~python\nraise ValueError\n~~~\n": "code fence the test does not read",
        "````python\nraise ValueError\n````\n": "code fence the test does not read",
        "```python\nraise ValueError\n": "code fence the test does not read",  # never closed
        "- item\n\n    ```python\n    raise ValueError\n    ```\n": "code fence the test",
        "text\n\n    raise ValueError\n\ntext\n": "indented code block",
        "<!-- stup\nraise ValueError\n-->\n": "HTML comment",
        "<!-- setup x = 1 -->\n": "HTML comment",
        "```Python\nx = 1\n```\n": "unknown info string",
        "```python\nif __name__ == '__main__':\n    raise ValueError\n```\n": "__main__",
    }
    for text, error in refused.items():
        page.write_text(text)
        with pytest.raises(AssertionError, match=error):
            items(page)
    # what is allowed: trailing blanks after the info string (not part of it in CommonMark),
    # a list item's indented continuation, text indented inside a list
    page.write_text("```python  \nx = 1\n```\n\n- a\n\n    more of a\n\nprose on "
                    "`<!-- setup ... -->` comments\n")
    assert [it.kind for it in items(page)] == ["run"]
    # shown blocks that would prove nothing
    for text, error in {"```python excerpt=Makefile\n...\n```\n": "no lines to check",
                        "```python excerpt=no/such.py\nx\n```\n": "no such file",
                        "```console\n$ true\n[exit 0]\n```\n": "drop it",
                        "```sh\n```\n": "empty",
                        "```console\n$ export K=1\n$ pitstop ls\n```\n": "new one",
                        "```console\n$ cd runs\n```\n": "new one", "```text tree=no/such\nsuch/\n```\n": "no such",
                        "```text keys=docs/manifest.schema.json\nx\n```\n": "nothing to check",
                        }.items():
        page.write_text(text)
        assert error in "\n".join(shown_problems(page)), text
    # a command that fails fails, whatever `...` its expected output is
    page.write_text("```console\n$ false\n...\n```\n")
    (item,) = items(page)
    with pytest.raises(pytest.fail.Exception, match="got \\(exit 1\\)"):
        _console(ROOT / "README.md", item, tmp_path / "bin")


def test_console_blocks_match_with_ellipsis_and_exit_status(tmp_path: Path) -> None:
    code = "$ echo a; echo b\na\n...\n$ echo x >&2; exit 3\nx\n[exit 3]\n$ true\n"
    assert console_commands(code) == [(0, "echo a; echo b", "a\n...\n", 0),
                                      (3, "echo x >&2; exit 3", "x", 3), (6, "true", "", 0)]
    assert output_matches("a\n...\n", "a\nb\nc  \n")
    assert output_matches("...step 3 ... by step 7...", "x\nstep 3 held by step 7\ny")
    assert not output_matches("a\n", "a\nb\n")  # no trailing text without ...
    assert not output_matches("", "something")
    assert output_matches("...\nb\n...", "b") and output_matches("...\nb\n...", "a\nb\nc")
    assert output_matches("a\n...\nb", "a\nb") and not output_matches("a\n...\nb", "ab")
    assert output_matches("...", "anything\nat all") and output_matches("...", "")
    page = tmp_path / "page.md"
    page.write_text("```console\n$ pitstop --version\npitstop ...\n$ echo no; exit 2\nno\n[exit 2]\n```\n")
    (item,) = items(page)
    _console(ROOT / "README.md", item, tmp_path / "bin")  # the checkout's `pitstop` is on PATH
    page.write_text("```console\n$ echo no; exit 2\nno\n```\n")
    (item,) = items(page)
    with pytest.raises(pytest.fail.Exception, match=r"README.md:2: \$ echo no; exit 2"):
        _console(ROOT / "README.md", item, tmp_path / "bin")


def test_shown_block_checks_find_rot() -> None:
    assert excerpt_problem("demo: $(STAMP)\n\n...\nclean:", "Makefile") is None
    assert excerpt_problem("clean:\n...\ndemo: $(STAMP)", "Makefile")  # out of order
    assert excerpt_problem("x", "no/such/file")
    assert sh_problems("python benchmarks/torture.py --only crash --seed 1  # note\nmake test") == []
    assert len(sh_problems("python benchmarks/torture.py --no-such-flag\nmake nothing\nls")) == 3
    assert output_problems("crash: 1 trials, killed_in_hash 2, restores_checked_by_the_job 3",
                           "benchmarks/torture.py") == []
    assert output_problems("crash: no_such_counter 1", "benchmarks/torture.py")
    assert tree_problems("pitstop/\n  core/\n    policy.py\n    format/\n      dtypes.py hashing.py\n",
                         "pitstop") == []
    assert tree_problems("pitstop/\n  core/\n    nothing.py\n", "pitstop")
    assert keys_problems('"encryption": {"key_id": 1}', "docs/manifest.schema.json") == []
    assert keys_problems('"no_such_key": 1', "docs/manifest.schema.json")


# ------------------------------------------------------------------------- format.md's reader
def test_format_reader_reads_escaped_paths_and_encoded_keys(tmp_path: Path) -> None:
    """docs/format.md's reader on what the format section describes beyond the core test's
    state: an empty key (``~2``) beside arrays, and ``$dict`` keys in the value encoding."""
    import numpy as np

    (reader,) = [it for it in items(DOCS / "format.md") if it.kind == "run"]
    ns: dict = {"__name__": "format_md_reader"}
    exec(compile(reader.code, "docs/format.md", "exec"), ns)
    state = {
        "": np.arange(3, dtype=np.int16),
        "a/b": {"~x": np.ones(2), "": {"": np.zeros(1)}},
        "keys": {(0, 1): "pair", b"raw": 1, None: 2, 1.5: 3, "": 4, "$x": 5, True: 6,
                 ("nested", (1, 2)): 7},
    }
    with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False) as mgr:
        mgr.save(3, state).wait()
        via_pitstop = mgr.load()
    manifest = json.loads((tmp_path / "ck" / "step_0000000003" / "manifest.json").read_text())
    assert {"~2", "a~1b/~0x", "a~1b/~2/~2"} <= set(manifest["arrays"])
    # foreign entries that look like checkpoints: the reader must ignore them
    for foreign in ("step_99", "step_00000000099"):
        shutil.copytree(tmp_path / "ck" / "step_0000000003", tmp_path / "ck" / foreign)
    got = ns["load"](ns["latest"](str(tmp_path / "ck")))
    for tree in (got, via_pitstop):
        assert list(tree) == ["", "a/b", "keys"]
        assert (tree[""] == state[""]).all() and tree[""].dtype == np.int16
        assert (tree["a/b"][""][""] == 0).all() and (tree["a/b"]["~x"] == 1).all()
        assert tree["keys"] == state["keys"]
        assert [type(k) for k in tree["keys"]] == [type(k) for k in state["keys"]]
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((DOCS / "manifest.schema.json").read_text())
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(manifest)]
    assert not errors, errors[:3]  # encoded $dict keys are valid under the schema
