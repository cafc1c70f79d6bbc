"""Float64 loop references of ``pmlfunc.losses.cross_modal``, written from the papers.

``clip``: Radford et al. 2021, the symmetric cross entropy over the image–text logits
``S_ij = t·â_i·b̂_j + b`` (one positive per row: its pair); with labels, every pair of equal labels
is a positive and each row (and column) averages its log-probabilities over its positives, as
SupCon (Khosla et al. 2020) does. ``siglip``: Zhai et al. 2023, ``−(1/N) Σ_ij log σ(z_ij S_ij)``
with ``z = +1`` for positives and ``−1`` otherwise. Each term is a Python loop over rows and
pairs on ``math`` floats: nothing is shared with the library.
"""

from __future__ import annotations

import math


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
