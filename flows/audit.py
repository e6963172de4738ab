"""The audit flow: one baseline, its variants, one token stream, one verdict.

Read top to bottom: validate the config, read and tokenize the corpus once, score the baseline and
every variant (one task each; a failed variant never loses the others), compare, judge, report.
The flow ends Completed when every variant passes its gate, Failed with a one-line reason otherwise.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed

from tasks.audit import VariantResult, preflight
from tasks.config import AuditConfig, VariantSpec, load_audit_config
from tasks.steps import read_corpus, spool_audit, tokenize_corpus, track
from tasks.tracking import use_tracking
from tasks.verdict import comparison_row, format_table, judge, overall
from flows.runners import score_all


def event_variant(config: AuditConfig, model_path: str | None, method: str | None, baseline: str | None) -> AuditConfig:
    """The config narrowed to the one variant a ``quantization.completed`` event names."""
    if not model_path:
        return config
    variant = VariantSpec(name=Path(model_path).name or "variant", method=method or "gptq", path=model_path,
                          dtype=config.baseline.dtype, device=config.baseline.device)
    gates = {k: v for k, v in config.thresholds.per_variant.items() if k == variant.name}
    update = {"variants": [variant], "thresholds": config.thresholds.model_copy(update={"per_variant": gates})}
    if baseline:
        update["baseline"] = config.baseline.model_copy(update={"path": baseline})
    return AuditConfig.model_validate(config.model_copy(update=update).model_dump())


def report(config: AuditConfig, baseline: VariantResult, variants: list[VariantResult]) -> dict:
    """Comparison rows, per-variant verdicts and the audit's verdict, as plain data."""
    rows = [comparison_row(baseline, baseline)] + [comparison_row(v, baseline) for v in variants]
    verdicts = [judge(row, config.thresholds) for row in rows[1:]]
    return {"name": config.name, "rows": rows, "verdicts": verdicts, "verdict": overall(rows[0], verdicts),
            "table": format_table(rows, {v.name: v for v in verdicts})}


@flow(name="ppl-audit", flow_run_name="audit-{config}")
def audit(config: str, overrides: list[str] | None = None, model_path: str | None = None, method: str | None = None,
          bits: int | str | None = None, baseline: str | None = None):
    """Audit a baseline and its variants by perplexity.

    Args:
        config: path of the audit YAML (the single source of truth).
        overrides: ``key=value`` settings that replace the file's.
        model_path, method, bits, baseline: from a ``quantization.completed`` event: audit that one
            checkpoint (``bits`` is informative) against ``baseline`` (else the config's).
    """
    settings = event_variant(load_audit_config(config, overrides or []), model_path or None, method or None,
                             baseline or None)
    use_tracking(settings.tracking.uri)  # models:/ variants resolve against the audit's registry
    preflight(settings, variants=False)
    text = read_corpus(settings.corpus)
    scored = tokenize_corpus(text, settings)
    baseline_result, variant_results = score_all(settings, scored)
    results = [baseline_result, *variant_results]
    summary = report(settings, baseline_result, variant_results)
    print(summary["table"])
    record = spool_audit(settings, config, scored, summary, results)
    tracked = track(record, return_state=True)
    if tracked.is_completed():
        summary["mlflow_run_id"] = tracked.result()
        where = f"MLflow run {summary['mlflow_run_id']} (experiment {settings.tracking.experiment})"
    else:
        where = f"kept in {record} (tracking failed: {tracked.message}); run `ppl-audit sync` later"
    print(f"record: {where}")
    summary["results"] = results
    verdict = summary["verdict"]
    create_markdown_artifact(
        key=f"{settings.name}-comparison".lower().replace("_", "-").replace(".", "-"),
        markdown=f"# Audit {settings.name}: {verdict.status}\n\n{verdict.reason}\n\n"
                 f"```\n{summary['table']}\n```\n\nRecord: {where}\n",
        description=f"ppl-audit {settings.name}",
    )
    if verdict.status == "pass":
        return Completed(message=verdict.reason, data=summary)
    return Failed(message=f"{verdict.status}: {verdict.reason}", data=summary)
