"""The folders ppl-audit keeps things in; standard library only, so any command can ask cheaply."""

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


# the embedded corpora, each built into <cache>/corpora/NAME by tasks.data.embedded (its EMBEDDED_CORPORA says from
# what); a corpus source names one as ``embedded`` (austen) or ``embedded:NAME``
EMBEDDED_CORPUS_NAMES = ("austen", "python", "russian", "chinese")


def embedded_corpus_name(source: str) -> str | None:
    """The embedded corpus a corpus source names (``embedded`` is austen), or None for a source of another kind.
    An unknown ``embedded:NAME`` is an InputError of one line naming the known corpora."""
    from tasks.core.errors import InputError

    if source == "embedded":
        return "austen"
    if not source.startswith("embedded:"):
        return None
    name = source.removeprefix("embedded:")
    if name not in EMBEDDED_CORPUS_NAMES:
        raise InputError(f"no embedded corpus '{name}'; give embedded (austen) or embedded:NAME with NAME one of "
                         f"{', '.join(EMBEDDED_CORPUS_NAMES)}")
    return name


def references_dir() -> Path:
    """Stored baseline references (``tasks.audit.reference``): ``$PPL_AUDIT_REFERENCES``, default
    ``<cache>/references``. A 70B baseline's takes gigabytes: put them on a disk that has room."""
    return Path(os.environ.get("PPL_AUDIT_REFERENCES", cache_dir() / "references"))


def spool_dir() -> Path:
    """Audit records not yet in a tracking server (``tasks.record.spool``)."""
    return home() / "spool"


def synced_dir() -> Path:
    """Audit records already in one."""
    return home() / "synced"


def quarantine_dir() -> Path:
    """Spooled records too damaged to replay, set aside for a person to inspect."""
    return home() / "quarantine"


def log_dir() -> Path:
    return home() / "logs"


def check_places() -> None:
    """Refuse, in one line, a folder setting that names a file (or lies under one): every command would otherwise
    crash with ``NotADirectoryError`` the first time it writes there, after loading a model."""
    from tasks.core.errors import InputError

    for variable, place in (("PPL_AUDIT_HOME", home), ("PPL_AUDIT_CACHE", cache_dir),
                            ("PPL_AUDIT_REFERENCES", references_dir)):
        if variable in os.environ and not os.environ[variable].strip():  # Path("") would be the current folder
            raise InputError(f"{variable} is set but empty; unset it for its default, or name a folder")
        folder = place()
        found = next((path for path in (folder, *folder.parents) if path.exists()), None)
        if found is not None and not found.is_dir():
            raise InputError(f"{variable} {folder}: {found} is a file, not a folder; set {variable} to a folder "
                             "(it is made where missing)")


def default_uri() -> str:
    return f"sqlite:///{home() / 'mlflow.db'}"

def tracking_uri(configured: str | None = None) -> str:
    """The config's URI, else ``MLFLOW_TRACKING_URI``, else the local SQLite store."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
