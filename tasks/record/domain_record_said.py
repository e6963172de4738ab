"""The record of an audit of several domains (``domains_record``), written from each domain's own
(``tasks.record.contents.audit_record``: what its one-corpus audit would record), each read once, here, into a typed
value (``DomainRecord``). Light: no torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from tasks.record.domain_view_said import SHARED
from tasks.record.entry_said import CorpusSaid
from tasks.record.result import AuditResult


@dataclass(frozen=True)
class DomainRecord:
    """Domain ``name``'s record: its corpus, its population's digest, each model's entry by name (its per-token
    file named ``DOMAIN.FILE``, as the audit's folder holds it), the record whole (``record``: the audit's top is
    its first domain's) and what is its own (``own``: all but ``SHARED``), both with those entries."""

    name: str
    corpus: CorpusSaid
    population: str | None
    entries: Mapping[str, dict]
    record: dict
    own: dict

    @classmethod
    def of_record(cls, name: str, record: dict) -> DomainRecord:
        entries = [entry | {"arrays": f"{name}.{entry['arrays']}"} if entry.get("arrays") else entry
                   for entry in record["variants"]]
        whole = record | {"variants": entries}
        return cls(name, CorpusSaid.of_record(record["corpus"]), (record.get("population") or {}).get("digest"),
                   {entry["name"]: entry for entry in entries}, whole,
                   {key: value for key, value in whole.items() if key not in SHARED})


def domains_record(config: dict, records: dict[str, dict], result: AuditResult) -> dict:
    """The record of an audit of several domains, from each domain's own (``audit_record``: what its one-corpus audit
    would record, under ``domains``): at the top, each model's worst domain's entry (``domain`` names it) with its
    verdict across domains, and the corpus as the sum of the domains'. ``config``: the audit's, every corpus in it.
    A domain's per-token arrays are named ``DOMAIN.MODEL.parquet`` (``domain_arrays``)."""
    said = {name: DomainRecord.of_record(name, record) for name, record in records.items()}
    first = next(iter(said.values()))
    verdicts = {v.name: v.as_record() for v in result.verdicts}
    variants = [said[row.domain].entries[row.variant] | {"domain": row.domain, "row": row.as_record(),
                                                         "verdict": verdicts.get(row.variant)} for row in result.rows]
    return first.record | {"config": config, "corpus": _corpus(list(said.values())),
                           "population": _population(list(said.values())), "floor": [], "runtime_costs": [],
                           "tokens_differ": None, "verdict": result.verdict.as_record(), "table": result.table,
                           "variants": variants, "domains": {name: domain.own for name, domain in said.items()}}


def _corpus(domains: list[DomainRecord]) -> dict:
    """The audit's corpus: its domains' together, its digest of theirs."""
    corpora = [d.corpus for d in domains]
    return {"source": ", ".join(f"{d.name} {d.corpus.source}" for d in domains),
            "location": ", ".join(c.location for c in corpora),
            "digest": hashlib.sha256(" ".join(c.digest for c in corpora).encode()).hexdigest(),
            "n_tokens": sum(c.n_tokens for c in corpora), "n_bytes": sum(c.n_bytes for c in corpora),
            "bos": corpora[0].bos, "hf_config": None, "hf_split": None, "domains": [d.name for d in domains]}


def _population(domains: list[DomainRecord]) -> dict:
    """Which tokens the audit scored: each domain's population's digest, and a digest of them all."""
    populations = {d.name: d.population for d in domains}
    return {"digest": hashlib.sha256(json.dumps(populations).encode()).hexdigest()[:16], "domains": populations}


def domain_arrays(arrays: dict[str, dict]) -> dict:
    """Every domain's per-token tables (by domain, by file name) under the record's names for them."""
    return {f"{name}.{file}": table for name, tables in arrays.items() for file, table in tables.items()}
