"""One command that proves the GPU claims: CUDA tests, benchmarks beside PML, capacity, a report.

    python -m benchmarks.gpu_check --output DIR [--budget-seconds 480] [--dry-run]

On a CUDA machine it runs these steps in this order, most valuable first, within
``--budget-seconds`` (the whole command, report included):

1. ``environment``: Python, PyTorch, CUDA, Triton, PML, optree and numpy versions, the GPU and
   its memory, and every package the later steps need that cannot be imported;
2. ``cuda-tests``: ``pytest -m cuda tests/test_cuda.py``: every loss family, miners, the tiled
   and chunked paths and a whole training step captured in CUDA graphs and replayed with new
   data equal to eager, the bfloat16 safe Euclidean distance against float64, no host sync in
   a step, a loss compiled with ``mode="reduce-overhead"``;
3. ``benchmarks``: the seed cases (:data:`SEED_CASES`: the reference protocol's default run plus
   SupCon, MultiSimilarity and batch-hard triplet, and CLIP and SigLIP dense beside tiled) at batches 512 and 2,048, float32 and
   bfloat16, pmlfunc beside PML 2.9.0 and the matmul floor, with ``benchmarks.run``'s
   measurement shortened to 5 warm-up and 20 measured steps: every eager and CUDA-graph entry
   first, then the compiled entries (each compilation takes tens of seconds);
4. ``capacity``: the largest NT-Xent batch under 90% of the GPU's memory (``benchmarks.capacity``)
   for PML, pmlfunc (dense) and pmlfunc tiled (``chunk_size=256``), the step's time split among
   the three searches;

and writes ``DIR/gpu_check.json`` (everything), ``DIR/<gpu>.md`` (the report, laid out as
``docs/benchmarks/cpu.md``), ``DIR/<gpu>.csv`` and ``DIR/gpu_check.log`` (every child
process's output) after every step and while the long ones run, so that a run cut off at any
point still reports what it did. Each step is recorded as ``done``, ``failed`` (it ran and
something failed: the report says what), ``cut off`` (its time ran out; what it finished is
kept) or ``skipped`` (not started, with the reason); a failing step never stops the plan.

Budget: step ``i`` may use ``min(share_i × budget, time left − REPORT_RESERVE_S)`` seconds
(:data:`STEPS` lists the shares); a step that would get less than its minimum is skipped, and
time a step leaves unused goes to the next. Inside the benchmark step an entry is not started
when less than its mode's minimum is left; inside the capacity step each search gets an equal
part of what is left. Every step runs in child processes (their process groups are ended at
the step's deadline), so a hung or crashed CUDA context costs one step, not the run; a
benchmark worker whose CUDA context broke is replaced by a fresh one for the entries left.
SIGTERM ends the running child, marks its step ``cut off`` and writes the report.

``--dry-run`` runs the same plan on CPU at tiny sizes in seconds (a test does it, so the kit
cannot rot): the CUDA tests are collected and reported skipped, the benchmark entries run on
CPU (compiled with the ``eager`` backend, for the first configuration only; CUDA-graph entries
skipped), the capacity step is skipped. Without CUDA and without ``--dry-run`` the command
writes a report that says so and exits with status 2.

``python -m benchmarks.gpu_check --from-json DIR/gpu_check.json --output docs/benchmarks``
renders the page again elsewhere, with ``--charts`` the scaling charts too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 480.0
REPORT_RESERVE_S = 10.0  # kept for the last report
WORKER_MARGIN_S = 3.0  # a benchmark worker stops starting entries this long before its deadline
LOG_TAIL_BYTES = 256 * 1024  # of each child's output, in gpu_check.log
TICK_S = 10.0  # partial results are saved this often while a child runs
MAX_WORKERS = 3  # benchmark workers started in one step (a broken CUDA context needs a fresh one)

# The reference protocol's default run (contrastive, all-triplet, NT-Xent, pair miner, mined
# triplet, proxy), the release matrix's SupCon, MultiSimilarity and batch-hard triplet, and the
# tiled engine beside the dense path (CLIP, SigLIP; last: the least established claim).
SEED_CASES = (
    "contrastive",
    "all-triplet",
    "ntxent",
    "supcon",
    "multi_similarity",
    "pair-miner",
    "mined-triplet",
    "batch-hard-triplet",
    "proxy",
    "tiled-clip",
    "tiled-siglip",
)
BENCH_MODES = ("eager", "cudagraph", "compile")
STICKY_CUDA_ERRORS = ("CUDA error", "CUBLAS_STATUS", "cudaError", "device-side assert")
NEEDED = (
    "torch",
    "pmlfunc",
    "optree",
    "numpy",
    "pytest",
    "pytest_benchmark",
    "pytorch_metric_learning",
    "tqdm",
)


@dataclass(frozen=True)
class Settings:
    """What a plan measures. :data:`FULL` on a GPU, :data:`DRY` for ``--dry-run``."""

    device: str
    batches: tuple[int, ...]
    dtypes: tuple[str, ...]
    dimensions: int = 128
    samples_per_class: int = 4
    repeats: int = 20
    warmup: int = 5
    max_step_seconds: float = 10.0
    compile_backend: str = "inductor"
    compile_configs: int | None = None  # leading (dtype, batch) configs compiled; None: all
    # An entry is not started with less than this left in the step (by mode).
    min_job_seconds: dict[str, float] = field(
        default_factory=lambda: {"eager": 2.0, "cudagraph": 2.0, "compile": 20.0}
    )
    # NT-Xent capacity searches: (implementation, first batch, ceiling).
    capacity: tuple[tuple[str, int, int], ...] = (
        ("pml", 512, 1 << 20),
        ("pmlfunc", 16384, 1 << 20),
        ("pmlfunc-tiled", 32768, 1 << 18),
    )
    capacity_min_seconds: float = 15.0
    budget_fraction: float = 0.9


FULL = Settings(device="cuda", batches=(512, 2048), dtypes=("float32", "bfloat16"))
DRY = replace(
    FULL,
    device="cpu",
    batches=(32, 64),
    dimensions=8,
    repeats=2,
    warmup=1,
    compile_backend="eager",
    compile_configs=1,
    min_job_seconds={},
)


# ----------------------------------------------------------------------------------------------
# the plan: steps within a budget
# ----------------------------------------------------------------------------------------------
class Interrupted(Exception):
    """SIGTERM arrived: the running step is cut off and the report written."""


@dataclass
class Outcome:
    """What a step did: ``status`` (``done``, ``failed``, ``cut off``, ``skipped``) and a
    one-line ``summary``."""

    status: str
    summary: str = ""


@dataclass(frozen=True)
class Step:
    """``run(context, deadline)`` -> :class:`Outcome`; the deadline is on the plan's clock.
    ``share``: the most of the budget it may use; ``min_seconds``: it is not started with less."""

    name: str
    title: str
    run: Callable[[Any, float], Outcome]
    share: float
    min_seconds: float


class Plan:
    """Runs steps in order within ``budget`` seconds of ``clock``, recording each one."""

    def __init__(
        self,
        steps: Iterable[Step],
        budget: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        reserve: float = REPORT_RESERVE_S,
    ):
        self.steps = list(steps)
        self.budget, self.clock, self.reserve = budget, clock, reserve
        self.start = clock()
        self.records = [
            {
                "name": s.name,
                "title": s.title,
                "status": "pending",
                "summary": "",
                "seconds": None,
                "allowed_s": None,
            }
            for s in self.steps
        ]

    def remaining(self) -> float:
        return self.budget - (self.clock() - self.start)

    def allowance(self, step: Step) -> float:
        """Seconds ``step`` may use if it starts now."""
        return min(step.share * self.budget, self.remaining() - self.reserve)

    def execute(self, context: Any, on_update: Callable[[], None] = lambda: None) -> list[dict]:
        for step, record in zip(self.steps, self.records, strict=True):
            allowed = self.allowance(step)
            record["allowed_s"] = round(max(allowed, 0.0), 1)
            if allowed < step.min_seconds:
                record.update(
                    status="skipped",
                    summary=f"not started: {max(self.remaining(), 0):.0f} s of the budget left, "
                    f"it needs at least {step.min_seconds:.0f} s",
                )
                on_update()
                continue
            record["status"] = "running"
            on_update()
            began = self.clock()
            try:
                outcome = step.run(context, began + allowed)
            except Interrupted:
                record.update(status="cut off", summary="interrupted (SIGTERM)")
                record["seconds"] = round(self.clock() - began, 1)
                for later in self.records:
                    if later["status"] == "pending":
                        later.update(status="skipped", summary="not started: interrupted")
                on_update()
                raise
            except Exception as err:  # recorded; the plan goes on
                outcome = Outcome("failed", f"{type(err).__name__}: {err}"[:500])
                record["traceback"] = traceback.format_exc()[-4000:]
            record.update(
                status=outcome.status,
                summary=outcome.summary,
                seconds=round(self.clock() - began, 1),
            )
            on_update()
        return self.records


# ----------------------------------------------------------------------------------------------
# the context: output files, child processes
# ----------------------------------------------------------------------------------------------
class Context:
    """What the steps share: the settings, the output folder, the JSON document being filled,
    the log, and child processes run in their own process groups with a deadline."""

    def __init__(self, out: Path, settings: Settings, dry_run: bool, doc: dict[str, Any]):
        self.out, self.settings, self.dry_run, self.doc = out, settings, dry_run, doc
        self.clock: Callable[[], float] = time.monotonic
        self.cuda = False  # set by the environment step
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")
        self._children = 0
        self._running: subprocess.Popen | None = None

    def log(self, line: str, echo: bool = True) -> None:
        with self.log_path.open("a") as f:
            f.write(line + "\n")
        if echo:
            print(line, flush=True)

    def wall(self, deadline: float) -> float:
        """``deadline`` (on :attr:`clock`) as a ``time.time()`` epoch, for child processes."""
        return time.time() + (deadline - self.clock())

    def child(
        self,
        title: str,
        args: list[str],
        deadline: float,
        env: dict[str, str] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> tuple[int | None, bool]:
        """Run ``python args...`` in the repository root until it ends or ``deadline``:
        ``(returncode, timed_out)``; its output goes to the log."""
        self._children += 1
        out_path = self.tmp / f"child-{self._children}.log"
        child_env = {**os.environ, **(env or {})}
        if self.dry_run:  # CPU only, even on a machine with a GPU
            child_env["CUDA_VISIBLE_DEVICES"] = ""
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        cmd = [sys.executable, *args]
        began = time.monotonic()
        rc, timed_out = None, False
        with out_path.open("w") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
            self._running = proc
            try:
                while True:
                    left = deadline - self.clock()
                    if left <= 0:
                        timed_out = True
                        break
                    try:
                        rc = proc.wait(timeout=min(TICK_S, left))
                        break
                    except subprocess.TimeoutExpired:
                        if on_tick is not None:
                            on_tick()
            finally:
                self._running = None
                end_group(proc)
        seconds = time.monotonic() - began
        state = "timed out" if timed_out else f"exit status {rc}"
        self.log(f"== {title}: {' '.join(cmd[1:])} ({state}, {seconds:.1f} s)", echo=False)
        with out_path.open("rb") as f:
            f.seek(max(0, out_path.stat().st_size - LOG_TAIL_BYTES))
            self.log(f.read().decode("utf-8", "replace"), echo=False)
        return rc, timed_out

    def interrupt(self, *_: Any) -> None:
        """SIGTERM: end the running child and cut off the step."""
        if self._running is not None:
            end_group(self._running)
        raise Interrupted()

    def save(self) -> None:
        """Write the JSON, the Markdown page and the CSV as they stand."""
        self.doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        name = page_name(self.doc)
        write_atomic(self.out / "gpu_check.json", json.dumps(self.doc, indent=1))
        write_atomic(self.out / f"{name}.md", render(self.doc))
        from . import report

        csv_path = self.out / f"{name}.csv"
        report.write_csv(self.doc.get("runs", []), csv_path)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def end_group(proc: subprocess.Popen) -> None:
    """End a child started in its own session, and everything it started (compile workers
    outlive it otherwise)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file (a line being written is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


# ----------------------------------------------------------------------------------------------
# step 1: the environment
# ----------------------------------------------------------------------------------------------
def environment_info() -> dict[str, Any]:
    """Versions and the device, in the process that reports them (a child: it initialises CUDA)."""
    import importlib
    import platform

    import torch

    from .run import git_revision

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "git_revision": git_revision(),
    }
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
        )
    missing = []
    for module in (*NEEDED, "triton"):
        try:
            mod = importlib.import_module(module)
        except Exception:  # any import failure counts as missing
            if module != "triton" or info["cuda_available"]:
                missing.append(module)
            continue
        info[f"version_{module}"] = getattr(mod, "__version__", None)
    info["missing"] = missing
    return info


def environment_step(ctx: Context, deadline: float) -> Outcome:
    path = ctx.tmp / "environment.json"
    rc, timed_out = ctx.child(
        "environment",
        ["-m", "benchmarks.gpu_check", "--worker", "env", "--events", str(path)],
        deadline,
    )
    if timed_out or rc != 0 or not path.exists():
        return Outcome("cut off" if timed_out else "failed", "could not start torch: see the log")
    env = json.loads(path.read_text())
    ctx.doc["environment"] = env
    ctx.cuda = bool(env["cuda_available"]) and not ctx.dry_run
    summary = environment_line(env)
    if env["missing"]:
        return Outcome("failed", f"{summary}; cannot import {', '.join(env['missing'])}")
    return Outcome("done", summary)


def environment_line(env: dict[str, Any]) -> str:
    device = (
        f"{env['device']} ({env['memory_gib']} GiB, sm {env['capability']})"
        if env.get("device")
        else "no CUDA device"
    )
    parts = [f"{device}", f"torch {env['torch']} (CUDA {env['cuda']})", f"Python {env['python']}"]
    for label, key in (
        ("Triton", "triton"),
        ("PML", "pytorch_metric_learning"),
        ("optree", "optree"),
        ("numpy", "numpy"),
    ):
        if env.get(f"version_{key}"):
            parts.append(f"{label} {env[f'version_{key}']}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# step 2: the CUDA tests
# ----------------------------------------------------------------------------------------------
PYTEST_ARGS = (
    "-m pytest -m cuda tests/test_cuda.py -p benchmarks.pytest_events -p no:cacheprovider -q -rfE"
).split()


def outcomes_of(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per test: ``outcome`` (``passed``, ``failed``, ``error``, ``skipped``), seconds, message."""
    tests: dict[str, dict[str, Any]] = {}
    for e in events:
        t = tests.setdefault(e["nodeid"], {"outcome": "passed", "seconds": 0.0, "message": None})
        t["seconds"] = round(t["seconds"] + e.get("duration", 0.0), 3)
        if e["outcome"] == "failed":
            t["outcome"] = "failed" if e["when"] == "call" else "error"
            t["message"] = e.get("message")
        elif e["outcome"] == "skipped" and t["outcome"] == "passed":
            t["outcome"] = "skipped"
            t["message"] = e.get("message")
    return tests


def counts_of(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    out = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for t in tests.values():
        out[t["outcome"]] += 1
    return out


def tests_step(ctx: Context, deadline: float) -> Outcome:
    events_path = ctx.tmp / "pytest-events.jsonl"

    def collect(rc: int | None = None, timed_out: bool = False) -> dict[str, Any]:
        tests = outcomes_of(read_jsonl(events_path))
        ctx.doc["tests"] = {
            "command": "python " + " ".join(PYTEST_ARGS),
            "returncode": rc,
            "timed_out": timed_out,
            "counts": counts_of(tests),
            "tests": tests,
        }
        return ctx.doc["tests"]

    def tick() -> None:
        collect()
        ctx.save()

    rc, timed_out = ctx.child(
        "cuda tests",
        PYTEST_ARGS,
        deadline,
        env={"PMLFUNC_PYTEST_EVENTS": str(events_path)},
        on_tick=tick,
    )
    result = collect(rc, timed_out)
    n = result["counts"]
    line = ", ".join(f"{v} {k}" for k, v in n.items() if v) or "no test ran"
    if timed_out:
        return Outcome("cut off", f"{line} before the step's time ran out")
    if n["failed"] or n["error"] or rc not in (0, 5):
        return Outcome("failed", f"{line} (pytest exit status {rc})")
    if not ctx.cuda:
        why = "dry run" if ctx.dry_run else "no CUDA device"
        return Outcome("skipped", f"{why}: {line} (pytest -m cuda collects them and skips)")
    return Outcome("done", line)


# ----------------------------------------------------------------------------------------------
# step 3: the benchmarks
# ----------------------------------------------------------------------------------------------
def bench_configs(settings: Settings) -> list[tuple[int, str]]:
    """``(batch, dtype)`` pairs in measuring order: float32 first, small batches first."""
    return [(b, d) for d in settings.dtypes for b in settings.batches]


def bench_jobs(settings: Settings, cases: Iterable[str] = SEED_CASES) -> list[dict[str, Any]]:
    """Every entry the benchmark step measures, most valuable first: for each configuration
    every eager entry and every CUDA-graph one (pmlfunc and floor), then the compiled ones
    (every pmlfunc loss of a configuration before its floors)."""
    from .cases import library, registry

    table = registry()
    configs = bench_configs(settings)
    compiled = configs[: settings.compile_configs] if settings.compile_configs else configs
    plan = [(cfg, mode) for cfg in configs for mode in ("eager", "cudagraph")]
    plan += [(cfg, "compile") for cfg in compiled]
    jobs = []
    for (batch, dtype), mode in plan:
        members = [(case, impl) for case in cases for impl in table[case].members]
        if mode != "eager":  # PML is measured eager only; compiled floors after every loss
            members = [m for m in members if library(m[1]) != "pml"]
            members.sort(key=lambda m: library(m[1]) == "floor" and mode == "compile")
        for case, impl in members:
            key = f"b{batch}/{dtype}/{mode}/{case}/{impl}"
            jobs.append(dict(key=key, batch=batch, dtype=dtype, mode=mode, case=case, impl=impl))
    return jobs


def run_jobs(
    jobs: list[dict[str, Any]],
    measure_one: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    deadline: float,
    clock: Callable[[], float],
    emit: Callable[[dict[str, Any]], None],
    min_seconds: dict[str, float],
) -> int:
    """The worker's loop: each job is measured unless less than its mode's minimum is left
    (``skipped`` event). A ``start`` event precedes each measurement, a ``result`` event
    follows it. Returns 3 after an entry whose error breaks the CUDA context (a fresh worker
    must go on), else 0."""
    for job in jobs:
        if clock() + min_seconds.get(job["mode"], 0.0) > deadline:
            emit({"event": "skipped", "key": job["key"]})
            continue
        emit({"event": "start", "key": job["key"]})
        record = measure_one(job)
        emit({"event": "result", "key": job["key"], "record": record})
        reason = record.get("reason") or ""
        if record["status"] == "error" and any(s in reason for s in STICKY_CUDA_ERRORS):
            return 3
    return 0


def run_args(settings: Settings, batch: int, dtype: str, modes: Iterable[str]):
    """``benchmarks.run``'s arguments for one configuration."""
    from .run import parse

    s = settings
    return parse(
        f"--batch-size {batch} --dtype {dtype} --device {s.device} --dimensions {s.dimensions} "
        f"--samples-per-class {s.samples_per_class} --repeats {s.repeats} --warmup {s.warmup} "
        f"--max-step-seconds {s.max_step_seconds} --compile-backend {s.compile_backend} "
        f"--mode {','.join(modes)} --quiet".split()
    )


def bench_worker(jobs_path: Path, events_path: Path, deadline: float) -> int:
    """In a child process: measure the jobs of ``jobs_path`` until ``deadline`` (epoch)."""

    from .cases import registry
    from .run import environment, measure

    spec = json.loads(jobs_path.read_text())
    settings = settings_from(spec["settings"])
    table = registry()

    def emit(event: dict[str, Any]) -> None:
        with events_path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    def measure_one(job: dict[str, Any]) -> dict[str, Any]:
        args = run_args(settings, job["batch"], job["dtype"], [job["mode"]])
        return measure(table[job["case"]], job["impl"], args, job["mode"])

    emit({"event": "environment", "environment": environment()})
    return run_jobs(
        spec["jobs"],
        measure_one,
        deadline=deadline - WORKER_MARGIN_S,
        clock=time.time,
        emit=emit,
        min_seconds=settings.min_job_seconds,
    )


def not_measured(
    job: dict[str, Any], status: str, reason: str, reached: bool = True
) -> dict[str, Any]:
    """The record of an entry without measurements (``reached=False``: the time ran out)."""
    from .cases import library

    lib = library(job["impl"])
    return dict(case=job["case"], impl=job["impl"], library=lib, mode=job["mode"], status=status,
                reason=reason, extra={}, reached=reached)  # fmt: skip


def entry_kind(record: dict[str, Any] | None) -> str:
    """``measured``, ``failed``, ``skipped by rule`` (PML's memory limit, CUDA graphs without
    CUDA, ...) or ``not reached`` (the step's time ran out first)."""
    if record is None or not record.get("reached", True):
        return "not reached"
    return {"ok": "measured", "error": "failed"}.get(record["status"], "skipped by rule")


def bench_runs(
    settings: Settings, jobs: list[dict], results: dict[str, dict], env: dict | None
) -> list[dict[str, Any]]:
    """One ``benchmarks.run`` document per configuration (what ``benchmarks.report`` reads);
    jobs without a result are listed as not reached."""
    from .run import run_document

    runs = []
    for batch, dtype in bench_configs(settings):
        mine = [j for j in jobs if (j["batch"], j["dtype"]) == (batch, dtype)]
        modes = list(dict.fromkeys(j["mode"] for j in mine))
        records = [
            results.get(j["key"])
            or not_measured(j, "skipped", "not reached: the step's time ran out", reached=False)
            for j in mine
        ]
        doc = run_document(run_args(settings, batch, dtype, modes), records, env or {})
        doc["path"] = f"gpu_check.json: batch {batch}, {dtype}"
        runs.append(doc)
    return runs


def benchmarks_step(ctx: Context, deadline: float) -> Outcome:
    if not ctx.cuda and not ctx.dry_run:
        return Outcome("skipped", "no CUDA device")
    settings = ctx.settings
    jobs = bench_jobs(settings)
    results: dict[str, dict[str, Any]] = {}
    env: dict[str, Any] = {}
    events_path = ctx.tmp / "bench-events.jsonl"

    def ingest(final: bool = False, timed_out: bool = False, rc: int | None = None) -> None:
        by_key = {j["key"]: j for j in jobs}
        started = None
        for e in read_jsonl(events_path):
            if e["event"] == "environment":
                env.update(e["environment"])
            elif e["event"] == "result":
                results[e["key"]] = e["record"]
            elif e["event"] == "skipped":
                results[e["key"]] = not_measured(
                    by_key[e["key"]],
                    "skipped",
                    "not started: too little of the step's time left",
                    reached=False,
                )
            elif e["event"] == "start":
                started = e["key"]
        if final and started is not None and started not in results:
            if timed_out:
                why = "cut off: the step's time ran out during this entry"
                results[started] = not_measured(by_key[started], "skipped", why, reached=False)
            else:
                why = f"the worker process ended during this entry (exit status {rc})"
                results[started] = not_measured(by_key[started], "error", why)
        ctx.doc["runs"] = bench_runs(settings, jobs, results, env)

    def tick() -> None:
        ingest()
        ctx.save()

    timed_out = False
    for attempt in range(MAX_WORKERS):
        pending = [j for j in jobs if j["key"] not in results]
        if not pending or deadline - ctx.clock() < WORKER_MARGIN_S + 1:
            break
        jobs_path = ctx.tmp / f"bench-jobs-{attempt}.json"
        jobs_path.write_text(json.dumps({"settings": asdict(settings), "jobs": pending}))
        events_path.unlink(missing_ok=True)
        worker = ["-m", "benchmarks.gpu_check", "--worker", "bench", "--jobs", str(jobs_path),
                  "--events", str(events_path), "--deadline", f"{ctx.wall(deadline):.3f}"]  # fmt: skip
        rc, timed_out = ctx.child(f"benchmark worker {attempt + 1}", worker, deadline, on_tick=tick)
        ingest(final=True, timed_out=timed_out, rc=rc)
        if rc == 0 or timed_out:
            break
    kinds = [entry_kind(results.get(j["key"])) for j in jobs]
    n = {k: kinds.count(k) for k in ("measured", "failed", "skipped by rule", "not reached")}
    line = f"{n['measured']} of {len(jobs)} entries measured, " + ", ".join(
        f"{v} {k}" for k, v in n.items() if k != "measured"
    )
    errors, unreached = n["failed"], n["not reached"]
    if errors:
        return Outcome("failed", line)
    if unreached or timed_out:
        return Outcome("cut off", line)
    return Outcome("done", line)


# ----------------------------------------------------------------------------------------------
# step 4: the capacity search
# ----------------------------------------------------------------------------------------------
def capacity_step(
    ctx: Context, deadline: float, probe: Callable[..., str] | None = None
) -> Outcome:
    if not ctx.cuda:
        return Outcome("skipped", "dry run" if ctx.dry_run else "no CUDA device")
    from . import capacity

    searches = ctx.settings.capacity
    found: list[dict[str, Any]] = []
    ctx.doc["capacity"] = found
    for i, (impl, start, ceiling) in enumerate(searches):
        share = (deadline - ctx.clock()) / (len(searches) - i)
        entry: dict[str, Any] = {"case": "ntxent", "impl": impl, "start": start, "ceiling": ceiling}
        if share < ctx.settings.capacity_min_seconds:
            found.append({**entry, "status": "skipped", "reason": f"{share:.0f} s left for it"})
            continue
        until = ctx.clock() + share
        flags = ["--case", "ntxent", "--impl", impl, "--device", "cuda", "--budget-fraction",
                 str(ctx.settings.budget_fraction), "--dimensions", str(ctx.settings.dimensions)]  # fmt: skip
        args = capacity.parse(flags)
        outputs: list[str] = []

        def run_probe(batch: int, args=args, until=until, outputs=outputs) -> str:
            run = probe or capacity.probe_in_subprocess
            return run(args, batch, timeout=until - ctx.clock(), on_output=outputs.append)

        began = ctx.clock()
        result = capacity.search(
            run_probe,
            start=start,
            ceiling=ceiling,
            multiple=ctx.settings.samples_per_class,
            deadline=until,
            clock=ctx.clock,
        )
        for text in outputs:
            ctx.log(f"== capacity probe ({impl}) output:\n{text[-LOG_TAIL_BYTES:]}", echo=False)
        found.append(
            {
                **entry,
                **result,
                "status": "cut off" if result["cut_off"] else "done",
                "budget_fraction": ctx.settings.budget_fraction,
                "seconds": round(ctx.clock() - began, 1),
            }
        )
        ctx.save()
    line = "; ".join(f"{c['impl']} {capacity_text(c)}" for c in found)
    if any(c["status"] != "done" for c in found):
        return Outcome("cut off", line)
    return Outcome("done", line)


def capacity_text(c: dict[str, Any]) -> str:
    """One search's result in words: the largest batch that fits, and what failed above it."""
    if c["status"] == "skipped":
        return f"skipped ({c['reason']})"
    failed = f"{c['failed_at']:,} failed ({c['failure']})" if c["failed_at"] else ""
    if c["cut_off"]:
        if c["batch"] == 0:
            return "cut off before a batch passed" + (f"; {failed}" if failed else "")
        return f"≥ {c['batch']:,} (cut off" + (f"; {failed})" if failed else ")")
    if c["batch"] == 0:
        return f"nothing fits ({failed})"
    if c["lower_bound"]:
        return f"≥ {c['batch']:,} (the search's ceiling)"
    return f"{c['batch']:,} ({failed})"


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
STEPS = (
    Step("environment", "Environment", environment_step, share=0.10, min_seconds=5),
    Step("cuda-tests", "CUDA tests", tests_step, share=0.35, min_seconds=20),
    Step("benchmarks", "Benchmarks", benchmarks_step, share=0.45, min_seconds=20),
    Step("capacity", "Capacity", capacity_step, share=0.40, min_seconds=20),
)


def page_name(doc: dict[str, Any]) -> str:
    """``h200`` for an NVIDIA H200 (``docs/benchmarks/<gpu>.md``); ``dry-run`` for a dry run."""
    device = (doc.get("environment") or {}).get("device")
    if doc.get("dry_run") or not device:
        return "dry-run" if doc.get("dry_run") else "no-gpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().removeprefix("nvidia ")).strip("-")
    return slug or "gpu"


def summary_table(runs: list[dict[str, Any]]) -> list[str]:
    """Per configuration, one row per case: the medians of every implementation and mode."""
    from .report import _fmt, _ratio, rows

    columns = [
        ("pml", "eager", "PML eager"),
        ("pmlfunc", "eager", "pmlfunc eager"),
        ("pmlfunc", "cudagraph", "pmlfunc CUDA graph"),
        ("pmlfunc", "compile", "pmlfunc compiled"),
        ("floor", "eager", "floor eager"),
        ("floor", "cudagraph", "floor CUDA graph"),
    ]
    lines = []
    table = rows(runs)
    for run in runs:
        cfg = run["config"]
        mine = [r for r in table if (r["batch"], r["dtype"]) == (cfg["batch_size"], cfg["dtype"])]
        if not any(r["status"] == "ok" for r in mine):
            continue
        lines += [
            f"### Batch {cfg['batch_size']:,}, {cfg['dtype']}",
            "",
            "| case | " + " | ".join(c[2] for c in columns) + " | PML / best pmlfunc |",
            "|---" * (len(columns) + 2) + "|",
        ]
        for case in dict.fromkeys(r["case"] for r in mine):
            med = {
                (r["impl"], r["mode"]): r["median_ms"]
                for r in mine
                if r["case"] == case and r["status"] == "ok"
            }
            cells = [_fmt(med.get((impl, mode))) for impl, mode, _ in columns]
            ours = [v for (impl, _), v in med.items() if impl == "pmlfunc" and v is not None]
            best = _ratio(med.get(("pml", "eager")), min(ours)) if ours else "—"
            lines.append(f"| {case} | " + " | ".join(cells) + f" | {best} |")
        lines.append("")
    return lines


def tests_section(tests: dict[str, Any] | None) -> list[str]:
    if not tests:
        return ["## CUDA tests", "", "Not run.", ""]
    n = tests["counts"]
    head = ", ".join(f"{v} {k}" for k, v in n.items()) or "no test reported"
    lines = [
        "## CUDA tests",
        "",
        f"`{tests['command']}`: {head}"
        + (" (cut off by the step's time)" if tests.get("timed_out") else "")
        + ".",
        "",
    ]
    bad = {k: t for k, t in tests["tests"].items() if t["outcome"] in ("failed", "error")}
    for nodeid, t in bad.items():
        message = (t["message"] or "").strip().splitlines()[-25:]
        lines += [
            f"- `{nodeid}` ({t['outcome']}):",
            "",
            "  ```",
            *("  " + m for m in message),
            "  ```",
            "",
        ]
    if tests["tests"]:
        lines += ["| test | outcome | seconds |", "|---|---|---|"]
        for nodeid, t in tests["tests"].items():
            name = nodeid.split("::", 1)[-1]
            lines.append(f"| `{name}` | {t['outcome']} | {t['seconds']:.2f} |")
        lines.append("")
    return lines


def capacity_section(found: list[dict[str, Any]] | None, fraction: float) -> list[str]:
    lines = [f"## Capacity: NT-Xent under {fraction:.0%} of the GPU's memory", ""]
    if not found:
        return [*lines, "Not run.", ""]
    names = {
        "pml": "PML 2.9.0",
        "pmlfunc": "pmlfunc (dense)",
        "pmlfunc-tiled": "pmlfunc tiled (`chunk_size=256`)",
    }
    lines += [
        "The largest batch (128 dimensions, 4 per class, float32) whose forward and backward "
        "ran five times in a fresh process, bracketed to 128 rows or 5% and confirmed twice "
        "(`benchmarks.capacity`); the batch that failed above it and how.",
        "",
        "| implementation | largest batch | probes | seconds |",
        "|---|---|---|---|",
    ]
    for c in found:
        probes = len(c.get("trials", []))
        lines.append(
            f"| {names.get(c['impl'], c['impl'])} | {capacity_text(c)} | {probes} | "
            f"{c.get('seconds', '—')} |"
        )
    return [*lines, ""]


def render(doc: dict[str, Any]) -> str:
    """The Markdown page of a gpu_check document."""
    from .report import markdown

    env = doc.get("environment") or {}
    device = env.get("device") or "CPU"
    title = (
        f"Dry run of the GPU check ({device}, tiny sizes)"
        if doc.get("dry_run")
        else f"{device} benchmarks: pmlfunc beside PML 2.9.0 and the matmul floor"
    )
    steps = doc.get("steps", [])
    lines = [
        "## The GPU check",
        "",
        f"Budget {doc['budget_seconds']:.0f} s, started {doc['started']}, last written "
        f"{doc.get('updated', '—')}." + (f" Environment: {environment_line(env)}." if env else ""),
        "",
        "| step | status | seconds | allowed | result |",
        "|---|---|---|---|---|",
        *(
            f"| {s['title']} | {s['status']} | {s['seconds'] if s['seconds'] is not None else '—'}"
            f" | {s['allowed_s'] if s['allowed_s'] is not None else '—'} | {s['summary']} |"
            for s in steps
        ),
        "",
        "`done`: ran and passed; `failed`: ran, and something failed (below); `cut off`: its "
        "time ran out, what it finished is below; `skipped`: not started (the reason is given); "
        "`pending`/`running`: the run ended before (a report written while it ran).",
        "",
        *tests_section(doc.get("tests")),
        *capacity_section(doc.get("capacity"), doc["settings"]["budget_fraction"]),
        "## Benchmarks: medians (ms per step) side by side",
        "",
        f"The seed cases at {doc['settings']['dimensions']} dimensions, "
        f"{doc['settings']['samples_per_class']} per class, {doc['settings']['warmup']} warm-up "
        f"and {doc['settings']['repeats']} measured steps per entry (the reference protocol "
        "shortened to fit). The full tables follow.",
        "",
        *(summary_table(doc.get("runs", [])) or ["No entry was measured.", ""]),
    ]
    return markdown(doc.get("runs", []), title, doc.get("command"), preamble=lines)


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------
def settings_from(raw: dict[str, Any]) -> Settings:
    raw = dict(raw)
    for key in ("batches", "dtypes"):
        raw[key] = tuple(raw[key])
    raw["capacity"] = tuple(tuple(c) for c in raw["capacity"])
    return Settings(**raw)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, required=True, help="folder for the report and JSON")
    p.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, CUDA steps skipped")
    p.add_argument("--from-json", type=Path, default=None, help="render a gpu_check.json again")
    p.add_argument("--charts", action="store_true", help="with --from-json: scaling charts too")
    return p.parse_args(argv)


def worker(argv: list[str]) -> int:
    """A child process of a running check: ``--worker env`` or ``--worker bench``."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["env", "bench"], required=True)
    p.add_argument("--jobs", type=Path)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--deadline", type=float)
    w = p.parse_args(argv)
    if w.worker == "env":
        w.events.write_text(json.dumps(environment_info()))
        return 0
    return bench_worker(w.jobs, w.events, w.deadline)


def rerender(source: Path, out: Path, charts: bool) -> list[Path]:
    from . import report

    doc = json.loads(source.read_text())
    out.mkdir(parents=True, exist_ok=True)
    name = page_name(doc)
    text = render(doc)
    written = [out / f"{name}.md", out / f"{name}.csv"]
    if charts:
        svgs = report.charts(doc.get("runs", []), out, f"{name}-")
        if svgs:
            text += "\n## Scaling\n\n" + "\n".join(f"![{s.stem}]({s.name})" for s in svgs) + "\n"
        written += svgs
    written[0].write_text(text)
    report.write_csv(doc.get("runs", []), written[1])
    return written


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if "--worker" in raw:
        return worker(raw)
    args = parse(raw)
    if args.from_json is not None:
        for path in rerender(args.from_json, args.output, args.charts):
            print(f"wrote {path}")
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    settings = DRY if args.dry_run else FULL
    shown = " ".join(["python -m benchmarks.gpu_check", *raw])
    doc: dict[str, Any] = {
        "kind": "pmlfunc gpu_check",
        "command": shown,
        "dry_run": args.dry_run,
        "budget_seconds": args.budget_seconds,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": asdict(settings),
        "steps": [],
        "runs": [],
    }
    ctx = Context(args.output, settings, args.dry_run, doc)
    plan = Plan(STEPS, args.budget_seconds)
    doc["steps"] = plan.records
    shown: set[tuple[str, str]] = set()

    def update() -> None:  # the report, and a line on stdout per change of a step's status
        ctx.save()
        for r in plan.records:
            if (r["name"], r["status"]) not in shown:
                shown.add((r["name"], r["status"]))
                print(f"[{plan.budget - plan.remaining():5.0f} s] {r['title']}: {r['status']} "
                      f"{r['summary']}", flush=True)  # fmt: skip

    previous = signal.signal(signal.SIGTERM, ctx.interrupt)
    status = 0
    try:
        plan.execute(ctx, on_update=update)
    except Interrupted:
        status = 124
    finally:
        signal.signal(signal.SIGTERM, previous)
        ctx.save()
        ctx.close()
    for s in plan.records:
        print(f"{s['title']:12s} {s['status']:8s} {s['summary']}")
    print(f"report: {args.output / (page_name(doc) + '.md')}, {args.output / 'gpu_check.json'}")
    if status:
        return status
    if not args.dry_run and not ctx.cuda:
        return 2
    return 1 if any(s["status"] == "failed" for s in plan.records) else 0


if __name__ == "__main__":
    sys.exit(main())
