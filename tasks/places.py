"""The two folders ppl-audit keeps things in; standard library only, so any command can ask cheaply."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Audit records, the local MLflow store and logs: ``$PPL_AUDIT_HOME``, default ``~/.ppl-audit``."""
    return Path(os.environ.get("PPL_AUDIT_HOME", Path.home() / ".ppl-audit"))


def cache_dir() -> Path:
    """What can be made again (embedded model and corpus, quantized checkpoints, token streams):
    ``$PPL_AUDIT_CACHE``, default ``~/.cache/ppl-audit``."""
    return Path(os.environ.get("PPL_AUDIT_CACHE", Path.home() / ".cache" / "ppl-audit"))


def log_dir() -> Path:
    return home() / "logs"
