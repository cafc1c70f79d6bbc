"""``margin_mse``, ``distill_kl_div``, ``cosent`` and ``angle`` (``pmlfunc.losses.graded``): the
float64 loop references (tests/reference/graded.py) on values and every gradient,
sentence-transformers' loss classes on the same embeddings, the given scores never
differentiated, input errors, low precision. Gradcheck, ``torch.func``, compile, meta and NaN
propagation are in the conformance suite (the ``margin_mse``, ``distill_kl_div``, ``cosent``
and ``angle`` entries)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    GivenEmbeddings,
    assert_same,
    sentence_transformers_losses,
    value_and_grads,
)
from reference import graded as ref

import pmlfunc as pf

F64, F32 = torch.float64, torch.float32
N, K, D = 7, 3, 6
EXACT = {"rtol": 1e-10, "atol": 1e-10}
L = pf.losses
DISTANCES = {
    "dot": (pf.distances.dot(), ("dot", {})),
    "cosine": (pf.distances.cosine(), ("cosine", {})),
    "euclidean": (pf.distances.lp(normalize=False), ("lp", {"normalize": False})),
}


def _draw(*shapes, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=F64).to(dtype) for s in shapes]


def _triples(k=K, seed=0, dtype=F64):
    """Queries, their positives (near them) and ``k`` negatives a row."""
    q, noise, n = _draw((N, D), (N, D), (N, k, D), seed=seed, dtype=F64)
    return [t.to(dtype) for t in (q, q + 0.7 * noise, n)]


GOLD = torch.tensor([0.5, 4.0, 2.5, 2.5, 1.0, 4.0, 0.0], dtype=F64)  # ties: pairs not compared


# ----------------------------------------------------------------------------------------------
# the float64 references: values and every gradient
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", list(DISTANCES))
@pytest.mark.parametrize("layout", ["margins", "scores", "one-negative-vector"])
def test_margin_mse_equals_the_reference_for_every_teacher_layout(layout, distance):
    k = 1 if layout == "one-negative-vector" else K
    q, p, n = _triples(k)
    (teacher,) = _draw((N, k + 1) if layout == "scores" else (N, k), seed=3)
    if layout == "one-negative-vector":
        teacher = teacher[:, 0]
    ours_d, ref_d = DISTANCES[distance]
    got = value_and_grads(lambda *x: L.margin_mse(*x, teacher, distance=ours_d), q, p, n)
    want = value_and_grads(lambda *x: ref.margin_mse(*x, teacher, distance=ref_d), q, p, n)
    assert_same(got, want, **EXACT)


def test_margin_mse_reads_its_teacher_scores_as_margins_from_the_positive():
    q, p, n = _triples()
    (scores,) = _draw((N, K + 1), seed=3)
    margins = scores[:, :1] - scores[:, 1:]
    torch.testing.assert_close(L.margin_mse(q, p, n, scores), L.margin_mse(q, p, n, margins))


def test_margin_mse_of_a_one_negative_row_accepts_a_2d_negative_and_a_1d_margin():
    q, p, n = _triples(1)
    (m,) = _draw((N,), seed=3)
    want = L.margin_mse(q, p, n, m.unsqueeze(1))
    torch.testing.assert_close(L.margin_mse(q, p, n[:, 0], m), want, rtol=0, atol=0)


TEMPERATURES = {
    "default": {},
    "shared": {"temperature": 2.0},
    "student-and-teacher": {"student_temperature": 0.5, "teacher_temperature": 3.0},
    "student-only": {"temperature": 4.0, "student_temperature": 0.7},
}


@pytest.mark.parametrize("distance", ["dot", "cosine"])
@pytest.mark.parametrize("temperatures", list(TEMPERATURES))
@pytest.mark.parametrize("k", [1, K])
def test_distill_kl_div_equals_the_reference(k, temperatures, distance):
    q, p, n = _triples(k)
    (teacher,) = _draw((N, k + 1), seed=4)
    kw = TEMPERATURES[temperatures]
    ours_d, ref_d = DISTANCES[distance]
    got = value_and_grads(lambda *x: L.distill_kl_div(*x, teacher, distance=ours_d, **kw), q, p, n)
    want = value_and_grads(
        lambda *x: ref.distill_kl_div(*x, teacher, distance=ref_d, **kw), q, p, n
    )
    assert_same(got, want, **EXACT)


def test_distill_kl_div_drops_a_candidate_the_teacher_scores_minus_infinity():
    """A teacher score of ``−inf`` (sentence-transformers: "a candidate the caller excluded on
    purpose") has probability 0: its KL term is 0 (no NaN from ``0 · log 0``), while the
    candidate stays in the student's softmax, which is pushed to give it 0."""
    q, p, n = _triples()
    (teacher,) = _draw((N, K + 1), seed=4)
    teacher[:, -1] = -math.inf
    got = value_and_grads(lambda *x: L.distill_kl_div(*x, teacher), q, p, n)
    want = value_and_grads(lambda *x: ref.distill_kl_div(*x, teacher), q, p, n)
    assert_same(got, want, **EXACT)
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
    assert (got[1][2][:, -1].abs().sum(-1) > 0).all()  # the student learns to score it lower
    without = L.distill_kl_div(q, p, n[:, :-1], teacher[:, :-1])
    assert not torch.isclose(got[0], without)  # the student's softmax still holds it


def test_distill_kl_div_is_zero_when_the_student_is_its_own_teacher():
    q, p, n = _triples()
    own = torch.cat([(q * p).sum(-1, keepdim=True), torch.einsum("nd,nkd->nk", q, n)], 1)
    for kw in ({}, {"temperature": 3.0}):
        torch.testing.assert_close(
            L.distill_kl_div(q, p, n, own, **kw), torch.zeros((), dtype=F64), atol=1e-14, rtol=0
        )


@pytest.mark.parametrize("distance", list(DISTANCES))
@pytest.mark.parametrize("scale", [20.0, 3.0])
def test_cosent_equals_the_reference(scale, distance):
    a, b = _draw((N, D), (N, D))
    ours_d, ref_d = DISTANCES[distance]
    got = value_and_grads(lambda *x: L.cosent(*x, GOLD, scale=scale, distance=ours_d), a, b)
    want = value_and_grads(lambda *x: ref.cosent(*x, GOLD, scale=scale, distance=ref_d), a, b)
    assert_same(got, want, **EXACT)


@pytest.mark.parametrize(
    "gold",
    [
        torch.tensor([1, 0, 3, 3, 2, 0, 1]),
        torch.tensor([True, False, True, False, False, True, True]),
        torch.tensor([0.25, 0.5, 0.5, 0.75, 0.0, 1.0, 0.25], dtype=torch.float16),
    ],
    ids=["int", "bool", "float16"],
)
def test_cosent_compares_integer_bool_and_half_gold_scores(gold):
    a, b = _draw((N, D), (N, D))
    got = value_and_grads(lambda *x: L.cosent(*x, gold), a, b)
    want = value_and_grads(lambda *x: ref.cosent(*x, gold), a, b)
    assert_same(got, want, **EXACT)


def test_cosent_pairs_of_equal_gold_score_are_not_compared():
    """One gold score for every pair: nothing to rank, ``log(1 + 0) = 0``, zero gradients."""
    a, b = _draw((N, D), (N, D))
    value, grads = value_and_grads(lambda *x: L.cosent(*x, torch.full((N,), 3.0)), a, b)
    assert value == 0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("width", [D, D + 1], ids=["even", "odd"])
def test_angle_equals_the_reference_on_pairs(width):
    a, b = _draw((N, width), (N, width))
    got = value_and_grads(lambda *x: L.angle(*x, GOLD), a, b)
    want = value_and_grads(lambda *x: ref.angle(*x, GOLD), a, b)
    assert_same(got, want, **EXACT)


@pytest.mark.parametrize("gold", [None, "given"])
@pytest.mark.parametrize("k", [1, K])
def test_angle_with_negatives_equals_the_reference(k, gold):
    q, p, n = _triples(k)
    y = None if gold is None else torch.rand(N, generator=torch.Generator().manual_seed(5))
    got = value_and_grads(lambda a, b, c: L.angle(a, b, y, negatives=c, scale=5.0), q, p, n)
    want = value_and_grads(lambda a, b, c: ref.angle(a, b, y, negatives=c, scale=5.0), q, p, n)
    assert_same(got, want, **EXACT)


def test_angle_similarity_is_its_authors_complex_quotient():
    """The similarity itself (the ranking loss of two pairs is ``log(1 + e^{λ(s_0 − s_1)})``):
    sentence-transformers' cosine-plus-sine form equals the authors' complex division."""
    a, b = _draw((2, 5), (2, 5), seed=8)
    gold = torch.tensor([0.0, 1.0])
    s = [ref.angle_sim(a[i], b[i]) for i in range(2)]
    want = torch.log1p(torch.exp(2.0 * (s[0] - s[1])))
    torch.testing.assert_close(L.angle(a, b, gold, scale=2.0), want, **EXACT)


def test_a_tensor_hyper_parameter_gives_the_number_s_value_and_its_own_gradient():
    q, p, n = _triples()
    (teacher,) = _draw((N, K + 1), seed=4)
    tau = torch.tensor(2.0, dtype=F64, requires_grad=True)
    got = L.distill_kl_div(q, p, n, teacher, student_temperature=tau)
    torch.testing.assert_close(got, L.distill_kl_div(q, p, n, teacher, student_temperature=2.0))
    (g,) = torch.autograd.grad(got, tau)
    eps = 1e-6
    numeric = (
        L.distill_kl_div(q, p, n, teacher, student_temperature=2.0 + eps)
        - L.distill_kl_div(q, p, n, teacher, student_temperature=2.0 - eps)
    ) / (2 * eps)
    torch.testing.assert_close(g, numeric, rtol=1e-6, atol=1e-9)
    a, b = _draw((N, D), (N, D))
    lam = torch.tensor(7.0, dtype=F64)
    torch.testing.assert_close(L.cosent(a, b, GOLD, scale=lam), L.cosent(a, b, GOLD, scale=7.0))
    torch.testing.assert_close(L.angle(a, b, GOLD, scale=lam), L.angle(a, b, GOLD, scale=7.0))


# ----------------------------------------------------------------------------------------------
# the given scores are never differentiated
# ----------------------------------------------------------------------------------------------
def test_the_teacher_scores_and_gold_scores_receive_no_gradient():
    q, p, n = (t.requires_grad_() for t in _triples())
    (scores,) = _draw((N, K + 1), seed=4)
    calls = {
        "margin_mse": lambda t: L.margin_mse(q, p, n, t),
        "distill_kl_div": lambda t: L.distill_kl_div(q, p, n, t),
        "cosent": lambda t: L.cosent(q, p, t[:, 0]),
        "angle": lambda t: L.angle(q, p, t[:, 0], negatives=n),
    }
    for name, call in calls.items():
        t = scores.clone().requires_grad_()
        loss = call(t)
        assert loss.requires_grad, name  # the embeddings' graph
        (g,) = torch.autograd.grad(loss, t, allow_unused=True)
        assert g is None, f"{name}: the given scores got a gradient"


# ----------------------------------------------------------------------------------------------
# sentence-transformers' classes on the same embeddings
# ----------------------------------------------------------------------------------------------
def _st_util():
    return pytest.importorskip("sentence_transformers.util")


def _same_loss_and_gradients(ours, theirs, wrt) -> None:
    """Equal to float32 rounding: the loss and its gradient with respect to each of ``wrt``."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, wrt), torch.autograd.grad(theirs, wrt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _leaves(*tensors):
    return [t.float().detach().requires_grad_() for t in tensors]


def _columns(q, p, n):
    return [q, p, *n.unbind(1)]


@pytest.mark.parametrize("similarity", ["pairwise_dot_score", "pairwise_cos_sim"])
@pytest.mark.parametrize("layout", ["margins", "scores", "one-negative"])
def test_margin_mse_equals_sentence_transformers(layout, similarity):
    losses, util = sentence_transformers_losses(), _st_util()
    k = 1 if layout == "one-negative" else K
    q, p, n = _leaves(*_triples(k))
    (labels,) = _draw((N, k + 1) if layout == "scores" else (N, k), seed=3, dtype=F32)
    if layout == "one-negative":
        labels = labels[:, 0]
    columns = _columns(q, p, n)
    loss = losses.MarginMSELoss(GivenEmbeddings(columns), similarity_fct=getattr(util, similarity))
    theirs = loss.compute_loss_from_embeddings(columns, labels)
    distance = pf.distances.dot() if similarity == "pairwise_dot_score" else pf.distances.cosine()
    ours = L.margin_mse(q, p, n, labels, distance=distance)
    _same_loss_and_gradients(ours, theirs, (q, p, n))


@pytest.mark.filterwarnings("ignore")  # its first-batch look at the teacher's softmax may warn
@pytest.mark.parametrize("similarity", ["pairwise_dot_score", "pairwise_cos_sim"])
@pytest.mark.parametrize("temperatures", list(TEMPERATURES))
def test_distill_kl_div_equals_sentence_transformers(temperatures, similarity):
    losses, util = sentence_transformers_losses(), _st_util()
    q, p, n = _leaves(*_triples())
    (labels,) = _draw((N, K + 1), seed=4, dtype=F32)
    columns = _columns(q, p, n)
    kw = TEMPERATURES[temperatures]
    loss = losses.DistillKLDivLoss(
        GivenEmbeddings(columns), similarity_fct=getattr(util, similarity), **kw
    )
    theirs = loss.compute_loss_from_embeddings(columns, labels)
    distance = pf.distances.dot() if similarity == "pairwise_dot_score" else pf.distances.cosine()
    ours = L.distill_kl_div(q, p, n, labels, distance=distance, **kw)
    _same_loss_and_gradients(ours, theirs, (q, p, n))


COSENT_CASES = {
    "default": ({}, {}),
    "scale": ({"scale": 5.0}, {"scale": 5.0}),
    "dot": ({"similarity_fct": "pairwise_dot_score"}, {"distance": pf.distances.dot()}),
    "euclidean": (
        {"similarity_fct": "pairwise_euclidean_sim", "scale": 2.0},
        {"distance": pf.distances.lp(normalize=False), "scale": 2.0},
    ),
    "manhattan": (
        {"similarity_fct": "pairwise_manhattan_sim", "scale": 0.5},
        {"distance": pf.distances.lp(p=1, normalize=False), "scale": 0.5},
    ),
}


@pytest.mark.parametrize("case", list(COSENT_CASES))
def test_cosent_equals_sentence_transformers(case):
    losses, util = sentence_transformers_losses(), _st_util()
    a, b = _leaves(*_draw((N, D), (N, D)))
    st_kw, our_kw = COSENT_CASES[case]
    if "similarity_fct" in st_kw:
        st_kw = {**st_kw, "similarity_fct": getattr(util, st_kw["similarity_fct"])}
    gold = GOLD.float()
    theirs = losses.CoSENTLoss(GivenEmbeddings([a, b]), **st_kw).compute_loss_from_embeddings(
        [a, b], gold
    )
    _same_loss_and_gradients(L.cosent(a, b, gold, **our_kw), theirs, (a, b))


@pytest.mark.parametrize("width", [D, D + 1], ids=["even", "odd"])
def test_angle_equals_sentence_transformers_on_pairs(width):
    losses = sentence_transformers_losses()
    a, b = _leaves(*_draw((N, width), (N, width)))
    gold = GOLD.float()
    theirs = losses.AnglELoss(GivenEmbeddings([a, b])).compute_loss_from_embeddings([a, b], gold)
    _same_loss_and_gradients(L.angle(a, b, gold), theirs, (a, b))


@pytest.mark.parametrize("gold", [None, "given"])
@pytest.mark.parametrize("k", [1, K])
def test_angle_equals_sentence_transformers_on_n_tuples(k, gold):
    losses = sentence_transformers_losses()
    q, p, n = _leaves(*_triples(k))
    y = None if gold is None else torch.rand(N, generator=torch.Generator().manual_seed(5))
    columns = _columns(q, p, n)
    theirs = losses.AnglELoss(GivenEmbeddings(columns), scale=10.0).compute_loss_from_embeddings(
        columns, y
    )
    _same_loss_and_gradients(L.angle(q, p, y, negatives=n, scale=10.0), theirs, (q, p, n))


def test_sentence_transformers_forward_through_a_model_gives_the_same_loss():
    """The classes' ``forward`` (a model embeds each column) on a stand-in model."""
    losses = sentence_transformers_losses()
    q, p, n = _leaves(*_triples(1))
    columns = [q, p, n[:, 0]]
    features = [{"column": i} for i in range(3)]
    (scores,) = _draw((N, 2), seed=4, dtype=F32)
    model = GivenEmbeddings(columns)
    pairs = [
        (losses.MarginMSELoss(model)(features, scores), L.margin_mse(q, p, n, scores)),
        (losses.DistillKLDivLoss(model)(features, scores), L.distill_kl_div(q, p, n, scores)),
        (losses.CoSENTLoss(model)(features[:2], scores[:, 0]), L.cosent(q, p, scores[:, 0])),
        (losses.AnglELoss(model)(features, None), L.angle(q, p, negatives=n)),
    ]
    for theirs, ours in pairs:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# input errors: the argument named, what was expected
# ----------------------------------------------------------------------------------------------
def _errors():
    q, p, n = _triples()
    t = torch.zeros(N, K + 1, dtype=F64)
    mse = (L.margin_mse, {"anchors": q, "positives": p, "negatives": n, "teacher_scores": t})
    kl = (L.distill_kl_div, mse[1])
    cosent = (L.cosent, {"emb_a": q, "emb_b": p, "scores": GOLD})
    angle = (L.angle, cosent[1])
    yield "mse-positives-rows", mse, {"positives": p[:3]}, ValueError, "positives"
    yield "mse-positives-width", mse, {"positives": p[:, :2]}, ValueError, "positives"
    yield "mse-negatives-rows", mse, {"negatives": n[:3]}, ValueError, "negatives"
    yield "mse-negatives-width", mse, {"negatives": n[..., :2]}, ValueError, "negatives"
    yield "mse-no-negatives", mse, {"negatives": n[:, :0]}, ValueError, "negatives"
    yield "mse-negatives-none", mse, {"negatives": None}, ValueError, "negatives"
    yield "mse-negatives-dtype", mse, {"negatives": n.float()}, TypeError, "negatives"
    yield "mse-anchors-dtype", mse, {"anchors": q.long()}, TypeError, "anchors"
    yield "mse-anchors-3d", mse, {"anchors": n}, ValueError, "anchors"
    yield "mse-teacher-shape", mse, {"teacher_scores": t[:, :2]}, ValueError, "teacher_scores"
    yield "mse-teacher-1d", mse, {"teacher_scores": t[:, 0]}, ValueError, "teacher_scores"
    yield "mse-teacher-int", mse, {"teacher_scores": t.long()}, TypeError, "teacher_scores"
    yield "mse-teacher-list", mse, {"teacher_scores": [0.0] * N}, TypeError, "teacher_scores"
    yield "mse-teacher-device", mse, {"teacher_scores": t.to("meta")}, ValueError, "teacher_scores"
    yield "mse-distance", mse, {"distance": "dot"}, TypeError, "distance"
    yield "kl-teacher-shape", kl, {"teacher_scores": t[:, 1:]}, ValueError, "teacher_scores"
    yield "kl-temperature", kl, {"temperature": 0.0}, ValueError, "temperature"
    yield "kl-temperature-inf", kl, {"temperature": math.inf}, ValueError, "temperature"
    yield "kl-temperature-1d", kl, {"temperature": torch.ones(2)}, ValueError, "temperature"
    yield "kl-student", kl, {"student_temperature": -1.0}, ValueError, "student_temperature"
    yield "kl-teacher", kl, {"teacher_temperature": "2"}, TypeError, "teacher_temperature"
    yield "cosent-rows", cosent, {"emb_b": p[:3]}, ValueError, "emb_b"
    yield "cosent-dtype", cosent, {"emb_b": p.float()}, TypeError, "emb_b"
    yield "cosent-scores-shape", cosent, {"scores": GOLD[:3]}, ValueError, "scores"
    yield "cosent-scores-2d", cosent, {"scores": GOLD.unsqueeze(1)}, ValueError, "scores"
    yield "cosent-scores-complex", cosent, {"scores": GOLD.to(torch.complex64)}, TypeError, "scores"
    yield "cosent-scores-device", cosent, {"scores": GOLD.to("meta")}, ValueError, "scores"
    yield "cosent-scale", cosent, {"scale": 0.0}, ValueError, "scale"
    yield "cosent-distance", cosent, {"distance": 3}, TypeError, "distance"
    yield "angle-no-scores", angle, {"scores": None}, ValueError, "scores"
    yield "angle-negatives", angle, {"negatives": n[:3]}, ValueError, "negatives"
    yield "angle-scale", angle, {"scale": -1.0}, ValueError, "scale"


ERRORS = {name: rest for name, *rest in _errors()}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_raises_naming_the_argument(name):
    (fn, inputs), change, error, match = ERRORS[name]
    with pytest.raises(error, match=rf"(^|\W){match}\b"):
        fn(**{**inputs, **change})


# ----------------------------------------------------------------------------------------------
# low precision: a float32 loss
# ----------------------------------------------------------------------------------------------
def _calls(dtype):
    q, p, n = _triples(dtype=dtype)
    (t,) = _draw((N, K + 1), seed=4, dtype=F32)
    return {
        "margin_mse": (lambda a, b, c: L.margin_mse(a, b, c, t), (q, p, n)),
        "distill_kl_div": (lambda a, b, c: L.distill_kl_div(a, b, c, t), (q, p, n)),
        "cosent": (lambda a, b: L.cosent(a, b, GOLD), (q, p)),
        "angle": (lambda a, b, c: L.angle(a, b, negatives=c), (q, p, n)),
    }


@pytest.mark.parametrize("name", ["margin_mse", "distill_kl_div", "cosent", "angle"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_embeddings_give_a_float32_loss_near_float64(dtype, name):
    fn, inputs = _calls(dtype)[name]
    value, grads = value_and_grads(fn, *inputs)
    assert value.dtype == F32 and torch.isfinite(value)
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)
    want = fn(*(x.double() for x in inputs))
    torch.testing.assert_close(value.double(), want, rtol=1e-5, atol=1e-5)
