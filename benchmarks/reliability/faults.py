"""Resource faults: a full disk, permission denied, I/O errors, a full memory tier.

The promise each scenario counts: a save that meets the fault fails with a clear
``CheckpointWriteError`` naming its step and path (from its handle, ``wait()`` or the next
``save()``, as docs/quickstart.md says), or, for the memory tier, goes on without the tier
after one warning; committed checkpoints stay bit-exact; no temporary is left; once the fault
is gone, training goes on and the next save commits.

How the faults are made, and why:

- ``full_disk``: a real tmpfs of a few hundred KiB to a few MiB, mounted per trial (we run as
  root). Where mounting is refused, the trials run in a child process under
  ``RLIMIT_FSIZE`` instead (EFBIG for real), and the counts say which ran.
- ``permission_denied``: ``chattr +i`` (immutable, refused even to root) on the run directory,
  on a save's temporary directory or on ``.pitstop``, at a point of the save chosen per trial
  through the engine's hooks; plus trials in a child that dropped to uid 65534, where a
  plain ``chmod 0555`` does it. Both are the kernel refusing, not a simulation.
- ``io_error``: EIO, ENOSPC, EDQUOT and EROFS cannot be had from a real file system on
  demand without dm-error/FUSE (root-only, slow, and too much machinery for a test), and
  LD_PRELOAD would fake libc, not pitstop's code. So they are raised at pitstop's own
  storage seam: a ``LocalStorage`` subclass handed to the manager as its directory (the
  public way to give it a storage), whose methods do the real work on real files and raise
  the error at the n-th call of one of them: ``begin`` (the temporary directory), a
  ``Writer.write``, a ``Writer.close`` (the fsync), ``commit`` before it publishes, ``commit``
  after it published (as a failed directory fsync after the rename would), ``write_meta``
  (the index), retention's delete, and ``read_into``/``read_bytes`` during a restore.
- ``full_shm``: the memory tier (``memory_tier=<dir>``) on a tmpfs that a filler file fills
  before a save, during a persist, or that is too small from the start, with states whose
  size changes so the tier's buffer is made again at different points.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pitstop
from pitstop.core.directory.names import DEFAULT
from pitstop.core.storage.base import Transaction, Writer
from pitstop.core.storage.local import LocalStorage

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
    spawn,
    state_bytes,
    state_of,
    target_of,
    tmpfs,
    trial_rng,
)

#: the full run's trials per scenario: 50, or more where a trial is cheap
FULL_TRIALS = {"full_disk": 200, "permission_denied": 100, "io_error": 200, "full_shm": 50}


def _open(d: Path | LocalStorage, **kw: Any) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    kw.setdefault("save_every_steps", 1)  # step() saves every step, as surface "step" needs
    kw.setdefault("on_busy", "wait")
    return pitstop.CheckpointManager(d, **kw)


def _clear(e: BaseException, step: int, words: tuple[str, ...]) -> str | None:
    """None when ``e`` is a clear failure of the save of ``step``: a CheckpointWriteError
    with that step, the path of its checkpoint, and the cause in words."""
    if not isinstance(e, pitstop.CheckpointWriteError):
        return f"{type(e).__name__} instead of CheckpointWriteError: {e}"
    if e.step != step:
        return f"the error names step {e.step}, the failed save was {step}: {e}"
    if not e.path or not e.path.endswith(DEFAULT.name(step)) or e.path not in str(e):
        return f"the error does not name the checkpoint's path ({e.path}): {e}"
    if words and not any(w in str(e) for w in words):
        return f"the error does not say why ({' / '.join(words)}): {e}"
    return None


class _Saves:
    """Saves with their failures caught where the docs say they surface, checked once."""

    def __init__(self, res: Result, where: str, words: tuple[str, ...]) -> None:
        self.res, self.where, self.words = res, where, words
        self.raised: list[BaseException] = []
        self.handles: dict[int, Any] = {}

    def save(self, mgr: pitstop.CheckpointManager, step: int, state: Any, surface: str) -> bool:
        """One save; False once a failure surfaced (in the way ``surface`` names)."""
        try:
            # "step": a training loop's step() (save_every_steps=1, on_busy="wait")
            h = mgr.step(step, state) if surface == "step" else mgr.save(step, state)
            if h is None:
                self.res.fail(f"{self.where}: step({step}) did not save")
                return True
        except pitstop.CheckpointError as e:  # the next save()/step() reports a failure
            self.raised.append(e)
            if getattr(e, "handle", None) is not None:  # save() attempted its own step too
                self.handles[step] = e.handle
            return False
        except Exception as e:  # noqa: BLE001 - a raw error escaped: counted
            self.res.fail(f"{self.where}: save({step}) raised {type(e).__name__}: {e}")
            self.raised.append(e)
            return False
        self.handles[step] = h
        try:
            if surface == "handle":
                h.wait(timeout=120)
            elif surface == "wait":
                mgr.wait(timeout=120)
        except pitstop.CheckpointError as e:
            self.raised.append(e)
            return False
        except Exception as e:  # noqa: BLE001
            self.res.fail(f"{self.where}: waiting for {step} raised {type(e).__name__}: {e}")
            self.raised.append(e)
            return False
        return True

    def settle(self, mgr: pitstop.CheckpointManager) -> list[int]:
        """Wait for every save; check each failure was raised once and clearly; returns the
        failed steps."""
        try:
            mgr.wait(timeout=120)
        except pitstop.CheckpointError as e:
            self.raised.append(e)
        except Exception as e:  # noqa: BLE001
            self.res.fail(f"{self.where}: wait() raised {type(e).__name__}: {e}")
        failed = sorted(s for s, h in self.handles.items() if h.done() and not h.committed
                        and not h.stats.skipped)
        steps_raised = [getattr(r, "step", None) for r in self.raised]
        if failed and not self.raised:
            self.res.fail(f"{self.where}: saves of {failed} failed and nothing was raised")
        if len(set(steps_raised)) != len(steps_raised):
            self.res.fail(f"{self.where}: a failure was raised twice: {steps_raised}")
        for err in self.raised:
            step = getattr(err, "step", None)
            if step not in failed:
                self.res.fail(f"{self.where}: {type(err).__name__} for step {step}, which did "
                              f"not fail (failed: {failed}): {err}")
                continue
            bad = _clear(err, step, self.words)
            if bad:
                self.res.fail(f"{self.where}: {bad}")
        if failed and self.raised and getattr(self.raised[0], "step", None) != failed[0]:
            self.res.fail(f"{self.where}: the first error raised is of step "
                          f"{getattr(self.raised[0], 'step', None)}, the first failed save "
                          f"{failed[0]}")
        self.raised = []
        return failed


def _after(res: Result, where: str, d: Path, seed: int, n_of: dict[int, int],
           failed: list[int]) -> None:
    """What must hold after a failure: committed checkpoints exact, no failed step
    committed (unless its outcome was unknown), no temporary left."""
    left = leftovers(d)
    if left:
        res.fail(f"{where}: temporaries left after the failure: {left}")
    for p in check_all_exact(d, seed, n_of):
        res.fail(f"{where}: {p}")
    present = set(committed_on_disk(d)) & set(failed)
    if present:
        res.fail(f"{where}: failed step(s) {sorted(present)} are committed")


# ====================================================================== full disk
def full_disk(trials: int, seed: int, workdir: Path) -> Result:
    """Saves until a small tmpfs is full; the failure is clear, nothing committed is
    touched, and after space is freed the next save commits."""
    res = Result("full_disk")
    probe = workdir / "full_disk_probe"
    with tmpfs(probe, "64k") as mounted:
        pass
    if not mounted:
        return _fsize_fallback(res, trials, seed, workdir)
    with quiet_pitstop():
        for t in range(trials):
            counted_trial(res, "full_disk", seed, t, _full_disk_trial, res, seed, t,
                          workdir / f"full_disk_{t}")
    res.bump("tmpfs_trials", trials)
    return res


def _full_disk_trial(res: Result, seed: int, t: int, mnt: Path) -> None:
    rng = trial_rng(seed, t, "full_disk")
    n = rng.choice([4 << 10, 16 << 10, 48 << 10, 96 << 10])
    one = state_bytes(n)
    free_by = rng.choice(["delete", "filler"])
    filler_size = rng.randint(one + (64 << 10), 2 * one + (64 << 10)) if free_by == "filler" \
        else rng.randint(0, one)
    size = filler_size + rng.randint(2, 6) * one + rng.randint(64, 256) * 1024
    size = -(-size // 4096) * 4096
    surface = rng.choice(["handle", "wait", "next", "step"])
    where = f"full_disk seed {seed} trial {t} ({size >> 10} KiB, {one >> 10} KiB/save, " \
            f"errors by {surface}, freed by {free_by})"
    with tmpfs(mnt, str(size)) as ok:
        if not ok:
            res.fail(f"{where}: could not mount the tmpfs")
            return
        d = mnt / "run"
        mgr = _open(d, writer_threads=rng.choice([1, 2, 4]), durable=rng.random() < 0.5,
                    compression=rng.choice([None, None, "zstd"]))
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            f.write(os.urandom(filler_size))
        saves = _Saves(res, where, ("No space left", "ENOSPC", "Errno 28"))
        n_of: dict[int, int] = {}
        step = 0
        try:
            while step < 64:
                n_of[step] = n
                ok_ = saves.save(mgr, step, state_of(seed, step, n), surface)
                step += 1
                if not ok_:
                    break
            failed = saves.settle(mgr)
            n_of = {s: n_of[s] for s in saves.handles}  # (a save() that raised: its e.handle)
            if not failed:
                res.fail(f"{where}: the disk never filled in {step} saves")
                return
            res.bump("failed_saves", len(failed))
            _after(res, where, d, seed, n_of, failed)
            # make room, as a user (or another program) would
            if free_by == "delete":
                committed = committed_on_disk(d)
                if committed:
                    mgr.delete(committed[0])
                    n_of.pop(committed[0])
            else:
                filler.unlink()
            # training goes on: the failed step again (its save never committed) or a new one
            for s in [failed[0] if rng.random() < 0.5 else step]:
                n_of[s] = n
                try:
                    stats = mgr.save(s, state_of(seed, s, n)).result(timeout=120)
                except pitstop.CheckpointError as e:
                    res.fail(f"{where}: after space was freed, save({s}) failed: {e}")
                    return
                if not stats.committed:
                    res.fail(f"{where}: after space was freed, save({s}) did not commit")
                    return
                res.bump("commits_after_free")
            newest = committed_on_disk(d)[-1]
            target = target_of(n)
            got = mgr.restore(target)
            if got != newest or diff(target, state_of(seed, newest, n)):
                res.fail(f"{where}: restore after the refill gave step {got}, not an exact "
                         f"{newest}")
        finally:
            try:
                mgr.close()
            except pitstop.CheckpointError as e:
                res.fail(f"{where}: close() raised {e}")
        _after(res, where, d, seed, n_of, [])


_FSIZE_CHILD = """
import json, sys
from pathlib import Path
from benchmarks.reliability.faults import _fsize_trials
trials, seed, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
res = _fsize_trials(trials, seed, workdir)
print(json.dumps(res.__dict__), flush=True)
"""


def _fsize_fallback(res: Result, trials: int, seed: int, workdir: Path) -> Result:
    """No tmpfs can be mounted: the same promise under a file-size limit, in a child."""
    proc = spawn(_FSIZE_CHILD, str(trials), str(seed), str(workdir / "full_disk_fsize"))
    try:
        doc = read_json_line(proc, timeout=600)
    except (ChildDied, TimeoutError) as e:
        res.trials += trials
        res.fail(f"full_disk (RLIMIT_FSIZE) seed {seed}: the child failed: {e}")
        return res
    finally:
        end(proc)
    res.trials += doc["trials"]
    res.failures += doc["failures"]
    res.details += doc["details"]
    for k, v in doc["counts"].items():
        res.bump(k, v)
    return res


def _fsize_trials(trials: int, seed: int, workdir: Path) -> Result:
    """In a child: a file-size limit makes a save's data file fail with EFBIG at a point
    chosen per trial; raising the limit again is the freed space."""
    import resource
    res = Result("full_disk")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with quiet_pitstop():
        for t in range(trials):
            res.trials += 1
            rng = trial_rng(seed, t, "fsize")
            d = workdir / f"t{t}"
            small, big = 1 << 10, rng.choice([32 << 10, 64 << 10, 128 << 10])
            threads = rng.choice([1, 2, 4])
            surface = rng.choice(["handle", "wait", "next", "step"])
            where = f"full_disk (RLIMIT_FSIZE) seed {seed} trial {t} ({surface})"
            mgr = _open(d, writer_threads=threads)
            saves = _Saves(res, where, ("File too large", "EFBIG", "Errno 27"))
            n_of = {}
            try:
                for s in range(rng.randint(1, 3)):
                    n_of[s] = small
                    saves.save(mgr, s, state_of(seed, s, small), "handle")
                step = len(n_of)
                limit = rng.randint(state_bytes(small) + 4096, state_bytes(big) // threads - 1)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
                n_of[step] = big
                saves.save(mgr, step, state_of(seed, step, big), surface)
                if surface in ("next", "step"):
                    n_of[step + 1] = small
                    saves.save(mgr, step + 1, state_of(seed, step + 1, small), surface)
                failed = saves.settle(mgr)
                if step not in failed:
                    res.fail(f"{where}: the save over the limit did not fail")
                res.bump("failed_saves", len(failed))
                _after(res, where, d, seed, n_of, failed)
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                nxt = max(n_of) + 1
                n_of[nxt] = big
                if mgr.save(nxt, state_of(seed, nxt, big)).result(timeout=120).committed:
                    res.bump("commits_after_free")
                mgr.close()
                _after(res, where, d, seed, n_of, [])
            except Exception as e:  # noqa: BLE001
                res.fail(f"{where}: {type(e).__name__}: {e}")
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                if not mgr.closed:
                    try:
                        mgr.close()
                    except pitstop.CheckpointError:
                        pass
    res.bump("fsize_trials", trials)
    return res


# ====================================================================== permission denied
def _chattr(path: Path, flag: str) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


class _Protect:
    """Makes a directory unwritable: ``chattr +i`` (root), or ``chmod 0555`` (a non-root
    owner: the child that dropped to uid 65534)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.done: list[Path] = []

    def on(self, path: Path) -> None:
        if self.how == "chattr":
            if not _chattr(path, "+i"):
                raise RuntimeError(f"chattr +i {path} failed")
        else:
            os.chmod(path, 0o555)
        self.done.append(path)

    def off(self) -> None:
        for path in reversed(self.done):
            if self.how == "chattr":
                _chattr(path, "-i")
            else:
                os.chmod(path, 0o755)
        self.done = []


_PERM_WHERE = ("run dir, before the save", "run dir, at the commit", "the save's temporary",
               "the index (.pitstop)")


def permission_denied(trials: int, seed: int, workdir: Path) -> Result:
    """A directory pitstop writes made unwritable at a point of a save; the save fails
    clearly (or, for the index only, commits with a warning), nothing committed is touched,
    and once the permissions are back saves go on and the next writer leaves no temporary."""
    res = Result("permission_denied")
    probe = workdir / "perm_probe"
    probe.mkdir(parents=True, exist_ok=True)
    immutable = os.geteuid() == 0 and _chattr(probe, "+i")
    if immutable:
        _chattr(probe, "-i")
    # chattr where it works; else a child that dropped to uid 65534 (it needs a Python
    # that uid may run: not one under root's home)
    n_here = trials if immutable else 0
    n_child = trials if not immutable and os.geteuid() == 0 else 0
    if n_here:
        with quiet_pitstop():
            _perm_trials(res, range(n_here), seed, workdir / "perm", "chattr")
        res.bump("chattr_trials", n_here)
    if n_child:
        _perm_child(res, range(n_here, n_here + n_child), seed)
    if not n_here and not n_child:
        res.details.append("permission_denied: neither chattr +i nor an unprivileged child "
                           "is possible here (not root): nothing ran")
    return res


def _perm_trials(res: Result, ts: range, seed: int, base: Path, how: str) -> None:
    for t in ts:
        prot = _Protect(how)
        try:
            counted_trial(res, f"permission_denied ({how})", seed, t, _perm_trial, res, seed, t,
                          base / f"t{t}", prot)
        finally:
            prot.off()


def _perm_trial(res: Result, seed: int, t: int, d: Path, prot: _Protect) -> None:
    rng = trial_rng(seed, t, "perm")
    where_i = rng.randrange(len(_PERM_WHERE))
    n = rng.choice([1 << 10, 8 << 10, 32 << 10])
    surface = rng.choice(["handle", "wait", "next", "step"])
    where = f"permission_denied ({prot.how}) seed {seed} trial {t} ({_PERM_WHERE[where_i]}, " \
            f"errors by {surface})"
    words = ("Permission denied", "Operation not permitted", "EACCES", "EPERM")
    mgr = _open(d, writer_threads=rng.choice([1, 2]), keep_last=rng.choice([None, 2]))
    saves = _Saves(res, where, words)
    n_of: dict[int, int] = {}
    step = 0
    for _ in range(rng.randint(1, 3)):
        n_of[step] = n
        saves.save(mgr, step, state_of(seed, step, n), "handle")
        step += 1
    before = committed_on_disk(d)

    def at_commit(_step: int) -> None:
        if prot.done:
            return  # once: the save after it must meet the directory as it is then
        if where_i == 1:
            prot.on(d)
        else:
            tmp = [e for e in os.listdir(d) if e.startswith(".tmp-")]
            prot.on(d / tmp[0])

    if where_i == 0:
        prot.on(d)
    elif where_i in (1, 2):
        mgr.hooks["before_commit"] = at_commit
    else:
        prot.on(d / ".pitstop")
    bad = step
    n_of[bad] = n
    saves.save(mgr, bad, state_of(seed, bad, n), surface)
    if surface in ("next", "step"):
        n_of[bad + 1] = n
        saves.save(mgr, bad + 1, state_of(seed, bad + 1, n), surface)
    failed = saves.settle(mgr)
    mgr.hooks.pop("before_commit", None)
    n_of = {s: n_of[s] for s in saves.handles}
    if where_i == 3:
        # only the index is refused: the save commits; retention and the index catch up later
        if failed:
            res.fail(f"{where}: an unwritable index failed the save of {failed}")
        else:
            res.bump("index_refused_saves_committed")
    elif bad not in failed:
        res.fail(f"{where}: the save into an unwritable directory did not fail")
    else:
        res.bump("failed_saves", len(failed))
    gone = [s for s in before if s not in committed_on_disk(d) and not mgr.retention]
    if gone:
        res.fail(f"{where}: committed step(s) {gone} vanished")
    for p in check_all_exact(d, seed, n_of):
        res.fail(f"{where}: {p}")
    prot.off()
    # the abort could not remove a temporary inside an unwritable directory; the next
    # writer to open the directory does
    if leftovers(d):
        res.bump("temporaries_until_reopen")
    nxt = max(n_of) + 1
    n_of[nxt] = n
    try:
        if not mgr.save(nxt, state_of(seed, nxt, n)).result(timeout=120).committed:
            res.fail(f"{where}: with permissions back, save({nxt}) did not commit")
        else:
            res.bump("commits_after_restore")
    except pitstop.CheckpointError as e:
        res.fail(f"{where}: with permissions back, save({nxt}) failed: {e}")
    mgr.close()
    _open(d).close()  # the next writer
    _after(res, where, d, seed, n_of, failed)


_PERM_CHILD = """
import json, sys
from pathlib import Path
from benchmarks.reliability import Result
from benchmarks.reliability.faults import _perm_trials
from benchmarks.reliability._faultkit import quiet_pitstop
first, last, seed, base = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
res = Result("permission_denied")
with quiet_pitstop():
    _perm_trials(res, range(first, last), seed, base, "chmod")
print(json.dumps(res.__dict__), flush=True)
"""


def _perm_child(res: Result, ts: range, seed: int) -> None:
    """Trials in a child that dropped to uid 65534 (nobody), where chmod is enough; in a
    directory of /tmp, since the workdir's parents may be closed to other users."""
    base = Path(tempfile.mkdtemp(prefix="pitstop-perm-"))
    os.chmod(base, 0o755)
    os.chown(base, 65534, 65534)
    try:
        proc = spawn(_PERM_CHILD, str(ts.start), str(ts.stop), str(seed), str(base),
                     user=65534)
    except OSError as e:
        shutil.rmtree(base, ignore_errors=True)
        res.details.append(f"permission_denied: no unprivileged child ({e}): nothing ran")
        return
    try:
        doc = read_json_line(proc, timeout=600)
    except (ChildDied, TimeoutError) as e:
        res.trials += len(ts)
        res.fail(f"permission_denied (uid 65534) seed {seed}: the child failed: {e}")
        return
    finally:
        end(proc)
        shutil.rmtree(base, ignore_errors=True)
    res.trials += doc["trials"]
    res.failures += doc["failures"]
    res.details += doc["details"]
    for k, v in doc["counts"].items():
        res.bump(k, v)
    res.bump("uid65534_trials", len(ts))


# ====================================================================== I/O errors
_ERRNOS = (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_WRITE_POINTS = ("begin", "write", "close", "commit", "commit-after", "meta", "delete")


class FaultyStorage(LocalStorage):
    """A LocalStorage that raises ``OSError(code)`` at the ``nth`` call of ``point`` (once),
    after doing the real work where the point is "after" it (``commit-after``)."""

    def __init__(self, location: str) -> None:
        super().__init__(location, durable=True)
        self.point: str | None = None
        self.nth = 0
        self.code = errno.EIO
        self.calls = 0
        self.fired = 0

    def arm(self, point: str, nth: int, code: int) -> None:
        self.point, self.nth, self.code, self.calls = point, nth, code, 0

    def hit(self, point: str) -> None:
        if self.point != point:
            return
        self.calls += 1
        if self.calls == self.nth:
            self.point = None
            self.fired += 1
            raise OSError(self.code, f"{os.strerror(self.code)} (injected at {point})")

    # -- writes
    def begin(self, name: str) -> Transaction:
        self.hit("begin")
        return _FaultyTxn(self, super().begin(name))

    def write_meta(self, relpath: str, data: bytes, *, durable: bool = True) -> None:
        self.hit("meta")
        super().write_meta(relpath, data, durable=durable)

    def delete_if_unread(self, name: str) -> bool:
        self.hit("delete")
        return super().delete_if_unread(name)

    # -- reads (the descriptor path is declined so every read goes through read_into)
    def open_reader(self, name: str, relpath: str) -> int:
        if self.point == "read":
            raise OSError(errno.ENOTSUP, "reads go through read_into here")
        return super().open_reader(name, relpath)

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        self.hit("read")
        return super().read_into(name, relpath, offset, out)

    def read_bytes(self, name: str, relpath: str) -> bytes:
        self.hit("read")
        return super().read_bytes(name, relpath)


class _FaultyTxn(Transaction):
    def __init__(self, storage: FaultyStorage, txn: Transaction) -> None:
        self.storage, self.txn = storage, txn
        self.name, self.location, self.token = txn.name, txn.location, txn.token

    def open_write(self, relpath: str, direct: bool = False) -> Writer:
        return _FaultyWriter(self.storage, self.txn.open_write(relpath, direct))

    def commit(self, manifest: bytes) -> None:
        self.storage.hit("commit")
        self.txn.commit(manifest)
        self.storage.hit("commit-after")

    def abort(self) -> None:
        self.txn.abort()


class _FaultyWriter(Writer):
    def __init__(self, storage: FaultyStorage, w: Writer) -> None:
        self.storage, self.w = storage, w
        self.direct = getattr(w, "direct", False)

    def write(self, data: Any) -> None:
        self.storage.hit("write")
        self.w.write(data)

    def close(self) -> None:
        try:
            self.storage.hit("close")
        except OSError:
            self.w.close()
            raise
        self.w.close()


def io_error(trials: int, seed: int, workdir: Path) -> Result:
    """EIO/ENOSPC/EDQUOT/EROFS at a random call of the storage layer: a save fails clearly
    (or commits, where only the index or retention met it), a restore raises a
    CheckpointError and moves nothing aside; committed checkpoints stay exact."""
    res = Result("io_error")
    with quiet_pitstop():
        for t in range(trials):
            counted_trial(res, "io_error", seed, t, _io_trial, res, seed, t, workdir / f"io_{t}")
    return res


def _io_trial(res: Result, seed: int, t: int, d: Path) -> None:
    rng = trial_rng(seed, t, "io")
    point = rng.choice(_WRITE_POINTS + ("read", "read"))
    code = rng.choice(_ERRNOS) if point != "read" else errno.EIO
    n = rng.choice([1 << 10, 16 << 10, 300 << 10])  # the largest is written in several chunks
    threads = rng.choice([1, 2, 4])
    surface = rng.choice(["handle", "wait", "next", "step"])
    nth = {"write": rng.randint(1, threads * 2), "close": rng.randint(1, threads),
           "meta": 1, "delete": 1, "read": rng.randint(1, 4)}.get(point, 1)
    where = (f"io_error seed {seed} trial {t} ({errno.errorcode[code]} at the {nth}. {point}, "
             f"errors by {surface})")
    storage = FaultyStorage(str(d))
    mgr = _open(storage, writer_threads=threads, keep_last=2 if point == "delete" else None,
                compression=rng.choice([None, None, "zstd"]))
    words = (os.strerror(code), errno.errorcode[code])
    saves = _Saves(res, where, words)
    n_of: dict[int, int] = {}
    try:
        for s in range(3):
            n_of[s] = n
            saves.save(mgr, s, state_of(seed, s, n), "handle")
        if saves.settle(mgr):
            res.fail(f"{where}: a save failed before any fault was armed")
            return
        if point == "read":
            _io_read(res, where, mgr, storage, nth, seed, n_of)
            return
        storage.arm(point, nth, code)
        bad = 3
        n_of[bad] = n
        saves.save(mgr, bad, state_of(seed, bad, n), surface)
        if surface in ("next", "step"):
            n_of[bad + 1] = n
            saves.save(mgr, bad + 1, state_of(seed, bad + 1, n), surface)
        failed = saves.settle(mgr)
        storage.point = None  # not reached (fewer calls than nth): disarmed all the same
        if not storage.fired:
            res.bump("fault_not_reached")  # e.g. fewer writes than nth: not a broken promise
        elif point in ("meta", "delete"):
            # bookkeeping after a commit: never the save's failure
            if failed:
                res.fail(f"{where}: a failure after the commit failed the save of {failed}")
            else:
                res.bump("bookkeeping_faults_absorbed")
        elif not failed:
            # (with errors by "next", the n-th call may be in the save after ``bad``)
            res.fail(f"{where}: the injected error failed no save")
        else:
            res.bump("failed_saves", len(failed))
        if point == "commit-after":
            # the checkpoint was published before the error: an unknown outcome for the
            # caller, but what is there must be whole
            published = [s for s in failed if s in committed_on_disk(d)]
            res.bump("published_despite_error", len(published))
            failed = [s for s in failed if s not in published]
        _after(res, where, d, seed, n_of, failed)
        nxt = max(n_of) + 1
        n_of[nxt] = n
        if mgr.save(nxt, state_of(seed, nxt, n)).result(timeout=120).committed:
            res.bump("commits_after_fault")
        target = target_of(n)
        got = mgr.restore(target)
        if got != nxt or diff(target, state_of(seed, nxt, n)):
            res.fail(f"{where}: restore after the fault gave step {got}, not an exact {nxt}")
    finally:
        storage.point = None
        try:
            mgr.close()
        except pitstop.CheckpointError as e:
            res.fail(f"{where}: close() raised {e}")
    _after(res, where, d, seed, n_of, [])


def _io_read(res: Result, where: str, mgr: pitstop.CheckpointManager, storage: FaultyStorage,
             nth: int, seed: int, n_of: dict[int, int]) -> None:
    """A read error during restore or load: a CheckpointError, nothing moved aside, and a
    retry restores exactly."""
    newest = max(n_of)
    n = n_of[newest]
    before = committed_on_disk(Path(storage.location))
    call = trial_rng(seed, nth, where).choice(["restore", "load", "restore-step"])
    storage.arm("read", nth, errno.EIO)
    target = target_of(n)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if call == "restore":
                got: Any = mgr.restore(target)
            elif call == "load":
                got = mgr.load()
            else:
                got = mgr.restore(target, step=newest)
        if storage.fired:
            res.fail(f"{where}: {call} met an injected EIO and returned {got!r}"
                     if not isinstance(got, dict) else f"{where}: load met an EIO and returned")
        else:
            res.bump("fault_not_reached")
    except pitstop.CorruptCheckpointError as e:
        res.fail(f"{where}: an I/O error during {call} was called corruption: {e}")
    except pitstop.CheckpointError as e:
        if "Input/output error" not in str(e) and "EIO" not in str(e):
            res.fail(f"{where}: the error of {call} does not say why: {e}")
        elif getattr(e, "overwritten", None) and "overwritten" not in str(e):
            res.fail(f"{where}: {call} overwrote {getattr(e, 'overwritten', None)} and does "
                     f"not say so: {e}")
        else:
            res.bump("read_errors_raised")
    except Exception as e:  # noqa: BLE001
        res.fail(f"{where}: {call} raised {type(e).__name__}: {e}")
    storage.point = None
    after = committed_on_disk(Path(storage.location))
    if after != before:
        res.fail(f"{where}: a read error changed the checkpoints: {before} -> {after}")
    target = target_of(n)
    got = mgr.restore(target)
    if got != newest or diff(target, state_of(seed, newest, n)):
        res.fail(f"{where}: the retry restored {got}, not an exact {newest}")


# ====================================================================== full /dev/shm
def full_shm(trials: int, seed: int, workdir: Path) -> Result:
    """The memory tier on a tmpfs that is too small, or filled by another program before a
    save or during a persist: every save commits, one warning per manager, nothing lost,
    no tier file left after close."""
    res = Result("full_shm")
    with tmpfs(workdir / "shm_probe", "64k") as mounted:
        pass
    if not mounted:
        res.details.append("full_shm: no tmpfs can be mounted here (not root?): nothing ran")
        return res
    with quiet_pitstop() as log:
        for t in range(trials):
            counted_trial(res, "full_shm", seed, t, _shm_trial, res, seed, t,
                          workdir / f"shm_{t}", log)
    return res


def _shm_trial(res: Result, seed: int, t: int, base: Path, log: Any) -> None:
    rng = trial_rng(seed, t, "shm")
    sizes = [rng.choice([4 << 10, 32 << 10, 96 << 10, 200 << 10]) for _ in range(6)]
    tier_kib = rng.choice([256, 512, 1024, 2048])
    fill_at = rng.randrange(len(sizes) + 1)  # len(sizes): never filled (only too small)
    during = rng.random() < 0.5
    where = (f"full_shm seed {seed} trial {t} (tier {tier_kib} KiB, states "
             f"{[state_bytes(n) >> 10 for n in sizes]} KiB, filled "
             f"{'during' if during else 'before'} save {fill_at})")
    mnt = base / "tier"
    with tmpfs(mnt, f"{tier_kib}k") as ok:
        if not ok:
            res.fail(f"{where}: cannot mount a tmpfs here")
            return
        d = base / "run"
        filler = mnt / "other-program"
        first = len(log.records)
        warned = len(log.warned)
        mgr = _open(d, memory_tier=str(mnt), max_in_flight=rng.choice([1, 2]),
                    keep_last=rng.choice([None, 2]))

        def fill(_step: int = 0) -> None:
            mgr.hooks.pop("before_persist", None)  # once
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass  # full

        n_of: dict[int, int] = {}
        filled = False
        try:
            for s, n in enumerate(sizes):
                if s == fill_at and not filled:
                    filled = True
                    if during:
                        mgr.hooks["before_persist"] = fill
                    else:
                        fill()
                n_of[s] = n
                try:
                    stats = mgr.save(s, state_of(seed, s, n)).result(timeout=120)
                except pitstop.CheckpointError as e:
                    res.fail(f"{where}: save({s}) failed: {e}")
                    continue
                if not stats.committed:
                    res.fail(f"{where}: save({s}) did not commit")
            target = target_of(sizes[-1])
            got = mgr.restore(target)
            last = len(sizes) - 1
            if got != last or diff(target, state_of(seed, last, sizes[-1])):
                res.fail(f"{where}: restore gave {got}, not an exact {last}")
        finally:
            mgr.close()
        tier_warnings = [r for r in log.records[first:]
                         if r.levelno >= 30 and "memory tier" in r.getMessage()]
        user_warnings = [w for w in log.warned[warned:] if "memory tier" in str(w.message)]
        if tier_warnings:
            res.bump("tier_stepped_aside")
        if len(tier_warnings) > 1 or len(user_warnings) > 1:
            res.fail(f"{where}: {len(tier_warnings)} log warnings and {len(user_warnings)} "
                     "warnings about the memory tier, not one: "
                     + " | ".join(r.getMessage()[:120] for r in tier_warnings[:4]))
        left = [e for e in os.listdir(mnt) if e != filler.name]
        if left:
            res.fail(f"{where}: tier files left after close: {left}")
        if filled:
            res.bump("tier_filled")
        for p in check_all_exact(d, seed, n_of):
            res.fail(f"{where}: {p}")


SCENARIOS: dict[str, Scenario] = {
    "full_disk": full_disk,
    "permission_denied": permission_denied,
    "io_error": io_error,
    "full_shm": full_shm,
}
