"""A tune checked before anything loads: the variant can be tuned, its options are ones it can take, the budget fits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.audit.checkpoints import Lineup, baseline_gguf
from tasks.audit.recipe import gptq
from tasks.audit.recipe.gptq import Option, Shapes
from tasks.audit.recipe.sizes import Budget, Sizes, Span, Unit, span_of, units_of
from tasks.config import AuditConfig
from tasks.core.errors import InputError


TYPES = ("Q6_K", "Q8_0", "F16")  # the options a GGUF unit may take by default: more bits, and left unquantized


def check_tunable(config: AuditConfig, variant: str) -> None:
    """Refuse, in one line, a variant whose precision cannot be set module by module here."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    gguf, gptq = spec.method == "gguf" and spec.type is not None, spec.method == "gptq" and spec.path is None
    if not (gguf or gptq):
        what = f"method {spec.method}" + (f" ({spec.path})" if spec.path else "")
        also = (" (gptqmodel 7.6.0's AWQ quantizes every module at one bit width and group size: its dynamic only "
                "skips modules)") if spec.method == "awq" else ""
        raise InputError(f"variant '{variant}' is {what}: tune sets each module's precision in a model made here from "
                         "the baseline, so give the variant as method gguf with a type (type: Q4_0), or as method gptq "
                         f"without a path{also}")
    if spec.imatrix:
        raise InputError(f"variant '{variant}' is quantized with an importance matrix, which tune does not carry into "
                         "its uniform files yet; tune the variant without imatrix")
    if spec.tensor_types or spec.dynamic:
        raise InputError(f"variant '{variant}' already has {'tensor_types' if spec.tensor_types else 'dynamic'} (a "
                         "recipe): tune the uniform variant")


@dataclass(frozen=True)
class Prepared:
    """A tune checked before anything loads: the variant's file (a GGUF variant's; a gptq variant is made as it is
    measured), the baseline's, the units, the options (``types``: their labels), the sizes a budget is read against
    and the bytes it allows beyond the variant. A gptq tune has the baseline's matrices' shapes (``shapes``), from
    which its options' sizes are costed (``option_sizes``); a GGUF tune's are read from its options' files."""

    variant: str
    budget: Budget
    per: str
    types: tuple[str, ...]
    variant_file: Path | None
    baseline_file: Path
    units: tuple[Unit, ...]
    span: Span
    extra: int
    sizes: Sizes  # the variant's
    scheme: str  # the uniform variant's, as the verdicts name it: Q4_0, 4-bit g64
    method: str = "gguf"
    own: Option | None = None  # a gptq variant's bits and group size
    options: tuple[Option, ...] = ()
    shapes: Shapes | None = None

    def option_sizes(self) -> list[Sizes]:
        """A gptq tune's options' sizes, costed from the baseline's shapes."""
        return [self.shapes.sizes(option) for option in self.options]


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


def prepare(lineup: Lineup, variant: str, budget: Budget, per: str, types: list[str] | None = None) -> Prepared:
    """The tune of ``lineup``'s one variant, checked: its options (``types``; None: the defaults), its units, and
    the budget read against it (below the variant's own size or above the baseline's: one line). A GGUF variant's
    file is made (cached); a gptq variant's sizes are costed from the baseline's shapes."""
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    if checkpoint.spec.method == "gptq":
        return _prepare_gptq(lineup, variant, budget, per, types)
    options = check_types(list(types or TYPES))
    variant_file, baseline_file = Path(checkpoint.source), baseline_gguf(lineup.baseline.model)
    sizes = Sizes.of(variant_file)
    units = tuple(units_of(sizes.layers))
    span = span_of(sizes, Sizes.of(baseline_file), list(units))
    return Prepared(variant, budget, per, options, variant_file, baseline_file, units, span, span.extra_bytes(budget),
                    sizes, checkpoint.spec.type.upper())


def _prepare_gptq(lineup: Lineup, variant: str, budget: Budget, per: str, types: list[str] | None) -> Prepared:
    from tasks.models.resolve import model_files

    [checkpoint] = lineup.variants
    bits, group, _ = checkpoint.spec.quantization
    own = gptq.Option(bits, group)
    folder = model_files(lineup.baseline.source, fetch=True)
    shapes = gptq.Shapes.of(folder)
    options = tuple(dict.fromkeys(gptq.parse(t, own) for t in types)) if types else tuple(
        o for o in gptq.defaults(own) if shapes.fits(o.group))  # a default's smaller group where it fits the widths
    wrong = next((o for o in options if not shapes.fits(o.group)), None)
    if wrong is not None:
        raise InputError(f"--types {wrong.label}: group size {wrong.group} does not divide the input widths of "
                         f"{lineup.baseline.name}'s layers; give a group size that does")
    sizes = shapes.sizes(own)
    units = tuple(units_of(shapes.layers))
    span = span_of(sizes, shapes.sizes(gptq.Option(None, group)), list(units))
    return Prepared(variant, budget, per, tuple(o.label for o in options), None, folder, units, span,
                    span.extra_bytes(budget), sizes, own.scheme, "gptq", own, options, shapes)
