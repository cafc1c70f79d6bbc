"""CI runs the README's test command verbatim, type checks included."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [ln for b in blocks for ln in b.splitlines() if "python -m pytest" in ln]
    assert len(lines) == 1, f"expected one README test command, found {lines}"
    return lines[0].strip()


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    after = ci[ci.index("# README: test") + 1].strip()
    assert after == _readme_test_command()


def test_the_readme_test_command_type_checks_with_mypy_and_pyright_before_pytest():
    steps = [s.strip() for s in _readme_test_command().split("&&")]
    assert "mypy" in steps and "pyright" in steps
    assert steps.index("mypy") < steps.index("python -m pytest")
    assert steps.index("pyright") < steps.index("python -m pytest")
