"""A variant's run that stops once its verdict is settled (``evaluation.sequential``).

The variant scores its windows in a seeded random order; after each batch, every figure its gate judges gets an
anytime-valid confidence sequence (``tasks.engine.sequential``), at the audit's level split evenly over the gated
figures (Bonferroni), so that the verdict's error over every look stays at that level. The run stops, after the
minimum (``minimum_windows``), when the verdict is settled: every gated figure's sequence inside its limit (pass),
or one entirely past it (fail). A run that never settles scores every window and is judged as without it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from tasks.config import Gate
from tasks.engine.paired import CONFIDENCE, Estimate
from tasks.engine.perplexity import PerplexityResult
from tasks.engine.progress import Progress
from tasks.engine.sequential import minimum_windows, mixture_rho2, ratio_sequence
from tasks.record.sequential_said import SequentialSaid
from tasks.record.figures import GATED

# each gated figure from per-window sums: which sum, and the map from the mean per token to the figure
GATED_FIGURES = {"delta_ppl_pct": ("nll", lambda x: 100 * math.expm1(x)),
           "kld_mean": ("kl", lambda x: x),
           "top1_agreement": ("top1", lambda x: x)}


def gate_limits(gate: Gate) -> list[tuple[str, float, bool]]:
    """``(figure, limit, whether the limit is a maximum)`` of each limit the gate sets."""
    return [(f.key, getattr(gate, f.limit), f.above) for f in GATED if getattr(gate, f.limit) is not None]


def settled(bounds: dict[str, tuple[float, float]], gate: Gate) -> str | None:
    """``pass`` when every gated figure's bounds are inside its limit, ``fail`` when one's are entirely past it,
    else None (not settled); a figure without bounds settles nothing."""
    inside = []
    for key, limit, above in gate_limits(gate):
        low, high = bounds.get(key, (math.nan, math.nan))
        if not (math.isfinite(low) and math.isfinite(high)):
            return None
        if (low > limit) if above else (high < limit):
            return "fail"
        inside.append(high <= limit if above else low >= limit)
    return "pass" if inside and all(inside) else None


class Watch:
    """The ``until`` of a sequential run (``tasks.engine.perplexity.score_windows``): after each batch, the
    sequences of the gated figures; True once the verdict is settled and the minimum is scored.

    Args:
        gate: the variant's limits.
        base_window_nll: ``[n_windows]`` the baseline's NLL sum of every window, which the variant's pair with.
        seed: the seed of the window order, kept in ``said``.
    """

    def __init__(self, gate: Gate, base_window_nll: np.ndarray, seed: int):
        self.gate, self.seed = gate, seed
        self.base_nll = torch.as_tensor(np.asarray(base_window_nll, np.float64))
        self.alpha = (1 - CONFIDENCE) / max(1, len(gate_limits(gate)))
        self.decision: str | None = None
        self.bounds: dict[str, tuple[float, float]] = {}

    @classmethod
    def against(cls, gate: Gate | None, baseline: PerplexityResult, seed: int) -> Watch:
        """The watch of a variant with ``gate`` (None: a lineup's variant without one, the default ``Gate()``, which
        sets no limit: nothing settles, the run goes to the end) over windows paired with ``baseline``'s: built here
        only, for a run in one place (``tasks.audit.scoring``) as for one in pieces (``flows.runners``)."""
        return cls(gate or Gate(), baseline.window_nll, seed)

    def sequences(self, progress: Progress) -> dict[str, Estimate]:
        """Each gated figure's estimate with its sequence's bounds, from the windows scored so far."""
        scored = torch.tensor(progress.order)
        counts = progress.tokens[scored].numpy()
        rho2 = mixture_rho2(minimum_windows(len(progress.tokens), progress.batch_size), self.alpha)
        found = {}
        for key, _, _ in gate_limits(self.gate):
            source, figure = GATED_FIGURES[key]
            if source not in progress.sums:
                continue  # no baseline to take KL from: the gate cannot settle, the run goes to the end
            sums = progress.sums[source][scored]
            if source == "nll":
                sums = sums - self.base_nll[scored]
            found[key] = ratio_sequence(sums.numpy(), counts, self.alpha, rho2, len(progress.tokens)).mapped(figure)
        return found

    def __call__(self, progress: Progress) -> bool:
        if len(progress.order) < minimum_windows(len(progress.tokens), progress.batch_size):
            return False
        found = self.sequences(progress)
        self.bounds = {key: (e.low, e.high) for key, e in found.items()}
        self.decision = settled(self.bounds, self.gate)
        return self.decision is not None

    def said(self, result: PerplexityResult) -> SequentialSaid:
        """What the record keeps of the run: the order's seed, how much was scored, and at a stop, the decision
        and the sequences' bounds it rested on."""
        said = SequentialSaid(self.seed, CONFIDENCE, self.alpha, result.scored_fraction, len(result.window_tokens),
                              "ran to the end")
        if result.scored_windows is None:
            return said
        return replace(said, stopped="settled", decision=self.decision, bounds=dict(self.bounds),
                       windows=tuple(int(w) for w in result.scored_windows))

