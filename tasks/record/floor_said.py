"""What a variant's row says of it against the noise floor (``tasks.record.floor.judged``), typed: the judgement
(``FloorJudgement``) and its comparison with each floor (``AgainstFloor``); written into and read from the record's
row (``as_record``, ``of_record``) key for key and in the order records have always held them. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.core.plain import read_fields, write_fields


@dataclass(frozen=True)
class FloorDifference:
    """The variant's per-token figure less the floor's on the same tokens: the mean and its 95% interval."""

    difference: float
    low: float
    high: float

    def as_record(self) -> dict[str, float]:
        return write_fields(self)

    @classmethod
    def of_record(cls, said: dict) -> FloorDifference:
        return read_fields(cls, said)

    @property
    def above(self) -> bool | None:
        """Above beyond noise; None where the interval is not a number (one window)."""
        return bool(self.low > 0) if math.isfinite(self.low) else None


@dataclass(frozen=True)
class AgainstFloor:
    """A variant against one floor (``floor``, the baseline in ``dtype``): NLL paired (``nll``, ``ppl_above``), and
    where both measured KL, the floor's own mean KL (``kld``), the variant's (``kld_variant``) and their paired
    difference (``kl``); ``above`` is KL's where it was measured, else NLL's."""

    floor: str
    dtype: str
    nll: FloorDifference
    ppl_above: bool | None
    above: bool | None
    kld: float | None = None
    kld_variant: float | None = None
    kl: FloorDifference | None = None

    def as_record(self) -> dict:
        said = {"floor": self.floor, "dtype": self.dtype, "nll": self.nll.as_record(), "ppl_above": self.ppl_above}
        if self.kl is not None:
            said |= {"kld": self.kld, "kld_variant": self.kld_variant, "kl": self.kl.as_record()}
        return said | {"above": self.above}

    @classmethod
    def of_record(cls, said: dict) -> AgainstFloor:
        return read_fields(cls, said, {"nll": FloorDifference.of_record, "kl": FloorDifference.of_record})


@dataclass(frozen=True)
class FloorJudgement:
    """A variant against every floor: the one that decides (``dtype``, its mean KL ``kld``, whether the variant is
    ``above`` it), one line for the table and the report (``said``), and each floor's comparison (``floors``)."""

    dtype: str
    kld: float | None
    above: bool | None
    said: str
    floors: tuple[AgainstFloor, ...] = ()  # none in a record of before the floors were kept

    def as_record(self) -> dict:
        return {"dtype": self.dtype, "kld": self.kld, "above": self.above, "said": self.said,
                "floors": [found.as_record() for found in self.floors]}

    @classmethod
    def of_record(cls, said: dict) -> FloorJudgement:
        return read_fields(cls, said, {"floors": lambda floors: tuple(map(AgainstFloor.of_record, floors))})
