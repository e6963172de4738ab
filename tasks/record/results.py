"""What scoring one model of an audit gives; the record and the verdict read it without the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.engine.perplexity import Part, PerplexityResult
    from tasks.models.variants import VariantFacts


@dataclass
class VariantResult:
    """One model's outcome.

    ``divergence``: a variant's, the reference its KL was measured against and the memory its LM head
    took. ``reference``: the baseline's, whether it was ``scored`` or ``reused`` from its stored
    reference (``key``, ``path``), the ``drift`` of a rescore from the reference before, or the
    ``problem`` that left it without one (``tasks.audit.scoring``). ``sequential``: a variant scored in a random
    order that may stop once its verdict is settled (``tasks.audit.sequential.Watch.said``).
    """

    name: str
    method: str
    status: str  # "ok" or "failed"
    reason: str = ""
    result: PerplexityResult | None = None
    facts: VariantFacts | None = None
    manifest: dict | None = field(default=None, repr=False)
    divergence: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    part: Part | None = field(default=None, repr=False)  # a shard's windows, before they are merged
    shards: list[dict] = field(default_factory=list)  # per shard: windows, tokens, worker, seconds
    sequential: dict = field(default_factory=dict)
    retry_elsewhere: bool = False  # failed in a way another worker may not (out of memory, a crash)
    started: float | None = None  # epoch seconds: when it began and ended (quantizing and loading included)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"
