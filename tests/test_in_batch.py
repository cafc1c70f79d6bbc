"""``mega_batch_margin`` (``pmlfunc.losses.in_batch``): the float64 loop reference
(tests/reference/in_batch.py) on values and every gradient, ``chunk_size`` changing nothing,
sentence-transformers' ``MegaBatchMarginLoss`` (plain and mini-batched) on the same embeddings,
input errors, low precision. Gradcheck, ``torch.func``, compile, meta and NaN propagation are in
the conformance suite (``mega_batch_margin`` entries)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    GivenEmbeddings,
    assert_same,
    sentence_transformers_losses,
    value_and_grads,
)
from reference import in_batch as ref

import pmlfunc as pf

F64, F32 = torch.float64, torch.float32
N, D = 9, 5
EXACT = {"rtol": 1e-10, "atol": 1e-10}
mega = pf.losses.mega_batch_margin


def _pairs(n=N, seed=0, dtype=F64):
    """Anchors and their positives (near them, so some hinges are active and some are not)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, D, generator=g, dtype=F64)
    p = a + 0.9 * torch.randn(n, D, generator=g, dtype=F64)
    return a.to(dtype), p.to(dtype)


MARGINS = {
    "default": {},
    "wide": {"positive_margin": 0.95, "negative_margin": -0.2},
    "tensors": {
        "positive_margin": torch.tensor(0.6, dtype=F64),
        "negative_margin": torch.tensor(0.1, dtype=F64),
    },
}


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 50])
@pytest.mark.parametrize("margins", list(MARGINS))
@pytest.mark.parametrize("rows", [1, 2, N])
def test_equals_the_reference(rows, margins, chunk_size):
    a, p = _pairs(rows)
    kw = MARGINS[margins]
    got = value_and_grads(lambda x, y: mega(x, y, chunk_size=chunk_size, **kw), a, p)
    want = value_and_grads(lambda x, y: ref.mega_batch_margin(x, y, **kw), a, p)
    assert_same(got, want, **EXACT)


def test_chunk_size_changes_neither_the_value_nor_the_gradient():
    a, p = _pairs(seed=1)
    want = value_and_grads(mega, a, p)
    for chunk_size in (1, 2, 3, N - 1, N):
        got = value_and_grads(lambda x, y, c=chunk_size: mega(x, y, chunk_size=c), a, p)
        assert torch.equal(got[0], want[0]) and all(
            torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True)
        ), chunk_size


def test_a_one_row_batch_has_only_its_positive_term():
    a, p = _pairs(1)
    cos = torch.nn.functional.cosine_similarity(a, p)[0]
    torch.testing.assert_close(mega(a, p, positive_margin=2.0), 2.0 - cos, **EXACT)
    assert mega(a, p, positive_margin=-1.0) == 0


def test_the_hardest_negative_of_equal_maxima_is_the_first_and_takes_the_whole_gradient():
    """Rows 3 and 6 hold the same positive, which anchor 0 nearly equals: its two hardest
    negatives tie. With the margins leaving only that hinge active, the gradient goes to the
    first of them (``torch.max``'s choice, sentence-transformers'), not half to each (``amax``'s)."""
    a, p = _pairs(seed=2)
    p[6] = p[3]
    a[0] = p[3] + 0.05 * a[0]
    kw = {"positive_margin": -1.0, "negative_margin": 0.99}
    got = value_and_grads(lambda x, y: mega(x, y, **kw), a, p)
    want = value_and_grads(lambda x, y: ref.mega_batch_margin(x, y, **kw), a, p)
    assert_same(got, want, **EXACT)
    assert got[0] > 0
    grad_p = got[1][1]
    assert grad_p[3].abs().sum() > 0 and grad_p[6].abs().sum() == 0


def test_the_loss_reaches_the_positives_only_through_the_chosen_negatives():
    """A positive no anchor picks gets the gradient of its own positive term alone."""
    a, p = _pairs(seed=3)
    p[5] = -10 * a.sum(0)  # dissimilar to every anchor: nobody's hardest negative
    _, (_, grad_p) = value_and_grads(lambda x, y: mega(x, y, positive_margin=-1.0), a, p)
    assert grad_p[5].abs().sum() == 0  # its positive term is inactive too


# ----------------------------------------------------------------------------------------------
# sentence-transformers
# ----------------------------------------------------------------------------------------------
def _leaves(*tensors):
    return [t.float().detach().requires_grad_() for t in tensors]


@pytest.mark.parametrize("margins", [{}, {"positive_margin": 0.5, "negative_margin": 0.0}])
def test_equals_sentence_transformers_without_mini_batches(margins):
    losses = sentence_transformers_losses()
    a, p = _leaves(*_pairs(16, seed=4))
    model = GivenEmbeddings([a, p])
    loss = losses.MegaBatchMarginLoss(model, use_mini_batched_version=False, **margins)
    theirs = loss([{"column": 0}, {"column": 1}], None)
    ours = mega(a, p, **margins)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for g, w in zip(
        torch.autograd.grad(ours, (a, p)), torch.autograd.grad(theirs, (a, p)), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mini_batch_size", [3, 5, 16])
def test_equals_sentence_transformers_mini_batched(mini_batch_size):
    """The mini-batched version's loss and cached gradients (its step 2, ``calculate_loss``
    with ``with_backward=True`` over the mini-batches' embeddings) against ``chunk_size``."""
    losses = sentence_transformers_losses()
    a, p = _pairs(16, seed=5, dtype=F32)
    loss = losses.MegaBatchMarginLoss.__new__(losses.MegaBatchMarginLoss)
    torch.nn.Module.__init__(loss)  # its constructor inspects a real model's first module
    loss.positive_margin, loss.negative_margin = 0.8, 0.3
    loss.mini_batch_size = mini_batch_size
    reps = [[t.detach().clone().requires_grad_() for t in x.split(mini_batch_size)] for x in (a, p)]
    theirs = loss.calculate_loss(reps, with_backward=True)
    theirs_grads = [torch.cat([r.grad for r in column]) for column in reps]
    x, y = _leaves(a, p)
    ours = mega(x, y, chunk_size=mini_batch_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(ours, (x, y)), theirs_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# input errors, low precision
# ----------------------------------------------------------------------------------------------
def _errors():
    a, p = _pairs()
    yield "rows", lambda: mega(a, p[:3]), ValueError, "mega_batch_margin pairs"
    yield "width", lambda: mega(a, p[:, :2]), ValueError, "positives"
    yield "dtype", lambda: mega(a, p.float()), TypeError, "positives"
    yield "device", lambda: mega(a, p.to("meta")), ValueError, "positives"
    yield "anchors", lambda: mega(a.long(), p), TypeError, "anchors"
    yield "anchors-1d", lambda: mega(a[0], p), ValueError, "anchors"
    yield "positives-list", lambda: mega(a, p.tolist()), TypeError, "positives"
    yield "chunk", lambda: mega(a, p, chunk_size=0), ValueError, "chunk_size"
    yield "chunk-float", lambda: mega(a, p, chunk_size=2.0), ValueError, "chunk_size"
    yield "margin", lambda: mega(a, p, positive_margin="0.8"), TypeError, "positive_margin"
    yield (
        "margin-1d",
        lambda: mega(a, p, negative_margin=torch.ones(2)),
        ValueError,
        "negative_margin",
    )


ERRORS = {name: (call, error, match) for name, call, error, match in _errors()}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_raises_naming_the_argument(name):
    call, error, match = ERRORS[name]
    with pytest.raises(error, match=rf"^{match}\b"):
        call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_embeddings_give_a_float32_loss_near_float64(dtype):
    a, p = _pairs(dtype=dtype)
    value, grads = value_and_grads(lambda x, y: mega(x, y, chunk_size=4), a, p)
    assert value.dtype == F32 and torch.isfinite(value)
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(value.double(), mega(a.double(), p.double()), rtol=1e-5, atol=1e-5)
