"""What the record keeps of a sequential run (``evaluation.sequential``): a typed value while the audit runs, the
record's plain dict at its boundary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequentialSaid:
    """A variant scored in a seeded random order that may stop once its verdict is settled
    (``tasks.audit.sequential.Watch.said``): the order's ``seed``, the confidence ``level`` and each gated figure's
    share of it (``alpha_each``), how much was scored, whether it ``stopped`` (``settled`` or ``ran to the end``),
    and at a stop the ``decision``, the sequences' ``bounds`` it rested on (by figure: low, high) and the
    ``windows`` scored."""

    seed: int
    level: float
    alpha_each: float
    scored_fraction: float
    windows_scored: int
    stopped: str
    decision: str | None = None
    bounds: dict[str, tuple[float, float]] | None = None
    windows: tuple[int, ...] | None = None

    def as_record(self) -> dict:
        """The record's dict of it, key for key and in the order the record has always held them."""
        said = {"seed": self.seed, "level": self.level, "alpha_each": self.alpha_each,
                "scored_fraction": self.scored_fraction, "windows_scored": self.windows_scored, "stopped": self.stopped}
        if self.stopped == "settled":
            said |= {"decision": self.decision, "bounds": {key: list(b) for key, b in (self.bounds or {}).items()},
                     "windows": list(self.windows or ())}
        return said
