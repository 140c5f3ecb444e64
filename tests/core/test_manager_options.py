"""The manager's keywords are one documented dataclass: ManagerOptions has a field for
every keyword of CheckpointManager (the directory aside) with the same default, each field
is documented, and it checks its values as the constructor always did."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import pitstop
from pitstop.core.manager import ManagerOptions


def test_every_keyword_is_a_field_with_its_default():
    params = dict(inspect.signature(pitstop.CheckpointManager).parameters)
    del params["directory"]
    fields = {f.name: f.default for f in dataclasses.fields(ManagerOptions)}
    assert list(fields) == list(params)  # same names, same order
    for name, p in params.items():
        assert fields[name] == p.default, name


def test_every_field_is_documented():
    doc = ManagerOptions.__doc__ or ""
    missing = [f.name for f in dataclasses.fields(ManagerOptions) if f"{f.name}:" not in doc]
    assert not missing


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ManagerOptions().keep_last = 3  # type: ignore[misc]


@pytest.mark.parametrize(("kw", "text"), [
    ({"on_busy": "never"}, "on_busy must be 'skip' or 'wait'"),
    ({"keep_best": 2}, "keep_best needs best_metric"),
    ({"snapshot": "later"}, "snapshot must be 'eager'"),
    ({"permissions": 0o600}, "permissions must be None"),
    ({"save_on_signals": ["SIGNOPE"]}, "SIGNOPE"),
])
def test_check_says_what_the_constructor_says(tmp_path, kw, text):
    with pytest.raises(pitstop.InvalidArgumentError, match=text) as direct:
        ManagerOptions(**kw).check(tmp_path)
    with pytest.raises(pitstop.InvalidArgumentError) as made:
        pitstop.CheckpointManager(tmp_path / "ck", **kw)
    assert str(made.value) == str(direct.value)
    assert not (tmp_path / "ck").exists()  # refused before anything is written


def test_retention_policies_from_keywords():
    policies = ManagerOptions(keep_last=2, keep_every_steps=10, keep_best=1,
                              best_metric="loss").retention_policies()
    assert [type(p).__name__ for p in policies] == ["KeepLast", "KeepEverySteps", "KeepBest"]
