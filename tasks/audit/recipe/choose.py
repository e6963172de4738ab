"""The choice within a budget: a multiple-choice knapsack over measured gains and exact costs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Choice:
    """A unit at an option (an index into the options), what it costs beyond the variant and what it wins back
    alone on the sample: KL in nats per token, and as a share of the variant's KL with its interval."""

    unit: int
    option: int
    cost: int
    gain: float
    share: tuple[float, float, float]


def knapsack(choices: list[Choice], budget: int, steps: int = 2000, excluded: frozenset = frozenset()) -> tuple:
    """The choices (at most one per unit) of most summed gain whose costs sum within ``budget`` bytes: a
    multiple-choice knapsack solved exactly over costs rounded up to ``budget / steps`` (so never over budget).
    ``excluded``: ``(unit, option)`` pairs not to take. Returns the chosen ``Choice`` objects, by unit."""
    if budget <= 0:
        return ()
    quantum = budget / steps
    by_unit: dict[int, list[Choice]] = {}
    for choice in choices:
        if choice.gain > 0 and (choice.unit, choice.option) not in excluded:
            by_unit.setdefault(choice.unit, []).append(choice)
    best = np.full(steps + 1, -np.inf)
    best[0] = 0.0
    taken: list[np.ndarray] = []
    for options in by_unit.values():
        nxt, pick = best.copy(), np.full(steps + 1, -1)
        for k, choice in enumerate(options):
            units = math.ceil(choice.cost / quantum - 1e-9)
            if units > steps:
                continue
            shifted = np.full(steps + 1, -np.inf)
            shifted[units:] = best[: steps + 1 - units] + choice.gain
            better = shifted > nxt
            nxt[better], pick[better] = shifted[better], k
        taken.append(pick)
        best = nxt
    at = int(np.argmax(best))
    chosen = []
    for options, pick in zip(reversed(list(by_unit.values())), reversed(taken)):
        k = pick[at]
        if k >= 0:
            chosen.append(options[k])
            at -= math.ceil(options[k].cost / quantum - 1e-9)
    return tuple(sorted(chosen, key=lambda c: c.unit))
