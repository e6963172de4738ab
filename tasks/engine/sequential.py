"""Anytime-valid confidence sequences, for an audit that stops scoring a variant once its verdict is settled.

A variant scores its windows in a seeded random order; after each batch, the scored windows are a sample drawn
without replacement from the stream's windows, and the quantity a gate judges (a mean of per-token figures: a
ratio of window sums to window token counts) is the stream's value, which the whole run measures exactly.
The bound is the two-sided asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas
(2021, "Time-uniform central limit theory and asymptotic confidence sequences"): a Robbins normal mixture on the
running mean, scaled by the running standard deviation of the windows' linearized residuals. It holds at every
batch at once, however often it is looked at, and its variance comes from windows (clusters), as the fixed-size
interval's does (``tasks.engine.paired``). Sampling without replacement only makes it wider than it need be.
``docs/statistics.md`` says why this construction and not a bounded one.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import lambertw

from tasks.engine.paired import CONFIDENCE, Estimate, t_quantile

# A sequence may stop a run only after the more of these: its bound rests on the windows' running mean and
# spread, which a few windows do not show.
MIN_FRACTION = 0.05
MIN_BATCHES = 4


def window_order(n_windows: int, seed: int) -> np.ndarray:
    """The order a sequential run scores the windows in: a permutation of ``range(n_windows)`` fixed by ``seed``."""
    return np.random.default_rng(seed).permutation(n_windows)


def minimum_windows(n_windows: int, batch_size: int) -> int:
    """How many windows are scored before a sequence may stop the run."""
    return min(n_windows, max(math.ceil(MIN_FRACTION * n_windows), MIN_BATCHES * batch_size))


def mixture_rho2(t_opt: float, alpha: float) -> float:
    """The normal mixture's variance that makes the boundary narrowest after ``t_opt`` observations (the paper's
    closed form, through the lower branch of Lambert's W)."""
    return float((-lambertw(-alpha**2 / math.e, k=-1).real - 1) / t_opt)


def margin(t: int, alpha: float, rho2: float) -> float:
    """Half the width of the sequence after ``t`` observations of unit variance (two-sided, level ``1 - alpha``)."""
    return math.sqrt(2 * (t * rho2 + 1) / (t * t * rho2) * math.log(math.sqrt(t * rho2 + 1) / alpha))


def ratio_sequence(sums: np.ndarray, counts: np.ndarray, alpha: float, rho2: float, windows: int | None = None
                   ) -> Estimate:
    """The stream's mean of a per-token figure from the windows scored so far: the ratio of their sums to their
    token counts, with the sequence's bounds as ``low``/``high`` and the plain standard error as ``stderr``.

    Args:
        sums: ``[t]`` per-window sums of the figure over each scored window's tokens (float64).
        counts: ``[t]`` tokens each of those windows scored.
        alpha: the sequence's error over every look at once.
        rho2: ``mixture_rho2`` for the time it is tuned to.
        windows: the stream's windows: the bounds then reach further by the half-width the whole run's fixed
            interval will have (estimated from the spread so far), so that they bound that interval's ends, on
            which the whole run's gate judges, not only the stream's value.
    """
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    t = len(sums)
    mean = float(sums.sum() / counts.sum())
    if t < 2:
        return Estimate(mean, math.nan, math.nan, math.nan)
    # the ratio linearized: sum/count - mean ≈ mean of (sum_w - mean·count_w) / mean count
    residuals = (sums - mean * counts) / counts.mean()
    sigma = float(np.sqrt((residuals**2).sum() / (t - 1)))
    half = sigma * margin(t, alpha, rho2)
    if windows:
        half += t_quantile(CONFIDENCE, windows - 1) * sigma / math.sqrt(windows)
    return Estimate(mean, sigma / math.sqrt(t), mean - half, mean + half)
