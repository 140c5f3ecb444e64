"""docs/format.md cannot rot: its pure-numpy reader must read what CheckpointManager writes,
and real manifests must validate against docs/manifest.schema.json."""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pitstop

DOCS = Path(__file__).resolve().parents[3] / "docs"
ALLOWED_IMPORTS = {
    "base64",
    "hashlib",
    "json",
    "os",
    "re",
    "numpy",
    "xxhash",
    "ml_dtypes",
    "zstandard",
}


def reader_source() -> str:
    text = (DOCS / "format.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 1, "docs/format.md must hold exactly one ```python block: the reader"
    return blocks[0]


@pytest.fixture
def reader(monkeypatch):
    """The doc's reader: it imports only numpy, xxhash and the stdlib (checked on its source,
    function bodies included), and its module body runs with pitstop made unimportable."""
    src = reader_source()
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    ns: dict = {"__name__": "format_md_reader"}
    with monkeypatch.context() as m:
        for name in [n for n in sys.modules if n == "pitstop" or n.startswith("pitstop.")]:
            m.setitem(sys.modules, name, None)
        exec(compile(src, "docs/format.md", "exec"), ns)
    return ns


def saved_state() -> dict:
    rng = np.random.default_rng(7)
    return {
        "model": {
            "w": rng.standard_normal((33, 17), dtype=np.float32),
            "w_t": np.asfortranarray(rng.standard_normal((5, 9))),  # saved in C order
            "bf16": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
            "fp8": np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e4m3fn),
            "half": np.arange(10, dtype=np.float16),
            "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
            "layers": [np.full(3, i, np.int8) for i in range(3)],
            "pair": (np.ones(2, np.uint16), np.zeros((0, 4), np.float64)),
        },
        "misc": {
            "flags": np.array([True, False, True]),
            "cplx": np.array([1 + 2j, -3j], np.complex64),
            "names": np.array(["ab", "héllo"]),
            "when": np.array(["2024-01-02T03:04:05"], "datetime64[s]"),
            "rec": np.zeros(3, [("a", "<f4"), ("b", "<i2", (2,))]),
            "scalar": np.float64(2.5),
            "a/b": {"~x": np.arange(4, dtype=np.int64)},  # key path escaping
            3: np.arange(2, dtype=np.uint32),  # an int key
        },
        "optimizer": {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "nesterov": False},
        "rng": np.random.default_rng(123).bit_generator.state,  # ints beyond 64 bits
        "epoch": 7,
        "tag": "run-é/1",
        "nothing": None,
        "best": float("inf"),
        "worst": float("nan"),
        "blob": b"\x00\x01pitstop",
        "by_id": {1: "one", 2: [1, 2]},
        "dollar": {"$float": "not a wrapper"},
    }


def assert_same(got, want, path="state"):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), path
        dtype = want.dtype.newbyteorder("<") if want.dtype.byteorder == ">" else want.dtype
        assert got.dtype == dtype and got.shape == want.shape, (path, got.dtype, got.shape)
        assert got.tobytes() == np.ascontiguousarray(want, dtype).tobytes(), path
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got == want, path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (path, list(got), list(want))
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), path
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"compression": "zstd+shuffle", "hash_algorithm": "sha256"},
        {"compression": "zstd", "hash_algorithm": "blake2b", "writer_threads": 1, "shm": 1},
        {"writer_threads": 3, "shm": 1},
    ],
)
def test_doc_reader_reads_what_pitstop_writes(tmp_path, options, reader):
    state = saved_state()
    options = dict(options)
    tier: str | bool = False
    if options.pop("shm", None):  # with the memory tier on (in a private directory)
        tier = str(tmp_path / "shm")
        Path(tier).mkdir()
    ckdir = tmp_path / "ck"
    with pitstop.CheckpointManager(ckdir, memory_tier=tier, **options) as mgr:
        mgr.save(3, state, metrics={"loss": 0.25}).wait()
        mgr.save(12, state, metrics={"loss": 0.125}).wait()
        via_pitstop = mgr.load()
    ckpt = reader["latest"](str(ckdir))
    assert ckpt.endswith("step_0000000012")
    got = reader["load"](ckpt)
    assert_same(got, state)
    assert_same(got, via_pitstop)  # the same as pitstop's own load()


def test_doc_reader_checks_hashes(tmp_path, reader):
    with pitstop.CheckpointManager(tmp_path, memory_tier=False) as mgr:
        mgr.save(1, {"w": np.arange(100, dtype=np.float32)}).wait()
    ckpt = Path(reader["latest"](str(tmp_path)))
    entry = json.loads((ckpt / "manifest.json").read_text())["arrays"]["w"]
    data = bytearray((ckpt / entry["file"]).read_bytes())
    data[entry["offset"] + 5] ^= 0x10
    (ckpt / entry["file"]).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="hash mismatch"):
        reader["load"](str(ckpt))


def test_doc_reader_reads_a_root_leaf_and_a_flat_manifest(tmp_path, reader):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pitstop.CheckpointManager(tmp_path, memory_tier=False) as mgr:
        mgr.save(0, a).wait()
    assert_same(reader["load"](reader["latest"](str(tmp_path))), a)


def test_manifests_match_the_json_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((DOCS / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for i, options in enumerate([{}, {"compression": "zstd+shuffle", "nonfinite_guard": True}]):
        state = saved_state()
        if options.get("nonfinite_guard"):
            state = {k: v for k, v in state.items() if k != "worst"}
        d = tmp_path / str(i)
        with pitstop.CheckpointManager(d, memory_tier=False, **options) as mgr:
            grad_norm = 1.0 if options.get("nonfinite_guard") else math.inf  # else skipped
            mgr.save(
                5,
                state,
                metrics={"loss": 0.5, "phase": "train", "grad_norm": grad_norm},
                user_metadata={"note": "x", "shape": (1, 2)},
            ).wait()
        manifest = json.loads((d / "step_0000000005" / "manifest.json").read_text())
        errors = sorted(validator.iter_errors(manifest), key=str)
        assert not errors, [e.message for e in errors][:5]
    # and the schema rejects what readers must refuse
    bad = dict(manifest, files={"../escape": {"length": 1}})
    assert not validator.is_valid(bad)
    bad = dict(manifest, format_version="5.0")
    assert not validator.is_valid(bad)
