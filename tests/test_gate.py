"""The gate on crafted comparison rows: clear pass, clear fail, inside the noise, and missing figures."""

from __future__ import annotations

import math

import pytest
from helpers import typed

from tasks.config import Thresholds
from tasks.record.verdict import Verdict, format_table, judge_row as judge_typed, overall


def row(delta=0.5, low=0.2, high=0.8, kld=0.01, kld_high=0.012, top1=0.97, top1_low=0.96, **extra):
    """A variant's row as a record holds it (flat), with the figures a gate reads."""
    return {"variant": "q", "method": "gptq", "status": "ok", "reason": "", "delta_ppl": delta / 4,
            "ppl_ratio": 1 + delta / 100, "delta_ppl_pct": delta,
            "delta_ppl_pct_low": low, "delta_ppl_pct_high": high, "kld_mean": kld, "kld_mean_low": kld / 2,
            "kld_mean_high": kld_high, "top1_agreement": top1,
            "top1_agreement_low": top1_low, "top1_agreement_high": min(1, 2 * top1 - top1_low), **extra}


def judge_row(flat: dict, thresholds: Thresholds):
    """The verdict on a row as a record holds it, read as the audit's typed row."""
    return judge_typed(typed(flat), thresholds)


def drawn(rows: list[dict], verdicts: dict) -> str:
    return format_table([typed(r) for r in rows], verdicts)


GATE = Thresholds(max_ppl_increase_pct=1.0, max_kld_mean=0.02, min_top1_agreement=0.95)
OK = {"variant": "base", "method": "baseline", "status": "ok", "reason": ""}
FAILED = {"variant": "base", "method": "baseline", "status": "failed", "reason": "gone"}


def test_clear_pass():
    verdict = judge_row(row(), GATE)
    assert verdict.status == "pass"
    assert "ΔPPL +0.50% [+0.20, +0.80] ≤ 1" in verdict.reason and "top-1 agreement" in verdict.reason


@pytest.mark.parametrize("changes,expected", [
    ({"delta": 1.5, "low": 1.2, "high": 1.8}, "ΔPPL +1.50% [+1.20, +1.80] breaks the limit ≤ 1"),
    ({"kld": 0.03, "kld_high": 0.04}, "KLD mean 0.0300"),
    ({"top1": 0.90, "top1_low": 0.88}, "top-1 agreement 0.9000"),
])
def test_clear_fail(changes, expected):
    verdict = judge_row(row(**changes), GATE)
    assert verdict.status == "fail" and expected in verdict.reason and "breaks the limit" in verdict.reason


@pytest.mark.parametrize("changes,expected", [
    ({"delta": 0.9, "low": 0.4, "high": 1.4}, "ΔPPL +0.90% [+0.40, +1.40] is inside the noise"),
    ({"kld": 0.018, "kld_high": 0.021}, "KLD mean 0.0180"),
    ({"top1": 0.955, "top1_low": 0.945}, "top-1 agreement 0.9550"),
])
def test_inside_the_noise_is_judged_on_the_pessimistic_end(changes, expected):
    verdict = judge_row(row(**changes), GATE)
    assert verdict.status == "fail" and expected in verdict.reason and "inside the noise" in verdict.reason


def test_per_variant_override_and_missing_figures():
    relaxed = Thresholds(max_ppl_increase_pct=1.0, per_variant={"q": {"max_ppl_increase_pct": 5}})
    assert judge_row(row(delta=1.5, low=1.2, high=1.8), relaxed).status == "pass"
    no_kl = {k: v for k, v in row().items() if not k.startswith(("kld", "top1"))}
    assert judge_row(no_kl, GATE).status == "error"
    failed = {"variant": "q", "method": "gptq", "status": "failed", "reason": "out of memory at batch size 1"}
    assert judge_row(failed, GATE).reason == "out of memory at batch size 1"


def test_overall_verdict():
    passing, failing = judge_row(row(), GATE), judge_row(row(delta=2, low=1.5, high=2.5), GATE)
    assert overall(typed(OK), [passing]).status == "pass"
    assert overall(typed(OK), [passing, failing]).status == "fail"
    assert overall(typed(FAILED), [passing]).reason == "baseline failed: gone"


def test_table_shows_interval_kl_agreement_and_failures():
    ok = row(ppl=25.0, ppl_stderr=0.5, bits_per_byte=1.2, tokens_per_second=300, weight_mib=100)
    base = {"variant": "base", "method": "baseline", "status": "ok", "reason": "", "ppl": 24.9, "ppl_stderr": 0.5,
            "bits_per_byte": 1.19, "tokens_per_second": 310, "weight_mib": 500}
    broken = {"variant": "gone", "method": "awq", "status": "failed", "reason": "model folder not found"}
    table = drawn([base, ok, broken], {"q": judge_row(ok, GATE)}).splitlines()
    assert "ΔPPL % [95% CI]" in table[0] and "KLD" in table[0] and "top-1" in table[0]
    assert "+0.50 [+0.20,+0.80]" in table[3] and "0.0100" in table[3] and "97.0%" in table[3] and "pass:" in table[3]
    assert table[4].split()[:3] == ["gone", "awq", "—"] and table[4].endswith("model folder not found")


def test_a_variant_equal_to_its_baseline_reads_zero_not_minus_zero():
    """Float noise of an identical variant (the embedded GGUF file) is below the printed digits: +0.00."""
    same = row(delta=-1e-9, low=-2e-9, high=1e-9, kld=1e-12, kld_high=1e-11, top1=1.0, top1_low=1.0, ppl=25.0,
               ppl_stderr=0.5, bits_per_byte=1.2, tokens_per_second=300, weight_mib=100)
    same["kld_mean_low"] = -1e-11
    verdict = judge_row(same, GATE)
    table = drawn([same], {"q": verdict})
    assert "-0.00" not in table and "+0.00 [+0.00,+0.00]" in table
    # a KL keeps its significant digits (1e-12, not 0.0000), as every view gives it
    assert "ΔPPL +0.00% [+0.00, +0.00]" in verdict.reason and "KLD mean 1e-12 [-1e-11, 1e-11]" in verdict.reason


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["", "_low", "_high"], ids=["estimate", "low end", "high end"])
@pytest.mark.parametrize("what, key", [("ΔPPL", "delta_ppl_pct"), ("KLD mean", "kld_mean"),
                                       ("top-1 agreement", "top1_agreement")])
def test_no_gate_passes_what_is_not_a_finite_number(what, key, where, bad):
    """`x > limit` is False for NaN: a NaN KLD once printed `pass: KLD mean nan [nan, nan] ≤ 0.01`."""
    crafted = row(windows=40) | {f"{key}{where}": bad}
    verdict = judge_row(crafted, GATE)
    assert verdict.status == "error", verdict
    assert f"{what} " in verdict.reason and "cannot be judged" in verdict.reason
    assert "it is not a finite number" in verdict.reason
    assert overall(typed(OK), [verdict]).status != "pass"


def test_one_window_cannot_be_judged_and_says_why():
    """One window (`chunks: 1`) has no interval: it once passed every gate where three windows failed."""
    nan = math.nan
    alone = row(delta=0.88, low=nan, high=nan, kld=0.1386, kld_high=nan, top1=0.5161, top1_low=nan, windows=1)
    alone["kld_mean_low"] = nan
    verdict = judge_row(alone, Thresholds(max_ppl_increase_pct=5, max_kld_mean=0.5, min_top1_agreement=0.5))
    assert verdict.status == "error"
    assert verdict.reason.count("it rests on 1 window(s), and an interval needs at least 2") == 3


def test_a_clear_failure_stays_a_failure_beside_a_gate_that_cannot_be_judged():
    verdict = judge_row(row(delta=3.0, low=2.5, high=3.5, windows=40) | {"kld_mean_high": math.nan}, GATE)
    assert verdict.status == "fail" and "breaks the limit" in verdict.reason and "cannot be judged" in verdict.reason


def test_table_keeps_figures_apart_and_says_how_many_windows():
    """A one-token corpus once printed PPL and its error as one number: `9829.417415894.1041`."""
    huge = row(delta=130.73, low=math.nan, high=math.nan, ppl=9829.4174, ppl_stderr=15894.1041, bits_per_byte=None,
               tokens_per_second=12345678, weight_mib=123456789, windows=1, variant="a-variant-with-a-long-name",
               method="compressed-tensors")
    lines = drawn([huge], {}).splitlines()
    assert "win" in lines[0].split()
    cells = lines[2].split()
    assert cells[:6] == ["a-variant-with-a-long-name", "compressed-tensors", "9829.4174", "15894.1041", "+130.73",
                         "[+nan,+nan]"] and cells[6] == "1"
    assert len({len(lines[0]), len(lines[1])}) == 1


def test_the_lines_of_a_drift_and_of_llama_cpp_say_each_field_where_it_belongs():
    """Each field read to its own place: distinct values, so that one read for another shows."""
    from tasks.record.verdict import drift_text, llama_cpp_text

    drift = {"reference": "r0", "max_abs_delta_nll": 0.0123, "mean_abs_delta_nll": 0.0004, "delta_ppl_pct": 0.567,
             "changed": {"torch": "2.1 → 2.2"}, "drift": True}
    said = ("environment drift: the baseline's NLL moved by up to 0.0123 nats a token (ΔPPL +0.5670%) since "
            "reference r0 (torch 2.1 → 2.2)")
    assert drift_text(drift) == said
    assert overall(typed(OK), [Verdict("q", "pass", "")]).reason == "all 1 variant(s) passed"
    assert overall(typed(OK), [Verdict("q", "pass", "")], drift).reason == f"{said}; all 1 variant(s) passed"
    assert drift_text(drift | {"drift": False, "changed": {}}).startswith("no drift: ")
    assert overall(typed(OK), [Verdict("q", "pass", "")], drift | {"drift": False}).reason == "all 1 variant(s) passed"
    ran = {"threads": 3, "batch": 64, "type_k": "q8_0", "type_v": "f16", "flash_attn": "on", "gpu_layers": 5,
           "n_ctx": 256, "n_batch": 64, "n_ubatch": 32, "flash_attn_asked": "auto", "gpu_layers_asked": 7}
    assert llama_cpp_text(ran) == ("flash attention on (asked: auto), K/V cache q8_0/f16, n_ctx 256, batch 64/32, "
                                   "3 threads, 5 layers on a GPU (7 asked: this build cannot offload)")
    asked = {"threads": "default", "batch": 64, "type_k": "f16", "type_v": "q4_0", "flash_attn": "auto", "gpu_layers": 0}
    assert llama_cpp_text(asked) == "flash attention auto, K/V cache f16/q4_0, default threads"


def test_the_lines_under_a_table_say_each_field_where_it_belongs():
    """The population, the runtime's cost and the stream llama.cpp tokenized, each field to its own place."""
    from tasks.record.population import population_line
    from tasks.record.runtime_cost import runtime_cost_lines, stream_line

    found = {"digest": "d" * 16, "tokenizer": "t" * 64, "tokenized_by": "transformers", "text": "x" * 64,
             "stream": "s" * 64, "mode": "sliding", "window": 256, "stride": 128, "bos": "stream", "max_tokens": None,
             "chunks": None, "tokens": 1024}
    assert population_line(found) == (f"token population {'d' * 16}: 1,024 tokens of text {'x' * 12}, tokenizer "
                                      f"{'t' * 12} (transformers), window 256, stride 128, BOS stream, max_tokens all")
    assert population_line(found | {"mode": "chunks", "max_tokens": 2048}).endswith(
        "window 256 (chunks chunks), BOS stream, max_tokens 2048")
    cost = {"served": "q4 served", "weights": "q4 weights", "file": "m.gguf", "delta_ppl_pct": 1.5,
            "delta_ppl_pct_low": 0.25, "delta_ppl_pct_high": 2.75, "windows": 9}
    assert runtime_cost_lines([cost]) == [
        "runtime cost: q4 served (llama.cpp) against q4 weights (the same file dequantized in transformers): "
        "ΔPPL +1.50% [+0.25, +2.75] over 9 windows"]
    differ = {"transformers_tokens": 1000, "llama_cpp_tokens": 1002, "first_difference": 17}
    assert stream_line(differ) == ["tokens: llama.cpp's tokenizer of the served file gives 1,002 tokens where "
                                   "transformers' gives 1,000, first different at token 17; every model scored "
                                   "llama.cpp's stream"] and stream_line(None) == []
