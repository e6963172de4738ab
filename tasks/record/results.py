"""What scoring one model of an audit gives; the record and the verdict read it without the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tasks.record.reference_said import Divergence, ReferenceSaid
from tasks.record.sequential_said import SequentialSaid
from tasks.record.shard_said import ShardSaid

if TYPE_CHECKING:
    from tasks.engine.perplexity import Part, PerplexityResult
    from tasks.models.variants import VariantFacts


@dataclass(frozen=True)
class VariantResult:
    """One model's outcome, built once from what was measured (a failed one by ``failed``); a value derived from it
    (shards merged, a retry's, a joined reference) is a new one (``dataclasses.replace``).

    ``divergence``: a variant's, what its KL was measured against (None: not asked for). ``reference``: the
    baseline's, what its stored reference says (``ReferenceSaid``). ``sequential``: a variant scored in a random
    order that may stop once its verdict is settled (``SequentialSaid``).
    """

    name: str
    method: str
    status: str  # "ok" or "failed"
    reason: str = ""
    result: PerplexityResult | None = None
    facts: VariantFacts | None = None
    manifest: dict | None = field(default=None, repr=False)
    divergence: Divergence | None = None
    reference: ReferenceSaid | None = None
    part: Part | None = field(default=None, repr=False)  # a shard's windows, before they are merged
    shards: tuple[ShardSaid, ...] = ()  # per task that scored a piece of it: where it ran, what it scored
    sequential: SequentialSaid | None = None
    retry_elsewhere: bool = False  # failed in a way another worker may not (out of memory, a crash)
    started: float | None = None  # epoch seconds: when it began and ended (quantizing and loading included)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def failed(cls, name: str, method: str, reason: str, retry_elsewhere: bool = False, **known) -> VariantResult:
        """A model that could not be scored, with ``reason`` (one line) and what was ``known`` of it before it failed
        (its manifest, facts, shards' rows, times)."""
        return cls(name, method, "failed", reason, retry_elsewhere=retry_elsewhere, **known)
