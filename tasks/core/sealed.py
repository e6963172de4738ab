"""What a cache entry keeps so that it is checked when read: its files' sizes and sha256, and a digest of its own fields.

One way for every cache (stored references, quantized checkpoints, token streams, remembered model digests, spooled
records, batch sizes): an entry is written with ``files_entry`` of its files and ``seal``-ed; ``damage`` says what is
wrong with it when it is read. A damaged entry is never used: the caller says so in one line (``warn_remade``) and
makes it again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tasks.core import console
from tasks.core.files import file_digest

DIGEST = "digest"  # the field of an entry that holds the digest of the others


def fields_digest(entry: dict) -> str:
    """sha256 of an entry's fields but its own ``digest``: an edited entry is told from the one written."""
    return hashlib.sha256(json.dumps({k: v for k, v in entry.items() if k != DIGEST}, sort_keys=True,
                                     default=str).encode()).hexdigest()


def seal(entry: dict) -> dict:
    """``entry`` with the digest of its fields in it."""
    return entry | {DIGEST: fields_digest(entry)}


def files_entry(folder: Path, names: Iterable[str], known: dict[str, str] | None = None) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of the files ``names`` in ``folder``; ``known``: the sha256 of files already
    hashed as they were written (not read again)."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": (known or {}).get(name) or file_digest(folder / name)}
            for name in sorted(names)}


def files_damage(folder: Path, files: dict, required: Iterable[str] = ()) -> str | None:
    """What is wrong with the files an entry lists (``files_entry``), None when each holds what was written: one
    missing, of another size, or whose sha256 differs. ``required``: names it must list. Reads every file once."""
    if not isinstance(files, dict):
        return "it lists no files"
    for name in sorted(set(required) | set(files)):
        path = folder / name
        if name not in files or not path.is_file():
            return f"{name} is missing"
        about = files[name]
        if not isinstance(about, dict) or path.stat().st_size != about.get("bytes"):
            return f"{name} holds {path.stat().st_size} bytes, not the {about.get('bytes') if isinstance(about, dict) else '?'} written"
        if file_digest(path) != about.get("sha256"):
            return f"{name} does not hold the bytes written (its sha256 differs)"
    return None


def damage(entry: object, what: str, made_from: dict | None = None) -> str | None:
    """What is wrong with an entry's own fields, None when they are the ones written (``seal``) from ``made_from``: its
    fields of those names equal to them (a cache keyed by a digest of what it was made from may hold, copied or
    renamed into its place, an entry made from something else)."""
    if not isinstance(entry, dict) or DIGEST not in entry:
        return f"{what} keeps no digest of its content (written by an older ppl-audit, or not by ppl-audit)"
    if entry[DIGEST] != fields_digest(entry):
        return f"{what} was changed after it was written"
    for key, value in (made_from or {}).items():
        if entry.get(key) != value:
            shown = f" ({entry.get(key)[:12]}…, not {value[:12]}…)" if isinstance(value, str) and \
                isinstance(entry.get(key), str) and len(value) > 12 else ""  # digests: their heads tell them apart
            return f"{what} was made from another {key.replace('_', ' ')}{shown}"
    return None


def read_entry(path: Path) -> object:
    """The JSON in ``path`` as it is, None when it is not JSON: for ``damage`` to say what is wrong (one line)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def warn_remade(what: str, where: Path | str, problem: str, done: str = "it is removed and made again") -> None:
    """The one line a damaged cache entry gets: what and where it is, what is wrong, what is done instead."""
    print(f"ppl-audit: warning: {what} {where} is damaged: {problem}; {done}", file=console.err())
