r"""Mutation testing for one module: plant one small bug at a time, run the tests that should catch it.

    python tools/mutate.py --max 40 --seed 0 --json /tmp/mut/tiled.json \
        pmlfunc/losses/_tiled.py tests/test_tiled.py -m "not slow"
    python tools/mutate.py --same-as /tmp/mut/tiled.json --json /tmp/mut/tiled-after.json \
        pmlfunc/losses/_tiled.py tests/test_tiled.py -m "not slow"   # the same mutants again
    python tools/mutate.py --list pmlfunc/reducers.py       # the mutants only
    python tools/mutate.py --show 17 pmlfunc/reducers.py    # mutant 17 as a diff

(the options come before the module; everything after it goes to pytest: files, node ids, ``-k``,
``-m``).

Each *mutant* is the module with one operator changed, found by walking its syntax tree (docstrings,
f-strings and ``raise`` messages, annotations, decorators and ``__all__`` left alone):

| kind | original → mutant |
|---|---|
| comparison | ``<`` ↔ ``<=``, ``>`` ↔ ``>=``, ``==`` ↔ ``!=``, ``is`` ↔ ``is not``, ``in`` ↔ ``not in`` |
| arithmetic | ``+`` ↔ ``-``, ``*`` → ``/``, ``/`` → ``*``, ``//`` → ``/``, ``**`` → ``*``, ``%`` → ``*`` (augmented assignments too) |
| a dropped term or factor | ``a + b``, ``a - b``, ``a * b``, ``a / b`` → ``a`` |
| a dropped update | ``x += y`` (and ``-=``, ``*=``, ``/=``) → nothing |
| boolean | ``and`` ↔ ``or``, ``not x`` → ``x``, ``True`` ↔ ``False`` |
| numbers | an integer ``n`` → ``n + 1``; a float ``f`` → ``2f`` (``0.0`` → ``1.0``); a unary minus dropped |
| reductions | ``amax`` ↔ ``amin``, ``max`` ↔ ``min``, ``maximum`` ↔ ``minimum``, ``sum`` ↔ ``mean``, ``clamp_min`` ↔ ``clamp_max`` |

Only the mutated expression is rewritten (in parentheses); the rest of the file, its comments and
line numbers stay as they are. The tests run on a private copy of the repository (a
``git worktree`` of ``HEAD`` plus the working tree's uncommitted ``.py`` files), one mutant at a
time, with ``pytest -x``: a mutant is *killed* when a test fails, errors or exceeds the time
limit (three times the unmutated run, plus 30 s; the whole process group is stopped, spawned
ranks included), and *survives* when every test passes. Survivors are the report: each one is a
bug the tests would let through, or an *equivalent* mutant (the same behaviour, e.g. ``<``
against ``<=`` where equality cannot occur), to be explained in ``docs/contributing.md``.

``--max N`` takes N mutants in a fixed pseudo-random order (``--seed``), so that a run fits in the
time at hand; ``--same-as SUMMARY.json`` runs exactly the mutants of an earlier run (matched by
their line's text and operator, so a module edited since still gets the same mutants where their
lines survive; those not found are listed; with ``--survivors``, only its survivors: a quick
check of new tests); ``--jobs`` runs that many mutants at once, each on
its own copy. Not part of CI: a module takes minutes to an hour (see ``docs/contributing.md``,
"Mutation testing").
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
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
_DROPPABLE = (ast.Add, ast.Sub, ast.Mult, ast.Div)  # a + b → a, a * b → a, ...
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
    code: str  # the original line, stripped (to read the report, and for --same-as)
    nth: int = 1  # which of the mutants with this code and what (in walk order)


@dataclass
class Result:
    mutant: Mutant
    outcome: str  # killed | survived | timeout | error
    seconds: float
    detail: str = ""  # the first failing test, or pytest's last line


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes not to mutate: docstrings, f-strings, ``raise`` messages, annotations,
    decorators and ``__all__``."""
    skip: set[int] = set()

    def all_of(node: ast.AST) -> None:
        skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                all_of(body[0])
        if isinstance(node, ast.JoinedStr):
            all_of(node)
        if isinstance(node, (ast.AnnAssign, ast.arg)) and getattr(node, "annotation", None):
            all_of(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            all_of(node.returns)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                all_of(decorator)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            all_of(node)
        if isinstance(node, ast.Raise) and node.exc is not None:
            for arg in getattr(node.exc, "args", []):
                all_of(arg)
    return skip


def _sites(tree: ast.Module):
    """``(node, change, replacement, description)`` for every mutation site, in walk order."""
    skip = _skipped(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                new = _COMPARE.get(type(op))
                if new is not None:
                    yield node, ("ops", i), new, f"{_SYMBOL[type(op)]} → {_SYMBOL[new]}"
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            new = _BINOP.get(type(node.op))
            if new is not None:
                eq = "=" if isinstance(node, ast.AugAssign) else ""
                what = f"{_SYMBOL[type(node.op)]}{eq} → {_SYMBOL[new]}{eq}"
                yield node, ("op", None), new, what
            if isinstance(node, ast.BinOp) and isinstance(node.op, _DROPPABLE):
                yield node, ("drop-right", None), None, f"a {_SYMBOL[type(node.op)]} b → a"
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            yield node, ("op", None), new, f"{_SYMBOL[type(node.op)]} → {_SYMBOL[new]}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            what = "not x → x" if isinstance(node.op, ast.Not) else "-x → x"
            yield node, ("drop-unary", None), None, what
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
        if isinstance(node, ast.AugAssign) and isinstance(node.op, _DROPPABLE):
            yield node, ("drop-stmt", None), None, f"{_SYMBOL[type(node.op)]}= update dropped"


def mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source``."""
    lines = source.splitlines()
    seen: Counter = Counter()
    found = []
    for i, (node, _, _, what) in enumerate(_sites(ast.parse(source))):
        code = lines[node.lineno - 1].strip()
        seen[code, what] += 1
        found.append(Mutant(i, node.lineno, what, code, seen[code, what]))
    return found


def _replacement(node: ast.AST, change: tuple[str, int | None], new) -> str:
    """The mutated node's text (an expression in parentheses)."""
    name, i = change
    if name == "drop-stmt":
        return "pass"
    if name == "drop-unary":
        return f"({ast.unparse(node.operand)})"  # type: ignore[attr-defined]
    if name == "drop-right":
        return f"({ast.unparse(node.left)})"  # type: ignore[attr-defined]
    if name == "ops":
        node.ops[i] = new()  # type: ignore[attr-defined]
    elif name == "op":
        node.op = new()  # type: ignore[attr-defined]
    elif name == "value":
        node.value = new  # type: ignore[attr-defined]
    elif name == "attr":
        node.attr = new  # type: ignore[attr-defined]
    text = ast.unparse(node)
    return text if isinstance(node, ast.stmt) else f"({text})"


def mutate(source: str, index: int) -> str:
    """``source`` with mutant ``index`` applied: the mutated node's text replaced, nothing else."""
    tree = ast.parse(source)
    node, change, new, _ = next(s for i, s in enumerate(_sites(tree)) if i == index)
    # the syntax tree's columns count UTF-8 bytes
    lines = source.encode().splitlines(keepends=True)
    start = sum(len(b) for b in lines[: node.lineno - 1]) + node.col_offset
    end = sum(len(b) for b in lines[: node.end_lineno - 1]) + node.end_col_offset
    raw = source.encode()
    text = (raw[:start] + _replacement(node, change, new).encode() + raw[end:]).decode()
    ast.parse(text)  # a mutant is always valid Python
    return text


def _diff(source: str, index: int, name: str) -> str:
    new = mutate(source, index)
    return "".join(
        difflib.unified_diff(
            source.splitlines(keepends=True), new.splitlines(keepends=True), name, name, n=1
        )
    )


def _worktree(base: Path, module: Path) -> Path:
    """A private copy of ``HEAD`` with the working tree's uncommitted ``.py`` files."""
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
    """Run pytest on ``tree``: ``(outcome, seconds, detail)``."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header"]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(
        [*cmd, *tests], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,  # its own process group: spawned ranks included
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", time.monotonic() - start, f"over {timeout:.0f} s"
    finally:
        try:  # whatever it left running (a rank that outlived pytest)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = out.strip().splitlines() or [""]
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    detail = (failed[0] if failed else lines[-1])[:300]
    if proc.returncode == 0:
        return "survived", time.monotonic() - start, detail
    return ("killed" if proc.returncode == 1 else "error"), time.monotonic() - start, detail


def _same_as(
    every: list[Mutant], path: str, survivors: bool = False
) -> tuple[list[Mutant], list[dict]]:
    """The mutants of an earlier summary (``survivors``: its survivors only), matched by their
    line's text, operator and place among equal ones; and those no longer found."""
    by_key = {(m.code, m.what, m.nth): m for m in every}
    chosen, missing = [], []
    for r in json.loads(Path(path).read_text())["survivors" if survivors else "results"]:
        m = by_key.get((r["code"], r["what"], r["nth"]))
        if m is None:
            missing.append(r)
        else:
            chosen.append(m)
    return chosen, missing


def run(
    module: str, tests: list[str], *, limit: int | None, seed: int, jobs: int,
    same_as: str | None = None, survivors: bool = False,
) -> dict:  # fmt: skip
    path = Path(module)
    source = (ROOT / path).read_text()
    every = mutants(source)
    missing: list[dict] = []
    if same_as:
        chosen, missing = _same_as(every, same_as, survivors)
    else:
        chosen = list(every)
        random.Random(seed).shuffle(chosen)
        chosen = chosen[:limit] if limit else chosen
    chosen = sorted(chosen, key=lambda m: m.index)
    base = Path(tempfile.mkdtemp(prefix="pmlfunc-mutation-"))
    began = time.monotonic()
    trees = [_worktree(base, path) for _ in range(max(1, jobs))]
    try:
        outcome, baseline, last = _pytest(trees[0], tests, timeout=3600)
        if outcome != "survived":
            raise SystemExit(f"the tests fail before any mutation ({last}); fix them first")
        timeout = 3 * baseline + 30
        print(f"{module}: {len(every)} mutants, running {len(chosen)}; unmutated tests "
              f"{baseline:.0f} s ({last}), limit {timeout:.0f} s a mutant", flush=True)  # fmt: skip
        for r in missing:
            print(f"  not found: line {r['line']}: {r['what']}: {r['code']}", flush=True)
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
            print(f"  #{m.index:<4d} line {m.line:4d}  {m.what:16s} {mark:8s} ({secs:3.0f} s)  "
                  f"{m.code[:60]}", flush=True)  # fmt: skip
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
        "seed": seed,
        "same_as": same_as,
        "not_found": missing,
        "baseline_seconds": round(baseline, 1),
        "seconds": round(time.monotonic() - began, 1),
        "survivors": [asdict(r.mutant) for r in results if r.outcome == "survived"],
        "results": [
            {**asdict(r.mutant), "outcome": r.outcome, "seconds": round(r.seconds, 1), "detail": r.detail}
            for r in results
        ],
    }  # fmt: skip
    print(f"{module}: killed {killed} of {len(results)} ({100 * summary['kill_rate']:.0f} %) "
          f"in {summary['seconds'] / 60:.1f} min")  # fmt: skip
    for s in summary["survivors"]:
        print(f"  survivor #{s['index']}: line {s['line']}: {s['what']}: {s['code']}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("module", help="the module to mutate, e.g. pmlfunc/reducers.py")
    parser.add_argument("--max", type=int, default=None, help="run at most this many mutants")
    parser.add_argument("--seed", type=int, default=0, help="the order --max takes them in")
    parser.add_argument("--same-as", default=None, help="run the mutants of this earlier summary")
    parser.add_argument(
        "--survivors", action="store_true", help="with --same-as: only that run's survivors"
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--show", type=int, default=None, help="print this mutant as a diff")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument(
        "tests", nargs=argparse.REMAINDER, help="pytest's arguments: test files, -k, -m ..."
    )
    args = parser.parse_args(argv)
    source = (ROOT / args.module).read_text()
    if args.list:
        for m in mutants(source):
            print(f"{m.index:4d}  line {m.line:4d}  {m.what:16s} {m.code}")
        return {}
    if args.show is not None:
        print(_diff(source, args.show, args.module), end="")
        return {}
    if not args.tests:
        parser.error("name the test files to run")
    summary = run(
        args.module, args.tests, limit=args.max, seed=args.seed, jobs=args.jobs,
        same_as=args.same_as, survivors=args.survivors,
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    return summary


if __name__ == "__main__":
    main()
