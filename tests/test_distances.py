"""Distances: values against float64 direct references and PML, the safe-matmul Euclidean
distance's accuracy in every precision, its gradients, transforms, memory and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances as pml_d
from pytorch_metric_learning import losses as pml_losses
from tracking import LargestTensor

import pmlfunc as pf
from pmlfunc.distances import safe_euclidean


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _direct(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Float64 direct-difference Euclidean distances (the ground truth)."""
    x, y = x.double(), y.double()
    return (x[:, None, :] - y[None, :, :]).pow(2).sum(-1).sqrt()


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

PML_PAIRS = [
    (pf.distances.lp(), pml_d.LpDistance()),
    (pf.distances.lp(normalize=False), pml_d.LpDistance(normalize_embeddings=False)),
    (pf.distances.lp(power=2), pml_d.LpDistance(power=2)),
    (pf.distances.lp(p=1), pml_d.LpDistance(p=1)),
    (pf.distances.lp(p=3, normalize=False), pml_d.LpDistance(p=3, normalize_embeddings=False)),
    (pf.distances.lp(p=1, power=2), pml_d.LpDistance(p=1, power=2)),
    (
        pf.distances.lp(p=3, power=2, normalize=False),
        pml_d.LpDistance(p=3, power=2, normalize_embeddings=False),
    ),
    (pf.distances.cosine(), pml_d.CosineSimilarity()),
    (pf.distances.dot(), pml_d.DotProductSimilarity(normalize_embeddings=False)),
    (pf.distances.dot(normalize=True), pml_d.DotProductSimilarity()),
    (pf.distances.snr(), pml_d.SNRDistance()),
    (pf.distances.snr(), pml_d.SNRDistance()),
]


@pytest.mark.parametrize("ours,theirs", PML_PAIRS, ids=lambda v: repr(v))
@pytest.mark.parametrize("with_ref", [False, True])
def test_matches_pml_values_and_gradients(ours, theirs, with_ref):
    g = _gen(1)
    x = torch.randn(10, 7, generator=g, dtype=torch.float64)
    y = torch.randn(6, 7, generator=g, dtype=torch.float64) if with_ref else None
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = (None, None) if y is None else (y.clone().requires_grad_(), y.clone().requires_grad_())
    a = ours(x1, y1)
    b = theirs(x2, y2)
    assert ours.is_similarity == theirs.is_inverted
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    w = torch.randn(a.shape, generator=g, dtype=torch.float64)
    (a * w).sum().backward()
    (b * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-8, atol=1e-10)
    if y is not None:  # the reference rows' gradient too (6 rows against 10: not a square)
        torch.testing.assert_close(y1.grad, y2.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("ours,theirs", PML_PAIRS, ids=lambda v: repr(v))
def test_sign_times_a_difference_is_pmls_margin(ours, theirs):
    """``sign() * (a - b)`` is PML's ``margin(a, b)``: ``a - b`` for a distance, ``b - a`` for a
    similarity (what the margin losses and miners read)."""
    a, b = torch.randn(2, 7, generator=_gen(2), dtype=torch.float64)
    torch.testing.assert_close(ours.sign() * (a - b), theirs.margin(a, b), rtol=0, atol=0)


def test_snr_equals_variance_definition():
    g = _gen(2)
    x = torch.randn(5, 9, generator=g, dtype=torch.float64)
    y = torch.randn(4, 9, generator=g, dtype=torch.float64)
    xn, yn = F.normalize(x, dim=1), F.normalize(y, dim=1)
    ref = torch.var(xn[:, None] - yn[None], dim=2) / torch.var(xn, dim=1)[:, None]
    torch.testing.assert_close(pf.distances.snr()(x, y), ref, rtol=1e-12, atol=1e-14)


def test_self_distance_diagonal_is_exactly_zero():
    x = torch.randn(33, 16, generator=_gen(3)) * 100
    for d in (
        pf.distances.lp(),
        pf.distances.lp(normalize=False),
        pf.distances.lp(power=2),
        pf.distances.snr(),
    ):
        assert torch.all(d(x).diagonal() == 0), d


def test_distance_objects_are_immutable_and_hashable():
    assert pf.distances.lp() == pf.distances.lp()
    assert hash(pf.distances.lp()) == hash(pf.distances.lp())
    assert pf.distances.lp() != pf.distances.lp(power=2)
    assert len({pf.distances.cosine(), pf.distances.cosine(), pf.distances.dot()}) == 2
    with pytest.raises(AttributeError):
        pf.distances.lp().p = 1  # type: ignore[misc]
    assert pf.distances.cosine().is_similarity and not pf.distances.lp().is_similarity


# ---------------------------------------------------------------------------------------------
# Safe-matmul Euclidean accuracy
# ---------------------------------------------------------------------------------------------


def _case(kind: str, dtype: torch.dtype):
    g = _gen(4)
    n, dim = 64, 128
    base = torch.randn(n, dim, generator=g)
    if kind == "random":
        x = base
    elif kind == "nearby":  # pairs of rows 1e-3 apart (relative): the expansion cancels
        x = torch.cat(
            [base[: n // 2], base[: n // 2] + 1e-3 * torch.randn(n // 2, dim, generator=g)]
        )
    elif kind == "duplicate":  # every row twice
        x = torch.cat([base[: n // 2], base[: n // 2]])
    elif kind == "mixed":  # norms from 1e-2 to 1e2
        x = base * torch.logspace(-2, 2, n)[:, None]
    else:
        raise AssertionError(kind)
    return x.to(dtype)


# The stated bound, for entries within the exact budget (every case below has at most one
# near-duplicate per row): |d − d*| ≤ rel·d* + abs·sqrt(‖a‖² + ‖b‖²), with d* the float64
# direct-difference distance of the same (rounded) inputs. rel is the output format's rounding
# (2⁻²⁴, 2⁻¹¹, 2⁻⁸ for float32, float16, bfloat16) plus float32 accumulation; abs covers the
# expansion's error on entries far from cancellation. Measured worst cases: float32 0.05 of
# the old (1e-6, 2e-6) bound, i.e. 1.5e-7 relative; float16/bfloat16 0.99 (output rounding).
BOUNDS = {
    torch.float32: (2.5e-7, 1e-7),
    torch.float16: (2**-11 + 1e-6, 2e-6),
    torch.bfloat16: (2**-8 + 1e-6, 2e-6),
}


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
@pytest.mark.parametrize("kind", ["random", "nearby", "duplicate", "mixed"])
@pytest.mark.parametrize("self_mode", [True, False])
def test_safe_euclidean_error_bound(dtype, kind, self_mode):
    x = _case(kind, dtype)
    y = None if self_mode else x.flip(0).contiguous()
    d = safe_euclidean(x, y)
    assert d.dtype == dtype
    ref = _direct(x, x if y is None else y)
    yy = x if y is None else y
    scale = (x.double().pow(2).sum(1)[:, None] + yy.double().pow(2).sum(1)[None]).sqrt()
    rel, ab = BOUNDS[dtype]
    err = (d.double() - ref).abs()
    assert torch.all(err <= rel * ref + ab * scale), float((err - rel * ref).max())


def _close_pairs(gap: float) -> torch.Tensor:
    """64 rows of 128 in pairs ``gap`` apart (relative to their norms), float32."""
    g = _gen(5)
    base = torch.randn(32, 128, generator=g)
    return torch.cat([base, base + gap * torch.randn(32, 128, generator=g)])


def _gradient_errors(x, self_mode, squared, grad=torch.func.grad):
    """The largest row-wise relative error of ``safe_euclidean``'s float32 gradient (taken by
    ``grad``) against the float64 direct-difference gradient of the same inputs, for a random
    upstream gradient: ``x``'s, and ``y``'s (a reversed copy: exact copies, at distance 0)."""
    inputs = (x,) if self_mode else (x, x.flip(0).contiguous())
    upstream = torch.randn(len(x), len(x), generator=_gen(6))

    def loss(*leaves):
        return (safe_euclidean(*leaves, squared=squared) * upstream.to(leaves[0].dtype)).sum()

    def direct(*leaves):  # float64 differences; a zero distance's gradient 0, as safe_euclidean's
        d2 = (leaves[0][:, None] - leaves[-1][None]).pow(2).sum(-1)
        d = d2 if squared else torch.where(d2 == 0, 1.0, d2).sqrt()
        return (d * upstream.double()).sum()

    got = grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    want = torch.func.grad(direct, argnums=tuple(range(len(inputs))))(*[t.double() for t in inputs])
    errors = [
        (a.detach().double() - b).norm(dim=1) / b.norm(dim=1)
        for a, b in zip(got, want, strict=True)
    ]
    return max(float(e.max()) for e in errors)


@pytest.mark.parametrize("self_mode", [True, False], ids=["self", "cross"])
@pytest.mark.parametrize("squared", [False, True], ids=["d", "d2"])
@pytest.mark.parametrize("gap", [1e-3, 1e-5])
def test_gradient_of_near_entries_is_taken_from_their_differences(gap, squared, self_mode):
    """The backward's two matmuls, ``x_i Σ_j w_ij − Σ_j w_ij y_j``, cancel where ``y_j`` is near
    ``x_i`` (an error ``~eps·‖x‖/d`` relative: 0.4–1 % at 1e-5 apart); the entries the forward
    recomputed from their differences have their gradient from the differences too. Float32
    rounding against the float64 gradient of the same inputs, self and cross, ``d`` and ``d²``."""
    assert _gradient_errors(_close_pairs(gap), self_mode, squared) < 2e-6


def test_gradient_of_near_entries_needs_the_correction():
    """The case above is hard: with the correction off, the gradient is far outside its bound."""
    from pmlfunc import distances as dist

    x = _close_pairs(1e-5)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dist, "_near_correction", lambda w, *args, **kwargs: (w, None))
        assert _gradient_errors(x, True, False) > 1e-3


@pytest.mark.parametrize("self_mode", [True, False], ids=["self", "cross"])
@pytest.mark.parametrize("path", ["accelerator-columns", "vmap", "compile", "double-backward"])
def test_gradient_of_near_entries_on_every_path(monkeypatch, path, self_mode):
    """The same gradient where the near columns are each row's top-k (an accelerator's), under
    ``vmap`` (a batch of one), compiled (the in-place operator) and with a graph recorded
    (``create_graph``: the correction's ops out of place)."""
    from pmlfunc import distances as dist

    x = _close_pairs(1e-5)
    grad = torch.func.grad
    if path == "accelerator-columns":
        monkeypatch.setattr(dist, "_near_columns", _topk_columns)
    elif path == "vmap":

        def grad(f, argnums):  # a transform of the plain grad
            def batched(*leaves):
                one = [t.unsqueeze(0) for t in leaves]
                return [g[0] for g in torch.func.vmap(torch.func.grad(f, argnums))(*one)]

            return batched
    elif path == "compile":
        torch._dynamo.reset()

        def grad(f, argnums):
            def compiled(*leaves):
                leaves = [t.detach().requires_grad_() for t in leaves]
                torch.compile(f, fullgraph=True)(*leaves).backward()
                return [t.grad for t in leaves]

            return compiled
    else:

        def grad(f, argnums):
            def recorded(*leaves):
                leaves = [t.detach().requires_grad_() for t in leaves]
                return torch.autograd.grad(f(*leaves), leaves, create_graph=True)

            return recorded

    assert _gradient_errors(x, self_mode, False, grad) < 2e-6


@pytest.mark.parametrize("kind", ["nearby", "duplicate"])
def test_plain_expansion_fails_where_safe_one_holds(kind):
    """The cases above are hard: the unscreened expansion is far outside the bound."""
    x = _case(kind, torch.float32)
    sq = x.pow(2).sum(1)
    naive = (sq[:, None] + sq[None] - 2 * x @ x.T).clamp_min(0).sqrt()
    ref = _direct(x, x)
    off = ~torch.eye(len(x), dtype=torch.bool)
    naive_err = (naive.double() - ref)[off].abs().max()
    safe_err = (safe_euclidean(x).double() - ref)[off].abs().max()
    assert naive_err > 100 * safe_err


def test_budget_zero_is_the_plain_expansion_and_budget_bounds_exact_entries():
    """Near-duplicates (1e-3 apart, not bitwise equal) need the exact budget."""
    x = _case("nearby", torch.float32)
    ref = _direct(x, x)
    off = ~torch.eye(len(x), dtype=torch.bool)
    err0 = (safe_euclidean(x, exact_budget=0).double() - ref)[off].abs().max()
    err1 = (safe_euclidean(x, exact_budget=1).double() - ref)[off].abs().max()
    assert err1 < 1e-5 < err0
    # Four near copies of each row need a budget of three per row.
    g = _gen(9)
    base = x[:16]
    x4 = torch.cat([base] + [base + 1e-3 * torch.randn(base.shape, generator=g) for _ in range(3)])
    ref4 = _direct(x4, x4)
    assert (safe_euclidean(x4, exact_budget=3).double() - ref4).abs().max() < 1e-5
    assert (safe_euclidean(x4, exact_budget=1).double() - ref4).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "distance",
    [
        pf.distances.lp(),
        pf.distances.lp(power=2),
        pf.distances.lp(normalize=False),
        pf.distances.lp(exact_budget=0),  # copies 0 apart only by the tie merge
        pf.distances.cosine(),
        pf.distances.dot(),
        pf.distances.snr(),
    ],
    ids=repr,
)
def test_exact_duplicates_give_bitwise_equal_rows_and_columns(distance, dtype):
    """Duplicated embeddings are ties, exactly: their rows and columns are bitwise equal (the
    matmul alone rounds differently by column position), even with no exact budget; a
    Euclidean self-matrix has a zero diagonal and zero distance between copies."""
    x = _case("random", torch.float32)[:40].to(dtype)
    x[5] = x[3]
    x[7] = x[3]
    x[39] = x[0]
    for mat in (distance.matrix(x), distance.matrix(x, x[:20])):
        for a, b in ((3, 5), (3, 7), (0, 39)):
            assert torch.equal(mat[a], mat[b])
            if b < mat.shape[1]:
                assert torch.equal(mat[:, a], mat[:, b])
    if distance.kind == "lp":
        m = distance.matrix(x)
        assert torch.equal(m.diagonal(), torch.zeros_like(m.diagonal()))
        assert m[3, 5] == 0 and m[0, 39] == 0


@pytest.mark.parametrize("normalize", [True, False])
def test_a_self_matrix_with_nothing_near_skips_the_tie_search(monkeypatch, normalize):
    """A Euclidean self-matrix whose near entries were read and are none has no duplicated rows
    (a copy is at d² ≈ 0, far below the threshold), so the tie search does not run; with a
    copy it runs and ties the copies; a cross matrix always searches (copies within one side
    need not be near the other side)."""
    import pmlfunc.distances as pfd

    calls = []
    ties = pfd._ties

    def spy(x):
        calls.append(x.shape)
        return ties(x)

    monkeypatch.setattr(pfd, "_ties", spy)
    distance = pf.distances.lp(normalize=normalize)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0)) * 3
    m = distance.matrix(x)
    assert calls == [] and torch.equal(m.diagonal(), torch.zeros(40))
    distance.matrix(x, x[:20] + 1.0)  # cross: both sides searched
    assert len(calls) == 2
    calls.clear()
    x[7] = x[2]
    m = distance.matrix(x)
    assert len(calls) == 1 and torch.equal(m[2], m[7]) and torch.equal(m[:, 2], m[:, 7])


@pytest.mark.parametrize("scale", [None, 2.5])
@pytest.mark.parametrize(
    "distance",
    [pf.distances.lp(), pf.distances.cosine(), pf.distances.dot(), pf.distances.snr()],
    ids=repr,
)
def test_ties_on_one_side_only_merge_that_side_only(distance, scale):
    """Duplicates among the query rows but none among the reference rows (and the reverse):
    only the duplicated side is merged. The other side's columns (rows) stay as computed,
    whatever the two sizes; a side without ties must not borrow the other side's."""
    base = _case("random", torch.float32)
    x, y = base[:10].clone(), base[10:40].clone()  # distinct rows; y larger than x
    x[5] = x[3]
    for q, r, dup in ((x, y, "rows"), (y[:10], x, "cols")):
        got = distance.matrix(q, r, scale=scale)
        want = distance.matrix(q, r, ties=False, scale=scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if dup == "rows":
            assert torch.equal(got[3], got[5])
            assert not torch.equal(got[:, 3], got[:, 5])  # y's rows 3 and 5 differ
        else:
            assert torch.equal(got[:, 3], got[:, 5])
            assert not torch.equal(got[3], got[5])


@pytest.mark.parametrize(
    "distance", [pf.distances.lp(), pf.distances.cosine(), pf.distances.snr()], ids=repr
)
def test_ties_false_skips_only_the_tie_merge(distance):
    """``matrix(..., ties=False)`` (for losses smooth in the matrix) is the same matrix up to the
    duplicates' rounding, with the same gradients; ``ties=True`` is the default."""
    x = _case("random", torch.float32)[:40].clone()
    x[5] = x[3]
    x[39] = x[0]
    for y in (None, x[:20]):
        tied, untied = distance.matrix(x, y), distance.matrix(x, y, ties=False)
        assert torch.equal(tied, distance.matrix(x, y, ties=True))
        torch.testing.assert_close(untied, tied, rtol=1e-5, atol=1e-6)
        others = torch.ones(40, dtype=torch.bool)
        others[[5, 39]] = False  # the rows the merge rewrites
        cols = others[: tied.shape[1]]
        assert torch.equal(untied[others][:, cols], tied[others][:, cols])
    xr = x.clone().requires_grad_()
    w = torch.randn(40, 40)
    (g_tied,) = torch.autograd.grad((distance.matrix(xr) * w).sum(), xr)
    (g_untied,) = torch.autograd.grad((distance.matrix(xr, ties=False) * w).sum(), xr)
    torch.testing.assert_close(g_untied, g_tied, rtol=1e-5, atol=1e-5)


def test_near_entries_are_symmetric_bitwise():
    """The exactly recomputed (near) entries of the self-matrix are written to both halves."""
    x = _case("nearby", torch.float32)
    m = safe_euclidean(x)
    n = len(x) // 2
    pairs = torch.arange(n)
    assert torch.equal(m[pairs, pairs + n], m[pairs + n, pairs])
    torch.testing.assert_close(m, m.T, rtol=1e-5, atol=1e-5)  # the rest: to rounding


def _topk_columns(key, budget, threshold):
    """The accelerator's choice of the entries to recompute: each row's ``budget`` smallest."""
    return key.topk(budget, dim=-1, largest=False, sorted=False).indices, None


@pytest.mark.parametrize("kind", ["random", "nearby", "duplicate", "mixed"])
@pytest.mark.parametrize("self_mode", [True, False])
@pytest.mark.parametrize(
    "distance", [pf.distances.lp(), pf.distances.lp(normalize=False)], ids=repr
)
def test_near_entries_on_cpu_equal_the_accelerator_path(monkeypatch, distance, kind, self_mode):
    """A CPU recomputes the entries with ratio below NEAR_RATIO (at most ``exact_budget`` a
    row); an accelerator each row's ``exact_budget`` smallest. The near entries are bitwise
    equal on both; the rest agree to rounding."""
    from pmlfunc import distances as dist

    x = _case(kind, torch.float32)
    y = None if self_mode else x.flip(0).contiguous()
    yy = x if y is None else y
    cpu = distance.matrix(x, y)
    ratio = _direct(x, yy).pow(2) / (x.double().pow(2).sum(1)[:, None] + yy.double().pow(2).sum(1))
    near = ratio < dist.NEAR_RATIO
    monkeypatch.setattr(dist, "_near_columns", _topk_columns)
    accelerator = distance.matrix(x, y)
    if kind in ("nearby", "duplicate"):
        assert near.any(-1).all()  # every row has a near entry: there is work to do
    assert torch.equal(cpu[near], accelerator[near])
    torch.testing.assert_close(cpu, accelerator, rtol=2e-6, atol=1e-6)


def test_cpu_near_columns_take_the_smallest_keys_below_the_threshold():
    """Four near copies of each row: three near entries a row. A budget of two takes the two
    smallest of them (as the accelerator's top-2 does), a budget of five the three (the other
    slots not valid); nothing near: no slot valid. The custom operator (compile, transforms)
    is the same function."""
    from pmlfunc import distances as dist

    g = _gen(9)
    base = _case("random", torch.float32)[:8]
    x = torch.cat([base] + [base + 1e-3 * torch.randn(base.shape, generator=g) for _ in range(3)])
    d2 = (x[:, None] - x[None]).pow(2).sum(-1)
    d2.fill_diagonal_(float("inf"))
    smallest = d2.topk(2, largest=False).indices.sort(-1).values
    index, valid = dist._cpu_near_columns(d2, 2, 0.5)
    assert valid.all() and torch.equal(index.sort(-1).values, smallest)
    index, valid = dist._cpu_near_columns(d2, 5, 0.5)
    assert torch.equal(valid.sum(-1), torch.full((len(x),), 3))
    assert torch.equal(
        index[valid].view(-1, 3).sort(-1).values, d2.topk(3, largest=False).indices.sort(-1).values
    )
    far = d2 + 10.0
    index, valid = dist._cpu_near_columns(far, 5, 0.5)
    assert index.shape == valid.shape == (len(x), 5) and not valid.any()
    for key in (d2, far):
        want = dist._cpu_near_columns(key, 5, 0.5)
        got = dist._near_columns_op(key, 5, 0.5)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        batched = torch.func.vmap(lambda k: dist._near_columns_op(k, 5, 0.5))(key[None])
        assert all(torch.equal(a[0], b) for a, b in zip(batched, want, strict=True))


@pytest.mark.compile
def test_compiled_euclidean_recomputes_the_near_entries():
    """Under compile the CPU's exact entries are the eager code's, run by the in-place operator
    pmlfunc::exact_entries_: the near entries are recomputed exactly as in eager, where the
    plain expansion is off by percents."""
    from pmlfunc import distances as dist

    x = _case("nearby", torch.float32)
    eager = pf.distances.lp()(x)
    torch._dynamo.reset()
    compiled = torch.compile(pf.distances.lp(), fullgraph=True)(x)
    ratio = _direct(x, x).pow(2) / (x.double().pow(2).sum(1)[:, None] + x.double().pow(2).sum(1))
    near = ratio < dist.NEAR_RATIO
    near.fill_diagonal_(False)
    assert near.sum() == len(x)  # each row's near copy
    unit = torch.nn.functional.normalize(x)
    expansion = (2 - 2 * unit @ unit.T).clamp_min(0).sqrt()
    assert not torch.allclose(expansion[near], eager[near], rtol=1e-3)  # the test can fail
    torch.testing.assert_close(compiled[near], eager[near], rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled, eager, rtol=2e-6, atol=1e-6)


@pytest.mark.compile
@pytest.mark.parametrize("self_mode", [True, False], ids=["self", "cross"])
@pytest.mark.parametrize("kind", ["nearby", "duplicate"])
def test_compiled_euclidean_makes_its_entries_exact_in_place(monkeypatch, kind, self_mode):
    """Compiled on a CPU, the near entries and the duplicated rows' ties are written into the
    expansion's own buffer by the operator pmlfunc::exact_entries_, where the static path's
    scatters and index copies, functionalised, copy the whole matrix (self mode: seven
    ``B × B`` buffers against three, 2026-12-07): fewer ``B × M`` buffers, the matrix of eager
    mode and of the static path (the duplicates' rows bitwise equal) and the same gradient."""
    import re

    from torch._inductor.utils import run_and_get_code

    from pmlfunc import distances as dist

    x = _case(kind, torch.float32)
    y = None if self_mode else x.flip(0).contiguous()
    eager = pf.distances.lp().matrix(x, y)

    def compiled():
        torch._dynamo.reset()
        e = x.clone().requires_grad_()
        fn = torch.compile(lambda a: pf.distances.lp()(a, y), fullgraph=True)
        out, code = run_and_get_code(lambda: fn(e))
        (g,) = torch.autograd.grad(out.sum(), e)
        text = "".join(code)
        shape = rf"empty_strided_cpu\(\({len(x)}, {len(x)}\), [^)]*\), torch\.float32\)"
        return out, g, len(re.findall(shape, text)), "exact_entries_" in text

    out, g, buffers, in_place = compiled()
    monkeypatch.setattr(dist, "_exact_in_place", lambda d2: False)
    out_static, g_static, buffers_static, in_place_static = compiled()
    torch._dynamo.reset()
    assert in_place and not in_place_static
    assert buffers < buffers_static
    torch.testing.assert_close(out, eager, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(out, out_static, rtol=2e-6, atol=1e-6)
    if kind == "duplicate":  # every row twice: the copies' rows (and columns) bitwise equal
        half = len(x) // 2
        assert torch.equal(out[:half], out[half:])
        assert torch.equal(out[:, :half], out[:, half:])  # y = x flipped: duplicated too
    torch.testing.assert_close(g, g_static, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Gradients and transforms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("squared", [False, True])
def test_safe_euclidean_gradcheck(squared):
    g = _gen(5)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: safe_euclidean(a, b, squared=squared), (x, y))
    assert torch.autograd.gradcheck(lambda a: safe_euclidean(a, squared=squared), (x,))


def test_gradient_is_zero_not_nan_at_zero_distance():
    x = torch.randn(4, 3, generator=_gen(6)).repeat(2, 1).requires_grad_()
    d = pf.distances.lp(normalize=False)(x)
    (g,) = torch.autograd.grad(d.sum(), x)
    assert torch.isfinite(g).all()
    # Duplicates: each row's gradient is the sum over the distinct rows only.
    xd = x.detach().double()
    ref = sum(
        (xd[i] - xd[j]) / (xd[i] - xd[j]).norm()
        for i in range(1)
        for j in range(8)
        if (xd[i] - xd[j]).norm() > 0
    )
    torch.testing.assert_close(g[0].double(), 2 * ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["one-product", "two-products"])
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize(
    "distance",
    [pf.distances.dot(), pf.distances.cosine(), pf.distances.lp(), pf.distances.snr()],
    ids=repr,
)
def test_self_matrix_gradients_both_ways(monkeypatch, distance, ties, fused):
    """A self-matrix's backward gives both sides' gradients from one product (g + gᵀ) x on a
    CPU for a cache-sized matrix, else two; a matmul similarity takes a learnable ``scale``
    as an input of its own. Either way: gradients and second derivatives are the function's,
    checked against finite differences, with the scale's."""
    import pmlfunc._ops as ops

    monkeypatch.setattr(ops, "SELF_PRODUCT_FUSE_LIMIT", 1 << 30 if fused else 0)
    g = _gen(11)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, generator=g, dtype=torch.float64)
    if distance.kind == "dot":
        scale = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
        fn = lambda a, s: (distance.matrix(a, ties=ties, scale=s) * w).sum()  # noqa: E731
        args: tuple[torch.Tensor, ...] = (x, scale)
    else:
        fn = lambda a: (distance.matrix(a, ties=ties) * w).sum()  # noqa: E731
        args = (x,)
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize(
    "d", [pf.distances.lp(), pf.distances.cosine(), pf.distances.snr()], ids=repr
)
def test_vmap_and_grad_equal_eager(d):
    g = _gen(7)
    xs = torch.randn(3, 8, 5, generator=g)
    ys = torch.randn(3, 6, 5, generator=g)
    out = torch.func.vmap(d)(xs, ys)
    torch.testing.assert_close(out, torch.stack([d(xs[i], ys[i]) for i in range(3)]))
    gv = torch.func.vmap(torch.func.grad(lambda a: d(a).sum()))(xs)
    ge = torch.stack([torch.func.grad(lambda a: d(a).sum())(xs[i]) for i in range(3)])
    torch.testing.assert_close(gv, ge)


@pytest.mark.compile
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    g = _gen(8)
    x = torch.randn(12, 6, generator=g)
    y = torch.randn(9, 6, generator=g)

    def f(a, b):
        return (
            pf.distances.lp()(a).sum()
            + pf.distances.lp()(a, b).square().sum()
            + pf.distances.snr()(a, b).sum()
        )

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = torch.compile(f, fullgraph=True)(x1, y)
    b = f(x2, y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.backward()
    b.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "d",
    [pf.distances.lp(), pf.distances.lp(power=2), pf.distances.cosine(), pf.distances.snr()],
    ids=repr,
)
def test_meta_device(d):
    x = torch.empty(16, 8, device="meta", requires_grad=True)
    out = d(x, torch.empty(5, 8, device="meta"))
    assert out.shape == (16, 5) and out.device.type == "meta"
    d(x).sum().backward()


@pytest.mark.parametrize("d", [pf.distances.lp(), pf.distances.snr()], ids=repr)
def test_fake_tensors_under_vmap_give_eager_shapes(d):
    """What ``torch.compile`` traces with: fake tensors, here under ``vmap`` of a batch with
    near rows (the CPU's near listing, ``pmlfunc::near_columns``, sees the batch dimension in
    front). The shapes are eager's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = _gen(11)
    base = torch.randn(3, 10, 4, generator=g)
    x = torch.cat([base, base + 1e-3 * torch.randn(3, 10, 4, generator=g)], 1)
    want = torch.func.vmap(d)(x)
    with FakeTensorMode() as mode:
        got = torch.func.vmap(d)(mode.from_tensor(x))
    assert got.shape == want.shape == (3, 20, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_no_batch_by_batch_by_dim_buffer(dtype):
    n, m, dim = 96, 80, 64
    g = _gen(9)
    x = torch.randn(n, dim, generator=g).to(dtype).requires_grad_()
    y = torch.randn(m, dim, generator=g).to(dtype).requires_grad_()
    with LargestTensor() as mode:
        (safe_euclidean(x, y).float().sum() + safe_euclidean(x).float().sum()).backward()
    assert mode.largest <= max(n * m, n * 8 * dim)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_bad_inputs():
    d = pf.distances.lp()
    with pytest.raises(ValueError, match="x must be 2-D"):
        d(torch.randn(3))
    with pytest.raises(ValueError, match="y has embedding size"):
        d(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        d(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="y has dtype"):
        d(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty batch"):
        d(torch.randn(0, 4))
    with pytest.raises(ValueError, match="p must be >= 1"):
        pf.distances.lp(p=0.5)
    with pytest.raises(ValueError, match="power must be > 0"):
        pf.distances.lp(power=0)
    with pytest.raises(ValueError, match="embedding size >= 2"):
        pf.distances.snr()(torch.randn(3, 1))


# ---------------------------------------------------------------------------------------------
# Row-aligned pairs (what a loss reads for a list of L pairs)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ours,theirs", PML_PAIRS, ids=lambda v: repr(v))
def test_pairs_equal_the_matrix_diagonal(ours, theirs):
    x = torch.randn(9, 6, generator=_gen(3), dtype=torch.float64)
    y = torch.randn(9, 6, generator=_gen(4), dtype=torch.float64)
    want = theirs(x, y).diagonal()
    torch.testing.assert_close(ours.pairs(x, y), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.pairs(x, y), ours.matrix(x, y).diagonal())


@pytest.mark.parametrize("d", [pf.distances.lp(), pf.distances.lp(normalize=False)])
def test_pairs_gradient_is_zero_not_nan_for_identical_rows(d):
    x = torch.randn(4, 5, generator=_gen(5), requires_grad=True)
    (g,) = torch.autograd.grad(d.pairs(x, x).sum(), x)
    assert torch.equal(g, torch.zeros_like(g))
    assert torch.equal(d.pairs(x, x).detach(), torch.zeros(4))


def test_pairs_low_precision_computes_in_float32():
    x = torch.randn(5, 4, generator=_gen(6)).to(torch.bfloat16)
    y = torch.randn(5, 4, generator=_gen(7)).to(torch.bfloat16)
    out = pf.distances.lp().pairs(x, y)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, pf.distances.lp().pairs(x.float(), y.float()))


def test_pairs_bad_shapes():
    with pytest.raises(ValueError, match="pairs needs two"):
        pf.distances.lp().pairs(torch.randn(3, 4), torch.randn(2, 4))


def test_pairs_on_meta_and_under_compile():
    d = pf.distances.lp()
    out = d.pairs(torch.randn(5, 4, device="meta"), torch.randn(5, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (5,)
    x, y = torch.randn(6, 4, generator=_gen(8)), torch.randn(6, 4, generator=_gen(9))
    for dist in (pf.distances.lp(), pf.distances.cosine()):
        compiled = torch.compile(dist.pairs, fullgraph=True)
        torch.testing.assert_close(compiled(x, y), dist.pairs(x, y))


# ---------------------------------------------------------------------------------------------
# Listed row pairs by index (what a loss reads for listed triplets, without the matrix)
# ---------------------------------------------------------------------------------------------

ROW_DISTANCES = [ours for ours, _ in PML_PAIRS[:-1]] + [pf.distances.lp(power=3)]
_I = torch.tensor([0, 1, 1, 3, 9, 2, 9])  # repeated indices, and (1, 1): a zero distance
_J = torch.tensor([1, 1, 5, 3, 0, 5, 0])
_J2 = torch.stack([_J, torch.tensor([4, 2, 1, 3, 5, 0, 1])])  # each i against two rows


def _indexed_case(with_ref: bool, two: bool):
    x = torch.randn(10, 6, generator=_gen(21), dtype=torch.float64)
    y = torch.randn(7, 6, generator=_gen(22), dtype=torch.float64) if with_ref else None
    return x, y, (_J2 if two else _J)


@pytest.mark.parametrize("two", [False, True], ids=["L", "KxL"])
@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("d", ROW_DISTANCES, ids=lambda v: repr(v))
def test_indexed_pairs_equal_pairs_of_the_gathered_rows(d, with_ref, two):
    """Values and the gradients of both inputs equal those of ``pairs(x[i], y[j])`` (autograd
    through advanced indexing), also for repeated indices, a zero distance and ``(K, L)``."""
    x, y, j = _indexed_case(with_ref, two)
    w = torch.randn(j.shape, generator=_gen(23), dtype=torch.float64)
    inputs = (x,) if y is None else (x, y)

    def ours(x, *ys):
        return (d.indexed_pairs(x, _I, j, ys[0] if ys else None) * w).sum()

    def theirs(x, *ys):
        ref = ys[0] if ys else x
        rows = ref[j]
        return (
            d.pairs(
                x[_I].expand_as(rows).reshape(-1, x.shape[-1]), rows.reshape(-1, x.shape[-1])
            ).view(j.shape)
            * w
        ).sum()

    got = [t.clone().requires_grad_() for t in inputs]
    want = [t.clone().requires_grad_() for t in inputs]
    a, b = ours(*got), theirs(*want)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(torch.autograd.grad(a, got), torch.autograd.grad(b, want), strict=True):
        assert torch.isfinite(ga).all()
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize(
    "d", [pf.distances.lp(), pf.distances.lp(power=2), pf.distances.cosine()], ids=repr
)
def test_indexed_pairs_gradcheck_and_second_derivatives(d, with_ref):
    x, y, _ = _indexed_case(with_ref, True)
    i, j = _I[:4], _J2[:, :4].clone()
    j[0, 1] = 5  # no zero distance: the second derivative of ‖·‖ is singular there
    inputs = (x.requires_grad_(),) if y is None else (x.requires_grad_(), y.requires_grad_())

    def f(x, *ys):
        return d.indexed_pairs(x, i, j, ys[0] if ys else None)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("d", [pf.distances.lp(), pf.distances.lp(normalize=False)])
def test_indexed_pairs_gradient_is_zero_not_nan_for_identical_rows(d):
    x = torch.randn(4, 5, generator=_gen(24), requires_grad=True)
    i = torch.arange(4)
    out = d.indexed_pairs(x, i, torch.stack([i, i]))
    assert torch.equal(out.detach(), torch.zeros(2, 4))
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize(
    "d", [pf.distances.lp(), pf.distances.cosine(), pf.distances.snr()], ids=repr
)
def test_indexed_pairs_under_vmap_grad_compile_and_on_meta(d):
    x = torch.randn(10, 6, generator=_gen(25))
    xs = torch.stack([x, 2 * x + 1])

    def loss(x, i=_I, j=_J2):
        return d.indexed_pairs(x, i, j).square().sum()

    def grad_loop(x, i=_I, j=_J2):
        x = x.clone().requires_grad_()
        return torch.autograd.grad(loss(x, i, j), x)[0]

    # batched rows, shared indices; shared rows, batched indices (a miner's result per problem)
    got = torch.func.vmap(torch.func.grad(loss))(xs)
    torch.testing.assert_close(got, torch.stack([grad_loop(x) for x in xs]))
    js = torch.stack([_J2, _J2.flip(0)])
    got = torch.func.vmap(lambda j: torch.func.grad(loss)(x, _I, j))(js)
    torch.testing.assert_close(got, torch.stack([grad_loop(x, _I, j) for j in js]))
    xc = x.clone().requires_grad_()
    value = torch.compile(loss, fullgraph=True)(xc)
    torch.testing.assert_close(value, loss(x))
    torch.testing.assert_close(torch.autograd.grad(value, xc)[0], grad_loop(x))
    xm = torch.randn(10, 6, device="meta", requires_grad=True)
    out = d.indexed_pairs(xm, _I.to("meta"), _J2.to("meta"))
    assert out.shape == (2, 7) and out.device.type == "meta"
    (gm,) = torch.autograd.grad(out.sum(), xm)
    assert gm.shape == xm.shape


def test_indexed_pairs_low_precision_computes_in_float32():
    x = torch.randn(10, 4, generator=_gen(26)).to(torch.bfloat16)
    out = pf.distances.lp().indexed_pairs(x, _I, _J)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, pf.distances.lp().indexed_pairs(x.float(), _I, _J))


def test_indexed_pairs_bad_input():
    x = torch.randn(10, 4)
    with pytest.raises(TypeError, match="i must be an int32 or int64"):
        pf.distances.lp().indexed_pairs(x, _I.float(), _J)
    with pytest.raises(ValueError, match=r"i must be \(L,\) and j"):
        pf.distances.lp().indexed_pairs(x, _I, _J[:3])
    with pytest.raises(ValueError, match=r"i must be \(L,\) and j"):
        pf.distances.lp().indexed_pairs(x, _I, _J2.unsqueeze(0))
    with pytest.raises(ValueError):
        pf.distances.lp().indexed_pairs(x, _I, _J, torch.randn(7, 5))


# ---------------------------------------------------------------------------------------------
# One-sided and asymmetric near pairs (issue 36)
# ---------------------------------------------------------------------------------------------
#
# A chain of rows a + ε·t_k·u (u ⟂ a, ‖u‖ = ‖a‖, gaps t_{k+1} − t_k = 1.3^k, ε = 0.01) hidden
# among far random rows: every chain row is near every other (ratio < ¼), and its nearest is its
# left neighbour, so with a budget of k each row recomputes its k nearest and most of those
# choices are one-sided (row j chose i, row i chose others). The expansion is up to ~1e-4 off
# there, over ten times the direct difference's bound (D·eps): an entry recomputed on one side
# only stands out (with ε = 1e-3 it is ≈ 3 % off, but rounding can then reorder a row's
# nearest). Each row's choice is well defined: its budget-th and next ratios are further apart
# than the expansion's error.

DIM = 64
EPS32 = 2.0**-23
# recomputed entries: a direct difference, |d − d*| ≤ D·eps·d*
REL_EXACT = DIM * EPS32
# any other entry: the expansion, |d − d*| ≤ √D·eps·(‖a‖² + ‖b‖²) / d* (the module docstring)
EXPANSION = DIM**0.5 * EPS32


def _chain_rows(gen, length, offset=0.0, eps=0.01):
    """``length`` float64 chain rows at positions ``t_k + offset`` (in steps of ε‖a‖)."""
    a = torch.randn(DIM, generator=gen, dtype=torch.float64)
    u = torch.randn(DIM, generator=gen, dtype=torch.float64)
    u = u - (u @ a) / (a @ a) * a
    u = u / u.norm() * a.norm()
    gaps = 1.3 ** torch.arange(length - 1, dtype=torch.float64)
    t = torch.cat([torch.zeros(1, dtype=torch.float64), gaps.cumsum(0)]) + offset
    return a + eps * t[:, None] * u


def _hidden(gen, rows, n_far=8):
    """``rows`` (float32) shuffled among ``n_far`` far random rows; the rows' new positions."""
    x = torch.cat([rows.float(), 3 * torch.randn(n_far, rows.shape[1], generator=gen)])
    perm = torch.randperm(len(x), generator=gen)
    return x[perm].contiguous(), perm.argsort()[: len(rows)]


def _normalized(x, normalize):
    return F.normalize(x, dim=-1) if normalize else x


def _chosen(x, y, budget, threshold):
    """The entries the kernel recomputes, from float64 distances: each row's ``budget``
    smallest ratios below ``threshold`` (the diagonal excluded when ``y is None``), as a bool
    ``(B, M)`` matrix, and whether each row's choice is well defined (its ``budget``-th and
    ``budget+1``-th ratios further apart than twice the expansion's error on a ratio,
    ``2√D·eps``, so that rounding cannot swap them)."""
    yy = x if y is None else y
    key = _direct(x, yy).pow(2) / (x.double().pow(2).sum(1)[:, None] + yy.double().pow(2).sum(1))
    if y is None:
        key.fill_diagonal_(float("inf"))
    key = torch.where(key < threshold, key, torch.inf)
    k = min(budget, key.shape[1])
    chosen = torch.zeros_like(key, dtype=torch.bool)
    chosen.scatter_(1, key.topk(k, largest=False).indices, True)
    chosen &= key < torch.inf
    ordered = torch.cat([key.sort(-1).values, torch.full_like(key[:, :1], torch.inf)], 1)
    kth, after = ordered[:, k - 1], ordered[:, k]
    return chosen, (after == torch.inf) | (after - kth > 4 * EXPANSION)


def _assert_safe_matrix(m, x, y, budget, rows, threshold=0.25):
    """What the design promises of ``safe_euclidean(x, y)`` (``m``, ``x``/``y`` as the kernel
    sees them): the recomputed entries (``_chosen``) within ``REL_EXACT`` of the float64
    distance, every other entry within the expansion's bound; in self mode (``y is None``) an
    exact-zero diagonal, the recomputed entries of either side bitwise equal to their mirror
    and the others symmetric to the expansion's bound. ``rows``: the rows whose choice the
    caller needs defined. Returns the recomputed entries."""
    yy = x if y is None else y
    ref = _direct(x, yy)
    md = m.double()
    chosen, defined = _chosen(x, y, budget, threshold)
    assert defined[rows].all(), "the test's data: a row whose choice rounding could swap"
    chosen &= defined[:, None]
    sq = x.double().pow(2).sum(1)[:, None] + yy.double().pow(2).sum(1)
    err = (md - ref).abs()
    assert (err[chosen] <= REL_EXACT * ref[chosen]).all(), float((err / ref)[chosen].max())
    bound = EXPANSION * sq / ref.clamp_min(1e-30)
    off = ~torch.eye(*ref.shape, dtype=torch.bool) if y is None else torch.ones_like(chosen)
    assert (err[off] <= bound[off]).all(), float((err / bound)[off].max())
    if y is None:
        assert torch.equal(m.diagonal(), torch.zeros_like(m.diagonal()))
        either = chosen | chosen.T
        assert torch.equal(m[either], m.T[either]), "a near entry recomputed on one side only"
        asym = (md - md.T).abs()
        assert (asym[off] <= 2 * bound[off]).all()
    return chosen


def _one_sided_case(gen, length=12):
    x, chain = _hidden(gen, _chain_rows(gen, length))
    return x, chain


@pytest.mark.parametrize("budget", [1, 3, 8])
@pytest.mark.parametrize("normalize", [False, True], ids=["safe_euclidean", "lp"])
def test_near_entry_recomputed_for_one_row_only_is_written_to_both_halves(gen, normalize, budget):
    """A chain of 12 near rows, each near all 11 others: a budget of 1, 3 or 8 recomputes each
    row's nearest only, and most choices are one-sided (row j's nearest is i, row i's are
    others). The self-matrix keeps every recomputed entry bitwise symmetric and within the
    direct difference's error of float64; the surplus near entries (the expansion, up to ~1e-4
    off here) within the expansion's bound."""
    x, chain = _one_sided_case(gen)
    d = pf.distances.lp(normalize=normalize, exact_budget=budget)
    m = d(x)
    xn = _normalized(x, normalize)
    chosen = _assert_safe_matrix(m, xn, None, budget, chain, 0.25)
    one_sided = chosen & ~chosen.T
    assert one_sided[chain][:, chain].sum() >= len(chain) // 2  # the case the test exists for
    if budget < 8:  # the surplus is not recomputed: the budget binds (entries off by > REL_EXACT)
        ref = _direct(xn, xn)
        surplus = ~(chosen | chosen.T) & (ref > 0)
        surplus[:, ~torch.isin(torch.arange(len(x)), chain)] = False
        assert ((m.double() - ref).abs() > REL_EXACT * ref)[surplus].any()


@pytest.mark.parametrize("normalize", [False, True], ids=["safe_euclidean", "lp"])
def test_chain_within_the_budget_is_exact_and_bitwise_symmetric(gen, normalize):
    """Six chain rows (5 near entries a row) and the default budget of 8: every entry between
    chain rows is recomputed, exact to the direct difference and bitwise symmetric."""
    x, chain = _hidden(gen, _chain_rows(gen, 6))
    m = pf.distances.lp(normalize=normalize)(x)
    chosen = _assert_safe_matrix(m, _normalized(x, normalize), None, 8, chain)
    inner = chosen[chain][:, chain]
    assert inner.sum() == 6 * 5
    sub = m[chain][:, chain]
    assert torch.equal(sub, sub.T)


@pytest.mark.parametrize("budget", [5, 8])
@pytest.mark.parametrize("normalize", [False, True], ids=["safe_euclidean", "lp"])
def test_a_budget_of_b_minus_one_or_more_recomputes_every_entry(gen, normalize, budget):
    """A batch that is one chain (6 rows 1e-3 apart, each near the 5 others) and a budget of
    B − 1 or more: the budget is capped at the B − 1 columns besides the diagonal, and every
    off-diagonal entry is recomputed, exact to the direct difference and bitwise symmetric
    (the expansion is ~1e-3 off there)."""
    x = _chain_rows(gen, 6, eps=1e-3).float()
    m = pf.distances.lp(normalize=normalize, exact_budget=budget)(x)
    chosen = _assert_safe_matrix(m, _normalized(x, normalize), None, budget, torch.arange(6))
    assert chosen.sum() == 6 * 5


def test_copies_are_tied_when_another_row_has_their_values_in_another_order():
    """Rows 3 and 7 are copies and row 5 between them holds row 3's values reversed (the same
    plain sum): the copies are still found (rows are sorted by a *weighted* sum) and their rows
    and columns are bitwise equal, with no exact budget to make them so."""
    from pmlfunc.distances import _ties

    g = _gen(4)
    x = torch.randint(-512, 512, (40, 200), generator=g).float() / 128  # sums exact in float32
    x[7] = x[3]
    x[5] = x[3].flip(0)
    assert x[5].sum() == x[3].sum()
    ties = _ties(x)
    assert ties is not None and (7, 3) in set(map(tuple, ties.T.tolist()))
    for d in (pf.distances.lp(normalize=False, exact_budget=0), pf.distances.lp(exact_budget=0)):
        m = d.matrix(x)
        assert torch.equal(m[3], m[7]) and torch.equal(m[:, 3], m[:, 7])


def _cpu_and_accelerator(monkeypatch, path):
    """``path == "accelerator"``: the per-row ``topk`` an accelerator runs (every row's
    ``budget`` smallest, near or not) in place of the CPU's near listing. The threshold of
    ``_chosen`` for that path."""
    from pmlfunc import distances as dist

    if path == "accelerator":
        monkeypatch.setattr(dist, "_near_columns", _topk_columns)
        return float("inf")
    return dist.NEAR_RATIO


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_one_sided_choices_keep_the_promises_on_cpu_and_accelerator_paths(gen, monkeypatch, path):
    """The CPU's listing of near entries and the accelerator's per-row top-k (where far rows
    recompute their nearest far rows too): the same promises, budget 2."""
    threshold = _cpu_and_accelerator(monkeypatch, path)
    x, chain = _one_sided_case(gen)
    m = safe_euclidean(x, exact_budget=2)
    _assert_safe_matrix(m, x, None, 2, chain, threshold)


@pytest.mark.parametrize("budget", [1, 4])
def test_cross_distance_recomputes_each_query_rows_nearest_whoever_it_is_nearest_to(gen, budget):
    """x-vs-y (a reference set, nothing mirrored): a chain of 10 query rows and two reference
    rows beside its first (at −0.5 and 0.3 steps), so that every query row's nearest reference
    rows are these two, while each of them is nearest to the first few query rows only. Each
    query row's ``budget`` nearest are exact to the direct difference and the rest within the
    expansion's bound; the same for y against x, with its own choices."""
    x, xi = _hidden(gen, _chain_rows(_gen(10), 10), n_far=6)
    near_y = torch.cat(
        [_chain_rows(_gen(10), 1, offset=-0.5), _chain_rows(_gen(10), 1, offset=0.3)]
    )
    y, yi = _hidden(gen, near_y, n_far=5)
    chosen = _assert_safe_matrix(safe_euclidean(x, y, exact_budget=budget), x, y, budget, xi)
    back = _assert_safe_matrix(safe_euclidean(y, x, exact_budget=budget), y, x, budget, yi)
    # the case the test exists for: a query row's choice is not its choice's choice
    assert (chosen & ~back.T).any()
    if budget == 1:  # and a reference row's choice chose the other reference row
        assert (back.T & ~chosen).any()


@pytest.mark.parametrize("mode", ["self", "ref"])
def test_copies_beyond_the_budget_are_ties_and_zero_apart_in_the_self_matrix(gen, mode):
    """Five copies of a chain row (four beyond a budget of 1) among its near neighbours: their
    rows and columns are bitwise equal (ties); in the self-matrix the copies are exactly 0
    apart (the first copy's diagonal), in a cross matrix between copies in both sets within
    the expansion's bound for ``d* = 0``, ``√(2√D·eps·(‖a‖² + ‖b‖²))`` (the surplus keeps the
    expansion's value, as documented)."""
    rows = _chain_rows(gen, 5)
    rows = torch.cat([rows, rows[2:3].expand(4, -1)])  # rows 2, 5, 6, 7, 8 equal
    x, pos = _hidden(gen, rows, n_far=4)
    copies = pos[[2, 5, 6, 7, 8]]
    y = None if mode == "self" else x.flip(0).contiguous()
    m = safe_euclidean(x, y, exact_budget=1)
    ycopies = copies if y is None else len(x) - 1 - copies
    for c in copies[1:]:
        assert torch.equal(m[c], m[copies[0]])
    for c in ycopies[1:]:
        assert torch.equal(m[:, c], m[:, ycopies[0]])
    between = m[copies][:, ycopies]
    if y is None:
        assert torch.equal(between, torch.zeros(5, 5))
    else:
        sq = 2 * x[copies[0]].double().pow(2).sum()
        assert (between.double() <= (2 * EXPANSION * sq).sqrt()).all()
    _assert_safe_matrix(m, x, y, 1, pos[:2])  # the rows whose nearest is no copy
    _assert_safe_matrix(safe_euclidean(x, y), x, y, 8, pos)  # a budget for every near entry


@pytest.mark.parametrize("mode", ["self", "ref"])
def test_gradient_with_copies_is_finite_and_zero_distances_contribute_zero(gen, mode):
    """The gradient of Σ W ⊙ d with copies of rows in both sets (and the default budget, which
    recomputes every near entry): finite, each zero distance contributing 0, equal to a float64
    loop over the pairs with d > 0 to the float32 backward's rounding (its two matmuls cancel
    for near pairs: w = 1/d is large)."""
    rows = _chain_rows(gen, 5)
    rows = torch.cat([rows, rows[2:3].expand(2, -1)])  # rows 2, 5, 6 equal
    x, _ = _hidden(gen, rows, n_far=4)
    y = None if mode == "self" else x.flip(0).contiguous()
    yy = x if y is None else y
    w = torch.randn(len(x), len(yy), generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad((safe_euclidean(xr, y) * w.float()).sum(), xr)
    assert torch.isfinite(grad).all()
    xd, yd = x.double(), yy.double()
    want = torch.zeros_like(xd)
    for i in range(len(xd)):
        for j in range(len(yd)):
            diff = xd[i] - yd[j]
            if diff.norm() > 0:
                want[i] += w[i, j] * diff / diff.norm()
                if y is None:
                    want[j] -= w[i, j] * diff / diff.norm()
    torch.testing.assert_close(grad.double(), want, rtol=0, atol=1e-3 * want.abs().max())


@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("mode", ["self", "ref"])
def test_gradient_at_zero_distance_is_zero_under_torch_func(gen, mode, squared):
    """torch.func.grad and vmap(grad) of Σ W ⊙ d over rows with duplicates (and a reference
    set holding copies of query rows): finite, equal to eager autograd, and the gradient of a
    row whose only partners are copies of itself is exactly 0."""
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    x = torch.cat([x, x[:2], x[5:6].expand(2, -1)])  # 0 ~ 6, 1 ~ 7, 5 ~ 8 ~ 9
    y = None if mode == "self" else torch.cat([x[3:4], x[:2]])  # x3 = y0, x0 = y1, x1 = y2
    w = torch.randn(10, 10 if y is None else 3, generator=gen, dtype=torch.float64)

    def f(a, wt):
        return (safe_euclidean(a, y, squared=squared) * wt).sum()

    grad = torch.func.grad(f)(x, w)
    assert torch.isfinite(grad).all()
    xr = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(f(xr, w), xr)
    torch.testing.assert_close(grad, eager, rtol=1e-12, atol=1e-12)
    stacked = torch.func.vmap(torch.func.grad(f))(x.expand(2, -1, -1), torch.stack([w, 2 * w]))
    torch.testing.assert_close(stacked, torch.stack([eager, 2 * eager]), rtol=1e-12, atol=1e-12)
    # a row whose only partners are its own copies: zero (not NaN)
    lone = torch.func.grad(
        lambda a: safe_euclidean(a, None if y is None else a, squared=squared).sum()
    )
    assert torch.equal(lone(x[8:10]), torch.zeros(2, 5, dtype=torch.float64))


@pytest.mark.parametrize("normalize", [False, True], ids=["safe_euclidean", "lp"])
def test_one_sided_near_entries_under_vmap(gen, normalize):
    """Inside torch.func.vmap (the custom operator pmlfunc::near_columns, out-of-place scatters)
    the one-sided case keeps every promise, for each matrix of the stack."""
    x1, chain1 = _one_sided_case(gen)
    x2 = x1.flip(0).contiguous()
    chain2 = len(x1) - 1 - chain1
    d = pf.distances.lp(normalize=normalize, exact_budget=2)
    out = torch.func.vmap(d)(torch.stack([x1, x2]))
    for m, x, chain in ((out[0], x1, chain1), (out[1], x2, chain2)):
        _assert_safe_matrix(m, _normalized(x, normalize), None, 2, chain)
    ys = torch.stack([x2, x1])
    cross = torch.func.vmap(lambda a, b: safe_euclidean(a, b, exact_budget=2))(
        torch.stack([x1, x2]), ys
    )
    _assert_safe_matrix(cross[0], x1, x2, 2, chain1)


@pytest.mark.compile
def test_one_sided_near_entries_compiled(gen):
    """torch.compile(fullgraph=True) (inductor; the CPU's listing is the custom operator):
    the one-sided case keeps every promise, self and cross, and the gradient is finite."""
    x, chain = _one_sided_case(gen)
    y = x.flip(0).contiguous()

    def f(a, b):
        return safe_euclidean(a, exact_budget=2), safe_euclidean(a, b, exact_budget=2)

    torch._dynamo.reset()
    try:
        self_m, cross_m = torch.compile(f, fullgraph=True)(x, y)
        _assert_safe_matrix(self_m, x, None, 2, chain)
        _assert_safe_matrix(cross_m, x, y, 2, chain)
        xr = x.clone().requires_grad_()
        g = torch.compile(lambda a: safe_euclidean(a, exact_budget=2).sum(), fullgraph=True)
        g(xr).backward()
        assert torch.isfinite(xr.grad).all()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("p", [2, 3])
def test_a_power_below_one_has_pmls_finite_gradient_at_zero_distance(p, normalize):
    """``lp(power=0.5)``: ``d^0.5``'s derivative is infinite at ``d = 0`` (a self distance's
    diagonal, a duplicate row), which made every gradient NaN under a finite loss; it is 0
    there, as ``torch.cdist``'s backward (PML's). Matrix, listed pairs and a loss, float64."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    x[5] = x[0]  # a duplicate: a zero off the diagonal too
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    ours = pf.distances.lp(p=p, power=0.5, normalize=normalize)
    theirs = pml_d.LpDistance(p=p, power=0.5, normalize_embeddings=normalize)
    for fn, ref in (
        (lambda e: ours(e).sum(), lambda e: theirs(e).sum()),
        (
            lambda e: pf.losses.contrastive(e, y, distance=ours),
            lambda e: pml_losses.ContrastiveLoss(distance=theirs)(e, y),
        ),
        (
            lambda e: pf.losses.triplet_margin(
                e,
                y,
                distance=ours,
                indices_tuple=(torch.tensor([0]), torch.tensor([1]), torch.tensor([5])),
            ),
            lambda e: pml_losses.TripletMarginLoss(margin=0.2, distance=theirs)(
                e, y, (torch.tensor([0]), torch.tensor([1]), torch.tensor([5]))
            ),
        ),
    ):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ga,) = torch.autograd.grad(fn(a), a)
        (gb,) = torch.autograd.grad(ref(b), b)
        assert torch.isfinite(ga).all()
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("x", "y", "error", "match"),
    [
        (torch.randn(3, 2), torch.randn(4, 2, dtype=torch.float64), TypeError, "y has dtype"),
        (torch.randn(3), None, ValueError, "x must be 2-D"),
        (torch.randn(3, 2), torch.randn(4, 5), ValueError, "y"),
        (torch.zeros(0, 2), None, ValueError, "x is an empty batch"),
    ],
    ids=["mixed-dtypes", "1-d", "widths", "empty"],
)
def test_safe_euclidean_checks_its_inputs_as_a_distance_does(x, y, error, match):
    """The public function checks what every Distance checks (a float64 ``y`` was rounded to
    ``x``'s float32 silently, an empty batch returned a (0, 0) tensor, other shapes raised
    torch's errors naming no argument)."""
    with pytest.raises(error, match=match):
        safe_euclidean(x, y)
