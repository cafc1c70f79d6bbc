"""Self-supervised losses of the views of a batch, without labels.

| function | what it is | PML |
|---|---|---|
| :func:`vicreg` | invariance + variance + covariance of two views | ``VICRegLoss`` |
| :func:`vicregl` | VICReg of the pooled views plus VICReg of nearest-neighbour-matched feature-map locations | none (lightly's ``VICRegLLoss``) |
| :func:`barlow_twins` | the two views' cross-correlation pulled to the identity | none (lightly's ``BarlowTwinsLoss``) |
| :func:`negative_cosine_similarity` | ``−mean_i cos(a_i, b_i)`` | none (lightly's ``NegativeCosineSimilarity``) |
| :func:`sym_neg_cosine_similarity` | BYOL/SimSiam's symmetric form, targets detached | none (lightly's ``SymNegCosineSimilarityLoss``) |
| :func:`hypersphere` | alignment + uniformity on the sphere | none (lightly's ``HypersphereLoss``) |
| :func:`dino` | student views against the centred, sharpened teacher views; the centre as state | none (lightly's ``DINOLoss``) |
| :func:`swav` | each crop predicts the Sinkhorn–Knopp codes of the other high-resolution crops | none (lightly's ``SwaVLoss``) |
| :func:`tico` | alignment plus a running covariance penalty; the covariance as state | none (lightly's ``TiCoLoss``) |
| :func:`mmcr` | the nuclear norm of the views' centroids maximised | none (lightly's ``MMCRLoss``) |
| :func:`koleo` | ``−mean log`` of each row's nearest-neighbour distance on the sphere | none (lightly's ``KoLeoLoss``) |
| :func:`sigreg` | LeJEPA's Epps–Pulley test of random projections against ``N(0, 1)`` | none (lightly's ``SIGReg``) |
| :func:`ibot_patch` | iBOT's masked patch tokens against the centred, sharpened teacher's; the centre as state | none (lightly's ``IBOTPatchLoss``) |
| :func:`wmse` | the views whitened in random sub-batches (Cholesky), then their normalised MSE | none (lightly's ``WMSELoss``) |
| :func:`msn` | masked anchor views predict the sharpened, Sinkhorn-balanced prototype assignment of the target view, plus me-max | none (lightly's ``MSNLoss``) |
| :func:`pmsn` | :func:`msn` with a power-law prior's KL divergence instead of me-max | none (lightly's ``PMSNLoss``) |

:func:`barlow_twins` is a function of batch statistics only (means, variances, the ``D × D``
cross-correlation), each sum over rows taken through :func:`pmlfunc._global.total`: under
:func:`pmlfunc.distributed.global_objective` those sums are all-reduced, so every rank computes
the global batch's statistics from its own rows, with no gather.

The contrastive self-supervised objectives (NT-Xent/SimCLR, DCL) are softmax losses
(:mod:`pmlfunc.losses.softmax`): with ``labels`` the sample index, both views of a sample are a
positive pair.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, _global, _random
from .._global import total
from .._ops import apply, einsum, matmul, scalar_like
from ..reducers import AlreadyReduced, Reducer, elements, mean, none, reduce

__all__ = [
    "barlow_twins",
    "dino",
    "dino_init",
    "hypersphere",
    "ibot_patch",
    "ibot_patch_init",
    "koleo",
    "mmcr",
    "msn",
    "negative_cosine_similarity",
    "pmsn",
    "sigreg",
    "swav",
    "sym_neg_cosine_similarity",
    "tico",
    "tico_init",
    "vicreg",
    "vicregl",
    "wmse",
]


@_global.reduces_statistics("embeddings", "ref_emb")
def vicreg(
    embeddings: Tensor,
    ref_emb: Tensor,
    *,
    invariance_lambda: float | Tensor = 25.0,
    variance_mu: float | Tensor = 25.0,
    covariance_v: float | Tensor = 1.0,
    eps: float | Tensor = 1e-4,
    reducer: Reducer | None = None,
) -> Tensor:
    r"""VICReg: variance-invariance-covariance regularisation of two views of a batch.

    For two views ``Z = embeddings`` and ``Z' = ref_emb`` (``B × D``, row ``i`` of each is the
    same sample), with ``Var`` the unbiased variance over the batch and ``C(Z)`` the unbiased
    ``D × D`` covariance matrix:

    .. math::
        L = \lambda\, R\Big(\big\{\tfrac{1}{D}\lVert z_i - z'_i\rVert^2\big\}_i\Big)
          + \mu\, R\Big(\big\{\tfrac12 [1 - \sqrt{\mathrm{Var}(Z_{:,d}) + ε}]_+\big\}_d\Big)
          + \mu\, R\Big(\big\{\tfrac12 [1 - \sqrt{\mathrm{Var}(Z'_{:,d}) + ε}]_+\big\}_d\Big)
          + \nu\, \frac{1}{D}\sum_{d \ne e} \big(C(Z)_{de}^2 + C(Z')_{de}^2\big)

    ``R`` is the reducer, applied to each of the first three sub-losses (``invariance_loss``,
    ``variance_loss1``, ``variance_loss2``); the covariance term is already reduced and is added
    as it is, whatever the reducer (as in PML). There are no labels, pairs or distance: PML's
    ``VICRegLoss`` rejects them too. The covariance term costs one ``D × D`` matrix per view.

    Under :func:`pmlfunc.distributed.global_objective` every statistic is the global batch's,
    all-reduced (the invariance term's reducer share and normaliser, each view's mean, variance
    and covariance: ``O(D²)`` numbers, no gather); ``reducer=none()`` is refused there.

    Args:
        embeddings: ``(B, D)`` float tensor, the first view (``B ≥ 2``: the variance is unbiased).
        ref_emb: ``(B, D)`` float tensor, the second view, row-aligned with ``embeddings``
            (PML: ``loss_fn(embeddings, ref_emb=ref_emb)``).
        invariance_lambda: weight λ of the invariance term (default ``25``).
        variance_mu: weight μ of the variance terms (default ``25``).
        covariance_v: weight ν of the covariance term (default ``1``).
        eps: ``ε`` added to the variance under the square root (default ``1e-4``).
        reducer: default ``mean()``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> z1, z2 = torch.randn(8, 4), torch.randn(8, 4)
        >>> loss = pf.losses.vicreg(z1, z2, invariance_lambda=25.0)

    Reference: Bardes, Ponce, LeCun, "VICReg: Variance-Invariance-Covariance Regularization for
    Self-Supervised Learning", ICLR 2022.
    """
    if ref_emb is None:
        raise ValueError("vicreg needs ref_emb: the second view of the batch, row-aligned")
    if _global.active():  # a rank may hold fewer than 2 rows (the variance is the global one)
        _two_views(embeddings, ref_emb, "vicreg", ("embeddings", "ref_emb"))
    else:
        _checks.embeddings(embeddings)
        _checks.embeddings(ref_emb, "ref_emb")
        _checks.same_space(embeddings, ref_emb)
        if ref_emb.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"ref_emb must have as many rows as embeddings (two views of one batch), got "
                f"{ref_emb.shape[0]} and {embeddings.shape[0]}"
            )
        if embeddings.shape[0] < 2:
            raise ValueError("vicreg needs a batch of at least 2 rows (the variance is unbiased)")
    lam = _checks.hyper(invariance_lambda, "invariance_lambda")
    mu = _checks.hyper(variance_mu, "variance_mu")
    nu = _checks.hyper(covariance_v, "covariance_v")
    eps = _checks.hyper(eps, "eps", nonnegative=True)
    reducer = mean() if reducer is None else reducer
    cd = _checks.compute_dtype(embeddings.dtype)
    x, y = embeddings.to(cd), ref_emb.to(cd)
    lam, mu, nu, eps = (scalar_like(v, x) for v in (lam, mu, nu, eps))
    diff = x - y
    invariance = elements(lam * (diff * diff).mean(-1))
    n = total(torch.full((), x.shape[0], dtype=cd, device=x.device))
    (x_var, x_off), (y_var, y_off) = (_covariance(z, n) for z in (x, y))
    covariance = nu * (x_off + y_off) / x.shape[1]
    terms = {
        "variance_loss1": elements(mu * _variance_hinge(x_var, eps)),
        "variance_loss2": elements(mu * _variance_hinge(y_var, eps)),
        "covariance_loss": AlreadyReduced(covariance),  # added as it is, whatever the reducer
    }
    if not _global.active():  # one reduce (none() lists the unreduced terms)
        return reduce(reducer, {"invariance_loss": invariance, **terms}, None, cd)
    if not isinstance(reducer, Reducer) or isinstance(reducer, type(none())):
        raise ValueError("vicreg under global_objective needs a reducer of a value (not none())")
    # the invariance terms are per row: the reducer's normaliser and share summed over the ranks;
    # the other sub-losses are functions of the (global) statistics, the same on every rank
    return (_global.reduced(reducer, invariance) + reduce(reducer, terms, None, cd)).to(cd)


def _variance_hinge(var: Tensor, eps: float | Tensor) -> Tensor:
    """Per column ``[1 − √(Var + ε)]₊ / 2``."""
    return F.relu(1.0 - torch.sqrt(var + eps)) / 2


def _covariance(x: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """The unbiased variance of each column of ``x`` over the batch and ``Σ_{d≠e} C_de²`` of its
    unbiased covariance ``C`` (each sum over rows a :func:`pmlfunc._global.total`); ``x`` is
    ``(N, D)`` or ``(N, ..., D)``, one ``C`` per index of ``...`` (variances ``(..., D)``, sums
    ``(...)``).

    The diagonal is subtracted before squaring (not ``‖C‖² − Σ C_dd²``, which cancels when the
    features are nearly decorrelated: the regime VICReg drives them to).
    """
    xc = x - total(x.sum(0)) / n
    cov = total(matmul(xc.movedim(0, -1), xc.movedim(0, -2))) / (n - 1)
    var = cov.diagonal(dim1=-2, dim2=-1)
    off = cov - torch.diag_embed(var)
    return var, (off * off).sum((-2, -1))


def vicregl(
    global_view_features: tuple[Tensor, Tensor],
    global_view_grids: Tensor,
    local_view_features: tuple[Tensor, Tensor] | None = None,
    local_view_grids: Tensor | None = None,
    *,
    lambda_param: float | Tensor = 25.0,
    mu_param: float | Tensor = 25.0,
    nu_param: float | Tensor = 1.0,
    alpha: float | Tensor = 0.75,
    eps: float | Tensor = 1e-4,
    num_matches: tuple[int, int] = (20, 4),
) -> Tensor:
    r"""VICRegL: VICReg of the pooled embeddings plus VICReg of matched feature-map locations.

    Each view ``v`` of sample ``n`` has a pooled embedding ``y_{nv}`` (``D``), a feature map
    ``z_{nv}`` (``S_v = H_v × W_v`` locations of ``E`` features) and the image coordinates
    ``g_{nv}`` of those locations. With ``G`` global and ``L`` local views (``V = G + L``) and
    ``P`` the ``G (V − 1)`` ordered pairs ``(a, b)`` with ``a`` a global view and ``b ≠ a``,
    the loss is ``α L_g + (1 − α) L_l`` where

    .. math::
        L_g = \frac{λ}{|P|} \sum_{(a,b) \in P} \mathrm{MSE}(y_a, y_b)
            + \frac{μ}{V} \sum_v \mathrm{mean}_d \big[1 - \sqrt{\mathrm{Var}(y_{v,:,d}) + ε}\big]_+
            + \frac{ν}{V D} \sum_v \sum_{d \ne e} C(y_v)_{de}^2

    .. math::
        L_l = \frac{1}{|P|} \sum_{(a,b) \in P} \frac12 \big(R_f(a, b) + R_f(b, a)
            + R_g(a, b) + R_g(b, a)\big)

    ``R_f(a, b)`` matches, per sample, each location of ``z_a`` with its nearest location of
    ``z_b`` (L2 distance of the features; ``R_g``: of the grid coordinates) and keeps the ``k``
    pairs with the smallest distances (``k = min(num_matches[0], S_a)``; ``num_matches[1]``
    for ``R_·(b, a)``), giving two ``(N, k, E)`` tensors, then takes VICReg of them with the
    variances and covariances over the batch for each of the ``k`` match ranks:
    ``λ·MSE + μ·½(var + var') + ½ν·(cov + cov')`` (``½ν``: the VICRegL authors' covariance,
    half VICReg's). This is lightly 1.6.0's ``VICRegLLoss`` and the authors' code: 20 matches
    in the first search, 4 in the second, whatever the view type. The matching is ``topk`` on
    the distances (fixed shapes, no host sync) and is not differentiated; a non-finite distance
    is matched first, so a NaN or inf in a feature map makes the loss non-finite (lightly
    would skip it).

    The variance and covariance terms are those of :func:`vicreg` (``_variance_hinge``,
    ``_covariance``). The loss is of the batch it is given: per rank under DDP, as lightly's
    ``gather_distributed=False``; :func:`pmlfunc.distributed.global_objective` does not take it.

    Args:
        global_view_features: ``(pooled, maps)``: ``(N, G, D)`` pooled embeddings and
            ``(N, G, H, W, E)`` feature maps of the ``G ≥ 1`` global views (lightly's list of
            ``(global_features, local_features)`` tuples, stacked along dimension 1), ``N ≥ 2``.
        global_view_grids: ``(N, G, H, W, 2)`` float tensor, the coordinates of the global maps'
            locations.
        local_view_features: ``None`` or ``(pooled, maps)``: ``(N, L, D)`` and
            ``(N, L, h, w, E)`` of the local views (``h × w`` may differ from ``H × W``).
        local_view_grids: ``(N, L, h, w, 2)``, given exactly when ``local_view_features`` is.
        lambda_param: weight λ of the invariance terms (default ``25``).
        mu_param: weight μ of the variance terms (default ``25``).
        nu_param: weight ν of the covariance terms (default ``1``).
        alpha: weight α of the global loss, ``1 − α`` the local loss's (default ``0.75``).
        eps: ``ε ≥ 0`` added to the variances under the square root (default ``1e-4``).
        num_matches: ``(k_0, k_1)`` ints ``≥ 1``, the matches kept in the two searches (default
            ``(20, 4)``; a count above a map's size keeps all its locations).

    Returns:
        0-d tensor: float32 for float16/bfloat16 inputs, else their dtype.

    Example:
        >>> pooled, maps = torch.randn(8, 2, 16), torch.randn(8, 2, 7, 7, 4)
        >>> grids = torch.rand(8, 2, 7, 7, 2)
        >>> loss = pf.losses.vicregl((pooled, maps), grids)

    Reference: Bardes, Ponce, LeCun, "VICRegL: Self-Supervised Learning of Local Visual
    Features", NeurIPS 2022.
    """
    g_emb, g_maps, g_grid = _vicregl_views(global_view_features, global_view_grids, "global_view")
    if (local_view_features is None) != (local_view_grids is None):
        raise ValueError(
            "vicregl: local_view_features and local_view_grids must both be given or both be None"
        )
    if g_emb.shape[0] < 2:
        raise ValueError(
            "vicregl needs a batch of at least 2 rows in global_view_features (the variance is "
            "unbiased)"
        )
    lam = _checks.hyper(lambda_param, "lambda_param")
    mu = _checks.hyper(mu_param, "mu_param")
    nu = _checks.hyper(nu_param, "nu_param")
    al = _checks.hyper(alpha, "alpha")
    eps = _checks.hyper(eps, "eps", nonnegative=True)
    if not isinstance(num_matches, (tuple, list)) or len(num_matches) != 2:
        raise TypeError(f"num_matches must be a pair of ints >= 1, got {num_matches!r}")
    k0, k1 = (_checks.integer(k, "num_matches") for k in num_matches)
    cd = _checks.compute_dtype(g_emb.dtype)
    locals_: tuple[Tensor, Tensor, Tensor] | None = None
    if local_view_features is not None:
        locals_ = _vicregl_views(local_view_features, local_view_grids, "local_view")
        l_emb, l_maps, _ = locals_
        for got, want, what in ((l_emb, g_emb, "pooled"), (l_maps, g_maps, "maps")):
            if got.shape[0] != want.shape[0] or got.shape[-1] != want.shape[-1]:
                raise ValueError(
                    f"local_view_features' {what} must have the global views' batch size "
                    f"{want.shape[0]} and width {want.shape[-1]}, got shape {tuple(got.shape)}"
                )
            if got.dtype != want.dtype or got.device != want.device:
                raise TypeError(
                    f"local_view_features' {what} must have the global views' dtype and "
                    f"device ({want.dtype}, {want.device}), got ({got.dtype}, {got.device})"
                )
    n_global = g_emb.shape[1]
    n_views = n_global + (0 if locals_ is None else locals_[0].shape[1])
    if n_views < 2:
        raise ValueError(
            "vicregl needs at least 2 views: give global_view_features 2 global views or add "
            "local views"
        )
    x = g_emb.to(cd)
    lam, mu, nu, al, eps = (scalar_like(v, x) for v in (lam, mu, nu, al, eps))
    emb = x if locals_ is None else torch.cat([x, locals_[0].to(cd)], 1)  # (N, V, D)
    n = torch.full((), x.shape[0], dtype=cd, device=x.device)
    pairs = n_global * (n_views - 1)
    diff = emb[:, :n_global, None] - emb[:, None]  # (N, G, V, D); a == b gives 0
    invariance = (diff * diff).mean((0, 3)).sum() / pairs
    var, off = _covariance(emb, n)  # (V, D), (V,)
    variance = (2 * _variance_hinge(var, eps)).mean()  # lightly's mean_d [1 − √(Var + ε)]₊
    covariance = (off / emb.shape[-1]).mean()
    global_loss = lam * invariance + mu * variance + nu * covariance

    hp = (lam, mu, nu, eps, n, k0, k1)
    maps = g_maps.to(cd).flatten(2, 3)  # (N, G, S, E)
    grid = g_grid.to(cd).flatten(2, 3)
    local_loss = x.new_zeros(())
    if n_global > 1:
        a_idx = [a for a in range(n_global) for b in range(n_global) if a != b]
        b_idx = [b for a in range(n_global) for b in range(n_global) if a != b]
        ia, ib = (torch.tensor(i, device=x.device) for i in (a_idx, b_idx))
        local_loss = (
            local_loss
            + _vicregl_local(
                maps.index_select(1, ia),
                maps.index_select(1, ib),
                grid.index_select(1, ia),
                grid.index_select(1, ib),
                hp,
            ).sum()
        )
    if locals_ is not None:
        l_maps = locals_[1].to(cd).flatten(2, 3)  # (N, L, s, E)
        l_grid = locals_[2].to(cd).flatten(2, 3)
        n_local = l_maps.shape[1]
        ia = torch.arange(n_global, device=x.device).repeat_interleave(n_local)
        ib = torch.arange(n_local, device=x.device).repeat(n_global)
        local_loss = (
            local_loss
            + _vicregl_local(
                maps.index_select(1, ia),
                l_maps.index_select(1, ib),
                grid.index_select(1, ia),
                l_grid.index_select(1, ib),
                hp,
            ).sum()
        )
    return al * global_loss + (1 - al) * local_loss / pairs


def _vicregl_views(features: object, grids: object, what: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(pooled (N, V, D), maps (N, V, H, W, E))`` and ``grids (N, V, H, W, 2)``, checked."""
    name = f"{what}_features"
    if not isinstance(features, (tuple, list)) or len(features) != 2:
        raise TypeError(
            f"{name} must be a pair (pooled (N, V, D), maps (N, V, H, W, E)), got "
            f"{type(features).__name__}"
        )
    pooled = _checks.tensor(features[0], f"{name}[0]")
    maps = _checks.tensor(features[1], f"{name}[1]")
    grid = _checks.tensor(grids, f"{what}_grids")
    for t, nm, nd, shape in (
        (pooled, f"{name}[0]", 3, "(N, V, D)"),
        (maps, f"{name}[1]", 5, "(N, V, H, W, E)"),
        (grid, f"{what}_grids", 5, "(N, V, H, W, 2)"),
    ):
        if not t.is_floating_point():
            raise TypeError(f"{nm} must be a floating-point tensor, got {t.dtype}")
        if t.ndim != nd or 0 in t.shape:
            raise ValueError(f"{nm} must be a non-empty {shape} tensor, got {tuple(t.shape)}")
    if maps.dtype != pooled.dtype or maps.device != pooled.device:
        raise TypeError(
            f"{name}[1] must have {name}[0]'s dtype and device ({pooled.dtype}, "
            f"{pooled.device}), got ({maps.dtype}, {maps.device})"
        )
    if maps.shape[:2] != pooled.shape[:2]:
        raise ValueError(
            f"{name}[1] must have {name}[0]'s batch size and views {tuple(pooled.shape[:2])}, "
            f"got {tuple(maps.shape)}"
        )
    if grid.shape[:4] != maps.shape[:4] or grid.shape[-1] != 2 or grid.device != maps.device:
        raise ValueError(
            f"{what}_grids must be (N, V, H, W, 2) = {(*maps.shape[:4], 2)} on {maps.device} "
            f"(one coordinate pair per location of {name}[1]), got {tuple(grid.shape)} on "
            f"{grid.device}"
        )
    return pooled, maps, grid


def _vicregl_local(za: Tensor, zb: Tensor, ga: Tensor, gb: Tensor, hp: tuple) -> Tensor:
    """Per view pair ``(P,)``: the VICReg losses of the locations matched in feature space and
    by grid location, each ``½`` (``a ⇝ b`` with ``k_0`` matches ``+ b ⇝ a`` with ``k_1``);
    ``za`` ``(N, P, S_a, E)``, ``zb`` ``(N, P, S_b, E)``, the grids ``(N, P, S, 2)``."""
    lam, mu, nu, eps, n, k0, k1 = hp

    def matched(x: Tensor, y: Tensor, dist: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with torch.no_grad():  # lightly's nearest_neighbors; a non-finite distance first
            key = torch.where(torch.isfinite(dist), dist, -torch.inf)
            best, col = key.topk(1, dim=-1, largest=False)  # (N, P, S_x, 1)
            _, rows = best.squeeze(-1).topk(min(k, x.shape[2]), dim=-1, largest=False)
            cols = col.squeeze(-1).gather(-1, rows)
        width = x.shape[-1]
        take = (rows.unsqueeze(-1).expand(*rows.shape, width), cols.unsqueeze(-1))
        return x.gather(2, take[0]), y.gather(2, take[1].expand(*cols.shape, width))

    def vicreg_(x: Tensor, y: Tensor) -> Tensor:
        d = x - y
        inv = (d * d).mean((0, 2, 3))
        (x_var, x_off), (y_var, y_off) = (_covariance(z, n) for z in (x, y))
        var = _variance_hinge(x_var, eps).mean((-2, -1)) + _variance_hinge(y_var, eps).mean(
            (-2, -1)
        )
        cov = ((x_off + y_off) / x.shape[-1]).mean(-1)
        return lam * inv + mu * var + 0.5 * nu * cov

    def both(da: Tensor, db: Tensor) -> Tensor:
        return 0.5 * (vicreg_(*matched(za, zb, da, k0)) + vicreg_(*matched(zb, za, db, k1)))

    with torch.no_grad():
        dists = [torch.cdist(p, q) for p, q in ((za, zb), (zb, za), (ga, gb), (gb, ga))]
    return both(dists[0], dists[1]) + both(dists[2], dists[3])


@_global.reduces_statistics("emb_a", "emb_b")
def barlow_twins(
    emb_a: Tensor,
    emb_b: Tensor,
    *,
    lambda_param: float | Tensor = 5e-3,
    unbiased: bool = True,
    eps: float | Tensor = 0.0,
) -> Tensor:
    r"""Barlow Twins: the cross-correlation of two views' standardised embeddings pulled to the
    identity.

    Each view ``Z`` (``N × D``, row ``n`` of each is the same sample) is standardised along the
    batch, ``Ẑ = (Z − μ) / \sqrt{σ² + ε}`` with ``μ``, ``σ²`` its per-dimension mean and
    variance over the ``N`` rows; then

    .. math::
        C = \tfrac{1}{N} Ẑ_aᵀ Ẑ_b, \qquad
        L = \sum_i (1 - C_{ii})^2 + λ \sum_{i \ne j} C_{ij}^2 .

    The defaults are the paper's Algorithm 1: the unbiased variance (``torch.std``), no ``ε``,
    ``λ = 5·10⁻³``. The authors' training code and lightly 1.6.0's ``BarlowTwinsLoss``
    normalise with a batch norm without affine parameters instead: ``unbiased=False,
    eps=1e-5`` gives theirs. Under
    :func:`pmlfunc.distributed.global_objective` ``μ``, ``σ²`` and ``C`` are the global batch's
    (two all-reduces of ``D`` and ``D × D`` sums; per-rank memory does not grow with the world
    size), where lightly's ``gather_distributed=True`` averages the ranks' ``C``, each
    standardised with its own rank's statistics.

    Args:
        emb_a: ``(N, D)`` float tensor, the first view (``N ≥ 2``).
        emb_b: ``(N, D)`` float tensor, the second view, row-aligned with ``emb_a``.
        lambda_param: ``λ ≥ 0``, the weight of the off-diagonal (redundancy) term.
        unbiased: divide the variance by ``N − 1`` (default) or ``N``.
        eps: ``ε ≥ 0`` added to the variance (default 0: a constant dimension gives NaN).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings (the statistics in float32), else
        their dtype.

    Example:
        >>> z1, z2 = torch.randn(16, 8), torch.randn(16, 8)
        >>> loss = pf.losses.barlow_twins(z1, z2)

    Reference: Zbontar, Jing, Misra, LeCun, Deny, "Barlow Twins: Self-Supervised Learning via
    Redundancy Reduction", ICML 2021.
    """
    a, b = _two_views(emb_a, emb_b, "barlow_twins")
    if a.shape[0] < 2 and not _global.active():  # (a rank of a global objective may hold one)
        raise ValueError(
            "barlow_twins needs a batch of at least 2 rows in emb_a (one row's variance is 0 "
            f"or undefined), got {a.shape[0]}"
        )
    lam = _checks.hyper(lambda_param, "lambda_param", nonnegative=True)
    eps = _checks.hyper(eps, "eps", nonnegative=True)
    cd = _checks.compute_dtype(a.dtype)
    a, b = a.to(cd), b.to(cd)
    ddof = 1 if unbiased else 0
    if not (_global.active() or isinstance(lam, Tensor) or isinstance(eps, Tensor)):
        return apply(_BarlowTwins, a, b, lam, ddof, eps)[0]  # one process, float hyper-parameters
    n = total(torch.full((), a.shape[0], dtype=cd, device=a.device))
    za, zb = (_standardised(z, n, ddof, eps) for z in (a, b))
    c = total(matmul(za.transpose(0, 1), zb)) / n
    d = c.shape[0]
    off = c.flatten()[1:].view(d - 1, d + 1)[:, :-1]  # the off-diagonal entries, a view
    return (1 - c.diagonal()).pow(2).sum() + scalar_like(lam, c) * off.pow(2).sum()


def _barlow_parts(a: Tensor, b: Tensor, ddof: int, eps: float):
    """``(X_a, X_b, r_a, r_b, C)`` of one process's views: ``X = Z − μ``, ``r = (σ² + ε)^{-1/2}``
    per dimension (the variance over ``N − ddof``), ``C = Ẑ_aᵀ Ẑ_b / N`` with ``Ẑ = X r``,
    taken as ``(X_aᵀ X_b) ⊙ r_a r_bᵀ / N`` (the scale on the ``D × D`` product, not on the
    ``N × D`` rows). Plain sums along the batch: ``var_mean`` and ``vector_norm`` along dim 0
    are ~25× and ~6× slower on a CPU."""
    n = a.shape[0]
    parts = []
    for z in (a, b):
        x = z - z.sum(0) / n
        parts.append((x, torch.rsqrt((x * x).sum(0) / (n - ddof) + eps)))
    (xa, ra), (xb, rb) = parts
    c = matmul(xa.transpose(0, 1), xb).mul_(torch.outer(ra, rb).div_(n))
    return xa, xb, ra, rb, c


class _BarlowTwins(torch.autograd.Function):
    r"""Barlow Twins of one process's views with its backward written out. With ``G = ∂L/∂C``
    (``2λ C`` off the diagonal, ``−2 (1 − C_ii)`` on it) and ``W = diag(r_a) G diag(r_b) / N``,
    ``∂L/∂Z_a = X_b Wᵀ − X_a ⊙ r_a² · (N / (N − ddof)) · Σ_e (G ⊙ C)_{de} / N`` and ``∂L/∂Z_b``
    the same with the roles swapped (``X_a W``, the sums over ``G ⊙ C``'s rows).

    The standardisation's backward, ``r ⊙ (∂Ẑ − mean(∂Ẑ) − Ẑ ⊙ Σ_n (∂Ẑ ⊙ Ẑ) / (N − ddof))``,
    reads no ``N × D`` sum here: ``mean(∂Ẑ_a) = mean(Ẑ_b) Gᵀ / N`` is 0 (``Ẑ_b`` is centred)
    and ``Σ_n ∂Ẑ_a ⊙ Ẑ_a = Σ_e (G ⊙ C)_{·e}``. Both are identities in ``Z``, so the form is the
    gradient everywhere, and differentiating it again gives the second derivatives (a
    recorded backward, ``create_graph=True``, recomputes the parts from the views in
    differentiable ops). One process and float hyper-parameters only: the global objective
    all-reduces ``μ``, ``σ²`` and ``C`` through autograd. Autograd's composed graph of this
    loss dispatched 106 ops at 512 × 128, forward and backward; this, 60, most of them on
    ``D``-sized vectors, with two ``N × D`` passes in the backward (lightly's ``F.batch_norm``
    form was 1.2× faster than the composed one; this is faster than lightly's)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor, lam: float, ddof: int, eps: float):
        xa, xb, ra, rb, c = _barlow_parts(a, b, ddof, eps)
        diag = c.diagonal()
        loss = (1 - diag).square().sum() + lam * ((c * c).sum() - diag.square().sum())
        return loss, xa, xb, ra, rb, c

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, lam, ddof, eps = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zeros for the parts' cotangents
        ctx.save_for_backward(a, b, *output[1:])
        ctx.lam, ctx.ddof, ctx.eps = lam, ddof, eps

    @staticmethod
    def backward(ctx, g, *_):
        if g is None:  # only the parts' cotangents
            return None, None, None, None, None
        a, b, *parts = ctx.saved_tensors
        if torch.is_grad_enabled():  # recorded: the parts as functions of the views
            parts = _barlow_parts(a, b, ctx.ddof, ctx.eps)
        xa, xb, ra, rb, c = parts
        n = a.shape[0]
        gc = c * (2 * ctx.lam / n * g)  # G / N
        gc.diagonal().copy_((c.diagonal() - 1) * (2 / n * g))
        gcc = (gc * c).mul_(n / (n - ctx.ddof))
        ka, kb = (gcc.sum(1) * ra * ra).neg_(), (gcc.sum(0) * rb * rb).neg_()
        del gcc  # (D × D buffers: G, then W in its place)
        w = (
            gc.mul_(torch.outer(ra, rb))
            if not torch.is_grad_enabled()
            else gc * torch.outer(ra, rb)
        )
        # (the correction added into the product's buffer: one N × D tensor a gradient)
        ga = matmul(xb, w.transpose(0, 1)).addcmul_(xa, ka)
        gb = matmul(xa, w).addcmul_(xb, kb)
        return ga, gb, None, None, None


def _two_views(
    emb_a: object, emb_b: object, what: str, names: tuple[str, str] = ("emb_a", "emb_b")
) -> tuple[Tensor, Tensor]:
    """Two row-aligned views (:func:`pmlfunc._checks.paired_rows`); under a statistics
    objective (:func:`pmlfunc._global.active`) a rank may hold no rows."""
    if _global.active() and isinstance(emb_a, Tensor) and emb_a.ndim == 2 and not len(emb_a):
        if not isinstance(emb_b, Tensor) or emb_b.shape != emb_a.shape:
            raise ValueError(
                f"{what}: {names[1]} must have {names[0]}'s shape {tuple(emb_a.shape)}"
            )
        _checks.same_space(emb_a, emb_b, names[1], names[0])
        return emb_a, emb_b
    return _checks.paired_rows(emb_a, emb_b, names, what)


def _standardised(z: Tensor, n: Tensor, ddof: int, eps: float | Tensor) -> Tensor:
    """``(z − μ) / sqrt(σ² + ε)`` with the batch's (:func:`pmlfunc._global.total`) mean and
    variance (divided by ``n − ddof``), per dimension."""
    centred = z - total(z.sum(0)) / n
    var = total((centred * centred).sum(0)) / (n - ddof)
    return centred * torch.rsqrt(var + scalar_like(eps, z))


@_global.reduces_statistics("emb_a", "emb_b")
def negative_cosine_similarity(
    emb_a: Tensor, emb_b: Tensor, *, eps: float | Tensor = 1e-8
) -> Tensor:
    r"""The negative cosine similarity of row-aligned pairs, averaged over the rows:
    ``L = −(1/N) Σ_i cos(a_i, b_i)``, with ``cos(u, v) = u·v / (max(‖u‖, ε) max(‖v‖, ε))``
    (``F.cosine_similarity``).

    lightly's ``NegativeCosineSimilarity`` (``dim=1``): the predictor loss of SimSiam and BYOL,
    where ``emb_b`` is the target branch, which the caller detaches (as with lightly); the
    symmetric form with the targets detached is :func:`sym_neg_cosine_similarity`. Under
    :func:`pmlfunc.distributed.global_objective` the mean is over the global batch (the sum
    and the count all-reduced; no gather).

    Args:
        emb_a: ``(N, D)`` float tensor (predictions).
        emb_b: ``(N, D)`` float tensor, row-aligned (targets).
        eps: ``ε > 0`` (default ``1e-8``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> p, z = torch.randn(8, 16), torch.randn(8, 16)
        >>> loss = pf.losses.negative_cosine_similarity(p, z.detach())

    References: Chen, He, "Exploring Simple Siamese Representation Learning" (SimSiam), CVPR
    2021; Grill et al., "Bootstrap Your Own Latent" (BYOL), NeurIPS 2020.
    """
    a, b = _two_views(emb_a, emb_b, "negative_cosine_similarity")
    return -_mean_cosine(a, b, _checks.hyper(eps, "eps", positive=True))


@_global.reduces_statistics("z0", "p0", "z1", "p1")
def sym_neg_cosine_similarity(
    z0: Tensor, p0: Tensor, z1: Tensor, p1: Tensor, *, eps: float | Tensor = 1e-8
) -> Tensor:
    r"""SimSiam's and BYOL's symmetric loss: each view's prediction against the other view's
    projection, the projections detached (stop-gradient):

    .. math::
        L = -\tfrac12 \Big(\tfrac1N \sum_i \cos(p0_i, \operatorname{sg}(z1_i))
            + \tfrac1N \sum_i \cos(p1_i, \operatorname{sg}(z0_i))\Big)

    lightly's ``SymNegCosineSimilarityLoss`` with ``out0 = (z0, p0)``, ``out1 = (z1, p1)``. No
    gradient reaches ``z0`` or ``z1`` through this loss (they reach the encoder through
    ``p0``/``p1``'s branch). Under :func:`pmlfunc.distributed.global_objective` the means are
    over the global batch (no gather).

    Args:
        z0, p0: ``(N, D)``: the first view's projection and prediction.
        z1, p1: ``(N, D)``: the second view's, row-aligned with the first.
        eps: ``ε > 0`` of the cosine (default ``1e-8``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> z0, p0, z1, p1 = (torch.randn(8, 16) for _ in range(4))
        >>> loss = pf.losses.sym_neg_cosine_similarity(z0, p0, z1, p1)

    Reference: Chen, He, "Exploring Simple Siamese Representation Learning" (SimSiam), CVPR 2021.
    """
    z0, p0 = _two_views(z0, p0, "sym_neg_cosine_similarity", ("z0", "p0"))
    z1, p1 = _two_views(z1, p1, "sym_neg_cosine_similarity", ("z1", "p1"))
    _two_views(z0, z1, "sym_neg_cosine_similarity", ("z0", "z1"))
    e = _checks.hyper(eps, "eps", positive=True)
    return -(_mean_cosine(p0, z1.detach(), e) + _mean_cosine(p1, z0.detach(), e)) / 2


def _mean_cosine(a: Tensor, b: Tensor, eps: float | Tensor) -> Tensor:
    """``(1/N) Σ_i cos(a_i, b_i)`` over the batch (:func:`pmlfunc._global.total`), in the
    compute dtype."""
    cd = _checks.compute_dtype(a.dtype)
    a, b = a.to(cd), b.to(cd)
    e = scalar_like(eps, a)
    na = torch.linalg.vector_norm(a, dim=-1).clamp_min(e)
    nb = torch.linalg.vector_norm(b, dim=-1).clamp_min(e)
    cos = (a * b).sum(-1) / (na * nb)
    n = total(torch.full((), a.shape[0], dtype=cd, device=a.device))
    return total(cos.sum()) / n


def hypersphere(
    emb_a: Tensor,
    emb_b: Tensor,
    *,
    t: float | Tensor = 1.0,
    lam: float | Tensor = 1.0,
    alpha: float | Tensor = 2.0,
) -> Tensor:
    r"""Alignment and uniformity on the hypersphere (Wang & Isola), on L2-normalised rows:

    .. math::
        \mathcal L_{align} = \tfrac1N \sum_i \lVert \hat a_i - \hat b_i \rVert^{α},
        \qquad
        \mathcal L_{unif}(X) = \log \frac{2}{N(N-1)} \sum_{i<j} e^{-t \lVert \hat x_i - \hat x_j \rVert^2},

    ``L = L_align + λ (L_unif(A) + L_unif(B)) / 2``: lightly's ``HypersphereLoss`` (the
    uniformity's log-mean-exp taken stably, as a log-sum-exp). The uniformity term reads every
    pair of the batch: under :func:`pmlfunc.distributed.global_objective` the two views are
    gathered (every rank computes the whole loss of the global batch).

    Args:
        emb_a: ``(N, D)`` float tensor, ``N ≥ 2``.
        emb_b: ``(N, D)`` float tensor, row-aligned (the positive of row ``i`` is row ``i``).
        t: ``t > 0``, the uniformity's temperature (default 1).
        lam: ``λ ≥ 0``, the uniformity's weight (default 1).
        alpha: ``α > 0``, the alignment's power (default 2).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, b = torch.randn(8, 16), torch.randn(8, 16)
        >>> loss = pf.losses.hypersphere(a, b)

    Reference: Wang, Isola, "Understanding Contrastive Representation Learning through Alignment
    and Uniformity on the Hypersphere", ICML 2020.
    """
    a, b = _checks.paired_rows(emb_a, emb_b, ("emb_a", "emb_b"), "hypersphere")
    if a.shape[0] < 2:
        raise ValueError(
            "hypersphere needs a batch of at least 2 rows (its uniformity reads pairs)"
        )
    t_ = _checks.hyper(t, "t", positive=True)
    lam_ = _checks.hyper(lam, "lam", nonnegative=True)
    alpha_ = _checks.hyper(alpha, "alpha", positive=True)
    cd = _checks.compute_dtype(a.dtype)
    x, y = F.normalize(a.to(cd), dim=-1), F.normalize(b.to(cd), dim=-1)
    diff = x - y
    align = torch.linalg.vector_norm(diff, dim=-1).pow(scalar_like(alpha_, x)).mean()
    unif = (_uniformity(x, scalar_like(t_, x)) + _uniformity(y, scalar_like(t_, x))) / 2
    return align + scalar_like(lam_, x) * unif


def _uniformity(x: Tensor, t: float | Tensor) -> Tensor:
    """``log mean_{i<j} exp(−t ‖x_i − x_j‖²)`` of unit rows (``‖x_i − x_j‖² = 2 − 2 x_i·x_j``)."""
    n = x.shape[0]
    sq = (2 - 2 * matmul(x, x.transpose(0, 1))).clamp_min(0)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
    logits = torch.where(upper, -t * sq, -torch.inf)
    return torch.logsumexp(logits.flatten(), 0) - math.log(n * (n - 1) / 2)


def dino_init(
    output_dim: int, *, dtype: torch.dtype = torch.float32, device=None
) -> dict[str, Tensor]:
    """The state of :func:`dino`: ``{"center": (output_dim,) zeros}`` (DINO's initial centre).

    Example:
        >>> pf.losses.dino_init(4)["center"]
        tensor([0., 0., 0., 0.])
    """
    _checks.integer(output_dim, "output_dim")
    return {"center": torch.zeros(output_dim, dtype=dtype, device=device)}


@_global.reduces_statistics("teacher_out", "student_out")
def dino(
    teacher_out: Tensor,
    student_out: Tensor,
    state: dict[str, Tensor],
    *,
    teacher_temp: float | Tensor = 0.04,
    student_temp: float | Tensor = 0.1,
    center_momentum: float | Tensor = 0.9,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""DINO's self-distillation loss over views, with the teacher's centre as explicit state.

    Row ``n`` holds one image's views: ``teacher_out`` ``(N, V_t, K)`` the teacher's outputs of
    its ``V_t`` global crops, ``student_out`` ``(N, V_s, K)`` the student's outputs of every
    crop, the first ``V_t`` being the same global crops. With ``c`` the centre,

    .. math::
        P_t^{(i)} = \operatorname{softmax}\big((t_i - c) / τ_t\big), \qquad
        \log P_s^{(v)} = \operatorname{log\,softmax}(s_v / τ_s),

    .. math::
        L = \frac{1}{|\{(i, v): i \ne v\}|} \sum_{i < V_t} \sum_{v \ne i}
            \frac1N \sum_n - P_t^{(i)} \cdot \log P_s^{(v)}

    (no gradient through the teacher), and the new centre is
    ``m · c + (1 − m) · mean_{n, i} t_i``. Returns ``(L, {"center": new centre})``: the state
    goes in and comes out, so a compiled or captured step sees it. ``teacher_temp`` may be a 0-d
    tensor, the schedule's value this step (DINO warms it up from 0.04 to 0.07).

    lightly's ``DINOLoss`` (``output_dim``, ``warmup_teacher_temp`` ... its epoch schedule is
    the caller's here) takes lists of views; stack them as ``torch.stack(views, 1)``. Under
    :func:`pmlfunc.distributed.global_objective` the means over rows and the centre's batch
    mean are the global batch's (all-reduced, no gather), so every rank's new centre is the
    same.

    Args:
        teacher_out: ``(N, V_t, K)`` float tensor (detached by the loss).
        student_out: ``(N, V_s, K)`` float tensor, ``V_s ≥ V_t``, ``V_s ≥ 2``.
        state: ``{"center": (K,)}`` from :func:`dino_init` or the previous step.
        teacher_temp: ``τ_t > 0`` (default 0.04).
        student_temp: ``τ_s > 0`` (default 0.1).
        center_momentum: ``m`` in ``[0, 1]`` (default 0.9).

    Returns:
        ``(loss, new state)``: a 0-d tensor (float32 for float16/bfloat16 outputs, else their
        dtype) and ``{"center": (K,)}`` in the state's dtype, detached.

    Example:
        >>> state = pf.losses.dino_init(32)
        >>> teacher, student = torch.randn(8, 2, 32), torch.randn(8, 6, 32)
        >>> loss, state = pf.losses.dino(teacher, student, state)

    Reference: Caron et al., "Emerging Properties in Self-Supervised Vision Transformers"
    (DINO), ICCV 2021.
    """
    t, s_out, center = _dino_inputs(teacher_out, student_out, state)
    tau_t = scalar_like(_checks.hyper(teacher_temp, "teacher_temp", positive=True), t)
    tau_s = scalar_like(_checks.hyper(student_temp, "student_temp", positive=True), t)
    m = _momentum(center_momentum, "center_momentum")
    n_t, n_s = t.shape[1], s_out.shape[1]
    teacher = torch.softmax((t - center.to(t.dtype)) / tau_t, dim=-1)  # (N, V_t, K)
    log_student = torch.log_softmax(s_out / tau_s, dim=-1)  # (N, V_s, K)
    # Σ_n Σ_{i, v ≠ i} −⟨P_t^(i), log P_s^(v)⟩: every pair's sum, ⟨Σ_i P_t^(i), Σ_v log P_s^(v)⟩,
    # less the same crops' (v = i): elementwise passes over the views, no (V_t, V_s) product
    every = (teacher.sum(1) * log_student.sum(1)).sum()
    same = (teacher * log_student[:, :n_t]).sum()
    pairs = n_t * n_s - n_t
    n = total(torch.full((), t.shape[0], dtype=t.dtype, device=t.device))
    loss = total(same - every) / (n * pairs)
    batch_center = total(t.sum((0, 1))) / (n * n_t)
    m_ = scalar_like(m, t)
    new_center = (m_ * center.to(t.dtype) + (1 - m_) * batch_center).to(center.dtype)
    return loss, {"center": new_center}


def _dino_inputs(teacher_out, student_out, state) -> tuple[Tensor, Tensor, Tensor]:
    """The views in the compute dtype (the teacher detached) and the centre, checked."""
    for x, name in ((teacher_out, "teacher_out"), (student_out, "student_out")):
        _checks.floating(x, name)
        if x.ndim != 3:
            raise ValueError(f"{name} must be (N, views, K), got shape {tuple(x.shape)}")
    if teacher_out.shape[0] == 0 and not _global.active():
        raise ValueError("teacher_out has no rows (an empty batch)")
    n, v_t, k = teacher_out.shape
    if student_out.shape[0] != n or student_out.shape[2] != k:
        raise ValueError(
            f"student_out must be ({n}, views, {k}) (teacher_out's rows and width), got "
            f"{tuple(student_out.shape)}"
        )
    if v_t < 1 or student_out.shape[1] < max(v_t, 2):
        raise ValueError(
            f"student_out needs at least max(2, V_t = {v_t}) views (its first V_t are the "
            f"teacher's crops), got {student_out.shape[1]}"
        )
    center = _state(state, "center", (k,), teacher_out.device, "dino_init")
    cd = _checks.compute_dtype(torch.promote_types(teacher_out.dtype, student_out.dtype))
    return teacher_out.detach().to(cd), student_out.to(cd), center.detach()


@_global.reduces_statistics("high_resolution_outputs", "low_resolution_outputs")
def swav(
    high_resolution_outputs: Tensor,
    low_resolution_outputs: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    sinkhorn_iterations: int = 3,
    sinkhorn_epsilon: float | Tensor = 0.05,
    queue_outputs: Tensor | None = None,
) -> Tensor:
    r"""SwaV: every crop predicts the codes of the other high-resolution crops, the codes an
    equipartition of the batch over the prototypes (Sinkhorn–Knopp).

    Row ``n`` holds one image's crops' prototype scores (``z · cᵀ``, the prototypes the
    caller's): ``high_resolution_outputs`` ``(N, V_h, K)``, ``low_resolution_outputs``
    ``(N, V_l, K)`` or ``None``. For each high-resolution crop ``i`` the codes ``q^{(i)}`` are
    ``sinkhorn_iterations`` rounds of Sinkhorn–Knopp on ``exp(s^{(i)} / ε)`` (``K × N``: each
    prototype's row, then each sample's column normalised; no gradient), and

    .. math::
        L = \frac{1}{V_h} \sum_{i} \frac{1}{V_h + V_l - 1} \sum_{v \ne i}
            -\frac1N \sum_n q^{(i)}_n \cdot \log\operatorname{softmax}(s^{(v)}_n / τ).

    lightly's ``SwaVLoss`` (its lists of crops stacked as ``torch.stack(crops, 1)``).
    ``queue_outputs`` ``(Q, V_h, K)``: the scores of earlier batches' high-resolution crops
    against the current prototypes (the caller keeps the features, e.g. a FIFO updated with
    ``torch.cat([new, queue])[:Q]``, and scores them each step), appended to the batch for the
    codes' Sinkhorn rounds only, no gradient (lightly's ``queue_outputs``, its list stacked on
    dimension 1); SwaV uses it when the batch is small against the prototypes. Under :func:`pmlfunc.distributed.global_objective` the prototypes'
    row sums of every Sinkhorn round and the means over rows are the global batch's
    (all-reduced). lightly's ``sinkhorn_gather_distributed=True`` all-reduces the same
    Sinkhorn sums, but its loss is each rank's own mean, which DDP's averaging turns into the
    global mean only when every rank holds as many rows. ``exp(s / ε)`` is taken as the paper does: scores far above ``ε · 88``
    (float32) overflow; normalised embeddings and prototypes keep them in ``[−1, 1]``.

    Args:
        high_resolution_outputs: ``(N, V_h, K)`` float tensor, ``V_h ≥ 1``.
        low_resolution_outputs: ``None`` or ``(N, V_l, K)``; ``V_h + V_l ≥ 2``.
        temperature: ``τ > 0`` of the predictions' softmax (default 0.1).
        sinkhorn_iterations: rounds of Sinkhorn–Knopp (default 3; a fixed count: no host
            sync).
        sinkhorn_epsilon: ``ε > 0`` (default 0.05).
        queue_outputs: ``None`` (default) or ``(Q, V_h, K)``, earlier rows' scores (under
            :func:`~pmlfunc.distributed.global_objective`, each rank's own queue: the Sinkhorn
            sums run over every rank's batch and queue).

    Returns:
        0-d tensor: float32 for float16/bfloat16 outputs, else their dtype.

    Example:
        >>> high, low = torch.randn(8, 2, 16).tanh(), torch.randn(8, 4, 16).tanh()
        >>> loss = pf.losses.swav(high, low)

    Reference: Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster
    Assignments" (SwaV), NeurIPS 2020.
    """
    high, low = _swav_inputs(high_resolution_outputs, low_resolution_outputs)
    tau = scalar_like(_checks.hyper(temperature, "temperature", positive=True), high)
    eps = scalar_like(_checks.hyper(sinkhorn_epsilon, "sinkhorn_epsilon", positive=True), high)
    _checks.integer(sinkhorn_iterations, "sinkhorn_iterations", minimum=0)
    v_h = high.shape[1]
    v = v_h if low is None else v_h + low.shape[1]
    log_high = torch.log_softmax(high / tau, dim=-1)  # every crop's predictions
    with torch.no_grad():  # the codes of each high-resolution crop: (N, V_h, K)
        scores = high.detach()
        if queue_outputs is not None:  # earlier rows join the equipartition, then are dropped
            queue = _swav_queue(queue_outputs, high)
            scores = torch.cat([scores, queue], 0)
        codes = _sinkhorn(scores, eps, sinkhorn_iterations)[: high.shape[0]]
    # Σ_n Σ_{i, v ≠ i} −q^(i)_n · log p^(v)_n: every pair's sum, ⟨Σ_i q^(i), Σ_v log p^(v)⟩,
    # less the same crops' (v = i): elementwise passes, no (V_h, V) product or concatenation
    summed = log_high.sum(1)
    if low is not None:
        summed = summed + torch.log_softmax(low / tau, dim=-1).sum(1)
    every = (codes.sum(1) * summed).sum()
    same = (codes * log_high).sum()
    n = total(torch.full((), high.shape[0], dtype=high.dtype, device=high.device))
    return total(same - every) / (n * v_h * (v - 1))


def _sinkhorn(scores: Tensor, eps: float | Tensor, iterations: int) -> Tensor:
    """Sinkhorn–Knopp codes of each crop's scores ``(N, V, K)`` (crops independent): ``Q =
    exp(s / ε)`` normalised to sum 1, then ``iterations`` rounds of prototype rows (summed over
    the batch: :func:`pmlfunc._global.total`) and sample columns; each sample's codes sum to 1.
    With no round, the whole matrix times the batch's rows ``B`` (the authors' last ``Q *= B``,
    lightly's): the samples' codes sum to 1 on average (not to ``1 / B``)."""
    q = torch.exp(scores / eps)
    q = q / total(q.sum((0, 2), keepdim=True))  # per crop: the whole matrix sums to 1
    if iterations == 0:
        return q * total(q.new_full((), float(q.shape[0])))
    for _ in range(iterations):
        q = q / total(q.sum(0, keepdim=True))  # each prototype's row over the batch
        q = q / q.sum(-1, keepdim=True)  # each sample's column
    return q


def _swav_queue(queue: object, high: Tensor) -> Tensor:
    """The queue's scores, checked against the high-resolution crops ``(N, V_h, K)``, detached
    in their compute dtype."""
    queue = _checks.floating(queue, "queue_outputs")
    if queue.ndim != 3 or queue.shape[1:] != high.shape[1:]:
        raise ValueError(
            f"queue_outputs must be (Q, {high.shape[1]}, {high.shape[2]}) (the high-resolution "
            f"crops' views and prototypes), got {tuple(queue.shape)}"
        )
    if queue.device != high.device:
        raise ValueError(f"queue_outputs is on {queue.device}, the crops on {high.device}")
    return queue.detach().to(high.dtype)


def _swav_inputs(high, low) -> tuple[Tensor, Tensor | None]:
    """The crops in the compute dtype, checked: ``(N, V_h, K)`` and ``None`` or
    ``(N, V_l, K)``."""
    _checks.tensor(high, "high_resolution_outputs")
    views = [(high, "high_resolution_outputs")]
    if low is not None:
        _checks.tensor(low, "low_resolution_outputs")
        views.append((low, "low_resolution_outputs"))
    for x, name in views:
        _checks.floating(x, name)
        if x.ndim != 3:
            raise ValueError(f"{name} must be (N, crops, K), got shape {tuple(x.shape)}")
    n, v_h, k = high.shape
    if n == 0 and not _global.active():
        raise ValueError("high_resolution_outputs has no rows (an empty batch)")
    if low is not None and (low.shape[0] != n or low.shape[2] != k):
        raise ValueError(
            f"low_resolution_outputs must be ({n}, crops, {k}) (the high-resolution crops' rows "
            f"and width), got {tuple(low.shape)}"
        )
    if v_h < 1 or v_h + (0 if low is None else low.shape[1]) < 2:
        raise ValueError("swav needs a high-resolution crop and at least 2 crops in all")
    dtype = high.dtype if low is None else torch.promote_types(high.dtype, low.dtype)
    cd = _checks.compute_dtype(dtype)
    return high.to(cd), None if low is None else low.to(cd)


@_global.reduces_statistics("anchors", "targets")
def msn(
    anchors: Tensor,
    targets: Tensor,
    prototypes: Tensor,
    *,
    temperature: float | Tensor = 0.1,
    sinkhorn_iterations: int = 3,
    regularization_weight: float | Tensor = 1.0,
    target_sharpen_temperature: float | Tensor = 0.25,
) -> Tensor:
    r"""Masked Siamese Networks: each masked anchor view predicts the sharpened, Sinkhorn-balanced
    prototype assignment of its image's target view, plus the mean-entropy maximisation (me-max)
    of the anchors' mean assignment.

    Image ``n`` has ``V`` anchor views ``a_{nv}`` and one target view ``t_n``; ``ĉ_k`` are the
    ``K`` unit prototypes, ``x̂`` a unit row (``x / max(‖x‖, 10⁻¹²)``, ``F.normalize``'s). With

    .. math::
        p_{nv} = \operatorname{softmax}(\hat a_{nv} \hat C^\top / τ), \qquad
        q_n = \operatorname{softmax}\big(\hat t_n \hat C^\top / (τ T)\big)

    (``softmax(·/τ)^{1/T}`` renormalised, the sharpened target) followed by
    ``sinkhorn_iterations`` rounds of Sinkhorn–Knopp (each prototype's column of ``q`` divided
    by its sum over the batch, then each image's row by its sum; no gradient through the
    targets), and ``p̄ = mean_{n, v} p_{nv}``,

    .. math::
        L = \frac{1}{NV} \sum_{n, v} -q_n \cdot \log p_{nv}
            + λ \Big(\sum_k p̄_k \log p̄_k + \log K\Big).

    The prototypes are the caller's learnable tensor (a model's parameter, as in lightly: no
    ``*_init``), differentiated through the anchors' predictions only.

    lightly's ``MSNLoss(temperature=0.1, sinkhorn_iterations=3, regularization_weight=1.0)``
    with ``forward(anchors, targets, prototypes, target_sharpen_temperature=0.25)``: its anchors
    ``(N·V, D)`` view-major (view ``v`` of image ``n`` in row ``v N + n``) are taken as they are,
    or ``(N, V, D)``. Under :func:`pmlfunc.distributed.global_objective` (the ``(N, V, D)``
    layout) the means over rows, ``p̄`` and every Sinkhorn round's prototype sums are the global
    batch's (all-reduced, no gather); lightly's ``gather_distributed=True`` all-reduces the
    same Sinkhorn sums, but its cross-entropy and ``p̄`` are each rank's own means.

    Args:
        anchors: ``(N, V, D)`` or lightly's ``(N·V, D)`` float tensor, the anchor (masked)
            views' embeddings (normalised by the loss).
        targets: ``(N, D)`` float tensor, the target views' embeddings (detached by the loss).
        prototypes: ``(K, D)`` float tensor (normalised by the loss).
        temperature: ``τ > 0`` (default 0.1).
        sinkhorn_iterations: rounds of Sinkhorn–Knopp on the targets (default 3; 0 disables;
            a fixed count: no host sync).
        regularization_weight: ``λ ≥ 0`` of the me-max term (default 1.0).
        target_sharpen_temperature: ``T > 0`` (default 0.25).

    Returns:
        0-d tensor: float32 for float16/bfloat16 inputs, else their dtype.

    Example:
        >>> anchors, targets = torch.randn(8, 3, 16), torch.randn(8, 16)
        >>> prototypes = torch.randn(10, 16, requires_grad=True)
        >>> loss = pf.losses.msn(anchors, targets, prototypes)

    Reference: Assran et al., "Masked Siamese Networks for Label-Efficient Learning" (MSN),
    ECCV 2022.
    """
    return _msn(
        anchors,
        targets,
        prototypes,
        temperature,
        sinkhorn_iterations,
        regularization_weight,
        target_sharpen_temperature,
        None,
    )


@_global.reduces_statistics("anchors", "targets")
def pmsn(
    anchors: Tensor,
    targets: Tensor,
    prototypes: Tensor,
    *,
    temperature: float | Tensor = 0.1,
    sinkhorn_iterations: int = 3,
    regularization_weight: float | Tensor = 1.0,
    power_law_exponent: float = 0.25,
    target_sharpen_temperature: float | Tensor = 0.25,
) -> Tensor:
    r"""Prior-Matching Siamese Networks: :func:`msn` with the me-max term replaced by the KL
    divergence of a power-law prior from the anchors' mean assignment ``p̄``.

    With :func:`msn`'s cross-entropy term and ``π_k = k^{-s} / \sum_{j=1}^{K} j^{-s}``
    (``k = 1 … K``, ``s`` = ``power_law_exponent``),

    .. math::
        L = \frac{1}{NV} \sum_{n, v} -q_n \cdot \log p_{nv}
            + λ \sum_k π_k \log\frac{π_k}{p̄_k}.

    lightly's ``PMSNLoss(temperature=0.1, sinkhorn_iterations=3, regularization_weight=1,
    power_law_exponent=0.25)`` (its ``F.kl_div(p̄.log(), π, reduction="sum")``); everything
    else, the layouts and :func:`pmlfunc.distributed.global_objective` included, is
    :func:`msn`'s. lightly builds ``π`` in float32 whatever the input; here in the compute
    dtype. (lightly's ``PMSNCustomLoss``, any prior: compose :func:`msn` with
    ``regularization_weight=0`` and your own KL term of ``p̄``.)

    Args:
        anchors: ``(N, V, D)`` or lightly's ``(N·V, D)`` float tensor (normalised by the loss).
        targets: ``(N, D)`` float tensor (detached by the loss).
        prototypes: ``(K, D)`` float tensor (normalised by the loss).
        temperature: ``τ > 0`` (default 0.1).
        sinkhorn_iterations: rounds of Sinkhorn–Knopp on the targets (default 3; 0 disables).
        regularization_weight: ``λ ≥ 0`` of the prior term (default 1.0).
        power_law_exponent: ``s ≥ 0``, a Python number (default 0.25; 0 is the uniform prior,
            :func:`msn`'s me-max).
        target_sharpen_temperature: ``T > 0`` (default 0.25).

    Returns:
        0-d tensor: float32 for float16/bfloat16 inputs, else their dtype.

    Example:
        >>> anchors, targets = torch.randn(8, 3, 16), torch.randn(8, 16)
        >>> prototypes = torch.randn(10, 16, requires_grad=True)
        >>> loss = pf.losses.pmsn(anchors, targets, prototypes)

    Reference: Assran et al., "The Hidden Uniform Cluster Prior in Self-Supervised Learning"
    (PMSN), ICLR 2023.
    """
    power = _checks.number(power_law_exponent, "power_law_exponent", nonnegative=True)
    return _msn(
        anchors,
        targets,
        prototypes,
        temperature,
        sinkhorn_iterations,
        regularization_weight,
        target_sharpen_temperature,
        power,
    )


def _msn(anchors, targets, prototypes, temperature, iterations, weight, sharpen, power):
    """:func:`msn`'s loss; ``power``: ``None`` (me-max, the uniform prior) or the exponent of
    :func:`pmsn`'s power-law prior."""
    a, t, c = _msn_inputs(anchors, targets, prototypes)
    tau = scalar_like(_checks.hyper(temperature, "temperature", positive=True), a)
    tau_t = scalar_like(_checks.hyper(sharpen, "target_sharpen_temperature", positive=True), a)
    lam = scalar_like(_checks.hyper(weight, "regularization_weight", nonnegative=True), a)
    _checks.integer(iterations, "sinkhorn_iterations", minimum=0)
    unit = c / torch.linalg.vector_norm(c, dim=-1, keepdim=True).clamp_min(1e-12)
    a = a / torch.linalg.vector_norm(a, dim=-1, keepdim=True).clamp_min(1e-12)
    log_p = torch.log_softmax(einsum("nvd,kd->nvk", a, unit) / tau, dim=-1)  # (N, V, K)
    with torch.no_grad():  # the targets' sharpened, balanced assignments: (N, K)
        t = t / torch.linalg.vector_norm(t, dim=-1, keepdim=True).clamp_min(1e-12)
        q = torch.softmax(matmul(t, unit.detach().transpose(0, 1)) / (tau * tau_t), dim=-1)
        for _ in range(iterations):
            q = q / total(q.sum(0, keepdim=True))  # each prototype's sum over the batch
            q = q / q.sum(-1, keepdim=True)  # each image's assignment sums to 1
    rows = total(torch.full((), a.shape[0] * a.shape[1], dtype=a.dtype, device=a.device))
    cross = total(-einsum("nk,nvk->", q, log_p)) / rows
    mean_p = total(log_p.exp().sum((0, 1))) / rows  # p̄, (K,)
    k = mean_p.shape[0]
    if power is None:  # me-max: the KL divergence of p̄ from the uniform prior
        reg = torch.xlogy(mean_p, mean_p).sum() + math.log(k)
    else:  # the KL divergence of p̄ from the power law ∝ k^(−power), k = 1 … K
        prior = torch.arange(1, k + 1, dtype=a.dtype, device=a.device) ** -power
        prior = prior / prior.sum()
        reg = (prior * (prior.log() - mean_p.log())).sum()
    return cross + lam * reg


def _msn_inputs(anchors, targets, prototypes) -> tuple[Tensor, Tensor, Tensor]:
    """The anchors as ``(N, V, D)``, the targets (detached) and the prototypes in the compute
    dtype, checked."""
    for x, name in ((anchors, "anchors"), (targets, "targets"), (prototypes, "prototypes")):
        _checks.floating(x, name)
    if targets.ndim != 2:
        raise ValueError(f"targets must be (N, D), got shape {tuple(targets.shape)}")
    n, d = targets.shape
    if prototypes.ndim != 2 or prototypes.shape[0] == 0 or prototypes.shape[1] != d:
        raise ValueError(
            f"prototypes must be (K, {d}) (targets' width, K ≥ 1), got {tuple(prototypes.shape)}"
        )
    if anchors.ndim == 2 and anchors.shape[1] == d and n > 0 and anchors.shape[0] % n == 0:
        a = anchors.view(anchors.shape[0] // n, n, d).transpose(0, 1)  # lightly's view-major rows
    elif anchors.ndim == 3 and anchors.shape[0] == n and anchors.shape[2] == d:
        a = anchors
    else:
        raise ValueError(
            f"anchors must be ({n}, V, {d}) or lightly's (V·{n}, {d}) (targets' rows and width), "
            f"got {tuple(anchors.shape)}"
        )
    if a.shape[1] == 0:
        raise ValueError("anchors has no views")
    if n == 0 and not _global.active():
        raise ValueError("targets has no rows (an empty batch)")
    for x, name in ((targets, "targets"), (prototypes, "prototypes")):
        if x.device != anchors.device:
            raise ValueError(f"{name} must be on anchors' device {anchors.device}")
    cd = _checks.compute_dtype(
        torch.promote_types(torch.promote_types(anchors.dtype, targets.dtype), prototypes.dtype)
    )
    return a.to(cd), targets.detach().to(cd), prototypes.to(cd)


def tico_init(
    embedding_size: int, *, dtype: torch.dtype = torch.float32, device=None
) -> dict[str, Tensor]:
    """The state of :func:`tico`: ``{"covariance": (D, D) zeros}`` (TiCo's initial ``C``).

    Example:
        >>> pf.losses.tico_init(3)["covariance"].shape
        torch.Size([3, 3])
    """
    _checks.integer(embedding_size, "embedding_size")
    return {"covariance": torch.zeros(embedding_size, embedding_size, dtype=dtype, device=device)}


@_global.reduces_statistics("emb_a", "emb_b")
def tico(
    emb_a: Tensor,
    emb_b: Tensor,
    state: dict[str, Tensor],
    *,
    beta: float | Tensor = 0.9,
    rho: float | Tensor = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""TiCo (transformation invariance and covariance contrast), the running covariance as
    explicit state.

    With ``â``, ``b̂`` the L2-normalised rows and ``C₀`` the state's covariance,

    .. math::
        C = β C_0 + (1 - β) \tfrac1N \hat A^⊤ \hat A, \qquad
        L = 1 - \tfrac1N \sum_n \hat a_n \cdot \hat b_n
            + ρ \tfrac1N \sum_n \hat a_n^⊤ C \hat a_n,

    the gradient flowing through this batch's part of ``C``; returns ``(L, {"covariance": C})``
    (``C`` detached). lightly's ``TiCoLoss`` (``update_covariance_matrix=False``: keep the
    returned state unused). Under :func:`pmlfunc.distributed.global_objective` ``Â^⊤Â``, ``N``
    and the means are the global batch's (all-reduced, no gather), so every rank's new
    covariance is the same.

    Args:
        emb_a: ``(N, D)`` float tensor, the first view.
        emb_b: ``(N, D)`` float tensor, row-aligned.
        state: ``{"covariance": (D, D)}`` from :func:`tico_init` or the previous step.
        beta: ``β`` in ``[0, 1]``, the covariance's momentum (default 0.9).
        rho: ``ρ ≥ 0``, the covariance penalty's weight (default 20).

    Returns:
        ``(loss, new state)``: a 0-d tensor (float32 for float16/bfloat16 embeddings, else
        their dtype) and ``{"covariance": (D, D)}`` in the state's dtype, detached.

    Example:
        >>> state = pf.losses.tico_init(16)
        >>> loss, state = pf.losses.tico(torch.randn(8, 16), torch.randn(8, 16), state)

    Reference: Zhu, Liu, Huang, "TiCo: Transformation Invariance and Covariance Contrast for
    Self-Supervised Visual Representation Learning", 2022.
    """
    a, b = _two_views(emb_a, emb_b, "tico")
    d = a.shape[1]
    c0 = _state(state, "covariance", (d, d), a.device, "tico_init")
    beta_ = _momentum(beta, "beta")
    rho_ = _checks.hyper(rho, "rho", nonnegative=True)
    cd = _checks.compute_dtype(a.dtype)
    x, y = F.normalize(a.to(cd), dim=-1), F.normalize(b.to(cd), dim=-1)
    n = total(torch.full((), x.shape[0], dtype=cd, device=x.device))
    m = scalar_like(beta_, x)
    cov = m * c0.detach().to(cd) + (1 - m) * total(matmul(x.transpose(0, 1), x)) / n
    align = total((x * y).sum()) / n
    penalty = total((matmul(x, cov) * x).sum()) / n
    loss = 1 - align + scalar_like(rho_, x) * penalty
    return loss, {"covariance": cov.detach().to(c0.dtype)}


def _momentum(value: float | Tensor, name: str) -> float | Tensor:
    """A momentum in ``[0, 1]`` (a 0-d tensor is not read: no host sync)."""
    m = _checks.hyper(value, name, nonnegative=True)
    if not isinstance(m, Tensor) and m > 1:
        raise ValueError(f"{name} must be in [0, 1], got {m}")
    return m


def _state(state: object, key: str, shape: tuple[int, ...], device, init: str) -> Tensor:
    """``state[key]``, a tensor of ``shape`` on ``device`` (the state :func:`{init}` makes)."""
    if not isinstance(state, dict) or not isinstance(state.get(key), Tensor):
        raise TypeError(f"state must be {{{key!r}: {shape} tensor}} from pf.losses.{init}")
    t = state[key]
    if t.shape != shape or t.device != device:
        raise ValueError(
            f"state[{key!r}] must be {shape} on {device}, got {tuple(t.shape)} on {t.device}"
        )
    return t


def koleo(embeddings: Tensor, *, p: float = 2, eps: float | Tensor = 1e-8) -> Tensor:
    r"""KoLeo: the Kozachenko–Leonenko differential-entropy estimator as a regulariser, which
    spreads a batch's L2-normalised rows by pushing each away from its nearest neighbour.

    With ``x̂_i = x_i / \max(\lVert x_i\rVert_2, ε)`` and ``n(i)`` row ``i``'s nearest
    neighbour on the sphere (the largest cosine, ``j ≠ i``),

    .. math::
        L = -\frac1N \sum_i \log\big(\lVert \hat x_i - \hat x_{n(i)} + ε\rVert_p + ε\big).

    lightly's ``KoLeoLoss(p, eps)`` and DINOv2's: the ``+ ε`` inside the norm is
    ``torch.nn.PairwiseDistance``'s (it keeps the distance of duplicate rows, and its gradient,
    finite); the gradient reaches both ``x̂_i`` and its neighbour, the choice of neighbour is not
    differentiated. A NaN row makes the loss NaN (the neighbour search propagates it).

    The nearest neighbour reads every row of the batch, so the loss is of the batch it is given:
    per rank under DDP, as DINOv2 computes it. It is not a loss of batch statistics, and
    :func:`pmlfunc.distributed.global_objective` does not take it (it has no labels to gather);
    for the global batch's neighbours call it on the gathered rows,
    ``koleo(pf.distributed.all_gather(embeddings))`` (autograd-aware: every rank computes the
    whole loss and its rows receive ``W · ∂L/∂x``, which DDP's averaging turns into the
    single-process gradient).

    Args:
        embeddings: ``(N, D)`` float tensor, ``N ≥ 2`` (normalised by the loss).
        p: ``p > 0``, the norm of the neighbour distance (default 2; the neighbour itself is
            always the largest cosine, as in lightly).
        eps: ``ε ≥ 0`` of the normalisation, the distance and the logarithm (default
            ``1e-8``).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb = torch.randn(16, 8)
        >>> loss = pf.losses.koleo(emb)

    References: Sablayrolles, Douze, Schmid, Jégou, "Spreading vectors for similarity search",
    ICLR 2019; Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision",
    TMLR 2024.
    """
    x = _checks.embeddings(embeddings)
    if x.shape[0] < 2:
        raise ValueError("koleo needs a batch of at least 2 rows (each row's nearest neighbour)")
    p_ = _checks.number(p, "p", positive=True)
    e = _checks.hyper(eps, "eps", nonnegative=True)
    cd = _checks.compute_dtype(x.dtype)
    x = x.to(cd)
    e = scalar_like(e, x)
    unit = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(e)
    with torch.no_grad():  # the neighbour: the largest cosine but itself (NaN wins: propagated)
        cos = matmul(unit, unit.transpose(0, 1))
        cos.diagonal().fill_(-torch.inf)  # a row is not its own neighbour (this product's buffer)
        nearest = cos.argmax(-1)
    dist = torch.linalg.vector_norm(unit - unit[nearest] + e, ord=p_, dim=-1)
    return -torch.log(dist + e).mean()


@_global.reduces_statistics("embeddings", "momentum")
def mmcr(
    embeddings: Tensor,
    momentum: Tensor | None = None,
    *,
    lmda: float | Tensor = 5e-3,
    normalize: bool = True,
) -> Tensor:
    r"""MMCR: maximum manifold capacity, the nuclear norm of the batch's view centroids
    maximised.

    Row ``n`` holds one sample's ``K`` views, ``(N, K, D)`` (``momentum``, a momentum encoder's
    views of the same samples, joins them along the views). With ``z_{nk}`` the views
    (L2-normalised when ``normalize``), ``c_n = \frac1K \sum_k z_{nk}`` the centroids,
    ``C = [c_1 … c_N]ᵀ`` (``N × D``), ``Z_n`` sample ``n``'s ``K × D`` matrix of views and
    ``\lVert·\rVert_*`` the nuclear norm (the sum of the singular values),

    .. math::
        L = -\lVert C\rVert_* + λ \frac1N \sum_n \lVert Z_n\rVert_* .

    The formula and default are lightly's ``MMCRLoss(lmda=5e-3)`` (``loss(online,
    momentum)``, the two ``(N, K, D)`` tensors concatenated along the views), which does not
    normalise: ``normalize=False`` reproduces it; the paper and its authors' code normalise
    the views onto the sphere (``normalize=True``, the default), which bounds ``‖C‖_*`` and the
    loss (without it, scaling the embeddings up lowers the loss without limit).

    Under :func:`pmlfunc.distributed.global_objective` the loss is the global batch's: the
    local term's sum over samples and ``N`` are all-reduced, and ``‖C‖_*`` is read from the
    ``D × D`` Gram matrix ``CᵀC = Σ_ranks C_rᵀ C_r`` (all-reduced with autograd: per-rank
    memory ``O(D²)``, flat in the world size; no rank holds ``C``):
    ``‖C‖_* = Σ_i \sqrt{λ_i(CᵀC)}``, its gradient ``C_r (CᵀC)^{−1/2}`` (a pseudo-inverse; ``= U Vᵀ``, the
    gradient of the singular values) with the eigenvalues below ``D · eps · λ_max`` taken as
    zero (a rank-deficient ``C``: fewer samples than dimensions). The Gram matrix squares
    ``C``'s condition number, so singular values below ``\sqrt{D · eps}`` of the largest are
    not resolved there (float32: ``~10⁻²`` at ``D = 512``); one process takes the singular
    values of ``C`` itself. Non-finite views make the loss NaN (the SVD is taken of finite
    values, so it does not raise). On CUDA, torch's SVD and ``eigh`` check their convergence
    on the host (a synchronisation per call, as in lightly): the loss compiles with
    ``fullgraph=True`` but cannot be captured in a CUDA graph.

    Args:
        embeddings: ``(N, K, D)`` float tensor: ``K`` views of each of ``N`` samples.
        momentum: ``None`` or ``(N, K', D)`` (a momentum encoder's views), joined to
            ``embeddings``' views (not detached: detach it as lightly's callers do).
        lmda: ``λ ≥ 0``, the weight of the per-sample nuclear norms (default ``5e-3``;
            a Python ``0`` skips their SVD).
        normalize: L2-normalise every view first (default ``True``, the paper's).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> views = torch.randn(16, 4, 8)
        >>> loss = pf.losses.mmcr(views)

    Reference: Yerxa, Kuang, Simoncelli, Chung, "Learning Efficient Coding of Natural Images
    with Maximum Manifold Capacity Representations", NeurIPS 2023.
    """
    z = _mmcr_views(embeddings, momentum)
    lam = _checks.hyper(lmda, "lmda", nonnegative=True)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if normalize:
        z = F.normalize(z, dim=-1)
    safe = torch.where(torch.isfinite(z), z, 0.0)  # the SVD raises on non-finite values
    poison = z.sum() * 0  # NaN for any non-finite view, else 0 (with a zero gradient)
    n = total(torch.full((), z.shape[0], dtype=z.dtype, device=z.device))
    local = poison
    if not (isinstance(lam, (int, float)) and lam == 0):
        local = local + torch.linalg.svdvals(safe).sum()
    local = total(local) / n
    return -_nuclear_norm(safe.mean(1)) + scalar_like(lam, z) * local


def _mmcr_views(embeddings: object, momentum: object) -> Tensor:
    """The views ``(N, K [+ K'], D)`` in the compute dtype, checked."""
    views = [(embeddings, "embeddings")]
    if momentum is not None:
        views.append((momentum, "momentum"))
    for value, name in views:
        x = _checks.floating(value, name)
        if x.ndim != 3 or x.shape[1] == 0 or x.shape[2] == 0:
            raise ValueError(
                f"{name} must be (N, views, D) with at least one view and dimension, got shape "
                f"{tuple(x.shape)}"
            )
    assert isinstance(embeddings, Tensor)
    if embeddings.shape[0] == 0 and not _global.active():
        raise ValueError("embeddings has no rows (an empty batch)")
    if not isinstance(momentum, Tensor):
        return embeddings.to(_checks.compute_dtype(embeddings.dtype))
    n, _, d = embeddings.shape
    if momentum.shape[0] != n or momentum.shape[2] != d:
        raise ValueError(
            f"momentum must be ({n}, views, {d}) (embeddings' rows and width), got "
            f"{tuple(momentum.shape)}"
        )
    if momentum.dtype != embeddings.dtype or momentum.device != embeddings.device:
        raise TypeError(
            f"momentum must have embeddings' dtype and device ({embeddings.dtype} on "
            f"{embeddings.device}), got {momentum.dtype} on {momentum.device}"
        )
    cd = _checks.compute_dtype(embeddings.dtype)
    return torch.cat([embeddings, momentum], 1).to(cd)


def _nuclear_norm(c: Tensor) -> Tensor:
    """``‖C‖_*`` of the batch's ``(N, D)`` rows: the singular values of ``C`` in one process;
    under :func:`pmlfunc._global.summing` the square roots of the eigenvalues of the
    all-reduced Gram matrix ``CᵀC`` (those below ``D · eps · λ_max`` taken as zero, value and
    gradient: the rank ``C`` lacks)."""
    if not _global.active():
        return torch.linalg.svdvals(c).sum()
    gram = total(matmul(c.transpose(0, 1), c))
    lam = torch.linalg.eigvalsh(gram)  # ascending; its gradient V diag(·) Vᵀ has no gaps
    floor = lam[-1].detach() * (c.shape[1] * torch.finfo(c.dtype).eps)
    keep = lam > floor
    return torch.where(keep, torch.sqrt(torch.where(keep, lam, 1.0)), 0.0).sum()


@_global.reduces_statistics("embeddings")
def sigreg(
    embeddings: Tensor,
    *,
    generator: torch.Generator | Tensor | None = None,
    knots: int = 17,
    t_max: float | Tensor = 3.0,
    num_vectors: int = 1024,
) -> Tensor:
    r"""SIGReg: sketched isotropic Gaussian regularisation (LeJEPA), the Epps–Pulley test of
    random one-dimensional projections of the batch against the standard normal.

    ``M = num_vectors`` random directions ``a_m`` (Gaussian vectors normalised to unit length,
    drawn from ``generator``); each projection ``s_{nm} = x_n · a_m`` is compared with
    ``N(0, 1)`` through its empirical characteristic function on the grid
    ``t_k = k · t_max / (knots − 1)``, ``k = 0 … knots − 1``:

    .. math::
        e_m(t) = \Big(\frac1N \sum_n \cos(t s_{nm}) - e^{-t^2/2}\Big)^2
               + \Big(\frac1N \sum_n \sin(t s_{nm})\Big)^2, \qquad
        L = \frac1M \sum_m N \sum_k w_k\, e^{-t_k^2/2}\, e_m(t_k),

    ``w`` the trapezoidal weights of ``∫_{−t_max}^{t_max}`` folded onto ``t ≥ 0`` (the
    integrand is even): ``Δt · [1, 2, …, 2, 1]``, ``Δt = t_max / (knots − 1)``. This is the
    Epps–Pulley statistic ``N ∫ |φ̂_N(t) − φ(t)|² φ(t) dt`` (weight function the Gaussian
    density up to ``√(2π)``) averaged over the slices, as lightly's ``SIGReg(knots=17,
    t_max=3.0, num_vectors=1024)`` computes it (LeJEPA's reference code). ``(N, V, D)``
    embeddings (``V`` views of each sample) give each view its own statistic, averaged over the
    views: lightly's ``(V, N, D)`` input, transposed. LeJEPA's loss is
    ``λ · sigreg + (1 − λ) · invariance`` (lightly's ``LeJEPALoss``, ``λ = 0.05``); compose it.

    The directions come from ``generator`` (required: a ``torch.Generator``, or a 0-d integer
    seed tensor under ``torch.compile`` and CUDA graphs), counter-based
    (``pmlfunc._random``): the same seed gives the same directions on every device, not
    those of ``torch.randn``. Under :func:`pmlfunc.distributed.global_objective` the sums
    ``Σ_n cos``, ``Σ_n sin`` and ``N`` are all-reduced (with autograd), so the statistic is the
    global batch's, exactly (lightly's ``gather_distributed=True``); every rank must pass the
    same generator state or seed (lightly broadcasts rank 0's directions instead). Memory:
    ``N · V · M · knots`` numbers for the cosines and the sines.

    Args:
        embeddings: ``(N, D)`` or ``(N, V, D)`` float tensor (the projector's output, not
            normalised).
        generator: a ``torch.Generator`` or a 0-d integer seed tensor, for the directions.
        knots: the number of frequencies ``t_k``, ``≥ 2`` (default 17).
        t_max: the largest frequency, ``> 0`` (default 3).
        num_vectors: the number of random directions (slices) ``M ≥ 1`` (default 1024).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> proj = torch.randn(32, 16)
        >>> loss = pf.losses.sigreg(proj, generator=torch.Generator().manual_seed(0))

    Reference: Balestriero, LeCun, "LeJEPA: Provable and Scalable Self-Supervised Learning
    Without the Heuristics", 2025 (arXiv:2511.08544); Epps, Pulley, "A test for normality based
    on the empirical characteristic function", Biometrika 1983.
    """
    embeddings = _checks.floating(embeddings, "embeddings")
    if embeddings.ndim not in (2, 3) or embeddings.shape[-1] == 0:
        raise ValueError(
            f"embeddings must be (N, D) or (N, views, D) with D >= 1, got shape "
            f"{tuple(embeddings.shape)}"
        )
    if embeddings.shape[0] == 0 and not _global.active():
        raise ValueError("embeddings has no rows (an empty batch)")
    _checks.integer(knots, "knots", minimum=2)
    _checks.integer(num_vectors, "num_vectors")
    t_max_ = _checks.hyper(t_max, "t_max", positive=True)
    cd = _checks.compute_dtype(embeddings.dtype)
    x = embeddings.to(cd)
    seed = _random.seed_tensor(generator, x.device)
    directions = _sigreg_directions(seed, x.shape[-1], num_vectors).to(cd)
    step = scalar_like(t_max_, x) / (knots - 1)
    t = torch.arange(knots, dtype=cd, device=x.device) * step  # (knots,)
    window = torch.exp(-t * t / 2)  # the standard normal's characteristic function
    k = torch.arange(knots, device=x.device)
    trapezoid = 2 - ((k == 0) | (k == knots - 1)).to(cd)  # 1, 2, …, 2, 1
    weights = trapezoid * step * window
    xt = matmul(x, directions).unsqueeze(-1) * t  # (N, [V,] M, knots)
    n = total(torch.full((), x.shape[0], dtype=cd, device=x.device))
    cos_mean = total(torch.cos(xt).sum(0)) / n
    sin_mean = total(torch.sin(xt).sum(0)) / n
    err = (cos_mean - window).square() + sin_mean.square()  # ([V,] M, knots)
    return (matmul(err, weights.unsqueeze(-1)).squeeze(-1) * n).mean()


def _sigreg_directions(seed: Tensor, dim: int, count: int) -> Tensor:
    """``(dim, count)`` float64 unit columns, uniform on the sphere: Gaussian vectors
    (Box–Muller on :func:`pmlfunc._random.uniform`'s streams 0 and 1) normalised."""
    u1 = _random.uniform(seed, 0, (dim, count))
    u2 = _random.uniform(seed, 1, (dim, count))
    gauss = torch.sqrt(-2 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
    return gauss / torch.linalg.vector_norm(gauss, dim=0, keepdim=True)


def ibot_patch_init(
    output_dim: int, *, dtype: torch.dtype = torch.float32, device=None
) -> dict[str, Tensor]:
    """The state of :func:`ibot_patch`: ``{"center": (output_dim,) zeros}`` (iBOT's initial
    patch centre).

    Example:
        >>> pf.losses.ibot_patch_init(3)["center"]
        tensor([0., 0., 0.])
    """
    _checks.integer(output_dim, "output_dim")
    return {"center": torch.zeros(output_dim, dtype=dtype, device=device)}


@_global.reduces_statistics("teacher_out", "student_out", "mask")
def ibot_patch(
    teacher_out: Tensor,
    student_out: Tensor,
    mask: Tensor,
    state: dict[str, Tensor],
    *,
    teacher_temp: float | Tensor = 0.04,
    student_temp: float | Tensor = 0.1,
    center_momentum: float | Tensor = 0.9,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""iBOT's masked patch-token self-distillation loss (as in DINOv2), the teacher's patch
    centre as explicit state.

    Image ``b`` has ``P`` patch tokens, ``m_{bp} = 1`` for the patches masked in the student's
    input. With ``c`` the centre, ``t_{bp}``, ``s_{bp}`` the teacher's and the student's
    prototype scores of patch ``p`` (``K`` of them) and ``B`` the number of images,

    .. math::
        H_{bp} = -\operatorname{softmax}\big((t_{bp} - c) / τ_t\big) \cdot
                 \operatorname{log\,softmax}(s_{bp} / τ_s), \qquad
        L = \frac1B \sum_b \frac{\sum_p m_{bp} H_{bp}}{\max(1, \sum_p m_{bp})}

    (each image's masked patches averaged, then the images; no gradient through the teacher),
    and the new centre is ``μ · c + (1 − μ) · mean_{m_{bp} = 1} t_{bp}``, the mean over the
    masked patches (the centre is kept when no patch is masked). Returns
    ``(L, {"center": new centre})``. ``teacher_temp`` may be a 0-d tensor (a schedule's value).

    Two layouts of the patch outputs:

    - ``(B, P, K)``, every patch of each image, ``mask`` ``(B, P)`` or ``(B, H, W)`` with
      ``H · W = P``: fixed shapes whatever the masking (compile and CUDA graphs), the unmasked
      patches weighted 0 (a non-finite one still makes the loss NaN: its gradient would be);
    - ``(M, K)``, the masked patches only, in the mask's row-major order (lightly's
      ``IBOTPatchLoss`` input, ``M = mask.sum()``; not checked, which would read the mask on
      the host): each row's image is found by a search in the cumulative counts.

    lightly's ``IBOTPatchLoss(output_dim, teacher_temp=0.04, student_temp=0.1,
    center_momentum=0.9)`` (``forward(teacher_out, student_out, mask)``, the second layout)
    with its ``Center`` buffer as the state. Under
    :func:`pmlfunc.distributed.global_objective` (first layout: ``mask`` has one row per
    image) ``B`` and the centre's sums ``Σ m_{bp} t_{bp}``, ``Σ m_{bp}`` are the global batch's
    (all-reduced, no gather; each image's normaliser is its own rank's), so every rank's loss
    and new centre equal one process's on the whole batch; lightly averages the ranks' means,
    equal only when every rank holds as many masked patches.

    Args:
        teacher_out: ``(B, P, K)`` or ``(M, K)`` float tensor (detached by the loss).
        student_out: ``teacher_out``'s shape.
        mask: ``(B, P)`` or ``(B, H, W)`` bool tensor, ``True`` for a masked patch.
        state: ``{"center": (K,)}`` from :func:`ibot_patch_init` or the previous step.
        teacher_temp: ``τ_t > 0`` (default 0.04).
        student_temp: ``τ_s > 0`` (default 0.1).
        center_momentum: ``μ`` in ``[0, 1]`` (default 0.9).

    Returns:
        ``(loss, new state)``: a 0-d tensor (float32 for float16/bfloat16 outputs, else their
        dtype) and ``{"center": (K,)}`` in the state's dtype, detached.

    Example:
        >>> state = pf.losses.ibot_patch_init(32)
        >>> teacher, student = torch.randn(4, 9, 32), torch.randn(4, 9, 32)
        >>> mask = torch.rand(4, 3, 3) < 0.4
        >>> loss, state = pf.losses.ibot_patch(teacher, student, mask, state)

    References: Zhou et al., "iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022;
    Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision", TMLR 2024.
    """
    t, s, masked, center = _ibot_inputs(teacher_out, student_out, mask, state)
    tau_t = scalar_like(_checks.hyper(teacher_temp, "teacher_temp", positive=True), t)
    tau_s = scalar_like(_checks.hyper(student_temp, "student_temp", positive=True), t)
    m = scalar_like(_momentum(center_momentum, "center_momentum"), t)
    c = center.to(t.dtype)
    teacher = torch.softmax((t - c) / tau_t, dim=-1)
    cross = -(teacher * torch.log_softmax(s / tau_s, dim=-1)).sum(-1)  # (B, P) or (M,)
    counts = masked.sum(1)  # masked patches per image, (B,)
    per_image = 1 / counts.clamp_min(1)
    if t.ndim == 3:
        weight = masked * per_image.unsqueeze(1)  # (B, P): 0 for the unmasked patches
        rows = (cross * weight).sum(1)  # (B,)
        picked = (masked.unsqueeze(-1) * t).sum((0, 1))  # Σ over the masked patches, (K,)
        n_masked = counts.sum()
    else:  # row r of the masked patches belongs to the first image whose cumulative count > r
        ends = torch.cumsum(counts, 0)
        r = torch.arange(t.shape[0], device=t.device, dtype=ends.dtype)
        image = torch.searchsorted(ends, r, right=True).clamp_max(masked.shape[0] - 1)
        rows = cross * per_image[image]  # (M,): summed over the images below
        picked = t.sum(0)
        n_masked = torch.full((), t.shape[0], dtype=t.dtype, device=t.device)
    n = total(torch.full((), masked.shape[0], dtype=t.dtype, device=t.device))
    loss = total(rows.sum()) / n
    n_masked = total(n_masked)
    batch_center = total(picked) / n_masked.clamp_min(1)
    new_center = torch.where(n_masked > 0, m * c + (1 - m) * batch_center, c)
    return loss, {"center": new_center.to(center.dtype)}


def _ibot_inputs(teacher_out, student_out, mask, state) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The patch outputs in the compute dtype (the teacher detached), the mask as ``(B, P)``
    in that dtype, and the centre, checked."""
    _checks.tensor(teacher_out, "teacher_out")
    _checks.tensor(student_out, "student_out")
    mask = _checks.tensor(mask, "mask")
    for x, name in ((teacher_out, "teacher_out"), (student_out, "student_out")):
        _checks.floating(x, name)
        if x.ndim not in (2, 3) or x.shape[-1] == 0:
            raise ValueError(
                f"{name} must be (B, P, K) (every patch) or (M, K) (the masked patches), got "
                f"shape {tuple(x.shape)}"
            )
    if student_out.shape != teacher_out.shape:
        raise ValueError(
            f"student_out must have teacher_out's shape {tuple(teacher_out.shape)}, got "
            f"{tuple(student_out.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True: a masked patch), got {mask.dtype}")
    if mask.ndim not in (2, 3):
        raise ValueError(f"mask must be (B, P) or (B, H, W), got shape {tuple(mask.shape)}")
    if mask.device != teacher_out.device:
        raise ValueError(f"mask must be on teacher_out's device {teacher_out.device}")
    flat = mask.flatten(1)
    if teacher_out.ndim == 3 and (
        teacher_out.shape[0] != mask.shape[0] or teacher_out.shape[1] != flat.shape[1]
    ):
        raise ValueError(
            f"mask must hold teacher_out's {teacher_out.shape[0]} images of "
            f"{teacher_out.shape[1]} patches, got shape {tuple(mask.shape)}"
        )
    if mask.shape[0] == 0 and not _global.active():
        raise ValueError("mask has no rows (an empty batch of images)")
    center = _state(
        state, "center", (teacher_out.shape[-1],), teacher_out.device, "ibot_patch_init"
    )
    cd = _checks.compute_dtype(torch.promote_types(teacher_out.dtype, student_out.dtype))
    return teacher_out.detach().to(cd), student_out.to(cd), flat.to(cd), center.detach()


def wmse(
    embeddings: Tensor,
    *,
    generator: torch.Generator | Tensor | None = None,
    w_size: int = 256,
    w_iter: int = 1,
    eps: float | Tensor = 0.0,
) -> Tensor:
    r"""W-MSE: the views whitened in random sub-batches, then their normalised MSE.

    Row ``n`` holds one sample's ``V`` views, ``(N, V, D)``. Each of ``w_iter`` iterations
    splits the batch by a random permutation into ``N / w_size`` sub-batches of ``w_size``
    rows; each view of each sub-batch ``X`` (``w_size × D``) is whitened with the Cholesky
    factor of its shrunk unbiased covariance,

    .. math::
        Σ = (1 - ε) \tfrac{1}{w - 1} (X - \bar X)^⊤ (X - \bar X) + ε I = L L^⊤, \qquad
        Z = (X - \bar X) L^{-⊤},

    and with ``ẑ`` the L2-normalised whitened rows

    .. math::
        L_{wmse} = \frac{1}{w_{iter} \binom V2} \sum_{iter} \sum_{u < v}
            \frac1N \sum_n \lVert ẑ^{(u)}_n - ẑ^{(v)}_n \rVert^2
            \quad\big(= 2 - 2 \cos\big).

    lightly's ``WMSELoss(w_size=256, w_iter=1, eps=0)`` in training mode (its running mean and
    covariance, ``momentum`` and ``track_running_stats``, are used in eval mode only and are
    not provided; ``embedding_dim`` and ``num_samples`` are read from the shape); its input
    ``torch.cat(views)`` is ours as ``x.view(V, N, D).transpose(0, 1)``. As lightly, ``N``
    must be a multiple of ``w_size`` and ``w_size ≥ 2 D``. The permutation comes from
    ``generator`` (counter-based, ``pmlfunc._random``: a stable argsort of random keys,
    not ``torch.randperm``'s order), required when there is more than one sub-batch; with
    one (``N = w_size``) the loss does not depend on the order and ``generator`` is not used.
    A sub-batch whose shrunk covariance is not positive definite (fewer than ``D + 1``
    distinct rows with ``ε = 0``) gives NaN where lightly's Cholesky raises (the check would
    read the factorisation's status on the host).

    The whitening reads each sub-batch's own mean and covariance: it does not map to sums over
    the global batch, so :func:`pmlfunc.distributed.global_objective` does not take it. Under
    DDP it is per rank (each rank whitens sub-batches of its own rows, as the authors' code);
    for sub-batches drawn from the global batch call it on the gathered rows,
    ``wmse(pf.distributed.all_gather(embeddings), generator=seed)`` with the same seed on
    every rank (autograd-aware, as for :func:`koleo`).

    Args:
        embeddings: ``(N, V, D)`` float tensor, ``V ≥ 2`` views of each of ``N`` samples.
        generator: a ``torch.Generator`` or a 0-d integer seed tensor, for the sub-batches.
        w_size: the sub-batch size ``w``, ``≥ 2 D``, dividing ``N`` (default 256).
        w_iter: the number of whitening iterations (default 1).
        eps: ``ε`` in ``[0, 1]``, the shrinkage of the covariance to the identity (default 0).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> views = torch.randn(32, 2, 8)
        >>> loss = pf.losses.wmse(views, w_size=16, generator=torch.Generator().manual_seed(0))

    Reference: Ermolov, Siarohin, Sangineto, Sebe, "Whitening for Self-Supervised
    Representation Learning", ICML 2021.
    """
    x = _wmse_views(embeddings)
    n, v, d = x.shape
    _checks.integer(w_size, "w_size", minimum=2)
    _checks.integer(w_iter, "w_iter")
    if w_size < 2 * d:
        raise ValueError(f"w_size must be at least 2 D = {2 * d} (lightly's bound), got {w_size}")
    if n % w_size:
        raise ValueError(f"embeddings must hold a multiple of w_size = {w_size} samples, got {n}")
    e = _momentum(eps, "eps")
    groups = n // w_size
    if groups > 1:
        sub = x[_wmse_orders(_random.seed_tensor(generator, x.device), w_iter, n)]
    else:  # one sub-batch: every iteration whitens the same rows
        sub = x.unsqueeze(0)
    sub = sub.view(sub.shape[0], groups, w_size, v, d).transpose(2, 3)  # (I, G, V, w, D)
    z = _whitened(sub, scalar_like(e, x))
    unit = F.normalize(z, dim=-1)
    cos = einsum("igvwd,igqwd->vq", unit, unit)  # Σ over the rows of each pair of views
    pairs = torch.triu(torch.ones(v, v, dtype=torch.bool, device=x.device), diagonal=1)
    mean_cos = cos.masked_fill(~pairs, 0.0).sum() / (sub.shape[0] * n * (v * (v - 1) // 2))
    return 2 - 2 * mean_cos


def _wmse_orders(seed: Tensor, w_iter: int, n: int) -> Tensor:
    """``(w_iter, n)``: each iteration's order of the rows, a stable argsort of random keys
    (:func:`pmlfunc._random.random_bits`, stream 0)."""
    return torch.argsort(_random.random_bits(seed, 0, (w_iter, n)), dim=-1, stable=True)


def _whitened(x: Tensor, eps: float | Tensor) -> Tensor:
    """Each ``(w, D)`` matrix of ``x`` (``(..., w, D)``) centred and whitened: ``(X − X̄) L^{−⊤}``,
    ``L`` the Cholesky factor of the shrunk unbiased covariance (NaN where it is not positive
    definite: no host sync)."""
    xc = x - x.mean(-2, keepdim=True)
    cov = matmul(xc.transpose(-1, -2), xc) / (x.shape[-2] - 1)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    chol, info = torch.linalg.cholesky_ex((1 - eps) * cov + eps * eye)
    chol = torch.where((info == 0)[..., None, None], chol, torch.nan)
    # Z = Xc L^{-T} as (L^{-1} Xcᵀ)ᵀ on contiguous operands: the right-sided solve on the
    # transposed factor aborted (or gave a wrong gradient) in a compiled backward on CPU
    zt = torch.linalg.solve_triangular(chol, xc.transpose(-1, -2).contiguous(), upper=False)
    return zt.transpose(-1, -2)


def _wmse_views(embeddings: object) -> Tensor:
    """The views ``(N, V, D)`` in the compute dtype, checked."""
    embeddings = _checks.floating(embeddings, "embeddings")
    if embeddings.ndim != 3 or embeddings.shape[1] < 2 or embeddings.shape[2] == 0:
        raise ValueError(
            f"embeddings must be (N, views, D) with at least 2 views and one dimension, got "
            f"shape {tuple(embeddings.shape)}"
        )
    if embeddings.shape[0] == 0:
        raise ValueError("embeddings has no rows (an empty batch)")
    return embeddings.to(_checks.compute_dtype(embeddings.dtype))
