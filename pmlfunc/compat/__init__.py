"""Compatibility layers: other libraries' class-based APIs as thin modules over pmlfunc's pure
functions.

:mod:`pmlfunc.compat.pml` is pytorch-metric-learning 2.9.0's: change the import, keep the code
(``from pmlfunc.compat.pml import losses, miners, distances, reducers``).
"""
