"""The largest batch a case fits in a GPU memory budget (CUDA).

    python -m benchmarks.capacity --case ntxent --impl pmlfunc --device cuda \\
        [--budget-fraction 0.9] [--start 512] [--ceiling 1048576] [--output cap.json]

As the reference documents describe: each probe runs in a fresh process that limits PyTorch's
allocator to ``--budget-fraction`` of the device memory
(``torch.cuda.set_per_process_memory_fraction``), then runs the case's first step, one warmup
and three measured steps. The search doubles the batch from ``--start`` until a probe fails, then
bisects the bracket until it is narrower than 128 rows or 5% of the passing batch, whichever is
larger, and confirms the passing endpoint in two more fresh processes. Out-of-memory, indexing
limits (``INT_MAX``), non-finite results, other errors and the five-minute per-probe timeout are
distinct outcomes; reaching ``--ceiling`` gives a lower bound, never a measured limit. Batches
stay multiples of ``--samples-per-class``.

``--time-limit SECONDS`` caps the whole search: no probe starts after it, a probe running at it is
stopped, and the result says ``cut_off`` with the bracket reached so far (the largest batch that
passed is then a lower bound). ``--impl pmlfunc-tiled`` (``--case ntxent``) is the tiled path,
``pf.losses.ntxent(..., chunk_size=256)``, which no timed case holds.

Capacity is a GPU-memory measurement; on another device the command says so and exits with
status 2 (CPU memory: ``python -m benchmarks.memory_report``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("ok", "oom", "int_max", "nonfinite", "error", "timeout")
PROBE_TIMEOUT_S = 300
TILE = 256  # rows per tile of the tiled NT-Xent member


class OutOfTime(Exception):
    """Raised by a probe (or by :func:`search` itself) when the search's time is up: no outcome."""


def extra_members() -> dict[tuple[str, str], Any]:
    """Members that only the capacity search measures, by ``(case, impl)``: the tiled NT-Xent."""
    import functools

    import pmlfunc as pf

    from . import common as C
    from .cases import Member

    tiled = functools.partial(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE, chunk_size=TILE)
    return {("ntxent", "pmlfunc-tiled"): Member(lambda e, y: (tiled, []))}


def member(case: str, impl: str):
    """The member ``impl`` of ``case``: from the registry, or one of :func:`extra_members`."""
    from .cases import registry

    extra = extra_members()
    if (case, impl) in extra:
        return extra[case, impl]
    return registry()[case].members[impl]


def search(
    probe: Callable[[int], str],
    *,
    start: int,
    ceiling: int,
    multiple: int,
    confirmations: int = 2,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Largest passing batch for ``probe(batch) -> outcome`` (``"ok"`` passes).

    Doubling, then bisection to ``max(128, 5%)`` rows, then ``confirmations`` more probes of the
    passing endpoint (a failed confirmation moves the bracket down and the search resumes).
    With a ``deadline`` (on ``clock``), no probe starts after it and a probe may raise
    :class:`OutOfTime`; the result then has ``cut_off: True``, the largest batch that passed so
    far (a lower bound) and the smallest that failed (``failed_at``, ``None`` if none did).
    """
    try:
        return _search(probe, start, ceiling, multiple, confirmations, deadline, clock)
    except OutOfTime as stop:
        good, bad, trials = stop.args
        failure = next((t["outcome"] for t in trials if t["batch"] == bad), None)
        return {"batch": good, "lower_bound": True, "failure": failure, "trials": trials,
                "cut_off": True, "failed_at": bad}  # fmt: skip


def _search(probe, start, ceiling, multiple, confirmations, deadline, clock) -> dict[str, Any]:

    def snap(b: int) -> int:
        return max(multiple, (b // multiple) * multiple)

    trials: list[dict[str, Any]] = []
    good, bad = 0, None

    def run(b: int) -> str:
        if deadline is not None and clock() >= deadline:
            raise OutOfTime(good, bad, trials)
        try:
            outcome = probe(b)
        except OutOfTime:
            raise OutOfTime(good, bad, trials) from None
        if outcome not in OUTCOMES:
            raise ValueError(f"probe returned {outcome!r}, expected one of {OUTCOMES}")
        trials.append({"batch": b, "outcome": outcome})
        return outcome

    b = snap(start)
    while b <= ceiling:  # doubling
        if run(b) != "ok":
            bad = b
            break
        good, b = b, snap(b * 2)
    if bad is None:  # never failed
        return {"batch": good, "lower_bound": True, "failure": None, "trials": trials,
                "cut_off": False, "failed_at": None}  # fmt: skip
    while good == 0 and bad > multiple:  # the start already failed: halve down to a pass
        b = snap(bad // 2)
        if b >= bad:
            break
        if run(b) == "ok":
            good = b
        else:
            bad = b
    while True:
        while bad - good > max(128, 0.05 * good, multiple):
            mid = snap((good + bad) // 2)
            if mid <= good or mid >= bad:
                break
            if run(mid) == "ok":
                good = mid
            else:
                bad = mid
        if good == 0:
            break
        confirmed = all(run(good) == "ok" for _ in range(confirmations))
        if confirmed:
            break
        bad, good = good, 0 if good <= multiple else snap(good // 2)
        if good and run(good) != "ok":
            bad, good = good, 0
    failure = next((t["outcome"] for t in trials if t["batch"] == bad), None)
    return {"batch": good, "lower_bound": False, "failure": failure, "trials": trials,
            "cut_off": False, "failed_at": bad}  # fmt: skip


def probe_in_subprocess(
    args: argparse.Namespace,
    batch: int,
    timeout: float = PROBE_TIMEOUT_S,
    on_output: Callable[[str], None] | None = None,
) -> str:
    """One probe in a fresh process: its outcome; ``"timeout"`` after ``PROBE_TIMEOUT_S``.
    A shorter ``timeout`` (the search's time left) raises :class:`OutOfTime` instead.
    ``on_output`` receives the child's output when the outcome is not ``"ok"``."""
    cmd = [sys.executable, "-m", "benchmarks.capacity", "--probe", str(batch),
           "--case", args.case, "--impl", args.impl, "--device", args.device,
           "--budget-fraction", str(args.budget_fraction), "--dimensions", str(args.dimensions),
           "--samples-per-class", str(args.samples_per_class), "--dtype", args.dtype]  # fmt: skip
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(timeout, PROBE_TIMEOUT_S)
        )
    except subprocess.TimeoutExpired:
        if timeout < PROBE_TIMEOUT_S:
            raise OutOfTime() from None
        return "timeout"
    lines = [line for line in out.stdout.splitlines() if line.startswith("OUTCOME ")]
    outcome = lines[-1].split()[1] if lines else "error"
    if on_output is not None and outcome != "ok":
        on_output(f"batch {batch}: {outcome}\n{out.stdout}{out.stderr}")
    return outcome


def run_probe(args: argparse.Namespace) -> str:
    """In the child: one case at one batch under the memory budget."""
    import torch

    from . import common as C
    from .run import _Step

    device = torch.device(args.device)
    # the index, not "cuda": set_per_process_memory_fraction refuses a device without one
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(args.budget_fraction, index)
    chosen = member(args.case, args.impl)
    emb, labels = C.make_inputs(
        args.probe, args.dimensions, args.samples_per_class,
        dtype=getattr(torch, args.dtype), device=device,
    )  # fmt: skip
    fn, params = chosen.make(emb, labels)
    step = _Step(chosen, fn, params, emb, labels)
    try:
        for _ in range(5):  # first step, one warmup, three measured
            out = step.forward()
            step.check(out, step.backward(out))
            torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        return "oom"
    except RuntimeError as err:
        text = str(err)
        if "INT_MAX" in text or "int32" in text.lower():
            return "int_max"
        if "finite" in text:
            return "nonfinite"
        return "error"
    return "ok"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True)
    p.add_argument("--impl", default="pmlfunc")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-fraction", type=float, default=0.9)
    p.add_argument("--start", type=int, default=512)
    p.add_argument("--ceiling", type=int, default=1_048_576)
    p.add_argument("--dimensions", type=int, default=128)
    p.add_argument("--samples-per-class", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole search")
    p.add_argument("--output", default=None)
    p.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print(
            "benchmarks.capacity measures GPU memory and needs --device cuda; for CPU memory use "
            "python -m benchmarks.memory_report",
            file=sys.stderr,
        )
        return 2
    if args.probe is not None:
        print("OUTCOME", run_probe(args))
        return 0
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit

    def probe(batch: int) -> str:
        if deadline is None:
            return probe_in_subprocess(args, batch)
        return probe_in_subprocess(args, batch, timeout=deadline - time.monotonic())

    result = search(
        probe,
        start=args.start,
        ceiling=args.ceiling,
        multiple=args.samples_per_class,
        deadline=deadline,
    )
    result.update(case=args.case, impl=args.impl, budget_fraction=args.budget_fraction)
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
