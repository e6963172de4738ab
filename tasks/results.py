"""What scoring one model of an audit gives; the record and the verdict read it without the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.perplexity import PerplexityResult
    from tasks.variants import VariantFacts


@dataclass
class VariantResult:
    """One model's outcome. ``divergence`` says how KL was measured (lockstep/topk) and its memory."""

    name: str
    method: str
    status: str  # "ok" or "failed"
    reason: str = ""
    result: PerplexityResult | None = None
    facts: VariantFacts | None = None
    manifest: dict | None = field(default=None, repr=False)
    divergence: dict = field(default_factory=dict)
    started: float | None = None  # epoch seconds: when it began and ended (quantizing and loading included)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"
