"""Helpers the test modules share: seeded data, values with gradients, and their comparison."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch

import pmlfunc as pf

F64, F32 = torch.float64, torch.float32
UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]  # uneven classes; 2 and 4 are singletons
REF_LABELS = [0, 1, 1, 5, 3, 3, 0, 2]  # a reference set: shares some classes, has an unseen one
EDGE_LAYOUTS = {  # legal batches with nothing, or almost nothing, to compare
    "batch_of_one": [3],
    "no_positives": [0, 1, 2, 3, 4],
    "no_negatives": [1, 1, 1, 1, 1],
    "two_rows_same": [0, 0],
    "two_rows_distinct": [0, 1],
}


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a loss of ``dtype`` embeddings: float32 for float16/bfloat16 (the loss is
    computed and returned in float32), else ``dtype``. Gradients keep ``dtype``."""
    return F32 if dtype in (torch.float16, torch.bfloat16) else dtype


def randn(gen, *shape, dtype=F64):
    """Normal draws in float64 (the same numbers whatever ``dtype``), then cast."""
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def value_and_grads(fn, *tensors):
    """``fn(*leaves)`` and the gradient of the result w.r.t. fresh leaf copies of ``tensors``
    (zeros for an input it does not use). A tuple result is a loss and its state."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    if isinstance(out, tuple):
        out = out[0]
    assert out.ndim == 0, f"loss must be 0-d, got shape {tuple(out.shape)}"
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    return out.detach(), grads


def with_and_without_bound(monkeypatch, fn, *tensors):
    """``(got, want)``: :func:`value_and_grads` of ``fn`` as the tiled engine computes it (the
    unshifted base-2 exponentials where its bound on the logits allows) and with no bound known
    (``_tiled._logit_bound`` patched to ``None``: the softmax and plain paths)."""
    from pmlfunc.losses import _tiled

    got = value_and_grads(fn, *tensors)
    with monkeypatch.context() as m:
        m.setattr(_tiled, "_logit_bound", lambda *a: None)
        want = value_and_grads(fn, *tensors)
    return got, want


def assert_same(got, want, **tol):
    """Two ``(value, grads)`` results equal (``want`` cast to ``got``'s dtypes)."""
    (gv, gg), (wv, wg) = got, want
    torch.testing.assert_close(gv, wv.to(gv.dtype), **tol, msg=lambda m: f"value: {m}")
    for k, (a, b) in enumerate(zip(gg, wg, strict=True)):
        torch.testing.assert_close(
            a, b.to(a.dtype), **tol, msg=lambda m, k=k: f"grad of input {k}: {m}"
        )


def finite(fn, *tensors):
    """:func:`value_and_grads`, asserting the value and every gradient are finite."""
    value, grads = value_and_grads(fn, *tensors)
    assert torch.isfinite(value), f"loss not finite: {value}"
    for g in grads:
        assert torch.isfinite(g).all(), f"gradient not finite: {g}"
    return value, grads


def assert_vmap_equals_a_loop(fn, x):
    """``vmap(fn)`` over two problems equals ``fn`` on each."""
    batched = torch.func.vmap(fn)(torch.stack([x, 2 * x + 1]))
    torch.testing.assert_close(batched, torch.stack([fn(x), fn(2 * x + 1)]))


@contextlib.contextmanager
def compiled_saved_tensors() -> Iterator[list[list[tuple[torch.Tensor, str]]]]:
    """Record, for each training graph inductor compiles inside the block, the tensors its
    forward saves for the backward (the outputs of AOT autograd's min-cut partition, as fake
    tensors, each with the source line that made it). The graph caches are off, so that every
    graph is partitioned here; a test that finds nothing recorded should fail rather than pass
    vacuously (the private hook moved)."""
    from torch._functorch import config as functorch_config
    from torch._functorch import partitioners
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config

    recorded: list[list[tuple[torch.Tensor, str]]] = []
    partition = partitioners.min_cut_rematerialization_partition

    def hook(joint, *args, **kwargs):
        fw, bw = partition(joint, *args, **kwargs)
        out = next(n for n in fw.graph.nodes if n.op == "output")
        graph = []
        for node in out.args[0]:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor):
                trace = (node.meta.get("stack_trace") or node.name).strip().splitlines()
                graph.append((value, trace[-2].strip() if len(trace) > 1 else trace[-1]))
        recorded.append(graph)
        return fw, bw

    with (
        # where inductor's compile calls it (its own imported name), and where it is defined
        mock.patch.object(compile_fx, "min_cut_rematerialization_partition", hook),
        mock.patch.object(partitioners, "min_cut_rematerialization_partition", hook),
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield recorded


def saved_bool_masks(recorded, rows: int) -> list[tuple[tuple[int, ...], str]]:
    """The boolean tensors of at least ``rows × rows`` entries in :func:`compiled_saved_tensors`'
    record: ``(shape, source line)``. Inductor's CPU code stores such a mask ~20× slower than a
    float one (``pmlfunc._ops.indicator``), so no loss's compiled graph should save one. A
    dimension known only at run time (the width ``K`` of a listing of each row's positive
    columns, :func:`pmlfunc._ops.label_rows`) is not the grid's: a ``(B, K)`` listing's
    validity is not such a mask."""
    return [
        (tuple(t.shape), where)
        for graph in recorded
        for t, where in graph
        if t.dtype == torch.bool
        and t.ndim >= 2
        and all(isinstance(d, int) and d >= rows for d in t.shape[-2:])
    ]


class GivenEmbeddings(torch.nn.Module):
    """A stand-in sentence-transformers model for parity tests: ``forward`` returns the given
    embeddings of the column it is fed (``features = {"column": i}``); ``model[0]`` is itself,
    the module the Cached losses inspect."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns

    def forward(self, features):
        return {"sentence_embedding": self.columns[features["column"]]}

    def __getitem__(self, index):
        return self


def sentence_transformers_losses():
    """``sentence_transformers``' loss classes, or the test skipped where it is not installed."""
    import pytest

    return pytest.importorskip("sentence_transformers.sentence_transformer.losses")


def retrieval_calls(option: dict, guide=None) -> tuple[dict, dict]:
    """A ``multiple_negatives_ranking`` test option as ``(pmlfunc kwargs, reference kwargs)``
    (the float64 reference, tests/reference/retrieval.py): ``"k"`` (the batch's hard negatives a
    row) dropped; ``"guide": True`` becomes ``guide`` (the guide's embeddings, without the
    negatives' for pmlfunc when ``k`` is 0); ``"distance": "dot"`` pmlfunc's dot product and the
    reference's ``normalize=False``; a ``"reducer"`` pmlfunc's sum reducer (the reference takes
    its name)."""
    opt = {key: v for key, v in option.items() if key != "k"}
    ours, theirs = dict(opt), dict(opt)
    if opt.get("guide"):
        ours["guide"] = theirs["guide"] = guide
        if option.get("k") == 0:
            ours["guide"] = guide[:2]
    if opt.get("distance") == "dot":
        ours["distance"], theirs["normalize"] = pf.distances.dot(), False
        theirs.pop("distance")
    if "reducer" in opt:
        ours["reducer"] = pf.reducers.sum()
    return ours, theirs


def fresh_pytest_env(**extra: str) -> dict[str, str]:
    """The environment for a nested ``python -m pytest`` that a test starts: this one's without
    the variables that tell a pytest it runs in an xdist worker (``PYTEST_XDIST_*``; under them
    pytest-benchmark disables its timing) or in a test (``PYTEST_CURRENT_TEST``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.pop("PYTEST_CURRENT_TEST", None)
    return {**env, **extra}
