"""Corruption torture: random damage to a directory of real checkpoints, then every way to read it.

A template directory is made once per run: four checkpoints of a state with several arrays
(float32, float64, float16, bool, int64, a larger uint8 one), JSON values and an index; step
3 is compressed (``zstd+shuffle``). Each trial copies it and applies one random damage:

``bitflip_data`` / ``bitflip_manifest``  one bit flipped anywhere in the file
``truncate``                             a data file or the manifest cut short
``zero_block``                           512 B - 64 KiB of a data file overwritten with zeros
``delete_file``                          a data file or the manifest deleted
``extra_file``                           a stray file in a checkpoint, the run directory or
                                         ``.pitstop``, or a checkpoint copied under another
                                         step's name
``swap``                                 the same file exchanged between two checkpoints
``manifest_edit``                        one manifest field edited (its ``manifest_hash`` left)
``manifest_edit_resealed``               one field of the array table, the file table, the
                                         step or the format edited and ``manifest_hash``
                                         recomputed (:func:`pitstop.core.format.seal.seal`)
``index_edit``                           ``.pitstop/index.json`` edited, garbage, or deleted

Then a read-only manager restores and loads the damaged checkpoint by step, loads the latest,
and ``verify()`` reads every checkpoint; a writing manager restores the latest (falling back,
moving a corrupt one aside) and the damaged step again. Each outcome must be the exact state
of the step asked for (of some saved step for "latest", never older than the newest
undamaged one), or a :class:`CheckpointError` that names the checkpoint and, for damage to a
data file, the file and an array it holds. A wrong value, any other exception or a hang
(> 60 s) is a failure. A damage nothing reads (padding, a stray file, the index) may go
unnoticed: the trial counts as ``harmless`` only when every value read back was exact.

What a re-sealed edit may change is limited to what a manifest's own checks can catch: a
manifest whose hash was recomputed after editing its JSON values, its structure or an
array's dtype to another of the same size is, byte for byte, one pitstop could have written;
only an authenticated manifest (``docs/encryption.md``) tells such an edit apart.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import pitstop
from pitstop.core.errors import CheckpointError
from pitstop.core.format.seal import seal
from pitstop.core.restore.read import CheckpointReader

from . import Result

STEPS = (1, 2, 3, 4)
COMPRESSED = 3
FULL_TRIALS = 200
HANG_S = 60.0
KINDS = ("bitflip_data", "bitflip_manifest", "truncate", "zero_block", "delete_file",
         "extra_file", "swap", "manifest_edit", "manifest_edit_resealed", "index_edit")


def state_of(step: int) -> dict[str, Any]:
    """What step ``step`` saves: arrays of several dtypes and JSON values, all from the step."""
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal((96, 64)).astype("f4"),
                  "b": rng.standard_normal(64)},
        "big": rng.integers(0, 255, 1 << 18, dtype=np.uint8),
        "half": rng.standard_normal(100).astype("f2"),
        "mask": rng.random(333) > 0.5,
        "count": rng.integers(0, 1 << 40, 3000),
        "meta": {"step": step, "name": f"run-{step}", "lr": 0.1 / (step + 1),
                 "history": [step, str(step)]},
    }


def blank() -> dict[str, Any]:
    s = state_of(0)
    for a in (s["model"]["w"], s["model"]["b"], s["big"], s["half"], s["mask"], s["count"]):
        a[...] = 0
    s["meta"] = {"step": -1, "name": "", "lr": 0.0, "history": [0, ""]}
    return s


def differs(got: Any, want: Any, path: str = "") -> str | None:
    """Where ``got`` is not bit-identical to ``want`` (None when it is)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{path or 'state'}: keys {sorted(got) if isinstance(got, dict) else got!r}"
        for k in want:
            why = differs(got[k], want[k], f"{path}/{k}" if path else k)
            if why:
                return why
        return None
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or \
                got.shape != want.shape or got.tobytes() != want.tobytes():
            return f"{path}: array differs"
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            why = differs(g, w, f"{path}/{i}")
            if why:
                return why
        return None
    if type(got) is not type(want) or got != want:
        return f"{path}: {got!r} != {want!r}"
    return None


def make_template(d: Path) -> None:
    """Four real checkpoints; step 3 compressed."""
    kw: dict[str, Any] = {"memory_tier": False, "save_on_signals": None, "writer_threads": 3}
    with pitstop.CheckpointManager(d, **kw) as m:
        m.save(1, state_of(1), metrics={"loss": 1.0})
        m.save(2, state_of(2), metrics={"loss": 0.5})
    with pitstop.CheckpointManager(d, compression="zstd+shuffle", **kw) as m:
        m.save(3, state_of(3), metrics={"loss": 0.25})
    with pitstop.CheckpointManager(d, **kw) as m:
        m.save(4, state_of(4), metrics={"loss": 0.125})


@dataclass
class Damage:
    """What one trial did: the kind, the checkpoints it touched, and what an error about
    them must name."""

    kind: str
    what: str
    touched: set[int] = field(default_factory=set)
    #: checkpoint step -> (file, arrays whose bytes changed); an error reading that step
    #: must name the file and one of those arrays (file None: the manifest)
    expect: dict[int, tuple[str | None, set[str]]] = field(default_factory=dict)
    #: steps whose manifest was deleted: no longer checkpoints at all, passed over silently
    gone: set[int] = field(default_factory=set)


def name(step: int) -> str:
    return f"step_{step:010d}"


def data_files(d: Path, step: int) -> list[str]:
    return sorted(f for f in os.listdir(d / name(step)) if f.startswith("data-"))


def manifest_of(d: Path, step: int) -> dict[str, Any]:
    return json.loads((d / name(step) / "manifest.json").read_bytes())


def arrays_hit(d: Path, step: int, fname: str, lo: int, hi: int) -> set[str]:
    """The arrays of ``step`` stored in ``fname`` whose bytes overlap ``[lo, hi)``."""
    out = set()
    for key, e in manifest_of(d, step)["arrays"].items():
        if e["file"] == fname and e["offset"] < hi and lo < e["offset"] + e["length"]:
            out.add(key)
    return out


def damage(d: Path, kind: str, rng: random.Random) -> Damage:
    """Apply one damage of ``kind`` to the copy ``d``."""
    step = rng.choice(STEPS)
    ck = d / name(step)
    if kind in ("bitflip_data", "truncate", "zero_block") or \
            (kind == "delete_file" and rng.random() < 0.75):
        fname = rng.choice(data_files(d, step))
        if kind == "truncate" and rng.random() < 0.2:
            fname = "manifest.json"
        path = ck / fname
        data = bytearray(path.read_bytes())
        if kind == "bitflip_data":
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            return Damage(kind, f"{name(step)}/{fname}: bit flipped at byte {at}", {step},
                          {step: (fname, arrays_hit(d, step, fname, at, at + 1))})
        if kind == "truncate":
            keep = rng.randrange(len(data))
            hit = arrays_hit(d, step, fname, keep, len(data)) if fname != "manifest.json" \
                else set()
            os.truncate(path, keep)
            return Damage(kind, f"{name(step)}/{fname}: cut to {keep} of {len(data)} bytes",
                          {step}, {step: (None if fname == "manifest.json" else fname, hit)})
        if kind == "zero_block":
            n = rng.choice((512, 4096, 65536))
            at = rng.randrange(max(1, len(data) - n))
            data[at:at + n] = bytes(len(data[at:at + n]))
            path.write_bytes(bytes(data))
            return Damage(kind, f"{name(step)}/{fname}: {n} bytes zeroed at {at}", {step},
                          {step: (fname, arrays_hit(d, step, fname, at, at + n))})
        hit = arrays_hit(d, step, fname, 0, 1 << 62)
        path.unlink()
        return Damage(kind, f"{name(step)}/{fname} deleted", {step}, {step: (fname, hit)})
    if kind == "delete_file":
        (ck / "manifest.json").unlink()
        return Damage(kind, f"{name(step)}/manifest.json deleted", {step}, {step: (None, set())},
                      gone={step})
    if kind == "bitflip_manifest":
        path = ck / "manifest.json"
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return Damage(kind, f"{name(step)}/manifest.json: bit flipped at byte {at}", {step},
                      {step: (None, set())})
    if kind == "extra_file":
        return extra_file(d, step, rng)
    if kind == "swap":
        other = rng.choice([s for s in STEPS if s != step])
        common = sorted(set(os.listdir(ck)) & set(os.listdir(d / name(other))))
        fname = rng.choice(common)
        a, b = ck / fname, d / name(other) / fname
        tmp = d / "swap.tmp"
        os.rename(a, tmp)
        os.rename(b, a)
        os.rename(tmp, b)
        f = None if fname == "manifest.json" else fname
        return Damage(kind, f"{fname} exchanged between {name(step)} and {name(other)}",
                      {step, other}, {step: (f, arrays_hit(d, step, fname, 0, 1 << 62)
                                             if f else set()),
                                      other: (f, arrays_hit(d, other, fname, 0, 1 << 62)
                                              if f else set())})
    if kind in ("manifest_edit", "manifest_edit_resealed"):
        return edit_manifest(d, step, rng, resealed=kind.endswith("resealed"))
    return edit_index(d, rng)


def extra_file(d: Path, step: int, rng: random.Random) -> Damage:
    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000)))
    where = rng.randrange(4)
    if where == 0:
        fname = rng.choice(("data-007.bin", "notes.txt", "manifest.json.bak"))
        (d / name(step) / fname).write_bytes(junk)
        return Damage("extra_file", f"{name(step)}/{fname} added", set())
    if where == 1:
        fname = rng.choice(("README", "step_0000000009", "step_5", ".tmp-x"))
        (d / fname).write_bytes(junk)
        return Damage("extra_file", f"{fname} added to the run directory", set())
    if where == 2:
        (d / ".pitstop" / "stray.json").write_bytes(junk)
        return Damage("extra_file", ".pitstop/stray.json added", set())
    # a checkpoint copied in under another (newer) step's name: must never restore as it
    shutil.copytree(d / name(step), d / name(9))
    return Damage("extra_file", f"{name(step)} copied to {name(9)}", {9}, {9: (None, set())})


def _any_path(doc: Any, rng: random.Random, skip: tuple[str, ...]) -> list[Any]:
    """A random path (list of keys) to a node of ``doc``, avoiding top-level ``skip``."""
    path: list[Any] = []
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) \
            if isinstance(node, list) else []
        if not path:
            keys = [k for k in keys if k not in skip]
        if not keys or (path and rng.random() < 0.3):
            return path
        k = rng.choice(keys)
        path.append(k)
        node = node[k]


def _mutant(value: Any, rng: random.Random) -> Any:
    """Something else where ``value`` was: another number, type or text."""
    choices: list[Callable[[], Any]] = [
        lambda: None, lambda: "garbage", lambda: [], lambda: {}, lambda: -1, lambda: 2**70,
        lambda: True, lambda: 1.5]
    if isinstance(value, int) and not isinstance(value, bool):
        choices += [lambda: value + rng.choice((-4096, -8, -1, 1, 8, 4096)), lambda: 0,
                    lambda: value * 2]
    if isinstance(value, str):
        choices += [lambda: value[:-1], lambda: value + "0",
                    lambda: value[::-1] if len(value) > 1 else value + "x"]
    if isinstance(value, list) and value:
        choices += [lambda: value[:-1], lambda: value + value[-1:]]
    while True:
        new = rng.choice(choices)()
        if new != value or type(new) is not type(value):
            return new


def edit_manifest(d: Path, step: int, rng: random.Random, resealed: bool) -> Damage:
    path = d / name(step) / "manifest.json"
    doc = json.loads(path.read_bytes())
    stale = doc.pop("manifest_hash", None)
    if resealed:
        # what only a manifest's own checks can catch: the array and file tables, the step,
        # the format (see the module's docstring for what is left out, and why)
        top = rng.choice(("arrays", "arrays", "arrays", "files", "step", "format_version",
                          "hash_algorithm", "format"))
        if top in ("arrays", "files"):
            key = rng.choice(sorted(doc[top]))
            entry = doc[top][key]
            field_ = rng.choice(sorted(entry))
            if field_ == "dtype":
                size = np.dtype(entry["dtype"]).itemsize
                entry[field_] = rng.choice(
                    [t for t in ("<f8", "|u1", "<f2", "<u4") if np.dtype(t).itemsize != size]
                    + ["garbage", "O", 3])
            elif field_ == "shape":
                entry[field_] = rng.choice(([1], entry[field_] + [2], [-1], "x",
                                            [n + 1 for n in entry[field_]] or [1]))
            elif rng.random() < 0.15:
                del entry[field_]
                field_ += " (removed)"
            else:
                entry[field_] = _mutant(entry[field_], rng)
            what = f"{top}.{key}.{field_} -> {str(entry.get(field_.split()[0]))[:40]}"
        else:
            doc[top] = _mutant(doc[top], rng)
            what = f"{top} -> {str(doc[top])[:40]}"
    else:
        keys = _any_path(doc, rng, ())
        what = "/".join(map(str, keys)) or "(whole)"
        if not keys:
            doc = {"not": "a manifest"}
        else:
            node = doc
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = _mutant(node[keys[-1]], rng)
            what += f" -> {str(node[keys[-1]])[:40]}"
    body = json.dumps(doc, separators=(",", ":")).encode()
    if resealed:
        algorithm = doc.get("hash_algorithm")
        body = seal(body, algorithm if algorithm in ("xxh3-128", "sha256") else "xxh3-128")
    elif stale is not None and rng.random() < 0.8:
        body = body[:-1] + b',"manifest_hash":"' + str(stale).encode() + b'"}'
    # (else: the edit without any manifest_hash)
    path.write_bytes(body)
    kind = "manifest_edit_resealed" if resealed else "manifest_edit"
    return Damage(kind, f"{name(step)}/manifest.json: {what} edited", {step},
                  {step: (None, set())})


def edit_index(d: Path, rng: random.Random) -> Damage:
    path = d / ".pitstop" / "index.json"
    how = rng.randrange(4)
    if how == 0:
        path.unlink()
        return Damage("index_edit", "index.json deleted")
    if how == 1:
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))))
        return Damage("index_edit", "index.json replaced by garbage")
    doc = json.loads(path.read_bytes())
    if how == 2:
        keys = _any_path(doc, rng, ())
        if keys:
            node = doc
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = _mutant(node[keys[-1]], rng)
        what = "/".join(map(str, keys))
    else:
        doc["checkpoints"].pop(rng.choice(sorted(doc["checkpoints"])), None)
        doc["checkpoints"]["99"] = {"metrics": {"loss": -1}, "ours": True, "all_finite": True,
                                    "protected": True}
        what = "an entry removed, a step that does not exist added"
    path.write_text(json.dumps(doc))
    return Damage("index_edit", f"index.json: {what} edited")


# ---------------------------------------------------------------------------- reading it back
class Trial:
    """The reads of one damaged copy and what they gave."""

    def __init__(self, d: Path, dmg: Damage, where: str, res: Result) -> None:
        self.d, self.dmg, self.where, self.res = d, dmg, where, res
        self.detected = False
        self.fell_back = False

    def broken(self, what: str) -> None:
        self.res.fail(f"{self.where}: {self.dmg.kind} ({self.dmg.what}): {what}")

    def refused(self, op: str, e: BaseException, step: int | None) -> None:
        """An operation raised: fine if it is a CheckpointError that says where."""
        if not isinstance(e, CheckpointError):
            self.broken(f"{op} raised {type(e).__name__}, not a CheckpointError: {e}")
            return
        self.detected = True
        text = str(e)
        if step is None:
            # opening, or reading "the latest": there is an undamaged checkpoint to fall
            # back to, so refusing is a broken promise
            if any(s not in self.dmg.touched for s in STEPS):
                self.broken(f"{op} raised instead of falling back to an undamaged "
                            f"checkpoint: {type(e).__name__}: {text[:300]}")
            return
        if step not in self.dmg.touched:
            self.broken(f"{op} refused step {step}, which was not damaged: {text[:300]}")
            return
        if isinstance(e, pitstop.CheckpointNotFoundError):
            # the damaged step's manifest is gone, or a writer moved it aside as corrupt
            if f"step {step} " not in text:
                self.broken(f"{op}: the error does not name step {step}: {text[:300]}")
            return
        if name(step) not in text:
            self.broken(f"{op}: the error does not name checkpoint {name(step)}: {text[:300]}")
        fname, arrays = self.dmg.expect.get(step, (None, set()))
        if fname is not None and fname not in text:
            self.broken(f"{op}: the error does not name the damaged file {fname}: "
                        f"{text[:300]}")
        elif arrays and not any(repr(k) in text or f"'{k}'" in text for k in arrays):
            self.broken(f"{op}: the error names none of the damaged arrays "
                        f"{sorted(arrays)}: {text[:300]}")
        else:
            self.res.bump("errors_naming_what_is_damaged")

    def got(self, op: str, value: Any, step: int, asked: int | None) -> None:
        """An operation gave the state of ``step``: it must be exactly what step saved."""
        if asked is not None and step != asked:
            self.broken(f"{op} asked for step {asked} gave step {step}")
            return
        if step not in STEPS:
            self.broken(f"{op} gave step {step}, which was never saved")
            return
        why = differs(value, state_of(step))
        if why is not None:
            self.broken(f"{op} gave step {step} with a wrong value: {why}")

    def run(self, rng: random.Random) -> None:
        d = self.d
        # the damaged step (or any) read by a read-only manager: by step, then the latest
        steps = sorted(self.dmg.touched) or [rng.choice(STEPS)]
        ro = self.call("open read-only", None,
                       lambda: pitstop.CheckpointManager(d, read_only=True))
        if ro is not None:
            for s in steps:
                target = blank()
                got = self.call(f"restore(step={s}) read-only", s,
                                partial(ro.restore, target, step=s))
                if got is not None:
                    self.got(f"restore(step={s}) read-only", target, int(got), s)
                got = self.call(f"load(step={s})", s, partial(ro.load, step=s))
                if got is not None:
                    self.got(f"load(step={s})", got, s, s)
            got = self.call("load() read-only", None, ro.load)
            if got is not None:
                step = got.get("meta", {}).get("step") if isinstance(got, dict) else None
                self.got("load() read-only", got, step if isinstance(step, int) else -1, None)
            for s in STEPS + tuple(x for x in self.dmg.touched if x not in STEPS):
                if not (d / name(s) / "manifest.json").exists():
                    continue

                def verify(s: int = s) -> bool:
                    CheckpointReader(ro.storage, name(s), naming=ro.naming).verify()
                    return True

                self.call(f"verify({name(s)})", s, verify)
            self.call("close read-only", None, ro.close)
        # a writing manager: the latest (falling back past damage), then the damaged step
        w = self.call("open", None, lambda: pitstop.CheckpointManager(
            d, memory_tier=False, save_on_signals=None))
        if w is None:
            return
        target = blank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = self.call("restore()", None, lambda: w.restore(target), quiet=False)
        if got is not None:
            got = int(got)
            self.got("restore()", target, got, None)
            intact = [s for s in STEPS if s not in self.dmg.touched]
            if intact and got < intact[-1]:
                self.broken(f"restore() gave step {got}, older than the newest undamaged "
                            f"step {intact[-1]}")
            if got != STEPS[-1]:
                self.fell_back = True
                # loudly: a warning names each newer checkpoint it passed over (one whose
                # manifest is gone was never a checkpoint: nothing to say)
                said = " ".join(str(c.message) for c in caught)
                quiet_ones = [s for s in sorted(self.dmg.touched - self.dmg.gone)
                              if s > got and name(s) not in said]
                if quiet_ones:
                    self.broken(f"restore() fell back to step {got} without a warning "
                                f"naming {[name(s) for s in quiet_ones]}")
        for s in steps:
            target = blank()
            got = self.call(f"restore(step={s})", s, partial(w.restore, target, step=s))
            if got is not None:
                self.got(f"restore(step={s})", target, int(got), s)
        self.call("close", None, w.close)

    def call(self, op: str, step: int | None, fn: Callable[[], Any], quiet: bool = True) -> Any:
        try:
            with warnings.catch_warnings():
                if quiet:
                    warnings.simplefilter("ignore")
                return fn()
        except Exception as e:  # noqa: BLE001 - judged, never raised
            self.refused(op, e, step)
            return None


def run_trials(trials: int, seed: int, workdir: Path) -> Result:
    """``trials`` random damages, one kind after another in turn, each on a fresh copy."""
    res = Result("corruption")
    rng = random.Random(seed)
    template = workdir / "template"
    if not (template / name(STEPS[-1]) / "manifest.json").exists():
        shutil.rmtree(template, ignore_errors=True)
        make_template(template)
    for trial in range(trials):
        kind = KINDS[trial % len(KINDS)]
        where = f"trial {trial} (seed {seed})"
        d = workdir / "trial"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(template, d)
        try:
            dmg = damage(d, kind, random.Random(rng.random()))
        except Exception as e:  # noqa: BLE001 - the harness's own trouble: counted too
            res.fail(f"{where}: could not apply {kind}: {type(e).__name__}: {e}")
            res.trials += 1
            continue
        t = Trial(d, dmg, f"{where}", res)
        failures = res.failures
        worker = threading.Thread(target=t.run, args=(random.Random(rng.random()),),
                                  daemon=True)
        worker.start()
        worker.join(HANG_S)
        if worker.is_alive():
            t.broken(f"the reads did not finish within {HANG_S:.0f} s (a hang)")
        elif res.failures == failures:
            res.bump(f"{kind}_{'detected' if t.detected or t.fell_back else 'harmless'}")
            if t.fell_back:
                res.bump("fell_back_to_an_older_step")
        res.trials += 1
    return res


def run(trials: int, seed: int, workdir: Path) -> Result:
    """The corruption scenario (full run: 200 trials)."""
    return run_trials(trials, seed, workdir)


SCENARIOS = {"corruption": run}
DEFAULT_TRIALS = {"corruption": FULL_TRIALS}
