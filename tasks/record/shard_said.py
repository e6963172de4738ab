"""Where one task of a model ran (``ShardSaid``): a typed value while the audit runs (the runners read its worker and
what it scored), the record's plain dict of it (an entry's ``shards``) at its boundary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSaid:
    """One task that scored a piece of a model (``tasks.audit.pieces``): a shard's ``windows`` (first, stop) or a
    sequential run's ``sample`` (its windows, in order), the ``worker`` it ran on, the ``tokens`` it scored and its
    ``seconds`` once done, and why the try ``failed`` where it was tried again elsewhere."""

    worker: str
    windows: tuple[int, int] | None = None
    sample: tuple[int, ...] | None = None
    tokens: int | None = None
    seconds: float | None = None
    failed: str | None = None

    def as_record(self) -> dict:
        """The record's dict of it, key for key and in the order records have always held them."""
        piece = {"sample": list(self.sample)} if self.sample is not None else {"windows": list(self.windows)}
        done = {"tokens": self.tokens, "seconds": self.seconds} if self.tokens is not None else {}
        return piece | {"worker": self.worker} | done | ({"failed": self.failed} if self.failed is not None else {})
