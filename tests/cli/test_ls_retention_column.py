"""Probes of `pitstop ls` and `inspect`: what ls's retention column says the next save keeps
or deletes is what retention does when one more checkpoint is saved (randomized; the seed is
printed); records it cannot read are said in one line."""

from __future__ import annotations

import math
import os
import random

import numpy as np
from test_cli_status import rows

import pitstop
from pitstop.cli import main


def open_mgr(d, **kw) -> pitstop.CheckpointManager:
    return pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None, **kw)


def statuses(capsys, d) -> dict[int, str]:
    """step -> STATUS of each committed row of `pitstop ls d`."""
    capsys.readouterr()  # (what the saves before said)
    assert main(["ls", str(d)]) == 0
    out, err = capsys.readouterr()
    assert err == "", err
    return rows(out)


def committed(d) -> set[int]:
    return {int(n[5:]) for n in os.listdir(d) if n.startswith("step_") and n[5:].isdigit()}


BIG = np.arange(32, dtype=np.float32)


def policy(rng: random.Random) -> dict:
    kw: dict = {}
    while not kw:
        if rng.random() < 0.6:
            kw["keep_last"] = rng.randint(1, 3)
        if rng.random() < 0.4:
            kw["keep_every_steps"] = rng.choice([2, 3, 5])
        if rng.random() < 0.5:
            kw.update(keep_best=rng.randint(1, 2), best_metric="loss",
                      best_mode=rng.choice(["min", "max"]))
    return kw


def test_ls_predicts_what_the_next_save_keeps(tmp_path, capsys):
    seed = int(os.environ.get("PITSTOP_PROBE_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    for trial in range(8):
        d = tmp_path / f"t{trial}"
        first, second = policy(rng), policy(rng)
        incremental = rng.random() < 0.4
        guard = rng.random() < 0.3
        step = 0

        def save(mgr, metrics=None, guard=guard):
            nonlocal step
            step += rng.randint(1, 3)
            if metrics is None:
                metrics = {}
                r = rng.random()
                if r < 0.7:
                    metrics["loss"] = rng.choice([rng.random(), 0.5])
                elif r < 0.8:
                    metrics["loss"] = math.nan
            w = np.full(4, step, np.float32)
            if metrics and guard and rng.random() < 0.2:
                w[1] = np.nan  # (a non-finite save: the newest all-finite one is kept)
            state = {"big": BIG if rng.random() < 0.7 else BIG + step, "w": w}
            mgr.save(step, state, metrics=metrics).wait()

        with open_mgr(d, incremental=incremental, nonfinite_guard=guard, **first) as mgr:
            for _ in range(rng.randint(2, 7)):
                save(mgr)
        if rng.random() < 0.3:  # a rollback: the newer checkpoints are abandoned
            back = sorted(committed(d))
            with open_mgr(d, incremental=incremental, nonfinite_guard=guard, **first) as mgr:
                mgr.restore({"big": BIG.copy(), "w": np.zeros(4, np.float32)},
                            step=back[len(back) // 2])
                step = back[len(back) // 2]
                save(mgr)
        # the next writer, with its own policy: recorded when it opens, before it saves
        with open_mgr(d, incremental=incremental, nonfinite_guard=guard, **second) as mgr:
            said = statuses(capsys, d)
            ctx = f"seed {seed} trial {trial}: {first} then {second}, inc={incremental}, " \
                  f"guard={guard}: ls said {said}"
            assert set(said) == committed(d), ctx
            save(mgr, metrics={})  # no loss: it cannot outrank a kept best
        kept = committed(d)
        for s, line in said.items():
            if "deleted at the next save" in line or "until the next save" in line:
                assert s not in kept, f"{ctx}; step {s} survived the next save"
            else:
                assert s in kept, f"{ctx}; step {s} was deleted by the next save"


def test_ls_says_a_retention_record_it_cannot_read_in_one_line(tmp_path, capsys):
    import json
    d = tmp_path / "run"
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(1, {"w": np.zeros(4, np.float32)}).wait()
    ident = d / ".pitstop" / "directory.json"
    doc = json.loads(ident.read_text())
    for record, said in (({"keep_last": 2}, "retention: not understood ({\"keep_last\":2}"),
                         ([{"keep_last": -1}, {"keep_last": 3}],
                          "retention: {\"keep_last\":-1} (not understood), keep_last=3")):
        ident.write_text(json.dumps({**doc, "retention": record}))
        capsys.readouterr()
        assert main(["ls", str(d)]) == 0
        out, err = capsys.readouterr()
        assert err == "" and out.splitlines()[1].startswith(said), out
    with open_mgr(d, keep_last=1) as mgr:  # the writer records its own again
        mgr.save(2, {"w": np.zeros(4, np.float32)}).wait()
    assert json.loads(ident.read_text())["retention"] == [{"keep_last": 1}]



class KeepLastEven(pitstop.KeepLast):
    """A user's policy built on pitstop's KeepLast: its own keep(), not KeepLast's."""

    def keep(self, checkpoints):
        return {c.step for c in checkpoints if c.step % 2 == 0}


def test_ls_does_not_take_a_subclass_of_keep_last_for_keep_last(tmp_path, capsys):
    d = tmp_path / "run"
    with open_mgr(d, retention=[KeepLastEven(1)]) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": np.zeros(4, np.float32)}).wait()
    said = statuses(capsys, d)
    assert sorted(said) == [2, 3]  # 1: deleted by the user's policy
    assert f"kept unless {__name__}.KeepLastEven deletes it" in said[2], said


def test_inspect_with_a_writer_record_naming_no_framework(tmp_path, capsys):
    """A manifest (unsealed 1.0, edited) whose frameworks name only a Keras backend: no
    empty "written by:" line."""
    import json
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(1, {"w": np.zeros(4, np.float32)}).wait()
    path = d / "step_0000000001" / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("manifest_hash")
    doc["format_version"] = "1.0"
    doc["writer"]["frameworks"] = {"keras.backend": "jax"}
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["inspect", str(d)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "written by:" in ln)
    assert line.startswith("  written by: pitstop ") and "frameworks not recorded" in line, line
