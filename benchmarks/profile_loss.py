"""Where a loss spends its time: torch.profiler over forward+backward steps.

Usage::

    python -m benchmarks.profile_loss ntxent [--impl pmlfunc] [--batch 512] [--threads 1]
        [--steps 20] [--rows 25]

Prints the profiler's operator table (self CPU time, sorted), for the same inputs and
settings as the benchmark suite. Cases: every case of ``benchmarks.cases.registry`` (the core
and other losses, miners, proxy, anchor-batched); implementations: the case's members
(``pmlfunc``, ``pml``, ``floor``, variants such as ``pmlfunc-full``).
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from . import common as C


def main(argv: list[str] | None = None) -> None:
    from .cases import make_step, registry

    cases = registry()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(cases))
    parser.add_argument("--impl", default="pmlfunc", help="a member of the case")
    parser.add_argument("--batch", type=int, default=C.DEFAULT_BATCH)
    parser.add_argument("--dim", type=int, default=C.DEFAULT_DIM)
    parser.add_argument("--samples-per-class", type=int, default=C.DEFAULT_SAMPLES_PER_CLASS)
    parser.add_argument("--threads", type=int, default=C.DEFAULT_THREADS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--sort", default="self_cpu_time_total")
    args = parser.parse_args(argv)
    members = cases[args.case].members
    if args.impl not in members:
        parser.error(f"--impl: {args.case} has members {list(members)}, not {args.impl!r}")

    emb, labels = C.make_inputs(args.batch, args.dim, args.samples_per_class)
    step = make_step(members[args.impl], emb, labels)
    with C.set_threads(args.threads):
        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        times.sort()
        print(
            f"{args.case}/{args.impl} batch={args.batch} dim={args.dim} threads={args.threads}: "
            f"median {times[len(times) // 2] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms "
            f"over {args.steps} steps"
        )
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                step()
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows))
    print(
        prof.key_averages(group_by_input_shape=True).table(sort_by=args.sort, row_limit=args.rows)
    )


if __name__ == "__main__":
    main()
