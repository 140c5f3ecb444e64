"""A Lightning job SIGKILLed at a random training batch and started again with the same
command (``fit(ckpt_path="last")``) goes on exactly: every later loss, the final weights and
the optimizer state are bitwise those of an uninterrupted run (issue 29)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

CHILD = Path(__file__).with_name("lightning_child.py")
#: each run's stderr, for the failure messages
_ERR: list[str] = []


def _run(run_dir: Path, out: Path, kill_at: int | None = None, term_at: int | None = None
         ) -> int:
    """Run the child; with ``kill_at``, SIGKILL its process group once it printed that
    batch done. Returns the exit code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [] if term_at is None else ["--term-at", str(term_at)]
    proc = subprocess.Popen([sys.executable, str(CHILD), "--dir", str(run_dir), "--out", str(out),
                             *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if kill_at is not None and line.strip() == f"done {kill_at}":
            os.killpg(proc.pid, signal.SIGKILL)
            break
    _, err = proc.communicate(timeout=300)
    _ERR.append(err)
    if kill_at is None and term_at is None:
        assert proc.returncode == 0, err[-3000:]
    return proc.returncode


def _losses(out: Path) -> tuple[list[int], dict[int, list[str]]]:
    """The batches each start resumed after, and every loss of each batch."""
    starts, seen = [], {}
    for line in (out / "log.txt").read_text().splitlines():
        kind, n, *v = line.split()
        if kind == "start":
            starts.append(int(n))
        else:
            seen.setdefault(int(n), []).append(v[0])
    return starts, seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    _run(out / "run", out)
    return out


def test_sigterm_then_sigkill_at_random_batches_resume_bitwise(reference: Path, tmp_path: Path
                                                                ) -> None:
    seed = int(os.environ.get("PITSTOP_LIGHTNING_SEED") or random.randrange(1 << 30))
    print(f"seed {seed}")  # rerun a failure: PITSTOP_LIGHTNING_SEED=<seed>
    rng = random.Random(seed)
    term_at = rng.randint(3, 12)   # SIGTERM: pitstop saves this batch (mid-accumulation or
    kill_at = rng.randint(term_at + 3, 28)  # not) and exits; then a SIGKILL, no save
    run = tmp_path / "run"
    assert _run(run, tmp_path, term_at=term_at) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    code = _run(run, tmp_path, kill_at=kill_at, term_at=term_at)
    assert code == -signal.SIGKILL, (code, _ERR[-1][-3000:])
    assert not (tmp_path / "final.pt").exists()
    _run(run, tmp_path, term_at=term_at)  # the same command again
    (ref_starts, ref), (starts, got) = _losses(reference), _losses(tmp_path)
    assert ref_starts == [0] and sorted(got) == sorted(ref) == list(range(1, 33))
    # the SIGTERM run saved the very batch it was told at; the killed one resumed from a
    # checkpoint a few batches back (every 3 optimizer steps, every 5 batches), not the start
    assert starts[:2] == [0, term_at] and kill_at - 6 <= starts[2] <= kill_at, (starts, kill_at)
    # the batches trained twice: after the third start's checkpoint, up to the killed run's
    # last (the SIGKILL lands a batch or so after the line it waits for, under load)
    lines = (tmp_path / "log.txt").read_text().splitlines()
    third = [i for i, x in enumerate(lines) if x.startswith("start ")][2]
    killed_last = max(int(x.split()[1]) for x in lines[:third] if not x.startswith("start "))
    assert killed_last >= kill_at, (killed_last, kill_at)
    for n, values in got.items():
        assert set(values) == {ref[n][0]}, f"batch {n}: {values} vs {ref[n]} (seed {seed})"
        assert len(values) == (2 if starts[2] < n <= killed_last else 1), (n, values, starts)
    a = torch.load(reference / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "final.pt", weights_only=True)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, s in a["optimizer"]["state"].items():
        for name, t in s.items():
            assert torch.equal(t, b["optimizer"]["state"][i][name]), (i, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
