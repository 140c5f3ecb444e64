"""Why each checkpoint stays or goes at the next retention pass (what ``pitstop ls`` shows),
from the retention the writer recorded: the same rule the writer's retention applies."""

from __future__ import annotations

from pitstop.core.directory.names import DEFAULT
from pitstop.core.directory.retention import (
    explain_retention,
    held_aside_by,
    recorded_retention,
    referencing,
    retention_record,
)
from pitstop.core.policy import CheckpointInfo, KeepBest, KeepLast, to_delete


def _infos(refs=None):
    refs = refs or {}
    return {s: CheckpointInfo(s, {"loss": float(10 - s)}, refs=refs.get(s, ()))
            for s in (1, 2, 3, 4)}


def test_the_record_round_trips_into_labels():
    ret = recorded_retention(retention_record([KeepLast(2), KeepBest(1, "loss", "max")]))
    assert [label for _p, label in ret.policies] == ["newest 2", "best loss"]
    assert ret.summary == "retention: keep_last=2, keep_best=1 by loss (max)"
    assert recorded_retention(None).policies is None
    assert "not understood" in recorded_retention({"keep_last": 2}).summary


def test_what_the_next_pass_deletes_and_why_the_rest_stays():
    ret = recorded_retention([{"keep_last": 2}])
    said = explain_retention(ret, _infos(), {}, DEFAULT)
    assert said == {1: "deleted at the next save", 2: "deleted at the next save",
                    3: "kept until the next save (newest 2)", 4: "kept: newest 2"}
    # the writer's rule deletes the same ones (the explanation evaluates one more save)
    infos = list(_infos().values()) + [CheckpointInfo(5, {})]
    assert to_delete(infos, [KeepLast(2)]) == [1, 2, 3]


def test_references_keep_what_they_read_from():
    infos = _infos(refs={4: (2,)})
    aside = {DEFAULT.name(4) + ".abandoned-1-abcd": (DEFAULT.name(1),)}
    said = explain_retention(recorded_retention([{"keep_last": 2}]), infos, aside, DEFAULT)
    assert said == {1: f"kept: referenced by {DEFAULT.name(4)}.abandoned-1-abcd",
                    2: "kept: referenced by step 4", 3: "kept until the next save (newest 2)",
                    4: "kept: newest 2"}
    # keep_last=1: step 4 goes at the next save, and with it what held step 2
    said = explain_retention(recorded_retention([{"keep_last": 1}]), infos, aside, DEFAULT)
    assert said[2] == "kept until the next save (referenced by step 4)"
    assert said[3] == "deleted at the next save"
    assert referencing(2, infos, infos) == [4] and referencing(2, infos, [1, 3]) == []
    assert held_aside_by(DEFAULT.name(1), aside) == list(aside)


def test_no_retention_keeps_everything():
    said = explain_retention(recorded_retention([]), _infos(), {}, DEFAULT)
    assert set(said.values()) == {"kept: no retention"}
