"""Speed ratios of a bench_core run against the project's targets.

Usage::

    pytest benchmarks/bench_core.py --benchmark-enable --benchmark-only \\
        --benchmark-json=/tmp/pmlfunc-bench.json
    python -m benchmarks.ratios /tmp/pmlfunc-bench.json [--check]

For every case it prints the median forward+backward time of each implementation,
``pml / pmlfunc`` (speed-up over PML 2.9.0) and ``pmlfunc / floor`` (cost relative to one
B×B matmul forward+backward), next to the targets. ``--check`` exits with status 1 when
a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# case: (minimum speed-up over PML, maximum multiple of the matmul floor)
TARGETS: dict[str, tuple[float, float]] = {
    "contrastive": (1.0, 3.0),
    "all-triplet": (10.0, 8.0),
    "ntxent": (1000.0, 3.0),
    "supcon": (1.0, 3.0),
    "multi_similarity": (1.0, 3.0),
}


def load_medians(path: Path) -> dict[str, dict[str, float]]:
    """``{case: {impl: median seconds}}`` from a ``--benchmark-json`` file."""
    data = json.loads(path.read_text())
    medians: dict[str, dict[str, float]] = {}
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        case, impl = info.get("case"), info.get("impl")
        if case is None or impl is None:
            continue
        medians.setdefault(case, {})[impl] = bench["stats"]["median"]
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    medians = load_medians(args.json)
    header = (
        f"{'case':<17} {'pmlfunc ms':>11} {'pml ms':>11} {'floor ms':>9} "
        f"{'pml/pmlfunc':>12} {'target':>7} {'pmlfunc/floor':>14} {'target':>7}  verdict"
    )
    print(header)
    print("-" * len(header))
    missed = 0
    for case, (min_speedup, max_floor) in TARGETS.items():
        row = medians.get(case, {})
        if not {"pmlfunc", "pml", "floor"} <= row.keys():
            print(f"{case:<17} (incomplete: {sorted(row)})")
            continue
        ours, theirs, floor = row["pmlfunc"], row["pml"], row["floor"]
        speedup, vs_floor = theirs / ours, ours / floor
        ok = speedup >= min_speedup and vs_floor <= max_floor
        missed += not ok
        print(
            f"{case:<17} {ours * 1e3:>11.3f} {theirs * 1e3:>11.3f} {floor * 1e3:>9.3f} "
            f"{speedup:>11.1f}x {'>=' + format(min_speedup, 'g'):>7} "
            f"{vs_floor:>13.2f}x {'<=' + format(max_floor, 'g'):>7}  {'ok' if ok else 'MISS'}"
        )
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
