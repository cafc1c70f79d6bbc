"""``benchmarks.gpu_check``: the plan's time accounting (a fake clock), the benchmark worker's
loop, the capacity search's deadline, the report of a run cut off anywhere, and the dry run
itself (the whole plan on CPU at tiny sizes), so that the GPU kit cannot rot on CPU."""

from __future__ import annotations

import json

import pytest
from helpers import fresh_pytest_env

from benchmarks import capacity
from benchmarks import gpu_check as G


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def step(name: str, clock: FakeClock, takes: float, share: float, min_seconds: float = 5.0,
         status: str = "done", seen: list | None = None) -> G.Step:  # fmt: skip
    """A step that takes ``takes`` seconds of the fake clock and records its deadline."""

    def run(ctx, deadline):
        if seen is not None:
            seen.append((name, deadline - clock()))
        clock.advance(takes)
        return G.Outcome(status, f"{name} ran")

    return G.Step(name, name.title(), run, share=share, min_seconds=min_seconds)


def test_each_step_gets_its_share_or_what_is_left_and_unused_time_goes_on():
    clock, seen = FakeClock(), []
    steps = [
        step("a", clock, takes=10, share=0.5, seen=seen),  # uses 10 of its 50
        step("b", clock, takes=60, share=0.6, seen=seen),  # gets min(60, 100 - 10 - 10) = 60
        step("c", clock, takes=5, share=0.5, seen=seen),  # gets 100 - 70 - 10 = 20
    ]
    records = G.Plan(steps, budget=100, clock=clock, reserve=10).execute(None)
    assert seen == [("a", 50), ("b", 60), ("c", 20)]
    assert [r["status"] for r in records] == ["done"] * 3
    assert [r["seconds"] for r in records] == [10, 60, 5]
    assert [r["allowed_s"] for r in records] == [50, 60, 20]


def test_a_step_that_would_get_less_than_its_minimum_is_skipped_and_the_plan_goes_on():
    clock, seen = FakeClock(), []
    steps = [
        step("long", clock, takes=85, share=1.0, seen=seen),  # overruns into the reserve
        step("needs_time", clock, takes=1, share=1.0, min_seconds=20, seen=seen),
        step("quick", clock, takes=1, share=1.0, min_seconds=0, seen=seen),
    ]
    records = G.Plan(steps, budget=100, clock=clock, reserve=10).execute(None)
    assert [r["status"] for r in records] == ["done", "skipped", "done"]
    assert "15 s of the budget left" in records[1]["summary"]
    assert records[1]["seconds"] is None and records[2]["allowed_s"] == 5
    assert seen == [("long", 90), ("quick", 5)]


def test_a_failing_step_is_recorded_and_the_next_one_runs():
    clock = FakeClock()

    def boom(ctx, deadline):
        clock.advance(3)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    steps = [G.Step("boom", "Boom", boom, share=0.5, min_seconds=1),
             step("after", clock, takes=2, share=0.5)]  # fmt: skip
    records = G.Plan(steps, budget=100, clock=clock).execute(None)
    assert records[0]["status"] == "failed" and "illegal memory access" in records[0]["summary"]
    assert "RuntimeError" in records[0]["traceback"] and records[0]["seconds"] == 3
    assert records[1]["status"] == "done"


def test_an_interrupted_step_is_cut_off_and_the_rest_skipped():
    clock, saved = FakeClock(), []

    def interrupted(ctx, deadline):
        clock.advance(4)
        raise G.Interrupted()

    steps = [step("first", clock, takes=1, share=0.5),
             G.Step("second", "Second", interrupted, share=0.5, min_seconds=1),
             step("third", clock, takes=1, share=0.5)]  # fmt: skip
    plan = G.Plan(steps, budget=100, clock=clock)
    with pytest.raises(G.Interrupted):
        plan.execute(None, on_update=lambda: saved.append([r["status"] for r in plan.records]))
    assert [r["status"] for r in plan.records] == ["done", "cut off", "skipped"]
    assert saved[-1] == ["done", "cut off", "skipped"]
    assert ["running", "pending", "pending"] in saved  # the report is written as steps start


def test_the_benchmark_worker_starts_no_entry_it_has_no_time_for():
    clock, events = FakeClock(0.0), []
    jobs = [{"key": f"{mode}{i}", "mode": mode} for i, mode in
            enumerate(["eager", "eager", "compile", "eager", "compile"])]  # fmt: skip
    cost = {"eager": 3.0, "compile": 30.0}

    def measure(job):
        clock.advance(cost[job["mode"]])
        return {"status": "ok"}

    rc = G.run_jobs(jobs, measure, deadline=40.0, clock=clock, emit=events.append,
                    min_seconds={"eager": 2.0, "compile": 20.0})  # fmt: skip
    assert rc == 0
    done = [e["key"] for e in events if e["event"] == "result"]
    skipped = [e["key"] for e in events if e["event"] == "skipped"]
    # 0 -> 3 -> 6 -> 36 (compile started with 34 left), then 36 + 2 <= 40: eager3 runs (39),
    # compile4 has 1 s left of the 20 it needs
    assert done == ["eager0", "eager1", "compile2", "eager3"] and skipped == ["compile4"]
    starts = [e["key"] for e in events if e["event"] == "start"]
    assert starts == done  # a start before every measurement


def test_the_benchmark_worker_stops_after_an_error_that_breaks_the_cuda_context():
    events = []
    jobs = [{"key": "a", "mode": "eager"}, {"key": "b", "mode": "eager"}]
    reason = "RuntimeError: CUDA error: an illegal memory access was encountered"
    rc = G.run_jobs(jobs, lambda job: {"status": "error", "reason": reason}, deadline=1e9,
                    clock=FakeClock(), emit=events.append, min_seconds={})  # fmt: skip
    assert rc == 3 and [e["key"] for e in events if e["event"] == "result"] == ["a"]


def test_the_capacity_search_stops_at_its_deadline_with_the_bracket_so_far():
    clock = FakeClock(0.0)

    def probe(batch):
        clock.advance(10)
        return "ok" if batch <= 5000 else "oom"

    result = capacity.search(probe, start=512, ceiling=2**20, multiple=4, deadline=45, clock=clock)
    # 512, 1024, 2048, 4096 pass, 8192 fails at t=50: then the deadline stops the bisection
    assert result["cut_off"] and result["batch"] == 4096 and result["failed_at"] == 8192
    assert result["failure"] == "oom" and len(result["trials"]) == 5

    def out_of_time(batch):
        raise capacity.OutOfTime()

    result = capacity.search(out_of_time, start=512, ceiling=2**20, multiple=4, deadline=1e9)
    assert result["cut_off"] and result["batch"] == 0 and result["trials"] == []
    text = G.capacity_text({**result, "status": "cut off", "start": 512})
    assert text == "cut off before a batch passed"


def test_the_capacity_step_splits_its_time_among_the_searches(tmp_path):
    clock = FakeClock(0.0)
    searches = tuple((impl, 512, 2**20) for impl in ("pml", "pmlfunc", "pmlfunc-tiled"))
    ctx = G.Context(tmp_path, G.replace(G.FULL, capacity=searches), False, {"runs": []})
    ctx.clock, ctx.cuda = clock, True
    ctx.save = lambda: None
    calls = []

    def probe(args, batch, timeout, on_output):
        calls.append((args.impl, batch, timeout))
        clock.advance(20)
        return "ok"

    outcome = G.capacity_step(ctx, deadline=300.0, probe=probe)
    found = ctx.doc["capacity"]
    assert [c["impl"] for c in found] == ["pml", "pmlfunc", "pmlfunc-tiled"]
    assert all(c["cut_off"] and c["seconds"] == 100 for c in found)  # 300 s in three parts
    assert outcome.status == "cut off" and "≥" in outcome.summary
    assert calls[0] == ("pml", 512, 100) and calls[1] == ("pml", 1024, 80)
    ctx.close()


def test_bench_jobs_put_every_eager_and_cudagraph_entry_before_any_compiled_one():
    from benchmarks.cases import registry

    jobs = G.bench_jobs(G.FULL)
    assert set(G.SEED_CASES) <= set(registry())
    modes = [j["mode"] for j in jobs]
    assert modes.index("compile") > max(i for i, m in enumerate(modes) if m != "compile")
    assert all(j["mode"] == "eager" for j in jobs if j["impl"] == "pml")
    configs = list(dict.fromkeys((j["batch"], j["dtype"]) for j in jobs))
    assert configs == [(512, "float32"), (2048, "float32"), (512, "bfloat16"), (2048, "bfloat16")]
    assert len({j["key"] for j in jobs}) == len(jobs)


def test_a_report_written_before_anything_ran_is_readable(tmp_path):
    doc = {"budget_seconds": 480, "started": "now", "command": "python -m benchmarks.gpu_check",
           "settings": G.asdict(G.FULL), "runs": [],
           "steps": [{"title": "Environment", "status": "running", "summary": "", "seconds": None,
                      "allowed_s": 48}]}  # fmt: skip
    text = G.render(doc)
    assert "| Environment | running | — | 48 |" in text and "No entry was measured." in text
    (tmp_path / "gpu_check.json").write_text(json.dumps(doc))
    md, csv = G.rerender(tmp_path / "gpu_check.json", tmp_path / "page", charts=True)
    assert md.name == "no-gpu.md" and md.read_text() == text and csv.exists()


def test_page_name_follows_the_gpu():
    assert G.page_name({"environment": {"device": "NVIDIA H200"}}) == "h200"
    assert G.page_name({"environment": {"device": "NVIDIA H100 80GB HBM3"}}) == "h100-80gb-hbm3"
    assert G.page_name({"dry_run": True, "environment": {}}) == "dry-run"


def test_dry_run_runs_the_whole_plan_on_cpu(tmp_path):
    """The plan as on a GPU, at tiny sizes: the CUDA tests collected and skipped, every
    benchmark entry measured or skipped by rule, the report and JSON written."""
    out = tmp_path / "out"
    assert G.main(["--output", str(out), "--dry-run", "--budget-seconds", "300"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["dry-run.csv", "dry-run.md", "gpu_check.json", "gpu_check.log"]
    doc = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in doc["steps"]}
    assert status == {"environment": "done", "cuda-tests": "skipped", "benchmarks": "done",
                      "capacity": "skipped"}, doc["steps"]  # fmt: skip
    tests = doc["tests"]["tests"]
    assert len(tests) >= 40  # pytest -m cuda collects every CUDA test ...
    skipped = [t for t in tests.values() if t["outcome"] == "skipped"]
    assert len(skipped) == len(tests) - 1  # ... and skips all but the table's coverage check
    assert all("CUDA" in t["message"] for t in skipped)
    assert len(doc["runs"]) == 4
    records = [r for run in doc["runs"] for r in run["results"]]
    assert {r["mode"] for r in records} == {"eager", "cudagraph", "compile"}
    assert all(r["status"] == "ok" for r in records if r["mode"] != "cudagraph")
    assert all(r["status"] == "skipped" for r in records if r["mode"] == "cudagraph")
    page = (out / "dry-run.md").read_text()
    for heading in ("## The GPU check", "## CUDA tests", "## Capacity", "## Benchmarks",
                    "### Batch 32, float32", "## Batch 64, bfloat16, eager", "## Provenance"):  # fmt: skip
        assert heading in page


@pytest.mark.slow
def test_the_cuda_tests_pass_on_cpu_with_a_simulated_graph():
    """The bodies of tests/test_cuda.py, run on CPU with a stand-in for the captured graph
    (``PMLFUNC_SIMULATE_CUDA_GRAPHS=1``): the GPU run must not fail for a reason a CPU finds."""
    import subprocess
    import sys

    env = fresh_pytest_env(PMLFUNC_SIMULATE_CUDA_GRAPHS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q",
         "-p", "no:cacheprovider"],
        cwd=G.ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-5000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
