"""Judge what an audit scored: each domain's comparison and verdicts, then the audit's over its domains
(``judge``), and the record of it (``recorded``). Plain Python over the scores, no Prefect: the flow scores, this
judges, and every view reads the ``AuditResult`` it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from tasks.audit.checkpoints import Lineup
from tasks.audit.plan import AuditPlan, Domain
from tasks.audit.population import population
from tasks.audit.where import where_of
from tasks.config import AuditConfig
from tasks.record.contents import Started, audit_record, token_arrays
from tasks.record.domain_record_said import domain_arrays, domains_record
from tasks.record.domains import audit_over_domains
from tasks.record.dominance import dominated_by
from tasks.record.floor import floor_row, judged, kept_as
from tasks.record.population import population_line
from tasks.record.result import AuditResult, DomainResult, Findings
from tasks.record.results import VariantResult
from tasks.record.row import Dominance, ModelRow
from tasks.record.runtime_cost import runtime_cost_lines, runtime_costs, stream_line
from tasks.record.verdict import comparison_row, format_table, judge_row as gate, overall


@dataclass(frozen=True)
class Scored:
    """One domain's models as scored: the baseline, its variants (in the config's order) and its noise floor."""

    baseline: VariantResult
    variants: list[VariantResult]
    floors: list[VariantResult]


def _rows(config: AuditConfig, scored: Scored, dominated: dict[str, str | None]) -> tuple[list[ModelRow],
                                                                                        list[ModelRow]]:
    """The comparison rows (the baseline's first), each variant's saying whether it lost more than the floor beyond
    noise (``floor``) and which variant dominates it (``dominance``); and the floor's rows."""
    window, baseline = config.evaluation.window, scored.baseline
    rows = [comparison_row(baseline, baseline, window)]
    for variant in scored.variants:
        row = comparison_row(variant, baseline, window)
        rows.append(replace(row, floor=judged(variant, scored.floors, row.delta_ppl_pct),
                            dominance=Dominance(dominated[variant.name]) if variant.name in dominated else None))
    floor_rows = [floor_row(comparison_row(f, baseline, window), dtype, kept_as(f))
                  for f, dtype in zip(scored.floors, config.evaluation.floors)]
    return rows, floor_rows


def judge_domain(domain: Domain, lineup: Lineup, scored: Scored) -> DomainResult:
    """A domain's comparison and verdicts (its own gates: ``Domain.config``), each variant against the noise floor,
    the front of size against quality, and where each variant loses in its text."""
    config, evaluation, baseline = domain.config, domain.evaluation, scored.baseline
    dominated = dominated_by(scored.variants)
    rows, floor_rows = _rows(config, scored, dominated)
    verdicts = [gate(row, config.thresholds) for row in rows[1:]]
    stopped = sum(row.measured is not None and row.measured.scored_fraction < 1 for row in rows[1:])
    front = [name for name, by in dominated.items() if by is None] if len(dominated) > 1 else []
    verdict = overall(rows[0], verdicts, baseline.reference.drift if baseline.reference else None, stopped, front)
    costs = runtime_costs(scored.variants)
    named = population(evaluation, lineup.baseline.tokenizer)
    table = [format_table(rows[:1] + floor_rows + rows[1:], {v.name: v for v in verdicts}),
             *runtime_cost_lines(costs), population_line(named), *stream_line(evaluation.tokens_differ)]
    lost = {v.name: found for v in scored.variants
            if (found := where_of(v, baseline, evaluation, lineup.tokenizer))}
    return DomainResult(domain.name, (baseline, *scored.variants), tuple(rows), tuple(verdicts), verdict,
                        "\n".join(table), tuple(floor_rows), tuple(costs), named, evaluation.tokens_differ,
                        Findings(lost))


def judge(plan: AuditPlan, scored: Sequence[Scored]) -> AuditResult:
    """The audit's answer: each domain judged as its one-corpus audit would be, and, in an audit that names its
    domains, each variant by its worst domain (``tasks.record.domains.audit_over_domains``); an audit of one corpus
    is its one domain's."""
    domains = {domain.name: judge_domain(domain, plan.lineup, each) for domain, each in zip(plan.domains, scored)}
    return plan.naming.whole(domains, partial(_over_domains, plan.name), partial(AuditResult.of_one, plan.name))


def _over_domains(name: str, domains: Mapping[str, DomainResult]) -> AuditResult:
    return audit_over_domains(name, list(domains.values()))


def recorded(plan: AuditPlan, result: AuditResult, started: Started) -> tuple[dict, dict]:
    """The audit's record and its per-token arrays by file name: an audit of one corpus records it as it always
    has; one that names its domains, each domain's under ``domains`` (``domains_record``)."""
    records = {d.name: audit_record(d.config, plan.path, d.evaluation, result.domains[d.name], started)
               for d in plan.domains}
    arrays = {name: token_arrays(list(d.results)) for name, d in result.domains.items()}
    whole = partial(domains_record, plan.config.model_dump(mode="json"), result=result)
    return result.naming.whole(records, whole), result.naming.whole(arrays, domain_arrays)
