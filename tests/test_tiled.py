"""Tests for the tiled engine (``pmlfunc.losses._tiled``) behind ``chunk_size=`` of NT-Xent,
SupCon, CLIP and SigLIP.

Every kind of the engine is tested here on its own: with each reducer of ``_tiled.KINDS``, with
labels and without, with a logit bias and without, in tiles of 1 row, of a size not dividing
the rows and of more rows than there are, the value and the gradients w.r.t. the embeddings, the
reference (second) set, the temperature (logit scale) and the bias equal a float64 reference
written here from the formulas, and the engine's blocks (partial statistics of blocks of
columns merged, the ring's walk in one process) give the same numbers. NT-Xent and SupCon are
also compared with the dense ``pf.losses.ntxent`` / ``supcon`` (reducers, distances, labels
without positives or negatives, transforms, compile), and no tensor larger than
``max(chunk × M, B × D)`` is ever created, in the forward or the backward
(``test_cross_modal.py`` compares CLIP and SigLIP's tiled and dense paths too).
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from helpers import loss_dtype, with_and_without_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from tracking import DispatchedOps, LargestTensor

import pmlfunc.distances as pfd
import pmlfunc.losses as pfl
import pmlfunc.losses._tiled as _tiled
import pmlfunc.reducers as pfr
from pmlfunc.losses._batch import spec

F64 = torch.float64
B, M, D = 11, 9, 5

# the tiled path is the public loss given chunk_size (every call below passes one)
STREAMING = {"ntxent": pfl.ntxent, "supcon": pfl.supcon}


def _batch_path(fn):
    """``fn``'s general batch path (the one that takes ``mat=``, ``indices_tuple`` and any
    distance), which the engine's dense calls skip: the tiled results' independent check."""

    def call(emb, labels, *, temperature=None, **inputs):
        hyper = {} if temperature is None else {"temperature": temperature}
        return spec(fn)(emb, labels, inputs, **hyper)

    return call


DENSE = {"ntxent": _batch_path(pfl.ntxent), "supcon": _batch_path(pfl.supcon)}
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


@pytest.mark.compile
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["dense", "tiled"])
def test_compiled_labelled_tiles_write_no_boolean_masks(name, chunk):
    """Compiled, a labelled tile's positive and negative masks (the diagonal left out) are
    expressions of the labels that each kernel reading them recomputes, not boolean tiles
    written out: inductor's CPU store of a boolean tile took 3.6 ms of an 11.7 ms NT-Xent step
    at 512 x 512 (2026-12-07), 3.4x the matmul floor's time against 2.5x without it."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    emb = torch.randn(64, 8, requires_grad=True)
    labels = torch.arange(64) // 4
    fn = torch.compile(lambda e: getattr(pfl, name)(e, labels, chunk_size=chunk), fullgraph=True)
    _, code = run_and_get_code(lambda: fn(emb).backward())
    found = re.findall(r"empty_strided_cpu\(\((.*?)\), .*?, (torch\.\w+)\)", "".join(code))
    shapes = [
        (tuple(d for d in dims.replace(" ", "").split(",") if d), dtype) for dims, dtype in found
    ]
    assert shapes and [s for s in shapes if s[1] == "torch.bool" and len(s[0]) > 1] == []
    torch._dynamo.reset()


@pytest.mark.compile
def test_compile_one_tensor_as_both_labels_and_both_sets(gen):
    """The same labels tensor as ``labels`` and ``ref_labels``, and the batch as its own
    reference set under ``dot()``, compile (Function.apply refuses a tensor given twice) and
    equal eager; the batch as its reference set excludes nothing (the reference-set rule)."""
    torch._dynamo.reset()
    emb, _ = _data(gen)
    labels = torch.tensor(LABELS["uneven"])

    def fn(e):
        a = pfl.ntxent(e, labels, ref_emb=e, ref_labels=labels, distance=pfd.dot(), chunk_size=4)
        return a + pfl.supcon(e, labels, ref_emb=e, ref_labels=labels, chunk_size=3)

    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    out = torch.compile(fn, fullgraph=True)(e1)
    want = fn(e2)
    _assert_same((out, torch.autograd.grad(out, e1)), (want, torch.autograd.grad(want, e2)))
    ref = _batch_path(pfl.ntxent)(
        e2, labels, ref_emb=e2, ref_labels=labels, distance=pfd.dot(), temperature=0.07
    )
    got = pfl.ntxent(e2, labels, ref_emb=e2, ref_labels=labels, distance=pfd.dot(), chunk_size=4)
    torch.testing.assert_close(got, ref)


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


@pytest.mark.parametrize("chunk", [None, 3], ids=["dense", "tiled"])
def test_a_backward_through_vmap_of_clip_with_labels_equals_a_loop(gen, chunk):
    """``vmap`` of CLIP with labels, then ``.backward()`` on its outputs: the stacked gradients
    of each batch's loss. Its positives' weights were added into a tile buffer with ``out=``,
    for which vmap has no batching rule (the backward raised; ``vmap(grad)`` worked)."""
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    params = pfl.clip_init(dtype=F64)
    stack = torch.randn(2, 8, 2 * D, generator=gen, dtype=F64)

    def loss(x):
        return pfl.clip(x[:, :D], x[:, D:], params, labels=labels, chunk_size=chunk)

    x = stack.clone().requires_grad_(True)
    torch.func.vmap(loss)(x).sum().backward()
    for i in range(2):
        xi = stack[i].clone().requires_grad_(True)
        loss(xi).backward()
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=1e-10, atol=1e-12)


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


@pytest.mark.parametrize("temperature", ["float", "learnable"])
def test_a_self_mode_tile_of_every_row_multiplies_once_backward(temperature):
    """Dense self-mode NT-Xent (one tile of all the rows, ``g`` small enough to stay in cache):
    the rows' and the columns' gradients from one product, ``(∂S + ∂Sᵀ) x``: two ``N² D``
    products in all, forward and backward (a learnable temperature's gradient from the same
    product). With ``chunk_size`` (n = 4 tiles of 64 rows at D = 128, CPU eager) the backward's
    ``2n²`` block products become ``2n² − 3n + 2``: each diagonal block once, ``(G_tt + G_ttᵀ)
    x_t``, and each pair of neighbouring tiles' blocks twice, ``V = G_ut + G_tuᵀ`` (the first
    block kept a tile); with a learnable temperature (its gradient reads every block's product),
    or tiles too small to pay for the split (16 rows at D = 8), each tile multiplies twice."""
    from torch.utils.flop_counter import FlopCounterMode

    n, d = 64, 8
    emb = torch.randn(n, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    labels = torch.arange(n) // 4
    t = torch.tensor(0.2, dtype=F64, requires_grad=True) if temperature == "learnable" else 0.2

    def addmm_(into, a, b, *_, out_shape=None, **__):  # not in FlopCounterMode's table
        return 2 * a[0] * a[1] * b[1]

    def flops(**kw):
        x = emb.clone().requires_grad_()
        mapping = {torch.ops.aten.addmm_: addmm_}
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            torch.autograd.grad(pfl.ntxent(x, labels, temperature=t, **kw), x)
        return counter.get_total_flops()

    assert flops() == 2 * (2 * n * n * d)
    assert flops(chunk_size=16) == 3 * (2 * n * n * d)  # small tiles: two products each
    n, d = 256, 128
    emb = torch.randn(n, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    labels = torch.arange(n) // 4
    tiles, block = 4, 2 * 64 * 64 * d
    backward = 2 * tiles**2 if temperature == "learnable" else 2 * tiles**2 - 3 * tiles + 2
    assert flops(chunk_size=64) == (tiles**2 + backward) * block


@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_self_mode_tiles_that_split_their_products_give_the_dense_gradient(name, monkeypatch):
    """Tiles large enough to split their products (64 rows at D = 128: each diagonal block
    once, the blocks of the next two tiles met as G_ut + G_tuᵀ; 600 rows, ten tiles, a
    shorter last one) give the dense call's gradient in float64, every tile through the split."""
    split = []
    real = _tiled._GradSums._add_self_tile

    def spy(self, ds, r0, r1):
        split.append((r0, r1))
        return real(self, ds, r0, r1)

    monkeypatch.setattr(_tiled._GradSums, "_add_self_tile", spy)
    emb = torch.randn(600, 128, generator=torch.Generator().manual_seed(5), dtype=F64)
    labels = torch.arange(600) // 3

    def grad(**kw):
        x = emb.clone().requires_grad_()
        return torch.autograd.grad(getattr(pfl, name)(x, labels, **kw), x)[0]

    dense = grad()
    assert split == []
    torch.testing.assert_close(grad(chunk_size=64), dense, rtol=1e-10, atol=1e-12)
    assert _tiled._kept_tiles(600, 64) == 2
    assert split == [(r0, min(r0 + 64, 600)) for r0 in range(0, 600, 64)]


def test_self_tiles_added_in_any_order_sum_to_the_whole_products_gradient():
    """``_GradSums`` of self-mode tiles (eight of 64 rows at D = 128, each keeping the next
    two tiles' blocks): whatever order the tiles come in (a block kept for a tile that does
    not come when expected is multiplied on its own; those left at the end, by ``result``),
    the gradient is ``(G + Gᵀ) x``."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(512, 128, generator=gen, dtype=F64)
    g = torch.randn(512, 512, generator=gen, dtype=F64)
    assert _tiled._kept_tiles(512, 64) == 2
    shuffled = torch.randperm(8, generator=gen).tolist()
    for order in (range(8), range(7, -1, -1), shuffled, [1, 0, 3, 2, 5, 4, 7, 6], [0, 2, 4, 6]):
        into = torch.zeros_like(x)
        sums = _tiled._GradSums(x, _tiled.Columns((x,)), (True, (True,), False, False), into)
        rows = torch.zeros(512, dtype=torch.bool)
        for t in order:
            r0, r1 = 64 * t, 64 * (t + 1)
            assert sums._splits(r0, r1)
            sums.add(g[r0:r1].clone(), r0, r1)
            rows[r0:r1] = True
        _, (gx,), _, _ = sums.result()
        part = torch.where(rows.unsqueeze(-1), g, 0.0)  # the tiles' rows of G
        torch.testing.assert_close(gx, (part + part.T) @ x, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Labelled tiles by a listing of the positives (CPU eager), not r × M masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("excluded", [False, True], ids=["block", "own-block"])
def test_the_label_listing_is_the_masks_nonzero(excluded):
    """``_label_listing`` (columns sorted by label, each row's run found by binary search)
    lists exactly the ``(rows, cols)`` of ``(rows == colsᵀ).nonzero()``, in its order, without
    the self pairs of a block's own diagonal, and each tile's memo is its slice, shifted to the
    tile's rows; where the positives are more than an eighth of the block, ``None``."""
    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 40, (37,), generator=g)
    cols = rows if excluded else torch.randint(0, 40, (29,), generator=g)
    x = torch.zeros(37, 3)
    listing = _tiled._label_listing("ntxent", x, rows, cols, excluded)
    assert listing is not None
    mask = rows.unsqueeze(-1) == cols.unsqueeze(-2)
    if excluded:
        mask.fill_diagonal_(False)
    want_r, want_c = mask.nonzero(as_tuple=True)
    assert torch.equal(listing.rows, want_r) and torch.equal(listing.cols, want_c)
    for r0, r1 in [(0, 5), (5, 6), (6, 37), (30, 37)]:
        memo = listing.memo(r0, r1)
        tr, tc = mask[r0:r1].nonzero(as_tuple=True)
        assert torch.equal(memo["listed"][0], tr) and torch.equal(memo["listed"][1], tc)
        assert memo["diag"] == (r0 if excluded else None)
    few = torch.arange(37) // 6  # 6 of 37 columns a row: above an eighth
    assert _tiled._label_listing("ntxent", x, few, few, excluded) is None
    assert _tiled._label_listing("clip", x, rows, cols, excluded) is None


def _listed_inputs(gen, mode):
    """40 rows in 14 classes (a few positives a row: listed) and one row without positives;
    ``mode="ref"``: 36 references in the same classes. ``(emb, ref, labels, ref_labels)``."""
    n, m = 40, 36
    emb = torch.randn(n, 6, generator=gen, dtype=F64)
    ref = torch.randn(m, 6, generator=gen, dtype=F64) if mode == "ref" else None
    labels = torch.randint(0, 14, (n,), generator=gen)
    labels[-1] = 99  # a row without positives
    ref_labels = torch.randint(0, 14, (m,), generator=gen) if mode == "ref" else None
    return emb, ref, labels, ref_labels


@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_listed_tiles_equal_the_masked_tiles_and_build_no_mask(gen, name, mode, chunk, monkeypatch):
    """NT-Xent and SupCon with labels, on a CPU in eager mode: the tiles read their positives
    from one listing a walk and build no ``r × M`` mask (``_masks`` is not called), and the
    loss and every gradient (embeddings, reference set, learnable temperature) equal the masks'
    path, which compiled and transformed calls take, for every reducer; a NaN among the
    negatives still gives NaN."""
    emb, ref, labels, ref_labels = _listed_inputs(gen, mode)
    temperature = torch.tensor(0.3, dtype=F64)
    masks = _tiled._masks
    calls = []
    monkeypatch.setattr(_tiled, "_masks", lambda *a: calls.append(1) or masks(*a))
    for reducer in REDUCERS[name]:
        kw = {"chunk_size": chunk, "reducer": _reducer(reducer)}
        listed = _value_and_grads(STREAMING[name], emb, labels, ref, ref_labels, temperature, **kw)
        assert not calls
        with monkeypatch.context() as m_:
            m_.setattr(_tiled, "_label_listing", lambda *a: None)
            masked = _value_and_grads(
                STREAMING[name], emb, labels, ref, ref_labels, temperature, **kw
            )
        assert calls
        calls.clear()
        _assert_same(listed, masked)
    if mode == "ref":
        ref = ref.clone()
        ref[0, 1] = float("nan")
        assert torch.isnan(STREAMING[name](emb, labels, ref_emb=ref, ref_labels=ref_labels))


@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("mode", ["self", "ref"])
@pytest.mark.parametrize("name", ["ntxent", "supcon"])
def test_bounded_logits_take_unshifted_base2_exponentials_and_equal_the_masks_path(
    gen, name, mode, chunk, monkeypatch
):
    """Where ``|S| ≤ 40`` is known from the rows' norms (a float temperature, no bias, a CPU in
    eager mode), the listed walk that forms the gradient takes ``E = 2^(S log₂e)`` with no row
    maximum and hands the sums a row-scaled tile (``_tiled.RowScaled``); the loss and every
    gradient equal the masks' path (maxima, softmax) for every reducer, with the cosine and the
    unnormalised dot distance, a row without positives and a row without negatives, and a
    learnable (0-d tensor) temperature with its gradient. Past the bound (temperature 0.01) the
    walk takes the softmax."""
    emb, ref, labels, ref_labels = _listed_inputs(gen, mode)
    fold = getattr(_tiled, f"_{name}_base2_fold_")
    calls = []
    monkeypatch.setattr(_tiled, f"_{name}_base2_fold_", lambda *a: calls.append(1) or fold(*a))

    def both(temperature, **kw):
        got = _value_and_grads(STREAMING[name], emb, labels, ref, ref_labels, temperature, **kw)
        with monkeypatch.context() as m_:
            m_.setattr(_tiled, "_label_listing", lambda *a: None)
            want = _value_and_grads(
                STREAMING[name], emb, labels, ref, ref_labels, temperature, **kw
            )
        return got, want

    for reducer in REDUCERS[name]:
        # |S| ≤ max‖x‖ max‖y‖ / temperature: 1 / 0.3 with the cosine, about 4 · 4 with the dot
        for distance, temperature in ((pfd.cosine(), 0.3), (pfd.dot(), 1.0)):
            kw = {"chunk_size": chunk, "reducer": _reducer(reducer), "distance": distance}
            got, want = both(temperature, **kw)
            assert calls
            calls.clear()
            _assert_same(got, want)
    if mode == "ref":  # rows whose every reference is a positive: no negatives
        ref_labels = torch.full_like(ref_labels, 7)
        labels = torch.where(torch.arange(len(labels)) < 3, 7, labels)
        _assert_same(*both(0.3, chunk_size=chunk))
        assert calls
        calls.clear()
    _assert_same(*both(torch.tensor(0.3, dtype=F64), chunk_size=chunk))  # and its gradient
    assert calls
    calls.clear()
    got, want = both(0.01, chunk_size=chunk)  # |S| up to 100: past the bound
    _assert_same(got, want)
    both(torch.tensor(0.01, dtype=F64), chunk_size=chunk)
    assert not calls


# kind -> (loss, params within the bound (with and without a bias), params past it, the helper
# that only the bounded path calls)
BOUNDED_TWO_SET = {
    "siglip": (
        pfl.siglip, [pfl.siglip_init(dtype=F64)], pfl.siglip_init(math.log(100.0), dtype=F64),
        "_siglip_base2_fold_",
    ),
    "clip": (
        pfl.clip, [pfl.clip_init(dtype=F64), pfl.clip_init(logit_bias=-2.0, dtype=F64)],
        pfl.clip_init(math.log(100.0), dtype=F64), "_clip_exp_ds_",
    ),
}  # fmt: skip


@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("labelled", [False, True])
@pytest.mark.parametrize("kind", list(BOUNDED_TWO_SET))
def test_two_set_losses_with_bounded_logits_take_one_exponential_and_equal_the_unbounded_path(
    gen, kind, labelled, chunk, monkeypatch
):
    """SigLIP where ``|S| ≤ 80``, CLIP where ``|S| ≤ 40`` is known from the rows' norms, the
    scale and the bias (a CPU in eager mode): SigLIP's terms and gradient come from one ``exp2``
    pass (``log1p(t)``, ``t / (1 + t)``); CLIP's row and column log-sum-exps are the sums of
    one ``exp2`` pass (no maxima, no online rescaling) and its gradient ``E ⊙ (u_i + v_j)``
    minus the positives' terms, in tiles of rows (a forward walk, every tile recomputed in the
    backward) and in the dense call's one tile (the gradient formed in the forward). Aligned
    sets (the diagonal's correction) and labels, every reducer: the loss and the gradients of
    both sets, the scale and the bias equal the unbounded path's (``softplus`` and ``sigmoid``;
    the shifted softmaxes). Past the bound (a scale of 100) the unbounded path runs. CLIP's
    in-place ``E ⊙ (u_i + v_j)`` goes a few rows a step (two here)."""
    loss_fn, within, past, helper = BOUNDED_TWO_SET[kind]
    monkeypatch.setattr(_tiled, "_INPLACE_STEP", 26)
    n = 13
    a = torch.randn(n, 5, generator=gen, dtype=F64)
    b = torch.randn(n, 5, generator=gen, dtype=F64)
    labels = torch.randint(0, 4, (n,), generator=gen) if labelled else None
    bounded = getattr(_tiled, helper)
    calls = []
    monkeypatch.setattr(_tiled, helper, lambda *x: calls.append(1) or bounded(*x))

    def both(params, **kw):
        def loss(a_, b_, *values):
            given = dict(zip(params, values, strict=True))
            return loss_fn(a_, b_, given, labels=labels, chunk_size=chunk, **kw)

        return with_and_without_bound(monkeypatch, loss, a, b, *params.values())

    for params in within:
        for reducer in _tiled.KINDS[kind]:  # the first is the default (None)
            red = None if reducer == _tiled.KINDS[kind][0] else _reducer(reducer)
            _assert_same(*both(params, reducer=red))
            assert calls
            calls.clear()
    _assert_same(*both(past))
    assert not calls


@pytest.mark.parametrize("width", [1, 2, 7, 64, 65])
@pytest.mark.parametrize("levels", [0, 1, 2, 3])
def test_log1p_sum_folds_column_halves_and_equals_the_sum_of_log1p(gen, levels, width):
    """SigLIP's bounded walk sums its terms ``log1p(t)`` after folding the tile's column halves
    ``(1 + a)(1 + b) = 1 + (a + b + ab)``: the same sum (float64 to 1e-13, float32 to its
    rounding) for odd widths too (the odd column on its own), ``t`` left as it was."""
    for dtype, rtol in ((F64, 1e-13), (torch.float32, 2e-6)):
        t = torch.exp(torch.randn(5, width, generator=gen, dtype=F64) * 8).to(dtype)
        before = t.clone()
        got = _tiled._log1p_sum(t, levels, torch.empty_like(t))
        torch.testing.assert_close(got, torch.log1p(t.double()).sum().to(dtype), rtol=rtol, atol=0)
        assert torch.equal(t, before)


@pytest.mark.parametrize("bound", [0.0, 5.0, 10.0, 20.0, 40.0, 80.0])
def test_log1p_levels_fold_as_many_factors_as_float32_holds(bound):
    """``2^levels`` factors ``(1 + e^bound)`` multiply to a finite float32, and one fold more
    would not (or the cap is reached): SigLIP's default ``|S| ≤ 20`` folds twice, a scale of
    100 (``|S|`` up to 80 with its bias) not at all."""
    levels = _tiled._log1p_levels(bound)
    log_factor = math.log1p(math.exp(bound))
    assert 2**levels * log_factor < math.log(torch.finfo(torch.float32).max)
    assert levels == _tiled._MAX_LOG1P_LEVELS or 2 ** (levels + 1) * (bound + math.log(2)) > 88
    t = torch.full((2, 2**levels), math.exp(bound), dtype=torch.float32)
    assert torch.isfinite(_tiled._log1p_sum(t, levels, torch.empty_like(t)))
    assert {20.0: 2, 80.0: 0}.get(bound, levels) == levels


def test_siglip_bounded_walk_folds_its_terms_as_its_bound_allows(gen, monkeypatch):
    """The default SigLIP (``|S| ≤ 20``: scale 10, bias −10, unit rows) takes two folds a
    tile in eager mode on a CPU, tiled and dense, and equals the float64 loss computed without
    them (``levels`` 0)."""
    a = torch.randn(40, 8, generator=gen)
    b = torch.randn(40, 8, generator=gen)
    params = pfl.siglip_init()
    plain = _tiled._log1p_sum
    seen = []
    monkeypatch.setattr(
        _tiled, "_log1p_sum", lambda t, lv, out: seen.append(lv) or plain(t, lv, out)
    )
    for chunk in (7, None):
        got = pfl.siglip(a, b, params, chunk_size=chunk)
        assert seen and set(seen) == {2}
        seen.clear()
        monkeypatch.setattr(_tiled, "_log1p_levels", lambda bound: 0)
        want = pfl.siglip(a.double(), b.double(), {k: v.double() for k, v in params.items()})
        monkeypatch.setattr(_tiled, "_log1p_levels", _LEVELS)
        assert seen and set(seen) == {0}
        seen.clear()
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


_LEVELS = _tiled._log1p_levels


# ---------------------------------------------------------------------------------------------
# Every kind of the engine on its own: values and full gradients against float64 references
# ---------------------------------------------------------------------------------------------
#
# The references below are written from the formulas of ``pmlfunc/losses/_tiled.py``'s table
# (and the losses' docstrings), one row at a time, with nothing of pmlfunc in them: the logits
# S = scale · x̂ ŷᵀ + bias of rows already normalised, positives by equal labels (``None``: row i
# with column i), self mode without the diagonal.

TINY = torch.finfo(F64).tiny


def _masks_ref(n, m, rows, cols, self_mode):
    if rows is None:
        pos = torch.eye(n, m, dtype=torch.bool)
    else:
        pos = rows[:, None] == (rows if cols is None else cols)[None, :]
    neg = ~pos
    if self_mode:
        pos.fill_diagonal_(False)
        neg.fill_diagonal_(False)
    return pos, neg


def _reference(kind, reducer, s, pos, neg):
    """The loss of ``kind`` with ``reducer`` over logits ``s`` (float64, differentiable)."""
    n, m = s.shape
    zero = s.sum() * 0.0
    if kind == "siglip":  # Σ softplus(−z S), z = +1 on positives
        terms = [torch.nn.functional.softplus(-s[i, j] if pos[i, j] else s[i, j])
                 for i in range(n) for j in range(m)]  # fmt: skip
        total = sum(terms, zero)
        return {"batch": total / n, "mean": total / (n * m), "sum": total}[reducer]
    if kind == "ntxent":  # −log(e^{S_ij} / (e^{S_ij} + Σ_neg e^{S_ik}) + ε) per positive pair
        terms = []
        for i in range(n):
            negs = s[i][neg[i]]
            for j in torch.nonzero(pos[i]).flatten().tolist():
                share = torch.exp(s[i, j] - torch.logsumexp(torch.cat([s[i, j : j + 1], negs]), 0))
                terms.append(-torch.log(share + TINY))
        total = sum(terms, zero)
        return total / len(terms) if reducer == "mean" and terms else total
    if kind == "supcon":  # lse over candidates − mean over positives, per row with positives
        if not pos.any() or not neg.any():
            return zero
        losses = [
            torch.logsumexp(s[i][pos[i] | neg[i]], 0) - s[i][pos[i]].mean() if pos[i].any() else zero
            for i in range(n)
        ]  # fmt: skip
        total = sum(losses, zero)
        if reducer == "avg_nonzero":
            active = sum(int(v > 0) for v in losses)
            return total / active if active else zero
        return total / n if reducer == "mean" else total
    # clip: (R over rows + R over columns) / 2 of lse − mean over positives
    rows = [torch.logsumexp(s[i], 0) - s[i][pos[i]].mean() for i in range(n)]
    cols = [torch.logsumexp(s[:, j], 0) - s[:, j][pos[:, j]].mean() for j in range(m)]
    if reducer == "mean":
        return (sum(rows, zero) / n + sum(cols, zero) / m) / 2
    return (sum(rows, zero) + sum(cols, zero)) / 2


LAYOUTS = {  # kind -> its layouts of labels (_layout_labels)
    "ntxent": ("self", "ref", "self_one_class", "self_distinct"),
    "supcon": ("self", "ref", "self_one_class", "self_distinct"),
    "clip": ("pairs", "pairs_labels"),
    "siglip": ("pairs", "pairs_labels"),
}
EDGE = ("self_one_class", "self_distinct")  # tested at one chunk size
REF_CHUNKS = [1, 3, B, B + 5]  # one row a tile, 3 not dividing B = 11, one tile, B < chunk


def _layout_labels(layout):
    """``(labels, ref_labels)`` of a layout (``None`` where it has none)."""
    if layout == "self_one_class":
        return torch.tensor(LABELS["no_negative"]), None
    if layout == "self_distinct":
        return torch.tensor(LABELS["no_positive"]), None
    if layout == "pairs":
        return None, None
    labels = torch.tensor(LABELS["uneven"])
    return labels, torch.tensor(REF_LABELS["uneven"]) if layout == "ref" else None


def _kind_inputs(gen, kind, layout, bias):
    """The leaves a call of ``kind`` is differentiated in: ``(emb, other, p, b)`` with ``other``
    the reference set or the second set (``None`` in self mode), ``p`` the temperature or the
    logit scale, ``b`` the logit bias (or ``None``)."""
    emb, ref = _data(gen)
    if kind in ("clip", "siglip"):
        other = torch.randn(B, D, generator=gen, dtype=F64)
        p, b = torch.tensor(0.8, dtype=F64), torch.tensor(-0.7, dtype=F64) if bias else None
        return emb, other, p, b
    return emb, ref if layout == "ref" else None, torch.tensor(0.35, dtype=F64), None


def _call_kind(kind, reducer, layout, chunk, emb, other, p, b):
    """The public loss of ``kind`` (``chunk``: the tiled engine, ``None``: the reference)."""
    labels, ref_labels = _layout_labels(layout)
    if chunk is None:
        x = torch.nn.functional.normalize(emb, dim=-1)
        y = None if other is None else torch.nn.functional.normalize(other, dim=-1)
        scale = p.exp() if kind in ("clip", "siglip") else 1.0 / p
        s = scale * x @ (x if y is None else y).T + (0.0 if b is None else b)
        pos, neg = _masks_ref(len(x), s.shape[1], labels, ref_labels, y is None)
        return _reference(kind, reducer, s, pos, neg)
    red = None if reducer == _tiled.KINDS[kind][0] else getattr(pfr, reducer)()
    if kind in ("clip", "siglip"):
        params = {"logit_scale": p} if b is None else {"logit_scale": p, "logit_bias": b}
        return getattr(pfl, kind)(emb, other, params, labels=labels, chunk_size=chunk, reducer=red)
    kw = {} if other is None else {"ref_emb": other, "ref_labels": ref_labels}
    return getattr(pfl, kind)(emb, labels, temperature=p, chunk_size=chunk, reducer=red, **kw)


def _kind_value_and_grads(kind, reducer, layout, chunk, inputs):
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    loss = _call_kind(kind, reducer, layout, chunk, *leaves)
    used = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, used, allow_unused=True)
    return loss.detach(), [
        torch.zeros_like(t) if g is None else g for t, g in zip(used, grads, strict=True)
    ]


def _kind_cases():
    for kind, layouts in LAYOUTS.items():
        for reducer in _tiled.KINDS[kind]:
            for layout in layouts:
                biases = (False, True) if kind in ("clip", "siglip") else (False,)
                for bias in biases:
                    for chunk in [3] if layout in EDGE else REF_CHUNKS:
                        yield pytest.param(kind, reducer, layout, bias, chunk, id=(
                            f"{kind}-{reducer}-{layout}{'-bias' if bias else ''}-chunk{chunk}"
                        ))  # fmt: skip


@pytest.mark.parametrize(("kind", "reducer", "layout", "bias", "chunk"), list(_kind_cases()))
def test_every_kind_and_reducer_equals_a_float64_reference(gen, kind, reducer, layout, bias, chunk):
    """Each kind of ``_tiled.KINDS`` with each of its reducers, with labels and without
    (clip, siglip), a reference set and self mode (ntxent, supcon; also one class and all
    labels distinct), with a logit bias and without, in tiles of 1, 3 (not dividing 11), 11
    and 16 (more than the rows) rows: the loss and its gradients w.r.t. the embeddings, the
    reference / second set, the temperature or logit scale and the bias equal the reference."""
    inputs = _kind_inputs(gen, kind, layout, bias)
    got = _kind_value_and_grads(kind, reducer, layout, chunk, inputs)
    want = _kind_value_and_grads(kind, reducer, layout, None, inputs)
    _assert_same(got, want)
    if layout not in EDGE:  # the test has teeth: no gradient is zero (but CLIP's bias's: a
        # softmax does not see a constant shift)
        grads = got[1][:-1] if kind == "clip" and bias else got[1]
        assert all(g.abs().max() > 1e-6 for g in grads)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_tile_buffers_reused_from_tile_to_tile_give_the_same_numbers(gen, kind, monkeypatch):
    """A plain walk on a CPU in eager mode writes each tile's logits (and NT-Xent's and
    SupCon's softmax) into buffers reused from tile to tile (``_Scratch``), the last tile a
    view of their first rows: the loss and every gradient are bitwise those of fresh buffers,
    for each reducer and layout, with tiles of 3 rows (11 not divisible by 3) and dense calls
    (one tile), forward walks and CLIP's backward walk alike; a reused buffer is taken."""
    taken = []
    take = _tiled._Scratch.take

    def spy(self, name, rows, cols, like):
        buf = take(self, name, rows, cols, like)
        taken.append(buf is not None)
        return buf

    monkeypatch.setattr(_tiled._Scratch, "take", spy)
    for reducer, layout, bias, chunk in itertools.product(
        _tiled.KINDS[kind], LAYOUTS[kind][:2], (False, True), (3, 11)
    ):
        if bias and kind not in ("clip", "siglip"):
            continue
        inputs = _kind_inputs(gen, kind, layout, bias)
        reused = _kind_value_and_grads(kind, reducer, layout, chunk, inputs)
        with monkeypatch.context() as m:
            m.setattr(_tiled, "_reuses", lambda *a: False)
            fresh = _kind_value_and_grads(kind, reducer, layout, chunk, inputs)
        assert torch.equal(reused[0], fresh[0]), (reducer, layout, chunk)
        assert all(torch.equal(a, b) for a, b in zip(reused[1], fresh[1], strict=True))
    assert any(taken)


# aten ops one eager CPU call dispatches, forward and backward, at 32 × 8 (dense, tiled in two
# tiles of 16): at 2026-12-07 ntxent 91 / 147, supcon 142 / 202, clip 157 / 201, siglip 117 / 173
# (before that day's trims: 130 / 197, 180 / 250, 194 / 229, 128 / 184); the budgets allow 5 more
OP_BUDGET = {
    ("ntxent", None): 96, ("ntxent", 16): 153, ("supcon", None): 147, ("supcon", 16): 207,
    ("clip", None): 131, ("clip", 16): 206, ("siglip", None): 122, ("siglip", 16): 178,
}  # fmt: skip


@pytest.mark.parametrize(("name", "chunk"), list(OP_BUDGET))
def test_a_small_eager_call_dispatches_no_more_ops_than_its_budget(gen, name, chunk):
    """A small call's time on a CPU is its ops' overhead (a few µs each, tens after a large op
    has evicted the caches): the engine's forward and backward at 32 × 8 stay within a budget
    of dispatched aten ops, so that a change which adds per-call or per-tile ops shows here."""
    emb = torch.randn(32, 8, generator=gen)
    labels = torch.arange(32) // 4
    other = torch.randn(32, 8, generator=gen)

    def step():
        a = emb.clone().requires_grad_()
        if name in ("ntxent", "supcon"):
            loss, inputs = getattr(pfl, name)(a, labels, chunk_size=chunk), [a]
        else:
            b = other.clone().requires_grad_()
            params = {k: v.requires_grad_() for k, v in getattr(pfl, f"{name}_init")().items()}
            loss = getattr(pfl, name)(a, b, params, chunk_size=chunk)
            inputs = [a, b, *params.values()]
        torch.autograd.grad(loss, inputs)

    step()  # first calls (lazy initialisation) apart
    with DispatchedOps() as rec:
        step()
    assert 0 < rec.count <= OP_BUDGET[(name, chunk)], rec.count


def test_dense_tiles_hold_a_fixed_number_of_entries_but_never_fewer_than_256_rows():
    """A dense call of a row-complete kind walks tiles of ``DENSE_TILE`` entries (2¹⁹), but
    of at least ``DENSE_MIN_ROWS`` (256) rows of ``x`` once the columns are many (each tile
    adds its product into the whole ``(M, D)`` column gradient: thin tiles made dense NT-Xent
    at 8,192 × 512 1.3× slower), never more rows than the batch; the retrieval kind's tiles
    (fresh buffers each tile) stay within ``FRESH_DENSE_TILE`` entries (2²², under glibc's
    mmap threshold), a tile's rows counting its roles; CLIP takes one tile."""
    assert (_tiled.DENSE_TILE, _tiled.DENSE_MIN_ROWS) == (2**19, 256)
    dense_rows = _tiled.dense_rows
    assert dense_rows("ntxent", 512, 512) == 512  # 2^19 entries would be 1,024 rows
    assert dense_rows("ntxent", 4096, 1024) == 512  # 2^19 / 1,024
    assert dense_rows("supcon", 4096, 2048) == 256  # 2^19 / 2,048
    assert dense_rows("siglip", 8192, 8192) == 256  # 2^19 / 8,192 = 64, raised to 256
    assert dense_rows("ntxent", 100, 65536) == 100  # at most the batch
    assert dense_rows("clip", 8192, 8192) == 8192
    # a loss row of 8 engine rows (x: 4,096 engine rows, 512 loss rows)
    retrieval = _tiled.Retrieval(8, (), True, None, (False, False), False)
    assert dense_rows(retrieval, 4096, 32768) == 16  # 2^22 / (32,768 · 8): 128 engine rows
    assert dense_rows(retrieval, 4096, 4096) == 128  # 2^22 / (4,096 · 8)


# ---------------------------------------------------------------------------------------------
# The engine's blocks: partial statistics merged across blocks of columns (the ring's walk)
# ---------------------------------------------------------------------------------------------


def _blocks(sizes):
    edges = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return list(itertools.pairwise(edges))


def _walk_blocks(kind, reducer, x, y, rows, cols, scale, bias, chunk, x_sizes, y_sizes):
    """The loss and its gradients ``(∂x, ∂y, ∂scale, ∂bias)`` of the rows of ``x`` split into
    blocks of ``x_sizes`` rows (ranks), each walking the column blocks of ``y`` (``y_sizes``;
    ``y=None``: self mode, ``x``'s blocks) through ``block_forward`` / ``merge`` / ``counts`` /
    ``reduce`` / ``block_backward``, as the ring does, in one process."""
    self_mode = y is None
    yy, cc = x if self_mode else y, rows if cols is None else cols  # labels of both: rows
    xb, yb = _blocks(x_sizes), _blocks(x_sizes if self_mode else y_sizes)
    part = lambda t, r: None if t is None else t[r[0] : r[1]]  # noqa: E731

    def walk(r, lse=None):
        acc, col = None, []
        for o, blk in enumerate(yb):
            st = _tiled.block_forward(
                kind, part(x, xb[r]), part(yy, blk), part(rows, xb[r]), part(cc, blk), scale,
                bias, chunk, diag=o == r, exclude=self_mode, lse=lse, final=False,
            )  # fmt: skip
            acc = _tiled.merge(acc, {k: v for k, v in st.items() if not k.startswith("col")})
            col.append({k: v for k, v in st.items() if k.startswith("col")})
        return acc, col

    stats, cols_of = [], [None] * len(yb)
    for r in range(len(xb)):
        st, col = walk(r)
        if kind == "ntxent":  # the terms need each row's final log-sum-exp: a second walk
            st = {"row_lse": st["row_lse"], **walk(r, st["row_lse"])[0]}
        stats.append(st)
        for o, c in enumerate(col):
            cols_of[o] = _tiled.merge(cols_of[o], c)
    if kind == "clip":  # a block's column statistics over every block of rows
        for r, st in enumerate(stats):
            st.update(cols_of[r])
    counts = [_tiled.counts(kind, st, b - a) for st, (a, b) in zip(stats, xb, strict=True)]
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    reduced = [_tiled.reduce(kind, st, reducer, total) for st in stats]
    loss = sum(share for share, _ in reduced)
    n_row = _tiled.ROW_STATS[kind]
    gx = [torch.zeros_like(x[a:b]) for a, b in xb]
    gy = [torch.zeros_like(yy[a:b]) for a, b in yb]
    g_scale, g_bias = torch.zeros((), dtype=F64), torch.zeros((), dtype=F64)
    for r, (_, row_stats) in enumerate(reduced):
        for o, blk in enumerate(yb):
            col_stats = reduced[o][1][n_row:]
            px, (py,), x_dot, sum_ds = _tiled.block_backward(
                kind, part(x, xb[r]), part(yy, blk), part(rows, xb[r]), part(cc, blk), scale,
                bias, chunk, row_stats[:n_row], col_stats, (True, True, True, bias is not None),
                diag=o == r, exclude=self_mode,
            )  # fmt: skip
            gx[r] += px * scale
            gy[o] += py * scale
            g_scale += x_dot
            if bias is not None:
                g_bias += sum_ds
    if self_mode:  # x is both sides: its rows' parts and its columns' parts
        return loss, [torch.cat(gx) + torch.cat(gy), g_scale, g_bias]
    return loss, [torch.cat(gx), torch.cat(gy), g_scale, g_bias]


def _block_cases():
    for kind, layouts in LAYOUTS.items():
        for reducer in _tiled.KINDS[kind]:
            for layout in layouts:
                if layout not in EDGE:
                    yield pytest.param(kind, reducer, layout, id=f"{kind}-{reducer}-{layout}")


@pytest.mark.parametrize(("kind", "reducer", "layout"), list(_block_cases()))
def test_blocks_of_columns_merged_equal_the_reference(gen, kind, reducer, layout):
    """The rows in three blocks (4, 0 and 7 rows: one empty) walking three blocks of columns
    (the reference set's 2, 3, 4 rows, or the rows' own blocks), tiles of 3 rows: the partial
    log-sum-exps and sums merged across blocks (``merge``, the columns' statistics of CLIP
    across blocks of rows), the counts summed, each block's share reduced and its gradient
    walked again give the loss and the gradients w.r.t. both sets, the scale and the bias of
    the float64 reference."""
    emb, other, p, b = _kind_inputs(gen, kind, layout, bias=True)
    labels, ref_labels = _layout_labels(layout)
    x = torch.nn.functional.normalize(emb, dim=-1)
    y = None if other is None else torch.nn.functional.normalize(other, dim=-1)
    scale = p.exp() if kind in ("clip", "siglip") else 1.0 / p
    y_sizes = [4, 0, 7] if kind in ("clip", "siglip") else [2, 3, 4]
    got = _walk_blocks(kind, reducer, x, y, labels, ref_labels, scale, b, 3, [4, 0, 7], y_sizes)

    leaves = [t.clone().requires_grad_() for t in (x, *(() if y is None else (y,)), scale)]
    bias = None if b is None else b.clone().requires_grad_()
    xl, yl = leaves[0], None if y is None else leaves[1]
    s = leaves[-1] * xl @ (xl if yl is None else yl).T + (0.0 if bias is None else bias)
    pos, neg = _masks_ref(len(x), s.shape[1], labels, ref_labels, y is None)
    want_loss = _reference(kind, reducer, s, pos, neg)
    wrt = leaves + ([] if bias is None else [bias])
    want = list(torch.autograd.grad(want_loss, wrt))
    if bias is None:
        got[1].pop()
    _assert_same((got[0], got[1]), (want_loss.detach(), want))


# ---------------------------------------------------------------------------------------------
# Non-finite inputs
# ---------------------------------------------------------------------------------------------


def test_row_lse_of_non_finite_rows_is_row_logsumexp():
    """The engine's in-place log-sum-exp agrees with ``_ops.row_logsumexp`` on every kind of
    row: finite, a kept NaN (NaN, never the empty row's −finfo.max), a kept +inf (+inf), a kept
    −inf (adds 0), only −inf, nothing kept (−finfo.max), an empty block of columns."""
    from pmlfunc._ops import row_logsumexp

    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, 7, generator=g, dtype=F64)
    s[1, 3], s[2, 0], s[3, 5], s[4, :] = float("nan"), float("inf"), -float("inf"), -float("inf")
    keep = torch.ones(6, 7, dtype=torch.bool)
    keep[5] = False
    keep[:5, 6] = False
    got = _tiled._row_lse_(s.clone(), keep)
    want = row_logsumexp(s.masked_fill(~keep, 0.0), keep.to(F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0, equal_nan=True)
    low = -torch.finfo(F64).max
    assert torch.isnan(got[1]) and got[2] == float("inf") and got[4] == low and got[5] == low
    torch.testing.assert_close(got[3], torch.logsumexp(s[3, [0, 1, 2, 3, 4]], 0))
    assert torch.equal(_tiled._row_lse_(s[:, :0].clone(), None), torch.full((6,), low, dtype=F64))


# the retrieval kind's NaN hard negative: tests/test_retrieval.py
@pytest.mark.parametrize("chunk", [1, 3, B + 5])
@pytest.mark.parametrize("kind", [k for k in _tiled.KINDS if k != "retrieval"])
def test_a_nan_in_a_row_that_is_only_a_negative_gives_a_nan_loss(gen, kind, chunk):
    """A NaN in one reference row (NT-Xent, SupCon: a label no query row has, so that it enters
    every row's log-sum-exp of negatives and no positive term) or in one row of the second set
    (CLIP, SigLIP): the tiled loss is NaN, with every reducer; reading the NaN log-sum-exp as
    an empty row would give a finite loss (0 for NT-Xent)."""
    inputs = list(_kind_inputs(gen, kind, "ref" if kind in ("ntxent", "supcon") else "pairs", True))
    if kind in ("ntxent", "supcon"):
        row = REF_LABELS["uneven"].index(5)  # label 5: no query row has it
        assert 5 not in LABELS["uneven"]
    else:
        row = 4
    inputs[1] = inputs[1].clone()
    inputs[1][row, 2] = float("nan")
    for reducer in _tiled.KINDS[kind]:
        layout = "ref" if kind in ("ntxent", "supcon") else "pairs"
        loss = _call_kind(kind, reducer, layout, chunk, *inputs)
        assert torch.isnan(loss), (reducer, loss)


# ---------------------------------------------------------------------------------------------
# Columns: segments read as one matrix, normalised in the tile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False], ids=["formed-in-forward", "recomputed"])
@pytest.mark.parametrize("chunk", [1, 3, B])
@pytest.mark.parametrize("kind", ["ntxent", "supcon", "clip", "siglip"])
def test_columns_in_segments_normalised_in_the_tile_equal_normalised_rows(
    gen, kind, chunk, fused, monkeypatch
):
    """``tiled_loss(x, (y1, y2), unit=True)``, the engine reading two raw segments and
    normalising each column in the tile, gives the value and the gradients (w.r.t. the rows, each
    raw segment, the scale and the bias) of ``tiled_loss(x, F.normalize(cat(y1, y2)))``, the
    normalisation differentiated by autograd; one column is zero and one has a norm below
    ``F.normalize``'s ``ε`` (no projection there, as autograd's), in the walk that forms the
    gradient in the forward and in the backward that recomputes the tiles."""
    if not fused:
        monkeypatch.setattr(_tiled, "_fused", lambda *a: False)
    pairs = kind in ("clip", "siglip")
    x = torch.nn.functional.normalize(torch.randn(B, D, generator=gen, dtype=F64), dim=-1)
    y1 = torch.randn(4 if not pairs else 5, D, generator=gen, dtype=F64)
    y2 = torch.randn(M - 4 if not pairs else B - 5, D, generator=gen, dtype=F64)
    y1[1] = 0.0
    y2[0] = 1e-14 * y2[0]
    labels = None if pairs else torch.tensor(LABELS["uneven"])
    ref_labels = None if pairs else torch.tensor(REF_LABELS["uneven"])
    bias = torch.tensor(-0.3, dtype=F64) if kind == "siglip" else None
    reducer = _tiled.KINDS[kind][0]

    def run(unit):
        leaves = [t.clone().requires_grad_() for t in (x, y1, y2, torch.tensor(2.5, dtype=F64))]
        b = None if bias is None else bias.clone().requires_grad_()
        xx, a, c, scale = leaves
        y = (a, c) if unit else torch.nn.functional.normalize(torch.cat([a, c]), dim=-1)
        loss = _tiled.tiled_loss(
            xx, y, labels, ref_labels, scale=scale, bias=b, chunk=chunk, kind=kind,
            reducer=reducer, unit=unit,
        )  # fmt: skip
        wrt = leaves + ([] if b is None else [b])
        return loss.detach(), torch.autograd.grad(loss, wrt)

    got, want = run(True), run(False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert got[1][1][1].abs().max() > 1.0  # the zero column's gradient: 1/ε-sized, not lost
