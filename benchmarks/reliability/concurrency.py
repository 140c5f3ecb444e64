"""Concurrency: readers, retention and writers at the same time, counted in trials.

- ``restore_during_retention``: a read-only manager in another process restores and loads
  the newest checkpoint again and again while the writer saves with ``keep_last`` 1 or 2, so
  retention deletes what the reader may be reading. Promise: an exact state of some step, or
  a clear ``CheckpointError`` (never corruption, never ``None`` while checkpoints exist, never
  a raw error). Retention skips a checkpoint under a reader's read lease (DESIGN.md); the
  counts say how often it did.
- ``two_writers``: a writer process saves in a loop; a second writer (this process) is
  refused with ``DirectoryLockedError`` naming the holder while it lives, and the holder's
  saves go on undisturbed; after a SIGKILL (at a random point, often mid-save) the second
  one takes over, removes the leftovers, recovers nothing wrong, and every checkpoint of both
  is exact.
- ``reader_while_writer_saves``: a read-only manager in another process lists, loads, reads
  metadata and restores listed steps in a loop while the writer saves and retention runs: it
  lists only committed steps, and what it reads is exact (or the step was deleted meanwhile
  and is no longer listed).
- ``restore_while_same_step_in_flight``: the save of step N is held inside its persist
  (before hashing, before writing or before the commit). docs/quickstart.md promises that the
  writer's own ``latest_step()`` names N and its ``restore()``/``load()`` wait for it: they
  must return N's snapshot exactly, and never before the commit. A second, read-only manager
  only sees committed checkpoints: N is not there (``CheckpointNotFoundError`` for
  ``step=N``; the newest is N-1) until the commit, and exact after. When the held save fails,
  the waiting restore returns N-1 (or ``CheckpointNotFoundError`` for ``step=N``), and the
  failure is raised once by ``wait()``.

A race waits for the state it needs (a line from the child, an event set by a hook), never
for a fixed time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pitstop

from . import Result, Scenario
from ._faultkit import (
    ChildDied,
    check_all_exact,
    committed_on_disk,
    counted_trial,
    diff,
    end,
    leftovers,
    quiet_pitstop,
    read_json_line,
    send,
    spawn,
    state_of,
    target_of,
    trial_rng,
)

#: the full run's trials per scenario: 50, or more where a trial is cheap
FULL_TRIALS = {"restore_during_retention": 50, "two_writers": 50,
               "reader_while_writer_saves": 50, "restore_while_same_step_in_flight": 200}


def _open(d: Path, **kw: Any) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(d, **kw)


# ====================================================================== the reader child
_READER = """
import json, sys
from benchmarks.reliability.concurrency import _reader_loop
from benchmarks.reliability._faultkit import quiet_pitstop
for line in sys.stdin:
    with quiet_pitstop():
        out = _reader_loop(json.loads(line))
    print(json.dumps(out), flush=True)
"""


def _reader_loop(cmd: dict[str, Any]) -> dict[str, Any]:
    """In the reader process: read ``cmd["dir"]`` until ``cmd["stop"]`` exists, checking
    every answer; returns the counts and the broken promises."""
    d, seed, n, stop = Path(cmd["dir"]), cmd["seed"], cmd["n"], cmd["stop"]
    mode, steps_max = cmd["mode"], cmd["steps"]
    rng = random.Random(cmd["rseed"])
    out: dict[str, Any] = {"ops": 0, "exact": 0, "errors": {}, "fail": [], "restored": [],
                           "vanished": 0}

    def error(e: BaseException, what: str, allowed: bool) -> None:
        name = type(e).__name__
        out["errors"][name] = out["errors"].get(name, 0) + 1
        if not isinstance(e, pitstop.CheckpointError):
            out["fail"].append(f"{what}: a raw {name}: {e}")
        elif not allowed:
            out["fail"].append(f"{what}: {name}: {e}")

    ro = pitstop.CheckpointManager(d, read_only=True)
    print(json.dumps({"ready": True}), flush=True)
    target = target_of(n)
    try:
        while True:
            last = os.path.exists(stop)
            out["ops"] += 1
            if mode == "restore":
                _read_newest(ro, rng, seed, n, target, out, error)
            else:
                _read_listed(ro, rng, seed, n, target, steps_max, out, error)
            if last:
                break
    finally:
        ro.close()
    return out


def _read_newest(ro: Any, rng: random.Random, seed: int, n: int, target: Any,
                 out: dict[str, Any], error: Any) -> None:
    """restore() or load() of the newest: exact, or a clear error; never None (step 0 was
    committed before the reader started, and retention always keeps the newest)."""
    call = rng.choice(["restore", "load"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = ro.restore(target) if call == "restore" else ro.load()
    except pitstop.CorruptCheckpointError as e:
        error(e, f"{call}() while retention runs: nothing is corrupt", False)
        return
    except pitstop.CheckpointNotFoundError as e:
        error(e, f"{call}() while checkpoints exist", False)
        return
    except Exception as e:  # noqa: BLE001
        error(e, f"{call}()", True)
        return
    if got is None:
        out["fail"].append(f"{call}() returned None while checkpoints exist "
                           f"(on disk now: {ro.all_steps()})")
        return
    step = int(got) if call == "restore" else got.get("step")
    state = target if call == "restore" else got
    bad = diff(state, state_of(seed, step, n)) if isinstance(step, int) else "no step"
    if bad:
        out["fail"].append(f"{call}() gave step {step}, not its exact state: {bad}")
        return
    out["exact"] += 1
    out["restored"].append(step)


def _read_listed(ro: Any, rng: random.Random, seed: int, n: int, target: Any,
                 steps_max: int, out: dict[str, Any], error: Any) -> None:
    """List, then read one listed step by number: only committed steps are listed, and a
    listed step reads exactly unless it was deleted meanwhile (and is then not listed)."""
    try:
        steps = ro.all_steps()
        latest = ro.latest_step()
    except Exception as e:  # noqa: BLE001
        error(e, "all_steps()/latest_step()", False)
        return
    if steps != sorted(set(steps)) or any(not 0 <= s < steps_max for s in steps):
        out["fail"].append(f"all_steps() lists {steps}: not steps the writer saved")
        return
    if latest is not None and (not 0 <= latest < steps_max or (steps and latest < steps[-1])):
        out["fail"].append(f"latest_step() {latest} after all_steps() {steps}")
    if not steps:
        # step 0 was committed before the reader started; retention keeps the newest
        out["fail"].append("all_steps() is empty while checkpoints exist")
        return
    s = rng.choice(steps)
    call = rng.choice(["load", "metadata", "restore"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if call == "load":
                got: Any = ro.load(s)
                bad = diff(got, state_of(seed, s, n))
            elif call == "metadata":
                m = ro.metadata(s)
                bad = None if m.step == s and m.metrics == {"loss": float(s)} else \
                    f"manifest of step {m.step}, metrics {m.metrics}"
            else:
                got = ro.restore(target, step=s)
                bad = None if got == s else f"restored {got}"
                bad = bad or diff(target, state_of(seed, s, n))
    except Exception as e:  # noqa: BLE001
        still = s in ro.all_steps()
        if not still:
            out["vanished"] += 1
        # nothing is corrupt here: a step deleted meanwhile is "not found"
        error(e, f"{call}({s}) of a listed step{' still listed' if still else ''}",
              not still and not isinstance(e, pitstop.CorruptCheckpointError))
        return
    if bad:
        out["fail"].append(f"{call}({s}): {bad}")
        return
    out["exact"] += 1
    out["restored"].append(s)


class _Reader:
    """The reader process of a scenario, kept across its trials (started again if it dies)."""

    def __init__(self) -> None:
        self.proc: Any = None

    def run(self, cmd: dict[str, Any], writer: Any) -> dict[str, Any]:
        """Start the read loop of ``cmd``; once the reader is reading, ``writer()`` runs
        here; then the stop file ends the loop and the reader's answer is returned."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = spawn(_READER)
        send(self.proc, cmd)
        try:
            first = read_json_line(self.proc)
            if not first.get("ready"):
                raise ChildDied(f"the reader said {first}")
            writer()
        finally:
            Path(cmd["stop"]).touch()
        return dict(read_json_line(self.proc, timeout=300))

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            end(self.proc)


def _writer_run(res: Result, where: str, d: Path, seed: int, n: int, steps: int,
                rng: random.Random, **kw: Any) -> tuple[Any, list[Any]]:
    """Make the writer's directory with step 0; returns the writer function for the rest."""
    mgr = _open(d, **kw)
    mgr.save(0, state_of(seed, 0, n), metrics={"loss": 0.0}).result(timeout=120)
    problems: list[Any] = []
    by_step = rng.random() < 0.5

    def write() -> None:
        try:
            for s in range(1, steps):
                st = state_of(seed, s, n)
                if by_step:
                    mgr.step(s, st, metrics={"loss": float(s)})
                else:
                    h = mgr.save(s, st, metrics={"loss": float(s)})
                    if rng.random() < 0.3:
                        h.wait(timeout=120)
            mgr.close()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{where}: the writer failed: {type(e).__name__}: {e}")
            try:
                mgr.close()
            except pitstop.CheckpointError:
                pass

    return write, problems


def _reading_scenario(name: str, mode: str, trials: int, seed: int, workdir: Path) -> Result:
    res = Result(name)
    reader = _Reader()
    try:
        with quiet_pitstop() as log:
            for t in range(trials):
                res.trials += 1
                rng = trial_rng(seed, t, name)
                n = rng.choice([256, 4 << 10, 64 << 10])
                steps = rng.randint(8, 24)
                keep = rng.choice([1, 2]) if mode == "restore" else rng.choice([1, 2, 3])
                where = f"{name} seed {seed} trial {t} (keep_last={keep}, {steps} steps)"
                d = workdir / f"{name}_{t}"
                first = len(log.records)
                try:
                    write, problems = _writer_run(
                        res, where, d, seed, n, steps, rng, keep_last=keep,
                        save_every_steps=1, on_busy="wait",
                        writer_threads=rng.choice([1, 2]))
                    out = reader.run({"dir": str(d), "seed": seed, "n": n, "mode": mode,
                                      "stop": str(workdir / f"{name}_{t}.stop"),
                                      "steps": steps, "rseed": rng.random()}, write)
                except (ChildDied, TimeoutError) as e:
                    res.fail(f"{where}: the reader process failed: {e}")
                    continue
                for p in problems:
                    res.fail(p)
                for f in out["fail"]:
                    res.fail(f"{where}: reader: {f}")
                for p in check_all_exact(d, seed, n):
                    res.fail(f"{where}: {p}")
                res.bump("reads", out["ops"])
                res.bump("exact_reads", out["exact"])
                gone = set(out["restored"]) - set(committed_on_disk(d))
                res.bump("read_steps_retention_deleted_later", len(gone))
                for k, v in out["errors"].items():
                    res.bump(f"clear_errors_{k}", v)
                if out["vanished"]:
                    res.bump("listed_then_deleted_while_read", out["vanished"])
                msgs = [r.getMessage() for r in log.records[first:]]
                res.bump("retention_deletions", sum("retention deleted" in m for m in msgs))
                res.bump("retention_deferred_for_reader",
                         sum("it is being read" in m for m in msgs))
    finally:
        reader.close()
    return res


def restore_during_retention(trials: int, seed: int, workdir: Path) -> Result:
    """A reader restoring the newest while retention deletes old checkpoints."""
    return _reading_scenario("restore_during_retention", "restore", trials, seed, workdir)


def reader_while_writer_saves(trials: int, seed: int, workdir: Path) -> Result:
    """A reader listing and reading steps by number while the writer saves and retains."""
    return _reading_scenario("reader_while_writer_saves", "listed", trials, seed, workdir)


# ====================================================================== two writers
_WRITER = """
import json, sys
import pitstop
from benchmarks.reliability._faultkit import state_of, quiet_pitstop
d, seed, n, tier, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
point, hold_step = sys.argv[6], int(sys.argv[7])

def hold(step):
    if step == hold_step:  # held here until the SIGKILL
        print(json.dumps({"held": step}), flush=True)
        sys.stdin.readline()

with quiet_pitstop():
    mgr = pitstop.CheckpointManager(d, save_on_signals=None, memory_tier=tier == "1",
                                    keep_last=int(keep) or None)
    if point != "none":
        mgr.hooks[point] = hold
    print(json.dumps({"pid": __import__("os").getpid()}), flush=True)
    s = 0
    while True:
        mgr.save(s, state_of(seed, s, n)).result(timeout=120)
        print(json.dumps({"committed": s}), flush=True)
        s += 1
"""


def two_writers(trials: int, seed: int, workdir: Path) -> Result:
    """A second writer is refused while the first lives and takes over once it is killed."""
    res = Result("two_writers")
    with quiet_pitstop():
        for t in range(trials):
            counted_trial(res, "two_writers", seed, t, _two_writers_trial, res, seed, t,
                          workdir / f"two_{t}")
    return res


def _two_writers_trial(res: Result, seed: int, t: int, d: Path) -> None:
    rng = trial_rng(seed, t, "two")
    n = rng.choice([256, 16 << 10, 128 << 10])
    tier = rng.random() < 0.5 and os.path.isdir("/dev/shm")
    keep = rng.choice([0, 0, 3])
    before_kill = rng.randint(1, 4)
    # killed after a commit line (wherever it then is), or held inside a save
    point = rng.choice(("none",) + _POINTS)
    where = (f"two_writers seed {seed} trial {t} (n={n}, tier={tier}, keep_last={keep}, "
             f"killed {'after' if point == 'none' else 'in the save after'} {before_kill} "
             f"commits{'' if point == 'none' else ', held ' + point})")
    first = spawn(_WRITER, str(d), str(seed), str(n), "1" if tier else "0", str(keep),
                  point, str(before_kill))
    try:
        pid = read_json_line(first, waiting="its pid")["pid"]
        seen = [read_json_line(first, waiting="its first commit")["committed"]]
        # the second writer, while the first lives: refused, naming the holder
        listed = committed_on_disk(d)
        try:
            other = _open(d, memory_tier=None if tier else False)
            other.close()
            res.fail(f"{where}: a second writer opened the directory while the first lived")
        except pitstop.DirectoryLockedError as e:
            if str(pid) not in str(e) or str(d) not in str(e):
                res.fail(f"{where}: DirectoryLockedError does not name the holder {pid} and "
                         f"the directory: {e}")
            else:
                res.bump("refused_while_alive")
        except Exception as e:  # noqa: BLE001
            res.fail(f"{where}: the second writer got {type(e).__name__}: {e}")
        # the refused writer touched nothing: the holder's checkpoints are there, and its
        # saves go on
        lost = [s for s in listed if s not in committed_on_disk(d) and not keep]
        if lost:
            res.fail(f"{where}: the refused writer's attempt lost steps {lost}")
        while True:
            line = read_json_line(first, waiting=f"a commit or 'held' after {seen}")
            if "held" in line:
                res.bump(f"killed_held_{point}")
                break
            seen.append(line["committed"])
            if point == "none" and len(seen) >= before_kill:
                break
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    except (ChildDied, TimeoutError) as e:
        res.fail(f"{where}: the first writer: {e}")
        return
    finally:
        end(first)
    res.bump("killed")
    had_leftovers = bool(leftovers(d))
    # the second writer takes over: the kernel released the lock with the process
    try:
        mgr = _open(d, memory_tier=None if tier else False, keep_last=keep or None)
    except pitstop.CheckpointError as e:
        res.fail(f"{where}: the second writer was refused after the first was killed: {e}")
        return
    try:
        res.bump("took_over")
        if had_leftovers:
            res.bump("temporaries_cleaned_at_takeover")
        recovered = mgr.latest_step()
        mgr.wait(timeout=120)  # (a snapshot recovered from the memory tier is persisting)
        if leftovers(d):
            res.fail(f"{where}: leftovers after the takeover: {leftovers(d)}")
        if recovered is not None and recovered > max(seen):
            res.bump("recovered_from_memory_tier")
        target = target_of(n)
        restored = mgr.restore(target)
        got = None if restored is None else int(restored)
        if got is None or diff(target, state_of(seed, got, n)):
            res.fail(f"{where}: the takeover restored {got}, not an exact state: "
                     f"{diff(target, state_of(seed, got, n)) if got is not None else None}")
        elif got < max(seen):
            res.fail(f"{where}: the takeover restored {got}, older than the committed "
                     f"{max(seen)}")
        nxt = (got if got is not None else -1) + 1
        for s in range(nxt, nxt + rng.randint(1, 3)):
            mgr.save(s, state_of(seed, s, n)).result(timeout=120)
    finally:
        mgr.close()
    for p in check_all_exact(d, seed, n):
        res.fail(f"{where}: {p}")
    for s in seen:
        if s not in committed_on_disk(d) and not keep:
            res.fail(f"{where}: the first writer's committed step {s} is gone")


# ====================================================================== same step in flight
_POINTS = ("before_persist", "before_write", "before_commit")


def restore_while_same_step_in_flight(trials: int, seed: int, workdir: Path) -> Result:
    """restore/load of step N while N's save is held in its persist: the writer waits for it,
    a read-only manager sees only what is committed; never a torn read."""
    res = Result("restore_while_same_step_in_flight")
    with quiet_pitstop():
        for t in range(trials):
            counted_trial(res, "restore_while_same_step_in_flight", seed, t, _in_flight_trial,
                          res, seed, t, workdir / f"flight_{t}")
    return res


def _in_flight_trial(res: Result, seed: int, t: int, d: Path) -> None:
    rng = trial_rng(seed, t, "flight")
    n = rng.choice([256, 16 << 10, 256 << 10])
    point = rng.choice(_POINTS)
    call = rng.choice(["restore", "restore-step", "load", "load-step"])
    fails = rng.random() < 0.25
    k = rng.randint(1, 3)
    where = (f"restore_while_same_step_in_flight seed {seed} trial {t} (held {point}, "
             f"{call}, {'the save fails' if fails else 'it commits'})")
    mgr = _open(d, writer_threads=rng.choice([1, 2]), memory_tier=rng.choice([False, None]))
    ro = None
    try:
        for s in range(k):
            mgr.save(s, state_of(seed, s, n)).result(timeout=120)
        ro = pitstop.CheckpointManager(d, read_only=True)
        entered, gate, released = threading.Event(), threading.Event(), threading.Event()

        def hold(step: int) -> None:
            if step != k:
                return
            entered.set()
            gate.wait(120)
            if fails:
                raise OSError(5, "Input/output error (injected while held)")

        mgr.hooks[point] = hold
        live = state_of(seed, k, n)
        mgr.save(k, live)
        # training goes on: the live state changes; the save holds its snapshot
        live["model"]["w"] += 1
        live["opt"]["m"][:] = 0
        if not entered.wait(120):
            res.fail(f"{where}: the save never reached {point}")
            return
        res.bump("held_in_flight")
        # the writer itself names the step being saved
        if mgr.latest_step() != k:
            res.fail(f"{where}: the writer's latest_step() is {mgr.latest_step()} while {k} "
                     "is being saved")
        # a read-only manager sees committed checkpoints only
        _check_read_only(res, where, ro, seed, n, k, committed=False)
        # the writer's own restore/load waits for the save
        result: dict[str, Any] = {}

        def read() -> None:
            target = target_of(n)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if call == "restore":
                        got: Any = mgr.restore(target)
                    elif call == "restore-step":
                        got = mgr.restore(target, step=k)
                    elif call == "load":
                        got = target = mgr.load()
                    else:
                        got = target = mgr.load(step=k)
                result["got"] = got if call.startswith("restore") else target.get("step")
                result["state"] = target
            except Exception as e:  # noqa: BLE001
                result["error"] = e
            result["after_release"] = released.is_set()

        reader = threading.Thread(target=read)
        reader.start()
        if rng.random() < 0.5:
            threading.Event().wait(rng.random() * 0.01)  # let the reader reach its wait
        released.set()
        gate.set()
        reader.join(120)
        if reader.is_alive():
            res.fail(f"{where}: {call} never returned")
            return
        if not result["after_release"]:
            res.fail(f"{where}: {call} returned while the save of {k} was still held")
        err = result.get("error")
        if fails:
            _check_failed(res, where, mgr, err, result, call, seed, n, k)
        elif err is not None:
            res.fail(f"{where}: {call} raised {type(err).__name__}: {err}")
        elif result["got"] != k or diff(result["state"], state_of(seed, k, n)):
            res.fail(f"{where}: {call} gave {result['got']}, not the exact snapshot of {k}")
        else:
            res.bump("waited_and_exact")
        if not fails:
            _check_read_only(res, where, ro, seed, n, k, committed=True)
    finally:
        mgr.hooks.clear()
        if ro is not None:
            ro.close()
        try:
            mgr.close()
        except pitstop.CheckpointError as e:
            if not fails:
                res.fail(f"{where}: close() raised {e}")


def _check_failed(res: Result, where: str, mgr: Any, err: Any, result: dict[str, Any],
                  call: str, seed: int, n: int, k: int) -> None:
    """The held save failed: the waiting read gets the previous step or a clear 'not
    found', and the failure is raised once, by wait()."""
    if call.endswith("-step"):
        if not isinstance(err, pitstop.CheckpointNotFoundError):
            res.fail(f"{where}: {call} of the failed step {k} gave "
                     f"{type(err).__name__ if err else result.get('got')}, not "
                     "CheckpointNotFoundError")
    elif err is not None:
        res.fail(f"{where}: {call} raised {type(err).__name__}: {err}")
    elif result["got"] != k - 1 or diff(result["state"], state_of(seed, k - 1, n)):
        res.fail(f"{where}: {call} gave {result['got']}, not the exact step {k - 1}")
    raised = 0
    for _ in range(2):
        try:
            mgr.wait(timeout=120)
        except pitstop.CheckpointWriteError as e:
            raised += 1
            if e.step != k:
                res.fail(f"{where}: wait() raised the failure of step {e.step}, not {k}")
    if raised != 1:
        res.fail(f"{where}: the failed save was raised {raised} times by wait(), not once")
    else:
        res.bump("failed_in_flight_reported_once")


def _check_read_only(res: Result, where: str, ro: Any, seed: int, n: int, k: int,
                     committed: bool) -> None:
    target = target_of(n)
    try:
        steps = ro.all_steps()
        if (k in steps) != committed:
            res.fail(f"{where}: the read-only manager lists {steps} "
                     f"{'after' if committed else 'before'} step {k} committed")
        if committed:
            got = ro.restore(target, step=k)
            if got != k or diff(target, state_of(seed, k, n)):
                res.fail(f"{where}: read-only restore of committed {k} is not exact")
            return
        try:
            ro.restore(target, step=k)
            res.fail(f"{where}: read-only restore(step={k}) succeeded while {k} was in flight")
        except pitstop.CheckpointNotFoundError:
            res.bump("read_only_not_found_in_flight")
        newest = ro.load()
        if newest.get("step") != k - 1 or diff(newest, state_of(seed, k - 1, n)):
            res.fail(f"{where}: read-only load() while {k} was in flight gave step "
                     f"{newest.get('step')}, not an exact {k - 1}")
    except pitstop.CheckpointError as e:
        res.fail(f"{where}: the read-only manager raised {type(e).__name__}: {e}")


SCENARIOS: dict[str, Scenario] = {
    "restore_during_retention": restore_during_retention,
    "two_writers": two_writers,
    "reader_while_writer_saves": reader_while_writer_saves,
    "restore_while_same_step_in_flight": restore_while_same_step_in_flight,
}
