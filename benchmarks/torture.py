"""Run pitstop's reliability scenarios for a counted number of trials and print the counts.

    python benchmarks/torture.py [--trials N] [--only crash,corruption] [--seed S] [--markdown]

Each scenario module of ``benchmarks/reliability`` (crash, corruption, and faults and
concurrency where present) exposes ``SCENARIOS``: name -> ``run(trials, seed, workdir)``.
Every scenario runs its full count (``DEFAULT_TRIALS`` of its module, else 200) unless
``--trials`` says otherwise; one ``scenario: trials, failures`` line is printed as each
finishes, the failures' descriptions after it. ``--markdown`` prints a table of the counts for
``docs/reliability.md`` at the end. Exits 1 when any scenario had a failure.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.reliability import Result  # noqa: E402

#: the scenario modules, in the order they run; the last two are optional
MODULES = ("crash", "corruption", "faults", "concurrency", "bad_input")
OPTIONAL = ()
FULL = 200


def scenarios() -> dict[str, tuple[Any, int]]:
    """name -> (run function, full trial count), from every module present."""
    out: dict[str, tuple[Any, int]] = {}
    for mod_name in MODULES:
        path = ROOT / "benchmarks" / "reliability" / f"{mod_name}.py"
        if mod_name in OPTIONAL and not path.exists():
            continue
        mod = importlib.import_module(f"benchmarks.reliability.{mod_name}")
        # per scenario: DEFAULT_TRIALS or FULL_TRIALS (a dict), or one count for the module
        full = getattr(mod, "DEFAULT_TRIALS", None) or getattr(mod, "FULL_TRIALS", FULL)
        for name, fn in mod.SCENARIOS.items():
            count = full.get(name, FULL) if isinstance(full, dict) else full
            out[name] = (fn, int(count))
    return out


def markdown(results: list[tuple[Result, float]]) -> str:
    """The counts as a table for docs/reliability.md."""
    rows = ["| scenario | trials | failures | what the trials exercised | time |",
            "|---|---:|---:|---|---:|"]
    for r, secs in results:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items())) or "-"
        rows.append(f"| {r.scenario} | {r.trials} | {r.failures} | {counts} | {secs:.0f} s |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=None,
                    help="trials per scenario (default: each scenario's full count)")
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    ap.add_argument("--seed", type=int, default=None, help="seed (default: from the clock)")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    ap.add_argument("--verbose", action="store_true",
                    help="show pitstop's own log and warnings (the scenarios provoke many)")
    ap.add_argument("--workdir", default=None,
                    help="where the scenarios write (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        ap.error("--trials must be at least 1")
    found = scenarios()
    names = list(found)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in found]
        if unknown:
            ap.error(f"unknown scenario(s) {unknown}; have {sorted(found)}")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    print(f"seed {seed}", flush=True)
    log = logging.getLogger("pitstop")
    level = log.level
    with warnings.catch_warnings():
        if not args.verbose:
            # the scenarios judge every outcome themselves; pitstop's warnings about the
            # damage and crashes they cause on purpose would bury the counts
            log.setLevel(logging.CRITICAL)
            warnings.simplefilter("ignore")
        try:
            results = run_all(names, found, args.trials, seed, args.workdir)
        finally:
            log.setLevel(level)
    if args.markdown:
        print()
        print(markdown(results))
    return 1 if any(r.failures for r, _s in results) else 0


def run_all(names: list[str], found: dict[str, tuple[Any, int]], trials_arg: int | None,
            seed: int, workdir_arg: str | None) -> list[tuple[Result, float]]:
    """Run each scenario, printing its line (and its failures) as it finishes."""
    results: list[tuple[Result, float]] = []
    if workdir_arg is not None:
        os.makedirs(workdir_arg, exist_ok=True)  # --workdir on a disk of the user's choosing
    with tempfile.TemporaryDirectory(prefix="pitstop-torture-", dir=workdir_arg) as tmp:
        for name in names:
            fn, full = found[name]
            trials = trials_arg if trials_arg is not None else full
            workdir = Path(tmp) / name
            workdir.mkdir()
            t0 = time.monotonic()
            try:
                res = fn(trials, seed, workdir)
            except Exception as e:  # noqa: BLE001 - a scenario that breaks is a failure too
                res = Result(name, failures=1,
                             details=[f"the scenario itself raised {type(e).__name__}: {e}"])
            secs = time.monotonic() - t0
            results.append((res, secs))
            print(f"{res.line()} ({secs:.0f} s)", flush=True)
            for detail in res.details:
                print(f"  - {detail}", flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
