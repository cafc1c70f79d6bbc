"""The README's quick start and the examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python block"
    for block in blocks:
        scope: dict = {}
        exec(compile(block, "README.md", "exec"), scope)
        assert isinstance(scope["loss"], torch.Tensor) and torch.isfinite(scope["loss"])


def test_quickstart_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for name in ("contrastive", "triplet_margin", "ntxent", "supcon", "multi_similarity"):
        assert name in out
    assert "nan" not in out.lower()
