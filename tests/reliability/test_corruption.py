"""Corruption torture at a reduced count (``benchmarks/reliability/corruption.py``): random
damage of every kind to copies of real checkpoints; each read gives the exact saved state or
a CheckpointError that names what is damaged. Plus the defects it found, kept as tests."""

from __future__ import annotations

import json
import os

import pytest

import pitstop
from benchmarks.reliability import corruption
from pitstop.core.format.seal import seal

TRIALS = 50  # five of each kind
SEED = 20261201


def test_random_corruption_is_detected_or_harmless_never_a_wrong_value(tmp_path):
    res = corruption.run(TRIALS, SEED, tmp_path)
    print(res.line())
    assert res.trials == TRIALS
    assert res.failures == 0, f"seed {SEED}:\n" + "\n".join(res.details)
    for kind in corruption.KINDS:
        tried = res.counts.get(f"{kind}_detected", 0) + res.counts.get(f"{kind}_harmless", 0)
        assert tried == TRIALS // len(corruption.KINDS), f"{kind}: {res.counts}"
    # the kinds that change bytes a restore reads are found (not only shrugged off)
    for kind in ("bitflip_manifest", "truncate", "delete_file", "swap", "manifest_edit"):
        assert res.counts.get(f"{kind}_detected", 0) > 0, res.counts
    assert res.counts.get("fell_back_to_an_older_step", 0) > 0, res.counts
    assert res.counts.get("errors_naming_what_is_damaged", 0) > 0, res.counts


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None,
                                   writer_threads=2) as m:
        m.save(1, corruption.state_of(1))
    return d / "step_0000000001"


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_short_or_missing_data_file_names_the_arrays_it_held(ckpt, damage):
    """Found by the torture: the error named the file but not what was lost with it."""
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    fname = sorted(doc["files"])[-1]
    held = [k for k, e in doc["arrays"].items() if e["file"] == fname]
    if damage == "truncate":
        os.truncate(ckpt / fname, 10)
    else:
        os.unlink(ckpt / fname)
    mgr = pitstop.CheckpointManager(ckpt.parent, read_only=True)
    for call in (lambda: mgr.restore(corruption.blank(), step=1), lambda: mgr.load(step=1)):
        with pytest.raises(pitstop.CorruptCheckpointError) as e:
            call()
        assert fname in str(e.value) and any(repr(k) in str(e.value) for k in held), e.value
    # the structural check before a restore reads anything names every one
    with pytest.raises(pitstop.CorruptCheckpointError) as e:
        mgr.restore(corruption.blank(), step=1)
    assert all(repr(k) in str(e.value) for k in held), e.value


def test_a_manifest_whose_hash_algorithm_is_not_a_string_is_corrupt_not_a_type_error(ckpt):
    """Found by the torture: an object where the algorithm's name belongs raised TypeError
    (unhashable) from the manifest's hash check, outside CheckpointError."""
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_bytes())
    stale = doc.pop("manifest_hash")
    doc["hash_algorithm"] = {}
    body = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(body[:-1] + b',"manifest_hash":"' + stale.encode() + b'"}')
    mgr = pitstop.CheckpointManager(ckpt.parent, read_only=True)
    with pytest.raises(pitstop.CorruptCheckpointError, match="step_0000000001"):
        mgr.load(step=1)
    # and a re-sealed one (the hash recomputed over the edit) too
    path.write_bytes(seal(body, "xxh3-128"))
    with pytest.raises(pitstop.CorruptCheckpointError, match="step_0000000001"):
        mgr.load(step=1)
