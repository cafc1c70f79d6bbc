"""Tests for ``pmlfunc._ops`` helpers whose contract is not already pinned by every loss using
them (those are tested through the losses)."""

from __future__ import annotations

import functools

import pytest
import torch

from pmlfunc import _ops
from pmlfunc._ops import argsort_rows, label_rows, sparse_rows
from pmlfunc.labels import label_masks


def test_sparse_rows_lists_each_rows_columns_in_order_then_pads():
    mask = torch.zeros(4, 16)
    mask[0, [3, 9]] = 1.0
    mask[2, 5] = 2.0  # a count, not just 0/1
    index, valid = sparse_rows(mask)
    assert index.tolist() == [[3, 9], [0, 0], [5, 0], [0, 0]]
    assert valid.tolist() == [[True, True], [False, False], [True, False], [False, False]]


def test_sparse_rows_of_an_empty_mask_is_one_invalid_column():
    index, valid = sparse_rows(torch.zeros(3, 8))
    assert index.shape == valid.shape == (3, 1) and not valid.any()


def test_sparse_rows_declines_dense_masks_and_unreadable_values():
    dense = torch.ones(4, 4)
    assert sparse_rows(dense) is None  # more than an eighth of the columns
    assert sparse_rows(dense, cost=1 / 8) is not None  # work per listed column that cheap
    assert (
        sparse_rows(torch.eye(16), cost=2.0) is not None
        and sparse_rows(torch.eye(16), cost=3.0) is None
    )
    assert sparse_rows(torch.eye(16, device="meta")) is None  # values cannot be read
    seen = []
    torch.func.vmap(lambda m: seen.append(sparse_rows(m)) or m.sum())(
        torch.eye(16).expand(2, 16, 16)
    )
    assert seen == [None]  # inside a transform: the static path


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_argsort_rows_is_a_stable_argsort(dtype):
    g = torch.Generator().manual_seed(3)
    info = torch.iinfo(dtype)
    keys = torch.randint(info.min, info.max, (5, 300), generator=g, dtype=torch.int64).to(dtype)
    keys[:, ::4] = keys[:, 1:2]  # ties (order by column), extremes
    keys[0, 7], keys[1, 9] = info.min, info.max
    want = keys.argsort(stable=True, dim=-1)
    assert torch.equal(argsort_rows(keys), want)
    assert torch.equal(argsort_rows(keys[2]), want[2])  # one row
    # inside a transform (the custom operator's batching rule, any batch dim) and compiled
    # (the custom operator in a full graph): the same order
    assert torch.equal(torch.func.vmap(argsort_rows)(keys), want)
    assert torch.equal(torch.func.vmap(argsort_rows, in_dims=1, out_dims=1)(keys.T), want.T)
    nested = torch.func.vmap(torch.func.vmap(argsort_rows))(keys.view(5, 1, 300))
    assert torch.equal(nested, want.view(5, 1, 300))


@pytest.mark.compile
def test_argsort_rows_compiles_into_a_full_graph_as_the_custom_operator():
    g = torch.Generator().manual_seed(4)
    keys = torch.randint(-50, 50, (6, 40), generator=g, dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(argsort_rows, fullgraph=True)
    assert torch.equal(compiled(keys), keys.argsort(stable=True, dim=-1))
    graph = torch._dynamo.explain(argsort_rows)(keys).graphs[0]
    assert "pmlfunc.argsort_rows" in graph.code


def test_unit_rows_is_f_normalize_with_its_gradients():
    """The same values as ``F.normalize`` bit for bit, the same first and second derivatives
    (also for a zero row and one below the norm's ε, where no projection applies), under vmap
    too; other p are F.normalize itself."""
    import torch.nn.functional as F

    from pmlfunc._ops import unit_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    x[2] = 0.0
    x[4] *= 1e-14
    x.requires_grad_(True)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64)
    assert torch.equal(unit_rows(x), F.normalize(x, dim=-1))
    got = torch.autograd.grad((unit_rows(x) * w).sum(), x)[0]
    want = torch.autograd.grad((F.normalize(x, dim=-1) * w).sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    smooth = x[[0, 1, 3, 5]].detach().requires_grad_(True)
    assert torch.autograd.gradgradcheck(unit_rows, (smooth,))
    batched = torch.func.vmap(unit_rows)(x.detach().view(2, 3, 5))
    assert torch.equal(batched.view(6, 5), F.normalize(x.detach(), dim=-1))
    assert torch.equal(unit_rows(x, 1), F.normalize(x, p=1, dim=-1))


def test_count_true_counts_like_a_bool_sum():
    from pmlfunc._ops import count_true

    mask = torch.rand(7, 9, generator=torch.Generator().manual_seed(6)) > 0.4
    assert count_true(mask) == mask.sum() and count_true(mask).dtype == torch.int32
    assert torch.equal(count_true(mask, -1), mask.sum(-1).int())
    assert torch.equal(count_true(mask, 0, keepdim=True), mask.sum(0, keepdim=True).int())
    assert count_true(torch.zeros(0, 3, dtype=torch.bool)) == 0


# ---------------------------------------------------------------------------------------------
# Non-finite rows: a NaN row propagates NaN (never read as an empty row), an infinity gives the
# mathematically right value or the NaN each function documents; the other rows are untouched
# ---------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


def _rows_with_non_finite_entries():
    """Rows of 5: 0 finite, 1 a NaN, 2 all NaN, 3 a +inf, 4 a −inf, 5 −inf on every kept entry,
    6 a NaN where ``keep`` (below) is 0, 7 a −inf where ``keep`` is 0; ``keep`` drops column 4."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    x[1, 2] = NAN
    x[2] = NAN
    x[3, 1] = INF
    x[4, 0] = -INF
    x[5, :4] = -INF
    x[6, 4] = NAN
    x[7, 4] = -INF
    keep = torch.ones_like(x)
    keep[:, 4] = 0.0
    return x, keep


def test_row_logsumexp_of_non_finite_rows():
    """A NaN row (or a NaN anywhere in it, kept or not) is NaN, not the empty row's −finfo.max;
    a kept +inf gives +inf (torch.logsumexp's value); a kept −inf adds e^{−inf} = 0; a row of
    only −inf is empty (−finfo.max, as documented); an infinity on an entry not kept is NaN
    (``masked``: x·0); the finite rows equal torch.logsumexp over their kept entries."""
    from pmlfunc._ops import masked_logsumexp, row_logsumexp

    x, keep = _rows_with_non_finite_entries()
    low = -torch.finfo(x.dtype).max
    want = torch.logsumexp(x[:, :4], -1)
    want[5] = low
    want[[6, 7]] = NAN
    for weights, k in ((keep, None), (2.0 * keep, keep)):  # 0/1 weights, and counts with keep
        shift = torch.log(weights[:, :1])  # log 2 for the counts
        for fn in (row_logsumexp, masked_logsumexp):
            got = fn(x, weights, k) - torch.where(want == low, 0.0, shift.squeeze(-1))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0, equal_nan=True)
    assert torch.isnan(row_logsumexp(x, keep)[[1, 2, 6, 7]]).all()
    assert row_logsumexp(x, keep)[3] == INF
    empty = row_logsumexp(x, torch.zeros_like(x))  # nothing kept: empty, but a non-finite row
    assert empty[0] == low and torch.isnan(empty[1:]).all()


def test_masked_logsumexp_gradient_of_non_finite_rows_stays_in_its_row():
    """The gradient (``row_softmax``): each finite row's is its softmax over the kept entries,
    whatever the other rows hold; a NaN row's is NaN, a +inf row's NaN at the infinity (e^{inf −
    inf}) and 0 elsewhere; a −inf entry gets 0, the empty row of −inf nothing (below 1e-30)."""
    from pmlfunc._ops import masked_logsumexp, row_softmax

    x, keep = _rows_with_non_finite_entries()
    xr = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(masked_logsumexp(xr, keep).sum(), xr)
    want = torch.softmax(x[[0, 4]][:, :4], -1)
    torch.testing.assert_close(grad[[0, 4]][:, :4], want, rtol=1e-12, atol=1e-30)
    assert torch.equal(grad[[0, 3, 4, 5], 4], torch.zeros(4, dtype=x.dtype))  # not kept
    assert torch.isnan(grad[[1, 2, 6, 7], 4]).all()  # a NaN row's gradient: NaN throughout
    assert torch.isnan(grad[1]).any() and torch.isnan(grad[2]).all()
    assert torch.isnan(grad[3, 1]) and (grad[3, [0, 2, 3]].abs() < 1e-30).all()
    assert grad[4, 0].abs() < 1e-30 and (grad[5].abs() < 1e-30).all()
    lse = masked_logsumexp(x, keep)
    torch.testing.assert_close(row_softmax(x, keep, lse), grad, equal_nan=True)


def _every_listing(mask):
    """``sparse_rows`` of ``mask`` whatever its density."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_ops, "SPARSE_FRACTION", float("inf"))
        return sparse_rows(mask)


@pytest.mark.parametrize("seed", range(40))
def test_label_rows_lists_the_label_masks_positives_as_sparse_rows_does(seed):
    """Self mode (own column left out) and a reference set, classes of every size (singletons,
    one class, labels absent from the other side): the same ``(index, valid)`` layout,
    bit for bit, as listing the mask built from the labels."""
    g = torch.Generator().manual_seed(seed)
    rows, classes = (
        int(torch.randint(1, 40, (1,), generator=g)),
        int(torch.randint(1, 9, (1,), generator=g)),
    )
    labels = torch.randint(0, classes, (rows,), generator=g)
    ref = torch.randint(
        0, classes + 2, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
    )
    for ref_labels in (None, ref, ref.int()):
        want = _every_listing(label_masks(labels, ref_labels).pos)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_ops, "SPARSE_FRACTION", float("inf"))
            got = label_rows(labels, ref_labels)
        assert got is not None
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_label_rows_declines_as_sparse_rows_does():
    """Eager on a CPU: the same density rule as :func:`sparse_rows`; meta tensors and
    ``torch.func`` transforms: the dense path."""
    few = torch.arange(64) // 4  # 3 positives a row of 64 columns
    assert label_rows(few) is not None and label_rows(few, cost=3.0) is None
    assert label_rows(torch.zeros(16, dtype=torch.long)) is None  # 15 of 16 columns
    assert label_rows(few.to("meta")) is None
    seen = []
    torch.func.vmap(lambda x: seen.append(label_rows(few)) or x.sum())(torch.ones(2, 3))
    assert seen == [None]


@pytest.mark.compile
def test_compiled_label_rows_lists_any_width_without_recompiling():
    """Under ``torch.compile`` with ``compiled=True`` the listing's width ``K`` is a size known
    at run time: batches of 2, 4 and 16 samples a class (K = 1, 3, 15 of 32 columns, past the
    eager density rule) run one graph, each equal to the dense sum over the label mask; without
    ``compiled``, no listing."""

    def listed_sum(s, labels):
        listed = label_rows(labels, compiled=True)
        assert listed is not None
        index, valid = listed
        return torch.where(valid, s.gather(-1, index), 0.0).sum(-1)

    s = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(listed_sum, fullgraph=True)
    compiled(s, torch.arange(32) // 2)
    with torch.compiler.set_stance("fail_on_recompile"):
        for per_class in (2, 4, 16):
            labels = torch.arange(32) // per_class
            want = (s * label_masks(labels).pos).sum(-1)
            torch.testing.assert_close(compiled(s, labels), want)
    seen = []
    torch.compile(lambda y: seen.append(label_rows(y)) or y + 1, fullgraph=True)(labels)
    assert seen == [None]
    torch._dynamo.reset()


def test_sparse_rows_of_a_mask_with_a_nan_takes_the_dense_path():
    """A NaN entry is nonzero (``nonzero`` lists it) but counts 0 (``sign``): the mask is not a
    0/1 count and listing declines (``None``, the dense path, which carries the NaN) instead of
    a wrong layout or an IndexError; a +inf entry is listed like any nonzero."""
    mask = torch.zeros(4, 32)
    mask[0, [3, 9]] = 1.0
    mask[1, 5] = NAN
    assert sparse_rows(mask) is None
    mask[1] = NAN
    assert sparse_rows(mask) is None
    mask[1] = 0.0
    mask[2, 7] = INF
    index, valid = sparse_rows(mask)
    assert index.tolist() == [[3, 9], [0, 0], [7, 0], [0, 0]]
    assert valid.tolist() == [[True, True], [False, False], [True, False], [False, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_indicator_is_nan_for_nan_and_exact_elsewhere(dtype):
    """``indicator`` never reads a NaN as "not selected" (``torch.sign`` maps NaN to 0): NaN in,
    NaN out, in both forms; ±inf, ±0 and the smallest subnormals on the right side; the 0/1
    values exact, +0 (no −0), as a bool comparison gives them; under vmap too."""
    from pmlfunc._ops import indicator

    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 2.5, -3.0, tiny, -tiny], dtype=dtype)
    x = torch.cat([x, torch.tensor([1e-45, -1e-45]).to(dtype)])  # subnormals (0 below float32)
    for strict, want in ((True, x > 0), (False, x >= 0)):
        got = indicator(x, strict=strict)
        assert got.dtype == dtype and torch.isnan(got[0])
        assert torch.equal(got[1:], want[1:].to(dtype))
        assert not torch.signbit(got[1:]).any()
        batched = torch.func.vmap(functools.partial(indicator, strict=strict))(x[None])[0]
        assert torch.isnan(batched[0]) and torch.equal(batched[1:], got[1:])


def test_ratio_of_non_finite_values():
    """``ratio`` (documented): ``num / den``, and where ``den == 0`` ``num · 0``: 0 for a finite
    ``num``, NaN for a NaN or infinite one; a NaN ``den`` gives NaN; the gradient at
    ``den == 0`` is 0 for a finite ``num``."""
    from pmlfunc._ops import ratio

    num = torch.tensor([1.0, 0.0, NAN, INF, -INF, 1.0, NAN, 3.0, 2.0], dtype=torch.float64)
    den = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, NAN, 2.0, INF, 4.0], dtype=torch.float64)
    want = torch.tensor([0.0, 0.0, NAN, NAN, NAN, NAN, NAN, 0.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(ratio(num, den), want, equal_nan=True)
    n = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    d = torch.tensor([0.0, 4.0], dtype=torch.float64, requires_grad=True)
    gn, gd = torch.autograd.grad(ratio(n, d).sum(), (n, d))
    assert torch.equal(gn, torch.tensor([0.0, 0.25], dtype=torch.float64))
    assert torch.equal(gd, torch.tensor([0.0, -2.0 / 16], dtype=torch.float64))


def test_cross_entropy_and_unit_rows_of_non_finite_rows():
    """Row functions keep a non-finite row to itself: ``cross_entropy`` of a NaN row is NaN, of
    a −inf logit off the label the finite cross entropy of the rest, at the label +inf, of a
    +inf logit NaN (inf − inf, torch's); ``unit_rows`` of a NaN or inf row is NaN there (``F.normalize``'s
    values) and its gradient NaN on that row only."""
    import torch.nn.functional as F

    from pmlfunc._ops import cross_entropy, unit_rows

    x, _ = _rows_with_non_finite_entries()
    labels = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0])
    ce = cross_entropy(x, labels)
    assert torch.isnan(ce[[1, 2, 3]]).all()
    assert ce[5] == INF  # the label's logit −inf, another finite: probability 0
    want = torch.logsumexp(x[4, 1:], -1) - x[4, 1]
    torch.testing.assert_close(ce[4], want, rtol=1e-12, atol=0)
    torch.testing.assert_close(ce[0], F.cross_entropy(x[:1], labels[:1])[()])
    xr = x.clone().requires_grad_()
    out = unit_rows(xr)
    assert torch.equal(out.isnan(), F.normalize(x, dim=-1).isnan())
    assert torch.isnan(out[[1, 2, 3, 4, 5]]).any(-1).all() and torch.isfinite(out[0]).all()
    (grad,) = torch.autograd.grad((out.nan_to_num() * torch.arange(5.0)).sum(), xr)
    assert torch.isfinite(grad[0]).all() and torch.isnan(grad[1]).all()


@pytest.mark.compile
def test_indicator_compiled_keeps_nan():
    """Under torch.compile (inductor) the same values: NaN for NaN, 0/1 elsewhere."""
    from pmlfunc._ops import indicator

    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 2.5, -3.0])
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda v: (indicator(v), indicator(v, strict=False)), fullgraph=True)
        for got, want in zip(fn(x), (x > 0, x >= 0), strict=True):
            assert torch.isnan(got[0]) and torch.equal(got[1:], want[1:].float())
    finally:
        torch._dynamo.reset()


# 6 to 512: fused (in cache; 256 and 512: unaliased); 800: two products under grad mode, in
# blocks of 512 without (a shorter last block); 1,024: two whole blocks
@pytest.mark.parametrize("b", [6, 256, 512, 800, 1024])
@pytest.mark.parametrize("scale", [None, 64.0, "tensor"])
def test_self_product_grad_is_the_scaled_gradient_of_both_sides(b, scale):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(b, b, generator=gen, dtype=torch.float64)
    x = torch.randn(b, 5, generator=gen, dtype=torch.float64)
    s = torch.tensor(0.3, dtype=torch.float64) if scale == "tensor" else scale
    want = (g @ x + g.T @ x) * (1.0 if s is None else s)
    tol = 1e-12 * b  # sums of b products (entries up to ~64 · √b)
    for grad_mode in (False, True):  # (a backward records nothing: grad mode off)
        with torch.set_grad_enabled(grad_mode):
            got = _ops.self_product_grad(g, x, s)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=tol)
    # the scale batched on its own under vmap: the fused path may not scale the sum in place
    scales = torch.tensor([0.5, 2.0], dtype=torch.float64)
    got = torch.func.vmap(lambda c: _ops.self_product_grad(g, x, c))(scales)
    want = torch.stack([(g @ x + g.T @ x) * c for c in scales])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=tol)


def test_a_large_self_products_gradient_takes_one_products_flops_in_blocks():
    """Past the fused size, on a CPU with no gradient recorded, ``(g + gᵀ) x`` in square blocks
    (a pair of blocks a step): the FLOPs of one ``B × B × D`` product, where ``g x + gᵀ x``
    takes two (still so under grad mode, whose double backward the blocks' in-place adds would
    complicate)."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(into, a, b, *_, out_shape=None, **__):  # not in FlopCounterMode's table
        return 2 * a[0] * a[1] * b[1]

    b, d = 1100, 16
    g, x = torch.randn(b, b), torch.randn(b, d)
    for grad_mode, products in ((False, 1), (True, 2)):
        with (
            torch.set_grad_enabled(grad_mode),
            FlopCounterMode(
                display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}
            ) as counter,
        ):
            _ops.self_product_grad(g, x)
        assert counter.get_total_flops() == products * 2 * b * b * d


@pytest.mark.parametrize("cols", [256, 512, 384, 7])
def test_unaliased_spreads_rows_a_multiple_of_256_entries_apart_for_a_transposed_read(cols):
    """A 2-D CPU tensor whose rows lie a multiple of 256 entries apart is copied with rows 8
    entries further apart (a column's entries then fall into other cache sets); others, and
    any inside a torch.func transform or under compile, are returned as they are. The values
    are the same, and so is the gradient through the copy."""
    g = torch.randn(5, cols, dtype=torch.float64, requires_grad=True)
    got = _ops.unaliased(g)
    assert torch.equal(got, g)
    if cols % 256:
        assert got is g
    else:
        assert got.stride() == (cols + 8, 1)
        (grad,) = torch.autograd.grad((got * got).sum(), g)
        torch.testing.assert_close(grad, 2 * g)
    inside = torch.func.vmap(lambda t: _ops.unaliased(t).stride(-2) + 0 * t.sum())(g[None])
    assert inside.item() == g.stride(-2)  # vmap: the batched tensor is read as it is
    fn = torch.compile(lambda t: _ops.unaliased(t) * 1.0, fullgraph=True)
    torch.testing.assert_close(fn(g.detach()), g.detach())
    torch._dynamo.reset()
