"""Paired intervals cover the truth at about the stated rate; KL and the top-k cache against references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.engine import divergence
from tasks.engine.paired import cluster_mean, paired_difference

Z95 = 1.959963984540054  # the normal quantile a token-level error bar is read with


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


def test_kl_is_taken_both_ways():
    """KL(base‖variant) weighs by the baseline's probabilities, KL(variant‖base) by the variant's: they
    differ, and each is the textbook sum computed here in float64."""
    base = random_log_probs(256, 500, 1)
    variant = torch.log_softmax(base + 0.7 * random_log_probs(256, 500, 2), -1)
    both = divergence.exact(base, variant)
    torch.testing.assert_close(both["kl"], (base.exp() * (base - variant)).sum(-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(both["kl_reverse"], (variant.exp() * (variant - base)).sum(-1), rtol=1e-12, atol=0)
    assert float((both["kl"] - both["kl_reverse"]).abs().max()) > 1e-3




def test_the_statistics_block_has_llama_perplexity_s_figures_computed_independently():
    """Every figure of the block against a plain re-computation: KL both ways with their percentiles, Δp
    with its RMS, same top token, and the per-token correlation of ln PPL (llama.cpp's, computed here
    from its sums as llama-perplexity does)."""
    from tasks.engine.paired import divergence_summary
    from tasks.record.verdict import format_stats

    rng = np.random.default_rng(0)
    counts = rng.integers(20, 40, size=30)
    n = int(counts.sum())
    base = rng.gamma(2.0, 1.5, n)
    variant = base + rng.normal(0, 0.2, n)
    extra = {"kl": rng.gamma(0.5, 0.02, n), "kl_reverse": rng.gamma(0.5, 0.03, n), "top1": rng.random(n) < 0.9}
    s = divergence_summary(extra, base, variant, counts)
    for name, values in (("kld", extra["kl"]), ("kld_reverse", extra["kl_reverse"])):
        assert s[f"{name}_mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert s[f"{name}_max"] == values.max() and s[f"{name}_min"] == values.min()
        for p in (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1):
            assert s[f"{name}_p{p:g}"] == pytest.approx(np.quantile(values, p / 100))
    dp = np.exp(-variant) - np.exp(-base)
    assert s["dp_mean"] == pytest.approx(dp.mean(), rel=1e-12)
    assert s["dp_rms"] == pytest.approx(math.sqrt((dp**2).sum() / n), rel=1e-12)
    assert 0 < s["dp_rms_stderr"] < s["dp_rms"]
    assert {f"dp_p{p:g}" for p in (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1)} <= set(s)
    assert s["top1_agreement"] == pytest.approx(extra["top1"].mean())
    sums = (base.sum(), variant.sum(), (base * base).sum(), (variant * variant).sum(), (base * variant).sum())
    cov = sums[4] / n - sums[0] * sums[1] / n**2
    cor = cov / math.sqrt((sums[2] / n - (sums[0] / n) ** 2) * (sums[3] / n - (sums[1] / n) ** 2))
    assert s["token_lnppl_correlation"] == pytest.approx(cor, rel=1e-9)

    row = {"variant": "q", "ppl": 10.0, "ppl_stderr": 0.1, "delta_ppl": 0.2, "reference": "abc",
           **paired_difference(base, variant, counts), **s}
    block = format_stats([{"variant": "baseline", "ppl": 9.8, "ppl_stderr": 0.1}, row])
    for line in ("Mean PPL(Q)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean    KLD:", "99.9%   KLD:", "Minimum KLD:",
                 "KLD(Q‖base), reverse", "RMS Δp    :", "Same top p:", "0.1%    Δp:", "Median  Δp:"):
        assert line in block, line
    assert f"{100 * cor:6.2f}%" in block


@pytest.mark.parametrize("windows", [3, 5])
def test_a_few_windows_still_give_a_95_percent_interval(windows):
    """Over W windows the interval is Student's t with W-1 degrees of freedom: the normal quantile's would
    cover about 80% of the truth at 3 windows."""
    rng = np.random.default_rng(windows)
    truth, trials, covered = 0.05, 4000, 0
    for _ in range(trials):
        values = truth + rng.standard_normal(windows).repeat(20)  # each window one draw: W independent values
        estimate = cluster_mean(values, np.full(windows, 20))
        covered += estimate.low <= truth <= estimate.high
    assert 0.935 <= covered / trials <= 0.965


def test_one_window_gives_no_interval():
    estimate = cluster_mean(np.array([1.0, 2.0, 3.0]), np.array([3]))
    assert estimate.value == 2.0 and all(math.isnan(x) for x in (estimate.stderr, estimate.low, estimate.high))
