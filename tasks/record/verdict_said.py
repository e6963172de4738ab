"""A verdict (``Verdict``): a typed value while the audit runs, the record's ``{"status", "reason"}`` at its boundary,
read back here (``Verdict.of_record``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # pass, fail, error, or ungated: no limit applied, so nothing was judged (never said as a pass)
    reason: str

    @property
    def said(self) -> str:
        return said(self.status)

    def as_record(self) -> dict[str, str]:
        """The verdict as a record holds it (its name is the key or the entry it is under)."""
        return {"status": self.status, "reason": self.reason}

    @classmethod
    def of_record(cls, name: str, said: dict) -> Verdict:
        return cls(name, said["status"], said["reason"])


def said(status: str) -> str:
    """A verdict's status as a person reads it (tables, badges, run names): ``no gate`` for ``ungated``."""
    return "no gate" if status == "ungated" else status
