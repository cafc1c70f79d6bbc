"""Every ```python block of the documentation runs as written, on its own.

The pages are README.md, docs/*.md and docs/guides/*.md. Each block is one test, named
``<page>:<line of the opening fence>``, and runs in a fresh namespace with its own imports and
made-up data: a reader can copy any block and run it. Tracebacks point at the Markdown page and
the line in it. A 0-d tensor named ``loss`` that a block leaves behind must be finite.

A block that cannot run in this process says why in a first-line marker comment, which readers
see as well, ``# doc-test: <mode> (<reason>)``:

- ``needs-cuda``: run only where CUDA is available (CUDA graphs have no CPU fallback);
- ``script``: run as ``python <block>.py``, as ``__main__`` in a new process (e.g. it spawns
  processes that import its functions from ``__main__``);
- ``torchrun``: run on two CPU ranks, as ``torchrun --standalone --nproc_per_node=2 <block>.py``
  would (the same environment variables, without torchrun's agent).

Keep these rare; an unknown mode or a marker without a reason fails the block's test.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]
MODES = {"needs-cuda", "script", "torchrun"}
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_MARKER = re.compile(r"#\s*doc-test:\s*(?P<mode>[\w-]+)\s*(?P<reason>.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced python block: its page (relative to the repository), the line of its opening
    fence (1-based) and its source, dedented by the fence's indentation."""

    page: str
    line: int
    source: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def marker(self) -> tuple[str, str] | None:
        """``(mode, reason)`` from a ``# doc-test:`` comment on the first line, else ``None``."""
        first = self.source.split("\n", 1)[0].strip()
        m = _MARKER.fullmatch(first)
        return (m["mode"], m["reason"].strip(" ()—-")) if m else None


def python_blocks(text: str, page: str) -> list[Block]:
    """The fenced code blocks whose info string's first word is ``python`` or ``py``.

    A fence closes on a line of the same character, at least as long, with nothing after it
    (CommonMark); a ```python line inside another fenced block is that block's content.
    """
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].split()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if info and info[0] in ("python", "py"):
            body = [
                line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1 : j]
            ]
            blocks.append(Block(page, i + 1, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    blocks = []
    for path in PAGES:
        page = path.relative_to(ROOT).as_posix()
        blocks += python_blocks(path.read_text(encoding="utf-8"), page)
    return blocks


def _params() -> list:
    params = []
    for block in all_blocks():
        marks = []
        mode = block.marker[0] if block.marker else None
        if mode == "needs-cuda":
            marks.append(pytest.mark.cuda)
        if mode in ("script", "torchrun"):  # new processes, each importing torch
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


def _run_in_process(block: Block) -> dict:
    # Line numbers of the compiled code are those of the page, so a traceback shows the page's
    # line; the namespace is fresh and the global RNG seeded, so every run draws the same data.
    code = compile("\n" * block.line + block.source, str(ROOT / block.page), "exec")
    scope: dict = {"__name__": "__doc_block__"}
    torch.manual_seed(0)
    exec(code, scope)
    return scope


# Printed after a rank's last line: the block ran to its end (see _teardown_abort).
_DONE = "__doc_block_done__"


def _write_script(block: Block, tmp_path: Path, epilogue: str = "") -> Path:
    script = tmp_path / (re.sub(r"\W", "_", block.id) + ".py")
    script.write_text(block.source + epilogue, encoding="utf-8")
    return script


def _teardown_abort(returncode: int, out: str, err: str) -> bool:
    """A rank that ran the whole block (barrier and ``destroy_process_group`` included) and then
    aborted while the interpreter shut down: PyTorch 2.13's CPU gloo teardown race after a
    backward through collectives (``terminate called without an active exception`` from a
    native thread; ~1 run in 8 with DDP alone and a plain loss, no pmlfunc call). The block's
    work is done and checked; the crash is torch's, after it."""
    return (
        returncode == -signal.SIGABRT
        and _DONE in out
        and "terminate called without an active exception" in err
    )


def _check_exit(block: Block, procs: list[subprocess.Popen], torchrun: bool = False) -> None:
    """Wait for every process (5 minutes at most); each must exit with status 0 (or, for a
    torchrun block, abort only in torch's teardown race: :func:`_teardown_abort`)."""
    failures = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode != 0 and not (torchrun and _teardown_abort(proc.returncode, out, err)):
            failures.append(f"process {rank}: exit {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}")
    assert not failures, f"{block.id} failed:\n" + "\n".join(failures)


def _popen(script: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as_ranks(block: Block, tmp_path: Path, world_size: int = 2) -> None:
    """What ``torchrun --standalone --nproc_per_node=<world_size>`` does for the script, without
    its agent: one process per rank, with the environment ``init_process_group`` reads."""
    script = _write_script(block, tmp_path, f"\nprint({_DONE!r}, flush=True)\n")
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        env.update(LOCAL_WORLD_SIZE=str(world_size))
        procs.append(_popen(script, env))
    _check_exit(block, procs, torchrun=True)


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    marker = block.marker
    if marker is None:
        scope = _run_in_process(block)
        loss = scope.get("loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            assert torch.isfinite(loss), f"{block.id} leaves a non-finite loss: {loss}"
        return
    mode, reason = marker
    assert mode in MODES, f"{block.id}: unknown '# doc-test:' mode {mode!r} (one of {MODES})"
    assert reason, f"{block.id}: a '# doc-test: {mode}' marker must say why, in the comment"
    if mode == "needs-cuda":
        if not torch.cuda.is_available():
            pytest.skip(f"needs CUDA: {reason}")
        _run_in_process(block)
    elif mode == "script":
        _check_exit(block, [_popen(_write_script(block, tmp_path))])
    else:
        _run_as_ranks(block, tmp_path)


def test_docs_have_python_blocks_on_the_pages_that_teach_the_api() -> None:
    """The collector finds the blocks (a parsing regression would otherwise test nothing)."""
    pages = {b.page for b in all_blocks()}
    for page in ("README.md", "docs/index.md", "docs/concepts.md", "docs/guides/distributed.md"):
        assert page in pages


def test_index_quick_start_is_the_readme_quick_start() -> None:
    """docs/index.md says its quick start is the README's; the two blocks are identical."""

    def quick_start(page: str) -> str:
        text = (ROOT / page).read_text(encoding="utf-8")
        section = text[text.index("## Quick start") :]
        return python_blocks(section, page)[0].source

    assert quick_start("docs/index.md") == quick_start("README.md")


def test_python_blocks_parser_reads_fences_as_commonmark_does() -> None:
    text = "\n".join(
        [
            "intro",
            "```python",  # line 2
            "x = 1",
            "```",
            "````markdown",  # a page showing a python fence: not a block of its own
            "```python",
            "not_run()",
            "```",
            "````",
            "- a list item:",
            "",
            "    ```py title='indented'",  # line 12
            "    y = 2",
            "        z = 3",
            "    ```",
            "~~~python",  # line 16
            "```",  # not a closing fence for ~~~
            "~~~",
            "```bash",
            "echo hi",
            "```",
            "```pythonic",  # another language
            "```",
            "```python",  # unclosed: runs to the end of the page
            "w = 4",
        ]
    )
    blocks = python_blocks(text, "page.md")
    assert [(b.line, b.source) for b in blocks] == [
        (2, "x = 1\n"),
        (12, "y = 2\n    z = 3\n"),
        (16, "```\n"),
        (24, "w = 4\n"),
    ]


def test_marker_gives_mode_and_reason_from_the_first_line_only() -> None:
    block = Block("p.md", 1, "# doc-test: script (the ranks import __main__)\nx = 1\n")
    assert block.marker == ("script", "the ranks import __main__")
    assert Block("p.md", 1, "x = 1\n# doc-test: script (late)\n").marker is None
    assert Block("p.md", 1, "# doc-test: torchrun\n").marker == ("torchrun", "")
