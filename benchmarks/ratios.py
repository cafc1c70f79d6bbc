"""Speed ratios of a benchmark run (core losses, miners) against the project's targets.

Usage::

    pytest benchmarks/cases/bench_core_losses.py --benchmark-enable --benchmark-only \\
        --benchmark-json=/tmp/pmlfunc-bench.json
    python -m benchmarks.ratios /tmp/pmlfunc-bench.json [--check]

For every case in the run it prints the median forward+backward time of each pmlfunc
implementation (``pmlfunc``, or one row per ``pmlfunc-<variant>``, labelled
``case:variant``), of PML and of the floor, ``pml / pmlfunc`` (speed-up over PML 2.9.0) and
``pmlfunc / floor`` (cost relative to the case's floor), next to the targets. ``-`` marks a
missing implementation (no PML in a ``reused-*`` group) or an unconstrained ratio; a row with
no target gets no verdict. ``--check`` exits with status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# case: (minimum speed-up over PML, maximum multiple of the floor); None: unconstrained.
# Cases of a run that are not listed here are printed without a verdict.
TARGETS: dict[str, tuple[float | None, float | None]] = {
    "contrastive": (1.0, 3.0),
    "all-triplet": (10.0, 8.0),
    "ntxent": (1000.0, 3.0),
    "supcon": (1.0, 3.0),
    "multi_similarity": (1.0, 3.0),
    "mined-triplet": (20.0, None),
    "batch-hard-triplet": (1.0, None),
}


def load_medians(path: Path) -> dict[str, dict[str, float]]:
    """``{case: {impl: median seconds}}`` from a ``--benchmark-json`` file, in run order."""
    data = json.loads(path.read_text())
    medians: dict[str, dict[str, float]] = {}
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        case, impl = info.get("case"), info.get("impl")
        if case is None or impl is None:
            continue
        medians.setdefault(case, {})[impl] = bench["stats"]["median"]
    return medians


def _ours(row: dict[str, float]) -> list[str]:
    """The pmlfunc implementations of a case: ``pmlfunc`` and ``pmlfunc-<variant>``."""
    return [impl for impl in row if impl == "pmlfunc" or impl.startswith("pmlfunc-")]


def _ms(seconds: float | None, width: int) -> str:
    return f"{'-':>{width}}" if seconds is None else f"{seconds * 1e3:>{width}.3f}"


def _bound(op: str, value: float | None) -> str:
    return "-" if value is None else op + format(value, "g")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    medians = load_medians(args.json)
    cases = [c for c in TARGETS if c in medians] + [c for c in medians if c not in TARGETS]
    rows = [
        (case, impl, case if impl == "pmlfunc" else f"{case}:{impl.removeprefix('pmlfunc-')}")
        for case in cases
        for impl in _ours(medians[case]) or ["pmlfunc"]
    ]
    width = max([17, *(len(label) for _, _, label in rows)])  # 17: the core losses' layout
    header = (
        f"{'case':<{width}} {'pmlfunc ms':>11} {'pml ms':>11} {'floor ms':>9} "
        f"{'pml/pmlfunc':>12} {'target':>7} {'pmlfunc/floor':>14} {'target':>7}  verdict"
    )
    print(header)
    print("-" * len(header))
    missed = 0
    for case, impl, label in rows:
        row = medians[case]
        min_speedup, max_floor = TARGETS.get(case, (None, None))
        ours, theirs, floor = row.get(impl), row.get("pml"), row.get("floor")
        needed = {impl} | ({"pml"} if min_speedup is not None else set())
        needed |= {"floor"} if max_floor is not None else set()
        if not needed <= row.keys():
            print(f"{label:<{width}} (incomplete: {sorted(row)})")
            continue
        speedup = None if ours is None or theirs is None else theirs / ours
        vs_floor = None if ours is None or floor is None else ours / floor
        checks = []
        if min_speedup is not None:
            checks.append(speedup >= min_speedup)
        if max_floor is not None:
            checks.append(vs_floor <= max_floor)
        verdict = ("ok" if all(checks) else "MISS") if checks else "-"
        missed += verdict == "MISS"
        speedup_s = f"{'-':>12}" if speedup is None else f"{speedup:>11.1f}x"
        floor_s = f"{'-':>14}" if vs_floor is None else f"{vs_floor:>13.2f}x"
        print(
            f"{label:<{width}} {_ms(ours, 11)} {_ms(theirs, 11)} {_ms(floor, 9)} "
            f"{speedup_s} {_bound('>=', min_speedup):>7} "
            f"{floor_s} {_bound('<=', max_floor):>7}  {verdict}"
        )
    absent = [c for c in TARGETS if c not in medians]
    if absent:
        print(f"(targets not in this run: {', '.join(absent)})")
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
