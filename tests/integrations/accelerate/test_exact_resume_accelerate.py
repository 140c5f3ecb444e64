"""Accelerate + pitstop's Checkpointing: a job SIGKILLed at a random batch, started again with
the same command, stopped by a SIGTERM to its process group at a later random batch (it
saves at the next optimizer step and exits), and started once more, ends bitwise identical
to an uninterrupted run: every batch's loss, the final weights, optimizer moments and LR
schedule. The job (accelerate_child.py) has a shuffled DataLoader with two worker processes,
dropout, gradient accumulation 2 and warm-up + cosine. The seed of the random plan is in
every failure message.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

CHILD = Path(__file__).with_name("accelerate_child.py")
ROOT = Path(__file__).resolve().parents[3]
PER_EPOCH, EPOCHS = 11, 2
SYNC = (2, 4, 6, 8, 10, 11)  # batches of an epoch that end an accumulation (2; end of data)


def global_step_after(batch: int) -> int:
    """Optimizer steps done after the run's ``batch``-th batch (1-based)."""
    epoch, within = divmod(batch, PER_EPOCH)
    return epoch * len(SYNC) + sum(1 for s in SYNC if s <= within)


class Job:
    def __init__(self, out: Path, project: Path, *extra: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.err = out / "stderr.txt"
        with open(self.err, "ab") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), "--project", str(project), "--out", str(out),
                 *extra], stdout=subprocess.PIPE, stderr=se, env=env, start_new_session=True)
        self.lines: list[str] = []
        self._buf = b""

    def read_until(self, prefix: str | None, timeout: float = 180) -> None:
        """Read stdout until a line starting with ``prefix`` (None: until it closes)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"no {prefix!r} from the child in {timeout} s: {self.stderr()}"
            chunk = os.read(fd, 4096)
            if not chunk:
                assert prefix is None, (f"the child exited before {prefix!r}: {self.lines[-3:]} "
                                        f"{self.stderr()}")
                return
            self._buf += chunk
            *done, self._buf = self._buf.split(b"\n")
            new = [d.decode() for d in done]
            self.lines += new
            if prefix is not None and any(n.startswith(prefix) for n in new):
                return

    def stderr(self) -> str:
        return self.err.read_text()[-3000:]

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self) -> int:
        self.read_until(None)
        rc = self.proc.wait(timeout=180)
        self.signal(signal.SIGKILL)  # leftover workers, if any
        return rc

    def losses(self) -> list[tuple[int, str]]:
        return [(int(p[1]), p[3]) for p in (ln.split() for ln in self.lines)
                if len(p) == 4 and p[0] == "batch"]


def test_sigkill_then_sigterm_resume_is_bitwise_exact(tmp_path: Path) -> None:
    seed = int(os.environ.get("PITSTOP_TEST_SEED", random.randrange(2**32)))
    plan = random.Random(seed)
    k1 = plan.randint(5, 2 * PER_EPOCH - 6)
    k2 = plan.randint(k1 + 2, 2 * PER_EPOCH - 2)
    note = f"seed {seed}: SIGKILL after batch {k1}, SIGTERM after batch {k2}"
    print(note)
    project = tmp_path / "project"
    ref = Job(tmp_path / "ref", tmp_path / "ref_project")  # the same job, never stopped
    first = Job(tmp_path / "run", project)
    first.read_until(f"batch {k1} ")
    first.signal(signal.SIGKILL)
    first.finish()

    second = Job(tmp_path / "run", project)
    second.read_until(f"batch {k2} ")
    second.signal(signal.SIGTERM)  # to the group, workers too: pitstop saves, then exits
    rc = second.finish()
    assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), (note, rc, second.stderr())
    # the signal lands at or some batches after k2 (the child prints a batch's line before
    # its ckpt.step(), and runs on while the line is read); the job stops at the first
    # optimizer step from there, having saved that step (k2 itself when it ends a step)
    boundary = second.losses()[-1][0]
    assert boundary >= k2 and global_step_after(boundary) > global_step_after(boundary - 1), (
        note, boundary)
    steps = sorted(int(p.name.split("_")[1]) for p in (project / "checkpoints").glob("step_*"))
    assert steps[-1] == global_step_after(boundary), (note, steps)
    assert second.lines[0] != "restored None", note  # resumed from the SIGKILLed run's save

    third = Job(tmp_path / "run", project)
    assert third.finish() == 0, (note, third.stderr())
    assert ref.finish() == 0, ref.stderr()
    assert third.lines[0] == f"restored {global_step_after(boundary)}", (note, third.lines[0])
    assert len(steps) <= 3, (note, steps)  # ProjectConfiguration(total_limit=3)

    want = dict(ref.losses())
    assert sorted(want) == list(range(1, 2 * PER_EPOCH + 1)), note
    seen: dict[int, str] = {}
    for job in (first, second, third):
        for b, loss in job.losses():
            assert loss == want[b], (note, "batch", b, loss, want[b])
            seen[b] = loss
    assert sorted(seen) == sorted(want), note
    # the resumed runs start at the batch after their checkpoint: none is trained twice
    # beyond what the checkpoint did not hold, and none is skipped
    # (the SIGKILL lands some batches after k1 under load: the first run's last batch bounds it)
    assert second.losses()[0][0] <= first.losses()[-1][0] + 1, note
    # (a SIGTERM landing in the last batch leaves the third run nothing to train)
    assert [b for b, _ in third.losses()][:1] == ([boundary + 1] if boundary < 2 * PER_EPOCH
                                                  else []), note

    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), (note, k)
    for pid, st in a["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][pid][name]), (note, pid, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"], note
    assert a["scheduler"] == b["scheduler"], note
