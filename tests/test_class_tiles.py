"""The classifier losses over tiles of classes (``class_chunk_size=``), where each property is
the engine's rather than one loss's.

The values and gradients against the float64 loop references and PML 2.9.0 are checked with the
losses (``test_margin_softmax.py``, ``test_proxies.py``: every reference and parity case also
runs with tiles of 1 class, of a size not dividing ``C`` and of more classes than there are);
``test_conformance.py`` runs each ``name[classes]`` entry through gradcheck, ``torch.func``,
``torch.compile(fullgraph=True)`` (also of ``torch.func.grad_and_value``), the meta device, the
non-finite inputs and low precision. Here: no tensor of ``B × C`` entries in either pass, bf16
weights read a tile at a time, per-sample gradients under ``vmap``, one class, many tiles, the
second differentiation that raises and the bad ``class_chunk_size``; and the table sharded
across gloo ranks (``pf.distributed.sharded_classes``): one process's numbers on ranks of
unequal rows and classes (none included), the same error on every rank for a bad call.
"""

from __future__ import annotations

import re

import pytest
import torch
from tracking import LargestTensor

import pmlfunc as pf
import pmlfunc.losses as pfl
from pmlfunc.memory import peak_tensor_bytes

F64 = torch.float64

# name -> (loss, init, its params' key, hyper-parameters)
TILED = {
    "arcface": (pfl.arcface, pfl.arcface_init, "weight", {"scale": 16.0}),
    "cosface": (pfl.cosface, pfl.cosface_init, "weight", {"scale": 16.0}),
    "sphereface": (pfl.sphereface, pfl.sphereface_init, "weight", {}),
    "large_margin_softmax": (pfl.large_margin_softmax, pfl.large_margin_softmax_init, "weight", {}),
    "subcenter_arcface": (pfl.subcenter_arcface, pfl.subcenter_arcface_init, "weight", {}),
    "normalized_softmax": (pfl.normalized_softmax, pfl.normalized_softmax_init, "weight", {}),
    "proxy_nca": (pfl.proxy_nca, pfl.proxy_nca_init, "proxies", {"softmax_scale": 4.0}),
    "proxy_anchor": (pfl.proxy_anchor, pfl.proxy_anchor_init, "proxies", {}),
    "soft_triple": (pfl.soft_triple, pfl.soft_triple_init, "weight", {}),
    "p2s_grad": (pfl.p2s_grad, pfl.p2s_grad_init, "weight", {}),
}


def _call(name, x, labels, params, **kw):
    fn, _, _, hp = TILED[name]
    return fn(x, labels, params, **hp, **kw)


def _draw(name, b, c, d, dtype=torch.float32, seed=0):
    _, init, key, _ = TILED[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=dtype)
    labels = torch.randint(0, c, (b,), generator=g)
    params = {key: init(c, d, generator=g, dtype=dtype)[key]}
    return x, labels, params


def _draw_leaves(name, b, c, d):
    """``(x, labels, params, key, K)``: :func:`_draw`'s float32 embeddings and class table as
    leaves that want gradients, the table's key in ``params`` and its sub-centres a class ``K``
    (1 for a ``(C, D)`` table)."""
    x, labels, params = _draw(name, b, c, d)
    key = TILED[name][2]
    x.requires_grad_(True)
    params[key].requires_grad_(True)
    k = params[key].shape[1] if params[key].ndim == 3 else 1
    return x, labels, params, key, k


@pytest.mark.parametrize("name", list(TILED))
def test_no_tensor_of_the_batch_times_the_classes_in_either_pass(name):
    """Forward and backward create nothing larger than the weights (their gradient) or a tile of
    ``B × chunk·K``; the dense loss creates its ``B × C·K`` logits (the check has teeth)."""
    b, c, d, chunk = 48, 300, 4, 16
    x, labels, params, key, k = _draw_leaves(name, b, c, d)
    bound = max(params[key].numel(), b * chunk * k, b * d)
    assert b * c > bound
    with LargestTensor() as rec:
        _call(name, x, labels, params, class_chunk_size=chunk).backward()
    assert rec.largest <= bound, (rec.largest, bound)
    assert x.grad is not None and params[key].grad is not None
    assert params[key].grad.abs().sum() > 0
    with LargestTensor() as rec:
        _call(name, x, labels, params).backward()
    assert rec.largest >= b * c > bound


@pytest.mark.parametrize("name", list(TILED))
def test_beyond_the_two_gradients_only_a_few_tiles_are_ever_alive(name):
    """The live-tensor peak of forward + backward, less the embedding and weight gradients, is a
    few ``B × chunk·K`` tiles, ``B × D`` rows and ``chunk·K × D`` weight tiles: the weights are
    eight times that budget here, so a second weight-sized tensor (a copy of the gradient)
    fails this."""
    b, c, d, chunk = 8, 2000, 64, 16
    x, labels, params, key, k = _draw_leaves(name, b, c, d)
    _, peak = peak_tensor_bytes(
        lambda: _call(name, x, labels, params, class_chunk_size=chunk).backward()
    )
    budget = 8 * (b * chunk * k + b * d + chunk * k * d) * 4
    assert params[key].numel() * 4 > 8 * budget
    assert peak - (x.numel() + params[key].numel()) * 4 <= budget, (peak, budget)


@pytest.mark.parametrize("name", ["arcface", "subcenter_arcface", "normalized_softmax"])
def test_bf16_weights_are_read_a_tile_at_a_time_with_float32_statistics(name):
    """bf16 weights with float32 embeddings: the loss is the float32 loss of the same (rounded)
    weights, the weight gradient comes back in bf16, and no float32 copy of the weights is
    made (the largest tensor is the bf16 gradient)."""
    b, c, d, chunk = 32, 400, 8, 16
    x, labels, params = _draw(name, b, c, d)
    key = TILED[name][2]
    w16 = params[key].to(torch.bfloat16).requires_grad_(True)
    w32 = w16.detach().float().requires_grad_(True)
    with LargestTensor() as rec:
        got = _call(name, x, labels, {key: w16}, class_chunk_size=chunk)
        got.backward()
    want = _call(name, x, labels, {key: w32})
    want.backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert w16.grad is not None and w16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w16.grad.float(), w32.grad, rtol=2e-2, atol=1e-4)
    assert rec.largest <= max(w16.numel(), b * chunk * 3)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_per_sample_gradients_under_vmap_equal_a_loop():
    """``vmap(grad)`` over the samples (the weights shared): each sample's weight gradient equals
    the loss of that sample alone, differentiated on its own."""
    x, labels, params = _draw("subcenter_arcface", 6, 11, 5, dtype=F64)
    w = params["weight"]

    def one(xi, yi, w):
        return pfl.subcenter_arcface(xi[None], yi[None], {"weight": w}, class_chunk_size=4)

    got = torch.func.vmap(torch.func.grad(one, argnums=2), in_dims=(0, 0, None))(x, labels, w)
    for i in range(x.shape[0]):
        want = torch.func.grad(
            lambda w, i=i: pfl.subcenter_arcface(x[i : i + 1], labels[i : i + 1], {"weight": w})
        )(w)
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["arcface", "normalized_softmax", "proxy_nca"])
def test_one_class_gives_the_dense_loss(name):
    """With one class there is no other class: the loss is the dense one (0 for a softmax over
    one logit), with its gradients."""
    x, labels, params = _draw(name, 5, 1, 3, dtype=F64)
    key = TILED[name][2]
    for chunk in (None, 1, 4):
        p = {key: params[key].clone().requires_grad_(True)}
        xx = x.clone().requires_grad_(True)
        out = _call(name, xx, labels, p, class_chunk_size=chunk)
        out.backward()
        assert out == 0
        assert (xx.grad == 0).all() and (p[key].grad == 0).all()


def test_many_tiles_over_many_classes_equal_the_dense_loss():
    """100,000 classes in 13 tiles of 8,192 (the last one partial): the dense loss's value and
    gradients in float64."""
    x, labels, params = _draw("cosface", 16, 100_000, 8, dtype=F64)
    labels[:3] = torch.tensor([0, 8_191, 99_999])  # a tile's first and last class, the last class
    grads = []
    for chunk in (None, 8_192):
        xx = x.clone().requires_grad_(True)
        w = params["weight"].clone().requires_grad_(True)
        out = pfl.cosface(xx, labels, {"weight": w}, class_chunk_size=chunk)
        grads.append((out, *torch.autograd.grad(out, (xx, w))))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


TENSOR_HP = {  # name -> hyper-parameters given as tensors (each differentiated)
    "proxy_anchor": {"margin": 0.2, "alpha": 8.0},
    "soft_triple": {"la": 6.0, "gamma": 0.3, "margin": 0.05},  # gamma: the soft centres' τ = λγ
    "normalized_softmax": {"temperature": 0.4},
    "proxy_nca": {"softmax_scale": 3.0},
}


@pytest.mark.parametrize("name", list(TENSOR_HP))
def test_tensor_hyper_parameters_get_the_dense_gradient(name):
    """Margins, scales and temperatures given as tensors: the tiled loss's gradient with respect
    to each equals the dense loss's (float64), with the embeddings' and the table's."""
    fn, _, key, _ = TILED[name]
    x, labels, params = _draw(name, 9, 13, 5, dtype=F64)
    results = []
    for chunk in (None, 4):
        hp = {k: torch.tensor(v, dtype=F64, requires_grad=True) for k, v in TENSOR_HP[name].items()}
        leaves = [x.clone().requires_grad_(True), params[key].clone().requires_grad_(True)]
        out = fn(leaves[0], labels, {key: leaves[1]}, class_chunk_size=chunk, **hp)
        results.append((out, *torch.autograd.grad(out, [*leaves, *hp.values()])))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_differentiating_twice_raises():
    x, labels, params = _draw("arcface", 6, 9, 4, dtype=F64)
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(
        pfl.arcface(x, labels, params, class_chunk_size=4), x, create_graph=True
    )
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(gx.sum(), x)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
@pytest.mark.parametrize("name", list(TILED))
def test_a_bad_class_chunk_size_is_refused_naming_it(name, bad):
    x, labels, params = _draw(name, 4, 5, 3)
    with pytest.raises(ValueError, match="class_chunk_size must be a positive int"):
        _call(name, x, labels, params, class_chunk_size=bad)


def test_labels_out_of_range_are_refused_as_on_the_dense_path():
    x, labels, params = _draw("arcface", 4, 5, 3)
    labels[0] = 5
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\)"):
        pf.losses.arcface(x, labels, params, class_chunk_size=2)


# ---------------------------------------------------------------------------------------------
# classes sharded across ranks (pf.distributed.sharded_classes)
# ---------------------------------------------------------------------------------------------
SHARD_CASES = {  # name -> (params key, hyper-parameters; tensors are differentiated)
    "arcface": ("weight", {"scale": torch.tensor(8.0, dtype=F64)}),
    "large_margin_softmax": ("weight", {}),
    "sphereface": ("weight", {}),
    "subcenter_arcface": ("weight", {"scale": 8.0}),
    "dynamic_arcface": ("weight", {"margins": torch.linspace(0.1, 0.6, 11, dtype=F64)}),
    "normalized_softmax": ("weight", {"temperature": torch.tensor(0.3, dtype=F64)}),
    "proxy_nca": ("proxies", {"softmax_scale": 3.0}),
    "soft_triple": ("weight", {"la": torch.tensor(6.0, dtype=F64), "gamma": 0.3}),
    "p2s_grad": ("weight", {}),
    "proxy_anchor": ("proxies", {"alpha": torch.tensor(8.0, dtype=F64), "margin": 0.2}),
}


def _leaves(hp: dict) -> dict:
    return {k: v.clone().requires_grad_(True) if torch.is_tensor(v) else v for k, v in hp.items()}


def sharded_on_rank(cases, sizes, classes):
    """Every case's loss, embedding, shard and hyper-parameter gradients on this rank, from
    ``sharded_classes`` on its rows (``sizes``) and classes (``classes``), tiles of 3 classes."""
    import torch.distributed as dist

    rank = dist.get_rank()
    r0, c0 = sum(sizes[:rank]), sum(classes[:rank])
    out = []
    for name, x, labels, table, hp in cases:
        key = SHARD_CASES[name][0]
        xl = x[r0 : r0 + sizes[rank]].clone().requires_grad_(True)
        wl = table[c0 : c0 + classes[rank]].clone().requires_grad_(True)
        leaves = _leaves(hp)
        loss_fn = pf.distributed.sharded_classes(getattr(pfl, name))
        rows = labels[r0 : r0 + sizes[rank]]
        loss = loss_fn(xl, rows, {key: wl}, class_chunk_size=3, **leaves)
        loss.backward()
        grads = {k: v.grad for k, v in leaves.items() if torch.is_tensor(v)}
        out.append((loss.detach(), xl.grad, wl.grad, grads))
    return out, pf.distributed.class_range(11)


def test_sharded_classes_equal_one_process_over_the_whole_table():
    """Three ranks of 0, 3 and 5 rows holding 4, 0 and 7 of the 11 classes: every loss with
    class tiles gives, on every rank, the one-process loss over the whole batch and table; each
    shard its rows of the table's gradient; the rows ``W · ∂L/∂x`` (global_objective's
    convention); a tensor scale, temperature or per-class margins the whole ``∂L/∂θ``. And
    ``class_range`` splits 11 classes over the 3 ranks as 4, 4, 3."""
    g = torch.Generator().manual_seed(5)
    sizes, classes, c, d = (0, 3, 5), (4, 0, 7), 11, 5
    cases = []
    for name, (key, hp) in SHARD_CASES.items():
        init = TILED[name][1] if name in TILED else getattr(pfl, f"{name}_init")
        x = torch.randn(sum(sizes), d, generator=g, dtype=F64)
        labels = torch.randint(0, c, (sum(sizes),), generator=g)
        cases.append((name, x, labels, init(c, d, generator=g, dtype=F64)[key], hp))
    results = pf.testing.spawn_ranks(sharded_on_rank, cases, sizes, classes, world_size=3)
    got = [r[0] for r in results]
    assert [r[1] for r in results] == [(0, 4), (4, 8), (8, 11)]  # class_range: 11 over 3 ranks
    tol = {"rtol": 1e-10, "atol": 1e-12}
    for i, (name, x, labels, table, hp) in enumerate(cases):
        key = SHARD_CASES[name][0]
        xx, ww, leaves = (
            x.clone().requires_grad_(True),
            table.clone().requires_grad_(True),
            _leaves(hp),
        )
        want = getattr(pfl, name)(xx, labels, {key: ww}, **leaves)
        want.backward()
        for rank, (loss, gx, gw, grads) in enumerate(r[i] for r in got):
            r0, c0 = sum(sizes[:rank]), sum(classes[:rank])
            torch.testing.assert_close(loss, want.detach(), **tol)
            torch.testing.assert_close(gx, 3 * xx.grad[r0 : r0 + sizes[rank]], **tol)
            torch.testing.assert_close(gw, ww.grad[c0 : c0 + classes[rank]], **tol)
            for k, v in grads.items():
                torch.testing.assert_close(v, leaves[k].grad, **tol, msg=f"{name} {k}")


def sharded_error_on_rank(change: str):
    """The message each rank raises for a bad sharded call (``change``: what is wrong)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    d = 6 if change == "width" and rank == 1 else 4
    x, labels = torch.randn(3, d), torch.tensor([0, 2, 5])
    if change == "label" and rank == 0:
        labels = torch.tensor([0, 2, 9])  # 9 classes in all: 0..8
    kw = {"indices_tuple": (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))}
    try:
        if change == "reducer":
            loss_fn = pf.distributed.sharded_classes(pfl.proxy_anchor)
            loss_fn(x, labels, pfl.proxy_anchor_init(3, d), reducer=pf.reducers.mean())
        pf.distributed.sharded_classes(pfl.arcface)(
            x, labels, pfl.arcface_init(3, d), **(kw if change == "mined" else {})
        )
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("width", r"disagree.*embeddings"),
        ("label", r"labels must be in \[0, 9\) \(num_classes from the ranks' shards together\)"),
        ("mined", r"indices_tuple refers to local rows"),
        (
            "reducer",
            r"proxy_anchor with the table sharded takes reducer=None \(divisor\(\)\) or sum",
        ),
    ],
)
def test_a_bad_sharded_call_raises_the_same_error_on_every_rank(change, match):
    """Ranks that disagree on the embedding width, a label outside the ranks' classes together,
    a miner's local indices and proxy_anchor with a reducer that does not sum over fixed
    divisors: every rank raises, naming the cause, and none hangs."""
    got = pf.testing.spawn_ranks(sharded_error_on_rank, change, world_size=3, timeout=120)
    for message in got:
        assert re.search(match, message), message


def test_sharded_classes_refuses_a_loss_without_class_tiles():
    with pytest.raises(ValueError, match="sharded_classes takes a loss with class tiles"):
        pf.distributed.sharded_classes(pfl.triplet_margin)


def test_outside_a_process_group_sharded_classes_is_the_loss_itself():
    x, labels, params = _draw("cosface", 6, 9, 4, dtype=F64)
    got = pf.distributed.sharded_classes(pfl.cosface)(x, labels, params, class_chunk_size=4)
    torch.testing.assert_close(got, pfl.cosface(x, labels, params), rtol=1e-12, atol=0)
    assert pf.distributed.class_range(10) == (0, 10)


# ---------------------------------------------------------------------------------------------
# sampled negative classes (sharded_classes(..., sample_rate=))
# ---------------------------------------------------------------------------------------------
def _kept_reference(c, labels, rate, seed):
    """The classes a sampled call keeps, drawn here as the docs say: one uniform per class of
    the table from the generator, below ``rate``, and every label's class."""
    kept = torch.rand(c, generator=torch.Generator().manual_seed(seed)) < rate
    kept[labels] = True
    return kept


def test_sampling_is_the_loss_over_the_kept_classes_with_zero_gradient_elsewhere():
    """One process: the sampled loss equals the dense loss over the kept classes (labels
    renumbered among them, per-class margins sliced), every gradient included; every label's
    class is kept; the classes not kept get a zero gradient, the kept ones a non-zero one."""
    x, labels, params = _draw("subcenter_arcface", 10, 60, 6, dtype=F64)
    margins = torch.linspace(0.1, 0.6, 60, dtype=F64)
    leaves = [t.clone().requires_grad_(True) for t in (x, params["weight"], margins)]
    loss_fn = pf.distributed.sharded_classes(pfl.dynamic_arcface, sample_rate=0.25)
    got = loss_fn(
        leaves[0], labels, {"weight": leaves[1]}, margins=leaves[2], scale=8.0,
        generator=torch.Generator().manual_seed(3), class_chunk_size=4,
    )  # fmt: skip
    got.backward()
    kept = _kept_reference(60, labels, 0.25, 3)
    assert 0 < int(kept.sum()) < 60
    idx, order = kept.nonzero().squeeze(1), torch.cumsum(kept, 0) - 1
    ref = [t.clone().requires_grad_(True) for t in (x, params["weight"], margins)]
    want = pfl.dynamic_arcface(
        ref[0], order[labels], {"weight": ref[1][idx]}, margins=ref[2][idx], scale=8.0
    )
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert (leaves[1].grad[~kept] == 0).all()
    assert (leaves[1].grad[kept].abs().sum((1, 2)) > 0).all()


def test_a_sparse_gradient_holds_the_kept_rows_only_and_equals_the_dense_one():
    """``sparse_grad=True``: the table's gradient is a sparse COO tensor of the kept rows (the
    dense gradient's non-zero rows), equal to the dense gradient; ``SparseAdam`` then moves
    those rows only."""
    x, labels, params = _draw("subcenter_arcface", 10, 60, 6, dtype=F64)
    grads = []
    for sparse in (False, True):
        w = params["weight"].clone().requires_grad_(True)
        loss_fn = pf.distributed.sharded_classes(
            pfl.subcenter_arcface, sample_rate=0.25, sparse_grad=sparse
        )
        loss_fn(
            x, labels, {"weight": w}, generator=torch.Generator().manual_seed(3),
            class_chunk_size=4,
        ).backward()  # fmt: skip
        grads.append(w.grad)
    dense, sparse = grads
    assert sparse.is_sparse and sparse.shape == dense.shape
    kept = _kept_reference(60, labels, 0.25, 3)
    assert sparse.coalesce().indices().flatten().tolist() == kept.nonzero().flatten().tolist()
    torch.testing.assert_close(sparse.to_dense(), dense, rtol=0, atol=0)
    w = params["weight"].clone().float().requires_grad_(True)
    before = w.detach().clone()
    w.grad = sparse.float()
    torch.optim.SparseAdam([w], lr=0.1).step()
    moved = (w.detach() != before).flatten(1).any(1)
    assert torch.equal(moved, kept)


def test_sampling_slices_class_weighted_weights_as_it_renumbers_the_labels():
    """``class_weighted(w)`` is read by the labels, which sampling renumbers among the kept
    classes: its weights are sliced to the kept classes too (each row read another class's
    weight before, without a word)."""
    x, labels, params = _draw("cosface", 8, 30, 5, dtype=F64)
    w = torch.arange(1.0, 31.0, dtype=F64)
    loss_fn = pf.distributed.sharded_classes(pfl.cosface, sample_rate=0.3)
    got = loss_fn(
        x, labels, params, generator=torch.Generator().manual_seed(1),
        reducer=pf.reducers.class_weighted(w),
    )  # fmt: skip
    kept = _kept_reference(30, labels, 0.3, 1)
    assert 0 < int(kept.sum()) < 30
    idx, order = kept.nonzero().squeeze(1), torch.cumsum(kept, 0) - 1
    want = pfl.cosface(
        x, order[labels], {"weight": params["weight"][idx]},
        reducer=pf.reducers.class_weighted(w[idx]),
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_weight_regularizer_is_refused_on_a_sampled_or_sharded_table():
    """The weight regularizer reads the whole table, which a sampled call (or a rank of a
    sharded one) holds part of: refused, where each rank's regularizer of its own rows gave
    every rank another loss."""
    x, labels, params = _draw("cosface", 8, 30, 5, dtype=F64)
    loss_fn = pf.distributed.sharded_classes(pfl.cosface, sample_rate=0.5)
    with pytest.raises(ValueError, match="weight_regularizer= reads the whole class table"):
        loss_fn(
            x, labels, params, generator=torch.Generator().manual_seed(0),
            weight_regularizer=pf.regularizers.lp, weight_reg_weight=0.5,
        )  # fmt: skip


def test_sparse_grad_needs_sampling():
    with pytest.raises(ValueError, match="sparse_grad=True is for sampled classes"):
        pf.distributed.sharded_classes(pfl.arcface, sparse_grad=True)


def test_sampling_every_class_is_the_full_loss():
    x, labels, params = _draw("arcface", 8, 30, 5, dtype=F64)
    loss_fn = pf.distributed.sharded_classes(pfl.arcface, sample_rate=1.0)
    got = loss_fn(x, labels, params, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, pfl.arcface(x, labels, params), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("rate", "kw", "error", "match"),
    [
        (0.0, {}, ValueError, "sample_rate must be"),
        (1.5, {}, ValueError, r"sample_rate must be in \(0, 1\]"),
        (0.5, {}, TypeError, "needs generator="),
        # without sampling, in one process, the wrapper is the loss itself: no generator=
        (None, {"generator": torch.Generator()}, TypeError, "generator"),
    ],
)
def test_bad_sampling_arguments_are_refused(rate, kw, error, match):
    x, labels, params = _draw("arcface", 4, 9, 3)
    with pytest.raises(error, match=match):
        pf.distributed.sharded_classes(pfl.arcface, sample_rate=rate)(x, labels, params, **kw)


def sampled_on_rank(x, labels, table, sizes, classes, seed):
    """This rank's loss and gradients of a sampled sharded arcface (``seed``: its generator's)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    r0, c0 = sum(sizes[:rank]), sum(classes[:rank])
    xl = x[r0 : r0 + sizes[rank]].clone().requires_grad_(True)
    wl = table[c0 : c0 + classes[rank]].clone().requires_grad_(True)
    loss_fn = pf.distributed.sharded_classes(pfl.arcface, sample_rate=0.3)
    generator = torch.Generator().manual_seed(seed[rank] if isinstance(seed, tuple) else seed)
    try:
        loss = loss_fn(
            xl, labels[r0 : r0 + sizes[rank]], {"weight": wl}, scale=8.0, generator=generator,
            class_chunk_size=3,
        )  # fmt: skip
    except ValueError as err:
        return str(err)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


def test_sampled_sharded_classes_keep_the_same_classes_whatever_the_world_size():
    """Three ranks (2, 0 and 6 rows; 9, 5 and 6 of 20 classes) with generators seeded alike
    keep the classes one process keeps with that seed: the same loss on every rank, each shard
    its rows of the one-process gradient, the rows ``W ·`` theirs. Ranks whose generators
    differ raise the same error on every rank, before any data moves."""
    g = torch.Generator().manual_seed(11)
    sizes, classes = (2, 0, 6), (9, 5, 6)
    x = torch.randn(8, 5, generator=g, dtype=F64)
    labels = torch.randint(0, 20, (8,), generator=g)
    table = pfl.arcface_init(20, 5, generator=g, dtype=F64)["weight"]
    got = pf.testing.spawn_ranks(sampled_on_rank, x, labels, table, sizes, classes, 4, world_size=3)
    xx, ww = x.clone().requires_grad_(True), table.clone().requires_grad_(True)
    want = pf.distributed.sharded_classes(pfl.arcface, sample_rate=0.3)(
        xx, labels, {"weight": ww}, scale=8.0, generator=torch.Generator().manual_seed(4)
    )
    want.backward()
    tol = {"rtol": 1e-10, "atol": 1e-12}
    for rank, (loss, gx, gw) in enumerate(got):
        r0, c0 = sum(sizes[:rank]), sum(classes[:rank])
        torch.testing.assert_close(loss, want.detach(), **tol)
        torch.testing.assert_close(gx, 3 * xx.grad[r0 : r0 + sizes[rank]], **tol)
        torch.testing.assert_close(gw, ww.grad[c0 : c0 + classes[rank]], **tol)
    errors = pf.testing.spawn_ranks(
        sampled_on_rank, x, labels, table, sizes, classes, (4, 4, 5), world_size=3
    )
    assert all("disagree" in e and "generator" in e for e in errors), errors
