"""An audit of several corpora judged as one: each variant by its worst domain, the audit by its variants.

Each domain was scored and judged as its one-corpus audit would be (its own token stream, reference and gates), so
its figures and its verdict are that audit's. A variant passes only when it passes on every domain: the audit's
claim "within the limits everywhere" is the intersection of the per-domain claims, each shown at 95% on the
pessimistic end of its interval, which keeps the chance of passing a variant that breaks a limit on some domain
at most 5% with no correction for the number of domains (an intersection-union test: docs/statistics.md).
"""

from __future__ import annotations

import math
from dataclasses import replace

from tasks.record.floor import floor_figures, floor_text
from tasks.record.population import population_line
from tasks.record.result import AuditResult, DomainResult
from tasks.record.row import ModelRow
from tasks.record.runtime_cost import runtime_cost_lines, stream_line
from tasks.record.verdict import format_table, overall
from tasks.record.verdict_said import Verdict

# how bad a domain's verdict is, worst first: what decides a variant's verdict across domains
SEVERITY = {"fail": 0, "error": 1, "pass": 2, "ungated": 3}


def _pessimistic(row: ModelRow) -> float:
    """A row's ΔPPL at the pessimistic end of its interval (its estimate where it has none): what ranks domains."""
    pct = row.change.delta_ppl_pct if row.change else None
    for value in (pct.high, pct.value) if pct else ():
        if isinstance(value, float) and math.isfinite(value):
            return value
    return -math.inf


def worst_domain(domains: list[DomainResult], v: int) -> str:
    """The domain that decides variant ``v``'s verdict: its worst verdict, and among equals the largest ΔPPL at the
    pessimistic end of its interval."""
    def badness(domain: DomainResult) -> tuple:
        return SEVERITY[domain.verdicts[v].status], -_pessimistic(domain.rows[v + 1])

    return min(domains, key=badness).name


def across(domains: list[DomainResult], v: int) -> Verdict:
    """Variant ``v``'s verdict over every domain: its worst domain's, naming it, and the others that fail with it;
    its ΔPPL on each domain after."""
    by_name = {d.name: d.verdicts[v] for d in domains}
    worst = worst_domain(domains, v)
    decided = by_name[worst]
    statuses = {verdict.status for verdict in by_name.values()}
    each = "; ΔPPL by domain: " + ", ".join(_delta(d.name, d.rows[v + 1]) for d in domains)
    if statuses == {"ungated"}:
        return Verdict(decided.name, "ungated", f"no limit on any of the {len(domains)} domains{each}")
    if decided.status in ("pass", "ungated"):
        ungated = [name for name, verdict in by_name.items() if verdict.status == "ungated"]
        judged = len(domains) - len(ungated)
        unjudged = f" (no limit on {', '.join(ungated)})" if ungated else ""
        return Verdict(decided.name, "pass", f"passes on all {judged} gated domains{unjudged}; worst, {worst}: "
                                             f"{decided.reason}{each}")
    others = [name for name, verdict in by_name.items() if name != worst and verdict.status in ("fail", "error")]
    said = {"fail": "fails", "error": "errs"}
    also = (f"; also {' or '.join(sorted({said[by_name[n].status] for n in others}))} on {', '.join(others)}"
            if others else "")
    return Verdict(decided.name, decided.status, f"{decided.status}s on {worst}: {decided.reason}{also}{each}")


def _delta(name: str, row: ModelRow) -> str:
    value = row.delta_ppl_pct
    return f"{name} {value:+.2f}%" if isinstance(value, float) and math.isfinite(value) else f"{name} —"


def audit_over_domains(name: str, domains: list[DomainResult]) -> AuditResult:
    """An audit of several domains judged as one: per variant its worst domain's row (``domain`` names it) and its
    verdict across domains (``across``); the audit's verdict from those; ``table``, one line per model."""
    failed_baseline = next((d for d in domains if not d.rows[0].ok), None)
    base = failed_baseline or domains[0]
    rows, verdicts, worst = [replace(base.rows[0], domain=base.name)], [], {}
    for v, variant in enumerate(domains[0].verdicts):
        worst[variant.name] = worst_domain(domains, v)
        rows.append(replace(next(d for d in domains if d.name == worst[variant.name]).rows[v + 1],
                            domain=worst[variant.name]))
        verdicts.append(across(domains, v))
    drifted = [d.name for d in domains if d.rows[0].said and d.rows[0].said.drift == "environment drift"]
    stopped = sum(any(d.rows[v + 1].measured is not None and d.rows[v + 1].measured.scored_fraction < 1
                      for d in domains) for v in range(len(verdicts)))
    verdict = overall(rows[0], verdicts, None, stopped)
    if verdict.status == "pass":
        verdict = Verdict("audit", "pass", f"{verdict.reason} on every one of {len(domains)} domains "
                                           f"({', '.join(d.name for d in domains)})")
    if drifted:  # each variant was compared with the baseline in this environment: its verdict stands
        verdict = Verdict("audit", verdict.status, f"environment drift of the baseline on {', '.join(drifted)} "
                                                   f"(its table says how much); {verdict.reason}")
    # each domain's runtime cost and tokenization, under the table of worst domains, named by their domain
    said = [f"{d.name}: {line}" for d in domains
            for line in [*runtime_cost_lines(list(d.runtime_costs)), *stream_line(d.tokens_differ),
                         *([population_line(d.population)] if d.population else [])]]
    table = "\n".join([format_table(rows, {v.name: v for v in verdicts}), *floor_lines(domains), *said])
    return AuditResult(name, {d.name: d for d in domains}, True, tuple(rows), tuple(verdicts), verdict, table, worst)


def floor_lines(domains: list[DomainResult]) -> list[str]:
    """A line per noise floor under the table of worst domains: its figures on every domain (each variant's row says
    whether it is above its worst domain's floor; ``--by-domain`` shows every floor row)."""
    names = dict.fromkeys(row.variant for d in domains for row in d.floor)
    lines = []
    for name in names:
        rows = {d.name: row for d in domains for row in d.floor if row.variant == name}
        figures = ", ".join(f"{domain} {floor_figures(row)}" for domain, row in rows.items())
        lines.append(f"{name}: {floor_text(next(iter(rows.values())))}; by domain: {figures}")
    return lines

