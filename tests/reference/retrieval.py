"""Float64 loop reference of ``multiple_negatives_ranking``, written from sentence-transformers'
documented formulas (``MultipleNegativesRankingLoss``, ``GISTEmbedLoss``) and the papers.

Row ``i``: query ``q_i``, positive ``p_i``, hard negatives ``n_i1..n_ik``. The documents of the
batch are every positive and every hard negative. For each row the candidates are listed one by
one, as the directions define them (van den Oord et al. 2018 for ``query_to_doc``; GTE, Li et
al. 2023, for the four directions in one softmax; symmetric InfoNCE for ``per_direction``):

* ``query_to_doc``: ``(q_i, d)`` for every document ``d``;
* ``query_to_query``: ``(q_i, q_r)``, ``r ≠ i``;
* ``doc_to_query``: ``(p_i, q_r)`` for every ``r``;
* ``doc_to_doc``: ``(p_i, d)`` for the documents of rows ``r ≠ i``.

A candidate is dropped when it is a known non-negative: a query or positive of a row ``r ≠ i``
with the same anchor id or positive id; or (guide, GISTEmbed, Solatorio 2024) when the guide's
cosine of the same two texts exceeds ``g_i − margin`` (absolute) or ``g_i − |g_i|·margin``
(relative), ``g_i`` the guide cosine of ``(q_i, p_i)``, the positive pair itself always kept.
Hardness (Lan et al. 2025): ``α · s`` (the raw similarity, no gradient) added to the chosen
``query_to_doc`` negatives. ``ℓ_i = lse(candidates) − t·s(q_i, p_i)`` (``per_direction``: the
mean of the directions' log-sum-exps); the loss is the mean (or sum) over rows. Nothing is
shared with the library: every candidate is a separate dot product.

``memory``: a queue of earlier steps' rows (a dict of plain tensors, as
``pf.queues.document_queue_init`` lays it out; only its first ``count`` slots are read, the
ring buffer's filled ones before it wraps): every queued document is one more candidate of
``query_to_doc`` and ``doc_to_doc``, every queued query one more of ``query_to_query`` and
``doc_to_query``, no row's own, dropped when its anchor id (or positive id) equals the row's
and the batch gives that kind of id (MoCo, He et al. 2020, for the queue).
"""

from __future__ import annotations

import torch


def _unit(v, normalize: bool):
    return v / v.norm() if normalize else v


def multiple_negatives_ranking(
    q,
    p,
    neg=None,
    *,
    scale=20.0,
    normalize=True,
    directions=("query_to_doc",),
    partition_mode="joint",
    hardness_mode=None,
    hardness_strength=0.0,
    anchor_ids=None,
    positive_ids=None,
    guide=None,
    margin_strategy="absolute",
    margin=0.0,
    reducer="mean",
    memory=None,
):
    n = q.shape[0]
    k = 0 if neg is None else neg.shape[1]
    Q = [_unit(q[i], normalize) for i in range(n)]
    P = [_unit(p[i], normalize) for i in range(n)]
    NEG = [[_unit(neg[i, j], normalize) for j in range(k)] for i in range(n)]
    # every document: (owner row, "pos" / "neg", vector, guide vector)
    aid = list(range(n)) if anchor_ids is None else [int(v) for v in anchor_ids]
    pid = list(range(n)) if positive_ids is None else [int(v) for v in positive_ids]

    def related(i, r):
        return r != i and (aid[i] == aid[r] or pid[i] == pid[r])

    queued = []  # (query or None, document, anchor id, positive id) of each filled slot
    if memory is not None:
        for s in range(int(memory["count"])):
            mq = memory["queries"][s] if "queries" in memory else None
            queued.append(
                (
                    None if mq is None else _unit(mq.to(q.dtype), normalize),
                    _unit(memory["documents"][s].to(q.dtype), normalize),
                    int(memory["anchor_ids"][s]),
                    int(memory["positive_ids"][s]),
                )
            )

    def related_queued(i, entry):
        return (anchor_ids is not None and aid[i] == entry[2]) or (
            positive_ids is not None and pid[i] == entry[3]
        )

    if guide is not None:
        gq = [guide[0][i] / guide[0][i].norm() for i in range(n)]
        gp = [guide[1][i] / guide[1][i].norm() for i in range(n)]
        gn = [[guide[2][i, j] / guide[2][i, j].norm() for j in range(k)] for i in range(n)]
    docs = []
    for r in range(n):
        docs.append((r, "pos", P[r], gp[r] if guide is not None else None))
    for r in range(n):
        for j in range(k):
            docs.append((r, "neg", NEG[r][j], gn[r][j] if guide is not None else None))

    losses = []
    for i in range(n):
        threshold = None
        if guide is not None:
            g = torch.dot(gq[i], gp[i])
            threshold = g - margin if margin_strategy == "absolute" else g - g.abs() * margin

        def guided_out(gu, gv, positive_pair, threshold=threshold):
            if threshold is None or positive_pair:
                return False
            return bool(torch.dot(gu, gv) > threshold)

        per_direction = {}
        # query_to_doc
        terms = []
        for r, what, d, gd in docs:
            if what == "pos" and related(i, r):
                continue
            if guided_out(gq[i] if guide is not None else None, gd, r == i and what == "pos"):
                continue
            sim = torch.dot(Q[i], d)
            logit = scale * sim
            if hardness_mode is not None:
                own = r == i
                pen = {
                    "in_batch_negatives": not own,
                    "hard_negatives": own and what == "neg",
                    "all_negatives": not (own and what == "pos"),
                }[hardness_mode]
                if pen:
                    logit = logit + hardness_strength * sim.detach()
            terms.append(logit)
        for entry in queued:
            if related_queued(i, entry):
                continue
            sim = torch.dot(Q[i], entry[1])
            pen = hardness_mode in ("in_batch_negatives", "all_negatives")
            terms.append(scale * sim + (hardness_strength * sim.detach() if pen else 0.0))
        per_direction["query_to_doc"] = terms
        own_queries = [e[0] for e in queued if e[0] is not None and not related_queued(i, e)]
        own_docs = [e[1] for e in queued if not related_queued(i, e)]
        if "query_to_query" in directions:
            per_direction["query_to_query"] = [
                scale * torch.dot(Q[i], Q[r])
                for r in range(n)
                if r != i
                and not related(i, r)
                and not (guide is not None and guided_out(gq[i], gq[r], False))
            ] + [scale * torch.dot(Q[i], v) for v in own_queries]
        if "doc_to_query" in directions:
            per_direction["doc_to_query"] = [
                scale * torch.dot(P[i], Q[r])
                for r in range(n)
                if not related(i, r)
                and not (guide is not None and guided_out(gp[i], gq[r], r == i))
            ] + [scale * torch.dot(P[i], v) for v in own_queries]
        if "doc_to_doc" in directions:
            per_direction["doc_to_doc"] = [
                scale * torch.dot(P[i], d)
                for r, what, d, gd in docs
                if r != i
                and not (what == "pos" and related(i, r))
                and not (guide is not None and guided_out(gp[i], gd, False))
            ] + [scale * torch.dot(P[i], v) for v in own_docs]
        positive = scale * torch.dot(Q[i], P[i])
        if partition_mode == "joint":
            every = [t for v in per_direction.values() for t in v]
            log_z = torch.logsumexp(torch.stack(every), 0)
        else:
            parts = [torch.logsumexp(torch.stack(v), 0) for v in per_direction.values()]
            log_z = sum(parts) / len(parts)
        losses.append(log_z - positive)
    total = sum(losses)
    return total / n if reducer == "mean" else total
