"""An audit's record read back as the ``AuditResult`` it was written from (``from_record``), so that a view of a
record (``card``, ``compare``, a replayed audit) reads the value the live audit's views read.

``SCHEMA`` is the record's version, written at its top (``schema``). A record without one was written before the
version was kept (schema 1, before 2026-11-29): it reads the same, without the lines under a domain's table that
it did not keep apart (each domain's ``runtime_costs`` and ``tokens_differ``: its ``table`` still says them).
Light: no torch, so that ``sync`` and ``ui`` stay quick.
"""

from __future__ import annotations

from tasks.config import ONE_CORPUS
from tasks.record.result import AuditResult, DomainResult, Findings
from tasks.record.row import ModelRow
from tasks.record.verdict_said import Verdict

SCHEMA = 2


class UnknownSchema(ValueError):
    """A record written by a later ppl-audit than this one: its fields may mean what this one cannot tell."""


def _judged(record: dict) -> tuple[tuple[ModelRow, ...], tuple[Verdict, ...], Verdict]:
    """What a record (an audit's, or a domain's under ``domains``) judged: each model's row, the baseline first, each
    variant's verdict and its own."""
    entries = record["variants"]
    return (tuple(ModelRow.of_record(entry["row"]) for entry in entries),
            tuple(Verdict.of_record(entry["name"], entry["verdict"]) for entry in entries[1:]),
            Verdict.of_record("audit", record["verdict"]))


def _domain(name: str, record: dict) -> DomainResult:
    """Domain ``name`` of a record: its one-corpus audit's record (``domain_view``)."""
    variants = record["variants"][1:]
    rows, verdicts, verdict = _judged(record)
    return DomainResult(
        name, (), rows, verdicts, verdict, record["table"],
        tuple(ModelRow.of_record(floor["row"]) for floor in record.get("floor", [])),
        tuple(record.get("runtime_costs", [])),
        record.get("population"), record.get("tokens_differ"),
        Findings({e["name"]: e["where"] for e in variants if "where" in e},
                 {e["name"]: e["diagnosis"] for e in variants if "diagnosis" in e}))


def from_record(record: dict) -> AuditResult:
    """The ``AuditResult`` an audit's record was written from, less what a record does not hold: the models' scores
    token by token (``DomainResult.results`` is empty: they are the record's Parquet files) and where the record
    went (``record``, ``mlflow_run_id``: the reader knows)."""
    schema = record.get("schema", 1)
    if schema > SCHEMA:
        raise UnknownSchema(f"the record of audit {record.get('name')} has schema {schema}, and this ppl-audit reads "
                            f"up to {SCHEMA}: read it with a later ppl-audit")
    # a record of one corpus (without ``domains``) is its one domain's record: that domain's figures and verdicts are
    # the audit's own, and its name is never shown (``named`` false)
    domains = record.get("domains") or {ONE_CORPUS: record}
    rows, verdicts, verdict = _judged(record)
    return AuditResult(record["name"], {name: _domain(name, domain) for name, domain in domains.items()},
                       "domains" in record, rows, verdicts, verdict, record["table"],
                       {entry["name"]: entry.get("domain", ONE_CORPUS) for entry in record["variants"][1:]})
