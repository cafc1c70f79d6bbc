"""Input checks and the distance matrix shared by losses and miners."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks
from .distances import Distance
from .tuples import check_mined, check_tuple, is_mined

__all__ = ["matrix", "validate"]


def validate(
    embeddings: Tensor,
    labels: Tensor | None,
    *,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
):
    """Check a loss's or a miner's inputs (shapes, dtypes, devices; index values as
    :func:`~pmlfunc.tuples.check_tuple` and :func:`~pmlfunc.tuples.check_mined` do) and return
    ``indices_tuple`` ready to use: a PML tuple with its negative indices wrapped, a miner's
    result as it is."""
    _checks.embeddings(embeddings)
    b = embeddings.shape[0]
    if labels is not None:
        _checks.labels(labels, b, embeddings.device)
    elif indices_tuple is None:
        raise ValueError("labels and indices_tuple cannot both be None")
    if ref_emb is not None:
        _checks.embeddings(ref_emb, "ref_emb")
        _checks.same_space(embeddings, ref_emb)
        if ref_labels is None and indices_tuple is None:
            raise ValueError(
                "ref_emb was given without ref_labels; pass ref_labels (one label per ref_emb row)"
            )
        if ref_labels is not None:
            if labels is None:
                raise ValueError("ref_labels was given but labels is None")
            _checks.labels(ref_labels, ref_emb.shape[0], ref_emb.device, "ref_labels", "ref_emb")
    elif ref_labels is not None:
        raise ValueError("ref_labels was given without ref_emb")
    if indices_tuple is not None:
        m = b if ref_emb is None else ref_emb.shape[0]
        check = check_mined if is_mined(indices_tuple) else check_tuple
        indices_tuple = check(indices_tuple, (b, m))
    return indices_tuple


def matrix(
    embeddings: Tensor,
    ref_emb: Tensor | None,
    mat: Tensor | None,
    distance: Distance,
    rows: tuple[int, int] | None = None,
    anchors: Tensor | None = None,
    *,
    needs_grad: bool = True,
    ties: bool = True,
    scale: float | Tensor | None = None,
) -> Tensor:
    """The ``(B, M)`` matrix of ``distance`` in the compute dtype: ``mat`` when given (checked),
    else computed (for the anchor ``rows`` only, when given; ``anchors`` may carry those rows as
    a tensor of their own, so that their gradient is taken separately).

    ``needs_grad``: a given ``mat`` without an autograd graph is rejected while the embeddings
    require gradients (the loss would silently give the encoder none). ``ties`` and ``scale``:
    passed on to :meth:`~pmlfunc.distances.Distance.matrix` (exact ties among duplicated rows;
    ``scale · matrix``, folded into the product where the distance can).
    """
    b = embeddings.shape[0]
    m = b if ref_emb is None else ref_emb.shape[0]
    r0, r1 = (0, b) if rows is None else rows
    cd = _checks.compute_dtype(embeddings.dtype)
    if mat is not None:
        if rows is not None:
            raise ValueError(
                "mat cannot be combined with chunking: each chunk computes its own rows"
            )
        if not isinstance(mat, Tensor):
            raise TypeError(f"mat must be a tensor, got {type(mat).__name__}")
        if tuple(mat.shape) != (b, m):
            raise ValueError(
                f"mat must have shape (batch_size, ref_size) = {(b, m)}, got {tuple(mat.shape)}"
            )
        if not mat.dtype.is_floating_point:
            raise TypeError(f"mat must be floating point, got {mat.dtype}")
        if mat.device != embeddings.device:
            raise ValueError(f"mat is on {mat.device} but embeddings are on {embeddings.device}")
        if (
            needs_grad
            and torch.is_grad_enabled()
            and (embeddings.requires_grad or (ref_emb is not None and ref_emb.requires_grad))
            and not mat.requires_grad
        ):
            raise ValueError(
                "mat has no autograd graph but the embeddings require gradients: compute mat "
                "from the embeddings with gradients enabled (the loss's gradient flows through "
                "mat only), or detach the embeddings"
            )
        if scale is not None:
            raise ValueError("scale applies to a matrix computed here, not to a given mat")
        mat = mat.to(cd)
    elif rows is None:
        mat = distance.matrix(embeddings, ref_emb, ties=ties, scale=scale)
    else:
        if anchors is None:
            anchors = embeddings[r0:r1]
        elif tuple(anchors.shape) != (r1 - r0, embeddings.shape[1]):
            raise ValueError(
                f"anchors must be the rows {rows} of embeddings, got {tuple(anchors.shape)}"
            )
        if ref_emb is None:
            mat = distance.rows(anchors, embeddings, ties=ties, scale=scale)
        else:
            mat = distance.matrix(anchors, ref_emb, ties=ties, scale=scale)
    return mat
