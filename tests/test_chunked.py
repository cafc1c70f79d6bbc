"""pf.chunked.value_and_grad: equal to the full batch, bounded memory, clear errors."""

from __future__ import annotations

import functools

import pytest
import torch
from tracking import LargestTensor

import pmlfunc as pf
from pmlfunc.chunked import rows_value_and_grad

F64 = torch.float64
LABELS = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5]  # uneven classes and a singleton
REF_LABELS = [0, 1, 2, 5, 6, 0, 3, 3, 9]
LABELS_64 = torch.arange(64) % 6
LOSSES = {
    "contrastive": pf.losses.contrastive,
    "triplet_margin": pf.losses.triplet_margin,
    "ntxent": pf.losses.ntxent,
    "supcon": pf.losses.supcon,
    "multi_similarity": pf.losses.multi_similarity,
}


def _data(seed=0, dtype=F64, with_ref=False):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(len(LABELS), 6, generator=g, dtype=dtype)
    kw = {}
    if with_ref:
        kw = {
            "ref_emb": torch.randn(len(REF_LABELS), 6, generator=g, dtype=dtype),
            "ref_labels": torch.tensor(REF_LABELS),
        }
    return emb, torch.tensor(LABELS), kw


def _full(fn, emb, labels, wrt=("embeddings",), **kw):
    leaves = {"embeddings": emb.clone().requires_grad_()}
    if "ref_emb" in kw:
        kw = {**kw, "ref_emb": kw["ref_emb"].clone().requires_grad_()}
        leaves["ref_emb"] = kw["ref_emb"]
    loss = fn(leaves["embeddings"], labels, **kw)
    grads = torch.autograd.grad(loss, [leaves[n] for n in wrt])
    return loss, grads


def _assert_equal(chunked, full):
    (lc, gc), (lf, gf) = chunked, full
    gc = gc if isinstance(gc, tuple) else (gc,)
    torch.testing.assert_close(lc, lf, rtol=1e-9, atol=1e-12)
    for a, b in zip(gc, gf, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 20])
@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("name", LOSSES)
def test_equals_full_batch(name, with_ref, chunk_size):
    emb, labels, kw = _data(with_ref=with_ref)
    fn = LOSSES[name]
    wrt = ("embeddings", "ref_emb") if with_ref else ("embeddings",)
    got = pf.chunked.value_and_grad(fn, chunk_size, wrt=wrt)(emb, labels, **kw)
    _assert_equal(got, _full(fn, emb, labels, wrt, **kw))
    assert got[0] != 0


REDUCERS = {
    "mean": pf.reducers.mean(),
    "avg_nonzero": pf.reducers.avg_nonzero(),
    "sum": pf.reducers.sum(),
    "threshold": pf.reducers.threshold(0.05, 2.0),
    "per_anchor": pf.reducers.per_anchor(pf.reducers.avg_nonzero()),
    "class_weighted": pf.reducers.class_weighted(torch.arange(1.0, 11.0, dtype=F64)),
}


@pytest.mark.parametrize("reducer", REDUCERS)
@pytest.mark.parametrize("name", LOSSES)
def test_every_chunkable_reducer(name, reducer):
    emb, labels, _ = _data(seed=1)
    fn = functools.partial(LOSSES[name], reducer=REDUCERS[reducer])
    got = pf.chunked.value_and_grad(fn, 5)(emb, labels)
    _assert_equal(got, _full(fn, emb, labels))


@pytest.mark.parametrize(
    "name,kw",
    [
        ("triplet_margin", {"smooth_loss": True}),
        ("triplet_margin", {"distance": pf.distances.cosine(), "margin": 0.1}),
        ("contrastive", {"distance": pf.distances.snr()}),
        ("contrastive", {"distance": pf.distances.lp(power=2)}),
        ("multi_similarity", {"distance": pf.distances.lp()}),
        ("ntxent", {"distance": pf.distances.dot(), "temperature": 0.5}),
        ("supcon", {"temperature": 0.3}),
    ],
)
def test_distances_and_hyper_parameters(name, kw):
    emb, labels, _ = _data(seed=2)
    got = pf.chunked.value_and_grad(LOSSES[name], 3)(emb, labels, **kw)
    _assert_equal(got, _full(LOSSES[name], emb, labels, **kw))


def _tuples():
    pairs = (
        torch.tensor([0, 1, 3, 3, 12]),
        torch.tensor([1, 2, 4, 4, 11]),
        torch.tensor([0, 5, 12, 5]),
        torch.tensor([3, 5, 2, 0]),
    )
    triplets = (
        torch.tensor([0, 1, 3, 5, 12, 0]),
        torch.tensor([1, 2, 4, 0, 11, 1]),
        torch.tensor([3, 5, 0, 7, 2, 3]),
    )
    return {"pairs": pairs, "triplets": triplets}


@pytest.mark.parametrize("kind", ["pairs", "triplets"])
@pytest.mark.parametrize("name", LOSSES)
def test_indices_tuples_with_repeats(name, kind):
    emb, labels, _ = _data(seed=3)
    it = _tuples()[kind]
    got = pf.chunked.value_and_grad(LOSSES[name], 4)(emb, labels, indices_tuple=it)
    _assert_equal(got, _full(LOSSES[name], emb, labels, indices_tuple=it))


def test_tensor_temperature_and_no_positive_batches():
    emb, _, _ = _data(seed=4)
    labels = torch.arange(len(LABELS))  # no positives at all
    for name in ("ntxent", "supcon", "contrastive"):
        got = pf.chunked.value_and_grad(LOSSES[name], 4)(emb, labels)
        _assert_equal(got, _full(LOSSES[name], emb, labels))
    t = torch.tensor(0.2, dtype=F64)
    got = pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, torch.tensor(LABELS), temperature=t)
    _assert_equal(got, _full(pf.losses.ntxent, emb, torch.tensor(LABELS), temperature=t))


def test_low_precision_loss_is_float32_and_gradient_keeps_the_input_dtype():
    emb, labels, _ = _data(seed=5, dtype=torch.bfloat16)
    loss, g = pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels)
    assert loss.dtype == torch.float32 and g.dtype == torch.bfloat16
    assert torch.isfinite(g.float()).all()
    full, (gf,) = _full(pf.losses.ntxent, emb, labels)
    torch.testing.assert_close(loss.float(), full.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(g.float(), gf.float(), rtol=2e-2, atol=1e-3)


HYPER = {  # a loss and hyper-parameters it can learn, as tensors
    "ntxent": {"temperature": 0.2},
    "supcon": {"temperature": 0.3},
    "multi_similarity": {"alpha": 2.0, "beta": 40.0, "base": 0.4},
    "contrastive": {"pos_margin": 0.2, "neg_margin": 0.6},
    "triplet_margin": {"margin": 0.3},
}


@pytest.mark.parametrize("chunk_size", [4, 13], ids=["chunked", "whole"])
@pytest.mark.parametrize("name", HYPER)
def test_tensor_hyper_parameters_in_wrt_get_the_full_batch_gradient(name, chunk_size):
    emb, labels, _ = _data(seed=8)
    hyper = {k: torch.tensor(v, dtype=F64) for k, v in HYPER[name].items()}
    wrt = ("embeddings", *hyper)
    loss, grads = pf.chunked.value_and_grad(LOSSES[name], chunk_size, wrt=wrt)(emb, labels, **hyper)

    leaves = {k: v.clone().requires_grad_() for k, v in hyper.items()}
    x = emb.clone().requires_grad_()
    full = LOSSES[name](x, labels, **leaves)
    want = torch.autograd.grad(full, [x, *leaves.values()])
    _assert_equal((loss, grads), (full, want))
    assert any(float(g.abs()) > 0 for g in grads[1:])  # the test can see a wrong gradient
    # one name alone: a tensor, not a tuple
    _, g = pf.chunked.value_and_grad(LOSSES[name], chunk_size, wrt=wrt[1])(emb, labels, **hyper)
    torch.testing.assert_close(g, want[1], rtol=1e-7, atol=1e-10)


@pytest.mark.compile
def test_compile_fullgraph_with_a_learnable_temperature():
    torch._dynamo.reset()
    emb, labels, _ = _data(seed=9, dtype=torch.float32)
    vg = pf.chunked.value_and_grad(pf.losses.ntxent, 5, wrt=("embeddings", "temperature"))
    t = torch.tensor(0.25)
    lc, (gc, tc) = torch.compile(vg, fullgraph=True)(emb, labels, temperature=t)
    le, (ge, te) = vg(emb, labels, temperature=t)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(tc, te, rtol=1e-4, atol=1e-5)


@pytest.mark.compile
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    emb, labels, _ = _data(seed=6, dtype=torch.float32)
    vg = pf.chunked.value_and_grad(pf.losses.contrastive, 7)
    lc, gc = torch.compile(vg, fullgraph=True)(emb, labels)
    le, ge = vg(emb, labels)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["ntxent", "contrastive"])  # one sub-loss and two
def test_shares_of_complementary_anchor_rows_sum_to_the_whole_batch(name):
    """The rows form pf.distributed splits over ranks: row bounds that cut a chunk, each
    share normalised over the whole batch."""
    emb, labels, _ = _data(seed=8)
    rows_vg = rows_value_and_grad(LOSSES[name], 4, "embeddings")
    (v1, g1), (v2, g2) = rows_vg((0, 6), emb, labels), rows_vg((6, 13), emb, labels)
    _assert_equal((v1 + v2, g1 + g2), _full(LOSSES[name], emb, labels))
    assert v1 != 0 and v2 != 0


def test_eager_chunks_take_plain_autograd_not_torch_func(monkeypatch):
    """A torch.func transform costs ~1 ms a call on a CPU: through it, chunked NT-Xent at
    B = 512 (chunk 128) took ~2x the dense step (issue 29). Eager mode must not use it."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.func transform in eager mode")

    for name in ("vjp", "grad", "grad_and_value"):
        monkeypatch.setattr(torch.func, name, refuse)
    emb, labels, kw = _data(seed=9, with_ref=True)
    wrt = ("embeddings", "ref_emb")
    fn = functools.partial(pf.losses.contrastive, embedding_regularizer=pf.regularizers.lp)
    got = pf.chunked.value_and_grad(fn, 4, wrt=wrt)(emb, labels, **kw)
    _assert_equal(got, _full(fn, emb, labels, wrt, **kw))


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_the_engines_losses_take_the_tiled_engine_in_tiles_of_the_chunk(
    name, with_ref, monkeypatch
):
    """In eager mode a call the tiled engine runs (labels, no ``indices_tuple``, ``cosine()`` or
    ``dot()``, a reducer of its own) is computed by the engine in tiles of ``chunk_size`` rows,
    one walk that forms each tile's gradient: the loss and the gradients (embeddings, reference
    set, a learnable temperature) equal the chunks' path for every reducer and both distances,
    with an embedding regularizer too; a call with an ``indices_tuple`` takes the chunks."""
    from pmlfunc import chunked
    from pmlfunc.losses import _tiled

    emb, labels, kw = _data(seed=12, with_ref=with_ref)
    kw["temperature"] = torch.tensor(0.3, dtype=F64)
    wrt = ("embeddings", *(("ref_emb",) if with_ref else ()), "temperature")
    run_local = _tiled.run_local
    chunks: list[int | None] = []
    monkeypatch.setattr(_tiled, "run_local", lambda c: chunks.append(c.chunk) or run_local(c))
    reducers = {"ntxent": ("mean", "sum"), "supcon": ("avg_nonzero", "mean", "sum")}[name]
    for reducer in reducers:
        for distance in (pf.distances.cosine(), pf.distances.dot()):
            for regularizer in (None, pf.regularizers.lp):
                fn = functools.partial(
                    LOSSES[name], reducer=getattr(pf.reducers, reducer)(), distance=distance,
                    embedding_regularizer=regularizer,
                )  # fmt: skip
                got = pf.chunked.value_and_grad(fn, 4, wrt=wrt)(emb, labels, **kw)
                assert chunks == [4]
                chunks.clear()
                with monkeypatch.context() as m:
                    m.setattr(chunked, "_engine", lambda *a: None)
                    want = pf.chunked.value_and_grad(fn, 4, wrt=wrt)(emb, labels, **kw)
                _assert_equal(got, (want[0], want[1]))
    pairs = pf.miners.pair_margin(emb, labels) if not with_ref else None
    if pairs is not None:
        pf.chunked.value_and_grad(LOSSES[name], 4)(emb, labels, indices_tuple=pairs)
        assert chunks == []


def test_eager_results_carry_no_autograd_graph():
    """Whatever the embeddings' own graph: the gradient goes into it by emb.backward(grad)."""
    emb, labels, _ = _data(seed=10)
    emb = emb.requires_grad_()
    for chunk in (4, 13):  # several chunks, and one holding the whole batch
        loss, grad = pf.chunked.value_and_grad(pf.losses.ntxent, chunk)(emb, labels)
        assert loss.grad_fn is None and not loss.requires_grad
        assert grad.grad_fn is None and not grad.requires_grad


@pytest.mark.parametrize("name", ["ntxent", "contrastive"])
def test_vmap_over_value_and_grad_equals_each_batch(name):
    """Inside a torch.func transform the chunks are differentiated by torch.func.vjp."""
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(3, len(LABELS), 6, generator=g, dtype=F64)
    labels = torch.tensor(LABELS)
    vg = pf.chunked.value_and_grad(LOSSES[name], 4)
    values, grads = torch.func.vmap(lambda e: vg(e, labels))(emb)
    for i in range(emb.shape[0]):
        _assert_equal((values[i], grads[i]), _full(LOSSES[name], emb[i], labels))


@pytest.mark.parametrize("name", LOSSES)
def test_no_tensor_larger_than_a_chunk_block(name):
    b, d, chunk = 192, 4, 16
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(b, d, generator=g)
    labels = torch.arange(b) // 4
    with LargestTensor() as full:
        _full(LOSSES[name], emb, labels)
    with LargestTensor() as chunked:
        pf.chunked.value_and_grad(LOSSES[name], chunk)(emb, labels)
    assert full.largest >= b * b
    assert chunked.largest <= max(chunk * b, 8 * chunk * d, b * d)


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("name", HYPER)
def test_chunked_loss_backward_gives_the_full_batch_gradients(name, with_ref):
    """pf.chunked.loss: the same value, and backward() reaches the embeddings, the reference
    set and the tensor hyper-parameters with the full-batch gradients."""
    emb, labels, kw = _data(seed=12, with_ref=with_ref)

    def leaves():
        x = emb.clone().requires_grad_()
        extra = {k: torch.tensor(v, dtype=F64, requires_grad=True) for k, v in HYPER[name].items()}
        if with_ref:
            extra |= {
                "ref_emb": kw["ref_emb"].clone().requires_grad_(),
                "ref_labels": kw["ref_labels"],
            }
        return x, extra

    x, extra = leaves()
    got = pf.chunked.loss(LOSSES[name], 4)(x, labels, **extra)
    got.backward()
    x_full, extra_full = leaves()
    want = LOSSES[name](x_full, labels, **extra_full)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in [(x, x_full), *[(extra[k], extra_full[k]) for k in extra if k != "ref_labels"]]:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-10)


def test_chunked_loss_under_torch_func_grad_and_bounded_memory():
    b, d, chunk = 192, 4, 16
    g = torch.Generator().manual_seed(13)
    emb = torch.randn(b, d, generator=g, dtype=F64)
    labels = torch.arange(b) // 4
    fn = pf.chunked.loss(pf.losses.multi_similarity, chunk)
    got = torch.func.grad(lambda e: fn(e, labels))(emb)
    _, (want,) = _full(pf.losses.multi_similarity, emb, labels)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)
    x = emb.float().requires_grad_()
    with LargestTensor() as rec:
        fn(x, labels).backward()
    assert rec.largest <= max(chunk * b, 8 * chunk * d, b * d)


@pytest.mark.compile
def test_chunked_loss_compiles_fullgraph_with_its_backward():
    torch._dynamo.reset()
    emb, labels, _ = _data(seed=14, dtype=torch.float32)
    fn = pf.chunked.loss(pf.losses.contrastive, 5)
    x, y = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    compiled = torch.compile(fn, fullgraph=True)(x, labels)
    compiled.backward()
    eager = fn(y, labels)
    eager.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", [pf.losses.lifted_structure, pf.losses.intra_pair_variance])
def test_losses_that_do_not_decompose_raise(loss):
    """lifted_structure's positive pair reads its positive's row; intra_pair_variance's
    terms need the mean over every pair."""
    emb, labels = torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="cannot be chunked"):
        pf.chunked.value_and_grad(loss, chunk_size=2)(emb, labels)


def test_errors():
    emb, labels, kw = _data(with_ref=True)
    with pytest.raises(ValueError, match="does not decompose over anchors"):
        pf.chunked.value_and_grad(pf.losses.proxy_anchor, 4)
    with pytest.raises(ValueError, match="does not decompose over anchors"):
        pf.chunked.value_and_grad(lambda e, y: e.sum(), 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            pf.chunked.value_and_grad(pf.losses.ntxent, bad)
    for bad_wrt in ((), ("embeddings", "embeddings"), (3,)):
        with pytest.raises(ValueError, match="wrt must name"):
            pf.chunked.value_and_grad(pf.losses.ntxent, 4, wrt=bad_wrt)
    with pytest.raises(ValueError, match=r"'labels', which is neither .* hyper-parameters: "):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4, wrt="labels")(emb, labels)
    with pytest.raises(TypeError, match="'temperature', so it must be given as a floating tensor"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4, wrt="temperature")(emb, labels)
    with pytest.raises(ValueError, match="swap=True"):
        pf.chunked.value_and_grad(pf.losses.triplet_margin, 4)(emb, labels, swap=True)
    with pytest.raises(ValueError, match="does not split over anchors"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, reducer=pf.reducers.none())
    with pytest.raises(ValueError, match="mat cannot be chunked"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, mat=pf.distances.cosine()(emb))
    with pytest.raises(ValueError, match="no ref_emb was given"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4, wrt="ref_emb")(emb, labels)
    with pytest.raises(ValueError, match="chunking itself"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, chunk_size=2)
    with pytest.raises(TypeError):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, temprature=0.1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, temperature=0.0)
    with pytest.raises(ValueError, match="ref_emb was given without ref_labels"):
        pf.chunked.value_and_grad(pf.losses.ntxent, 4)(emb, labels, ref_emb=kw["ref_emb"])


@pytest.mark.parametrize("name", ["decoupled_contrastive", "instance", "ntxent"])
@pytest.mark.parametrize("entry", ["value_and_grad", "loss"])
def test_autocast_gives_the_float32_gradient(name, entry):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with float32 embeddings, the
    chunked gradient is the float32 one: the chunks' backward runs inside the forward, where
    the user's autocast region would cast its products (decoupled contrastive and instance,
    whose backward autograd records: 2e-3 off)."""
    emb, labels = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), LABELS_64
    fn = getattr(pf.losses, name)

    def run(enabled):
        x = emb.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            if entry == "value_and_grad":
                return pf.chunked.value_and_grad(fn, chunk_size=16)(x, labels)
            loss = pf.chunked.loss(fn, 16)(x, labels)
        return loss, torch.autograd.grad(loss, x)[0]

    (want, want_grad), (got, got_grad) = run(False), run(True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("how", ["backward", "func.grad"])
def test_a_learnable_embedding_reg_weight_gets_the_regularizers_value_as_its_gradient(how):
    """``∂L/∂w = regularizer(x)``, as the plain loss's autograd gives it (the chunked forward
    adds ``w · regularizer(x)`` without a graph: its gradient was None, 0 under torch.func)."""
    emb = torch.randn(17, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(17) % 5
    reg = pf.regularizers.lp

    def grad_of(fn):
        def value(w):
            return fn(emb, labels, embedding_regularizer=reg, embedding_reg_weight=w)

        if how == "func.grad":
            return torch.func.grad(value)(torch.tensor(0.3, dtype=F64))
        w = torch.tensor(0.3, dtype=F64, requires_grad=True)
        return torch.autograd.grad(value(w), w)[0]

    want = grad_of(pf.losses.triplet_margin)
    torch.testing.assert_close(want, reg(emb), rtol=1e-12, atol=0)
    for chunk in (7, 100):
        got = grad_of(pf.chunked.loss(pf.losses.triplet_margin, chunk))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_vmap_over_hyper_parameters_alone_equals_a_loop():
    """``vmap(grad)`` over a hyper-parameter with unbatched embeddings (and over embeddings and
    one hyper-parameter with another left unbatched): the chunks' gradients are batched, the
    buffers not, so they add out of place there (it raised a shape error)."""
    g = torch.Generator().manual_seed(0)
    emb, labels = torch.randn(17, 5, dtype=F64, generator=g), torch.arange(17) % 5
    ntx = pf.chunked.loss(pf.losses.ntxent, 7)
    ts = torch.tensor([0.1, 0.3, 1.0], dtype=F64)
    got = torch.func.vmap(torch.func.grad(lambda t: ntx(emb, labels, temperature=t)))(ts)
    want = torch.stack([torch.func.grad(lambda t: ntx(emb, labels, temperature=t))(t) for t in ts])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)

    ms = pf.chunked.loss(pf.losses.multi_similarity, 7)
    beta = torch.tensor(50.0, dtype=F64)
    embs = torch.randn(3, 17, 5, dtype=F64, generator=g)
    alphas = torch.tensor([1.0, 2.0, 3.0], dtype=F64)

    def grads(e, a):
        return torch.func.grad(lambda e, a: ms(e, labels, alpha=a, beta=beta), argnums=(0, 1))(e, a)

    got_e, got_a = torch.func.vmap(grads)(embs, alphas)
    for i in range(3):
        want_e, want_a = grads(embs[i], alphas[i])
        torch.testing.assert_close(got_e[i], want_e, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_a[i], want_a, rtol=1e-12, atol=0)
