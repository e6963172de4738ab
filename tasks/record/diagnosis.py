"""A variant's diagnosis as users read it: a console table, two charts, a JSON file kept locally and an MLflow run.

The diagnosis is made and kept as plain data (``tasks.audit.diagnose.diagnosis_report``): each view that is given it
reads it once as a ``VariantDiagnosis`` (``tasks.record.diagnosis_said``) and shows its attributes.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path

from matplotlib.figure import Figure

from tasks.core.places import home
from tasks.record.diagnosis_said import VariantDiagnosis, WonBack
from tasks.record.plots import BASELINE_COLOUR, DPI, FAIL_COLOUR, SMALL, TEXT, TITLE, WIDTH
from tasks.record.tags import DOMAIN

WORST = 3  # layers marked in the console table: those that win back most
OWN, ACCUMULATED, RECOVERY = "#c62828", "#1565c0", "#9e9e9e"


def _pct(value, low=None, high=None) -> str:
    if not isinstance(value, (int, float)) or value != value:
        return "—"
    if isinstance(low, (int, float)) and low == low and isinstance(high, (int, float)) and high == high:
        return f"{value:5.1f}% [{low:.1f}, {high:.1f}]"
    return f"{value:5.1f}%"


def _share(won: WonBack) -> str:
    return _pct(won.pct, won.low, won.high)


def diagnosis_table(found: dict | VariantDiagnosis) -> str:
    """A row per decoder layer (own and accumulated SQNR, what restoring it alone wins back, its cost), the
    layers that win back most marked; then the LM head's own error and the greedy restore curve. ``found`` as plain
    data is read here; as read (``ppl-audit diagnose``'s), taken as it is."""
    said = found if isinstance(found, VariantDiagnosis) else VariantDiagnosis.of_record(found)
    marked = set(said.ranking[:WORST])
    domain = f" of the domain {said.domain}" if said.domain else ""  # an audit of several corpora's
    lines = [f"{said.variant} ({said.method}): ΔPPL {said.delta_ppl_pct:+.2f}%, KL {said.kl:.5f} on "
             f"{said.windows} windows{domain} ({said.tokens} tokens)",
             f"  {'layer':>5}  {'own SQNR':>9}  {'acc. SQNR':>9}  {'own cos err':>11}  "
             f"{'restore wins back (KL, 95%)':>28}  {'ΔNLL':>7}  {'MiB':>6}"]
    for row in said.layers:
        lines.append(f"{'*' if row.layer in marked else ' '} {row.layer:>5}  {row.own_sqnr_db:7.1f}dB  "
                     f"{row.accumulated_sqnr_db:7.1f}dB  {row.own_cos_err:11.2e}  {_share(row.restore_kl):>28}  "
                     f"{_pct(row.restore_nll.pct):>7}  {row.restore_mib:6.2f}")
    lines.append(f"  head: KL {said.head.kl:.2e} of its own (the variant's LM head on the baseline's final "
                 f"hidden states), same top token {100 * said.head.top1:.2f}%; input embeddings: SQNR "
                 f"{said.embeddings.sqnr_db:.1f} dB (what restoring every layer cannot win back)")
    lines.append("  restore curve (greedy): " + "; ".join(
        f"{len(step.restored)} layers {list(step.restored)}: KL {step.kl:.5f} ({_pct(step.kl_recovery.pct)} "
        f"back), ΔNLL {step.delta_nll:+.5f}, +{step.mib:.2f} MiB" for step in said.restore_curve[1:]))
    lines.append(f"  * the {WORST} layers that win back most alone; took {said.seconds:.0f} s")
    return "\n".join(lines)


def layers_chart(said: VariantDiagnosis) -> Figure:
    """Own and accumulated SQNR per layer (lines, left axis) and the KL restoring each wins back (bars, right)."""
    figure = Figure(figsize=(WIDTH, 5), dpi=DPI, layout="constrained")
    axis = figure.subplots()
    layers = [row.layer for row in said.layers]
    twin = axis.twinx()
    shares = [row.restore_kl for row in said.layers]
    errors = [[max(0.0, won.pct - won.low) if won.low == won.low else 0.0 for won in shares],  # NaN: no interval
              [max(0.0, won.high - won.pct) if won.high == won.high else 0.0 for won in shares]]
    twin.bar(layers, [won.pct for won in shares], color=RECOVERY, alpha=0.5, yerr=errors, capsize=2,
             label="KL won back restoring it alone")
    twin.set_ylabel("KL won back (% of the variant's)", fontsize=TEXT)
    for sqnr, colour, label in (([row.own_sqnr_db for row in said.layers], OWN, "own SQNR (baseline's input)"),
                                ([row.accumulated_sqnr_db for row in said.layers], ACCUMULATED,
                                 "accumulated SQNR (end to end)")):
        axis.plot(layers, sqnr, "o-", color=colour, label=label)
    axis.set_zorder(twin.get_zorder() + 1)
    axis.patch.set_visible(False)
    axis.set_xlabel("decoder layer", fontsize=TEXT)
    axis.set_ylabel("SQNR (dB; higher is closer to the baseline)", fontsize=TEXT)
    handles = axis.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    figure.legend(handles=handles, fontsize=SMALL, loc="outside lower center", ncols=3)  # off the bars
    figure.suptitle(f"{said.variant}: where in the model it loses (worst first: {list(said.ranking[:WORST])})",
                    fontsize=TITLE)
    return figure


def restore_curve_chart(said: VariantDiagnosis) -> Figure:
    """KL and ΔNLL left after restoring 0, 1, ... layers greedily, each point labelled with its extra MiB."""
    figure = Figure(figsize=(WIDTH, 4.5), dpi=DPI, layout="constrained")
    axis = figure.subplots()
    steps = said.restore_curve
    counts = [len(step.restored) for step in steps]
    axis.plot(counts, [step.kl for step in steps], "o-", color=FAIL_COLOUR, label="mean KL(baseline‖variant)")
    for count, step in zip(counts, steps):
        axis.annotate(f"+{step.mib:.1f} MiB" if count else "as quantized", (count, step.kl),
                      textcoords="offset points", xytext=(4, 6), fontsize=SMALL)
    added = [""] + [f"+ layer {(set(b.restored) - set(a.restored)).pop()}" for a, b in zip(steps, steps[1:])]
    twin = axis.twinx()
    deltas = [step.delta_nll for step in steps]
    twin.plot(counts, deltas, "s--", color=BASELINE_COLOUR, label="ΔNLL")
    # both from zero: a curve drawn from its own minimum makes a tenth of a nat look like the whole loss
    axis.set_ylim(0, 1.1 * max(step.kl for step in steps) or 1.0)
    twin.set_ylim(1.1 * min(0.0, *deltas), 1.1 * max(0.0, *deltas) or 1.0)
    axis.set_xticks(counts, labels=[f"{count}\n{label}" for count, label in zip(counts, added)])
    axis.set_xlabel("decoder layers restored (greedy: each the one that wins back most beside those before)",
                    fontsize=TEXT)
    axis.set_ylabel("mean KL", fontsize=TEXT)
    twin.set_ylabel("ΔNLL (nats per token)", fontsize=TEXT)
    axis.legend(handles=axis.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0], fontsize=SMALL)
    figure.suptitle(f"{said.variant}: what keeping layers in the baseline's precision wins back", fontsize=TITLE)
    return figure


def keep(found: dict) -> Path:
    """Write the diagnosis to ``<home>/diagnoses`` first: nothing computed is lost if tracking fails."""
    said = VariantDiagnosis.of_record(found)
    folder = home() / "diagnoses"
    folder.mkdir(parents=True, exist_ok=True)
    domain = f".{said.domain}" if said.domain else ""  # two domains' diagnoses in one second: two files
    audit = "audit" if said.audit is None else said.audit  # one made but by the diagnose flow names none
    path = folder / f"{datetime.now():%Y%m%dT%H%M%S}-{audit}-{said.variant}{domain}.json"
    path.write_text(diagnosis_json(said.as_record()) + "\n")
    return path


def diagnosis_json(found: dict) -> str:
    """One JSON line (NaN, which JSON has not, as null) of plain data: a diagnosis's, or a tune's
    (``tasks.record.tuning``)."""
    def plain(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return json.dumps(plain(found))


def log_diagnosis_run(client, experiment_id: str, found: dict, tags: dict[str, str]) -> str:
    """An MLflow run of the diagnosis, with ``tags`` (its audit's run as parent): per-layer metrics by layer as the
    step (MLflow's charts draw them along the layers), the curve by layers restored, the JSON, both charts.
    Returns its id."""
    said = VariantDiagnosis.of_record(found)
    on = f" on the domain {said.domain}" if said.domain else ""
    tags = tags | {"ppl_audit.kind": "diagnosis", "ppl_audit.variant": said.variant,
                   "mlflow.note.content": f"Where `{said.variant}` loses{on}, layers most responsible first: "
                                          f"{list(said.ranking)}"}
    if said.domain:  # which of its audit's corpora it was diagnosed on
        tags[DOMAIN] = said.domain
    run = client.create_run(experiment_id, run_name=f"diagnose {said.variant}{on}", tags=tags).info.run_id
    metrics = _metrics(said, int(time.time() * 1000))
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(run, metrics=metrics[start : start + 1000])
    client.log_dict(run, json.loads(diagnosis_json(said.as_record())), "diagnosis.json")
    client.log_figure(run, layers_chart(said), "layers.png")
    client.log_figure(run, restore_curve_chart(said), "restore_curve.png")
    client.set_terminated(run, "FINISHED")
    return run


def _metrics(said: VariantDiagnosis, now: int) -> list:
    """The run's metrics: the variant's loss and its head's at step 0, each layer's figures (those measured: NaN is
    none) by layer as the step, the curve's by layers restored."""
    from mlflow.entities import Metric

    metrics = [Metric(key, float(value), now, 0) for key, value in
               (("delta_nll", said.delta_nll), ("delta_ppl_pct", said.delta_ppl_pct), ("kl", said.kl),
                ("head_kl", said.head.kl))]
    for row in said.layers:
        figures = (("own_sqnr_db", row.own_sqnr_db), ("accumulated_sqnr_db", row.accumulated_sqnr_db),
                   ("own_cos_err", row.own_cos_err), ("restore_recovery_pct", row.restore_kl.pct))
        metrics += [Metric(f"layer_{key}", float(value), now, row.layer) for key, value in figures if value == value]
    for step in said.restore_curve:
        metrics += [Metric(f"curve_{key}", float(value), now, len(step.restored))
                    for key, value in (("kl", step.kl), ("delta_nll", step.delta_nll), ("mib", step.mib))]
    return metrics
