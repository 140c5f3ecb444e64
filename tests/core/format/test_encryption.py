"""Encryption at rest (AES-256-GCM, HMAC-sealed manifest): round trips, what is on disk, and
every way a wrong key or a changed byte must be refused clearly."""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pitstop
from pitstop.core.format import crypto
from pitstop.core.format.seal import seal
from pitstop.core.format.validate import parse
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage.local import LocalStorage
from pitstop.core.tree import ArrayLeaf, NumpyLeaf

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
#: a run of bytes that occurs in the state and nowhere else by chance
MARK = b"PITSTOP-PLAINTEXT-MARKER-0123456"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """64 KiB segments: multi-segment arrays from a few hundred KiB of state."""
    monkeypatch.setattr(crypto, "SEGMENT", 64 << 10)
    monkeypatch.delenv(crypto.ENV, raising=False)


def enc(key: bytes = KEY) -> pitstop.Encryption:
    return pitstop.Encryption(lambda: key)


def state_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    marked = np.frombuffer(MARK * 2048, np.uint8).copy()  # 64 KiB of the marker
    return {"w": rng.standard_normal((300, 100)).astype(np.float32),  # 117 KiB: 2 segments
            "m": marked, "empty": np.zeros((0, 3)), "b": np.arange(step, step + 5),
            "step": step, "note": "plain values stay visible"}


def blank() -> dict:
    return {"w": np.zeros((300, 100), np.float32), "m": np.zeros(len(MARK) * 2048, np.uint8),
            "empty": np.zeros((0, 3)), "b": np.zeros(5, np.int64), "step": 0, "note": ""}


def same(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        else:
            assert a[k] == b[k], k


def mgr(d, key: bytes | None = KEY, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("save_on_signals", None)
    kw.setdefault("memory_tier", False)
    return pitstop.CheckpointManager(d, encryption=None if key is None else enc(key), **kw)


def saved(d, steps=(1, 2), **kw) -> None:
    with mgr(d, **kw) as m:
        for s in steps:
            m.save(s, state_of(s)).wait()


def step_dir(d, s: int) -> Path:
    return Path(d) / f"step_{s:010d}"


def files_bytes(d) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file())


@pytest.mark.parametrize("compression", [None, "zstd+shuffle"])
def test_round_trip_is_bit_exact_and_nothing_is_plaintext(tmp_path, compression):
    d = tmp_path / "run"
    saved(d, compression=compression)
    man = json.loads((step_dir(d, 2) / "manifest.json").read_bytes())
    assert man["format_version"] == "3.0" and "manifest_hash" not in man
    assert man["encryption"]["algorithm"] == "aes-256-gcm"
    assert man["encryption"]["key_id"] == enc().key_id
    base = "none" if compression is None else "zstd+shuffle4"
    assert man["arrays"]["w"]["codec"] == crypto.codec_of(base)
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert not [e.message for e in validator.iter_errors(man)][:3]
    assert not validator.is_valid({k: v for k, v in man.items() if k != "manifest_mac"})
    assert MARK not in files_bytes(d)
    assert KEY not in files_bytes(d) and KEY.hex().encode() not in files_bytes(d)
    with mgr(d, compression=compression) as m:
        t = blank()
        assert m.restore(t) == 2
        same(t, state_of(2))
        same(m.load(1), state_of(1))
        m.save(3, state_of(3)).wait()  # a run continued: still encrypted
    with mgr(d, read_only=True) as m:
        assert m.metadata(3).encryption is not None
    # the control: the same state without encryption does leave the marker on disk
    saved(tmp_path / "plain", steps=(1,), key=None)
    assert MARK in files_bytes(tmp_path / "plain")


class RowSharded(ArrayLeaf):
    """A 2-D array stored as row shards; restored through regions, as a sharded jax.Array is."""

    sharded = True

    def __init__(self, arr: np.ndarray, rows: list[tuple[int, int]]) -> None:
        self.arr, self.rows = arr, rows
        self.shape, self.dtype = arr.shape, arr.dtype
        self.regions: list[np.ndarray] = []
        self.restore_from = self._restore

    def pieces(self):
        return [(((a, b), (0, self.shape[1])), NumpyLeaf(self.arr[a:b])) for a, b in self.rows]

    def _restore(self, read) -> None:
        self.regions = [read(((0, self.shape[0]), (0, self.shape[1]))),
                        read(((90, 110), (3, 7)))]


def test_sharded_state_round_trip_and_region_reads(tmp_path):
    arr = np.random.default_rng(7).standard_normal((200, 120)).astype(np.float32)
    with mgr(tmp_path) as m:
        m.save(1, {"s": RowSharded(arr, [(0, 100), (100, 200)])}).wait()
        target = RowSharded(np.zeros_like(arr), [(0, 50), (50, 200)])
        assert m.restore({"s": target}) == 1
        whole, part = target.regions
        assert whole.tobytes() == arr.tobytes()
        assert part.tobytes() == arr[90:110, 3:7].tobytes()
        entry = m.metadata(1).arrays["s"]
        assert len(entry.shards) == 2 and all(s.codec == "aes-256-gcm" for s in entry.shards)
        CheckpointReader(LocalStorage(str(tmp_path)), "step_0000000001",
                         encryption=enc()).verify()


def nonces(d, s: int, key: bytes = KEY) -> list[bytes]:
    """Every segment's stored nonce in checkpoint ``s`` (walking the manifest's entries)."""
    r = CheckpointReader(LocalStorage(str(d)), f"step_{s:010d}", encryption=enc(key))
    seg = r.manifest.encryption["segment_bytes"] + crypto.OVERHEAD
    out = []
    for _k, e in r.manifest.stored():
        data = (step_dir(d, s) / e.file).read_bytes()[e.offset:e.offset + e.length]
        out += [data[i:i + crypto.NONCE] for i in range(0, len(data), seg)]
    return out


def test_nonces_are_unique_across_files_and_checkpoints(tmp_path):
    saved(tmp_path, steps=(1, 2, 3), writer_threads=3)  # several data files per checkpoint
    assert len(list(step_dir(tmp_path, 1).glob("data-*.bin"))) > 1
    every = nonces(tmp_path, 1) + nonces(tmp_path, 2) + nonces(tmp_path, 3)
    assert len(every) == 15 and len(set(every)) == len(every)
    # the same state saved twice encrypts differently (no deterministic keystream reuse)
    with mgr(tmp_path) as m:
        m.save(4, state_of(1)).wait()
    assert (step_dir(tmp_path, 1) / "data-000.bin").read_bytes() != \
        (step_dir(tmp_path, 4) / "data-000.bin").read_bytes()


def test_wrong_key_and_no_key_are_clear_and_read_nothing(tmp_path, monkeypatch):
    saved(tmp_path, steps=(1,))
    where = str(step_dir(tmp_path, 1))
    with pytest.raises(pitstop.EncryptionKeyError) as e:
        CheckpointReader(LocalStorage(str(tmp_path)), "step_0000000001", encryption=enc(OTHER))
    assert where in str(e.value) and enc().key_id in str(e.value) \
        and enc(OTHER).key_id in str(e.value)
    with pytest.raises(pitstop.EncryptionKeyError, match=r"is encrypted \(key id \w+\); set PITSTOP_ENCRYPTION"):
        CheckpointReader(LocalStorage(str(tmp_path)), "step_0000000001")
    # a manager: refused at construction, writer or reader, with or without a key
    for key, ro in ((None, False), (None, True), (OTHER, False), (OTHER, True)):
        with pytest.raises(pitstop.EncryptionKeyError, match="encrypted"):
            mgr(tmp_path, key=key, read_only=ro)
    # nothing was moved aside or changed
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pitstop", "step_0000000001"]
    # a reader (the export helpers' read-only manager) takes the key from the variable
    monkeypatch.setenv(crypto.ENV, KEY.hex())
    with pitstop.CheckpointManager(tmp_path, read_only=True, save_on_signals=None) as m:
        same(m.load(), state_of(1))


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def reseal_plain(path: Path, edit) -> None:
    """Edit a manifest value and seal it as a plaintext manifest would be (no key needed)."""
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_mac")
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(seal(body, doc["hash_algorithm"]))


def tamper_cases():
    def data_byte(d):
        e = json.loads((step_dir(d, 2) / "manifest.json").read_bytes())["arrays"]["w"]
        flip(step_dir(d, 2) / e["file"], e["offset"] + 40)
        return "'w'"

    def manifest_value(d):
        reseal_plain(step_dir(d, 2) / "manifest.json",
                     lambda doc: doc["values"].__setitem__("step", {"$int": 99}))
        return "manifest"

    def manifest_value_kept_mac(d):
        p = step_dir(d, 2) / "manifest.json"
        p.write_bytes(p.read_bytes().replace(b'"plain values stay visible"',
                                             b'"plain values stay VISIBLE"'))
        return "manifest"

    def swapped_files(d):
        for f in step_dir(d, 1).glob("data-*.bin"):
            shutil.copy(f, step_dir(d, 2) / f.name)
        return "array"

    def truncated(d):
        e = json.loads((step_dir(d, 2) / "manifest.json").read_bytes())["arrays"]["w"]
        p = step_dir(d, 2) / e["file"]
        p.write_bytes(p.read_bytes()[:e["offset"] + e["length"] - 100])
        return e["file"]

    return [data_byte, manifest_value, manifest_value_kept_mac, swapped_files, truncated]


@pytest.mark.parametrize("tamper", tamper_cases(), ids=lambda f: f.__name__)
def test_tampering_is_a_clear_error_and_restore_falls_back(tmp_path, tamper):
    saved(tmp_path)
    named = tamper(tmp_path)
    where = str(step_dir(tmp_path, 2))
    with pytest.raises(pitstop.CorruptCheckpointError) as e:
        r = CheckpointReader(LocalStorage(str(tmp_path)), "step_0000000002", encryption=enc())
        r.verify()
    assert where in str(e.value) and named in str(e.value), str(e.value)
    with mgr(tmp_path) as m, pytest.warns(UserWarning, match="step_0000000002"):
        t = blank()
        assert m.restore(t) == 1  # the previous valid one
        same(t, state_of(1))


def test_segments_swapped_between_arrays_do_not_authenticate(tmp_path):
    """Two arrays' stored bytes exchanged inside one file (same lengths): each segment is
    bound to its place, so decryption refuses it before the stored-bytes hash is compared."""
    with mgr(tmp_path, writer_threads=1) as m:
        m.save(1, {"a": np.ones(1000), "b": np.zeros(1000)}).wait()
    r = CheckpointReader(LocalStorage(str(tmp_path)), "step_0000000001", encryption=enc())
    a, b = r.manifest.arrays["a"], r.manifest.arrays["b"]
    assert a.file == b.file and a.length == b.length
    p = step_dir(tmp_path, 1) / a.file
    data = bytearray(p.read_bytes())
    sa, sb = bytes(data[a.offset:a.offset + a.length]), bytes(data[b.offset:b.offset + b.length])
    data[a.offset:a.offset + a.length], data[b.offset:b.offset + b.length] = sb, sa
    p.write_bytes(bytes(data))
    with pytest.raises(pitstop.CorruptCheckpointError, match="'a'.*does not authenticate"):
        r.read_array("a", a)


def test_older_reader_refuses_as_newer_format(tmp_path, monkeypatch):
    """An encrypted manifest is format 3.0: a 2.x reader (which checks no seal of a 3.x
    manifest, then its major) says "upgrade pitstop", never "corrupt" (nothing moved aside)."""
    saved(tmp_path, steps=(1,))
    data = (step_dir(tmp_path, 1) / "manifest.json").read_bytes()
    assert json.loads(data)["format_version"] == "3.0"
    from pitstop.core.format import validate
    monkeypatch.setattr(validate, "MAJOR", 2)
    with pytest.raises(pitstop.UnsupportedFormatError, match="Upgrade pitstop"):
        parse(data, "x", enc())


def test_plaintext_and_encrypted_never_mix(tmp_path):
    plain = tmp_path / "plain"
    saved(plain, steps=(1,), key=None)
    with pytest.raises(pitstop.EncryptionKeyError, match="holds unencrypted checkpoints"):
        mgr(plain)
    # a plaintext checkpoint copied into an encrypted directory is not trusted there
    secret = tmp_path / "secret"
    saved(secret, steps=(1,))
    shutil.copytree(step_dir(plain, 1), step_dir(secret, 2))
    with mgr(secret) as m, pytest.warns(UserWarning, match="not encrypted"):
        t = blank()
        assert m.restore(t) == 1
    # an empty plaintext directory becomes an encrypted one
    empty = tmp_path / "empty"
    mgr(empty, key=None).close()
    saved(empty, steps=(1,))
    with pytest.raises(pitstop.EncryptionKeyError):
        mgr(empty, key=None)


def test_key_forms_and_bad_keys_never_show_the_key(monkeypatch):
    want = enc().key_id
    monkeypatch.setenv(crypto.ENV, KEY.hex())
    assert pitstop.Encryption().key_id == want
    monkeypatch.setenv(crypto.ENV, base64.b64encode(KEY).decode() + "\n")
    assert pitstop.Encryption().key_id == want
    monkeypatch.setenv("MY_KEY", KEY.hex().upper())
    assert pitstop.Encryption(env="MY_KEY").key_id == want
    secret = "s3cr3t-" + KEY.hex()[:20]
    bad = [(lambda: pitstop.Encryption(env="UNSET_VAR_X"), "UNSET_VAR_X"),
           (lambda: pitstop.Encryption(lambda: KEY[:16]), "32 bytes"),
           (lambda: pitstop.Encryption(lambda: KEY.hex()), "32 bytes"),
           (lambda: pitstop.Encryption(KEY), "callable"),  # type: ignore[arg-type]
           (lambda: pitstop.Encryption(lambda: (_ for _ in ()).throw(RuntimeError(secret))),
            "raised RuntimeError")]
    for text in (KEY.hex()[:62], secret, base64.b64encode(KEY[:31]).decode()):
        monkeypatch.setenv("BAD_KEY", text)
        bad.append((lambda: pitstop.Encryption(env="BAD_KEY"), "BAD_KEY"))
        with pytest.raises(pitstop.InvalidArgumentError) as e:
            pitstop.Encryption(env="BAD_KEY")
        assert text not in str(e.value) and text[:16] not in str(e.value)
    for make, says in bad:
        with pytest.raises(pitstop.InvalidArgumentError, match=says) as e:
            make()
        assert secret not in str(e.value) and KEY.hex()[:16] not in str(e.value)
        assert e.value.__cause__ is None and (e.value.__context__ is None
                                              or e.value.__suppress_context__)
    e = enc()
    assert KEY.hex() not in repr(e) and want in repr(e)
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(e)
    with pytest.raises(pitstop.InvalidArgumentError, match="pitstop.Encryption"):
        pitstop.CheckpointManager("/tmp/never", encryption=KEY)
    # without the 'cryptography' package: say how to get it
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(pitstop.CheckpointError, match=r"pip install 'pitstop\[crypto\]'"):
        enc()


def test_the_key_is_in_no_log_file_or_error(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(crypto.ENV, KEY.hex())
    texts = []
    with pitstop.CheckpointManager(tmp_path, encryption=pitstop.Encryption(),
                                   save_on_signals=None) as m:  # memory tier on (default)
        m.save(1, state_of(1)).wait()
        texts += [repr(m.encryption), repr(m.metadata(1))]
    flip(next(step_dir(tmp_path, 1).glob("data-*.bin")), 100)
    for attempt in (lambda: mgr(tmp_path, key=OTHER),
                    lambda: mgr(tmp_path, read_only=True).load(1)):
        with pytest.raises(pitstop.CheckpointError) as e:
            attempt()
        texts.append(str(e.value))
    texts.append(caplog.text)
    blob = "\n".join(texts).encode() + files_bytes(tmp_path)
    for form in (KEY, KEY.hex().encode(), base64.b64encode(KEY)):
        assert form not in blob


def test_cli_verify_with_and_without_the_key(tmp_path):
    saved(tmp_path, steps=(1,))
    env = {k: v for k, v in os.environ.items() if k != crypto.ENV}
    cmd = [sys.executable, "-m", "pitstop.cli", "verify", str(tmp_path)]
    no = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert no.returncode == 2 and crypto.ENV in no.stdout + no.stderr, no
    env[crypto.ENV] = KEY.hex()
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert ok.returncode == 0, ok
    assert "OK" in ok.stdout or "ok" in ok.stdout, ok.stdout


def test_object_storage_round_trip(monkeypatch):
    import random
    url = f"memory://pitstop-enc-{os.getpid()}-{random.randrange(1 << 30)}"
    with mgr(url, compression="zstd") as m:
        m.save(1, state_of(1)).wait()
        m.save(2, state_of(2)).wait()
    import fsspec
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    blob = b"".join(fs.cat_file(p) for p in fs.find(root))
    assert MARK not in blob and b'"manifest_mac"' in blob
    with mgr(url) as m:
        t = blank()
        assert m.restore(t) == 2
        same(t, state_of(2))
    with pytest.raises(pitstop.EncryptionKeyError):
        mgr(url, key=None)


def test_several_ranks_each_encrypt_their_files(tmp_path):
    from thread_ranks import ranks
    d = tmp_path / "ck"

    def open_rank(coord, key=KEY):
        return pitstop.CheckpointManager(d, distributed=coord, save_on_signals=None,
                                         memory_tier=False, encryption=enc(key))

    def job(rank, coord):
        with open_rank(coord) as m:
            m.save(1, {**state_of(1), "mine": np.full(4, rank)}).wait()

    ranks(2, job)
    r = CheckpointReader(LocalStorage(str(d)), "step_0000000001", encryption=enc())
    assert r.manifest.world == 2 and r.manifest.encryption is not None
    assert sorted({f.split("-")[1] for f in r.manifest.files}) == ["r00000", "r00001"]
    r.verify()  # every rank's files
    assert MARK not in files_bytes(d)

    def resume(rank, coord):
        t = {**blank(), "mine": np.zeros(4, int)}
        with open_rank(coord) as m:
            return m.restore(t), t["mine"].tolist(), t["w"].tobytes() == state_of(1)["w"].tobytes()

    assert ranks(2, resume) == [(1, [0] * 4, True), (1, [1] * 4, True)]

    def other_key(rank, coord):
        try:
            open_rank(coord, KEY if rank == 0 else OTHER).close()
        except pitstop.CheckpointError as e:
            return str(e)
        return None

    said = ranks(2, other_key)
    assert all(s and enc(OTHER).key_id in s for s in said), said


_CHILD = """
import sys, time
import numpy as np
import pitstop
d, MARK = sys.argv[1], sys.argv[2].encode()
mgr = pitstop.CheckpointManager(d, save_on_signals=None, encryption=pitstop.Encryption())
def hold(step):
    if step == 2:
        print("HOLD", mgr.directory_id, flush=True)
        time.sleep(600)
mgr.hooks["before_write"] = hold
marked = lambda s: {"m": np.frombuffer(MARK * 2048, np.uint8) + 0, "step": s}
mgr.save(1, marked(1)).wait()
mgr.save(2, marked(2))
time.sleep(600)
"""


def test_memory_tier_recovery_persists_encrypted(tmp_path):
    """A writer SIGKILLed mid-persist: the next one restores the plaintext snapshot from
    /dev/shm and persists it encrypted, like any save."""
    from pitstop.core.save.memtier import default_root
    if default_root() is None:
        pytest.skip("no usable /dev/shm")
    d = tmp_path / "ck"
    env = {**os.environ, crypto.ENV: KEY.hex()}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(d), MARK.decode()], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("HOLD"), p.stderr.read()
    finally:
        p.kill()
        p.wait(30)
    ident = line.split()[1]
    try:
        with mgr(d, memory_tier=None) as m:
            t = {"m": np.zeros(len(MARK) * 2048, np.uint8), "step": 0}
            assert m.restore(t) == 2 and t["m"].tobytes() == MARK * 2048
            m.wait()
            assert m.all_steps() == [1, 2]
        man = json.loads((step_dir(d, 2) / "manifest.json").read_bytes())
        assert man["format_version"] == "3.0" and man["encryption"]["key_id"] == enc().key_id
        assert MARK not in files_bytes(d)
    finally:
        import glob
        for f in glob.glob(f"{default_root()}/pitstop-{ident}-*"):
            os.unlink(f)
