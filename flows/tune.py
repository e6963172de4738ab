"""The tune flow: a mixed-precision recipe for one variant of an audit within a size budget, measured, made, and
audited beside the uniform variant and a uniform variant of equal or larger size (``ppl-audit tune``).

It measures (a task: ``tasks.steps.measure_tune``), writes the recipe where the user can take it
(``<home>/tunes/<time>-<audit>-<variant>/``: llama-quantize's tensor-type file, gptqmodel's ``dynamic``, an
llm-compressor recipe, the audit's YAML), runs that audit (the audit flow, its own MLflow parent run), says whether
the recipe is proven better than each uniform variant there, and logs the tune as a child of that run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from functools import partial
from pathlib import Path

import numpy as np
import yaml
from prefect import flow

from flows.answers import where_logged
from flows.audit import audit, result_of
from tasks.audit.plan import AuditPlan
from tasks.audit.recipe.plan import alone, prepare_tune
from tasks.audit.recipe.proof import audit_of, compared, uniform_above
from tasks.audit.recipe.sizes import Budget
from tasks.core.places import home
from tasks.record.result import AuditResult
from tasks.record.tune_audit_said import AuditedModel, RecipeAudit
from tasks.record.tune_said import AuditedAt, Proven, TuneFound
from tasks.record.tuning import gptqmodel_dynamic, llm_compressor_recipe, tensor_type_lines, tune_json
from tasks.steps import log_tune, measure_tune, open_plan


def _written(found: TuneFound, audit: RecipeAudit) -> Path:
    """The recipe in every format and the audit of it, in a folder of their own under ``<home>/tunes``: written
    before the audit runs, so nothing measured is lost if it fails."""
    folder = home() / "tunes" / f"{datetime.now():%Y%m%dT%H%M%S}-{audit.name}-{found.variant}"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"the recipe and its audit: {folder}")
    record = found.as_record()  # what the recipe formats and the tune's JSON are written from
    if found.tensor_types:  # a GGUF recipe's; a gptq recipe is gptqmodel's dynamic
        (folder / "llama-quantize-tensor-types.txt").write_text(tensor_type_lines(record))
    (folder / "gptqmodel-dynamic.json").write_text(json.dumps(gptqmodel_dynamic(record), indent=2) + "\n")
    (folder / "llm-compressor-recipe.yaml").write_text(yaml.safe_dump(llm_compressor_recipe(record), sort_keys=False))
    (folder / "audit.yaml").write_text(yaml.safe_dump(audit.config, sort_keys=False, allow_unicode=True))
    (folder / "tune.json").write_text(tune_json(record) + "\n")
    return folder


def claims(result: AuditResult, audit: RecipeAudit, found: TuneFound, larger: tuple[str, float, dict] | None
           ) -> TuneFound:
    """The tune with what the audit of the recipe found: per uniform variant (and per domain), whether the recipe is
    proven better there (``verdicts``), whether it is in every domain (``proven``), and each model's audit figures
    for the chart (``audited``: on the first domain). A model that failed makes no claim: not proven."""
    lines, audited = [], {}
    tuned_bpw = found.built.bpw
    # by role, in the order of Proven's fields: the uniform variant, then the larger one where there is one
    against = [("uniform", audit.uniform, found.variant_bpw, f"uniform {found.file_type}")]
    if larger is not None:
        against.append(("larger", audit.larger, larger[1], f"uniform {larger[0]}"))
    proven = {role: True for role, *_ in against}
    first = next(iter(result.domains.values()))
    for on, judged in result.labelled(" on {}"):  # " on DOMAIN" where the audit names its domains
        by_name = {m.name: AuditedModel.of(m) for m in judged.results}
        tuned = by_name.get(audit.tuned)
        for role, name, bpw, label in against:
            other = by_name.get(name)
            if tuned is None or other is None or not (tuned.scored.ok and other.scored.ok) or tuned.kl is None:
                failed = next((m.scored for m in (tuned, other) if m is not None and not m.scored.ok), None)
                lines.append(f"no claim against {label}{on}: {failed.reason if failed else 'not scored'}")
                proven[role] = False
                continue
            better, line = compared(tuned.scored, other.scored, tuned_bpw, bpw, label)
            lines.append(line + on)
            proven[role] = proven[role] and better
            if judged is first:
                audited[name] = AuditedAt(bpw, float(np.mean(other.kl)))
                audited[audit.tuned] = AuditedAt(tuned_bpw, float(np.mean(tuned.kl)))
    return replace(found, verdicts=tuple(lines), proven=Proven(*proven.values()), audited=tuple(audited.items()))


@flow(name="ppl-audit-tune", flow_run_name="tune-{variant}", log_prints=True)
def tune(config: str, variant: str, budget: str, per: str = "layer", types: list[str] | None = None,
         overrides: list[str] | None = None, plan: AuditPlan | None = None) -> dict:
    """Tune the variant ``variant`` of the audit ``config`` within ``budget`` (``Budget``), make the recipe and audit
    it beside the uniform variants.

    Args:
        per: what gets one choice: ``layer`` (a decoder layer's matrices) or ``module`` (its fused groups).
        types: what a unit may take: GGUF tensor types (default ``TYPES``), or a gptq variant's options (8bit, g32,
            bf16: ``tasks.audit.recipe.gptq.parse_options``; by default all three).
        plan: the audit of the variant alone (``opened``: the CLI makes it); without it, made here once.

    Returns:
        the tune, with ``verdicts`` (``claims``' lines), ``folder`` (the recipe's files) and ``record`` (where it was logged).
    """
    wanted = Budget.parse(budget)
    if plan is None:
        plan = open_plan(config, overrides or [], narrow=partial(alone, variant=variant))
    prepared = prepare_tune(plan.lineup, variant, wanted, per, types)
    settings = plan.config
    found = TuneFound.of_record(measure_tune(plan.lineup, [d.evaluation for d in plan.domains], prepared,
                                             settings.diagnosis.windows, settings.diagnosis.seed))
    larger = uniform_above(prepared, found.built.bpw)
    recipe_audit = RecipeAudit.of(*audit_of(settings, variant, found.built.recipe, larger))
    folder = _written(found, recipe_audit)
    found = replace(found, folder=str(folder))
    state = audit(config=str(folder / "audit.yaml"), return_state=True)  # it opens its plan, as a run Prefect starts
    result = result_of(state)
    if result is None:
        found = replace(found, verdicts=(f"no claim: the audit of the recipe failed ({state.message})",),
                        proven=Proven())
        parent = None
    else:
        found = replace(claims(result, recipe_audit, found, larger), audit_table=result.table,
                        audit_verdict=result.verdict.said)
        parent = result.mlflow_run_id
    record = found.as_record()  # the tune as plain data: what is written, logged and answered
    (folder / "tune.json").write_text(tune_json(record) + "\n")
    tracking = settings.tracking
    logged = log_tune(record, tracking.uri, tracking.experiment, parent, return_state=True)
    return record | where_logged(logged, tracking, folder)
