"""Large host arrays are hashed as they are copied into the staging buffer (xxh3 only, where
the raw bytes' hash is wanted): the persist then writes them without reading them again.
The digests must be exactly those of the staged bytes, the saves must verify, and the
optimisation must step aside (never fail a save) where it cannot run."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import pitstop
from pitstop.core.format.hashing import hash_bytes
from pitstop.core.format.validate import parse
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.save import copying
from pitstop.core.save.copying import HASH_COPY_PIECE, copy_hashing
from pitstop.core.storage.local import LocalStorage
from pitstop.core.tree import NumpyLeaf

MIB = 2**20


@pytest.mark.parametrize("nbytes", [0, 1, HASH_COPY_PIECE - 3, HASH_COPY_PIECE,
                                    3 * HASH_COPY_PIECE + 5])
@pytest.mark.parametrize("dtype", ["uint8", "float32", "complex64", "bool"])
@pytest.mark.parametrize("algorithm", ["xxh3-128", "xxh3-64"])
def test_copy_hashing_copies_and_digests_the_staged_bytes(nbytes: int, dtype: str,
                                                          algorithm: str) -> None:
    rng = np.random.default_rng(nbytes)
    raw = rng.integers(0, 256, nbytes - nbytes % np.dtype(dtype).itemsize, dtype=np.uint8)
    src = raw.view(dtype).reshape(-1)
    dst = np.zeros_like(src)
    digest = copy_hashing(src, dst, algorithm)
    assert dst.tobytes() == src.tobytes()
    assert digest == hash_bytes(algorithm, raw.tobytes())


def state(big: int = 6, small: int = 4, mib: float = 1.5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {f"big{i}": rng.standard_normal(int(mib * MIB) // 4).astype(np.float32)
           for i in range(big)}
    out.update({f"small{i}": rng.standard_normal(100).astype(np.float32) for i in range(small)})
    out["bytes"] = np.arange(MIB + 7, dtype=np.uint8)  # not a whole number of pages
    return out


def manifest_hashes(d: str, step: int = 1) -> dict[str, str]:
    (ckpt,) = [p for p in glob.glob(os.path.join(d, "*")) if os.path.isdir(p)
               and os.path.exists(os.path.join(p, "manifest.json"))]
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        m = parse(f.read(), ckpt)
    assert m.step == step
    CheckpointReader(LocalStorage(d), os.path.basename(ckpt)).verify()
    return {k: e.hash for k, e in m.arrays.items()}


def known_after_save(tmp_path, st, **kw) -> tuple[dict[str, str], dict[str, str], str]:
    d = str(tmp_path / "ck")
    kw.setdefault("hash_in_copy", True)
    mgr = pitstop.CheckpointManager(d, keep_last=1, memory_tier=False, **kw)
    try:
        mgr.save(1, st).wait()
        (buf,) = mgr._engine.pool.buffers
        known = dict(buf.known_hashes)
        algorithm = mgr._engine.hash_algorithm
    finally:
        mgr.close()
    return known, manifest_hashes(d), algorithm


@pytest.mark.parametrize("mib", [1.5, 8])  # serial copy (< 32 MiB) and the parallel one
def test_large_arrays_are_hashed_in_the_copy_and_the_save_verifies(tmp_path, mib) -> None:
    st = state(mib=mib)
    known, hashes, algorithm = known_after_save(tmp_path, st, copy_threads=2)
    big = {k for k, v in st.items() if v.nbytes >= copying.HASH_IN_COPY_MIN}
    assert set(known) == {k for k in hashes if k.split("/")[-1] in big} and len(known) == 7
    for key, digest in hashes.items():
        name = key.split("/")[-1]
        assert digest == hash_bytes(algorithm, st[name].tobytes()), key
        if key in known:
            assert known[key] == digest


def test_an_array_larger_than_one_threads_share_is_hashed_by_the_persist(tmp_path) -> None:
    st = {"huge": np.ones(40 * MIB // 4, np.float32), "b": np.zeros(2 * MIB, np.uint8)}
    known, hashes, algorithm = known_after_save(tmp_path, st, copy_threads=2)
    assert [k.split("/")[-1] for k in known] == ["b"]  # "huge" is chunked across threads
    for key, digest in hashes.items():
        assert digest == hash_bytes(algorithm, st[key.split("/")[-1]].tobytes())


@pytest.mark.parametrize("kw", [{"hash_algorithm": "sha256"},
                                {"compression": "zstd"}])
def test_not_hashed_in_the_copy_when_slow_or_not_wanted(tmp_path, kw) -> None:
    pytest.importorskip("zstandard")
    st = state()
    known, hashes, algorithm = known_after_save(tmp_path, st, **kw)
    assert known == {}
    if "hash_algorithm" in kw:
        assert all(hashes[k] == hash_bytes(algorithm, st[k.split("/")[-1]].tobytes())
                   for k in hashes)


def test_a_failing_hashed_copy_steps_aside(tmp_path, monkeypatch) -> None:
    def broken(self):
        raise RuntimeError("no view today")

    monkeypatch.setattr(NumpyLeaf, "host_view", broken)
    st = state()
    known, hashes, algorithm = known_after_save(tmp_path, st)
    assert known == {}
    assert all(hashes[k] == hash_bytes(algorithm, st[k.split("/")[-1]].tobytes())
               for k in hashes)


def test_a_reused_buffer_forgets_the_previous_saves_digests(tmp_path) -> None:
    st = state()
    d = str(tmp_path / "ck")
    with pitstop.CheckpointManager(d, keep_last=1, memory_tier=False,
                                   hash_in_copy=True) as mgr:
        mgr.save(1, st).wait()
        for v in st.values():
            v += 1  # every array changes
        mgr.save(2, st).wait()
    hashes = manifest_hashes(d, step=2)
    for key, digest in hashes.items():
        assert digest == hash_bytes("xxh3-128", st[key.split("/")[-1]].tobytes()), key


def test_off_by_default_the_stall_only_copies(tmp_path) -> None:
    """The hashed copy lengthens the stall (about a quarter at 1 GiB): a manager hashes in
    the copy only when asked, and its checkpoint is the same either way."""
    st = state()
    with pitstop.CheckpointManager(tmp_path / "off", keep_last=1, memory_tier=False) as mgr:
        mgr.save(1, st).wait()
        (buf,) = mgr._engine.pool.buffers
        assert buf.known_hashes == {}
    hashes = manifest_hashes(str(tmp_path / "off"))
    known_on, hashes_on, _algorithm = known_after_save(tmp_path / "on", st)
    assert known_on and hashes_on == hashes


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_hash_in_copy_takes_a_bool_only(tmp_path, bad) -> None:
    with pytest.raises(pitstop.InvalidArgumentError, match="hash_in_copy must be True or False"):
        pitstop.CheckpointManager(tmp_path / "ck", hash_in_copy=bad)
    assert not (tmp_path / "ck").exists()
