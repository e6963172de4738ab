"""The recipe made and proven: checked on its file, the uniform variant of equal or larger size found, the audit of
them written, and the recipe compared with each uniform variant on the audit's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tasks.audit.recipe.measure import Measured, Tuning
from tasks.audit.recipe.plan import Prepared
from tasks.audit.recipe.sizes import MIB, Sizes
from tasks.config import AuditConfig
from tasks.engine.layers import recovered_share
from tasks.engine.paired import CONFIDENCE

# Uniform file types by their nominal bits per weight (llama.cpp's table): the uniform variant of equal or larger size
# the recipe is audited beside is the first of these at least as large as the recipe, as built
UNIFORM = (("Q2_K", 2.625), ("Q3_K_S", 3.4375), ("Q4_0", 4.5), ("Q4_1", 5.0), ("Q5_0", 5.5), ("Q5_1", 6.0),
           ("Q6_K", 6.5625), ("Q8_0", 8.5))


def report(tuning: Tuning, prepared: Prepared, file_type: str, donor_sizes: list[Sizes]) -> dict:
    """The tune as plain data: what the console, ``--json``, the files and the MLflow run are written from. Each
    chosen unit says the types its option's file holds for its tensors (``held``): llama.cpp falls back to another
    type for a shape the option cannot hold (a 576-wide row in 256-weight K-quant blocks)."""
    span, units, types = prepared.span, tuning.units, tuning.types

    def point(found: Measured) -> dict:
        return {"kl": found.kl, "delta_nll": found.delta_nll, "predicted": found.predicted, "share": list(found.share),
                "cost": found.cost, "bpw": span.bpw(span.variant_bytes + found.cost),
                "units": [units[c.unit].label for c in found.chosen]}

    chosen = [{"unit": units[c.unit].label, "layer": units[c.unit].layer, "part": units[c.unit].part,
               "modules": list(units[c.unit].modules), "type": types[c.option], "gain": c.gain, "share": list(c.share),
               "cost": c.cost, "held": sorted({donor_sizes[c.option].types[name] for name in units[c.unit].tensors})}
              for c in tuning.final.chosen]
    every = [{"unit": units[c.unit].label, "type": types[c.option], "gain": c.gain, "share": list(c.share),
              "cost": c.cost} for c in tuning.choices]
    return {"variant": prepared.variant, "file_type": file_type, "budget": str(prepared.budget), "per": prepared.per,
            "types": list(types), "budget_bpw": span.bpw(span.variant_bytes + prepared.extra),
            "extra_bytes": prepared.extra, "variant_bpw": span.bpw(span.variant_bytes),
            "baseline_bpw": span.bpw(span.baseline_bytes), "variant_kl": tuning.variant_kl,
            "variant_delta_nll": tuning.variant_delta_nll, "windows": tuning.windows, "tokens": tuning.tokens,
            "chosen": chosen, "every": every, "first": point(tuning.first), "final": point(tuning.final),
            "curve": [point(m) for m in tuning.curve], "tried": tuning.tried, "seconds": tuning.seconds,
            "tensor_types": tuning.tensor_types(), "group_size": 32}


def built(tuning: Tuning, prepared: Prepared, file_type: str, donor_sizes: list[Sizes]) -> tuple[Path, dict]:
    """The recipe made by llama.cpp's quantizer (cached), checked on the file: every tensor of a chosen unit in the
    type its option's uniform file gives it, every other as in the uniform variant, the whole within the budget."""
    from tasks.models import llama_cpp

    file = llama_cpp.made_file(prepared.baseline_file, file_type, tensor_types=tuple(tuning.tensor_types()))
    sizes, uniform = Sizes.of(file), Sizes.of(prepared.variant_file)
    expected = {name: uniform.types[name] for name in uniform.types} | tuning.expected_types(donor_sizes)
    wrong = sorted(name for name in expected if sizes.types.get(name) != expected[name])
    matrix = sizes.matrix_bytes(list(prepared.units))
    return file, {"file": file.name, "path": str(file), "bpw": prepared.span.bpw(matrix), "bytes": matrix,
                  "file_mib": sizes.total / MIB, "within": matrix <= prepared.span.variant_bytes + prepared.extra,
                  "checked": len(expected) - len(wrong), "tensors": len(expected), "wrong": wrong[:5]}


def uniform_above(prepared: Prepared, file_type: str, bpw: float) -> tuple[str, float] | None:
    """The smallest uniform file type (``UNIFORM``) whose decoder-layer matrices take at least ``bpw`` as
    llama.cpp's quantizer makes it from the baseline, and its bits per weight; None when none does."""
    from tasks.models import llama_cpp

    for name, nominal in UNIFORM:
        if nominal < bpw - 0.5 or name == file_type.upper():
            continue
        sizes = Sizes.of(llama_cpp.made_file(prepared.baseline_file, name))
        found = prepared.span.bpw(sizes.matrix_bytes(list(prepared.units)))
        if found >= bpw:
            return name, found
    return None


def audit_of(config: AuditConfig, variant: str, tensor_types: list[str], uniform: str | None) -> tuple[dict, dict]:
    """The audit of the recipe as a config (plain data, to be written as YAML): the uniform variant, the recipe,
    and the uniform variant of equal or larger size, with divergence on and the variant's gate for each; and the
    names it gives them (``tuned``, ``uniform``, ``larger``)."""
    spec = next(v for v in config.variants if v.name == variant)
    names = {"uniform": variant, "tuned": f"{variant}-tuned"}
    variants = [spec.model_dump(mode="json", exclude_defaults=True),
                spec.model_dump(mode="json", exclude_defaults=True) | {"name": names["tuned"], "tensor_types": tensor_types}]
    if uniform is not None:
        names["larger"] = f"{variant}-as-{uniform.lower()}"
        variants.append(spec.model_dump(mode="json", exclude_defaults=True) | {"name": names["larger"], "type": uniform})
    data = config.model_dump(mode="json", exclude_defaults=True)
    data |= {"name": f"{config.name}-tune", "variants": variants, "diagnose": False}
    data["evaluation"] = data.get("evaluation", {}) | {"divergence": "on"}
    gate = (data.get("thresholds") or {}).get("per_variant", {}).get(variant)
    if gate is not None:
        data["thresholds"]["per_variant"] = {name: gate for name in names.values()}
    data.pop("schedule", None)
    return data, names


def compared(tuned, other, tuned_bpw: float, other_bpw: float, label: str) -> tuple[bool, str]:
    """Whether the recipe's model is better than ``other`` beyond the paired intervals on the audit's tokens (its
    KL lower with the interval of the difference wholly below zero, its NLL not higher beyond noise), and the line
    that says so."""
    from tasks.engine.paired import cluster_mean

    a, b = tuned.result, other.result
    tokens = np.asarray(a.window_tokens)
    kl = recovered_share(np.asarray(b.extra["kl"], np.float64), np.asarray(a.extra["kl"], np.float64), tokens, CONFIDENCE)
    nll = cluster_mean(np.asarray(a.token_nll, np.float64) - np.asarray(b.token_nll, np.float64), tokens)
    better = kl[1] > 0 and not nll.low > 0
    mine, theirs = float(np.mean(a.extra["kl"])), float(np.mean(b.extra["kl"]))
    relative = (f"KL {-kl[0]:+.0f}% [{-kl[2]:+.0f}, {-kl[1]:+.0f}]" if theirs > 0 and kl[1] == kl[1]
                else f"KL {mine:.5f} against {theirs:.5f}")
    change = f"{relative}, ΔNLL {nll.value:+.5f} [{nll.low:+.5f}, {nll.high:+.5f}]"
    return better, (f"{'proven better' if better else 'not proven better'} than {label} "
                    f"({other_bpw:.3f} bpw) at {tuned_bpw - other_bpw:+.3f} bpw: {change}")
