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

ROOT = Path(__file__).resolve().parents[2]
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


def test_workers_start_with_both_signals_blocked():
    """From the first instruction of a worker (no window before its worker_init_fn), while
    the trainer itself keeps receiving them."""
    loader = ResumableLoader(TensorDataset(torch.arange(20)), batch_size=2, num_workers=2,
                             multiprocessing_context="fork")
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
