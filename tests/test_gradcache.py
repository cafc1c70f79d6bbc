"""pf.chunked.gradcache: the GradCache step gives the gradients of one backward through the same
forward, replays dropout, trains the loss's own params, syncs DDP once, bounds the activations."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist

import pmlfunc as pf
from pmlfunc.memory import peak_tensor_bytes
from pmlfunc.testing import spawn_ranks

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _mlp(d_in: int = 12, hidden: int = 24, d_out: int = 6, *, dropout: float = 0.3, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.Dropout(dropout), torch.nn.GELU(),
        torch.nn.Linear(hidden, d_out),
    ).to(F64)  # fmt: skip


def _data(n: int = 37, d_in: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=F64), torch.arange(n) % 7


def _reference(encoders, inputs, loss_fn, mini_batch):
    """One backward through the forward GradCache replays: each encoder on the same
    mini-batches in the same order (so the same random draws), the loss on all rows at once."""
    embs = [
        torch.cat([enc(x) for x in inp.split(mini_batch)])
        for enc, inp in zip(encoders, inputs, strict=True)
    ]
    loss = loss_fn(*embs)
    loss.backward()
    return loss.detach()


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def _assert_same_grads(a, b):
    for ga, gb in zip(_grads(a), _grads(b), strict=True):
        torch.testing.assert_close(ga, gb, **TOL)


@pytest.mark.parametrize("mini_batch", [1, 8, 10, 37, 64], ids=lambda m: f"mini{m}")
def test_gradients_equal_one_backward_through_the_same_forward_with_dropout(mini_batch):
    x, y = _data()
    enc, ref = _mlp(), _mlp()
    loss_fn = functools.partial(pf.losses.ntxent, labels=y, temperature=0.2)

    torch.manual_seed(123)
    loss = pf.chunked.gradcache(enc, x, loss_fn, mini_batch=mini_batch)
    state_after = torch.get_rng_state()
    torch.manual_seed(123)
    expected = _reference([ref], [x], loss_fn, mini_batch)

    torch.testing.assert_close(loss, expected, **TOL)
    assert not loss.requires_grad
    _assert_same_grads(enc, ref)
    # the replays consume no random numbers: the generator ends where one forward leaves it
    assert torch.equal(state_after, torch.get_rng_state())


def test_without_replay_dropout_draws_new_masks_and_the_gradients_differ():
    x, y = _data()
    enc, ref = _mlp(), _mlp()
    loss_fn = functools.partial(pf.losses.ntxent, labels=y)
    torch.manual_seed(5)
    pf.chunked.gradcache(enc, x, loss_fn, mini_batch=8, replay_rng=False)
    torch.manual_seed(5)
    _reference([ref], [x], loss_fn, 8)
    diff = max(float((a - b).abs().max()) for a, b in zip(_grads(enc), _grads(ref), strict=True))
    assert diff > 1e-3  # the replay is what makes the test above pass


def test_two_towers_and_a_learnable_logit_scale_on_the_tiled_clip():
    x, _ = _data(29)
    t = torch.randn(29, 9, generator=torch.Generator().manual_seed(1), dtype=F64)
    towers = [_mlp(seed=1), _mlp(9, seed=2)]
    refs = copy.deepcopy(towers)
    params = {"logit_scale": torch.tensor(2.0, dtype=F64, requires_grad=True)}
    ref_params = {"logit_scale": torch.tensor(2.0, dtype=F64, requires_grad=True)}

    torch.manual_seed(7)
    loss = pf.chunked.gradcache(
        towers, (x, t), lambda a, b: pf.losses.clip(a, b, params, chunk_size=8), mini_batch=6
    )
    torch.manual_seed(7)
    expected = _reference(refs, [x, t], lambda a, b: pf.losses.clip(a, b, ref_params), 6)

    torch.testing.assert_close(loss, expected, **TOL)
    for enc, ref in zip(towers, refs, strict=True):
        _assert_same_grads(enc, ref)
    torch.testing.assert_close(params["logit_scale"].grad, ref_params["logit_scale"].grad, **TOL)
    assert params["logit_scale"].grad != 0


def test_towers_of_different_batch_sizes_hard_negatives():
    q, _ = _data(11)
    docs, _ = _data(33, seed=3)  # a positive and two negatives per query
    enc, ref = _mlp(dropout=0.0), _mlp(dropout=0.0)

    def loss_fn(eq, ed):
        return pf.losses.multiple_negatives_ranking(eq, ed[:11], ed[11:].reshape(11, 2, -1))

    loss = pf.chunked.gradcache((enc, enc), (q, docs), loss_fn, mini_batch=5)
    expected = _reference([ref, ref], [q, docs], loss_fn, 5)
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_same_grads(enc, ref)


def test_a_functional_encoder_accumulates_into_its_params_leaves():
    x, y = _data(21)
    module, ref = _mlp(), _mlp()
    params = {k: v.detach().clone().requires_grad_() for k, v in module.named_parameters()}
    encoder = functools.partial(torch.func.functional_call, module, params)
    loss_fn = functools.partial(pf.losses.ntxent, labels=y)
    torch.manual_seed(9)
    pf.chunked.gradcache(encoder, x, loss_fn, mini_batch=6)
    torch.manual_seed(9)
    _reference([ref], [x], loss_fn, 6)
    for (name, p), q in zip(params.items(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    assert all(p.grad is None for p in module.parameters())  # the module's own are untouched


class _Recorder(torch.nn.Module):
    """An encoder with DDP's ``no_sync`` interface that records, per call, whether autograd
    was on and whether it ran inside ``no_sync``."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls, self._unsynced = inner, [], False

    @contextlib.contextmanager
    def no_sync(self):
        self._unsynced = True
        try:
            yield
        finally:
            self._unsynced = False

    def forward(self, x):
        self.calls.append((torch.is_grad_enabled(), self._unsynced))
        return self.inner(x)


def test_no_sync_on_every_mini_batch_but_the_last_use_of_each_module():
    x, _ = _data(20)
    shared, other = _Recorder(_mlp(dropout=0.0)), _Recorder(_mlp(dropout=0.0, seed=4))
    pf.chunked.gradcache(
        (shared, other, shared),
        (x, x[:9], x[:7]),
        lambda a, b, c: a.sum() + b.square().sum() + c.prod(1).sum(),
        mini_batch=8,
    )
    # shared: 3 + 1 mini-batches in pass 1 (no graph), then again with a graph: only the very
    # last one (of the third tower) outside no_sync
    assert shared.calls == [(False, False)] * 4 + [(True, True)] * 3 + [(True, False)]
    assert other.calls == [(False, False)] * 2 + [(True, True), (True, False)]


def test_a_frozen_tower_is_not_run_again():
    x, _ = _data(16)
    frozen = _Recorder(_mlp(dropout=0.0)).requires_grad_(False)
    trained = _mlp(dropout=0.0)
    pf.chunked.gradcache(
        (trained, frozen), (x, x), lambda a, b: pf.losses.clip(a, b, pf.losses.clip_init()),
        mini_batch=4,
    )  # fmt: skip
    assert frozen.calls == [(False, False)] * 4
    assert all(p.grad is not None for p in trained.parameters())


def test_gradients_accumulate_like_backward():
    x, y = _data(16)
    enc, ref = _mlp(dropout=0.0), _mlp(dropout=0.0)
    loss_fn = functools.partial(pf.losses.supcon, labels=y)
    for _ in range(2):
        pf.chunked.gradcache(enc, x, loss_fn, mini_batch=5)
    _reference([ref], [x], loss_fn, 5)
    for ga, gb in zip(_grads(enc), _grads(ref), strict=True):
        torch.testing.assert_close(ga, 2 * gb, **TOL)


def test_mapping_and_tuple_inputs_split_tensors_and_pass_other_values_whole():
    x, y = _data(13)
    mask = torch.rand(13, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    lin, ref = _mlp(dropout=0.0), _mlp(dropout=0.0)
    seen = []

    def encoder(module, features, mask, *, scale):
        seen.append((features.shape[0], scale))
        return module(features * mask) * scale

    loss_fn = functools.partial(pf.losses.ntxent, labels=y)
    pf.chunked.gradcache(
        functools.partial(encoder, lin, scale=2.0),
        {"features": x, "mask": mask},
        loss_fn,
        mini_batch=5,
    )
    assert seen == [(5, 2.0), (5, 2.0), (3, 2.0)] * 2
    pf.chunked.gradcache(
        lambda f, m, s: encoder(lin, f, m, scale=s), (x, mask, 2.0), loss_fn, mini_batch=5
    )
    loss = loss_fn(ref(x * mask) * 2.0)
    loss.backward()
    for ga, gb in zip(_grads(lin), _grads(ref), strict=True):
        torch.testing.assert_close(ga, 2 * gb, **TOL)  # two steps accumulated


def test_activations_held_for_one_mini_batch():
    # a wide 2-layer MLP and the tiled loss in both steps: the full step holds the batch's
    # activations (B x 2048, twice), the GradCache step one mini-batch's, the B x D embeddings
    # and their gradient (issue 32: <= 1/8 of the full-batch step)
    torch.manual_seed(0)
    enc = torch.nn.Sequential(
        torch.nn.Linear(16, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 32)
    )  # fmt: skip
    x, y = torch.randn(1024, 16), torch.arange(1024) // 4
    loss_fn = functools.partial(pf.losses.ntxent, labels=y, chunk_size=64)

    _, peak_full = peak_tensor_bytes(lambda: loss_fn(enc(x)).backward())
    grads_full = _grads(enc)
    enc.zero_grad(set_to_none=True)
    _, peak_cached = peak_tensor_bytes(pf.chunked.gradcache, enc, x, loss_fn, mini_batch=64)

    assert peak_cached <= peak_full / 8, (peak_cached, peak_full)
    for a, b in zip(_grads(enc), grads_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda enc, x, f: pf.chunked.gradcache(enc, x, f, mini_batch=0), ValueError, "mini_batch"),
        (lambda enc, x, f: pf.chunked.gradcache([enc, enc], [x], f, mini_batch=4), ValueError,
         "one input per encoder"),
        (lambda enc, x, f: pf.chunked.gradcache([enc, 3], [x, x], f, mini_batch=4), TypeError,
         r"encoders\[1\] must be callable"),
        (lambda enc, x, f: pf.chunked.gradcache(enc, x[:0], f, mini_batch=4), ValueError,
         "empty batch"),
        (lambda enc, x, f: pf.chunked.gradcache(enc, (x, x[:3]), f, mini_batch=4), ValueError,
         "share their first dimension"),
        (lambda enc, x, f: pf.chunked.gradcache(enc, "text", f, mini_batch=4), TypeError,
         "must be a tensor"),
        (lambda enc, x, f: pf.chunked.gradcache(enc, (1, 2), f, mini_batch=4), TypeError,
         "holds no tensor"),
        (lambda enc, x, f: pf.chunked.gradcache(lambda v: v[:2], x, f, mini_batch=4), ValueError,
         "returned 2 rows for a mini-batch of 4"),
        (lambda enc, x, f: pf.chunked.gradcache(lambda v: v.long(), x, f, mini_batch=4),
         TypeError, "floating tensor of embeddings"),
        (lambda enc, x, f: pf.chunked.gradcache(enc, x, lambda e: e.sum(1), mini_batch=4),
         TypeError, r"0-d floating tensor .* shape \(10,\)"),
    ],
    ids=["mini-batch", "count", "not-callable", "empty", "batch-sizes", "input-type",
         "no-tensor", "rows", "dtype", "loss-shape"],
)  # fmt: skip
def test_bad_input_is_a_clear_error(call, error, match):
    x, y = _data(10)
    with pytest.raises(error, match=match):
        call(_mlp(), x, lambda e: pf.losses.ntxent(e, y))


# --- under DDP: two gloo processes -------------------------------------------------------------


def _ddp_rank(mode: str, sizes: tuple[int, ...]) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    x, y = _data(sum(sizes))
    r0 = sum(sizes[:rank])
    x, y = x[r0 : r0 + sizes[rank]], y[r0 : r0 + sizes[rank]]
    model = DDP(_mlp(seed=3))
    syncs = []

    def count(state, bucket):  # DDP calls it once per bucket and synchronised backward
        syncs.append(1)
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0] / dist.get_world_size())
        )

    model.register_comm_hook(None, count)
    loss_fn = pf.distributed.global_objective(functools.partial(pf.losses.ntxent, temperature=0.3))
    torch.manual_seed(100 + rank)
    if mode == "gradcache":
        loss = pf.chunked.gradcache(model, x, lambda e: loss_fn(e, y), mini_batch=4)
    else:  # the plain DDP step through the forward gradcache replays
        loss = loss_fn(torch.cat([model(xs) for xs in x.split(4)] or [model(x)]), y)
        loss.backward()
    return {"loss": loss.detach(), "grads": _grads(model.module), "syncs": len(syncs)}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
@pytest.mark.parametrize("sizes", [(10, 7), (9, 0)], ids=["unequal", "empty-rank"])
def test_under_ddp_equal_to_the_plain_step_with_one_all_reduce(sizes):
    cached = spawn_ranks(_ddp_rank, "gradcache", sizes, world_size=2, timeout=120)
    plain = spawn_ranks(_ddp_rank, "plain", sizes, world_size=2, timeout=120)
    for got, want in zip(cached, plain, strict=True):
        torch.testing.assert_close(got["loss"], want["loss"], **TOL)
        for a, b in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(a, b, **TOL)
        # 3 mini-batches on rank 0, 2 (or none: an empty rank) on rank 1, yet the buckets are
        # reduced once, as in the plain step (a rank with more mini-batches would otherwise wait
        # on the other)
        assert got["syncs"] == want["syncs"] >= 1
    torch.testing.assert_close(cached[0]["grads"][0], cached[1]["grads"][0], **TOL)
