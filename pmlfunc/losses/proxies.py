"""Proxy and classifier losses: embeddings scored against learnable per-class vectors.

Every loss here takes its learnable parameters as a plain dict (the third positional argument),
created by the matching ``*_init`` function with PML 2.9.0's initialisation scheme:

| loss | params | shape | PML class (PML layout) |
|---|---|---|---|
| :func:`proxy_anchor` | ``"proxies"`` | ``(C, D)`` | ``ProxyAnchorLoss.proxies`` ``(C, D)`` |
| :func:`proxy_nca` | ``"proxies"`` | ``(C, D)`` | ``ProxyNCALoss.proxies`` ``(C, D)`` |
| :func:`normalized_softmax` | ``"weight"`` | ``(C, D)`` | ``NormalizedSoftmaxLoss.W`` ``(D, C)`` |
| :func:`soft_triple` | ``"weight"`` | ``(C, K, D)`` | ``SoftTripleLoss.fc`` ``(D, C·K)`` |
| :func:`p2s_grad` | ``"weight"`` | ``(C, D)`` | ``P2SGradLoss.weight`` ``(D, C)`` |

Converting to PML's layout: ``W = weight.t()``; SoftTriple's ``fc = weight.reshape(C*K, D).t()``
(PML's column ``c·K + k`` is class ``c``'s centre ``k``: class-major). Each ``*_init`` draws in PML's
layout and transposes, so with the same seed it reproduces PML's own initial values exactly.

Parameters are never modified or cast in place (PML casts its parameters to the input dtype in
place, and P2SGrad renormalises its weight in place): float16/bfloat16 embeddings are computed in
float32 against float32 copies made by autograd-tracked casts, and the loss is float32 (the
embeddings' dtype for float32/float64 embeddings).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .. import _checks, _global
from .. import params as _params
from .._ops import (
    _RENORM_MAX,
    apply,
    cross_entropy,
    fresh,
    inside_transform,
    logaddexp,
    masked_logsumexp,
    matmul,
    renorm_rows,
    row_values,
    scalar_like,
    scatter_,
    unit_rows,
)
from ..distances import Distance, _Dot, _Lp, cosine, lp, resolve
from ..reducers import DenseTerms, Reducer, divisor, elements, mean, reduce
from ..tuples import sample_weights
from ._logits import CLASS_LOGITS, class_inputs
from ._regularize import regularize, regularize_params
from ._tiled import (
    CLASS_TILED,
    Classes,
    class_count,
    class_cross_entropy,
    class_statistics,
    class_table,
    rank_shared,
    rank_sum,
    softmax_term,
)

__all__ = [
    "normalized_softmax",
    "normalized_softmax_init",
    "p2s_grad",
    "p2s_grad_init",
    "proxy_anchor",
    "proxy_anchor_init",
    "proxy_nca",
    "proxy_nca_init",
    "soft_triple",
    "soft_triple_init",
]


# ---------------------------------------------------------------------------------------------
# shared set-up
# ---------------------------------------------------------------------------------------------
def _proxy_inputs(
    embeddings: Tensor, labels: Tensor, params: object, key: str, ndim: int = 2, cast: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate, then return ``(embeddings, param, labels)`` with both floats in the compute dtype
    (out-of-place, autograd-tracked casts; the param as it is without ``cast``: the class tiles
    cast it a tile at a time) and the labels as int64."""
    x, p = class_inputs(embeddings, labels, params, key, ndim, cast, optional=False)
    return x, p, labels.long()


def _one_hot(labels: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """``(B, C)`` 0/1 float matrix ``[labels_i == c]`` (a comparison: no value check, runs on meta)."""
    classes = torch.arange(num_classes, device=labels.device)
    return (labels.unsqueeze(-1) == classes).to(dtype)


def _weighted(losses: Tensor, weights: Tensor | None) -> Tensor:
    return losses if weights is None else losses * weights


def _sizes(num_classes: object, embedding_size: object) -> tuple[int, int]:
    return _checks.integer(num_classes, "num_classes"), _checks.integer(
        embedding_size, "embedding_size"
    )


# ---------------------------------------------------------------------------------------------
# Proxy-Anchor
# ---------------------------------------------------------------------------------------------
def proxy_anchor(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    margin: float | Tensor = 0.1,
    alpha: float | Tensor = 32.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""Proxy-Anchor loss: each proxy is an anchor pulling its class's samples and pushing the rest.

    With similarity ``s(x, p_c)`` (cosine by default; a distance ``d`` enters as ``-d``), margin
    ``δ``, scale ``α``, the batch's samples ``X_c^+`` of class ``c`` and the others ``X_c^-``:

    .. math::
        L = \frac{1}{|P^+|} \sum_{c \in P^+} \log\Big(1 + \sum_{x \in X_c^+} e^{-α(s(x, p_c) - δ)}\Big)
          + \frac{1}{C} \sum_{c=1}^{C} \log\Big(1 + \sum_{x \in X_c^-} e^{α(s(x, p_c) + δ)}\Big)

    where ``P^+`` is the set of proxies with at least one positive in the batch (counted with a
    tensor sum: no host sync). The log-sum-exps run over the batch, one per proxy. With an
    ``indices_tuple``, each sample's exponent gets ``w_x − 1`` added, ``w_x`` its count in the
    tuple over the largest count (PML's ``convert_to_weights``), so unlisted samples are damped,
    not removed, exactly as PML does.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, C)``.
        params: ``{"proxies": (C, D)}`` from :func:`proxy_anchor_init`.
        margin: ``δ`` (default ``0.1``).
        alpha: ``α`` (default ``32``).
        distance: default ``cosine()``.
        reducer: default ``divisor()`` (the divisors above). Any reducer is applied to the two
            per-proxy sub-losses ``pos_loss`` and ``neg_loss`` (``C`` terms each) and the results
            are summed; ``class_weighted`` weights each proxy's term by its class.
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        class_chunk_size: ``None`` (default): the whole ``(B, C)`` matrix. An int: the same
            loss over tiles of that many proxies, never the ``(B, C)`` matrix (memory
            ``O(B × class_chunk_size)`` beyond the proxies and their gradient; the "Millions
            of classes" guide): each tile's negative log-sum-exps are complete (a proxy's
            terms run over the batch), the positives' are read by index. For ``cosine()``
            (the default) and ``dot()``. Not differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = proxy_anchor_init(4, 8, generator=torch.Generator().manual_seed(0))
        >>> emb, labels = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3])
        >>> loss = pf.losses.proxy_anchor(emb, labels, params, margin=0.1, alpha=32.0)

    Reference: Kim et al., "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020.
    """
    margin = _checks.hyper(margin, "margin")
    alpha = _checks.hyper(alpha, "alpha")
    distance = resolve(distance, cosine())
    reducer = _anchor_reducer(reducer)
    tiled = class_chunk_size is not None
    x, proxies, labels = _proxy_inputs(embeddings, labels, params, "proxies", cast=not tiled)
    num_classes = proxies.shape[0]
    # the rows' weights from an indices_tuple enter every exponent as w_x − 1
    mw = sample_weights(indices_tuple, labels.shape[0], x.dtype, labels.device)
    shift = None if mw is None else mw - 1.0
    if tiled:
        chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size")
        pos_term, neg_term = _anchor_terms_tiled(
            x, proxies, labels, margin, alpha, distance, shift, chunk
        )
    else:
        pos_term, neg_term = _anchor_terms(x, proxies, labels, margin, alpha, distance, shift)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # log(1 + Σ_x e^z) per proxy (over the batch); a proxy without terms gives 0.
    pos_term, neg_term = (
        logaddexp(zero, pos_term, twice=True),
        logaddexp(zero, neg_term, twice=True),
    )
    counts = torch.zeros(num_classes + 1, dtype=x.dtype, device=x.device)
    counts = counts.index_add(
        0, _owned(labels, num_classes), torch.ones_like(labels, dtype=x.dtype)
    )
    with_pos = rank_sum((counts[:num_classes] > 0).to(x.dtype).sum())
    ones = torch.ones_like(pos_term)
    total = float(class_count(proxies))
    terms = {
        "pos_loss": DenseTerms(pos_term, ones, "element", num_classes, divisor=with_pos),
        "neg_loss": DenseTerms(neg_term, ones, "element", num_classes, divisor=total),
    }
    proxy_labels = torch.arange(num_classes, device=labels.device)
    loss = rank_sum(reduce(reducer, terms, proxy_labels, x.dtype))
    return regularize_params(
        loss,
        embeddings,
        params["proxies"],
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )


def proxy_anchor_init(
    num_classes: int,
    embedding_size: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`proxy_anchor`: ``{"proxies": (C, D)}``.

    PML's scheme, ``kaiming_normal_(mode="fan_out")`` on ``(C, D)``: ``N(0, 2 / C)`` entries
    (fan_out = C, gain √2). Same seed, same values as PML.

    Example:
        >>> proxy_anchor_init(10, 4)["proxies"].shape
        torch.Size([10, 4])
    """
    c, d = _sizes(num_classes, embedding_size)
    std = math.sqrt(2.0) / math.sqrt(c)
    proxies = _params.init_normal((c, d), generator=generator, dtype=dtype, device=device, std=std)
    return {"proxies": proxies}


def _anchor_terms(x, proxies, labels, margin, alpha, distance, shift) -> tuple[Tensor, Tensor]:
    """Each proxy's log-sum-exps over its positives and its negatives, ``(C,)`` each, from the
    whole ``(B, C)`` matrix: ``α·margin(s, δ)`` on the positives, ``α·margin(−δ, s)`` on the
    negatives (PML's ``distance.margin(u, v) = sign·(u − v)``), plus the rows' ``shift``."""
    mat = distance.matrix(x, proxies, ties=False)  # (B, C); smooth in it: no exact ties
    m, a = scalar_like(margin, mat), scalar_like(alpha, mat)
    sign = distance.sign()
    pos_logits = (sign * a) * (mat - m)
    neg_logits = (-sign * a) * (mat + m)
    if shift is not None:
        pos_logits, neg_logits = pos_logits + shift.unsqueeze(-1), neg_logits + shift.unsqueeze(-1)
    pos_mask = _one_hot(labels, proxies.shape[0], mat.dtype).t()  # (C, B): over the batch
    return (
        masked_logsumexp(pos_logits.t(), pos_mask),
        masked_logsumexp(neg_logits.t(), 1.0 - pos_mask),
    )


def _anchor_terms_tiled(x, proxies, labels, margin, alpha, distance, shift, chunk):
    """:func:`_anchor_terms` over tiles of proxies: with ``v = x̂·p̂`` and ``σ = sign·α``, the
    positives' logits are ``σv + b`` and the negatives' ``−σv + b``, ``b = −σδ + shift`` per
    row: the negatives' log-sum-exps are the class tiles' column statistic of the rows
    ``−σx̂`` (:class:`Classes` ``fold="columns"``), the positives' a segment log-sum-exp of the
    ``B`` target values ``σ x̂_i · p̂_{y_i}`` read by index."""
    if not isinstance(distance, _Dot):
        raise ValueError(
            "class_chunk_size needs a matmul similarity, cosine() (the default) or dot(); "
            f"got {distance!r}"
        )
    normalize, _ = distance.split_normalization()
    sa = distance.sign() * scalar_like(alpha, x)
    rows = normalize(x) * sa
    b = row_values(-sa * scalar_like(margin, x), x)
    b = b if shift is None else b + shift
    kind = Classes(chunk, unit=distance.normalize, fold="columns")
    neg, t = class_statistics(-rows, rows, class_table(proxies), labels, kind, b)
    c = proxies.shape[0]  # this rank's proxies when sharded: the rows of others' go to slot c
    return _segment_logsumexp(t + rank_shared(b), _owned(labels, c), c + 1)[:c], neg


def _owned(labels: Tensor, num_classes: int) -> Tensor:
    """The labels as indices of this rank's proxies (``num_classes`` of them; all of the table
    outside :func:`pmlfunc.distributed.sharded_classes`), ``num_classes`` for a row whose class
    another rank holds."""
    shard = _global.class_shard()
    if shard is None:
        return labels
    local = labels - shard.offset
    return torch.where((local >= 0) & (local < num_classes), local, num_classes)


def _anchor_reducer(reducer: Reducer | None) -> Reducer:
    """proxy_anchor's reducer: ``divisor()`` by default. With the table sharded, each rank
    reduces its proxies' terms and the results are summed over the ranks: right for the
    reducers that sum terms over fixed divisors (``divisor()``, ``sum()``) only."""
    if _global.class_shard() is not None and reducer is not None and repr(reducer) != "sum()":
        raise ValueError(
            "proxy_anchor with the table sharded takes reducer=None (divisor()) or sum(), got "
            f"{reducer!r}: its proxies' terms are reduced on the rank that holds them"
        )
    return divisor() if reducer is None else reducer


def _segment_logsumexp(values: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``(C,)``: the log-sum-exp of the ``values`` of each class's rows, ``−finfo.max`` for a
    class without rows (a scatter of ``B`` values: no ``B × C`` tensor)."""
    low = torch.finfo(values.dtype).min
    top = values.new_full((num_classes,), low)
    top = top.scatter_reduce(0, labels, values.detach(), "amax").detach()
    sums = values.new_zeros(num_classes).index_add(0, labels, torch.exp(values - top[labels]))
    empty = sums == 0  # (a NaN stays NaN)
    return torch.where(empty, low, torch.log(torch.where(empty, 1.0, sums)) + top)


# ---------------------------------------------------------------------------------------------
# ProxyNCA
# ---------------------------------------------------------------------------------------------
def proxy_nca(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    softmax_scale: float | Tensor = 1,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""ProxyNCA loss: neighbourhood component analysis of each sample against the class proxies.

    With distance ``d`` (squared normalised Euclidean by default; a similarity ``s`` enters as
    ``-s`` would, i.e. ``z = σ·s``) and scale ``σ``, per sample ``i``:

    .. math::
        \ell_i = -\log \frac{e^{-σ\, d(x_i, p_{y_i})}}{\sum_{c=1}^{C} e^{-σ\, d(x_i, p_c)}}

    As in PML, a sample whose probability underflows to exactly 0 is left out (weight 0) instead
    of contributing ``inf``. With an ``indices_tuple`` each term is multiplied by the sample's
    count among the tuple's anchors over the largest count (PML's ``convert_to_weights`` with
    ``using_ref``).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, C)``.
        params: ``{"proxies": (C, D)}`` from :func:`proxy_nca_init`.
        softmax_scale: ``σ`` (default ``1``).
        distance: default ``lp(power=2)`` (squared Euclidean between normalised rows).
        reducer: default ``mean()`` over the samples.
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        class_chunk_size: ``None`` (default): the whole ``(B, C)`` logit matrix. An int: the
            same loss over tiles of that many proxies, never the ``(B, C)`` matrix (memory
            ``O(B × class_chunk_size)`` beyond the proxies and their gradient; the "Millions
            of classes" guide), for the default distance, ``cosine()`` and ``dot()``. Not
            differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = proxy_nca_init(4, 8, generator=torch.Generator().manual_seed(0))
        >>> emb, labels = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3])
        >>> loss = pf.losses.proxy_nca(emb, labels, params, softmax_scale=10.0)

    Reference: Movshovitz-Attias et al., "No Fuss Distance Metric Learning using Proxies",
    ICCV 2017.
    """
    softmax_scale = _checks.hyper(softmax_scale, "softmax_scale")
    distance = resolve(distance, lp(power=2))
    tiled = class_chunk_size is not None
    x, proxies, labels = _proxy_inputs(embeddings, labels, params, "proxies", cast=not tiled)
    if tiled:  # the logits' rows and factor, the proxies normalised in their tiles
        chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size")
        rows, r, unit = _nca_rows(distance, x, softmax_scale)
        r = x.new_ones(x.shape[0]) * scalar_like(r, x)
        log_p = -class_cross_entropy(rows, r, proxies, labels, chunk=chunk, unit=unit)
    else:
        log_p = -cross_entropy(_nca_logits(distance, x, proxies, softmax_scale), labels)
    keep = (log_p.detach().exp() != 0).to(x.dtype)  # PML drops samples whose p is exactly 0
    losses = _weighted(
        -log_p,
        sample_weights(indices_tuple, labels.shape[0], x.dtype, labels.device, anchors_only=True),
    )
    terms = {"loss": DenseTerms(losses, keep, "element", x.shape[0])}
    loss = reduce((mean() if reducer is None else reducer), terms, labels, x.dtype)
    return regularize_params(
        loss,
        embeddings,
        params["proxies"],
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )


def _nca_logits(distance: Distance, x: Tensor, proxies: Tensor, scale: float | Tensor) -> Tensor:
    """``(B, C)`` logits ``z = −σ·d(x_i, p_c)`` (``σ·s`` for a similarity), up to a per-row
    constant, which the softmax over classes ignores; the scale folded into the product where
    the distance is one (no pass over the matrix for it either way), no exact ties (the loss is
    smooth in ``z``).

    The default, the squared Euclidean distance of unit rows, is ``‖x̂ − p̂‖² = 2 − 2 x̂·p̂``:
    ``z = 2σ·x̂·p̂`` (dropping ``−2σ``), one product of the normalised rows, where the distance
    takes its own product, the exact-budget search and a pass per term, both ways. The
    softmax's rounding is of the same size either way: both forms are exact to a few ulp of the
    ``O(1)`` terms."""
    if isinstance(distance, _Lp) and distance.p == 2 and distance.power == 2 and distance.normalize:
        return cosine().matrix(x, proxies, ties=False, scale=2.0 * scale)
    sigma = scale if distance.is_similarity else -scale
    return distance.matrix(x, proxies, ties=False, scale=sigma)


def _nca_rows(distance: Distance, x: Tensor, scale: float | Tensor):
    """:func:`_nca_logits` as the class tiles take it: ``(rows, factor, unit)`` with
    ``z = factor · rows · p̂ᵀ`` (``p`` normalised in the tile when ``unit``); a matmul form
    exists for the default distance and ``cosine()``/``dot()`` only."""
    if isinstance(distance, _Lp) and distance.p == 2 and distance.power == 2 and distance.normalize:
        return unit_rows(x), 2.0 * scale, True
    if isinstance(distance, _Dot):
        normalize, _ = distance.split_normalization()
        return normalize(x), scale, distance.normalize
    raise ValueError(
        "class_chunk_size needs a distance whose logits are a product of the rows and the "
        f"proxies: lp(power=2) (the default), cosine() or dot(); got {distance!r}"
    )


def proxy_nca_init(
    num_classes: int,
    embedding_size: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`proxy_nca`: ``{"proxies": (C, D)}`` with ``N(0, 1)`` entries (PML's
    default ``normal_``). Same seed, same values as PML.

    Example:
        >>> proxy_nca_init(10, 4)["proxies"].shape
        torch.Size([10, 4])
    """
    c, d = _sizes(num_classes, embedding_size)
    return {"proxies": _params.init_normal((c, d), generator=generator, dtype=dtype, device=device)}


# ---------------------------------------------------------------------------------------------
# Normalized softmax
# ---------------------------------------------------------------------------------------------
def normalized_softmax(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    temperature: float | Tensor = 0.05,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""Normalized softmax loss: cross entropy over cosine logits against unit-norm class weights.

    With unit-norm class weights ``ŵ_c`` (the rows of ``params["weight"]``, normalised),
    similarity ``s`` (cosine by default; a distance ``d`` enters as ``-d``) and temperature ``τ``:

    .. math::
        \ell_i = -\log \frac{e^{s(x_i, ŵ_{y_i})/τ}}{\sum_{c=1}^{C} e^{s(x_i, ŵ_c)/τ}}

    With an ``indices_tuple`` each term is multiplied by the sample's count in the tuple over the
    largest count (PML's ``convert_to_weights``).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, C)``.
        params: ``{"weight": (C, D)}`` from :func:`normalized_softmax_init` (PML's ``W`` is its
            transpose, ``(D, C)``).
        temperature: ``τ > 0`` (default ``0.05``).
        distance: default ``cosine()``: PML 2.9.0's default ``DotProductSimilarity()``
            normalises both sides, which is the cosine. The weights are L_p-normalised whatever
            the distance (as PML does), so ``dot()`` (PML's
            ``DotProductSimilarity(normalize_embeddings=False)``) scores the raw embeddings
            against unit-norm weights.
        reducer: default ``mean()`` over the samples.
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        class_chunk_size: ``None`` (default): the whole ``(B, C)`` logit matrix. An int: the
            same loss over tiles of that many classes, never the ``(B, C)`` matrix (memory
            ``O(B × class_chunk_size)`` beyond the weights and their gradient; the "Millions
            of classes" guide), for ``cosine()`` and ``dot()``. Not differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = normalized_softmax_init(4, 8, generator=torch.Generator().manual_seed(0))
        >>> emb, labels = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3])
        >>> loss = pf.losses.normalized_softmax(emb, labels, params, temperature=0.05)

    Reference: Zhai & Wu, "Classification is a Strong Baseline for Deep Metric Learning",
    BMVC 2019.
    """
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    distance = resolve(distance, cosine())
    tiled = class_chunk_size is not None
    x, weight, labels = _proxy_inputs(embeddings, labels, params, "weight", cast=not tiled)
    # PML always normalises the weights (``distance.normalize``, with the distance's p), whatever
    # the distance's own normalisation; e.g. ``dot()`` scores raw embeddings against unit weights.
    # The distance's own normalisation of them (PML's second one) is then the identity to
    # rounding: only the embeddings get it. 1/temperature (signed for a distance) goes into the
    # matrix's computation (into the rows before a matmul similarity's product).
    cd = _checks.compute_dtype(x.dtype)
    normalize, plain = distance.split_normalization()
    inverse = 1.0 / scalar_like(temperature, x)
    if tiled:  # the weights normalised in their tiles
        if not isinstance(plain, _Dot):
            raise ValueError(
                "class_chunk_size needs a matmul similarity, cosine() (the default) or dot(); "
                f"got {distance!r}"
            )
        r = x.new_ones(x.shape[0]) * inverse
        chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size")
        ce = class_cross_entropy(normalize(x), r, weight, labels, chunk=chunk)
    else:
        ce = cross_entropy(_ns_logits(distance, x, weight.to(cd), temperature), labels)
    losses = _weighted(ce, sample_weights(indices_tuple, labels.shape[0], x.dtype, labels.device))
    terms = {"loss": elements(losses)}
    loss = reduce((mean() if reducer is None else reducer), terms, labels, x.dtype)
    return regularize_params(
        loss,
        embeddings,
        params["weight"],
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )


def _ns_logits(distance: Distance, x: Tensor, weight: Tensor, temperature) -> Tensor:
    """``(B, C)``: ``±d(x_i, ŵ_c) / T``, the weights normalised with the distance's ``p`` (PML
    normalises them whatever the distance), no exact ties (the loss is smooth in them)."""
    normalize, plain = distance.split_normalization()
    inverse = 1.0 / scalar_like(temperature, x)
    weight = unit_rows(weight, getattr(distance, "p", 2.0))
    scale = inverse if distance.is_similarity else -inverse
    return plain.matrix(normalize(x), weight, ties=False, scale=scale)


def normalized_softmax_init(
    num_classes: int,
    embedding_size: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`normalized_softmax`: ``{"weight": (C, D)}`` with ``N(0, 1)`` entries
    (PML's default ``normal_`` on its ``(D, C)`` matrix; drawn in that layout and transposed, so
    the same seed gives PML's values).

    Example:
        >>> normalized_softmax_init(10, 4)["weight"].shape
        torch.Size([10, 4])
    """
    c, d = _sizes(num_classes, embedding_size)
    w = _params.init_normal((d, c), generator=generator, dtype=dtype, device=device)
    return {"weight": w.t().contiguous()}


# ---------------------------------------------------------------------------------------------
# SoftTriple
# ---------------------------------------------------------------------------------------------
def soft_triple(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    centers_per_class: int | None = None,
    la: float | Tensor = 20,
    gamma: float | Tensor = 0.1,
    margin: float | Tensor = 0.01,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    indices_tuple=None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    weight_regularizer: Callable[[Tensor], Tensor] | None = None,
    weight_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""SoftTriple loss: a softmax over classes, each class a soft maximum over ``K`` centres.

    With centres ``w_{ck}`` (``params["weight"][c, k]``), cosine similarity ``s``, scale ``λ``
    (``la``), entropy scale ``γ`` and margin ``δ``:

    .. math::
        S_{ic} = \sum_{k=1}^{K} \frac{e^{s(x_i, w_{ck})/γ}}{\sum_{k'} e^{s(x_i, w_{ck'})/γ}}\,
                 s(x_i, w_{ck}), \qquad
        \ell_i = -\log \frac{e^{λ(S_{i y_i} - δ)}}
                             {e^{λ(S_{i y_i} - δ)} + \sum_{c \ne y_i} e^{λ S_{ic}}}

    As in PML 2.9.0, the paper's centre regulariser is not part of the loss: pass
    ``weight_regularizer=functools.partial(pf.regularizers.sparse_centers, num_classes=C,
    centers_per_class=K)`` (it receives the ``(C·K, D)`` centres, class-major). With an ``indices_tuple``
    each term is multiplied by the sample's count in the tuple over the largest count (PML's
    ``convert_to_weights``).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, C)``.
        params: ``{"weight": (C, K, D)}`` from :func:`soft_triple_init`. PML's ``fc`` is
            ``weight.reshape(C * K, D).t()`` (its column ``c·K + k`` is centre ``k`` of class
            ``c``).
        centers_per_class: ``K``; read from ``params`` when ``None`` (default), checked against
            them when given (PML's name; its default, 10, is :func:`soft_triple_init`'s).
        la: ``λ`` (default ``20``).
        gamma: ``γ > 0`` (default ``0.1``; PML stores ``1/γ``).
        margin: ``δ`` (default ``0.01``).
        distance: a similarity; default ``cosine()`` (PML asserts an inverted distance too).
        reducer: default ``mean()`` over the samples.
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        class_chunk_size: ``None`` (default): the whole ``(B, C·K)`` matrix. An int: the same
            loss over tiles of that many classes (``B × class_chunk_size·K`` at a time, never
            the ``(B, C·K)`` matrix; the "Millions of classes" guide): the tiles read the rows
            ``λx̂`` and take each class's soft maximum at the temperature ``λγ``, which is
            ``λ S_ic``. For ``cosine()`` (the default) and ``dot()``; ``la`` must not be 0.
            Not differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = soft_triple_init(4, 8, centers_per_class=3)
        >>> emb, labels = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3])
        >>> loss = pf.losses.soft_triple(emb, labels, params, la=20, gamma=0.1, margin=0.01)

    Reference: Qian et al., "SoftTriple Loss: Deep Metric Learning Without Triplet Sampling",
    ICCV 2019.
    """
    la = _checks.hyper(la, "la")
    gamma = _checks.hyper(gamma, "gamma", positive=True)
    margin = _checks.hyper(margin, "margin")
    distance = resolve(distance, cosine())
    if not distance.is_similarity:
        raise ValueError(
            f"soft_triple needs a similarity (cosine(), dot()), got the distance {distance!r}"
        )
    tiled = class_chunk_size is not None
    x, weight, labels = _proxy_inputs(embeddings, labels, params, "weight", ndim=3, cast=not tiled)
    k = weight.shape[1]
    if (
        centers_per_class is not None
        and _checks.integer(centers_per_class, "centers_per_class") != k
    ):
        raise ValueError(
            f"centers_per_class={centers_per_class} but params['weight'] has {k} centres per class"
        )
    if tiled:
        chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size")
        ce = _soft_triple_tiled(x, weight, labels, la, gamma, margin, distance, chunk)
    else:
        ce = cross_entropy(
            _soft_triple_logits(x, weight, labels, la, gamma, margin, distance), labels
        )
    losses = _weighted(ce, sample_weights(indices_tuple, labels.shape[0], x.dtype, labels.device))
    terms = {"loss": elements(losses)}
    loss = reduce((mean() if reducer is None else reducer), terms, labels, x.dtype)
    return regularize_params(
        loss,
        embeddings,
        params["weight"],
        embedding_regularizer,
        embedding_reg_weight,
        weight_regularizer,
        weight_reg_weight,
    )


def _soft_triple_logits(x, weight, labels, la, gamma, margin, distance) -> Tensor:
    """``(B, C)``: ``λ(S_ic − δ[c = y_i])`` (``S``: each class's soft maximum over its centres at
    ``γ``); without ``labels``, ``λ S_ic``."""
    num_classes, k, d = weight.shape
    sim = distance.matrix(x, weight.reshape(num_classes * k, d), ties=False)
    sim = sim.view(-1, num_classes, k)
    # PML multiplies by 1/γ: do the same for a Python number (bit-equal), divide for a tensor
    scaled = sim * (1.0 / gamma) if isinstance(gamma, float) else sim / scalar_like(gamma, sim)
    sim_to_classes = (torch.softmax(scaled, -1) * sim).sum(-1)  # (B, C)
    if labels is not None:
        own = _one_hot(labels, num_classes, sim.dtype)
        sim_to_classes = sim_to_classes - scalar_like(margin, sim) * own
    return scalar_like(la, sim) * sim_to_classes


def _soft_triple_tiled(x, weight, labels, la, gamma, margin, distance, chunk) -> Tensor:
    """:func:`soft_triple`'s per-sample cross entropy over tiles of classes: the tiles read the
    rows ``λx̂`` (``λ`` = ``la``), whose class values at the temperature ``τ = λγ`` are ``λ S_ic``
    (the soft maximum is homogeneous: ``softmax(λs/λγ) = softmax(s/γ)``), the target's is read
    by index and its logit is ``λ(S_{iy} − δ)``."""
    if not isinstance(distance, _Dot):
        raise ValueError(
            "class_chunk_size needs a matmul similarity, cosine() (the default) or dot(); "
            f"got {distance!r}"
        )
    if isinstance(la, float) and la == 0:
        raise ValueError("soft_triple with class_chunk_size needs la != 0 (it scales the rows)")
    normalize, _ = distance.split_normalization()
    lam = scalar_like(la, x)
    rows = normalize(x) * lam
    tau = row_values(lam * scalar_like(gamma, x), x)
    kind = Classes(chunk, weight.shape[1], distance.normalize, soft=True)
    lse, target = class_statistics(rows, rows, class_table(weight), labels, kind, tau)
    return softmax_term(lse, target - lam * scalar_like(margin, x))


def soft_triple_init(
    num_classes: int,
    embedding_size: int,
    *,
    centers_per_class: int = 10,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`soft_triple`: ``{"weight": (C, K, D)}``.

    PML's scheme, ``kaiming_uniform_(a=√5)`` on its ``(D, C·K)`` matrix, whose fan_in is ``C·K``:
    ``U(−b, b)`` with ``b = 1/√(C·K)``. Drawn in PML's layout and rearranged, so the same seed
    gives PML's values.

    Example:
        >>> soft_triple_init(10, 4, centers_per_class=3)["weight"].shape
        torch.Size([10, 3, 4])
    """
    c, d = _sizes(num_classes, embedding_size)
    k = _checks.integer(centers_per_class, "centers_per_class")
    fc = _params.init_kaiming_uniform(
        (d, c * k), fan_in=c * k, generator=generator, dtype=dtype, device=device
    )
    return {"weight": fc.t().reshape(c, k, d).contiguous()}


# ---------------------------------------------------------------------------------------------
# P2SGrad
# ---------------------------------------------------------------------------------------------
_NORM_FLOOR = 1e-12  # F.normalize's eps: the floor of ‖x‖ that P2SGrad divides by


class _P2SGrad(torch.autograd.Function):
    r"""Per-sample P2SGrad terms ``ℓ_i = mean_c (k_ic − [c = y_i])²`` with
    ``k = clamp(c, −1, 1)``, ``c_ic = x_i·ŵ_c / ‖x_i‖`` and ``ŵ = renorm(w)``, the gradient of
    ``w`` straight through the renormalisation (see :func:`p2s_grad`).

    The backward is formed in the forward, where the clamped error is at hand: with
    ``E = (k − Y)·[−1 ≤ c ≤ 1]`` (saved; clamp's gradient mask, inclusive as torch's), the
    cotangent ``g`` and ``h = E ŵ``,

        ∂/∂x_i = 2g_i/(C‖x_i‖)·(h_i − x̂_i (h_i·x̂_i)),   ∂/∂ŵ = Eᵀ (x ⊙ 2g/(C‖x‖)),

    (``h_i·x̂_i = Σ_c E_ic c_ic``; no projection where ``‖x_i‖`` is below its floor, as autograd
    through ``clamp_min``): two products and ``B × D`` work, where autograd's backward makes
    some ten passes over the ``B × C`` matrix, and the forward makes five (the product's
    scale, the clamp, its mask, the norm and the mask's fill) instead of eight, with the
    one-hot target applied at the ``B`` labelled entries only. Where a higher derivative may
    follow (the backward runs with grad mode on, ``create_graph=True``, or inside a
    ``torch.func`` transform) ``E``, ``ŵ`` and ``‖x‖`` are recomputed in differentiable ops
    (:func:`_p2s_parts`) and the same formulas differentiate through them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, w: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w_hat = renorm_rows(w)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        cos = matmul(x, w_hat.t()).div_(norm.clamp_min(_NORM_FLOOR))
        err = cos.clamp(-1.0, 1.0)
        outside = err != cos  # clamped: no gradient
        idx = labels.unsqueeze(-1)
        err = scatter_(err, idx, err.gather(-1, idx) - 1.0)  # k − Y at the labels only
        rms = torch.linalg.vector_norm(err, dim=-1)  # (vecdot would run in bf16 under autocast)
        losses = (rms * rms).div_(err.shape[-1])
        return losses, fresh(err.masked_fill_(outside, 0.0)), w_hat, norm

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, labels = inputs
        _, e, w_hat, norm = output
        ctx.mark_non_differentiable(e, w_hat, norm)
        ctx.set_materialize_grads(False)  # no zero cotangents for the saved outputs
        ctx.save_for_backward(x, w, labels, e, w_hat, norm)

    @staticmethod
    def backward(ctx, g, *_):
        x, w, labels, e, w_hat, norm = ctx.saved_tensors
        if g is None:  # the loss did not reach the terms
            return None, None, None
        if torch.is_grad_enabled() or inside_transform():  # a higher derivative may follow
            e, w_hat, norm = _p2s_parts(x, w, labels)
        n = norm.clamp_min(_NORM_FLOOR)
        scale = g.unsqueeze(-1) * (2.0 / e.shape[-1]) / n  # 2g/(C‖x‖), (B, 1)
        h = matmul(e, w_hat)
        x_hat = x / n
        # no projection where ‖x‖ is at its floor (a constant there, as through clamp_min)
        along = torch.where(norm >= _NORM_FLOOR, (h * x_hat).sum(-1, keepdim=True), 0.0)
        gx = torch.addcmul(h, x_hat, along, value=-1.0) * scale
        gw = matmul(e.transpose(-1, -2), x * scale)
        return gx, gw, None


def _p2s_parts(x: Tensor, w: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`_P2SGrad`'s saved ``(E, ŵ, ‖x‖)`` in differentiable ops of ``x`` and ``w`` (``ŵ``
    straight through to ``w``; ``E``'s clamp mask is a constant, as its derivative)."""
    w_hat = (w - w.detach()) + renorm_rows(w.detach())
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    cos = matmul(x, w_hat.t()) / norm.clamp_min(_NORM_FLOOR)
    k = cos.clamp(-1.0, 1.0)
    inside = (k.detach() == cos.detach()).to(k.dtype)
    return (k - _one_hot(labels, w.shape[0], k.dtype)) * inside, w_hat, norm


def p2s_grad(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    reducer: Reducer | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    class_chunk_size: int | None = None,
) -> Tensor:
    r"""P2SGrad loss: squared error between cosines and one-hot targets.

    With ``ŵ_c`` the unit-norm class weights and ``x̂_i`` the normalised embeddings:

    .. math::
        L = \frac{1}{B\,C} \sum_{i=1}^{B} \sum_{c=1}^{C}
            \big(\mathrm{clamp}(x̂_i \cdot ŵ_c, -1, 1) - [c = y_i]\big)^2

    PML renormalises its weight to unit rows in place before every call (``renorm(2, 1, 1e-5)``,
    then ×1e5) and differentiates with respect to the renormalised weight. A pure function cannot
    modify ``params``; instead it uses ``ŵ = renorm(w)`` in the forward and passes the gradient
    with respect to ``ŵ`` straight through to ``w`` (P2SGrad defines its weight gradient this
    way; it is not the derivative through the normalisation). Value and gradients equal PML's for
    any ``w``. To follow PML's trajectory exactly, renormalise the rows after each optimiser step
    (``w / (‖w‖ + 1e-7)``); without it, only ``‖w‖`` drifts, which the forward ignores.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids in ``[0, C)``.
        params: ``{"weight": (C, D)}`` from :func:`p2s_grad_init` (PML's ``weight`` is its
            transpose, ``(D, C)``).
        reducer: default ``mean()``: the per-sample terms are ``mean_c(·)²``, so the default is
            PML's MSE over all ``B·C`` entries. PML returns that value for any reducer
            ("already reduced"); here another reducer sees the ``B`` per-sample terms.
        class_chunk_size: ``None`` (default): the whole ``(B, C)`` matrix. An int: the same
            loss over tiles of that many classes, never the ``(B, C)`` matrix (the "Millions
            of classes" guide): ``C·ℓ_i = Σ_c k_ic² − 2k_{iy_i} + 1``, the sum of squares
            kept over the tiles, the target's ``k`` read by index. Not differentiable twice.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = p2s_grad_init(4, 8, generator=torch.Generator().manual_seed(0))
        >>> emb, labels = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 3, 3])
        >>> loss = p2s_grad(emb, labels, params)

    Reference: Zhang et al., "P2SGrad: Refined Gradients for Optimizing Deep Face Models",
    CVPR 2019.
    """
    tiled = class_chunk_size is not None
    x, w, labels = _proxy_inputs(embeddings, labels, params, "weight", cast=not tiled)
    if tiled:
        chunk = _checks.chunk_size(class_chunk_size, "class_chunk_size")
        # the rows x / max(‖x‖, ε): the cosine's denominator as _P2SGrad's
        rows = unit_rows(x)
        kind = Classes(chunk, unit=False, fold="squares", renorm=True)
        squares, target = class_statistics(rows, rows, class_table(w), labels, kind)
        losses = (squares - 2.0 * target.clamp(-1.0, 1.0) + 1.0) / class_count(w)
    else:
        losses = apply(_P2SGrad, x, w, labels)[0]
    terms = {"loss": elements(losses)}
    loss = reduce((mean() if reducer is None else reducer), terms, labels, x.dtype)
    loss = regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    return loss


def p2s_grad_init(
    num_classes: int,
    embedding_size: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`p2s_grad`: ``{"weight": (C, D)}`` with unit-norm rows.

    PML's own scheme: ``U(−1, 1)`` entries on its ``(D, C)`` matrix, each column renormalised to
    unit length (``renorm_(2, 1, 1e-5).mul_(1e5)``); drawn in that layout and transposed, so the
    same seed gives PML's values. Note the argument order: PML's ``P2SGradLoss`` takes
    ``(descriptors_dim, num_classes)``; this takes ``(num_classes, embedding_size)`` like every
    other ``*_init``.

    Example:
        >>> p2s_grad_init(10, 4)["weight"].norm(dim=1).round(decimals=4)
        tensor([1., 1., 1., 1., 1., 1., 1., 1., 1., 1.])
    """
    c, d = _sizes(num_classes, embedding_size)
    # drawn and renormalised in float32, then cast (as _params.init_normal): one generator
    # state gives PML's values in every dtype (a float64 draw gave another table)
    w = torch.empty((d, c), dtype=torch.float32, device=_params.generator_device(generator, device))
    w = w.uniform_(-1.0, 1.0, generator=generator).renorm(2, 1, _RENORM_MAX).mul(1.0 / _RENORM_MAX)
    return {"weight": w.t().contiguous().to(dtype)}


# the class logits (pmlfunc.losses.class_logits): each loss's distance resolved as in the loss
def _signed(default: Callable[[], Distance], key: str, scale: str | None = None) -> Callable:
    """The logits ``±σ·d(x_i, p_c)`` of a proxy loss (``σ``: the hyper-parameter ``scale``)."""

    def logits(embeddings: Tensor, params, labels: Tensor | None, hyper: dict) -> Tensor:
        distance = resolve(hyper["distance"], default())
        x, p = class_inputs(embeddings, labels, params, key, 2, True)
        sigma = 1.0 if scale is None else scalar_like(_checks.hyper(hyper[scale], scale), x)
        return distance.matrix(x, p, ties=False, scale=-sigma * distance.sign())

    return logits


def _ns_class_logits(embeddings: Tensor, params, labels: Tensor | None, hyper: dict) -> Tensor:
    temperature = _checks.hyper(hyper["temperature"], "temperature", positive=True)
    x, weight = class_inputs(embeddings, labels, params, "weight", 2, True)
    return _ns_logits(resolve(hyper["distance"], cosine()), x, weight, temperature)


def _soft_triple_class_logits(embeddings: Tensor, params, labels: Tensor | None, hyper: dict):
    distance = resolve(hyper["distance"], cosine())
    x, weight = class_inputs(embeddings, labels, params, "weight", 3, True)
    la, gamma, margin = (
        _checks.hyper(hyper["la"], "la"),
        _checks.hyper(hyper["gamma"], "gamma", positive=True),
        _checks.hyper(hyper["margin"], "margin"),
    )
    labels = None if labels is None else labels.long()
    return _soft_triple_logits(x, weight, labels, la, gamma, margin, distance)


def _p2s_class_logits(embeddings: Tensor, params, labels: Tensor | None, hyper: dict) -> Tensor:
    x, w = class_inputs(embeddings, labels, params, "weight", 2, True)
    return matmul(unit_rows(x), renorm_rows(w).t()).clamp(-1.0, 1.0)


CLASS_LOGITS.update(
    {
        proxy_anchor: _signed(cosine, "proxies"),
        proxy_nca: _signed(lambda: lp(power=2), "proxies", "softmax_scale"),
        normalized_softmax: _ns_class_logits,
        soft_triple: _soft_triple_class_logits,
        p2s_grad: _p2s_class_logits,
    }
)
CLASS_TILED[proxy_anchor] = "proxies"
CLASS_TILED[proxy_nca] = "proxies"
CLASS_TILED[normalized_softmax] = "weight"
CLASS_TILED[soft_triple] = "weight"
CLASS_TILED[p2s_grad] = "weight"
