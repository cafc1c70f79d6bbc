"""Numeric building blocks shared by losses, reducers, distances and the tiled paths.

| helper | computes |
|---|---|
| :func:`masked_logsumexp` | row-wise ``log Σ_j w_j e^{x_j}`` over kept entries, one autograd node |
| :func:`row_logsumexp` / :func:`row_softmax` | its forward and its gradient, as plain functions (tiles) |
| :func:`masked` | ``x`` on kept entries, ``−finfo.max`` elsewhere |
| :func:`ratio` | ``num / den``, 0 (with a zero gradient) where ``den == 0`` |
| :class:`FirstOrder`, :func:`first_order_backward`, :func:`unrecorded` | a gradient formed as a Function of its own, whose second differentiation raises (the tiled engine, ``pf.chunked.loss``) |
| :func:`sigmoid`, :func:`sigmoid_` | ``σ(x)`` with its subnormal tail (``torch.sigmoid`` returns 0 below −88.7 in float32); in place with ``σ(1 − σ)`` |
| :func:`logaddexp` | ``torch.logaddexp``, in a form inductor compiles well (and, ``twice``, with a finite second derivative at ``−finfo.max``) |
| :func:`indicator` | ``[x > 0]`` or ``[x ≥ 0]`` as a float mask, no bool tensor |
| :func:`count_true` | the true entries of a bool mask, by an ``int32`` sum |
| :func:`unit_rows` | ``F.normalize`` along the last dim, with a written-out backward for ``p = 2`` |
| :func:`scalar_like`, :func:`shift`, :func:`rshift` | a hyper-parameter combined with a tensor |
| :func:`cross_entropy` | per-row ``logsumexp(z) − z[label]`` |
| :func:`matmul`, :func:`einsum`, :func:`addmm_`; :func:`no_autocast` | in the operands' dtype, also under ``torch.autocast`` (``addmm_``: accumulated in place); the context they run in (also around a backward run inside a forward) |
| :func:`self_product_grad` | the gradient of ``x xᵀ``, one product where the transposed add is cheaper |
| :func:`bin_floor` | a histogram node index valid for any input (NaN, ±inf included) |
| :func:`scatter_`, :func:`index_copy_` | in place where the transforms allow |
| :func:`argsort_rows` | a stable argsort along the last dim (NumPy's vectorised sort in CPU eager mode) |
| :func:`apply` | an ``autograd.Function`` called without torch's per-call signature binding |
| :func:`readable`, :func:`sparse_rows`, :func:`scatter_rows` | whether values may be read (CPU eager); a sparse mask's columns per row, and values on them put back in place |

Masks enter by arithmetic rather than ``where`` wherever a mask is scattered: on CPU a ``where``
with a scattered mask is ~25× slower than a multiply-add.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "addmm_",
    "apply",
    "argsort_rows",
    "bin_floor",
    "count_true",
    "cross_entropy",
    "einsum",
    "fresh",
    "index_copy_",
    "indicator",
    "inside_transform",
    "logaddexp",
    "masked",
    "masked_logsumexp",
    "matmul",
    "no_autocast",
    "ratio",
    "renorm_rows",
    "row_logsumexp",
    "row_softmax",
    "row_values",
    "rshift",
    "scalar_like",
    "scalar_tensor",
    "scatter_",
    "scatter_rows",
    "self_product_grad",
    "shift",
    "sigmoid",
    "sigmoid_",
    "sparse_rows",
    "unit_rows",
]


def masked(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` on kept entries (``keep`` is a 0/1 float mask), ``−finfo.max`` elsewhere: a fresh
    buffer, by arithmetic. A non-finite ``x`` on an entry not kept gives NaN there (``x · 0``):
    a NaN or infinity in the input is never dropped silently."""
    return torch.addcmul((keep - 1.0).mul_(torch.finfo(x.dtype).max), x, keep)


def _exp_shifted_(buf: Tensor, shift: Tensor, weights: Tensor) -> Tensor:
    """In place on a :func:`masked` buffer: ``w · exp(max(buf − shift, −80))``.

    Masked entries (``−finfo.max``) give 0. Exponents are clamped at −80 (e⁻⁸⁰ ≈ 2e-35 is far
    below any dtype's precision relative to the row maximum's e⁰) because CPU ``exp`` of
    arguments that underflow is ~35× slower than of ordinary ones.
    """
    return buf.sub_(shift).clamp_min_(-80.0).exp_().mul_(weights)


def row_logsumexp(x: Tensor, weights: Tensor, keep: Tensor | None = None) -> Tensor:
    """The forward of :func:`masked_logsumexp` (no autograd node of its own): rows with nothing
    kept (or only −inf) give ``−finfo.max``; a row with a kept +inf gives +inf (as
    ``torch.logsumexp``); a row with a NaN, or with an infinity on an entry not kept
    (:func:`masked`), gives NaN."""
    if keep is None:
        keep = weights
    low = -torch.finfo(x.dtype).max
    buf = masked(x, keep)
    shift = buf.amax(-1, keepdim=True)
    # Empty rows (nothing kept, or only −inf) are −finfo.max; a NaN shift is not empty: it
    # propagates, so that a non-finite input never reads as an empty row (a loss of 0). A +inf
    # shift is not subtracted (inf − inf is NaN): e^{+inf} makes the sum, and the result, +inf.
    has_any = ~(shift <= low)
    shift = torch.where(has_any & (shift != torch.inf), shift, 0.0)
    s = _exp_shifted_(buf, shift, weights).sum(-1, keepdim=True)
    lse = torch.where(has_any, torch.log(torch.where(has_any, s, 1.0)) + shift, low)
    return lse.squeeze(-1)


def row_softmax(x: Tensor, weights: Tensor, lse: Tensor) -> Tensor:
    """``w · e^{x − lse}`` on kept entries (``w > 0``): the gradient of :func:`row_logsumexp`
    with respect to ``x`` (0 on rows with nothing kept). Four passes: a kept entry has
    ``x ≤ lse``, so clamping the exponent to ``[−80, 80]`` changes no kept value and keeps
    ``e^{x − lse}`` finite where ``w = 0`` (no :func:`masked` buffer)."""
    if torch.is_grad_enabled():  # recorded (a second derivative): out of place, autograd's
        return torch.exp((x - lse.unsqueeze(-1)).clamp(-80.0, 80.0)) * weights
    e = (x - lse.unsqueeze(-1)).clamp_(-80.0, 80.0).exp_()
    return _mul_fresh_(e, weights)


def _mul_fresh_(fresh_buf: Tensor, other: Tensor) -> Tensor:
    """``fresh_buf * other``, in place on the fresh buffer except inside ``torch.func``
    transforms (where ``other`` may be batched and the buffer not)."""
    if torch.compiler.is_compiling() or not inside_transform():
        return fresh_buf.mul_(other)
    return fresh_buf * other


class _MaskedLogSumExp(torch.autograd.Function):
    """:func:`row_logsumexp` as one autograd node.

    The forward keeps only the per-row result (plus the inputs); the backward recomputes the
    softmax weights (:func:`row_softmax`, one buffer). Two ``B × M`` buffers forward, one
    backward, instead of the half-dozen temporaries of the composed ops (each a fresh
    allocation, page faults included).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weights: Tensor, keep: Tensor | None) -> Tensor:
        # keep is None: 0/1 weights (a flag: compile rejects one tensor given twice)
        return row_logsumexp(x, weights, keep)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weights, _ = inputs
        ctx.save_for_backward(x, weights, output)

    @staticmethod
    def backward(ctx, g):
        x, weights, lse = ctx.saved_tensors
        p = row_softmax(x, weights, lse)
        if torch.is_grad_enabled():  # recorded (a second derivative): no op in place
            return p * g.unsqueeze(-1), None, None
        return _mul_fresh_(p, g.unsqueeze(-1)), None, None


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, every argument given positionally.

    ``Function.apply`` binds the arguments to ``forward``'s signature on every call (for
    ``setup_context``, through ``inspect.signature``: ~15 µs on CPU, a tenth of a small loss's
    step). With every argument given there is nothing to bind, so in plain eager mode this calls
    the C++ ``apply`` directly (after the same unwrapping of dead ``torch.func`` wrappers);
    inside ``torch.func`` transforms and under ``torch.compile`` it is ``fn.apply``.
    """
    if _unwrap_dead_wrappers is None or torch.compiler.is_compiling() or _transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*_unwrap_dead_wrappers(args))  # type: ignore[misc]


def first_order_backward(what: str, instead: str):
    """The backward of a :class:`FirstOrder` Function: raises that ``what`` is not
    differentiable (a second time), and says what to do ``instead``."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{what} is not differentiable (double backward, torch.func.hessian); {instead}"
        )

    return backward


class FirstOrder(torch.autograd.Function):
    """A first-order backward as a Function of its own: its forward forms the gradients (no
    context to set up), its backward raises (a subclass sets ``backward`` to a
    :func:`first_order_backward`). As a Function, the first-order backward records no graph under
    ``create_graph=True`` or ``torch.func.grad``, so memory stays bounded, and a second
    differentiation fails loudly instead of silently missing terms."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


def unrecorded() -> bool:
    """Whether nothing records a backward's operations: plain eager autograd without
    ``create_graph`` (grad mode off in the backward), no ``torch.func`` transform, not
    compiling. There the formed gradients are scaled directly; elsewhere through
    a :class:`FirstOrder` Function, whose backward raises on a second differentiation (a
    Function applied costs ~20 µs on a CPU)."""
    return (
        not torch.is_grad_enabled() and not torch.compiler.is_compiling() and not inside_transform()
    )


def masked_logsumexp(x: Tensor, weights: Tensor, keep: Tensor | None = None) -> Tensor:
    """``log Σ_j w_j exp(x_j)`` along the last dim over the entries with ``w_j > 0``.

    ``keep`` is the 0/1 float indicator of ``w > 0``; pass it when it differs from ``weights``
    (pair counts). Rows with nothing kept get ``−finfo.max``, a finite stand-in for −∞ that keeps
    every gradient finite (``logaddexp`` with it returns the other operand).
    """
    return apply(_MaskedLogSumExp, x, weights, keep)


def count_true(mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The number of true entries of a bool ``mask`` (along ``dim``), as an ``int32`` sum where
    it cannot overflow: a bool sum accumulates in ``int64`` and on a CPU runs ~16× slower
    (2048 × 2048 along rows: 25 ms against 1.5 ms)."""
    dtype = torch.int32 if mask.numel() < 2**31 else torch.int64
    if dim is None:
        return mask.sum(dtype=dtype)
    return mask.sum(dim, keepdim=keepdim, dtype=dtype)


def indicator(x: Tensor, *, strict: bool = True) -> Tensor:
    """``[x > 0]`` (``strict``) or ``[x ≥ 0]`` as a 0/1 tensor of ``x``'s float dtype, by
    arithmetic (detached: an indicator carries no gradient); NaN where ``x`` is NaN (a
    non-finite input is never read as "not selected"), ``[+inf > 0] = 1``, ``[−inf ≥ 0] = 0``.

    ``⌈clamp(x, 0, 1)⌉ + 0`` and ``⌊clamp(x, −1, 0)⌋ + 1``, three passes: ``clamp`` keeps a
    NaN, where ``torch.sign`` (eager and compiled) maps it to 0, so that the ``sign``-based form
    read a NaN as not selected; the ``+ 0`` makes ``x = −0`` give ``+0``.

    No bool tensor is made. In eager mode a comparison costs a conversion before it can weight
    anything; under ``torch.compile`` on a CPU, a boolean ``B × M`` mask that a training graph
    saves for its backward is stored by inductor ~20× slower than a float one (a comparison's
    mask at B = 512: ~3 ms against 0.15 ms for the float form)."""
    v = x.detach()
    if strict:
        return v.clamp(0.0, 1.0).ceil_().add_(0.0)
    return v.clamp(-1.0, 0.0).floor_().add_(1.0)


_RENORM_MAX = 1e-5  # PML's P2SGrad: weight.renorm(2, 1, 1e-5).mul(1e5)


def renorm_rows(w: Tensor) -> Tensor:
    """``w.t().renorm(2, 1, 1e-5).mul(1e5).t()``: P2SGrad's (PML's) projection of each row onto
    the unit sphere (rows of norm at most ``1e-5`` are scaled by ``1e5`` instead), written with
    plain ops (``renorm`` has no vmap batching rule)."""
    n = torch.linalg.vector_norm(w, dim=-1, keepdim=True)
    factor = torch.where(n > _RENORM_MAX, _RENORM_MAX / (n + 1e-7), 1.0)
    return (w * factor) * (1.0 / _RENORM_MAX)


_NORMALIZE_EPS = 1e-12  # F.normalize's


class _UnitRows(torch.autograd.Function):
    """``x / max(‖x‖₂, ε)`` along the last dim (``F.normalize``'s value, bit for bit) with the
    backward written out: ``(g − y·(y·g)·[‖x‖ ≥ ε]) / max(‖x‖, ε)`` (no projection where the
    norm is below ``ε``, as autograd's). Autograd's composed backward of ``F.normalize`` runs
    a dozen ops and nodes (~0.2 ms fwd+bwd at 128 × 128 on a CPU); this, six (~0.15 ms).
    The forward's norms are a second output (not differentiable), which a first-order backward
    reads; where the backward is itself recorded (``create_graph=True``) it recomputes them
    from ``x`` in differentiable ops: higher derivatives work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> tuple[Tensor, Tensor]:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x / norm.clamp_min(_NORMALIZE_EPS), norm

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        y, norm = output
        ctx.mark_non_differentiable(norm)
        ctx.set_materialize_grads(False)  # no zeros for the norms' cotangent
        ctx.save_for_backward(x, y, norm)

    @staticmethod
    def backward(ctx, g, _):
        if g is None:  # only the norms' cotangent (a higher-order pass): nothing reaches x
            return None
        x, y, norm = ctx.saved_tensors
        if torch.is_grad_enabled():  # recorded: the norms as a function of x
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        # no projection below ε; a NaN norm's row stays NaN through y
        along = torch.where(norm >= _NORMALIZE_EPS, (y * g).sum(-1, keepdim=True), 0.0)
        return torch.addcmul(g, y, along, value=-1.0) / norm.clamp_min(_NORMALIZE_EPS)


def unit_rows(x: Tensor, p: float = 2) -> Tensor:
    """``F.normalize(x, p=p, dim=-1)``; for ``p = 2`` by :class:`_UnitRows` (the same values,
    a shorter backward)."""
    if p != 2:
        return F.normalize(x, p=p, dim=-1)
    return apply(_UnitRows, x)[0]


SIGMOID_CLAMP = 80.0  # σ(x) rounds to 1 in float32 and float64 long before e^80 overflows


def sigmoid(x: Tensor) -> Tensor:
    """``σ(x)`` with its subnormal tail: ``e / (1 + e)``, ``e = exp(min(x, 80))``.
    ``torch.sigmoid`` computes ``1 / (1 + e^{−x})`` and returns 0 once ``e^{−x}`` overflows
    (``x < −88.7`` in float32), where ``σ(x) ≈ e^x`` is still a (subnormal) number: NT-Xent's
    ``−log(σ + ε)`` with ``ε = finfo.tiny`` reads it (a logit 88–104 below its negatives'
    log-sum-exp: temperatures of 0.005 and below) and lost up to 0.4 of a term and its whole
    gradient there. Differentiable (the gradient ``e / (1 + e)²``, 0 above the clamp, where
    ``σ'`` is below ``e^{−80}``)."""
    e = torch.exp(torch.clamp_max(x, SIGMOID_CLAMP))
    return e / (1.0 + e)


def sigmoid_(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(σ(x), σ(x)(1 − σ(x)))`` as :func:`sigmoid` computes them, ``σ`` in ``x``'s buffer:
    σ's derivative, exactly 0 where ``σ`` rounds to 1 (from ``x ≈ 17`` in float32, ``37`` in
    float64: a sentinel such as 100 leaves no trace). Not differentiable (a first-order
    walk's)."""
    e = x.clamp_max_(SIGMOID_CLAMP).exp_()
    sig = e.div_(torch.add(e, 1.0))  # (a division: σ ≤ 1, where e · (1/(1+e)) may not be)
    return sig, torch.rsub(sig, 1.0).mul_(sig)


def logaddexp(a: Tensor, b: Tensor, *, twice: bool = False) -> Tensor:
    """``torch.logaddexp(a, b)``; under ``torch.compile``, and with ``twice``, as ``max(a, b) +
    log1p(e^{−|a − b|})``, the same function to rounding, but for equal infinities (NaN instead
    of that infinity: non-finite either way). Inductor's CPU code for ``logaddexp`` of a row
    vector against a column vector in a training graph saves boolean masks for its backward
    (see :func:`indicator`) and ran ~4x slower than this form (lifted structure at B = 512:
    6.7 -> 2.1 ms for that part, forward and backward). ``twice``: where an argument may be an
    empty row's ``−finfo.max`` (:func:`masked_logsumexp`) and the loss is differentiated twice:
    ``torch.logaddexp``'s second derivative there is NaN (``e^{finfo.max} / (1 + e^{…})²``),
    this form's 0."""
    if not (twice or torch.compiler.is_compiling()):
        return torch.logaddexp(a, b)
    return torch.maximum(a, b) + torch.log1p(torch.exp(-(a - b).abs()))


def ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``den == 0`` (and a zero, not NaN, gradient there).

    Non-finite values are never read as an empty selection: a NaN ``den`` gives NaN, and where
    ``den == 0`` the result is ``num · 0`` (0 for a finite ``num``, NaN for a non-finite one: a
    sum over no selected terms that met a NaN term, weighted 0, is NaN).
    """
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), num * 0)


def bin_floor(t: Tensor, lo: int, hi: int) -> Tensor:
    """``floor(t)`` clamped to ``[lo, hi]``, with NaN mapped to ``lo``: a valid histogram node
    for every input, as a float tensor without gradient (turn it into indices with ``.long()``).
    A non-finite ``t`` still reaches the loss through the interpolation weights it is used in."""
    return torch.floor(t.detach()).nan_to_num(float(lo)).clamp(lo, hi)


def _autocast_device(t: Tensor) -> str:
    return "cpu" if t.device.type == "meta" else t.device.type


def _autocast_on(device: str) -> bool:
    """Whether autocast is enabled for ``device`` (always assumed under ``torch.compile``, where
    the context is free and traced)."""
    return torch.compiler.is_compiling() or torch.is_autocast_enabled(device)


def no_autocast(ref: Tensor) -> contextlib.AbstractContextManager[Any]:
    """A context with autocast off on ``ref``'s device (a no-op context where it is off: it
    costs ~3 µs a call): inside it, ops run in their operands' dtypes. For pmlfunc's own
    products, and for a backward it runs inside its forward (the chunked and first-order paths:
    a CPU backward runs on the calling thread, in the user's autocast region)."""
    device = _autocast_device(ref)
    if not _autocast_on(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)


def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` with autocast off: in the operands' dtype (float32 for a loss's low-precision
    inputs), also inside ``torch.autocast``. Under autocast a matmul runs in bfloat16/float16,
    which turns the Euclidean expansion's cancellation and every reduction's sums into wrong
    numbers; a loss's matmuls are a small part of a step. ``out``: a buffer to write into (eager,
    no autograd)."""
    with no_autocast(a):
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def addmm_(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``c += a @ b`` in ``c``'s buffer (``c`` may be a view with unit stride along its last
    dim, a block of columns): accumulated by the GEMM (``Tensor.addmm_``: no product tensor,
    no second pass over ``c``), autocast off (as :func:`matmul`); inside ``torch.func``
    transforms the product is added to ``c`` (``add_``)."""
    if not torch.compiler.is_compiling() and inside_transform():
        return c.add_(matmul(a, b))
    with no_autocast(a):
        return c.addmm_(a, b)


def einsum(equation: str, *operands: Tensor) -> Tensor:
    """``torch.einsum`` with autocast off (as :func:`matmul`)."""
    with no_autocast(operands[0]):
        return torch.einsum(equation, *operands)


def scalar_tensor(value: float | Tensor, ref: Tensor) -> Tensor:
    """``value`` as a 0-d tensor of ``ref``'s dtype and device. A Python number is filled on the
    device (``torch.full``), not copied from the host: ``torch.as_tensor(x, device="cuda")`` is
    a blocking host-to-device copy that CUDA-graph capture refuses."""
    if isinstance(value, Tensor):
        return value.to(dtype=ref.dtype, device=ref.device)
    return torch.full((), value, dtype=ref.dtype, device=ref.device)


def fresh(out: Tensor) -> Tensor:
    """The output of an autograd Function's forward that was built in place, made safe for
    ``torch.compile`` on PyTorch < 2.13: there a Function whose forward returns a tensor it
    modified in place gets its gradient routed to the wrong tensor (pytorch#180642); a view of
    it does not. Free (a view) and a no-op outside compile."""
    return out.view_as(out) if torch.compiler.is_compiling() else out


def scalar_like(value: float | Tensor, ref: Tensor) -> float | Tensor:
    """A hyper-parameter ready to combine with ``ref``: tensors are cast to its dtype/device."""
    if isinstance(value, Tensor):
        return value.to(dtype=ref.dtype, device=ref.device)
    return value


def row_values(value: float | Tensor, ref: Tensor) -> Tensor:
    """``(B,)``: a scalar hyper-parameter repeated for each of ``ref``'s rows (a view when it
    is a tensor, so its gradient flows)."""
    if isinstance(value, Tensor):
        return value.to(dtype=ref.dtype, device=ref.device).expand(ref.shape[0])
    return ref.new_full((ref.shape[0],), value)


def shift(x: Tensor, value: float | Tensor) -> Tensor:
    """``x - value`` without a pass over ``x`` when ``value`` is the Python number 0."""
    if isinstance(value, float) and value == 0.0:
        return x
    return x - scalar_like(value, x)


def rshift(value: float | Tensor, x: Tensor) -> Tensor:
    """``value - x`` in one pass."""
    return torch.rsub(x, scalar_like(value, x))


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row ``logsumexp(logits) − logits[label]`` (``CrossEntropyLoss(reduction="none")``):
    torch's fused kernel for ``(N, C)`` logits (one pass each way, no scattered gather in the
    backward), the two ops otherwise."""
    if logits.ndim == 2:
        return F.cross_entropy(logits, labels.long(), reduction="none")
    return torch.logsumexp(logits, -1) - logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


try:  # private (apply's shortcut): without them, apply is plain fn.apply
    from torch._C import _are_functorch_transforms_active as _transforms_active
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
except ImportError:  # pragma: no cover - a torch without them: always take the safe path
    _unwrap_dead_wrappers = None  # type: ignore[assignment]

    def _transforms_active() -> bool:
        return True


def inside_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ...) is running: its tensors
    cannot be read on the host, and some ops lack batching rules. (Dynamo traces this query
    inside a compiled transform; ``torch._C._functorch.maybe_current_level`` breaks the graph.)"""
    return _transforms_active()


def readable(t: Tensor) -> bool:
    """Whether reading ``t``'s values on the host is free and safe: a CPU tensor in eager mode,
    outside ``torch.func`` transforms. There a data-dependent shortcut (a check, or skipping
    work that the values show to be a no-op) costs nothing and breaks no trace; on an
    accelerator (asynchronous, capturable in a CUDA graph) and under ``torch.compile`` the
    static path runs."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not inside_transform()


SPARSE_FRACTION = 1 / 8  # sparse_rows: listing pays up to an eighth of the columns


def sparse_rows(mask: Tensor, cost: float = 1.0) -> tuple[Tensor, Tensor] | None:
    """Each row's nonzero columns of a 2-D ``mask`` as ``(index, valid)``, both ``(R, K)`` with
    ``K`` the longest row's count (at least 1): row ``r``'s columns in order, then padding
    (column 0, ``valid`` False). Only where listing is free (:func:`readable`) and worth it:
    ``cost·K`` at most :data:`SPARSE_FRACTION` of the columns (``cost``: what the caller's
    work per listed column costs relative to a pass over a row), so that work on the listed
    layout costs a fraction of the same work on the matrix. Else ``None``, and the caller
    takes its dense (static-shape) path over every column; also for a mask with a NaN (or
    negative) entry, which no count lists: the dense path carries it."""
    if not readable(mask) or mask.ndim != 2 or mask.shape[0] == 0:
        return None
    # masks are non-negative: sign() is the 0/1 indicator. A float sum, not a bool one (at
    # 2048 × 2048: 2 ms against 17 ms), and nonzero of the floats themselves (no bool pass).
    counts = mask.sign().sum(-1).long()
    k = max(int(counts.max()), 1)
    if cost * k > SPARSE_FRACTION * mask.shape[-1]:
        return None
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each row's columns in order
    if rows.numel() != int(counts.sum()):  # a NaN is nonzero but has sign 0 (a negative, −1)
        return None
    slot = torch.arange(rows.numel(), device=mask.device) - (counts.cumsum(0) - counts)[rows]
    shape = (mask.shape[0], k)
    index = torch.zeros(shape, dtype=torch.long, device=mask.device)
    valid = torch.zeros(shape, dtype=torch.bool, device=mask.device)
    return index.index_put_((rows, slot), cols), valid.index_put_((rows, slot), torch.tensor(True))


def label_rows(
    labels: Tensor, ref_labels: Tensor | None = None, cost: float = 1.0, compiled: bool = False
) -> tuple[Tensor, Tensor] | None:
    """:func:`sparse_rows` of the label positive mask, from the labels alone: each query row's
    columns of the same label (``ref_labels`` ``None``: the batch against itself, its own
    column left out), in the same layout, ``O(M log M + B·K)`` (a sort of the reference labels
    and a binary search each query) instead of passes over a ``B × M`` mask.

    In eager mode on a CPU the same rule as :func:`sparse_rows` (``None`` where ``cost·K``
    exceeds :data:`SPARSE_FRACTION` of the columns). Under ``torch.compile`` on a CPU, with
    ``compiled=True``, the custom operator ``pmlfunc::label_rows``, whose ``K`` is a size known
    at run time only (no recompilation when it changes), whatever ``K``: for a caller whose
    listed work replaces dense passes of its own (a transcendental per entry that the compiled
    kernels do not fuse into another pass: the tuplet-margin and lifted-structure terms) and
    costs no more than them when ``K`` nears ``M`` (``cost ≤ 1``). Where the dense term fuses
    into a row reduction that runs anyway (the generalized lifted structure's and circle's
    positive log-sum-exp), listing under compile costs more than it saves (measured, B = 512:
    1.9 -> 2.5x and 1.8 -> 2.0x the floor): ``compiled=False``, ``None`` there. Elsewhere
    (accelerators, ``torch.func`` transforms) ``None``: the dense path."""
    if labels.device.type != "cpu" or labels.ndim != 1 or labels.shape[0] == 0:
        return None
    if readable(labels):
        index, valid = _label_rows(labels, ref_labels)
        m = labels.shape[0] if ref_labels is None else ref_labels.shape[0]
        return None if cost * index.shape[-1] > SPARSE_FRACTION * m else (index, valid)
    if compiled and cost <= 1.0 and torch.compiler.is_compiling() and not inside_transform():
        return _label_rows_op(labels, ref_labels)
    return None


def _label_rows(labels: Tensor, ref_labels: Tensor | None) -> tuple[Tensor, Tensor]:
    """:func:`label_rows` of CPU labels, always listed (NumPy: ~15 small ops on ``B``-long
    vectors cost a few µs each there, against ~20 µs each as torch ops)."""
    y = labels.numpy()
    ref = y if ref_labels is None else ref_labels.numpy()
    order = np.argsort(ref, kind="stable")  # each label's columns together, in column order
    sorted_ref = ref[order]
    lo = np.searchsorted(sorted_ref, y, side="left")
    count = np.searchsorted(sorted_ref, y, side="right") - lo
    slot = np.arange(max(int(count.max(initial=0)) - (ref_labels is None), 1))
    if ref_labels is None:  # a row is one of its own label's columns: left out, the slots at
        count -= 1  # or past its place in the run read one further
        own = np.empty_like(order)
        own[order] = np.arange(order.shape[0])
        slot = slot + (slot >= (own - lo)[:, None])
    valid = np.arange(slot.shape[-1]) < count[:, None]
    index = np.where(valid, order[np.minimum(lo[:, None] + slot, ref.shape[0] - 1)], 0)
    return torch.from_numpy(index), torch.from_numpy(valid)


@torch.library.custom_op("pmlfunc::label_rows", mutates_args=(), device_types="cpu")
def _label_rows_op(labels: Tensor, ref_labels: Tensor | None) -> tuple[Tensor, Tensor]:
    return _label_rows(labels, ref_labels)


@_label_rows_op.register_fake
def _(labels: Tensor, ref_labels: Tensor | None) -> tuple[Tensor, Tensor]:
    m = labels.shape[0] if ref_labels is None else ref_labels.shape[0]
    # a bound only where the width is static (a graph made dynamic in the rows has none)
    bound = max(m, 1) if isinstance(m, int) else None
    k = torch.library.get_ctx().new_dynamic_size(min=1, max=bound)
    shape = (labels.shape[0], k)
    return labels.new_empty(shape, dtype=torch.long), labels.new_empty(shape, dtype=torch.bool)


def argsort_rows(keys: Tensor) -> Tensor:
    """``keys.argsort(stable=True, dim=-1)`` for integer ``keys``.

    PyTorch's CPU sort compares one pair at a time (6.5 ms for 512 rows of 512 ``int32``); NumPy
    sorts ``int64`` with a vectorised quicksort (x86-simd-sort/Highway: 0.5 ms). For CPU keys
    that fit 32 bits, each is packed with its column index into one ``int64`` (key high, index
    low: distinct, ordered by key then index) and NumPy sorts those; the index bits are the
    stable order. In eager mode that is a direct call; under ``torch.compile`` and inside
    ``torch.func`` transforms the same sort is the custom operator ``pmlfunc::argsort_rows``
    (static shapes, a batching rule: it traces into a full graph). Elsewhere (accelerators,
    64-bit keys) it is ``torch.argsort``.
    """
    n = keys.shape[-1]
    if keys.device.type != "cpu" or keys.dtype not in _SMALL_INTS or n >= 2**31:
        return keys.argsort(stable=True, dim=-1)
    if readable(keys):
        return _packed_argsort(keys)
    return _argsort_rows_op(keys)


def _packed_argsort(keys: Tensor) -> Tensor:
    """:func:`argsort_rows` of CPU keys of at most 32 bits, by NumPy (any leading dims)."""
    n = keys.shape[-1]
    packed = keys.detach().contiguous().numpy().astype(np.int64)  # one buffer, then in place
    packed <<= 32
    packed |= np.arange(n, dtype=np.int64)
    packed.sort(axis=-1)
    packed &= 0xFFFFFFFF
    return torch.from_numpy(packed)


@torch.library.custom_op("pmlfunc::argsort_rows", mutates_args=(), device_types="cpu")
def _argsort_rows_op(keys: Tensor) -> Tensor:
    return _packed_argsort(keys)


@_argsort_rows_op.register_fake
def _(keys: Tensor) -> Tensor:
    return keys.new_empty(keys.shape, dtype=torch.long)


def _argsort_rows_vmap(info: Any, in_dims: tuple[int | None], keys: Tensor) -> tuple[Tensor, int]:
    # rows along the last dim whatever the leading dims: the batch dim in front, one call
    (dim,) = in_dims
    return _argsort_rows_op(keys if dim is None else keys.movedim(dim, 0)), 0


_argsort_rows_op.register_vmap(_argsort_rows_vmap)


_SMALL_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32)


def scatter_rows(values: Tensor, listed: tuple[Tensor, Tensor], like: Tensor) -> Tensor:
    """``values`` on the listed columns (``(R, K)``, from :func:`sparse_rows`) put back into a
    zero matrix shaped as ``like``; the padding is dropped (also a NaN computed on it)."""
    index, valid = listed
    return torch.zeros_like(like).scatter_add(-1, index, torch.where(valid, values, 0.0))


SELF_PRODUCT_FUSE_LIMIT = 1 << 19  # self_product_grad: g + gᵀ where g has at most this many entries


ALIASED_STRIDE = 256  # entries: rows this many apart (or a multiple) share a CPU's cache sets


def unaliased(g: Tensor) -> Tensor:
    """``g``, or (a 2-D CPU ``g`` in eager mode, outside transforms, whose rows lie a multiple of
    :data:`ALIASED_STRIDE` entries apart) a copy whose rows lie 8 entries further apart, for a
    transposed read: down a column of such a ``g`` every entry falls into the same few sets of
    the cache, which a read of the column evicts as it goes. One thread, ``g + gᵀ`` at B = 512:
    555 → 169 µs with the copy (256: 53 → 39 µs); B = 384, 640 and 724 are not multiples and
    gain nothing from it."""
    if g.ndim != 2 or g.stride(-1) != 1 or g.stride(-2) % ALIASED_STRIDE or not readable(g):
        return g
    return padded_copy(g)


def padded_copy(g: Tensor) -> Tensor:
    """A copy of a 2-D ``g`` whose rows lie 8 entries further apart than its width, for a
    transposed read (:func:`unaliased`)."""
    rows, cols = g.shape
    return g.new_empty((rows, cols + 8))[:, :cols].copy_(g)


def self_product_grad(g: Tensor, x: Tensor, scale: float | Tensor | None = None) -> Tensor:
    """``scale · (g x + gᵀ x)``: the gradient of a self product ``scale · x xᵀ`` (both sides)
    given its upstream gradient ``g`` (``(..., B, B)``; ``scale`` ``None``: 1).

    On a CPU with ``g`` small enough to stay in cache (at most
    :data:`SELF_PRODUCT_FUSE_LIMIT` entries, B ≤ 724), as one product ``(g + gᵀ) x``: the
    transposed add costs a quarter to a half of the matmul it saves (B = 128 to 768, D = 128).
    A larger ``g``'s transposed read thrashes the cache (at B = 1024 it costs more than the
    matmul): on a CPU in eager mode with no gradient recorded, ``(g + gᵀ) x`` is then taken a
    pair of square blocks at a time (:func:`_blocked_self_product`), one product's FLOPs. On
    accelerators the matmul is the cheap part, and elsewhere (a recorded double backward,
    ``torch.func`` transforms, compile): two products.

    ``scale`` multiplies the ``B × B`` factor before the products, not the ``B × D`` result:
    a softmax's gradient under a large scale (``γ = 64``) has entries below float32's normal
    range (denormals: 0.26 % of them at B = 2,048 for the instance loss, 0.02 % once scaled),
    and a CPU's products slow down on denormal operands (2,048 × 128, one thread: 38 ms
    against 31 ms scaled first; fused at B = 512: 1.58 against 1.11 ms). In the fused path the
    scale costs nothing (in place on the sum, in cache); else one pass over ``g``. The
    transposed read is of :func:`unaliased` ``g``."""
    if g.device.type == "cpu" and g.shape[-1] * g.shape[-2] <= SELF_PRODUCT_FUSE_LIMIT:
        s = g + unaliased(g).transpose(-1, -2)
        if scale is not None:
            s = (
                s.mul_(scale)
                if torch.compiler.is_compiling() or not inside_transform()
                else s * scale
            )
        return matmul(s, x)
    if g.ndim == 2 and x.ndim == 2 and readable(g) and not torch.is_grad_enabled():
        return _blocked_self_product(g, x, scale)
    if scale is not None:
        g = g * scale
    return matmul(g, x) + matmul(g.transpose(-1, -2), x)


SELF_PRODUCT_BLOCK = 512  # _blocked_self_product: the side of its square blocks (1 MiB float32)


def _blocked_self_product(g: Tensor, x: Tensor, scale: float | Tensor | None) -> Tensor:
    """``scale · (g + gᵀ) x`` for a ``g`` too large for one transposed add in cache, in square
    blocks of :data:`SELF_PRODUCT_BLOCK`: for each pair ``t ≤ u`` of block rows, ``V = g_tu +
    g_utᵀ`` (the transposed read of one block, :func:`unaliased`, in cache) adds ``V x_u`` to
    the rows of ``t`` and ``Vᵀ x_t`` to those of ``u`` (``t = u``: once). Every entry of ``g``
    meets one product where ``g x + gᵀ x`` met two. One thread, float32, against two products:
    1,024 × 128 6.7–7.4 → 4.9 ms, 2,048 × 128 28–30 → 19–20, 2,048 × 512 102–108 → 54–60,
    4,096 × 128 118–125 → 80 (one product alone: 3.3, 13–14, 50–55, 62–66)."""
    b, c = g.shape[-1], SELF_PRODUCT_BLOCK
    out = torch.zeros_like(x)
    for t0 in range(0, b, c):
        t1 = min(b, t0 + c)
        for u0 in range(t0, b, c):
            u1 = min(b, u0 + c)
            v = g[t0:t1, u0:u1] + unaliased(g[u0:u1, t0:t1]).transpose(-1, -2)
            if scale is not None:
                v = v.mul_(scale)
            addmm_(out[t0:t1], v, x[u0:u1])
            if u0 != t0:
                addmm_(out[u0:u1], v.transpose(-1, -2), x[t0:t1])
    return out


def scatter_(buf: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """``buf.scatter_(-1, index, src)`` in place when possible.

    vmap has no batching rule for in-place ``scatter_`` (it falls back to a slow loop and warns),
    so inside any ``torch.func`` transform the out-of-place ``scatter`` is used; in plain eager
    mode and under ``torch.compile``, in place saves a copy of ``buf`` (on CPU, a fresh buffer's
    page faults cost more than the scatter itself).
    """
    if torch.compiler.is_compiling() or not inside_transform():
        return buf.scatter_(-1, index, src)
    return buf.scatter(-1, index, src)


def index_copy_(buf: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """``buf.index_copy_(dim, index, src)`` in place when possible (out of place inside
    ``torch.func`` transforms, as :func:`scatter_`)."""
    if torch.compiler.is_compiling() or not inside_transform():
        return buf.index_copy_(dim, index, src)
    return buf.index_copy(dim, index, src)
