"""Embedding losses as pure functions: ``loss(embeddings, labels[, params], *, ...) -> 0-d tensor``.

One module per family; every loss is re-exported here by its PML name in snake_case. Learnable
losses take a ``params`` dict created by their ``<loss>_init``.
"""

from .contrastive_ext import (
    decoupled_contrastive,
    multi_supcon,
    selectively_contrastive_triplet,
    vicreg,
)
from .margin_softmax import (
    arcface,
    arcface_init,
    cosface,
    cosface_init,
    dynamic_arcface,
    dynamic_arcface_init,
    dynamic_arcface_margins,
    large_margin_softmax,
    large_margin_softmax_init,
    sphereface,
    sphereface_init,
    subcenter_arcface,
    subcenter_arcface_init,
)
from .pairs import contrastive, multi_similarity
from .proxies import (
    normalized_softmax,
    normalized_softmax_init,
    p2s_grad,
    p2s_grad_init,
    proxy_anchor,
    proxy_anchor_init,
    proxy_nca,
    proxy_nca_init,
    soft_triple,
    soft_triple_init,
)
from .ranking import (
    dynamic_soft_margin,
    dynamic_soft_margin_init_state,
    fast_ap,
    histogram,
    pnp,
    smooth_ap,
)
from .softmax import ntxent, supcon
from .structured import (
    circle,
    generalized_lifted_structure,
    intra_pair_variance,
    lifted_structure,
    margin,
    margin_init,
    signal_to_noise_ratio_contrastive,
    tuplet_margin,
)
from .triplets import triplet_margin

__all__ = [
    "arcface",
    "arcface_init",
    "circle",
    "contrastive",
    "cosface",
    "cosface_init",
    "decoupled_contrastive",
    "dynamic_arcface",
    "dynamic_arcface_init",
    "dynamic_arcface_margins",
    "dynamic_soft_margin",
    "dynamic_soft_margin_init_state",
    "fast_ap",
    "generalized_lifted_structure",
    "histogram",
    "intra_pair_variance",
    "large_margin_softmax",
    "large_margin_softmax_init",
    "lifted_structure",
    "margin",
    "margin_init",
    "multi_similarity",
    "multi_supcon",
    "normalized_softmax",
    "normalized_softmax_init",
    "ntxent",
    "p2s_grad",
    "p2s_grad_init",
    "pnp",
    "proxy_anchor",
    "proxy_anchor_init",
    "proxy_nca",
    "proxy_nca_init",
    "selectively_contrastive_triplet",
    "signal_to_noise_ratio_contrastive",
    "smooth_ap",
    "soft_triple",
    "soft_triple_init",
    "sphereface",
    "sphereface_init",
    "subcenter_arcface",
    "subcenter_arcface_init",
    "supcon",
    "triplet_margin",
    "tuplet_margin",
    "vicreg",
]
