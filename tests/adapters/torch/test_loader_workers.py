"""ResumableLoader's worker processes leave SIGTERM and SIGINT to the training process.

Slurm preemption, scancel and docker stop signal every process of the job; a worker that
died of it made torch raise in the trainer before its save (see also
test_exact_resume.py::test_a_signal_to_the_whole_process_group_...). Workers must still obey
their parent (Process.terminate at interpreter exit) and shut down normally.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from torch_helpers import MarkedDataset, mark_worker

from pitstop.adapters.torch import ResumableLoader
from pitstop.adapters.torch._workers import WorkerInit

pytestmark = pytest.mark.skipif(
    not (hasattr(signal, "sigwaitinfo") and os.path.exists("/proc/self/status")),
    reason="needs POSIX real-time signal calls and /proc (Linux)")

ROOT = Path(__file__).resolve().parents[3]
BLOCKED = {signal.SIGTERM, signal.SIGINT}


def proc_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as a dict ({} once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def signal_set(mask: str) -> set[int]:
    bits = int(mask, 16)
    return {s for s in range(1, 65) if bits >> (s - 1) & 1}


def wait_until_taken(pid: int, signums: set[int], timeout: float = 30) -> None:
    """Wait until none of ``signums`` is pending in process ``pid`` any more (taken by a
    thread, or the process died of it)."""
    deadline = time.monotonic() + timeout
    while True:
        st = proc_status(pid)
        if not st or st["State"].startswith(("Z", "X")):
            return
        if not signums & (signal_set(st["ShdPnd"]) | signal_set(st["SigPnd"])):
            return
        assert time.monotonic() < deadline, f"signals {signums} still pending in {pid}: {st}"
        time.sleep(0.01)


def send_from_another_process(pid: int, signum: int) -> None:
    """What Slurm or a terminal does: a signal whose sender is not the worker's parent."""
    subprocess.run([sys.executable, "-c", f"import os; os.kill({pid}, {int(signum)})"],
                   check=True)


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_start_with_both_signals_blocked(context):
    """From the first instruction of a worker (no window before its worker_init_fn), while
    the trainer itself keeps receiving them."""
    loader = ResumableLoader(TensorDataset(torch.arange(20)), batch_size=2, num_workers=2,
                             multiprocessing_context=context)
    it = iter(loader)
    pids = [w.pid for w in it.it._workers]
    for pid in pids:
        assert BLOCKED <= signal_set(proc_status(pid)["SigBlk"]), pid
    assert not BLOCKED & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the trainer's mask
    assert len(list(it)) == 10
    del it


def test_a_worker_ignores_signals_from_others_and_obeys_its_parent():
    loader = ResumableLoader(TensorDataset(torch.arange(40)), batch_size=2, num_workers=1)
    it = iter(loader)
    first = next(it)  # the worker ran its worker_init_fn
    worker = it.it._workers[0]
    for signum in (signal.SIGTERM, signal.SIGINT):
        send_from_another_process(worker.pid, signum)
    wait_until_taken(worker.pid, BLOCKED)
    assert worker.is_alive()
    rest = list(it)  # it still serves every batch; then the normal shutdown ends it
    assert len(rest) == 19 and first[0].tolist() == [0, 1]
    worker.join(30)
    assert worker.exitcode == 0

    it = iter(loader)
    next(it)
    worker = it.it._workers[0]
    worker.terminate()  # the parent's SIGTERM, as multiprocessing sends it at exit
    worker.join(30)
    assert worker.exitcode == 0  # ended at once, as torch's own handler would
    del it


def test_the_users_worker_init_fn_is_still_called_also_under_spawn():
    loader = ResumableLoader(MarkedDataset(4), batch_size=2, num_workers=1,
                             multiprocessing_context="spawn", worker_init_fn=mark_worker)
    assert isinstance(loader.worker_init_fn, WorkerInit)
    assert pickle.loads(pickle.dumps(loader.worker_init_fn)).fn is mark_worker
    rows = [r for batch in loader for r in batch.tolist()]
    # every item: fetched after the user's init ran (mark 100), with SIGTERM blocked
    assert rows == [[i, 100, 1] for i in range(4)]


CHILD = """
import sys
import textwrap
import torch
from torch.utils.data import TensorDataset
from pitstop.adapters.torch import ResumableLoader
loader = ResumableLoader(TensorDataset(torch.arange(100.)), batch_size=4, num_workers=2)
it = iter(loader)   # alive until the interpreter exits
next(it)
print(" ".join(str(w.pid) for w in it.it._workers), flush=True)
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("how", ["return", "interrupt"])
def test_exit_with_a_live_iterator_ends_the_workers_and_does_not_hang(how):
    """The iterator outlives the program (a global; a traceback): at exit multiprocessing
    terminates the daemonic workers and joins them without a timeout. Workers that ignored
    every SIGTERM would hang the exit here forever."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the program did not exit: its DataLoader workers never ended")
    expected = 0 if how == "return" else -signal.SIGINT
    assert proc.returncode == expected, err.decode()[-3000:]
    assert len(out.split()) == 2
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker left behind


_PLAIN_LOADER_JOB = textwrap.dedent("""
    import sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import pitstop
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=2)
    with pitstop.CheckpointManager(sys.argv[1], memory_tier=False,
                                   save_every_steps=1000) as mgr:
        for step, (x,) in enumerate(loader):
            model(x).sum().backward()
            if step == 3:
                print("waiting", step, flush=True)
                for _ in range(600):      # the only way on is the workers' death
                    time.sleep(0.05)
            mgr.step(step, {"model": model})
""")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_a_plain_dataloader_killed_by_a_group_signal_says_why_nothing_was_saved(tmp_path):
    """A plain DataLoader's workers die of a SIGTERM sent to the whole group and torch ends
    the training loop before the step boundary: pitstop cannot save, and says so, naming
    ResumableLoader as the fix."""
    p = subprocess.Popen([sys.executable, "-c", _PLAIN_LOADER_JOB, str(tmp_path / "ck")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        first = p.stdout.readline().strip()
        assert first == "waiting 3", first + p.stderr.read()
        os.killpg(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    seen = f"exit {p.returncode}\nstdout: {out}\nstderr: {err}"
    assert p.returncode == 1, seen
    assert "DataLoader worker" in err, seen
    assert "SIGTERM arrived" in err and "nothing was saved for it" in err, seen
    assert "ResumableLoader" in err, seen
    assert not (tmp_path / "ck" / "step_0000000003").exists()


# --------------------------------------------------------------- spawn and forkserver
SIGNAL_CHILD = Path(__file__).with_name("signal_child.py")
HERE = Path(__file__).resolve().parent


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))


class Trainer:
    """One run of signal_child.py in its own process group (trainer, workers, and the
    multiprocessing helpers: resource tracker, forkserver)."""

    def __init__(self, out: Path, context: str, *, gate: bool, workers: int = 2) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.ckpt = out, out / "ckpt"
        self.gate = out / "gate" if gate else None
        self.buf = b""
        with open(out / "stderr.txt", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(SIGNAL_CHILD), "--dir", str(self.ckpt), "--context",
                 context, "--gate", str(self.gate or ""), "--workers", str(workers)],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=child_env(),
                start_new_session=True)

    def line(self, prefix: str, timeout: float = 120) -> list[str]:
        """The next stdout line starting with ``prefix``, split into words."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                raw, self.buf = self.buf.split(b"\n", 1)
                words = raw.decode().split()
                if words and words[0] == prefix:
                    return words
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            assert ready, f"no {prefix!r} line within {timeout} s: {self.stderr()}"
            chunk = os.read(fd, 65536)
            assert chunk, f"the trainer exited before a {prefix!r} line: {self.stderr()}"
            self.buf += chunk

    def workers_starting(self) -> list[int]:
        """The pids of the first epoch's workers, once each waits in its start-up."""
        pids = [int(p) for p in self.line("workers")[1:]]
        for pid in pids:
            marker = Path(f"{self.gate}.started.{pid}")
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert time.monotonic() < deadline, f"worker {pid} never started: {self.stderr()}"
                time.sleep(0.01)
        return pids

    def open_gate(self) -> None:
        assert self.gate is not None
        self.gate.touch()

    def finish(self, timeout: float = 120) -> int:
        """Wait for the trainer's exit (draining its stdout meanwhile; a worker that
        outlives it may hold the pipe open); its return code."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        eof = False
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"the trainer did not exit: {self.stderr()}"
            if eof:
                time.sleep(0.05)
            elif select.select([fd], [], [], 0.05)[0]:
                eof = not os.read(fd, 65536)
        return self.proc.returncode

    def group_gone(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            alive = [p for p in _group_members(self.proc.pid)
                     if not proc_status(p).get("State", "Z").startswith(("Z", "X"))]
            if not alive:
                return True  # zombies only (reparented to an init that does not reap)
            time.sleep(0.05)
        return False

    def saved_steps(self) -> list[int]:
        return sorted(int(p.name[5:]) for p in self.ckpt.glob("step_*") if p.is_dir())

    def stderr(self) -> str:
        return (self.out / "stderr.txt").read_text()[-4000:]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    out.append(int(entry.name))
    return out


SCENARIOS = {
    # a signal to the whole group while the workers are still starting / while they run
    "term-startup-spawn": ("spawn", True, 2),
    "term-startup-forkserver": ("forkserver", True, 2),
    "term-steady-spawn": ("spawn", False, 2),
    "term-steady-forkserver": ("forkserver", False, 2),
    # the trainer killed (SIGKILL, itself only) while its worker starts / runs
    "orphan-startup-spawn": ("spawn", True, 1),
    "orphan-startup-forkserver": ("forkserver", True, 1),
    "orphan-steady-forkserver": ("forkserver", False, 1),
}


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """Every scenario's trainer, started together (they are mostly torch's import time)."""
    started = {name: Trainer(tmp_path_factory.mktemp(name), ctx, gate=gate, workers=n)
               for name, (ctx, gate, n) in SCENARIOS.items()}
    yield started
    for t in started.values():
        t.kill()


def check_saved_and_exited_as_asked(t: Trainer) -> None:
    rc = t.finish()
    err = t.stderr()
    assert rc == -signal.SIGTERM, f"exit {rc}: {err}"
    assert "DataLoader worker" not in err, err
    assert t.saved_steps() and "after SIGTERM" in err, err
    assert t.group_gone(), f"processes left in the group: {_group_members(t.proc.pid)}"


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_group_sigterm_while_workers_start_is_saved(trainers, context):
    """The workers, and under forkserver the forkserver that forks them, are started with
    SIGTERM blocked: multiprocessing's resource tracker, whose start unblocks the signals
    in the starting thread, is started before that window."""
    t = trainers[f"term-startup-{context}"]
    t.workers_starting()  # each worker waits in its start-up, before worker_init_fn
    os.killpg(t.proc.pid, signal.SIGTERM)  # pending in each worker now
    t.open_gate()
    check_saved_and_exited_as_asked(t)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_group_sigterm_while_workers_run_is_saved(trainers, context):
    t = trainers[f"term-steady-{context}"]
    t.line("step")
    t.line("workers")  # the second epoch's workers have started: steady iteration
    t.line("step")
    os.killpg(t.proc.pid, signal.SIGTERM)
    check_saved_and_exited_as_asked(t)


@pytest.mark.parametrize("name", ["orphan-startup-spawn", "orphan-startup-forkserver",
                                  "orphan-steady-forkserver"])
def test_workers_of_a_killed_trainer_end(trainers, name):
    """A worker whose trainer is gone ends: one still starting when the trainer died (its
    OS parent is then init, or the forkserver, never the trainer torch's watchdog looks
    for), and one running under forkserver (whose OS parent, the forkserver, lives on)."""
    t = trainers[name]
    if t.gate is not None:
        pids = t.workers_starting()
    else:
        pids = [int(p) for p in t.line("workers")[1:]]
        t.line("step")
    os.kill(t.proc.pid, signal.SIGKILL)  # the trainer only
    t.finish()
    if t.gate is not None:
        t.open_gate()
    assert t.group_gone(), (f"workers {pids} outlived their trainer: "
                            f"{[proc_status(p).get('PPid') for p in pids]}")


def test_a_forkserver_started_earlier_without_the_signals_blocked_is_said_once(tmp_path):
    code = textwrap.dedent("""
        import multiprocessing, time
        import torch
        from torch.utils.data import TensorDataset
        from torch_helpers import mark_worker
        from pitstop.adapters.torch import ResumableLoader
        p = multiprocessing.get_context("forkserver").Process(target=mark_worker, args=(0,))
        p.start()   # other code starts the forkserver first, with the signals unblocked
        p.join()
        loader = ResumableLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=1,
                                 multiprocessing_context="forkserver")
        for _ in range(2):
            assert len(list(loader)) == 2
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=child_env(), timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("forkserver process (pid") == 1, r.stderr
    assert "multiprocessing_context='spawn'" in r.stderr, r.stderr


def test_other_processes_of_the_loaders_forkserver_still_end_on_terminate(tmp_path):
    """The forkserver a ResumableLoader starts keeps the signals blocked; a process other
    code starts through it gets them unblocked, so Process.terminate() still ends it."""
    code = textwrap.dedent("""
        import multiprocessing, time
        import torch
        from torch.utils.data import TensorDataset
        from pitstop.adapters.torch import ResumableLoader
        loader = ResumableLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=1,
                                 multiprocessing_context="forkserver")
        assert len(list(loader)) == 2   # the forkserver is started, signals blocked
        p = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(120,))
        p.start()
        time.sleep(0.5)
        p.terminate()
        p.join(60)
        print(p.exitcode)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=child_env(), timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(-signal.SIGTERM)], r.stdout + r.stderr


def test_the_worker_death_hint_fits_what_the_process_used(monkeypatch):
    from pitstop.adapters.torch import _workers

    died = RuntimeError("DataLoader worker (pid 123) is killed by signal: Terminated.")
    assert _workers.worker_death_hint(RuntimeError("something else")) is None
    monkeypatch.setitem(_workers.seen, "started", False)
    monkeypatch.setitem(_workers.seen, "unprotected", [])
    plain = _workers.worker_death_hint(died)
    assert "plain DataLoader" in plain and "Use pitstop.adapters.torch.ResumableLoader" in plain
    assert "forkserver" not in plain
    # this process did start a ResumableLoader's workers: say what else can kill them
    monkeypatch.setitem(_workers.seen, "started", True)
    both = _workers.worker_death_hint(died)
    assert both.startswith(plain) and "forkserver" in both
    assert "multiprocessing_context='spawn'" in both
    # and when pitstop saw why they were exposed, that reason
    monkeypatch.setitem(_workers.seen, "unprotected", ["the forkserver process (pid 7) ..."])
    known = _workers.worker_death_hint(died)
    assert "could not be protected" in known and "pid 7" in known
    assert "Use pitstop.adapters.torch.ResumableLoader" not in known


_WORKER_DIES_DURING_THE_SAVE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import pitstop

    class KillsAWorker:
        # taken inside the signal's save: the worker's share of the group SIGTERM lands then
        pid = None
        def state_dict(self):
            if self.pid is not None:
                # from another process, as Slurm's: a worker obeys its parent's SIGTERM
                subprocess.run(["kill", "-TERM", str(self.pid)], check=True)
                stat = f"/proc/{self.pid}/stat"
                while open(stat).read().rsplit(")", 1)[1].split()[0] != "Z":
                    time.sleep(0.01)          # until the trainer's SIGCHLD has come
                for _ in range(20):
                    time.sleep(0.01)          # Python runs signal handlers in between
            return {"n": 1}
        def load_state_dict(self, state):
            pass

    model, killer = torch.nn.Linear(4, 1), KillsAWorker()
    it = iter(DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=2))
    with pitstop.CheckpointManager(sys.argv[1], memory_tier=False,
                                   save_every_steps=1000) as mgr:
        for step, (x,) in enumerate(it):
            if step == 3:
                killer.pid = it._workers[0].pid
                os.kill(os.getpid(), signal.SIGTERM)   # the trainer's share of it
            mgr.step(step, {"model": model, "killer": killer})
""")


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="needs SIGCHLD")
def test_a_plain_dataloader_worker_dying_during_the_signals_save_does_not_fail_it(tmp_path):
    """The trainer reached the step boundary and saves for a group SIGTERM when its plain
    DataLoader's worker dies of the same signal: torch's SIGCHLD handler raised inside the
    save (or its wait), the job exited 1 with a traceback, or without its save. The save
    must commit and the job exit as the signal asks."""
    # stderr to a file: the other worker, which holds a pipe until it sees its parent gone
    # (within 5 s), is not waited for
    with open(tmp_path / "stderr.txt", "wb") as f:
        p = subprocess.run([sys.executable, "-c", _WORKER_DIES_DURING_THE_SAVE,
                            str(tmp_path / "ck")], stdout=subprocess.DEVNULL, stderr=f,
                           timeout=120, env=child_env(), stdin=subprocess.DEVNULL)
    err = (tmp_path / "stderr.txt").read_text()
    seen = f"exit {p.returncode}\nstderr: {err}"
    assert p.returncode == -signal.SIGTERM, seen
    assert "DataLoader worker" not in err, seen
    assert "saved step 3 after SIGTERM" in err, seen
    assert (tmp_path / "ck" / "step_0000000003").is_dir(), seen
