"""The code follows the lint rules pyproject.toml's ``[tool.ruff]`` selects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_follows_the_configured_lint_rules():
    # --no-cache: nothing written into the checkout; the rules and exclusions are pyproject.toml's
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stdout + found.stderr
