"""Command-line benchmark runner: every case of the suite, pmlfunc beside PML 2.9.0 and the floor.

    python -m benchmarks.run --batch-size 512 --dimensions 128 --repeats 20 --warmup 5 \\
        --output /tmp/pmlfunc-cpu.json

Flags follow the reference runner (``shared/reference/000_*``, "Development measurements"):
``--batch-size --dimensions --samples-per-class --dtype --threads --repeats --warmup --device
--case --mode --anchor-batch-size --output``; ``--case`` and ``--mode`` take comma-separated
lists (default: every case; ``eager``). Inputs are seeded standard-normal embeddings with
balanced contiguous labels (``benchmarks.common``); each case builds its own.

Modes:

- ``eager``;
- ``compile``: the pmlfunc and floor functions under ``torch.compile(fullgraph=True)``; the
  first step (compilation included) is reported apart (``first_step_ms``). An unsupported
  operation fails that entry (``status: error``), with no eager fallback. PML is not compiled
  (``status: skipped``);
- ``cudagraph``: forward and backward captured in one CUDA graph and replayed (CUDA only;
  elsewhere ``status: skipped`` with the reason).

Peers (``benchmarks/cases/bench_peers.py``, ``--case peers`` for all of them): a peer library's
member (open_clip, sentence-transformers, lightly, optax) is skipped with the reason when its
package is absent (``pip install -e '.[bench-peers]'``), and is measured eager only. Before it is
timed its loss and every gradient are checked equal to its group's pmlfunc member
(``Case.reference``, rtol 1e-4 in float32); an entry that differs is an error with the
difference as its reason, and is not timed. optax computes under jax: its peak memory and FLOPs
are not recorded (``null``). ``environment.peers`` records the peers' versions.

``--toggle MODULE.NAME=V1,V2,...`` (values: Python literals) times every pmlfunc member once
per value of that module attribute, set before each of its steps (and its checking step), the
variants (``IMPL@NAME=V``) timed in the same rounds as the other members: an in-process A/B of
a code path that reads the attribute when called (eager; a compiled graph keeps the value it
was traced with). The attribute is restored afterwards. E.g. the dense tiles' minimum rows::

    python -m benchmarks.run --case tiled-ntxent --impl pmlfunc-full,floor --batch-size 8192 \
        --repeats 3 --warmup 1 --toggle pmlfunc.losses._tiled.DENSE_MIN_ROWS=1,256

``--case distributed`` runs the DDP case of ``benchmarks.distributed`` (one process per device,
under ``torchrun --standalone --nproc_per_node=2 -m benchmarks.run --case distributed``).

Every measured step builds a fresh graph; ``forward_ms`` covers the call, ``backward_ms`` the
gradient (``None`` for mining and anchor-batched entries, which do all their work in the
forward). CUDA synchronises around both intervals. A case's members are timed in rounds, one
step of each per round (``--warmup`` rounds, then ``--repeats``), so that a drift of the
machine's speed falls on PML, pmlfunc and the floor alike. Before timing, each entry is checked once:
a finite loss and gradient, or a valid miner result. The JSON keeps the raw samples, medians,
quartiles, the configuration, versions and the git revision; ``python -m benchmarks.report``
turns runs into tables and charts. ``extra`` per entry: peak memory (CPU: the peak of live
tensor storage one step adds, ``pmlfunc.memory``; CUDA: allocated memory above the pre-forward
baseline), FLOPs of one step (``torch.utils.flop_counter``), and the case's settings.

Some PML 2.9.0 steps cannot run at large batches: its NT-Xent, lifted-structure, tuplet-margin
and mined-pairs-to-triplets paths build a (positive pairs) × (negative pairs) matrix, its PNP a
``B × B × B`` one. Entries whose estimate exceeds ``--pml-memory-limit-gib`` (8) are skipped
with the estimate as the reason, and any entry whose first (checking) step takes more than ``--max-step-seconds`` (60)
is skipped with its time.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import common as C
from . import peers
from .cases import (
    Case,
    Skip,
    library,
    pml_matrix_name,
    pml_pair_matrix_gib,
    reference_mismatch,
    reference_rtol,
    registry,
)

MODES = ("eager", "compile", "cudagraph")
ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "q1": q[0],
        "q3": q[2],
        "mean": statistics.fmean(samples),
    }


class _Step:
    """Forward / backward of one member on fixed inputs (a fresh graph each call)."""

    def __init__(self, member, fn, params, emb, labels):
        self.member, self.fn, self.params, self.emb, self.labels = member, fn, params, emb, labels

    def forward(self):
        if self.member.kind == "mine":
            with torch.no_grad():
                return self.fn(self.emb, self.labels)
        return self.fn(self.emb, self.labels)

    def backward(self, out):
        if self.member.kind != "loss":
            return None
        return torch.autograd.grad(out, [self.emb, *self.params])

    def check(self, out, grads) -> float | None:
        kind = self.member.kind
        if kind == "mine":
            mined = out.to_indices() if hasattr(out, "to_indices") else out
            if isinstance(mined, torch.Tensor):  # the mining floor
                if not torch.isfinite(mined).all():
                    raise RuntimeError("non-finite result")
                return None
            for t in mined:
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.emb.shape[0]):
                    raise RuntimeError("miner index out of range")
            return None
        loss, grad = out if kind == "value_and_grad" else (out, grads[0])
        if loss.ndim != 0 or not torch.isfinite(loss):
            raise RuntimeError(f"loss is not a finite scalar: {loss}")
        if not torch.isfinite(grad).all():
            raise RuntimeError("non-finite gradient")
        return float(loss.detach())


def _one_step(step: _Step):
    return lambda: step.backward(step.forward())


def _result(step: _Step) -> tuple[Any, Any]:
    """One eager step's output and gradients, detached."""
    out = step.forward()
    grads = step.backward(out)
    return _detached(out), _detached(grads)


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a miner's NamedTuple
        return type(x)(*(_detached(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x


def mismatch(
    kind: str, ref: tuple[Any, Any], got: tuple[Any, Any], dtype: torch.dtype
) -> str | None:
    """How a step's ``(output, gradients)`` differs from the reference ``ref`` (``None``: within
    the parity tolerance, relative to each tensor's largest entry). Miners are not compared."""
    if kind == "mine":
        return None
    (ref_out, ref_grads), (out, grads) = ref, got
    if kind == "loss":
        pairs = [("loss", ref_out, out)]
        pairs += [
            (f"gradient {i}", r, g) for i, (r, g) in enumerate(zip(ref_grads, grads, strict=True))
        ]
    else:  # value_and_grad: the output is (loss, gradient)
        pairs = [("loss", ref_out[0], out[0]), ("gradient", ref_out[1], out[1])]
    rtol = C.parity_rtol(dtype)
    for name, r, g in pairs:
        r, g = r.detach().double(), g.detach().double()
        err, scale = float((g - r).abs().max()), float(r.abs().max())
        if not err <= rtol * scale + 1e-6:  # NaN fails too
            return f"{name} differs from eager: max |difference| {err:.3g}, max |eager| {scale:.3g}"
    return None


def _graphed(step: _Step, device: torch.device):
    """Capture forward+backward in one CUDA graph; returns a replay function and the captured
    ``(output, gradients)``, which every replay recomputes."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on a side stream before capture
            step.backward(step.forward())
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.forward()
        grads = step.backward(out)
    return graph.replay, (out, grads)


Timer = Callable[[], tuple[float, float]]  # one timed step: (forward ms, backward ms)


def measure(case: Case, impl: str, args, mode: str) -> dict[str, Any]:
    """Time one member of ``case`` in one mode; the record written to the JSON."""
    record, timer = prepare(case, impl, args, mode)
    return time_rounds([(record, timer)], args)[0]


def prepare(case: Case, impl: str, args, mode: str) -> tuple[dict[str, Any], Timer | None]:
    """Everything before the timed steps of one member of ``case`` in one mode: its record
    (skipped, failed, or with the loss, FLOPs, peak memory and the compiled step's check) and,
    when it is to be timed, the timer of one step."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    member, lib = case.members[impl], library(impl)
    record: dict[str, Any] = {
        "case": case.name,
        "impl": impl,
        "library": lib,
        "mode": mode,
        "kind": member.kind,
        "status": "ok",
        "reason": None,
        "extra": dict(case.extra),
    }
    gib = pml_pair_matrix_gib(case, args.batch_size, args.samples_per_class)
    if lib == "pml" and gib > args.pml_memory_limit_gib:
        return _skipped(record, f"PML 2.9.0 would build a {gib:,.0f} GiB {pml_matrix_name(case)}")
    if mode != "eager" and lib == "pml":
        return _skipped(record, f"PML is measured eager only ({mode})")
    if mode != "eager" and lib not in ("pmlfunc", "floor"):
        return _skipped(record, f"the peer libraries are measured eager only ({mode})")
    if mode == "cudagraph" and device.type != "cuda":
        return _skipped(record, "CUDA-graph capture needs CUDA")
    if mode == "cudagraph" and member.kind == "value_and_grad":
        return _skipped(
            record, "anchor-batched steps run Python loops over chunks; capture the loss instead"
        )
    emb, labels = C.make_inputs(
        args.batch_size, args.dimensions, args.samples_per_class, dtype=dtype, device=device
    )
    if member.kind == "mine":
        emb = emb.detach()
    try:
        fn, params = member.make(emb, labels)
    except (peers.PeerUnavailable, Skip) as err:  # a peer not installed, inputs too large for it
        return _skipped(record, str(err))
    step = _Step(member, fn, params, emb, labels)
    try:
        with C.set_threads(args.threads):
            t0 = time.perf_counter()
            out = step.forward()
            grads = step.backward(out)
            record["loss"] = step.check(out, grads)
            first = time.perf_counter() - t0
            reference = None if member.kind == "mine" else (_detached(out), _detached(grads))
            # the first step's graph must not outlive it: a live graph keeps the inputs'
            # AccumulateGrad nodes, made on the default stream, and a CUDA-graph capture that
            # reaches them waits on that stream, which invalidates the capture (seen on an H200,
            # torch 2.11: every cudagraph entry failed, the floor's too)
            del out, grads
            if first > args.max_step_seconds:
                return _skipped(
                    record,
                    f"one step took {first:,.1f} s (> --max-step-seconds "
                    f"{args.max_step_seconds:g})",
                )
            # A peer (a case with a reference member) equals its pmlfunc member, loss and every
            # gradient, before it is timed.
            bad = reference_mismatch(case, impl, emb, labels, reference_rtol(dtype))
            if bad is not None:
                return {**record, "status": "error", "reason": bad}, None
            if case.reference is not None and impl not in (case.reference, "floor"):
                record["checked_against"] = case.reference
            if member.tracked_memory:
                record["flops"] = C.step_flops(_one_step(step))
                record["peak_memory_mib"] = C.step_peak_mib(_one_step(step), device)
            else:  # computed outside torch: the counters would see nothing
                record["flops"] = record["peak_memory_mib"] = None
            # A compiled or replayed step is compared with eager when eager repeats itself (a
            # member that draws a new subset every step cannot be compared).
            comparable = (
                mode != "eager"
                and reference is not None
                and mismatch(member.kind, reference, _result(step), dtype) is None
            )
            got = None
            if mode == "compile":
                step.fn = C.compiled(fn, getattr(args, "compile_backend", "inductor"))
                _sync(device)
                t0 = time.perf_counter()
                got = _result(step)
                _sync(device)
                record["first_step_ms"] = (time.perf_counter() - t0) * 1e3
            replay = None
            if mode == "cudagraph":
                replay, got = _graphed(step, device)
                replay()
                _sync(device)
            if comparable:
                bad = mismatch(member.kind, reference, got, dtype)
                if bad is not None:
                    return {**record, "status": "error", "reason": f"{mode}: {bad}"}, None
                record["checked_against_eager"] = True
            return record, _timer(step, replay, device)
    except Exception as err:  # recorded, never silent: the report shows it
        return _failed(record, err), None


def _skipped(record: dict[str, Any], reason: str) -> tuple[dict[str, Any], None]:
    return {**record, "status": "skipped", "reason": reason}, None


def _failed(record: dict[str, Any], err: Exception) -> dict[str, Any]:
    return {**record, "status": "error", "reason": f"{type(err).__name__}: {err}"[:500]}


class Toggle:
    """One value of ``--toggle``'s module attribute: :meth:`set` puts it, :meth:`restore` puts
    back the value the attribute had when the option was read."""

    def __init__(self, module: Any, name: str, value: Any):
        self.module, self.name, self.value = module, name, value
        self.original = getattr(module, name)

    def set(self) -> None:
        setattr(self.module, self.name, self.value)

    def restore(self) -> None:
        setattr(self.module, self.name, self.original)


def toggles(spec: str | None) -> list[Toggle]:
    """``--toggle MODULE.NAME=V1,V2,...`` read: one :class:`Toggle` a value (none without the
    option); a ``ValueError`` for a module or attribute that does not exist or a value that is
    not a Python literal."""
    if spec is None:
        return []
    target, sep, values = spec.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name or not name or not values:
        raise ValueError(f"--toggle takes MODULE.NAME=V1,V2,...; got {spec!r}")
    try:
        module = importlib.import_module(module_name)
        parsed = [ast.literal_eval(v) for v in values.split(",")]
    except (ImportError, ValueError, SyntaxError) as err:
        raise ValueError(f"--toggle {spec!r}: {err}") from err
    if not hasattr(module, name):
        raise ValueError(f"--toggle {spec!r}: {module_name} has no attribute {name!r}")
    return [Toggle(module, name, v) for v in parsed]


def toggled(case: Case, impl: str, args, mode: str, toggle: Toggle) -> tuple[dict, Timer | None]:
    """:func:`prepare` of ``impl`` with ``toggle``'s value set (its checking step included), as
    the member ``IMPL@NAME=VALUE``, whose every timed step sets the value first."""
    toggle.set()
    record, timer = prepare(case, impl, args, mode)
    record = {**record, "impl": f"{impl}@{toggle.name}={toggle.value!r}"}
    record["toggle"] = {"attribute": toggle.name, "value": repr(toggle.value)}
    if timer is None:
        return record, None
    measured = timer

    def one() -> tuple[float, float]:
        toggle.set()
        return measured()

    return record, one


def _timer(step: _Step, replay: Callable[[], Any] | None, device: torch.device) -> Timer:
    def one() -> tuple[float, float]:
        _sync(device)
        t0 = time.perf_counter()
        if replay is not None:
            replay()
            out = None
        else:
            out = step.forward()
        _sync(device)
        t1 = time.perf_counter()
        if replay is None and step.member.kind == "loss":
            step.backward(out)
            _sync(device)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    return one


def time_rounds(prepared: list[tuple[dict[str, Any], Timer | None]], args) -> list[dict[str, Any]]:
    """Time the prepared members of one case in rounds, one step of each member per round
    (``args.warmup`` rounds untimed, then ``args.repeats``): a slow drift of the machine's speed
    falls on every member alike instead of on whichever ran last, so their ratios hold. Each
    round runs the members in a fresh order (shuffled, seeded): a step's cost depends on what
    ran before it (after the floor's large product its small ops and its inputs are cold, after
    a member that read the same inputs they are warm), and in a fixed order the member after
    the floor, a case's first, always paid for it. Returns the finished records, in order."""
    timed = [i for i, (_, timer) in enumerate(prepared) if timer is not None]
    samples: dict[int, list[tuple[float, float]]] = {i: [] for i in timed}
    failed: dict[int, dict[str, Any]] = {}
    with C.set_threads(args.threads):
        rng = random.Random(0)
        for round_ in range(args.warmup + args.repeats):
            order = list(samples)
            rng.shuffle(order)
            for i in order:
                timer = prepared[i][1]
                assert timer is not None
                try:
                    fwd_bwd = timer()
                except Exception as err:  # recorded, never silent: the report shows it
                    failed[i] = _failed(prepared[i][0], err)
                    del samples[i]
                    continue
                if round_ >= args.warmup:
                    samples[i].append(fwd_bwd)
    records = []
    for i, (record, _) in enumerate(prepared):
        if i in failed or i not in samples:
            records.append(failed.get(i, record))
            continue
        kind = record["kind"]
        fwd = [f for f, _ in samples[i]]
        bwd = [b for _, b in samples[i]]
        total = [f + b for f, b in samples[i]]
        no_backward = kind != "loss" or record["mode"] == "cudagraph"
        records.append(
            record
            | dict(
                forward_ms=fwd,
                backward_ms=None if no_backward else bwd,
                total_ms=total,
                stats=_stats(total),
                forward_stats=_stats(fwd),
                backward_stats=None if no_backward else _stats(bwd),
            )
        )
    return records


PEER_CASES = "peers"  # --case peers: every peer case (benchmarks/cases/bench_peers.py)


def select(cases_arg: str | None) -> list[tuple[Case, str]]:
    """``(case, member name)`` of every member of the chosen cases (default: all; ``peers``:
    every case with a peer library's member)."""
    table = registry()
    names = list(table) if not cases_arg or cases_arg == "all" else cases_arg.split(",")
    if PEER_CASES in names:
        from .cases import bench_peers

        at = names.index(PEER_CASES)
        names[at : at + 1] = [n for n in bench_peers.CASES if n not in names]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(table)}")
    return [(table[n], impl) for n in names for impl in table[n].members]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=C.DEFAULT_BATCH)
    p.add_argument("--dimensions", type=int, default=C.DEFAULT_DIM)
    p.add_argument("--samples-per-class", type=int, default=C.DEFAULT_SAMPLES_PER_CLASS)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"]
    )
    p.add_argument("--threads", type=int, default=C.DEFAULT_THREADS)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--case",
        default=None,
        help="comma-separated case names (default: all; 'peers': the peer libraries' cases)",
    )
    p.add_argument("--impl", default=None, help="comma-separated implementations (default: all)")
    p.add_argument("--mode", default="eager", help=f"comma-separated, from {MODES}")
    p.add_argument("--anchor-batch-size", type=int, default=256)
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of --mode compile (eager: tracing only, for quick checks)",
    )
    p.add_argument("--pml-memory-limit-gib", type=float, default=8.0)
    p.add_argument(
        "--max-step-seconds",
        type=float,
        default=60.0,
        help="skip an entry whose first (checking) step takes longer",
    )
    p.add_argument(
        "--toggle",
        default=None,
        help="MODULE.NAME=V1,V2,...: every pmlfunc member once per value of that attribute",
    )
    p.add_argument("--output", default=None, help="JSON file to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    modes = args.mode.split(",")
    if any(m not in MODES for m in modes):
        p.error(f"--mode must be a comma-separated list from {MODES}, got {args.mode!r}")
    args.modes = modes
    try:
        args.toggles = toggles(args.toggle)
    except ValueError as err:
        p.error(str(err))
    if args.batch_size < 2 * args.samples_per_class:
        p.error("--batch-size must hold at least two complete classes")
    return args


def _distributed(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--case distributed`` (under torchrun): the DDP case of ``benchmarks.distributed``."""
    from . import distributed

    flags = ["--batch-size", args.batch_size, "--dimensions", args.dimensions,
             "--samples-per-class", args.samples_per_class, "--dtype", args.dtype,
             "--threads", args.threads, "--repeats", args.repeats, "--warmup", args.warmup,
             "--device", args.device]  # fmt: skip
    if args.output:
        flags += ["--output", args.output]
    return distributed.main([str(f) for f in flags])


def environment() -> dict[str, Any]:
    """Versions, machine, device, git revision and time of a run."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_revision": git_revision(),
        "peers": {name: peers.version(name) for name in peers.PEERS},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


CONFIG_KEYS = ("batch_size", "dimensions", "samples_per_class", "dtype", "threads", "repeats",
               "warmup", "device", "anchor_batch_size", "toggle")  # fmt: skip


def run_document(
    args: argparse.Namespace, results: list[dict[str, Any]], env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON a run writes (what ``benchmarks.report`` reads): configuration, environment
    (``env``, default :func:`environment`) and the entries."""
    return {
        "config": {k: getattr(args, k) for k in CONFIG_KEYS}
        | {"modes": args.modes, "seed": C.SEED},
        "environment": environment() if env is None else env,
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.case == "distributed":
        return _distributed(args)
    from .cases import bench_anchor_batched, bench_peers

    bench_anchor_batched.ANCHOR_BATCH = args.anchor_batch_size  # read when a member is made
    bench_peers.OPTAX_THREADS = args.threads  # XLA's threads, set when jax is first imported
    C.settle_allocator()
    chosen = select(args.case)
    if args.impl:
        keep = set(args.impl.split(","))
        chosen = [(c, i) for c, i in chosen if i in keep or library(i) in keep]
    jobs = [(c, i, m) for m in args.modes for c, i in chosen]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = (
        tqdm(jobs, desc="benchmarks", unit="entry", file=sys.stderr)
        if tqdm and not args.quiet
        else contextlib.nullcontext(jobs)
    )
    results: list[dict[str, Any]] = []
    with bar as progress:
        prepared: list[tuple[dict[str, Any], Timer | None]] = []
        for n, (case, impl, mode) in enumerate(progress):
            if hasattr(progress, "set_postfix_str"):
                progress.set_postfix_str(f"{case.name}/{impl}/{mode}")
            if args.toggles and library(impl) == "pmlfunc":
                prepared += [toggled(case, impl, args, mode, t) for t in args.toggles]
            else:
                prepared.append(prepare(case, impl, args, mode))
            following = jobs[n + 1] if n + 1 < len(jobs) else None
            if following is None or (following[0], following[2]) != (case, mode):
                results += time_rounds(prepared, args)  # a case's members, side by side
                prepared = []
    for toggle in args.toggles[:1]:  # every value set the same attribute: its first value's
        toggle.restore()
    run = run_document(args, results)
    for r in results:
        median = r["stats"]["median"] if r.get("stats") else None
        shown = f"{median:10.3f} ms" if median is not None else f"{r['status']:>13}"
        print(f"{r['case']:24s} {r['impl']:24s} {r['mode']:9s} {shown}  {r.get('reason') or ''}")
    if args.output:
        Path(args.output).write_text(json.dumps(run, indent=1))
    bad = [r for r in results if r["status"] == "error"]
    if bad:
        print(f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} failed", file=sys.stderr)
    return run


if __name__ == "__main__":
    main()
