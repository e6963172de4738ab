"""The audit flow: one baseline, its variants, one token stream, one verdict.

Read top to bottom: the audit's plan (made by the CLI, or here for a run Prefect started: ``open_audit``), score
the baseline and every variant (one task each; a failed variant never loses the others), compare, judge, report.
The flow ends Completed when every variant passes its gate, Failed with a one-line reason otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed

from flows.answers import failed, failure_line
from flows.diagnose import diagnoses
from flows.runners import score_domains
from tasks.audit.checkpoints import Lineup
from tasks.audit.plan import AuditPlan, Domain, Event
from tasks.audit.population import population
from tasks.audit.served import Refused
from tasks.audit.where import where_of
from tasks.config import AuditConfig
from tasks.core import console
from tasks.core.errors import InputError
from tasks.core.places import tracking_uri
from tasks.record.contents import Findings, Started, audit_record, token_arrays
from tasks.record.domains import DomainSummary, by_domain_table, combined, domain_arrays, domains_record
from tasks.record.results import VariantResult
from tasks.record.runtime_cost import runtime_cost_lines, runtime_costs, stream_line
from tasks.record.spool import record_json
from tasks.record.tracking import run_link
from tasks.record.dominance import dominated_by
from tasks.record.population import population_line
from tasks.record.floor import floor_row, judged, kept_as
from tasks.record.verdict import comparison_row, format_table, judge, overall
from tasks.steps import open_plan, spool_audit, track


def _unspooled(record: dict, why: str):
    """The Failed state of an audit whose record could not be written: the record (all but the per-token
    arrays) goes to stdout as JSON instead, so that nothing computed is lost, and the error to stderr."""
    # written, not printed: the flow's log_prints would send a print to Prefect's logger, which may be
    # the very thing that cannot write
    for stream, text in ((console.out(), record_json(record)),
                         (console.err(), f"ppl-audit: ERROR: {why}; the audit's record is printed above as JSON "
                                         "instead: keep it")):
        stream.write(text + "\n")
        stream.flush()
    return failed(f"record not written: {why}")


def summary_of(state) -> dict | None:
    """What an ``audit`` run computed, passed or failed (None when it ended before a verdict)."""
    result = state.result(raise_on_failure=False)
    return result if isinstance(result, dict) else getattr(result, "summary", None)


def summary_json(summary: dict) -> str:
    """One JSON line of what an audit found: its verdict and each model's row with its verdict; an audit of several
    corpora gives each model's worst domain's row (``domain``) and, under ``domains``, each domain's verdict and
    rows."""
    def plain(row: dict, **verdict) -> dict:  # JSON has no NaN
        return {k: None if isinstance(v, float) and v != v else v for k, v in row.items()} | verdict

    def models(judged: dict) -> list[dict]:
        baseline, *variants = judged["rows"]
        return [plain(baseline, verdict="baseline")] + [plain(row, verdict=v.status, verdict_reason=v.reason)
                                                         for row, v in zip(variants, judged["verdicts"])]

    verdict = summary["verdict"]
    said = {"audit": summary["name"], "verdict": verdict.status, "reason": verdict.reason,
            "mlflow_run_id": summary.get("mlflow_run_id"), "record": summary["record"], "models": models(summary),
            "runtime_costs": summary.get("runtime_costs", []),
            "population": summary.get("population"), "floor": [plain(row) for row in summary.get("floor", [])]}
    if "domains" in summary:
        said["domains"] = {name: {"verdict": domain["verdict"].status, "reason": domain["verdict"].reason,
                                  "models": models(domain), "runtime_costs": domain.get("runtime_costs", []),
                                  "population": domain.get("population"),
                                  "floor": [plain(row) for row in domain.get("floor", [])]}
                           for name, domain in summary["domains"].items()}
    return json.dumps(said)


def _scheduled() -> bool:
    """Whether Prefect's scheduler made this run (a deployment's cron), not an event, a user or a test."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.auto_scheduled)


def report(config: AuditConfig, baseline: VariantResult, variants: list[VariantResult],
           floors: list[VariantResult] = ()) -> dict:
    """Comparison rows, per-variant verdicts and the audit's verdict, as plain data; with a noise floor (``floors``),
    its rows (``floor``: shown in the table under the baseline, never judged) and each variant's row's ``floor``:
    whether it lost more than the floor, beyond noise (``tasks.record.floor``)."""
    window = config.evaluation.window
    rows = [comparison_row(baseline, baseline, window)] + [comparison_row(v, baseline, window) for v in variants]
    for row, variant in zip(rows[1:], variants):
        found = judged(variant, list(floors), row.get("delta_ppl_pct"))
        if found is not None:
            row["floor"] = found
    floor_rows = [floor_row(comparison_row(f, baseline, window), dtype, kept_as(f))
                  for f, dtype in zip(floors, config.evaluation.floors)]
    verdicts = [judge(row, config.thresholds) for row in rows[1:]]
    dominated = dominated_by(variants)
    for row in rows[1:]:
        if row["variant"] in dominated:
            row["dominated_by"] = dominated[row["variant"]]
    stopped = sum(row.get("scored_fraction", 1.0) < 1 for row in rows[1:])
    front = [name for name, by in dominated.items() if by is None] if len(dominated) > 1 else []
    verdict = overall(rows[0], verdicts, baseline.reference.drift if baseline.reference else None, stopped, front)
    costs = runtime_costs(variants)
    table = "\n".join([format_table(rows[:1] + floor_rows + rows[1:], {v.name: v for v in verdicts}),
                       *runtime_cost_lines(costs)])
    return {"name": config.name, "rows": rows, "verdicts": verdicts, "verdict": verdict, "table": table,
            "runtime_costs": costs, "floor": floor_rows}


@dataclass(frozen=True)
class Judged:
    """One domain of an audit scored and judged as its one-corpus audit would be: its ``summary`` (``report``), its
    models' ``results`` and what the audit found beyond the figures (``findings``)."""

    domain: Domain
    results: list[VariantResult]
    summary: dict
    findings: Findings

    def record(self, path: str, started: Started) -> dict:
        """The domain's record, as its one-corpus audit's."""
        return audit_record(self.domain.config, path, self.domain.evaluation, self.summary, self.results, started,
                            self.findings)


def judge_domain(domain: Domain, lineup: Lineup, baseline: VariantResult, variants: list[VariantResult],
                 floors: list[VariantResult] = ()) -> Judged:
    """A domain's comparison and verdicts (its own gates: ``Domain.config``), each variant against the noise floor
    (``floors``), and where each variant loses in its text."""
    scored = domain.evaluation
    summary = report(domain.config, baseline, variants, floors)
    named = population(scored, lineup.baseline.tokenizer)
    summary |= {"population": named, "table": "\n".join([summary["table"], population_line(named)])}
    if scored.tokens_differ:
        summary |= {"table": "\n".join([summary["table"], *stream_line(scored.tokens_differ)]),
                    "tokens_differ": scored.tokens_differ}
    lost = {v.name: found for v in variants if (found := where_of(v, baseline, scored, lineup.tokenizer))}
    return Judged(domain, [baseline, *variants], summary, Findings(lost))


def diagnosed(judged: list[Judged], lineup: Lineup, summary: dict) -> list[Judged]:
    """Each domain with the diagnoses its config asks for (after the verdict: they never change it) of the variants
    whose verdict it decides (their worst domain's, in an audit of several: diagnosed once, where they lose most)."""
    done = []
    for domain in judged:
        name = domain.domain.name
        picked = [(c, v) for c, v, row in zip(lineup.variants, summary["verdicts"], summary["rows"][1:])
                  if row.get("domain", name) == name]
        found = diagnoses(domain.domain.config, replace(lineup, variants=[c for c, _ in picked]),
                          domain.domain.evaluation, [v for _, v in picked])
        done.append(replace(domain, findings=replace(domain.findings, diagnoses=found)))
    return done


@flow(name="ppl-audit", flow_run_name="audit-{config}", log_prints=True)
def audit(config: str, overrides: list[str] | None = None, event: Event | None = None, plan: AuditPlan | None = None):
    """Audit a baseline and its variants by perplexity.

    Args:
        config: path of the audit YAML (the single source of truth).
        overrides: ``key=value`` settings that replace the file's.
        event: from a ``quantization.completed`` event: audit the one checkpoint it names (``tasks.audit.events``).
        plan: the audit already opened from ``config``, ``overrides`` and ``event`` (``open_audit``: the CLI makes
            it before Prefect starts); without it, a run Prefect started makes it here, once.
    """
    started = datetime.now(timezone.utc)
    if plan is None:
        opened = open_plan(config, overrides or [], event, return_state=True)
        plan = opened.result(raise_on_failure=False)
        if not opened.is_completed():
            if not isinstance(plan, InputError):
                raise plan
            return failed(f"{'refused' if isinstance(plan, Refused) else 'error'}: {plan}")
    if plan.said:
        print(plan.said)
    settings, lineup = plan.config, plan.lineup
    judged = [judge_domain(domain, lineup, *scored)
              for domain, scored in zip(plan.domains, score_domains(settings, lineup, plan.domains))]
    if plan.by_domain:
        summary = combined(settings.name, [DomainSummary(d.domain.name, d.summary) for d in judged])
        results = {d.domain.name: d.results for d in judged}
    else:
        summary, results = judged[0].summary, judged[0].results
    print(summary["table"])
    judged = diagnosed(judged, lineup, summary)
    when = Started(started, _scheduled())
    records = {d.domain.name: d.record(plan.path, when) for d in judged}
    if plan.by_domain:
        record = domains_record(settings.model_dump(mode="json"), records, summary)
        arrays = domain_arrays({d.domain.name: token_arrays(d.results) for d in judged})
    else:
        record, arrays = records[judged[0].domain.name], token_arrays(results)
    spooled = spool_audit(record, arrays, return_state=True)  # first: tracking and artifacts can fill a disk too
    if not spooled.is_completed():
        return _unspooled(record, spooled.message)
    folder = spooled.result()
    tracked = track(folder, return_state=True)
    if tracked.is_completed():
        summary["mlflow_run_id"] = tracked.result()
        where = f"MLflow run {summary['mlflow_run_id']} (experiment {settings.tracking.experiment})"
        link = run_link(tracking_uri(settings.tracking.uri), summary["mlflow_run_id"])
        where += f": {link}" if link else ""
    else:
        where = f"kept in {folder} (tracking failed: {failure_line(tracked)}); run `ppl-audit sync` later"
    print(f"record: {where}")
    summary["record"] = where
    summary["results"] = results  # a one-corpus audit's models; of several, each domain's, in the config's order
    verdict = summary["verdict"]
    create_markdown_artifact(
        key=f"{settings.name}-comparison".lower().replace("_", "-").replace(".", "-"),
        markdown=f"# Audit {settings.name}: {verdict.status}\n\n{verdict.reason}\n\n"
                 f"```\n{summary['table']}\n```\n\n"
                 + (f"## By domain\n\n```\n{by_domain_table(summary)}\n```\n\n" if plan.by_domain else "")
                 + f"Record: {where}\n",
        description=f"ppl-audit {settings.name}",
    )
    if verdict.status in ("pass", "ungated"):
        return Completed(message=verdict.reason, data=summary)
    return failed(f"{verdict.status}: {verdict.reason}", summary)
