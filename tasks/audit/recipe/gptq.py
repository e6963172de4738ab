"""A gptq recipe's options and sizes: what a module at other bits, another group size, or left unquantized costs in a
checkpoint gptqmodel saves, and what a made checkpoint holds (its ``dynamic`` overrides are written from the tune's
report: ``tasks.record.tuning.gptqmodel_dynamic``).

gptqmodel stores a module of ``in`` inputs and ``out`` outputs, quantized to ``bits`` in groups of ``group`` inputs,
as ``qweight`` (int32, ``in·bits/32 × out``), ``qzeros`` (int32, ``groups × out·bits/32``), ``scales`` (float16,
``groups × out``) and ``g_idx`` (int32, ``in``); a module its ``dynamic`` leaves unquantized (``-:``) as a bfloat16
``weight``. Those are the bytes costed here, and checked on the checkpoint as built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tasks.audit.recipe.sizes import GGUF_NAMES, Sizes
from tasks.core.errors import InputError
from tasks.methods.gptq import METHOD as GPTQ
from tasks.models.cost import tensor_shapes

FLOAT = "bf16"  # the option that leaves a unit unquantized: gptqmodel saves it in bfloat16
GROUP_SIZES = GPTQ.kernel_group_sizes  # those gptqmodel's kernels run (one a row: -1)
FLOAT_WORDS = ("bf16", "f16", "fp16", "unquantized")


@dataclass(frozen=True)
class Option:
    """What a unit may take: ``bits`` in groups of ``group`` inputs (-1: one group per output channel), or, with
    ``bits`` None, left unquantized (bfloat16)."""

    bits: int | None
    group: int

    @property
    def label(self) -> str:
        return FLOAT if self.bits is None else f"{self.bits}bit-g{self.group}"

    @property
    def scheme(self) -> str:
        """As the verdicts name a uniform variant of it: ``4-bit g64``."""
        return "unquantized (bf16)" if self.bits is None else f"{self.bits}-bit g{self.group}"

    def bytes(self, out: int, inputs: int) -> int:
        if self.bits is None:
            return 2 * out * inputs
        groups = 1 if self.group < 0 else -(-inputs // self.group)
        return inputs * out * self.bits // 8 + groups * out * self.bits // 8 + 2 * groups * out + 4 * inputs

    def override(self) -> dict:
        """What gptqmodel's ``dynamic`` gives a module to hold this option (``+:``)."""
        return {"bits": self.bits, "group_size": self.group}


def parse_options(text: str, variant: Option) -> Option:
    """An option as a user writes it: ``8bit`` (the variant's group size), ``g32`` (its bits), ``8bit-g32``, or
    ``bf16`` (left unquantized); one line when it is none of them."""
    word = text.strip().lower()
    if word in FLOAT_WORDS:
        return Option(None, variant.group)
    found = re.fullmatch(r"(?:(\d)bits?)?-?(?:g(-?\d+))?", word)
    if not word or found is None or not (found[1] or found[2]):
        raise InputError(f"--types {text}: a gptq option is 8bit (more bits, the variant's group size), g32 (a smaller "
                         "group), 8bit-g32, or bf16 (left unquantized)")
    option = Option(int(found[1]) if found[1] else variant.bits, int(found[2]) if found[2] else variant.group)
    if option.bits not in (2, 3, 4, 8) or option.group not in GROUP_SIZES:
        raise InputError(f"--types {text}: gptq takes 2, 3, 4 or 8 bits and a group size of "
                         f"{', '.join(map(str, GROUP_SIZES))}")
    return option


def defaults(variant: Option, shapes: Shapes, kernels: Kernels) -> tuple[list[Option], list[str]]:
    """More bits at the variant's group size, its bits at a smaller group size, and left unquantized: the three ways
    the issue's users give a module more precision, each one this machine's kernels run. The smaller group is the
    largest at most half the variant's (128 for one a row) that the model's widths take and a kernel here runs.
    Returns the options, and a line for each left out saying why."""
    half = 128 if variant.group < 0 else variant.group // 2
    smaller = [Option(variant.bits, group) for group in sorted(GROUP_SIZES, reverse=True)
               if 0 < group <= half and shapes.fits(group)]
    runs = [option for option in smaller if kernels.problem(option) is None]
    wanted = ([Option(8, variant.group)] if variant.bits != 8 else []) + runs[:1] + [Option(None, variant.group)]
    found = [option for option in wanted if kernels.problem(option) is None]
    left_out = [f"tune leaves out option {option.label}: {kernels.problem(option)}" for option in wanted
                if option not in found]
    if smaller and smaller[0] not in runs:
        which = "half the variant's group size" if smaller[0].group == half else "a smaller group size"
        instead = f"; it takes {runs[0].label} instead" if runs else ""
        left_out.insert(0, f"tune leaves out option {smaller[0].label} ({which}): {kernels.problem(smaller[0])}{instead}")
    return found, left_out


@dataclass(frozen=True)
class Kernels:
    """What runs a gptq tune's modules where it loads them (the variant's device): its options are those gptqmodel's
    kernels there can run (``tasks.models.quantize.gptq_kernel_problem``), checked before anything is quantized."""

    device_type: str
    sym: bool
    widths: tuple[int, ...]  # the inputs of the baseline's decoder-layer matrices

    def problem(self, option: Option) -> str | None:
        """Why ``option`` cannot run here; None when it can (an unquantized one always can)."""
        from tasks.models.quantize import gptq_kernel_problem

        if option.bits is None:
            return None
        return gptq_kernel_problem(option.bits, option.group, self.sym, self.widths, self.device_type)


@dataclass(frozen=True)
class Shapes:
    """The baseline's decoder-layer matrices as gptqmodel names them (``<prefix>.<layer>.<module>``): ``[out, in]``
    each; and the elements of every other tensor (which a gptq checkpoint keeps in bfloat16)."""

    prefix: str
    matrices: dict[str, tuple[int, int]]
    rest: int

    @classmethod
    def of(cls, folder: Path) -> Shapes:
        shapes = tensor_shapes(str(folder))
        first = next((re.fullmatch(r"(.*)\.0\.self_attn\.q_proj\.weight", name) for name in shapes
                      if name.endswith(".0.self_attn.q_proj.weight")), None)
        if first is None:
            raise InputError(f"{folder}: its decoder layers' matrices are not named as tune reads them "
                             f"(<layers>.N.{', '.join(GGUF_NAMES)}); tune a GGUF variant of it instead")
        prefix = first[1]
        pattern = re.compile(rf"{re.escape(prefix)}\.(\d+)\.({'|'.join(map(re.escape, GGUF_NAMES))})\.weight")
        matrices = {name.removesuffix(".weight"): (shape[0], shape[1]) for name, shape in shapes.items()
                    if pattern.fullmatch(name)}
        rest = sum(_count(shape) for name, shape in shapes.items() if name.removesuffix(".weight") not in matrices)
        return cls(prefix, matrices, rest)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted({inputs for _, inputs in self.matrices.values()}))

    def fits(self, group: int) -> bool:
        """Whether groups of ``group`` inputs divide every matrix's inputs (-1, one group a channel, always does)."""
        return group < 0 or all(inputs % group == 0 for _, inputs in self.matrices.values())

    @property
    def layers(self) -> int:
        return 1 + max(int(name[len(self.prefix) + 1:].split(".")[0]) for name in self.matrices)

    def sizes(self, option: Option) -> Sizes:
        """What every matrix takes at ``option``, and the checkpoint's whole size with the rest in bfloat16."""
        held = {name: option.bytes(*shape) for name, shape in self.matrices.items()}
        return Sizes(held, dict.fromkeys(held, option.label), sum(held.values()) + 2 * self.rest,
                     {name: out * inputs for name, (out, inputs) in self.matrices.items()}, self.prefix)


def _count(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def held(folder: Path, shapes: Shapes) -> dict[str, str]:
    """What a gptq checkpoint holds for each of ``shapes``' matrices, read from its tensors' shapes (no config
    trusted): ``<bits>bit-g<group>``, ``bf16`` for a plain weight, or what else it found."""
    stored = tensor_shapes(str(folder))
    found = {}
    for name, (out, inputs) in shapes.matrices.items():
        if f"{name}.qweight" in stored and f"{name}.scales" in stored:
            bits = stored[f"{name}.qweight"][0] * 32 // inputs
            groups = stored[f"{name}.scales"][0]
            found[name] = Option(bits, -1 if groups == 1 else inputs // groups).label
        elif f"{name}.weight" in stored:
            found[name] = FLOAT if stored[f"{name}.weight"] == [out, inputs] else "another shape"
        else:
            found[name] = "missing"
    return found


def larger(own: Option, shapes: Shapes, kernels: Kernels) -> list[Option]:
    """The uniform schemes a recipe of ``own`` may be audited beside, smallest first: its bits at a smaller group
    size, and 8 bits at any group size, that fit the model's widths and this machine's kernels run."""
    groups = [g for g in GROUP_SIZES if shapes.fits(g)]
    found = [Option(bits, group) for bits in sorted({own.bits, 8}) for group in groups
             if Option(bits, group) != own and (bits > own.bits or 0 < group < own.group or own.group < 0 < group)
             and kernels.problem(Option(bits, group)) is None]
    units = [(out, inputs) for out, inputs in shapes.matrices.values()]
    return sorted(found, key=lambda option: sum(option.bytes(*shape) for shape in units))


def as_name(variant: str, scheme: str) -> str:
    """The name a tune gives the uniform variant of ``scheme`` beside ``variant`` (``gptq-4bit-as-4-bit-g32``): in the
    audit of its recipe, and as the uniform model it measures an option with, so that both are one checkpoint."""
    return f"{variant}-as-" + scheme.lower().replace(" ", "-")
