r"""Losses that learn from given scores: gold similarities and a teacher's scores.

Each loss reads row-aligned pairs only and regresses, ranks or distils the student's
similarities ``s`` against scores the caller gives:

| function | inputs | per batch | sentence-transformers |
|---|---|---|---|
| :func:`margin_mse` | ``anchors`` ``q``, ``positives`` ``p``, ``negatives`` ``n_1 … n_k``, the teacher's margins ``m`` ``(N, k)`` (or scores ``(N, 1 + k)``) | ``mean_ij (s(q_i, p_i) − s(q_i, n_ij) − m_ij)²`` | ``MarginMSELoss`` |
| :func:`distill_kl_div` | ``anchors``, ``positives``, ``negatives``, the teacher's scores ``t`` ``(N, 1 + k)`` | ``τ_s² · (1/N) Σ_i KL(softmax(t_i / τ_t) ‖ softmax(s_i / τ_s))`` over the candidates ``(p_i, n_i1 … n_ik)`` | ``DistillKLDivLoss`` |
| :func:`cosent` | pairs ``(a_i, b_i)``, gold scores ``y`` ``(N,)`` | ``log(1 + Σ_{y_i < y_j} e^{λ (s_i − s_j)})`` | ``CoSENTLoss`` |
| :func:`angle` | the same (or anchors, positives, negatives) | CoSENT over AnglE's similarity ``|cos + sin|`` | ``AnglELoss`` |

The rules every loss here keeps, stated once (the functions' docstrings refer to them):

- **Similarity.** ``s(u, v)`` is the ``distance``'s value on the row pair ``(u, v)`` when it is a
  similarity (:func:`~pmlfunc.distances.dot`, :func:`~pmlfunc.distances.cosine`) and its negative
  when it is a distance (:func:`~pmlfunc.distances.lp`, :func:`~pmlfunc.distances.snr`):
  sentence-transformers' ``pairwise_euclidean_sim`` and ``pairwise_manhattan_sim`` are
  ``lp(normalize=False)`` and ``lp(p=1, normalize=False)``. Only listed pairs are scored (no
  ``N × N`` matrix): ``O(N (1 + k) D)`` work.
- **Negatives** are row ``i``'s own: ``(N, D)`` (one a row) or ``(N, k, D)``. No loss here uses
  the other rows' documents (in-batch negatives are :func:`~pmlfunc.losses.multiple_negatives_ranking`'s).
- **Given scores are data.** Teacher scores and gold scores are never differentiated (a teacher
  score with an autograd graph is detached) and are checked by shape, dtype and device only:
  sentence-transformers' first-batch look at the teacher's values (a NaN raises, a collapsed
  softmax warns) reads them on the host and is not done; a NaN score gives a NaN loss. Teacher
  scores are cast to the compute dtype; gold scores are only compared, in their own dtype
  (bool as integers, float16/bfloat16 as float32).
- **Low precision.** float16/bfloat16 embeddings are computed in float32 and the loss is
  float32; otherwise the loss has the embeddings' dtype.

Hyper-parameters (``scale``, the temperatures) are a Python number or a 0-d tensor. None of
these losses takes a ``reducer``: each has sentence-transformers' one reduction (a mean of
squares, ``batchmean``, one log-sum-exp over every ranked pair).

``MegaBatchMarginLoss``, the other sentence-transformers companion of the retrieval loss, learns
from no given score: it mines each anchor's hardest negative from the batch, so it lives with
the in-batch losses (:func:`pmlfunc.losses.in_batch.mega_batch_margin`).

Example:
    >>> q, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 2, 8)
    >>> teacher = torch.randn(4, 3)  # the teacher's scores of (p, n_1, n_2) for each query
    >>> mse = pf.losses.margin_mse(q, p, n, teacher)
    >>> kl = pf.losses.distill_kl_div(q, p, n, teacher)
    >>> sts = pf.losses.cosent(q, p, torch.tensor([0.9, 0.1, 0.5, 0.3]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._ops import einsum, unit_rows
from ..distances import Distance, cosine, dot, resolve

__all__ = ["angle", "cosent", "distill_kl_div", "margin_mse"]


def margin_mse(
    anchors: Tensor,
    positives: Tensor,
    negatives: Tensor,
    teacher_scores: Tensor,
    *,
    distance: Distance | None = None,
) -> Tensor:
    r"""Margin-MSE distillation: the student's margins regressed on the teacher's.

    Row ``i`` is a query ``q_i``, a first document ``p_i`` and ``k`` others ``n_i1 … n_ik``; the
    teacher's margins ``m_ij`` (given, or from its scores ``t_i0 … t_ik`` as ``t_i0 − t_ij``):

    .. math::
        L = \frac{1}{N k} \sum_{i=1}^{N} \sum_{j=1}^{k}
            \big(s(q_i, p_i) - s(q_i, n_{ij}) - m_{ij}\big)^2

    The two documents need not be a positive and a negative: a margin may be of either sign.

    sentence-transformers' ``MarginMSELoss(model, similarity_fct=f)`` on the columns
    ``(query, document_1, document_2 … document_{k+1})`` and labels ``teacher_scores`` is
    ``margin_mse(q, d1, stack(d2 …), teacher_scores, distance=...)`` with ``pairwise_dot_score``
    → ``dot()`` (the default), ``pairwise_cos_sim`` → ``cosine()``; its labels' three layouts
    are accepted, read from their shape as it reads them.

    Args:
        anchors: ``(N, D)`` float tensor, the queries.
        positives: ``(N, D)`` float tensor, row ``i`` the first document of query ``i``.
        negatives: ``(N, D)`` (``k = 1``) or ``(N, k, D)`` with ``k ≥ 1``: row ``i``'s other
            documents.
        teacher_scores: float tensor on the anchors' device, never differentiated: the margins
            ``(N, k)`` (``(N,)`` when ``k = 1``), or the scores ``(N, 1 + k)`` of
            ``(p_i, n_i1 … n_ik)``, turned into margins ``t_i0 − t_ij``.
        distance: default ``dot()`` (sentence-transformers' ``pairwise_dot_score``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> q, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        >>> teacher = torch.tensor([2.0, -0.5, 1.0, 0.0])  # t(q, p) - t(q, n), one per query
        >>> loss = pf.losses.margin_mse(q, p, n, teacher)
        >>> own = (q * p).sum(1) - (q * n).sum(1)  # the student's own margins: nothing to learn
        >>> float(pf.losses.margin_mse(q, p, n, own)) < 1e-10
        True

    References: Hofstätter et al., "Improving Efficient Neural Ranking Models with
    Cross-Architecture Knowledge Distillation", 2020 (arXiv:2010.02666).
    """
    dist, q, docs = _candidates(anchors, positives, negatives, distance, dot(), "margin_mse")
    n, k = docs.shape[0], docs.shape[1] - 1
    t = _teacher(teacher_scores, anchors, q.dtype)
    if t.shape == (n, k + 1):
        t = t[:, :1] - t[:, 1:]
    elif t.shape == (n,) and k == 1:
        t = t.unsqueeze(1)
    elif t.shape != (n, k):
        raise ValueError(
            f"teacher_scores must be the teacher's margins ({n}, {k})"
            + (f" or ({n},)" if k == 1 else "")
            + f" or its scores ({n}, {k + 1}) of (positive, {k} negatives), for N = {n} rows "
            f"and k = {k} negatives, got shape {tuple(t.shape)}"
        )
    s = _pair_scores(dist, q, docs)
    diff = s[:, :1] - s[:, 1:] - t
    return (diff * diff).mean()


def distill_kl_div(
    anchors: Tensor,
    positives: Tensor,
    negatives: Tensor,
    teacher_scores: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    student_temperature: float | Tensor | None = None,
    teacher_temperature: float | Tensor | None = None,
    distance: Distance | None = None,
) -> Tensor:
    r"""Listwise KL distillation: the student's softmax over each query's candidates fitted to
    the teacher's.

    Row ``i``'s candidates are ``c_i = (p_i, n_i1 … n_ik)``; with the student's similarities
    ``s_ic = s(q_i, c)``, the teacher's scores ``t_ic``, their softmaxes
    ``P_i = softmax(t_i / τ_t)`` and ``Q_i = softmax(s_i / τ_s)``:

    .. math::
        L = \frac{τ_s^2}{N} \sum_{i=1}^{N} \mathrm{KL}(P_i \,\|\, Q_i)
          = \frac{τ_s^2}{N} \sum_{i=1}^{N} \sum_{c} P_{ic} \big(\log P_{ic} - \log Q_{ic}\big)

    (``KLDivLoss(reduction="batchmean")`` times the student temperature squared, which keeps
    the gradient's size comparable across temperatures, Hinton et al. 2015). A candidate whose
    teacher probability is 0 (a teacher score of ``−inf``) has no KL term (``0 · log 0 = 0``);
    it stays in the student's softmax, which is taught to give it 0.

    sentence-transformers' ``DistillKLDivLoss(model, similarity_fct=f, temperature=τ,
    student_temperature=τ_s, teacher_temperature=τ_t)`` on the columns ``(query, candidate_1 …
    candidate_{k+1})`` and labels ``teacher_scores`` ``(N, 1 + k)`` is
    ``distill_kl_div(q, c1, stack(c2 …), teacher_scores, temperature=τ, ...)`` with the same
    temperatures and ``f`` as ``distance`` (``pairwise_dot_score`` → ``dot()``).

    Args:
        anchors: ``(N, D)`` float tensor, the queries.
        positives: ``(N, D)`` float tensor, row ``i``'s first candidate.
        negatives: ``(N, D)`` (``k = 1``) or ``(N, k, D)`` with ``k ≥ 1``: row ``i``'s other
            candidates (a softmax over one candidate would be constant).
        teacher_scores: ``(N, 1 + k)`` float tensor on the anchors' device, the teacher's
            scores of ``(p_i, n_i1 … n_ik)``; never differentiated.
        temperature: ``τ`` of both softmaxes unless overridden: ``> 0``, default ``1.0``.
        student_temperature: ``τ_s`` (default ``None``: ``temperature``); also the loss's factor
            ``τ_s²``.
        teacher_temperature: ``τ_t`` (default ``None``: ``temperature``).
        distance: default ``dot()`` (sentence-transformers' ``pairwise_dot_score``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> q, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 3, 8)
        >>> teacher = torch.randn(4, 4)  # scores of (p, n_1, n_2, n_3) for each query
        >>> loss = pf.losses.distill_kl_div(q, p, n, teacher, temperature=2.0)
        >>> own = torch.cat([(q * p).sum(-1, keepdim=True), torch.einsum("nd,nkd->nk", q, n)], 1)
        >>> float(pf.losses.distill_kl_div(q, p, n, own)) < 1e-6  # the student is its own teacher
        True

    References: Lin, Yang, Lin, "Distilling Dense Representations for Ranking using
    Tightly-Coupled Teachers", 2020 (arXiv:2010.11386); Hinton, Vinyals, Dean, "Distilling the
    Knowledge in a Neural Network", 2015.
    """
    dist, q, docs = _candidates(anchors, positives, negatives, distance, dot(), "distill_kl_div")
    n, c = docs.shape[0], docs.shape[1]
    cd = q.dtype
    tau = _temperature(temperature, "temperature", cd, q.device)
    tau_s = (
        tau
        if student_temperature is None
        else _temperature(student_temperature, "student_temperature", cd, q.device)
    )
    tau_t = (
        tau
        if teacher_temperature is None
        else _temperature(teacher_temperature, "teacher_temperature", cd, q.device)
    )
    t = _teacher(teacher_scores, anchors, cd)
    if t.shape != (n, c):
        raise ValueError(
            f"teacher_scores must be ({n}, {c}): the teacher's scores of each row's {c} "
            f"candidates (positive, then {c - 1} negatives), got shape {tuple(t.shape)}"
        )
    log_q = torch.log_softmax(_pair_scores(dist, q, docs) / tau_s, dim=1)
    p = torch.softmax(t / tau_t, dim=1)
    kl = (torch.xlogy(p, p) - p * log_q).sum() / n
    return kl * (tau_s * tau_s)


def cosent(
    emb_a: Tensor,
    emb_b: Tensor,
    scores: Tensor,
    *,
    scale: float | Tensor = 20.0,
    distance: Distance | None = None,
) -> Tensor:
    r"""CoSENT: every pair ranked above each pair with a lower gold score.

    With ``s_i = s(a_i, b_i)`` the similarity of pair ``i``, ``y_i`` its gold score and the
    scale ``λ``:

    .. math::
        L = \log\Big(1 + \sum_{(i, j):\, y_i < y_j} e^{λ (s_i - s_j)}\Big)

    Pairs of equal gold score are not compared. Computed as sentence-transformers does, without
    the ``N × N`` pair matrix: the pairs sorted by gold score, a reversed cumulative
    log-sum-exp of ``−λ s`` gives each pair's ``log Σ_{y_j > y_i} e^{−λ s_j}`` (a binary search
    finds where the higher scores start), then one log-sum-exp: ``O(N log N)``.

    sentence-transformers' ``CoSENTLoss(model, scale=λ, similarity_fct=f)`` on the columns
    ``(a, b)`` and labels ``scores`` is ``cosent(a, b, scores, scale=λ, distance=...)`` with
    ``pairwise_cos_sim`` → ``cosine()`` (the default), ``pairwise_dot_score`` → ``dot()``; as
    there, columns after the second are not read (there is no ``negatives``).

    Args:
        emb_a: ``(N, D)`` float tensor, the first text of each pair.
        emb_b: ``(N, D)`` float tensor, row ``i`` the second text of pair ``i``.
        scores: ``(N,)`` real (integer, bool or float) tensor on ``emb_a``'s device: the gold
            similarity of each pair, only compared (any scale, e.g. 0–5 STS-B scores).
        scale: ``λ > 0`` (an inverse temperature), default ``20.0``.
        distance: default ``cosine()`` (sentence-transformers' ``pairwise_cos_sim``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, b = torch.randn(6, 8), torch.randn(6, 8)
        >>> gold = torch.tensor([4.5, 0.5, 3.0, 3.0, 1.0, 5.0])  # e.g. STS-B scores
        >>> loss = pf.losses.cosent(a, b, gold)
        >>> float(pf.losses.cosent(a, b, torch.zeros(6)))  # no pair ranks above another
        0.0

    References: Su, "CoSENT: a more efficient sentence vector scheme than Sentence-BERT", 2022
    (blog post; Huang et al., "CoSENT: Consistent Sentence Embedding via Similarity Ranking",
    IEEE/ACM TASLP 2024).
    """
    a, b = _checks.paired_rows(emb_a, emb_b, ("emb_a", "emb_b"), "cosent")
    gold = _gold(scores, a.shape[0], a.device)
    lam = _scale(scale, a)
    dist = resolve(distance, cosine())
    cd = _checks.compute_dtype(a.dtype)
    s = -dist.sign() * dist.pairs(a.to(cd), b.to(cd))
    return _ranked(s, gold, lam)


def angle(
    emb_a: Tensor,
    emb_b: Tensor,
    scores: Tensor | None = None,
    *,
    negatives: Tensor | None = None,
    scale: float | Tensor = 20.0,
) -> Tensor:
    r"""AnglE: CoSENT over the angle-difference similarity of two embeddings.

    Each row is split into halves ``u = (u', u'')`` (the real and imaginary parts of a complex
    vector; an odd width gets a zero last entry), and with ``û`` the L2-normalised row the
    similarity is sentence-transformers' ``pairwise_angle_sim``, the authors' code's:

    .. math::
        s(u, v) = \big|\, û \cdot v̂ + û'' \cdot v̂' - û' \cdot v̂'' \,\big|

    (the cosine plus the "sine" of the normalised complex angle difference; not a geometric
    angle: see sentence-transformers' note on equation 3 of the paper). The loss is
    :func:`cosent`'s ranking loss over it, with the same ``scale``.

    With ``negatives`` (sentence-transformers' ``(anchor, positive, negative_1 …)`` input),
    ``emb_a`` holds the anchors and ``emb_b`` the positives: the pairs are ``(a_i, b_i)`` with
    gold score ``y_i`` (default 1) and ``(a_i, n_ij)`` with gold score ``1 − y_i``.

    sentence-transformers' ``AnglELoss(model, scale=λ)`` is ``angle(a, b, scores, scale=λ)`` on
    pairs and ``angle(a, p, scores, negatives=stack(n_1 …), scale=λ)`` (``scores`` ``None``
    for its label-less triplets) on n-tuples.

    Args:
        emb_a: ``(N, D)`` float tensor, the first text of each pair (the anchors).
        emb_b: ``(N, D)`` float tensor, row ``i`` the second text of pair ``i`` (the positives).
        scores: ``(N,)`` real tensor on ``emb_a``'s device, the gold scores of the pairs
            ``(a_i, b_i)``; required without ``negatives``, default 1 with them.
        negatives: ``None``, ``(N, D)`` or ``(N, k, D)``: row ``i``'s negatives.
        scale: ``λ > 0``, default ``20.0``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, b = torch.randn(6, 8), torch.randn(6, 8)
        >>> loss = pf.losses.angle(a, b, torch.tensor([4.5, 0.5, 3.0, 3.0, 1.0, 5.0]))
        >>> triplets = pf.losses.angle(a, b, negatives=torch.randn(6, 2, 8))

    References: Li & Li, "AnglE-optimized Text Embeddings", 2023 (arXiv:2309.12871; "AoE:
    Angle-optimized Embeddings for Semantic Textual Similarity", ACL 2024).
    """
    a, b = _checks.paired_rows(emb_a, emb_b, ("emb_a", "emb_b"), "angle")
    n = a.shape[0]
    lam = _scale(scale, a)
    cd = _checks.compute_dtype(a.dtype)
    if negatives is None:
        if scores is None:
            raise ValueError(
                "angle needs scores (the gold score of each pair) when no negatives are given"
            )
        docs = b.unsqueeze(1)
        gold = _gold(scores, n, a.device).unsqueeze(1)
    else:
        neg = _negatives(negatives, a)
        docs = torch.cat([b.unsqueeze(1), neg], 1)
        y = (
            torch.ones(n, dtype=cd, device=a.device)
            if scores is None
            else _gold(scores, n, a.device)
        )
        gold = torch.cat([y.unsqueeze(1), (1 - y).unsqueeze(1).expand(n, neg.shape[1])], 1)
    s = _angle_sim(a.to(cd), docs.to(cd))
    return _ranked(s.reshape(-1), gold.reshape(-1), lam)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _negatives(negatives: object, anchors: Tensor, *, required: bool = False) -> Tensor:
    """``negatives`` as ``(N, k, D)`` (a 2-D one is ``k = 1``), in the anchors' space."""
    given = _checks.tensor(negatives, "negatives")
    neg = given.unsqueeze(1) if given.ndim == 2 else given
    n, d = anchors.shape
    if neg.ndim != 3 or neg.shape[0] != n or neg.shape[2] != d:
        raise ValueError(
            f"negatives must be (N, D) or (N, k, D) with N = {n} (the anchors' rows) and D = {d} "
            f"(their embedding size), got shape {tuple(given.shape)}"
        )
    if neg.dtype != anchors.dtype:
        raise TypeError(f"negatives has dtype {neg.dtype} but the anchors have {anchors.dtype}")
    if neg.device != anchors.device:
        raise ValueError(f"negatives is on {neg.device} but the anchors are on {anchors.device}")
    if required and neg.shape[1] == 0:
        raise ValueError("negatives must hold at least one negative a row (k >= 1), got k = 0")
    return neg


def _candidates(
    anchors, positives, negatives, distance, default: Distance, what: str
) -> tuple[Distance, Tensor, Tensor]:
    """The distance, the queries ``(N, D)`` and each row's candidates ``(N, 1 + k, D)``
    (positive first), validated and in the compute dtype."""
    q, p = _checks.paired_rows(anchors, positives, ("anchors", "positives"), what)
    if negatives is None:
        raise ValueError(f"{what} needs negatives: (N, D) or (N, k, D), k >= 1")
    neg = _negatives(negatives, q, required=True)
    dist = resolve(distance, default)
    cd = _checks.compute_dtype(q.dtype)
    return dist, q.to(cd), torch.cat([p.unsqueeze(1), neg], 1).to(cd)


def _pair_scores(dist: Distance, q: Tensor, docs: Tensor) -> Tensor:
    """``(N, K)`` similarities ``s(q_i, docs_ic)``: the rows normalised once, then the pairs."""
    normalize, rest = dist.split_normalization()
    q, docs = normalize(q), normalize(docs)
    n, k, d = docs.shape
    if rest.kind == "dot":  # an inner product: one batched contraction, no copies of q
        return einsum("nd,nkd->nk", q, docs)
    flat = rest.pairs(q.unsqueeze(1).expand(n, k, d).reshape(n * k, d), docs.reshape(n * k, d))
    return -rest.sign() * flat.view(n, k)


def _teacher(scores: object, anchors: Tensor, cd: torch.dtype) -> Tensor:
    """Teacher scores: a float tensor on the anchors' device, detached, in the compute dtype."""
    t = _checks.tensor(scores, "teacher_scores")
    if not t.dtype.is_floating_point:
        raise TypeError(f"teacher_scores must be a floating-point tensor, got {t.dtype}")
    if t.device != anchors.device:
        raise ValueError(f"teacher_scores is on {t.device} but the anchors are on {anchors.device}")
    return t.detach().to(cd)


def _gold(scores: object, n: int, device: torch.device) -> Tensor:
    """Gold scores ``(N,)``: real, on ``device``, detached; compared in their own dtype (bool
    as int64, float16/bfloat16 as float32)."""
    y = _checks.tensor(scores, "scores")
    if y.dtype.is_complex:
        raise TypeError(f"scores must be a real (integer, bool or float) tensor, got {y.dtype}")
    if y.shape != (n,):
        raise ValueError(
            f"scores must be ({n},): one gold score a pair, got shape {tuple(y.shape)}"
        )
    if y.device != device:
        raise ValueError(f"scores is on {y.device} but the embeddings are on {device}")
    y = y.detach()
    if y.dtype == torch.bool:
        return y.to(torch.int64)
    return y.to(torch.float32) if y.dtype in _checks.LOW_PRECISION else y


def _scale(scale: object, like: Tensor) -> float | Tensor:
    lam = _checks.hyper(scale, "scale", positive=True)
    cd = _checks.compute_dtype(like.dtype)
    return lam.to(dtype=cd, device=like.device) if isinstance(lam, Tensor) else lam


def _temperature(value: object, name: str, cd: torch.dtype, device) -> float | Tensor:
    tau = _checks.hyper(value, name, positive=True)
    if isinstance(tau, Tensor):
        return tau.to(dtype=cd, device=device)
    if tau == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {tau}")
    return tau


def _ranked(s: Tensor, gold: Tensor, lam: float | Tensor) -> Tensor:
    """CoSENT's ``log(1 + Σ_{y_i < y_j} e^{λ (s_i − s_j)})`` over the pairs' similarities ``s``
    and gold scores ``y`` (both ``(L,)``), in ``O(L log L)``: sorted by ``y``, each pair's
    ``log Σ_{y_j > y_i} e^{−λ s_j}`` is a suffix log-sum-exp read where the higher scores start."""
    x = s * lam
    gold, order = gold.sort()
    x = x[order]
    higher = torch.searchsorted(gold, gold, right=True)  # the first pair of a strictly higher y
    suffix = torch.logcumsumexp(-x.flip(0), dim=0).flip(0)
    suffix = torch.cat([suffix, suffix.new_full((1,), -torch.inf)])  # no higher pair: e^{-inf}
    terms = x + suffix[higher]
    return torch.logsumexp(torch.cat([terms.new_zeros(1), terms]), dim=0)


def _angle_sim(a: Tensor, docs: Tensor) -> Tensor:
    """``(N, K)`` AnglE similarities ``|cos + sin|`` of ``a_i`` ``(N, D)`` and ``docs_ic``
    ``(N, K, D)`` (sentence-transformers' ``pairwise_angle_sim``)."""
    a, docs = unit_rows(a), unit_rows(docs)
    if a.shape[-1] % 2:  # a zero entry pairs the last dimension (it changes no norm)
        a, docs = F.pad(a, (0, 1)), F.pad(docs, (0, 1))
    h = a.shape[-1] // 2
    cos = einsum("nd,nkd->nk", a, docs)
    sin = einsum("nd,nkd->nk", a[:, h:], docs[..., :h]) - einsum(
        "nd,nkd->nk", a[:, :h], docs[..., h:]
    )
    return (cos + sin).abs()
