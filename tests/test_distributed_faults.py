"""pmlfunc.distributed when ranks disagree, hold no rows or fail (two gloo processes spawned by
the test; every scenario bounded in time). ``python -m benchmarks.faults`` measures the same
cases from the command line."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

import pmlfunc as pf
from pmlfunc import distributed
from pmlfunc.distributed import RankError
from pmlfunc.testing import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

D = 6
SPAWN_TIMEOUT = 120.0  # a whole scenario, start-up included; far above what each one takes


def _batch(n: int, *, d: int = D, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return emb, torch.arange(n) % 3


NTXENT = functools.partial(pf.losses.ntxent, temperature=0.1)
MNRL = pf.losses.multiple_negatives_ranking


def _negatives(k: int, n: int = 6, seed: int = 2) -> torch.Tensor:
    """``k`` hard negatives for each of ``n`` queries, ``(n, k, D)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, D, generator=g, dtype=torch.float64).requires_grad_()


def _outcome(fn) -> tuple[str, str]:
    """``("ok", value)`` or the exception's type and message."""
    try:
        return "ok", repr(float(fn().detach()))
    except Exception as err:
        return type(err).__name__, str(err)


def _disagreements() -> dict[str, tuple[str, str]]:
    """Each case: rank 0 and rank 1 call the same entry point with something that differs."""
    rank = dist.get_rank()
    first = rank == 0
    emb, labels = _batch(6)
    pair_b, _ = _batch(6, seed=1)
    params = pf.losses.siglip_init(dtype=torch.float64)
    gather, ring = (
        distributed.global_objective,
        functools.partial(distributed.global_objective, exchange="ring"),
    )
    cases = {
        "embeddings dtype": lambda: gather(NTXENT)(emb.to(torch.float32 if first else torch.float64), labels),
        "labels dtype": lambda: gather(pf.losses.supcon)(emb, labels.to(torch.int64 if first else torch.int32)),
        "ring width": lambda: ring(pf.losses.clip)(_batch(6, d=8 + rank)[0], _batch(6, d=8 + rank)[0], params),
        "labels on one rank (gather)": lambda: gather(pf.losses.clip)(emb, pair_b, params, **({"labels": labels} if first else {})),
        "labels on one rank (ring)": lambda: ring(pf.losses.siglip)(emb, pair_b, params, **({"labels": labels} if first else {})),
        "temperature": lambda: gather(pf.losses.ntxent)(emb, labels, temperature=0.1 if first else 0.2),
        "params keys": lambda: ring(pf.losses.siglip)(emb, pair_b, params if first else {"logit_scale": params["logit_scale"]}),
        "different losses": lambda: gather(NTXENT if first else pf.losses.supcon)(emb, labels),
        "different exchanges": lambda: distributed.global_objective(NTXENT, exchange="gather" if first else "ring")(emb, labels),
        "requires_grad": lambda: gather(NTXENT)(emb if first else emb.detach(), labels),
        "memory size": lambda: distributed.cross_batch_memory(
            pf.losses.contrastive, emb, labels, pf.wrappers.cross_batch_memory_init(20 + 4 * rank, D, dtype=torch.float64)
        )[0],
        "value_and_grad width": lambda: distributed.value_and_grad(NTXENT, 3)(_batch(6, d=D + rank)[0].detach(), labels)[0],
        "all_gather width": lambda: distributed.all_gather(_batch(6, d=D + rank)[0], name="emb").sum(),
        "hard negatives a row (ring)": lambda: ring(MNRL)(emb, pair_b, _negatives(2 if first else 3)),
        "anchor ids on one rank (ring)": lambda: ring(MNRL)(emb, pair_b, _negatives(2), **({"anchor_ids": labels} if first else {})),
        "guide on one rank (ring)": lambda: ring(MNRL)(emb, pair_b, **({"guide": (emb.detach(), pair_b.detach())} if first else {})),
        "queue size (ring)": lambda: ring(MNRL)(emb, pair_b, memory=pf.queues.document_queue_init(8 + 4 * rank, D, dtype=torch.float64)),
        "queue on one rank (ring)": lambda: ring(pf.losses.siglip)(
            emb, pair_b, params, **({"memory": pf.queues.document_queue_init(8, D, dtype=torch.float64)} if first else {})
        ),
        "statistics width": lambda: gather(pf.losses.barlow_twins)(_batch(6, d=D + rank)[0], _batch(6, d=D + rank)[0]),
        "statistics momentum": lambda: gather(pf.losses.dino)(
            emb.view(6, 2, 3), emb.view(6, 2, 3), pf.losses.dino_init(3, dtype=torch.float64), center_momentum=0.9 if first else 0.8
        )[0],
        "statistics optional on one rank": lambda: gather(pf.losses.mmcr)(
            emb.view(6, 2, 3), **({"momentum": emb.view(6, 2, 3)} if first else {})
        ),
        "labels of the wrong length on rank 1": lambda: gather(NTXENT)(emb, labels if first else labels[:4]),
        "labels a list on rank 1": lambda: gather(NTXENT)(emb, labels if first else labels.tolist()),
    }  # fmt: skip
    out = {name: _outcome(case) for name, case in cases.items()}
    # none of these broke the process group: a correct call still gives the global loss
    out["afterwards"] = _outcome(lambda: gather(NTXENT)(emb, labels))
    return out


# case -> what each rank's message must name besides both ranks (the argument, both values)
DISAGREEMENTS = {
    "embeddings dtype": ("embeddings", "float32", "float64"),
    "labels dtype": ("labels", "int64", "int32"),
    "ring width": ("emb_a", "(*, 8)", "(*, 9)"),
    "labels on one rank (gather)": ("labels", "None", "given on some ranks only"),
    "labels on one rank (ring)": ("labels", "None", "given on some ranks only"),
    "temperature": ("temperature", "0.1", "0.2"),
    "params keys": ("params", "'logit_bias'"),
    "hard negatives a row (ring)": ("negatives", "(*, 2, 6)", "(*, 3, 6)"),
    "anchor ids on one rank (ring)": ("anchor_ids", "None", "given on some ranks only"),
    "guide on one rank (ring)": ("guide[0]", "(not given)", "given on some ranks only"),
    "queue size (ring)": ("memory", "(8, 6)", "(12, 6)"),
    "queue on one rank (ring)": ("memory", "given on some ranks only"),
    "statistics width": ("emb_a", "(*, 6)", "(*, 7)"),
    "statistics momentum": ("center_momentum", "0.9", "0.8"),
    "statistics optional on one rank": ("momentum", "None", "given on some ranks only"),
    "different losses": ("different calls", "ntxent", "supcon"),
    "different exchanges": ("different calls", "exchange='ring'"),
    "requires_grad": ("embeddings", "requires_grad"),
    "memory size": ("memory", "(20, 6)", "(24, 6)"),
    "value_and_grad width": ("embeddings", "(*, 6)", "(*, 7)"),
    "all_gather width": ("emb", "(*, 6)", "(*, 7)"),
}


def test_ranks_that_disagree_raise_the_same_value_error_on_every_rank_and_the_group_stays_usable():
    start = time.monotonic()
    results = spawn_ranks(_disagreements, world_size=2, timeout=SPAWN_TIMEOUT)
    for case, names in DISAGREEMENTS.items():
        (kind0, text0), (kind1, text1) = results[0][case], results[1][case]
        assert kind0 == kind1 == "ValueError", (case, results[0][case], results[1][case])
        assert text0 == text1, case  # the same message on every rank
        assert "rank 0" in text0 and "rank 1" in text0, (case, text0)
        for name in names:
            assert name in text0, (case, name, text0)
    # a rank's own check: raised there as it is, and reported by the other rank (same type)
    kind0, text0 = results[0]["labels of the wrong length on rank 1"]
    kind1, text1 = results[1]["labels of the wrong length on rank 1"]
    assert kind0 == kind1 == "ValueError"
    assert text1.startswith("labels must have one row per row of embeddings")
    assert "refused on rank 1" in text0 and text1 in text0
    kinds = {r["labels a list on rank 1"][0] for r in results}
    assert kinds == {"TypeError"}, results[0]["labels a list on rank 1"]
    # afterwards: the global loss of the 12 rows, on both ranks
    emb, labels = _batch(6)
    whole = NTXENT(torch.cat([emb, emb]), torch.cat([labels, labels]))
    for res in results:
        assert res["afterwards"][0] == "ok"
        assert float(res["afterwards"][1]) == pytest.approx(float(whole.detach()), rel=1e-12)
    assert time.monotonic() - start < SPAWN_TIMEOUT


def _empty_everywhere() -> dict[str, tuple[str, str]]:
    emb, labels = _batch(0)
    b, _ = _batch(0, seed=1)
    params = pf.losses.clip_init(dtype=torch.float64)
    return {
        "gather": _outcome(lambda: distributed.global_objective(NTXENT)(emb, labels)),
        "ring": _outcome(lambda: distributed.global_objective(pf.losses.clip, exchange="ring")(emb, b, params)),
        "pair": _outcome(lambda: distributed.global_objective(pf.losses.clip)(emb, b, params)),
        "value_and_grad": _outcome(lambda: distributed.value_and_grad(NTXENT, 4)(emb.detach(), labels)[0]),
    }  # fmt: skip


def test_a_global_batch_without_rows_is_refused_on_every_rank():
    results = spawn_ranks(_empty_everywhere, world_size=2, timeout=SPAWN_TIMEOUT)
    for case in ("gather", "ring", "pair", "value_and_grad"):
        assert results[0][case] == results[1][case], case
        kind, text = results[0][case]
        assert kind == "ValueError" and "no rows on any rank" in text, (case, text)


EMPTY_RANK_CASES = [
    ("ntxent", "gather"),
    ("supcon", "gather"),
    ("ntxent", "ring"),
    ("supcon", "ring"),
    ("ntxent", "value_and_grad"),
]


def _one_rank_empty() -> dict[tuple[str, str], tuple[float, torch.Tensor]]:
    """Per case: the loss of rows 0..7 held by rank 0 only (rank 1 has none) and the rank's
    gradient."""
    out = {}
    for loss, exchange in EMPTY_RANK_CASES:
        emb, labels = _batch(8 if dist.get_rank() == 0 else 0)
        fn = functools.partial(getattr(pf.losses, loss), temperature=0.1)
        if exchange == "value_and_grad":
            value, g = distributed.value_and_grad(fn, 3)(emb.detach(), labels)
        else:
            value = distributed.global_objective(fn, exchange=exchange)(emb, labels)
            value.backward()
            g = emb.grad
        out[loss, exchange] = (float(value), g.detach())
    return out


def test_an_empty_rank_takes_part_and_contributes_nothing():
    """The gather (anchors split), the ring and the chunked value and gradient with rank 1
    empty: the global loss on both ranks, ``W · ∂L/∂x`` on rank 0's rows, a (0, D) gradient on
    rank 1's (pair losses and parameters: tests/test_testing.py, through check_distributed)."""
    results = spawn_ranks(_one_rank_empty, world_size=2, timeout=SPAWN_TIMEOUT)
    for loss, exchange in EMPTY_RANK_CASES:
        emb, labels = _batch(8)
        fn = functools.partial(getattr(pf.losses, loss), temperature=0.1)
        whole = fn(emb, labels)
        (grad,) = torch.autograd.grad(whole, emb)
        got = [res[loss, exchange] for res in results]
        for rank, (value, _) in enumerate(got):
            assert value == pytest.approx(float(whole), rel=1e-12), (loss, exchange, rank)
        torch.testing.assert_close(got[0][1], 2 * grad, rtol=1e-9, atol=1e-12)  # W · ∂L/∂x
        assert got[1][1].shape == (0, D)


def _calls_twice(call) -> dict[str, object]:
    """``call()`` twice on this rank: each outcome ``("ok", "", None)`` or the exception's
    ``(type, message, ranks)`` (a :class:`RankError`'s ranks), and its seconds."""
    out: dict[str, object] = {}
    for step in range(2):
        start = time.monotonic()
        try:
            call()
            out[f"step {step}"] = ("ok", "", None)
        except Exception as err:
            ranks = err.ranks if isinstance(err, RankError) else None
            out[f"step {step}"] = (type(err).__name__, str(err), ranks)
        out[f"step {step} seconds"] = time.monotonic() - start
    return out


def _ring_fault(phase: str, loss: str) -> dict[str, object]:
    """Rank 1 raises inside the ring (its second tile walk of the forward, or the backward's
    walk), catches it and calls the ring again; rank 0 is in the same call. ``loss``: CLIP,
    or the retrieval loss with hard negatives and ids (blocks with metadata)."""
    import pmlfunc._ring as ring_module

    rank = dist.get_rank()
    if rank == 1:
        name = "block_forward" if phase == "forward" else "block_backward"
        real, calls = getattr(ring_module, name), [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError(f"injected fault in rank 1's {phase}")
            return real(*args, **kwargs)

        setattr(ring_module, name, failing)
    a, _ = _batch(8)
    b, _ = _batch(8, seed=1)
    fn = (
        pf.losses.clip
        if loss == "clip"
        else functools.partial(MNRL, anchor_ids=torch.arange(8) // 2)
    )
    ring = distributed.global_objective(fn, exchange="ring", timeout=60.0)
    params = pf.losses.clip_init(dtype=torch.float64)
    args = (a, b, params) if loss == "clip" else (a, b, _negatives(2, 8), params)
    return _calls_twice(lambda: ring(*args).backward())


@pytest.mark.parametrize("loss", ["clip", "retrieval"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_failing_inside_the_ring_makes_every_rank_fail_within_seconds_naming_it(phase, loss):
    results = spawn_ranks(_ring_fault, phase, loss, world_size=2, timeout=SPAWN_TIMEOUT)
    kind, text, ranks = results[0]["step 0"]
    assert kind == "RankError" and ranks == (1,), text
    assert f"rank 1 failed (in its pmlfunc call #0, while the ring's {phase})" in text
    assert f"RuntimeError: injected fault in rank 1's {phase}" in text
    assert results[0]["step 0 seconds"] < 10.0  # the posted failure, not the 60 s timeout
    assert results[1]["step 0"][:2] == ("RuntimeError", f"injected fault in rank 1's {phase}")
    for rank in (0, 1):  # the group is broken: every later call says so at once
        kind, text, _ = results[rank]["step 1"]
        assert kind == "RankError" and "cannot be used by pmlfunc any more" in text
        assert results[rank]["step 1 seconds"] < 1.0


def _failing_user_loss(emb, labels):
    if dist.get_rank() == 1:
        raise ValueError("this rank's loss broke")
    return NTXENT(emb, labels)


def _gather_fault() -> tuple[str, str, tuple[int, ...] | None, float]:
    """Rank 1's loss raises after the gather; rank 0 computes it and waits in the backward."""
    emb, labels = _batch(6)
    start = time.monotonic()
    try:
        distributed.global_objective(_failing_user_loss, timeout=60.0)(emb, labels).backward()
        return "ok", "", None, time.monotonic() - start
    except Exception as err:
        ranks = err.ranks if isinstance(err, RankError) else None
        return type(err).__name__, str(err), ranks, time.monotonic() - start


def test_a_rank_whose_loss_fails_after_the_gather_is_named_by_the_rank_waiting_in_the_backward():
    results = spawn_ranks(_gather_fault, world_size=2, timeout=SPAWN_TIMEOUT)
    kind, text, ranks, seconds = results[0]
    assert kind == "RankError" and ranks == (1,), text
    assert "while computing the loss): ValueError: this rank's loss broke" in text
    assert "backward of gathering embeddings" in text and seconds < 10.0
    assert results[1][:2] == ("ValueError", "this rank's loss broke")


def _absent_rank() -> tuple[str, str, tuple[int, ...] | None, bool | None, float]:
    """Rank 1 never calls the loss; rank 0 waits ``timeout`` = 1 s."""
    if dist.get_rank() == 1:
        time.sleep(3.0)
        return "skipped", "", None, None, 0.0
    emb, labels = _batch(6)
    start = time.monotonic()
    try:
        distributed.global_objective(NTXENT, timeout=1.0)(emb, labels)
        return "ok", "", None, None, time.monotonic() - start
    except RankError as err:
        return type(err).__name__, str(err), err.ranks, err.timed_out, time.monotonic() - start


def _statistics_fault() -> tuple[str, str, tuple[int, ...] | None, float]:
    """Rank 1's statistics loss raises after the agreement; rank 0 waits in its first all-reduce."""
    from pmlfunc.losses import self_supervised

    if dist.get_rank() == 1:

        def broken(*args, **kwargs):
            raise ValueError("this rank's statistics broke")

        self_supervised._mean_cosine = broken  # a fresh process: nothing else sees it
    a, b = _batch(6)[0], _batch(6, seed=1)[0]
    start = time.monotonic()
    try:
        distributed.global_objective(pf.losses.negative_cosine_similarity, timeout=60.0)(a, b)
        return "ok", "", None, time.monotonic() - start
    except Exception as err:
        ranks = err.ranks if isinstance(err, RankError) else None
        return type(err).__name__, str(err), ranks, time.monotonic() - start


def test_a_rank_whose_statistics_loss_fails_is_named_by_the_rank_waiting_in_the_all_reduce():
    results = spawn_ranks(_statistics_fault, world_size=2, timeout=SPAWN_TIMEOUT)
    kind, text, ranks, seconds = results[0]
    assert kind == "RankError" and ranks == (1,), text
    assert "this rank's statistics broke" in text and seconds < 10.0
    assert results[1][:2] == ("ValueError", "this rank's statistics broke")


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    results = spawn_ranks(_absent_rank, world_size=2, timeout=SPAWN_TIMEOUT)
    kind, text, ranks, timed_out, seconds = results[0]
    assert kind == "RankError" and timed_out and ranks == (1,), text
    assert "rank 0 waited 1 s while agreeing on the call" in text
    assert "in pmlfunc call #0 on this process group" in text
    assert "rank(s) [1] never reached this call" in text
    assert 1.0 <= seconds < 5.0


# ---------------------------------------------------------------------------------------------
# classes sharded across ranks (distributed.sharded_classes): rank 0 holds classes 0..3, rank 1
# classes 4..6 (class_range); each rank 6 rows with global labels in both shards
# ---------------------------------------------------------------------------------------------
C = 7
ARCFACE = pf.losses.arcface
SHARDED_TIMEOUT = 5.0  # each wait's bound in the failure scenarios: a posted failure is read
# within POLL (0.25 s); short, so that a failure that is not posted shows as a 5 s wait


def _table(dtype=torch.float64) -> torch.Tensor:
    """The whole ``(C, D)`` table (every rank draws it alike and keeps its rows)."""
    g = torch.Generator().manual_seed(3)
    return pf.losses.arcface_init(C, D, generator=g, dtype=dtype)["weight"]


def _sharded_inputs(rank: int, *, dtype=torch.float64, table_dtype=torch.float64):
    """Rank ``rank``'s rows, their global labels and its shard of the table (a leaf)."""
    emb, _ = _batch(6, dtype=dtype, seed=10 + rank)
    start, stop = (0, 4) if rank == 0 else (4, C)  # class_range(C) on two ranks
    shard = _table(table_dtype)[start:stop].clone().requires_grad_()
    return emb, (2 * torch.arange(6) + rank) % C, shard


def _sharded_disagreements() -> dict[str, tuple[str, str]]:
    """Rank 0 and rank 1 call ``sharded_classes(arcface)`` with something that differs."""
    rank = dist.get_rank()
    first = rank == 0
    loss_fn = distributed.sharded_classes(ARCFACE)
    emb, labels, shard = _sharded_inputs(rank)
    dtype = torch.float32 if first else torch.float64  # rank 0 in single precision

    def call(e=emb, y=labels, w=shard, **kw):
        return loss_fn(e, y, {"weight": w}, **kw)

    cases = {
        "embeddings dtype": lambda: call(e=_sharded_inputs(rank, dtype=dtype)[0]),
        "shard dtype": lambda: call(w=_sharded_inputs(rank, table_dtype=dtype)[2]),
        # a rank in lower precision throughout: the first argument that differs is named
        "embeddings and shard dtype": lambda: call(*_sharded_inputs(rank, dtype=dtype, table_dtype=dtype)),
        "labels dtype": lambda: call(y=labels.to(torch.int64 if first else torch.int32)),
        "labels of the wrong length on rank 1": lambda: call(y=labels if first else labels[:4]),
        "params not a dict on rank 1": lambda: loss_fn(emb, labels, {"weight": shard} if first else shard),
    }  # fmt: skip
    out = {name: _outcome(case) for name, case in cases.items()}
    # none of these broke the process group: a correct call still gives the whole table's loss
    out["afterwards"] = _outcome(lambda: call(class_chunk_size=2))
    return out


# case -> what each rank's message must name besides both ranks (the argument, both values)
SHARDED_DISAGREEMENTS = {
    "embeddings dtype": ("sharded_classes(arcface)", "embeddings", "float32", "float64"),
    "shard dtype": ("sharded_classes(arcface)", "params differs", "float32", "float64"),
    "embeddings and shard dtype": ("sharded_classes(arcface)", "embeddings", "float32", "float64"),
    "labels dtype": ("sharded_classes(arcface)", "labels", "int64", "int32"),
}


def test_sharded_classes_ranks_that_disagree_on_dtype_raise_the_same_error_on_every_rank():
    """Embeddings, the shard of the table or the labels in another dtype on one rank: the same
    ``ValueError`` on both ranks, naming the argument, the ranks and both dtypes; a rank's own
    refused input (labels of the wrong length, params not a dict) raised there as it is and
    reported by the other rank with the same type; and the group is still usable afterwards
    (the one-process loss over both ranks' rows and the whole table)."""
    start = time.monotonic()
    results = spawn_ranks(_sharded_disagreements, world_size=2, timeout=SPAWN_TIMEOUT)
    for case, names in SHARDED_DISAGREEMENTS.items():
        (kind0, text0), (kind1, text1) = results[0][case], results[1][case]
        assert kind0 == kind1 == "ValueError", (case, results[0][case], results[1][case])
        assert text0 == text1, case  # the same message on every rank
        assert "the ranks disagree" in text0 and "rank 0" in text0 and "rank 1" in text0, text0
        for name in names:
            assert name in text0, (case, name, text0)
    kind0, text0 = results[0]["labels of the wrong length on rank 1"]
    kind1, text1 = results[1]["labels of the wrong length on rank 1"]
    assert kind0 == kind1 == "ValueError"
    assert text1.startswith("labels must have one row per row of embeddings")
    assert "sharded_classes(arcface) refused on rank 1" in text0 and text1 in text0
    kind0, text0 = results[0]["params not a dict on rank 1"]
    kind1, text1 = results[1]["params not a dict on rank 1"]
    assert kind0 == kind1 == "TypeError", (text0, text1)
    assert "refused on rank 1" in text0 and text1 in text0
    # afterwards: arcface over the 12 rows and the whole table, on both ranks
    rows = [_sharded_inputs(rank) for rank in (0, 1)]
    whole = ARCFACE(
        torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), {"weight": _table()}
    )
    for res in results:
        assert res["afterwards"][0] == "ok", res["afterwards"]
        assert float(res["afterwards"][1]) == pytest.approx(float(whole.detach()), rel=1e-12)
    assert time.monotonic() - start < SPAWN_TIMEOUT


def _sharded_fault(phase: str) -> dict[str, object]:
    """Rank 1 raises inside ``sharded_classes`` (its classes' statistics in the forward, or
    their gradients in the backward), catches it and calls again; rank 0 is in the same call,
    waiting in the all-reduce that combines the ranks' statistics (the injection of
    ``_ring_fault``: the engine's function replaced on rank 1 only)."""
    import pmlfunc.losses._tiled as tiled_module

    rank = dist.get_rank()
    if rank == 1:
        name = "class_forward" if phase == "forward" else "class_backward"

        def failing(*args, **kwargs):
            raise RuntimeError(f"injected fault in rank 1's {phase}")

        setattr(tiled_module, name, failing)
    emb, labels, shard = _sharded_inputs(rank)
    loss_fn = distributed.sharded_classes(ARCFACE, timeout=SHARDED_TIMEOUT)
    return _calls_twice(
        lambda: loss_fn(emb, labels, {"weight": shard}, class_chunk_size=2).backward()
    )


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_that_fails_inside_sharded_classes_is_named_by_the_waiting_ranks(phase):
    """Rank 1's own exception on rank 1; on rank 0, well within its timeout, a
    ``RankError`` naming rank 1, where it failed and its exception; then the group is broken
    and every later call on both ranks says so at once."""
    results = spawn_ranks(_sharded_fault, phase, world_size=2, timeout=SPAWN_TIMEOUT)
    kind, text, ranks = results[0]["step 0"]
    assert kind == "RankError" and ranks == (1,), text
    assert "sharded_classes(arcface): rank 1 failed (in its pmlfunc call #0, while" in text
    assert phase == "backward" or "while computing the loss)" in text
    assert f"RuntimeError: injected fault in rank 1's {phase}" in text
    assert results[0]["step 0 seconds"] < SHARDED_TIMEOUT / 2  # the posted failure, not the timeout
    assert results[1]["step 0"][:2] == ("RuntimeError", f"injected fault in rank 1's {phase}")
    for rank in (0, 1):  # the group is broken: every later call says so at once
        kind, text, _ = results[rank]["step 1"]
        assert kind == "RankError" and "cannot be used by pmlfunc any more" in text, text
        assert results[rank]["step 1 seconds"] < 1.0


def _compiled_ring() -> dict[str, object]:
    a, _ = _batch(6)
    b, _ = _batch(6, seed=1)
    params = pf.losses.clip_init(dtype=torch.float64)
    ring = distributed.global_objective(pf.losses.clip, exchange="ring")

    def step(a, b):
        return ring(a, b, params) * 2

    def full_step(a, b):  # its own code object: dynamo's cache is per function
        return ring(a, b, params) * 2

    out: dict[str, object] = {"eager": float(step(a, b).detach())}
    out["compiled"] = float(torch.compile(step)(a, b).detach())  # a graph break: eager ring
    try:
        torch.compile(full_step, fullgraph=True)(a, b)
    except Exception as err:
        out["fullgraph"] = str(err)
    return out


@pytest.mark.compile
def test_the_ring_under_compile_is_a_graph_break_and_fullgraph_gives_pmlfuncs_reason():
    results = spawn_ranks(_compiled_ring, world_size=2, timeout=SPAWN_TIMEOUT)
    for res in results:
        assert res["compiled"] == pytest.approx(res["eager"], rel=1e-12)
        first_lines = "\n".join(str(res["fullgraph"]).splitlines()[:2])
        assert "pmlfunc: global_objective(clip, exchange='ring') runs eagerly" in first_lines
        assert "use exchange='gather'" in first_lines


def test_the_fault_benchmark_reports_what_each_rank_sees():
    """benchmarks/faults.py (the measurement behind the guide's before/after table), one case."""
    from benchmarks import faults

    rows = faults.run_rank_scenario("labels-one-rank", hang=60.0)
    assert [r for r, _, _ in rows] == [0, 1]
    for _, outcome, seconds in rows:
        assert outcome.startswith("ValueError: global_objective(clip): the ranks disagree")
        assert seconds < 30.0
