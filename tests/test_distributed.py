"""pmlfunc.distributed: two gloo processes spawned by the test itself
(:func:`pmlfunc.testing.spawn_ranks`; the examples and benchmarks also run under torchrun).

Each scenario trains one step of a linear encoder under DDP on its rank's slice of a global
batch and returns the parameter gradients; the test compares them with single-process gradients
of the same loss on the whole batch (float64, tight tolerances).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import pmlfunc as pf
from pmlfunc import distributed
from pmlfunc.testing import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

DIM_IN, DIM_OUT, CLASSES = 12, 6, 5
WORLD = 2


def _data(sizes):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, DIM_IN, generator=g, dtype=torch.float64)
    y = torch.arange(n) % CLASSES
    return x, y


def _encoder() -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(DIM_IN, DIM_OUT).double()


def _proxy_params():
    g = torch.Generator().manual_seed(2)
    return {"proxies": torch.randn(CLASSES, DIM_OUT, generator=g, dtype=torch.float64)}


# name -> (loss function, needs params)
LOSSES = {
    "contrastive": (functools.partial(pf.losses.contrastive, neg_margin=1.4), False),
    "ntxent": (functools.partial(pf.losses.ntxent, temperature=0.1), False),
    "supcon": (functools.partial(pf.losses.supcon, temperature=0.1), False),
    "triplet_margin": (functools.partial(pf.losses.triplet_margin, margin=0.2), False),
    "multi_similarity": (pf.losses.multi_similarity, False),
    "proxy_anchor": (pf.losses.proxy_anchor, True),
}


# the ring's losses: name -> (loss function, "self" (embeddings, labels) | "pair" (two aligned
# sets, learnable scale and bias) | "pair-labels" (the same, with labels=))
RING_CASES = {
    "ntxent": (functools.partial(pf.losses.ntxent, temperature=0.1), "self"),
    "ntxent-tiled": (functools.partial(pf.losses.ntxent, temperature=0.1, chunk_size=4), "self"),
    "supcon": (functools.partial(pf.losses.supcon, temperature=0.1), "self"),
    "supcon-tiled": (functools.partial(pf.losses.supcon, chunk_size=4), "self"),
    "clip": (pf.losses.clip, "pair"),
    "clip-tiled-labels": (functools.partial(pf.losses.clip, chunk_size=4), "pair-labels"),
    "siglip-labels": (pf.losses.siglip, "pair-labels"),
    "siglip-tiled": (functools.partial(pf.losses.siglip, chunk_size=4), "pair"),
}


def _pair_params():
    params = pf.losses.siglip_init(logit_scale=1.5, logit_bias=-2.0, dtype=torch.float64)
    return {k: v.requires_grad_() for k, v in params.items()}


def _ring_case_loss(name: str, fn, encoder, x, y, params):
    """The case's loss of the rows ``x`` (a pair case's second set: the encoder on ``x``
    reversed along the features, a second view)."""
    form = RING_CASES[name][1]
    if form == "self":
        return fn(encoder(x), y)
    labels = {"labels": y} if form == "pair-labels" else {}
    return fn(encoder(x), encoder(x.flip(-1)), params, **labels)


def _const(value, _):
    return value


class _LargestDim(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest dimension of any tensor an op makes (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim:
                self.largest = max(self.largest, *t.shape)
        return out


MEMORY_SIZE, MEMORY_STEPS = 20, 4


def _memory_batch(step: int, sizes):
    g = torch.Generator().manual_seed(100 + step)
    n = sum(sizes)
    return torch.randn(n, DIM_IN, generator=g, dtype=torch.float64), torch.randint(
        0, CLASSES, (n,), generator=g
    )


def _single_process(name: str, sizes) -> dict[str, torch.Tensor]:
    """Gradients of the loss on the whole batch in one process."""
    x, y = _data(sizes)
    enc = _encoder()
    loss_fn, has_params = LOSSES[name]
    params = {k: v.requires_grad_() for k, v in _proxy_params().items()}
    loss = loss_fn(enc(x), y, params) if has_params else loss_fn(enc(x), y)
    loss.backward()
    out = {f"enc.{k}": p.grad for k, p in enc.named_parameters()}
    if has_params:
        out.update({f"params.{k}": v.grad for k, v in params.items()})
    out["loss"] = loss.detach()
    return out


def _scenario(scenario: str, sizes) -> dict:
    """One rank's part of a scenario (in a process of :func:`pmlfunc.testing.spawn_ranks`)."""
    rank = dist.get_rank()
    result: dict = {}
    x, y = _data(sizes)
    r0 = sum(sizes[:rank])
    x_local, y_local = x[r0 : r0 + sizes[rank]], y[r0 : r0 + sizes[rank]]
    if scenario == "losses":
        for name, (loss_fn, has_params) in LOSSES.items():
            ddp = torch.nn.parallel.DistributedDataParallel(_encoder())
            params = {k: v.requires_grad_() for k, v in _proxy_params().items()}
            objective = distributed.global_objective(loss_fn)
            emb = ddp(x_local)
            loss = objective(emb, y_local, params) if has_params else objective(emb, y_local)
            loss.backward()
            grads = {f"enc.{k}": p.grad.clone() for k, p in ddp.module.named_parameters()}
            if has_params:
                grads.update({f"params.{k}": v.grad.clone() for k, v in params.items()})
            grads["loss"] = loss.detach()
            result[name] = grads
            # which path ran: anchors split over ranks, or the whole loss on every rank
            args = (params,) if has_params else ()
            split = distributed._anchor_split(loss_fn, x, y, args, {})
            result[f"{name}.split"] = split is not None
    elif scenario == "ring":
        for name, (loss_fn, _) in RING_CASES.items():
            for exchange in distributed.EXCHANGES:
                ddp = torch.nn.parallel.DistributedDataParallel(_encoder())
                params = _pair_params()
                objective = distributed.global_objective(loss_fn, exchange=exchange)
                loss = _ring_case_loss(name, objective, ddp, x_local, y_local, params)
                loss.backward()
                grads = {f"enc.{k}": p.grad.clone() for k, p in ddp.module.named_parameters()}
                if RING_CASES[name][1] != "self":
                    grads.update({f"params.{k}": v.grad.clone() for k, v in params.items()})
                grads["loss"] = loss.detach()
                result[f"{name}.{exchange}"] = grads
                # the loss alone, on leaf embeddings: the largest tensor it makes
                emb = _encoder()(x_local).detach().requires_grad_()
                with _LargestDim() as seen:
                    _ring_case_loss(
                        name,
                        objective,
                        functools.partial(_const, emb),
                        x_local,
                        y_local,
                        params,
                    ).backward()
                result[f"{name}.{exchange}.largest"] = seen.largest
    elif scenario == "chunked":
        for name in ("ntxent", "contrastive", "triplet_margin"):
            ddp = torch.nn.parallel.DistributedDataParallel(_encoder())
            vg = distributed.value_and_grad(LOSSES[name][0], chunk_size=3)
            emb = ddp(x_local)
            value, g = vg(emb.detach(), y_local)
            emb.backward(g)
            grads = {f"enc.{k}": p.grad.clone() for k, p in ddp.module.named_parameters()}
            grads["loss"] = value
            result[name] = grads
    elif scenario == "mismatch":
        width = DIM_OUT + rank  # rank 1 has a wider embedding
        try:
            distributed.all_gather(torch.zeros(3, width), name="embeddings")
        except ValueError as err:
            result["error"] = str(err)
        objective = distributed.global_objective(pf.losses.contrastive)
        emb, y = torch.randn(4, 3), torch.arange(4)
        try:  # mined indices refer to local rows: refused
            objective(emb, y, indices_tuple=pf.miners.batch_hard(emb, y))
        except ValueError as err:
            result["indices_error"] = str(err)
        ring = distributed.global_objective(pf.losses.ntxent, exchange="ring")
        for key, kw in {
            "ref_emb": {"ref_emb": emb, "ref_labels": y},
            "regularizer": {"embedding_regularizer": pf.regularizers.lp},
            "distance": {"distance": pf.distances.lp()},
        }.items():
            try:
                ring(emb, y, **kw)
            except ValueError as err:
                result[f"ring_{key}_error"] = str(err)
    elif scenario == "memory":
        ddp = torch.nn.parallel.DistributedDataParallel(_encoder())
        memory = pf.wrappers.cross_batch_memory_init(MEMORY_SIZE, DIM_OUT, dtype=torch.float64)
        for step in range(MEMORY_STEPS):
            xs, ys = _memory_batch(step, sizes)
            r0 = sum(sizes[:rank])
            emb = ddp(xs[r0 : r0 + sizes[rank]])
            ddp.zero_grad()
            loss, memory = distributed.cross_batch_memory(
                pf.losses.contrastive, emb, ys[r0 : r0 + sizes[rank]], memory
            )
            loss.backward()
            result[step] = {
                "loss": loss.detach(),
                "grads": [p.grad.clone() for p in ddp.module.parameters()],
                "memory": {k: v.clone() for k, v in memory.items()},
            }
    elif scenario == "compiled":
        mine = torch.full((3, 2), float(rank), requires_grad=True)
        gather = torch.compile(distributed.all_gather, fullgraph=True)
        got = gather(mine)
        (got * torch.arange(6.0).unsqueeze(-1)).sum().backward()
        result["gathered"] = got.detach()
        result["grad"] = mine.grad
    elif scenario == "gather":
        mine = torch.full((sizes[rank], 2), float(rank), requires_grad=True)
        got = distributed.all_gather(mine)
        (got * torch.arange(got.shape[0], dtype=got.dtype).unsqueeze(-1)).sum().backward()
        result["gathered"] = got.detach()
        result["grad"] = mine.grad
    return result


def _spawn(scenario: str, sizes) -> list[dict]:
    return spawn_ranks(_scenario, scenario, list(sizes), world_size=WORLD)


@pytest.mark.parametrize("sizes", [(8, 8), (9, 6)], ids=["equal", "unequal"])
def test_global_objective_equals_single_process(sizes):
    results = _spawn("losses", sizes)
    for name, (_, has_params) in LOSSES.items():
        expected = _single_process(name, sizes)
        for rank, res in enumerate(results):
            # embedding losses split their anchors over the ranks; proxy losses run whole
            assert res[f"{name}.split"] is not has_params
            got = res[name]
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(
                    got[key], value, rtol=1e-10, atol=1e-12, msg=f"{name} {key} rank {rank}"
                )


@pytest.mark.parametrize("sizes", [(9, 6)])
def test_ring_and_gather_equal_single_process_under_ddp(sizes):
    """clip, siglip, ntxent and supcon, dense and tiled, with and without labels: the loss on
    every rank and the encoder's and the loss parameters' gradients after DDP's averaging equal
    one process on the whole batch, for both exchanges; and the ring makes no tensor with the
    global batch's rows (forward and backward; the gather, as a control, does)."""
    results = _spawn("ring", sizes)
    x, y = _data(sizes)
    for name, (loss_fn, form) in RING_CASES.items():
        enc, params = _encoder(), _pair_params()
        loss = _ring_case_loss(name, loss_fn, enc, x, y, params)
        loss.backward()
        expected = {f"enc.{k}": p.grad for k, p in enc.named_parameters()}
        if form != "self":
            expected.update({f"params.{k}": v.grad for k, v in params.items()})
        expected["loss"] = loss.detach()
        for rank, res in enumerate(results):
            for exchange in distributed.EXCHANGES:
                got = res[f"{name}.{exchange}"]
                assert got.keys() == expected.keys()
                for key, value in expected.items():
                    torch.testing.assert_close(
                        got[key], value, rtol=1e-9, atol=1e-12,
                        msg=f"{name} {exchange} {key} rank {rank}",
                    )  # fmt: skip
            assert res[f"{name}.ring.largest"] < sum(sizes), name
            assert res[f"{name}.gather.largest"] >= sum(sizes), name


def test_chunked_global_value_and_grad():
    sizes = (9, 6)
    results = _spawn("chunked", sizes)
    for name in ("ntxent", "contrastive", "triplet_margin"):
        expected = _single_process(name, sizes)
        for rank, res in enumerate(results):
            for key, value in expected.items():
                torch.testing.assert_close(
                    res[name][key], value, rtol=1e-10, atol=1e-12, msg=f"{name} {key} rank {rank}"
                )


def test_cross_batch_memory_identical_on_every_rank():
    sizes = (4, 3)
    results = _spawn("memory", sizes)
    enc = _encoder()
    memory = pf.wrappers.cross_batch_memory_init(MEMORY_SIZE, DIM_OUT, dtype=torch.float64)
    for step in range(MEMORY_STEPS):  # single process on the concatenated batches
        xs, ys = _memory_batch(step, sizes)
        enc.zero_grad()
        loss, memory = pf.wrappers.cross_batch_memory(pf.losses.contrastive, enc(xs), ys, memory)
        loss.backward()
        for rank, res in enumerate(results):
            got = res[step]
            torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
            for g, p in zip(got["grads"], enc.parameters(), strict=True):
                torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
            for key, value in memory.items():
                torch.testing.assert_close(got["memory"][key], value, msg=f"{key} rank {rank}")
    assert int(memory["count"]) == MEMORY_SIZE  # the ring wrapped around


def test_all_gather_order_and_gradient():
    sizes = (3, 2)
    results = _spawn("gather", sizes)
    expected = torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2] * 2)
    coef = torch.arange(5.0)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["gathered"], expected)
        # Each rank's loss weighs row i by i; both ranks' losses reach rank r's rows: 2·i.
        rows = coef[:3] if rank == 0 else coef[3:]
        torch.testing.assert_close(res["grad"], (WORLD * rows).unsqueeze(-1).expand(-1, 2))


def test_all_gather_under_compile():
    results = _spawn("compiled", (3, 3))
    expected = torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2] * 3)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["gathered"], expected)
        rows = torch.arange(6.0)[3 * rank : 3 * rank + 3]
        torch.testing.assert_close(res["grad"], (WORLD * rows).unsqueeze(-1).expand(-1, 2))


def test_mismatched_width_is_an_error_on_every_rank():
    results = _spawn("mismatch", (3, 3))
    for res in results:
        assert "embeddings differs" in res["error"] and "(*, 6)" in res["error"]
        assert "(*, 7)" in res["error"] and "same dtype, device type, shape" in res["error"]
        assert "indices_tuple" in res["indices_error"]
        assert "ref_emb is not supported" in res["ring_ref_emb_error"]
        assert "embedding_regularizer" in res["ring_regularizer_error"]
        assert "distance=cosine() or dot()" in res["ring_distance_error"]
        assert "global_objective(ntxent, exchange='ring')" in res["ring_distance_error"]


def test_outside_a_process_group_is_the_plain_loss():
    assert not distributed.is_active()
    assert distributed.world_size() == 1
    x, y = _data((10,))
    emb = _encoder()(x)
    torch.testing.assert_close(
        distributed.global_objective(pf.losses.ntxent)(emb, y), pf.losses.ntxent(emb, y)
    )
    assert distributed.all_gather(emb) is emb
    v, g = distributed.value_and_grad(pf.losses.ntxent, chunk_size=4)(emb.detach(), y)
    v2, g2 = pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size=4)(emb.detach(), y)
    torch.testing.assert_close(v, v2)
    torch.testing.assert_close(g, g2)


def test_bad_input():
    with pytest.raises(TypeError, match="x must be a tensor"):
        distributed.all_gather([1, 2])
    with pytest.raises(ValueError, match="batch dimension"):
        distributed.all_gather(torch.tensor(1.0))
    with pytest.raises(ValueError, match="exchange must be one of"):
        distributed.global_objective(pf.losses.ntxent, exchange="allreduce")
    with pytest.raises(
        ValueError,
        match=r"runs clip, multiple_negatives_ranking, ntxent, siglip, supcon .*got contrastive",
    ):
        distributed.global_objective(pf.losses.contrastive, exchange="ring")


def test_ring_outside_a_process_group_is_the_plain_loss():
    a, b = _data((8,))[0], _data((8,))[0].flip(-1)
    params = _pair_params()
    ring = distributed.global_objective(
        functools.partial(pf.losses.clip, chunk_size=3), exchange="ring"
    )
    torch.testing.assert_close(ring(a, b, params), pf.losses.clip(a, b, params))


def _torchrun(*args: str, timeout: int = 300) -> str:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run(
        [*cmd, *args], cwd=root, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_ddp_example_under_torchrun():
    out = _torchrun("examples/ddp.py", "--epochs", "2")
    assert "2 rank(s), supcon, exchange=gather; DDP gradient vs single-process gradient" in out
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2, out


def test_ddp_example_with_the_ring():
    out = _torchrun("examples/ddp.py", "--epochs", "1", "--loss", "clip", "--exchange", "ring")
    assert "2 rank(s), clip, exchange=ring; DDP gradient vs single-process gradient" in out
    assert len([line for line in out.splitlines() if line.startswith("epoch ")]) == 1, out


def test_ring_benchmark_memory_is_flat_in_the_world_size(tmp_path):
    """benchmarks/ring.py at a small size: per-rank peak memory of the ring the same on 2 and 4
    ranks (the gather's grows), and both exchanges give the same loss."""
    from benchmarks import ring

    rows = ring.main([
        "--world-sizes", "2,4", "--batch-size", "48", "--dimensions", "8", "--repeats", "1",
        "--warmup", "0", "--losses", "clip,siglip,retrieval",
        "--markdown", str(tmp_path / "ring.md"),
    ])  # fmt: skip
    peak = {(r["loss"], r["exchange"], r["world_size"]): r["peak_mib"] for r in rows}
    for loss in ("clip", "siglip", "retrieval"):
        assert peak[loss, "ring", 4] <= 1.2 * peak[loss, "ring", 2], peak
        assert peak[loss, "gather", 4] >= 2.0 * peak[loss, "gather", 2], peak
        assert peak[loss, "ring", 2] < peak[loss, "gather", 2], peak
    table = (tmp_path / "ring.md").read_text()
    assert "| clip | 4 | 192 |" in table and "NO" not in table


def test_distributed_benchmark_under_torchrun(tmp_path):
    import json

    path = tmp_path / "gloo.json"
    _torchrun(  # through the runner's --case distributed, as the reference runner does
        "-m", "benchmarks.run", "--case", "distributed", "--batch-size", "16",
        "--dimensions", "8", "--repeats", "2", "--warmup", "1", "--output", str(path),
    )  # fmt: skip
    report = json.loads(path.read_text())
    assert report["world_size"] == 2 and report["global_batch_size"] == 32
    assert report["backend"] == "gloo"
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        for impl in ("pmlfunc", "pml"):
            assert len(rank[impl]["forward_ms"]) == 2
    # PML returns world_size × the global loss; pmlfunc the global loss itself
    assert abs(report["loss"]["pml"] / 2 - report["loss"]["pmlfunc"]) < 1e-4


def _func_grad_of_the_gather(sizes) -> torch.Tensor:
    """torch.func.grad through global_objective on this rank's rows, minus autograd's."""
    x, y = _data(sizes)
    rank = dist.get_rank()
    r0 = sum(sizes[:rank])
    mine, labels = x[r0 : r0 + sizes[rank], :DIM_OUT], y[r0 : r0 + sizes[rank]]
    objective = distributed.global_objective(LOSSES["ntxent"][0])
    by_func = torch.func.grad(lambda e: objective(e, labels))(mine)
    leaf = mine.clone().requires_grad_()
    objective(leaf, labels).backward()
    return by_func - leaf.grad


def test_torch_func_grad_through_the_gather_equals_autograd():
    for diff in spawn_ranks(_func_grad_of_the_gather, (5, 3), world_size=WORLD):
        assert diff.abs().max() == 0.0
