"""What an audit answers, read from its ``AuditResult``: the console's text (``ppl-audit run``: the table or every
domain's, ``--stats full``, the verdict and where the record is), its one JSON line (``--json``) and the markdown
Prefect keeps with the run."""

from __future__ import annotations

import json

from tasks.record.result import AuditResult, DomainResult
from tasks.record.row import ModelRow
from tasks.record.verdict import format_stats


def _plain(row: ModelRow, **verdict) -> dict:
    """A row as JSON holds it: JSON has no NaN."""
    return {k: None if isinstance(v, float) and v != v else v for k, v in row.as_record().items()} | verdict


def _models(rows: tuple[ModelRow, ...], verdicts) -> list[dict]:
    baseline, *variants = rows
    return [_plain(baseline, verdict="baseline")] + [_plain(row, verdict=v.status, verdict_reason=v.reason)
                                                     for row, v in zip(variants, verdicts)]


def _domain_json(domain: DomainResult) -> dict:
    return {"models": _models(domain.rows, domain.verdicts), "runtime_costs": list(domain.runtime_costs),
            "population": domain.population, "floor": [_plain(row) for row in domain.floor]}


def answer_json(result: AuditResult) -> str:
    """One JSON line of what an audit found: its verdict and each model's row with its verdict; an audit that names
    its domains gives each model's worst domain's row (``domain``) and, under ``domains``, each domain's verdict and
    rows."""
    verdict = result.verdict
    said = {"audit": result.name, "verdict": verdict.status, "reason": verdict.reason,
            "mlflow_run_id": result.mlflow_run_id, "record": result.record,
            "models": _models(result.rows, result.verdicts)}
    shown = {name: {"verdict": d.verdict.status, "reason": d.verdict.reason} | _domain_json(d)
             for name, d in result.shown.items()}
    # the JSON's two shapes, as the record's: the domains shown by name under ``domains`` (the audit has no lines of
    # its own under its table), or the one corpus's figures as the audit's own
    said |= ({"runtime_costs": [], "population": None, "floor": [], "domains": shown} if shown
             else _domain_json(next(iter(result.domains.values()))))
    return json.dumps(said)


def answer_text(result: AuditResult, by_domain: bool = False, stats: str = "summary") -> str:
    """What ``ppl-audit run`` prints: one line per model (``by_domain``: every domain's table, where the audit names
    them), llama-perplexity's statistics per variant (``stats`` full), the verdict and where the record is."""
    by_domains = result.by_domain_table() if by_domain else ""
    parts = [by_domains or result.table]  # one corpus has no table by domain: its one domain's is the audit's
    for title, domain in result.labelled("domain {}:\n") if stats == "full" else ():
        parts.append(f"\n{title}{format_stats(list(domain.rows))}\n")
    verdict = result.verdict
    parts += [f"verdict: {verdict.said.upper()} — {verdict.reason}", f"record: {result.record}"]
    return "\n".join(parts)


def artifact_markdown(result: AuditResult) -> str:
    """The audit's answer as the markdown artifact Prefect keeps with its run: its table, and every domain's under
    it where the audit names them."""
    verdict = result.verdict
    table = result.by_domain_table()
    by_domain = f"## By domain\n\n```\n{table}\n```\n\n" if table else ""
    return (f"# Audit {result.name}: {verdict.status}\n\n{verdict.reason}\n\n```\n{result.table}\n```\n\n"
            f"{by_domain}Record: {result.record}\n")
