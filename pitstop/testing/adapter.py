"""``AdapterSuite``: the battery every face of pitstop (and a third-party adapter) passes.

A framework's test module subclasses it and fills in the hooks; pytest collects the
subclass's ``test_*`` methods. The battery uses pitstop's public API only: what it proves
holds for any user of that face.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pitstop
from pitstop.core.storage import LocalStorage
from pitstop.testing import _job
from pitstop.testing._bits import Bits, differences, fingerprint

#: environment variable that fixes the SIGKILL test's random step (the failing run's seed)
SEED_VARIABLE = "PITSTOP_CONFORMANCE_SEED"


class AdapterSuite:
    """The conformance battery. Subclass it as ``Test<Face>Conformance`` and fill in:

    * :meth:`make_state` — a fresh training state, the same values on every call;
    * :meth:`train_step` — one deterministic training step, in place; returns the loss;
    * :meth:`leaf_examples` — every leaf kind the face supports, values chosen by ``seed``;
    * :meth:`wrong_shape_target` — a state like :meth:`make_state` with one array of
      another shape;
    * :meth:`to_host` — framework objects as numpy arrays, values or :class:`Bits`.

    Optional: :meth:`manager_options`, :attr:`incompatible_errors`, :attr:`kill_steps`.
    """

    #: what a refused restore raises (a face may document a subclass of its own)
    incompatible_errors: ClassVar[tuple[type[BaseException], ...]] = (
        pitstop.IncompatibleTargetError,)
    #: steps of the SIGKILL test's job (it is killed at a random one of them)
    kill_steps: ClassVar[int] = 8
    #: seconds a child job may take
    job_timeout: ClassVar[float] = 300.0

    # -- hooks ---------------------------------------------------------------------------

    def make_state(self) -> dict[str, Any]:
        """A fresh training state (model, optimizer, RNG, ...): equal values on every call,
        in every process (seed each generator it holds, the global ones of a
        ``pitstop.RNG()`` too)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_state()")

    def train_step(self, state: dict[str, Any], step: int) -> float:
        """One training step of ``state``, in place (JAX: replace its entries); the loss.
        Deterministic: only ``state`` (its RNG included) decides the result."""
        raise NotImplementedError(f"{type(self).__name__} must define train_step()")

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        """``{name: leaf}``, one entry per leaf kind the face supports (dtypes, 0-d, empty,
        views, scalars, Python values, RNG). The same structure for every ``seed``; the
        values differ between seeds."""
        raise NotImplementedError(f"{type(self).__name__} must define leaf_examples()")

    def wrong_shape_target(self) -> dict[str, Any]:
        """A state like :meth:`make_state` in which one array has another shape."""
        raise NotImplementedError(f"{type(self).__name__} must define wrong_shape_target()")

    def to_host(self, obj: Any) -> Any:
        """``obj`` as numpy arrays, Python values, containers of them or :class:`Bits`
        (a copy); ``NotImplemented`` for objects the generic walk reads itself (numpy,
        Python values and generators, containers, objects with ``state_dict()``)."""
        return NotImplemented

    def manager_options(self) -> dict[str, Any]:
        """Options of every manager the battery opens (the child job's too)."""
        return {"durable": False, "memory_tier": False}

    # -- helpers -------------------------------------------------------------------------

    def fingerprint(self, state: Any) -> dict[str, Bits]:
        """``{path: Bits}``: a bitwise copy of everything ``state`` holds."""
        return fingerprint(state, self.to_host)

    def assert_same(self, expected: dict[str, Any], actual: dict[str, Any], what: str) -> None:
        diff = differences(expected, actual)
        assert not diff, f"{type(self).__name__}: {what}:\n  " + "\n  ".join(diff)

    def manager(self, directory: Any, **options: Any) -> pitstop.CheckpointManager:
        return pitstop.CheckpointManager(
            directory, **{"save_on_signals": None, **self.manager_options(), **options})

    def _trained(self, steps: int) -> tuple[dict[str, Any], list[dict[str, Bits]]]:
        state = self.make_state()
        prints = []
        for step in range(steps):
            self.train_step(state, step)
            prints.append(self.fingerprint(state))
        return state, prints

    # -- the battery ---------------------------------------------------------------------

    def test_every_leaf_kind_round_trips_bitwise(self, tmp_path: Path) -> None:
        saved, target = self.leaf_examples(1), self.leaf_examples(2)
        expected, before = self.fingerprint(saved), self.fingerprint(target)
        assert set(expected) == set(before), \
            "leaf_examples(seed) must give the same structure for every seed"
        same = []  # a leaf with no bytes (an empty array) cannot differ
        for k in saved:
            one, two = self.fingerprint({k: saved[k]}), self.fingerprint({k: target[k]})
            if one == two and any(b.data for b in one.values()):
                same.append(k)
        assert not same, f"leaf_examples(1) and (2) must differ in every leaf; equal: {same}"
        with self.manager(tmp_path / "ckpt") as mgr:
            mgr.save(0, saved).wait()
            assert mgr.restore(target) == 0
        self.assert_same(expected, self.fingerprint(target), "a restored leaf differs")

    def test_sigkill_resumes_exactly(self, tmp_path: Path) -> None:
        seed = int(os.environ.get(SEED_VARIABLE) or random.randrange(2**32))
        steps = self.kill_steps
        kill_at = random.Random(seed).randrange(1, steps - 1)
        why = f"(killed after step {kill_at}; {SEED_VARIABLE}={seed} repeats this run)"
        file, name = inspect.getfile(type(self)), type(self).__qualname__
        jobs = {}
        for run in ("reference", "killed"):
            (tmp_path / run).mkdir()
            log = tmp_path / f"{run}.stderr"
            jobs[run] = _job.Output(_job.start(  # the killed one waits at kill_at, its
                file, name, tmp_path / run / "ckpt", steps, log,  # save persisting
                pause_at=kill_at if run == "killed" else -1), log)
        killed, reference = jobs["killed"], jobs["reference"]
        try:
            reached = killed.read_until(kill_at, self.job_timeout)
            assert reached, f"the job ended before step {kill_at}: {killed.stderr()}"
            os.killpg(killed.proc.pid, signal.SIGKILL)
            assert killed.proc.wait(timeout=self.job_timeout) == -signal.SIGKILL
            log = tmp_path / "resumed.stderr"  # while the reference run goes on
            jobs["resumed"] = resumed = _job.Output(
                _job.start(file, name, tmp_path / "killed" / "ckpt", steps, log), log)
            codes = {run: jobs[run].finish(self.job_timeout) for run in ("reference", "resumed")}
        finally:
            for job in jobs.values():
                if job.proc.poll() is None:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                    job.proc.wait()
                for pipe in (job.proc.stdin, job.proc.stdout):
                    if pipe is not None:
                        pipe.close()
        assert codes["reference"] == 0 and reference.final is not None, \
            f"the uninterrupted job failed ({codes['reference']}): {reference.stderr()}"
        assert codes["resumed"] == 0 and resumed.final is not None, \
            f"the resumed job failed ({codes['resumed']}) {why}: {resumed.stderr()}"
        assert resumed.start in (kill_at - 1, kill_at), \
            f"the resumed job restored step {resumed.start!r} {why}"
        for label, job in (("killed", killed), ("resumed", resumed)):
            wrong = {s: (loss, reference.losses.get(s)) for s, loss in job.losses.items()
                     if loss != reference.losses.get(s)}
            assert not wrong, f"{label} job's losses differ {why}: {wrong}"
        assert sorted(resumed.losses) == list(range(resumed.start + 1, steps)), \
            f"the resumed job trained steps {sorted(resumed.losses)} {why}"
        self.assert_same(reference.final, resumed.final,
                         f"the resumed job's final state differs {why}")

    def test_corrupt_newest_falls_back_to_the_previous_one(self, tmp_path: Path) -> None:
        state = self.make_state()
        prints = []
        with self.manager(tmp_path / "ckpt") as mgr:
            for step in range(2):
                self.train_step(state, step)
                prints.append(self.fingerprint(state))
                path = mgr.save(step, state).result().path
            entries = [e for e in mgr.metadata(1).arrays.values() if e.length > 0]
        assert entries, "the state holds no array with bytes to corrupt"
        entry = max(entries, key=lambda e: e.length)
        with open(os.path.join(path, entry.file), "r+b") as f:  # one bit flipped on disk
            f.seek(entry.offset + entry.length // 2)
            byte = f.read(1)[0]
            f.seek(entry.offset + entry.length // 2)
            f.write(bytes([byte ^ 0x10]))
        target = self.make_state()
        with warnings.catch_warnings(record=True) as caught, \
                self.manager(tmp_path / "ckpt") as mgr:
            warnings.simplefilter("always")
            restored = mgr.restore(target)
        assert restored == 0, f"restored step {restored}, not the previous one (0)"
        said = [str(w.message) for w in caught if "corrupt" in str(w.message)]
        assert said, f"no warning named the corrupt checkpoint: {[str(w.message) for w in caught]}"
        self.assert_same(prints[0], self.fingerprint(target), "the fallback restore differs")

    def test_stop_signal_saves_at_the_next_step_boundary(self, tmp_path: Path) -> None:
        assert threading.current_thread() is threading.main_thread(), \
            "signals are handled on the main thread only"
        handed_on: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: handed_on.append(signum))
        try:
            state = self.make_state()
            mgr = self.manager(tmp_path / "ckpt", save_on_signals=("SIGTERM",),
                               save_policy=pitstop.OnSteps(()))
            for step in range(4):  # no save policy: only the signal saves
                self.train_step(state, step)
                if step == 2:
                    expected = self.fingerprint(state)
                    signal.raise_signal(signal.SIGTERM)
                    assert not handed_on, "the signal reached the old handler before a save"
                mgr.step(step, state)
                if handed_on:
                    break
            mgr.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert handed_on == [signal.SIGTERM], "pitstop did not hand SIGTERM on after its save"
        assert step == 2, f"training went on to step {step} after the signal"
        with self.manager(tmp_path / "ckpt", read_only=True) as reader:
            assert reader.all_steps() == [2]
            target = self.make_state()
            assert reader.restore(target) == 2
        self.assert_same(expected, self.fingerprint(target), "the signal's checkpoint differs")

    def test_skipped_save_is_visible(self, tmp_path: Path, caplog: Any) -> None:
        storage = _HeldStorage(str(tmp_path / "ckpt"))
        state = self.make_state()
        with caplog.at_level(logging.WARNING, logger="pitstop"), \
                self.manager(storage, save_every_steps=1, on_busy="skip", max_in_flight=1,
                             async_save=True) as mgr:
            try:
                self.train_step(state, 0)
                first = mgr.step(0, state)
                assert first is not None and storage.entered.wait(60), "step 0 was not saved"
                self.train_step(state, 1)
                skipped = mgr.step(1, state)  # step 0's persist is held: no buffer is free
            finally:
                storage.release.set()
            first.wait()
            assert skipped is None or skipped.result().skipped, \
                "a save due while the only buffer persists was not skipped"
            assert mgr.skipped_saves == 1 and mgr.skipped_steps == [1], \
                (mgr.skipped_saves, mgr.skipped_steps)
            self.train_step(state, 2)
            later = mgr.step(2, state)
            assert later is not None
            assert later.result().skipped_before == 1
            assert mgr.all_steps() == [0, 2]
        assert any("skip" in r.getMessage() for r in caplog.records), \
            "the skipped save was not warned about"

    def test_wrong_target_is_refused_before_any_byte_changes(self, tmp_path: Path) -> None:
        state, _ = self._trained(1)
        with self.manager(tmp_path / "ckpt") as mgr:
            mgr.save(0, state).wait()
            missing = self.make_state()
            missing.pop(list(missing)[-1])
            unexpected = {**self.make_state(), "conformance_extra": [1, 2, 3]}
            targets = {"another shape": self.wrong_shape_target(),
                       "a missing entry": missing, "an unexpected entry": unexpected}
            for what, target in targets.items():
                before = self.fingerprint(target)
                try:
                    mgr.restore(target)
                except self.incompatible_errors:
                    pass
                else:
                    raise AssertionError(f"a restore into {what} was not refused")
                self.assert_same(before, self.fingerprint(target),
                                 f"a refused restore into {what} changed the target")


class _HeldStorage(LocalStorage):
    """A local directory whose saves wait, once, before writing: a persist held until
    ``release`` is set."""

    def __init__(self, location: str) -> None:
        super().__init__(location, durable=False)
        self.entered, self.release = threading.Event(), threading.Event()

    def begin(self, name: str) -> Any:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(60)
        return super().begin(name)
