"""The reference flow: score an audit's baseline once and store its reference (``tasks.audit.reference``), so
that the audits that follow (a nightly run, one per new checkpoint) load only the variant."""

from __future__ import annotations

from prefect import flow

from tasks.audit.preflight import preflight
from tasks.config import load_audit_config
from tasks.record.results import VariantResult
from tasks.steps import prepare_models, read_corpus, score_baseline, tokenize_corpus


@flow(name="ppl-audit-reference", flow_run_name="reference-{config}", log_prints=True)
def build_reference(config: str, overrides: list[str] | None = None) -> VariantResult:
    """Score the baseline of the audit ``config`` (with ``overrides``) as the audit would, or find its
    reference already stored (``baseline.rescore`` decides); returns the baseline's outcome."""
    settings = load_audit_config(config, overrides or [])
    preflight(settings, variants=False)
    lineup = prepare_models(settings.model_copy(update={"variants": []}))
    scored = tokenize_corpus(read_corpus(settings.corpus), settings, lineup)
    return score_baseline(lineup.baseline, scored)
