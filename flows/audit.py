"""The audit flow: one baseline, its variants, one token stream per domain, one verdict.

Read top to bottom: the audit's plan (made by the CLI, or here for a run Prefect started: ``open_plan``), score the
baseline and every variant on every domain (a failed variant never loses the others), judge (``tasks.audit.judge``:
the ``AuditResult`` every view reads), diagnose what the config asks, record (spool first), track. The flow ends
Completed when every variant passes its gate, Failed with a one-line reason otherwise; either way its data is the
``AuditResult``.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed

from flows.answers import failed, failure_line
from flows.diagnose import audit_diagnoses
from flows.runners import score_domains
from tasks.audit.judge import judge, recorded
from tasks.audit.plan import AuditPlan, Event
from tasks.audit.served import Refused
from tasks.config import AuditConfig
from tasks.core import console
from tasks.core.errors import InputError
from tasks.core.places import tracking_uri
from tasks.record.answer import artifact_markdown
from tasks.record.contents import Started
from tasks.record.result import AuditResult
from tasks.record.spool import record_json
from tasks.record.tracking import run_link
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


def result_of(state) -> AuditResult | None:
    """What an ``audit`` run found, passed or failed (None when it ended before a verdict)."""
    found = state.result(raise_on_failure=False)
    return found if isinstance(found, AuditResult) else getattr(found, "result", None)


def _scheduled() -> bool:
    """Whether Prefect's scheduler made this run (a deployment's cron), not an event, a user or a test."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.auto_scheduled)


def _opened(config: str, overrides: list[str], event: Event | None) -> AuditPlan:
    """The plan of a run Prefect started (the CLI opens its own before Prefect starts); a refusal raises the
    ``InputError`` that says why."""
    opened = open_plan(config, overrides, event, return_state=True)
    plan = opened.result(raise_on_failure=False)
    if not opened.is_completed():
        raise plan
    return plan


def _tracked(result: AuditResult, config: AuditConfig, folder) -> AuditResult:
    """The result with where its record is: the MLflow run the spooled record was logged to, with its link, or the
    spool's folder and how to send it later."""
    tracked = track(folder, return_state=True)
    if not tracked.is_completed():
        return replace(result, record=f"kept in {folder} (tracking failed: {failure_line(tracked)}); run "
                                      "`ppl-audit sync` later")
    run = tracked.result()
    link = run_link(tracking_uri(config.tracking.uri), run)
    where = f"MLflow run {run} (experiment {config.tracking.experiment})" + (f": {link}" if link else "")
    return replace(result, record=where, mlflow_run_id=run)


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
    started = Started(datetime.now(timezone.utc), _scheduled())
    try:
        plan = plan if plan is not None else _opened(config, overrides or [], event)
    except InputError as refusal:
        return failed(f"{'refused' if isinstance(refusal, Refused) else 'error'}: {refusal}")
    if plan.said:
        print(plan.said)
    result = judge(plan, score_domains(plan.config, plan.lineup, plan.domains))
    print(result.table)
    result = audit_diagnoses(plan, result)
    record, arrays = recorded(plan, result, started)
    spooled = spool_audit(record, arrays, return_state=True)  # first: tracking and artifacts can fill a disk too
    if not spooled.is_completed():
        return _unspooled(record, spooled.message)
    result = _tracked(result, plan.config, spooled.result())
    print(f"record: {result.record}")
    create_markdown_artifact(key=f"{plan.name}-comparison".lower().replace("_", "-").replace(".", "-"),
                             markdown=artifact_markdown(result), description=f"ppl-audit {plan.name}")
    if result.passed:
        return Completed(message=result.verdict.reason, data=result)
    return failed(f"{result.verdict.status}: {result.verdict.reason}", result)
