"""Embedding losses as pure functions: ``loss(embeddings, labels, *, ...) -> 0-d tensor``.

One module per family; every loss is re-exported here by its PML name in snake_case.
"""

from .pairs import contrastive, multi_similarity
from .softmax import ntxent, supcon
from .triplets import triplet_margin

__all__ = ["contrastive", "multi_similarity", "ntxent", "supcon", "triplet_margin"]
