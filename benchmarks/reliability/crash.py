"""Crash torture: a training job that saves every step, SIGKILLed and restarted again and again.

One run directory per mode (without and with the memory tier), kept across trials like a job
that is restarted after every crash. Each trial starts the job (:mod:`.crash_child`), which
restores, checks what it restored, and saves step after step (each step's arrays encode the
step). The job dies by SIGKILL, either

- at a point it is told (through the manager's hooks): in the snapshot copy, while hashing or
  writing the data files, at the commit, during retention (deleting an old checkpoint with
  ``keep_last``), or while the restarted job itself opens and restores the directory; at the
  start of the phase or a few milliseconds into it; or
- after a random delay sent from here (half of those only after a first commit).

Where each kill landed is read from the job's own progress lines (phases begun and not yet
ended when it died) and counted per phase. The promises checked after every kill:

- the next start restores a step >= the last one reported committed (with the memory tier:
  >= the last step whose ``save()`` had returned) and it is bit-identical to what that step
  saved (checked by the restarted job, or here);
- leftovers of the killed save (``.tmp-*``) are gone once the next manager has opened the
  directory;
- every checkpoint on disk is exactly its step (checked here, after about half the kills, by a
  manager of its own, which is then closed cleanly);
- after that clean ``close()`` nothing of the run is left in ``/dev/shm``.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pitstop
from pitstop.core.errors import CheckpointError

from . import Result
from .crash_child import blank, leftovers, mismatch

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("crash_child.py")
ARRAYS = 4
ELEMS = 4 << 20  # 4 arrays x 16 MiB of uint32 = 64 MiB per checkpoint
KEEP = 2
FULL_TRIALS = 200
#: the phases a kill is aimed at, in turn
PHASES = ("restore", "snapshot", "retention", "hash", "restore", "commit", "write")
#: how far into a phase a delayed self-kill may land (seconds)
SPREAD = {"snapshot": 0.03, "hash": 0.05, "write": 0.1, "commit": 0.01, "retention": 0.005,
          "delete": 0.005}
#: the longest a trial's job may live before it is killed anyway
CHILD_LIMIT_S = 120.0


@dataclass
class RunDir:
    """One run directory and what the trials so far proved about it."""

    path: Path
    tier: bool
    #: the newest step known committed (reported by on_save, or restored)
    committed: int | None = None
    #: the newest step whose save() returned (the memory tier must not lose it)
    returned: int | None = None
    #: how long the last restart took to open and restore (aims restore kills)
    restore_s: float = 0.2
    trials: int = 0
    aimed: int = 0

    def floor(self) -> int | None:
        """The oldest step a restart may restore."""
        known = [s for s in (self.committed, self.returned if self.tier else None)
                 if s is not None]
        return max(known) if known else None

    def saw(self, restored: int) -> None:
        self.committed = restored if self.committed is None else max(self.committed, restored)


def shm_ok() -> bool:
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)


def plan_for(run: RunDir, rng: random.Random) -> list[Any] | None:
    """The kill of the next trial: ``[phase, n, delay]`` for the job to kill itself, or None
    for a kill sent from here after a random delay (every third trial)."""
    run.trials += 1
    if run.trials % 3 == 0:
        return None
    phase = PHASES[run.aimed % len(PHASES)]
    if phase == "restore" and run.committed is None:
        phase = "write"  # nothing to restore yet: aim at the restore next time
    else:
        run.aimed += 1
    if phase == "restore":
        # early in the last restart's time: opening (cleanup, memory-tier recovery) or reading
        return ["restore", 1, rng.uniform(0.05, 0.6) * run.restore_s]
    # the first round kills at the start of each phase (so a short run covers them all),
    # later ones at the start or a few milliseconds into it
    at_start = run.aimed <= len(PHASES) or rng.random() < 0.5
    if phase == "retention" and rng.random() < 0.5:
        phase = "delete"  # right before (or while) an old checkpoint is deleted
    return [phase, rng.randint(1, 2), 0.0 if at_start else rng.uniform(0, SPREAD[phase])]


def landed(lines: list[str]) -> list[str]:
    """The phases under way when the job died, from its progress lines."""
    active: dict[str, str] = {}
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        tag, what = parts[0], parts[1] if len(parts) > 1 else ""
        if tag == "B":
            if what in ("hash", "write"):
                active["persist"] = what
            elif what == "commit":
                active.pop("persist", None)
                active["commit"] = what
            elif what == "retention":
                active.pop("commit", None)
                active["retention"] = what
            elif what == "delete":
                active["retention"] = "delete"
            else:
                active[what] = what
        elif tag == "E":
            active.pop(what, None)
        elif tag == "C":
            active.pop("retention", None)
    out = []
    for phase, sub in active.items():
        out.append(sub if phase == "persist" else phase)
        if sub == "delete":
            out.append("retention_deleting")
    return sorted(out)


def run_trials(trials: int, seed: int, workdir: Path, *, elems: int = ELEMS,
               check_ratio: float = 0.5) -> Result:
    """``trials`` kills, alternately in the run without and with the memory tier."""
    res = Result("crash")
    rng = random.Random(seed)
    runs = [RunDir(workdir / "run-disk", tier=False)]
    if shm_ok():
        runs.append(RunDir(workdir / "run-tier", tier=True))
    for run in runs:
        run.path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for trial in range(trials):
        run = runs[trial % len(runs)]
        where = f"trial {trial} (seed {seed}, tier={run.tier})"
        try:
            plan = plan_for(run, rng)
            one_kill(run, plan, rng, env, elems, res, where)
            last = trial >= trials - len(runs)
            if last or rng.random() < check_ratio:
                full_check(run, elems, res, where)
        except Exception as e:  # noqa: BLE001 - a broken promise is counted, never raised
            res.fail(f"{where}: {type(e).__name__}: {e}")
        res.trials += 1
    return res


def one_kill(run: RunDir, plan: list[Any] | None, rng: random.Random, env: dict[str, str],
             elems: int, res: Result, where: str) -> None:
    """Start the job, let it die by SIGKILL as planned, and check what it said."""
    cfg = {"dir": str(run.path), "tier": run.tier, "arrays": ARRAYS, "elems": elems,
           "keep": KEEP, "kill": plan}
    proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        if plan is None:
            while True:
                line = proc.stdout.readline()
                if not line:
                    break
                seen.append(line)
                if line.startswith("ready"):
                    break
            if run.trials % 2 and seen and seen[-1].startswith("ready"):
                # half of them only after a commit, so a slow (loaded) machine cannot turn
                # them all into kills before the first save
                while True:
                    line = proc.stdout.readline()
                    if not line:
                        break
                    seen.append(line)
                    if line.startswith("C "):
                        break
            time.sleep(rng.uniform(0.05, 0.6))
            proc.send_signal(signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=CHILD_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            res.bump("planned_kill_missed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = "".join(seen).splitlines() + out.splitlines()
    if proc.returncode != -signal.SIGKILL:
        res.fail(f"{where}: the job ended by itself (rc {proc.returncode}), not by the kill "
                 f"{plan}: {err.strip()[-800:]}")
        return
    res.bump("kills_aimed" if plan is not None else "kills_random_delay")
    phases = landed(lines)
    for phase in phases:
        res.bump(f"killed_in_{phase}")
    if not phases:
        res.bump("killed_between_phases")
    floor = run.floor()
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "L":
            res.fail(f"{where}: leftover {parts[1]} of a killed save still there after the "
                     "next start opened the directory")
        elif parts[0] == "R":
            if parts[1] == "none":
                if floor is not None:
                    res.fail(f"{where}: the restart restored nothing, but step {floor} was "
                             "committed")
                continue
            restored = int(parts[1])
            if parts[2] != "ok":
                res.fail(f"{where}: the restart restored step {restored}, not as saved: "
                         f"{' '.join(parts[3:])}")
            if floor is not None and restored < floor:
                res.fail(f"{where}: the restart restored step {restored}, but step {floor} was "
                         "committed" + (" (or its save had returned)" if run.tier else ""))
            if run.committed is not None and restored > run.committed:
                res.bump("restored_newer_than_reported")
            run.saw(restored)
            res.bump("restores_checked_by_the_job")
        elif parts[0] == "C":
            res.bump("commits")
            run.saw(int(parts[1]))
        elif parts[0] == "E" and parts[1] == "snapshot":
            s = int(parts[2])
            run.returned = s if run.returned is None else max(run.returned, s)
        elif parts[0] == "E" and parts[1] == "restore" and len(parts) > 3:
            run.restore_s = float(parts[3])


def full_check(run: RunDir, elems: int, res: Result, where: str) -> None:
    """Open the directory as the next start would, restore, check every checkpoint on disk,
    close cleanly, and look for what the run left in /dev/shm."""
    before = leftovers(str(run.path))
    floor = run.floor()
    mgr = pitstop.CheckpointManager(run.path, keep_last=KEEP, memory_tier=run.tier,
                                    save_on_signals=None)
    try:
        stale = set(before) & set(leftovers(str(run.path)))
        if stale:
            res.fail(f"{where}: leftovers {sorted(stale)} still there after opening")
        target = blank(ARRAYS, elems)
        got = mgr.restore(target)
        if got is None:
            if floor is not None:
                res.fail(f"{where}: restored nothing, but step {floor} was committed")
        else:
            restored = int(got)
            if floor is not None and restored < floor:
                res.fail(f"{where}: restored step {restored}, but step {floor} was committed")
            why = mismatch(target, restored, ARRAYS, elems)
            if why is not None:
                res.fail(f"{where}: restored step {restored} is not as saved: {why}")
            if run.committed is not None and restored > run.committed:
                res.bump("restored_newer_than_reported")
            run.saw(restored)
        mgr.wait()  # a snapshot recovered from memory is committed now
        after = leftovers(str(run.path))
        if after:
            res.fail(f"{where}: leftovers {after} after the recovery committed")
        for s in mgr.all_steps():
            try:
                why = mismatch(mgr.load(step=s), s, ARRAYS, elems)
            except CheckpointError as e:
                why = f"{type(e).__name__}: {e}"
            if why is not None:
                res.fail(f"{where}: checkpoint of step {s} on disk is not as saved: {why}")
            res.bump("checkpoints_checked")
    finally:
        mgr.close()
    res.bump("full_checks")
    if run.tier:
        left = glob.glob(f"/dev/shm/pitstop-{mgr.directory_id}-*")
        if left:
            res.fail(f"{where}: {left[:3]} left in /dev/shm after a clean close()")


def run(trials: int, seed: int, workdir: Path) -> Result:
    """The crash scenario (full run: 200 trials of 64 MiB saves)."""
    return run_trials(trials, seed, workdir)


SCENARIOS = {"crash": run}
DEFAULT_TRIALS = {"crash": FULL_TRIALS}
