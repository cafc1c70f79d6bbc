"""pmlfunc.distributed: two gloo processes spawned by the test itself (not under torchrun).

Each scenario trains one step of a linear encoder under DDP on its rank's slice of a global
batch and saves the parameter gradients; the test compares them with single-process gradients of
the same loss on the whole batch (float64, tight tolerances).
"""

from __future__ import annotations

import functools
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pmlfunc as pf
from pmlfunc import distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

DIM_IN, DIM_OUT, CLASSES = 12, 6, 5
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _worker(rank: int, port: int, scenario: str, sizes, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result: dict = {}
    try:
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
    except Exception:  # report, never hang the other rank's test
        result["traceback"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Both ranks finish their collectives before the group goes; then leave without the
        # interpreter's teardown, where gloo's worker threads have aborted ("terminate called
        # without an active exception") on a loaded 2-core machine. Results are already saved,
        # and any failure of the work itself is in them (the traceback above).
        try:
            dist.barrier()
            dist.destroy_process_group()
        finally:
            os._exit(0)


def _spawn(scenario: str, sizes, tmp_path) -> list[dict]:
    mp.spawn(
        _worker, args=(_free_port(), scenario, list(sizes), str(tmp_path)), nprocs=WORLD, join=True
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "traceback" not in res, f"rank {r} failed:\n{res['traceback']}"
    return results


@pytest.mark.parametrize("sizes", [(8, 8), (9, 6)], ids=["equal", "unequal"])
def test_global_objective_equals_single_process(sizes, tmp_path):
    results = _spawn("losses", sizes, tmp_path)
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


def test_chunked_global_value_and_grad(tmp_path):
    sizes = (9, 6)
    results = _spawn("chunked", sizes, tmp_path)
    for name in ("ntxent", "contrastive", "triplet_margin"):
        expected = _single_process(name, sizes)
        for rank, res in enumerate(results):
            for key, value in expected.items():
                torch.testing.assert_close(
                    res[name][key], value, rtol=1e-10, atol=1e-12, msg=f"{name} {key} rank {rank}"
                )


def test_cross_batch_memory_identical_on_every_rank(tmp_path):
    sizes = (4, 3)
    results = _spawn("memory", sizes, tmp_path)
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


def test_all_gather_order_and_gradient(tmp_path):
    sizes = (3, 2)
    results = _spawn("gather", sizes, tmp_path)
    expected = torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2] * 2)
    coef = torch.arange(5.0)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["gathered"], expected)
        # Each rank's loss weighs row i by i; both ranks' losses reach rank r's rows: 2·i.
        rows = coef[:3] if rank == 0 else coef[3:]
        torch.testing.assert_close(res["grad"], (WORLD * rows).unsqueeze(-1).expand(-1, 2))


def test_all_gather_under_compile(tmp_path):
    results = _spawn("compiled", (3, 3), tmp_path)
    expected = torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2] * 3)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["gathered"], expected)
        rows = torch.arange(6.0)[3 * rank : 3 * rank + 3]
        torch.testing.assert_close(res["grad"], (WORLD * rows).unsqueeze(-1).expand(-1, 2))


def test_mismatched_width_is_an_error_on_every_rank(tmp_path):
    results = _spawn("mismatch", (3, 3), tmp_path)
    for res in results:
        assert "embeddings" in res["error"] and "same shape" in res["error"]
        assert "indices_tuple" in res["indices_error"]


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
    assert "2 rank(s); DDP gradient vs single-process gradient" in out
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2, out


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
