"""What of a model one scoring task scores (``Piece``), and what a variant measures its divergence against
(``Against``): typed values, so that each way of scoring is said, not chosen by which optional arguments are set."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.audit.cluster import worker
from tasks.record.results import VariantResult
from tasks.record.shard_said import ShardSaid


@dataclass(frozen=True)
class Whole:
    """Every window of the audit, as one result (a sequential run: in its seeded order, stopping itself once its
    verdict is settled)."""

    def row(self) -> ShardSaid | None:
        return None

    def named(self) -> str:
        return ""


@dataclass(frozen=True)
class Windows:
    """A shard: the windows ``first`` to ``stop - 1``, kept as a ``part`` for ``merge_shards``."""

    first: int
    stop: int

    @property
    def bounds(self) -> tuple[int, int]:
        return self.first, self.stop

    def row(self) -> ShardSaid:
        return ShardSaid(worker(), windows=self.bounds)

    def named(self) -> str:
        return f"-windows-{self.first}-{self.stop - 1}"


@dataclass(frozen=True)
class Sample:
    """A piece of a sequential run on a cluster: only these windows of the plan, in this order, as a ``part``."""

    windows: tuple[int, ...]

    def row(self) -> ShardSaid:
        return ShardSaid(worker(), sample=tuple(int(w) for w in self.windows))

    def named(self) -> str:
        return f"-sample-of-{len(self.windows)}-from-window-{self.windows[0]}"


Piece = Whole | Windows | Sample
WHOLE = Whole()


@dataclass(frozen=True)
class Slices:
    """The baseline a variant's shard measures its divergence against while the baseline's reference is still in
    slices: the outcomes of the baseline's first shard (its slice names the LM head) and of the shard over the same
    windows (whose slice it reads, ``tasks.audit.reference.slice_baseline``)."""

    shards: tuple[VariantResult, ...]


# what a variant measures against: the baseline's outcome (its stored reference, as its ``reference`` says, and its
# windows' NLL for a sequential run's watch), the slices its shards wrote, or nothing (a model scored alone)
Against = VariantResult | Slices | None
