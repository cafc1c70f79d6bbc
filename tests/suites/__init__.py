"""Test suites shared by several loss families.

A suite is a class of tests for one loss; the loss's test class, in the test file of the
pmlfunc module that holds the loss, derives from the suite and names the loss (for example
``class TestContrastive(CoreLoss): name = "contrastive"`` in tests/test_pairs.py). Each suite
module holds the tables and runners its tests share (PML classes, hyper-parameters, distances).
"""
