"""What an audit says of the baseline's stored reference (``ReferenceSaid``) and of what a variant's divergence was
measured against (``Divergence``): typed values while the audit runs, the record's plain dict at its boundary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReferenceSaid:
    """The baseline's reference, for the record (``tasks.audit.scoring``): whether the baseline was ``scored`` or
    ``reused`` from it (``baseline``), its ``key`` and ``path`` once in place, the ``drift`` of a rescore from the
    reference stored before (``tasks.audit.reference.drift``), the ``problem`` that left it without one, the damaged
    references found and ``removed``, and ``baseline_key`` (which audits compare with this one,
    ``tasks.audit.reference.baseline_key``). A baseline's shard says only the ``slice`` of it that it wrote (and the
    ``key`` it is joined under), or its ``problem``."""

    baseline: str | None = None
    key: str | None = None
    path: str | None = None
    baseline_key: str | None = None
    removed: tuple[str, ...] = ()
    drift: dict | None = None
    problem: str | None = None
    slice: str | None = None

    @classmethod
    def of_record(cls, said: dict) -> ReferenceSaid:
        """It read back from the record's dict (``as_record``): the fields any schema held."""
        return cls(said.get("baseline"), said.get("key"), said.get("path"), said.get("baseline_key"),
                   tuple(said.get("removed", ())), said.get("drift"), said.get("problem"), said.get("slice"))

    def as_record(self) -> dict:
        """The record's dict of it, key for key and in the order the record has always held them (a spooled record
        is replayed by ``ppl-audit sync`` long after: its format does not move)."""
        said = {"baseline_key": self.baseline_key} if self.baseline_key is not None else {}
        said |= {"removed": list(self.removed)} if self.removed else {}
        said |= {"baseline": self.baseline, "key": self.key} if self.baseline is not None else {}
        said |= {"drift": self.drift} if self.drift is not None else {}
        said |= {"problem": self.problem} if self.problem is not None else {}
        said |= {"path": self.path} if self.path is not None else {}
        return said | ({"slice": self.slice, "key": self.key} if self.slice is not None else {})


@dataclass(frozen=True)
class Divergence:
    """What a variant's KL was measured against: the baseline reference's ``key`` and the ``memory_bytes`` its LM
    head took; or, where it was not measured though asked for, why (``absent``)."""

    reference: str = ""
    memory_bytes: int = 0
    absent: str | None = None

    @classmethod
    def missing(cls, why: str) -> Divergence:
        return cls(absent=why)
