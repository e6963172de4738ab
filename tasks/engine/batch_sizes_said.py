"""The batch size cache's content (``$PPL_AUDIT_CACHE/batch_sizes.json``, ``tasks.engine.batching``) as a typed value:
this module alone reads and writes its keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizes:
    """The batch size found for each model, window and device (``batching._cache_key``)."""

    sizes: dict[str, int]

    @classmethod
    def of_json(cls, entry: dict) -> BatchSizes | None:
        """What a sealed entry holds; None where it holds a batch size that is not a positive whole number."""
        sizes = entry.get("sizes")
        if isinstance(sizes, dict) and all(isinstance(size, int) and not isinstance(size, bool) and size >= 1
                                           for size in sizes.values()):
            return cls(sizes)
        return None

    def to_json(self) -> dict:
        """The entry, before it is sealed."""
        return {"sizes": self.sizes}
