r"""Loss transforms: a function of a loss that returns a loss with the same signature.

Retrieval and embedding models are trained with wrappers around a base loss; here they are
plain functions that compose with each other and with ``pf.distributed``, ``pf.chunked`` and
``torch.func``:

==========================  ================================================================
transform                   value of the returned loss
==========================  ================================================================
:func:`matryoshka`          ``Σ_k w_k · loss(e[..., :d_k])``: every embedding argument cut to
                            each of the nested widths ``dims`` (Kusupati et al., 2022)
:func:`adaptive_layers`     ``w_last · loss(e_L) + Σ_{l<L} [w_prior · ω(l) / n · loss(e_l) +
                            λ · T · KL(softmax(e_L / T) ‖ softmax(e_l / T))]`` over per-layer
                            embeddings (2DMSE, Li et al., 2024)
==========================  ================================================================

*Embedding arguments* are the loss's parameters named in :data:`EMBEDDING_ARGS` (``embeddings``,
``ref_emb``, ``emb_a``, ``emb_b``, ``anchors``, ``positives``, ``negatives``) that the call gives
as tensors; everything else (labels, params, a guide model's embeddings, hyper-parameters) reaches
every inner call unchanged. ``embedding_args=`` names others for a loss of your own.

The transforms are picklable objects (a ``functools.partial`` of a module-level loss inside one
pickles too), so ``pf.testing.check_distributed`` and spawned ranks take them. Under DDP put the
distributed objective inside: ``matryoshka(pf.distributed.global_objective(pf.losses.clip),
dims)`` (each width's call gathers, or rings, its own prefix). 2D Matryoshka is the composition
``adaptive_layers(matryoshka(loss, dims))``: a matryoshka loss on every layer, the KL term on the
full width.

Cost of :func:`matryoshka`: where the tiled engine runs the call (``ntxent``, ``supcon``,
``clip``, ``siglip``, dense or with ``chunk_size``, in one process), one walk over the tiles
computes every width's logits from one blocked product: the prefix products are cumulative sums
of block products, ``C_k = Σ_{j ≤ k} x_j y_jᵀ``, a normalised prefix's logits a rank-1 rescale
of them, and the backward sums the widths' ``∂S`` from the widest down and multiplies each block
once (``pmlfunc.losses._tiled.run_nested``). The products of all the widths then cost those
of one full-width call (the naive sum's cost ``Σ_k d_k / D`` as much: 1.94 for ``(D, D/2, …,
D/16)``); each width's elementwise work remains. Any other batch loss on ``cosine()`` or
``dot()`` (a pair or triplet loss, or the engine's losses with a miner's tuples or an embedding
regularizer) gets every width's whole matrix from the same blocked product as ``mat=``
(``prefix_matrices``). Any other loss or call (a Euclidean distance, ``mat=``, the retrieval loss,
``pf.distributed.global_objective``, the ring) is called once per width. :func:`adaptive_layers`
calls the loss once per layer.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _global
from ._ops import scalar_tensor
from .distances import _Dot
from .losses._batch import spec_of
from .losses._tiled import nested_call, prefix_matrices, run_nested

__all__ = ["EMBEDDING_ARGS", "adaptive_layers", "matryoshka"]

EMBEDDING_ARGS = ("embeddings", "ref_emb", "emb_a", "emb_b", "anchors", "positives", "negatives")


@dataclass(frozen=True)
class _Slots:
    """Where a loss's embedding arguments sit in a call: their positional index (``None``:
    keyword-only) by name, read once from the loss's signature."""

    names: tuple[str, ...]
    positions: tuple[int | None, ...]

    @staticmethod
    def of(loss_fn: Callable[..., Tensor], names: Sequence[str] | None) -> _Slots:
        try:
            params = inspect.signature(loss_fn).parameters
        except (TypeError, ValueError) as err:  # a builtin without a signature
            raise TypeError(f"cannot read the signature of {loss_fn!r}: {err}") from err
        given = EMBEDDING_ARGS if names is None else tuple(names)
        # a loss taking **kwargs (the batch losses' ref_emb) may get any of them by keyword
        open_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
        found = [n for n in given if n in params or open_kw]
        if not found:
            raise ValueError(
                f"{_name(loss_fn)} takes none of the embedding arguments {given} (its parameters: "
                f"{', '.join(params)}); name them with embedding_args="
            )
        order = [
            n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return _Slots(tuple(found), tuple(order.index(n) if n in order else None for n in found))

    def read(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The embedding arguments this call gives (a value that is ``None`` is left out)."""
        out = {}
        for name, pos in zip(self.names, self.positions, strict=True):
            value = (
                kwargs.get(name) if name in kwargs or pos is None or pos >= len(args) else args[pos]
            )
            if value is not None:
                out[name] = value
        return out

    def replace(
        self, args: tuple, kwargs: dict[str, Any], values: Mapping[str, Any]
    ) -> tuple[tuple, dict[str, Any]]:
        """The call with the given embedding arguments replaced."""
        args_l, kwargs = list(args), dict(kwargs)
        for name, pos in zip(self.names, self.positions, strict=True):
            if name not in values:
                continue
            if name in kwargs or pos is None or pos >= len(args_l):
                kwargs[name] = values[name]
            else:
                args_l[pos] = values[name]
        return tuple(args_l), kwargs


def _name(fn: Callable) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", type(inner).__name__)


def _weights(
    weights: Sequence[float | Tensor] | Tensor | None, n: int, name: str
) -> Sequence[float | Tensor] | Tensor:
    """One weight per entry: all 1 by default; a 1-d tensor is kept whole (indexed at each
    call, so a learnable one gets a fresh graph every step)."""
    if weights is None:
        return (1.0,) * n
    if isinstance(weights, Tensor):
        if weights.ndim != 1 or weights.shape[0] != n:
            raise ValueError(
                f"{name} must have one weight per entry ({n}), got shape {tuple(weights.shape)}"
            )
        return weights
    weights = tuple(weights)
    if len(weights) != n:
        raise ValueError(f"{name} must have one weight per entry ({n}), got {len(weights)}")
    for w in weights:
        if not isinstance(w, Tensor):
            _checks.number(w, name, nonnegative=True)
    return weights


@dataclass(frozen=True)
class _Matryoshka:
    loss_fn: Callable[..., Tensor]
    dims: tuple[int, ...]
    weights: Sequence[float | Tensor] | Tensor
    normalize: bool
    slots: _Slots

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        given = self.slots.read(args, kwargs)
        if not given:
            raise ValueError(
                f"matryoshka({_name(self.loss_fn)}): the call gives none of its embedding "
                f"arguments {self.slots.names}"
            )
        width = None
        for name, value in given.items():
            # (no rows: the loss's to refuse, or global_objective's to take on an empty rank)
            plain = value.ndim == 2 and value.shape[0] > 0
            x = _checks.embeddings(value, name) if plain else _checks.tensor(value, name)
            if width is None:
                width = x.shape[-1]
            elif x.shape[-1] != width:
                raise ValueError(
                    f"matryoshka: every embedding argument must have one width; {name} has "
                    f"{x.shape[-1]}, {next(iter(given))} has {width}"
                )
        assert width is not None
        if max(self.dims) > width:
            raise ValueError(
                f"matryoshka: dims {list(self.dims)} exceed the embeddings' width {width}"
            )
        one = self._one_walk(args, kwargs)
        if one is not None:
            return one
        mats = self._one_product(given, args, kwargs)
        total: Tensor | None = None
        for k, d in enumerate(self.dims):
            w = self.weights[k]
            cut = {n: _prefix(v, d, self.normalize) for n, v in given.items()}
            a, kw = self.slots.replace(args, kwargs, cut)
            if mats is not None:
                kw["mat"] = mats[k]
            term = self.loss_fn(*a, **kw) * w
            total = term if total is None else total + term
        assert total is not None
        return total

    def _one_walk(self, args: tuple, kwargs: Mapping[str, Any]) -> Tensor | None:
        """The loss from one blocked product (:func:`pmlfunc.losses._tiled.run_nested`) where
        the tiled engine runs the call, else ``None``."""
        call = nested_call(self.loss_fn, args, kwargs, repr(self))
        if call is None:
            return None
        order = sorted(range(len(self.dims)), key=self.dims.__getitem__)
        x, w = call.x, self.weights
        if isinstance(w, Tensor):
            weights = w.to(x.dtype)[order]
        else:
            weights = torch.stack([scalar_tensor(w[i], x) for i in order])
        return run_nested(call, tuple(self.dims[i] for i in order), weights, self.normalize)

    def _one_product(
        self, given: Mapping[str, Tensor], args: tuple, kwargs: Mapping[str, Any]
    ) -> list[Tensor] | None:
        """Each width's matrix (in ``self.dims``' order), all from one blocked product
        (:func:`pmlfunc.losses._tiled.prefix_matrices`), where the call is a batch loss on a
        matmul similarity (``cosine()``, ``dot()``) given ``embeddings`` (and ``ref_emb``) and
        no ``mat=``; else ``None``."""
        if not set(given) <= {"embeddings", "ref_emb"}:
            return None
        try:  # a partial binding positions, or a call the loss refuses: left to the loss
            spec, bound = spec_of(self.loss_fn)
            if spec is None:
                return None
            call = spec.bind_call(args, {**bound, **kwargs})
        except (TypeError, ValueError):
            return None
        distance = call.distance
        if not isinstance(distance, _Dot) or call.mat is not None or call.embeddings.ndim != 2:
            return None
        cd = _checks.compute_dtype(call.embeddings.dtype)
        x = call.embeddings.to(cd)
        y = None if call.ref_emb is None else call.ref_emb.to(cd)
        order = sorted(range(len(self.dims)), key=self.dims.__getitem__)
        unit = self.normalize or distance.normalize
        # unbind: one node, whose backward stacks the widths' gradients (a select a width
        # would fill a zero (K, N, M) buffer each)
        ascending = prefix_matrices(x, y, tuple(self.dims[i] for i in order), unit).unbind(0)
        mats: list[Tensor] = [ascending[0]] * len(order)
        for rank, i in enumerate(order):
            mats[i] = ascending[rank]
        return mats

    @property
    def __signature__(self) -> inspect.Signature:  # the base loss's: transforms compose
        return inspect.signature(self.loss_fn)

    def __repr__(self) -> str:
        return f"matryoshka({_name(self.loss_fn)}, dims={list(self.dims)})"


def _prefix(x: Tensor, d: int, normalize: bool) -> Tensor:
    x = x[..., :d]
    if not normalize:
        return x
    return F.normalize(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=-1).to(
        x.dtype
    )


def matryoshka(
    loss_fn: Callable[..., Tensor],
    dims: Sequence[int],
    weights: Sequence[float | Tensor] | Tensor | None = None,
    *,
    normalize: bool = False,
    embedding_args: Sequence[str] | None = None,
) -> Callable[..., Tensor]:
    r"""Matryoshka representation learning: the loss summed over nested embedding widths.

    ``matryoshka(loss, dims, weights)(*args, **kwargs) = Σ_k w_k · loss(*args', **kwargs')``
    where every embedding argument (``embeddings``, ``ref_emb``, ``emb_a``/``emb_b``,
    ``anchors``/``positives``/``negatives``; :data:`EMBEDDING_ARGS`) is cut to its first
    ``dims[k]`` features, ``e[..., :d_k]``, and everything else is passed unchanged. Trained this
    way, the first ``d_k`` features of an embedding are a usable embedding on their own
    (Kusupati et al., "Matryoshka Representation Learning", NeurIPS 2022).

    Args:
        loss_fn: any pmlfunc loss (or a ``functools.partial`` of one, or a function with
            parameters named as above): ``pf.losses.ntxent``, ``pf.losses.clip``,
            ``pf.losses.multiple_negatives_ranking``, ``pf.distributed.global_objective(...)``.
        dims: the widths, positive ints without repeats, each at most the embeddings' width
            (checked at the call); e.g. ``(768, 512, 256, 128, 64)``.
        weights: one non-negative weight per width (floats or 0-d tensors, a learnable weight
            included); default all 1 (sentence-transformers' ``MatryoshkaLoss`` default).
        normalize: L2-normalise each prefix before the loss, as sentence-transformers' ``shrink``
            does; the same for losses with a cosine similarity, different for ``dot()`` ones.
            Default ``False``: the plain prefix.
        embedding_args: the names of the arguments to cut, for a loss of your own.

    The engine's losses (``ntxent``/``supcon`` with labels, ``clip``, ``siglip``, dense or
    tiled) get every width from one blocked product, forward and backward: the products of a
    full-width call for all the widths, memory a tile a width (``O(K × chunk × M)``); equal to
    the sum of the calls to float64 rounding (rows or prefixes of norm below ``F.normalize``'s
    ``ε = 1e-12`` aside: the engine rescales the full-width unit rows). Other batch losses on
    ``cosine()``/``dot()`` get each width's matrix from one blocked product as ``mat=``; the
    rest run a width at a time. The one-product gradient is first-order (as the tiled
    engine's).

    Returns:
        A function with ``loss_fn``'s signature.

    Raises:
        ValueError: empty or repeated ``dims``, a width below 1 or above the embeddings', a
            weight count that differs, embedding arguments of different widths, a call with none.

    Example:
        >>> emb, labels = torch.randn(16, 32), torch.arange(16) // 4
        >>> nested = matryoshka(pf.losses.ntxent, dims=(32, 16, 8))
        >>> loss = nested(emb, labels, temperature=0.1)
        >>> naive = sum(pf.losses.ntxent(emb[:, :d], labels, temperature=0.1) for d in (32, 16, 8))
        >>> torch.allclose(loss, naive)
        True
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    dims = tuple(dims)
    if not dims:
        raise ValueError("dims must list at least one width")
    dims = tuple(_checks.integer(d, "dims") for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims must not repeat a width, got {list(dims)}")
    return _Matryoshka(
        loss_fn,
        dims,
        _weights(weights, len(dims), "weights"),
        bool(normalize),
        _Slots.of(loss_fn, embedding_args),
    )


LAYER_WEIGHTINGS = ("uniform", "log", "linear")


def _layer_weight(weighting: str | Callable[[int], float], index: int) -> float:
    if callable(weighting):
        return float(weighting(index))
    if weighting == "log":
        return 1.0 / (1.0 + math.log(1 + index))
    if weighting == "linear":
        return 1.0 / (1 + index)
    return 1.0


@dataclass(frozen=True)
class _AdaptiveLayers:
    loss_fn: Callable[..., Tensor]
    layer_weighting: str | Callable[[int], float]
    last_layer_weight: float
    prior_layers_weight: float
    kl_weight: float
    temperature: float
    slots: _Slots

    def __call__(
        self, *args: Any, layer_indices: Sequence[int] | None = None, **kwargs: Any
    ) -> Tensor:
        given = self.slots.read(args, kwargs)
        layered = {n: v for n, v in given.items() if isinstance(v, (list, tuple))}
        if not layered:
            raise ValueError(
                f"adaptive_layers({_name(self.loss_fn)}): give at least one embedding argument "
                f"({', '.join(self.slots.names)}) as a sequence of per-layer tensors, the last "
                "layer last"
            )
        counts = {n: len(v) for n, v in layered.items()}
        n_layers = next(iter(counts.values()))
        if n_layers == 0 or any(c != n_layers for c in counts.values()):
            raise ValueError(
                f"adaptive_layers: every layered argument must hold the same, non-zero number of layers, got {counts}"
            )
        indices = tuple(range(n_layers)) if layer_indices is None else tuple(layer_indices)
        if len(indices) != n_layers or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices
        ):
            raise ValueError(
                f"layer_indices must give a non-negative int per layer ({n_layers}), got {layer_indices!r}"
            )

        def layer_loss(layer: int) -> Tensor:
            a, kw = self.slots.replace(args, kwargs, {n: v[layer] for n, v in layered.items()})
            return self.loss_fn(*a, **kw)

        total = layer_loss(n_layers - 1) * self.last_layer_weight
        prior = n_layers - 1
        if prior == 0:
            return total
        final = kl = None
        if self.temperature > 0 and self.kl_weight != 0:
            final = torch.cat([_rows(v[-1], n) for n, v in layered.items()]).detach()
            kl = _layer_kl_of(self.loss_fn)
        for layer in range(prior):
            w = _layer_weight(self.layer_weighting, indices[layer])
            total = total + layer_loss(layer) * (w / prior * self.prior_layers_weight)
            if kl is not None:
                student = torch.cat([_rows(v[layer], n) for n, v in layered.items()])
                term = kl(student, final, temperature=self.temperature)
                total = total + term * (self.temperature * self.kl_weight)
        return total

    @property
    def __signature__(self) -> inspect.Signature:  # the base loss's, plus layer_indices
        sig = inspect.signature(self.loss_fn)
        params = list(sig.parameters.values())
        extra = inspect.Parameter("layer_indices", inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
        return sig.replace(parameters=[*params[:at], extra, *params[at:]])

    def __repr__(self) -> str:
        return f"adaptive_layers({_name(self.loss_fn)}, layer_weighting={self.layer_weighting!r})"


@_global.reduces_statistics("student", "teacher")
def _layer_kl(student: Tensor, teacher: Tensor, *, temperature: float) -> Tensor:
    """``KL(softmax(teacher / T) ‖ softmax(student / T))`` of each row, averaged over the rows
    (``F.kl_div``'s ``batchmean``; ``teacher`` read as a constant). The sum and the number of
    rows are :func:`~pmlfunc._global.total`'s: under a global objective, the global batch's."""
    n = torch.full((), student.shape[0], dtype=student.dtype, device=student.device)
    rows = _global.total(n)
    kl = F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.softmax(teacher.detach() / temperature, dim=-1),
        reduction="sum",
    )
    return _global.total(kl) / rows


def _layer_kl_of(loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """:func:`_layer_kl`, over the same ranks as ``loss_fn`` where that is a
    :func:`~pmlfunc.distributed.global_objective` (inside a :func:`matryoshka` too): the KL
    term is the transform's, outside the loss, and its mean must be the global batch's as the
    loss is (each rank's own rows' mean gave every rank another loss, and unequal ranks wrong
    gradients)."""
    from . import distributed  # (distributed imports the losses this module's callers use)

    while isinstance(loss_fn, _Matryoshka):
        loss_fn = loss_fn.loss_fn
    options = distributed.objective_options(loss_fn)
    if options is None:
        return _layer_kl
    group, timeout = options
    return distributed.global_objective(_layer_kl, group=group, timeout=timeout)


def _rows(x: Tensor, name: str) -> Tensor:
    """A layer's rows as ``(rows, D)`` in the compute dtype (float32 for half types)."""
    x = _checks.tensor(x, name)
    return x.reshape(-1, x.shape[-1]).to(_checks.compute_dtype(x.dtype))


def adaptive_layers(
    loss_fn: Callable[..., Tensor],
    *,
    layer_weighting: str | Callable[[int], float] = "uniform",
    last_layer_weight: float = 1.0,
    prior_layers_weight: float = 1.0,
    kl_weight: float = 1.0,
    temperature: float = 0.3,
    embedding_args: Sequence[str] | None = None,
) -> Callable[..., Tensor]:
    r"""Adaptive layers (2DMSE): the loss on every layer's embeddings, each earlier layer also
    pulled towards the last one.

    The returned function takes the loss's arguments with one or more embedding arguments given
    as sequences of per-layer tensors ``(e_0, ..., e_{L-1})``, the last layer last (the others,
    e.g. a fixed reference set, as usual), and returns

    .. math::

        w_{last} · ℓ(e_{L-1}) + \sum_{l < L-1} \Big[\frac{w_{prior} · ω(i_l)}{L-1} ℓ(e_l)
        + λ · T · \mathrm{KL}\big(\mathrm{softmax}(e_{L-1}/T) \,\|\, \mathrm{softmax}(e_l/T)\big)\Big]

    where ``ℓ`` is the base loss on that layer's embeddings, ``i_l`` the layer's index in the
    model (``layer_indices=``, default ``0, 1, ...``) and ``ω`` the layer weighting: ``"uniform"``
    1 (2DMSE, Starbucks), ``"log"`` ``1 / (1 + ln(1 + i))`` (ESE), ``"linear"`` ``1 / (1 + i)``,
    or a callable of ``i``. The KL term is sentence-transformers' ``AdaptiveLayerLoss`` one: a
    softmax over the features of every row of every layered argument (rows concatenated,
    ``batchmean``), the last layer as a stop-gradient teacher; ``temperature=0`` or
    ``kl_weight=0`` drops it. Sampling layers per step (sentence-transformers'
    ``n_layers_per_step``) is the caller's: pass the sampled layers and their ``layer_indices``.
    With a matryoshka loss inside (``adaptive_layers(matryoshka(loss, dims))``) this is 2D
    Matryoshka; the KL term then reads the full width.

    Args:
        loss_fn: the base loss (any pmlfunc loss, a :func:`matryoshka` one included).
        layer_weighting: ``"uniform"``, ``"log"``, ``"linear"`` or ``callable(index) -> float``.
        last_layer_weight: ``w_last``.
        prior_layers_weight: ``w_prior``, shared by the earlier layers' losses (averaged over them).
        kl_weight: ``λ``.
        temperature: ``T`` (> 0; 0 turns the KL term off).
        embedding_args: the names of the layered arguments, for a loss of your own.

    Returns:
        A function with ``loss_fn``'s signature plus the keyword-only ``layer_indices``.

    References: Li et al., "2D Matryoshka Sentence Embeddings" (2DMSE), 2024; Li and Li, "ESE:
    Espresso Sentence Embeddings", 2024 (``"log"``); Zhuang et al., "Starbucks: Improved
    Training for 2D Matryoshka Embeddings", 2024; sentence-transformers' ``AdaptiveLayerLoss``
    (the KL term).

    Example:
        >>> layers = [torch.randn(16, 8) for _ in range(4)]  # e.g. each layer's pooled output
        >>> labels = torch.arange(16) // 4
        >>> loss = adaptive_layers(pf.losses.supcon, layer_weighting="log")(layers, labels)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not callable(layer_weighting) and layer_weighting not in LAYER_WEIGHTINGS:
        raise ValueError(
            f"layer_weighting must be one of {LAYER_WEIGHTINGS} or a callable, got {layer_weighting!r}"
        )
    for value, name in (
        (last_layer_weight, "last_layer_weight"),
        (prior_layers_weight, "prior_layers_weight"),
        (kl_weight, "kl_weight"),
        (temperature, "temperature"),
    ):
        _checks.number(value, name, nonnegative=True)
    return _AdaptiveLayers(
        loss_fn,
        layer_weighting,
        float(last_layer_weight),
        float(prior_layers_weight),
        float(kl_weight),
        float(temperature),
        _Slots.of(loss_fn, embedding_args),
    )
