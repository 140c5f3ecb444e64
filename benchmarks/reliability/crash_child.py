"""The training job that :mod:`benchmarks.reliability.crash` kills again and again.

Run as ``python crash_child.py CONFIG_JSON``. It opens the run directory like a restarted
job, restores, checks what it restored against what that step saved, then saves every step;
each step's arrays encode the step, so a torn or mixed checkpoint is visible. It reports its
progress on stdout, one line per event, written with one ``write`` each (so nothing is lost
in a buffer when the process dies):

``B <phase> <step>`` a phase began (restore, snapshot, hash, write, commit, retention,
delete); ``E snapshot <step>`` save() returned; ``E restore <step> <seconds>`` the restore is done (and how long opening and
restoring took);
``C <step>`` the save of step is committed and its bookkeeping (index, retention) done;
``R <step|none> ok|WRONG <why>`` what the restore gave; ``L <name>`` a leftover of a killed
save still there after the manager opened the directory; ``ready <first step>``.

With ``kill = [phase, n, delay]`` in the config it SIGKILLs itself ``delay`` seconds after
the ``n``-th time ``phase`` began (at once for a delay of 0), through the manager's hooks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

import pitstop


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def expected(step: int, i: int, elems: int) -> np.ndarray:
    """Array ``i`` as step ``step`` saves it."""
    return np.arange(elems, dtype=np.uint32) + np.uint32((step * 2654435761 + i * 40503) % 2**32)


def blank(arrays: int, elems: int) -> dict[str, Any]:
    s: dict[str, Any] = {f"a{i}": np.zeros(elems, np.uint32) for i in range(arrays)}
    s["small"] = np.zeros(7, np.int64)
    s["meta"] = {"step": -1}
    return s


def mismatch(state: Any, step: int, arrays: int, elems: int) -> str | None:
    """Why ``state`` (a restored or loaded state) is not exactly what ``step`` saved."""
    try:
        if state["meta"]["step"] != step:
            return f"meta.step is {state['meta']['step']}"
        small = state["small"]
        if small.dtype != np.int64 or small.shape != (7,) or not (small == step).all():
            return "array 'small' differs"
        for i in range(arrays):
            a = state[f"a{i}"]
            if a.dtype != np.uint32 or not np.array_equal(a, expected(step, i, elems)):
                return f"array 'a{i}' differs"
    except (KeyError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def leftovers(d: str) -> list[str]:
    """What a killed save, deletion or index write leaves (``.tmp-*`` names)."""
    top = [e for e in os.listdir(d) if e.startswith(".tmp-")]
    meta_dir = os.path.join(d, ".pitstop")
    meta = [".pitstop/" + e for e in os.listdir(meta_dir)
            if ".tmp-" in e] if os.path.isdir(meta_dir) else []
    return sorted(top + meta)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    d, tier, arrays, elems, keep = (cfg["dir"], cfg["tier"], cfg["arrays"], cfg["elems"],
                                    cfg["keep"])
    kill = cfg.get("kill")
    begun: dict[str, int] = {}

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def begin(phase: str, step: int) -> None:
        say(f"B {phase} {step}")
        if kill is None or kill[0] != phase:
            return
        begun[phase] = begun.get(phase, 0) + 1
        if begun[phase] != kill[1]:
            return
        if kill[2] <= 0:
            die()
        threading.Timer(kill[2], die).start()

    t0 = time.monotonic()
    begin("restore", -1)
    before = leftovers(d)
    mgr = pitstop.CheckpointManager(
        d, keep_last=keep, memory_tier=tier, save_on_signals=None,
        on_save=lambda stats: say(f"C {stats.step}"))
    for name in sorted(set(before) & set(leftovers(d))):
        say(f"L {name}")
    state = blank(arrays, elems)
    restored = mgr.restore(state)
    say(f"E restore {-1 if restored is None else int(restored)} {time.monotonic() - t0:.4f}")
    if restored is None:
        say("R none")
    else:
        why = mismatch(state, int(restored), arrays, elems)
        say(f"R {int(restored)} ok" if why is None else f"R {int(restored)} WRONG {why}")

    for phase in ("snapshot", "hash", "write", "commit"):
        mgr.hooks[{"snapshot": "before_snapshot", "hash": "before_persist",
                   "write": "before_write", "commit": "before_commit"}[phase]] = \
            lambda step, phase=phase: begin(phase, step)
    mgr.hooks["after_commit"] = lambda step: begin("retention", step)
    mgr.hooks["before_delete"] = lambda step: begin("delete", step)

    base = np.arange(elems, dtype=np.uint32)
    start = 0 if restored is None else int(restored) + 1
    say(f"ready {start}")
    for step in range(start, start + 1_000_000):
        for i in range(arrays):
            np.add(base, np.uint32((step * 2654435761 + i * 40503) % 2**32), out=state[f"a{i}"])
        state["small"][:] = step
        state["meta"]["step"] = step
        mgr.save(step, state)  # blocks only while the previous save still persists
        say(f"E snapshot {step}")


if __name__ == "__main__":
    main()
