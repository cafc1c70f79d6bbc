"""Quick start: the core losses and miners as pure functions, with torch.func and torch.compile.

Run: python examples/quickstart.py
"""

import torch

import pmlfunc as pf

torch.manual_seed(0)
emb = torch.randn(64, 32, requires_grad=True)  # a batch of 64 embeddings
labels = torch.arange(64) // 4  # 16 classes, 4 samples each

# 1. Losses are functions of (embeddings, labels); hyper-parameters are keyword-only.
losses = {
    "contrastive": pf.losses.contrastive(emb, labels, pos_margin=0.0, neg_margin=1.4),
    "triplet_margin (all triplets)": pf.losses.triplet_margin(emb, labels, margin=0.2),
    "ntxent": pf.losses.ntxent(emb, labels, temperature=0.07),
    "supcon": pf.losses.supcon(emb, labels, temperature=0.1),
    "multi_similarity": pf.losses.multi_similarity(emb, labels),
}
for name, value in losses.items():
    print(f"{name:32s} {value.item():.4f}")

# 2. Distances and reducers are small immutable objects.
loss = pf.losses.contrastive(
    emb, labels, distance=pf.distances.cosine(), reducer=pf.reducers.mean()
)
print(f"{'contrastive (cosine, mean)':32s} {loss.item():.4f}")

# 3. One distance matrix shared by several losses.
mat = pf.distances.cosine()(emb)
both = pf.losses.ntxent(emb, labels, mat=mat) + pf.losses.multi_similarity(emb, labels, mat=mat)
print(f"{'ntxent + multi_similarity (mat)':32s} {both.item():.4f}")

# 4. A separate reference set (e.g. a memory queue): nothing is excluded.
queue, queue_labels = torch.randn(128, 32), torch.randint(0, 16, (128,))
print(
    f"{'supcon vs a queue':32s} {pf.losses.supcon(emb, labels, ref_emb=queue, ref_labels=queue_labels).item():.4f}"
)

# 5. torch.func composes: gradients and a vmap over independent problems.
grad = torch.func.grad(pf.losses.ntxent)(emb.detach(), labels)
print(f"{'|grad ntxent|':32s} {grad.norm().item():.4f}")
stack = torch.randn(3, 64, 32)
per_problem = torch.func.vmap(pf.losses.ntxent, in_dims=(0, None))(stack, labels)
print(f"{'vmap ntxent over 3 problems':32s} {[round(v, 4) for v in per_problem.tolist()]}")

# 6. A learnable temperature is just a 0-d tensor.
temperature = torch.tensor(0.07, requires_grad=True)
pf.losses.ntxent(emb, labels, temperature=temperature).backward()
print(f"{'d loss / d temperature':32s} {temperature.grad.item():.4f}")

# 7. Miners return fixed-shape results (no host sync) that every loss takes as indices_tuple.
hard = pf.miners.batch_hard(emb, labels)
loss = pf.losses.triplet_margin(emb, labels, margin=0.2, indices_tuple=hard)
print(f"{'triplet_margin on batch_hard':32s} {loss.item():.4f}")
pairs = pf.miners.pair_margin(emb, labels, pos_margin=0.2, neg_margin=1.4)
loss = pf.losses.triplet_margin(emb, labels, margin=0.2, indices_tuple=pairs)
print(f"{'triplet_margin on pair_margin':32s} {loss.item():.4f}")
mined = pf.miners.triplet_margin(  # at most 8 random triplets per anchor
    emb, labels, margin=0.2, tuples_per_anchor=8, generator=torch.Generator().manual_seed(0)
)
loss = pf.losses.triplet_margin(emb, labels, margin=0.2, indices_tuple=mined)
print(f"{'triplet_margin, 8 per anchor':32s} {loss.item():.4f} ({int(mined.valid.sum())} triplets)")
