"""PML 2.9.0's ``pytorch_metric_learning.utils`` as far as pmlfunc provides it: the
``AccuracyCalculator`` (:mod:`.accuracy_calculator`, over :mod:`pmlfunc.evaluation`).

Not provided: PML's ``common_functions``, ``loss_and_miner_utils``, ``inference``
(``InferenceModel``, ``MatchFinder``, ``FaissKNN``, ``CustomKNN``; pmlfunc's search is
:func:`pmlfunc.evaluation.knn`), ``distributed``, ``logging_presets``, ``loss_tracker`` and
``module_with_records``.

Example:
    >>> from pmlfunc.compat.pml.utils import AccuracyCalculator
    >>> AccuracyCalculator(exclude=("AMI", "NMI")).get_curr_metrics()
    ['mean_average_precision', 'mean_average_precision_at_r', 'mean_reciprocal_rank', 'precision_at_1', 'r_precision']
"""

from . import accuracy_calculator
from .accuracy_calculator import AccuracyCalculator

__all__ = ["AccuracyCalculator", "accuracy_calculator"]
