"""What a config says where pydantic does not hand it over as settings: pydantic's details of what it refused
(``tasks.config.validation_line`` makes one line of them), and the parts of the raw YAML a validator reads before
pydantic does (retired evaluation settings, a gptq variant's per-module overrides). Each read once, here, into a
small typed value."""

from __future__ import annotations

from dataclasses import dataclass

# evaluation.divergence's modes before the baseline reference: refused in a config, read as on in an old record
RETIRED_DIVERGENCE = ("auto", "lockstep", "topk")


@dataclass(frozen=True)
class Refusal:
    """One thing pydantic refused: its ``type`` (``extra_forbidden``, ``string_pattern_mismatch``, ...), where
    (``loc``, its parts), why (``msg``), the value refused (``input``), and what a pattern or length refusal was
    checked against (``pattern``, ``max_length``; None for other refusals)."""

    type: str
    loc: tuple[int | str, ...]
    msg: str
    input: object
    pattern: str | None = None
    max_length: int | None = None

    @classmethod
    def of_detail(cls, detail: dict) -> Refusal:
        """``detail``: one of a ``ValidationError``'s ``errors()``."""
        context = detail.get("ctx", {})
        return cls(type=detail["type"], loc=tuple(detail["loc"]), msg=detail["msg"], input=detail["input"],
                   pattern=context.get("pattern"), max_length=context.get("max_length"))


def refusals(error) -> tuple[Refusal, ...]:
    """What a pydantic ``ValidationError`` refused, in its order."""
    return tuple(Refusal.of_detail(detail) for detail in error.errors())


@dataclass(frozen=True)
class RetiredSaid:
    """The settings an evaluation section gives that were retired with the baseline reference: its ``divergence``
    as written (a retired mode, or what today's setting reads), and whether it gives ``top_k``."""

    divergence: object
    top_k: bool

    @classmethod
    def of_section(cls, section: dict) -> RetiredSaid:
        return cls(divergence=section.get("divergence"), top_k="top_k" in section)


def evaluation_of_record(section: dict) -> dict:
    """A recorded evaluation section as today's settings read it: ``top_k`` left out, a retired divergence mode
    read as on (KL was computed then too)."""
    kept = {key: value for key, value in section.items() if key != "top_k"}
    if RetiredSaid.of_section(section).divergence in RETIRED_DIVERGENCE:
        kept["divergence"] = True
    return kept


@dataclass(frozen=True)
class OverrideSaid:
    """One ``+:``/``-:`` entry of a gptq variant's ``dynamic`` (pydantic has checked its keys and numbers): the bits
    and group size it sets, None where it leaves the variant's."""

    bits: int | None
    group_size: int | None

    @classmethod
    def of_entry(cls, override: dict) -> OverrideSaid:
        return cls(bits=override.get("bits"), group_size=override.get("group_size"))
