"""The first save's staging buffer is made ahead, off the training thread: a ``step()`` that
does not save (or a ``restore()`` that restored) starts it, the first save copies into it,
and a first save that had to make it itself says why.

Nothing here is timed: each test waits for the state it needs (the buffer made), with a
deadline."""

from __future__ import annotations

import glob
import logging
import threading
import time

import numpy as np

import pitstop
from pitstop.core.save import snapshot
from pitstop.core.save.snapshot import Layout, StagingPool
from pitstop.core.tree import NumpyLeaf

MIB = 2**20


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def layout_of(**arrays: np.ndarray) -> Layout:
    return Layout.of({k: NumpyLeaf(v) for k, v in arrays.items()})


def big_state(mib: int = 20) -> dict:
    return {"w": np.arange(mib * MIB // 4, dtype=np.float32), "step": 0}


def test_pool_prepare_hands_the_first_acquire_that_buffer() -> None:
    pool = StagingPool(1)
    layout = layout_of(w=np.zeros(1000, np.float32), b=np.zeros(3, np.int64))
    assert pool.prepare(layout)
    assert not pool.prepare(layout)  # one is being made (or made): nothing more to do
    wait_for(lambda: pool.buffers, "the prepared buffer")
    prepared = pool.buffers[0]
    assert pool.acquire(layout, block=False) is prepared
    assert pool.first_allocation == "prepared"
    pool.close()


def test_acquire_waits_for_a_buffer_being_prepared_and_allocates_no_second(monkeypatch) -> None:
    release = threading.Event()
    made: list[object] = []
    real = StagingPool._allocate

    def slow(self, layout):  # the preparing thread is held until the acquire waits on it
        release.wait(30)
        buf = real(self, layout)
        made.append(buf)
        return buf

    monkeypatch.setattr(StagingPool, "_allocate", slow)
    pool = StagingPool(1)
    layout = layout_of(w=np.zeros(10, np.float32))
    pool.prepare(layout)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(layout, block=False)))
    t.start()
    time.sleep(0.05)
    assert not got  # a save with on_busy="skip" waits for it too: it is never skipped for it
    release.set()
    t.join(30)
    assert got == made and len(made) == 1
    pool.close()


def test_a_state_that_changed_since_prepared_gets_a_new_buffer_and_says_why() -> None:
    pool = StagingPool(1)
    pool.prepare(layout_of(w=np.zeros(10, np.float32)))
    wait_for(lambda: pool.buffers, "the prepared buffer")
    other = layout_of(w=np.zeros(20, np.float32))
    buf = pool.acquire(other, block=False)
    assert buf is not None and buf.layout == other
    assert pool.first_allocation == "the state's arrays changed since it was prepared"
    pool.close()


def test_close_while_preparing_leaves_no_memory_tier_file(tmp_path, monkeypatch) -> None:
    release = threading.Event()
    real = StagingPool._allocate

    def slow(self, layout):
        release.wait(30)
        return real(self, layout)

    monkeypatch.setattr(StagingPool, "_allocate", slow)
    prefix = str(tmp_path / "tier")
    pool = StagingPool(1, shm_prefix=prefix)
    pool.prepare(layout_of(w=np.zeros(5000, np.float32)))
    closer = threading.Thread(target=pool.close)
    closer.start()
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert glob.glob(prefix + "*") == [] and pool.buffers == []


def test_populate_lets_go_of_pythons_lock_on_linux() -> None:
    # the path that makes preparing ahead free for the training thread is the one taken here
    m = snapshot._mapped(-1, 4 * MIB, snapshot.mmap.MAP_PRIVATE | snapshot.mmap.MAP_ANONYMOUS)
    try:
        assert snapshot._populate(m, 4 * MIB)
    finally:
        m.close()


def test_step_that_does_not_save_prepares_the_first_saves_buffer(tmp_path) -> None:
    mgr = pitstop.CheckpointManager(tmp_path / "run", save_every_steps=3, memory_tier=False,
                                    save_on_signals=None)
    state = big_state()
    assert mgr.step(1, state) is None
    wait_for(lambda: mgr.pool.buffers, "the staging buffer made ahead")
    prepared = mgr.pool.buffers[0]
    mgr.step(2, state)
    handle = mgr.step(3, state)
    assert handle is not None
    handle.wait()
    assert mgr.pool.buffers == [prepared] and mgr.pool.first_allocation == "prepared"
    mgr.close()
    again = pitstop.CheckpointManager(tmp_path / "run", save_every_steps=3, memory_tier=False,
                                      save_on_signals=None)
    restored = {"w": np.zeros_like(state["w"]), "step": 0}
    assert again.restore(restored) == 3
    wait_for(lambda: again.pool.buffers, "the staging buffer made after a restore")
    np.testing.assert_array_equal(restored["w"], state["w"])
    again.close()


def test_a_first_save_that_makes_its_own_buffer_says_why(tmp_path, caplog) -> None:
    mgr = pitstop.CheckpointManager(tmp_path / "run", memory_tier=False, save_on_signals=None)
    with caplog.at_level(logging.INFO, logger="pitstop"):
        mgr.save(1, big_state()).wait()
        mgr.save(2, big_state()).wait()
    said = [r.getMessage() for r in caplog.records if "staging buffer itself" in r.getMessage()]
    assert len(said) == 1, said
    assert "step 1" in said[0] and "no step() or restore() saw the state" in said[0]
    mgr.close()
