"""The benchmark command-line tools: ``benchmarks.run``, ``benchmarks.report``,
``benchmarks.capacity``, ``benchmarks.memory_report`` (on a tiny configuration; timings are not
asserted)."""

from __future__ import annotations

import argparse
import collections
import csv
import itertools
import json
import xml.etree.ElementTree as ET

import pytest
from helpers import fresh_pytest_env

from benchmarks import capacity, memory_report, ratios, report, run

TINY = ["--batch-size", "16", "--dimensions", "8", "--repeats", "2", "--warmup", "1", "--quiet"]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "b16.json"
    cases = "contrastive,pair-miner,mined-triplet,proxy,anchor-batched-triplet,reused-lp"
    run.main([*TINY, "--case", cases, "--mode", "eager,cudagraph", "--output", str(out)])
    return json.loads(out.read_text())


def test_run_records_every_entry_with_samples_and_provenance(eager_run):
    results = eager_run["results"]
    eager = [r for r in results if r["mode"] == "eager"]
    assert {r["case"] for r in eager} == {
        "contrastive", "pair-miner", "mined-triplet", "proxy", "anchor-batched-triplet", "reused-lp"
    }  # fmt: skip
    for r in eager:
        assert r["status"] == "ok", r
        assert len(r["total_ms"]) == 2 and r["stats"]["median"] > 0
        assert r["peak_memory_mib"] is not None and r["peak_memory_mib"] > 0
    kinds = {(r["case"], r["impl"]): r for r in eager}
    assert kinds[("pair-miner", "pmlfunc")]["backward_ms"] is None  # mining: no backward
    assert kinds[("anchor-batched-triplet", "pmlfunc-anchor-batched")]["backward_ms"] is None
    assert len(kinds[("contrastive", "pmlfunc")]["backward_ms"]) == 2
    assert kinds[("contrastive", "pmlfunc")]["flops"] > 0
    # the same loss from both libraries
    for case in ("contrastive", "mined-triplet", "proxy"):
        ours, theirs = kinds[(case, "pmlfunc")]["loss"], kinds[(case, "pml")]["loss"]
        assert ours == pytest.approx(theirs, rel=1e-3, abs=1e-6), case
    assert eager_run["config"]["batch_size"] == 16
    assert eager_run["environment"]["torch"]


def test_cuda_graph_mode_is_skipped_with_a_reason_on_cpu(eager_run):
    graphed = [r for r in eager_run["results"] if r["mode"] == "cudagraph"]
    assert graphed and all(r["status"] == "skipped" for r in graphed)
    reasons = {r["reason"] for r in graphed}
    assert any("CUDA-graph capture needs CUDA" in x for x in reasons), reasons


@pytest.mark.compile
def test_compile_mode_reports_the_first_step_apart(tmp_path):
    out = tmp_path / "compiled.json"
    run.main([*TINY, "--case", "contrastive", "--mode", "compile", "--output", str(out)])
    results = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert results["pml"]["status"] == "skipped"
    assert results["pmlfunc"]["status"] == "ok"
    assert results["pmlfunc"]["first_step_ms"] > results["pmlfunc"]["stats"]["median"]


def test_settle_allocator_sets_glibcs_parameters():
    import platform

    from benchmarks import common as C

    assert C.settle_allocator() is (platform.libc_ver()[0] == "glibc")


def test_pml_pair_matrix_guard(tmp_path):
    from benchmarks.cases import pml_pair_matrix_gib, registry

    cases = registry()
    assert pml_pair_matrix_gib(cases["ntxent"], 512, 4) == pytest.approx(
        512 * 3 * 512 * 508 * 4 / 2**30
    )
    assert pml_pair_matrix_gib(cases["pnp"], 2048, 4) == 32.0  # 2048³ float32 ranks
    assert pml_pair_matrix_gib(cases["contrastive"], 512, 4) == 0.0
    out = tmp_path / "guard.json"
    run.main([*TINY, "--case", "ntxent", "--pml-memory-limit-gib", "0", "--output", str(out)])
    results = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert results["pml"]["status"] == "skipped" and "GiB" in results["pml"]["reason"]
    assert results["pmlfunc"]["status"] == "ok"


def test_run_rejects_unknown_cases_and_modes():
    with pytest.raises(SystemExit):
        run.main([*TINY, "--case", "no-such-case"])
    with pytest.raises(SystemExit):
        run.main([*TINY, "--mode", "jit"])


def test_report_writes_tables_csv_and_charts(eager_run, tmp_path):
    first = tmp_path / "b16.json"
    first.write_text(json.dumps(eager_run))
    second = tmp_path / "b32.json"
    run.main([*TINY[:1], "32", *TINY[2:], "--case", "contrastive", "--output", str(second)])
    written = report.main([str(first), str(second), "--output", str(tmp_path / "rep")])
    md = (tmp_path / "rep" / "README.md").read_text()
    assert "## Batch 16, float32, eager" in md and "## Batch 32, float32, eager" in md
    assert "| contrastive | pmlfunc |" in md
    assert "CUDA-graph capture needs CUDA" in md  # skipped entries are listed, not hidden
    assert "## Provenance" in md
    with (tmp_path / "rep" / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(eager_run["results"]) + 3
    svgs = [p for p in written if p.suffix == ".svg" and p.name != "summary.svg"]
    assert [p.name for p in svgs] == ["contrastive.svg"]  # the only case at two batch sizes
    assert ET.parse(svgs[0]).getroot().tag.endswith("svg")
    # the summary chart leads the page, before the first table
    assert (tmp_path / "rep" / "summary.svg") in written
    assert md.index("](summary.svg)") < md.index("## Batch 16, float32, eager")


def _entry(case, impl, median=None, status="ok", reason=None):
    return {"case": case, "impl": impl, "mode": "eager", "status": status, "reason": reason,
            "stats": {"median": median} if median is not None else None}  # fmt: skip


def _run(batch, entries, dtype="float32"):
    return {"config": {"batch_size": batch, "dtype": dtype}, "results": entries}


def test_summary_speedups_are_pml_over_pmlfunc_and_pmlfunc_over_floor():
    one = _run(
        512,
        [
            _entry("ntxent", "pml", 30.0),
            _entry("ntxent", "pmlfunc", 3.0),
            _entry("ntxent", "floor", 1.5),
            # PML stopped after one 2.5 s step: the speed-up is a lower bound
            _entry(
                "pnp",
                "pml",
                status="skipped",
                reason="one step took 2.5 s (> --max-step-seconds 2)",
            ),
            _entry("pnp", "pmlfunc", 5.0),
            _entry("pnp", "floor", 1.0),
            # no time for PML at all: no speed-up, the floor ratio still
            _entry("lifted", "pml", status="skipped", reason="would build a 96 GiB matrix"),
            _entry("lifted", "pmlfunc", 2.0),
            _entry("lifted", "floor", 1.0),
            # several pmlfunc variants: one row each
            _entry("miner", "pml", 8.0),
            _entry("miner", "pmlfunc-bounded", 2.0),
            _entry("miner", "pmlfunc-unbounded", 4.0),
        ],
    )
    got = report.speedups([one])[(512, "float32", "eager")]
    assert got["ntxent"] == {"speedup": 10.0, "lower_bound": False, "floor_ratio": 2.0}
    assert got["pnp"] == {"speedup": 500.0, "lower_bound": True, "floor_ratio": 5.0}
    assert got["lifted"] == {"speedup": None, "lower_bound": False, "floor_ratio": 2.0}
    assert got["miner (bounded)"]["speedup"] == 4.0
    assert got["miner (unbounded)"]["speedup"] == 2.0
    text = report.summary_text([one])
    assert text == [
        "- Batch 512: pmlfunc is faster than PML on 4 of 4 losses, median speed-up at least "
        "6.3× (1 with PML stopped after one step over the time limit); median 2.0× the matmul "
        "floor's time."
    ]


def test_eager_tables_show_the_compiled_time_and_its_ratio_to_the_compiled_floor():
    def entries(mode, pmlfunc, floor):
        rows = [_entry("ntxent", "pmlfunc", pmlfunc), _entry("ntxent", "floor", floor)]
        rows += [] if mode == "compile" else [_entry("ntxent", "pml", 40.0)]
        return [{**r, "mode": mode} for r in rows]

    def run(mode, pmlfunc, floor):
        return {
            **_run(512, entries(mode, pmlfunc, floor)),
            "environment": {},
            "config": {
                "batch_size": 512,
                "dtype": "float32",
                "dimensions": 128,
                "samples_per_class": 4,
                "threads": 1,
                "repeats": 10,
                "warmup": 2,
                "device": "cpu",
            },
            "path": f"{mode}.json",
        }

    md = report.markdown([run("eager", 4.0, 2.0), run("compile", 3.0, 2.5)], "t")
    eager = md.split("## Batch 512, float32, eager")[1].split("##")[0]
    assert "| compiled ms | compiled / compiled floor |" in eager
    assert "| ntxent | pmlfunc | 4 |" in eager and eager.count("| 3 | 1.2× |") == 1
    assert "| ntxent | pml | 40 |" in eager  # PML has no compiled run: blank cells
    compiled = md.split("## Batch 512, float32, compile")[1]
    assert "compiled ms" not in compiled.split("\n\n")[1]  # the compiled table itself: as before


def test_report_of_a_single_run_leads_with_the_summary_chart(eager_run, tmp_path):
    source = tmp_path / "b16.json"
    source.write_text(json.dumps(eager_run))
    written = report.main([str(source), "--output", str(tmp_path / "one"), "--name", "cpu"])
    summary = tmp_path / "one" / "cpu-summary.svg"
    assert summary in written
    root = ET.parse(summary).getroot()
    assert root.tag.endswith("svg")
    svg_text = summary.read_text()
    for case in ("contrastive", "mined-triplet", "proxy"):  # one row per loss measured by both
        assert f">{case}<" in svg_text or case in svg_text
    md = (tmp_path / "one" / "cpu.md").read_text()
    first_table = md.index("## Batch 16, float32, eager")
    assert md.index("](cpu-summary.svg)") < first_table
    assert md.index("- Batch 16: pmlfunc is faster than PML on") < first_table


@pytest.mark.parametrize("limit", [100, 700, 5000])
def test_capacity_search_brackets_to_128_rows_or_5_percent(limit):
    result = capacity.search(
        lambda b: "ok" if b <= limit else "oom", start=512, ceiling=2**20, multiple=4
    )
    got = result["batch"]
    assert got <= limit and got % 4 == 0
    assert limit - got <= max(128, 0.05 * got) + 4
    assert result["failure"] == "oom" and not result["lower_bound"]
    assert sum(t["batch"] == got for t in result["trials"]) >= 3  # confirmed twice more


def test_capacity_search_when_nothing_fits():
    result = capacity.search(lambda b: "oom", start=512, ceiling=2**20, multiple=4)
    assert result["batch"] == 0 and result["failure"] == "oom"
    assert min(t["batch"] for t in result["trials"]) == 4  # halved down to one class


def test_capacity_search_ceiling_is_a_lower_bound():
    result = capacity.search(lambda b: "ok", start=512, ceiling=4096, multiple=4)
    assert result == {**result, "batch": 4096, "lower_bound": True}


def test_capacity_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert capacity.main(["--case", "ntxent"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.compile
def test_compiled_members_join_the_pytest_benchmark_groups():
    """``PMLFUNC_BENCH_MODES=compile`` adds ``<impl>-compile`` bodies (run untimed here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = fresh_pytest_env(PMLFUNC_BENCH_MODES="compile,cudagraph", PMLFUNC_BENCH_BATCH="16")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "contrastive-",
         "benchmarks/cases/bench_compile_and_cudagraph.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    assert "passed" in out.stdout
    # -k contrastive- selects contrastive and signal_to_noise_ratio_contrastive: two compiled
    # members each (pmlfunc, floor); their CUDA-graph members are skipped on CPU
    if not __import__("torch").cuda.is_available():
        assert "4 passed, 4 skipped" in out.stdout, out.stdout[-2000:]


def test_memory_report_measures_every_loss_and_path_and_writes_markdown(tmp_path, capsys):
    """Tensor bytes only (no subprocesses), at two small batches: the bounded paths double with
    the batch, dense CLIP holds one ``N × N`` tile (not two: its gradient is formed in place of
    its exponentials) beside ``O(N·D)`` buffers, and the Markdown table has a cell for each. The
    other dense calls are bounded too: NT-Xent's and SigLIP's (tiles of at most 2^19 entries)
    and the retrieval loss's (2^22 entries, M = 8N columns with 7 hard negatives) grow less than
    twofold from 1,024 to 2,048 rows. Both sizes are above the self-product fuse limit (724
    rows: below it the dense self-mode backward holds ``∂S + ∂Sᵀ``, one more ``N²`` buffer for
    one product fewer), so each path is the same code at both."""
    batches = {"ntxent,clip,siglip": (1024, 2048), "retrieval": (1024, 2048)}
    rows = {}
    for losses, sizes in batches.items():
        argv = ["--losses", losses, "--batches", ",".join(map(str, sizes)), "--no-rss", "--time"]
        md = tmp_path / f"{losses}.md"
        assert memory_report.main([*argv, "--repeats", "1", "--markdown", str(md)]) == 0
        for line in capsys.readouterr().out.splitlines():
            parts = line.split()
            if len(parts) == 8 and parts[0] in memory_report.LOSSES:
                rows[(parts[0], parts[1], int(parts[2]))] = float(parts[5])
    sizes = {loss: batches["retrieval" if loss == "retrieval" else "ntxent,clip,siglip"]
             for loss in memory_report.LOSSES}  # fmt: skip
    paths = [(loss, impl) for loss, impls in memory_report.LOSSES.items() for impl in impls]
    assert set(rows) == {(*p, b) for p in paths for b in sizes[p[0]]}
    for loss, impl in paths:
        small, large = sizes[loss]
        growth = rows[(loss, impl, large)] / rows[(loss, impl, small)]
        if impl == "full" and loss == "clip":
            tile = large * large * 4 / 2**20  # MiB
            assert 2.5 < growth < 4.5 and tile <= rows[(loss, impl, large)] < 1.5 * tile
        elif impl == "full":
            assert growth < 2.2, (loss, impl)
        else:
            assert 1.8 < growth < 2.2, (loss, impl)
    table = (tmp_path / "ntxent,clip,siglip.md").read_text()
    assert "| batch | ntxent full | ntxent chunked | ntxent tiled | clip full |" in table
    assert table.count("\n| 1,024 |") == 1 and " s) |" in table
    table = (tmp_path / "retrieval.md").read_text()
    assert "| batch | retrieval full | retrieval tiled |" in table
    assert table.count("\n| 2,048 |") == 1


@pytest.mark.parametrize(
    ("flags", "timed"),
    [((), False), (("--benchmark-only",), True), (("--benchmark-enable",), True)],
    ids=["plain", "benchmark-only", "benchmark-enable"],
)
def test_pytest_benchmark_options_work_as_typed(flags, timed):
    """``pytest --benchmark-only`` times the bodies (no "Can't have both ... --benchmark-disable"
    error) and prints a line per finished benchmark as it goes, before pytest-benchmark's tables
    (benchmarks/conftest.py); a plain ``pytest`` runs each body once, untimed (the root
    conftest.py), with pytest's usual dots."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # the three members of one group (proxy-b512): normalized-softmax's
    cmd += ["benchmarks/cases/bench_proxy_losses.py", "-k", "proxy-", "--benchmark-max-time=0.01"]
    cmd += flags
    out = subprocess.run(
        cmd, cwd=root, env=fresh_pytest_env(), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "3 passed" in out.stdout
    assert ("benchmark 'proxy-b" in out.stdout) is timed, out.stdout[-3000:]
    progress = [line for line in out.stdout.splitlines() if line.startswith("[")]
    if not timed:
        assert progress == [], progress
        return
    assert [line.split()[0] for line in progress] == ["[1/3", "[2/3", "[3/3"], out.stdout[-3000:]
    assert all(" median " in line and " rounds" in line for line in progress), progress
    assert out.stdout.index(progress[-1]) < out.stdout.index("benchmark 'proxy-b")


def test_a_slow_pml_member_is_skipped_in_timed_runs_with_the_reason(monkeypatch):
    """Timed runs skip a PML member whose first step exceeds the budget (5 s, or
    PMLFUNC_BENCH_PML_MAX_STEP_SECONDS); pmlfunc and floor members are always measured."""
    from types import SimpleNamespace

    from benchmarks import common

    def request(impl):
        return SimpleNamespace(
            node=SimpleNamespace(callspec=SimpleNamespace(params={"impl": impl}))
        )

    with pytest.raises(pytest.skip.Exception, match=r"one step took 6\.0 s \(> 5 s"):
        common._skip_slow_pml(request("pml"), 6.0)
    common._skip_slow_pml(request("pml"), 4.0)
    for impl in ("pmlfunc", "pmlfunc-tiled", "floor"):
        common._skip_slow_pml(request(impl), 100.0)
    monkeypatch.setenv("PMLFUNC_BENCH_PML_MAX_STEP_SECONDS", "60")
    common._skip_slow_pml(request("pml"), 30.0)
    with pytest.raises(pytest.skip.Exception, match="> 60 s"):
        common._skip_slow_pml(request("pml-anchor-batched"), 61.0)


def _run_json(path, batch, entries, dtype="float32"):
    """A benchmarks.run file: ``entries`` are (case, impl, mode, median ms)."""
    results = [
        {"case": c, "impl": i, "mode": m, "status": "ok", "stats": {"median": ms}}
        for c, i, m, ms in entries
    ]
    config = {"batch_size": batch, "dtype": dtype}
    path.write_text(json.dumps({"config": config, "results": results}))
    return path


def test_ratios_check_the_speed_targets_of_both_modes(tmp_path, capsys):
    """Floor targets at batch 512 per mode (the compiled floor for compiled entries), PML's
    speed-up for eager entries at any batch (the higher ones at 512 only); a pytest-benchmark
    file reads the same."""
    b512 = _run_json(
        tmp_path / "b512.json",
        512,
        [
            ("contrastive", "pml", "eager", 9.0),
            ("contrastive", "pmlfunc", "eager", 5.0),  # 2.5x the floor: ok
            ("contrastive", "floor", "eager", 2.0),
            ("contrastive", "pmlfunc", "compile", 3.2),  # 1.6x the compiled floor: miss
            ("contrastive", "floor", "compile", 2.0),
            ("all-triplet", "pml", "eager", 100.0),
            ("all-triplet", "pmlfunc", "eager", 11.0),  # 5.5x, 9.1x PML (< 10x): miss
            ("all-triplet", "floor", "eager", 2.0),
        ],
    )
    b128 = _run_json(
        tmp_path / "b128.json",
        128,
        [
            ("contrastive", "pml", "eager", 0.7),
            ("contrastive", "pmlfunc", "eager", 0.8),  # slower than PML: miss
            ("contrastive", "floor", "eager", 0.1),  # 8x: no floor target at 128
            ("all-triplet", "pml", "eager", 5.0),
            ("all-triplet", "pmlfunc", "eager", 1.0),  # 5x PML: the 10x is stated at 512
            ("all-triplet", "floor", "eager", 0.1),
        ],
    )
    assert ratios.main([str(b512), str(b128)]) == 0
    assert ratios.main([str(b512), str(b128), "--check"]) == 1
    out = capsys.readouterr().out
    table = {
        (int(line.split()[0]), line.split()[1], line.split()[2]): line.split()[-1]
        for line in out.splitlines()
        if line[:5].strip().isdigit()
    }
    assert table[(512, "eager", "contrastive")] == "ok"
    assert table[(512, "compile", "contrastive")] == "MISS"
    assert table[(512, "eager", "all-triplet")] == "MISS"
    assert table[(128, "eager", "contrastive")] == "MISS"
    assert table[(128, "eager", "all-triplet")] == "ok"
    bf16 = _run_json(
        tmp_path / "bf16.json",
        512,
        [
            ("contrastive", "pml", "eager", 4.0),
            ("contrastive", "pmlfunc", "eager", 8.0),  # float32 compute: no target in bfloat16
            ("contrastive", "floor", "eager", 1.0),
        ],
        dtype="bfloat16",
    )
    medians = {**ratios.load_medians(b512), **ratios.load_medians(bf16)}
    by_mode = {r["mode"]: r for r in ratios.rows(medians) if r["label"] == "contrastive"}
    assert by_mode["eager-bfloat16"]["speedup"] == 0.5  # against PML in bfloat16, not float32
    assert by_mode["eager-bfloat16"]["verdict"] == "-"
    assert by_mode["eager"]["verdict"] == "ok"
    bench = tmp_path / "pytest.json"
    extra = {"shape": [512, 128]}
    bench.write_text(
        json.dumps(
            {
                "benchmarks": [
                    {"extra_info": {**extra, "case": "supcon", "impl": i}, "stats": {"median": t}}
                    for i, t in [("pml", 9e-3), ("pmlfunc", 4e-3), ("floor", 2e-3),
                                 ("pmlfunc-compile", 2.4e-3), ("floor-compile", 2e-3)]
                ]
            }
        )
    )  # fmt: skip
    medians = ratios.load_medians(bench)
    assert medians[(512, "supcon", "compile")] == {"pmlfunc": 2.4e-3, "floor": 2e-3}
    verdicts = {(r["mode"], r["label"]): r["verdict"] for r in ratios.rows(medians)}
    assert verdicts == {("eager", "supcon"): "ok", ("compile", "supcon"): "ok"}


# --- peers: the peer libraries' members (benchmarks/peers.py, benchmarks/cases/bench_peers.py) ---
# None of these needs a peer package: absence is simulated with missing module names, and the
# tests that load a real peer skip when it is not installed (CI does not install .[bench-peers]).


@pytest.fixture
def peers_absent(monkeypatch):
    """Every peer's module name replaced by a missing one, the loaders' cache cleared (and
    cleared again after, so that later tests load the real packages)."""
    from benchmarks import peers

    for name, peer in list(peers.PEERS.items()):
        missing = peers.Peer(f"pmlfunc_test_no_{name}", peer.distribution)
        monkeypatch.setitem(peers.PEERS, name, missing)
    peers.forget()
    yield peers
    peers.forget()


def test_the_peer_loaders_report_an_absent_package_with_the_reason(peers_absent):
    peers = peers_absent
    for name, load in peers.LOADERS.items():
        with pytest.raises(peers.PeerUnavailable, match=r"is not installed \(pip install -e"):
            load()
        reason = peers.unavailable(name)
        assert reason is not None and "bench-peers" in reason
        assert peers.PEERS["jax" if name == "optax" else name].module in reason


def test_the_peer_members_are_skipped_with_the_reason_when_absent(peers_absent, tmp_path):
    """benchmarks.run records every peer entry as skipped with the reason and measures the
    pmlfunc and floor members; the pytest body skips the peer with the same reason."""
    from benchmarks.cases import bench_peers

    out = tmp_path / "peers.json"
    run.main([*TINY, "--case", "peers", "--output", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {r["case"] for r in results} == set(bench_peers.CASES)
    for r in results:
        if report.is_peer(r["impl"]):
            assert r["status"] == "skipped", r
            assert "is not installed (pip install -e '.[bench-peers]')" in r["reason"], r
        else:
            assert r["status"] == "ok" and r["stats"]["median"] > 0, r
    with pytest.raises(pytest.skip.Exception, match=r"open_clip.*is not installed"):
        bench_peers.bench_peers(None, None, "peer-clip", "open_clip")


def test_the_peer_loader_restores_sys_modules():
    """``_aliased`` maps names for the duration only: an absent name is removed again, a
    present one gets its module back."""
    import sys
    import types

    from benchmarks import peers

    before = sys.modules["json"]
    stand_in = types.ModuleType("json")
    with peers._aliased({"json": stand_in, "pmlfunc_test_alias": stand_in}):
        assert sys.modules["json"] is stand_in and "pmlfunc_test_alias" in sys.modules
    assert sys.modules["json"] is before and "pmlfunc_test_alias" not in sys.modules


def test_a_peer_loss_file_is_loaded_without_its_package():
    """open_clip's and lightly's loss files run without their packages' init (the inits
    import torchvision), and leave no ``open_clip``/``lightly`` module behind."""
    import sys

    from benchmarks import peers

    for name, load in (("open_clip", peers.open_clip_loss), ("lightly", peers.lightly_ntxent)):
        reason = peers.unavailable(name)
        if reason is not None:
            pytest.skip(reason)
        had = {m for m in sys.modules if m == name or m.startswith(f"{name}.")}
        module = load()
        assert module.__name__.startswith(peers.PRIVATE)
        assert {m for m in sys.modules if m == name or m.startswith(f"{name}.")} == had
    assert hasattr(peers.open_clip_loss(), "SigLipLoss")
    assert hasattr(peers.lightly_ntxent(), "NTXentLoss")


def _wrong_case(reference_member, wrong_member):
    from benchmarks.cases import FLOOR, Case

    return Case(
        "peer-wrong",
        {"pmlfunc": reference_member, "fake_peer": wrong_member, "floor": FLOOR},
        reference="pmlfunc",
    )


def test_the_equality_check_fails_loudly_on_a_wrong_pairing(monkeypatch, tmp_path):
    """A deliberately wrong pairing is caught before timing: by its loss (MNRL's scale 20
    against a temperature of 0.07), and by its gradients alone (the same value with half the
    gradient)."""
    import torch

    from benchmarks import common
    from benchmarks.cases import bench_peers, reference_mismatch

    emb, labels = common.make_inputs(64, 8)
    right = bench_peers.CASES["peer-cached-mnrl"]  # its pmlfunc members need no peer
    assert reference_mismatch(right, "pmlfunc-chunked", emb, labels, 1e-4) is None

    def ntxent_at(t):
        def make(e, y):
            other, rows = common.make_paired(e).requires_grad_(), torch.arange(len(e))
            return (
                lambda e_, y_: bench_peers.pf.losses.ntxent(
                    e_, rows, ref_emb=other, ref_labels=rows.clone(), temperature=t
                )
            ), [other]

        return bench_peers.Member(make)

    by_loss = _wrong_case(ntxent_at(1 / bench_peers.ST_SCALE), ntxent_at(0.07))
    bad = reference_mismatch(by_loss, "fake_peer", emb, labels, 1e-4)
    assert bad is not None and bad.startswith("fake_peer differs from pmlfunc: loss"), bad

    def half_gradient(member):  # the same value, half of the embeddings' gradient
        def make(e, y):
            fn, params = member.make(e, y)
            return (lambda e_, y_: fn(0.5 * (e_ + e_.detach()), y_)), params

        return bench_peers.Member(make)

    symmetric = bench_peers._pf_symmetric()
    by_grad = _wrong_case(symmetric, half_gradient(symmetric))
    bad = reference_mismatch(by_grad, "fake_peer", emb, labels, 1e-4)
    assert bad is not None and "gradient 0: max |difference|" in bad, bad

    # benchmarks.run: an error entry with the difference, not timed
    monkeypatch.setattr(run, "registry", lambda: {"peer-wrong": by_loss})
    out = tmp_path / "wrong.json"
    run.main([*TINY, "--case", "peer-wrong", "--output", str(out)])
    results = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert results["fake_peer"]["status"] == "error"
    assert "differs from pmlfunc: loss" in results["fake_peer"]["reason"]
    assert "stats" not in results["fake_peer"]
    assert results["pmlfunc"]["status"] == results["floor"]["status"] == "ok"
    # the pytest body: an assertion error before anything is measured
    monkeypatch.setitem(bench_peers.CASES, "peer-wrong", by_grad)
    with pytest.raises(AssertionError, match="fake_peer differs from pmlfunc: gradient 0"):
        bench_peers.bench_peers(None, None, "peer-wrong", "fake_peer")


def test_the_cached_loss_stage_wrapper_scales_its_gradients_by_the_cotangent():
    """The GradCache-style members (ST's cached loss stage, ``pmlfunc-chunked``): the forward
    does the work, the backward multiplies the collected gradients by the cotangent."""
    import torch

    from benchmarks import common
    from benchmarks.cases import bench_peers, result

    emb, labels = common.make_inputs(32, 8)
    case = bench_peers.CASES["peer-cached-mnrl"]
    _, grads = result(case.members["pmlfunc-tiled"], emb, labels)
    fn, params = case.members["pmlfunc-chunked"].make(emb, labels)
    scaled = torch.autograd.grad(3.0 * fn(emb, labels), [emb, *params])
    for got, want in zip(scaled, grads, strict=True):
        torch.testing.assert_close(got, 3.0 * want, rtol=1e-4, atol=1e-7)


def test_optax_is_skipped_where_its_broadcast_is_too_large():
    import torch

    from benchmarks.cases import Skip, bench_peers

    assert bench_peers.optax_broadcast_gib(2048, 128) == 2.0
    member = bench_peers.CASES["peer-optax-ntxent"].members["optax"]
    with pytest.raises(Skip, match=r"N x N x D = 2 GiB tensor \(> 1 GiB"):
        member.make(torch.zeros(2048, 128), torch.zeros(2048, dtype=torch.long))


def _peer_run(path, batch, dims, medians):
    """A benchmarks.run file of the peer-clip case: ``medians`` maps impl to ms."""
    results = [
        {"case": "peer-clip", "impl": i, "mode": "eager", "status": "ok",
         "stats": {"median": ms, "q1": ms, "q3": ms}, "peak_memory_mib": 2.0}
        for i, ms in medians.items()
    ]  # fmt: skip
    results.append(
        {"case": "peer-clip", "impl": "open_clip-x", "mode": "eager", "status": "skipped",
         "reason": "not installed"}
    )  # fmt: skip
    config = {"batch_size": batch, "dimensions": dims, "dtype": "float32", "samples_per_class": 4,
              "threads": 1, "repeats": 3, "warmup": 1, "device": "cpu"}  # fmt: skip
    env = {"torch": "2.13", "peers": {"open_clip": "3.3.0"}}
    path.write_text(json.dumps({"config": config, "environment": env, "results": results}))
    return path


def test_the_peers_report_gives_the_median_and_range_of_the_runs_ratios(tmp_path):
    files = [
        _peer_run(tmp_path / "a.json", 512, 128, {"pmlfunc": 2.0, "open_clip": 3.0, "floor": 1.0}),
        _peer_run(tmp_path / "b.json", 512, 128, {"pmlfunc": 2.0, "open_clip": 2.0, "floor": 1.0}),
        _peer_run(tmp_path / "c.json", 512, 128, {"pmlfunc": 4.0, "open_clip": 5.0, "floor": 1.0}),
        _peer_run(tmp_path / "d.json", 2048, 512, {"pmlfunc": 8.0, "open_clip": 4.0, "floor": 2.0}),
    ]
    runs = report.load(files)
    ratios = report.peer_ratios(runs)
    assert ratios[("peer-clip", "open_clip", "pmlfunc")][(512, 128, "float32", "eager")] == [
        1.5, 1.0, 1.25
    ]  # fmt: skip
    assert ratios[("peer-clip", "open_clip-x", "pmlfunc")][(512, 128, "float32", "eager")] == []
    lines = report.peers_markdown(runs)
    head = next(line for line in lines if line.startswith("| group | peer |"))
    assert head == "| group | peer | pmlfunc member | N = 512, D = 128 | N = 2,048, D = 512 |"
    assert "| peer-clip | open_clip | pmlfunc | 1.25× [1.00–1.50] | 0.50× (1 run) |" in lines
    assert any("`peer-clip` / `open_clip-x`" in line and "not installed" in line for line in lines)
    written = report.main([*map(str, files), "--output", str(tmp_path / "out"), "--name",
                           "peers", "--peers", "--command", "the one-liner"])  # fmt: skip
    page = (tmp_path / "out" / "peers.md").read_text()
    assert "the one-liner" in page and "](peers.svg)" in page and "open_clip 3.3.0" in page
    assert (tmp_path / "out" / "peers.svg") in written
    assert ET.parse(tmp_path / "out" / "peers.svg").getroot().tag.endswith("svg")
    # the main page carries a peers section when a run holds a peer
    report.main([*map(str, files), "--output", str(tmp_path / "main")])
    main_page = (tmp_path / "main" / "README.md").read_text()
    assert "## Peers" in main_page and "](peers.svg)" in main_page


def test_class_tiles_dry_run_reports_every_member_and_the_tiles_add_less_memory(tmp_path):
    """``benchmarks.class_tiles`` on CPU at C = 3,000: every member runs, the report is written,
    and each tiled member adds less memory than its dense twin (B × C logits)."""
    from benchmarks import class_tiles

    argv = ["--device", "cpu", "--classes", "3000", "--steps", "1", "--output", str(tmp_path)]
    result = class_tiles.main(argv)
    rows = {(r["loss"], r["path"]): r for r in result["rows"]}
    assert len(rows) == 7 and all(r["outcome"] == "ok" for r in rows.values())
    for name in class_tiles.LOSSES:
        assert rows[(name, "tiled")]["added_mib"] < rows[(name, "dense")]["added_mib"] / 2
    assert "| 3,000 | arcface | tiled | 256 |" in (tmp_path / "class_tiles.md").read_text()
    assert json.loads((tmp_path / "class_tiles.json").read_text())["rows"] == result["rows"]


def test_matryoshka_cases_time_every_member_checked_against_the_naive_sum(tmp_path):
    out = tmp_path / "m.json"
    argv = ["--batch-size", "32", "--dimensions", "16", "--repeats", "1", "--warmup", "0"]
    run.main([*argv, "--case", "matryoshka-ntxent,matryoshka-clip", "--output", str(out),
              "--quiet"])  # fmt: skip
    results = {(r["case"], r["impl"]): r for r in json.loads(out.read_text())["results"]}
    assert len(results) == 10 and all(r["status"] == "ok" for r in results.values())
    for case in ("matryoshka-ntxent", "matryoshka-clip"):
        assert results[(case, "pmlfunc-matryoshka")]["checked_against"] == "pmlfunc-naive-dense"
        assert results[(case, "pmlfunc-naive")]["stats"]["median"] > 0


def test_rounds_shuffle_the_members_so_that_each_follows_each_other_one_alike():
    """Each round runs the members in a fresh seeded order: over 300 rounds of 3 members every
    member runs after each other member about equally often (within 25% of the mean; a fixed
    order, or a rotation of one, always put the same member after the floor), the same orders
    on every run."""

    def rounds():
        order: list[int] = []
        prepared = [
            ({"kind": "loss", "mode": "eager"}, lambda i=i: order.append(i) or (1.0, 1.0))
            for i in range(3)
        ]
        records = run.time_rounds(prepared, argparse.Namespace(warmup=0, repeats=300, threads=1))
        assert all(len(r["total_ms"]) == 300 for r in records)
        return order

    order = rounds()
    follows = collections.Counter((a, b) for a, b in itertools.pairwise(order) if a != b)
    assert len(follows) == 6 and max(follows.values()) < 1.25 * min(follows.values()), follows
    assert rounds() == order


def test_toggle_times_each_pmlfunc_member_once_per_value_and_restores_the_attribute(
    tmp_path, monkeypatch
):
    """``--toggle MODULE.NAME=V1,V2``: every pmlfunc member is timed once per value, as
    ``IMPL@NAME=V``, the value set for each of its steps (the checking step too); the floor once;
    the attribute is restored after the run."""
    import pmlfunc.losses._tiled as tiled

    seen = []
    real = tiled.dense_rows

    def spy(kind, n, m):
        seen.append(tiled.DENSE_MIN_ROWS)
        return real(kind, n, m)

    monkeypatch.setattr(tiled, "dense_rows", spy)
    out = tmp_path / "t.json"
    toggle = "pmlfunc.losses._tiled.DENSE_MIN_ROWS=1,256"
    run.main([*TINY, "--case", "tiled-ntxent", "--impl", "pmlfunc-full,floor", "--toggle", toggle,
              "--output", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    results = {r["impl"]: r for r in doc["results"]}
    assert set(results) == {"pmlfunc-full@DENSE_MIN_ROWS=1", "pmlfunc-full@DENSE_MIN_ROWS=256",
                            "floor"}  # fmt: skip
    assert all(r["status"] == "ok" and len(r["total_ms"]) == 2 for r in results.values())
    assert results["pmlfunc-full@DENSE_MIN_ROWS=1"]["toggle"] == {
        "attribute": "DENSE_MIN_ROWS", "value": "1"
    }  # fmt: skip
    assert doc["config"]["toggle"] == toggle
    assert set(seen) == {1, 256} and tiled.DENSE_MIN_ROWS == 256


@pytest.mark.parametrize(
    "spec", ["DENSE_MIN_ROWS=1", "pmlfunc.losses._tiled.NO_SUCH=1", "pmlfunc.no_such_module.X=1",
             "pmlfunc.losses._tiled.DENSE_MIN_ROWS=two", "pmlfunc.losses._tiled.DENSE_MIN_ROWS="]
)  # fmt: skip
def test_toggle_rejects_what_it_cannot_set(spec):
    with pytest.raises(SystemExit):
        run.main([*TINY, "--case", "tiled-ntxent", "--toggle", spec])
