"""Tests for the tiled engine (``pmlfunc.losses._tiled``) behind ``chunk_size=`` of NT-Xent and
SupCon (CLIP and SigLIP, which share it, are tested in ``test_cross_modal.py``; all four are
compiled here with their gradient taken inside the compiled function).

The tiled path must return what the dense ``pf.losses.ntxent`` / ``supcon`` return — value and
gradients w.r.t. the embeddings, the reference set and a tensor temperature — while no tensor
larger than ``max(chunk × M, B × D)`` is ever created, in the forward or the backward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import loss_dtype
from hypothesis import given, settings
from hypothesis import strategies as st
from tracking import LargestTensor

import pmlfunc.distances as pfd
import pmlfunc.losses as pfl
import pmlfunc.reducers as pfr

F64 = torch.float64
B, M, D = 11, 9, 5

# the tiled path is the public loss given chunk_size (every call below passes one)
STREAMING = {"ntxent": pfl.ntxent, "supcon": pfl.supcon}
DENSE = {"ntxent": pfl.ntxent, "supcon": pfl.supcon}
REDUCERS = {"ntxent": ("mean", "sum"), "supcon": ("avg_nonzero", "mean", "sum")}
DISTANCES = {"cosine": pfd.cosine, "dot": pfd.dot}

LABELS = {
    # uneven classes and singletons (classes 2 and 4 have one sample)
    "uneven": [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4],
    "no_positive": list(range(B)),  # every label distinct
    "no_negative": [7] * B,  # one class
}
REF_LABELS = {
    "uneven": [0, 3, 3, 1, 5, 0, 0, 4, 6],
    "no_positive": list(range(100, 100 + M)),
    "no_negative": [7] * M,
}
CHUNKS = [1, 3, 7, B, B + 5]


def _data(gen, dtype=F64):
    emb = torch.randn(B, D, generator=gen, dtype=F64).to(dtype)
    ref = torch.randn(M, D, generator=gen, dtype=F64).to(dtype)
    return emb, ref


def _value_and_grads(fn, emb, labels, ref, ref_labels, temperature, **kw):
    """The loss and its gradients w.r.t. (embeddings[, ref_emb][, temperature])."""
    e = emb.clone().requires_grad_()
    inputs = [e]
    if ref is not None:
        r = ref.clone().requires_grad_()
        kw.update(ref_emb=r, ref_labels=ref_labels)
        inputs.append(r)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.clone().requires_grad_()
        inputs.append(temperature)
    loss = fn(e, labels, temperature=temperature, **kw)
    return loss, torch.autograd.grad(loss, inputs)


def _assert_same(a, b):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=1e-10, atol=1e-13)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def _reducer(name):
    return getattr(pfr, name)()


# ---------------------------------------------------------------------------------------------
# Equality with the dense losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("case", list(LABELS))
@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_equals_dense_default_reducer(gen, name, mode, case, chunk):
    emb, ref = _data(gen)
    labels = torch.tensor(LABELS[case])
    ref_labels = torch.tensor(REF_LABELS[case]) if mode == "ref" else None
    ref = ref if mode == "ref" else None
    t = torch.tensor(0.3, dtype=F64)
    dense = _value_and_grads(DENSE[name], emb, labels, ref, ref_labels, t)
    stream = _value_and_grads(STREAMING[name], emb, labels, ref, ref_labels, t, chunk_size=chunk)
    _assert_same(stream, dense)


@pytest.mark.parametrize("chunk", [1, 4, B + 5])
@pytest.mark.parametrize("distance", list(DISTANCES))
@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize(
    ("name", "reducer"), [(n, r) for n in ("ntxent", "supcon") for r in REDUCERS[n]]
)
def test_equals_dense_reducers_and_distances(gen, name, reducer, mode, distance, chunk):
    emb, ref = _data(gen)
    emb = emb * 1.7  # dot(): unnormalised rows
    labels = torch.tensor(LABELS["uneven"])
    ref_labels = torch.tensor(REF_LABELS["uneven"]) if mode == "ref" else None
    ref = ref if mode == "ref" else None
    kw = {"reducer": _reducer(reducer), "distance": DISTANCES[distance]()}
    t = torch.tensor(0.5, dtype=F64)
    dense = _value_and_grads(DENSE[name], emb, labels, ref, ref_labels, t, **kw)
    stream = _value_and_grads(
        STREAMING[name], emb, labels, ref, ref_labels, t, chunk_size=chunk, **kw
    )
    _assert_same(stream, dense)


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_python_float_temperature_and_defaults(gen, name):
    emb, _ = _data(gen)
    labels = torch.tensor(LABELS["uneven"])
    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    a = STREAMING[name](e1, labels, chunk_size=4)
    b = DENSE[name](e2, labels)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(e1.grad, e2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["ref_emb", "temperature", "embeddings"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_partial_requires_grad(gen, name, which):
    """Only one input requires grad: the backward computes just that gradient, correctly."""
    emb, ref = _data(gen)
    labels, ref_labels = torch.tensor(LABELS["uneven"]), torch.tensor(REF_LABELS["uneven"])
    grads = []
    for fn, kw in ((STREAMING[name], {"chunk_size": 3}), (DENSE[name], {})):
        args = {
            "embeddings": emb.clone(),
            "ref_emb": ref.clone(),
            "temperature": torch.tensor(0.4, dtype=F64),
        }
        args[which].requires_grad_()
        loss = fn(
            args["embeddings"],
            labels,
            ref_emb=args["ref_emb"],
            ref_labels=ref_labels,
            temperature=args["temperature"],
            **kw,
        )
        grads.append(torch.autograd.grad(loss, args[which])[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["ntxent", "supcon"]),
    b=st.integers(1, 9),
    m=st.integers(1, 7),
    classes=st.integers(1, 4),
    chunk=st.integers(1, 12),
    ref_mode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_equals_dense_property(name, b, m, classes, chunk, ref_mode, seed):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(b, 3, generator=g, dtype=F64)
    labels = torch.randint(0, classes, (b,), generator=g)
    ref = torch.randn(m, 3, generator=g, dtype=F64) if ref_mode else None
    ref_labels = torch.randint(0, classes, (m,), generator=g) if ref_mode else None
    t = torch.tensor(0.25, dtype=F64)
    dense = _value_and_grads(DENSE[name], emb, labels, ref, ref_labels, t)
    stream = _value_and_grads(STREAMING[name], emb, labels, ref, ref_labels, t, chunk_size=chunk)
    _assert_same(stream, dense)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_low_precision(gen, name, dtype):
    """float16/bfloat16 in: float32 inside, a float32 loss and gradients of the input dtype, as
    the dense loss."""
    emb, ref = _data(gen, dtype)
    labels, ref_labels = torch.tensor(LABELS["uneven"]), torch.tensor(REF_LABELS["uneven"])
    for kw in ({}, {"ref_emb": ref, "ref_labels": ref_labels}):
        e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
        a = STREAMING[name](e1, labels, chunk_size=4, **kw)
        b = DENSE[name](e2, labels, **kw)
        assert a.dtype == torch.float32
        a.backward()
        b.backward()
        assert e1.grad.dtype == dtype
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(e1.grad, e2.grad)


# ---------------------------------------------------------------------------------------------
# Autograd machinery
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_gradcheck(gen, name, mode):
    emb = torch.randn(6, 3, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    ref = torch.randn(5, 3, generator=gen, dtype=F64, requires_grad=True)
    ref_labels = torch.tensor([0, 2, 1, 3, 1])
    t = torch.tensor(0.5, dtype=F64, requires_grad=True)
    if mode == "self":

        def fn(e, t):
            return STREAMING[name](e, labels, temperature=t, chunk_size=4)

        inputs = (emb, t)
    else:

        def fn(e, r, t):
            return STREAMING[name](
                e, labels, temperature=t, ref_emb=r, ref_labels=ref_labels, chunk_size=4
            )

        inputs = (emb, ref, t)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_torch_func(gen, name):
    """torch.func.grad, vmap (generate_vmap_rule) and a batched cotangent equal the dense loss."""
    labels = torch.tensor(LABELS["uneven"])
    emb, _ = _data(gen)

    def stream(e):
        return STREAMING[name](e, labels, chunk_size=4)

    def dense(e):
        return DENSE[name](e, labels)

    torch.testing.assert_close(torch.func.grad(stream)(emb), torch.func.grad(dense)(emb))
    batch = torch.randn(3, B, D, generator=gen, dtype=F64)
    torch.testing.assert_close(torch.vmap(stream)(batch), torch.vmap(dense)(batch))
    torch.testing.assert_close(
        torch.vmap(torch.func.grad(stream))(batch), torch.vmap(torch.func.grad(dense))(batch)
    )
    cts = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    _, vjp_s = torch.func.vjp(stream, emb)
    _, vjp_d = torch.func.vjp(dense, emb)
    torch.testing.assert_close(torch.vmap(vjp_s)(cts)[0], torch.vmap(vjp_d)(cts)[0])


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_double_backward_raises(gen, name):
    """The gradient is computed without a graph: differentiating it again fails loudly."""
    emb, _ = _data(gen)
    labels = torch.tensor(LABELS["uneven"])
    e = emb.clone().requires_grad_()
    (g,) = torch.autograd.grad(STREAMING[name](e, labels, chunk_size=3), e, create_graph=True)
    torch.testing.assert_close(g, torch.autograd.grad(DENSE[name](e, labels), e)[0])
    with pytest.raises(RuntimeError, match="not differentiable"):
        g.sum().backward()
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.func.grad(
            lambda v: torch.func.grad(lambda w: STREAMING[name](w, labels, chunk_size=3))(v).sum()
        )(emb)


@pytest.mark.compile
def test_compile_fullgraph_equals_eager(gen):
    torch._dynamo.reset()
    emb, ref = _data(gen)
    labels, ref_labels = torch.tensor(LABELS["uneven"]), torch.tensor(REF_LABELS["uneven"])

    def fn(e, r, t):
        a = pfl.ntxent(e, labels, temperature=t, chunk_size=4)
        b = pfl.supcon(e, labels, temperature=t, ref_emb=r, ref_labels=ref_labels, chunk_size=3)
        return a + b

    compiled = torch.compile(fn, fullgraph=True)
    t = torch.tensor(0.3, dtype=F64)
    results = []
    for f in (compiled, fn):
        inputs = [
            emb.clone().requires_grad_(),
            ref.clone().requires_grad_(),
            t.clone().requires_grad_(),
        ]
        out = f(*inputs)
        results.append((out, torch.autograd.grad(out, inputs)))
    _assert_same(results[0], results[1])


def _engine_call(gen, name: str, chunk: int | None):
    """``(f, args)``: ``f(*args)`` the loss ``name`` of the tiled engine (``chunk`` rows a tile,
    ``None``: dense) in everything it is differentiated in: NT-Xent and SupCon in the
    embeddings, a reference set and the temperature; CLIP and SigLIP in both sets and their
    params (a dict: a pytree)."""
    emb, ref = _data(gen)
    labels, ref_labels = torch.tensor(LABELS["uneven"]), torch.tensor(REF_LABELS["uneven"])
    if name in ("ntxent", "supcon"):

        def f(e, r, t):
            kw = {"ref_emb": r, "ref_labels": ref_labels}
            return getattr(pfl, name)(e, labels, temperature=t, chunk_size=chunk, **kw)

        return f, (emb, ref, torch.tensor(0.3, dtype=F64))
    params = getattr(pfl, f"{name}_init")(logit_scale=1.2, logit_bias=-0.4, dtype=F64)

    def g(a, b, p):
        return getattr(pfl, name)(a, b, p, labels=labels, chunk_size=chunk)

    return g, (emb, torch.randn(B, D, generator=gen, dtype=F64), params)


@pytest.mark.slow  # inductor: 10-25 s a loss on a loaded 2-core CPU
@pytest.mark.compile
@pytest.mark.parametrize("name", ["ntxent", "supcon", "clip", "siglip"])
def test_gradient_taken_inside_the_compiled_function_equals_eager_and_dense(gen, name):
    """``torch.compile(torch.func.grad_and_value(loss), fullgraph=True)`` of the tiled loss
    (inductor): the gradient formed inside the graph, through the engine's Functions (the
    tiled NT-Xent failed there, on dynamo's rewrite of ``addcmul_(value=)`` into a prim with no
    functorch rule, while a gradient taken outside the compiled function worked), equals the
    eager transform and the dense loss's gradient."""
    tiled, args = _engine_call(gen, name, 3)
    dense, _ = _engine_call(gen, name, None)
    argnums = tuple(range(len(args)))
    torch._dynamo.reset()
    compiled = torch.compile(torch.func.grad_and_value(tiled, argnums=argnums), fullgraph=True)
    got = compiled(*args)
    torch.testing.assert_close(got, torch.func.grad_and_value(tiled, argnums=argnums)(*args))
    want = torch.func.grad_and_value(dense, argnums=argnums)(*args)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_tiled_loss_compiles_inside_grad_and_vmap(gen, name):
    """``torch.func.grad`` (of the embeddings alone) and ``vmap`` over a stack of batches, each
    compiled with ``fullgraph=True`` (aot_eager: the graph capture is what is checked; inductor
    compiles the same ops above), equal the dense loss."""
    labels = torch.tensor(LABELS["uneven"])
    emb, _ = _data(gen)
    batch = torch.randn(3, B, D, generator=gen, dtype=F64)

    def stream(e):
        return getattr(pfl, name)(e, labels, chunk_size=4)

    def dense(e):
        return getattr(pfl, name)(e, labels)

    for transform, x in ((torch.func.grad, emb), (torch.func.vmap, batch)):
        torch._dynamo.reset()
        compiled = torch.compile(transform(stream), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), transform(dense)(x), rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="PyTorch 2.13: under torch.compile, vmap of a function whose gradient goes through "
    "an autograd.Function (every pmlfunc loss: the dense ones through pmlfunc._ops as well) "
    "fails, 'You tried to vmap over ApplyTemplate' (pytorch/pytorch#129845); eager vmap of "
    "the gradient works (test_torch_func), as does a loop over the batches of a compiled "
    "gradient",
)
def test_vmap_of_the_gradient_compiles(gen):
    labels = torch.tensor(LABELS["uneven"])
    batch = torch.randn(3, B, D, generator=gen, dtype=F64)

    def stream(e):
        return pfl.ntxent(e, labels, chunk_size=4)

    torch._dynamo.reset()
    try:
        fn = torch.compile(torch.func.vmap(torch.func.grad(stream)), fullgraph=True)
        got = fn(batch)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(stream))(batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_meta_device(name, mode, dtype):
    emb = torch.randn(B, D, device="meta", dtype=dtype, requires_grad=True)
    labels = torch.zeros(B, dtype=torch.long, device="meta")
    kw = {}
    if mode == "ref":
        ref = torch.randn(M, D, device="meta", dtype=dtype, requires_grad=True)
        kw = {"ref_emb": ref, "ref_labels": torch.zeros(M, dtype=torch.long, device="meta")}
    t = torch.tensor(0.2, device="meta", requires_grad=True)
    loss = STREAMING[name](emb, labels, temperature=t, chunk_size=4, **kw)
    assert loss.shape == () and loss.device.type == "meta" and loss.dtype == loss_dtype(dtype)
    loss.backward()
    assert emb.grad.shape == emb.shape and t.grad.shape == ()
    if mode == "ref":
        assert kw["ref_emb"].grad.shape == (M, D)


# ---------------------------------------------------------------------------------------------
# The memory bound
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_memory_bound(name, mode):
    """B = M = 256, chunk 16: the dense loss creates 256 × 256 tensors, the tiled loss
    nothing larger than max(chunk × M, B × D), in the forward or the backward."""
    g = torch.Generator().manual_seed(0)
    b, m, d, chunk = 256, 256, 8, 16
    emb = torch.randn(b, d, generator=g, requires_grad=True)
    labels = torch.randint(0, 20, (b,), generator=g)
    kw = {}
    if mode == "ref":
        kw = {
            "ref_emb": torch.randn(m, d, generator=g, requires_grad=True),
            "ref_labels": torch.randint(0, 20, (m,), generator=g),
        }
    t = torch.tensor(0.1, requires_grad=True)
    bound = max(chunk * m, b * d)
    with LargestTensor() as rec:
        STREAMING[name](emb, labels, temperature=t, chunk_size=chunk, **kw).backward()
    assert rec.largest <= bound, (rec.largest, bound)
    assert emb.grad is not None and t.grad is not None
    with LargestTensor() as rec:  # the check has teeth: the dense loss exceeds the bound
        DENSE[name](emb, labels, temperature=t, **kw).backward()
    assert rec.largest >= b * m > bound


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_errors(gen, name):
    fn = STREAMING[name]
    emb, ref = _data(gen)
    labels = torch.tensor(LABELS["uneven"])
    for dist, shown in ((pfd.lp(), "Lp"), (pfd.snr(), "SNR"), (pfd.lp(power=2), "Lp")):
        with pytest.raises(ValueError, match=rf"matmul.*{shown}"):
            fn(emb, labels, distance=dist, chunk_size=2)
    with pytest.raises(TypeError, match="distance"):
        fn(emb, labels, distance="cosine", chunk_size=2)
    bad_reducers = [
        (pfr.threshold(low=0.1), "threshold"),
        (pfr.per_anchor(), "per_anchor"),
        (pfr.class_weighted(torch.ones(5)), "class_weighted"),
        (pfr.none(), "none"),
        (pfr.divisor(), "divisor"),
    ]
    if name == "ntxent":
        bad_reducers.append((pfr.avg_nonzero(), "avg_nonzero"))
    for red, shown in bad_reducers:
        with pytest.raises(ValueError, match=rf"reducer.*{shown}"):
            fn(emb, labels, reducer=red, chunk_size=2)
    with pytest.raises(TypeError, match="reducer"):
        fn(emb, labels, reducer="mean", chunk_size=2)
    for chunk in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match="chunk_size"):
            fn(emb, labels, chunk_size=chunk)
    idx = torch.tensor([0]), torch.tensor([1]), torch.tensor([5])
    with pytest.raises(ValueError, match="indices_tuple"):
        fn(emb, labels, indices_tuple=idx, chunk_size=2)
    with pytest.raises(ValueError, match="mat"):
        fn(emb, labels, mat=torch.zeros(B, B, dtype=F64), chunk_size=2)
    with pytest.raises(ValueError, match="labels"):
        fn(emb, None, chunk_size=2)
    with pytest.raises(ValueError, match="ref_labels"):
        fn(emb, labels, ref_emb=ref, chunk_size=2)
    with pytest.raises(ValueError, match="ref_labels"):
        fn(emb, labels, ref_labels=torch.zeros(M, dtype=torch.long), chunk_size=2)
    with pytest.raises(ValueError, match="ref_labels"):
        fn(emb, labels, ref_emb=ref, ref_labels=torch.zeros(M + 1, dtype=torch.long), chunk_size=2)
    with pytest.raises(ValueError, match="temperature"):
        fn(emb, labels, temperature=-1.0, chunk_size=2)
    with pytest.raises(ValueError, match="embedding size"):
        fn(
            emb,
            labels,
            ref_emb=ref[:, :2],
            ref_labels=torch.zeros(M, dtype=torch.long),
            chunk_size=2,
        )
    with pytest.raises(ValueError, match="labels"):
        fn(emb, labels[:-1], chunk_size=2)


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_chunk_size_equals_the_dense_loss_on_a_larger_batch(name):
    """``pf.losses.ntxent(..., chunk_size=k)`` equals the dense loss (64 rows, 8 tiles)."""
    fn = getattr(pfl, name)
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(64, 8, generator=g, dtype=torch.float64)
    labels = torch.arange(64) // 4
    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    dense, streamed = fn(e1, labels), fn(e2, labels, chunk_size=8)
    (g1,) = torch.autograd.grad(dense, e1)
    (g2,) = torch.autograd.grad(streamed, e2)
    torch.testing.assert_close(streamed, dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g2, g1, rtol=1e-10, atol=1e-12)
