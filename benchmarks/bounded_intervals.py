"""Coverage of the intervals of figures that cannot be negative (a mean KL) or pass 1 (top-1 agreement), simulated:
the t interval against the log-scale (KL) and logit-scale (top-1) intervals ``tasks.engine.paired`` takes, over
windows whose tokens share a window-level effect, as an audit's do. No model is run.

    .venv/bin/python benchmarks/bounded_intervals.py [--trials 2000] [--seed 0]

Prints one JSON line per case: ``covered`` (the interval holds the truth), ``short_above`` (its upper end falls short:
the end a KL gate judges), ``short_below`` (its lower end lies above it: the end a top-1 gate judges), and ``past``
(the share of intervals reaching out of the figure's range: below 0, or above 1).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tasks.engine.paired import cluster_mean, positive_mean, share_mean

SIZE = 64  # tokens a window


def kl_case(rng, windows: int, spread: float, truth: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL: most tokens near zero and a long tail (gamma, shape 0.3), each window's scale lognormal with
    ``spread`` (some passages are harder), the stream's mean ``truth``."""
    scale = np.exp(spread * rng.standard_normal(windows) - spread**2 / 2)
    return (rng.gamma(0.3, truth / 0.3, (windows, SIZE)) * scale[:, None]).ravel(), np.full(windows, SIZE)


def top1_case(rng, windows: int, truth: float, concentration: float = 50) -> tuple[np.ndarray, np.ndarray]:
    """Per-token agreement (0 or 1), each window's rate drawn from a beta law of mean ``truth``."""
    rates = rng.beta(truth * concentration, (1 - truth) * concentration, windows)
    return (rng.random((windows, SIZE)) < rates[:, None]).astype(np.float64).ravel(), np.full(windows, SIZE)


def coverage(draw, estimator, truth: float, trials: int, low: float, high: float) -> dict[str, float]:
    counts = np.zeros(4)
    for _ in range(trials):
        found = estimator(*draw())
        counts += [found.low <= truth <= found.high, found.high < truth, found.low > truth,
                   found.low < low or found.high > high]
    return dict(zip(("covered", "short_above", "short_below", "past"), (counts / trials).round(3).tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    for windows in (5, 10, 30, 100):
        for spread in (0.5, 1.0):
            for name, estimator in (("t", cluster_mean), ("log", positive_mean)):
                found = coverage(lambda w=windows, s=spread: kl_case(rng, w, s), estimator, 0.01, args.trials, 0,
                                 np.inf)
                print(json.dumps({"figure": "kld_mean", "windows": windows, "window_spread": spread,
                                  "interval": name, **found}))
    for windows in (5, 10, 30):
        for truth in (0.9, 0.99):
            for name, estimator in (("t", cluster_mean), ("logit", share_mean)):
                found = coverage(lambda w=windows, p=truth: top1_case(rng, w, p), estimator, truth, args.trials, 0, 1)
                print(json.dumps({"figure": "top1_agreement", "windows": windows, "truth": truth, "interval": name,
                                  **found}))


if __name__ == "__main__":
    main()
