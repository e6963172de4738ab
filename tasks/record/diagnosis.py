"""A variant's diagnosis as users read it: a console table, two charts, a JSON file kept locally and an MLflow run.

The diagnosis itself is plain data (``tasks.audit.diagnose.diagnosis_report``): per decoder layer its own and accumulated
SQNR and what restoring it alone wins back, the ranking, and the greedy restore curve.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path

from matplotlib.figure import Figure

from tasks.core.places import home
from tasks.record.plots import COLOURS, DPI, SMALL, TEXT, TITLE, WIDTH
from tasks.record.tags import DOMAIN

WORST = 3  # layers marked in the console table: those that win back most
OWN, ACCUMULATED, RECOVERY = "#c62828", "#1565c0", "#9e9e9e"


def _pct(value, low=None, high=None) -> str:
    if not isinstance(value, (int, float)) or value != value:
        return "—"
    if isinstance(low, (int, float)) and low == low and isinstance(high, (int, float)) and high == high:
        return f"{value:5.1f}% [{low:.1f}, {high:.1f}]"
    return f"{value:5.1f}%"


def diagnosis_table(found: dict) -> str:
    """A row per decoder layer (own and accumulated SQNR, what restoring it alone wins back, its cost), the
    layers that win back most marked; then the LM head's own error and the greedy restore curve."""
    marked = set(found["ranking"][:WORST])
    domain = f" of the domain {found['domain']}" if found.get("domain") else ""  # an audit of several corpora's
    lines = [f"{found['variant']} ({found['method']}): ΔPPL {found['delta_ppl_pct']:+.2f}%, KL {found['kl']:.5f} on "
             f"{found['windows']} windows{domain} ({found['tokens']} tokens)",
             f"  {'layer':>5}  {'own SQNR':>9}  {'acc. SQNR':>9}  {'own cos err':>11}  "
             f"{'restore wins back (KL, 95%)':>28}  {'ΔNLL':>7}  {'MiB':>6}"]
    for row in found["layers"]:
        pct = _pct(row["restore_recovery_pct"], row["restore_recovery_low"], row["restore_recovery_high"])
        lines.append(f"{'*' if row['layer'] in marked else ' '} {row['layer']:>5}  {row['own_sqnr_db']:7.1f}dB  "
                     f"{row['accumulated_sqnr_db']:7.1f}dB  {row['own_cos_err']:11.2e}  {pct:>28}  "
                     f"{_pct(row['restore_nll_recovery_pct']):>7}  {row['restore_mib']:6.2f}")
    lines.append(f"  head: KL {found['head']['kl']:.2e} of its own (the variant's LM head on the baseline's final "
                 f"hidden states), same top token {100 * found['head']['top1']:.2f}%; input embeddings: SQNR "
                 f"{found['embeddings']['sqnr_db']:.1f} dB (what restoring every layer cannot win back)")
    lines.append("  restore curve (greedy): " + "; ".join(
        f"{len(step['restored'])} layers {step['restored']}: KL {step['kl']:.5f} ({_pct(step['kl_recovery_pct'])} "
        f"back), ΔNLL {step['delta_nll']:+.5f}, +{step['mib']:.2f} MiB" for step in found["restore_curve"][1:]))
    lines.append(f"  * the {WORST} layers that win back most alone; took {found['seconds']:.0f} s")
    return "\n".join(lines)


def layers_chart(found: dict) -> Figure:
    """Own and accumulated SQNR per layer (lines, left axis) and the KL restoring each wins back (bars, right)."""
    figure = Figure(figsize=(WIDTH, 5), dpi=DPI, layout="constrained")
    axis = figure.subplots()
    layers = [row["layer"] for row in found["layers"]]
    twin = axis.twinx()
    recovery = [row["restore_recovery_pct"] for row in found["layers"]]
    errors = [[max(0.0, r - row["restore_recovery_low"]) if row["restore_recovery_low"] == row["restore_recovery_low"]
               else 0.0 for r, row in zip(recovery, found["layers"])],
              [max(0.0, row["restore_recovery_high"] - r) if row["restore_recovery_high"] == row["restore_recovery_high"]
               else 0.0 for r, row in zip(recovery, found["layers"])]]
    twin.bar(layers, recovery, color=RECOVERY, alpha=0.5, yerr=errors, capsize=2, label="KL won back restoring it alone")
    twin.set_ylabel("KL won back (% of the variant's)", fontsize=TEXT)
    for key, colour, label in (("own_sqnr_db", OWN, "own SQNR (baseline's input)"),
                               ("accumulated_sqnr_db", ACCUMULATED, "accumulated SQNR (end to end)")):
        axis.plot(layers, [row[key] for row in found["layers"]], "o-", color=colour, label=label)
    axis.set_zorder(twin.get_zorder() + 1)
    axis.patch.set_visible(False)
    axis.set_xlabel("decoder layer", fontsize=TEXT)
    axis.set_ylabel("SQNR (dB; higher is closer to the baseline)", fontsize=TEXT)
    handles = axis.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    figure.legend(handles=handles, fontsize=SMALL, loc="outside lower center", ncols=3)  # off the bars
    figure.suptitle(f"{found['variant']}: where in the model it loses (worst first: {found['ranking'][:WORST]})",
                    fontsize=TITLE)
    return figure


def restore_curve_chart(found: dict) -> Figure:
    """KL and ΔNLL left after restoring 0, 1, ... layers greedily, each point labelled with its extra MiB."""
    figure = Figure(figsize=(WIDTH, 4.5), dpi=DPI, layout="constrained")
    axis = figure.subplots()
    steps = found["restore_curve"]
    counts = [len(step["restored"]) for step in steps]
    axis.plot(counts, [step["kl"] for step in steps], "o-", color=COLOURS["fail"], label="mean KL(baseline‖variant)")
    for count, step in zip(counts, steps):
        axis.annotate(f"+{step['mib']:.1f} MiB" if count else "as quantized", (count, step["kl"]),
                      textcoords="offset points", xytext=(4, 6), fontsize=SMALL)
    added = [""] + [f"+ layer {(set(b['restored']) - set(a['restored'])).pop()}" for a, b in zip(steps, steps[1:])]
    twin = axis.twinx()
    deltas = [step["delta_nll"] for step in steps]
    twin.plot(counts, deltas, "s--", color=COLOURS["baseline"], label="ΔNLL")
    # both from zero: a curve drawn from its own minimum makes a tenth of a nat look like the whole loss
    axis.set_ylim(0, 1.1 * max(step["kl"] for step in steps) or 1.0)
    twin.set_ylim(1.1 * min(0.0, *deltas), 1.1 * max(0.0, *deltas) or 1.0)
    axis.set_xticks(counts, labels=[f"{count}\n{label}" for count, label in zip(counts, added)])
    axis.set_xlabel("decoder layers restored (greedy: each the one that wins back most beside those before)",
                    fontsize=TEXT)
    axis.set_ylabel("mean KL", fontsize=TEXT)
    twin.set_ylabel("ΔNLL (nats per token)", fontsize=TEXT)
    axis.legend(handles=axis.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0], fontsize=SMALL)
    figure.suptitle(f"{found['variant']}: what keeping layers in the baseline's precision wins back", fontsize=TITLE)
    return figure


def keep(found: dict) -> Path:
    """Write the diagnosis to ``<home>/diagnoses`` first: nothing computed is lost if tracking fails."""
    folder = home() / "diagnoses"
    folder.mkdir(parents=True, exist_ok=True)
    domain = f".{found['domain']}" if found.get("domain") else ""  # two domains' diagnoses in one second: two files
    path = folder / f"{datetime.now():%Y%m%dT%H%M%S}-{found.get('audit', 'audit')}-{found['variant']}{domain}.json"
    path.write_text(diagnosis_json(found) + "\n")
    return path


def diagnosis_json(found: dict) -> str:
    """One JSON line (NaN, which JSON has not, as null)."""
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
    from mlflow.entities import Metric

    on = f" on the domain {found['domain']}" if found.get("domain") else ""
    tags = tags | {"ppl_audit.kind": "diagnosis", "ppl_audit.variant": found["variant"],
                   "mlflow.note.content": f"Where `{found['variant']}` loses{on}, layers most responsible first: "
                                          f"{found['ranking']}"}
    if found.get("domain"):  # which of its audit's corpora it was diagnosed on
        tags[DOMAIN] = found["domain"]
    run = client.create_run(experiment_id, run_name=f"diagnose {found['variant']}{on}", tags=tags).info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(found[key]), now, 0) for key in ("delta_nll", "delta_ppl_pct", "kl")]
    metrics += [Metric("head_kl", float(found["head"]["kl"]), now, 0)]
    for row in found["layers"]:
        metrics += [Metric(f"layer_{key}", float(row[key]), now, row["layer"])
                    for key in ("own_sqnr_db", "accumulated_sqnr_db", "own_cos_err", "restore_recovery_pct")
                    if row[key] == row[key]]
    for step in found["restore_curve"]:
        metrics += [Metric(f"curve_{key}", float(step[key]), now, len(step["restored"])) for key in ("kl", "delta_nll", "mib")]
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(run, metrics=metrics[start : start + 1000])
    client.log_dict(run, json.loads(diagnosis_json(found)), "diagnosis.json")
    client.log_figure(run, layers_chart(found), "layers.png")
    client.log_figure(run, restore_curve_chart(found), "restore_curve.png")
    client.set_terminated(run, "FINISHED")
    return run
