"""Tests for ``pmlfunc._ops`` helpers whose contract is not already pinned by every loss using
them (those are tested through the losses)."""

from __future__ import annotations

import pytest
import torch

from pmlfunc._ops import argsort_rows, sparse_rows


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
