"""pmlfunc: functional deep-metric-learning losses for PyTorch.

Losses, miners, distances and reducers are pure functions of tensors with static shapes and no host
synchronisation, so they compose with ``torch.func``, ``torch.compile(fullgraph=True)`` and
CUDA-graph capture, and they match pytorch-metric-learning 2.9.0's numbers.

    >>> import torch, pmlfunc as pf
    >>> emb, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> loss = pf.losses.ntxent(emb, labels, temperature=0.07)
"""

from . import (
    chunked,
    distances,
    distributed,
    evaluation,
    labels,
    losses,
    memory,
    miners,
    nn,
    params,
    queues,
    reducers,
    regularizers,
    samplers,
    testing,
    transforms,
    tuples,
    wrappers,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "chunked",
    "distances",
    "distributed",
    "evaluation",
    "labels",
    "losses",
    "memory",
    "miners",
    "nn",
    "params",
    "queues",
    "reducers",
    "regularizers",
    "samplers",
    "testing",
    "transforms",
    "tuples",
    "wrappers",
]
