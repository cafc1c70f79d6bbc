"""Embedding losses as pure functions: ``loss(embeddings, labels[, params], *, ...) -> 0-d tensor``.

One module per family; every loss is re-exported here by its PML name in snake_case. Learnable
losses take a ``params`` dict created by their ``<loss>_init``. Batch losses share the keyword
arguments of :class:`BatchInputs` (``distance``, ``reducer``, ``ref_emb``, ``ref_labels``,
``indices_tuple``, ``mat``, ``embedding_regularizer``, ``embedding_reg_weight``).

| module | losses |
|---|---|
| ``pmlfunc.losses.pairs`` | ``contrastive``, ``signal_to_noise_ratio_contrastive``, ``intra_pair_variance``, ``threshold_consistent_margin`` |
| ``pmlfunc.losses.pair_weighting`` | ``multi_similarity``, ``circle``, ``lifted_structure``, ``generalized_lifted_structure``, ``tuplet_margin`` |
| ``pmlfunc.losses.triplets`` | ``triplet_margin``, ``margin``, ``selectively_contrastive_triplet`` |
| ``pmlfunc.losses.softmax`` | ``ntxent``, ``supcon``, ``decoupled_contrastive``, ``multi_supcon`` |
| ``pmlfunc.losses.cross_modal`` | ``clip``, ``siglip`` (two aligned sets; the tiled engine with ``chunk_size``) |
| ``pmlfunc.losses.retrieval`` | ``multiple_negatives_ranking`` (queries, positives, hard negatives; directions, id and guide masks, hardness; the tiled engine) |
| ``pmlfunc.losses.graded`` | ``margin_mse``, ``distill_kl_div``, ``cosent``, ``angle`` (learn from given scores: a teacher's, gold similarities) |
| ``pmlfunc.losses.in_batch`` | ``mega_batch_margin`` (anchor–positive pairs, the hardest in-batch negative) |
| ``pmlfunc.losses.self_supervised`` | ``vicreg``, ``vicregl``, ``barlow_twins``, ``negative_cosine_similarity``, ``sym_neg_cosine_similarity``, ``hypersphere``, ``dino``, ``swav``, ``tico``, ``mmcr``, ``koleo``, ``sigreg``, ``ibot_patch``, ``wmse``, ``msn``, ``pmsn`` |
| ``pmlfunc.losses.neighbors`` | ``nca``, ``npairs``, ``angular``, ``instance``, ``ranked_list``, ``manifold`` |
| ``pmlfunc.losses.ranking`` | ``fast_ap``, ``histogram``, ``smooth_ap``, ``pnp``, ``dynamic_soft_margin`` |
| ``pmlfunc.losses.proxies`` | ``proxy_anchor``, ``proxy_nca``, ``normalized_softmax``, ``soft_triple``, ``p2s_grad`` |
| ``pmlfunc.losses.margin_softmax`` | ``large_margin_softmax``, ``sphereface``, ``cosface``, ``arcface``, ``subcenter_arcface``, ``dynamic_arcface`` |
| ``pmlfunc.losses.centroids`` | ``ge2e`` (learnable scale and bias; centroids from the batch) |

How a batch loss is written (its public function, its terms, its spec ``loss.spec``) is in
``pmlfunc/losses/_batch.py``; the proxy, classifier and centroid losses are written directly.
The softmax and sigmoid contrastive losses (``ntxent``, ``supcon``, ``clip``, ``siglip``) share
one tiled engine for ``chunk_size=`` (``pmlfunc/losses/_tiled.py``).

Example:
    >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> sorted(name for name in pf.losses.__all__ if name.startswith("n"))
    ['nca', 'negative_cosine_similarity', 'normalized_softmax', 'normalized_softmax_init', 'npairs', 'ntxent']
    >>> loss = pf.losses.ntxent(emb, labels, temperature=0.1)
"""

from ._batch import BatchInputs
from ._logits import class_logits
from .centroids import ge2e, ge2e_init
from .cross_modal import clip, clip_init, siglip, siglip_init
from .graded import angle, cosent, distill_kl_div, margin_mse
from .in_batch import mega_batch_margin
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
    subcenter_arcface_outliers,
)
from .neighbors import (
    angular,
    instance,
    manifold,
    manifold_init,
    manifold_meta_classes,
    nca,
    npairs,
    ranked_list,
)
from .pair_weighting import (
    circle,
    generalized_lifted_structure,
    lifted_structure,
    multi_similarity,
    tuplet_margin,
)
from .pairs import (
    contrastive,
    intra_pair_variance,
    signal_to_noise_ratio_contrastive,
    threshold_consistent_margin,
)
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
from .retrieval import multiple_negatives_ranking, multiple_negatives_ranking_init
from .self_supervised import (
    barlow_twins,
    dino,
    dino_init,
    hypersphere,
    ibot_patch,
    ibot_patch_init,
    koleo,
    mmcr,
    msn,
    negative_cosine_similarity,
    pmsn,
    sigreg,
    swav,
    sym_neg_cosine_similarity,
    tico,
    tico_init,
    vicreg,
    vicregl,
    wmse,
)
from .softmax import decoupled_contrastive, multi_supcon, ntxent, supcon
from .triplets import margin, margin_init, selectively_contrastive_triplet, triplet_margin

__all__ = [
    "BatchInputs",
    "angle",
    "angular",
    "arcface",
    "arcface_init",
    "barlow_twins",
    "circle",
    "class_logits",
    "clip",
    "clip_init",
    "contrastive",
    "cosent",
    "cosface",
    "cosface_init",
    "decoupled_contrastive",
    "dino",
    "dino_init",
    "distill_kl_div",
    "dynamic_arcface",
    "dynamic_arcface_init",
    "dynamic_arcface_margins",
    "dynamic_soft_margin",
    "dynamic_soft_margin_init_state",
    "fast_ap",
    "ge2e",
    "ge2e_init",
    "generalized_lifted_structure",
    "histogram",
    "hypersphere",
    "ibot_patch",
    "ibot_patch_init",
    "instance",
    "intra_pair_variance",
    "koleo",
    "large_margin_softmax",
    "large_margin_softmax_init",
    "lifted_structure",
    "manifold",
    "manifold_init",
    "manifold_meta_classes",
    "margin",
    "margin_init",
    "margin_mse",
    "mega_batch_margin",
    "mmcr",
    "msn",
    "multi_similarity",
    "multi_supcon",
    "multiple_negatives_ranking",
    "multiple_negatives_ranking_init",
    "nca",
    "negative_cosine_similarity",
    "normalized_softmax",
    "normalized_softmax_init",
    "npairs",
    "ntxent",
    "p2s_grad",
    "p2s_grad_init",
    "pmsn",
    "pnp",
    "proxy_anchor",
    "proxy_anchor_init",
    "proxy_nca",
    "proxy_nca_init",
    "ranked_list",
    "selectively_contrastive_triplet",
    "siglip",
    "siglip_init",
    "signal_to_noise_ratio_contrastive",
    "sigreg",
    "smooth_ap",
    "soft_triple",
    "soft_triple_init",
    "sphereface",
    "sphereface_init",
    "subcenter_arcface",
    "subcenter_arcface_init",
    "subcenter_arcface_outliers",
    "supcon",
    "swav",
    "sym_neg_cosine_similarity",
    "threshold_consistent_margin",
    "tico",
    "tico_init",
    "triplet_margin",
    "tuplet_margin",
    "vicreg",
    "vicregl",
    "wmse",
]
