"""Diagnose a variant: where in the model and where in the text it loses, and what restoring layers wins back.

``diagnosed`` is the work, shared by the ``diagnose`` flow (``ppl-audit diagnose``) and the audit flow
(``diagnose: failed`` or ``on``): one pass of both models over a seeded sample of the audit's windows, then one
task per restored layer set on the audit's runner (Dask or Ray workers when configured, else one after another
here, sharing the models loaded once).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import NoReturn

from prefect import flow

from flows.answers import where_logged
from flows.scheduler import Scheduler
from tasks.audit.checkpoints import Checkpoint, Lineup
from tasks.audit.diagnose import Restored, narrowed, diagnosis_report, sample, search
from tasks.audit.plan import AuditPlan, Domain
from tasks.config import AuditConfig
from tasks.core.errors import InputError, one_line
from tasks.data.evaluation import Evaluation
from tasks.record.diagnosis import keep
from tasks.record.result import AuditResult
from tasks.steps import WORKER_BENCH, examine_variant, log_diagnosis, open_plan, restore_layers


def diagnosed(config: AuditConfig, lineup: Lineup, scored: Evaluation, checkpoint: Checkpoint) -> dict:
    """``checkpoint``'s diagnosis as plain data (``tasks.audit.diagnose.diagnosis_report``); raises what it meets."""
    started = time.perf_counter()
    settings = config.diagnosis
    windows = sample(scored, settings.windows, settings.seed)
    print(f"diagnosing {checkpoint.name} on {len(windows)} windows ({sum(w.n_scored for w in windows)} tokens), "
          f"restoring up to {settings.restore} layers")
    # each worker's tasks share its own bench (tasks.steps.WorkerBench: one load of the pair; a bench sent with a task
    # would reach it as a copy); run here (LocalScheduler), this process is the worker, and its bench is let go at
    # the end; on a cluster, this process loads no model and its bench holds none
    try:
        with Scheduler.started(config.runner) as scheduler:

            def evaluate(sets: list[tuple[int, ...]]) -> list[Restored]:
                # a task per worker: each runs the variant once per batch and every set of its share from there
                shares = [sets[i :: scheduler.workers] for i in range(min(scheduler.workers, len(sets)))]
                futures = [scheduler.submit(restore_layers, checkpoint=checkpoint, lineup=lineup, evaluation_=scored,
                                            windows=windows, sets=share) for share in shares]
                found = {each.layers: each for future in futures for each in future.result()}
                return [found[tuple(layers)] for layers in sets]

            seen = scheduler.submit(examine_variant, checkpoint=checkpoint, lineup=lineup, evaluation_=scored,
                                    windows=windows).result()  # a worker examines both
            alone, curve = search(seen, evaluate, settings.restore)
    finally:
        WORKER_BENCH.forget()
    return diagnosis_report(seen, alone, curve, time.perf_counter() - started) | {"seed": settings.seed}


def wanted(config: AuditConfig, checkpoint: Checkpoint, verdict: str) -> bool:
    """Whether an audit diagnoses a variant after its verdict: ``diagnose: on`` for it (or for the audit), or
    ``diagnose: failed`` for the audit and it failed its gate (one that could not be scored has nothing to show)."""
    return checkpoint.spec.diagnose or config.diagnose is True or (config.diagnose == "failed" and verdict == "fail")


def diagnoses(config: AuditConfig, lineup: Lineup, scored: Evaluation, verdicts: list) -> dict[str, dict]:
    """The diagnoses an audit asks for (``wanted``), by variant; one that fails holds its ``problem`` and the
    others go on: a diagnosis never costs the audit its verdict or its record."""
    found = {}
    for checkpoint, verdict in zip(lineup.variants, verdicts):
        if not wanted(config, checkpoint, verdict.status):
            continue
        try:
            found[checkpoint.name] = diagnosed(config, lineup, scored, checkpoint)
        except Exception as error:  # noqa: BLE001 -- whatever stops one diagnosis, the audit keeps its results
            found[checkpoint.name] = {"variant": checkpoint.name, "problem": f"{type(error).__name__}: {one_line(error)}"}
    return found


def audit_diagnoses(plan: AuditPlan, result: AuditResult) -> AuditResult:
    """The audit's result with the diagnoses its config asks for (after the verdict: they never change it), each
    variant's on the domain that decides its verdict (its worst, in an audit of several: diagnosed once, where it
    loses most)."""
    domains = {}
    for domain in plan.domains:
        judged = result.domains[domain.name]
        picked = [(c, v) for c, v in zip(plan.lineup.variants, result.verdicts) if result.worst[c.name] == domain.name]
        found = diagnoses(domain.config, replace(plan.lineup, variants=[c for c, _ in picked]), domain.evaluation,
                          [v for _, v in picked])
        domains[domain.name] = replace(judged, findings=replace(judged.findings, diagnoses=found))
    return replace(result, domains=domains)


def on_domain(plan: AuditPlan, corpus: str | None) -> tuple[AuditPlan, str | None]:
    """The plan of the one domain a diagnosis reads, and its name: ``corpus`` of an audit of several corpora (the
    first when None); an audit of one corpus is its own (None). A name the audit lacks is one line naming its
    corpora, as is a name given for an audit of one corpus (it names none: ``corpus:``)."""
    domain = plan.domains[0] if corpus is None else plan.naming.whole(
        {d.name: d for d in plan.domains}, lambda _: plan.domain(corpus), partial(_names_none, plan, corpus))
    return plan.alone(domain.name), domain.corpus.shown


def _names_none(plan: AuditPlan, corpus: str, _: Domain) -> NoReturn:
    raise InputError(f"--corpus {corpus}: the audit {plan.name} has one corpus (corpus:), not several named ones "
                     "(corpora:); leave --corpus out")


@flow(name="ppl-audit-diagnose", flow_run_name="diagnose-{variant}", log_prints=True)
def diagnose(config: str, variant: str, overrides: list[str] | None = None, plan: AuditPlan | None = None,
             corpus: str | None = None) -> dict:
    """Diagnose the variant ``variant`` of the audit ``config`` against its baseline, and log it to MLflow (a child
    of the audit's latest run, when there is one).

    Args:
        plan: the audit opened for that variant alone (``open_audit`` with ``narrowed``: the CLI makes it); without
            it, made here once.
        corpus: in an audit of several corpora, the domain whose stream and settings it is diagnosed on (default: the
            first); ``found["domain"]`` names it.

    Returns:
        the diagnosis, with ``record``: where it was logged, or kept when tracking failed.
    """
    if plan is None:
        plan = open_plan(config, overrides or [], narrow=partial(narrowed, variant=variant))
    plan, domain = on_domain(plan, corpus)
    settings, lineup, scored = plan.config, plan.lineup, plan.evaluation
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    if domain is not None:
        print(f"on the domain {domain}")
    # the domain named last, as the JSON line has always ended before where it was logged
    named = {"domain": domain} if domain is not None else {}
    found = diagnosed(settings, lineup, scored, checkpoint) | {"audit": settings.name} | named
    kept = keep(found)
    tracking = settings.tracking
    logged = log_diagnosis(found, tracking.uri, tracking.experiment, return_state=True)
    found |= where_logged(logged, tracking, kept)
    return found
