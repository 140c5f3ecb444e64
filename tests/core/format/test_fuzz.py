"""Property-based fuzzing of everything a reader takes from disk or from the caller: manifests
(random JSON, and mutations of a real one, resealed), ``index.json``, memory-tier
descriptions and ``restore`` targets. The one property: only :class:`CheckpointError`
subclasses ever escape, nothing hangs, and what is refused changes nothing (a target is left
as it was; a bad index or tier file is ignored, never trusted).

Derandomized (``derandomize=True``): every run tries the same examples, and hypothesis prints
the failing one (it is the seed).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import pitstop
from pitstop.core.errors import CheckpointError, IncompatibleTargetError
from pitstop.core.format.hashing import ALGORITHMS, hash_bytes
from pitstop.core.format.seal import seal
from pitstop.core.format.validate import parse
from pitstop.core.manager import step_name
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.save.memtier import MemoryTier, malformed
from pitstop.core.storage.local import LocalStorage
from pitstop.core.tree import flatten

#: fallbacks to the previous checkpoint warn, as they should: expected here, many times
pytestmark = pytest.mark.filterwarnings("ignore:pitstop. :UserWarning")

#: the torture command (benchmarks/reliability/bad_input.py) runs these properties with
#: SCALE times the examples, drawn from the seed it passes (--hypothesis-seed) instead of
#: the derandomized ones the suite always tries
SCALE = int(os.environ.get("PITSTOP_FUZZ_SCALE", "1"))
FUZZ = settings(derandomize=SCALE == 1, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --------------------------------------------------------------------------- strategies
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
#: values a manifest's fields are most likely to be broken by
nasty = st.sampled_from([
    -1, 0, 1, 10**15, 2**63, 2**64 + 1, -(2**63), 1.5, "1", "", "../x", "/etc/passwd",
    "a\x00b", None, True, [], {}, [10**15], [-1], [2, 500], [1000], [0], "<f8", "<f4", "|O",
    [["a", "|O"]], [["a", "<f4", [10**9, 10**9]]], "bfloat16", "<U0", "V8", "zstd", "none",
    "zstd+shuffle4", {"$float": "abc"}, {"$dict": 5}, {"$bytes": "!!!"}, {"$tuple": 3},
    {"$dict": [[[1], 2]]}, {"$d": 5}, {"$l": [0, 0]}, {"$o": 7}, {"$d": [["w", 1]]}, 0.0,
]).map(copy.deepcopy) | json_values  # a fresh copy: mutate() changes what it puts


def state_of(step: int) -> dict:
    return {"w": np.arange(1000, dtype="f4") * step, "s": np.float32(step),
            "v": {"x": 1.5 * step, "b": b"hi", "t": (step, "s"), "n": {1: "a"}}}


def blank() -> dict:
    return {"w": np.zeros(1000, "f4"), "s": np.float32(0),
            "v": {"x": 0.0, "b": b"", "t": (0, ""), "n": {}}}


def open_mgr(d, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(d, **kw)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Checkpoints of steps 1 and 2, raw and compressed."""
    out = {}
    for kind, kw in (("raw", {}), ("zstd", {"compression": "zstd+shuffle"})):
        d = tmp_path_factory.mktemp("fuzz") / kind
        with open_mgr(d, **kw) as mgr:
            for s in (1, 2):
                mgr.save(s, state_of(s)).result(timeout=60)
        out[kind] = d
    # the raw one's step 2 rewritten as a sharded (format 2.0) checkpoint: "w" in two shards
    d = out["sharded"] = out["raw"].parent / "sharded"
    shutil.copytree(out["raw"], d)
    doc = unsealed(d)
    e = doc["arrays"]["w"]
    with open(os.path.join(d, step_name(2), e["file"]), "rb") as f:
        data = f.read()[e["offset"]:e["offset"] + e["length"]]
    half = len(data) // 2
    doc["format_version"] = "2.0"
    doc["arrays"]["w"] = {"dtype": e["dtype"], "shape": e["shape"], "shards": [
        {"index": [[a // 4, b // 4]], "file": e["file"], "offset": e["offset"] + a,
         "length": b - a, "hash": hash_bytes(doc["hash_algorithm"], data[a:b])}
        for a, b in ((0, half), (half, len(data)))]}
    write_sealed(d, doc)
    return out


def manifest_path(d, step: int = 2) -> str:
    return os.path.join(d, step_name(step), "manifest.json")


def unsealed(d, step: int = 2) -> dict:
    with open(manifest_path(d, step), "rb") as f:
        doc = json.loads(f.read())
    del doc["manifest_hash"]
    return doc


def write_sealed(d, doc: dict, step: int = 2) -> bytes:
    algorithm = doc.get("hash_algorithm")
    data = seal(json.dumps(doc, separators=(",", ":")).encode(),
                algorithm if isinstance(algorithm, str) and algorithm in ALGORITHMS
                else "xxh3-128")
    path = manifest_path(d, step)
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(data)
    return data


def paths_of(doc, prefix=()) -> list[tuple]:
    """Every place inside a JSON document (key paths), the root's children first."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) \
        if isinstance(doc, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(paths_of(v, (*prefix, k)))
    return out


def mutate(doc, data) -> None:
    """One random change at one random place: replaced, removed, or a key added."""
    where = data.draw(st.sampled_from(paths_of(doc)), label="where")
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    how = data.draw(st.sampled_from(["replace", "replace", "delete", "add"]), label="how")
    if how == "replace":
        parent[where[-1]] = data.draw(nasty, label="value")
    elif how == "delete":
        del parent[where[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=6), label="key")] = data.draw(nasty, label="value")
    else:
        parent.append(data.draw(nasty, label="value"))


def only_checkpoint_errors(fn, *args, **kw):
    """Run ``fn``; a CheckpointError is a fine answer, anything else fails the property."""
    try:
        return fn(*args, **kw)
    except CheckpointError as e:
        return e


# --------------------------------------------------------------------------- manifests
def test_the_fuzzed_checkpoints_read_back(base):
    """The mutations start from checkpoints that work, the sharded one included."""
    for kind in ("raw", "zstd", "sharded"):
        with open_mgr(base[kind], read_only=True) as mgr:
            np.testing.assert_array_equal(mgr.load()["w"], state_of(2)["w"])
            assert len(mgr.metadata(2).arrays["w"].parts) == (2 if kind == "sharded" else 1)


@settings(FUZZ, max_examples=150 * SCALE)
@given(doc=json_values | st.dictionaries(st.sampled_from(
    ["format", "format_version", "files", "arrays", "values", "structure", "step",
     "hash_algorithm", "world", "metrics"]), nasty, max_size=10))
def test_parse_of_random_json_raises_only_checkpoint_errors(doc):
    if isinstance(doc, dict) and doc.get("format") is not None:
        doc["format"] = "pitstop-checkpoint"
    body = json.dumps(doc, separators=(",", ":")).encode()
    for data in (body, seal(body, "xxh3-128") if body.endswith(b"}") and body != b"{}" else body):
        only_checkpoint_errors(parse, data, "fuzz")


@settings(FUZZ, max_examples=120 * SCALE)
@given(data=st.data())
def test_a_mutated_resealed_manifest_is_read_or_refused_cleanly(base, data):
    kind = data.draw(st.sampled_from(["raw", "zstd", "sharded"]), label="kind")
    d = base[kind]
    doc = unsealed(d)
    original = copy.deepcopy(doc)
    try:
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            if paths_of(doc):
                mutate(doc, data)
        raw = write_sealed(d, doc)
        parsed = only_checkpoint_errors(parse, raw, "fuzz")
        storage = LocalStorage(str(d), create=False)
        reader = only_checkpoint_errors(CheckpointReader, storage, step_name(2))
        if isinstance(parsed, CheckpointError):
            assert isinstance(reader, CheckpointError)  # one validation: the reader's
        event(f"reader: {type(reader).__name__}")
        if isinstance(reader, CheckpointError):
            return
        only_checkpoint_errors(reader.verify)
        only_checkpoint_errors(reader.load)
        target = blank()
        before = snapshot(target)
        result = only_checkpoint_errors(reader.restore_into, flatten(target), True)
        if isinstance(result, CheckpointError) and not getattr(result, "overwritten", None):
            assert snapshot(target) == before, "a refused restore changed the target"
        # the manager reading the latest: this one, or the previous one after a warning
        with open_mgr(d, read_only=True) as mgr:
            target = blank()
            got = only_checkpoint_errors(mgr.restore, target)
            event(f"manager: {type(got).__name__ if isinstance(got, Exception) else got}")
            assert got in (1, 2) or isinstance(got, IncompatibleTargetError), got
    finally:
        write_sealed(d, original)


# --------------------------------------------------------------------------- index.json
@settings(FUZZ, max_examples=40 * SCALE)
@given(data=st.data())
def test_a_random_index_never_hides_or_invents_checkpoints(base, data):
    d = base["raw"]
    index = os.path.join(d, ".pitstop", "index.json")
    with open(index, "rb") as f:
        good = f.read()
    ident = json.loads(good)["directory_id"]
    doc = data.draw(st.one_of(
        st.binary(max_size=40),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.text(max_size=4) | st.sampled_from(["1", "2", "7", "-1", "01"]),
                        st.dictionaries(st.sampled_from(["metrics", "ours", "all_finite",
                                                         "protected"]), nasty, max_size=4)
                        | nasty, max_size=4)
        .map(lambda c: json.dumps({"directory_id": ident, "checkpoints": c}).encode()),
    ), label="index.json")
    try:
        with open(index, "wb") as f:
            f.write(doc)
        with open_mgr(d) as mgr:  # a writer: it rebuilds what it cannot trust
            assert mgr.all_steps() == [1, 2]
            assert mgr.latest_step() == 2
            loaded = mgr.load()
            np.testing.assert_array_equal(loaded["w"], state_of(2)["w"])
            only_checkpoint_errors(mgr.rollback, blank())
    finally:
        with open(index, "wb") as f:
            f.write(good)


# --------------------------------------------------------------------------- memory tier
@pytest.fixture(scope="module")
def tier_template(base, tmp_path_factory):
    """A real memory-tier description and buffer of step 2 (copied while its manager was
    alive: close() removes them), and the checkpoint directory it belongs to."""
    root = tmp_path_factory.mktemp("tier")
    d = tmp_path_factory.mktemp("tierdir") / "run"
    with open_mgr(d, memory_tier=str(root)) as mgr:
        mgr.save(1, state_of(1)).result(timeout=60)
        mgr.save(2, state_of(2)).result(timeout=60)
        prefix = MemoryTier(str(root), str(d), mgr.directory_id).prefix
        metas = sorted(p for p in os.listdir(root) if p.endswith(".json"))
        with open(os.path.join(root, metas[-1])) as f:
            meta = json.load(f)
        assert meta["step"] == 2, metas
        buf = str(tmp_path_factory.mktemp("tierbuf") / "step2.buf")  # (a path: never printed)
        shutil.copy(os.path.join(root, metas[-1][:-len(".json")] + ".buf"), buf)
        ident = mgr.directory_id
    shutil.rmtree(os.path.join(d, step_name(2)))  # the snapshot is the newest again
    os.unlink(os.path.join(d, ".pitstop", "index.json"))
    meta["committed"] = False
    assert prefix
    return d, ident, meta, buf


@settings(FUZZ, max_examples=30 * SCALE)
@given(data=st.data())
def test_random_memory_tier_descriptions_are_ignored_or_refused(tier_template, data):
    template, ident, good_meta, buf = tier_template
    work = tempfile.mkdtemp(dir=os.path.dirname(template))
    d, root = os.path.join(work, "run"), os.path.join(work, "tier")
    shutil.copytree(template, d)
    os.mkdir(root)
    meta = copy.deepcopy(good_meta)
    meta["directory"] = os.path.realpath(d)
    kind = data.draw(st.sampled_from(["mutated", "mutated", "mutated", "random"]), label="kind")
    if kind == "random":
        text = data.draw(st.binary(max_size=60) | json_values.map(
            lambda v: json.dumps(v).encode()), label="description")
    else:
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            mutate(meta, data)
        text = json.dumps(meta).encode()
    prefix = MemoryTier(root, d, ident).prefix
    with open(prefix + "-0.json", "wb") as f:
        f.write(text)
    shutil.copy(buf, prefix + "-0.buf")
    sealed = kind == "mutated" and isinstance(meta, dict) and meta.get("hashes") is not None
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    damaged = not isinstance(doc, dict) or malformed(doc) is not None
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pitstop").addHandler(handler)
    try:
        with open_mgr(d, memory_tier=root) as mgr:
            target = blank()
            got = only_checkpoint_errors(mgr.restore, target)
            event(f"tier {kind}: {type(got).__name__ if isinstance(got, Exception) else got}")
            if got == 1:
                np.testing.assert_array_equal(target["w"], state_of(1)["w"])
            elif not isinstance(got, CheckpointError) and sealed:
                # taken from the tier: only bytes that match the hashes recorded
                np.testing.assert_array_equal(target["w"], state_of(2)["w"])
            if damaged:
                assert got == 1, "a malformed description was used"
                assert any("ignoring memory-tier" in m for m in said), said
    finally:
        logging.getLogger("pitstop").removeHandler(handler)
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- restore targets
def snapshot(obj):
    """A deep, comparable picture of a target: types, array bytes, values, identity of
    containers kept in place."""
    if isinstance(obj, np.ndarray):
        return ("nd", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, np.generic):
        return ("np", type(obj).__name__, obj.tobytes())
    if isinstance(obj, dict):
        return ("dict", id(obj), [(repr(k), snapshot(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, id(obj) if isinstance(obj, list) else 0,
                [snapshot(v) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(map(repr, obj)))
    return ("v", type(obj).__name__, repr(obj))


dtypes = st.sampled_from(["f4", "f8", "i8", "u1", "f2", "c8", "?", "<U3", "V4"])
arrays = st.builds(lambda dt, shape: np.zeros(shape, dt), dtypes,
                   st.lists(st.integers(0, 4), max_size=3).map(tuple)) | st.just(
    np.zeros(1000, "f4")) | st.just(np.zeros(1000, "f8")) | st.just(np.zeros((10, 100), "f4"))
leaves = arrays | scalars | st.sampled_from(
    [b"", b"x", (0, ""), {1: "a"}, {}, [], set(), np.float32(0), np.float64(0),
     np.int64(0), np.zeros((), "f4"), np.zeros(1000, "f4")[::2], object()])
targets = st.recursive(
    leaves, lambda inner: st.dictionaries(
        st.sampled_from(["w", "s", "v", "x", "b", "t", "n", "extra", "1"]) | st.integers(0, 2),
        inner, max_size=5) | st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=10)


@settings(FUZZ, max_examples=150 * SCALE)
@given(target=targets | st.builds(lambda extra: {**blank(), **extra},
                                  st.dictionaries(st.sampled_from(["w", "s", "v", "z"]),
                                                  targets, max_size=2)),
       strict=st.booleans())
def test_random_restore_targets_raise_only_checkpoint_errors_and_stay_unchanged(
        base, target, strict):
    with open_mgr(base["raw"], read_only=True) as mgr:
        before = snapshot(target)
        got = only_checkpoint_errors(mgr.restore, target, strict=strict)
        event(f"target: {type(got).__name__}")
        if isinstance(got, CheckpointError):
            assert not getattr(got, "overwritten", None)
            assert snapshot(target) == before, f"refused ({got}) but the target changed"
        else:
            assert got == 2


def test_the_tier_template_itself_is_recovered(tier_template):
    """The fuzzed descriptions start from one that works: unchanged, it is restored."""
    template, ident, good_meta, buf = tier_template
    work = tempfile.mkdtemp(dir=os.path.dirname(template))
    try:
        d, root = os.path.join(work, "run"), os.path.join(work, "tier")
        shutil.copytree(template, d)
        os.mkdir(root)
        meta = {**good_meta, "directory": os.path.realpath(d)}
        prefix = MemoryTier(root, d, ident).prefix
        with open(prefix + "-0.json", "w") as f:
            json.dump(meta, f)
        shutil.copy(buf, prefix + "-0.buf")
        with open_mgr(d, memory_tier=root) as mgr:
            target = blank()
            assert mgr.restore(target) == 2
            np.testing.assert_array_equal(target["w"], state_of(2)["w"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
