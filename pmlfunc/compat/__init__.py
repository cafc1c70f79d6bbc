"""Compatibility layers: other libraries' class-based APIs as thin modules over pmlfunc's pure
functions.

:mod:`pmlfunc.compat.pml` is pytorch-metric-learning 2.9.0's: change the import, keep the code
(``from pmlfunc.compat.pml import losses, miners, distances, reducers``).

Example:
    >>> from pmlfunc.compat.pml import losses
    >>> loss_func = losses.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)
    >>> loss = loss_func(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
"""
