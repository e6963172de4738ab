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
import platform
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tasks import console
from tasks.audit import Evaluation, VariantResult
from tasks.config import AuditConfig
from tasks.places import home
from tasks.files import died, owner_tag, write_atomically
from tasks.variants import versions


# a record being written: ``.partial-<pid>@<host>@<folder>``, hidden from ``pending()`` until renamed to <folder>
PARTIAL = ".partial-"

Claim = Literal["mine", "busy", "gone"]


def spool_dir() -> Path:
    return home() / "spool"


def synced_dir() -> Path:
    return home() / "synced"


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def corpus_location(source: str) -> str:
    """Where the corpus text lives: a resolved path, or the Hub dataset id as given."""
    if source == "embedded":
        from tasks.embedded import embedded_corpus_dir

        return str(embedded_corpus_dir())
    return source if source.startswith("hf:") else str(Path(source).resolve())


def _arrays(outcome: VariantResult) -> pa.Table:
    r = outcome.result
    windows = np.arange(len(r.window_tokens))
    token_window = np.repeat(windows, r.window_tokens)  # windows score consecutive stretches, in order
    columns = {"token": np.arange(len(r.token_nll)), "window": token_window, "nll": r.token_nll}
    columns |= {key: r.extra[key] for key in ("kl", "kl_bound", "top1") if key in r.extra}
    return pa.table(columns)


def arrays_file(outcome: VariantResult) -> str | None:
    """The record's Parquet file of a variant's per-token figures; None when it was not scored."""
    return f"{outcome.name}.parquet" if outcome.result is not None else None


def audit_record(config: AuditConfig, config_path: str, scored: Evaluation, summary: dict,
                 results: list[VariantResult], started: datetime) -> dict:
    """An audit's record: everything it computed but the per-token arrays (``token_arrays``).

    ``started`` is when the audit began; ``created`` (now) is when it ended.
    """
    created = datetime.now(timezone.utc)
    verdicts = {v.name: {"status": v.status, "reason": v.reason} for v in summary["verdicts"]}
    variants = []
    for outcome, row in zip(results, summary["rows"]):
        spec = config.baseline if outcome.name == config.baseline.name else next(
            v for v in config.variants if v.name == outcome.name)
        entry = {"name": outcome.name, "role": "baseline" if spec is config.baseline else "variant",
                 "spec": spec.model_dump(mode="json"), "status": outcome.status, "reason": outcome.reason,
                 "row": row, "verdict": verdicts.get(outcome.name), "manifest": outcome.manifest,
                 "result": outcome.result.summary() if outcome.result else None,
                 "facts": outcome.facts.summary() if outcome.facts else None,
                 "started": outcome.started, "ended": outcome.ended}
        if arrays_file(outcome):
            entry["arrays"] = arrays_file(outcome)
        variants.append(entry)
    stream = scored.stream
    return {
        "audit_id": uuid.uuid4().hex, "name": config.name, "started": started.isoformat(), "created": created.isoformat(),
        "config": config.model_dump(mode="json"), "config_path": str(config_path),
        "config_text": Path(config_path).read_text() if Path(config_path).is_file() else "",
        "corpus": {"source": config.corpus.source, "location": corpus_location(config.corpus.source),
                   "digest": stream.text_digest, "n_tokens": int(stream.ids.numel()),
                   "n_bytes": stream.n_bytes, "bos": stream.bos, "hf_config": config.corpus.hf_config,
                   "hf_split": config.corpus.hf_split},
        "environment": {"hardware": hardware(), "python": platform.python_version(),
                        "versions": versions("gptqmodel", "bitsandbytes", "torchao", "optimum", "prefect", "mlflow")},
        "verdict": {"status": summary["verdict"].status, "reason": summary["verdict"].reason},
        "table": summary["table"],
        "variants": variants,
    }


def token_arrays(results: list[VariantResult]) -> dict[str, pa.Table]:
    """The per-token figures of every scored variant, by the record's file name for them."""
    return {arrays_file(outcome): _arrays(outcome) for outcome in results if arrays_file(outcome)}


def record_json(record: dict) -> str:
    return json.dumps(record, indent=2, default=str)


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
        write_atomically(partial / "record.json", record_json(record))
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
