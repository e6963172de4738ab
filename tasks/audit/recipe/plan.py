"""A tune checked before anything loads: the variant can be tuned, its options are ones it can take, the budget fits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.audit.checkpoints import Lineup, baseline_gguf
from tasks.audit.recipe import gptq
from tasks.audit.recipe.gptq import Kernels, Option, Shapes
from tasks.audit.recipe.sizes import Budget, Sizes, Span, Unit, span_of, split, units_of
from tasks.config import AuditConfig
from tasks.core import console
from tasks.core.errors import InputError
from tasks.methods.method import Tune
from tasks.methods.registry import method_of


TYPES = ("Q6_K", "Q8_0", "F16")  # the options a GGUF unit may take by default: more bits, and left unquantized


def check_tunable(config: AuditConfig, variant: str) -> None:
    """Refuse, in one line, a variant whose precision cannot be set module by module here."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    method = spec.backend  # what tune may do with it: its descriptor's tune, for a variant made here
    if method.tune is None or not method.made_here(spec):
        what = f"method {spec.method}" + (f" ({spec.path})" if spec.path else "")
        also = method.tune_refusal
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
    method: str = "gguf"  # a tunable method's name (tasks.methods: its tune)
    own: Option | None = None  # a gptq variant's bits and group size
    options: tuple[Option, ...] = ()
    shapes: Shapes | None = None
    kernels: Kernels | None = None  # what runs a gptq variant's modules where the tune loads them

    @property
    def tune(self) -> Tune:
        """What its method's tune is: a gptq one's checkpoints made by gptqmodel, a GGUF one's files by llama.cpp."""
        return method_of(self.method).tune

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


def requested(types: list[str] | None) -> list[str] | None:
    """The options asked for, each stripped; None (none asked for) means the defaults. An empty request (``--types
    ""``, a stray comma) is refused in one line: read as none, it ran minutes of a tune nobody asked for."""
    if types is None:
        return None
    found = [t.strip() for t in types]
    if not found or not all(found):
        raise InputError("--types: an empty option; give some (Q6_K,Q8_0,F16 for a GGUF variant; 8bit,g32,bf16 for a "
                         "gptq one), or leave --types out for the defaults")
    return found


def check_types(types: list[str]) -> tuple[str, ...]:
    """The option types, each a GGUF tensor type llama-quantize's --tensor-type takes; one line naming them when not."""
    from gguf import GGMLQuantizationType

    known = {t.name for t in GGMLQuantizationType}
    wrong = [t for t in types if t.upper() not in known]
    if wrong:
        raise InputError(f"--types {','.join(types)}: {', '.join(wrong)} is not a GGUF tensor type; "
                         f"give some of {', '.join(sorted(known))}")
    return tuple(t.upper() for t in types)


def check_buys(prepared: Prepared, option_sizes: list[Sizes], exact: bool) -> Prepared:
    """Refuse, in one line, a tune that could choose nothing: no option takes a unit beyond the variant's own bytes,
    or the budget allows less than the cheapest step any unit can take (with ``--per module``, a fused group's). It
    would measure for minutes first. ``exact``: the options' sizes are what their files will hold (a gptq tune's),
    not a lower bound (a GGUF tune's, costed before its files are made)."""
    units = list(prepared.units) + ([part for unit in prepared.units for part in split(unit)]
                                    if prepared.per == "module" else [])
    steps = [(sizes.matrix_bytes([unit]) - prepared.sizes.matrix_bytes([unit]), unit, label)
             for sizes, label in zip(option_sizes, prepared.types) for unit in units]
    cheapest = min((step for step in steps if step[0] > 0), default=None, key=lambda step: step[0])
    if cheapest is None:
        raise InputError(f"--types {','.join(prepared.types)}: no option holds a unit in more bytes than the variant "
                         f"({prepared.scheme}) does, so none can win anything back; give options of more bits")
    cost, unit, label = cheapest
    if prepared.extra < cost:
        what = f"layer {unit.layer}'s matrices" if unit.part == "layer" else f"layer {unit.layer}'s {unit.part}"
        smallest = prepared.span.budget_for(cost, prepared.budget)
        raise InputError(f"--budget {prepared.budget}: it buys no unit any option: the cheapest step, {what} at "
                         f"{label}, adds {'' if exact else 'at least '}{cost} bytes; the smallest budget that buys one "
                         f"is {'' if exact else 'at least '}{smallest}; give that or more")
    return prepared


def prepare_tune(lineup: Lineup, variant: str, budget: Budget, per: str, types: list[str] | None = None) -> Prepared:
    """The tune of ``lineup``'s one variant, checked: its options (``types``; None: the defaults), its units, and
    the budget read against it (below the variant's own size or above the baseline's: one line). A GGUF variant's
    file is made (cached); a gptq variant's sizes are costed from the baseline's shapes."""
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    types = requested(types)
    if checkpoint.spec.backend.tune.gptqmodel:
        prepared = _prepare_gptq(lineup, variant, budget, per, types)
        return check_buys(prepared, prepared.option_sizes(), exact=True)
    options = check_types(list(TYPES if types is None else types))
    variant_file, baseline_file = Path(checkpoint.source), baseline_gguf(lineup.baseline.model)
    sizes = Sizes.of(variant_file)
    units = tuple(units_of(sizes.layers))
    span = span_of(sizes, Sizes.of(baseline_file), list(units))
    prepared = Prepared(variant, budget, per, options, variant_file, baseline_file, units, span,
                        span.extra_bytes(budget), sizes, checkpoint.spec.type.upper())
    return check_buys(prepared, [sizes.in_type(option, list(units)) for option in options], exact=False)


def _prepare_gptq(lineup: Lineup, variant: str, budget: Budget, per: str, types: list[str] | None) -> Prepared:
    from tasks.models.resolve import device_and_dtype, model_files

    [checkpoint] = lineup.variants
    bits, group, sym = checkpoint.spec.quantization
    own = gptq.Option(bits, group)
    folder = model_files(lineup.baseline.source, fetch=True)
    shapes = gptq.Shapes.of(folder)
    kernels = Kernels(device_and_dtype(checkpoint.spec)[0].type, sym, shapes.widths)
    if types is None:
        options, left_out = gptq.defaults(own, shapes, kernels)
        for line in left_out:
            print(f"ppl-audit: note: {line}", file=console.err())
    else:
        options = list(dict.fromkeys(gptq.parse_options(t, own) for t in types))
    wrong = next((o for o in options if not shapes.fits(o.group)), None)
    if wrong is not None:
        raise InputError(f"--types {wrong.label}: group size {wrong.group} does not divide the input widths of "
                         f"{lineup.baseline.name}'s layers; give a group size that does")
    # a module of an option no kernel here runs fails the tune after its models are quantized: refused now, by name
    cannot = next(((o, problem) for o in options if (problem := kernels.problem(o))), None)
    if cannot is not None:
        raise InputError(f"--types {cannot[0].label}: {cannot[1]}; give options a kernel here runs")
    sizes = shapes.sizes(own)
    units = tuple(units_of(shapes.layers))
    span = span_of(sizes, shapes.sizes(gptq.Option(None, group)), list(units))
    return Prepared(variant, budget, per, tuple(o.label for o in options), None, folder, units, span,
                    span.extra_bytes(budget), sizes, own.scheme, "gptq", own, tuple(options), shapes, kernels)
