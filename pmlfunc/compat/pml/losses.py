"""PML 2.9.0's losses (``pytorch_metric_learning.losses``) over :mod:`pmlfunc.losses`.

Each class is PML's name, its constructor's positional order, the defaults where PML 2.9.0's
differ from the function's, and the function: ``loss(embeddings, labels, indices_tuple=None,
ref_emb=None, ref_labels=None)`` calls it with the constructor's arguments (compat distances,
reducers and regularizers handed over as their ``.function``). An argument PML keeps in other
units than its constructor's (``ArcFaceLoss``/``SubCenterArcFaceLoss``/``TupletMarginLoss``'s
margin and ``AngularLoss``'s alpha in radians, ``SoftTripleLoss``'s ``1/γ``) is held as PML
holds it and converted for the function at each call.

The learnable losses hold their parameters as ``nn.Parameter`` under PML's names and in PML's
layouts (``W`` of shape ``(D, C)`` or ``(D, C·K)``, ``fc``, ``weight``, ``proxies``, ``beta``),
drawn by the function's ``*_init`` from the global RNG (the same values as PML's for the same
seed), so a PML state dict loads; the function receives views of them in its own layout. They
are created on the default device, so ``with torch.device("meta"):`` builds a module without
storage (PML 2.9.0 leaves most of its class tables on the CPU there).
``get_logits(embeddings)`` is :func:`pmlfunc.losses.class_logits`; ``SubCenterArcFaceLoss``
has ``get_outliers``. ``DynamicSoftMarginLoss`` keeps its histogram as the buffer ``hist_``
and updates it in place at each call, as PML does.

Example:
    >>> from pmlfunc.compat.pml.losses import ArcFaceLoss
    >>> head = ArcFaceLoss(num_classes=10, embedding_size=4)  # margin=28.6 degrees, PML's
    >>> head.W.shape, sorted(head.state_dict())
    (torch.Size([4, 10]), ['W'])
    >>> loss = head(torch.randn(8, 4), torch.randint(0, 10, (8,)))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ... import losses as _l
from ... import wrappers as _w
from ._base import (
    Loss,
    degrees,
    given,
    global_seed,
    no_grad_copy,
    radians,
    reciprocal,
    required,
    same,
)

__all__ = [
    "AngularLoss",
    "ArcFaceLoss",
    "CircleLoss",
    "ContrastiveLoss",
    "CosFaceLoss",
    "CrossBatchMemory",
    "DynamicSoftMarginLoss",
    "FastAPLoss",
    "GeneralizedLiftedStructureLoss",
    "HistogramLoss",
    "InstanceLoss",
    "IntraPairVarianceLoss",
    "LargeMarginSoftmaxLoss",
    "LiftedStructureLoss",
    "ManifoldLoss",
    "MarginLoss",
    "MultiSimilarityLoss",
    "MultipleLosses",
    "NCALoss",
    "NPairsLoss",
    "NTXentLoss",
    "NormalizedSoftmaxLoss",
    "P2SGradLoss",
    "PNPLoss",
    "ProxyAnchorLoss",
    "ProxyNCALoss",
    "RankedListLoss",
    "SelfSupervisedLoss",
    "SignalToNoiseRatioContrastiveLoss",
    "SmoothAPLoss",
    "SoftTripleLoss",
    "SphereFaceLoss",
    "SubCenterArcFaceLoss",
    "SupConLoss",
    "ThresholdConsistentMarginLoss",
    "TripletMarginLoss",
    "TupletMarginLoss",
    "VICRegLoss",
]


# ---------------------------------------------------------------------------------------------
# batch losses: the function's own names and defaults, PML's positional order
# ---------------------------------------------------------------------------------------------
class AngularLoss(Loss):
    """``.alpha`` holds PML's value, a 0-d tensor in radians (the function's degrees)."""

    function = _l.angular
    signature = ("alpha",)
    units = {"alpha": (lambda v: torch.tensor(radians(v), dtype=torch.float64), degrees)}


class CircleLoss(Loss):
    function = _l.circle
    signature = ("m", "gamma")


class ContrastiveLoss(Loss):
    function = _l.contrastive
    signature = ("pos_margin", "neg_margin")


class FastAPLoss(Loss):
    function = _l.fast_ap
    signature = ("num_bins",)


class GeneralizedLiftedStructureLoss(Loss):
    function = _l.generalized_lifted_structure
    signature = ("neg_margin", "pos_margin")


class HistogramLoss(Loss):
    function = _l.histogram
    signature = ("n_bins", "delta")


class InstanceLoss(Loss):
    function = _l.instance
    signature = ("gamma",)


class IntraPairVarianceLoss(Loss):
    function = _l.intra_pair_variance
    signature = ("pos_eps", "neg_eps")


class LiftedStructureLoss(Loss):
    function = _l.lifted_structure
    signature = ("neg_margin", "pos_margin")


class MultiSimilarityLoss(Loss):
    function = _l.multi_similarity
    signature = ("alpha", "beta", "base")


class NCALoss(Loss):
    function = _l.nca
    signature = ("softmax_scale",)


class NPairsLoss(Loss):
    function = _l.npairs


class NTXentLoss(Loss):
    function = _l.ntxent
    signature = ("temperature",)


class PNPLoss(Loss):
    function = _l.pnp
    signature = ("b", "alpha", "anneal", "variant")


class RankedListLoss(Loss):
    function = _l.ranked_list
    signature = ("margin", "Tn", "imbalance", "alpha", "Tp")
    defaults = {"margin": required(), "Tn": required()}


class SignalToNoiseRatioContrastiveLoss(Loss):
    function = _l.signal_to_noise_ratio_contrastive
    signature = ("pos_margin", "neg_margin")


class SmoothAPLoss(Loss):
    function = _l.smooth_ap
    signature = ("temperature",)


class SupConLoss(Loss):
    function = _l.supcon
    signature = ("temperature",)


class ThresholdConsistentMarginLoss(Loss):
    function = _l.threshold_consistent_margin
    signature = ("lambda_plus", "lambda_minus", "margin_plus", "margin_minus")


class TripletMarginLoss(Loss):
    """PML 2.9.0's default margin is 0.05 (pmlfunc's, PML 3's, 0.2)."""

    function = _l.triplet_margin
    signature = ("margin", "swap", "smooth_loss", "triplets_per_anchor")
    defaults = {"margin": 0.05}

    def options(self) -> dict[str, Any]:
        return _all_triplets(super().options(), "TripletMarginLoss")


class TupletMarginLoss(Loss):
    """The margin given in degrees, as PML's; ``.margin`` holds PML's value in radians (the
    function takes degrees)."""

    function = _l.tuplet_margin
    signature = ("margin", "scale")
    units = {"margin": (radians, degrees)}


class VICRegLoss(Loss):
    """``loss(embeddings, ref_emb=...)``: the two views (PML's signature)."""

    function = _l.vicreg
    signature = ("invariance_lambda", "variance_mu", "covariance_v", "eps")
    shared = ("reducer",)

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        if ref_emb is None:
            raise ValueError("VICRegLoss needs ref_emb (the second view)")
        return _l.vicreg(embeddings, ref_emb, **self.options())


def _all_triplets(options: dict[str, Any], name: str) -> dict[str, Any]:
    """``triplets_per_anchor``: PML's ``"all"`` is the function's only mode."""
    value = options.pop("triplets_per_anchor", "all")
    if value != "all":
        raise ValueError(
            f"{name}(triplets_per_anchor={value!r}) is not provided: use a miner with "
            "tuples_per_anchor= (pmlfunc.miners) or the default 'all'"
        )
    return options


class DynamicSoftMarginLoss(Loss):
    """The histogram as the buffer ``hist_`` (not in the state dict, as in PML), updated at
    each call."""

    function = _l.dynamic_soft_margin  # pyright: ignore[reportAssignmentType]  # (loss, state): see forward
    signature = ("min_val", "num_bins", "momentum")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bins = int(self.options().get("num_bins", 10))
        state = _l.dynamic_soft_margin_init_state(bins)
        self.register_buffer("hist_", state["hist"], persistent=False)

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        inputs = given(indices_tuple=indices_tuple, ref_emb=ref_emb, ref_labels=ref_labels)
        hist: Tensor = self.get_buffer("hist_")
        loss, state = _l.dynamic_soft_margin(
            embeddings, labels, {"hist": hist}, **self.options(), **inputs
        )
        no_grad_copy(hist, state["hist"])
        return loss


# ---------------------------------------------------------------------------------------------
# learnable losses: PML's parameter names and layouts
# ---------------------------------------------------------------------------------------------
def _on_default_device(value: Tensor) -> Tensor:
    """A parameter drawn on the CPU (PML's values for a seed), on the default device: the one
    of a ``with torch.device(...)`` block (``"meta"``: no storage) or of
    ``torch.set_default_device``."""
    return value.to(torch.get_default_device())


class _Learnable(Loss):
    """A loss with a class table: ``table`` is ``(PML's attribute, its layout)``: ``"columns"``
    for PML's ``(D, C)`` (``(D, C·K)`` with ``per_class``: ``weight[c, k]`` is column
    ``c·K + k``), ``"rows"`` for ``(C, D)``; ``init`` the function's ``*_init``; ``classes``,
    ``width`` and ``per_class`` PML's arguments for ``C``, ``D`` and the centres of a class
    (consumed here, not the function's)."""

    table: ClassVar[tuple[str, str]] = ("W", "columns")
    init: ClassVar[Callable[..., dict[str, Tensor]]]
    classes: ClassVar[str] = "num_classes"
    width: ClassVar[str] = "embedding_size"
    per_class: ClassVar[str | None] = None
    key: ClassVar[str] = "weight"
    shared = (*Loss.shared, "weight_regularizer", "weight_reg_weight")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = (
            int(self.argument(self.classes)),
            int(self.argument(self.per_class)) if self.per_class else 1,
            int(self.argument(self.width)),
        )
        extra = {self.per_class: self.shape[1]} if self.per_class else {}
        value = type(self).init(self.shape[0], self.shape[2], **extra)[self.key]
        attr, layout = self.table
        if layout == "columns":
            value = value.reshape(-1, self.shape[2]).t()
        setattr(self, attr, nn.Parameter(_on_default_device(value.contiguous())))

    def params(self) -> dict[str, Tensor]:
        attr, layout = self.table
        value = getattr(self, attr)
        if layout == "columns":
            value = value.t()
            if self.per_class:
                value = value.reshape(self.shape)
        return {self.key: value}

    def get_logits(self, embeddings: Tensor) -> Tensor:
        """The ``(B, C)`` class logits (:func:`pmlfunc.losses.class_logits`)."""
        return _l.class_logits(type(self).function, embeddings, self.params(), **self.options())


_CLASSES = ("num_classes", "embedding_size")
_SIZES = {"num_classes": required(), "embedding_size": required()}


class LargeMarginSoftmaxLoss(_Learnable):
    function = _l.large_margin_softmax
    init = _l.large_margin_softmax_init
    signature = (*_CLASSES, "margin", "scale")
    defaults = _SIZES
    consumed = _CLASSES


class SphereFaceLoss(LargeMarginSoftmaxLoss):
    function = _l.sphereface
    init = _l.sphereface_init


class CosFaceLoss(LargeMarginSoftmaxLoss):
    function = _l.cosface
    init = _l.cosface_init
    defaults = {**_SIZES, "margin": 0.35, "scale": 64}


class ArcFaceLoss(LargeMarginSoftmaxLoss):
    """``margin`` given in degrees, PML's (default 28.6); ``.margin`` holds PML's value in
    radians, the function's unit."""

    function = _l.arcface
    init = _l.arcface_init
    defaults = {**_SIZES, "margin": 28.6, "scale": 64}
    units = {"margin": (radians, same)}


class SubCenterArcFaceLoss(ArcFaceLoss):
    """``W`` is ``(D, C·K)``; ``get_outliers`` is PML's (indices and the dominant centres)."""

    function = _l.subcenter_arcface
    init = _l.subcenter_arcface_init
    signature = (*ArcFaceLoss.signature, "sub_centers")
    defaults = {**ArcFaceLoss.defaults, "sub_centers": 3}
    consumed = (*_CLASSES, "sub_centers")
    per_class = "sub_centers"

    def get_outliers(
        self,
        embeddings: Tensor,
        labels: Tensor,
        threshold: float = 75,
        return_dominant_centers=True,
    ):
        """PML's: the outlier rows' indices and the ``(D, C)`` dominant sub-centres (zero for a
        class without rows, where PML leaves them uninitialised); ``threshold`` in degrees."""
        weight = self.params()["weight"]
        mask, dominant = _l.subcenter_arcface_outliers(
            embeddings, labels, {"weight": weight}, threshold=math.radians(threshold)
        )
        outliers = mask.nonzero().flatten()
        if not return_dominant_centers:
            return outliers
        with torch.no_grad():
            centres = weight[torch.arange(self.shape[0]), dominant.clamp_min(0)]
            centres = centres * (dominant >= 0).unsqueeze(1).to(centres.dtype)
        return outliers, centres.t().to(embeddings.dtype)


class NormalizedSoftmaxLoss(_Learnable):
    function = _l.normalized_softmax
    init = _l.normalized_softmax_init
    signature = (*_CLASSES, "temperature")
    defaults = _SIZES
    consumed = _CLASSES


class ProxyAnchorLoss(NormalizedSoftmaxLoss):
    function = _l.proxy_anchor
    init = _l.proxy_anchor_init
    signature = (*_CLASSES, "margin", "alpha")
    table = ("proxies", "rows")
    key = "proxies"


class ProxyNCALoss(ProxyAnchorLoss):
    function = _l.proxy_nca
    init = _l.proxy_nca_init
    signature = (*_CLASSES, "softmax_scale")


class SoftTripleLoss(NormalizedSoftmaxLoss):
    """``.gamma`` holds PML's value, ``1/γ`` (the function takes ``γ``)."""

    units = {"gamma": (reciprocal, reciprocal)}
    function = _l.soft_triple
    init = _l.soft_triple_init
    signature = (*_CLASSES, "centers_per_class", "la", "gamma", "margin")
    defaults = {**_SIZES, "centers_per_class": 10}
    consumed = (*_CLASSES, "centers_per_class")
    per_class = "centers_per_class"
    table = ("fc", "columns")


class P2SGradLoss(_Learnable):
    """PML's argument order: ``(descriptors_dim, num_classes)``."""

    function = _l.p2s_grad
    init = _l.p2s_grad_init
    signature = ("descriptors_dim", "num_classes")
    defaults = {"descriptors_dim": required(), "num_classes": required()}
    consumed = signature
    width = "descriptors_dim"
    table = ("weight", "columns")
    shared = ("reducer", "embedding_regularizer", "embedding_reg_weight")


class MarginLoss(Loss):
    """``beta`` as in PML: an ``nn.Parameter`` with ``learn_beta`` (``(num_classes,)`` with
    ``num_classes``, else ``(1,)``), else a plain ``(1,)`` tensor, in no ``state_dict``."""

    function = _l.margin
    signature = ("margin", "nu", "beta", "triplets_per_anchor", "learn_beta", "num_classes")
    defaults = {"beta": 1.2, "learn_beta": False, "num_classes": None}
    consumed = ("beta", "learn_beta", "num_classes")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        learn, classes = bool(self.argument("learn_beta")), self.argument("num_classes")
        value = _l.margin_init(float(self.argument("beta")), classes if learn else None)["beta"]
        # PML's layout: a parameter only when learned, else a plain tensor (no state_dict
        # entry: a checkpoint loads strictly both ways)
        self.beta = nn.Parameter(value) if learn else value

    def params(self) -> dict[str, Tensor] | None:
        # a fixed beta is a hyper-parameter (no ν·β term), a learned one the function's params
        return {"beta": self.beta} if self.beta.requires_grad else None

    def options(self) -> dict[str, Any]:
        options = _all_triplets(super().options(), "MarginLoss")
        return options if self.beta.requires_grad else {**options, "beta": self.beta.detach()[0]}


class ManifoldLoss(Loss):
    """``proxies`` ``(K, l)``; PML draws its meta-classes from the global RNG, the function
    from its ``generator=`` (here none: its default), so values match PML's only given the same
    meta-classes."""

    function = _l.manifold
    signature = ("l", "K", "lambdaC", "alpha", "margin")
    defaults = {"l": required(), "K": 50}
    consumed = ("l", "K")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size, count = int(self.argument("l")), int(self.argument("K"))
        self.proxies = nn.Parameter(_on_default_device(_l.manifold_init(size, count)["proxies"]))

    def params(self) -> dict[str, Tensor]:
        return {"proxies": self.proxies}

    def options(self) -> dict[str, Any]:
        return {**super().options(), "generator": global_seed()}


# ---------------------------------------------------------------------------------------------
# wrappers
# ---------------------------------------------------------------------------------------------
class SelfSupervisedLoss(Loss):
    """``loss(embeddings, ref_emb)``: each row of ``embeddings`` and the same row of ``ref_emb``
    are a positive pair (:func:`pmlfunc.wrappers.self_supervised`)."""

    signature = ("loss", "symmetric")
    defaults = {"loss": required()}
    shared = ()

    def forward(self, embeddings, ref_emb=None, *args, **kwargs):
        if ref_emb is None:
            raise ValueError("SelfSupervisedLoss needs ref_emb (the second view)")
        options = self.options()
        loss = options.pop("loss")
        return _w.self_supervised(loss, embeddings, ref_emb, **options)


# PML has its wrappers under ``losses``
from .wrappers import CrossBatchMemory, MultipleLosses  # noqa: E402
