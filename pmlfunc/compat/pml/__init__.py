"""pytorch-metric-learning 2.9.0's classes as thin ``nn.Module``\\ s over pmlfunc's pure
functions: switch by changing the import.

.. code-block:: python

    # from pytorch_metric_learning import distances, losses, miners, reducers
    from pmlfunc.compat.pml import distances, losses, miners, reducers

    loss_func = losses.TripletMarginLoss(margin=0.2, distance=distances.CosineSimilarity(),
                                         reducer=reducers.ThresholdReducer(low=0))
    miner = miners.MultiSimilarityMiner()
    loss = loss_func(embeddings, labels, miner(embeddings, labels))

Every class has PML's name, constructor arguments (positional order included) and 2.9.0
defaults, and calls the function of the same name in snake case with no math of its own (the
data is in each module: ``losses``, ``miners``, ``distances``, ``reducers``,
``regularizers``); the values and gradients are PML's (``tests/test_compat_pml.py`` compares
every class with PML's on the same inputs). Where pmlfunc deliberately differs from PML 2.9.0
(``docs/losses.md``, the deliberate differences), the compat class gives pmlfunc's number.
``wrappers`` has ``CrossBatchMemory`` and ``MultipleLosses`` (also under ``losses``, as in PML)
over :mod:`pmlfunc.wrappers`; ``samplers`` PML's samplers (:mod:`pmlfunc.samplers`, drawing
from torch's generators instead of NumPy's); ``utils.accuracy_calculator`` PML's
``AccuracyCalculator`` over :mod:`pmlfunc.evaluation` (``tests/test_compat_pml_wrappers.py``).

Not provided: PML's trainers, testers, hooks, ``InferenceModel``, ``BatchedDistance``,
``MultipleReducers`` with a different reducer per sub-loss, ``PerAnchorReducer``'s
``aggregation_func``, ``TripletMarginLoss``/``MarginLoss`` ``triplets_per_anchor`` other than
``"all"`` (use a miner's ``tuples_per_anchor``), calling a reducer on a loss dictionary,
``CrossBatchMemory``'s ``enqueue_mask`` and added ``indices_tuple``, ``AccuracyCalculator``
metrics added by a subclass, ``utils`` other than ``accuracy_calculator`` and the recordable
statistics (``collect_stats``).

Example:
    >>> from pmlfunc.compat.pml import distances, losses, miners
    >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> loss_func = losses.TripletMarginLoss(margin=0.2, distance=distances.CosineSimilarity())
    >>> loss = loss_func(emb, labels, miners.MultiSimilarityMiner()(emb, labels))
"""

from . import distances, losses, miners, reducers, regularizers, samplers, utils, wrappers

__all__ = [
    "distances",
    "losses",
    "miners",
    "reducers",
    "regularizers",
    "samplers",
    "utils",
    "wrappers",
]
