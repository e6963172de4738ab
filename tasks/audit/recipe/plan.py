"""A tune checked before anything loads: the variant can be tuned, the options are GGUF types, the budget fits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.audit.checkpoints import Lineup, baseline_gguf
from tasks.audit.recipe.sizes import Budget, Sizes, Span, Unit, span_of, units_of
from tasks.config import AuditConfig
from tasks.core.errors import InputError


def check_tunable(config: AuditConfig, variant: str) -> None:
    """Refuse, in one line, a variant whose precision cannot be set module by module here."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    if spec.method != "gguf" or spec.type is None:
        what = f"method {spec.method}" + (f" ({spec.path})" if spec.path else "")
        raise InputError(f"variant '{variant}' is {what}: tune sets each tensor's type in a GGUF file llama.cpp's "
                         "quantizer makes from the baseline, so give the variant as method gguf with a type "
                         "(type: Q4_0); gptq/awq recipes (gptqmodel's dynamic) are not made here yet")
    if spec.imatrix:
        raise InputError(f"variant '{variant}' is quantized with an importance matrix, which tune does not carry into "
                         "its uniform files yet; tune the variant without imatrix")
    if spec.tensor_types:
        raise InputError(f"variant '{variant}' already has tensor_types (a recipe): tune the uniform variant")


@dataclass(frozen=True)
class Prepared:
    """A tune checked before anything loads: the variant's file, the baseline's, the units, the sizes a budget is
    read against and the bytes it allows beyond the variant."""

    variant: str
    budget: Budget
    per: str
    types: tuple[str, ...]
    variant_file: Path
    baseline_file: Path
    units: tuple[Unit, ...]
    span: Span
    extra: int


def alone(config: AuditConfig, variant: str) -> AuditConfig:
    """The audit ``config`` with its variant ``variant`` alone, refused in one line where tune cannot set its
    precision module by module."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    check_tunable(config, variant)
    return config.model_copy(update={"variants": [spec]})


def check_types(types: list[str]) -> tuple[str, ...]:
    """The option types, each a GGUF tensor type llama-quantize's --tensor-type takes; one line naming them when not."""
    from gguf import GGMLQuantizationType

    known = {t.name for t in GGMLQuantizationType}
    wrong = [t for t in types if t.upper() not in known]
    if wrong or not types:
        raise InputError(f"--types {','.join(types)}: {', '.join(wrong) or 'none given'} is not a GGUF tensor type; "
                         f"give some of {', '.join(sorted(known))}")
    return tuple(t.upper() for t in types)


def prepare(lineup: Lineup, variant: str, budget: Budget, per: str, types: tuple[str, ...]) -> Prepared:
    """The tune of ``lineup``'s one variant, checked: its file made (cached), its units, and the budget read
    against it (below the variant's own size or above the baseline's: one line)."""
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    variant_file, baseline_file = Path(checkpoint.source), baseline_gguf(lineup.baseline.model)
    sizes = Sizes.of(variant_file)
    units = tuple(units_of(sizes.layers))
    span = span_of(sizes, Sizes.of(baseline_file), list(units))
    return Prepared(variant, budget, per, types, variant_file, baseline_file, units, span, span.extra_bytes(budget))
