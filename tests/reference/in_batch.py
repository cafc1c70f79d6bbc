"""Float64 loop reference of ``mega_batch_margin`` (``pmlfunc.losses.in_batch``), written from
sentence-transformers' documented ``MegaBatchMarginLoss`` (after Wieting & Gimpel 2018's
mega-batching): for each anchor ``i``, its positive's cosine ``c_ii`` and the largest cosine
``c_ij*`` with another row's positive (``j* ≠ i``, the first of equal maxima), each computed
entry by entry; ``[m⁺ − c_ii]_+ + [c_ij* − m⁻]_+`` with ``[x]_+`` as ``torch.relu`` (gradient 0 at
0); the mean over anchors. Nothing here imports pmlfunc.
"""

from __future__ import annotations

import torch

from . import pair_distance


def mega_batch_margin(a, p, *, positive_margin=0.8, negative_margin=0.3):
    n = a.shape[0]
    total = 0.0
    for i in range(n):
        cos = [pair_distance(a[i], p[j], ("cosine", {})) for j in range(n)]
        total = total + torch.relu(positive_margin - cos[i])
        others = [j for j in range(n) if j != i]
        if others:
            best = others[0]
            for j in others[1:]:
                if float(cos[j].detach()) > float(cos[best].detach()):
                    best = j
            total = total + torch.relu(cos[best] - negative_margin)
    return total / n
