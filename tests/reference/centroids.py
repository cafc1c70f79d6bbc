"""Float64 loop references of ``pmlfunc.losses.centroids``: losses of each embedding's
similarities to the class centroids of the batch.

``ge2e`` is transcribed from Wan, Wang, Papir, Moreno, "Generalized End-to-End Loss for Speaker
Verification" (ICASSP 2018), equations 4-8, with arbitrary labels instead of the paper's
``N × M`` layout: the classes are the distinct labels of the batch, centroids are means of the
L2-normalised embeddings, the own class's centroid leaves the embedding out (a mean over the
other members, summed member by member), ``S = w·cos + b`` with ``w`` clamped at ``1e-6``, and
the bias is added to every similarity (so it cancels in the softmax variant only up to
rounding here). An embedding whose class has no other member has no loss; the losses are
averaged (``reduction="mean"``, 0 when none is left) or summed (the paper's
``reduction="sum"``).
"""

from __future__ import annotations

import torch


def _unit(x):
    return x / torch.sqrt(sum(x[k] * x[k] for k in range(x.shape[0])))


def _cos(a, c):
    dot = sum(a[k] * c[k] for k in range(a.shape[0]))
    norm_a = torch.sqrt(sum(a[k] * a[k] for k in range(a.shape[0])))
    norm_c = torch.sqrt(sum(c[k] * c[k] for k in range(c.shape[0])))
    return dot / (norm_a * norm_c)


def _mean(rows):
    return sum(rows) / len(rows)


def ge2e(emb, labels, w, b, *, variant="softmax", reduction="mean"):
    """GE2E (eq. 6 ``"softmax"``, eq. 7 ``"contrast"``) of float64 ``emb`` with 0-d ``w``,
    ``b``: the mean (or sum) of the per-embedding losses of the embeddings whose class has at
    least two members."""
    y = [int(v) for v in labels]
    n = len(y)
    e = [_unit(emb[i]) for i in range(n)]
    classes = sorted(set(y))
    members = {c: [i for i in range(n) if y[i] == c] for c in classes}
    centroid = {c: _mean([e[i] for i in members[c]]) for c in classes}
    scale = torch.clamp(w, min=1e-6)
    losses = []
    for i in range(n):
        j = y[i]
        rest = [m for m in members[j] if m != i]
        if not rest:
            continue  # no exclusive centroid: no loss
        s_own = scale * _cos(e[i], _mean([e[m] for m in rest])) + b
        s_other = [scale * _cos(e[i], centroid[k]) + b for k in classes if k != j]
        if variant == "softmax":
            logits = [s_own, *s_other]
            top = max(float(v.detach()) for v in logits)  # a constant shift, for range only
            total = torch.exp(s_own - top)
            for v in s_other:
                total = total + torch.exp(v - top)
            losses.append(-s_own + top + torch.log(total))
        elif variant == "contrast":
            hardest = max(
                (torch.sigmoid(v) for v in s_other), key=lambda v: float(v.detach()), default=None
            )
            term = 1.0 - torch.sigmoid(s_own)
            losses.append(term if hardest is None else term + hardest)
        else:
            raise ValueError(variant)
    zero = (emb * 0).sum() + w * 0 + b * 0
    if not losses:
        return zero
    total = sum(losses)
    return total / len(losses) if reduction == "mean" else total
