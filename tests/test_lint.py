"""Lint is part of the test suite, so the README's one test command (which CI runs) checks it too."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[test]' installs it)")
def test_ruff_finds_nothing() -> None:
    # The configuration (rules, line length, import order) is pyproject.toml's [tool.ruff].
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ci_runs_exactly_the_readme_test_command() -> None:
    quickstart = (ROOT / "README.md").read_text().split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [c.strip() for c in re.findall(r"```bash\n(.*?)```", quickstart, re.S) if "pytest" in c]
    assert len(commands) == 1, commands
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert ci == commands
