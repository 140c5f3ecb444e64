"""The package's shape, held by the suite: the layers of pyproject.toml's import-linter contracts
(core imports no framework and nothing above it), no import cycle between modules, rooms that
stay small (a module at most 600 lines, a function at most 100), one adapter seam."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pitstop"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_no_import_cycle_between_modules() -> None:
    """Every import counts, those inside functions and under TYPE_CHECKING too: a cycle is a
    cycle of dependencies whenever it is followed."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("pitstop", cache_dir=None)
    mods = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(mods))
             for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for start in mods:  # Tarjan's strongly connected components, without recursion
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(edges[nxt])))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_600_lines() -> None:
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, "split these modules:\n" + "\n".join(big)


def test_no_function_over_100_lines() -> None:
    long = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these functions:\n" + "\n".join(long)


def test_core_asks_adapters_only_through_the_protocol() -> None:
    """core/adapter.py declares every member core calls on an adapter, with defaults: no
    ``getattr(adapter, ...)`` lookups of members the protocol does not name."""
    lookups = []
    for p in (PACKAGE / "core").rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"getattr\(\s*(\w+\.)*(adapter|resolve\([^)]*\))\s*,", line):
                lookups.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not lookups, "\n".join(lookups)


def test_adapters_and_the_command_use_the_managers_public_calls() -> None:
    """A face reaches a manager through its public calls only (``closed``,
    ``report_restored``, ``set_aside_corrupt``, ``recovered_steps``...), never its private
    attributes: those may change with no face noticing."""
    private = re.compile(r"\b(mgr|manager|writer|reader|_mgr|self\.mgr|self\._mgr)\._[a-z]\w*")
    found = []
    for folder in ("adapters", "interop", "testing"):
        for p in (PACKAGE / folder).rglob("*.py"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if private.search(code) and "getattr(" not in code:
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
                if re.search(r"getattr\(\s*(self\.)?_?mgr\s*,\s*['\"]_", code):
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_tests_mirror_the_package() -> None:
    """Each core subpackage has its folder of tests (tests/core/<subpackage>/)."""
    missing = [d.name for d in sorted((PACKAGE / "core").iterdir())
               if d.is_dir() and (d / "__init__.py").exists()
               and d.name not in ("manager", "tree")
               and not (ROOT / "tests" / "core" / d.name).is_dir()]
    assert not missing, missing
    assert os.path.isdir(ROOT / "tests" / "adapters")
