"""The local record of every audit: written before anything is sent to a tracking server.

An audit's record is a folder holding ``record.json`` (config, figures, verdicts, facts) and one
Parquet file per scored variant (per-token and per-window NLL). MLflow runs are made from the record,
so nothing computed is lost when the tracking server is down, and ``ppl-audit sync`` replays it later.

A record is written in a hidden partial folder and renamed into place once complete, so a folder in
the spool is whole or not there; the process that replays a record holds a lock on it (``claim``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core import console, sealed
from tasks.core.files import died, owner_tag, write_atomically
from tasks.core.places import quarantine_dir, spool_dir, synced_dir

# a record being written: ``.partial-<pid>@<host>@<folder>``, hidden from ``pending()`` until renamed to <folder>
PARTIAL = ".partial-"

Claim = Literal["mine", "busy", "gone"]


def record_json(record: dict) -> str:
    return json.dumps(record, indent=2, default=str)


def sealed_record_json(record: dict) -> str:
    """``record.json``'s text: the record with the digest of its content (``sealed.seal``), computed on the record as
    its JSON reads back (keys made strings, tuples lists, other values ``str``-ed) so that a reader's digest is of the
    same fields. The spool writes it and tracking logs it: an edit to either copy is told (``record_damage``)."""
    return record_json(sealed.seal(json.loads(record_json(record))))


def record_damage(record: object, where: str) -> str | None:
    """Why a record read back cannot be trusted (``where`` was changed after ppl-audit wrote it), or None. A record
    written before records were sealed has no digest: it is read, with a one-line warning that it is unchecked."""
    if not isinstance(record, dict):
        return f"{where} does not hold a record"
    if sealed.DIGEST not in record:
        print(f"ppl-audit: warning: {where} keeps no digest of its content (written by an older ppl-audit): its "
              "figures are read unchecked", file=console.err())
        return None
    return sealed.damage(record, where)


def folder_name(record: dict) -> str:
    return f"{datetime.fromisoformat(record['created']):%Y%m%dT%H%M%S}-{record['name']}-{record['audit_id'][:8]}"


def write_record(record: dict, arrays: dict[str, pa.Table]) -> Path:
    """Write an audit's record into the spool and return its folder; raises OSError when it cannot.

    The files go into a hidden partial folder renamed into place after ``record.json``, so a killed
    or failed write never leaves a folder ``pending()`` would list; a failed one leaves nothing.
    """
    root = spool_dir()
    root.mkdir(parents=True, exist_ok=True)
    sweep_partials()
    folder = root / folder_name(record)
    partial = root / f"{PARTIAL}{owner_tag()}@{folder.name}"
    try:
        partial.mkdir()
        for name, table in arrays.items():
            pq.write_table(table, partial / name)
        # the arrays' sizes and sha256, checked before a replay (``spooled_damage``); record.json is not in it: it keeps its
        # own digest (``sealed_record_json``), which a person who mends a quarantined one removes
        write_atomically(partial / FILES, json.dumps(sealed.seal({"files": sealed.files_entry(partial, arrays)})))
        write_atomically(partial / "record.json", sealed_record_json(record))
        partial.rename(folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder


def _dead_writer(partial: Path) -> str | None:
    """The folder name a partial folder was to get, when the process writing it died."""
    owner, _, folder = partial.name.removeprefix(PARTIAL).rpartition("@")
    return folder if folder and died(owner) else None


def sweep_partials() -> None:
    """Deal with the partial folders of writers that died: a complete record (``record.json`` is written
    last, whole) is put in place, anything else is removed."""
    root = spool_dir()
    for partial in sorted(root.iterdir()) if root.is_dir() else []:
        folder = _dead_writer(partial) if partial.name.startswith(PARTIAL) else None
        if folder is None:
            continue
        if (partial / "record.json").is_file():
            try:
                partial.rename(root / folder)
            except FileNotFoundError:  # another sweep got there first
                continue
            print(f"ppl-audit: recovered the record {folder}, complete when the process writing it died",
                  file=console.err())
        else:
            shutil.rmtree(partial, ignore_errors=True)  # one that cannot be removed now is tried again next time
            print(f"ppl-audit: removed {partial.name}, an unfinished record of a process that died", file=console.err())


# what replaying a record reads of it, at the top and for each model, and of which type
RECORD_TYPES = {"name": str, "audit_id": str, "created": str, "verdict": dict, "variants": list, "config": dict,
                "table": str, "corpus": dict}
ENTRY_TYPES = {"name": str, "role": str, "status": str, "row": dict, "spec": dict, "reason": (str, type(None))}
OPTIONAL_ENTRY_TYPES = {"verdict": (dict, type(None)), "result": (dict, type(None)), "facts": (dict, type(None)),
                        "manifest": (dict, type(None)), "arrays": (str, type(None))}
FILES = "files.json"  # the per-token arrays' sizes and sha256 (``write_record``)
# what replaying reads of each domain's record in an audit of several (``record["domains"]``: the rest is the top's)
DOMAIN_TYPES = {"verdict": dict, "variants": list, "config": dict, "table": str, "corpus": dict}


def _entries(record: dict) -> list:
    """Every model's entry a replay reads: the top's and, in an audit of several domains, each domain's."""
    domains = record.get("domains", {})
    return list(record["variants"]) + [entry for domain in domains.values() if isinstance(domain.get("variants"), list)
                                       for entry in domain["variants"]]


def _wrong_fields(record: dict) -> str | None:
    """The fields a replay reads that are missing or of another type, in words; None when all are there."""
    domains = record.get("domains", {})  # an audit of several domains: each one's record
    if not isinstance(domains, dict) or not all(isinstance(domain, dict) for domain in domains.values()):
        return "record.json holds a value of the wrong type in domains"
    missing = [key for key in RECORD_TYPES if key not in record]
    missing += sorted(f"domains.{name}.{key}" for name, domain in domains.items() for key in DOMAIN_TYPES
                      if key not in domain)
    if not missing and isinstance(record["variants"], list):
        missing = sorted({f"variants[].{key}" for entry in _entries(record) for key in ENTRY_TYPES
                          if not isinstance(entry, dict) or key not in entry})
    if missing:
        return f"record.json lacks {', '.join(missing)}"
    wrong = [key for key, kind in RECORD_TYPES.items() if not isinstance(record[key], kind)]
    wrong += sorted(f"domains.{name}.{key}" for name, domain in domains.items() for key, kind in DOMAIN_TYPES.items()
                    if not isinstance(domain[key], kind))
    if not wrong:
        wrong = sorted({f"variants[].{key}" for entry in _entries(record)
                        for key, kind in (ENTRY_TYPES | OPTIONAL_ENTRY_TYPES).items()
                        if not isinstance(entry.get(key), kind)})
    if not wrong and not isinstance(record["config"].get("tracking"), dict):
        wrong = ["config.tracking"]
    if wrong:
        return f"record.json holds a value of the wrong type in {', '.join(wrong)}"
    try:
        datetime.fromisoformat(record["created"])
    except ValueError:
        return f"record.json's created ({record['created'][:40]}) is not a time"
    return None


def _arrays_damage(folder: Path, record: dict) -> str | None:
    """What is wrong with a record's per-token arrays: against their sizes and sha256 (``FILES``), or for a record
    spooled before those were kept, whether each is there and a Parquet file."""
    named = {entry["arrays"] for entry in _entries(record) if entry.get("arrays")}  # every domain's: ``DOMAIN.MODEL``
    if (folder / FILES).is_file():
        kept = sealed.read_entry(folder / FILES)
        return sealed.damage(kept, FILES) or sealed.files_damage(folder, kept.get("files"), named)
    for name in sorted(named):
        try:
            pq.read_metadata(folder / name)
        except (OSError, pa.ArrowException) as error:
            return f"{name} is missing or not a Parquet file ({type(error).__name__})"
    return None


def spooled_damage(folder: Path) -> str | None:
    """Why a spooled record cannot be replayed however often it is tried (not JSON, a field missing or of the wrong
    type, changed after it was written, its per-token arrays missing or not as written), or None. Reads its arrays
    once (their sha256)."""
    try:
        record = read_record(folder)
    except (OSError, ValueError) as error:
        return f"record.json is not readable JSON ({type(error).__name__}: {str(error)[:100]})"
    if not isinstance(record, dict):
        return "record.json does not hold a record"
    return _wrong_fields(record) or _changed(folder, record) or _arrays_damage(folder, record)


def _changed(folder: Path, record: dict) -> str | None:
    """That record.json was changed after it was written, and how to send it anyway; None when it was not."""
    problem = record_damage(record, f"{folder.name}/record.json")
    return problem and f"{problem}: its figures are not the audit's; to send it as it now is, remove its " \
                       f"\"{sealed.DIGEST}\" field"


def quarantine(folder: Path) -> Path:
    """Move a damaged record out of the spool, so later syncs go on with the others; returns where it went."""
    target = quarantine_dir() / folder.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(target))
    return target


def read_record(folder: Path) -> dict:
    return json.loads((folder / "record.json").read_text())


def pending() -> list[Path]:
    """Spooled audits not yet in a tracking server, oldest first."""
    root = spool_dir()
    found = root.iterdir() if root.is_dir() else []
    return sorted(p for p in found if not p.name.startswith(".") and (p / "record.json").is_file())


@contextmanager
def claim(folder: Path, wait: bool = False) -> Iterator[Claim]:
    """Hold a pending record for as long as it is replayed and moved to synced/, against other processes.

    Yields "mine", "busy" (another process holds it; only when not ``wait``) or "gone" (another process
    synced it since it was listed). The lock is on record.json's open file, which moves along with its
    folder, and the kernel drops it with its process: a killed sync leaves no record locked.
    """
    path = folder / "record.json"
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        yield "gone"
        return
    with handle:
        yield _lock(handle, path, wait)


def _lock(handle: IO[bytes], path: Path, wait: bool) -> Claim:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return "busy"
    try:  # the process that held it before may have synced the record and moved it away meanwhile
        still_pending = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        still_pending = False
    return "mine" if still_pending else "gone"


def mark_synced(folder: Path) -> None:
    """Move a record out of the pending spool once its runs are in the tracking server."""
    done = synced_dir()
    done.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(done / folder.name))
