"""Float64 loop reference of ``pmlfunc.losses.margin_softmax``: classifier heads with an
angular or additive margin at the target class.

Written from the papers' formulas with ``arccos`` and ``cos(mθ)``, nothing shared with the
implementation: L-Softmax (Liu et al. 2016) and SphereFace (Liu et al. 2017) with
ψ(θ) = (−1)^k cos(mθ) − 2k, CosFace (Wang et al. 2018) cos θ − m, ArcFace (Deng et al. 2019)
cos(θ + m) with its fallback cos θ − m·sin m past π − m, its sub-centre variant (the closest
sub-centre) and the dynamic variant (a margin per class).
"""

from __future__ import annotations

import math

import torch

SUBCENTER = {"subcenter_arcface", "dynamic_arcface"}


def _norm(v):
    return torch.sqrt(sum(v[t] * v[t] for t in range(v.shape[0])))


def _cos(a, b):
    return sum(a[t] * b[t] for t in range(a.shape[0])) / (_norm(a) * _norm(b))


def margin_softmax(name, x, labels, w, *, margin=None, scale=None, margins=None, miner=None):
    """The loss called ``name``: the mean over samples of −log softmax at the target, built entry
    by entry (``miner``: a per-sample weight, PML's miner weights)."""
    defaults = {
        "large_margin_softmax": (4, 1.0),
        "sphereface": (4, 1.0),
        "cosface": (0.35, 64.0),
        "arcface": (0.5, 64.0),
        "subcenter_arcface": (0.5, 64.0),
        "dynamic_arcface": (None, 64.0),
    }[name]
    margin = defaults[0] if margin is None else margin
    scale = defaults[1] if scale is None else scale
    terms = []
    for i in range(x.shape[0]):
        y = int(labels[i])
        xi = x[i]
        logits = []
        for j in range(w.shape[0]):
            if name in SUBCENTER:
                cos = max(
                    (_cos(xi, w[j, kk]) for kk in range(w.shape[1])),
                    key=lambda v: float(v.detach()),
                )
            else:
                cos = _cos(xi, w[j])
            if j == y:
                theta = torch.acos(cos)
                if name in ("large_margin_softmax", "sphereface"):
                    k = math.floor(float(theta.detach()) * margin / math.pi)
                    value = (-1) ** k * torch.cos(margin * theta) - 2 * k
                elif name == "cosface":
                    value = cos - margin
                else:
                    m = float(margins[y]) if name == "dynamic_arcface" else margin
                    if float(theta.detach()) <= math.pi - m:
                        value = torch.cos(theta + m)
                    else:
                        value = torch.cos(theta) - m * math.sin(m)
            else:
                value = cos
            if name == "large_margin_softmax":
                value = value * _norm(xi) * _norm(w[j])
            elif name == "sphereface":
                value = value * _norm(xi)
            logits.append(scale * value)
        top = max(float(z.detach()) for z in logits)
        lse = torch.log(sum(torch.exp(z - top) for z in logits)) + top
        term = lse - logits[y]
        if miner is not None:
            term = term * miner[i]
        terms.append(term)
    return sum(terms) / len(terms)
