"""Dominance: a variant no smaller than another and worse beyond their paired intervals is dominated; the rest is
the front."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tasks.engine.token_figures import TokenFigures
from tasks.record.dominance import dominated_by, worse_beyond_noise
from helpers import typed
from tasks.record.results import VariantResult
from tasks.record.verdict import FRONT, Verdict, format_table, overall

WINDOWS, TOKENS = 40, 50
rng = np.random.default_rng(0)
HARD = rng.standard_normal(WINDOWS * TOKENS) + np.repeat(rng.standard_normal(WINDOWS), TOKENS)  # shared by all


def variant(name: str, bits: float, nll_shift: float, kl: float, seed: int, scored_windows=None,
            cache: float = math.nan) -> VariantResult:
    """A variant's per-token NLL (the text's difficulty, which every model shares, its shift and its own noise) and
    KL, on the same 40 windows of 50 tokens."""
    own = np.random.default_rng(seed)
    result = SimpleNamespace(token_nll=HARD + nll_shift + own.normal(0, 0.05, HARD.size),
                             extra=TokenFigures(kl=np.abs(kl + own.normal(0, 0.01, HARD.size))),
                             window_tokens=np.full(WINDOWS, TOKENS), scored_windows=scored_windows)
    return VariantResult(name, "gptq", "ok", result=result,
                         facts=SimpleNamespace(bits_per_weight=bits, kv_bytes_per_token=cache))


def test_a_larger_and_clearly_worse_variant_is_dominated_by_the_smallest_better_one():
    worse = variant("worse", 4.5, 0.10, 0.10, 1)
    small, close = variant("small", 4.25, 0.02, 0.02, 2), variant("close", 4.3, 0.021, 0.0205, 3)
    tiny = variant("tiny", 3.0, 0.15, 0.15, 4)  # the worst of all, but the smallest: a choice of its own
    found = dominated_by([worse, small, close, tiny])
    assert found == {"worse": "small", "small": None, "close": None, "tiny": None}


def test_a_smaller_key_value_cache_is_a_cost_of_its_own():
    """The same weights with an int8 and an fp8 cache: fp8 is worse beyond noise, but its cache is smaller."""
    int8, fp8 = variant("kv-int8", 32, 0.02, 0.02, 2, cache=12240), variant("kv-fp8", 32, 0.10, 0.10, 1, cache=11520)
    assert worse_beyond_noise(fp8, int8)
    assert dominated_by([int8, fp8]) == {"kv-int8": None, "kv-fp8": None}
    bigger = variant("kv-f16", 32, 0.10, 0.10, 1, cache=23040)
    assert dominated_by([int8, bigger]) == {"kv-int8": None, "kv-f16": "kv-int8"}


def test_overlapping_intervals_are_no_dominance():
    small, close = variant("small", 4.25, 0.02, 0.02, 2), variant("close", 4.3, 0.021, 0.0205, 3)
    assert not worse_beyond_noise(close, small) and not worse_beyond_noise(small, close)
    assert dominated_by([small, close]) == {"small": None, "close": None}


def test_worse_in_nll_alone_is_not_enough_where_both_have_kl():
    better_kl = variant("a", 4.5, 0.10, 0.02, 1)
    assert not worse_beyond_noise(better_kl, variant("b", 4.0, 0.02, 0.02, 2))
    better_kl.result.extra = TokenFigures()  # where one has no KL, the NLL decides
    assert worse_beyond_noise(better_kl, variant("b", 4.0, 0.02, 0.02, 2))


def test_a_run_stopped_early_or_failed_or_not_costed_is_never_dominated():
    stopped = variant("stopped", 8.0, 0.5, 0.5, 1, scored_windows=np.arange(10))
    failed = VariantResult.failed("failed", "gptq", "out of memory")
    uncosted = variant("uncosted", float("nan"), 0.5, 0.5, 5)
    assert dominated_by([stopped, failed, uncosted, variant("good", 4.0, 0.0, 0.01, 2)]) == {
        "stopped": None, "good": None}


def test_the_table_marks_the_dominated_and_the_verdict_names_the_front():
    rows = [{"variant": "base", "status": "ok", "reason": "", "method": "baseline", "ppl": 10.0, "ppl_stderr": 0.1,
             "tokens_per_second": 1.0, "weight_mib": 1.0, "bits_per_byte": None, "bits_per_weight": 32.0},
            {"variant": "worse", "status": "ok", "reason": "", "method": "gptq", "ppl": 11.0, "ppl_stderr": 0.1,
             "tokens_per_second": 1.0, "weight_mib": 1.0, "bits_per_byte": None, "bits_per_weight": 4.5,
             "dominated_by": "small"}]
    table = format_table([typed(row) for row in rows], {"worse": Verdict("worse", "pass", "ΔPPL +10%")})
    assert "pass: ΔPPL +10%; dominated by small" in table and " 4.50 " in table
    said = overall(typed({"status": "ok"}), [Verdict("worse", "pass", ""), Verdict("small", "pass", "")], front=["small"])
    assert said.reason == f"all 2 variant(s) passed; {FRONT}: small"
