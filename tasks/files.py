"""Files other runs read back: written whole or not at all, and a damaged one set aside, not fatal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename.

    A crash or a full disk leaves the old file (or none), never a truncated one that breaks every later
    run; the temporary file is removed on failure.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_json(path: Path, what: str) -> dict | None:
    """The JSON object in ``path``; None when it is absent or damaged (then one line on stderr says so)."""
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        found = None
    if not isinstance(found, dict):
        print(f"ppl-audit: warning: {what} {path} is damaged; it is ignored and made again", file=sys.stderr)
        return None
    return found
