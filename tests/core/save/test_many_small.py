"""Many small tensors: the fast paths taken per tensor (flatten's reuse of the last save's
leaves, the manifest's writing and reading of plain entries, restore's reads in runs,
retention's look at a manifest's header) give exactly what the general paths give."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import pitstop
from pitstop.core.directory.names import step_name
from pitstop.core.format.encode import _arrays_json
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.format.validate import parse, peek_header
from pitstop.core.tree import FlattenCache, flatten

N = 300  # more than FlattenCache.MIN and restore's RUN_MIN


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


def many(n: int = N, value: float = 1.0) -> dict:
    return {"p": {f"w{i}": np.full(8 + i % 3, value + i, np.float32) for i in range(n)},
            "step": 0}


def restores_exactly(d, state: dict, step: int) -> None:
    """A fresh manager on ``d`` restores ``step`` into zeros: every array as in ``state``."""
    target = many(value=0.0)
    with open_mgr(d) as mgr:
        assert mgr.restore(target) == step
    for k, a in state["p"].items():
        np.testing.assert_array_equal(target["p"][k], a, err_msg=k)


# ------------------------------------------------------------------ flatten's reuse
def test_flatten_reuses_the_leaves_of_an_unchanged_dict_and_nothing_else():
    state = many()
    cache = FlattenCache()
    first = flatten(state, cache=cache)
    again = flatten(state, cache=cache)
    assert list(again.arrays) == list(first.arrays)
    assert all(again.arrays[k] is first.arrays[k] for k in first.arrays)
    assert again.structure == first.structure
    # each change makes new leaves for that dict: a replaced array, a reshape or a dtype
    # change in place (the same object), a new key
    changes = [
        lambda p: p.__setitem__("w5", np.zeros(9, np.float32)),
        lambda p: setattr(p["w6"], "shape", (2, 4)),
        lambda p: setattr(p["w9"], "dtype", np.int32),
        lambda p: p.__setitem__("new", np.zeros(1)),
    ]
    for change in changes:
        change(state["p"])
        want = flatten(state)  # no cache: the general walk
        got = flatten(state, cache=cache)
        assert list(got.arrays) == list(want.arrays)
        assert got.structure == want.structure
        for k, leaf in want.arrays.items():
            assert (got.arrays[k].shape, got.arrays[k].dtype) == (leaf.shape, leaf.dtype), k
            assert got.arrays[k].array is leaf.array, k
    cache.clear()
    assert not cache.last and not cache.next


def test_saves_after_an_in_place_reshape_come_back_exactly(tmp_path):
    state = many()
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, state).wait()
        state["p"]["w3"].shape = (1, -1)  # in place: the same array object
        state["p"]["w4"][:] = 42
        mgr.save(2, state).wait()
        target = many(value=0.0)
        target["p"]["w3"] = np.zeros((1, state["p"]["w3"].size), np.float32)
        assert mgr.restore(target) == 2
    for k, a in state["p"].items():
        np.testing.assert_array_equal(target["p"][k], a, err_msg=k)


# ------------------------------------------------------------------ the manifest
def test_the_arrays_section_is_the_text_json_makes_for_every_kind_of_entry():
    arrays = {
        "plain": ArrayEntry("<f4", [2, 3], "data-000.bin", 0, 24, "ab"),
        "scalar": ArrayEntry("<i8", [], "data-000.bin", 64, 8, "cd"),
        "odd key \"é/~\n": ArrayEntry("|u1", [0], "data-000.bin", 72, 0, "ef"),
        "structured": ArrayEntry([["a", "<f4"], ["b", "<i2"]], [2], "data-000.bin", 80, 12,
                                 "gh"),
        "zstd": ArrayEntry("<f8", [4], "data-000.bin", 96, 20, "ij", codec="zstd"),
        "referenced": ArrayEntry("<f4", [4], "data-000.bin", 0, 16, "mn",
                                 ref="step_0000000001"),
        "sharded": ArrayEntry("<f4", [4], "", 0, 0, "", shards=[
            ArrayEntry("<f4", [4], "data-000.bin", 128, 16, "kl", index=[[0, 4]])]),
    }
    want = json.dumps({k: e.to_json() for k, e in arrays.items()}, separators=(",", ":"))
    assert _arrays_json(arrays) == want


def test_a_manifest_of_plain_entries_reads_back_as_written():
    m = Manifest(step=3, files={"data-000.bin": 4096}, structure=None)
    for i in range(50):
        m.arrays[f"a{i}"] = ArrayEntry("<f4", [4, 2] if i % 2 else [8], "data-000.bin",
                                       i * 64, 32, f"{i:032x}")
    got = parse(m.to_bytes(), "ck")
    assert got.arrays == m.arrays


@pytest.mark.parametrize("edit, match", [
    (lambda e: e.update(shape=[0, 2 ** 60]), "more than 2..56 elements"),
    (lambda e: e.update(shape=[2, -1]), "non-negative integers"),
    (lambda e: e.update(shape=[True]), "non-negative integers"),
    (lambda e: e.update(offset=4090), "ends past the end"),
    (lambda e: e.update(length=8), "its shape and dtype need"),
    (lambda e: e.update(file="data-009.bin"), "does not list"),
    (lambda e: e.update(dtype="<q7"), "not one pitstop reads"),
    (lambda e: e.update(hash=7), "must be strings"),
    (lambda e: e.update(offset=-1), "is not an integer from 0"),
])
def test_a_bad_plain_entry_among_many_is_refused_as_the_full_check_refuses_it(edit, match):
    m = Manifest(step=3, files={"data-000.bin": 4096})
    for i in range(20):
        m.arrays[f"a{i}"] = ArrayEntry("<f4", [4], "data-000.bin", i * 64, 16, "h")
    doc = json.loads(m.to_bytes())
    del doc["manifest_hash"]
    edit(doc["arrays"]["a7"])
    from pitstop.core.format.seal import seal
    data = seal(json.dumps(doc, separators=(",", ":")).encode(), "xxh3-128")
    with pytest.raises(pitstop.CorruptCheckpointError, match=match) as info:
        parse(data, "ck")
    assert "'a7'" in str(info.value)


def test_peek_header_reads_whose_it_is_and_checks_the_seal(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(5, many(40)).wait()
        path = os.path.join(tmp_path, "ck", step_name(5), "manifest.json")
    with open(path, "rb") as f:
        data = f.read()
    head = peek_header(data, "ck")
    m = parse(data, "ck")
    assert head is not None and (head["step"], head["directory_id"]) == (5, m.directory_id)
    with pytest.raises(pitstop.CorruptCheckpointError, match="hash mismatch"):
        peek_header(data.replace(b'"step":5', b'"step":6', 1), "ck")
    # not laid out as pitstop writes it: the caller reads it whole
    doc = json.loads(data)
    assert peek_header(json.dumps(doc).encode(), "ck") is None
    assert peek_header(b"{}", "ck") is None


# ------------------------------------------------------------------ restore in runs
def test_restore_of_many_small_arrays_is_exact_and_names_a_corrupt_one(tmp_path):
    d = tmp_path / "ck"
    state = many()
    with open_mgr(d, writer_threads=1) as mgr:
        mgr.save(1, many(value=5.0)).wait()
        mgr.save(2, state).wait()
    restores_exactly(d, state, 2)
    ck = d / step_name(2)
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["p/w150"]
    with open(ck / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + 3)
        byte = f.read(1)
        f.seek(entry["offset"] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = many(value=0.0)
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(target, step=2)
    err = info.value
    assert err.key == "p/w150" and "hash mismatch" in str(err)
    assert "p/w149" in err.overwritten and "p/w150" in err.overwritten
    assert "p/w151" not in err.overwritten


def test_load_and_verify_of_many_small_arrays_are_exact_and_find_a_corrupt_one(tmp_path):
    from pitstop.core.restore.read import CheckpointReader
    from pitstop.core.storage.local import LocalStorage
    d = tmp_path / "ck"
    state = many()
    state["p"]["big"] = np.arange(300_000, dtype=np.float64)  # (over SMALL: read alone)
    with open_mgr(d, writer_threads=2) as mgr:
        mgr.save(1, state).wait()
        got = mgr.load()
    assert sorted(got["p"]) == sorted(state["p"]) and got["step"] == 0
    for k, a in state["p"].items():
        assert got["p"][k].dtype == a.dtype
        np.testing.assert_array_equal(got["p"][k], a, err_msg=k)
    CheckpointReader(LocalStorage(str(d)), step_name(1)).verify()
    ck = d / step_name(1)
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["p/w77"]
    with open(ck / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + entry["length"] - 1)
        byte = f.read(1)
        f.seek(entry["offset"] + entry["length"] - 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(pitstop.CorruptCheckpointError, match="hash mismatch") as info:
        CheckpointReader(LocalStorage(str(d)), step_name(1)).verify()
    assert info.value.key == "p/w77"
    with pytest.raises(pitstop.CorruptCheckpointError, match="'p/w77'"):
        CheckpointReader(LocalStorage(str(d)), step_name(1)).load()


def test_an_incremental_checkpoint_of_many_small_arrays_reads_each_from_its_own_file(
        tmp_path):
    """An incremental checkpoint's unchanged arrays stay in the older checkpoint's
    data-000.bin, its changed ones go to its own data-000.bin: the same file name. A run of
    small reads must never mix the two (it read the referenced arrays from the wrong file
    and called a valid checkpoint corrupt: restore() would have moved it aside)."""
    state = many()
    with open_mgr(tmp_path / "c", incremental=True) as mgr:
        mgr.save(1, state).wait()
        arrays = state["p"]
        for i, k in enumerate(arrays):
            if i % 2 == 0:
                arrays[k] = arrays[k] + 1000
        mgr.save(2, state).wait()
        entries = mgr.metadata(2).arrays.values()
        assert {e.ref for e in entries} == {None, step_name(1)}  # both kinds, ...
        own = {e.file for e in entries if e.ref is None}
        assert own & {e.file for e in entries if e.ref}  # ... under the same file names
    with open_mgr(tmp_path / "c") as mgr:
        got = mgr.load(2)
        target = many(value=0.0)
        assert mgr.restore(target) == 2
    for k, v in state["p"].items():
        np.testing.assert_array_equal(got["p"][k], v, err_msg=k)
        np.testing.assert_array_equal(target["p"][k], v, err_msg=k)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "xxh3-64", "sha256", "blake2b"])
def test_many_small_arrays_restore_and_verify_under_every_hash_algorithm(tmp_path, algorithm):
    # the runs' hasher was made from the class of an xxh3 hasher: hashlib's sha256 cannot
    # be made that way, and such a restore raised a raw TypeError
    from pitstop.core.restore.read import CheckpointReader
    from pitstop.core.storage.local import LocalStorage
    d = tmp_path / "ck"
    state = many()
    with open_mgr(d, hash_algorithm=algorithm) as mgr:
        mgr.save(1, state).wait()
    restores_exactly(d, state, 1)
    CheckpointReader(LocalStorage(str(d)), step_name(1)).verify()
    entry = json.loads((d / step_name(1) / "manifest.json").read_text())["arrays"]["p/w40"]
    with open(d / step_name(1) / entry["file"], "r+b") as f:
        f.seek(entry["offset"])
        f.write(b"\xff\xff")
    with open_mgr(d) as mgr, pytest.raises(pitstop.CorruptCheckpointError, match="'p/w40'"):
        mgr.restore(many(value=0.0), step=1)


def test_many_small_arrays_of_dtypes_without_a_buffer_format_restore_exactly(tmp_path):
    # a run's copy goes through a memoryview, which datetime64 (and bfloat16) cannot be
    state = {"t": {f"w{i}": np.arange(i, i + 5).astype("M8[s]") for i in range(N)},
             "f": {f"w{i}": np.full(3, i, np.float32) for i in range(N)}}
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, state).wait()
    target = {g: {k: np.zeros_like(v) for k, v in s.items()} for g, s in state.items()}
    with open_mgr(tmp_path / "ck") as mgr:
        assert mgr.restore(target) == 1
    for g, s in state.items():
        for k, v in s.items():
            np.testing.assert_array_equal(target[g][k], v, err_msg=f"{g}/{k}")
            assert target[g][k].dtype == v.dtype
