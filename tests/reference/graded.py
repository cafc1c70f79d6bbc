"""Float64 loop references of the losses that learn from given scores (``pmlfunc.losses.graded``),
written from the papers and from sentence-transformers' documented formulas. Nothing here
imports pmlfunc: every similarity is a loop over entries (:func:`reference.pair_distance`), every
sum a Python loop over rows, candidates or pairs of pairs.

* ``margin_mse`` (Hofstätter et al. 2020; ``MarginMSELoss``): for each row ``i`` and negative
  ``j``, ``(s(q_i, p_i) − s(q_i, n_ij) − m_ij)²``, the mean over the ``N·k`` terms. The teacher
  gives the margins ``m``, or its scores ``t``, from which ``m_ij = t_i0 − t_ij``.
* ``distill_kl_div`` (Lin et al. 2020; ``DistillKLDivLoss``): per row, the teacher's softmax
  ``P = softmax(t/τ_t)`` and the student's ``Q = softmax(s/τ_s)`` over the candidates
  ``(p_i, n_i1 … n_ik)``, each written out as ``e^{x_c} / Σ e^{x}``;
  ``KL(P ‖ Q) = Σ_c P_c (log P_c − log Q_c)`` (a term with ``P_c = 0`` is 0), summed over rows,
  divided by ``N`` (``batchmean``) and multiplied by ``τ_s²``.
* ``cosent`` (Su 2022; ``CoSENTLoss``): ``log(1 + Σ e^{λ(s_i − s_j)})`` over every ordered pair
  of pairs ``(i, j)`` with gold ``y_i < y_j``, enumerated.
* ``angle`` (Li & Li 2023): the same ranking loss over the AnglE similarity, computed as the
  authors' code does: the rows' halves are the real and imaginary parts ``(a + bi)``,
  ``(c + di)``; the complex quotient ``(a + bi)/(c + di)`` entry by entry over ``|y|²``, times
  ``|y|/|x|``, summed over the entries (real plus imaginary parts), absolute value. An odd width
  is padded with a zero entry (sentence-transformers). With negatives, the pairs ``(a_i, p_i)``
  have gold ``y_i`` (default 1) and ``(a_i, n_ij)`` gold ``1 − y_i``.
"""

from __future__ import annotations

import math

import torch

from . import oriented, pair_distance


def _sim(x, y, distance):
    """A similarity (larger is closer): a distance's value negated."""
    return oriented(pair_distance(x, y, distance), distance)


def _margins(teacher, n, k):
    if tuple(teacher.shape) == (n, k + 1):
        return [[teacher[i, 0] - teacher[i, 1 + j] for j in range(k)] for i in range(n)]
    if tuple(teacher.shape) == (n,):
        return [[teacher[i]] for i in range(n)]
    return [[teacher[i, j] for j in range(k)] for i in range(n)]


def margin_mse(q, p, neg, teacher, *, distance=("dot", {})):
    n, k = neg.shape[0], neg.shape[1]
    m = _margins(teacher.detach(), n, k)
    terms = []
    for i in range(n):
        pos = _sim(q[i], p[i], distance)
        for j in range(k):
            student = pos - _sim(q[i], neg[i, j], distance)
            terms.append((student - m[i][j]) ** 2)
    return sum(terms) / len(terms)


def _softmax(xs):
    top = max(float(x.detach()) for x in xs)
    e = [torch.exp(x - top) for x in xs]
    total = sum(e)
    return [v / total for v in e]


def distill_kl_div(
    q,
    p,
    neg,
    teacher,
    *,
    temperature=1.0,
    student_temperature=None,
    teacher_temperature=None,
    distance=("dot", {}),
):
    tau_s = temperature if student_temperature is None else student_temperature
    tau_t = temperature if teacher_temperature is None else teacher_temperature
    n, k = neg.shape[0], neg.shape[1]
    teacher = teacher.detach()
    total = 0.0
    for i in range(n):
        cands = [p[i]] + [neg[i, j] for j in range(k)]
        student = _softmax([_sim(q[i], c, distance) / tau_s for c in cands])
        target = _softmax([teacher[i, c] / tau_t for c in range(k + 1)])
        for pc, qc in zip(target, student, strict=True):
            if float(pc) > 0:
                total = total + pc * (torch.log(pc) - torch.log(qc))
    return total / n * tau_s**2


def _ranking(sims, gold, scale):
    """``log(1 + Σ_{y_i < y_j} e^{λ(s_i − s_j)})`` over every ordered pair of pairs."""
    terms = [
        scale * (sims[i] - sims[j])
        for i in range(len(sims))
        for j in range(len(sims))
        if float(gold[i]) < float(gold[j])
    ]
    if not terms:
        return sum(s * 0 for s in sims)
    top = max(0.0, max(float(t.detach()) for t in terms))
    return top + torch.log(math.exp(-top) + sum(torch.exp(t - top) for t in terms))


def cosent(a, b, gold, *, scale=20.0, distance=("cosine", {})):
    sims = [_sim(a[i], b[i], distance) for i in range(a.shape[0])]
    return _ranking(sims, [float(v) for v in gold], scale)


def angle_sim(x, y):
    """The AnglE authors' similarity of two rows: complex division of their halves."""
    if x.shape[0] % 2:
        x = torch.cat([x, x.new_zeros(1)])
        y = torch.cat([y, y.new_zeros(1)])
    h = x.shape[0] // 2
    a, b, c, d = x[:h], x[h:], y[:h], y[h:]
    z = sum(c[t] ** 2 + d[t] ** 2 for t in range(h))  # |y|²
    norm_x = torch.sqrt(sum(a[t] ** 2 + b[t] ** 2 for t in range(h)))
    norm_y = torch.sqrt(z)
    total = 0.0
    for t in range(h):
        re = (a[t] * c[t] + b[t] * d[t]) / z
        im = (b[t] * c[t] - a[t] * d[t]) / z
        total = total + (re + im) / (norm_x / norm_y)
    return total.abs()


def angle(a, b, gold=None, *, negatives=None, scale=20.0):
    n = a.shape[0]
    sims, ys = [], []
    y = [1.0] * n if gold is None else [float(v) for v in gold]
    for i in range(n):
        sims.append(angle_sim(a[i], b[i]))
        ys.append(y[i])
    if negatives is not None:
        for i in range(n):
            for j in range(negatives.shape[1]):
                sims.append(angle_sim(a[i], negatives[i, j]))
                ys.append(1.0 - y[i])
    return _ranking(sims, ys, scale)
