"""What a recipe costs: the units it gives one choice (a decoder layer, or one of its fused groups), the sizes
of GGUF files' tensors, and the budget read against the variant's and the baseline's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tasks.core.errors import InputError
from tasks.models.gguf_file import read_header

MIB = 2**20
# A Hugging Face decoder layer's matrices and the GGUF tensors llama.cpp's converter makes of them
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
# The groups runtimes fuse into one kernel (vLLM's qkv_proj and gate_up_proj): one choice each
PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


@dataclass(frozen=True)
class Budget:
    """What the tuned variant may take: bits per weight of the decoder layers' matrices (``4.5bpw``), or MiB of the
    whole file (``120MiB``); ``+`` before the number: more than the variant itself takes (``+0.25bpw``)."""

    value: float
    unit: str  # "bpw" or "MiB"
    added: bool
    text: str = field(default="", compare=False)  # as the user gave it

    @classmethod
    def parse(cls, text: str) -> Budget:
        found = re.fullmatch(r"\s*(\+?)\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(bpw|MiB)\s*", text, re.IGNORECASE)
        if found is None:
            raise InputError(f"--budget {text!r}: give bits per weight (4.5bpw), MiB of the file (120MiB), or what "
                             "is added to the variant's own (+0.25bpw, +8MiB)")
        unit = "bpw" if found[3].lower() == "bpw" else "MiB"
        if float(found[2]) <= 0:
            raise InputError(f"--budget {text!r}: give a budget above zero")
        return cls(float(found[2]), unit, bool(found[1]), text.strip())

    def __str__(self) -> str:
        return self.text or f"{'+' if self.added else ''}{self.value:g}{self.unit}"


@dataclass(frozen=True)
class Unit:
    """What a recipe gives one choice: decoder layer ``layer``'s matrices ``modules`` (its part ``part``)."""

    layer: int
    part: str
    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        return str(self.layer) if self.part == "layer" else f"{self.layer}.{self.part}"

    @property
    def tensors(self) -> list[str]:
        return [f"blk.{self.layer}.{GGUF_NAMES[m]}.weight" for m in self.modules]

    def entry(self, ggml_type: str) -> str:
        """The llama-quantize ``--tensor-type`` entry that gives these tensors ``ggml_type`` (and no others: the
        pattern is anchored on the layer's number and the tensors' names)."""
        names = "|".join(GGUF_NAMES[m] for m in self.modules)
        return f"blk\\.{self.layer}\\.({names})\\.weight={ggml_type.lower()}"


def units_of(layers: int) -> list[Unit]:
    """A model's decoder layers as units, each layer's matrices one choice."""
    return [Unit(i, "layer", tuple(GGUF_NAMES)) for i in range(layers)]


def split(unit: Unit) -> list[Unit]:
    """A layer's fused groups as units of their own."""
    return [Unit(unit.layer, part, modules) for part, modules in PARTS.items()]


def splits(layers: int) -> int:
    """How many layers ``--per module`` splits into their groups: those that win back most whole, a quarter of the
    layers (at least 4): a layer that wins back little whole rarely holds a group that wins back much."""
    return min(layers, max(4, layers // 4))


@dataclass(frozen=True)
class Sizes:
    """A model file's tensors: bytes and type by name, and the decoder layers' matrices' weights and bytes. A GGUF
    file's are named as llama.cpp names them (``Unit.tensors``); a gptq checkpoint's matrices as the model names its
    modules, ``<prefix>.<layer>.<module>`` (``tasks.audit.recipe.gptq``)."""

    bytes: dict[str, int]
    types: dict[str, str]
    total: int
    elements: dict[str, int]
    prefix: str | None = None  # None: a GGUF file's names

    @classmethod
    def of(cls, path: Path) -> Sizes:
        tensors = read_header(path).tensors
        return cls({t.name: int(t.n_bytes) for t in tensors}, {t.name: t.tensor_type.name for t in tensors},
                   sum(int(t.n_bytes) for t in tensors), {t.name: int(t.n_elements) for t in tensors})

    @property
    def layers(self) -> int:
        """How many decoder layers the file has (llama.cpp names their tensors ``blk.<layer>.``)."""
        return 1 + max(int(name.split(".")[1]) for name in self.bytes if name.startswith("blk."))

    def names(self, unit: Unit) -> list[str]:
        """The names ``unit``'s matrices have here."""
        if self.prefix is None:
            return unit.tensors
        return [f"{self.prefix}.{unit.layer}.{module}" for module in unit.modules]

    def in_type(self, ggml_type: str, units: list[Unit]) -> Sizes:
        """These sizes with ``units``' matrices in ``ggml_type`` (a GGUF file's), costed from their weights before the
        file is made: what its blocks take, a lower bound where llama.cpp falls back to a larger type for a shape
        ``ggml_type`` cannot hold (a 576-wide row in 256-weight K-quant blocks)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
        names = [name for unit in units for name in self.names(unit)]
        return Sizes(self.bytes | {name: self.elements[name] // block * block_bytes for name in names},
                     self.types | dict.fromkeys(names, ggml_type), self.total, self.elements, self.prefix)

    def matrix_bytes(self, units: list[Unit]) -> int:
        return sum(self.bytes[name] for unit in units for name in self.names(unit))

    def matrix_weights(self, units: list[Unit]) -> int:
        return sum(self.elements[name] for unit in units for name in self.names(unit))


@dataclass(frozen=True)
class Span:
    """The sizes a budget is read against: the variant's and the baseline's decoder-layer matrices (bits per weight)
    and the variant's whole file (MiB)."""

    weights: int  # the decoder layers' matrices' weights
    variant_bytes: int  # what they take in the variant
    baseline_bytes: int  # and in the baseline's GGUF file
    file_bytes: int  # the variant's whole file

    def bpw(self, matrix_bytes: float) -> float:
        return 8 * matrix_bytes / self.weights

    def budget_for(self, extra: int, like: Budget) -> str:
        """The smallest budget in ``like``'s form (bits per weight or MiB, added or whole) that allows ``extra`` bytes
        beyond the variant's matrices: rounded up past it where it is printed, so that it does."""
        if like.unit == "bpw":
            value = 8 * extra / self.weights + (0 if like.added else self.bpw(self.variant_bytes))
            return f"{'+' if like.added else ''}{(math.floor(value * 1000) + 1) / 1000:.3f}bpw"
        value = (extra + (0 if like.added else self.file_bytes)) / MIB
        return f"{'+' if like.added else ''}{(math.floor(value * 1000) + 1) / 1000:.3f}MiB"

    def extra_bytes(self, budget: Budget) -> int:
        """What the budget allows the matrices beyond the variant's own; one line when it is below the variant's
        own size or above the baseline's."""
        if budget.unit == "bpw":
            target = (self.bpw(self.variant_bytes) + budget.value if budget.added else budget.value) * self.weights / 8
            own, top = f"{self.bpw(self.variant_bytes):.3f}bpw", f"{self.bpw(self.baseline_bytes):.3f}bpw"
        else:
            whole = (self.file_bytes + budget.value * MIB) if budget.added else budget.value * MIB
            target = whole - (self.file_bytes - self.variant_bytes)
            own = f"{self.file_bytes / MIB:.2f}MiB"
            top = f"{(self.file_bytes - self.variant_bytes + self.baseline_bytes) / MIB:.2f}MiB"
        if target <= self.variant_bytes:
            raise InputError(f"--budget {budget}: the variant itself takes {own} (its decoder layers' matrices in bits "
                             f"per weight, or its file in MiB); give more, e.g. +0.25bpw")
        if target > self.baseline_bytes:
            raise InputError(f"--budget {budget}: more than the baseline itself takes ({top}); give less, or audit "
                             "the baseline")
        return int(target - self.variant_bytes)


def span_of(variant: Sizes, baseline: Sizes, units: list[Unit]) -> Span:
    return Span(variant.matrix_weights(units), variant.matrix_bytes(units), baseline.matrix_bytes(units), variant.total)
