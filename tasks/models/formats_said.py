"""What a checkpoint's files say of its format, typed: read once from the dicts the packages hold (a loaded model's
``quantization_config``, HQQ's layer meta, the facts ``gguf_facts`` gives, a pydantic refusal), so that
``tasks.models.formats`` reads attributes. Each reader takes what it reads as the package gives it, key for key."""

from __future__ import annotations

from dataclasses import dataclass

# the settings of a gptq or awq config the facts show, in this order, those it gives
GPTQ_SHOWN = ("bits", "group_size", "sym", "desc_act", "format")


@dataclass(frozen=True)
class FormatLabel:
    """The short label a format's facts give the table (``gguf Q4_K_M``)."""

    label: str

    @classmethod
    def of_facts(cls, facts: dict) -> FormatLabel:
        return cls(label=facts["label"])


@dataclass(frozen=True)
class HqqMeta:
    """An HQQ layer's settings, as its ``meta`` holds them."""

    nbits: int
    group_size: int
    axis: int
    packing: str

    @classmethod
    def of_json(cls, meta: dict) -> HqqMeta:
        return cls(nbits=meta["nbits"], group_size=meta["group_size"], axis=meta["axis"], packing=meta["packing"])


@dataclass(frozen=True)
class GptqConfig:
    """A gptq or awq checkpoint's ``quantization_config``: the settings it gives of ``GPTQ_SHOWN`` (key, value, in
    that order: the facts show them as given), its bits and group size (None: not given), and how many modules its
    ``dynamic`` sets at other bits or group sizes (a tune's recipe; 0: none)."""

    shown: tuple[tuple[str, object], ...]
    bits: int | None
    group_size: int | None
    overrides: int

    @classmethod
    def of_json(cls, settings: dict) -> GptqConfig:
        dynamic = settings.get("dynamic")
        return cls(shown=tuple((key, settings[key]) for key in GPTQ_SHOWN if key in settings),
                   bits=settings.get("bits"), group_size=settings.get("group_size"),
                   overrides=len(dynamic) if dynamic else 0)


@dataclass(frozen=True)
class QuantArgs:
    """One quantization of a compressed-tensors config group (its ``weights`` or ``input_activations``)."""

    type: str | None
    num_bits: int | None
    group_size: int | None
    strategy: str | None
    dynamic: bool | str | None

    @classmethod
    def of_json(cls, args: dict) -> QuantArgs:
        return cls(type=args.get("type"), num_bits=args.get("num_bits"), group_size=args.get("group_size"),
                   strategy=args.get("strategy"), dynamic=args.get("dynamic"))


@dataclass(frozen=True)
class CompressedConfig:
    """A compressed-tensors ``quantization_config``: its format, the weight and input quantizations of its config
    groups (those that give one, in the groups' order), whether it has groups at all, and the modules it leaves
    alone (``ignore``, as given: None when it gives none)."""

    format: str | None
    grouped: bool
    weights: tuple[QuantArgs, ...]
    inputs: tuple[QuantArgs, ...]
    ignore: list[str] | None

    @classmethod
    def of_json(cls, settings: dict) -> CompressedConfig:
        groups = list((settings.get("config_groups") or {}).values())
        return cls(format=settings.get("format"), grouped=bool(groups),
                   weights=tuple(QuantArgs.of_json(g["weights"]) for g in groups if g.get("weights")),
                   inputs=tuple(QuantArgs.of_json(g["input_activations"]) for g in groups
                                if g.get("input_activations")),
                   ignore=settings.get("ignore"))
