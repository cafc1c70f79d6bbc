"""Two-tower negative memory (``pmlfunc.queues``): the queue's ring buffer, the retrieval loss and
CLIP against a queue equal to the float64 reference (tests/reference/retrieval.py, ``memory=``),
SigLIP against a queue and with ids (tests/reference/cross_modal.py, ``siglip_pairs``), ids masking
duplicates across steps, a step that pushes compiled and under ``torch.func``, the queue under DDP
(gather) and its errors. Gradcheck, compile, meta and NaN of the losses with a queue are in the
conformance suite (``multiple_negatives_ranking[tiled,memory]``, ``clip[tiled,memory]``,
``siglip[tiled,memory]``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import retrieval_calls
from reference import cross_modal as ref_pairs
from reference import retrieval as ref

import pmlfunc as pf

F64 = torch.float64
mnrl = pf.losses.multiple_negatives_ranking
init, push = pf.queues.document_queue_init, pf.queues.document_queue_push
N, K, D, S = 6, 2, 5, 9
SYM = ("query_to_doc", "doc_to_query")
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
ANCHOR_IDS = torch.tensor([10, 11, 12, 10, 13, 14])
POSITIVE_IDS = torch.tensor([20, 21, 22, 23, 24, 21])


def _rows(n: int, seed: int, dtype=F64) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _batch():
    q, p = _rows(N, 0), _rows(N, 1)
    p = q + 0.8 * p  # positives near their queries
    n = torch.randn(N, K, D, generator=torch.Generator().manual_seed(2), dtype=F64)
    return [t.requires_grad_() for t in (q, p, n)]


def _queue(fill: int, queries: bool = True, ids: bool = True, dtype=F64):
    """A queue of ``S`` slots after pushes of ``fill`` rows in all (wrapped when ``fill > S``),
    some of whose ids equal the batch's (a query seen before, a document seen before)."""
    queue = init(S, D, queries=queries, dtype=dtype)
    done = 0
    while done < fill:
        b = min(4, fill - done)
        aid = torch.arange(100 + done, 100 + done + b)
        pid = torch.arange(200 + done, 200 + done + b)
        if done == 0:  # the first push holds row 3's query and row 5's document again
            aid[0], pid[1] = 10, 21
        queue = push(
            queue,
            _rows(b, 10 + done, dtype),
            queries=_rows(b, 50 + done, dtype) if queries else None,
            anchor_ids=aid if ids else None,
            positive_ids=pid if ids else None,
        )
        done += b
    return queue


OPTIONS = {
    "plain": {},
    "symmetric": {"directions": SYM, "partition_mode": "per_direction"},
    "symmetric-joint": {"directions": SYM},
    "every-direction": {"directions": ALL},
    "ids": {"directions": ALL, "anchor_ids": ANCHOR_IDS, "positive_ids": POSITIVE_IDS},
    "ids-symmetric": {
        "directions": SYM,
        "partition_mode": "per_direction",
        "anchor_ids": ANCHOR_IDS,
        "positive_ids": POSITIVE_IDS,
    },
    "positive-ids": {"positive_ids": POSITIVE_IDS},
    "hardness": {"hardness_mode": "in_batch_negatives", "hardness_strength": 4.0},
    "all-negatives-hardness": {"hardness_mode": "all_negatives", "hardness_strength": 2.0},
    "dot-sum": {"distance": "dot", "scale": 0.5, "reducer": "sum", "directions": ALL},
}


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("queue_kind", ["partial", "wrapped", "documents-only"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_queue_adds_its_entries_as_candidates_as_the_reference_says(name, chunk, queue_kind):
    q, p, n = _batch()
    queue = {
        "partial": lambda: _queue(7),
        "wrapped": lambda: _queue(13),
        "documents-only": lambda: _queue(7, queries=False),
    }[queue_kind]()
    ours, theirs = retrieval_calls(OPTIONS[name])
    got = mnrl(q, p, n, chunk_size=chunk, memory=queue, **ours)
    want = ref.multiple_negatives_ranking(q, p, n, memory=queue, **theirs)
    _close(got, want)
    for a, b in zip(
        torch.autograd.grad(got, (q, p, n)), torch.autograd.grad(want, (q, p, n)), strict=True
    ):
        _close(a, b)


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize(
    ("queue_kind", "ids"),
    [
        (q, i)
        for q in ("queries", "documents-only", "none")
        for i in ("no-ids", "both-ids")
        if (q, i) != ("none", "no-ids")
    ],
)  # without either: plain clip (tests/test_cross_modal.py)
def test_clip_against_a_queue_is_symmetric_infonce_over_the_batch_and_the_queue(
    queue_kind, ids, chunk
):
    """``ℓ^{a→b}_i``'s log-sum-exp over the batch's and the queue's ``b`` rows, ``ℓ^{b→a}_j``'s
    over the batch's and (when queued) the queue's ``a`` rows, candidates related by an id left
    out (without a queue too); the learnable scale's gradient."""
    a, b, _ = _batch()
    queue = {
        "queries": lambda: _queue(7),
        "documents-only": lambda: _queue(7, queries=False),
        "none": lambda: None,
    }[queue_kind]()
    given = {"anchor_ids": ANCHOR_IDS, "positive_ids": POSITIVE_IDS} if ids == "both-ids" else {}
    params = {"logit_scale": torch.tensor(math.log(12.0), dtype=F64, requires_grad=True)}
    got = pf.losses.clip(a, b, params, chunk_size=chunk, memory=queue, **given)
    want = ref.multiple_negatives_ranking(
        a, b, scale=params["logit_scale"].exp(), directions=SYM, partition_mode="per_direction",
        memory=queue, **given,
    )  # fmt: skip
    _close(got, want)
    wrt = (a, b, params["logit_scale"])
    for x, y in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(want, wrt), strict=True):
        _close(x, y)


SIGLIP_IDS = {
    "no-ids": {},
    "positive-ids": {"positive_ids": POSITIVE_IDS},
    "both-ids": {"anchor_ids": ANCHOR_IDS, "positive_ids": POSITIVE_IDS},
}


def _siglip_params(bias: bool = True):
    params = {"logit_scale": torch.tensor(math.log(6.0), dtype=F64, requires_grad=True)}
    if bias:
        params["logit_bias"] = torch.tensor(-2.0, dtype=F64, requires_grad=True)
    return params


@pytest.mark.parametrize("reducer", ["batch", "mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize(
    ("queue_kind", "ids"),
    [
        (q, i)
        for q in ("none", "partial", "wrapped")
        for i in SIGLIP_IDS
        if (q, i) != ("none", "no-ids")
    ],
)  # without either: plain siglip (tests/test_cross_modal.py)
def test_siglip_against_a_queue_and_ids_sums_the_reference_pairs(queue_kind, ids, chunk, reducer):
    """Each filled queue entry a negative pair of every row, pairs related by an id left out (in
    the batch and against the queue), the reducer over the pairs summed; values and the
    gradients of both sets, the scale and the bias."""
    a, b, _ = _batch()
    queue = {"none": None, "partial": _queue(7), "wrapped": _queue(13)}[queue_kind]
    params = _siglip_params()
    red = None if reducer == "batch" else getattr(pf.reducers, reducer)()
    got = pf.losses.siglip(
        a, b, params, chunk_size=chunk, reducer=red, memory=queue, **SIGLIP_IDS[ids]
    )
    want = ref_pairs.siglip_pairs(
        a, b, params["logit_scale"], params["logit_bias"], memory=queue, reducer=reducer,
        **SIGLIP_IDS[ids],
    )  # fmt: skip
    _close(got, want)
    wrt = (a, b, params["logit_scale"], params["logit_bias"])
    for x, y in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(want, wrt), strict=True):
        _close(x, y)


def test_siglip_with_distinct_ids_and_an_empty_queue_is_plain_siglip():
    a, b, _ = _batch()
    params = _siglip_params()
    plain = pf.losses.siglip(a, b, params)
    got = pf.losses.siglip(
        a, b, params, memory=init(S, D, dtype=F64), positive_ids=torch.arange(N) + 7
    )
    _close(got, plain)
    wrt = (a, b, *params.values())
    for x, y in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(plain, wrt), strict=True):
        _close(x, y)


def test_a_queued_copy_of_a_rows_document_with_its_id_is_not_a_siglip_negative_of_that_row():
    """A queued copy of row 0's document pushed with its id: a negative pair of every other row
    (as any queued document), none of row 0's; pushed without the id, a negative of row 0 too."""
    a, b, _ = _batch()
    params = _siglip_params(bias=False)
    ids = torch.arange(N)
    total = pf.reducers.sum()
    without = pf.losses.siglip(a, b, params, reducer=total, positive_ids=ids).detach()
    unit = torch.nn.functional.normalize
    pairs = torch.nn.functional.softplus(
        6.0 * unit(a.detach(), dim=-1) @ unit(b[0].detach(), dim=0)
    )
    copy = push(init(S, D, dtype=F64), b[:1].detach(), positive_ids=ids[:1])
    masked = pf.losses.siglip(a, b, params, reducer=total, memory=copy, positive_ids=ids)
    _close(masked.detach(), without + pairs[1:].sum())
    anonymous = push(init(S, D, dtype=F64), b[:1].detach())
    unmasked = pf.losses.siglip(a, b, params, reducer=total, memory=anonymous, positive_ids=ids)
    _close(unmasked.detach(), without + pairs.sum())


@pytest.mark.parametrize("name", ["plain", "symmetric", "every-direction", "ids"])
def test_an_empty_queue_gives_the_loss_without_memory(name):
    q, p, n = _batch()
    ours, _ = retrieval_calls(OPTIONS[name])
    empty = init(S, D, queries=True, dtype=F64)
    got, want = mnrl(q, p, n, memory=empty, **ours), mnrl(q, p, n, **ours)
    _close(got, want)
    for a, b in zip(
        torch.autograd.grad(got, (q, p)), torch.autograd.grad(want, (q, p)), strict=True
    ):
        _close(a, b)
    params = pf.losses.clip_init(dtype=F64)
    _close(pf.losses.clip(q, p, params, memory=empty), pf.losses.clip(q, p, params))


def test_a_queued_copy_of_a_rows_document_with_its_id_is_not_its_negative():
    """Last step pushed a document with its id; this step it is a query's positive again. With
    the id its queued copy leaves the query's candidates (the loss of a one-row batch is 0);
    without, it is a negative exactly as similar as the positive: ``ℓ = log 2``."""
    q, p, _ = _batch()
    q, p, pid = q[:1], p[:1], torch.tensor([42])
    queue = push(init(S, D, dtype=F64), p, positive_ids=pid)
    _close(mnrl(q, p, positive_ids=pid, memory=queue), torch.tensor(0.0, dtype=F64))
    _close(mnrl(q, p, memory=queue), torch.tensor(math.log(2.0), dtype=F64))
    _close(mnrl(q, p, positive_ids=pid + 1, memory=queue), torch.tensor(math.log(2.0), dtype=F64))


def test_no_gradient_reaches_the_queue():
    q, p, _ = _batch()
    queue = _queue(7)
    queue = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in queue.items()}
    loss = mnrl(q, p, directions=SYM, memory=queue)
    loss.backward()
    assert queue["documents"].grad is None and queue["queries"].grad is None
    assert q.grad is not None


def test_a_push_writes_the_oldest_slots_detached_and_returns_a_new_queue():
    queue = init(4, 2, queries=True)
    rows = torch.arange(12.0).view(6, 2).requires_grad_()
    first = push(queue, rows[:3], queries=-rows[:3], positive_ids=torch.tensor([7, 8, 9]))
    assert int(first["count"]) == 3 and int(first["index"]) == 3
    assert first["positive_ids"].tolist() == [7, 8, 9, pf.queues.NO_ID]
    assert first["anchor_ids"].tolist() == [pf.queues.NO_ID] * 4
    second = push(first, rows[3:], queries=-rows[3:])  # wraps: slots 3, 0, 1
    assert int(second["count"]) == 4 and int(second["index"]) == 2
    assert second["documents"][:, 0].tolist() == [8.0, 10.0, 4.0, 6.0]
    assert torch.equal(second["queries"], -second["documents"])
    assert second["positive_ids"].tolist() == [pf.queues.NO_ID, pf.queues.NO_ID, 9, pf.queues.NO_ID]
    assert not second["documents"].requires_grad
    assert int(queue["count"]) == 0 and not queue["documents"].any()  # the input is unchanged
    assert first["documents"][:, 0].tolist() == [0.0, 2.0, 4.0, 0.0]


def test_a_queue_keeps_its_dtype_and_a_bfloat16_batch_reads_it_in_float32():
    queue = push(init(S, D), _rows(4, 3, torch.bfloat16))
    assert queue["documents"].dtype == torch.float32
    q, p = _rows(N, 0, torch.bfloat16), _rows(N, 1, torch.bfloat16)
    loss = mnrl(q, p, memory=queue)
    want = ref.multiple_negatives_ranking(q.double(), p.double(), memory=queue)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=0, atol=1e-5)


def _step(q, p, queue):
    loss = mnrl(q, p, directions=SYM, partition_mode="per_direction", chunk_size=2, memory=queue)
    return loss, push(queue, p, queries=q)


def test_a_step_that_reads_and_pushes_compiles_with_fullgraph_equal_to_eager():
    q, p = _rows(N, 0, torch.float32), _rows(N, 1, torch.float32)
    queue = _queue(7, dtype=torch.float32)
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    eager_loss, eager_queue = _step(q, p, queue)
    loss, new = compiled(q, p, queue)
    torch.testing.assert_close(loss, eager_loss)
    for key in eager_queue:
        torch.testing.assert_close(new[key], eager_queue[key])


def test_torch_func_grad_of_a_step_with_a_queue_equals_autograd():
    q, p, _ = _batch()
    queue = _queue(13)
    g = torch.func.grad(lambda q, p: _step(q, p, queue)[0], argnums=(0, 1))(q, p)
    want = torch.autograd.grad(_step(q, p, queue)[0], (q, p))
    for a, b in zip(g, want, strict=True):
        _close(a, b)


def test_a_queue_runs_on_the_meta_device():
    queue = push(init(S, D, queries=True, device="meta"), torch.empty(4, D, device="meta"),
                 queries=torch.empty(4, D, device="meta"))  # fmt: skip
    q, p = torch.empty(N, D, device="meta"), torch.empty(N, D, device="meta")
    assert mnrl(q, p, directions=ALL, memory=queue).shape == ()
    assert pf.losses.clip(q, p, pf.losses.clip_init(device="meta"), memory=queue).shape == ()
    ids = torch.arange(N, device="meta")
    siglip = pf.losses.siglip(
        q, p, pf.losses.siglip_init(device="meta"), memory=queue, positive_ids=ids
    )
    assert siglip.shape == () and siglip.device.type == "meta"


def test_under_the_gather_a_queue_of_global_entries_gives_the_single_process_loss():
    """Every rank holds the same queue (pushed with the gathered batch); ranks of unequal sizes;
    every rank's loss and gradients equal one process's on the whole batch."""
    q, p, n = (t.detach() for t in _batch())
    report = pf.testing.check_distributed(
        mnrl, q, p, n, world_size=2, sizes=(2, 4), exchange="gather", rtol=1e-9, atol=1e-11,
        directions=SYM, anchor_ids=ANCHOR_IDS, positive_ids=POSITIVE_IDS, memory=_queue(13),
    )  # fmt: skip
    assert {"anchors", "positives", "negatives"} <= set(report.grad_diffs)


def test_siglip_with_ids_and_a_queue_under_the_gather_gives_the_single_process_loss():
    a, b, _ = (t.detach() for t in _batch())
    report = pf.testing.check_distributed(
        pf.losses.siglip, a, b, {k: v.detach() for k, v in _siglip_params().items()},
        world_size=2, sizes=(2, 4), exchange="gather", rtol=1e-9, atol=1e-11,
        anchor_ids=ANCHOR_IDS, positive_ids=POSITIVE_IDS, memory=_queue(13),
    )  # fmt: skip
    assert {"emb_a", "emb_b"} <= set(report.grad_diffs)


def test_siglip_with_ids_on_the_ring_gives_the_single_process_loss():
    """Ids without a queue: the ring's blocks carry their rows' ids (an empty rank too)."""
    a, b, _ = (t.detach() for t in _batch())
    report = pf.testing.check_distributed(
        pf.losses.siglip, a, b, {k: v.detach() for k, v in _siglip_params().items()},
        world_size=3, sizes=(2, 0, 4), exchange="ring", rtol=1e-9, atol=1e-11,
        anchor_ids=ANCHOR_IDS, positive_ids=POSITIVE_IDS, chunk_size=2,
    )  # fmt: skip
    assert {"emb_a", "emb_b"} <= set(report.grad_diffs)


RING_QUEUE = {
    "plain": (mnrl, {}, 7),
    "symmetric-doc-columns": (mnrl, {"directions": SYM, "positive_ids": POSITIVE_IDS}, 7),
    "every-direction-ids": (
        mnrl,
        {"directions": ALL, "anchor_ids": ANCHOR_IDS, "positive_ids": POSITIVE_IDS},
        13,
    ),
    "clip": (pf.losses.clip, {}, 13),
    "siglip-ids": (pf.losses.siglip, {"positive_ids": POSITIVE_IDS}, 13),
}


@pytest.mark.parametrize("name", list(RING_QUEUE))
def test_on_the_ring_each_rank_reads_its_copy_of_the_queue_once(name):
    """Every rank holds the same queue and reads it after the ring's steps (it does not travel):
    ranks of unequal sizes and an empty one give the single-process loss and gradients."""
    fn, kw, fill = RING_QUEUE[name]
    q, p, _ = (t.detach() for t in _batch())
    params = ()
    if fn is not mnrl:
        made = _siglip_params(bias=fn is pf.losses.siglip)
        params = ({k: v.detach() for k, v in made.items()},)
    report = pf.testing.check_distributed(
        fn, q, p, *params, world_size=3, sizes=(2, 0, 4), exchange="ring", rtol=1e-9,
        atol=1e-11, memory=_queue(fill, queries=fn is not pf.losses.siglip), chunk_size=2, **kw,
    )  # fmt: skip
    assert len(report.grad_diffs) >= 2


def _errors():
    q, p, _ = _batch()
    queue = _queue(4)
    no_queries = _queue(4, queries=False)
    return {
        "not-a-queue": (lambda: mnrl(q, p, memory={"x": q}), TypeError, "document_queue_init"),
        "missing-key": (
            lambda: mnrl(q, p, memory={k: v for k, v in queue.items() if k != "count"}),
            TypeError,
            "missing \\['count'\\]",
        ),
        "width": (
            lambda: mnrl(q[:, :3], p[:, :3], memory=queue),
            ValueError,
            r"memory\['documents'\] must be \(9, 3\)",
        ),
        "count-out-of-range": (
            lambda: mnrl(q, p, memory={**queue, "count": torch.tensor(10)}),
            ValueError,
            r"memory\['count'\] = 10 is out of range for a queue of 9 slots",
        ),
        "guide": (
            lambda: mnrl(q, p, guide=(q.detach(), p.detach()), memory=queue),
            ValueError,
            "guide",
        ),
        "clip-labels": (
            lambda: pf.losses.clip(
                q, p, pf.losses.clip_init(dtype=F64), labels=torch.arange(N), memory=queue
            ),
            ValueError,
            "labels",
        ),
        "clip-ids-and-labels": (
            lambda: pf.losses.clip(
                q,
                p,
                pf.losses.clip_init(dtype=F64),
                labels=torch.arange(N),
                anchor_ids=torch.arange(N),
            ),
            ValueError,
            "clip with anchor_ids/positive_ids does not take labels",
        ),
        "clip-bias": (
            lambda: pf.losses.clip(q, p, pf.losses.clip_init(0.0, 1.0, dtype=F64), memory=queue),
            ValueError,
            "logit_bias",
        ),
        "siglip-labels": (
            lambda: pf.losses.siglip(
                q, p, pf.losses.siglip_init(dtype=F64), labels=torch.arange(N), memory=queue
            ),
            ValueError,
            "siglip with memory= does not take labels",
        ),
        "siglip-ids-and-labels": (
            lambda: pf.losses.siglip(
                q,
                p,
                pf.losses.siglip_init(dtype=F64),
                labels=torch.arange(N),
                positive_ids=torch.arange(N),
            ),
            ValueError,
            "anchor_ids/positive_ids does not take labels",
        ),
        "siglip-ids-length": (
            lambda: pf.losses.siglip(
                q, p, pf.losses.siglip_init(dtype=F64), anchor_ids=torch.arange(N + 1)
            ),
            ValueError,
            "anchor_ids",
        ),
        "siglip-params": (
            lambda: pf.losses.siglip(q, p, {"scale": torch.tensor(1.0)}, memory=queue),
            TypeError,
            "siglip_init",
        ),
        "push-too-many": (
            lambda: push(no_queries, _rows(S + 1, 0)),
            ValueError,
            "10 rows, more than the queue's 9 slots",
        ),
        "push-without-queries": (lambda: push(queue, _rows(2, 0)), ValueError, "queries="),
        "push-unexpected-queries": (
            lambda: push(no_queries, _rows(2, 0), queries=_rows(2, 1)),
            ValueError,
            "queries=True",
        ),
        "push-ids-length": (
            lambda: push(no_queries, _rows(2, 0), positive_ids=torch.arange(3)),
            ValueError,
            "positive_ids",
        ),
        "push-dtype": (lambda: push(no_queries, _rows(2, 0).long()), TypeError, "documents"),
        "init-size": (lambda: init(0, D), ValueError, "size"),
    }


@pytest.mark.parametrize("name", list(_errors()))
def test_bad_input_raises_naming_the_argument(name):
    call, error, match = _errors()[name]
    with pytest.raises(error, match=match):
        call()
