r"""Mutation testing for one module: plant one small bug at a time, run the tests that should catch it.

    python tools/mutate.py pmlfunc/losses/_tiled.py tests/test_tiled.py -m "not slow"
    python tools/mutate.py --max 60 pmlfunc/miners.py tests/test_miners.py tests/test_boundaries.py
    python tools/mutate.py --list pmlfunc/reducers.py    # the mutants only

(the options come before the module; everything after it goes to pytest).

Each *mutant* is the module with one operator changed, found by walking its syntax tree (docstrings,
messages, annotations and ``__all__`` left alone):

| kind | original → mutant |
|---|---|
| comparison | ``<`` ↔ ``<=``, ``>`` ↔ ``>=``, ``==`` ↔ ``!=``, ``is`` ↔ ``is not``, ``in`` ↔ ``not in`` |
| arithmetic | ``+`` ↔ ``-``, ``*`` → ``/``, ``/`` → ``*``, ``//`` → ``/``, ``**`` → ``*``, ``%`` → ``*`` (augmented assignments too) |
| a dropped update | ``x += y`` (and ``-=``, ``*=``, ``/=``) → nothing |
| boolean | ``and`` ↔ ``or``, ``not x`` → ``x``, ``True`` ↔ ``False`` |
| numbers | an integer ``n`` → ``n + 1``; a float ``f`` → ``2f`` (``0.0`` → ``1.0``); a unary minus dropped |
| reductions | ``amax`` ↔ ``amin``, ``max`` ↔ ``min``, ``maximum`` ↔ ``minimum``, ``sum`` ↔ ``mean``, ``clamp_min`` ↔ ``clamp_max`` |

The tests run on a private copy of the repository (a ``git worktree`` of ``HEAD`` plus the
uncommitted changes of the module itself), one mutant at a time, with ``pytest -x``: a mutant
is *killed* when a test fails, errors or exceeds the time limit (three times the unmutated run,
plus 30 s), and *survives* when every test passes. Survivors are the report: each one is a bug
the tests would let through, or an *equivalent* mutant (the same behaviour, e.g. ``<`` against
``<=`` where equality cannot occur), to be explained in ``docs/contributing.md``.

``--max N`` takes N mutants in a fixed pseudo-random order (``--seed``), so that a run fits
in the time at hand; ``--jobs`` runs that many mutants at once, each on its own copy.
Not part of CI: a module takes minutes to hours (see ``docs/contributing.md``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_COMPARE = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
_BINOP = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div, ast.Pow: ast.Mult, ast.Mod: ast.Mult,
}  # fmt: skip
_SYMBOL = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+",
    ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Pow: "**", ast.Mod: "%",
    ast.And: "and", ast.Or: "or",
}  # fmt: skip
_NAMES = {
    "amax": "amin", "amin": "amax", "max": "min", "min": "max", "maximum": "minimum",
    "minimum": "maximum", "sum": "mean", "mean": "sum", "clamp_min": "clamp_max",
    "clamp_max": "clamp_min",
}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    index: int  # the site's place in the walk (stable for a given source)
    line: int
    what: str  # "original → mutant"


@dataclass
class Result:
    mutant: Mutant
    outcome: str  # killed | survived | timeout | error
    seconds: float
    detail: str = ""


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes not to mutate: docstrings, annotations, ``__all__``, raise messages."""
    skip: set[int] = set()

    def all_of(node: ast.AST) -> None:
        skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                all_of(body[0])
        if isinstance(node, (ast.AnnAssign, ast.arg)) and getattr(node, "annotation", None):
            all_of(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            all_of(node.returns)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            all_of(node)
        if isinstance(node, ast.Raise) and node.exc is not None:
            for arg in getattr(node.exc, "args", []):
                all_of(arg)
    return skip


def _sites(tree: ast.Module):
    """``(node, field, replacement-maker, description)`` for every mutation site, in walk order."""
    skip = _skipped(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                new = _COMPARE.get(type(op))
                if new is not None:
                    yield node, ("ops", i), new(), f"{_SYMBOL[type(op)]} → {_SYMBOL[new]}"
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            new = _BINOP.get(type(node.op))
            if new is not None:
                eq = "=" if isinstance(node, ast.AugAssign) else ""
                what = f"{_SYMBOL[type(node.op)]}{eq} → {_SYMBOL[new]}{eq}"
                yield node, ("op", None), new(), what
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            yield node, ("op", None), new(), f"{_SYMBOL[type(node.op)]} → {_SYMBOL[new]}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            yield (
                node,
                ("drop-unary", None),
                None,
                "not x → x" if isinstance(node.op, ast.Not) else "-x → x",
            )
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            v = node.value
            if isinstance(v, bool):
                new_v: object = not v
            elif isinstance(v, int):
                new_v = v + 1
            else:
                new_v = 2.0 * v if v else 1.0
            yield node, ("value", None), new_v, f"{v!r} → {new_v!r}"
        elif isinstance(node, ast.Attribute) and node.attr in _NAMES:
            yield node, ("attr", None), _NAMES[node.attr], f".{node.attr} → .{_NAMES[node.attr]}"
        if isinstance(node, ast.AugAssign) and isinstance(
            node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)
        ):
            yield node, ("drop-stmt", None), None, f"{_SYMBOL[type(node.op)]}= update dropped"


def mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source``."""
    tree = ast.parse(source)
    return [
        Mutant(i, getattr(node, "lineno", 0), what)
        for i, (node, _, _, what) in enumerate(_sites(tree))
    ]


class _Apply(ast.NodeTransformer):
    def __init__(self, target: ast.AST, field, new):
        self.target, self.field, self.new = target, field, new

    def visit(self, node):
        if node is not self.target:
            return self.generic_visit(node)
        name, i = self.field
        if name == "ops":
            node.ops[i] = self.new
        elif name == "op":
            node.op = self.new
        elif name == "value":
            node.value = self.new
        elif name == "attr":
            node.attr = self.new
        elif name == "drop-unary":
            return node.operand
        elif name == "drop-stmt":
            return ast.Pass()
        return node


def mutate(source: str, index: int) -> str:
    """``source`` with mutant ``index`` applied (the module re-printed from its syntax tree)."""
    tree = ast.parse(source)
    node, field, new, _ = next(s for i, s in enumerate(_sites(tree)) if i == index)
    tree = _Apply(node, field, copy.deepcopy(new) if isinstance(new, ast.AST) else new).visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


def _worktree(base: Path, module: Path) -> Path:
    """A private copy of ``HEAD`` with the working tree's ``module``."""
    path = Path(tempfile.mkdtemp(prefix="pmlfunc-mutate-", dir=base))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "--force", str(path), "HEAD"],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    for rel in _changed():  # the working tree's uncommitted changes, so tests and code match
        src, dst = ROOT / rel, path / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    shutil.copy2(ROOT / module, path / module)
    return path


def _changed() -> list[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [line[3:] for line in out.splitlines() if line[3:].endswith(".py")]


def _pytest(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header"]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        out = subprocess.run(
            [*cmd, *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode == 0:
        return "survived", time.monotonic() - start, last
    return ("killed" if out.returncode == 1 else "error"), time.monotonic() - start, last


def run(module: str, tests: list[str], *, limit: int | None, seed: int, jobs: int) -> dict:
    path = Path(module)
    source = (ROOT / path).read_text()
    every = mutants(source)
    chosen = list(every)
    random.Random(seed).shuffle(chosen)
    chosen = sorted(chosen[:limit] if limit else chosen, key=lambda m: m.index)
    base = Path(tempfile.mkdtemp(prefix="pmlfunc-mutation-"))
    trees = [_worktree(base, path) for _ in range(max(1, jobs))]
    try:
        outcome, baseline, last = _pytest(trees[0], tests, timeout=3600)
        if outcome != "survived":
            raise SystemExit(f"the tests fail before any mutation ({last}); fix them first")
        timeout = 3 * baseline + 30
        print(f"{module}: {len(every)} mutants, running {len(chosen)}; unmutated tests "
              f"{baseline:.0f} s, limit {timeout:.0f} s a mutant", flush=True)  # fmt: skip
        free = list(trees)

        def one(m: Mutant) -> Result:
            tree = free.pop()
            try:
                (tree / path).write_text(mutate(source, m.index))
                kind, secs, detail = _pytest(tree, tests, timeout)
            finally:
                (tree / path).write_text(source)
                free.append(tree)
            mark = "SURVIVED" if kind == "survived" else kind
            print(f"  line {m.line:4d}  {m.what:28s} {mark} ({secs:.0f} s)", flush=True)
            return Result(m, kind, secs, detail)

        with ThreadPoolExecutor(max_workers=len(trees)) as pool:
            results = list(pool.map(one, chosen))
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False, capture_output=True)  # fmt: skip
        shutil.rmtree(base, ignore_errors=True)
    killed = sum(r.outcome != "survived" for r in results)
    summary = {
        "module": module,
        "tests": tests,
        "mutants": len(every),
        "run": len(results),
        "killed": killed,
        "kill_rate": killed / len(results) if results else 1.0,
        "survivors": [asdict(r.mutant) for r in results if r.outcome == "survived"],
        "results": [{**asdict(r.mutant), "outcome": r.outcome, "seconds": round(r.seconds, 1)} for r in results],
    }  # fmt: skip
    print(f"{module}: killed {killed} of {len(results)} ({100 * summary['kill_rate']:.0f} %)")
    for s in summary["survivors"]:
        print(f"  survivor: line {s['line']}: {s['what']}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module", help="the module to mutate, e.g. pmlfunc/reducers.py")
    parser.add_argument("--max", type=int, default=None, help="run at most this many mutants")
    parser.add_argument("--seed", type=int, default=0, help="the order --max takes them in")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument(
        "tests", nargs=argparse.REMAINDER, help="pytest's arguments: test files, -k, -m ..."
    )
    args = parser.parse_args(argv)
    if args.list:
        for m in mutants((ROOT / args.module).read_text()):
            print(f"{m.index:4d}  line {m.line:4d}  {m.what}")
        return {}
    if not args.tests:
        parser.error("name the test files to run")
    summary = run(args.module, args.tests, limit=args.max, seed=args.seed, jobs=args.jobs)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
