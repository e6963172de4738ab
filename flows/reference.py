"""The reference flow: score an audit's baseline once and store its reference (``tasks.audit.reference``), so
that the audits that follow (a nightly run, one per new checkpoint) load only the variant."""

from __future__ import annotations

from prefect import flow

from flows.runners import score_floors
from flows.scheduler import LocalScheduler
from tasks.audit.plan import AuditPlan, baseline_alone
from tasks.config import Runner
from tasks.record.results import VariantResult
from tasks.steps import open_plan, score_baseline


@flow(name="ppl-audit-reference", flow_run_name="reference-{config}", log_prints=True)
def build_reference(config: str, overrides: list[str] | None = None, plan: AuditPlan | None = None
                    ) -> dict[str, tuple[VariantResult, list[VariantResult]]]:
    """Score the baseline of the audit ``config`` (with ``overrides``) as the audit would, or find its
    reference already stored (``baseline.rescore`` decides), on each of its corpora (one reference per domain), and
    its noise floor where ``evaluation.floor`` asks (kept with the reference, as an audit keeps it); returns the
    baseline's outcome and its floor's by domain (a one-corpus audit's: ``corpus``).

    Args:
        plan: the audit opened for its baseline alone (``open_audit`` with ``baseline_alone``: the CLI makes it);
            without it, made here once.
    """
    if plan is None:
        plan = open_plan(config, overrides or [], narrow=baseline_alone)
    built = {}
    here = LocalScheduler(Runner())  # whatever runner the audit names: a reference is built in this process
    for domain in plan.domains:
        baseline = here.submit(score_baseline, checkpoint=plan.lineup.baseline, evaluation_=domain.evaluation).result()
        built[domain.name] = baseline, score_floors(here, plan.lineup, domain.evaluation, baseline)
    return built
