"""Paired statistics of a variant against its baseline, over the same scored tokens.

Tokens are not independent (a hard passage is hard for both models, and errors cluster), so every
standard error here is taken over windows: the mean is a ratio of sums, and its variance is the
cluster-robust (sandwich) estimate from the per-window sums of residuals, with the W/(W-1) small-sample
factor. Intervals are 95% intervals of Student's t with W-1 degrees of freedom over W windows: the normal
quantile's are too narrow with few windows (a 3-window interval would cover about 80%, not 95%), and with
one window there is no interval at all (NaN), which no gate passes (``tasks.record.verdict``).
``tests/test_paired.py`` shows they cover the truth at about the stated rate on synthetic data with
correlated errors inside windows, where a token-level error bar does not. A mean that cannot be negative (KL) or
pass 1 (top-1 agreement) has its interval on the log or logit scale (``positive_mean``, ``share_mean``), inside its
range; a difference keeps Student's t.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.special import stdtrit  # scipy.stats' t.ppf is this function; scipy.stats takes 0.4 s more to import

if TYPE_CHECKING:
    from tasks.engine.token_figures import TokenFigures

MIN_WINDOWS = 2  # a paired interval needs the spread of windows: fewer give no interval
CONFIDENCE = 0.95  # of every interval and gate; a sequential run's sequences share it (tasks.audit.sequential)
# llama-perplexity's statistics block: the percentiles it prints of the per-token KL and of Δp
KLD_PERCENTILES = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)
DP_PERCENTILES = (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1)
# a token the baseline is sure of: its top token at this probability or more (a confident flip: the variant's top is
# another; #70)
CONFIDENT = 0.9


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error and 95% interval."""

    value: float
    stderr: float
    low: float
    high: float

    def mapped(self, f) -> Estimate:
        """The estimate under a monotone increasing map (error by the delta method)."""
        h = 1e-6 * max(1.0, abs(self.value))
        slope = (f(self.value + h) - f(self.value - h)) / (2 * h)
        return Estimate(f(self.value), abs(slope) * self.stderr, f(self.low), f(self.high))

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{'' if k == 'value' else '_' + k}": v for k, v in asdict(self).items()}


def cluster_mean(values: np.ndarray, window_tokens: np.ndarray) -> Estimate:
    """Mean of per-token ``values`` with its standard error over windows.

    Args:
        values: ``[n]`` per-token values, window by window (as the engine stores them).
        window_tokens: ``[W]`` tokens per window; they sum to ``n``.
    """
    counts = np.asarray(window_tokens, dtype=np.int64)
    counts = counts[counts > 0]
    values = np.asarray(values, dtype=np.float64)
    sums = np.add.reduceat(values, np.cumsum(counts) - counts)
    n, clusters = counts.sum(), len(counts)
    mean = sums.sum() / n
    if clusters < MIN_WINDOWS:
        return Estimate(mean, math.nan, math.nan, math.nan)
    residuals = sums - mean * counts
    stderr = math.sqrt(clusters / (clusters - 1) * float((residuals**2).sum()) / n**2)
    quantile = t_quantile(CONFIDENCE, clusters - 1)
    return Estimate(mean, stderr, mean - quantile * stderr, mean + quantile * stderr)


Scale = Callable[[float], float]


def positive_mean(values: np.ndarray, window_tokens: np.ndarray) -> Estimate:
    """``cluster_mean`` of a figure that cannot be negative (a mean KL), its interval taken on the log scale by the
    delta method, ``mean · exp(± t · stderr / mean)``, so that neither end reaches below zero.

    The t interval of such a mean reached below zero where a few windows carry most of it (``[-0.0002, 0.0081]``),
    and its upper end, the one a KL gate judges, fell short of the truth more often than 2.5%: a mean of right-skewed
    values is itself skewed. On the log scale it is nearer symmetric (``benchmarks/bounded_intervals.py`` measures
    the coverage of both, docs/statistics.md). Where the mean is not above zero (every token's KL 0, or float noise
    below it) the t interval is kept, cut at zero.
    """
    found = cluster_mean(values, window_tokens)
    return _on_scale(found, found.value > 0, lambda m: m, math.log, math.exp, (0.0, math.inf))


def share_mean(values: np.ndarray, window_tokens: np.ndarray) -> Estimate:
    """``cluster_mean`` of a share (top-1 agreement: each token 0 or 1), its interval taken on the logit scale by the
    delta method, so that it stays within [0, 1]: the t interval of a share near 1 reached past it. A share of
    exactly 0 or 1 (every token alike) has no spread, and its interval is the share itself."""
    found = cluster_mean(values, window_tokens)
    return _on_scale(found, 0 < found.value < 1, lambda m: m * (1 - m), lambda m: math.log(m / (1 - m)),
                     lambda x: 1 / (1 + math.exp(-x)), (0.0, 1.0))


def _on_scale(found: Estimate, inside: bool, slope: Scale, forward: Scale, back: Scale,
              bounds: tuple[float, float]) -> Estimate:
    """``found``'s interval taken again on the scale ``forward`` maps the figure to (``slope``: its derivative's
    reciprocal at the mean, ``back``: its inverse), where the mean is ``inside`` the figure's range; elsewhere its
    t interval cut to ``bounds``. Its standard error stays the figure's own."""
    mean, stderr = found.value, found.stderr
    if not (math.isfinite(found.low) and stderr > 0):  # too few windows (NaN), or no spread: nothing to move
        return found
    if not inside:
        return Estimate(mean, stderr, max(found.low, bounds[0]), min(found.high, bounds[1]))
    half = (found.high - mean) / slope(mean)  # the t quantile times the error, on that scale (delta method)
    return Estimate(mean, stderr, back(forward(mean) - half), back(forward(mean) + half))


def t_quantile(confidence: float, df: int) -> float:
    """The half-width of a two-sided Student-t interval at ``confidence``, in standard errors."""
    return float(stdtrit(df, (1 + confidence) / 2))


def paired_difference(base_nll: np.ndarray, variant_nll: np.ndarray, window_tokens: np.ndarray) -> dict[str, float]:
    """ΔNLL, PPL ratio and ΔPPL% with intervals, the correlation of per-window ln PPL, and ``windows``: how
    many windows the intervals rest on."""
    delta = cluster_mean(np.asarray(variant_nll, np.float64) - np.asarray(base_nll, np.float64), window_tokens)
    ratio = delta.mapped(math.exp)
    pct = delta.mapped(lambda x: 100 * math.expm1(x))
    counts = np.asarray(window_tokens)[np.asarray(window_tokens) > 0]
    starts = np.cumsum(counts) - counts
    base_w = np.add.reduceat(np.asarray(base_nll, np.float64), starts) / counts
    var_w = np.add.reduceat(np.asarray(variant_nll, np.float64), starts) / counts
    correlation = float(np.corrcoef(base_w, var_w)[0, 1]) if len(counts) > 1 else math.nan
    return {**delta.as_dict("delta_nll"), **ratio.as_dict("ppl_ratio"), **pct.as_dict("delta_ppl_pct"),
            "window_lnppl_correlation": correlation, "windows": len(counts)}


def _spread(values: np.ndarray, name: str, percentiles: tuple[float, ...]) -> dict[str, float]:
    return {f"{name}_max": float(values.max()), **{f"{name}_p{p:g}": float(np.percentile(values, p)) for p in percentiles},
            f"{name}_min": float(values.min())}


def divergence_summary(figures: TokenFigures[np.ndarray], base_nll: np.ndarray, variant_nll: np.ndarray,
                       window_tokens: np.ndarray) -> dict[str, float]:
    """llama-perplexity's KL-divergence and token-probability statistics, errors taken over windows.

    KL both ways (``kld``: KL(base‖variant), as llama.cpp; ``kld_reverse``: KL(variant‖base)): mean with
    error and interval, max, ``KLD_PERCENTILES``, min. Δp (the variant's probability of the right token
    less the baseline's): mean with error, RMS with error, max, ``DP_PERCENTILES``, min. Same top token:
    mean with error. ``kld_llama_mean``, where ``kl_llama`` was measured (mode llama.cpp): the mean KLD as
    llama-perplexity estimates it, with error and interval. ``token_lnppl_correlation``: llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))), the
    correlation of the two models' per-token NLL (``window_lnppl_correlation`` is per window).
    ``confident_flip_rate``, where the baseline's probability of its top token was kept (``base_top_p``): the share of
    tokens whose baseline put its top token at ``CONFIDENT`` or more and whose variant put another first.
    """
    summary: dict[str, float] = {}
    for name, kl in (("kld", figures.kl), ("kld_reverse", figures.kl_reverse)):
        values = np.asarray(kl, np.float64)
        summary |= positive_mean(values, window_tokens).as_dict(f"{name}_mean") | _spread(values, name, KLD_PERCENTILES)
    summary |= share_mean(np.asarray(figures.top1, np.float64), window_tokens).as_dict("top1_agreement")
    if figures.kl_llama is not None:
        summary |= positive_mean(np.asarray(figures.kl_llama, np.float64), window_tokens).as_dict("kld_llama_mean")
    base, variant = np.asarray(base_nll, np.float64), np.asarray(variant_nll, np.float64)
    dp = np.exp(-variant) - np.exp(-base)
    squares = cluster_mean(dp**2, window_tokens)
    rms = math.sqrt(squares.value)
    summary |= cluster_mean(dp, window_tokens).as_dict("dp_mean") | _spread(dp, "dp", DP_PERCENTILES)
    summary |= {"dp_rms": rms, "dp_rms_stderr": squares.stderr / (2 * rms) if rms else math.nan}
    summary |= {"token_lnppl_correlation": float(np.corrcoef(base, variant)[0, 1]) if len(base) > 1 else math.nan}
    if figures.base_top_p is not None:  # the share of all tokens that are confident flips, interval on the logit scale
        flips = (np.asarray(figures.base_top_p, np.float64) >= CONFIDENT) & ~np.asarray(figures.top1, bool)
        summary |= share_mean(flips.astype(np.float64), window_tokens).as_dict("confident_flip_rate")
    return summary


def token_slots(window_tokens: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """The places, in token arrays that hold every window's tokens window by window (``window_tokens`` each), of
    the tokens of ``windows``, in the order given."""
    starts = np.cumsum(window_tokens) - window_tokens
    return np.concatenate([np.arange(starts[w], starts[w] + window_tokens[w]) for w in windows])
