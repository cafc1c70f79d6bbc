"""Turn ``benchmarks.run`` JSON files into Markdown tables, a CSV and SVG scaling charts.

    python -m benchmarks.report RUN.json [RUN.json ...] --output DIR [--name NAME] [--title T]
        [--command "how the runs were made"]

Writes ``DIR/NAME.md`` (default ``README.md``; one table per batch size, dtype and mode: each case's median
forward+backward time per implementation, ``PML / pmlfunc`` and ``pmlfunc / floor``, the
peak memory one step adds, and every skipped or failed entry with its reason), ``DIR/results.csv``
(``DIR/NAME.csv``; one row per measured entry, with the spread) and ``DIR/[NAME-]<case>.svg`` (median time against batch
size, log-log, one line per implementation; only when the runs cover several batch sizes).
The provenance (versions, git revision, configuration) of every run is listed at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

COLUMNS = ("case", "impl", "mode", "batch", "dtype", "median_ms", "q1_ms", "q3_ms", "min_ms",
           "max_ms", "forward_ms", "backward_ms", "first_step_ms", "peak_memory_mib", "flops",
           "loss", "status", "reason")  # fmt: skip


def load(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        if "results" not in run or "config" not in run:
            raise ValueError(f"{path} is not a benchmarks.run output (no 'results'/'config')")
        run["path"] = str(path)
        runs.append(run)
    return runs


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per entry of every run."""
    out = []
    for run in runs:
        cfg = run["config"]
        for r in run["results"]:
            stats = r.get("stats") or {}
            fwd, bwd = r.get("forward_stats") or {}, r.get("backward_stats") or {}
            out.append(
                {
                    "case": r["case"],
                    "impl": r["impl"],
                    "mode": r["mode"],
                    "batch": cfg["batch_size"],
                    "dtype": cfg["dtype"],
                    "median_ms": stats.get("median"),
                    "q1_ms": stats.get("q1"),
                    "q3_ms": stats.get("q3"),
                    "min_ms": stats.get("min"),
                    "max_ms": stats.get("max"),
                    "forward_ms": fwd.get("median"),
                    "backward_ms": bwd.get("median"),
                    "first_step_ms": r.get("first_step_ms"),
                    "peak_memory_mib": r.get("peak_memory_mib"),
                    "flops": r.get("flops"),
                    "loss": r.get("loss"),
                    "status": r["status"],
                    "reason": r.get("reason"),
                }
            )
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if value < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "—"
    return f"{a / b:,.1f}×" if a / b < 1000 else f"{a / b:,.0f}×"


def markdown(
    runs: list[dict[str, Any]],
    title: str,
    command: str | None = None,
    preamble: list[str] | None = None,
) -> str:
    """The Markdown page of ``runs``; ``preamble``: lines placed after the introduction, before
    the tables (``benchmarks.gpu_check`` puts its steps, tests and capacity there)."""
    table = rows(runs)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in table:
        groups[(row["batch"], row["dtype"], row["mode"])].append(row)
    lines = [f"# {title}", ""]
    if command:
        lines += ["Produced by:", "", "```bash", command.strip(), "```", ""]
    lines += [
        "Median forward+backward time per step in ms (mining alone for `pair-miner`), pmlfunc",
        "beside PML 2.9.0 and the matmul floor `(E @ E.T).sum()` in the same process. Peak: the",
        "memory one step adds (CPU: live tensor storage; CUDA: allocated above the baseline).",
        "",
        *(preamble or []),
    ]
    skipped: list[str] = []
    for (batch, dtype, mode), members in sorted(groups.items(), key=lambda kv: kv[0]):
        lines += [f"## Batch {batch}, {dtype}, {mode}", ""]
        lines += [
            "| case | implementation | median ms | q1–q3 ms | PML / this | this / floor | peak MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        by_case: dict[str, dict[str, dict]] = defaultdict(dict)
        for row in members:
            by_case[row["case"]][row["impl"]] = row
        for case, impls in by_case.items():
            pml = impls.get("pml", {}).get("median_ms")
            floor = impls.get("floor", {}).get("median_ms")
            for impl, row in impls.items():
                if row["status"] != "ok":
                    skipped.append(
                        f"- batch {batch}, {dtype}, {mode}: `{case}` / `{impl}`: "
                        f"{row['status']} ({row['reason']})"
                    )
                    continue
                med = row["median_ms"]
                spread = f"{_fmt(row['q1_ms'])}–{_fmt(row['q3_ms'])}"
                vs_pml = _ratio(pml, med) if impl.startswith("pmlfunc") else ""
                vs_floor = _ratio(med, floor) if impl != "floor" else ""
                peak = _fmt(row["peak_memory_mib"])
                lines.append(
                    f"| {case} | {impl} | {_fmt(med)} | {spread} | {vs_pml} | {vs_floor} | {peak} |"
                )
        compiled = [r for r in members if r.get("first_step_ms") is not None]
        if compiled:
            lines += ["", "First compiled step (compilation included), ms: " + ", ".join(
                f"`{r['case']}/{r['impl']}` {_fmt(r['first_step_ms'])}" for r in compiled
            )]  # fmt: skip
        lines.append("")
    if skipped:
        lines += ["## Not measured", "", *skipped, ""]
    lines += ["## Provenance", ""]
    for run in runs:
        env, cfg = run["environment"], run["config"]
        lines.append(
            f"- `{Path(run['path']).name}`: torch {env.get('torch')}, Python {env.get('python')}, "
            f"{env.get('platform')}, {env.get('cuda_device') or env.get('processor')}, git "
            f"`{(env.get('git_revision') or 'unknown')[:12]}`, {env.get('time')}; batch "
            f"{cfg['batch_size']}, {cfg['dimensions']} dims, {cfg['samples_per_class']} per class, "
            f"{cfg['dtype']}, {cfg['threads']} thread(s), {cfg['repeats']} repeats after "
            f"{cfg['warmup']} warmup steps, device {cfg['device']}"
        )
    return "\n".join(lines) + "\n"


def write_csv(runs: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows(runs):
            writer.writerow(row)


def charts(runs: list[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """One SVG per (case, dtype, mode) measured at two or more batch sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows(runs):
        if row["status"] == "ok" and row["median_ms"] is not None:
            key = (row["case"], row["dtype"], row["mode"])
            series[key][row["impl"]].append((row["batch"], row["median_ms"]))
    written = []
    for (case, dtype, mode), impls in sorted(series.items()):
        if len({b for points in impls.values() for b, _ in points}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for impl, points in sorted(impls.items()):
            points.sort()
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("median ms per step")
        ax.set_title(f"{case} ({dtype}, {mode})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        suffix = "" if (dtype, mode) == ("float32", "eager") else f"-{dtype}-{mode}"
        path = out_dir / f"{prefix}{case}{suffix}.svg"
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="benchmarks.run JSON files")
    p.add_argument("--output", type=Path, required=True, help="directory to write")
    p.add_argument("--name", default=None, help="file stem (default: README.md, results.csv)")
    p.add_argument("--title", default="pmlfunc benchmarks")
    p.add_argument("--command", default=None, help="the commands that made the runs (shown)")
    args = p.parse_args(argv)
    runs = load(args.runs)
    args.output.mkdir(parents=True, exist_ok=True)
    md = args.output / (f"{args.name}.md" if args.name else "README.md")
    table = args.output / (f"{args.name}.csv" if args.name else "results.csv")
    text = markdown(runs, args.title, args.command)
    svgs = charts(runs, args.output, f"{args.name}-" if args.name else "")
    if svgs:
        text += "\n## Scaling\n\n" + "\n".join(f"![{s.stem}]({s.name})" for s in svgs) + "\n"
    md.write_text(text)
    write_csv(runs, table)
    print(f"wrote {md}, {table} and {len(svgs)} chart(s)")
    return [md, table, *svgs]


if __name__ == "__main__":
    main()
