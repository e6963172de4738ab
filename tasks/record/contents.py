"""An audit's record: everything it computed, as plain data (``audit_record``) and per-token tables
(``token_arrays``), which the spool keeps and tracking replays."""

from __future__ import annotations

import os
import platform
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from tasks.config import AuditConfig
from tasks.core.places import embedded_corpus_name
from tasks.core.versions import versions
from tasks.data.evaluation import Evaluation
from tasks.record.results import VariantResult
from tasks.record.serial import SCHEMA

if TYPE_CHECKING:
    from tasks.engine.perplexity import PerplexityResult
    from tasks.record.result import DomainResult, Findings
    from tasks.record.row import ModelRow

def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def corpus_location(source: str) -> str:
    """Where the corpus text lives: a resolved path, or the Hub dataset id as given."""
    embedded = embedded_corpus_name(source)
    if embedded is not None:
        from tasks.data.embedded import embedded_corpus_dir

        return str(embedded_corpus_dir(embedded))
    return source if source.startswith("hf:") else str(Path(source).resolve())


def token_windows(result: PerplexityResult) -> np.ndarray:
    """The plan's index of the window of each token of a result's token arrays (a stopped run's hold a sample
    of the windows)."""
    windows = np.arange(len(result.window_tokens)) if result.scored_windows is None else result.scored_windows
    return np.repeat(windows, result.window_tokens)  # windows score consecutive stretches, in order


def _arrays(outcome: VariantResult) -> pa.Table:
    r = outcome.result
    columns = {"token": np.arange(len(r.token_nll)), "window": token_windows(r), "nll": r.token_nll}
    columns |= dict(r.extra)  # its divergence from the baseline, each figure measured by its name (``TokenFigures``)
    return pa.table(columns)


def arrays_file(outcome: VariantResult) -> str | None:
    """The record's Parquet file of a variant's per-token figures; None when it was not scored."""
    return f"{outcome.name}.parquet" if outcome.result is not None else None


@dataclass(frozen=True)
class Started:
    """When an audit began (``at``; its record's ``created``, when it ended, is taken as the record is made), and
    whether Prefect's schedule started it (``ppl-audit compare`` says what moved from one scheduled run to the next)."""

    at: datetime
    scheduled: bool = False


def audit_record(config: AuditConfig, config_path: str, scored: Evaluation, judged: DomainResult,
                 started: Started) -> dict:
    """A domain's record, as its one-corpus audit's: everything it computed but the per-token arrays
    (``token_arrays``)."""
    created = datetime.now(timezone.utc)
    verdicts = {v.name: v.as_record() for v in judged.verdicts}
    variants = [_entry(config, outcome, row, verdicts.get(outcome.name), judged.findings)
                for outcome, row in zip(judged.results, judged.rows)]
    stream = scored.stream
    return {
        "schema": SCHEMA, "audit_id": uuid.uuid4().hex, "name": config.name, "started": started.at.isoformat(),
        "created": created.isoformat(), "scheduled": started.scheduled,
        "config": config.model_dump(mode="json"), "config_path": str(config_path),
        "config_text": Path(config_path).read_text() if Path(config_path).is_file() else "",
        "corpus": {"source": config.corpus.source, "location": corpus_location(config.corpus.source),
                   "digest": stream.text_digest, "n_tokens": int(stream.ids.numel()),
                   "n_bytes": stream.n_bytes, "bos": stream.bos, "tokenizer": scored.tokenized_by,
                   "hf_config": config.corpus.hf_config,
                   "hf_split": config.corpus.hf_split},
        "environment": {"hardware": hardware(), "python": platform.python_version(),
                        "versions": versions("gptqmodel", "bitsandbytes", "torchao", "optimum", "prefect", "mlflow")},
        "verdict": judged.verdict.as_record(),
        "table": judged.table,
        "variants": variants,
        # which tokens were scored, named (tasks.audit.population), and the noise floor's rows (tasks.audit.floor)
        "population": judged.population,
        # the lines under its table, apart (schema 2): what llama.cpp's runtime costs, and its tokenizer's stream
        "runtime_costs": list(judged.runtime_costs), "tokens_differ": judged.tokens_differ,
        "floor": [{"name": row.variant, "dtype": row.floor_of, "row": row.as_record()} for row in judged.floor],
    }


def _entry(config: AuditConfig, outcome: VariantResult, row: ModelRow, verdict: dict | None,
           findings: Findings) -> dict:
    """A model's entry of the record, its keys in the order records have always held them: those every entry has,
    then those only some have."""
    baseline = outcome.name == config.baseline.name
    spec = config.baseline if baseline else next(v for v in config.variants if v.name == outcome.name)
    arrays = arrays_file(outcome)
    return ({"name": outcome.name, "role": "baseline" if baseline else "variant", "spec": spec.model_dump(mode="json"),
             "status": outcome.status, "reason": outcome.reason, "row": row.as_record(), "verdict": verdict,
             "manifest": outcome.manifest, "result": outcome.result.summary() if outcome.result else None,
             "facts": outcome.facts.summary() if outcome.facts else None, "started": outcome.started,
             "ended": outcome.ended}
            | ({"arrays": arrays} if arrays else {})
            # where each slice of its windows ran, and any try that failed before
            | ({"shards": [row.as_record() for row in outcome.shards]} if outcome.shards else {})
            # the order's seed, how much was scored, the bounds at a stop
            | ({"sequential": outcome.sequential.as_record()} if outcome.sequential else {})
            | ({"where": findings.where[outcome.name]} if outcome.name in findings.where else {})
            | ({"diagnosis": findings.diagnoses[outcome.name]} if outcome.name in findings.diagnoses else {})
            # the record's dict of the baseline's reference, as it has always been written
            | ({"reference": outcome.reference.as_record() if outcome.reference else {}} if baseline else {}))


def token_arrays(results: list[VariantResult]) -> dict[str, pa.Table]:
    """The per-token figures of every scored variant, by the record's file name for them."""
    return {arrays_file(outcome): _arrays(outcome) for outcome in results if arrays_file(outcome)}
