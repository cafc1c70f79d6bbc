"""PML 2.9.0's samplers (``pytorch_metric_learning.samplers``) over :mod:`pmlfunc.samplers`.

``MPerClassSampler(labels, m, batch_size=None, length_before_new_iter=100000)``,
``HierarchicalSampler(labels, batch_size, samples_per_class, batches_per_super_tuple=4,
super_classes_per_batch=2, inner_label=0, outer_label=1)`` and ``FixedSetOfTriplets(labels,
num_triplets)`` are pmlfunc's classes themselves: PML's positional order and defaults, plus a
keyword-only ``generator=``. ``TuplesToWeightsSampler(model, miner, dataset, subset_size=None,
**tester_kwargs)`` is PML's constructor over pmlfunc's (which takes a ``mine(indices)``
callable): each ``iter()`` embeds the dataset (or a random subset of ``subset_size``) with
``model`` as PML's ``BaseTester.get_all_embeddings`` does (``model.eval()``, no gradient, a
``DataLoader`` of ``batch_size`` without shuffling, ``normalize_embeddings``), mines it with
``miner`` (a compat miner, a pmlfunc miner function or PML's miner) and draws from the weights
(``self.weights``, PML's).

Differs from PML: PML draws from NumPy's global generator (``np.random``) and, for
``TuplesToWeightsSampler``, torch's global one; these draw from a ``torch.Generator``
(``generator=None``: one seeded once from torch's global generator, so ``torch.manual_seed``
makes them repeatable), so the index sequences are of PML's kind (the same structure, lengths
and distributions; ``tests/test_samplers.py``) but not PML's numbers. Invalid arguments raise
``ValueError``/``TypeError`` naming them where PML asserts. ``MPerClassSampler`` with
``batch_size=None`` and ``m · num_classes > length_before_new_iter`` yields exactly ``len()``
indices (PML yields a whole pass, longer than its ``len()``). ``FixedSetOfTriplets`` keeps its
triplets as the ``(num_triplets, 3)`` tensor ``triplets`` (PML: the NumPy array
``fixed_set_of_triplets``, shuffled in place at each ``iter()``).

Not provided: ``TuplesToWeightsSampler``'s tester arguments that change the embeddings beyond
those above (``pca``; ``ValueError``); the tester's evaluation-only arguments
(``accuracy_calculator``, ``visualizer``, ``visualizer_hook``, ``end_of_testing_hook``,
``label_hierarchy_level``, ``dataset_labels``, ``set_min_label_to_zero``, ``use_trunk_output``)
are accepted and have no effect here, as they have none on PML's sampler.

Example:
    >>> from pmlfunc.compat.pml import miners, samplers
    >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> s = samplers.MPerClassSampler(labels, 2, 4, 8)  # PML's positional order
    >>> len(s), len(list(s))
    (8, 8)
    >>> data = torch.utils.data.TensorDataset(torch.randn(8, 3), labels)
    >>> t = samplers.TuplesToWeightsSampler(torch.nn.Linear(3, 2), miners.MultiSimilarityMiner(),
    ...                                     data, dataloader_num_workers=0, data_device="cpu")
    >>> len(list(t)), t.weights.shape
    (8, torch.Size([8]))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ... import samplers as _s
from ...samplers import FixedSetOfTriplets, HierarchicalSampler, MPerClassSampler

__all__ = [
    "FixedSetOfTriplets",
    "HierarchicalSampler",
    "MPerClassSampler",
    "TuplesToWeightsSampler",
]

# BaseTester's arguments that do not change the embeddings a sampler mines
_IGNORED = (
    "accuracy_calculator",
    "dataset_labels",
    "end_of_testing_hook",
    "label_hierarchy_level",
    "set_min_label_to_zero",
    "use_trunk_output",
    "visualizer",
    "visualizer_hook",
)


class TuplesToWeightsSampler(_s.TuplesToWeightsSampler):
    """PML's ``TuplesToWeightsSampler(model, miner, dataset, subset_size=None,
    **tester_kwargs)`` (module docstring); ``generator=`` keyword-only."""

    def __init__(
        self,
        model: nn.Module,
        miner: Any,
        dataset: Any,
        subset_size: int | None = None,
        *,
        generator: torch.Generator | None = None,
        normalize_embeddings: bool = True,
        batch_size: int = 32,
        dataloader_num_workers: int = 2,
        data_device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        data_and_label_getter: Any = None,
        pca: int | None = None,
        **tester_kwargs: Any,
    ) -> None:
        unknown = sorted(set(tester_kwargs) - set(_IGNORED))
        if unknown:
            raise TypeError(f"TuplesToWeightsSampler got unexpected keyword arguments {unknown}")
        if pca:
            raise ValueError("TuplesToWeightsSampler(pca=...) is not provided")
        if not callable(miner):
            raise TypeError(f"miner must be a miner (callable), got {type(miner).__name__}")
        self.model, self.miner, self.dataset = model, miner, dataset
        self.normalize_embeddings = normalize_embeddings
        self.batch_size, self.dataloader_num_workers = int(batch_size), dataloader_num_workers
        if data_device is None:
            data_device = "cuda" if torch.cuda.is_available() else "cpu"
        self.data_device = torch.device(data_device)
        self.dtype = dtype
        self.data_and_label_getter = data_and_label_getter or (lambda batch: batch)
        super().__init__(self._mine, len(dataset), subset_size, generator=generator)

    def embeddings(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """The embeddings and labels of ``dataset[indices]`` (PML's ``get_all_embeddings``)."""
        subset = torch.utils.data.Subset(self.dataset, indices.tolist())
        loader = torch.utils.data.DataLoader(
            subset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.dataloader_num_workers,
        )
        self.model.eval()
        embeddings, labels = [], []
        with torch.no_grad():
            for batch in loader:
                inputs, label = self.data_and_label_getter(batch)
                inputs = inputs.to(self.data_device, self.dtype)
                embeddings.append(self.model(inputs))
                labels.append(torch.as_tensor(label).to(self.data_device).reshape(len(inputs), -1))
        emb = torch.cat(embeddings)
        if self.normalize_embeddings:
            emb = torch.nn.functional.normalize(emb)
        return emb, torch.cat(labels).squeeze(1)

    def _mine(self, indices: Tensor) -> Any:
        return self.miner(*self.embeddings(indices))
