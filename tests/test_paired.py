"""Paired intervals cover the truth at about the stated rate; KL and the top-k cache against references."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import typed
from tasks.engine import divergence
from tasks.engine.paired import cluster_mean, paired_difference
from tasks.engine.token_figures import TokenFigures

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
    figures = TokenFigures(kl=rng.gamma(0.5, 0.02, n), kl_reverse=rng.gamma(0.5, 0.03, n), top1=rng.random(n) < 0.9)
    s = divergence_summary(figures, base, variant, counts)
    for name, values in (("kld", figures.kl), ("kld_reverse", figures.kl_reverse)):
        assert s[f"{name}_mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert s[f"{name}_max"] == values.max() and s[f"{name}_min"] == values.min()
        for p in (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1):
            assert s[f"{name}_p{p:g}"] == pytest.approx(np.quantile(values, p / 100))
    dp = np.exp(-variant) - np.exp(-base)
    assert s["dp_mean"] == pytest.approx(dp.mean(), rel=1e-12)
    assert s["dp_rms"] == pytest.approx(math.sqrt((dp**2).sum() / n), rel=1e-12)
    assert 0 < s["dp_rms_stderr"] < s["dp_rms"]
    assert {f"dp_p{p:g}" for p in (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1)} <= set(s)
    assert s["top1_agreement"] == pytest.approx(figures.top1.mean())
    sums = (base.sum(), variant.sum(), (base * base).sum(), (variant * variant).sum(), (base * variant).sum())
    cov = sums[4] / n - sums[0] * sums[1] / n**2
    cor = cov / math.sqrt((sums[2] / n - (sums[0] / n) ** 2) * (sums[3] / n - (sums[1] / n) ** 2))
    assert s["token_lnppl_correlation"] == pytest.approx(cor, rel=1e-9)

    row = {"variant": "q", "ppl": 10.0, "ppl_stderr": 0.1, "delta_ppl": 0.2, "reference": "abc",
           **paired_difference(base, variant, counts), **s}
    block = format_stats([typed({"variant": "baseline", "ppl": 9.8, "ppl_stderr": 0.1}), typed(row)])
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


def skewed_kl(rng, windows: int, size: int = 64, spread: float = 0.5, truth: float = 0.01):
    """Per-token KL as a quantized model's is: most tokens near zero and a long tail (gamma, shape 0.3), each
    window's scale drawn lognormal (some passages are harder), the stream's mean ``truth``."""
    scale = np.exp(spread * rng.standard_normal(windows) - spread**2 / 2)
    return (rng.gamma(0.3, truth / 0.3, (windows, size)) * scale[:, None]).ravel(), np.full(windows, size)


def test_an_interval_of_a_figure_that_cannot_be_negative_stays_above_zero():
    """A small KL over few, uneven windows: the t interval reached below zero (``[-0.0002, 0.0081]`` in an audit); the
    KL means' intervals are taken on the log scale, top-1 agreement's on the logit scale (it is a share: never past
    1), and Δp, which can be negative, keeps its own."""
    from tasks.engine.paired import divergence_summary

    counts = np.array([64, 64, 64, 64])
    kl = np.concatenate([np.full(64, 1e-5), np.full(64, 2e-5), np.full(64, 1e-5), np.full(64, 0.03)])
    top1 = np.concatenate([np.ones(192), np.r_[np.zeros(2), np.ones(62)]])
    assert cluster_mean(kl, counts).low < 0 and cluster_mean(top1, counts).high > 1  # the plain t interval's
    base = np.random.default_rng(0).gamma(2.0, 1.5, 256)
    s = divergence_summary(TokenFigures(kl=kl, kl_reverse=kl, top1=top1, kl_llama=kl), base, base + 0.01 * kl, counts)
    for name in ("kld_mean", "kld_reverse_mean", "kld_llama_mean"):
        assert 0 < s[f"{name}_low"] < s[name] < s[f"{name}_high"], name
        assert s[name] == pytest.approx(kl.mean())
    assert s["top1_agreement_low"] < s["top1_agreement"] < s["top1_agreement_high"] < 1
    assert s["dp_mean_low"] == pytest.approx(cluster_mean(np.exp(-base - 0.01 * kl) - np.exp(-base), counts).low)


def test_the_log_scale_kl_interval_covers_the_truth_better_than_the_t_interval():
    """On skewed per-token KL, 30 windows: the log-scale interval covers the mean at about the stated rate, and its
    upper end (the one a KL gate judges) falls short of it less often than the t interval's (about 6% against 8%,
    where 2.5% is the aim: a mean of skewed windows stays skewed at 30; docs/statistics.md has the table)."""
    from tasks.engine.paired import positive_mean

    rng = np.random.default_rng(3)
    trials, covered, above, above_t = 1000, 0, 0, 0
    for _ in range(trials):
        values, counts = skewed_kl(rng, windows=30)
        estimate, plain = positive_mean(values, counts), cluster_mean(values, counts)
        covered += estimate.low <= 0.01 <= estimate.high
        above += estimate.high < 0.01
        above_t += plain.high < 0.01
    assert 0.92 <= covered / trials <= 0.97
    assert above / trials <= 0.07 and above < above_t


def test_the_confident_flip_rate_counts_the_tokens_a_sure_baseline_loses_its_top_token_on():
    """#70: a token is a confident flip where the baseline gave its top token at least 0.9 and the variant put another
    first; the rate is their share of all tokens, with an interval over windows inside [0, 1]."""
    from tasks.engine.paired import CONFIDENT, divergence_summary

    rng = np.random.default_rng(3)
    counts = rng.integers(20, 40, size=12)
    n = int(counts.sum())
    base, variant = rng.gamma(2.0, 1.5, n), rng.gamma(2.0, 1.5, n)
    figures = TokenFigures(kl=rng.gamma(0.5, 0.02, n), kl_reverse=rng.gamma(0.5, 0.03, n), top1=rng.random(n) < 0.8,
                           base_top_p=rng.random(n).astype(np.float32))
    found = divergence_summary(figures, base, variant, counts)
    flips = sum(1 for p, same in zip(figures.base_top_p, figures.top1) if p >= CONFIDENT and not same)
    assert 0 < flips and found["confident_flip_rate"] == pytest.approx(flips / n, rel=1e-12)
    assert 0 <= found["confident_flip_rate_low"] < flips / n < found["confident_flip_rate_high"] <= 1
    assert "confident_flip_rate" not in divergence_summary(replace(figures, base_top_p=None), base, variant, counts)
