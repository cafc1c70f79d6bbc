"""pf.transforms: matryoshka equals the naive sum over widths, adaptive_layers its formula; both
keep the base loss's signature, compose, compile, run under torch.func and on several ranks."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import with_and_without_bound

import pmlfunc as pf
import pmlfunc.reducers as pfr
from pmlfunc.losses._tiled import nested_call
from pmlfunc.testing import check_distributed

T = pf.transforms
L = pf.losses
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
DIMS = (12, 6, 3)


def _randn(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _assert_same(got, want):
    (lg, gg), (lw, gw) = got, want
    torch.testing.assert_close(lg, lw, **TOL)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b, **TOL)


LABELS = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 4])
N = len(LABELS)

# name -> (the call on embedding tensors, their shapes): each case cuts every embedding argument
CASES = {
    "ntxent": (lambda f, e: f(e, LABELS, temperature=0.2), [(N, 12)]),
    "ntxent-tiled": (lambda f, e: f(e, LABELS, temperature=0.2, chunk_size=3), [(N, 12)]),
    "supcon-keyword": (lambda f, e: f(embeddings=e, labels=LABELS), [(N, 12)]),
    "contrastive-ref": (
        lambda f, e, r: f(e, LABELS, ref_emb=r, ref_labels=torch.arange(7) % 4),
        [(N, 12), (7, 12)],
    ),
    "clip": (
        lambda f, a, b: f(a, b, {"logit_scale": torch.tensor(2.0, dtype=F64)}),
        [(N, 12), (N, 12)],
    ),
    "siglip-keywords": (
        lambda f, a, b: f(emb_a=a, emb_b=b, params=L.siglip_init(dtype=F64), chunk_size=4),
        [(N, 12), (N, 12)],
    ),
    "mnrl-negatives": (lambda f, q, p, n: f(q, p, n), [(N, 12), (N, 12), (N, 2, 12)]),
}
BASE = {
    "ntxent": L.ntxent,
    "ntxent-tiled": L.ntxent,
    "supcon-keyword": L.supcon,
    "contrastive-ref": L.contrastive,
    "clip": L.clip,
    "siglip-keywords": L.siglip,
    "mnrl-negatives": L.multiple_negatives_ranking,
}


@pytest.mark.parametrize("name", CASES)
def test_matryoshka_equals_the_naive_sum_over_widths(name):
    call, shapes = CASES[name]
    inputs = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    weights = (1.0, 0.5, 0.25)

    got_in = _leaves(*inputs)
    got = call(T.matryoshka(BASE[name], DIMS, weights), *got_in)
    want_in = _leaves(*inputs)
    want = sum(
        w * call(BASE[name], *[x[..., :d] for x in want_in])
        for d, w in zip(DIMS, weights, strict=True)
    )
    _assert_same((got, _grads(got, got_in)), (want, _grads(want, want_in)))


def test_learnable_weights_get_each_width_s_loss_as_gradient():
    e = _randn(N, 12)
    w = torch.tensor([1.0, 0.3, 0.2], dtype=F64, requires_grad=True)
    loss_fn = T.matryoshka(L.ntxent, DIMS, w)
    for _ in range(2):  # a fresh graph every call: a second backward works
        (g,) = torch.autograd.grad(loss_fn(e, LABELS), w)
    torch.testing.assert_close(g, torch.stack([L.ntxent(e[:, :d], LABELS) for d in DIMS]), **TOL)


def test_normalize_cuts_then_normalises_each_prefix_like_sentence_transformers():
    e = _randn(N, 12)
    got = T.matryoshka(L.ntxent, DIMS, normalize=True)(e, LABELS, distance=pf.distances.dot())
    want = sum(
        L.ntxent(
            torch.nn.functional.normalize(e[:, :d], dim=-1), LABELS, distance=pf.distances.dot()
        )
        for d in DIMS
    )
    torch.testing.assert_close(got, want, **TOL)
    # with a cosine loss the normalisation changes nothing
    cos = T.matryoshka(L.ntxent, DIMS)
    torch.testing.assert_close(
        T.matryoshka(L.ntxent, DIMS, normalize=True)(e, LABELS), cos(e, LABELS), **TOL
    )


# --- the engine's losses: every width from one blocked product --------------------------------

R_LABELS = torch.tensor([0, 1, 1, 2, 4, 4, 3])


def _scaled(**extra):
    """A learnable logit scale (and bias) for clip/siglip: its gradient is compared too."""
    out = {"logit_scale": torch.tensor(2.0, dtype=F64, requires_grad=True)}
    out.update({k: torch.tensor(v, dtype=F64, requires_grad=True) for k, v in extra.items()})
    return out


# name -> (base loss, the call on (embedding tensors, hyper-parameter tensors), shapes,
# hyper-parameters): kinds, reducers, self mode and a reference set, cosine and dot, a dense call
# and tiles of 1, 3 and more rows than the batch (chunk sizes in the names)
ONE_PRODUCT = {
    "ntxent-dense": (L.ntxent, lambda f, e, p: f(e, LABELS, temperature=0.2), [(N, 12)], {}),
    "ntxent-1": (L.ntxent, lambda f, e, p: f(e, LABELS, chunk_size=1), [(N, 12)], {}),
    "ntxent-ref-3": (
        L.ntxent,
        lambda f, e, r, p: f(e, LABELS, ref_emb=r, ref_labels=R_LABELS, chunk_size=3),
        [(N, 12), (7, 12)], {},
    ),
    "ntxent-dot-3": (
        L.ntxent, lambda f, e, p: f(e, LABELS, distance=pf.distances.dot(), chunk_size=3),
        [(N, 12)], {},
    ),
    "supcon-mean-4": (
        L.supcon, lambda f, e, p: f(e, LABELS, reducer=pf.reducers.mean(), chunk_size=4),
        [(N, 12)], {},
    ),
    "supcon-avg-nonzero-dense": (L.supcon, lambda f, e, p: f(e, LABELS), [(N, 12)], {}),
    "clip-dense": (L.clip, lambda f, a, b, p: f(a, b, p), [(N, 12), (N, 12)], _scaled()),
    "clip-labels-3": (
        L.clip, lambda f, a, b, p: f(a, b, p, labels=LABELS, chunk_size=3),
        [(N, 12), (N, 12)], _scaled(),
    ),
    "siglip-16": (
        L.siglip, lambda f, a, b, p: f(a, b, p, chunk_size=16), [(N, 12), (N, 12)],
        _scaled(logit_bias=-1.0),
    ),
    "siglip-labels-dense": (
        L.siglip, lambda f, a, b, p: f(a, b, p, labels=LABELS), [(N, 12), (N, 12)],
        _scaled(logit_bias=-1.0),
    ),
}  # fmt: skip


def _one_product_case(name):
    base, call, shapes, params = ONE_PRODUCT[name]
    inputs = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    params = params or {}
    return base, call, inputs, params


@pytest.mark.parametrize("name", ONE_PRODUCT)
def test_one_product_equals_the_naive_sum_values_and_every_gradient(name, monkeypatch):
    """Loss and every gradient, float64 1e-10; CLIP's in-place ``E ⊙ (u_i + v_j)``, a step of
    rows at a time on a CPU, goes three or four rows a step here (the last step shorter)."""
    monkeypatch.setattr(pf.losses._tiled, "_INPLACE_STEP", 30)
    base, call, inputs, params = _one_product_case(name)
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=F64, requires_grad=True)
    leaves = [*params.values(), weights]
    nested = T.matryoshka(base, DIMS, weights)
    runs = []
    monkeypatch.setattr(
        pf.transforms, "run_nested", lambda *a: runs.append(a) or pf.losses._tiled.run_nested(*a)
    )

    got_in = _leaves(*inputs)
    got = call(nested, *got_in, params)
    assert len(runs) == 1  # one walk, not a call a width
    got_grads = _grads(got, [*got_in, *leaves])
    want_in = _leaves(*inputs)
    want = sum(
        weights[k] * call(base, *[x[..., :d] for x in want_in], params) for k, d in enumerate(DIMS)
    )
    _assert_same((got, got_grads), (want, _grads(want, [*want_in, *leaves])))


@pytest.mark.parametrize("name", [n for n in ONE_PRODUCT if n.startswith(("clip", "siglip"))])
def test_one_product_with_bounded_logits_equals_the_softmax_path(name, monkeypatch):
    """CLIP and SigLIP where every width's ``|S|`` is known bounded (normalised prefixes and
    the scale): the nested walks take each width's tile as ``S log₂e`` (unshifted base-2
    exponentials, CLIP's recomputed tiles too); the loss and every gradient equal those with no
    bound known (the softmax and plain paths)."""
    base, call, inputs, params = _one_product_case(name)
    nested = T.matryoshka(base, DIMS, torch.tensor([1.0, 0.5, 0.25], dtype=F64))
    prefixes = pf.losses._tiled._Prefixes
    tiles, units = prefixes.tiles, []

    def spy(self, *a, **k):
        units.append(self.base2)
        return tiles(self, *a, **k)

    monkeypatch.setattr(prefixes, "tiles", spy)

    def run(*xs):
        given = dict(zip(params, xs[len(inputs) :], strict=True))
        return call(nested, *xs[: len(inputs)], given)

    leaves = [*inputs, *(v.detach() for v in params.values())]
    got, want = with_and_without_bound(monkeypatch, run, *leaves)
    assert units and all(units[: len(units) // 2])  # bounded first, then not
    assert not any(units[len(units) // 2 :])
    _assert_same(got, want)


@pytest.mark.parametrize("name", ["ntxent-dense", "ntxent-ref-3", "clip-labels-3", "siglip-16"])
def test_one_product_costs_the_products_of_one_full_width_call(name):
    """Forward and backward, the matryoshka call's matmul FLOPs are the full-width call's
    (the naive sum's are Σ d_k / D = 1.75 times as many for DIMS)."""
    from torch.utils.flop_counter import FlopCounterMode

    base, call, inputs, params = _one_product_case(name)

    def addmm_(into, a, b, *_, out_shape=None, **__):  # not in FlopCounterMode's table
        return 2 * a[0] * a[1] * b[1]

    def flops(fn):
        xs = _leaves(*inputs)
        with FlopCounterMode(
            display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}
        ) as counter:
            torch.autograd.grad(call(fn, *xs, params), xs)
        return counter.get_total_flops()

    single, nested = flops(base), flops(T.matryoshka(base, DIMS))
    assert nested == single
    naive = flops(
        lambda *a, **k: sum(
            base(*(_cut(v, d) for v in a), **{n: _cut(v, d) for n, v in k.items()}) for d in DIMS
        )
    )
    assert naive == pytest.approx(single * sum(DIMS) / max(DIMS), rel=0.01)


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_one_product_self_mode_tiles_split_their_products_like_one_full_width_call(
    name, monkeypatch
):
    """Self-mode tiles large enough to split (128 rows, blocks of 64 to 128 columns: each
    width block's diagonal once, the next two tiles' blocks met as G_ut + G_tuᵀ;
    800 rows, seven tiles) give the naive sum's loss and gradient in float64, every tile of every
    block through the split, with the matmul FLOPs of one full-width call (SupCon's mean: its
    default avg_nonzero walks twice)."""
    from torch.utils.flop_counter import FlopCounterMode

    tiled = pf.losses._tiled
    split = []
    real = tiled._self_tile_products_

    def spy(into, x, ds, r0, r1, kept):
        split.append((x.shape[-1], r0))
        return real(into, x, ds, r0, r1, kept)

    monkeypatch.setattr(tiled, "_self_tile_products_", spy)
    kw = {"chunk_size": 128} if name == "ntxent" else {"chunk_size": 128, "reducer": pfr.mean()}
    base, dims = functools.partial(getattr(L, name), **kw), (256, 128, 64)
    labels = torch.arange(800) // 3
    emb = _randn(800, 256, seed=7)
    assert pf.losses._tiled._kept_tiles(800, 128) == 2
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=F64)
    nested = T.matryoshka(base, dims, weights)
    (x,) = _leaves(emb)
    got = nested(x, labels)
    got = (got, _grads(got, [x]))
    assert sorted(split) == sorted((w, r0) for w in (64, 64, 128) for r0 in range(0, 800, 128))
    (x,) = _leaves(emb)
    want = sum(w * base(x[:, :d], labels) for w, d in zip(weights, dims, strict=True))
    _assert_same(got, (want, _grads(want, [x])))

    def addmm_(into, a, b, *_, out_shape=None, **__):  # not in FlopCounterMode's table
        return 2 * a[0] * a[1] * b[1]

    def flops(fn):
        (x,) = _leaves(emb)
        with FlopCounterMode(
            display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}
        ) as counter:
            torch.autograd.grad(fn(x, labels), x)
        return counter.get_total_flops()

    assert flops(nested) == flops(base)


def test_one_product_walks_reuse_their_tile_buffers_and_give_the_numbers_of_fresh_ones(
    monkeypatch,
):
    """On a CPU in eager mode the nested walks take their tile buffers (the accumulated
    product, the logits, the softmaxes, ``W ⊙ C``) from the walk's ``_Scratch``, from tile to
    tile: the loss and every gradient are bitwise those of fresh buffers, for every kind,
    dense and tiled (the last tile a view of the buffers' first rows)."""
    scratch = pf.losses._tiled._Scratch
    take = scratch.take
    taken = []

    def spy(self, name, rows, cols, like):
        buf = take(self, name, rows, cols, like)
        if buf is not None:
            taken.append(name)
        return buf

    for name in ONE_PRODUCT:
        base, call, inputs, params = _one_product_case(name)
        nested = T.matryoshka(base, DIMS)
        results = []
        for fresh in (False, True):
            with monkeypatch.context() as m:
                m.setattr(scratch, "take", (lambda *a: None) if fresh else spy)
                xs = _leaves(*inputs)
                leaves = [*xs, *(v.detach().requires_grad_() for v in params.values())]
                p = dict(zip(params, leaves[len(xs) :], strict=True))
                loss = call(nested, *xs, p)
                results.append([loss, *torch.autograd.grad(loss, leaves)])
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), name
    assert {"c", "s", "probs0", "s0"} <= set(taken)


def _cut(v, d):
    return (
        v[..., :d] if isinstance(v, torch.Tensor) and v.ndim == 2 and v.is_floating_point() else v
    )


def test_one_product_holds_a_tile_a_width_not_the_batch_matrix():
    """The tiled matryoshka's live peak beyond its inputs and their gradient: a few tiles of
    ``chunk × M`` a width, far below one ``N × N`` matrix."""
    from pmlfunc.memory import peak_tensor_bytes

    n, d, chunk = 1024, 32, 32
    e = _randn(n, d, dtype=torch.float32)
    y = torch.arange(n) // 4
    nested = T.matryoshka(L.ntxent, (32, 16, 8, 4))
    x = e.clone().requires_grad_()
    _, peak = peak_tensor_bytes(lambda: nested(x, y, chunk_size=chunk).backward())
    tile = chunk * n * 4
    assert peak - 2 * e.nbytes < 12 * tile < n * n * 4 / 2


def test_one_product_is_first_order_and_evaluates_without_grad():
    e = _randn(N, 12).requires_grad_()
    nested = T.matryoshka(L.ntxent, DIMS)
    (g,) = torch.autograd.grad(nested(e, LABELS, chunk_size=3), e, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        g.sum().backward()
    with torch.no_grad():
        evaluated = nested(e, LABELS, chunk_size=3)
    torch.testing.assert_close(evaluated, sum(L.ntxent(e[:, :d], LABELS) for d in DIMS), **TOL)


def test_the_other_losses_and_calls_run_a_width_at_a_time():
    """Where the engine does not run the call, the transform calls the loss a width at a time:
    a pair loss, ``mat=``, a retrieval loss, an embedding regularizer, the distributed
    objective."""
    e = _randn(N, 12)
    reg = {"embedding_regularizer": pf.regularizers.lp, "embedding_reg_weight": 0.3}
    assert nested_call(L.contrastive, (e, LABELS), {}, "t") is None
    assert nested_call(L.ntxent, (e, LABELS), {"mat": e @ e.T}, "t") is None
    assert nested_call(L.ntxent, (e, LABELS), reg, "t") is None
    assert nested_call(L.multiple_negatives_ranking, (e, e), {}, "t") is None
    assert nested_call(pf.distributed.global_objective(L.ntxent), (e, LABELS), {}, "t") is None
    assert nested_call(L.ntxent, (e, LABELS), {"chunk_size": 3}, "t") is not None
    got = T.matryoshka(L.ntxent, DIMS)(e, LABELS, **reg)
    torch.testing.assert_close(got, sum(L.ntxent(e[:, :d], LABELS, **reg) for d in DIMS), **TOL)


# --- pair losses on a matmul similarity: every width's matrix from one blocked product -----------

R_REF = (7, 12)
# name -> (base loss, the call on embedding tensors, shapes): cosine and dot, self mode and a
# reference set, mined tuples, an embedding regularizer, the transform's normalize=
PAIRS = {
    "multi_similarity": (L.multi_similarity, lambda f, e: f(e, LABELS), [(N, 12)], {}),
    "contrastive-dot-ref": (
        L.contrastive,
        lambda f, e, r: f(
            e, LABELS, ref_emb=r, ref_labels=R_LABELS, distance=pf.distances.dot(),
            pos_margin=0.5, neg_margin=-0.5,
        ),
        [(N, 12), R_REF], {},
    ),
    "triplet-cosine-tuples": (
        L.triplet_margin,
        lambda f, e: f(
            e, None, distance=pf.distances.cosine(),
            indices_tuple=(torch.tensor([0, 2, 5]), torch.tensor([1, 3, 5]), torch.tensor([4, 0, 9])),
        ),
        [(N, 12)], {},
    ),
    "circle-regularized": (
        L.circle,
        lambda f, e: f(e, LABELS, embedding_regularizer=pf.regularizers.lp, embedding_reg_weight=0.3),
        [(N, 12)], {},
    ),
    "tuplet-margin-normalize": (
        L.tuplet_margin, lambda f, e: f(e, LABELS), [(N, 12)], {"normalize": True},
    ),
    "multi_similarity-dot-normalize": (
        L.multi_similarity, lambda f, e: f(e, LABELS, distance=pf.distances.dot()), [(N, 12)],
        {"normalize": True},
    ),
}  # fmt: skip


def _spy_prefix_matrices(monkeypatch):
    calls = []
    real = pf.transforms.prefix_matrices
    monkeypatch.setattr(
        pf.transforms, "prefix_matrices", lambda *a: calls.append(a[2:]) or real(*a)
    )
    return calls


@pytest.mark.parametrize("name", PAIRS)
def test_pair_loss_on_a_matmul_similarity_takes_every_width_from_one_product(name, monkeypatch):
    base, call, shapes, options = PAIRS[name]
    inputs = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=F64, requires_grad=True)
    calls = _spy_prefix_matrices(monkeypatch)

    got_in = _leaves(*inputs)
    got = call(T.matryoshka(base, DIMS, weights, **options), *got_in)
    assert calls == [((3, 6, 12), options.get("normalize", False) or name != "contrastive-dot-ref")]
    want_in = _leaves(*inputs)
    cut = functools.partial(_prefix, normalize=options.get("normalize", False))
    want = sum(weights[k] * call(base, *[cut(x, d) for x in want_in]) for k, d in enumerate(DIMS))
    _assert_same((got, _grads(got, [*got_in, weights])), (want, _grads(want, [*want_in, weights])))


def _prefix(x, d, normalize):
    x = x[..., :d]
    return torch.nn.functional.normalize(x, dim=-1) if normalize else x


@pytest.mark.parametrize("ref", [False, True], ids=["self", "ref"])
def test_pair_loss_one_product_costs_the_products_of_one_full_width_call(ref):
    """The one-product matrices' matmul FLOPs, forward and backward, are the full-width
    call's (self mode: one product a block each way, as the loss's own self product)."""
    from torch.utils.flop_counter import FlopCounterMode

    e, r = _randn(N, 12), _randn(*R_REF, seed=1)
    extra = {"ref_emb": r, "ref_labels": R_LABELS} if ref else {}

    def flops(fn):
        x = e.clone().requires_grad_()
        with FlopCounterMode(
            display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flops}
        ) as counter:
            torch.autograd.grad(fn(x, LABELS, **extra), x)
        return counter.get_total_flops()

    single = flops(L.multi_similarity)
    assert flops(T.matryoshka(L.multi_similarity, DIMS)) == single
    naive = flops(
        lambda x, y, **k: sum(
            L.multi_similarity(x[:, :d], y, **{n: _cut(v, d) for n, v in k.items()}) for d in DIMS
        )
    )
    assert naive == pytest.approx(single * sum(DIMS) / max(DIMS), rel=0.01)


def _addmm_flops(into, a, b, *_, out_shape=None, **__):  # not in FlopCounterMode's table
    return 2 * a[0] * a[1] * b[1]


def test_pair_losses_off_a_matmul_similarity_run_a_width_at_a_time(monkeypatch):
    """An Euclidean distance, a given ``mat=`` and a loss of one's own (not a batch loss, its
    matrix unknown) call the loss a width at a time (and equal the naive sum)."""
    e = _randn(N, 12)
    calls = _spy_prefix_matrices(monkeypatch)
    cos = pf.distances.cosine()
    for base, kw in [
        (L.contrastive, {}),  # lp()
        (L.multi_similarity, {"mat": cos(e)}),
        (_own_loss, {}),
    ]:
        got = T.matryoshka(base, DIMS)(e, LABELS, **kw)
        torch.testing.assert_close(got, sum(base(e[:, :d], LABELS, **kw) for d in DIMS), **TOL)
    assert calls == []


def _own_loss(embeddings, labels):
    return L.multi_similarity(embeddings, labels)


def _own_scaled_loss(scale, embeddings, labels):
    return scale * L.multi_similarity(embeddings, labels)


def test_a_partial_binding_positions_of_one_s_own_loss_runs_a_width_at_a_time():
    e = _randn(N, 12)
    got = T.matryoshka(functools.partial(_own_scaled_loss, 2.0), DIMS)(e, LABELS)
    want = sum(_own_scaled_loss(2.0, e[:, :d], LABELS) for d in DIMS)
    torch.testing.assert_close(got, want, **TOL)


def test_pair_loss_one_product_is_first_order():
    e = _randn(N, 12).requires_grad_()
    (g,) = torch.autograd.grad(
        T.matryoshka(L.multi_similarity, DIMS)(e, LABELS), e, create_graph=True
    )
    with pytest.raises(RuntimeError, match=r"not differentiable.*a width at a time"):
        g.sum().backward()


def _layer_reference(layers, loss_fn, weighting, indices, w_last, w_prior, kl_w, t):
    """The formula written out in float64, the KL term from its definition."""
    total = w_last * loss_fn(layers[-1])
    prior = len(layers) - 1
    p = torch.softmax(layers[-1].detach() / t, dim=-1)
    for j in range(prior):
        i = indices[j]
        omega = {"uniform": 1.0, "log": 1 / (1 + math.log(1 + i)), "linear": 1 / (1 + i)}[weighting]
        total = total + w_prior * omega / prior * loss_fn(layers[j])
        q = torch.log_softmax(layers[j] / t, dim=-1)
        kl = (p * (p.log() - q)).sum() / layers[j].shape[0]
        total = total + kl_w * t * kl
    return total


@pytest.mark.parametrize("weighting", ["uniform", "log", "linear"])
def test_adaptive_layers_equals_its_formula(weighting):
    layers = [_randn(N, 8, seed=s) for s in range(4)]
    indices = (0, 3, 5, 11)
    fn = T.adaptive_layers(
        L.supcon, layer_weighting=weighting, last_layer_weight=1.5, prior_layers_weight=0.7,
        kl_weight=0.4, temperature=0.5,
    )  # fmt: skip
    got_in = _leaves(*layers)
    got = fn(got_in, LABELS, layer_indices=indices)
    want_in = _leaves(*layers)
    want = _layer_reference(
        want_in, lambda e: L.supcon(e, LABELS), weighting, indices, 1.5, 0.7, 0.4, 0.5
    )
    _assert_same((got, _grads(got, got_in)), (want, _grads(want, want_in)))


def test_adaptive_layers_teacher_is_a_stop_gradient_and_a_callable_weighting():
    layers = _leaves(*[_randn(N, 8, seed=s) for s in range(3)])
    fn = T.adaptive_layers(L.ntxent, layer_weighting=lambda i: 2.0**-i, kl_weight=3.0)
    loss = fn(layers, LABELS)
    g_last = _grads(loss, layers)[-1]
    e = layers[-1].detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(L.ntxent(e, LABELS), e)
    torch.testing.assert_close(g_last, want, **TOL)  # no KL gradient reaches the last layer
    plain = T.adaptive_layers(L.ntxent, kl_weight=0.0)(layers, LABELS)
    ref = (
        L.ntxent(layers[2], LABELS)
        + (L.ntxent(layers[0], LABELS) + L.ntxent(layers[1], LABELS)) / 2
    )
    torch.testing.assert_close(plain, ref, **TOL)


def test_two_dimensional_matryoshka_is_the_composition():
    layers = [_randn(N, 12, seed=s) for s in range(3)]
    docs = [_randn(N, 12, seed=10 + s) for s in range(3)]
    fn = T.adaptive_layers(T.matryoshka(L.multiple_negatives_ranking, DIMS), kl_weight=0.0)
    got = fn(layers, docs)

    def nested(q, p):
        return sum(L.multiple_negatives_ranking(q[:, :d], p[:, :d]) for d in DIMS)

    want = (
        nested(layers[2], docs[2]) + (nested(layers[0], docs[0]) + nested(layers[1], docs[1])) / 2
    )
    torch.testing.assert_close(got, want, **TOL)
    # the KL term reads every layered argument's rows at full width
    with_kl = T.adaptive_layers(T.matryoshka(L.multiple_negatives_ranking, DIMS), temperature=0.3)
    kl = 0.0
    for j in range(2):
        p = torch.softmax(torch.cat([layers[2], docs[2]]) / 0.3, -1)
        q = torch.log_softmax(torch.cat([layers[j], docs[j]]) / 0.3, -1)
        kl += 0.3 * (p * (p.log() - q)).sum() / (2 * N)
    torch.testing.assert_close(with_kl(layers, docs), want + kl, **TOL)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["ntxent", "clip"])
def test_compile_fullgraph_equals_eager(name):
    torch._dynamo.reset()
    call, shapes = CASES[name]
    inputs = [_randn(*s, seed=i, dtype=torch.float32) for i, s in enumerate(shapes)]
    fn = T.matryoshka(BASE[name], DIMS)
    eager_in, comp_in = _leaves(*inputs), _leaves(*inputs)
    eager = call(fn, *eager_in)
    compiled = torch.compile(lambda *xs: call(fn, *xs), fullgraph=True)(*comp_in)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(compiled, comp_in), _grads(eager, eager_in), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    layered = T.adaptive_layers(L.ntxent)
    layers = [_randn(N, 8, seed=s, dtype=torch.float32) for s in range(3)]
    got = torch.compile(lambda ls: layered(ls, LABELS), fullgraph=True)(layers)
    torch.testing.assert_close(got, layered(layers, LABELS), rtol=1e-5, atol=1e-6)


def test_torch_func_grad_and_meta_device():
    e = _randn(N, 12)
    fn = T.matryoshka(L.supcon, DIMS)
    g = torch.func.grad(lambda x: fn(x, LABELS))(e)
    x = e.clone().requires_grad_()
    (want,) = torch.autograd.grad(fn(x, LABELS), x)
    torch.testing.assert_close(g, want, **TOL)
    meta = fn(torch.empty(N, 12, device="meta"), LABELS.to("meta"))
    assert meta.device.type == "meta" and meta.shape == ()
    layers = [torch.empty(N, 12, device="meta") for _ in range(2)]
    assert T.adaptive_layers(fn)(layers, LABELS.to("meta")).device.type == "meta"


def test_non_finite_embeddings_give_a_non_finite_loss():
    e = _randn(N, 12)
    e[3, 1] = float("nan")  # inside every prefix
    assert torch.isnan(T.matryoshka(L.ntxent, DIMS)(e, LABELS))
    e = _randn(N, 12)
    e[3, 10] = float("inf")  # in the widest prefix only: that term is non-finite
    assert not torch.isfinite(T.matryoshka(L.ntxent, DIMS)(e, LABELS))


def _bad(fn, *args, **kwargs):
    return lambda: fn(*args, **kwargs)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (_bad(T.matryoshka, L.ntxent, ()), ValueError, "at least one width"),
        (_bad(T.matryoshka, L.ntxent, (8, 8)), ValueError, "must not repeat"),
        (_bad(T.matryoshka, L.ntxent, (8, 0)), ValueError, "dims"),
        (_bad(T.matryoshka, L.ntxent, (8, 4), (1.0,)), ValueError, r"one weight per entry \(2\)"),
        (_bad(T.matryoshka, L.ntxent, (8, 4), (1.0, -1.0)), ValueError, "weights"),
        (_bad(T.matryoshka, lambda x, y: x.sum(), (8,)), ValueError, "none of the embedding arguments"),
        (_bad(T.matryoshka, 3, (8,)), TypeError, "callable"),
        (_bad(T.matryoshka(L.ntxent, (16, 4)), _randn(N, 12), LABELS), ValueError,
         r"dims \[16, 4\] exceed the embeddings' width 12"),
        (_bad(T.matryoshka(L.clip, (4,)), _randn(N, 12), _randn(N, 8), L.clip_init()), ValueError,
         "one width"),
        (_bad(T.adaptive_layers, L.ntxent, layer_weighting="cubic"), ValueError, "layer_weighting"),
        (_bad(T.adaptive_layers, L.ntxent, temperature=-1.0), ValueError, "temperature"),
        (_bad(T.adaptive_layers(L.ntxent), _randn(N, 8), LABELS), ValueError,
         "sequence of per-layer tensors"),
        (_bad(T.adaptive_layers(L.clip), [_randn(N, 8)] * 2, [_randn(N, 8)] * 3, L.clip_init()),
         ValueError, "same, non-zero number of layers"),
        (_bad(T.adaptive_layers(L.ntxent), [_randn(N, 8)] * 2, LABELS, layer_indices=(0,)),
         ValueError, "layer_indices"),
    ],
    ids=["no-dims", "repeat", "zero", "weight-count", "negative-weight", "no-embeddings",
         "not-callable", "too-wide", "widths-differ", "weighting", "temperature", "not-layered",
         "layer-counts", "layer-indices"],
)  # fmt: skip
def test_bad_input_is_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


# --- several ranks: the distributed objective inside the transform ------------------------------


def _nested_global_ntxent(emb, labels):
    inner = pf.distributed.global_objective(functools.partial(L.ntxent, temperature=0.2))
    return T.matryoshka(inner, DIMS)(emb, labels)


def _nested_ring_clip(a, b, params):
    return T.matryoshka(pf.distributed.global_objective(L.clip, exchange="ring"), DIMS)(
        a, b, params
    )


def test_matryoshka_of_the_global_objective_equals_one_process():
    e = _randn(11, 12)
    y = torch.arange(11) % 4
    check_distributed(
        T.matryoshka(functools.partial(L.ntxent, temperature=0.2), DIMS), e, y,
        distributed_fn=_nested_global_ntxent, sizes=(7, 4), rtol=1e-10, atol=1e-12,
    )  # fmt: skip
    params = {"logit_scale": torch.tensor(2.0, dtype=F64)}
    check_distributed(
        T.matryoshka(L.clip, DIMS), _randn(9, 12), _randn(9, 12, seed=1), params,
        distributed_fn=_nested_ring_clip, sizes=(5, 4), rtol=1e-10, atol=1e-12,
    )  # fmt: skip


def test_matryoshka_of_the_global_objective_takes_an_empty_rank():
    """A rank with no rows: matryoshka leaves the empty batch to the objective inside (it
    refused it before calling, and the other ranks waited in the objective's first collective
    until its timeout)."""
    check_distributed(
        T.matryoshka(functools.partial(L.ntxent, temperature=0.2), DIMS), _randn(11, 12),
        torch.arange(11) % 4, distributed_fn=_nested_global_ntxent, sizes=(0, 11), rtol=1e-10,
        atol=1e-12, timeout=60.0,
    )  # fmt: skip


def _adaptive_global_supcon(layers, labels, sizes):
    """One rank of ``adaptive_layers(global_objective(supcon))``: its loss and its rows'
    gradients."""
    import torch.distributed as dist

    r0 = sum(sizes[: dist.get_rank()])
    mine = [x[r0 : r0 + sizes[dist.get_rank()]].clone().requires_grad_() for x in layers]
    loss = T.adaptive_layers(pf.distributed.global_objective(L.supcon))(
        mine, labels[r0 : r0 + sizes[dist.get_rank()]]
    )
    return loss.detach(), torch.autograd.grad(loss, mine)


@pytest.mark.parametrize("sizes", [(3, 5), (8, 0)], ids=["unequal", "an-empty-rank"])
def test_adaptive_layers_of_the_global_objective_equals_one_process(sizes):
    """The KL term, the transform's own (outside the loss), is averaged over the global
    batch's rows as the loss is: every rank returns the single-process loss and its rows get
    ``W · ∂L/∂x`` (DDP's mean is the single-process gradient). Averaged over each rank's own
    rows it gave each rank another loss, unequal ranks wrong gradients, an empty rank NaN."""
    layers = [_randn(8, 5, seed=s) for s in range(3)]
    labels = torch.arange(8) // 2
    leaves = [x.clone().requires_grad_() for x in layers]
    want = T.adaptive_layers(L.supcon)(leaves, labels)
    want_grads = torch.autograd.grad(want, leaves)
    ranks = pf.testing.spawn_ranks(
        _adaptive_global_supcon, layers, labels, sizes, world_size=2, timeout=60.0
    )
    for loss, _ in ranks:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    for i, want_grad in enumerate(want_grads):
        got = torch.cat([grads[i] for _, grads in ranks]) / len(sizes)
        torch.testing.assert_close(got, want_grad, rtol=1e-10, atol=1e-12)
