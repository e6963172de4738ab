"""A runtime cost as an audit's ``runtime_costs`` keep it (``tasks.record.runtime_cost.runtime_costs``, and a record
read back), read once into a typed value."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.record.row import Change


@dataclass(frozen=True)
class RuntimeCost:
    """The llama.cpp row ``served`` and the transformers row ``weights`` of the same file, and the served row's paired
    change against the weights' (``paired_difference``'s figures, as a row's)."""

    served: str
    weights: str
    change: Change

    @classmethod
    def of_record(cls, cost: dict) -> RuntimeCost:
        return cls(cost["served"], cost["weights"], Change.of_flat(cost))
