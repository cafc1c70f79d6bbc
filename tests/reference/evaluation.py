"""Float64 loop references of ``pmlfunc.evaluation``'s IR metrics, shard merge and threshold.

Plain Python, one query (or one candidate threshold) at a time, written from the textbook
definitions documented in docs/evaluation.md; nothing here imports pmlfunc. Relevance is a dict
``{reference index: grade}`` per query; an item is relevant when its grade is > 0.
"""

from __future__ import annotations

import math

import torch


def ranking(q, r, *, similarity, exclude_self=False):
    """Each query's full ranking of the reference rows: a float64 (Q, R) score matrix ``q @ r.T``
    (similarity, larger first) or Euclidean distance (smaller first), sorted by score and then
    by lower index, own row dropped with ``exclude_self``."""
    q, r = q.double(), r.double()
    out = []
    for i in range(q.shape[0]):
        scores = []
        for j in range(r.shape[0]):
            if exclude_self and i == j:
                continue
            if similarity:
                value = float(q[i] @ r[j])
                scores.append((-value, j))
            else:
                value = math.sqrt(float(((q[i] - r[j]) ** 2).sum()))
                scores.append((value, j))
        out.append([j for _, j in sorted(scores)])
    return out


def relevance_from_labels(query_labels, reference_labels, *, exclude_self=False):
    ql, rl = query_labels.tolist(), reference_labels.tolist()
    return [
        {j: 1.0 for j, b in enumerate(rl) if b == a and not (exclude_self and i == j)}
        for i, a in enumerate(ql)
    ]


def relevance_from_matrix(matrix, *, exclude_self=False):
    rows = matrix.double().tolist()
    return [
        {j: g for j, g in enumerate(row) if g != 0 and not (exclude_self and i == j)}
        for i, row in enumerate(rows)
    ]


def relevance_from_ids(ids, grades=None, *, exclude_self=False):
    out = []
    for i, row in enumerate(ids.tolist()):
        g_row = [1.0] * len(row) if grades is None else grades.double()[i].tolist()
        out.append(
            {
                j: g
                for j, g in zip(row, g_row, strict=True)
                if j >= 0 and not (exclude_self and i == j)
            }
        )
    return out


def query_metrics(ranked, rel, name, k):
    """One query's metric from its ranked reference ids and its relevance dict, or None when the
    query has no relevant item (left out of the average)."""
    relevant = [j for j, g in rel.items() if g > 0]
    n = len(relevant)
    if n == 0:
        return None
    top = ranked[:k]
    hits = [rel.get(j, 0.0) > 0 for j in top]
    if name == "precision":
        return sum(hits) / k
    if name == "recall":
        return sum(hits) / n
    if name == "hit_rate":
        return 1.0 if any(hits) else 0.0
    if name == "mrr":
        for pos, h in enumerate(hits, start=1):
            if h:
                return 1.0 / pos
        return 0.0
    if name == "map":
        found, total = 0, 0.0
        for pos, h in enumerate(hits, start=1):
            if h:
                found += 1
                total += found / pos
        return total / min(n, k)
    if name == "ndcg":
        dcg = sum(rel.get(j, 0.0) / math.log2(pos + 1) for pos, j in enumerate(top, start=1))
        best = sorted((g for g in rel.values()), reverse=True)[:k]
        idcg = sum(g / math.log2(pos + 1) for pos, g in enumerate(best, start=1))
        return dcg / idcg
    raise ValueError(name)


def scores(rankings, relevances, metrics):
    """``{"name@k": mean over queries with a relevant item}`` (NaN when there are none)."""
    out = {}
    for spec in metrics:
        name, k = spec.split("@")
        values = [
            query_metrics(rk, rl, name, int(k)) for rk, rl in zip(rankings, relevances, strict=True)
        ]
        kept = [v for v in values if v is not None]
        out[spec] = sum(kept) / len(kept) if kept else math.nan
    return out


def per_query(rankings, relevances, spec):
    name, k = spec.split("@")
    return [
        math.nan if v is None else v
        for v in (
            query_metrics(rk, rl, name, int(k)) for rk, rl in zip(rankings, relevances, strict=True)
        )
    ]


def cross_modal(image, text, text_to_image, metrics, *, similarity=True):
    """Both directions by loops: image i's relevant texts are those with text_to_image == i."""
    t2i = text_to_image.tolist()
    i2t_rel = [{t: 1.0 for t, i in enumerate(t2i) if i == img} for img in range(image.shape[0])]
    t2i_rel = [{i: 1.0} for i in t2i]
    return {
        "image_to_text": scores(ranking(image, text, similarity=similarity), i2t_rel, metrics),
        "text_to_image": scores(ranking(text, image, similarity=similarity), t2i_rel, metrics),
    }


def threshold_metric(distances, is_match, threshold, metric, *, similarity=False):
    """The metric when pairs with distance <= threshold (similarity >= threshold) are matches."""
    tp = fp = tn = fn = 0
    for d, m in zip(distances.double().tolist(), is_match.tolist(), strict=True):
        predicted = (d >= threshold) if similarity else (d <= threshold)  # NaN: False
        if predicted and m:
            tp += 1
        elif predicted:
            fp += 1
        elif m:
            fn += 1
        else:
            tn += 1
    if metric == "accuracy":
        return (tp + tn) / (tp + fp + tn + fn)
    if metric == "balanced_accuracy":
        tpr = tp / (tp + fn) if tp + fn else 0.0
        tnr = tn / (tn + fp) if tn + fp else 0.0
        return (tpr + tnr) / 2
    return 2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 0.0


def best_threshold(distances, is_match, metric, *, similarity=False):
    """Brute force over every distinct value and "no match": ``(best score, the candidates that
    reach it within 1e-12, sorted strictest first)``."""
    values = sorted({d for d in distances.double().tolist() if not math.isnan(d)})
    none = math.inf if similarity else -math.inf
    candidates = [none, *(reversed(values) if similarity else values)]
    results = [
        (t, threshold_metric(distances, is_match, t, metric, similarity=similarity))
        for t in candidates
    ]
    best = max(s for _, s in results)
    return best, [t for t, s in results if s >= best - 1e-12]


def as_tensor(values):
    return torch.tensor(values, dtype=torch.float64)
