"""Peak added memory of NT-Xent forward+backward: full batch vs. anchor-chunked, on CPU.

Usage::

    python -m benchmarks.memory_report [--batches 2048,4096,8192,16384] [--chunk-size 256]
        [--dim 128] [--threads 1] [--full-max-batch 8192] [--no-tensor-bytes] [--check]

For each batch and path it prints the peak memory one step adds, in MiB, measured two ways
(``pmlfunc.memory``):

- ``rss``: the resident-set high-water mark a fresh ``python -c`` process gains while running the
  step (method b: includes allocator overhead, what the OS charges);
- ``tensors``: the peak of live tensor storage created by the step (method a: exact, no
  allocator overhead; run in this process),

and the growth factor per doubling of the batch (of ``rss``). One step is
``pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size)(emb, labels, temperature=0.07)``
(chunked) or ``ntxent`` + ``torch.autograd.grad`` (full), on the benchmark inputs
(``benchmarks.common``: seeded normal embeddings, 128 dims, four samples per class, float32,
one thread). Both include the returned ``B x D`` gradient. The full batch is skipped above
``--full-max-batch`` (its B x B matrices need several GiB at 16,384).

Each child first runs the step once at batch 256 and allocates and frees a 16 MiB buffer (as
``benchmarks/conftest.py`` does), so lazy initialisation (thread pool, ``torch.func`` imports)
is not charged to the step. Children run one at a time.

Issue 6's target: chunked NT-Xent adds at most 256 MiB at batch 16,384 and grows about 2x per
doubling (the full batch grows about 4x). ``--check`` exits non-zero when it is missed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pmlfunc.memory import TensorMemoryTracker, peak_rss_bytes_subprocess

from . import common as C

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
IMPLS = ("full", "chunked", "streaming")
DEFAULT_BATCHES = (2048, 4096, 8192, 16384)
DEFAULT_CHUNK = 256
FULL_MAX_BATCH = 8192
TARGET_BATCH = 16384
TARGET_MIB = 256.0
WARMUP_BATCH = 256


def step_source(impl: str, chunk_size: int) -> tuple[str, str]:
    """(definition, call) of one step as Python source, shared by the child and this process."""
    if impl == "chunked":
        define = (
            f"_vg = pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size={chunk_size})\n"
            "def _step(emb, labels):\n"
            f"    return _vg(emb.detach(), labels, temperature={C.NTXENT_TEMPERATURE})\n"
        )
    elif impl == "streaming":  # pf.losses.ntxent(chunk_size=...): plain backward, tiled
        define = (
            "def _step(emb, labels):\n"
            "    emb = emb.detach().requires_grad_()\n"
            f"    loss = pf.losses.ntxent(emb, labels, temperature={C.NTXENT_TEMPERATURE}, "
            f"chunk_size={chunk_size})\n"
            "    (grad,) = torch.autograd.grad(loss, emb)\n"
            "    return loss.detach(), grad\n"
        )
    elif impl == "full":
        define = (
            "def _step(emb, labels):\n"
            "    emb = emb.detach().requires_grad_()\n"
            f"    loss = pf.losses.ntxent(emb, labels, temperature={C.NTXENT_TEMPERATURE})\n"
            "    (grad,) = torch.autograd.grad(loss, emb)\n"
            "    return loss.detach(), grad\n"
        )
    else:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    return define, "_loss, _grad = _step(emb, labels)\n"


def rss_added_bytes(
    impl: str,
    batch: int,
    *,
    dim: int = C.DEFAULT_DIM,
    chunk_size: int = DEFAULT_CHUNK,
    threads: int = C.DEFAULT_THREADS,
    dtype: torch.dtype = torch.float32,
    warm_allocator: bool = True,
) -> int:
    """Method (b): peak RSS one step adds, in a fresh process (inputs built in setup).

    ``warm_allocator`` first frees a 16 MiB block, as the timing benchmarks do: glibc then keeps
    blocks up to 32 MiB in its heap, which is faster but lets fragmentation raise the resident
    high-water mark; without it, large blocks are mapped and unmapped one by one."""
    define, call = step_source(impl, chunk_size)
    dtype_name = str(dtype).removeprefix("torch.")
    setup = (
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "import torch\nimport pmlfunc as pf\nimport pmlfunc.chunked\n"
        "from benchmarks import common as C\n"
        f"torch.set_num_threads({threads})\n"
    )
    if warm_allocator:
        setup += "_buf = torch.empty(16 * 2**20 // 4).fill_(0.0)\ndel _buf\n"
    setup += define
    setup += (
        f"emb, labels = C.make_inputs({WARMUP_BATCH}, {dim}, dtype=torch.{dtype_name})\n"
        "_step(emb, labels)\n"
        f"emb, labels = C.make_inputs({batch}, {dim}, dtype=torch.{dtype_name})\n"
        "emb = emb.detach()\n"
    )
    return int(peak_rss_bytes_subprocess(call, setup))


def tensor_peak(
    impl: str,
    batch: int,
    *,
    dim: int = C.DEFAULT_DIM,
    chunk_size: int = DEFAULT_CHUNK,
    threads: int = C.DEFAULT_THREADS,
    dtype: torch.dtype = torch.float32,
    record_peak: bool = False,
) -> TensorMemoryTracker:
    """Method (a): live tensor bytes of one step, in this process; returns the tracker."""
    import pmlfunc as pf
    import pmlfunc.chunked  # pf.chunked, whether or not pmlfunc imports it

    define, _ = step_source(impl, chunk_size)
    scope: dict = {"pf": pf, "torch": torch}
    exec(define, scope)
    emb, labels = C.make_inputs(batch, dim, dtype=dtype)
    emb = emb.detach()
    with C.set_threads(threads), TensorMemoryTracker(record_peak=record_peak) as tracker:
        scope["_step"](emb, labels)
    return tracker


def _fmt(x: float | None, spec: str = "9.1f") -> str:
    return format(x, spec) if x is not None else format("-", spec[: spec.index(".")] + "s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="comma-separated"
    )
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--dim", type=int, default=C.DEFAULT_DIM)
    parser.add_argument("--threads", type=int, default=C.DEFAULT_THREADS)
    parser.add_argument("--full-max-batch", type=int, default=FULL_MAX_BATCH)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument(
        "--no-tensor-bytes", action="store_true", help="skip method (a) (in-process)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="list the largest live storages at the peak"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the target is missed")
    args = parser.parse_args(argv)
    batches = sorted(int(b) for b in args.batches.split(",") if b.strip())
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]

    print(
        f"NT-Xent forward+backward, dim {args.dim}, float32, {args.threads} thread(s), "
        f"chunk {args.chunk_size}; peak added memory in MiB "
        "(rss: fresh-process high-water mark, method b; tensors: live tensor bytes, method a)"
    )
    header = f"{'batch':>7} {'path':>8} {'rss MiB':>9} {'x/doubling':>10} {'tensors MiB':>11} {'x/doubling':>10}"
    print(header)
    print("-" * len(header))
    results: dict[tuple[str, int], tuple[float, float | None]] = {}
    skipped: list[str] = []
    for impl in impls:
        prev: tuple[int, float, float | None] | None = None
        for batch in batches:
            if impl == "full" and batch > args.full_max_batch:
                skipped.append(f"full at batch {batch}")
                print(
                    f"{batch:>7} {impl:>8} {'skipped':>9}  (full batch above {args.full_max_batch}: "
                    "its B x B matrices need several GiB)"
                )
                continue
            rss = rss_added_bytes(
                impl, batch, dim=args.dim, chunk_size=args.chunk_size, threads=args.threads
            )
            rss_mib = rss / MIB
            tens_mib = None
            tracker = None
            if not args.no_tensor_bytes:
                tracker = tensor_peak(
                    impl,
                    batch,
                    dim=args.dim,
                    chunk_size=args.chunk_size,
                    threads=args.threads,
                    record_peak=args.profile,
                )
                tens_mib = tracker.peak / MIB
            g_rss = g_t = None
            if prev is not None and batch == 2 * prev[0]:
                g_rss = rss_mib / prev[1] if prev[1] > 0 else None
                if tens_mib is not None and prev[2]:
                    g_t = tens_mib / prev[2]
            print(
                f"{batch:>7} {impl:>8} {rss_mib:>9.1f} {_fmt(g_rss, '10.2f')} "
                f"{_fmt(tens_mib, '11.1f')} {_fmt(g_t, '10.2f')}",
                flush=True,
            )
            if tracker is not None and args.profile:
                for s in tracker.peak_storages[:12]:
                    print(
                        f"        {s.nbytes / MIB:9.2f} MiB  {s.op:<40} {list(s.shape)} "
                        f"{str(s.dtype).removeprefix('torch.')}"
                    )
            results[(impl, batch)] = (rss_mib, tens_mib)
            prev = (batch, rss_mib, tens_mib)
    if skipped:
        print(f"skipped: {', '.join(skipped)} (above --full-max-batch {args.full_max_batch})")

    # The target is on allocated tensor bytes (method a): the CPU analogue of CUDA's peak
    # allocated memory that PML reports. The resident high-water mark (method b) also counts
    # what glibc keeps or fragments; MALLOC_MMAP_THRESHOLD_=1048576 brings it to the tensor
    # figure (docs/chunked.md).
    ok = True
    for impl in ("chunked", "streaming"):
        target = results.get((impl, TARGET_BATCH))
        if target is None or target[1] is None:
            continue
        met = target[1] <= TARGET_MIB
        ok &= met
        print(
            f"target: {impl} at batch {TARGET_BATCH} allocates <= {TARGET_MIB:.0f} MiB of tensors: "
            f"{target[1]:.1f} MiB -> {'met' if met else 'MISSED'} (rss {target[0]:.1f} MiB)"
        )
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
