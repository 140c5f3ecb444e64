"""Signals: SIGTERM / SIGINT / SIGUSR1 ask for a save at the next step boundary.

Each test runs a small training loop in a subprocess. The child prints ``STEP s`` right before
``mgr.step(s, ...)``, so the last ``STEP`` line it printed before dying is the step at which
the signal was handled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pitstop

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import pitstop
    d = sys.argv[1]
    opts = set(sys.argv[2:])
    # one write per line: print writes the text and its newline apart, and HOLD comes from
    # the save's thread, USER HANDLER from a signal handler
    def say(*words):
        sys.stdout.write(" ".join(map(str, words)) + "\\n"); sys.stdout.flush()
    if "user-term-handler" in opts:
        def on_term(signum, frame):
            say("USER HANDLER")
            os._exit(7)
        signal.signal(signal.SIGTERM, on_term)
    mgr = pitstop.CheckpointManager(d, memory_tier="tier" in opts)
    if "hold" in opts:
        def hold(step):
            say("HOLD", step)
            time.sleep(120)
        mgr.hooks["before_write"] = hold
    state = {"w": np.zeros(1000, np.float64), "meta": {"step": -1}}
    start = mgr.restore(state)
    if start is not None:
        # the restored state is the one of the step at which the signal was handled
        assert (state["w"] == start).all() and state["meta"]["step"] == start, state
    say("START", start)
    first = 0 if start is None else start + 1
    try:
        with mgr:
            for step in range(first, first + (30 if "short" in opts else 100_000)):
                if os.path.exists(d + ".stop"):  # the parent ends the run
                    break
                # a non-atomic update: a save from inside the signal handler could see it torn
                state["w"][:500] = step
                time.sleep(0.002)
                state["w"][500:] = step
                state["meta"]["step"] = step
                say("STEP", step)
                h = mgr.step(step, state)
                if h is not None:
                    say("SAVED", step, h.committed)
            if "short" in opts:
                say("EVAL")  # a long final evaluation: no more step() calls
                time.sleep(3)
    except KeyboardInterrupt:
        say("KeyboardInterrupt")
        sys.exit(3)
    say("DONE")
""")


class Child:
    def __init__(self, directory, *opts: str) -> None:
        self.p = subprocess.Popen([PY, "-c", _CHILD, str(directory), *opts],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        self.lines: list[str] = []

    def wait_for(self, prefix: str) -> str:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"child ended before {prefix!r}: {self.p.stderr.read()}")
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()

    def finish(self, timeout: float = 60) -> int:
        out, err = self.p.communicate(timeout=timeout)
        self.lines += out.strip().splitlines()
        self.stderr = err
        return self.p.returncode

    def last(self, prefix: str) -> str | None:
        hits = [x for x in self.lines if x.startswith(prefix)]
        return hits[-1] if hits else None

    def steps(self) -> list[int]:
        return [int(x.split()[1]) for x in self.lines if x.startswith("STEP ")]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def children():
    made: list[Child] = []

    def make(*a) -> Child:
        c = Child(*a)
        made.append(c)
        return c

    yield make
    for c in made:
        c.kill()


def stop(directory) -> None:
    with open(f"{directory}.stop", "w"):
        pass


def committed_steps(directory) -> list[int]:
    return pitstop.CheckpointManager(directory, read_only=True).all_steps()


def test_sigterm_saves_at_step_boundary_dies_with_sigterm_and_resumes_there(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d)
    c.wait_for("STEP 20")
    c.p.send_signal(signal.SIGTERM)
    rc = c.finish()
    assert rc == -signal.SIGTERM, c.stderr
    handled = c.steps()[-1]
    assert handled >= 20
    assert "DONE" not in c.lines
    assert committed_steps(d) == [handled]
    # a restart resumes from the step at which the signal was handled (asserted in the child)
    r = children(d)
    assert r.wait_for("START") == f"START {handled}"
    r.kill()


def test_sigterm_chains_to_a_previously_installed_handler(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d, "user-term-handler")
    c.wait_for("STEP 10")
    c.p.send_signal(signal.SIGTERM)
    rc = c.finish()
    # pitstop saved first, then handed the signal to the handler the program had installed
    assert rc == 7, c.stderr
    assert "USER HANDLER" in c.lines
    assert committed_steps(d) == [c.steps()[-1]]


def test_sigint_saves_then_raises_keyboard_interrupt(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d)
    c.wait_for("STEP 15")
    c.p.send_signal(signal.SIGINT)
    rc = c.finish()
    assert rc == 3, c.stderr
    assert "KeyboardInterrupt" in c.lines
    handled = c.steps()[-1]
    assert committed_steps(d) == [handled]
    r = children(d)
    assert r.wait_for("START") == f"START {handled}"
    r.kill()


def test_sigusr1_saves_and_training_continues(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d)
    c.wait_for("STEP 10")
    c.p.send_signal(signal.SIGUSR1)
    saved = c.wait_for("SAVED")
    step = int(saved.split()[1])
    assert saved.split()[2] == "True"  # committed before training went on
    # the save happened at the boundary right after the signal: the last STEP printed
    assert c.steps()[-1] == step
    c.wait_for(f"STEP {step + 5}")  # training goes on
    stop(d)
    rc = c.finish()
    assert rc == 0, c.stderr
    assert "DONE" in c.lines
    assert max(c.steps()) > step  # training continued past the save
    assert committed_steps(d) == [step]
    # a second SIGUSR1, later, is a new request (not "act immediately")
    os.unlink(f"{d}.stop")
    c2 = children(d)
    c2.wait_for("STEP")
    c2.wait_for(f"STEP {step + 10}")
    c2.p.send_signal(signal.SIGUSR1)
    step2 = int(c2.wait_for("SAVED").split()[1])
    c2.wait_for(f"STEP {step2 + 3}")
    c2.p.send_signal(signal.SIGUSR1)
    step3 = int(c2.wait_for("SAVED").split()[1])
    stop(d)
    assert c2.finish() == 0
    assert committed_steps(d) == [step, step2, step3]


def test_second_sigterm_acts_immediately(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d, "hold", "tier")
    c.wait_for("STEP 10")
    c.p.send_signal(signal.SIGTERM)
    held = int(c.wait_for("HOLD").split()[1])  # the save is persisting (held for 120 s)
    c.p.send_signal(signal.SIGTERM)
    rc = c.finish(timeout=60)  # long before the held persist could end
    assert rc == -signal.SIGTERM
    assert committed_steps(d) == []
    # the snapshot taken at the first signal survived in the memory tier
    r = children(d, "tier")
    assert r.wait_for("START") == f"START {held}"
    r.kill()
    # a last restart cleans the memory tier up on close (the killed restart left it behind)
    m = pitstop.CheckpointManager(d, save_on_signals=None)
    m.wait()  # the killed restart may not have finished persisting the recovered snapshot
    assert m.all_steps() == [held]
    ident = m.directory_id
    m.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pitstop-{ident}")]


def test_second_sigint_raises_at_once_even_inside_with(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d, "hold")
    c.wait_for("STEP 10")
    c.p.send_signal(signal.SIGINT)
    held = int(c.wait_for("HOLD").split()[1])  # the step whose save the signal started
    c.p.send_signal(signal.SIGINT)
    rc = c.finish(timeout=60)
    assert rc == 3, c.stderr
    assert "KeyboardInterrupt" in c.lines
    assert f"not waiting for the save of step(s) [{held}]" in c.stderr


_TWICE_BEFORE_A_BOUNDARY = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pitstop
    mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
    try:
        with mgr:
            mgr.save(0, {"w": np.zeros(3)}).wait()
            print("READY", flush=True)
            while mgr._signals.pending is None:   # a long evaluation: no step() comes
                time.sleep(0.01)
            print("NOTED", flush=True)
            time.sleep(60)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
""")


def test_two_sigints_before_a_step_boundary_say_nothing_was_saved(tmp_path):
    p = subprocess.Popen([PY, "-c", _TWICE_BEFORE_A_BOUNDARY, str(tmp_path / "ckpt")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline().strip() == "NOTED"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert "KeyboardInterrupt" in out, err
    assert "exiting without a save (the newest committed step is 0)" in err
    assert "not waiting" not in err


def test_signal_is_never_acted_on_inside_the_handler(tmp_path):
    # in-process: the handler only records the request; nothing is saved until step()
    mgr = pitstop.CheckpointManager(tmp_path / "ckpt", memory_tier=False,
                                    save_on_signals=("SIGUSR1",))
    try:
        state = {"w": np.zeros(10)}
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # let the interpreter run the handler
        assert mgr.all_steps() == []
        assert mgr._engine.in_flight() == 0
        h = mgr.step(4, state)
        assert h is not None and h.committed  # saved at the boundary, committed on return
        assert mgr.all_steps() == [4]
        assert mgr.step(5, state) is None  # the request was consumed
    finally:
        mgr.close()
    # close restores the handler that was there before
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)


def test_managers_closed_in_another_order_than_made_put_the_programs_handlers_back(tmp_path):
    def mine(signum, frame):  # the program's own handler, there before pitstop's
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, mine)
    try:
        a = pitstop.CheckpointManager(tmp_path / "a", memory_tier=False)
        b = pitstop.CheckpointManager(tmp_path / "b", memory_tier=False)
        a.close()  # the first one made closes first: b's handler is still on top
        assert signal.getsignal(signal.SIGTERM) not in (mine, signal.SIG_DFL)
        b.close()  # not a's retired handler: what was there before a
        assert signal.getsignal(signal.SIGTERM) is mine
        for s in (signal.SIGINT, signal.SIGUSR1):
            assert signal.getsignal(s) is before[s], signal.Signals(s).name
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_managers_off_the_main_thread_install_no_handlers(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    out = {}

    def run():
        m = pitstop.CheckpointManager(tmp_path / "ckpt", memory_tier=False)
        out["handler"] = signal.getsignal(signal.SIGTERM)
        m.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out["handler"] is before


def test_sigterm_after_the_last_step_is_acted_on_at_close(tmp_path, children):
    d = tmp_path / "ckpt"
    c = children(d, "short")
    c.wait_for("EVAL")
    c.p.send_signal(signal.SIGTERM)
    rc = c.finish()
    # deferred, not swallowed: close() (leaving the with block) delivers it
    assert rc == -signal.SIGTERM, c.stderr
    assert "DONE" not in c.lines


# ------------------------------------------------------------------ found by probing (issue 9)
def _run_job(code: str, *args: str, signal_after: str | None = None, signum: int = 0,
             timeout: float = 60) -> tuple[int, str, str]:
    """Run ``code``; when it prints ``signal_after``, send it ``signum``."""
    p = subprocess.Popen([PY, "-c", textwrap.dedent(code), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        if signal_after is not None:
            while True:
                line = p.stdout.readline()
                assert line, f"ended before {signal_after!r}: {p.stderr.read()}"
                if line.strip() == signal_after:
                    break
            p.send_signal(signum)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err


def test_a_signal_during_close_is_acted_on_after_the_saves_commit(tmp_path):
    code = """
        import sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        def slow(step):
            print("PERSISTING", flush=True)
            time.sleep(1.5)
        mgr.hooks["before_write"] = slow
        mgr.save(1, {"w": np.ones(1000)})
        mgr.close()
        print("ALIVE AFTER CLOSE", flush=True)
        time.sleep(5)
    """
    rc, out, err = _run_job(code, tmp_path / "ck", signal_after="PERSISTING",
                            signum=signal.SIGTERM)
    assert rc == -signal.SIGTERM, out + err
    assert "ALIVE AFTER CLOSE" not in out
    assert committed_steps(tmp_path / "ck") == [1]


def test_sigterm_is_honoured_when_its_own_save_fails(tmp_path):
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        state = {"w": np.zeros(100)}
        mgr.save(0, state).wait()
        def full(step):
            raise OSError(28, "No space left on device")
        mgr.hooks["before_write"] = full
        os.kill(os.getpid(), signal.SIGTERM)       # a preemption notice, then the disk fills
        for step in range(1, 100):
            time.sleep(0.01)
            try:
                mgr.step(step, state)
            except pitstop.CheckpointError:
                print("TRAINING ON", flush=True)   # a loop that tolerates checkpoint errors
        print("LOOP ENDED", flush=True)
    """
    rc, out, err = _run_job(code, tmp_path / "ck")
    assert rc == -signal.SIGTERM, out + err
    assert "LOOP ENDED" not in out and "exiting as the signal asks without it" in err


def test_sigterm_reaches_a_training_loop_on_another_thread(tmp_path):
    code = """
        import os, signal, sys, threading, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        state = {"w": np.zeros(100)}
        def train():
            for step in range(200):
                state["w"] += 1
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.3)
                mgr.step(step, state)
                time.sleep(0.02)
            print("LOOP ENDED", flush=True)
        t = threading.Thread(target=train)
        t.start()
        while t.is_alive():
            t.join(0.1)
        time.sleep(3)
        print("STILL ALIVE", flush=True)
    """
    rc, out, err = _run_job(code, tmp_path / "ck")
    assert rc == -signal.SIGTERM, out + err
    assert "STILL ALIVE" not in out and "LOOP ENDED" not in out
    assert committed_steps(tmp_path / "ck") == [3]


def test_a_loop_that_only_calls_save_acts_on_sigterm_at_the_next_save(tmp_path):
    code = """
        import sys, time, numpy as np, pitstop
        with pitstop.CheckpointManager(sys.argv[1], memory_tier=False) as mgr:
            state = {"w": np.zeros(10)}
            for step in range(10_000):
                state["w"] += 1
                time.sleep(0.01)
                if step == 5:
                    print("RUNNING", flush=True)
                if step % 10 == 0:
                    mgr.save(step, state)
            print("LOOP ENDED", flush=True)
    """
    rc, out, err = _run_job(code, tmp_path / "ck", signal_after="RUNNING",
                            signum=signal.SIGTERM)
    assert rc == -signal.SIGTERM, out + err
    assert "LOOP ENDED" not in out
    assert committed_steps(tmp_path / "ck")[-1] == 10  # the first save after the signal


def test_sigint_while_sigterms_save_runs_leaves_as_sigterm_asks(tmp_path):
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        def slow(step):
            print("PERSISTING", flush=True)
            time.sleep(30)
        state = {"w": np.zeros(10)}
        os.kill(os.getpid(), signal.SIGTERM)
        mgr.hooks["before_write"] = slow
        mgr.step(1, state)
    """
    rc, out, err = _run_job(code, tmp_path / "ck", signal_after="PERSISTING",
                            signum=signal.SIGINT)
    assert rc == -signal.SIGTERM, out + err


def test_a_handle_cannot_be_waited_for_in_a_forked_child(tmp_path):
    code = """
        import os, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False, save_on_signals=None)
        mgr.hooks["before_write"] = lambda step: time.sleep(1)
        h = mgr.save(1, {"w": np.ones(10)})
        pid = os.fork()
        if pid == 0:
            try:
                h.wait(timeout=30)
                os._exit(1)
            except pitstop.CheckpointError as e:
                os._exit(42 if "belongs to process" in str(e) else 2)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
        mgr.close()
    """
    rc, out, err = _run_job(code, tmp_path / "ck")
    assert rc == 0 and "CHILD 42" in out, out + err


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="needs SIGCHLD")
def test_a_sigchld_handler_waits_out_a_signals_save_and_is_put_back(tmp_path):
    """torch's DataLoader raises from its SIGCHLD handler: held during a signal's save, then
    put back and called once (after a save that trains on) for what came meanwhile."""
    calls = []

    def on_child(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGCHLD, on_child)

    class StartsAChild:
        def state_dict(self):
            subprocess.run(["true"], check=True)  # its exit sends this process SIGCHLD
            for _ in range(10):
                time.sleep(0.005)  # Python runs signal handlers in between
            seen.append(len(calls))
            return {}

        def load_state_dict(self, state):
            pass

    seen: list[int] = []
    try:
        with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False) as mgr:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert mgr.step(1, {"c": StartsAChild()}) is not None
            assert seen == [0] and calls == [signal.SIGCHLD]
            assert signal.getsignal(signal.SIGCHLD) is on_child
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_signal_save_that_could_not_be_taken_is_not_reported_saved(tmp_path):
    code = """
        import os, signal, sys, numpy as np, pitstop
        class Broken:
            def state_dict(self):
                raise RuntimeError("the capture fails")
            def load_state_dict(self, state):
                pass
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        os.kill(os.getpid(), signal.SIGTERM)
        mgr.step(1, {"w": np.zeros(10), "b": Broken()})
    """
    rc, out, err = _run_job(code, tmp_path / "ck")
    assert rc == -signal.SIGTERM, out + err
    assert "could not be taken" in err and "saved step 1" not in err, err


def test_under_torchrun_the_same_stop_signal_twice_still_saves(tmp_path):
    """scancel or a preemption SIGTERMs every process of a torchrun job, and torchrun
    forwards its own SIGTERM to the workers too: each worker got it twice and exited at once
    without its save (seen with a real torchrun). torchrun marks its workers'
    environment; it kills them on its own when it is asked again."""
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        os.kill(os.getpid(), signal.SIGTERM)   # the scheduler's
        os.kill(os.getpid(), signal.SIGTERM)   # torchrun's forward of its own
        time.sleep(0.05)
        mgr.step(1, {"w": np.zeros(10)})
        print("NOT REACHED", flush=True)
    """
    p = subprocess.run([PY, "-c", textwrap.dedent(code), str(tmp_path / "ck")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TORCHELASTIC_RUN_ID="job-1"))
    assert p.returncode == -signal.SIGTERM, p.stdout + p.stderr
    assert "NOT REACHED" not in p.stdout
    assert "SIGTERM again, under torchrun" in p.stderr, p.stderr
    assert committed_steps(tmp_path / "ck") == [1], p.stderr
