"""Repository-wide pytest set-up: the whole suite on every core (pytest-xdist), benchmark bodies
run untimed unless timing is asked for, and the `slow` mark that `python -m pytest -m "not slow"`
(the quick subset) leaves out."""

from __future__ import annotations

import functools
import inspect
import os
import re
from fnmatch import fnmatchcase

import pytest

# the pytest-benchmark options that ask for timed runs
_TIMED = (
    "benchmark_only",
    "benchmark_enable",
    "benchmark_json",
    "benchmark_save",
    "benchmark_autosave",
)


# --- the whole suite on every core: ``python -m pytest`` -----------------------------------------
#
# A run of the whole suite (no test paths named, ``-m`` and ``-k`` allowed) spreads its tests over
# one pytest-xdist worker per core (at most MAX_WORKERS; work stealing: a worker that runs out
# takes tests from another's queue), each worker with its share of the cores' threads. A run
# that names files or tests, collects only, times benchmarks (pytest-benchmark disables itself
# under xdist) or says ``-n`` itself runs as told: in this process unless ``-n`` says otherwise
# (``-n 0``: never in workers; ``-p no:xdist``: without the plugin).
MAX_WORKERS = 8


def _whole_suite_workers(config: pytest.Config) -> int:
    """How many xdist workers a plain run gets: 0 (in this process) unless it runs the whole
    suite, untimed, and more than one core is there."""
    option = config.option
    if hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ:
        return 0  # an xdist worker: it runs the tests it is sent (this hook runs there too)
    if getattr(option, "numprocesses", 0) is not None:  # -n given, or no xdist plugin
        return 0
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return 0  # test paths or node ids were named (or pytest ran outside the root)
    if option.collectonly or option.usepdb or any(getattr(option, k, None) for k in _TIMED):
        return 0
    return min(_cores(), MAX_WORKERS)


def _cores() -> int:
    """The cores this process may run on (``os.cpu_count()`` where affinity is not exposed,
    as on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Sets ``-n`` and ``--dist worksteal`` for a run of the whole suite
    (:func:`_whole_suite_workers`), before xdist reads them."""
    workers = _whole_suite_workers(config)
    if workers > 1:
        config.option.numprocesses = workers
        config.option.dist = "worksteal"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A plain ``pytest`` runs every benchmark body once, untimed (its parity check), and
    ``pytest --benchmark-only`` (or ``--benchmark-enable``, ``--benchmark-json``, ...) times
    them, as pytest-benchmark documents. ``--benchmark-disable`` in ``addopts`` would do the
    first but make ``--benchmark-only`` an error ("Can't have both"), so the default is set
    here, before pytest-benchmark reads it."""
    option = config.option
    if hasattr(option, "benchmark_disable") and not any(getattr(option, k, None) for k in _TIMED):
        option.benchmark_disable = True
    _share_the_cores()


def _share_the_cores() -> None:
    """In an xdist worker, torch (and the processes the tests start) use the worker's share of
    the cores' threads, not all of them: two workers on two cores with two threads each wait on
    one another's threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    threads = str(max(1, _cores() // int(workers)))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    import torch

    torch.set_num_threads(int(threads))


# --- the quick subset: ``python -m pytest -m "not slow"`` ---------------------------------------
#
# Tests that take seconds each on a 2-core CPU carry the ``slow`` mark (CI runs them all): every
# test that compiles (the ``compile`` mark, or "compile" in its name: a cold inductor compile per
# test, 1-60 s), every test whose body spawns ranks (calls ``spawn_ranks(`` or
# ``check_distributed(``: gloo process groups forked from a fork server, 0.1-10 s), and the node
# ids below, each with why. Patterns are ``fnmatch`` patterns of node
# ids (``[[]`` is a literal ``[``: a parameter id's bracket); a test module may also mark its own
# tests ``@pytest.mark.slow``.
SLOW_TESTS: dict[str, str] = {
    # gloo process groups: ranks forked per test, and the torchrun examples (2-16 s a test)
    "tests/test_distributed.py::test_global_objective_*": "spawns gloo ranks",
    "tests/test_distributed.py::test_ring_and_gather_*": "spawns gloo ranks",
    "tests/test_distributed.py::test_chunked_global_value_and_grad": "spawns gloo ranks",
    "tests/test_distributed.py::test_cross_batch_memory_identical_on_every_rank": "spawns gloo ranks",
    "tests/test_distributed.py::test_all_gather_*": "spawns gloo ranks",
    "tests/test_distributed.py::test_torch_func_grad_*": "spawns gloo ranks",
    "tests/test_distributed.py::test_mismatched_width_*": "spawns gloo ranks",
    "tests/test_distributed.py::test_ddp_example_*": "torchrun, two ranks",
    "tests/test_distributed.py::test_*_benchmark_*": "torchrun / spawned ranks",
    "tests/test_distributed_faults.py::*": "spawns gloo ranks, waits for timeouts",
    "tests/test_testing.py::test_the_ring_*": "spawns four gloo ranks",
    "tests/test_testing.py::test_the_gather_*": "spawns gloo ranks",
    "tests/test_testing.py::test_a_*": "spawns gloo ranks",
    "tests/test_testing.py::test_an_*": "spawns gloo ranks",
    "tests/test_testing.py::test_spawn_ranks_*": "spawns processes",
    "tests/test_testing.py::test_parameter_gradients_*": "spawns gloo ranks",
    "tests/test_retrieval.py::test_the_gather_and_the_ring_*": "spawns gloo ranks",
    # the documentation site: one mkdocs build (~30 s) shared by the tests that read it
    "tests/test_docs.py::test_mkdocs_build_strict": "builds the docs site",
    "tests/test_docs.py::test_no_raw_latex_left_in_any_page": "reads the built site",
    "tests/test_docs.py::test_every_docstring_formula_is_mathml_on_the_losses_page": "built site",
    "tests/test_docs.py::test_inline_dollar_math_in_a_markdown_page_is_mathml": "built site",
    "tests/test_docs.py::test_docstring_examples_are_code_blocks_with_their_prompts": "built site",
    "tests/test_docs.py::test_parameter_tables_have_one_row_per_parameter_*": "built site",
    "tests/test_docs.py::test_a_returns_section_is_one_row_*": "built site",
    "tests/test_docs.py::test_the_shared_inputs_are_documented_once_*": "built site",
    "tests/test_docs.py::test_the_site_loads_nothing_from_the_network": "built site",
    # examples and tools run as scripts
    "tests/test_examples.py::test_clip_pairs_example_*": "trains two towers, 5-30 s",
    "tests/test_examples.py::test_self_supervised_example_*": "trains two views, ~23 s",
    "tests/test_examples.py::test_two_tower_retrieval_example_*": "trains two towers, 9-10 s",
    "tests/test_gradcache_example.py::test_gradcache_example_runs": "runs the example, ~10 s",
    "tests/test_gradcache_example.py::test_compare_helper_and_train_step": "~5 s",
    "tests/test_gpu_check.py::test_dry_run_runs_the_whole_plan_on_cpu": "~15 s of subprocesses",
    "tests/test_memory.py::test_rss_*": "a fresh Python process each, 3-7 s",
    # untimed benchmark bodies whose PML 2.9.0 step takes seconds (PNP: 43 s)
    # (without the PML member, the pmlfunc member computes PML's loss for its parity check)
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]pnp-*]": "PML's B x B x B PNP, ~14 s",
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]histogram-*]": "PML step, 3-6 s",
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]threshold_consistent_margin-pml]": "~4 s",
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]signal_to_noise_ratio_contrastive-pml]": (
        "PML step, ~4 s"
    ),
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]dynamic_soft_margin-pml]": "~3 s",
    "benchmarks/cases/bench_other_losses.py::bench_loss[[]margin-pml]": "PML step, ~2.5 s",
    "benchmarks/cases/bench_miners.py::bench_miner[[]triplet-miner-pml]": "PML miner, ~6 s",
    "benchmarks/cases/bench_miners.py::bench_miner[[]mined-triplet-pml]": "PML miner, ~3 s",
    "benchmarks/cases/bench_core_losses.py::bench_loss[[]all-triplet-pml]": "PML step, ~2 s",
    "benchmarks/cases/bench_chunked_ntxent.py::*": "memory in fresh processes, 2-10 s",
    "tests/test_docstrings.py::test_docstring_examples_run[[]pmlfunc.testing]": "spawns ranks",
    "tests/test_doc_blocks.py::*compile-and-cuda-graphs.md*": "compiles a step",
    "tests/test_benchmark_tools.py::test_pytest_benchmark_options_work_as_typed*": (
        "a pytest subprocess each, 4-5 s"
    ),
    # single tests of several seconds
    "tests/test_miners.py::test_bounded_pairs_are_uniform_and_reproducible": "~10 s",
    "tests/test_miners.py::test_distance_weighted_negative_distribution*": "3-5 s each",
    "tests/test_conformance.py::test_gradcheck[[]soft_triple]": "float64 gradcheck, ~4 s",
    "tests/test_conformance.py::test_gradcheck[[]dynamic_arcface]": "float64 gradcheck, ~4 s",
    "tests/test_conformance.py::test_gradcheck[[]subcenter_arcface]": "float64 gradcheck, ~3 s",
    "tests/test_margin_softmax.py::test_gradcheck_on_every_branch[[]large_margin_softmax]": "~3 s",
    "tests/test_miners.py::test_large_batch_chunked_paths_match_pml": "large batches, ~4 s",
    "tests/test_miners.py::test_bounded_triplets_are_uniform*": "sampling statistics, ~3 s",
    "tests/test_ranking.py::test_dynamic_soft_margin_pml_settings*": "PML reference, ~3 s",
    "tests/test_pair_weighting.py::test_circle_gradient_holds_weights_constant": "~2 s",
}


_SPAWNS = re.compile(r"\b(?:spawn_ranks|check_distributed)\(")


@functools.cache
def _spawns_ranks(fn) -> bool:
    """Whether a test function's own source calls ``spawn_ranks(`` or ``check_distributed(``."""
    try:
        return _SPAWNS.search(inspect.getsource(fn)) is not None
    except (OSError, TypeError):
        return False


def _slow_reason(item: pytest.Item) -> str | None:
    if item.get_closest_marker("compile") or "compile" in getattr(item, "originalname", item.name):
        return "torch.compile"
    fn = getattr(item, "function", None)
    if fn is not None and _spawns_ranks(fn):
        return "spawns ranks"
    return next((why for pat, why in SLOW_TESTS.items() if fnmatchcase(item.nodeid, pat)), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the :data:`SLOW_TESTS` (and every compiling test) ``slow``, so that
    ``python -m pytest -m "not slow"`` deselects them."""
    for item in items:
        if item.get_closest_marker("slow") is None and _slow_reason(item) is not None:
            item.add_marker(pytest.mark.slow)
