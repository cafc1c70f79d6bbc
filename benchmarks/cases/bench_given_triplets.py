"""Given triplets: ``triplet_margin`` on listed ``(a, p, n)`` triplets beside ``F.triplet_margin_loss``.

A loss given its triplets reads ``2T`` distances; ``torch.nn.functional.triplet_margin_loss``
computes them from the ``T`` row differences, and so does pmlfunc when the tuple is small
against the ``B × M`` matrix (``pmlfunc.losses.triplets.row_path``). Three groups, each with
``pmlfunc`` (the reference: every other member is checked equal to it, loss and gradient, rtol
1e-4 in float32, before it is timed), ``torch`` (``F.triplet_margin_loss``), ``pml`` (PML 2.9.0's
``TripletMarginLoss`` given the same triplets) and the matmul ``floor``:

===============================  ==================================================================
group                            triplets and settings
===============================  ==================================================================
``given-triplets``               ``B`` triplets on the suite's ``B`` rows: ``a`` every row, ``p``
                                 the next row of its class, ``n`` the same place in the next class;
                                 raw Euclidean distance, the mean (``F.triplet_margin_loss``'s
                                 defaults); ``torch`` takes ``e`` itself as the anchors (``a`` is
                                 every row) and gathers ``e[p]``, ``e[n]``
``packaged-triplets``            ``embeddings_already_packaged_as_triplets`` of the first
                                 ``3·⌊B/3⌋`` rows (``⌊B/3⌋`` triplets: ``--batch-size 1536`` is
                                 512 triplets); raw distance, the mean; ``torch`` takes the three
                                 strided views ``e[0::3]``, ``e[1::3]``, ``e[2::3]``
``packaged-triplets-normalized`` the same triplets with PML's defaults (rows L2-normalised, the
                                 mean over the triplets with a positive loss: ``avg_nonzero``);
                                 ``torch`` is ``F.normalize`` then ``F.triplet_margin_loss``
                                 (``reduction="none"``) and that mean
===============================  ==================================================================

Every member uses margin 0.2 (``benchmarks.common.TRIPLET_MARGIN``). ``F.triplet_margin_loss``
adds ``eps = 1e-6`` to each difference before its norm; the losses agree to ~1e-6 relative.
Timed, from the command line (B = 512 and 2,048 triplets on 3B rows, D = 128 and 512)::

    python -m benchmarks.run --case packaged-triplets,packaged-triplets-normalized \\
        --batch-size 1536 --dimensions 128 --repeats 10 --warmup 5 --threads 1
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import reducers as pml_reducers

import pmlfunc as pf

from .. import common as C
from . import (
    DEVICE,
    FLOOR,
    SAMPLES_PER_CLASS,
    THREADS,
    Case,
    Fn,
    Member,
    by_name,
    inputs,
    make_step,
    params,
    plain,
    record,
    reference_mismatch,
    reference_rtol,
)

MARGIN = C.TRIPLET_MARGIN


def given_triplets(batch: int, samples_per_class: int = SAMPLES_PER_CLASS, device=None):
    """``(a, p, n)`` of ``given-triplets``: every row, the next row of its class (cyclic) and
    the row at the same place in the next class (the suite's labels are contiguous classes of
    ``samples_per_class``)."""
    a = torch.arange(batch, device=device)
    start = a // samples_per_class * samples_per_class
    p = start + (a - start + 1) % samples_per_class
    n = (a + samples_per_class) % batch
    return a, p, n


def _packaged(e: torch.Tensor) -> torch.Tensor:
    """The first ``3·⌊B/3⌋`` rows (``e`` itself when ``B`` is a multiple of 3)."""
    rows = 3 * (e.shape[0] // 3)
    return e if rows == e.shape[0] else e[:rows]


# --- given-triplets --------------------------------------------------------------------------


def _pf_given(e, y):
    tup = given_triplets(e.shape[0], device=e.device)
    dist, mean = pf.distances.lp(normalize=False), pf.reducers.mean()

    def fn(e, y):
        return pf.losses.triplet_margin(
            e, y, margin=MARGIN, indices_tuple=tup, distance=dist, reducer=mean
        )

    return fn, []


def _torch_given(e, y):
    _, p, n = given_triplets(e.shape[0], device=e.device)

    def fn(e, y):
        return F.triplet_margin_loss(e, e.index_select(0, p), e.index_select(0, n), margin=MARGIN)

    return fn, []


def _pml_raw() -> Fn:
    return pml_losses.TripletMarginLoss(
        margin=MARGIN,
        distance=pml_distances.LpDistance(normalize_embeddings=False),
        reducer=pml_reducers.MeanReducer(),
    )


def _pml_given(e, y):
    tup = given_triplets(e.shape[0], device=e.device)
    loss = _pml_raw()
    return (lambda e, y: loss(e, y, tup)), []


# --- packaged-triplets -----------------------------------------------------------------------


def _pf_packaged(**kw):
    def fn(e, y):
        v = _packaged(e)
        mined = pf.miners.embeddings_already_packaged_as_triplets(v)
        return pf.losses.triplet_margin(v, margin=MARGIN, indices_tuple=mined, **kw)

    return fn


def _torch_packaged(e, y):
    v = _packaged(e)
    return F.triplet_margin_loss(v[0::3], v[1::3], v[2::3], margin=MARGIN)


def _torch_packaged_normalized(e, y):
    v = F.normalize(_packaged(e), dim=-1)
    losses = F.triplet_margin_loss(v[0::3], v[1::3], v[2::3], margin=MARGIN, reduction="none")
    return losses.sum() / (losses > 0).sum().clamp_min(1)


def _pml_packaged(loss: Fn) -> Fn:
    def fn(e, y):
        v = _packaged(e)
        a = torch.arange(0, v.shape[0], 3, device=v.device)
        return loss(v, torch.arange(v.shape[0], device=v.device), (a, a + 1, a + 2))

    return fn


def _case(name: str, members: dict[str, Member], **extra) -> Case:
    return Case(
        name, {**members, "floor": FLOOR}, extra={"margin": MARGIN, **extra}, reference="pmlfunc"
    )


CASES = by_name(
    _case(
        "given-triplets",
        {"pmlfunc": Member(_pf_given), "torch": Member(_torch_given), "pml": Member(_pml_given)},
        triplets="B",
        distance="lp(normalize=False)",
        reducer="mean",
    ),
    _case(
        "packaged-triplets",
        {
            "pmlfunc": plain(
                lambda: _pf_packaged(
                    distance=pf.distances.lp(normalize=False), reducer=pf.reducers.mean()
                )
            ),
            "torch": plain(lambda: _torch_packaged),
            "pml": plain(lambda: _pml_packaged(_pml_raw())),
        },
        triplets="B // 3",
        distance="lp(normalize=False)",
        reducer="mean",
    ),
    _case(
        "packaged-triplets-normalized",
        {
            "pmlfunc": plain(_pf_packaged),
            "torch": plain(lambda: _torch_packaged_normalized),
            "pml": plain(lambda: _pml_packaged(pml_losses.TripletMarginLoss(margin=MARGIN))),
        },
        triplets="B // 3",
        distance="lp()",
        reducer="avg_nonzero",
    ),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_given_triplets(benchmark, request, case: str, impl: str) -> None:
    """One member, first checked equal to the group's pmlfunc member (loss and gradient)."""
    spec = CASES[case]
    member = spec.members[impl]
    emb, labels = inputs()
    step = make_step(member, emb, labels)
    with C.set_threads(THREADS):
        bad = reference_mismatch(spec, impl, emb, labels, reference_rtol(emb.dtype))
    assert bad is None, f"{case} at batch {emb.shape[0]}: {bad}"
    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        out = C.measure(benchmark, request, step, DEVICE)
        record(benchmark, emb, spec, impl, out)
    grad = step.last_grad  # type: ignore[attr-defined]
    assert out.ndim == 0 and torch.isfinite(out), f"{case}/{impl}: loss {out}"
    assert torch.isfinite(grad).all() and grad.shape == emb.shape, f"{case}/{impl}: gradient"
