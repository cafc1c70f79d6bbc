r"""Margin-softmax (classifier-head) losses: a softmax cross entropy over class weights whose
target logit carries a margin.

Every loss here is one computation with a different target-logit function ``ψ``:

.. math::
    \cos_{ij} = \hat x_i \cdot \hat w_j, \qquad
    z_{ij} = s\,\rho_{ij} \cdot \begin{cases} ψ(\cos_{ij}) & j = y_i \\ \cos_{ij} & j \ne y_i
    \end{cases}, \qquad
    \ell_i = \log \sum_j e^{z_{ij}} - z_{i y_i}

with ``x̂``, ``ŵ`` the L2-normalised embedding and class weight, ``s`` the scale and ``ρ`` the
magnitude factor (``‖x_i‖·‖w_j‖`` for large-margin softmax, ``‖x_i‖`` for SphereFace, ``1``
otherwise). The per-sample terms ``ℓ_i`` (PML's ``CrossEntropyLoss(reduction="none")``, times
the miner weights of an ``indices_tuple``) go through the reducer, ``mean()`` by default.

Parameters are ``{"weight": (num_classes, D)}``, or ``(num_classes, sub_centers, D)`` for the
sub-centre losses, whose class cosine is the largest over the class's sub-centres. PML 2.9.0
stores the transpose: ``W = weight.T`` of shape ``(D, num_classes)``, and for sub-centres
``W = weight.reshape(num_classes * sub_centers, D).T``, so PML's column ``c·K + k`` is our
``weight[c, k]`` (PML views its ``(B, C·K)`` cosines as ``(B, C, K)``).

ArcFace-family margins are in **radians** (PML 2.9.0 takes degrees: ``margin=28.6`` there is
``≈ 0.4992`` here; our default ``0.5`` is PML 3's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, _global
from .. import params as _params
from .._ops import cross_entropy, einsum, matmul, scalar_like
from ..reducers import Reducer, elements, mean, reduce
from ..tuples import sample_weights
from ._logits import CLASS_LOGITS, class_inputs
from ._regularize import regularize_params
from ._tiled import CLASS_TILED, class_cross_entropy

__all__ = [
    "arcface",
    "arcface_init",
    "cosface",
    "cosface_init",
    "dynamic_arcface",
    "dynamic_arcface_init",
    "dynamic_arcface_margins",
    "large_margin_softmax",
    "large_margin_softmax_init",
    "sphereface",
    "sphereface_init",
    "subcenter_arcface",
    "subcenter_arcface_init",
    "subcenter_arcface_outliers",
]

# A target function maps the target cosines (B,) and the labels to the target logits ψ (B,).
_Target = Callable[[Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------------------------
# shared machinery
# ----------------------------------------------------------------------------------------------
class _Head(NamedTuple):
    """What one margin loss is: its target function ``ψ``, the weights' ``ndim`` (3: the
    largest cosine over each class's sub-centres), the magnitude factor ``ρ`` (``"both"``:
    ``‖x_i‖·‖w_j‖``, ``"embedding"``: ``‖x_i‖``, ``"none"``) and the scale ``s``."""

    target: _Target
    ndim: int
    magnitude: str
    scale: float | Tensor


def _scale(scale: float | Tensor) -> float | Tensor:
    return _checks.hyper(scale, "scale", positive=True)


# each loss's head from (embeddings, params, its margin or margins, its scale)
_HEADS: dict[str, Callable[..., _Head]] = {
    "large_margin_softmax": lambda e, p, margin, scale: _Head(
        _multiplicative_target(_int_margin(margin)), 2, "both", _scale(scale)
    ),
    "sphereface": lambda e, p, margin, scale: _Head(
        _multiplicative_target(_int_margin(margin)), 2, "embedding", _scale(scale)
    ),
    "cosface": lambda e, p, margin, scale: _Head(
        _cosface_target(_checks.hyper(margin, "margin")), 2, "none", _scale(scale)
    ),
    "arcface": lambda e, p, margin, scale: _Head(
        _arcface_target(_checks.hyper(margin, "margin")), 2, "none", _scale(scale)
    ),
    "subcenter_arcface": lambda e, p, margin, scale: _Head(
        _arcface_target(_checks.hyper(margin, "margin")), 3, "none", _scale(scale)
    ),
    "dynamic_arcface": lambda e, p, margins, scale: _Head(
        _dynamic_target(e, p, margins), 3, "none", _scale(scale)
    ),
}


def _head_logits(name: str) -> Callable:
    """The :data:`CLASS_LOGITS` entry of the loss ``name``: :func:`_logits` of its head."""
    margin = "margins" if name == "dynamic_arcface" else "margin"

    def logits(embeddings: Tensor, params, labels: Tensor | None, hyper: dict) -> Tensor:
        head = _HEADS[name](embeddings, params, hyper[margin], hyper["scale"])
        x, weight = class_inputs(embeddings, labels, params, "weight", head.ndim, True)
        return _logits(x, weight, labels, head)

    return logits


def _margin_softmax(
    embeddings: Tensor,
    labels: Tensor,
    params,
    head: _Head,
    reducer: Reducer | None,
    indices_tuple,
    regularizers: tuple,
    class_chunk_size: object,
) -> Tensor:
    """The one computation behind every loss of this module (see the module docstring).

    ``class_chunk_size``: the same terms over tiles of that many classes
    (:func:`_tiled.class_cross_entropy`: the weights cast and normalised a tile at a time,
    never the ``(B, C)`` logits).
    """
    x, weight = class_inputs(embeddings, labels, params, "weight", head.ndim, False, False)
    tiled = class_chunk_size is not None
    chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size") if tiled else 0
    if tiled:
        losses = _tiled_terms(x, weight, labels, head, chunk)
    else:
        losses = cross_entropy(_logits(x, weight, labels, head), labels)
    miner = sample_weights(indices_tuple, x.shape[0], x.dtype, embeddings.device)
    if miner is not None:
        losses = losses * miner
    terms = {"loss": elements(losses)}
    loss = reduce((mean() if reducer is None else reducer), terms, labels, x.dtype)
    return regularize_params(loss, embeddings, weight, *regularizers)


def _logits(x: Tensor, weight: Tensor, labels: Tensor | None, head: _Head) -> Tensor:
    """The ``(B, C)`` logits ``z``: with the target's margin where ``labels`` are given,
    ``s·ρ·cos`` for every class where they are ``None``."""
    batch_size, num_classes = x.shape[0], weight.shape[0]
    w = weight.to(x.dtype)  # a new tensor when the dtype differs; the caller's is never touched
    x_hat = F.normalize(x, p=2, dim=1)
    w_hat = F.normalize(w.reshape(-1, w.shape[-1]), p=2, dim=1)
    cosine = matmul(x_hat, w_hat.t())  # (B, C) or (B, C·K)
    if head.ndim == 3:  # PML: view (B, C, K), max over the sub-centres (gradient to the argmax)
        cosine = cosine.view(batch_size, num_classes, w.shape[1]).max(dim=2).values
    factor = scalar_like(head.scale, cosine)  # s·ρ, one multiplication over the (B, C) logits
    if head.magnitude == "both":
        factor = (w.norm(p=2, dim=1).unsqueeze(0) * x.norm(p=2, dim=1).unsqueeze(1)) * factor
    elif head.magnitude == "embedding":
        factor = x.norm(p=2, dim=1, keepdim=True) * factor
    if labels is not None:
        idx = labels.long().unsqueeze(1)
        target_cos = cosine.gather(1, idx).squeeze(1)
        cosine = cosine.scatter(1, idx, head.target(target_cos, labels).unsqueeze(1))
    return cosine * factor


def _tiled_terms(x, weight, labels, head: _Head, chunk: int) -> Tensor:
    """The per-sample terms over tiles of ``chunk`` classes: the rows ``x̂``, the row factor
    ``r_i = s·ρ_i`` (``ρ_i = ‖x_i‖`` where the magnitude has it), the target function on the
    target cosine; L-Softmax's ``‖w_j‖`` read from unnormalised weights."""
    r = x.new_ones(x.shape[0]) * scalar_like(head.scale, x)
    if head.magnitude != "none":
        r = x.norm(p=2, dim=1) * r
    return class_cross_entropy(
        F.normalize(x, p=2, dim=1), r, weight, labels.long(), chunk=chunk,
        target=lambda c: head.target(c, labels), unit=head.magnitude != "both",
        magnitude=head.magnitude == "both",
    )  # fmt: skip


def _cosface_target(margin: float | Tensor) -> _Target:
    """CosFace's ``ψ = cos θ − m``."""
    return lambda c, labels: c - scalar_like(margin, c)


def _arcface_target(margin: float | Tensor) -> _Target:
    """ArcFace's ``ψ = cos(θ + m)`` (:func:`_arc_target`)."""
    return lambda c, labels: _arc_target(c, margin)


def _dynamic_target(embeddings: Tensor, params, margins: object) -> _Target:
    """Dynamic ArcFace's ``ψ = cos(θ + m_{y_i})``, ``margins`` checked against the table's
    classes (every class's, also when ``params`` hold a rank's shard)."""
    _checks.embeddings(embeddings)
    num_classes = _params.check(params, "weight", embeddings, ndim=3).shape[0]
    shard = _global.class_shard()  # params hold this rank's classes, margins every class's
    num_classes = num_classes if shard is None else shard.num_classes
    if not isinstance(margins, Tensor):
        raise TypeError(
            f"margins must be a (num_classes,) float tensor, got {type(margins).__name__}"
        )
    if not margins.dtype.is_floating_point:
        raise TypeError(f"margins must be floating point, got {margins.dtype}")
    if tuple(margins.shape) != (num_classes,):
        raise ValueError(
            f"margins must have shape (num_classes,) = ({num_classes},), got {tuple(margins.shape)}"
        )
    if margins.device != embeddings.device:
        raise ValueError(
            f"margins is on {margins.device} but embeddings are on {embeddings.device}"
        )
    return lambda c, labels: _arc_target(c, margins.to(c.dtype)[labels.long()])


def _cos_sin(margin: float | Tensor, ref: Tensor) -> tuple[float | Tensor, float | Tensor]:
    if isinstance(margin, Tensor):
        margin = margin.to(dtype=ref.dtype, device=ref.device)
        return torch.cos(margin), torch.sin(margin)
    return math.cos(margin), math.sin(margin)


def _arc_target(c: Tensor, margin: float | Tensor) -> Tensor:
    r"""ArcFace's ``cos(θ + m)`` for ``θ ≤ π − m``, else ``cos θ − m·sin m`` (PML's monotone
    extension), from ``c = cos θ`` without ``arccos``.

    ``cos(θ + m) = c·cos m − sin θ·sin m`` with ``sin θ = √((1 − c)(1 + c))``. Where
    ``(1 − c)(1 + c) ≤ 0`` (``|c| = 1``, or beyond by rounding) ``sin θ`` is 0 with a zero
    gradient, so the gradient is finite everywhere (PML's ``arccos`` gives NaN at ``|c| = 1``);
    elsewhere it equals PML's. ``θ ≤ π − m`` is ``c ≥ −cos m``.
    """
    cos_m, sin_m = _cos_sin(margin, c)
    margin = scalar_like(margin, c)
    sin2 = (1.0 - c) * (1.0 + c)
    inside = sin2 > 0
    sin_theta = torch.where(inside, torch.sqrt(torch.where(inside, sin2, 1.0)), 0.0)
    plus = c * cos_m - sin_theta * sin_m
    return torch.where(c >= -cos_m, plus, c - margin * sin_m)


def _multiplicative_target(margin: int) -> _Target:
    r"""L-Softmax's ``ψ(θ) = (−1)^k cos(mθ) − 2k``, ``k = ⌊θm/π⌋``.

    ``cos(mθ)`` is the Chebyshev polynomial ``T_m(cos θ)`` (recurrence
    ``T_{n+1} = 2c·T_n − T_{n−1}``; the same polynomial as PML's binomial sum, Eq. 7 of the
    paper), so its gradient is finite at ``|c| = 1``; ``k`` is piecewise constant (no gradient),
    computed as PML does from ``arccos`` of the clamped cosine.
    """

    def target(c: Tensor, labels: Tensor) -> Tensor:
        t_prev, t = torch.ones_like(c), c
        for _ in range(margin - 1):
            t_prev, t = t, 2.0 * c * t - t_prev
        with torch.no_grad():
            angles = torch.acos(torch.clamp(c.detach(), -1.0, 1.0))
            k = torch.floor(angles / (math.pi / margin))
            sign = 1.0 - 2.0 * torch.remainder(k, 2.0)
        return sign * t - 2.0 * k

    return target


def _int_margin(margin: object) -> int:
    if isinstance(margin, Tensor):
        raise TypeError(
            "margin must be a Python int for this loss (it is the degree of cos(m·θ)), got a tensor"
        )
    margin = _checks.number(margin, "margin")
    if margin != int(margin) or margin < 1:
        raise ValueError(f"margin must be a positive integer, got {margin}")
    return int(margin)


def _init(
    num_classes: int,
    embedding_size: int,
    sub_centers: int | None,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    device,
) -> dict[str, Tensor]:
    """PML's ``torch.nn.init.normal_`` of its ``(D, C)`` (or ``(D, C·K)``) ``W``, transposed.

    The values are drawn in PML's layout, so a generator seeded like PML's global RNG gives
    PML's exact initial weights.
    """
    cols = num_classes if sub_centers is None else num_classes * sub_centers
    w = _params.init_normal((embedding_size, cols), generator=generator, dtype=dtype, device=device)
    w = w.t().contiguous()
    if sub_centers is not None:
        w = w.view(num_classes, sub_centers, embedding_size)
    return {"weight": w}


# ----------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------
def large_margin_softmax(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: int = 4,
    scale: float | Tensor = 1.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""Large-margin softmax (L-Softmax): a multiplicative angular margin ``cos(mθ)``.

    With ``θ_{ij}`` the angle between ``x_i`` and ``w_j`` and ``k = ⌊θ m / π⌋``:

    .. math::
        ψ(θ) = (-1)^k \cos(mθ) - 2k, \qquad
        z_{ij} = s\,‖x_i‖\,‖w_j‖ \cdot \begin{cases} ψ(θ_{ij}) & j = y_i \\ \cos θ_{ij} & j \ne y_i
        \end{cases}, \qquad
        \ell_i = \log \sum_j e^{z_{ij}} - z_{i y_i}

    ``cos(mθ)`` is evaluated as the Chebyshev polynomial ``T_m(cos θ)``.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, D)}`` from :func:`large_margin_softmax_init`.
        margin: integer ``m ≥ 1`` (default ``4``); a Python int (it sets the polynomial degree).
        scale: ``s`` (default ``1``).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional PML-style miner output; each sample's loss is weighted by its
            count in the tuple over the largest count (PML's ``convert_to_weights``).
        class_chunk_size: ``None`` (default): the whole ``(B, C)`` logit matrix. An int: the
            same loss over tiles of that many classes, never the ``(B, C)`` matrix, in either
            pass (memory ``O(B × class_chunk_size)`` beyond the weights and their gradient;
            see the "Millions of classes" guide). Not differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = large_margin_softmax_init(10, 16, generator=torch.Generator().manual_seed(0))
        >>> loss = large_margin_softmax(torch.randn(8, 16), torch.randint(0, 10, (8,)), params)

    Reference: Liu, Wen, Yu, Yang, "Large-Margin Softmax Loss for Convolutional Neural
    Networks", ICML 2016.
    """
    head = _HEADS["large_margin_softmax"](embeddings, params, margin, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


def sphereface(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: int = 4,
    scale: float | Tensor = 1.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""SphereFace (A-Softmax): L-Softmax with normalised class weights.

    As :func:`large_margin_softmax` with ``‖w_j‖`` replaced by 1:

    .. math::
        z_{ij} = s\,‖x_i‖ \cdot \begin{cases} (-1)^k \cos(mθ_{ij}) - 2k & j = y_i \\
        \cos θ_{ij} & j \ne y_i \end{cases}, \qquad
        \ell_i = \log \sum_j e^{z_{ij}} - z_{i y_i}

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, D)}`` from :func:`sphereface_init`.
        margin: integer ``m ≥ 1`` (default ``4``, PML's).
        scale: ``s`` (default ``1``, PML's).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional miner output, as in :func:`large_margin_softmax`.
        class_chunk_size: as in :func:`large_margin_softmax`.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = sphereface_init(10, 16, generator=torch.Generator().manual_seed(0))
        >>> loss = sphereface(torch.randn(8, 16), torch.randint(0, 10, (8,)), params)

    Reference: Liu, Wen, Yu, Li, Raj, Song, "SphereFace: Deep Hypersphere Embedding for Face
    Recognition", CVPR 2017.
    """
    head = _HEADS["sphereface"](embeddings, params, margin, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


def cosface(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: float | Tensor = 0.35,
    scale: float | Tensor = 64.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""CosFace (large-margin cosine loss, AM-Softmax): an additive cosine margin.

    .. math::
        z_{ij} = s \cdot \begin{cases} \cos θ_{ij} - m & j = y_i \\ \cos θ_{ij} & j \ne y_i
        \end{cases}, \qquad
        \ell_i = \log \sum_j e^{z_{ij}} - z_{i y_i}

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, D)}`` from :func:`cosface_init`.
        margin: ``m`` (default ``0.35``); a 0-d tensor may change without recompiling.
        scale: ``s`` (default ``64``).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional miner output, as in :func:`large_margin_softmax`.
        class_chunk_size: as in :func:`large_margin_softmax`.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = cosface_init(10, 16, generator=torch.Generator().manual_seed(0))
        >>> loss = cosface(torch.randn(8, 16), torch.randint(0, 10, (8,)), params, margin=0.2)

    Reference: Wang et al., "CosFace: Large Margin Cosine Loss for Deep Face Recognition",
    CVPR 2018.
    """
    head = _HEADS["cosface"](embeddings, params, margin, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


def arcface(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: float | Tensor = 0.5,
    scale: float | Tensor = 64.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""ArcFace (additive angular margin loss): ``cos(θ + m)`` on the target class.

    .. math::
        ψ(θ) = \begin{cases} \cos(θ + m) & θ \le π - m \\ \cos θ - m \sin m & \text{otherwise}
        \end{cases}, \qquad
        z_{ij} = s \cdot \begin{cases} ψ(θ_{ij}) & j = y_i \\ \cos θ_{ij} & j \ne y_i
        \end{cases}, \qquad
        \ell_i = \log \sum_j e^{z_{ij}} - z_{i y_i}

    (the second case keeps ``ψ`` decreasing, as in PML). Computed from ``cos θ`` without
    ``arccos``: the gradient is finite at ``|cos θ| = 1`` (an embedding on its class weight),
    where PML's is NaN.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, D)}`` from :func:`arcface_init`.
        margin: ``m`` in **radians** (default ``0.5``; PML 2.9.0 takes degrees, default
            ``28.6°`` ≈ ``0.4992``); a 0-d tensor may change without recompiling.
        scale: ``s`` (default ``64``).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional miner output, as in :func:`large_margin_softmax`.
        class_chunk_size: as in :func:`large_margin_softmax`.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = arcface_init(10, 16, generator=torch.Generator().manual_seed(0))
        >>> loss = arcface(torch.randn(8, 16), torch.randint(0, 10, (8,)), params)

    Reference: Deng, Guo, Xue, Zafeiriou, "ArcFace: Additive Angular Margin Loss for Deep Face
    Recognition", CVPR 2019.
    """
    head = _HEADS["arcface"](embeddings, params, margin, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


def subcenter_arcface(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: float | Tensor = 0.5,
    scale: float | Tensor = 64.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""Sub-center ArcFace: ArcFace against the nearest of ``K`` sub-centres per class.

    .. math::
        \cos θ_{ij} = \max_{k} \hat x_i \cdot \hat w_{jk}

    then :func:`arcface` on these cosines. The number of sub-centres is
    ``params["weight"].shape[1]`` (set by :func:`subcenter_arcface_init`'s ``sub_centers``,
    default ``3``). PML's ``W`` is ``weight.reshape(C·K, D).T``: its column ``c·K + k`` is
    ``weight[c, k]``. PML's ``get_outliers``: :func:`subcenter_arcface_outliers`.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, sub_centers, D)}`` from
            :func:`subcenter_arcface_init`.
        margin: ``m`` in **radians** (default ``0.5``).
        scale: ``s`` (default ``64``).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional miner output, as in :func:`large_margin_softmax`.
        class_chunk_size: as in :func:`large_margin_softmax`.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = subcenter_arcface_init(10, 16, sub_centers=3)
        >>> loss = subcenter_arcface(torch.randn(8, 16), torch.randint(0, 10, (8,)), params)

    Reference: Deng, Guo, Liu, Gong, Zafeiriou, "Sub-center ArcFace: Boosting Face Recognition
    by Large-Scale Noisy Web Faces", ECCV 2020.
    """
    head = _HEADS["subcenter_arcface"](embeddings, params, margin, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


_OUTLIER_ANGLE = math.radians(75.0)  # PML's get_outliers(threshold=75) degrees


def subcenter_arcface_outliers(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    threshold: float | Tensor = _OUTLIER_ANGLE,
) -> tuple[Tensor, Tensor]:
    r"""Sub-center ArcFace's outlier detection (PML's ``SubCenterArcFaceLoss.get_outliers``):
    each class's dominant sub-centre, and the samples too far from their class's.

    For the rows of class ``c``, each row's nearest sub-centre ``k_i = argmax_k x̂_i · ŵ_{ck}``
    votes; the dominant sub-centre ``k*_c`` has the most votes (the lowest index on a tie). A
    row is an outlier when its angle to its class's dominant sub-centre exceeds ``threshold``:
    ``x̂_i · ŵ_{y_i k*} < cos(threshold)``. One pass over the ``(B, K)`` cosines to the rows'
    own classes; no loop over the classes and no host synchronisation (static shapes).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, K, D)}`` from :func:`subcenter_arcface_init`.
        threshold: the angle in **radians** (default ``75°``, PML's, which takes degrees).

    Returns:
        ``(outliers, dominant)``: a ``(B,)`` bool mask of the outlier rows (PML returns their
        indices: ``outliers.nonzero()``), and ``(num_classes,)`` int64 dominant sub-centre
        indices, ``-1`` for a class without rows (PML leaves those columns uninitialised; its
        dominant centres are ``weight[c, dominant[c]]``). Not differentiable (run under
        ``torch.no_grad()``). A NaN embedding is never an outlier (its comparison is false).

    Example:
        >>> params = subcenter_arcface_init(4, 8, sub_centers=3)
        >>> outliers, dominant = subcenter_arcface_outliers(
        ...     torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3]), params
        ... )
        >>> outliers.shape, dominant[2].item()
        (torch.Size([6]), -1)

    Reference: Deng et al., "Sub-center ArcFace: Boosting Face Recognition by Large-scale Noisy
    Web Faces", ECCV 2020.
    """
    threshold = _checks.hyper(threshold, "threshold")
    with torch.no_grad():
        x, weight = class_inputs(embeddings, labels, params, "weight", 3, True, False)
        labels = labels.long()
        w = F.normalize(weight.to(x.dtype)[labels], p=2, dim=-1)  # (B, K, D): the rows' classes
        cos = einsum("bd,bkd->bk", F.normalize(x, p=2, dim=1), w)
        votes = x.new_zeros(weight.shape[0], weight.shape[1])
        votes.index_put_((labels, cos.argmax(1)), x.new_ones(()), accumulate=True)
        dominant = torch.where(votes.sum(1) > 0, votes.argmax(1), -1)
        own = cos.gather(1, dominant[labels].unsqueeze(1)).squeeze(1)
        limit = torch.cos(torch.as_tensor(threshold, dtype=x.dtype, device=x.device))
        return own < limit, dominant


def dynamic_arcface(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margins: Tensor,
    scale: float | Tensor = 64.0,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""Sub-center ArcFace with a margin per class (dynamic margins).

    :func:`subcenter_arcface` where sample ``i`` uses its class's margin ``m_{y_i}``:

    .. math::
        ψ_i(θ) = \begin{cases} \cos(θ + m_{y_i}) & θ \le π - m_{y_i} \\
        \cos θ - m_{y_i} \sin m_{y_i} & \text{otherwise} \end{cases}

    The paper sets ``m_c = a·n_c^{−λ} + b`` from the class frequencies ``n_c``
    (:func:`dynamic_arcface_margins`), so rare classes get larger margins. ``sub_centers = 1``
    (``weight`` of shape ``(C, 1, D)``) is plain ArcFace with per-class margins. PML 3's
    ``DynamicArcFaceLoss`` (not in PML 2.9.0).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, num_classes)``.
        params: ``{"weight": (num_classes, sub_centers, D)}`` from :func:`dynamic_arcface_init`.
        margins: ``(num_classes,)`` float tensor of margins in radians (gradients flow to it).
        scale: ``s`` (default ``64``).
        reducer: default ``mean()`` over the samples.
        indices_tuple: optional miner output, as in :func:`large_margin_softmax`.
        class_chunk_size: as in :func:`large_margin_softmax`.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> counts = torch.tensor([500, 20, 3, 80, 7, 1000, 40, 9, 60, 2])
        >>> margins = dynamic_arcface_margins(counts)
        >>> params = dynamic_arcface_init(10, 16)
        >>> loss = dynamic_arcface(torch.randn(8, 16), torch.randint(0, 10, (8,)), params,
        ...                        margins=margins)

    Reference: Ha, Tran, Dzung, Nguyen, "Google Landmark Recognition 2020 Competition Third
    Place Solution" (dynamic margins for sub-center ArcFace), arXiv:2010.05350, 2020.
    """
    head = _HEADS["dynamic_arcface"](embeddings, params, margins, scale)
    regularizers = (
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )
    return _margin_softmax(
        embeddings, labels, params, head, reducer, indices_tuple, regularizers, class_chunk_size
    )


def dynamic_arcface_margins(
    class_counts: Tensor,
    *,
    a: float | Tensor = 0.5,
    b: float | Tensor = 0.05,
    lambda_: float | Tensor = 0.25,
) -> Tensor:
    r"""Per-class margins ``m_c = a·n_c^{−λ} + b`` (radians) from class frequencies ``n_c``.

    .. math::
        m_c = a \cdot \max(n_c, 1)^{-λ} + b

    A class with no samples is counted as one (the formula is undefined at 0; such a class
    never appears as a label, so its margin is never used).

    Args:
        class_counts: ``(num_classes,)`` tensor of training-set counts (integer or float).
        a: scale of the frequency term (default ``0.5``).
        b: the margin floor (default ``0.05``).
        lambda_: the exponent ``λ`` (default ``0.25``).

    Returns:
        ``(num_classes,)`` tensor: ``class_counts``' dtype if floating, else the default float
        dtype.

    Example:
        >>> dynamic_arcface_margins(torch.tensor([1, 16, 10000]))
        tensor([0.5500, 0.3000, 0.1000])

    Reference: Ha, Tran, Dzung, Nguyen, "Google Landmark Recognition 2020 Competition Third
    Place Solution", arXiv:2010.05350, 2020.
    """
    if not isinstance(class_counts, Tensor):
        raise TypeError(
            f"class_counts must be a (num_classes,) tensor, got {type(class_counts).__name__}"
        )
    if class_counts.ndim != 1:
        raise ValueError(
            f"class_counts must be 1-D of shape (num_classes,), got {tuple(class_counts.shape)}"
        )
    if class_counts.dtype == torch.bool or class_counts.dtype.is_complex:
        raise TypeError(f"class_counts must be real numbers, got {class_counts.dtype}")
    a = _checks.hyper(a, "a")
    b = _checks.hyper(b, "b")
    lambda_ = _checks.hyper(lambda_, "lambda_")
    dtype = (
        class_counts.dtype if class_counts.dtype.is_floating_point else torch.get_default_dtype()
    )
    n = class_counts.to(dtype).clamp_min(1.0)
    return scalar_like(a, n) * n.pow(-scalar_like(lambda_, n)) + scalar_like(b, n)


# ----------------------------------------------------------------------------------------------
# initialisers
# ----------------------------------------------------------------------------------------------
def large_margin_softmax_init(
    num_classes: int,
    embedding_size: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """``{"weight": (num_classes, embedding_size)}`` drawn ``N(0, 1)`` (PML's ``normal_``).

    Drawn in PML's ``(embedding_size, num_classes)`` order then transposed: a generator seeded
    like PML's global RNG reproduces PML's initial ``W`` exactly (``weight == W.T``). The same
    function is ``sphereface_init``, ``cosface_init`` and ``arcface_init``.

    Example:
        >>> params = large_margin_softmax_init(10, 16, generator=torch.Generator().manual_seed(0))
    """
    return _init(num_classes, embedding_size, None, generator, dtype, device)


# One scheme for every single-centre head: the same function under each loss's name.
sphereface_init = cosface_init = arcface_init = large_margin_softmax_init


def subcenter_arcface_init(
    num_classes: int,
    embedding_size: int,
    *,
    sub_centers: int = 3,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """``{"weight": (num_classes, sub_centers, embedding_size)}`` drawn ``N(0, 1)``.

    Drawn in PML's ``(embedding_size, num_classes·sub_centers)`` order, then
    ``weight[c, k] = W[:, c·sub_centers + k]``: a generator seeded like PML's global RNG
    reproduces PML's initial ``W`` exactly.

    Example:
        >>> params = subcenter_arcface_init(10, 16, sub_centers=3)
        >>> params["weight"].shape
        torch.Size([10, 3, 16])
    """
    k = _checks.integer(sub_centers, "sub_centers")
    return _init(num_classes, embedding_size, k, generator, dtype, device)


# PML 3's DynamicArcFaceLoss wraps a sub-centre ArcFace: the same parameters.
dynamic_arcface_init = subcenter_arcface_init

_LOSSES = (large_margin_softmax, sphereface, cosface, arcface, subcenter_arcface, dynamic_arcface)
CLASS_LOGITS.update({loss: _head_logits(loss.__name__) for loss in _LOSSES})
CLASS_TILED.update(dict.fromkeys(_LOSSES, "weight"))
