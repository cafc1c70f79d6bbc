"""pmlfunc.wrappers: cross-batch memory as explicit state, at PML 2.9.0 parity."""

from __future__ import annotations

import functools

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

import pmlfunc as pf
from pmlfunc import wrappers

D, S, B = 8, 20, 6

LOSSES = {
    "contrastive": (pf.losses.contrastive, lambda: pml_losses.ContrastiveLoss()),
    "ntxent": (
        functools.partial(pf.losses.ntxent, temperature=0.1),
        lambda: pml_losses.NTXentLoss(temperature=0.1),
    ),
    "supcon": (
        functools.partial(pf.losses.supcon, temperature=0.1),
        lambda: pml_losses.SupConLoss(temperature=0.1),
    ),
    "multi_similarity": (pf.losses.multi_similarity, lambda: pml_losses.MultiSimilarityLoss()),
    "triplet_margin": (pf.losses.triplet_margin, lambda: pml_losses.TripletMarginLoss(0.2)),
    # these two read references outside the pairs (NCA's softmax, angular's negative term)
    "nca": (pf.losses.nca, lambda: pml_losses.NCALoss()),
    "angular": (pf.losses.angular, lambda: pml_losses.AngularLoss()),
}
MINERS = {
    None: (None, None),
    "pair_margin": (
        functools.partial(pf.miners.pair_margin, pos_margin=0.2, neg_margin=0.8),
        lambda: pml_miners.PairMarginMiner(0.2, 0.8),
    ),
    "multi_similarity": (pf.miners.multi_similarity, lambda: pml_miners.MultiSimilarityMiner()),
    "triplet_margin": (pf.miners.triplet_margin, lambda: pml_miners.TripletMarginMiner(0.2)),
}


@pytest.mark.parametrize("miner", list(MINERS), ids=str)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_matches_pml_cross_batch_memory_over_steps(loss, miner):
    ours, theirs = LOSSES[loss]
    our_miner, their_miner = MINERS[miner]
    pml = pml_losses.CrossBatchMemory(
        theirs(), D, memory_size=S, miner=None if their_miner is None else their_miner()
    ).double()
    memory = wrappers.cross_batch_memory_init(S, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    # From the first step: in eager mode on a CPU the loss and the miner read the filled slots
    # only (PML's slice). Passing the empty slots gave NCA and angular another loss, and
    # per-anchor miners other picks, for the 4 steps (of 6-row batches in 20 slots) before full.
    for step in range(8):  # 48 rows through 20 slots: the ring wraps twice
        emb = torch.randn(B, D, generator=gen, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, 4, (B,), generator=gen)
        want = pml(emb, labels)
        (g_want,) = torch.autograd.grad(want, emb)
        got, memory = wrappers.cross_batch_memory(ours, emb, labels, memory, miner=our_miner)
        (g_got,) = torch.autograd.grad(got, emb)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"step {step}")
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12, msg=f"step {step}")
    torch.testing.assert_close(memory["embeddings"], pml.embedding_memory)
    torch.testing.assert_close(memory["labels"], pml.label_memory)
    assert int(memory["index"]) == pml.queue_idx
    assert int(memory["count"]) == S


def test_enqueue_is_a_pure_ring_buffer():
    memory = wrappers.cross_batch_memory_init(5, 2)
    before = {k: v.clone() for k, v in memory.items()}
    emb, labels = torch.arange(6.0).view(3, 2), torch.tensor([7, 8, 9])
    new, slots = wrappers.enqueue(memory, emb, labels)
    for k, v in memory.items():  # the input state is untouched
        assert torch.equal(v, before[k])
    assert slots.tolist() == [0, 1, 2]
    new, slots = wrappers.enqueue(new, emb + 10, labels + 10)
    assert slots.tolist() == [3, 4, 0]  # wraps around
    assert new["labels"].tolist() == [19, 8, 9, 17, 18]
    assert int(new["index"]) == 1 and int(new["count"]) == 5


@pytest.mark.parametrize("count_read", [True, False], ids=["eager-cpu", "not-read"])
def test_unfilled_slots_and_own_slot_never_pair(count_read, monkeypatch):
    """In eager mode on a CPU the loss reads the filled slots only (PML's slice); where the
    count is not read (CUDA, compiled, torch.func) every slot, the unfilled ones in no pair."""
    if not count_read:
        monkeypatch.setattr(wrappers, "readable", lambda t: False)
    memory = wrappers.cross_batch_memory_init(10, 3, dtype=torch.float64)
    emb = torch.randn(2, 3, dtype=torch.float64)
    labels = torch.tensor([1, 1])
    seen = {}

    def spy(e, y, *, ref_emb, ref_labels, indices_tuple):
        seen["pairs"], seen["ref"] = indices_tuple, ref_emb
        return pf.losses.contrastive(
            e, y, ref_emb=ref_emb, ref_labels=ref_labels, indices_tuple=indices_tuple
        )

    wrappers.cross_batch_memory(spy, emb, labels, memory)
    pos, neg = seen["pairs"]
    assert seen["ref"].shape[0] == (2 if count_read else 10)
    # slots 0 and 1 hold the batch; each anchor pairs with the other's slot only; unfilled
    # slots (labels 0, different from 1) are not negatives
    assert pos.tolist()[0][:3] == [0.0, 1.0, 0.0][: pos.shape[1]]
    assert pos.tolist()[1][:3] == [1.0, 0.0, 0.0][: pos.shape[1]]
    assert pos.sum() == 2 and neg.sum() == 0


def test_a_memory_whose_filled_slots_do_not_start_at_zero_is_read_in_ring_order():
    """The filled slots are the ``count`` last written, up to ``index``: a memory whose count
    was reset (count 0, index 7) holds the next batch in slots 7, 8, 9, 0, and the loss reads
    those rows, whether the count is read (sliced) or not (masked)."""
    memory = {**wrappers.cross_batch_memory_init(10, 3, dtype=torch.float64)}
    memory["index"] = torch.tensor(7)
    emb = torch.randn(4, 3, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1])
    want = pf.losses.contrastive(emb, labels)
    got, new = wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, memory)
    assert int(new["count"]) == 4 and int(new["index"]) == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.compile
def test_compiled_step_equals_eager_and_asserts_on_a_corrupted_state():
    """The compiled step equals eager as the index moves; a corrupted count or index (the state
    read on no host: a ``torch._assert_async`` in the graph) fails in the same graph."""

    def step(emb, labels, memory):
        return wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, memory)

    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    m_eager = m_comp = wrappers.cross_batch_memory_init(S, D)
    for _ in range(4):  # the index moves: no recompilation is needed (it is a tensor)
        emb, labels = torch.randn(B, D, generator=gen), torch.randint(0, 4, (B,), generator=gen)
        l_eager, m_eager = step(emb, labels, m_eager)
        l_comp, m_comp = compiled(emb, labels, m_comp)
        torch.testing.assert_close(l_comp, l_eager, rtol=1e-5, atol=1e-6)
        for k in m_eager:
            torch.testing.assert_close(m_comp[k], m_eager[k])
    for key, value in (("count", -3), ("index", S + 20)):
        with pytest.raises(RuntimeError, match=rf"memory\['{key}'\].*out of range"):
            compiled(emb, labels, {**m_comp, key: torch.tensor(value)})


def test_meta_device():
    memory = wrappers.cross_batch_memory_init(S, D, device="meta")
    emb, labels = torch.randn(B, D, device="meta"), torch.zeros(B, dtype=torch.long, device="meta")
    loss, new = wrappers.cross_batch_memory(
        pf.losses.ntxent, emb, labels, memory, miner=pf.miners.multi_similarity
    )
    assert loss.device.type == "meta" and loss.shape == ()
    assert new["embeddings"].shape == (S, D)


def test_errors():
    memory = wrappers.cross_batch_memory_init(4, 3)
    emb, labels = torch.randn(2, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="larger than the memory"):
        wrappers.cross_batch_memory(
            pf.losses.contrastive, torch.randn(5, 3), torch.zeros(5, dtype=torch.long), memory
        )
    with pytest.raises(ValueError, match="size 3 but embeddings have size 4"):
        wrappers.cross_batch_memory(pf.losses.contrastive, torch.randn(2, 4), labels, memory)
    with pytest.raises(TypeError, match="cross_batch_memory_init"):
        wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, {"embeddings": emb})
    with pytest.raises(ValueError, match="supplies ref_emb"):
        wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, memory, ref_emb=emb)
    with pytest.raises(ValueError, match="labels has length"):
        wrappers.cross_batch_memory(pf.losses.contrastive, emb, torch.tensor([0]), memory)
    with pytest.raises(ValueError, match="memory_size must be an int >= 1"):
        wrappers.cross_batch_memory_init(0, 3)
    with pytest.raises(TypeError, match="miner must return"):
        wrappers.cross_batch_memory(
            pf.losses.contrastive, emb, labels, memory, miner=lambda *a, **k: (labels, labels)
        )


def _filled_memory(size: int = 32, dim: int = 16) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A memory after three steps of 8 rows, and a batch."""
    gen = torch.Generator().manual_seed(0)
    emb, labels = torch.randn(8, dim, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    memory = wrappers.cross_batch_memory_init(size, dim)
    for _ in range(3):
        _, memory = wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, memory)
    return memory, emb, labels


@pytest.mark.parametrize(
    ("key", "value"),
    [("count", -3), ("count", 33), ("index", 40), ("index", 32), ("index", -1)],
)
def test_a_count_or_index_out_of_range_raises_a_value_error_naming_it(key, value):
    """A corrupted state was used silently (count −3, index 40 on 32 slots: losses 1.533 and
    1.0 against 1.4926); in eager mode on CPU it is read and refused, in enqueue too."""
    memory, emb, labels = _filled_memory()
    bad = {**memory, key: torch.tensor(value)}
    high = 33 if key == "count" else 32
    message = (
        rf"memory\['{key}'\] = {value} is out of range for a memory of 32 slots "
        rf"\(valid: 0 <= value < {high}\)"
    )
    with pytest.raises(ValueError, match=message):
        wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, bad)
    with pytest.raises(ValueError, match=message):
        wrappers.enqueue(bad, emb, labels)
    for edge in (0, high - 1):  # the ends of the valid range are accepted
        wrappers.cross_batch_memory(
            pf.losses.contrastive, emb, labels, {**memory, key: torch.tensor(edge)}
        )


@pytest.mark.parametrize("key", ["embeddings", "labels", "index", "count"])
def test_a_memory_tensor_on_another_device_raises_naming_it(key):
    """Memory labels on another device raised index_copy's raw RuntimeError."""
    memory, emb, labels = _filled_memory()
    moved = {**memory, key: memory[key].to("meta")}
    match = rf"memory\['{key}'\] is on meta, expected cpu"
    with pytest.raises(ValueError, match=match):
        wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, moved)


def test_a_memory_tensor_of_the_wrong_dtype_or_shape_raises_naming_it():
    memory, emb, labels = _filled_memory()
    cases = [
        ("labels", memory["labels"].int(), TypeError, r"memory\['labels'\] must be int64, got torch.int32"),
        ("count", memory["count"].float(), TypeError, r"memory\['count'\] must be int64"),
        ("index", memory["index"].view(1), ValueError, r"memory\['index'\] has shape \(1,\), expected \(\)"),
        ("labels", memory["labels"][:-1], ValueError, r"memory\['labels'\] has shape \(31,\), expected \(32,\)"),
        ("embeddings", memory["embeddings"].long(), TypeError, r"memory\['embeddings'\] must be floating-point"),
        ("count", 3, TypeError, r"memory\['count'\] must be a tensor, got int"),
    ]  # fmt: skip
    for key, value, error, match in cases:
        with pytest.raises(error, match=match):
            wrappers.cross_batch_memory(pf.losses.contrastive, emb, labels, {**memory, key: value})


def test_a_corrupted_state_inside_a_transform_or_on_meta_is_not_read():
    """Inside ``torch.func`` transforms (``torch._assert_async`` has no batching rule: under
    ``vmap`` it raises "Batching rule not implemented") and on ``meta`` (no values) the value
    checks are skipped, as for index tuples; shapes, dtypes and devices are still checked."""
    memory, emb, labels = _filled_memory()

    def loss(e, m):
        return wrappers.cross_batch_memory(pf.losses.contrastive, e, labels, m)[0]

    grad = torch.func.grad(loss)(emb, {**memory, "count": torch.tensor(-3)})
    assert grad.shape == emb.shape  # not read: no error
    meta = {k: v.to("meta") for k, v in memory.items()}
    meta["index"] = torch.tensor(40, device="meta")
    out, _ = wrappers.cross_batch_memory(
        pf.losses.contrastive, emb.to("meta"), labels.to("meta"), meta
    )
    assert out.device.type == "meta"
    with pytest.raises(ValueError, match=r"memory\['labels'\] is on meta, expected cpu"):
        torch.func.grad(loss)(emb, {**memory, "labels": memory["labels"].to("meta")})


_CUDA_ASSERT = """
import torch, pmlfunc as pf
W = pf.wrappers
emb = torch.randn(8, 16, device="cuda"); labels = torch.randint(0, 4, (8,), device="cuda")
memory = W.cross_batch_memory_init(32, 16, device="cuda")
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # the checks read nothing on the host
loss, memory = W.cross_batch_memory(pf.losses.contrastive, emb, labels, memory)
torch.cuda.set_sync_debug_mode("default")
print("clean", float(loss), flush=True)
loss, _ = W.cross_batch_memory(
    pf.losses.contrastive, emb, labels, {**memory, "count": torch.tensor(-3, device="cuda")}
)
torch.cuda.synchronize()
print("not fired", flush=True)
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_state_is_checked_by_a_device_assert_without_a_host_sync():
    """A clean step runs under ``set_sync_debug_mode("error")``; a count of −3 fires the
    device-side assert at the next synchronisation. In a child process: a fired device assert
    leaves the CUDA context unusable."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CUDA_ASSERT], capture_output=True, text=True, timeout=300
    )
    assert "clean" in done.stdout, done.stderr
    assert done.returncode != 0 and "not fired" not in done.stdout, done.stdout
    assert "device-side assert" in done.stderr or "memory['count']" in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------------
# self_supervised and multiple_losses
# ---------------------------------------------------------------------------------------------

SELF_SUPERVISED = {
    "ntxent": (
        functools.partial(pf.losses.ntxent, temperature=0.1),
        lambda: pml_losses.NTXentLoss(temperature=0.1),
    ),
    "triplet_margin": (pf.losses.triplet_margin, lambda: pml_losses.TripletMarginLoss(0.2)),
    "contrastive": (pf.losses.contrastive, lambda: pml_losses.ContrastiveLoss()),
    "supcon": (pf.losses.supcon, lambda: pml_losses.SupConLoss()),
}


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("loss", list(SELF_SUPERVISED))
def test_self_supervised_matches_pml(loss, symmetric):
    ours, theirs = SELF_SUPERVISED[loss]
    gen = torch.Generator().manual_seed(3)
    v1 = torch.randn(B, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v2 = torch.randn(B, D, generator=gen, dtype=torch.float64, requires_grad=True)
    got = wrappers.self_supervised(ours, v1, v2, symmetric=symmetric)
    want = pml_losses.SelfSupervisedLoss(theirs(), symmetric=symmetric)(v1, v2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(got, (v1, v2)), torch.autograd.grad(want, (v1, v2)), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_self_supervised_three_views_equals_explicit_labels():
    gen = torch.Generator().manual_seed(4)
    views = [torch.randn(B, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    labels = torch.arange(B)
    got = wrappers.self_supervised(pf.losses.supcon, *views)
    want = pf.losses.supcon(torch.cat(views), labels.repeat(3))
    torch.testing.assert_close(got, want)
    got = wrappers.self_supervised(pf.losses.supcon, *views, symmetric=False)
    want = pf.losses.supcon(
        views[0], labels, ref_emb=torch.cat(views[1:]), ref_labels=labels.repeat(2)
    )
    torch.testing.assert_close(got, want)


def test_multiple_losses_matches_pml_dict_and_list():
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(12, D, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.arange(12) // 3
    ours = wrappers.multiple_losses(
        {"tri": pf.losses.triplet_margin, "con": pf.losses.contrastive},
        miners={"tri": pf.miners.batch_hard},
        weights={"tri": 1.0, "con": 0.5},
    )
    theirs = pml_losses.MultipleLosses(
        {"tri": pml_losses.TripletMarginLoss(0.2), "con": pml_losses.ContrastiveLoss()},
        miners={"tri": pml_miners.BatchHardMiner()},
        weights={"tri": 1.0, "con": 0.5},
    )
    got, want = ours(emb, labels), theirs(emb, labels)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(got, emb)[0], torch.autograd.grad(want, emb)[0], rtol=1e-10, atol=1e-12
    )
    as_list = wrappers.multiple_losses(
        [pf.losses.triplet_margin, pf.losses.contrastive],
        miners=[pf.miners.batch_hard, None],
        weights=[1.0, 0.5],
    )
    torch.testing.assert_close(as_list(emb, labels), got)


def test_wrapper_errors():
    emb = torch.randn(4, D)
    with pytest.raises(ValueError, match="at least two views"):
        wrappers.self_supervised(pf.losses.ntxent, emb)
    with pytest.raises(ValueError, match=r"views\[0\] has 3 rows"):
        wrappers.self_supervised(pf.losses.ntxent, emb, torch.randn(3, D))
    with pytest.raises(ValueError, match="keys must match"):
        wrappers.multiple_losses({"a": pf.losses.ntxent}, weights={"b": 1.0})
    with pytest.raises(ValueError, match="same length"):
        wrappers.multiple_losses([pf.losses.ntxent], weights=[1.0, 2.0])
    fn = wrappers.multiple_losses([pf.losses.triplet_margin], miners=[pf.miners.batch_hard])
    labels = torch.arange(4) // 2
    with pytest.raises(ValueError, match="indices_tuple cannot be given"):
        fn(emb, labels, indices_tuple=pf.miners.batch_hard(emb, labels))
