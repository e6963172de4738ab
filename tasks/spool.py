"""The local record of every audit: written before anything is sent to a tracking server.

An audit's record is a folder holding ``record.json`` (config, figures, verdicts, facts) and one
Parquet file per scored variant (per-token and per-window NLL). MLflow runs are made from the record,
so nothing computed is lost when the tracking server is down, and ``ppl-audit sync`` replays it later.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tasks.audit import Evaluation, VariantResult
from tasks.config import AuditConfig
from tasks.files import write_atomically
from tasks.variants import versions


def home() -> Path:
    """Where audit records live: ``$PPL_AUDIT_HOME``, default ``~/.ppl-audit``."""
    return Path(os.environ.get("PPL_AUDIT_HOME", Path.home() / ".ppl-audit"))


def spool_dir() -> Path:
    return home() / "spool"


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


def write_record(config: AuditConfig, config_path: str, scored: Evaluation, summary: dict,
                 results: list[VariantResult]) -> Path:
    """Write an audit's record into the spool and return its folder."""
    created = datetime.now(timezone.utc)
    audit_id = uuid.uuid4().hex
    folder = spool_dir() / f"{created:%Y%m%dT%H%M%S}-{config.name}-{audit_id[:8]}"
    folder.mkdir(parents=True)
    verdicts = {v.name: {"status": v.status, "reason": v.reason} for v in summary["verdicts"]}
    variants = []
    for outcome, row in zip(results, summary["rows"]):
        spec = config.baseline if outcome.name == config.baseline.name else next(
            v for v in config.variants if v.name == outcome.name)
        entry = {"name": outcome.name, "role": "baseline" if spec is config.baseline else "variant",
                 "spec": spec.model_dump(mode="json"), "status": outcome.status, "reason": outcome.reason,
                 "row": row, "verdict": verdicts.get(outcome.name), "manifest": outcome.manifest,
                 "result": outcome.result.summary() if outcome.result else None,
                 "facts": outcome.facts.summary() if outcome.facts else None}
        if outcome.result is not None:
            entry["arrays"] = f"{outcome.name}.parquet"
            pq.write_table(_arrays(outcome), folder / entry["arrays"])
        variants.append(entry)
    stream = scored.stream
    record = {
        "audit_id": audit_id, "name": config.name, "created": created.isoformat(),
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
    write_atomically(folder / "record.json", json.dumps(record, indent=2, default=str))
    return folder


def read_record(folder: Path) -> dict:
    return json.loads((folder / "record.json").read_text())


def pending() -> list[Path]:
    """Spooled audits not yet in a tracking server, oldest first."""
    root = spool_dir()
    return sorted(p for p in root.iterdir() if (p / "record.json").is_file()) if root.is_dir() else []


def mark_synced(folder: Path) -> None:
    """Move a record out of the pending spool once its runs are in the tracking server."""
    done = spool_dir().parent / "synced"
    done.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(done / folder.name))
