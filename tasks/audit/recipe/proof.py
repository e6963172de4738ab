"""The recipe made and proven: checked on its file, the uniform variant of equal or larger size found, the audit of
them written, and the recipe compared with each uniform variant on the audit's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.audit.checkpoints import Lineup
from tasks.audit.recipe import gptq
from tasks.audit.recipe.measure import Measured, Tuning
from tasks.audit.recipe.plan import Prepared
from tasks.audit.recipe.sizes import MIB, Sizes
from tasks.config import AuditConfig, EvaluationConfig
from tasks.data.evaluation import Evaluation
from tasks.engine.layers import recovered_share
from tasks.engine.paired import CONFIDENCE
from tasks.record.tune_said import TuneRecipe

# Uniform file types by their nominal bits per weight (llama.cpp's table): the uniform variant of equal or larger size
# the recipe is audited beside is the first of these at least as large as the recipe, as built
UNIFORM = (("Q2_K", 2.625), ("Q3_K_S", 3.4375), ("Q4_0", 4.5), ("Q4_1", 5.0), ("Q5_0", 5.5), ("Q5_1", 6.0),
           ("Q6_K", 6.5625), ("Q8_0", 8.5))


def tune_report(tuning: Tuning, prepared: Prepared, donor_sizes: list[Sizes]) -> dict:
    """The tune as plain data: what the console, ``--json``, the files and the MLflow run are written from. Each
    chosen unit says what its option's uniform model holds for its matrices (``held``): llama.cpp falls back to
    another type for a shape the option cannot hold (a 576-wide row in 256-weight K-quant blocks)."""
    span, units, types = prepared.span, tuning.units, tuning.types

    def point(found: Measured) -> dict:
        return {"kl": found.kl, "delta_nll": found.delta_nll, "predicted": found.predicted, "share": list(found.share),
                "cost": found.cost, "bpw": span.bpw(span.variant_bytes + found.cost),
                "units": [units[c.unit].label for c in found.chosen]}

    def scheme(option: int) -> dict:  # a gptq option's bits (None: unquantized) and group size
        if not prepared.tune.gptqmodel:
            return {}
        return {"bits": prepared.options[option].bits, "group_size": prepared.options[option].group}

    chosen = [{"unit": units[c.unit].label, "layer": units[c.unit].layer, "part": units[c.unit].part,
               "modules": list(units[c.unit].modules), "type": types[c.option], "gain": c.gain, "share": list(c.share),
               "cost": c.cost, "held": sorted({donor_sizes[c.option].types[name]
                                               for name in donor_sizes[c.option].names(units[c.unit])})}
              | scheme(c.option) for c in tuning.final.chosen]
    every = [{"unit": units[c.unit].label, "type": types[c.option], "gain": c.gain, "share": list(c.share),
              "cost": c.cost} for c in tuning.choices]
    own = {"bits": prepared.own.bits, "group_size": prepared.own.group,
           "prefix": prepared.shapes.prefix} if prepared.tune.gptqmodel else {}
    return {"variant": prepared.variant, "method": prepared.method, "file_type": prepared.scheme,
            "budget": str(prepared.budget), "per": prepared.per,
            "types": list(types), "budget_bpw": span.bpw(span.variant_bytes + prepared.extra),
            "extra_bytes": prepared.extra, "variant_bpw": span.bpw(span.variant_bytes),
            "baseline_bpw": span.bpw(span.baseline_bytes), "variant_kl": tuning.variant_kl,
            "variant_delta_nll": tuning.variant_delta_nll, "windows": tuning.windows, "tokens": tuning.tokens,
            "chosen": chosen, "every": every, "first": point(tuning.first), "final": point(tuning.final),
            "curve": [point(m) for m in tuning.curve], "tried": tuning.tried, "seconds": tuning.seconds,
            "tensor_types": tuning.tensor_types() if not prepared.tune.gptqmodel else []} | own


@dataclass(frozen=True)
class RecipeChanges:
    """What the recipe changes in the variant's spec: a GGUF tune's llama-quantize ``tensor_types``, or a gptq tune's
    gptqmodel ``dynamic`` overrides (None for a GGUF tune)."""

    tensor_types: tuple[str, ...] = ()
    dynamic: dict | None = None

    def changes(self) -> dict:
        """As the variant's spec takes it, and as the audit's YAML and the tune's record write it."""
        if self.dynamic is not None:
            return {"dynamic": self.dynamic}
        return {"tensor_types": list(self.tensor_types)}


def _recipe(found: TuneRecipe, prepared: Prepared) -> RecipeChanges:
    """The recipe the tune ``found``: a gptq tune's as gptqmodel's overrides, a GGUF tune's as llama-quantize's."""
    from tasks.record.tuning import gptqmodel_overrides

    if prepared.tune.gptqmodel:
        return RecipeChanges(dynamic=gptqmodel_overrides(found))
    return RecipeChanges(tensor_types=found.tensor_types)


def proven_report(tuning: Tuning, prepared: Prepared, donor_sizes: list[Sizes], lineup: Lineup,
                  evaluation_: Evaluation) -> dict:
    """The tune's report (``tune_report``) with its recipe made and checked on what was made (``built``); ``lineup``
    holds the variant measured."""
    found = tune_report(tuning, prepared, donor_sizes)
    return found | {"built": built(found, tuning, prepared, donor_sizes, lineup, evaluation_)}


def built(found: dict, tuning: Tuning, prepared: Prepared, donor_sizes: list[Sizes], lineup: Lineup,
          evaluation_: Evaluation) -> dict:
    """The recipe made (cached: the audit of it finds it made) and checked on what was made: every matrix of a
    chosen unit as its option's uniform model holds it, every other as in the uniform variant, the whole within the
    budget. A GGUF file's tensor types are read from its header; a gptq checkpoint's bits and group sizes from its
    tensors' shapes."""
    recipe = _recipe(TuneRecipe.of_record(found), prepared)
    path = Path(_made(recipe, prepared, lineup, evaluation_))
    if prepared.tune.gptqmodel:
        held = gptq.held(path, prepared.shapes)
        sizes = Sizes(_stored(path, list(held)), held, _file_bytes(path), {}, prepared.shapes.prefix)
    else:
        sizes = Sizes.of(path)
    uniform = prepared.sizes
    expected = dict(uniform.types) | tuning.expected_types(donor_sizes)
    wrong = sorted(name for name in expected if sizes.types.get(name) != expected[name])
    matrix = sizes.matrix_bytes(list(prepared.units))
    return {"file": path.name, "path": str(path), "bpw": prepared.span.bpw(matrix), "bytes": matrix,
            "file_mib": sizes.total / MIB, "within": matrix <= prepared.span.variant_bytes + prepared.extra,
            "checked": len(expected) - len(wrong), "tensors": len(expected), "wrong": wrong[:5],
            "recipe": recipe.changes()}


def _made(recipe: RecipeChanges, prepared: Prepared, lineup: Lineup, evaluation_: Evaluation) -> str:
    """The recipe's file (llama.cpp's quantizer) or checkpoint (gptqmodel, with the variant's calibration), named as
    the audit of it names the tuned variant, so that the audit finds it made."""
    [checkpoint] = lineup.variants
    if prepared.tune.gptqmodel:
        from tasks.audit.checkpoints import quantized_checkpoint
        from tasks.data.corpus import corpus_text

        spec = checkpoint.spec.model_copy(update={"name": f"{prepared.variant}-tuned"} | recipe.changes())
        return quantized_checkpoint(spec, lineup, evaluation_, corpus_text, True)
    from tasks.models import llama_cpp

    # the type as the spec gives it, as the audit of the recipe asks for the file: one cached file, not two
    return str(llama_cpp.made_file(prepared.baseline_file, checkpoint.spec.type,
                                   tensor_types=recipe.tensor_types))


def _stored(folder: Path, modules: list[str]) -> dict[str, int]:
    """The bytes a checkpoint's tensors of each of ``modules`` take (their biases aside)."""
    from tasks.models.cost import checkpoint_tensor_bytes

    found = dict.fromkeys(modules, 0)
    for name, size in checkpoint_tensor_bytes(str(folder)).items():
        module, _, part = name.rpartition(".")
        if module in found and part != "bias":
            found[module] += size
    return found


def _file_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def uniform_above(prepared: Prepared, bpw: float) -> tuple[str, float, dict] | None:
    """The smallest uniform variant whose decoder-layer matrices take at least ``bpw``, its bits per weight and what
    it changes in the variant's spec; None when none does. A GGUF variant's from the file types of ``UNIFORM`` as
    llama.cpp's quantizer makes them from the baseline; a gptq variant's the same bits at a smaller group size, or 8
    bits (``gptq.larger``), costed from the baseline's shapes."""
    units = list(prepared.units)
    if prepared.tune.gptqmodel:
        for option in gptq.larger(prepared.own, prepared.shapes, prepared.kernels):
            found = prepared.span.bpw(prepared.shapes.sizes(option).matrix_bytes(units))
            if found >= bpw:
                return option.scheme, found, {"bits": option.bits, "group_size": option.group}
        return None
    from tasks.models import llama_cpp

    for name, nominal in UNIFORM:
        if nominal < bpw - 0.5 or name == prepared.scheme:
            continue
        sizes = Sizes.of(llama_cpp.made_file(prepared.baseline_file, name))
        found = prepared.span.bpw(sizes.matrix_bytes(units))
        if found >= bpw:
            return name, found, {"type": name}
    return None


def audit_of(config: AuditConfig, variant: str, recipe: dict, larger: tuple[str, float, dict] | None) -> tuple[dict, dict]:
    """The audit of the recipe as a config (plain data, to be written as YAML): the uniform variant, the recipe
    (``recipe``: what it changes in the variant's spec), and the uniform variant of equal or larger size
    (``uniform_above``), with divergence on and the variant's gate for each; and the names it gives them
    (``tuned``, ``uniform``, ``larger``)."""
    spec = next(v for v in config.variants if v.name == variant)
    tuned = f"{variant}-tuned"
    # gptq: every model of the audit loaded as the recipe's is (by gptqmodel, its scales exact): transformers' route,
    # which rounds them to bfloat16, would hand the recipe a small edge of its own (KL 0.0007 of 0.46 on the demo)
    same = {"dynamic": {}} if spec.backend.tune.gptqmodel else {}
    own = spec.model_dump(mode="json", exclude_defaults=True) | same
    variants = [own, own | {"name": tuned} | recipe]
    names = {"uniform": variant, "tuned": tuned}
    if larger is not None:
        label, _, changes = larger
        beside = gptq.as_name(variant, label)
        names |= {"larger": beside}
        variants.append(own | {"name": beside} | changes)
    data = config.model_dump(mode="json", exclude_defaults=True)
    # as the dump leaves it: out where it is its default (whose stride a validator fills), else without defaults
    given = {} if config.evaluation == EvaluationConfig() else \
        config.evaluation.model_dump(mode="json", exclude_defaults=True)
    data |= {"name": f"{config.name}-tune", "variants": variants, "diagnose": False,
             "evaluation": given | {"divergence": "on"}}
    gate = config.thresholds.per_variant.get(variant)
    if gate is not None:  # the variant's gate for each model (one value: the YAML names it once)
        limits = gate.model_dump(mode="json", exclude_defaults=True)
        thresholds = config.thresholds.model_dump(mode="json", exclude_defaults=True)
        data |= {"thresholds": thresholds | {"per_variant": {name: limits for name in names.values()}}}
    data.pop("schedule", None)
    return data, names


def compared(tuned, other, tuned_bpw: float, other_bpw: float, label: str) -> tuple[bool, str]:
    """Whether the recipe's model is better than ``other`` beyond the paired intervals on the audit's tokens (its
    KL lower with the interval of the difference wholly below zero, its NLL not higher beyond noise), and the line
    that says so."""
    from tasks.engine.paired import cluster_mean

    a, b = tuned.result, other.result
    tokens = np.asarray(a.window_tokens)
    tuned_kl, other_kl = a.extra.kl, b.extra.kl
    kl = recovered_share(np.asarray(other_kl, np.float64), np.asarray(tuned_kl, np.float64), tokens, CONFIDENCE)
    nll = cluster_mean(np.asarray(a.token_nll, np.float64) - np.asarray(b.token_nll, np.float64), tokens)
    better = bool(kl[1] > 0 and not nll.low > 0)  # numpy's bool is not JSON's
    mine, theirs = float(np.mean(tuned_kl)), float(np.mean(other_kl))
    relative = (f"KL {-kl[0]:+.0f}% [{-kl[2]:+.0f}, {-kl[1]:+.0f}]" if theirs > 0 and kl[1] == kl[1]
                else f"KL {mine:.5f} against {theirs:.5f}")
    change = f"{relative}, ΔNLL {nll.value:+.5f} [{nll.low:+.5f}, {nll.high:+.5f}]"
    return better, (f"{'proven better' if better else 'not proven better'} than {label} "
                    f"({other_bpw:.3f} bpw) at {tuned_bpw - other_bpw:+.3f} bpw: {change}")
