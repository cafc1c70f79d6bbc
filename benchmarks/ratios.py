"""Speed ratios of benchmark runs against the project's targets.

Usage::

    python -m benchmarks.run --batch-size 512 --mode eager,compile --output /tmp/b512.json
    python -m benchmarks.ratios /tmp/b512.json [more runs ...] [--check]

    pytest benchmarks/cases/bench_core_losses.py --benchmark-only \\
        --benchmark-json=/tmp/pmlfunc-bench.json
    python -m benchmarks.ratios /tmp/pmlfunc-bench.json [--check]

Reads ``benchmarks.run`` JSON files (every mode they hold) and pytest-benchmark
``--benchmark-json`` files (compiled members ``<impl>-compile`` as mode ``compile``). For every
case, mode and pmlfunc implementation (``pmlfunc``, or one row per ``pmlfunc-<variant>``,
labelled ``case:variant``) it prints the median forward+backward time, PML's and the floor's
(the floor of the same mode), ``pml / pmlfunc`` (the speed-up over PML 2.9.0, which is
measured eager only) and ``pmlfunc / floor``, next to the targets, and a verdict. ``--check``
exits with status 1 when a target is missed.

The targets (issue 17; measured on one CPU thread, 128 dimensions, 4 samples per class):

- in float32 (other dtypes are shown, as mode ``eager-bfloat16`` etc., without targets: the
  losses compute in float32 where PML's matmuls run in the low precision);
- at every batch size, every eager pmlfunc implementation is at least as fast as PML; at batch
  512 the higher speed-ups of :data:`SPEEDUPS` where PML is pathological (its cost there grows
  faster than the batch: at 128 they are smaller, at 2,048 PML cannot run them);
- at batch 512, eager: the pair and softmax losses (:data:`PAIR_SOFTMAX`) and batch-hard +
  triplet within 3× the floor, all-triplet and mined-triplet within 6×; compiled
  (``fullgraph=True``): the pair and softmax losses within 1.5× the compiled floor,
  all-triplet within 4× (:data:`FLOOR_TARGETS`). At other batch sizes no floor target applies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

PAIR_SOFTMAX = (
    "contrastive",
    "signal_to_noise_ratio_contrastive",
    "intra_pair_variance",
    "threshold_consistent_margin",
    "multi_similarity",
    "circle",
    "lifted_structure",
    "generalized_lifted_structure",
    "tuplet_margin",
    "ntxent",
    "supcon",
)
TARGET_BATCH = 512  # the batch size the floor targets and SPEEDUPS are stated at
# (case, mode): the largest multiple of the same mode's floor
FLOOR_TARGETS: dict[tuple[str, str], float] = {
    **{(case, "eager"): 3.0 for case in PAIR_SOFTMAX},
    ("batch-hard-triplet", "eager"): 3.0,
    ("all-triplet", "eager"): 6.0,
    ("mined-triplet", "eager"): 6.0,
    **{(case, "compile"): 1.5 for case in PAIR_SOFTMAX},
    ("all-triplet", "compile"): 4.0,
}
# eager speed-ups over PML above 1 at TARGET_BATCH (where PML 2.9.0 is pathological)
SPEEDUPS: dict[str, float] = {"ntxent": 1000.0, "all-triplet": 10.0, "mined-triplet": 20.0}

Medians = dict[tuple[int, str, str], dict[str, float]]  # (batch, case, mode): {impl: seconds}


def load_medians(path: Path) -> Medians:
    """``{(batch, case, mode): {impl: median seconds}}`` from a ``benchmarks.run`` JSON file or
    a pytest-benchmark ``--benchmark-json`` file, in run order (skipped entries left out)."""
    data = json.loads(path.read_text())
    medians: Medians = {}
    if "results" in data:  # benchmarks.run
        batch = int(data["config"]["batch_size"])
        for r in data["results"]:
            if r.get("status") == "ok":
                key = (batch, r["case"], _mode(r["mode"], data["config"].get("dtype")))
                medians.setdefault(key, {})[r["impl"]] = r["stats"]["median"] / 1e3
        return medians
    for bench in data["benchmarks"]:  # pytest-benchmark
        info = bench.get("extra_info", {})
        case, impl = info.get("case"), info.get("impl")
        if case is None or impl is None:
            continue
        mode = "eager"
        for suffix in ("compile", "cudagraph"):
            if impl.endswith(f"-{suffix}"):
                impl, mode = impl.removesuffix(f"-{suffix}"), suffix
        batch = int(info["shape"][0]) if "shape" in info else TARGET_BATCH
        key = (batch, case, _mode(mode, info.get("dtype")))
        medians.setdefault(key, {})[impl] = bench["stats"]["median"]
    return medians


def _mode(mode: str, dtype: str | None) -> str:
    """The mode column: ``eager`` / ``compile`` in float32 (the targets' dtype), else with the
    dtype (``eager-bfloat16``), which no target applies to."""
    dtype = (dtype or "float32").removeprefix("torch.")
    return mode if dtype == "float32" else f"{mode}-{dtype}"


def _ours(row: dict[str, float]) -> list[str]:
    """The pmlfunc implementations of a case: ``pmlfunc`` and ``pmlfunc-<variant>``."""
    return [impl for impl in row if impl == "pmlfunc" or impl.startswith("pmlfunc-")]


def rows(medians: Medians) -> Iterator[dict]:
    """One row per (batch, case, mode, pmlfunc implementation), with its ratios, targets and
    verdict (``ok``, ``MISS`` or ``-`` without a target)."""
    for (batch, case, mode), row in medians.items():
        _, dash, dtype = mode.partition("-")
        pml = medians.get((batch, case, "eager" + dash + dtype), {}).get("pml")
        floor = row.get("floor")
        for impl in _ours(row):
            ours = row[impl]
            speedup = None if pml is None else pml / ours
            vs_floor = None if floor is None else ours / floor
            higher = SPEEDUPS.get(case, 1.0) if batch == TARGET_BATCH else 1.0
            min_speedup = higher if mode == "eager" and pml else None
            max_floor = FLOOR_TARGETS.get((case, mode)) if batch == TARGET_BATCH else None
            checks = []
            if min_speedup is not None and speedup is not None:
                checks.append(speedup >= min_speedup)
            if max_floor is not None and vs_floor is not None:
                checks.append(vs_floor <= max_floor)
            label = case if impl == "pmlfunc" else f"{case}:{impl.removeprefix('pmlfunc-')}"
            yield {
                "batch": batch,
                "mode": mode,
                "label": label,
                "ours": ours,
                "pml": pml,
                "floor": floor,
                "speedup": speedup,
                "min_speedup": min_speedup,
                "vs_floor": vs_floor,
                "max_floor": max_floor,
                "verdict": ("ok" if all(checks) else "MISS") if checks else "-",
            }


def _ms(seconds: float | None, width: int) -> str:
    return f"{'-':>{width}}" if seconds is None else f"{seconds * 1e3:>{width}.3f}"


def _ratio(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width - 1}.2f}x"


def _bound(op: str, value: float | None) -> str:
    return "-" if value is None else op + format(value, "g")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "json", type=Path, nargs="+", help="benchmarks.run or pytest-benchmark JSON"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    medians: Medians = {}
    for path in args.json:
        medians.update(load_medians(path))
    table = list(rows(medians))
    width = max([17, *(len(r["label"]) for r in table)])
    header = (
        f"{'batch':>5} {'mode':<14} {'case':<{width}} {'pmlfunc ms':>11} {'pml ms':>11} "
        f"{'floor ms':>9} {'pml/pmlfunc':>12} {'target':>7} {'pmlfunc/floor':>14} "
        f"{'target':>7}  verdict"
    )
    print(header)
    print("-" * len(header))
    for r in table:
        print(
            f"{r['batch']:>5} {r['mode']:<14} {r['label']:<{width}} {_ms(r['ours'], 11)} "
            f"{_ms(r['pml'], 11)} {_ms(r['floor'], 9)} {_ratio(r['speedup'], 12)} "
            f"{_bound('>=', r['min_speedup']):>7} {_ratio(r['vs_floor'], 14)} "
            f"{_bound('<=', r['max_floor']):>7}  {r['verdict']}"
        )
    missed = [r for r in table if r["verdict"] == "MISS"]
    print(
        f"\n{len(table)} rows, {sum(r['verdict'] == 'ok' for r in table)} ok, {len(missed)} missed"
    )
    for r in missed:
        print(f"  MISS: batch {r['batch']} {r['mode']} {r['label']}")
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
