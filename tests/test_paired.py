"""Paired intervals cover the truth at about the stated rate; KL and the top-k cache against references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks import divergence
from tasks.paired import Z95, cluster_mean, paired_difference


def correlated_windows(rng, windows: int, size: int, mean: float, rho: float = 0.8, scale: float = 0.5):
    """Per-token differences whose errors follow an AR(1) process inside each window, independent across."""
    noise = np.empty((windows, size))
    noise[:, 0] = rng.standard_normal(windows)
    for t in range(1, size):
        noise[:, t] = rho * noise[:, t - 1] + math.sqrt(1 - rho**2) * rng.standard_normal(windows)
    shift = 0.3 * rng.standard_normal((windows, 1))  # a window-level effect: some passages are harder
    return (mean + scale * noise + shift).ravel(), np.full(windows, size)


def test_window_interval_covers_the_truth_at_the_stated_rate():
    rng = np.random.default_rng(0)
    truth, trials, covered, covered_naive = 0.05, 1000, 0, 0
    for _ in range(trials):
        values, counts = correlated_windows(rng, windows=60, size=40, mean=truth)
        estimate = cluster_mean(values, counts)
        covered += estimate.low <= truth <= estimate.high
        naive_se = values.std(ddof=1) / math.sqrt(len(values))  # treats tokens as independent
        covered_naive += abs(values.mean() - truth) <= Z95 * naive_se
    assert 0.93 <= covered / trials <= 0.97
    assert covered_naive / trials < 0.75  # why the error is taken over windows


def test_uneven_windows_and_the_ratio_intervals():
    rng = np.random.default_rng(1)
    counts = rng.integers(5, 80, size=50)
    base = rng.gamma(3.0, 1.0, counts.sum())
    variant = base + 0.02 + 0.1 * rng.standard_normal(counts.sum())
    paired = paired_difference(base, variant, counts)
    assert paired["delta_nll"] == pytest.approx((variant - base).mean())
    assert paired["delta_nll_low"] < paired["delta_nll"] < paired["delta_nll_high"]
    assert paired["ppl_ratio"] == pytest.approx(math.exp(paired["delta_nll"]))
    assert paired["delta_ppl_pct_high"] == pytest.approx(100 * math.expm1(paired["delta_nll_high"]))
    assert 0.9 < paired["window_lnppl_correlation"] <= 1


def random_log_probs(rows: int, vocab: int, seed: int, temperature: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3 / temperature, -1)


def test_exact_kl_of_a_model_with_itself_is_zero_and_agreement_one():
    logp = random_log_probs(64, 500, 0)
    same = divergence.exact(logp, logp)
    assert torch.all(same["kl"].abs() < 1e-12) and bool(same["top1"].all())


@pytest.mark.parametrize("k", [1, 4, 32, 200])
def test_top_k_cache_bounds_the_full_kl(k):
    base = random_log_probs(256, 500, 1)
    variant = torch.log_softmax(base + 0.7 * random_log_probs(256, 500, 2), -1)
    full = divergence.exact(base, variant)["kl"]
    ids, top = divergence.top_k(base, k)
    cached = divergence.from_top_k(ids, top.double(), variant)
    assert torch.all(cached["kl"] <= full + 1e-9)  # a lower bound ...
    assert torch.all(full <= cached["kl"] + cached["kl_bound"] + 1e-9)  # ... within its stated error
    assert torch.equal(cached["top1"], base.argmax(-1) == variant.argmax(-1))
    if k == 200:
        assert float((full - cached["kl"]).mean()) < 0.1 * float(full.mean())
