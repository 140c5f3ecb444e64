"""Bad input found by probing the one-validation read path as an attacker or a buggy tool
would: each manifest below is edited *and resealed* (``seal.seal``) unless the test
says otherwise. Every one must be a clear :class:`CorruptCheckpointError` (or read back
exactly), never a raw exception, a hang or a silent wrong resume."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

# the states, the manager and the raw/zstd templates of the named cases
from test_bad_input import blank, open_mgr, state_of, templates  # noqa: F401,F811

import pitstop
from pitstop.core.format.seal import seal
from pitstop.core.manager import step_name
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage.local import LocalStorage


@pytest.fixture
def run(templates, tmp_path):  # noqa: F811 (the fixture imported above)
    d = tmp_path / "run"
    shutil.copytree(templates["raw"], d)
    return d


def ck(d, step: int = 2) -> str:
    return os.path.join(d, step_name(step))


def mpath(d, step: int = 2) -> str:
    return os.path.join(ck(d, step), "manifest.json")


def body_of(d, step: int = 2) -> str:
    """The manifest's text without its ``manifest_hash`` (ready to edit and reseal)."""
    with open(mpath(d, step), encoding="utf-8") as f:
        text = f.read()
    return text[:text.index(',"manifest_hash"')] + "}"


def write(d, text: str | bytes, step: int = 2, sealed: bool = True) -> None:
    data = text.encode() if isinstance(text, str) else text
    if sealed:
        data = seal(data, "xxh3-128")
    os.chmod(mpath(d, step), 0o644)
    with open(mpath(d, step), "wb") as f:
        f.write(data)


def edit(d, fn, step: int = 2) -> None:
    doc = json.loads(body_of(d, step))
    fn(doc)
    write(d, json.dumps(doc, separators=(",", ":")), step)


def refused(d, match: str, step: int = 2) -> pitstop.CorruptCheckpointError:
    """Corrupt for the reader, for load() and restore() of that step; the latest falls back."""
    with pytest.raises(pitstop.CorruptCheckpointError, match=match) as info:
        CheckpointReader(LocalStorage(str(d), create=False), step_name(step)).verify()
    with open_mgr(d, read_only=True) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match=match):
            mgr.load(step=step)
        with pytest.raises(pitstop.CorruptCheckpointError, match=match):
            mgr.restore(blank(), step=step)
        with pytest.warns(UserWarning, match=step_name(step)):
            assert mgr.load()["v"] == state_of(1)["v"]
    return info.value


# --------------------------------------------------------------------------- the seal
@pytest.mark.parametrize("version", [1, 1.1, "01.1", " 1.1", "1", "+1.1", "1.1 ", True])
def test_a_format_version_int_would_read_otherwise_never_skips_the_seal(run, version):
    """The seal was checked only when ``str(format_version)`` started with "1.", "2." or
    "3.", while the major came from ``int(...)``: ``1``, ``"01.1"``, ``" 1.1"`` read as 1.x
    with the seal never checked, so a manifest changed by hand (its hash now wrong) was
    restored. The version must be exactly "<major>.<minor>"."""
    text = body_of(run).replace('"x":3.0', '"x":999.0')  # an edit the seal would catch
    text = text.replace('"format_version":"1.1"', f'"format_version":{json.dumps(version)}')
    old = json.loads(open(mpath(run), encoding="utf-8").read())["manifest_hash"]
    write(run, text[:-1] + f',"manifest_hash":"{old}"}}', sealed=False)
    refused(run, "bad format_version")


# --------------------------------------------------------------------------- strict JSON
@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_the_manifest_is_strict_json_without_non_finite_numbers(run, word):
    """Python's json reads NaN, Infinity and 1e400 (as inf); the format says the manifest
    is strict JSON (pitstop writes a non-finite float as {"$float": ...}), which other
    readers of the format would refuse: so does pitstop, with a clear message."""
    text = body_of(run).replace('"user_metadata":{}', f'"user_metadata":{{"a":{word}}}')
    write(run, text)
    refused(run, "not valid JSON")


# --------------------------------------------------------------------------- shapes, dtypes
def empty_hash() -> str:
    import xxhash
    return xxhash.xxh3_128_hexdigest(b"")


@pytest.mark.parametrize("dtype", ["|S0", "<U0"])
def test_a_zero_size_string_dtype_is_refused_not_filled_with_unread_memory(run, dtype):
    """numpy makes an array of "S0" as "S1": an entry declaring 10**6 elements of 0 bytes
    (length 0, the empty hash) loaded as 10**6 bytes never read from the checkpoint, i.e.
    whatever the allocator held, and past the memory check, which counted 0 bytes."""
    def fn(doc):
        doc["arrays"]["w"].update(dtype=dtype, shape=[10**6], length=0, hash=empty_hash())
    edit(run, fn)
    refused(run, "has no size")


def test_a_zero_sized_shape_with_absurd_other_dimensions_is_corrupt(run):
    """[0, 2**40, 2**40, ...] holds no element, so the 2**56 bound let it through, but
    numpy refuses to make it ("array is too big"): verify() raised that raw ValueError."""
    def fn(doc):
        doc["arrays"]["w"].update(shape=[0] + [2**40] * 20, length=0, hash=empty_hash())
    edit(run, fn)
    refused(run, "more than 2\\*\\*56 elements")


def sharded_manifest(shape: list[int], indices: list) -> bytes:
    shards = [{"index": ix, "file": "d", "offset": 0, "length": 0, "hash": empty_hash()}
              for ix in indices]
    doc = {"format": "pitstop-checkpoint", "format_version": "2.0", "step": 2,
           "hash_algorithm": "xxh3-128", "files": {"d": {"length": 0}},
           "arrays": {"w": {"dtype": "|V0", "shape": shape, "shards": shards}},
           "values": {}, "structure": None}
    return seal(json.dumps(doc, separators=(",", ":")).encode(), "xxh3-128")


@pytest.mark.timeout(60)
def test_shards_split_on_a_later_axis_are_checked_without_comparing_all_pairs():
    """The overlap check swept along the first dimension only: 4096 shards of [1, 4096]
    (split on axis 1, all sharing axis 0) were compared all with all, 17 s per parse (and a
    restore parses more than once). It now sweeps the axis the shards split most."""
    from pitstop.core.format.validate import parse
    m = parse(sharded_manifest([1, 4096], [[[0, 1], [i, i + 1]] for i in range(4096)]), "x")
    assert len(m.arrays["w"].shards) == 4096
    grid = [[[i, i + 1], [j, j + 1]] for i in range(64) for j in range(64)]
    assert len(parse(sharded_manifest([64, 64], grid), "x").arrays["w"].shards) == 4096
    with pytest.raises(pitstop.CorruptCheckpointError, match="exactly once"):
        parse(sharded_manifest([64, 64], [*grid[:-1], [[0, 1], [0, 1]]]), "x")  # twice + gap
    with pytest.raises(pitstop.CorruptCheckpointError, match="exactly once"):
        parse(sharded_manifest([2, 2], [[[0, 2], [0, 1]], [[0, 2], [0, 1]]]), "x")


# --------------------------------------------------------------------------- names
def test_a_file_name_with_a_trailing_newline_is_not_a_plain_name(run):
    """The name check used re.match with "$", which matches before a final newline:
    "data-000.bin\\n" passed as a plain file name (and split the CLI's one-line error)."""
    def fn(doc):
        doc["files"]["data-000.bin\n"] = doc["files"].pop("data-000.bin")
        doc["arrays"]["w"]["file"] = "data-000.bin\n"
    edit(run, fn)
    os.rename(os.path.join(ck(run), "data-000.bin"), os.path.join(ck(run), "data-000.bin\n"))
    refused(run, "plain file name")


@pytest.mark.parametrize("field, value", [("format_version", "1.1\n"), ("codec", "none\n")])
def test_versions_and_codecs_are_matched_whole(run, field, value):
    def fn(doc):
        (doc if field == "format_version" else doc["arrays"]["w"])[field] = value
    edit(run, fn)
    refused(run, "format_version" if field == "format_version" else "codec")


def test_an_index_step_with_a_trailing_newline_is_rebuilt(run):
    from pitstop.core.directory.catalog import parse_index
    path = os.path.join(run, ".pitstop", "index.json")
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc["checkpoints"] = {f"{k}\n": v for k, v in doc["checkpoints"].items()}
    with pytest.raises(ValueError, match="is not a step's"):
        parse_index(json.dumps(doc).encode(), doc["directory_id"])


# --------------------------------------------------------------------------- memory tier
def test_user_metadata_of_any_savable_kind_goes_through_the_memory_tier(tmp_path):
    """The tier description held metrics and user_metadata as plain json.dumps: a save
    with user_metadata={"b": b"x"} raised a raw TypeError with the tier on (the default),
    where without it the save works; tuples, int keys and NaN came back changed (or as
    non-JSON NaN) from a recovered snapshot. They are encoded as in the manifest now."""
    from pitstop.core.save.memtier import MemoryTier
    root, d = tmp_path / "tier", tmp_path / "run"
    root.mkdir()
    meta_um = {"b": b"x", "t": (1, 2), "f": float("inf"), "d": {1: "int key"}}
    with open_mgr(d, memory_tier=str(root)) as mgr:
        mgr.save(1, state_of(1)).result(timeout=60)
        mgr.save(2, state_of(2), metrics={"n": float("inf")},
                 user_metadata=meta_um).result(timeout=60)
        names = sorted(p for p in os.listdir(root) if p.endswith(".json"))
        with open(root / names[-1]) as f:
            meta = json.loads(f.read(), parse_constant=lambda w: pytest.fail(f"{w} in JSON"))
        buf = (root / names[-1]).with_suffix(".buf").read_bytes()
        ident = mgr.directory_id
    shutil.rmtree(ck(d, 2))  # the tier holds the only copy of step 2: a crash before commit
    os.unlink(d / ".pitstop" / "index.json")
    meta["committed"] = False
    prefix = MemoryTier(str(root), str(d), ident).prefix
    with open(prefix + "-0.json", "w") as f:
        json.dump(meta, f)
    with open(prefix + "-0.buf", "wb") as f:
        f.write(buf)
    with open_mgr(d, memory_tier=str(root)) as mgr:
        assert mgr.restore(blank()) == 2
    m = CheckpointReader(LocalStorage(str(d), create=False), step_name(2)).manifest
    assert m.user_metadata == {**meta_um, "f": float("inf")}
    assert m.metrics == {"n": float("inf")}


def test_a_directory_in_place_of_a_tier_buffer_does_not_fail_opening(tmp_path, caplog):
    """A directory under a tier buffer's name: the snapshot is unusable (said), and its
    removal failed with a raw IsADirectoryError out of CheckpointManager(...)."""
    from pitstop.core.save.memtier import MemoryTier
    root, d = tmp_path / "tier", tmp_path / "run"
    root.mkdir()
    with open_mgr(d, memory_tier=str(root)) as mgr:
        mgr.save(1, state_of(1)).result(timeout=60)
        ident = mgr.directory_id
    prefix = MemoryTier(str(root), str(d), ident).prefix
    os.mkdir(prefix + "-0.buf")
    with caplog.at_level("WARNING", logger="pitstop"):
        with open_mgr(d, memory_tier=str(root)) as mgr:
            target = blank()
            assert mgr.restore(target) == 1
    said = [r.getMessage() for r in caplog.records if "cannot remove" in r.getMessage()]
    assert len(said) == 1 and "Is a directory" in said[0], said


# --------------------------------------------------------------------------- deep stacks
def nested(n: int) -> dict:
    v: object = 1
    for _ in range(n):
        v = {"a": v}
    return v  # type: ignore[return-value]


def at_depth(n: int, fn):
    return fn() if n == 0 else at_depth(n - 1, fn)


def test_a_deeply_nested_valid_value_loads_from_a_deep_call_stack(tmp_path):
    """parse took any RecursionError met while checking values for corruption: a valid
    checkpoint (values nested 190 deep, within tree.MAX_DEPTH) loaded from a deep but legal
    call stack was "malformed", and load() said there was no valid checkpoint. A deep
    caller's manifest is now parsed (and load's tree rebuilt) on a fresh stack."""
    d = tmp_path / "run"
    state = {"w": np.zeros(3, "f4"), "cfg": nested(190)}
    with open_mgr(d) as mgr:
        mgr.save(1, state).result(timeout=60)
    with open_mgr(d, read_only=True) as mgr:
        assert mgr.load()["cfg"] == nested(190)  # from a shallow stack: fine
        depth = 0
        frame = __import__("sys")._getframe()
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        got = at_depth(700 - depth, lambda: mgr.load(step=1))
        assert got["cfg"] == nested(190)


# --------------------------------------------------------------------------- compressed
def test_a_frame_header_that_contradicts_its_entry_is_found_before_restore_writes(tmp_path):
    """A compressed array whose (hash-matching) zstd frame says it decodes to 12000 bytes
    where its entry needs 4000: restore() found it only while streaming, after writing the
    arrays before it, and said "had already overwritten 'w'" even of the one it had not.
    Every frame header is checked with the plan now, so the target is untouched."""
    import xxhash
    import zstandard
    d = tmp_path / "run"
    with open_mgr(d, compression="zstd") as mgr:
        for s in (1, 2):
            mgr.save(s, {"a": np.arange(1000, dtype="f4") * s,
                         "w": np.arange(1000, dtype="f4") * s}).result(timeout=60)
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(12000))

    def fn(doc):
        old = doc["arrays"]["w"]
        doc["files"]["extra.bin"] = {"length": len(payload)}
        doc["arrays"]["w"] = {**old, "file": "extra.bin", "offset": 0, "length": len(payload),
                              "hash": xxhash.xxh3_128_hexdigest(payload)}
    edit(d, fn)
    with open(os.path.join(ck(d), "extra.bin"), "wb") as f:
        f.write(payload)
    target = {"a": np.full(1000, 7, "f4"), "w": np.full(1000, 7, "f4")}
    with open_mgr(d, read_only=True) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="decodes to 12000") as info:
            mgr.restore(target, step=2)
    assert "overwritten" not in str(info.value)
    assert (target["a"] == 7).all() and (target["w"] == 7).all()


def test_a_zstd_bomb_without_a_content_size_is_refused_without_decoding_it_all(tmp_path):
    """64 KiB that decode to 2 GiB, with no content size in the frame header (the size
    check cannot see it): decoding stops at the entry's 4000 bytes."""
    import resource

    import xxhash
    import zstandard
    d = tmp_path / "run"
    with open_mgr(d, compression="zstd") as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).result(timeout=60)
    obj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    zeros = bytes(1 << 24)
    bomb = b"".join([obj.compress(zeros) for _ in range(128)] + [obj.flush()])

    def fn(doc):
        doc["files"]["bomb.bin"] = {"length": len(bomb)}
        doc["arrays"]["w"].update(file="bomb.bin", offset=0, length=len(bomb),
                                  hash=xxhash.xxh3_128_hexdigest(bomb))
    edit(d, fn)
    with open(os.path.join(ck(d), "bomb.bin"), "wb") as f:
        f.write(bomb)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(d, "cannot decode")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB


@pytest.mark.parametrize("target", ["/dev/zero", "/proc/self/mem", "."])
def test_a_data_file_linked_to_a_device_or_the_directory_is_refused(run, target):
    path = os.path.join(ck(run), "data-000.bin")
    os.unlink(path)
    os.symlink(target, path)
    refused(run, "outside checkpoint")


def test_a_data_file_hard_linked_from_outside_is_refused_as_a_symlink_is(run, tmp_path):
    """A hard link is a second name of a file that is also elsewhere: whoever can write
    there changes the checkpoint's bytes without touching it (issue 27). pitstop never
    links files, so one with two names is refused, as a symlink out of the checkpoint is;
    its error says how to copy a checkpoint without links (cp -l, a dedup tool, rsync
    --link-dest leave them). (Before issue 27 it was read, hash-verified.)"""
    path = os.path.join(ck(run), "data-000.bin")
    outside = tmp_path / "outside.bin"
    shutil.copy(path, outside)
    os.unlink(path)
    os.link(outside, path)
    assert "cp -a" in str(refused(run, "hard link"))


def test_object_store_file_names_cannot_reach_other_keys():
    """memory:// (fsspec): a file name spelled to reach another key ("..%2f", a "/") is
    refused by the name check before the store is asked."""
    import fsspec
    url = "memory://probe-bucket/run"
    fs = fsspec.filesystem("memory")
    fs.rm("/probe-bucket", recursive=True) if fs.exists("/probe-bucket") else None
    with open_mgr(url) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).result(timeout=60)
    key = f"/probe-bucket/run/{step_name(2)}/manifest.json"
    fs.pipe("/probe-bucket/run/secret.bin", fs.cat(f"/probe-bucket/run/{step_name(1)}/data-000.bin"))
    body = fs.cat(key)
    body = body[:body.index(b',"manifest_hash"')] + b"}"
    try:
        for name in ("..%2fsecret.bin", "../secret.bin", f"x/../../{step_name(1)}"):
            doc = json.loads(body)
            doc["files"] = {name: doc["files"].pop("data-000.bin")}
            doc["arrays"]["w"]["file"] = name
            fs.pipe(key, seal(json.dumps(doc, separators=(",", ":")).encode(), "xxh3-128"))
            with open_mgr(url, read_only=True) as mgr:
                with pytest.raises(pitstop.CorruptCheckpointError, match="plain file name"):
                    mgr.load(step=2)
    finally:
        fs.rm("/probe-bucket", recursive=True)
