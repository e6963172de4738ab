"""Which variants another beats on both counts: no larger, and better beyond the paired intervals.

A chooser keeps only the variants on the front of size against quality: a variant that takes at least as many bits
per weight as another (its quantized layers as shipped, ``tasks.models.cost``), and where both say, at least as many
bytes of key/value cache per token, and scores worse than it beyond noise is dominated. Worse is decided on the two variants' own paired difference over the same tokens, not on their point
estimates: its NLL above the other's (the ΔPPL between them) and, where both have it, its KL(baseline‖·) above the
other's, each with its 95% interval over windows wholly above zero. Speed is not a cost here: tok/s is measured
once, without an interval, on whatever else the machine was doing.
"""

from __future__ import annotations

import math

import numpy as np

from tasks.engine.paired import cluster_mean
from tasks.record.results import VariantResult


def worse_beyond_noise(a: VariantResult, b: VariantResult) -> bool:
    """Whether ``a`` scores worse than ``b`` beyond the paired intervals; never for runs that did not score the same
    tokens (a sequential run stopped early)."""
    ra, rb = a.result, b.result
    if ra.scored_windows is not None or rb.scored_windows is not None or len(ra.token_nll) != len(rb.token_nll):
        return False
    kl = [(ra.extra.kl, rb.extra.kl)] if ra.extra.kl is not None and rb.extra.kl is not None else []
    figures = [(ra.token_nll, rb.token_nll), *kl]
    return all(cluster_mean(np.asarray(x, np.float64) - np.asarray(y, np.float64), ra.window_tokens).low > 0
               for x, y in figures)  # a NaN bound (one window) is not beyond noise


def _bits(outcome: VariantResult) -> float:
    return outcome.facts.bits_per_weight if outcome.facts is not None else math.nan


def no_larger(b_bits: float, a_bits: float, b_cache: float, a_cache: float) -> bool:
    """Whether ``b`` costs no more than ``a``: bits per weight, and where both say, its key/value cache's bytes per
    token (an fp8 cache is smaller than an int8 one on the same weights, and neither dominates the other for it)."""
    return b_bits <= a_bits and not b_cache > a_cache  # a NaN cache size (not measured) decides nothing


def dominated_by(variants: list[VariantResult]) -> dict[str, str | None]:
    """Each scored variant's dominator (None for one on the front): of the variants no larger than it that it is
    worse than beyond noise, the smallest."""
    scored = [v for v in variants if v.ok and math.isfinite(_bits(v))]
    found = {}
    for a in scored:
        better = [b for b in scored if b is not a and no_larger(_bits(b), _bits(a), b.facts.kv_bytes_per_token,
                                                                 a.facts.kv_bytes_per_token)
                  and worse_beyond_noise(a, b)]
        found[a.name] = min(better, key=_bits).name if better else None
    return found
