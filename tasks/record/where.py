"""Where in the text a variant loses against its baseline: its change in NLL and its KL divergence by the
token's position in its window, by how sure the baseline was and by whether the baseline was right, and the
tokens it diverges on most. Plain numpy on paired per-token arrays: an audit's record and ``diagnose`` both
call ``where_figures``.

Each group's figures are means over its tokens with a 95% interval whose error is taken over windows, as every
interval of an audit is (``tasks.engine.paired.cluster_mean``): the tokens of one window are correlated, and an
interval that took them as independent would be too narrow to tell a group's difference from noise. KL's, which
cannot be negative, is taken on the log scale (``positive_mean``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from tasks.engine.paired import cluster_mean, positive_mean
from tasks.engine.token_figures import TokenFigures

POSITION_BINS = 8  # equal bins of the window, from its first position to its last
CONFIDENCE_EDGES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)  # of the baseline's top-1 probability; the last bin holds 1
TOP_TOKENS = 20  # the tokens of largest KL listed
INTERVAL = ("95%, Student's t with the error taken over windows (tokens of a window are not independent); KL's on "
            "the log scale")


@dataclass(frozen=True)
class TokenDivergence:
    """A variant's per-token divergence from the baseline that ``where`` groups and ranks its tokens by
    (``tasks.engine.perplexity.token_stats``): its KL, the baseline's top-1 probability, whether the baseline was
    right, and the baseline's and the variant's top tokens; each aligned with the variant's NLL."""

    kl: np.ndarray
    base_top_p: np.ndarray
    base_right: np.ndarray
    base_top: np.ndarray
    top: np.ndarray

    @classmethod
    def of_figures(cls, figures: TokenFigures[np.ndarray]) -> TokenDivergence | None:
        """Of a result's per-token figures (``extra``); None without KL (divergence off)."""
        if figures.kl is None:
            return None
        return cls(figures.kl, figures.base_top_p, figures.base_right, figures.base_top, figures.top)


@dataclass(frozen=True)
class TokenPlaces:
    """Where each of the paired tokens is: its position in its window (``tasks.engine.perplexity.scored_positions``),
    the plan's index of its window (ascending: the token arrays' order) and its id (the target), each ``[n]``."""

    positions: np.ndarray
    windows: np.ndarray
    targets: np.ndarray


@dataclass(frozen=True)
class ListedToken:
    """One of the tokens of largest KL: its place in the token arrays (``token``), its window and its position in it,
    its KL and ΔNLL, and its target and the baseline's and the variant's most likely tokens."""

    token: int
    window: int
    position: int
    kl: float
    delta_nll: float
    target: int
    base_top: int
    top: int


def undescribed(token: ListedToken) -> dict:
    """A listed token's row as it is, nothing added."""
    return {}


def position_edges(window: int) -> np.ndarray:
    """The edges of the ``POSITION_BINS`` bins of positions ``[0, window)``, whole numbers; bin i holds
    ``edges[i] <= position < edges[i + 1]``."""
    return np.unique(np.linspace(0, window, POSITION_BINS + 1).round().astype(np.int64))


def _mean(values: np.ndarray, windows: np.ndarray, name: str) -> dict[str, float | None]:
    """``name``, ``name_low``, ``name_high``: the mean of ``values`` and its 95% interval over the windows
    ``windows`` (each value's, ascending) (None where there are no values, or too few windows for an interval)."""
    if not len(values):
        return {name: None, f"{name}_low": None, f"{name}_high": None}
    _, counts = np.unique(windows, return_counts=True)
    found = (positive_mean if name == "kl" else cluster_mean)(values, counts)  # KL's interval stays above zero
    return {name: float(found.value)} | {f"{name}_{end}": float(bound) if math.isfinite(bound) else None
                                         for end, bound in (("low", found.low), ("high", found.high))}


def _figures(figures: dict[str, np.ndarray], windows: np.ndarray, chosen: np.ndarray) -> dict:
    """How many tokens ``chosen`` (a mask) holds, and each figure's mean over them with its interval."""
    row = {"tokens": int(chosen.sum())}
    for name, values in figures.items():
        row |= _mean(values[chosen], windows[chosen], name)
    return row


def _binned(figures: dict[str, np.ndarray], windows: np.ndarray, values: np.ndarray, edges: np.ndarray) -> list[dict]:
    """A row per bin of ``values`` (``low <= value < high``, the last bin closed at its top): its bounds and
    its figures."""
    bins = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)
    return [{"low": edges[i].item(), "high": edges[i + 1].item()} | _figures(figures, windows, bins == i)
            for i in range(len(edges) - 1)]


def _top_tokens(said: TokenDivergence, delta: np.ndarray, places: TokenPlaces) -> list[ListedToken]:
    """The ``TOP_TOKENS`` tokens of largest KL, largest first (the earlier token first among equals)."""
    order = np.argsort(-said.kl, kind="stable")[:TOP_TOKENS]
    return [ListedToken(int(i), int(places.windows[i]), int(places.positions[i]), float(said.kl[i]),
                        float(delta[i]), int(places.targets[i]), int(said.base_top[i]), int(said.top[i]))
            for i in order]


def where_figures(base_nll: np.ndarray, nll: np.ndarray, figures: TokenFigures[np.ndarray], places: TokenPlaces,
                  window: int, described: Callable[[ListedToken], dict] = undescribed) -> dict:
    """Where a variant loses against its baseline, over the same scored tokens.

    Args:
        base_nll, nll: ``[n]`` the baseline's and the variant's NLL of each token.
        figures: the variant's per-token divergence (``kl``, ``base_top_p``, ``base_right``, ``base_top``, ``top``:
            ``tasks.engine.perplexity.token_stats``), aligned with ``nll``; without ``kl`` (divergence off) the
            figures are ΔNLL by position only.
        places: where each token is: its position in its window, its window, its id.
        window: the window's length, whose positions are binned.
        described: what a listed token's row adds to its figures (its text, where a tokenizer reads it).

    Returns:
        Plain data: ``tokens``, ``interval`` (how the intervals are taken), ``all`` (every token's figures),
        ``by_position`` (a row per bin of ``position_edges``) and with KL also ``by_confidence`` (a row per bin
        of ``CONFIDENCE_EDGES`` of the baseline's top-1 probability), ``by_baseline`` (``right`` and ``wrong``)
        and ``top_kl`` (``TOP_TOKENS`` rows: ``ListedToken``'s fields, and what ``described`` adds). A row's
        figures are ``tokens``, ``delta_nll`` (mean variant NLL less the baseline's) and with KL ``kl``, each with
        ``_low``/``_high``.
    """
    delta = np.asarray(nll, np.float64) - np.asarray(base_nll, np.float64)
    said = TokenDivergence.of_figures(figures)
    grouped = {"delta_nll": delta} | ({"kl": np.asarray(said.kl, np.float64)} if said is not None else {})
    every = np.ones(len(delta), bool)
    windows = np.asarray(places.windows)
    found = {"tokens": len(delta), "interval": INTERVAL, "all": _figures(grouped, windows, every),
             "by_position": _binned(grouped, windows, places.positions, position_edges(window))}
    if said is not None:
        right = np.asarray(said.base_right, bool)
        found |= {"by_confidence": _binned(grouped, windows, said.base_top_p, np.asarray(CONFIDENCE_EDGES)),
                  "by_baseline": [{"baseline": "right"} | _figures(grouped, windows, right),
                                  {"baseline": "wrong"} | _figures(grouped, windows, ~right)],
                  "top_kl": [asdict(top) | described(top) for top in _top_tokens(said, delta, places)]}
    return found
