"""Paired statistics of a variant against its baseline, over the same scored tokens.

Tokens are not independent (a hard passage is hard for both models, and errors cluster), so every
standard error here is taken over windows: the mean is a ratio of sums, and its variance is the
cluster-robust (sandwich) estimate from the per-window sums of residuals, with the W/(W-1) small-sample
factor. Intervals are 95% intervals of Student's t with W-1 degrees of freedom over W windows: the normal
quantile's are too narrow with few windows (a 3-window interval would cover about 80%, not 95%), and with
one window there is no interval at all (NaN), which no gate passes (``tasks.record.verdict``).
``tests/test_paired.py`` shows they cover the truth at about the stated rate on synthetic data with
correlated errors inside windows, where a token-level error bar does not.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.special import stdtrit  # scipy.stats' t.ppf is this function; scipy.stats takes 0.4 s more to import

MIN_WINDOWS = 2  # a paired interval needs the spread of windows: fewer give no interval
CONFIDENCE = 0.95  # of every interval and gate; a sequential run's sequences share it (tasks.audit.sequential)
# llama-perplexity's statistics block: the percentiles it prints of the per-token KL and of Δp
KLD_PERCENTILES = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)
DP_PERCENTILES = (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1)


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


def divergence_summary(extra: dict[str, np.ndarray], base_nll: np.ndarray, variant_nll: np.ndarray,
                       window_tokens: np.ndarray) -> dict[str, float]:
    """llama-perplexity's KL-divergence and token-probability statistics, errors taken over windows.

    KL both ways (``kld``: KL(base‖variant), as llama.cpp; ``kld_reverse``: KL(variant‖base)): mean with
    error and interval, max, ``KLD_PERCENTILES``, min. Δp (the variant's probability of the right token
    less the baseline's): mean with error, RMS with error, max, ``DP_PERCENTILES``, min. Same top token:
    mean with error. ``kld_llama_mean``, where ``kl_llama`` was measured (mode llama.cpp): the mean KLD as
    llama-perplexity estimates it, with error and interval. ``token_lnppl_correlation``: llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))), the
    correlation of the two models' per-token NLL (``window_lnppl_correlation`` is per window).
    """
    summary: dict[str, float] = {}
    for name in ("kld", "kld_reverse"):
        values = np.asarray(extra["kl" if name == "kld" else "kl_reverse"], np.float64)
        summary |= cluster_mean(values, window_tokens).as_dict(f"{name}_mean") | _spread(values, name, KLD_PERCENTILES)
    summary |= cluster_mean(np.asarray(extra["top1"], np.float64), window_tokens).as_dict("top1_agreement")
    if "kl_llama" in extra:
        summary |= cluster_mean(np.asarray(extra["kl_llama"], np.float64), window_tokens).as_dict("kld_llama_mean")
    base, variant = np.asarray(base_nll, np.float64), np.asarray(variant_nll, np.float64)
    dp = np.exp(-variant) - np.exp(-base)
    squares = cluster_mean(dp**2, window_tokens)
    rms = math.sqrt(squares.value)
    summary |= cluster_mean(dp, window_tokens).as_dict("dp_mean") | _spread(dp, "dp", DP_PERCENTILES)
    summary |= {"dp_rms": rms, "dp_rms_stderr": squares.stderr / (2 * rms) if rms else math.nan}
    summary["token_lnppl_correlation"] = float(np.corrcoef(base, variant)[0, 1]) if len(base) > 1 else math.nan
    return summary
