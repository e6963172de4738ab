"""A method's own settings: the keys of a variant that only some methods take (bits, type, kernel, ...).

Each key is declared once, by the family of keys that owns it (here, or in its method's module), with what a variant
of a method that does not take it is told (``Keys.refusals``); the registry composes every family into
``tasks.config.VariantSpec`` (``registry.MethodKeys``), so that YAML keeps its flat keys and code reads
``variant.bits`` of any variant. What a method takes, and its rules, are its settings model (``Method.settings``, a
``MethodSettings`` in its module): the variant's validator validates the method keys it gives with that model,
picked by its ``method`` through the registry (``registry.method_keys_given``, ``registry.refusal_of``). A variant
with several mistakes is told first of a key its method does not take (in ``MethodKeys``' order), then of its
method's rules, then of every variant's (``tasks.config.VariantSpec``).

Why not a pydantic discriminated union of variant classes, one per method: a variant is constructed, typed and
subclassed as one class (``VariantSpec(...)`` across the code and tests; ``BaselineSpec`` is one); its method is
changed after validation (``auto`` becomes what the checkpoint's files say, by ``model_copy``), which would leave a
per-method class disagreeing with its method; its method's default depends on ``path``; code asks any variant for
``type`` or ``dynamic``; and this layer, below ``tasks.config``, cannot subclass it. A dispatch through the registry
gives the same per-method validation, each refusal in our words, never pydantic's union wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

Bits = Literal[2, 3, 4, 8]  # what gptq and awq quantize to here (hqq too)
# the words for bits, group_size, sym and calibration given to a method that is not quantized with them
NOT_QUANTIZED_HERE = "{keys} only apply to {takers}, not to method {method}"


class Keys(BaseModel):
    """A family of keys only some methods take. ``refusals``: what a variant of a method that takes none of a key is
    told of it, by key ({keys}: the keys given of those sharing its words, {method}: its method, {takers}: the
    methods that take any of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    refusals: ClassVar[dict[str, str]] = {}


class Grouping(Keys):
    """The bit width and group size a method quantizes with (gptq and awq made here, hqq as it loads)."""

    bits: Bits | None = None
    group_size: int | None = None
    refusals: ClassVar[dict[str, str]] = {"bits": NOT_QUANTIZED_HERE, "group_size": NOT_QUANTIZED_HERE}

    def group_size_problem(self, given: Given) -> str | None:
        return given.method.group_size_problem(self.group_size) if self.group_size is not None else None


class Variant(Protocol):
    """What a method's checks read of a variant (``tasks.config.VariantSpec``, which this layer cannot import)."""

    name: str
    method: str
    path: str | None
    gguf_file: str | None
    type: str | None
    group_size: int | None


class Checks(Protocol):
    """What a method's rules ask its descriptor (``tasks.methods.method.Method``, which names this module)."""

    def group_size_problem(self, group_size: int) -> str | None: ...

    def source_problem(self, spec: Variant) -> str | None: ...


@dataclass(frozen=True)
class Given:
    """What a method's settings are validated with besides its keys: the variant that gives them, and its method."""

    variant: Variant
    method: Checks


def first(*problems: str | None) -> str | None:
    """The first of a method's rules that a variant breaks, in the order a variant breaking several is told of them."""
    return next((problem for problem in problems if problem), None)


class MethodSettings(Keys):
    """A method's settings: the families of keys it takes, validated from those a variant gives with the variant as
    context; ``problem``: its rules. This base: a method that takes none (its only rule: a checkpoint to load, where
    it needs one). ``says``: its own words for a key it does not take, where they say more than the key's owner's;
    ``taken_with``: a key given with another (by key) that is the other's, not one of its settings."""

    says: ClassVar[dict[str, str]] = {}
    taken_with: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> MethodSettings:
        problem = self.problem(info.context)
        if problem:
            raise ValueError(problem)
        return self

    def problem(self, given: Given) -> str | None:
        """Why the variant's settings do not fit its method (None: they do)."""
        return given.method.source_problem(given.variant)
