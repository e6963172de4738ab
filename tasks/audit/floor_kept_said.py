"""A noise floor kept with the baseline's reference (``tasks.audit.floor``), read once into typed values: its
``floor.json`` (``KeptFloor``) and its ``scores.npz`` (``FloorScores``). This module alone reads their keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.engine.token_figures import TokenFigures

EXTRA = "extra."  # the prefix of a per-token array of the result's ``extra`` in scores.npz


@dataclass(frozen=True)
class KeptFloor:
    """A kept floor's entry (its seal checked before it is read): the floor's ``name`` and ``method``, its ``result``
    (``PerplexityResult.summary``), load ``facts`` (``VariantFacts.summary``), ``divergence`` (what its KL was measured
    against, as ``Divergence``'s fields; None: none) and ``files`` (``sealed.files_entry``)."""

    name: str
    method: str
    result: dict
    facts: dict
    divergence: dict | None
    files: dict

    @classmethod
    def of_json(cls, entry: dict) -> KeptFloor:
        return cls(entry["name"], entry["method"], entry["result"], entry["facts"], entry["divergence"],
                   entry["files"])


@dataclass(frozen=True)
class FloorScores:
    """A kept floor's per-token and per-window arrays, and the per-token figures of its result's ``extra``."""

    token_nll: np.ndarray
    window_nll: np.ndarray
    window_tokens: np.ndarray
    extra: TokenFigures[np.ndarray]

    @classmethod
    def read(cls, path: Path) -> FloorScores:
        with np.load(path) as arrays:
            scores = {name: arrays[name] for name in arrays.files}
        extra = {name.removeprefix(EXTRA): array for name, array in scores.items() if name.startswith(EXTRA)}
        return cls(scores["token_nll"], scores["window_nll"], scores["window_tokens"], TokenFigures.of_named(extra))
