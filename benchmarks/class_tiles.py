"""Classifier losses over many classes on one device: dense against class tiles, time and memory,
and how many classes each fits.

    python -m benchmarks.class_tiles --device cuda --output DIR [--classes 100000,1000000,10000000]
        [--capacity] [--budget-seconds 240] [--cce | --no-cce]

For each class count ``C``, loss (``arcface``, ``cosface``, ``normalized_softmax``) and path
(``dense``; ``tiled`` with ``class_chunk_size`` 8,192 and 65,536) and the matmul floor (``(x
Wᵀ).sum()`` and its backward), at ``B = 512`` rows of ``D = 128`` in float32: the median of
``--steps`` timed forward + backward steps (``torch.autograd.grad`` into the embeddings and the
weights, synchronised) after two warm-up steps, and the memory the step adds beyond the inputs,
the weights and their two gradients (CUDA: ``max_memory_allocated`` less what was allocated
before the step and the gradients' bytes; CPU: :func:`pmlfunc.memory.peak_tensor_bytes` less the
gradients). An out-of-memory step is recorded as ``"oom"``; the dense path is not tried where
its logits alone would not fit.

``normalized_softmax`` path ``cce`` (a peer; default on CUDA, ``--cce`` on CPU, ``--no-cce``
off): Apple's Cut Cross-Entropy, ``linear_cross_entropy(F.normalize(x) / T, F.normalize(W),
labels)`` with the ``normalized_softmax`` temperature, the same loss (``benchmarks/peers.py``).
On CUDA where the package imports (it needs triton) that is its Triton kernels (``impl="cce"``,
default ``filter_eps``, which for float32 drops gradient entries below ``2⁻²³ / 32``), else its
``"torch_compile"`` impl (dense logits under ``torch.compile``). The row records the impl and
``max_rel_diff``: for the loss and each gradient, the largest difference from pmlfunc's tiled
``normalized_softmax`` (exact, and it fits at every ``C``) over the largest entry. Not
installed: the row is ``"skipped: <reason>"``; an error in the peer's code ends only its row
(``"error: ..."``); the ``"torch_compile"`` impl is skipped where the dense logits would not
fit. On CPU its added memory is that of the same body
run eagerly (``torch.compiler.set_stance("force_eager")``; Inductor's buffers are invisible to
:func:`pmlfunc.memory.peak_tensor_bytes`).

``--capacity``: the largest ``C`` (doubling from 2²⁰, then bisecting to 5%) whose tiled
``arcface`` step runs on the device, with a note of the weights' share (CUDA: an allocation that
fails is an exception). ``--probe C`` (CPU): one tiled ``arcface`` step at ``C`` classes, its time
and the process's peak resident memory (on a CPU an allocation that does not fit ends the process,
so a search would need a process per probe; run one probe in its own process instead).

Writes ``DIR/class_tiles.json`` and ``DIR/class_tiles.md`` (a table), after every entry, so a run
cut off still reports what it did. ``--device cpu --classes 2000 --steps 1`` is the dry run a
test makes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pmlfunc as pf
from pmlfunc.memory import peak_tensor_bytes

from . import peers

B, D = 512, 128
CHUNKS = (8192, 65536)
LOSSES: dict[str, tuple[Callable[..., torch.Tensor], dict[str, float]]] = {
    "arcface": (pf.losses.arcface, {"margin": 0.5, "scale": 64.0}),
    "cosface": (pf.losses.cosface, {"margin": 0.35, "scale": 64.0}),
    "normalized_softmax": (pf.losses.normalized_softmax, {"temperature": 0.05}),
}
MIB = 2**20


def member(name: str, path: str, labels: torch.Tensor, chunk: int | None):
    if name == "floor":
        return lambda x, w: (x @ w.t()).sum()
    fn, hp = LOSSES[name]
    if path == "cce":  # Cut Cross-Entropy on normalized_softmax's logits (a peer)
        cce, impl, t = (
            peers.cut_cross_entropy(),
            peers.cce_impl(labels.device.type),
            hp["temperature"],
        )
        return lambda x, w: cce.linear_cross_entropy(
            F.normalize(x) / t, F.normalize(w), labels, impl
        )
    kw = {} if path == "dense" else {"class_chunk_size": chunk}
    return lambda x, w: fn(x, labels, {"weight": w}, **hp, **kw)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, x0: torch.Tensor, w0: torch.Tensor, steps: int) -> dict[str, Any]:
    """Time and added memory of ``steps`` forward + backward steps of ``fn(x, w)``."""
    device = x0.device

    def step():
        x, w = x0.detach().requires_grad_(), w0.detach().requires_grad_()
        loss = fn(x, w)
        grads = torch.autograd.grad(loss, (x, w))
        return loss.detach(), grads

    grads_bytes = (x0.numel() + w0.numel()) * x0.element_size()
    for _ in range(2):
        out = step()
        del out
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        _sync(device)
        times.append(time.perf_counter() - start)
        del out
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = step()
        _sync(device)
        added = torch.cuda.max_memory_allocated(device) - before - grads_bytes
        del out
    else:  # a compiled body (CCE's torch_compile impl) counted eagerly: see the module docstring
        with torch.compiler.set_stance("force_eager"):
            added = peak_tensor_bytes(step)[1] - grads_bytes
    return {
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "min_ms": round(min(times) * 1e3, 2),
        "max_ms": round(max(times) * 1e3, 2),
        "added_mib": round(added / MIB, 1),
    }


def _fits_dense(c: int, device: torch.device) -> bool:
    """Whether a few ``B × C`` float32 matrices (the dense path's logits and their gradients)
    can be allocated at all."""
    if device.type != "cuda":
        return B * c * 4 * 6 < 16 * 2**30
    free, _ = torch.cuda.mem_get_info(device)
    return B * c * 4 * 6 < free


def cce_diff(labels: torch.Tensor, x0: torch.Tensor, w0: torch.Tensor, chunk: int) -> dict:
    """The CCE member's largest difference from pmlfunc's tiled ``normalized_softmax`` (loss and
    both gradients), each over the largest entry of pmlfunc's."""
    out = {}
    for key in ("cce", "tiled"):
        x, w = x0.detach().requires_grad_(), w0.detach().requires_grad_()
        loss = member("normalized_softmax", key, labels, chunk)(x, w)
        out[key] = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
        del x, w, loss
    return {
        name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for name, a, b in zip(("loss", "grad_x", "grad_w"), out["cce"], out["tiled"], strict=True)
    }


def run_case(
    c: int, device: torch.device, steps: int, chunks, cce: bool = False
) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, D, generator=g).to(device)
    labels = torch.randint(0, c, (B,), generator=g).to(device)
    w0 = torch.randn(c, D, generator=g).to(device)
    rows = []
    plan = [("floor", "floor", None)]
    for name in LOSSES:
        plan.append((name, "dense", None))
        plan += [(name, "tiled", k) for k in chunks]
    if cce:
        plan.append(("normalized_softmax", "cce", None))
    for name, path, chunk in plan:
        row: dict[str, Any] = {"classes": c, "loss": name, "path": path, "class_chunk_size": chunk}
        reason = peers.unavailable("cut_cross_entropy") if path == "cce" else None
        if path == "cce" and reason is None:
            row["cce_impl"] = peers.cce_impl(device.type)
            row["cce_version"] = peers.version("cut_cross_entropy")
        dense = path == "dense" or row.get("cce_impl") == "torch_compile"  # dense logits
        if reason is not None:
            row["outcome"] = f"skipped: {reason}"
        elif dense and not _fits_dense(c, device):
            row["outcome"] = "skipped: the dense logits would not fit"
        else:
            try:
                if path == "cce":
                    row["max_rel_diff"] = cce_diff(labels, x0, w0, chunks[-1])
                row.update(measure(member(name, path, labels, chunk), x0, w0, steps))
                row["outcome"] = "ok"
            except torch.OutOfMemoryError:
                row["outcome"] = "oom"
            except Exception as err:  # a peer's failure (a Triton compile, say) ends only its row
                if path != "cce":
                    raise
                row["outcome"] = f"error: {type(err).__name__}: {err}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def capacity(device: torch.device, deadline: float) -> dict[str, Any]:
    """The largest ``C`` whose tiled ``arcface`` step (chunk 65,536) runs: doubling from 2²⁰,
    then bisecting until the bracket is within 5% of the passing ``C``."""
    fn, hp = LOSSES["arcface"]

    def ok(c: int) -> bool:
        try:
            x = torch.randn(B, D, device=device, requires_grad=True)
            w = torch.randn(c, D, device=device, requires_grad=True)
            labels = torch.randint(0, c, (B,), device=device)
            loss = fn(x, labels, {"weight": w}, **hp, class_chunk_size=CHUNKS[-1])
            torch.autograd.grad(loss, (x, w))
            _sync(device)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()

    good, bad = 0, None
    c = 2**20
    while bad is None and time.monotonic() < deadline:
        if ok(c):
            good, c = c, c * 2
        else:
            bad = c
    while bad is not None and bad - good > 0.05 * max(good, 1) and time.monotonic() < deadline:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return {
        "largest_classes": good,
        "first_failing": bad,
        "weights_and_grad_gib": round(2 * good * D * 4 / 2**30, 2),
        "bounded": bad is not None,
    }


def probe(c: int, device: torch.device, output: Path) -> dict[str, Any]:
    """One tiled ``arcface`` step (chunk 8,192) at ``c`` classes: its time and the process's
    peak resident memory (``ru_maxrss``)."""
    import resource

    fn, hp = LOSSES["arcface"]
    start = time.perf_counter()
    x = torch.randn(B, D, device=device, requires_grad=True)
    w = torch.randn(c, D, device=device, requires_grad=True)
    labels = torch.randint(0, c, (B,), device=device)
    made = time.perf_counter()
    loss = fn(x, labels, {"weight": w}, **hp, class_chunk_size=CHUNKS[0])
    grads = torch.autograd.grad(loss, (x, w))
    _sync(device)
    done = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = {
        "classes": c, "batch": B, "dim": D, "class_chunk_size": CHUNKS[0],
        "loss_finite": bool(torch.isfinite(loss)),
        # in slices: a (C, D) boolean of the whole gradient would be one more C-sized tensor
        "grad_finite": all(bool(torch.isfinite(t).all()) for t in grads[1].split(2**20)),
        "setup_s": round(made - start, 1), "step_s": round(done - made, 1),
        "peak_rss_gib": round(peak / 2**30, 2),
        "weights_and_grad_gib": round(2 * c * D * 4 / 2**30, 2),
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    output.mkdir(parents=True, exist_ok=True)
    (output / f"class_tiles_probe_c{c}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Class tiles on {result['device_name']}",
        "",
        f"`python -m benchmarks.class_tiles` (B = {B}, D = {D}, float32, forward + backward; "
        f"median of {result['steps']} steps [min–max]; memory the step adds beyond the inputs, "
        "the weights and their gradients).",
        "",
        "| C | loss | path | class_chunk_size | median ms [min–max] | added MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["outcome"] == "ok":
            t = f"{r['median_ms']} [{r['min_ms']}–{r['max_ms']}]"
            mem = str(r["added_mib"])
        else:
            t, mem = r["outcome"], "—"
        chunk = r["class_chunk_size"] or "—"
        path = f"cce (`{r['cce_impl']}`)" if r.get("cce_impl") else r["path"]
        lines.append(f"| {r['classes']:,} | {r['loss']} | {path} | {chunk} | {t} | {mem} |")
    cap = result.get("capacity")
    if cap:
        lines += [
            "",
            f"Capacity (tiled `arcface`, chunk {CHUNKS[-1]:,}): {cap['largest_classes']:,} "
            f"classes ran (weights and their gradient {cap['weights_and_grad_gib']} GiB); "
            + (
                f"{cap['first_failing']:,} did not."
                if cap["bounded"]
                else "the search ran out of time (a lower bound)."
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--classes", default="100000,1000000,10000000")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--budget-seconds", type=float, default=240.0)
    ap.add_argument("--probe", type=int, default=None)
    ap.add_argument(
        "--cce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time Cut Cross-Entropy (a peer) on normalized_softmax's logits (default: on CUDA)",
    )
    args = ap.parse_args(argv)
    if args.probe is not None:
        return probe(args.probe, torch.device(args.device), args.output)
    device = torch.device(args.device)
    start = time.monotonic()
    args.output.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result: dict[str, Any] = {"device_name": name, "steps": args.steps, "rows": []}
    chunks = CHUNKS if device.type == "cuda" else (256,)
    cce = device.type == "cuda" if args.cce is None else args.cce

    def save() -> None:
        (args.output / "class_tiles.json").write_text(json.dumps(result, indent=1))
        (args.output / "class_tiles.md").write_text(markdown(result))

    for c in (int(v) for v in args.classes.split(",")):
        if time.monotonic() - start > args.budget_seconds:
            result["cut_off"] = True
            break
        result["rows"] += run_case(c, device, args.steps, chunks, cce)
        save()
    if args.capacity:
        result["capacity"] = capacity(device, start + args.budget_seconds)
        save()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
