"""Type checking is part of the test suite, as lint is (tests/test_lint.py): CI's one test command runs mypy too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)  # a cold cache: about 10 s on two cores; warm, under a second
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[test]' installs it)")
def test_mypy_finds_nothing() -> None:
    # The configuration (third-party modules without types, the strict pure cores, the cache under
    # build/) is pyproject.toml's [tool.mypy].
    done = subprocess.run([sys.executable, "-m", "mypy", "pwmesh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
