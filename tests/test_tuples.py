"""PML index tuples: one validation (``pmlfunc.tuples.check_tuple``) for every reader.

Negative indices wrap as PML and Python index (``-1`` is the last row); an index outside
``[-rows, rows)`` raises an ``IndexError`` naming the tuple's position, its role, the offending
element and the valid range (eager CPU); index dtypes other than int32/int64 are a
``TypeError``. Regressions of issue 16: before, ``-1`` landed in another row and 16 in a batch
of 16 silently counted as a different pair (the flattened ``a·M + c`` cell).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, value_and_grads
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

B, D = 16, 4


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(B, D, generator=gen, dtype=torch.float64), torch.arange(B) // 4


def _t(*rows: list[int], dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(r, dtype=dtype) for r in rows)


PAIRS = _t([0, 1, 5], [1, -1, 6], [4, -2, 0], [5, -3, 12])  # (a1, p, a2, n), negatives wrap
TRIPLETS = _t([0, 15, 9], [1, -2, 10], [-1, 4, -16])  # (a, p, n)
CASES = {
    "contrastive": (pf.losses.contrastive, pml_losses.ContrastiveLoss(), PAIRS, {}),
    "triplet_margin": (
        pf.losses.triplet_margin,
        pml_losses.TripletMarginLoss(margin=0.2),
        TRIPLETS,
        {"margin": 0.2},
    ),
}


def _wrapped(t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.where(i < 0, i + B, i) for i in t)


@pytest.mark.parametrize("name", list(CASES))
def test_negative_indices_wrap_as_in_pml(name, data):
    emb, labels = data
    fn, pml, tup, hp = CASES[name]
    got = value_and_grads(lambda e: fn(e, labels, indices_tuple=tup, **hp), emb)
    wrapped = value_and_grads(lambda e: fn(e, labels, indices_tuple=_wrapped(tup), **hp), emb)
    want = value_and_grads(lambda e: pml(e, labels, indices_tuple=tup), emb)
    assert_same(got, wrapped, rtol=0, atol=0)
    assert_same(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bad", [B, -B - 1])
def test_an_index_out_of_range_names_the_tuple_position_and_the_valid_range(name, bad, data):
    emb, labels = data
    fn, _, tup, hp = CASES[name]
    broken = list(tup)
    broken[1] = broken[1].clone()
    broken[1][2] = bad
    role = "p" if len(tup) == 4 else "positives"
    match = (
        rf"indices_tuple\[1\] \({role}\)\[2\] = {bad} is out of range for {B} rows "
        rf"\(valid: -{B} <= value < {B}\)"
    )
    with pytest.raises(IndexError, match=match):
        fn(emb, labels, indices_tuple=tuple(broken), **hp)


BAD = _t([0], [1], [B])  # the negative is one past the last row
READERS = {
    "triplet_margin": lambda e, y: pf.losses.triplet_margin(e, y, indices_tuple=BAD),
    "nca": lambda e, y: pf.losses.nca(e, y, indices_tuple=BAD),
    "ntxent[ref]": lambda e, y: pf.losses.ntxent(
        e, y, ref_emb=e[:10], ref_labels=y[:10], indices_tuple=_t([0], [1], [10])
    ),
    "chunked": lambda e, y: pf.chunked.value_and_grad(pf.losses.triplet_margin, chunk_size=4)(
        e, y, indices_tuple=BAD
    ),
}


@pytest.mark.parametrize("name", list(READERS))
def test_every_reader_of_a_tuple_checks_it(name, data):
    """Losses of each family that reads tuples, a reference set and the anchor-chunked path."""
    with pytest.raises(IndexError, match=r"indices_tuple\[2\] \(negatives\)\[0\]"):
        READERS[name](*data)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32, torch.bool])
def test_an_index_dtype_other_than_int32_or_int64_is_a_type_error(dtype, data):
    emb, labels = data
    tup = (torch.tensor([0, 1]).to(dtype), *_t([1, 0], [4, 5]))
    with pytest.raises(TypeError, match=rf"indices_tuple\[0\] must be an int32 or int64 .*{dtype}"):
        pf.losses.triplet_margin(emb, labels, indices_tuple=tup)


def test_int32_indices_equal_int64(data):
    emb, labels = data
    small = tuple(t.to(torch.int32) for t in TRIPLETS)
    torch.testing.assert_close(
        pf.losses.triplet_margin(emb, labels, indices_tuple=small),
        pf.losses.triplet_margin(emb, labels, indices_tuple=TRIPLETS),
        rtol=0,
        atol=0,
    )


def test_a_tuple_of_the_wrong_shape_says_what_is_expected(data):
    emb, labels = data
    with pytest.raises(ValueError, match=r"tuple of 3 .* or 4"):
        pf.losses.contrastive(emb, labels, indices_tuple=_t([0], [1]))
    with pytest.raises(ValueError, match="equal lengths"):
        pf.losses.triplet_margin(emb, labels, indices_tuple=_t([0, 1], [1], [4]))
    with pytest.raises(ValueError, match="must be 1-D"):
        pf.losses.triplet_margin(
            emb, labels, indices_tuple=(torch.zeros(1, 1).long(), *_t([1], [4]))
        )
