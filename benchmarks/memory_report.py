"""Peak added memory and time of one contrastive forward+backward, dense vs bounded, on CPU.

Usage::

    python -m benchmarks.memory_report [--losses ntxent,clip,siglip] [--impls full,chunked,tiled]
        [--batches 2048,4096,8192,16384] [--chunk-size 256] [--dim 128] [--threads 1]
        [--full-max-batch 8192] [--no-rss] [--no-tensor-bytes] [--time] [--repeats 3]
        [--markdown PATH] [--check]

For each loss, path and batch it prints the peak memory one step adds, in MiB, measured two ways
(``pmlfunc.memory``):

- ``rss``: the resident-set high-water mark a fresh ``python -c`` process gains while running the
  step (method b: includes allocator overhead, what the OS charges);
- ``tensors``: the peak of live tensor storage created by the step (method a: exact, no
  allocator overhead; run in this process),

the growth factor per doubling of the batch, and with ``--time`` the median wall time of the
step over ``--repeats`` runs (in this process, after one warm-up run, without the tracker).

The paths (``--impls``; a loss runs those it has):

- ``full``: the dense loss and ``torch.autograd.grad`` (``ntxent``, ``clip``, ``siglip``,
  ``retrieval``: ``multiple_negatives_ranking`` with 7 hard negatives a query);
- ``tiled``: the same call with ``chunk_size=`` (the tiled engine, a plain backward);
- ``chunked``: ``pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size)`` (``ntxent`` only:
  anchor rows, the gradient with respect to the embeddings returned).

Inputs: the benchmark embeddings (``benchmarks.common``: seeded normal, 128 dims, float32, one
thread); ``ntxent`` uses four samples per class and ``temperature=0.07``; ``clip`` and
``siglip`` take a second seeded set of the same size as the paired set and their ``*_init()``
parameters, and differentiate both sets and both parameters. Every step includes the returned
gradients. The full path is skipped above ``--full-max-batch`` (its B x B matrices need several
GiB at 16,384).

Each rss child first runs the step once at batch 256 and allocates and frees a 16 MiB buffer (as
``benchmarks/conftest.py`` does), so lazy initialisation (thread pool, ``torch.func`` imports)
is not charged to the step. Children run one at a time.

Targets (``--check`` exits non-zero when one is missed), on live tensor bytes at 16,384 rows:
chunked NT-Xent <= 256 MiB (issue 6); tiled NT-Xent <= 96 MiB, tiled ``clip`` and ``siglip``
<= 128 MiB (issue 14); tiled ``retrieval`` <= 2x tiled ``clip`` (issue 31). ``--markdown PATH`` writes the tensor-bytes (and time) table as Markdown
(``docs/benchmarks/large-batch-memory.md`` is made with it).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pmlfunc.memory import TensorMemoryTracker, peak_rss_bytes_subprocess

from . import common as C

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
IMPLS = ("full", "chunked", "tiled")
LOSSES = {
    "ntxent": ("full", "chunked", "tiled"),
    "clip": ("full", "tiled"),
    "siglip": ("full", "tiled"),
    "retrieval": ("full", "tiled"),
}
RETRIEVAL_NEGATIVES = 7  # hard negatives a query of the retrieval loss
DEFAULT_BATCHES = (2048, 4096, 8192, 16384)
DEFAULT_CHUNK = 256
FULL_MAX_BATCH = 8192
TARGET_BATCH = 16384
TARGETS_MIB = {
    ("ntxent", "chunked"): 256.0,
    ("ntxent", "tiled"): 96.0,
    ("clip", "tiled"): 128.0,
    ("retrieval", "tiled"): 162.0,  # issue 31: 2 x tiled clip's 81 MiB at 16,384 rows
    ("siglip", "tiled"): 128.0,
}
WARMUP_BATCH = 256


def step_source(impl: str, chunk_size: int, loss: str = "ntxent") -> str:
    """The definition of ``_step(emb, other, labels) -> (loss, *grads)`` as Python source,
    shared by the rss child and this process (``other`` is the paired set; ``ntxent`` ignores
    it)."""
    if impl not in LOSSES.get(loss, ()):
        raise ValueError(
            f"unknown path {impl!r} for loss {loss!r}; expected one of {LOSSES.get(loss, IMPLS)}"
            if loss in LOSSES
            else f"unknown loss {loss!r}; expected one of {tuple(LOSSES)}"
        )
    tiled = f", chunk_size={chunk_size}" if impl == "tiled" else ""
    if impl == "chunked":
        return (
            f"_vg = pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size={chunk_size})\n"
            "def _step(emb, other, labels):\n"
            f"    return _vg(emb.detach(), labels, temperature={C.NTXENT_TEMPERATURE})\n"
        )
    if loss == "ntxent":
        return (
            "def _step(emb, other, labels):\n"
            "    emb = emb.detach().requires_grad_()\n"
            f"    loss = pf.losses.ntxent(emb, labels, temperature={C.NTXENT_TEMPERATURE}{tiled})\n"
            "    return (loss.detach(), *torch.autograd.grad(loss, emb))\n"
        )
    if loss == "retrieval":  # labels: the hard negatives (make_inputs)
        return (
            "def _step(emb, other, labels):\n"
            "    q, p, n = (t.detach().requires_grad_() for t in (emb, other, labels))\n"
            f"    loss = pf.losses.multiple_negatives_ranking(q, p, n{tiled})\n"
            "    return (loss.detach(), *torch.autograd.grad(loss, (q, p, n)))\n"
        )
    return (
        "def _step(emb, other, labels):\n"
        "    a, b = emb.detach().requires_grad_(), other.detach().requires_grad_()\n"
        f"    params = {{k: v.requires_grad_() for k, v in pf.losses.{loss}_init().items()}}\n"
        f"    loss = pf.losses.{loss}(a, b, params{tiled})\n"
        "    return (loss.detach(), *torch.autograd.grad(loss, (a, b, *params.values())))\n"
    )


def make_inputs(
    batch: int, dim: int, dtype: torch.dtype = torch.float32, loss: str = "ntxent"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeddings, paired embeddings, labels), detached; for ``retrieval`` the third is the
    queries' :data:`RETRIEVAL_NEGATIVES` hard negatives ``(batch, k, dim)``."""
    emb, labels = C.make_inputs(batch, dim, dtype=dtype)
    if loss == "retrieval":
        k = RETRIEVAL_NEGATIVES
        neg = C.make_embeddings(batch * k, dim, dtype=dtype, seed=C.SEED + 2)
        labels = neg.reshape(batch, k, dim)
    return emb.detach(), C.make_paired(emb), labels


def rss_added_bytes(
    impl: str,
    batch: int,
    *,
    loss: str = "ntxent",
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
    define = step_source(impl, chunk_size, loss)
    dtype_name = str(dtype).removeprefix("torch.")
    setup = (
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "import torch\nimport pmlfunc as pf\nimport pmlfunc.chunked\n"
        "from benchmarks.memory_report import make_inputs\n"
        f"torch.set_num_threads({threads})\n"
    )
    if warm_allocator:
        setup += "_buf = torch.empty(16 * 2**20 // 4).fill_(0.0)\ndel _buf\n"
    setup += define
    setup += (
        f"_step(*make_inputs({WARMUP_BATCH}, {dim}, torch.{dtype_name}, {loss!r}))\n"
        f"inputs = make_inputs({batch}, {dim}, torch.{dtype_name}, {loss!r})\n"
    )
    return int(peak_rss_bytes_subprocess("_out = _step(*inputs)\n", setup))


def _step_fn(impl: str, chunk_size: int, loss: str):
    import pmlfunc as pf
    import pmlfunc.chunked  # pf.chunked, whether or not pmlfunc imports it

    scope: dict = {"pf": pf, "torch": torch}
    exec(step_source(impl, chunk_size, loss), scope)
    return scope["_step"]


def tensor_peak(
    impl: str,
    batch: int,
    *,
    loss: str = "ntxent",
    dim: int = C.DEFAULT_DIM,
    chunk_size: int = DEFAULT_CHUNK,
    threads: int = C.DEFAULT_THREADS,
    dtype: torch.dtype = torch.float32,
    record_peak: bool = False,
) -> TensorMemoryTracker:
    """Method (a): live tensor bytes of one step, in this process; returns the tracker."""
    step = _step_fn(impl, chunk_size, loss)
    inputs = make_inputs(batch, dim, dtype, loss)
    with C.set_threads(threads), TensorMemoryTracker(record_peak=record_peak) as tracker:
        step(*inputs)
    return tracker


def step_seconds(
    impl: str,
    batch: int,
    *,
    loss: str = "ntxent",
    dim: int = C.DEFAULT_DIM,
    chunk_size: int = DEFAULT_CHUNK,
    threads: int = C.DEFAULT_THREADS,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
) -> float:
    """Median wall time of one step over ``repeats`` runs, after one warm-up run."""
    step = _step_fn(impl, chunk_size, loss)
    inputs = make_inputs(batch, dim, dtype, loss)
    times = []
    with C.set_threads(threads):
        step(*inputs)
        for _ in range(repeats):
            start = time.perf_counter()
            step(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fmt(x: float | None, spec: str = "9.1f") -> str:
    return format(x, spec) if x is not None else format("-", spec[: spec.index(".")] + "s")


def _growth(now: float | None, before: float | None) -> float | None:
    return now / before if now is not None and before else None


def markdown(results: dict, batches: list[int], args: argparse.Namespace, command: str) -> str:
    """The live-tensor table (and times) as Markdown: one row per batch, a column per path;
    ``command`` is the command line that measured it."""
    columns = [(loss, impl) for loss in args.losses for impl in LOSSES[loss] if impl in args.impls]
    head = ["batch"] + [f"{loss} {impl}" for loss, impl in columns]
    lines = [
        f"Live tensor MiB one forward + backward adds (dim {args.dim}, float32, chunk "
        f"{args.chunk_size}, {args.threads} thread(s); `{command}`)"
        + ("; in brackets, the median seconds of one step" if args.time else "")
        + ":",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for batch in batches:
        cells = [f"{batch:,}"]
        for key in columns:
            row = results.get((*key, batch))
            if row is None or row["tensors"] is None:
                cells.append("-")
                continue
            cell = f"{row['tensors']:,.1f}"
            if row.get("seconds") is not None:
                cell += f" ({row['seconds']:.2f} s)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", default="ntxent", help=f"comma-separated, of {tuple(LOSSES)}")
    parser.add_argument(
        "--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="comma-separated"
    )
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--dim", type=int, default=C.DEFAULT_DIM)
    parser.add_argument("--threads", type=int, default=C.DEFAULT_THREADS)
    parser.add_argument("--full-max-batch", type=int, default=FULL_MAX_BATCH)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--no-rss", action="store_true", help="skip method (b) (subprocesses)")
    parser.add_argument(
        "--no-tensor-bytes", action="store_true", help="skip method (a) (in-process)"
    )
    parser.add_argument("--time", action="store_true", help="also time each step (median)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per step (--time)")
    parser.add_argument("--markdown", type=Path, help="write the tensor table here as Markdown")
    parser.add_argument(
        "--profile", action="store_true", help="list the largest live storages at the peak"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    batches = sorted(int(b) for b in args.batches.split(",") if b.strip())
    args.losses = [s.strip() for s in args.losses.split(",") if s.strip()]
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    for loss in args.losses:
        if loss not in LOSSES:
            parser.error(f"unknown loss {loss!r}; expected some of {tuple(LOSSES)}")
    for impl in args.impls:
        if impl not in IMPLS:
            parser.error(f"unknown path {impl!r}; expected some of {IMPLS}")

    print(
        f"forward+backward, dim {args.dim}, float32, {args.threads} thread(s), "
        f"chunk {args.chunk_size}; peak added memory in MiB "
        "(rss: fresh-process high-water mark, method b; tensors: live tensor bytes, method a)"
    )
    header = (
        f"{'loss':>7} {'path':>8} {'batch':>7} {'rss MiB':>9} {'x/doubling':>10} "
        f"{'tensors MiB':>11} {'x/doubling':>10} {'seconds':>9}"
    )
    print(header)
    print("-" * len(header))
    results: dict[tuple[str, str, int], dict] = {}
    for loss in args.losses:
        for impl in (i for i in LOSSES[loss] if i in args.impls):
            prev: dict | None = None
            prev_batch = None
            for batch in batches:
                if impl == "full" and batch > args.full_max_batch:
                    print(
                        f"{loss:>7} {impl:>8} {batch:>7} {'skipped':>9}  (full batch above "
                        f"{args.full_max_batch}: its B x B matrices need several GiB)"
                    )
                    continue
                opts = dict(
                    loss=loss, dim=args.dim, chunk_size=args.chunk_size, threads=args.threads
                )
                row: dict = {"rss": None, "tensors": None, "seconds": None}
                if not args.no_rss:
                    row["rss"] = rss_added_bytes(impl, batch, **opts) / MIB
                tracker = None
                if not args.no_tensor_bytes:
                    tracker = tensor_peak(impl, batch, record_peak=args.profile, **opts)
                    row["tensors"] = tracker.peak / MIB
                if args.time:
                    row["seconds"] = step_seconds(impl, batch, repeats=args.repeats, **opts)
                doubled = prev is not None and batch == 2 * prev_batch
                g_rss = _growth(row["rss"], prev["rss"]) if doubled else None
                g_t = _growth(row["tensors"], prev["tensors"]) if doubled else None
                print(
                    f"{loss:>7} {impl:>8} {batch:>7} {_fmt(row['rss'])} {_fmt(g_rss, '10.2f')} "
                    f"{_fmt(row['tensors'], '11.1f')} {_fmt(g_t, '10.2f')} "
                    f"{_fmt(row['seconds'], '9.3f')}",
                    flush=True,
                )
                if tracker is not None and args.profile:
                    for s in tracker.peak_storages[:12]:
                        print(
                            f"        {s.nbytes / MIB:9.2f} MiB  {s.op:<40} {list(s.shape)} "
                            f"{str(s.dtype).removeprefix('torch.')}"
                        )
                results[(loss, impl, batch)] = row
                prev, prev_batch = row, batch

    if args.markdown is not None:
        given = sys.argv[1:] if argv is None else argv
        command = shlex.join(["python", "-m", "benchmarks.memory_report", *given])
        args.markdown.write_text(markdown(results, batches, args, command))
        print(f"wrote {args.markdown}")

    # The targets are on allocated tensor bytes (method a): the CPU analogue of CUDA's peak
    # allocated memory that PML reports. The resident high-water mark (method b) also counts
    # what glibc keeps or fragments; MALLOC_MMAP_THRESHOLD_=1048576 brings it to the tensor
    # figure (docs/chunked.md).
    ok = True
    for (loss, impl), target in TARGETS_MIB.items():
        row = results.get((loss, impl, TARGET_BATCH))
        if row is None or row["tensors"] is None:
            continue
        met = row["tensors"] <= target
        ok &= met
        print(
            f"target: {loss} {impl} at batch {TARGET_BATCH} allocates <= {target:.0f} MiB of "
            f"tensors: {row['tensors']:.1f} MiB -> {'met' if met else 'MISSED'}"
        )
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
