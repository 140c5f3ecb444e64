"""The asynchronous engine: snapshot vs commit, staging buffers, backpressure, failures, stats.

Every test holds the background persist with the ``before_write`` test hook where it needs to
observe an intermediate state, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pitstop
from pitstop.core.manager import step_name

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def make_state(seed: float = 0.0) -> dict:
    return {
        "model": {"w": np.arange(50_000, dtype=np.float32) + seed,
                  "b": np.full((7, 3), seed, dtype=np.float64)},
        "opt": [np.arange(1000, dtype=np.int64) * int(seed + 1), np.float32(seed)],
        "progress": {"epoch": int(seed), "history": [seed, seed * 2]},
    }


class Gate:
    """A before_write hook that holds the persist of chosen steps until released."""

    def __init__(self, steps: set[int] | None = None) -> None:
        self.steps = steps
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen: list[int] = []

    def __call__(self, step: int) -> None:
        self.seen.append(step)
        if self.steps is None or step in self.steps:
            self.entered.set()
            assert self.release.wait(60), "test forgot to release the gate"


@pytest.fixture
def managers(tmp_path):
    """Create managers (memory tier off unless asked) and always close them."""
    made: list[tuple[pitstop.CheckpointManager, list[Gate]]] = []

    def make(directory=None, gates=(), **kw) -> pitstop.CheckpointManager:
        kw.setdefault("memory_tier", False)
        kw.setdefault("save_on_signals", None)
        m = pitstop.CheckpointManager(directory or tmp_path / "ckpt", **kw)
        made.append((m, list(gates)))
        return m

    yield make
    for m, gates in made:
        for g in gates:
            g.release.set()
        try:
            m.close()
        except pitstop.CheckpointError:
            pass


def assert_tree_equal(got, want) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for k in want:
            assert_tree_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_tree_equal(g, w)
    elif isinstance(want, (np.ndarray, np.generic)):
        got = np.asarray(got)
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(got, want)
    else:
        assert got == want


def leftovers(directory) -> list[str]:
    return [e for e in os.listdir(directory) if e.startswith(".tmp-")]


# ------------------------------------------------------------------ snapshot vs commit
def test_save_returns_after_snapshot_and_commits_in_background(managers, tmp_path):
    gate = Gate()
    mgr = managers(gates=[gate])
    mgr.hooks["before_write"] = gate
    state = make_state(1.0)
    expected = make_state(1.0)

    handle = mgr.save(1, state, metrics={"loss": 0.5})

    assert gate.entered.wait(30)
    # snapshot taken, not committed: nothing visible on disk yet
    assert handle.snapshot_taken
    assert not handle.committed
    assert not handle.done()
    assert handle.wait(timeout=0) is False
    with pytest.raises(TimeoutError):
        handle.result(timeout=0)
    assert mgr.storage.list_checkpoints() == []
    # latest_step() already names it: restore() and load() would wait for it and return it
    assert mgr.latest_step() == 1 and mgr.all_steps() == [1]

    # the caller mutates everything at once: arrays in place, values, containers
    state["model"]["w"] += 1000
    state["model"]["b"][:] = -1
    state["opt"][0] *= 0
    state["progress"]["epoch"] = 99
    state["progress"]["history"].append(123.0)

    gate.release.set()
    stats = handle.result(timeout=60)
    assert handle.done() and handle.committed and handle.wait() is True
    assert stats.committed and stats.step == 1
    assert mgr.latest_step() == 1
    assert_tree_equal(mgr.load(1), expected)

    # and restore puts the snapshot-time values back into the live (mutated) objects
    assert mgr.restore(state) == 1
    assert_tree_equal(state["model"], expected["model"])
    assert state["progress"] == expected["progress"]


def test_sync_save_is_committed_on_return(managers):
    mgr = managers(async_save=False)
    state = make_state(2.0)
    handle = mgr.save(5, state)
    assert handle.done() and handle.committed
    assert mgr.latest_step() == 5
    state["model"]["w"][:] = 0
    assert_tree_equal(mgr.load(5), make_state(2.0))


def test_wait_and_close_wait_for_pending_commits(managers, tmp_path):
    gate = Gate()
    mgr = managers(gates=[gate])
    mgr.hooks["before_write"] = gate
    h = mgr.save(3, make_state(3.0))
    assert gate.entered.wait(30)
    threading.Timer(0.2, gate.release.set).start()
    mgr.close()  # must not return before the commit
    assert h.committed
    ro = pitstop.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert ro.all_steps() == [3]


def test_save_after_close_raises(managers):
    mgr = managers()
    mgr.close()
    with pytest.raises(pitstop.CheckpointError):
        mgr.save(1, make_state())


# ------------------------------------------------------------------ staging buffers
def test_staging_buffer_is_reused_while_layout_stays(managers):
    mgr = managers()
    state = make_state(0.0)
    mgr.save(0, state).wait()
    assert len(mgr.pool.buffers) == 1
    first = mgr.pool.buffers[0]
    first_mem = first.buf
    for s in range(1, 6):
        state["model"]["w"] += 1  # values change, layout does not
        mgr.save(s, state).wait()
        assert mgr.pool.buffers == [first]
        assert first.buf is first_mem  # no re-allocation of the bytes either
    # a layout change (new shape) replaces the buffer; the pool never grows past capacity
    state["model"]["w"] = np.zeros(10, np.float32)
    mgr.save(6, state).wait()
    assert len(mgr.pool.buffers) == 1 and mgr.pool.buffers[0] is not first
    second = mgr.pool.buffers[0]
    mgr.save(7, state).wait()
    assert mgr.pool.buffers == [second]
    assert mgr.load(7)["model"]["w"].shape == (10,)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_staging_buffers_never_exceed_max_in_flight(managers, max_in_flight):
    gate = Gate()
    mgr = managers(gates=[gate], max_in_flight=max_in_flight, on_busy="skip",
                   save_every_steps=1)
    mgr.hooks["before_write"] = gate
    state = make_state()
    handles = []
    for s in range(20):
        state["model"]["w"] += 1
        h = mgr.step(s, state)
        if h is not None:
            handles.append(h)
        assert len(mgr.pool.buffers) <= max_in_flight
    # the persist thread holds one job at the gate; the others wait in the queue, each
    # holding a buffer: exactly max_in_flight snapshots were accepted
    assert len(handles) == max_in_flight
    assert mgr._engine.in_flight() == max_in_flight
    gate.release.set()
    mgr.wait()
    assert mgr.all_steps() == [h.step for h in handles]
    assert len(mgr.pool.buffers) <= max_in_flight


# ------------------------------------------------------------------ backpressure
def test_periodic_save_while_persisting_is_skipped(managers):
    gate = Gate()
    mgr = managers(gates=[gate], save_every_steps=2, on_busy="skip")
    mgr.hooks["before_write"] = gate
    state = make_state()
    h0 = mgr.step(0, state)
    assert h0 is not None
    assert gate.entered.wait(30)
    assert mgr.step(1, state) is None  # policy: not a save step
    assert mgr.step(2, state) is None  # a save step, but the previous one persists: skipped
    assert mgr.step(3, state) is None
    gate.release.set()
    h0.wait()
    h4 = mgr.step(4, state)
    assert h4 is not None  # the engine is free again right after wait()
    h4.wait()
    assert mgr.all_steps() == [0, 4]  # nothing was saved for step 2


def test_engine_is_free_as_soon_as_wait_returns(managers, caplog):
    # after wait() the next periodic save must never be skipped as "busy"
    caplog.set_level(logging.INFO, logger="pitstop")
    mgr = managers(save_every_steps=1, on_busy="skip")
    state = {"w": np.zeros(16, np.float32)}
    for s in range(0, 60, 2):
        mgr.save(s, state).wait()
        h = mgr.step(s + 1, state)
        assert h is not None, f"step {s + 1} skipped right after wait() of step {s}"
        h.wait()


def test_periodic_save_waits_with_on_busy_wait(managers):
    gate = Gate({0})
    mgr = managers(gates=[gate], save_every_steps=2, on_busy="wait")
    mgr.hooks["before_write"] = gate
    state = make_state()
    mgr.step(0, state)
    assert gate.entered.wait(30)
    done = threading.Event()
    result = {}

    def train():
        result["h"] = mgr.step(2, state)
        done.set()

    t = threading.Thread(target=train)
    t.start()
    assert not done.wait(0.3)  # blocked behind the persist of step 0
    gate.release.set()
    t.join(60)
    assert result["h"] is not None
    result["h"].wait()
    assert mgr.all_steps() == [0, 2]


def test_explicit_save_always_waits_for_a_buffer(managers):
    gate = Gate({0})
    mgr = managers(gates=[gate], on_busy="skip")
    mgr.hooks["before_write"] = gate
    state = make_state(0.0)
    mgr.save(0, state)
    assert gate.entered.wait(30)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("h", mgr.save(1, make_state(1.0))))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for the only staging buffer, not skipped
    gate.release.set()
    t.join(60)
    out["h"].wait()
    assert mgr.all_steps() == [0, 1]
    assert_tree_equal(mgr.load(1), make_state(1.0))


# ------------------------------------------------------------------ failures
def test_background_failure_is_logged_and_raised_on_next_call(managers, tmp_path, caplog):
    mgr = managers()
    state = make_state(1.0)
    mgr.save(1, state).wait()

    def boom(step):
        if step == 2:
            raise OSError(28, "No space left on device")

    mgr.hooks["before_write"] = boom
    caplog.set_level(logging.ERROR, logger="pitstop")
    h = mgr.save(2, make_state(2.0))
    with pytest.raises(pitstop.CheckpointWriteError) as ei:
        h.wait(60)
    # logged at once, by the background thread, before anyone asked
    assert any("step 2" in r.getMessage() and "No space left" in r.getMessage()
               for r in caplog.records)
    err = ei.value
    assert err.step == 2 and err.path and step_name(2) in err.path
    assert "No space left" in str(err) and str(tmp_path) in str(err)
    assert isinstance(err.__cause__, OSError)
    # the handle reported it: the next calls are not blamed for it (each failure once)
    mgr.hooks.clear()
    assert mgr.latest_step() == 1 and mgr.load()["progress"]["epoch"] == 1
    mgr.save(3, state).wait()
    assert mgr.all_steps() == [1, 3]
    assert not leftovers(tmp_path / "ckpt")
    assert_tree_equal(mgr.load(1), make_state(1.0))


def _finished(handle) -> None:
    """Wait until a save finished, without asking its handle for the outcome."""
    assert handle._event.wait(60)


@pytest.mark.parametrize("call", ["step", "save", "wait", "close"])
def test_a_failure_nobody_waited_for_is_raised_once_by_the_next_call(managers, call):
    mgr = managers(save_every_steps=1)

    def boom(step):
        if step == 7:
            raise RuntimeError("disk on fire")

    mgr.hooks["before_write"] = boom
    h = mgr.save(7, make_state())
    _finished(h)
    with pytest.raises(pitstop.CheckpointWriteError, match="step 7.*disk on fire") as info:
        if call == "step":
            mgr.step(8, make_state())
        elif call == "save":
            mgr.save(8, make_state())
        elif call == "wait":
            mgr.wait()
        else:
            mgr.close()
    if call != "close":
        if call == "save":  # the save() that reported it attempted its own step too
            assert info.value.handle.result(timeout=60).committed
        # reported once: the next calls work, and save
        assert mgr.step(9, make_state()).result(timeout=60).committed
        mgr.wait()
        assert mgr.all_steps() == ([8, 9] if call == "save" else [9])


@pytest.mark.parametrize("call", ["restore", "load", "latest_step", "all_steps"])
def test_an_old_failure_never_blocks_reading(managers, call):
    """restore/load/latest_step never raise an old save's failure (it stays for the next
    save/step/wait/close), and never fail because of it."""
    mgr = managers()
    mgr.save(1, make_state(1.0)).wait()

    def boom(step):
        raise OSError(28, "No space left on device")

    mgr.hooks["before_write"] = boom
    h = mgr.save(2, make_state(2.0))
    _finished(h)
    target = make_state(0.0)
    if call == "restore":
        assert mgr.restore(target) == 1
        assert_tree_equal(target, make_state(1.0))
    elif call == "load":
        assert_tree_equal(mgr.load(), make_state(1.0))
    elif call == "latest_step":
        assert mgr.latest_step() == 1
    else:
        assert mgr.all_steps() == [1]
    with pytest.raises(pitstop.CheckpointWriteError, match="step 2"):
        mgr.wait()
    mgr.wait()  # once


def test_sync_save_failure_raises_once(managers):
    mgr = managers(async_save=False)
    mgr.hooks["before_write"] = lambda step: (_ for _ in ()).throw(OSError(5, "I/O error"))
    with pytest.raises(pitstop.CheckpointWriteError, match="I/O error"):
        mgr.save(1, make_state())
    mgr.hooks.clear()
    # the error was reported by the call that failed; the next save is not blamed for it
    assert mgr.save(2, make_state()).committed


_EFBIG_CHILD = textwrap.dedent("""
    import json, logging, os, resource, signal, sys
    import numpy as np
    import pitstop
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    d = sys.argv[1]
    out = {}
    mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
    small = {"w": np.arange(1000, dtype=np.float64)}
    mgr.save(1, small).wait()
    # from now on no file may grow past 256 KiB: the big save fails with EFBIG, for real
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    big = {"w": np.ones(1 << 20, dtype=np.float64)}   # 8 MiB
    h = mgr.save(2, big)
    h._event.wait()  # finished; nobody asked the handle: the next call reports it
    out["handle"] = "committed" if h.committed else "error"
    for call in ("save", "close"):
        try:
            if call == "save":
                mgr.save(3, small)
            else:
                mgr.close()
            out[call] = None
        except pitstop.CheckpointWriteError as e:
            out[call] = {"step": e.step, "path": e.path, "msg": str(e),
                         "cause": repr(e.__cause__)}
    print(json.dumps(out))
""")


def test_real_write_failure_efbig_is_reported_and_committed_data_survives(tmp_path):
    d = tmp_path / "ckpt"
    r = subprocess.run([PY, "-c", _EFBIG_CHILD, str(d)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["handle"] == "error"
    err = out["save"]
    assert err is not None, "the failure of step 2 was lost"
    assert err["step"] == 2 and step_name(2) in err["path"]
    assert "File too large" in err["msg"] or "EFBIG" in err["cause"] or "27" in err["cause"]
    # logged at once by the background thread
    assert "step 2" in r.stderr and "File too large" in r.stderr
    # the save() of step 3 reported step 2's failure and saved step 3 all the same;
    # close had nothing left to report
    assert out["close"] is None
    # committed checkpoints intact and restorable, no temporary leftovers
    assert not leftovers(d)
    mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
    try:
        assert mgr.all_steps() == [1, 3]
        target = {"w": np.zeros(1000, np.float64)}
        assert mgr.restore(target, step=1) == 1
        np.testing.assert_array_equal(target["w"], np.arange(1000, dtype=np.float64))
    finally:
        mgr.close()


def _can_mount_tmpfs(path) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_full_disk_on_tmpfs(tmp_path, caplog):
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here")
    try:
        caplog.set_level(logging.ERROR, logger="pitstop")
        mgr = pitstop.CheckpointManager(mnt / "ckpt", memory_tier=False, save_on_signals=None)
        small = {"w": np.arange(1000, dtype=np.float64)}
        mgr.save(1, small).wait()
        h = mgr.save(2, {"w": np.ones(1 << 20, dtype=np.float64)})  # 8 MiB > 2 MiB
        with pytest.raises(pitstop.CheckpointWriteError, match="No space left"):
            h.wait(60)
        assert any("No space left" in r.getMessage() for r in caplog.records)
        mgr.wait()  # reported by the handle: not raised again
        assert not leftovers(mnt / "ckpt")
        mgr.save(3, small).wait()  # space is free again: saving works
        mgr.close()
        ro = pitstop.CheckpointManager(mnt / "ckpt", read_only=True)
        assert ro.all_steps() == [1, 3]
        np.testing.assert_array_equal(ro.load(1)["w"], small["w"])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ------------------------------------------------------------------ stats
def test_every_save_reports_stats_callback_and_log(managers, caplog):
    seen = []
    caplog.set_level(logging.INFO, logger="pitstop")
    mgr = managers(on_save=seen.append, save_every_steps=2)
    state = make_state()
    nbytes = sum(a.nbytes for a in (state["model"]["w"], state["model"]["b"], state["opt"][0]))
    handles = [mgr.save(1, state)]
    handles[0].wait()
    for s in range(2, 7):
        h = mgr.step(s, state)
        if h is not None:
            h.wait()
            handles.append(h)
    assert [h.step for h in handles] == [1, 2, 4, 6]
    assert [s.step for s in mgr.stats] == [1, 2, 4, 6]
    assert [s.step for s in seen] == [1, 2, 4, 6]
    for h, cb in zip(handles, seen, strict=True):
        st = h.result()
        assert cb is st  # the callback receives the save's own figures
        assert st.committed
        assert st.stall_s > 0 and st.persist_s > 0 and st.total_s >= st.persist_s
        assert st.bytes >= nbytes
        assert st.throughput == pytest.approx(st.bytes / st.persist_s)
    lines = [r.getMessage() for r in caplog.records if "committed step" in r.getMessage()]
    assert len(lines) == 4
    assert "committed step 6" in lines[-1] and "stall" in lines[-1] and "persist" in lines[-1]


# ------------------------------------------------------------------ exceptions
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_in_with_block_commits_last_snapshot_first(tmp_path, exc):
    gate = Gate({5})
    mgr = pitstop.CheckpointManager(tmp_path / "ckpt", memory_tier=False, save_on_signals=None,
                                    save_every_steps=5)
    mgr.hooks["before_write"] = gate
    state = make_state(0.0)
    handle = None
    with pytest.raises(exc):
        with mgr:
            for step in range(0, 100):
                state["model"]["w"] += 1
                h = mgr.step(step, state)
                if step == 0:
                    h.wait()
                if step == 5:
                    handle = h
                    assert gate.entered.wait(30)
                    # release only well after the exception started propagating
                    threading.Timer(0.3, gate.release.set).start()
                if step == 7:
                    raise exc("training blew up")
    # by the time the exception reaches the caller, step 5 is committed
    assert handle is not None and handle.done() and handle.committed
    ro = pitstop.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert ro.all_steps() == [0, 5]
    np.testing.assert_array_equal(ro.load(5)["model"]["w"], make_state(6.0)["model"]["w"])
    # the manager was closed: the directory is free for the restart
    again = pitstop.CheckpointManager(tmp_path / "ckpt", memory_tier=False, save_on_signals=None)
    again.close()


def test_parallel_snapshot_copy_is_exact_for_every_layout(tmp_path):
    # above PARALLEL_COPY_MIN the snapshot copies on several threads, cutting large
    # contiguous arrays into chunks: every layout must still land exactly
    from pitstop.core.save.copying import COPY_CHUNK, PARALLEL_COPY_MIN
    rng = np.random.default_rng(7)
    n = (COPY_CHUNK * 2 + 12345) // 8
    state = {
        "big": rng.standard_normal(n),                                   # split in chunks
        "fortran": np.asfortranarray(rng.standard_normal((1500, 1500))),  # copied whole
        "strided": rng.standard_normal(2 * n)[::2],                       # non-contiguous
        "swapped": rng.standard_normal(n // 2).astype(">f8"),             # byte swap on copy
        "small": rng.integers(0, 9, 17, dtype=np.int16),
        "step": 3,
    }
    assert sum(a.nbytes for a in state.values() if isinstance(a, np.ndarray)) >= PARALLEL_COPY_MIN
    with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False, copy_threads=3,
                                   save_on_signals=None) as mgr:
        h = mgr.save(1, state)
        for v in state.values():  # mutating right after the snapshot changes nothing saved
            if isinstance(v, np.ndarray):
                v[...] = 0
        h.wait()
        out = mgr.load(1)
    rng = np.random.default_rng(7)
    want = {"big": rng.standard_normal(n),
            "fortran": rng.standard_normal((1500, 1500)),
            "strided": rng.standard_normal(2 * n)[::2],
            "swapped": rng.standard_normal(n // 2)}
    for k, v in want.items():
        assert np.array_equal(out[k], v), k


@pytest.mark.parametrize("tier", [False, True])
def test_hashes_taken_while_writing_match_whole_array_hashes(tmp_path, monkeypatch, tier):
    """Without a memory-tier copy to seal first, each array is hashed chunk by chunk as its
    data file is written: arrays across chunk boundaries, empty arrays (also last), many
    arrays in one chunk. The manifest's hashes are those of the whole arrays either way."""
    from pitstop.core.save import writing
    from pitstop.core.save.writing import hash_chunks
    monkeypatch.setattr(writing, "WRITE_CHUNK", 8192)
    monkeypatch.setattr(writing, "HASH_CHUNK", 3000)
    runs = []
    monkeypatch.setattr(writing, "_RunHasher", lambda *a, _c=writing._RunHasher:
                        runs.append(a) or _c(*a))
    rng = np.random.default_rng(7)
    state = {"a": rng.standard_normal(5000).astype(np.float32),  # 20000 B: 3 chunks
             "e0": np.zeros(0, np.float32),
             "small": [rng.integers(0, 9, 10 + i).astype(np.int16) for i in range(40)],
             "b": rng.standard_normal((33, 77)),
             "z": np.zeros((0, 4), np.float64)}
    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=tier, writer_threads=2) as mgr:
        mgr.save(1, state).wait()
    doc = json.loads((tmp_path / "c" / step_name(1) / "manifest.json").read_text())
    flat = {"a": state["a"], "e0": state["e0"], "b": state["b"], "z": state["z"]}
    for i, v in enumerate(state["small"]):
        flat[f"small/{i}"] = v
    for key, arr in flat.items():
        entry = next(e for k, e in doc["arrays"].items() if k.endswith(key))
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        assert entry["hash"] == hash_chunks(doc["hash_algorithm"], raw), key
    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False) as mgr:
        got = mgr.load()
    assert bool(runs) is not tier  # hashed while writing exactly when there is no tier
    np.testing.assert_array_equal(got["a"], state["a"])
    np.testing.assert_array_equal(got["small"][39], state["small"][39])
    assert got["z"].shape == (0, 4)


def test_newest_checkpoint_is_read_back_into_the_page_cache(tmp_path, monkeypatch):
    """Data files are written with O_DIRECT (not left in the page cache): the newest
    checkpoint is read back in the background, at close and after a save far from the one
    before it, never between saves that follow each other closely (it would slow them)."""
    from pitstop.core.storage.local import LocalStorage
    warmed: list[tuple[str, list[str]]] = []
    original = LocalStorage.warm_cache

    def spy(self, name, files):
        warmed.append((name, sorted(files)))
        original(self, name, files)  # the real advice runs too (no error on any file system)

    monkeypatch.setattr(LocalStorage, "warm_cache", spy)
    mgr = pitstop.CheckpointManager(tmp_path / "c", memory_tier=False)
    eng = mgr._engine
    for step in (1, 2, 3):
        eng._last_submit = time.perf_counter()  # right after the one before
        mgr.save(step, make_state(step)).wait()
    eng._last_submit -= 3600.0  # the next save comes an hour after the last one
    mgr.save(4, make_state(4)).wait()
    files = sorted(f for f in os.listdir(tmp_path / "c" / step_name(4)) if f != "manifest.json")
    deadline = time.monotonic() + 30
    while not warmed and time.monotonic() < deadline:  # (after the handle is finished)
        time.sleep(0.01)
    assert warmed == [(step_name(4), files)]  # and none of 1-3
    eng._last_submit = time.perf_counter()
    mgr.save(5, make_state(5)).wait()
    mgr.close()
    assert [w[0] for w in warmed] == [step_name(4), step_name(5)]  # step 5 at close, once


def test_a_save_is_warmed_at_commit_only_when_that_costs_little_of_the_gap(tmp_path,
                                                                        monkeypatch):
    """The read-back and the release of its pages cost CPU per GiB: a save is read back at
    commit only when the one before came long enough earlier for that to be WARM_SHARE of
    the time between them (1 GiB: 35 s), else only at close()."""
    import pitstop.core.save.engine as engine
    from pitstop.core.storage.local import LocalStorage
    assert engine.warm_gap_s(2**30) == pytest.approx(35.0)
    warmed: list[str] = []
    monkeypatch.setattr(LocalStorage, "warm_cache", lambda self, name, files:
                        warmed.append(name))
    state = make_state(1)
    # as if each GiB cost an hour of CPU: this state's saves must be a minute apart
    monkeypatch.setattr(engine, "WARM_CPU_S_PER_GIB", 3600.0)
    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False) as mgr:
        eng = mgr._engine
        eng._last_submit = time.perf_counter()
        mgr.save(0, state).wait()  # right after the one before: never at commit
        d = tmp_path / "c" / step_name(0)
        need = engine.warm_gap_s(sum(os.path.getsize(d / f) for f in os.listdir(d)
                                     if f != "manifest.json"))
        assert need > 10  # (far above how long the saves here take)
        eng._last_submit = time.perf_counter() - need / 2
        mgr.save(1, state).wait()
        time.sleep(0.2)
        assert warmed == []  # half the gap it needs: not at commit
        eng._last_submit = time.perf_counter() - 2 * need
        mgr.save(2, state).wait()
        deadline = time.monotonic() + 30
        while not warmed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warmed == [step_name(2)]
    assert warmed == [step_name(2)]  # close(): step 2 is warm already


def test_a_file_system_that_refuses_o_direct_after_creating_the_file_still_saves(
        tmp_path, monkeypatch):
    """Linux checks O_DIRECT support after O_CREAT made the file (tmpfs before 6.6, some
    FUSE file systems): open() fails with EINVAL and leaves an empty file behind. The
    buffered retry must take that file, not fail the save on its own O_EXCL."""
    import errno
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open
    refused: list[str] = []

    def refusing_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & direct:
            fd = real_open(path, flags & ~direct, mode, dir_fd=dir_fd)  # made, as Linux does
            os.close(fd)
            refused.append(os.fspath(path))
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", refusing_open)
    state = make_state(1)
    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False) as mgr:
        mgr.save(1, state).wait()
    monkeypatch.setattr(os, "open", real_open)
    assert refused  # the data files did try O_DIRECT
    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False) as mgr:
        got = mgr.load(1)
    np.testing.assert_array_equal(got["model"]["w"], state["model"]["w"])


class Held:
    """A before_write hook holding each save's persist until :meth:`release` of its step
    (``None``: every one, from now on)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.released: set[int] = set()
        self.all = False

    def wait(self, step: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.all or step in self.released, 60), step

    def release(self, step: int | None) -> None:
        with self.cond:
            if step is None:
                self.all = True
            else:
                self.released.add(step)
            self.cond.notify_all()


def loop_with_slow_persists(mgr, steps: int = 25, every: int = 5) -> list[int]:
    """The issue's loop: ``save_every_steps=5`` over 25 steps, each persist slower than one
    save interval and faster than two, deterministically: the persist of a save is held at
    the gate until the loop has made its step() call of the next save step, then the loop
    waits for it. Returns the steps step() saved."""
    held = Held()
    mgr.hooks["before_write"] = held.wait
    state = make_state()
    saved, last = [], None
    for s in range(steps):
        h = mgr.step(s, state)
        if s % every == 0 and last is not None:
            held.release(last.step)  # the next one came due
            if h is None:
                last.wait()  # done within two intervals
        if h is not None:
            saved.append(s)
            last = h
    held.release(None)
    mgr.wait()
    return saved


def test_a_skipped_periodic_save_warns_is_counted_and_listed(managers, tmp_path, caplog,
                                                            capsys):
    """Default on_busy: the saves of steps 5 and 15 came due while the previous persisted.
    They are skipped, but never in silence: one warning at once (the second is summed up at
    close), counted on the manager and in the next save's stats, listed by `pitstop ls`."""
    from pitstop.cli import main

    caplog.set_level(logging.WARNING, logger="pitstop")
    mgr = managers(save_every_steps=5, keep_last=2)
    assert loop_with_slow_persists(mgr) == [0, 10, 20]
    assert mgr.all_steps() == [10, 20]
    assert (mgr.skipped_saves, mgr.skipped_steps) == (2, [5, 15])
    assert [(s.step, s.skipped_before) for s in mgr.stats] == [(0, 0), (10, 1), (20, 1)]
    said = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()
            or "skipped" in r.getMessage()]
    assert len(said) == 1, said  # rate-limited: the first at once
    assert "step 5 not saved" in said[0] and "on_busy='wait'" in said[0]
    mgr.close()
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "1 more periodic save skipped" in said[-1] and "2 in all: steps 15" in said[-1]
    doc = json.loads((tmp_path / "ckpt" / ".pitstop" / "directory.json").read_text())
    assert doc["skipped"]["count"] == 2 and doc["skipped"]["steps"] == [5, 15]
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "ckpt")]) == 0
    assert "2 periodic saves skipped (previous save still persisting): steps 5, 15" in \
        capsys.readouterr().out
    # the next writer of the directory adds its own to the record
    again = managers(save_every_steps=5)
    gate = Gate({25})
    again.hooks["before_write"] = gate
    again.step(25, make_state())
    assert gate.entered.wait(30)
    assert again.step(30, make_state()) is None
    gate.release.set()
    again.close()
    doc = json.loads((tmp_path / "ckpt" / ".pitstop" / "directory.json").read_text())
    assert doc["skipped"]["count"] == 3 and doc["skipped"]["steps"] == [5, 15, 30]


def test_on_busy_wait_saves_every_step_of_the_same_loop(managers):
    """The same loop with on_busy="wait" (what Orbax, Keras and tf.train do): every save
    step is saved, nothing skipped."""
    mgr = managers(save_every_steps=5, keep_last=2, on_busy="wait")
    held = Held()
    mgr.hooks["before_write"] = held.wait
    state = make_state()
    for s in range(25):
        if s % 5 == 0 and s:
            held.release(s - 5)  # entering the next save step (which waits for it)
        mgr.step(s, state)
    held.release(None)
    mgr.wait()
    assert mgr.all_steps() == [15, 20]
    assert mgr.skipped_saves == 0 and [s.step for s in mgr.stats] == [0, 5, 10, 15, 20]


def test_later_skips_are_summed_up_and_a_failed_record_never_fails_the_writer(
        managers, caplog, monkeypatch):
    """Once the rate limit's interval passed (0 here), the next skip says how many came since
    the last warning; directory.json that cannot be written costs a warning, never a save."""
    from pitstop.core.save import skips

    monkeypatch.setattr(skips, "WARN_EVERY_S", 0.0)
    caplog.set_level(logging.WARNING, logger="pitstop")
    mgr = managers(save_every_steps=5)
    write_meta = mgr.storage.write_meta

    def refuse(name, data, **kw):
        if name == "directory.json":
            raise OSError(28, "No space left on device")
        return write_meta(name, data, **kw)

    monkeypatch.setattr(mgr.storage, "write_meta", refuse)
    assert loop_with_slow_persists(mgr) == [0, 10, 20]
    said = [r.getMessage() for r in caplog.records]
    assert any("1 more periodic save skipped" in m and "2 in all: steps 15" in m for m in said)
    assert any("could not record the skipped saves" in m and "No space left" in m
               for m in said), said
    assert mgr.all_steps() == [0, 10, 20] and mgr.skipped_saves == 2
    mgr.close()  # no error
