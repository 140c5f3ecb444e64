"""Retention, the rule and its explanation: what the writer records of its policies
(``directory.json``, "retention"), and, for each committed checkpoint, whether the next
retention pass keeps it and why (what ``pitstop ls`` shows). The rule a pass applies is
:func:`pitstop.core.policy.to_delete`, then what incremental checkpoints reference
(:func:`referencing`, :func:`held_aside_by`): the writer's retention
(:class:`pitstop.core.directory.catalog.Catalog`) and the explanation share them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pitstop.core.directory.identity import IDENTITY
from pitstop.core.directory.names import Naming
from pitstop.core.directory.text import brief, printable
from pitstop.core.errors import InvalidArgumentError
from pitstop.core.format.decoding import load_json
from pitstop.core.policy import (
    CheckpointInfo,
    KeepAll,
    KeepBest,
    KeepEverySteps,
    KeepLast,
    RetentionPolicy,
)
from pitstop.core.storage import Storage
from pitstop.core.storage.local import MANIFEST


def retention_record(policies: list[RetentionPolicy]) -> list[dict[str, Any]]:
    """The retention policies as recorded in ``directory.json`` (``"retention"``), so that
    ``pitstop ls`` can say which checkpoints the next retention pass keeps, and why. A
    policy pitstop does not know is recorded by its ``retention_label`` (a string attribute),
    else its class name (``"custom"``), also a subclass of one of pitstop's (its own
    ``keep`` may decide otherwise)."""
    out: list[dict[str, Any]] = []
    for p in policies:
        if type(p) is KeepLast:
            out.append({"keep_last": p.n})
        elif type(p) is KeepEverySteps:
            out.append({"keep_every_steps": p.k})
        elif type(p) is KeepBest:
            out.append({"keep_best": p.n, "best_metric": p.metric, "best_mode": p.mode})
        elif type(p) is KeepAll:
            out.append({"keep_all": True})
        else:
            kind = type(p)
            label = getattr(p, "retention_label", None)  # what the policy says it is
            out.append({"custom": label if isinstance(label, str) and label else
                        f"{kind.__module__}.{kind.__qualname__}"})
    return out


def record_retention(storage: Storage, policies: list[RetentionPolicy]) -> None:
    """Record the writer's retention in ``directory.json`` when it differs from what is
    recorded there (rewritten whole, atomically; readers ignore keys they do not know)."""
    raw = storage.read_meta(IDENTITY)
    if raw is None:
        return
    try:
        doc = load_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return  # (read_identity refused it already, or reads without it)
    record = retention_record(policies)
    if not isinstance(doc, dict) or doc.get("retention") == record:
        return
    doc["retention"] = record
    storage.write_meta(IDENTITY, json.dumps(doc).encode())


def referencing(step: int, infos: Mapping[int, CheckpointInfo], among: Iterable[int]
                ) -> list[int]:
    """The checkpoints of ``among`` (steps of ``infos``) that reference data ``step`` holds
    (incremental checkpoints): while one of them stays, ``step`` stays too."""
    return sorted(t for t in among if t != step and t in infos
                  and step in (infos[t].refs or ()))


def aside_refs(storage: Storage, entry: str) -> tuple[str, ...]:
    """The checkpoints whose data the manifest of ``entry`` (a checkpoint moved aside as
    abandoned) references; () when it cannot be read (encrypted, unreadable: it references
    nothing we can tell)."""
    try:
        doc = load_json(storage.read_bytes(entry, MANIFEST))
        return tuple(str(r) for r in doc.get("refs") or ())
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return ()


def held_aside_by(name: str, aside: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The checkpoints a rollback moved aside (abandoned: name -> what their manifests
    reference) that reference the checkpoint ``name``: pitstop keeps those, and so the
    checkpoints they read from."""
    return sorted(a for a, refs in aside.items() if name in refs)


@dataclass
class RecordedRetention:
    """The retention the directory's writer recorded (``directory.json``, "retention"):
    its policies that ls can evaluate, with their labels, and the names of those it cannot
    (a user's own policy objects); ``policies`` None: nothing recorded."""

    policies: list[tuple[Any, str]] | None
    custom: list[str]
    summary: str


def recorded_retention(record: Any) -> RecordedRetention:
    """The retention a directory recorded (its ``"retention"`` record, None: none), with
    the labels the explanation gives its policies."""
    if record is not None and not isinstance(record, list):
        return RecordedRetention(None, [], f"retention: not understood ({brief(record, 40)}: written "
                          "by a newer pitstop, or edited by hand); its writer records its own "
                          "when it opens the directory")
    if not isinstance(record, list):
        return RecordedRetention(None, [], "retention: policy unknown (the directory records none: "
                          "written by an older pitstop, or not opened by a writer since)")
    policies: list[tuple[Any, str]] = []
    custom: list[str] = []
    said: list[str] = []
    for item in record:
        try:
            if not isinstance(item, dict):
                raise TypeError
            if "keep_last" in item:
                n = item["keep_last"]
                policies.append((KeepLast(n), f"newest {n}"))
                said.append(f"keep_last={n}")
            elif "keep_every_steps" in item:
                k = item["keep_every_steps"]
                policies.append((KeepEverySteps(k), f"every {k}"))
                said.append(f"keep_every_steps={k}")
            elif "keep_best" in item:
                n, metric, mode = item["keep_best"], item["best_metric"], item["best_mode"]
                if not isinstance(metric, str):
                    raise TypeError
                label = f"best {printable(metric)}" if n == 1 else f"{n} best {printable(metric)}"
                policies.append((KeepBest(n, metric, mode), label))
                said.append(f"keep_best={n} by {printable(metric)} ({printable(mode)})")
            elif item.get("keep_all") is True:
                policies.append((KeepAll(), "keep all"))
                said.append("keep all")
            elif isinstance(item.get("custom"), str):
                custom.append(printable(item["custom"]))
                said.append(custom[-1])
            else:
                raise TypeError
        except (InvalidArgumentError, TypeError, KeyError, ValueError):
            custom.append(brief(item, 40))
            said.append(f"{custom[-1]} (not understood)")
    summary = ", ".join(said) if said else "none (keeps every checkpoint)"
    return RecordedRetention(policies, custom, f"retention: {summary}")


def explain_retention(ret: RecordedRetention, infos: dict[int, Any], aside_refs: dict[str, Any],
                      naming: Naming) -> dict[int, str]:
    """For each committed step, whether the next retention pass keeps it and why. That pass
    runs after the next save commits, so it is evaluated on these checkpoints plus a newer
    one (no metrics: it outranks no kept best), as the writer's retention decides
    (:func:`pitstop.core.policy.to_delete`, then what incremental checkpoints reference):
    one the ``keep_last`` window keeps now but not then is "kept until the next save";
    {} when the policy is unknown."""
    if ret.policies is None or not infos:
        return {}
    if not ret.policies and not ret.custom:
        return {s: "kept: no retention" for s in infos}
    now = _retention_pass(ret, infos, aside_refs, naming)
    mine = [c for c in infos.values() if c.ours]
    newest = max(infos)
    finite = None if not mine else max(mine, key=lambda c: c.step).all_finite
    nxt = dict(infos)
    # (the next save: ours, and finite when the run checks it; what it will reference is
    # not known, so a checkpoint only it would keep is said deleted, never the reverse)
    nxt[newest + 1] = CheckpointInfo(newest + 1, {}, ours=True,
                                     all_finite=None if finite is None else True)
    then = _retention_pass(ret, nxt, aside_refs, naming)
    out: dict[int, str] = {}
    for s in infos:
        if then[s] is None:
            out[s] = "deleted at the next save" if now[s] is None else \
                f"kept until the next save ({now[s]})"
        elif ret.custom and then[s] == "":
            out[s] = f"kept unless {ret.custom[0]} deletes it"
        else:
            out[s] = f"kept: {then[s]}"
    return out


def _retention_pass(ret: RecordedRetention, infos: dict[int, Any], aside_refs: dict[str, Any],
                    naming: Naming) -> dict[int, str | None]:
    """One retention pass over ``infos``: step -> why it is kept, "" when only a policy ls
    cannot evaluate may delete it, None when it is deleted."""
    mine = [c for c in infos.values() if c.ours]
    why: dict[int, list[str]] = {s: [] for s in infos}
    for policy, label in ret.policies or ():
        for s in policy.keep(mine):
            why[s].append(label)
    newest = max(infos)
    newest_mine = max((c.step for c in mine), default=None)
    finite = [s for s, c in infos.items() if c.all_finite]
    for s, c in infos.items():
        if not why[s] and s in (newest, newest_mine):
            why[s].append("newest")
        if not why[s] and finite and s == max(finite):
            why[s].append("newest all-finite")
        if c.protected:
            why[s].append("protected")
        if not why[s] and not c.ours:
            why[s].append("not written by this directory's runs")
    out: dict[int, str | None] = {s: ", ".join(r) for s, r in why.items() if r}
    remaining = set(infos)
    for s in sorted((s for s in infos if not why[s]), reverse=True):
        if ret.custom:
            out[s] = ""
            continue
        users = referencing(s, infos, remaining)
        if users:
            out[s] = f"referenced by step {', '.join(map(str, users))}"
            continue
        name = naming.name(s)
        held = held_aside_by(name, aside_refs)
        if held:
            out[s] = f"referenced by {', '.join(held)}"
            continue
        remaining.discard(s)
        out[s] = None
    return out


__all__ = ["retention_record", "record_retention", "RecordedRetention", "recorded_retention",
           "explain_retention", "referencing", "aside_refs", "held_aside_by"]
