"""Float64 loop references of ``pmlfunc.losses.cross_modal``, written from the papers.

``clip``: Radford et al. 2021, the symmetric cross entropy over the image–text logits
``S_ij = t·â_i·b̂_j + b`` (one positive per row: its pair); with labels, every pair of equal labels
is a positive and each row (and column) averages its log-probabilities over its positives, as
SupCon (Khosla et al. 2020) does. ``siglip``: Zhai et al. 2023, ``−(1/N) Σ_ij log σ(z_ij S_ij)``
with ``z = +1`` for positives and ``−1`` otherwise. Each term is a Python loop over rows and
pairs on ``math`` floats: nothing is shared with the library.

``siglip_pairs``: SigLIP's pairs listed one by one when the batch gives ids or a queue of
earlier documents (MoCo, He et al. 2020, for the queue): the pairs of row ``i`` are ``(a_i, b_j)``
for every ``j`` and ``(a_i, d_k)`` for the queue's filled documents ``d_k`` (its first ``count``
slots), a pair left out when it is not the row's own and its anchor id (or positive id) equals
the row's, where the batch gives that kind of id. Its terms are torch float64 scalars, so that
autograd gives the reference gradient.
"""

from __future__ import annotations

import math

import torch


def _logits(a, b, logit_scale: float, logit_bias: float | None, normalize: bool = True):
    def unit(v):
        n = math.sqrt(sum(x * x for x in v)) if normalize else 1.0
        return [x / n for x in v]

    ra, rb = [unit(r) for r in a.tolist()], [unit(r) for r in b.tolist()]
    t = math.exp(logit_scale)
    bias = 0.0 if logit_bias is None else logit_bias
    return [[t * sum(x * y for x, y in zip(p, q, strict=True)) + bias for q in rb] for p in ra]


def _positives(labels, n: int) -> list[list[bool]]:
    lab = list(range(n)) if labels is None else [int(v) for v in labels]
    return [[lab[i] == lab[j] for j in range(n)] for i in range(n)]


def clip(a, b, logit_scale, logit_bias=None, labels=None, reducer: str = "mean") -> float:
    s = _logits(a, b, logit_scale, logit_bias)
    n = len(s)
    pos = _positives(labels, n)

    def direction(rows):
        terms = []
        for i in range(n):
            row = [rows(i, j) for j in range(n)]
            lse = math.log(sum(math.exp(v) for v in row))
            p = [row[j] for j in range(n) if pos[i][j]]
            terms.append(lse - sum(p) / len(p))
        return sum(terms) / n if reducer == "mean" else sum(terms)

    return (direction(lambda i, j: s[i][j]) + direction(lambda j, i: s[i][j])) / 2


def siglip(a, b, logit_scale, logit_bias=None, labels=None, reducer: str = "batch") -> float:
    s = _logits(a, b, logit_scale, logit_bias)
    n = len(s)
    pos = _positives(labels, n)
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if pos[i][j] else -1.0
            total += -math.log(1.0 / (1.0 + math.exp(-z * s[i][j])))
    return {"batch": total / n, "mean": total / (n * n), "sum": total}[reducer]


def siglip_pairs(
    a, b, logit_scale, logit_bias=None, *, memory=None, anchor_ids=None, positive_ids=None,
    normalize=True, reducer="batch",
):  # fmt: skip
    """``Σ softplus(−z S)`` over the listed pairs (``z = +1`` for ``(a_i, b_i)``), divided by ``N``
    (``"batch"``), by the number of pairs (``"mean"``) or not (``"sum"``); a tensor."""

    def unit(v):
        return v / v.norm() if normalize else v

    n = a.shape[0]
    t = logit_scale.exp()
    bias = 0.0 if logit_bias is None else logit_bias
    no_id = None
    cols = [(unit(b[j]), j, j if anchor_ids is None else int(anchor_ids[j]),
             j if positive_ids is None else int(positive_ids[j])) for j in range(n)]  # fmt: skip
    if memory is not None:
        for k in range(int(memory["count"])):
            cols.append((unit(memory["documents"][k].to(a.dtype)), no_id,
                         int(memory["anchor_ids"][k]), int(memory["positive_ids"][k])))  # fmt: skip
    terms = []
    for i in range(n):
        ai = unit(a[i])
        for y, owner, aid, pid in cols:
            if owner != i and (
                (anchor_ids is not None and aid == int(anchor_ids[i]))
                or (positive_ids is not None and pid == int(positive_ids[i]))
            ):
                continue
            s = t * (ai * y).sum() + bias
            z = 1.0 if owner == i else -1.0
            terms.append(torch.nn.functional.softplus(-z * s, threshold=1e9))
    total = torch.stack(terms).sum()
    return {"batch": total / n, "mean": total / len(terms), "sum": total}[reducer]
