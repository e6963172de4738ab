"""A tune as users read it: the choice table on the console, the recipe in the formats quantizers read, the curve of
budget against KL, and an MLflow run under the audit of the recipe.

The tune itself is plain data (``flows.tune``): the choices with their measured gains and costs, the assignment
chosen and refined, the curve, the file as built, and the audit's verdicts against the uniform variants. Each function
here takes it as such and reads it once into its typed value (``tasks.record.tune_said``), which the views read.
"""

from __future__ import annotations

import json
import re
import time

from matplotlib.figure import Figure

from tasks.methods.registry import find_method
from tasks.record.plots import BASELINE_COLOUR, DPI, FAIL_COLOUR, SMALL, TEXT, TITLE, WIDTH
from tasks.record.tune_said import ChosenUnit, RecipeUnit, TuneFound, TuneRecipe

# What a GGUF type's precision is closest to in gptqmodel and compressed-tensors, which store integers of 2, 3, 4 or
# 8 bits: a 5- or 6-bit tensor is given 8 (more, never less, than the recipe measured); F16/BF16/F32: unquantized
INTEGER_BITS = {"Q2": 2, "Q3": 3, "Q4": 4, "Q5": 8, "Q6": 8, "Q8": 8}
FLOAT_TYPES = ("F16", "BF16", "F32")


def integer_bits(ggml_type: str) -> int | None:
    """The integer bits a gptq/compressed-tensors recipe gives a tensor of ``ggml_type``; None: left unquantized."""
    name = ggml_type.upper()
    return None if name in FLOAT_TYPES else INTEGER_BITS.get(name[:2], 8)


# what the recipe formats read: a whole tune, or a recipe written with only what they read
_Recipe = TuneFound | TuneRecipe


def _module_regex(found: _Recipe, layer: int, modules: tuple[str, ...]) -> str:
    names = "|".join(re.escape(m) for m in modules)
    return rf"{re.escape((found.own and found.own.prefix) or 'model.layers')}\.{layer}\.({names})$"


def _scheme(found: _Recipe, unit: ChosenUnit | RecipeUnit | None = None) -> tuple[int | None, int]:
    """The integer bits (None: left unquantized) and group size of the variant (``unit`` None) or of a chosen unit: a
    gptq tune's own; a GGUF tune's closest (``integer_bits``, the 32-weight blocks of llama.cpp's plain types)."""
    method = find_method(found.method)
    if method is not None and method.tune is not None and method.tune.gptqmodel:  # made by gptqmodel: its own scheme
        return (found.own.bits, found.own.group_size) if unit is None else (unit.scheme.bits, unit.scheme.group_size)
    return integer_bits(found.file_type if unit is None else unit.type) or (4 if unit is None else None), 32


def gptqmodel_dynamic(found: dict) -> dict:
    """gptqmodel's quantization config for the recipe: the variant's bits and group size, and its ``dynamic``
    per-module overrides (``gptqmodel_overrides``)."""
    return _dynamic(TuneRecipe.of_record(found))


def _dynamic(found: _Recipe) -> dict:
    bits, group = _scheme(found)
    return {"bits": bits, "group_size": group, "dynamic": gptqmodel_overrides(found)}


def gptqmodel_overrides(found: _Recipe) -> dict:
    """gptqmodel's ``dynamic`` per-module overrides for the recipe (``+:`` more bits or a smaller group, ``-:`` left
    unquantized), as its QuantizeConfig takes them and stores them in a checkpoint's quantization config (which vLLM
    and SGLang read); a gptq tune's are the ones its recipe was made with."""
    dynamic = {}
    for unit in found.chosen:
        bits, group = _scheme(found, unit)
        pattern = _module_regex(found, unit.layer, unit.modules)
        if bits is None:
            dynamic[f"-:{pattern}"] = {}
        else:
            dynamic[f"+:{pattern}"] = {"bits": bits, "group_size": group}
    return dynamic


def llm_compressor_recipe(found: dict) -> dict:
    """An llm-compressor recipe: the variant's scheme for every Linear, a config group per scheme the recipe gives
    more precision with (regex targets, which compressed-tensors matches before class names), the unquantized
    ignored."""
    return _compressor_recipe(TuneRecipe.of_record(found))


def _compressor_recipe(found: _Recipe) -> dict:
    def weights(bits: int, group: int) -> dict:
        grouping = {"strategy": "group", "group_size": group} if group > 0 else {"strategy": "channel"}
        return {"num_bits": bits, "type": "int", "symmetric": True} | grouping

    groups = {"group_0": {"targets": ["Linear"], "weights": weights(*_scheme(found))}}
    ignore = ["lm_head"]
    by_scheme: dict[tuple[int, int], list[str]] = {}
    for unit in found.chosen:
        (bits, group), target = _scheme(found, unit), "re:" + _module_regex(found, unit.layer, unit.modules)
        if bits is None:
            ignore.append(target)
        else:
            by_scheme.setdefault((bits, group), []).append(target)
    for i, (scheme, targets) in enumerate(sorted(by_scheme.items()), start=1):
        groups[f"group_{i}"] = {"targets": targets, "weights": weights(*scheme)}
    return {"quant_stage": {"quant_modifiers": {"GPTQModifier": {"ignore": ignore, "config_groups": groups}}}}


def tensor_type_lines(found: dict) -> str:
    """The recipe as a llama-quantize ``--tensor-type-file``: one PATTERN=TYPE a line."""
    return _tensor_type_lines(TuneRecipe.of_record(found))


def _tensor_type_lines(found: _Recipe) -> str:
    return "".join(f"{entry}\n" for entry in found.tensor_types)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _pct(share) -> str:
    value, low, high = share
    if low == low and high == high:
        return f"{value:5.1f}% [{low:.1f}, {high:.1f}]"
    return f"{value:5.1f}%"


def tune_table(found: dict | TuneFound) -> str:
    """What got more precision (its type, what it won back alone with its interval, its cost), the assignment as
    measured against the sum of its gains, the curve, the file as built and the verdicts."""
    return _table(_said(found))


def _table(found: TuneFound) -> str:
    lines = [f"{found.variant} ({found.file_type}): tune within {found.budget} — "
             f"{found.budget_bpw:.3f} bpw of the decoder layers' matrices, +{_mib(found.extra_bytes)} MiB; "
             f"measured on {found.windows} windows ({found.tokens} tokens)",
             f"  {'unit':>10}  {'type (as held)':>14}  {'wins back alone (KL, 95%)':>26}  {'KL gain':>9}  {'MiB':>6}"]
    for unit in found.chosen:
        held = "/".join(unit.held or [unit.type])
        shown = unit.type if held == unit.type else f"{unit.type} ({held})"
        lines.append(f"  {unit.unit:>10}  {shown:>14}  {_pct(unit.share):>26}  {unit.gain:9.2e}  "
                     f"{_mib(unit.cost):>6}")
    final = found.final
    lines.append(f"  as chosen: KL {final.kl:.5f} against {found.variant_kl:.5f} uniform "
                 f"({_pct(final.share)} won back; the units' gains alone add up to KL {final.predicted:.5f}); "
                 f"{found.tried} assignments scored, {found.seconds:.0f} s")
    lines.append("  curve: " + "; ".join(f"{point.bpw:.3f} bpw: KL {point.kl:.5f}" for point in found.curve))
    built = found.built
    if built:
        lines.append(f"  built: {built.file} — {built.bpw:.3f} bpw ({'within' if built.within else 'OVER'} "
                     f"the budget), {built.checked} tensors of {built.tensors} as the recipe says")
    for said in found.verdicts or ():
        lines.append(f"  {said}")
    return "\n".join(lines)


def budget_curve_chart(found: dict) -> Figure:
    """Mean KL on the sample against bits per weight: the uniform variant, the recipe at each share of the budget,
    and the uniform variants it was audited beside (their audit figures), so the front shows at a glance."""
    return _chart(TuneFound.of_record(found))


def _chart(found: TuneFound) -> Figure:
    figure = Figure(figsize=(WIDTH, 4.5), dpi=DPI, layout="constrained")
    axis = figure.subplots()
    points = [(found.variant_bpw, found.variant_kl)] + [(p.bpw, p.kl) for p in found.curve]
    axis.plot([p[0] for p in points], [p[1] for p in points], "o-", color=FAIL_COLOUR,
              label="recipe, measured on the sample (knapsack at ¼, ½, ¾ and all of the budget)")
    for i, (name, point) in enumerate(found.audited or ()):
        axis.plot(point.bpw, point.kl, "s", color=BASELINE_COLOUR,
                  label="audited on all of the audit's tokens" if i == 0 else None)
        axis.annotate(f"{name} (audit)", (point.bpw, point.kl), textcoords="offset points", xytext=(4, 6),
                      fontsize=SMALL)
    axis.set_ylim(0, 1.1 * max(p[1] for p in points) or 1.0)
    axis.set_xlabel("bits per weight of the decoder layers' matrices", fontsize=TEXT)
    axis.set_ylabel("mean KL(baseline‖variant)", fontsize=TEXT)
    axis.legend(fontsize=SMALL)
    figure.suptitle(f"{found.variant}: what the budget buys", fontsize=TITLE)
    return figure


def log_tune_run(client, experiment_id: str, found: dict, tags: dict[str, str]) -> str:
    """An MLflow run of the tune, with ``tags`` (the audit of the recipe as parent): the budget, the curve by step,
    the choice table, the recipe in every format, the chart. Returns its id."""
    from mlflow.entities import Metric, Param

    tune = TuneFound.of_record(found)
    tags = tags | {"ppl_audit.kind": "tune", "ppl_audit.variant": tune.variant,
                   "mlflow.note.content": "\n".join(tune.verdicts or ()) or f"tune {tune.variant}"}
    said = "PROVEN" if tune.proven and tune.proven.uniform else "NOT PROVEN"  # against the uniform variant
    run = client.create_run(experiment_id, run_name=f"tune {tune.variant} {tune.budget} · {said}",
                            tags=tags).info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(getattr(tune.final, key)), now, 0) for key in ("kl", "delta_nll", "predicted")]
    metrics += [Metric("variant_kl", float(tune.variant_kl), now, 0),
                Metric("budget_bpw", float(tune.budget_bpw), now, 0)]
    metrics += [Metric(f"curve_{key}", float(getattr(point, key)), now, step) for step, point in enumerate(tune.curve)
                for key in ("kl", "bpw")]
    if tune.built:
        metrics.append(Metric("built_bpw", float(tune.built.bpw), now, 0))
    params = [Param("budget", tune.budget), Param("per", tune.per), Param("types", ",".join(tune.types)),
              Param("file_type", tune.file_type)]
    client.log_batch(run, metrics=metrics, params=params)
    client.log_dict(run, json.loads(_json(tune)), "tune.json")
    client.log_text(run, _table(tune), "choices.txt")
    if tune.tensor_types:  # a GGUF recipe's
        client.log_text(run, _tensor_type_lines(tune), "recipe/llama-quantize-tensor-types.txt")
    client.log_dict(run, _dynamic(tune), "recipe/gptqmodel-dynamic.json")
    client.log_dict(run, _compressor_recipe(tune), "recipe/llm-compressor-recipe.yaml")
    client.log_figure(run, _chart(tune), "budget_curve.png")
    client.set_terminated(run, "FINISHED")
    return run


def tune_json(found: dict | TuneFound) -> str:
    """One JSON line (NaN as null)."""
    return _json(_said(found))


def _said(found: dict | TuneFound) -> TuneFound:
    """A tune read once: given as plain data, read here; given as read (``ppl-audit tune``'s), taken as it is."""
    return found if isinstance(found, TuneFound) else TuneFound.of_record(found)


def _json(found: TuneFound) -> str:
    from tasks.record.diagnosis import diagnosis_json

    return diagnosis_json(found.as_record())
