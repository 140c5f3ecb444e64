"""What a restore reports: the keys that did not match (as ``load_state_dict`` reports
them), the restored step carrying them, and the message of a refused restore."""

from __future__ import annotations

from dataclasses import dataclass, field

from pitstop.core.restore.keys import _Keys


@dataclass
class RestoreReport:
    """Keys that did not match, as ``load_state_dict`` reports them."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    #: mismatched key -> what differs (for the error message)
    details: dict[str, str] = field(default_factory=dict)
    #: what would allow a mismatch (an option an array leaf named), once each
    hints: list[str] = field(default_factory=list)
    #: array entries of the target that the restore wrote
    written: list[str] = field(default_factory=list)


class RestoredStep(int):
    """The restored step (an int), carrying what did not match under ``strict=False``."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]

    def __new__(cls, step: int, report: RestoreReport | None = None) -> RestoredStep:
        obj = super().__new__(cls, step)
        report = report or RestoreReport()
        obj.missing_keys = report.missing_keys
        obj.unexpected_keys = report.unexpected_keys
        obj.mismatched_keys = report.mismatched_keys
        return obj


def describe_mismatch(where: str, r: RestoreReport, target: _Keys, ck: _Keys) -> str:
    """The IncompatibleTargetError message: one line per kind of difference, a subtree that
    differs as a whole named once."""
    lines = [f"cannot restore {where} into this state (nothing was changed):"]
    if r.missing_keys:
        lines.append("  missing in the checkpoint: "
                     + _summarize(r.missing_keys, target, ck, r.details))
    if r.unexpected_keys:
        lines.append("  in the checkpoint but not in the target: "
                     + _summarize(r.unexpected_keys, ck, target, r.details))
    if r.mismatched_keys:
        lines.append("  mismatched: " + _summarize(r.mismatched_keys, target, None, r.details))
    lines.extend(f"  {h[0].upper()}{h[1:]}." for h in r.hints)
    lines.append("Pass strict=False to restore what matches, or restore into the state that "
                 "was saved.")
    return "\n".join(lines)


def _summarize(keys: list[str], universe: _Keys, other: _Keys | None,
               details: dict[str, str]) -> str:
    """``keys`` with every subtree of ``universe`` that is wholly in ``keys`` (and, when
    ``other`` is given, absent from it) named once."""
    chosen = set(keys)
    out: list[str] = []
    named: set[str] = set()
    for key in sorted(chosen):
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in named:
                break
            below = universe.under(prefix)
            if len(below) > 1 and all(k in chosen for k in below) and \
                    (other is None or not other.under(prefix)):
                named.add(prefix)
                kinds = {details.get(k) for k in below} - {None}
                same = f", {kinds.pop()}" if len(kinds) == 1 else ""
                out.append(f"{_q(prefix)} (whole subtree, {len(below)} entries{same})")
                break
        else:
            detail = details.get(key)
            out.append(f"{_q(key)} ({detail})" if detail else _q(key))
    return _some(out)


def _q(key: str, limit: int = 120) -> str:
    """A key path as it appears in messages: quoted (a key holding a newline cannot forge a
    line) and cut when very long."""
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _some(items: list[str], n: int = 20) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")
