"""Turn ``benchmarks.run`` JSON files into Markdown tables, a CSV and SVG charts.

    python -m benchmarks.report RUN.json [RUN.json ...] --output DIR [--name NAME] [--title T]
        [--command "how the runs were made"] [--peers]

One run's JSON is enough; several (batch sizes, dtypes) go on one page. Writes:

- ``DIR/[NAME-]summary.svg``: the page's lead chart, made from any number of runs: per loss (one
  row each, fastest speed-up first), pmlfunc's speed-up over PML (``PML / pmlfunc``, log scale)
  and pmlfunc's time over the matmul floor (``pmlfunc / floor``, log scale), one marker per
  batch size (and dtype, mode). Where PML was skipped for taking too long, the speed-up is a
  lower bound (hollow marker, from the step time the skip reason gives).
- ``DIR/NAME.md`` (default ``README.md``): the summary chart first, then one table per batch
  size, dtype and mode: each case's median forward+backward time per implementation,
  ``PML / pmlfunc`` and ``pmlfunc / floor``, the peak memory one step adds, and every skipped
  or failed entry with its reason; the scaling charts and the provenance (versions, git
  revision, configuration) of every run at the end.
- ``DIR/results.csv`` (``DIR/NAME.csv``): one row per measured entry, with the spread.
- ``DIR/[NAME-]<case>.svg``: median time against batch size, log-log, one line per
  implementation; only for cases measured at several batch sizes.
- ``DIR/[NAME-]peers.svg`` and a ``Peers`` section, when a run holds a peer library's member
  (``benchmarks/cases/bench_peers.py``): per group and size, the peer's time over the pmlfunc
  member's (the median over the runs of each run's ratio, the runs' range), the medians and the
  peak memory. ``--peers`` writes only that (``DIR/NAME.md``, the CSV and the chart ``DIR/NAME.svg``), for runs
  of the peer cases at several sizes and repeated (``docs/benchmarks/peers.md``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

COLUMNS = ("case", "impl", "mode", "batch", "dtype", "median_ms", "q1_ms", "q3_ms", "min_ms",
           "max_ms", "forward_ms", "backward_ms", "first_step_ms", "peak_memory_mib", "flops",
           "loss", "status", "reason", "dims", "run")  # fmt: skip


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
                    "dims": cfg.get("dimensions"),
                    "run": run.get("path"),
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


def _compiled_cells(compiled_of: dict[tuple[str, str], dict], case: str, impl: str) -> str:
    """The two compiled cells of an eager table row: the compiled median and its ratio to the
    compiled floor (blank where the entry was not compiled or did not run)."""
    row, floor = compiled_of.get((case, impl)), compiled_of.get((case, "floor"))
    if row is None or row["status"] != "ok":
        return "  |  |"
    ratio = ""
    if impl != "floor" and floor is not None and floor["status"] == "ok":
        ratio = _ratio(row["median_ms"], floor["median_ms"])
    return f" {_fmt(row['median_ms'])} | {ratio} |"


def markdown(
    runs: list[dict[str, Any]],
    title: str,
    command: str | None = None,
    preamble: list[str] | None = None,
    summary: str | None = None,
    peers: str | None = None,
) -> str:
    """The Markdown page of ``runs``; ``preamble``: lines placed after the introduction, before
    the tables (``benchmarks.gpu_check`` puts its steps, tests and capacity there);
    ``summary``: the file name of the summary chart (:func:`summary_chart`), shown first;
    ``peers``: that of the peers chart (:func:`peers_chart`), in the peers section (present when
    a run holds a peer library's member)."""
    table = rows(runs)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in table:
        groups[(row["batch"], row["dtype"], row["mode"])].append(row)
    lines = [f"# {title}", ""]
    if summary:
        lines += [f"![pmlfunc's speed-up over PML and its time over the matmul floor, per loss "
                  f"and batch size]({summary})", "", *summary_text(runs), ""]  # fmt: skip
        sections = [f"[batch {b}, {d}, {m}](#batch-{b}-{d}-{m})" for b, d, m in sorted(groups)]
        lines += ["Tables: " + " · ".join(sections) + ".", ""]
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
        # An eager table also shows the compiled run of the same batch and dtype, when there is
        # one: its time and its ratio to the compiled floor, beside the eager ones.
        compiled_rows = groups.get((batch, dtype, "compile")) if mode == "eager" else None
        compiled_of = {(r["case"], r["impl"]): r for r in compiled_rows or []}
        extra_head = " compiled ms | compiled / compiled floor |" if compiled_of else ""
        lines += [
            "| case | implementation | median ms | q1–q3 ms | PML / this | this / floor | peak MiB |"
            + extra_head,
            "|---|---|---|---|---|---|---|" + ("---|---|" if compiled_of else ""),
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
                cells = (
                    f"| {case} | {impl} | {_fmt(med)} | {spread} | {vs_pml} | {vs_floor} | {peak} |"
                )
                if compiled_of:
                    cells += _compiled_cells(compiled_of, case, impl)
                lines.append(cells)
        compiled = [r for r in members if r.get("first_step_ms") is not None]
        if compiled:
            lines += ["", "First compiled step (compilation included), ms: " + ", ".join(
                f"`{r['case']}/{r['impl']}` {_fmt(r['first_step_ms'])}" for r in compiled
            )]  # fmt: skip
        lines.append("")
    if skipped:
        lines += ["## Not measured", "", *skipped, ""]
    peer_lines = peers_markdown(runs, peers)
    if peer_lines:
        lines += ["## Peers", "", *peer_lines, ""]
    lines += ["## Provenance", "", *_provenance(runs)]
    return "\n".join(lines) + "\n"


# --- peers: the peer libraries beside the pmlfunc member doing the same loss ----------------

NOT_PEERS = ("pmlfunc", "floor", "pml")


def is_peer(impl: str) -> bool:
    """A peer library's member (``open_clip``, ``sentence_transformers``, ...): neither pmlfunc,
    PML nor the floor."""
    return impl.split("-")[0] not in NOT_PEERS


Size = tuple[int, Any, str, str]  # (batch, dims, dtype, mode)


def _varying(label: str, key: tuple, keys: list[tuple], fields: tuple[int, ...]) -> str:
    """``label`` followed by ``key``'s values at ``fields`` where they vary across ``keys``."""
    for i in fields:
        if len({k[i] for k in keys}) > 1:
            label += f", {key[i]}"
    return label


def _size_label(size: Size, sizes: list[Size]) -> str:
    return _varying(f"N = {size[0]:,}, D = {size[1]}", size, sizes, (2, 3))


def peer_ratios(runs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[Size, list]]:
    """Per ``(case, peer, pmlfunc member)`` of every case that holds a peer, and per size
    ``(batch, dims, dtype, mode)``: the ratio ``peer median / pmlfunc median`` of each run that
    timed both (below 1: the peer is faster), in the runs' order."""
    by_run: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows(runs):
        key = (row["run"], row["case"], (row["batch"], row["dims"], row["dtype"], row["mode"]))
        by_run[key][row["impl"]] = row
    out: dict[tuple[str, str, str], dict[Size, list]] = defaultdict(lambda: defaultdict(list))
    for (_, case, size), impls in by_run.items():
        ok = {i: r["median_ms"] for i, r in impls.items() if r["status"] == "ok" and r["median_ms"]}
        for peer in (i for i in impls if is_peer(i)):
            for ours in (i for i in impls if i.split("-")[0] == "pmlfunc"):
                bucket = out[(case, peer, ours)][size]  # listed even where one was not timed
                if peer in ok and ours in ok:
                    bucket.append(ok[peer] / ok[ours])
    return out


def _spread(values: list[float], digits: int = 2) -> str:
    """``median× [min–max]`` of per-run ratios (``median× (1 run)`` for one)."""
    if not values:
        return "—"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}× (1 run)"
    return f"{med:.{digits}f}× [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def _peer_cases(runs: list[dict[str, Any]]) -> dict[str, dict[Size, dict[str, list[dict]]]]:
    """``{case: {size: {impl: [its row of each run]}}}`` of the cases that hold a peer."""
    table = rows(runs)
    cases = {r["case"] for r in table if is_peer(r["impl"])}
    out: dict[str, dict[Size, dict[str, list[dict]]]] = {}
    for r in table:
        if r["case"] in cases:
            size = (r["batch"], r["dims"], r["dtype"], r["mode"])
            out.setdefault(r["case"], {}).setdefault(size, {}).setdefault(r["impl"], []).append(r)
    return out


def peers_markdown(runs: list[dict[str, Any]], chart: str | None = None) -> list[str]:
    """The peers' tables (empty when no run holds a peer): ``peer / pmlfunc`` per group and size
    (the median over the runs of each run's ratio of medians, the runs' range in brackets), the
    members' median times and their peak memory; ``chart``: the file name of the peers chart
    (:func:`peers_chart`), shown first."""
    ratios = peer_ratios(runs)
    if not ratios:
        return []
    per_case = _peer_cases(runs)
    sizes = sorted({size for by_size in per_case.values() for size in by_size},
                   key=lambda s: (s[2], s[3], s[1] or 0, s[0]))  # fmt: skip
    labels = [_size_label(size, sizes) for size in sizes]
    counts = sorted({len(v) for by_size in ratios.values() for v in by_size.values() if v})
    n_runs = "–".join(str(c) for c in (counts[0], counts[-1]) if counts) if counts else "0"
    if counts and counts[0] == counts[-1]:
        n_runs = str(counts[0])
    lines = []
    if chart:
        lines += [f"![peer time / pmlfunc time per group and size]({chart})", ""]
    lines += [
        "Peer time / pmlfunc time, forward + backward, each member's median over its timed steps, "
        f"the ratio taken within each run (its members timed in interleaved rounds); the median "
        f"over {n_runs} run(s), the runs' range in brackets. Below 1×: the peer is faster.",
        "",
        "| group | peer | pmlfunc member | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(sizes),
    ]
    for (case, peer, ours), by_size in ratios.items():
        cells = [_spread(by_size[size]) if size in by_size else "" for size in sizes]
        lines.append(f"| {case} | {peer} | {ours} | " + " | ".join(cells) + " |")
    for title, field, fmt in (
        ("Median ms per step (the median over the runs of each run's median)", "median_ms", _fmt),
        ("Peak memory one step adds, MiB (live tensor storage; — where not measured)",
         "peak_memory_mib", _fmt),
    ):  # fmt: skip
        lines += ["", f"{title}:", "", "| group | member | " + " | ".join(labels) + " |",
                  "|---|---|" + "---|" * len(sizes)]  # fmt: skip
        for case, by_size in per_case.items():
            impls = list(dict.fromkeys(i for size in sizes for i in by_size.get(size, {})))
            for impl in impls:
                cells = []
                for size in sizes:
                    values = [r[field] for r in by_size.get(size, {}).get(impl, [])
                              if r["status"] == "ok" and r[field] is not None]  # fmt: skip
                    cells.append(fmt(statistics.median(values)) if values else "—")
                lines.append(f"| {case} | {impl} | " + " | ".join(cells) + " |")
    skipped = {}
    for case, by_size in per_case.items():
        for size, impls in by_size.items():
            for impl, entries in impls.items():
                for r in entries:
                    if r["status"] != "ok":
                        skipped.setdefault((case, impl, r["status"], r["reason"]), []).append(size)
    if skipped:
        lines += ["", "Not measured:", ""]
        for (case, impl, status, reason), where in skipped.items():
            at = ", ".join(_size_label(s, sizes) for s in sorted(set(where)))
            lines.append(f"- `{case}` / `{impl}` ({at}): {status} ({reason})")
    return lines


def peers_chart(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Peer time / pmlfunc time against the batch, log-log, one line per (group, peer, pmlfunc
    member) with the runs' range as error bars, one panel per dimension; None without peers."""
    ratios = peer_ratios(runs)
    points = {k: {s: v for s, v in by_size.items() if v} for k, by_size in ratios.items()}
    points = {k: v for k, v in points.items() if v}
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    panels = sorted({(s[1], s[2], s[3]) for v in points.values() for s in v},
                    key=lambda p: (p[1], p[2], p[0] or 0))  # fmt: skip
    legend_rows = math.ceil(len(points) / 2)
    height = 4.0 + 0.22 * legend_rows
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(4.6 * len(panels), 7.0), height), sharey=True, squeeze=False
    )
    colors = plt.get_cmap("tab10")
    for ax, (dims, dtype, mode) in zip(axes[0], panels, strict=True):
        for j, ((case, peer, ours), by_size) in enumerate(points.items()):
            xs = sorted(s for s in by_size if (s[1], s[2], s[3]) == (dims, dtype, mode))
            if not xs:
                continue
            med = [statistics.median(by_size[s]) for s in xs]
            lo = [m - min(by_size[s]) for m, s in zip(med, xs, strict=True)]
            hi = [max(by_size[s]) - m for m, s in zip(med, xs, strict=True)]
            label = f"{case.removeprefix('peer-')}: {peer} / {ours}"
            ax.errorbar([s[0] for s in xs], med, yerr=[lo, hi], marker="o", ms=4, capsize=3,
                        color=colors(j % 10), label=label)  # fmt: skip
        ax.axhline(1.0, color="black", lw=0.9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (rows per set)")
        title = f"D = {dims}" + (
            "" if (dtype, mode) == ("float32", "eager") else f", {dtype}, {mode}"
        )
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        batches = sorted({s[0] for v in points.values() for s in v})
        ax.set_xticks(batches, [f"{b:,}" for b in batches])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        # label 0.2, 0.5, 2, 5, ... between the decades
        ax.yaxis.set_minor_formatter(
            FuncFormatter(lambda v, _: f"{v:g}×" if f"{v:.0e}"[0] in "25" else "")
        )
        ax.tick_params(axis="y", which="minor", labelsize=7)
    axes[0][0].set_ylabel("peer time / pmlfunc time")
    fig.suptitle("Peer time / pmlfunc time per step (below 1×: the peer is faster)", fontsize=10)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.15 + 0.2 * legend_rows) / height, 1, 1))
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def _provenance(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        env, cfg = run["environment"], run["config"]
        peers = env.get("peers") or {}
        with_peers = ", ".join(f"{k} {v}" for k, v in peers.items() if v)
        lines.append(
            f"- `{Path(run['path']).name}`: torch {env.get('torch')}, Python {env.get('python')}, "
            f"{env.get('platform')}, {env.get('cuda_device') or env.get('processor')}, git "
            f"`{(env.get('git_revision') or 'unknown')[:12]}`, {env.get('time')}; batch "
            f"{cfg['batch_size']}, {cfg['dimensions']} dims, {cfg['samples_per_class']} per class, "
            f"{cfg['dtype']}, {cfg['threads']} thread(s), {cfg['repeats']} repeats after "
            f"{cfg['warmup']} warmup steps, device {cfg['device']}"
            + (f"; {with_peers}" if with_peers else "")
        )
    return lines


def peers_page(
    runs: list[dict[str, Any]], title: str, command: str | None = None, chart: str | None = None
) -> str:
    """The page of ``--peers``: how the peers are compared, the command, the tables
    (:func:`peers_markdown`) and the runs' provenance."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["The runs (from the repository root):", "", "```bash", command.strip(), "```",
                  "", "then this page: `python -m benchmarks.report <the runs' JSON files> "
                  "--peers --output <dir> --name <name> --command <the runs' command>` (the whole "
                  "line: `benchmarks/README.md`, Peers).", ""]  # fmt: skip
    lines += [
        "Each group holds a peer library's loss, the pmlfunc member computing the same loss on",
        "the same inputs, and the matmul floor `(E @ E.T).sum()` (one `N × N` product and its",
        "backward); before a peer is timed its loss and every gradient are checked equal to the",
        "pmlfunc member's (rtol 1e-4 in float32). What each group compares:",
        "`benchmarks/cases/bench_peers.py`; how the peers are loaded: `benchmarks/peers.py`",
        "(both in the repository).",
        "",
        *peers_markdown(runs, chart),
        "",
        "## Provenance",
        "",
        *_provenance(runs),
    ]
    return "\n".join(lines) + "\n"


_TOOK = re.compile(r"one step took ([0-9.]+) s")


def speedups(runs: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """Per ``(batch, dtype, mode)`` and per loss row (the case, with the variant for cases
    measured as several pmlfunc variants): ``speedup`` (PML / pmlfunc median), ``lower_bound``
    (True when PML was skipped as too slow: its one timed step stands in for its median) and
    ``floor_ratio`` (pmlfunc / floor median). Missing values are None."""
    by_group: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows(runs):
        by_group[(row["batch"], row["dtype"], row["mode"])][row["case"]][row["impl"]] = row
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for key, cases in by_group.items():
        points: dict[str, dict[str, Any]] = {}
        for case, impls in cases.items():
            pml, floor = impls.get("pml"), impls.get("floor")
            pml_ms, bound = None, False
            if pml and pml["status"] == "ok":
                pml_ms = pml["median_ms"]
            elif pml and (m := _TOOK.search(pml.get("reason") or "")):
                pml_ms, bound = float(m.group(1)) * 1000.0, True
            floor_ms = floor["median_ms"] if floor and floor["status"] == "ok" else None
            ours = {i: r for i, r in impls.items() if i == "pmlfunc" or i.startswith("pmlfunc-")}
            for impl, r in sorted(ours.items()):
                label = case if impl == "pmlfunc" else f"{case} ({impl.removeprefix('pmlfunc-')})"
                ms = r["median_ms"] if r["status"] == "ok" else None
                points[label] = {
                    "speedup": pml_ms / ms if pml_ms and ms else None,
                    "lower_bound": bound,
                    "floor_ratio": ms / floor_ms if ms and floor_ms else None,
                }
        out[key] = points
    return out


def _series_label(key: tuple, keys: list[tuple]) -> str:
    return _varying(f"batch {key[0]}", key, keys, (1, 2))


def _order(data: dict[tuple, dict[str, dict[str, Any]]]) -> tuple[list[tuple], list[str]]:
    """Series (largest float32 eager batch last) and loss rows, fastest speed-up at the largest
    batch first (rows without a speed-up last, by their floor ratio)."""
    measured = [k for k, points in data.items() if any(
        p["speedup"] or p["floor_ratio"] for p in points.values())]  # fmt: skip
    keys = sorted(measured, key=lambda k: (k[1] == "float32" and k[2] == "eager", k[0], k[1], k[2]))
    labels = sorted({label for k in keys for label in data[k]})

    def rank(label: str) -> tuple:
        for key in reversed(keys):
            p = data[key].get(label)
            if p and p["speedup"]:
                return (0, -p["speedup"])
        for key in reversed(keys):
            p = data[key].get(label)
            if p and p["floor_ratio"]:
                return (1, p["floor_ratio"])
        return (2, 0.0)

    return keys, sorted(labels, key=lambda label: (rank(label), label))


def summary_text(runs: list[dict[str, Any]]) -> list[str]:
    """One line per series: on how many losses pmlfunc is faster than PML, the median speed-up
    and the median time over the floor."""
    data = speedups(runs)
    keys, _ = _order(data)
    lines = []
    for key in reversed(keys):
        points = list(data[key].values())
        values = sorted(p["speedup"] for p in points if p["speedup"])
        floors = sorted(p["floor_ratio"] for p in points if p["floor_ratio"])
        if not values and not floors:
            continue
        line = f"- {_series_label(key, keys).capitalize()}:"
        if values:
            bounds = sum(1 for p in points if p["speedup"] and p["lower_bound"])
            faster = sum(v > 1 for v in values)
            line += (
                f" pmlfunc is faster than PML on {faster} of {len(values)} losses, median "
                f"speed-up {'at least ' if bounds else ''}{_ratio(_median(values), 1.0)}"
            )
            if bounds:
                line += f" ({bounds} with PML stopped after one step over the time limit)"
            line += ";" if floors else "."
        if floors:
            line += f" median {_ratio(_median(floors), 1.0)} the matmul floor's time."
        lines.append(line)
    return lines


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else math.sqrt(values[n // 2 - 1] * values[n // 2])


def summary_chart(runs: list[dict[str, Any]], path: Path, title: str | None = None) -> Path | None:
    """The lead chart of the page (see the module docstring); None when no run has both a PML
    and a pmlfunc time or a floor time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    data = speedups(runs)
    keys, labels = _order(data)
    if not keys:
        return None
    # float32 eager: one blue per batch size, light (small) to dark (large); other dtypes and
    # modes: oranges, as diamonds.
    main = [k for k in keys if (k[1], k[2]) == ("float32", "eager")]
    other = [k for k in keys if k not in main]
    style = {k: (plt.get_cmap("Blues")(0.45 + 0.5 * j / max(len(main) - 1, 1)), "o")
             for j, k in enumerate(main)}  # fmt: skip
    style |= {k: (plt.get_cmap("Oranges")(0.55 + 0.4 * j / max(len(other) - 1, 1)), "D")
              for j, k in enumerate(other)}  # fmt: skip
    height = 1.9 + 0.25 * len(labels)
    fig, (ax_pml, ax_floor) = plt.subplots(
        1, 2, figsize=(9.6, height), sharey=True, gridspec_kw={"width_ratios": [3, 2]}
    )
    ys = {label: len(labels) - 1 - i for i, label in enumerate(labels)}
    spread = 0.3 if len(keys) > 1 else 0.0
    offsets = {k: spread * (j / max(len(keys) - 1, 1) - 0.5) for j, k in enumerate(keys)}
    handles = {}
    for key in keys:
        color, marker = style[key]
        for label, p in data[key].items():
            y = ys[label] - offsets[key]
            if p["speedup"]:
                face = "white" if p["lower_bound"] else color
                ax_pml.plot(p["speedup"], y, marker, ms=5.5, color=color, mfc=face)
            if p["floor_ratio"]:
                ax_floor.plot(p["floor_ratio"], y, marker, ms=5.5, color=color)
        handles[key] = Line2D(
            [], [], ls="", marker=marker, color=color, label=_series_label(key, keys)
        )
    legend = [handles[k] for k in (*main, *other)]
    if any(p["lower_bound"] for points in data.values() for p in points.values()):
        legend.append(
            Line2D([], [], ls="", marker="o", color="grey", mfc="white",
                   label="at least this (PML stopped after one slow step)")
        )  # fmt: skip
    from matplotlib.ticker import FuncFormatter

    times = FuncFormatter(lambda v, _: f"{v:g}×")
    for ax in (ax_pml, ax_floor):
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.9)
        ax.grid(True, axis="x", which="major", alpha=0.35)
        ax.grid(True, axis="y", alpha=0.12)
        ax.set_ylim(-0.7, len(labels) - 0.3)
        ax.tick_params(axis="x", which="both", top=True, labeltop=True)
        ax.xaxis.set_major_formatter(times)
    ax_pml.set_yticks(range(len(labels)), list(reversed(labels)))
    lo, hi = ax_pml.get_xlim()
    ax_pml.set_xlim(min(lo, 0.5), max(hi, 2.0))
    lo, hi = ax_floor.get_xlim()
    ax_floor.set_xlim(min(lo, 0.8), max(hi, 10.0))
    ax_pml.set_title("pmlfunc's speed-up over PML 2.9.0\n(PML time / pmlfunc time; right of 1×: faster)",
                     fontsize=10)  # fmt: skip
    ax_floor.set_title("pmlfunc's time over the matmul floor\n((E @ E.T).sum(); 1× = the floor)",
                       fontsize=10)  # fmt: skip
    legend_rows = math.ceil(len(legend) / 3)
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, (0.15 + 0.22 * legend_rows) / height, 1, 1))
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


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
    p.add_argument(
        "--peers",
        action="store_true",
        help="write the peers page only: peer / pmlfunc per group and size over several runs",
    )
    args = p.parse_args(argv)
    runs = load(args.runs)
    args.output.mkdir(parents=True, exist_ok=True)
    md = args.output / (f"{args.name}.md" if args.name else "README.md")
    table = args.output / (f"{args.name}.csv" if args.name else "results.csv")
    prefix = f"{args.name}-" if args.name else ""
    # the peers page's chart is NAME.svg; the main page's, [NAME-]peers.svg
    chart_name = f"{args.name}.svg" if args.peers and args.name else f"{prefix}peers.svg"
    chart = peers_chart(runs, args.output / chart_name)
    if args.peers:
        if chart is None:
            raise SystemExit("no run holds a peer library's member (benchmarks.run --case peers)")
        md.write_text(peers_page(runs, args.title, args.command, chart.name))
        write_csv(runs, table)
        print(f"wrote {md}, {table} and {chart}")
        return [md, table, chart]
    summary = summary_chart(runs, args.output / f"{prefix}summary.svg")
    text = markdown(
        runs,
        args.title,
        args.command,
        summary=summary.name if summary else None,
        peers=chart.name if chart else None,
    )
    svgs = charts(runs, args.output, prefix)
    if svgs:
        text += "\n## Scaling\n\n" + "\n".join(f"![{s.stem}]({s.name})" for s in svgs) + "\n"
    md.write_text(text)
    write_csv(runs, table)
    print(f"wrote {md}, {table}, {'a summary chart and ' if summary else ''}{len(svgs)} chart(s)")
    return [md, table, *([summary] if summary else []), *([chart] if chart else []), *svgs]


if __name__ == "__main__":
    main()
