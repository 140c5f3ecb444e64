"""The documentation runs: every ```python block of README.md and docs/*.md is executed.

Rules the pages follow (and this file enforces):

* A fenced block whose info string is ``python`` runs. The blocks of one page run in order,
  in one namespace, in a fresh temporary working directory. A block that raises fails the
  test, naming the page and the block's line.
* ``python no-run`` marks an illustrative block that is not run (keep these few). Any other
  word after ``python`` is an error, so a typo cannot switch a block off.
* Hidden code, for what a block needs but a reader does not (a model class, a dataset, a
  manager opened elsewhere), sits in an HTML comment that GitHub does not render::

      <!-- setup
      code
      -->

  It runs at its place in the page, in the page's namespace. ``<!-- check ... -->`` is the
  same, placed after a block to assert what the block's comments claim.
* ``<!-- manifest: PATH -->`` right before a ```json block: that block must be the
  manifest the page's code wrote to ``PATH`` (apart from time, ids, host and pid).
* A block (or its setup) that imports torch runs only where torch imports.

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
from pitstop.adapters import registry

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
    kind: str  # "run", "skip", "hidden", "manifest", "json", "other"
    line: int
    code: str = ""
    arg: str = ""


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
        if info[:1] == ["python"]:
            if info[1:] == []:
                found.append((m.start(), Item("run", line + 1, body)))
            elif info[1:] == ["no-run"]:
                found.append((m.start(), Item("skip", line + 1, body)))
            else:
                raise AssertionError(f"{page.name}:{line}: unknown marker {info[1:]} after "
                                     "```python (use ```python or ```python no-run)")
        elif info and info[0].lower().startswith(("py", "ipython")):
            raise AssertionError(f"{page.name}:{line}: ```{info[0]} is neither run nor marked; "
                                 "write ```python (or ```python no-run)")
        elif info[:1] == ["json"]:
            found.append((m.start(), Item("json", line + 1, body)))
        else:
            found.append((m.start(), Item("other", line + 1, body)))
    for m in _COMMENT.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue  # a comment inside a code block is code
        body = m.group("body")
        line = text.count("\n", 0, m.start()) + 1
        head, _, rest = body.lstrip().partition("\n")
        word = head.split(":")[0].strip()
        if word in ("setup", "check"):
            found.append((m.start(), Item("hidden", line + 1, rest)))
        elif word == "manifest":
            found.append((m.start(), Item("manifest", line, arg=head.split(":", 1)[1].strip())))
    return [it for _, it in sorted(found, key=lambda t: t[0])]


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
                                 if not type(a).__module__.startswith("docs_")]
        ns.clear()
        gc.collect()


def test_no_run_blocks_are_few() -> None:
    """Illustrative blocks are the exception: each page runs more than it shows."""
    for page in PAGES:
        kinds = [it.kind for it in items(page)]
        assert kinds.count("skip") <= max(1, kinds.count("run")), page.name


def test_every_python_block_is_valid_python() -> None:
    """Also the ``no-run`` ones: they must at least compile."""
    for page in PAGES:
        for it in items(page):
            if it.kind in ("run", "skip", "hidden"):
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
        title = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group("title"))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n, base = 0, slug
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


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
    page.write_text("<!-- setup\ny = 2\n-->\n\n```python no-run\nnot run\n```\n\n"
                    "<!-- manifest: d/step_0000000001 -->\n\n```json\n{}\n```\n")
    assert [(it.kind, it.arg) for it in items(page)] == [
        ("hidden", ""), ("skip", ""), ("manifest", "d/step_0000000001"), ("json", "")]
    page.write_text("```python norun\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="unknown marker"):
        items(page)
    page.write_text("```py\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="neither run nor marked"):
        items(page)


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
