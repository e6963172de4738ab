"""The layout is the architecture: import-linter's contracts in pyproject.toml hold, and they catch a break."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    done = lint(ROOT)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout + done.stderr


def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path):
    """The contracts see what a future change could add: the engine importing the record, a cycle in models."""
    for part in ("flows", "tasks", "pyproject.toml"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, tmp_path / part)
    with open(tmp_path / "tasks/engine/windows.py", "a") as module:
        module.write("\nfrom tasks.record import tracking  # noqa\n")
    with open(tmp_path / "tasks/models/resolve.py", "a") as module:
        module.write("\nfrom tasks.models import loading  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Layers: each imports only those below it BROKEN" in done.stdout, done.stdout
    assert "No import cycle inside any package BROKEN" in done.stdout, done.stdout
    assert "tasks.engine.windows -> tasks.record.tracking" in done.stdout, done.stdout
