"""``multiple_negatives_ranking``: the float64 reference (tests/reference/retrieval.py) on every
option, dense against tiled, sentence-transformers' loss classes on the same embeddings, CLIP's
equivalence, and its input errors. Gradcheck, ``torch.func``, compile, meta and NaN are in the
conformance suite (``multiple_negatives_ranking[...]`` entries)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import (
    GivenEmbeddings,
    assert_same,
    retrieval_calls,
    sentence_transformers_losses,
    with_and_without_bound,
)
from reference import retrieval as ref

import pmlfunc as pf

F64 = torch.float64
mnrl = pf.losses.multiple_negatives_ranking
N, K, D, DG = 7, 2, 5, 4
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
SYM = ("query_to_doc", "doc_to_query")


def _batch(k: int = K, seed: int = 0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, D, generator=g, dtype=F64)
    p = q + 0.8 * torch.randn(N, D, generator=g, dtype=F64)  # positives near their queries
    n = torch.randn(N, k, D, generator=g, dtype=F64)
    return [t.to(dtype).requires_grad_() for t in (q, p, n)]


def _guide(k: int = K, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, DG, generator=g, dtype=F64),
        torch.randn(N, DG, generator=g, dtype=F64),
        torch.randn(N, k, DG, generator=g, dtype=F64),
    )


# ids with a duplicated query (rows 0, 3) and a duplicated document (rows 1, 5)
ANCHOR_IDS = torch.tensor([10, 11, 12, 10, 13, 14, 15])
POSITIVE_IDS = torch.tensor([20, 21, 22, 23, 24, 21, 26])

OPTIONS = {
    "plain": {},
    "no-negatives": {"k": 0},
    "symmetric": {"directions": SYM, "partition_mode": "per_direction"},
    "symmetric-joint": {"directions": SYM},
    "gte": {"directions": ALL},
    "q2q": {"directions": ("query_to_doc", "query_to_query")},
    "d2d": {"directions": ("query_to_doc", "doc_to_doc")},
    "in-batch-hardness": {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
    "hard-negatives-hardness": {"hardness_mode": "hard_negatives", "hardness_strength": 5.0},
    "all-negatives-hardness": {"hardness_mode": "all_negatives", "hardness_strength": 2.0},
    "ids": {"anchor_ids": ANCHOR_IDS, "positive_ids": POSITIVE_IDS, "directions": ALL},
    "anchor-ids": {"anchor_ids": ANCHOR_IDS},
    "guide": {"guide": True, "directions": ("query_to_doc", "query_to_query", "doc_to_doc")},
    "guide-relative": {"guide": True, "margin_strategy": "relative", "margin": 0.3},
    "guide-symmetric": {"guide": True, "directions": SYM, "partition_mode": "per_direction"},
    # doc_to_query without doc_to_doc is read down the positives' columns: with every mask
    "ids-symmetric": {
        "anchor_ids": ANCHOR_IDS,
        "positive_ids": POSITIVE_IDS,
        "directions": SYM,
        "partition_mode": "per_direction",
    },
    "symmetric-joint-hardness": {
        "directions": SYM,
        "hardness_mode": "in_batch_negatives",
        "hardness_strength": 9.0,
    },
    "queries-both-ways": {
        "directions": ("query_to_doc", "query_to_query", "doc_to_query"),
        "hardness_mode": "all_negatives",
        "hardness_strength": 2.0,
        "anchor_ids": ANCHOR_IDS,
        "positive_ids": POSITIVE_IDS,
        "guide": True,
        "margin": 0.1,
    },
    "dot-sum": {"distance": "dot", "scale": 0.5, "reducer": "sum", "directions": ALL},
    "everything": {
        "directions": ALL,
        "hardness_mode": "all_negatives",
        "hardness_strength": 3.0,
        "anchor_ids": ANCHOR_IDS,
        "positive_ids": POSITIVE_IDS,
        "guide": True,
        "margin": 0.1,
    },
}


@pytest.mark.parametrize("chunk", [None, 1, 3])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_equals_the_float64_reference_on_values_and_every_gradient(name, chunk):
    option = OPTIONS[name]
    k = option.get("k", K)
    q, p, n = _batch(k)
    ours, theirs = retrieval_calls(option, _guide(k))
    negatives = n if k else None
    got = mnrl(q, p, negatives, chunk_size=chunk, **ours)
    want = ref.multiple_negatives_ranking(q, p, negatives, **theirs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    wrt = (q, p, n) if k else (q, p)
    g_got = torch.autograd.grad(got, wrt)
    g_want = torch.autograd.grad(want, wrt)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("k", [0, K])
def test_plain_query_rows_with_bounded_logits_take_unshifted_base2_exponentials(
    k, chunk, monkeypatch
):
    """Query rows that read every document (no ids, no guide, no hardness, no queue; a CPU in
    eager mode) with ``|S| ≤ 40`` known from the rows' norms and the scale take ``E = 2^(S log₂e)``
    with no row maximum and hand the sums a row-scaled tile: the loss and every gradient (the
    three sets, a learnable scale) equal the softmax path's. With the scale at 100 (past the
    bound) or a masked layout (symmetric directions, ids) the softmax runs."""
    from pmlfunc.losses import _tiled

    q, p, n = _batch(k)
    fold = _tiled._retrieval_base2_fold_
    calls = []
    monkeypatch.setattr(_tiled, "_retrieval_base2_fold_", lambda *a: calls.append(1) or fold(*a))

    def same(params, **kw):
        def loss(q_, p_, n_, *values):
            given = dict(zip(params, values, strict=True))
            return mnrl(q_, p_, n_ if k else None, given, chunk_size=chunk, **kw)

        got, want = with_and_without_bound(monkeypatch, loss, q, p, n, *params.values())
        assert_same(got, want, rtol=1e-10, atol=1e-12)

    same(pf.losses.multiple_negatives_ranking_init(dtype=F64))
    assert calls
    calls.clear()
    same(pf.losses.multiple_negatives_ranking_init(100.0, dtype=F64))
    same(pf.losses.multiple_negatives_ranking_init(dtype=F64), directions=SYM)
    same(pf.losses.multiple_negatives_ranking_init(dtype=F64), anchor_ids=ANCHOR_IDS)
    assert not calls


@pytest.mark.parametrize("name", ["plain", "gte", "symmetric"])
def test_a_learnable_scale_gets_the_gradient_of_the_reference(name):
    q, p, n = _batch()
    ours, theirs = retrieval_calls(OPTIONS[name])
    params = {"logit_scale": torch.tensor(math.log(12.0), dtype=F64, requires_grad=True)}
    got = mnrl(q, p, n, params, chunk_size=2, **ours)
    log_t = params["logit_scale"].detach().clone().requires_grad_()
    want = ref.multiple_negatives_ranking(q, p, n, scale=log_t.exp(), **theirs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    (g,) = torch.autograd.grad(got, params["logit_scale"])
    (g_ref,) = torch.autograd.grad(want, log_t)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_max_logit_scale_clamps_the_learnable_scale_with_a_zero_gradient_above():
    q, p, n = _batch()
    params = {"logit_scale": torch.tensor(math.log(200.0), dtype=F64, requires_grad=True)}
    got = mnrl(q, p, n, params, max_logit_scale=math.log(100.0))
    torch.testing.assert_close(got, mnrl(q, p, n, scale=100.0), rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got, params["logit_scale"])
    assert g == 0


def test_a_hardness_strength_that_requires_grad_is_refused_not_left_without_a_gradient():
    """The engine applies the strength to its tiles and forms no gradient for it: a learnable
    one would silently stay where it is (its gradient None, 0 under torch.func)."""
    q, p, n = _batch()
    alpha = torch.tensor(0.7, dtype=F64, requires_grad=True)
    for chunk_size in (None, 7):
        with pytest.raises(ValueError, match=r"hardness_strength .* not learnable"):
            mnrl(
                q,
                p,
                n,
                hardness_mode="all_negatives",
                hardness_strength=alpha,
                chunk_size=chunk_size,
            )
    with pytest.raises(ValueError, match="hardness_strength"):
        torch.func.grad(
            lambda a: mnrl(q, p, n, hardness_mode="all_negatives", hardness_strength=a)
        )(alpha.detach())


def test_a_tensor_scale_and_a_fixed_tensor_hardness_strength():
    q, p, n = _batch()
    t = torch.tensor(15.0, dtype=F64, requires_grad=True)
    alpha = torch.tensor(4.0, dtype=F64)
    got = mnrl(q, p, n, scale=t, hardness_mode="all_negatives", hardness_strength=alpha)
    want = ref.multiple_negatives_ranking(
        q, p, n, scale=t, hardness_mode="all_negatives", hardness_strength=4.0
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        torch.autograd.grad(got, t)[0], torch.autograd.grad(want, t)[0], rtol=1e-10, atol=1e-10
    )


def test_equal_ids_keep_a_duplicated_pair_out_of_its_twins_negatives():
    # two rows with the same query and document: without ids each row's positive ties with its
    # twin's (ℓ = log 2 exactly); with equal anchor ids (or positive ids) the twin is no negative
    q, p = torch.randn(1, D, dtype=F64), torch.randn(1, D, dtype=F64)
    q, p = q.expand(2, D), p.expand(2, D)
    torch.testing.assert_close(mnrl(q, p), torch.tensor(math.log(2.0), dtype=F64))
    same = torch.tensor([3, 3])
    for kw in ({"anchor_ids": same}, {"positive_ids": same}):
        torch.testing.assert_close(mnrl(q, p, **kw), torch.tensor(0.0, dtype=F64))
        # every direction: the twin's query and positive masked, the pair read both ways left
        torch.testing.assert_close(
            mnrl(q, p, directions=ALL, **kw), torch.tensor(math.log(2.0), dtype=F64)
        )


def test_clip_without_labels_is_the_symmetric_per_direction_loss():
    q, p, _ = _batch()
    params = pf.losses.clip_init(dtype=F64)
    got = mnrl(q, p, params=params, directions=SYM, partition_mode="per_direction")
    torch.testing.assert_close(got, pf.losses.clip(q, p, params), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"]
)
def test_low_precision_embeddings_give_a_float32_loss_near_float64(dtype):
    q, p, n = (t.detach() for t in _batch(dtype=dtype))
    got = mnrl(q, p, n, directions=ALL, chunk_size=3)
    want = mnrl(q.double(), p.double(), n.double(), directions=ALL)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 1, 3])
@pytest.mark.parametrize("directions", [("query_to_doc",), ALL], ids=["q2d", "all"])
def test_a_nan_in_a_hard_negative_makes_the_loss_nan(directions, chunk):
    # a hard negative is only ever a negative (in every row's log-sum-exp, no positive term):
    # reading its NaN log-sum-exp as an empty row would give a finite loss
    q, p, n = (t.detach().clone() for t in _batch())
    n[2, 1, 0] = float("nan")
    for reducer in (None, pf.reducers.sum()):
        loss = mnrl(q, p, n, directions=directions, chunk_size=chunk, reducer=reducer)
        assert torch.isnan(loss)


# ----------------------------------------------------------------------------------------------
# sentence-transformers
# ----------------------------------------------------------------------------------------------
def _same_loss_and_gradients(ours, theirs, wrt) -> None:
    """Equal to float32 rounding: the loss and its gradient with respect to each of ``wrt``."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, wrt), torch.autograd.grad(theirs, wrt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _st_loss(loss, columns):
    return loss.compute_loss_from_embeddings(list(columns), None)


ST_CASES = {
    "mnrl": ({}, {}),
    "symmetric": (
        {"directions": SYM, "partition_mode": "per_direction"},
        {"directions": SYM, "partition_mode": "per_direction"},
    ),
    "gte": ({"directions": ALL}, {"directions": ALL}),
    "hard-negatives": (
        {"hardness_mode": "hard_negatives", "hardness_strength": 5.0},
        {"hardness_mode": "hard_negatives", "hardness_strength": 5.0},
    ),
    "in-batch": (
        {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0, "scale": 10.0},
        {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0, "scale": 10.0},
    ),
    "all": (
        {"hardness_mode": "all_negatives", "hardness_strength": 3.0, "directions": ALL},
        {"hardness_mode": "all_negatives", "hardness_strength": 3.0, "directions": ALL},
    ),
}


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("case", list(ST_CASES))
def test_equals_sentence_transformers_multiple_negatives_ranking_loss(case, k):
    losses = sentence_transformers_losses()
    st_kw, our_kw = ST_CASES[case]
    q, p, n = (t.float().detach().requires_grad_() for t in _batch(k))
    columns = [q, p, *n.unbind(1)]
    theirs = _st_loss(
        losses.MultipleNegativesRankingLoss(GivenEmbeddings(columns), **st_kw), columns
    )
    ours = mnrl(q, p, n if k else None, chunk_size=3, **our_kw)
    _same_loss_and_gradients(ours, theirs, (q, p, n) if k else (q, p))


def test_equals_sentence_transformers_symmetric_ranking_loss():
    losses = sentence_transformers_losses()
    q, p, _ = (t.float().detach().requires_grad_() for t in _batch())
    theirs = _st_loss(losses.MultipleNegativesSymmetricRankingLoss(GivenEmbeddings([q, p])), [q, p])
    ours = mnrl(q, p, directions=SYM, partition_mode="per_direction")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _gist(losses, model, guide, *, temperature, margin_strategy="absolute", margin=0.0,
          contrast_anchors=True, contrast_positives=True):  # fmt: skip
    """GISTEmbedLoss over stand-in models: its constructor wants two tokenizers (to decide
    whether to retokenize), so the loss is built with the attributes its forward reads."""
    loss = losses.GISTEmbedLoss.__new__(losses.GISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.model, loss.guide, loss.temperature = model, guide, temperature
    loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
    loss.must_retokenize, loss.gather_across_devices = False, False
    loss.margin_strategy, loss.margin = margin_strategy, margin
    loss.contrast_anchors, loss.contrast_positives = contrast_anchors, contrast_positives
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    return loss


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"contrast_anchors": False, "contrast_positives": False},
        {"margin_strategy": "relative", "margin": 0.2, "contrast_positives": False},
        {"margin": 0.05},
    ],
    ids=["default", "q2d-only", "relative", "absolute-margin"],
)
def test_equals_sentence_transformers_gist_embed_loss(kw, k):
    losses = sentence_transformers_losses()
    if k and kw.get("contrast_positives", True):
        pytest.skip("GISTEmbed's positive–positive term reads positives only (documented)")
    q, p, n = (t.float().detach().requires_grad_() for t in _batch(k))
    gq, gp, gn = (t.float() for t in _guide(k))
    g_columns = [gq, gp, *gn.unbind(1)]
    columns = [q, p, *n.unbind(1)]
    loss = _gist(
        losses, GivenEmbeddings(columns), GivenEmbeddings(g_columns), temperature=0.05, **kw
    )
    features = [{"column": i} for i in range(len(columns))]
    theirs = loss(features, None)
    directions = ["query_to_doc"]
    if kw.get("contrast_anchors", True):
        directions.append("query_to_query")
    if kw.get("contrast_positives", True):
        directions.append("doc_to_doc")
    guide = (gq, gp, gn) if k else (gq, gp)
    ours = mnrl(
        q, p, n if k else None, scale=20.0, directions=tuple(directions), guide=guide,
        margin_strategy=kw.get("margin_strategy", "absolute"), margin=kw.get("margin", 0.0),
        chunk_size=2,
    )  # fmt: skip
    _same_loss_and_gradients(ours, theirs, (q, p, n) if k else (q, p))


def test_equals_sentence_transformers_cached_multiple_negatives_ranking_loss():
    losses = sentence_transformers_losses()
    q, p, n = (t.float().detach() for t in _batch(1))
    loss = losses.CachedMultipleNegativesRankingLoss(GivenEmbeddings([]), mini_batch_size=3)
    reps = [[q], [p], [n[:, 0]]]
    theirs = loss.calculate_loss(reps, with_backward=False)
    ours = mnrl(q, p, n, chunk_size=3)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# input errors
# ----------------------------------------------------------------------------------------------
def _errors():
    _, p, n = (t.detach() for t in _batch())
    yield "positives", {"positives": p[:3]}, ValueError, "as many rows"
    yield "negatives", {"negatives": n[:3]}, ValueError, "negatives must be"
    yield "negatives-width", {"negatives": n[..., :2]}, ValueError, "embedding size"
    yield "directions", {"directions": ("doc_to_query",)}, ValueError, "query_to_doc"
    yield "direction-name", {"directions": ("query_to_doc", "up")}, ValueError, "subset"
    yield "direction-str", {"directions": "query_to_doc"}, TypeError, "tuple"
    yield "partition", {"partition_mode": "both"}, ValueError, "partition_mode"
    yield (
        "per-direction",
        {"partition_mode": "per_direction", "directions": ALL},
        ValueError,
        "joint",
    )
    yield "hardness", {"hardness_mode": "hard"}, ValueError, "hardness_mode"
    yield "strength", {"hardness_strength": -1.0}, ValueError, "hardness_strength"
    yield "scale", {"scale": 0.0}, ValueError, "scale"
    yield "ids-length", {"anchor_ids": torch.arange(3)}, ValueError, "anchor_ids"
    yield "ids-dtype", {"positive_ids": torch.zeros(N)}, TypeError, "positive_ids"
    yield "guide-type", {"guide": torch.zeros(N, DG)}, TypeError, "guide"
    yield "guide-negatives", {"guide": _guide()[:2]}, ValueError, "guide_negatives"
    yield "guide-rows", {"guide": (torch.zeros(3, DG), torch.zeros(3, DG))}, ValueError, "rows"
    yield "margin-strategy", {"guide": _guide(), "margin_strategy": "x"}, ValueError, "margin"
    yield "distance", {"distance": pf.distances.lp()}, ValueError, "cosine"
    yield "reducer", {"reducer": pf.reducers.avg_nonzero()}, ValueError, "mean()"
    yield "params", {"params": {"scale": torch.tensor(1.0)}}, TypeError, "logit_scale"
    yield "max-scale", {"max_logit_scale": 2.0}, ValueError, "params"
    yield "chunk", {"chunk_size": 0}, ValueError, "chunk_size"


@pytest.mark.parametrize(("name", "change", "error", "match"), list(_errors()))
def test_bad_input_raises_naming_the_argument(name, change, error, match):
    q, p, n = (t.detach() for t in _batch())
    kw = {"anchors": q, "positives": p, "negatives": n, **change}
    with pytest.raises(error, match=match):
        mnrl(**kw)


def test_init_makes_the_log_of_the_scale():
    params = pf.losses.multiple_negatives_ranking_init(25.0, dtype=F64)
    assert set(params) == {"logit_scale"}
    torch.testing.assert_close(params["logit_scale"], torch.tensor(math.log(25.0), dtype=F64))


def test_every_option_combination_of_directions_is_accepted_or_refused_clearly():
    q, p, n = (t.detach() for t in _batch())
    for r in range(1, 5):
        for dirs in itertools.combinations(ALL, r):
            for mode in ("joint", "per_direction"):
                ok = "query_to_doc" in dirs and not (
                    mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(dirs)
                )
                if ok:
                    got = mnrl(q, p, n, directions=dirs, partition_mode=mode, chunk_size=4)
                    want = ref.multiple_negatives_ranking(
                        q, p, n, directions=dirs, partition_mode=mode
                    )
                    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
                else:
                    with pytest.raises(ValueError):
                        mnrl(q, p, n, directions=dirs, partition_mode=mode)


def test_vmap_over_query_sets_equals_a_loop():
    q, p, n = (t.detach() for t in _batch())
    qs = torch.stack([q, q.flip(0)])

    def loss(queries):
        return mnrl(queries, p, n, directions=ALL, chunk_size=3)

    torch.testing.assert_close(torch.vmap(loss)(qs), torch.stack([loss(qs[0]), loss(qs[1])]))
    grads = torch.vmap(torch.func.grad(loss))(qs)
    torch.testing.assert_close(grads[1], torch.func.grad(loss)(qs[1]))


# ----------------------------------------------------------------------------------------------
# distributed: the gather and the ring are the single-process loss, every option
# ----------------------------------------------------------------------------------------------
DISTRIBUTED = {
    "negatives": ({}, (3, 4)),
    "no-negatives-dense": ({"k": 0}, (4, 3)),
    "every-direction-ids-hardness": (
        {
            "directions": ALL,
            "anchor_ids": ANCHOR_IDS,
            "positive_ids": POSITIVE_IDS,
            "hardness_mode": "in_batch_negatives",
            "hardness_strength": 2.0,
            "chunk_size": 2,
        },
        (3, 4),
    ),
    # the duplicated document sits on two ranks (rows 1 and 5); rank 0 has no rows
    "positive-ids-guide-all-negatives": (
        {
            "positive_ids": POSITIVE_IDS,
            "guide": True,
            "directions": ("query_to_doc", "query_to_query", "doc_to_doc"),
            "hardness_mode": "all_negatives",
            "hardness_strength": 1.0,
            "chunk_size": 3,
        },
        (0, 4, 3),
    ),
    "dot-every-direction-relative-guide-anchor-ids": (
        {
            "distance": "dot",
            "scale": 0.5,
            "directions": ALL,
            "guide": True,
            "margin_strategy": "relative",
            "margin": 0.3,
            "anchor_ids": ANCHOR_IDS,
        },
        (4, 3),
    ),
    "symmetric-learnable-scale-sum": (
        {
            "directions": SYM,
            "partition_mode": "per_direction",
            "params": {"logit_scale": torch.tensor(math.log(10.0), dtype=F64)},
            "reducer": "sum",
            "hardness_mode": "hard_negatives",
            "hardness_strength": 3.0,
        },
        (2, 2, 3),
    ),
    # doc_to_query down the positives' columns: their log-sum-exps travel with the blocks
    "symmetric-joint-ids-guide": (
        {
            "directions": SYM,
            "anchor_ids": ANCHOR_IDS,
            "positive_ids": POSITIVE_IDS,
            "guide": True,
            "margin": 0.2,
            "chunk_size": 2,
        },
        (0, 4, 3),
    ),
}


@pytest.mark.parametrize("exchange", ["gather", "ring"])
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_the_gather_and_the_ring_are_the_single_process_loss_with_unequal_ranks(name, exchange):
    """Ranks of unequal sizes (an empty one too): every rank's loss and every input's gradient
    (the embeddings', the hard negatives', the learnable scale's) equal one process's on the
    whole batch; ids and guide rows are sharded with their rows."""
    option, sizes = DISTRIBUTED[name]
    k = option.get("k", K)
    q, p, n = (t.detach() for t in _batch(k))
    ours, _ = retrieval_calls({key: v for key, v in option.items() if key != "params"}, _guide(k))
    params = option.get("params")
    args = (q, p, n if k else None) + (() if params is None else (params,))
    report = pf.testing.check_distributed(
        mnrl, *args, world_size=len(sizes), sizes=sizes, exchange=exchange, rtol=1e-9,
        atol=1e-11, **ours,
    )  # fmt: skip
    # check_distributed raises on a loss or gradient out of tolerance; every input was compared
    wanted = {"anchors", "positives"} | ({"negatives"} if k else set())
    wanted |= {"params['logit_scale']"} if params else set()
    assert wanted <= set(report.grad_diffs) and math.isfinite(report.loss)
