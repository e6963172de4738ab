"""Where in the text a variant loses: each model's top token from the engine against full logits, positions in the
window against the model's input rows, the groups' figures against a plain re-computation, and a stopped
variant paired with the baseline's tokens of its own windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import perturbed, scored_log_probs, stored_reference

from tasks.audit.where import CONTEXT_TOKENS, where_of
from tasks.config import EvaluationConfig
from tasks.data.corpus import tokenize
from tasks.data.evaluation import evaluation
from tasks.engine.perplexity import combine, perplexity, score_part, scored_positions, scored_targets
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.engine.sequential import window_order
from tasks.engine.windows import plan
from tasks.record.results import VariantResult
from tasks.engine.token_figures import TokenFigures
from tasks.record.where import CONFIDENCE_EDGES, POSITION_BINS, TOP_TOKENS, TokenPlaces, where_figures

WINDOW, STRIDE = 64, 24


def full_vocabulary_tops(base, variant, stream, windows) -> dict[str, np.ndarray]:
    """Each window alone through both models, in float64 over the whole vocabulary: at every scored token the
    baseline's probability of its most likely token, whether that is the target, and each model's most likely."""
    found = {"base_top_p": [], "base_right": [], "base_top": [], "top": []}
    for q, lb, lv in scored_log_probs(base, variant, stream, windows):
        found["base_top_p"].append(float(lb.exp().max()))
        found["base_top"].append(int(lb.argmax()))
        found["base_right"].append(int(lb.argmax()) == int(stream.ids[q]))
        found["top"].append(int(lv.argmax()))
    return {key: np.array(values) for key, values in found.items()}


@pytest.fixture(scope="module")
def models(trained_model_dir):
    """The briefly trained Llama in float64 as baseline (an untrained one is never right) and a noisy copy of it."""
    return perturbed(trained_model_dir, scale=0.0), perturbed(trained_model_dir, scale=0.01)


@pytest.fixture(scope="module")
def scored(models, trained_model_dir, tokenizer, text):
    """An audit's evaluation, the baseline scored writing its reference, and the variant's divergence from it."""
    base, variant = models
    settings = evaluation(text, tokenizer, EvaluationConfig(window=WINDOW, stride=STRIDE, max_tokens=300))
    stored, base_result = stored_reference(base, settings.stream, WINDOW, STRIDE, trained_model_dir, "where")
    against = stored.baseline(str(trained_model_dir), torch.device("cpu"))
    return settings, base_result, against


def test_each_model_s_top_token_and_the_baseline_s_confidence_equal_a_float64_brute_force(models, scored):
    """From the stored reference, in the divergence's own pass: the baseline's top-1 probability, whether it was
    right, and both models' most likely tokens, against both models' full logits window by window."""
    base, variant = models
    settings, _, against = scored
    stream = settings.stream
    measured = perplexity(variant, stream, Windowing(WINDOW, STRIDE), 2, ScoreOptions(reference=against)).extra
    truth = full_vocabulary_tops(base, variant, stream, plan(stream, WINDOW, STRIDE))
    assert measured.base_top_p.dtype == np.float32 and measured.base_right.dtype == bool
    assert measured.base_top.dtype == measured.top.dtype == np.int32
    np.testing.assert_allclose(measured.base_top_p, truth["base_top_p"], rtol=1e-6)
    for key, found in (("base_right", measured.base_right), ("base_top", measured.base_top), ("top", measured.top)):
        np.testing.assert_array_equal(found, truth[key], err_msg=key)
    np.testing.assert_array_equal(measured.top1, truth["base_top"] == truth["top"])
    # the figures are not trivially the same: the variant disagrees somewhere, the baseline is right and wrong
    assert 0 < (truth["base_top"] != truth["top"]).sum() and 0 < truth["base_right"].sum() < len(truth["base_right"])


@pytest.mark.parametrize("mode, bos, window, stride", [("sliding", "stream", 64, 24), ("sliding", "none", 50, 17),
                                                       ("sliding", "window", 64, 24), ("gptq", "none", 40, 40),
                                                       ("llama.cpp", "stream", 40, 40)])
def test_a_token_s_position_is_where_it_sits_in_the_model_s_input(tokenizer, text, mode, bos, window, stride):
    """Each window's input row is its prefix and its stream tokens: a scored token sits at its position in that row,
    its window's scored tokens run to the row's end, and every position lies in the window."""
    stream = tokenize(text, tokenizer, bos=bos, max_tokens=437)
    positions = scored_positions(stream, window, stride, mode)
    targets = scored_targets(stream, window, stride, mode)
    assert len(positions) == len(targets)
    done = 0
    for w in plan(stream, window, stride, mode):
        row = torch.cat([torch.tensor(stream.prefix, dtype=torch.long), stream.ids[w.start : w.end]])
        mine = positions[done : done + w.n_scored]
        assert len(row) <= window and list(mine) == list(range(len(row) - w.n_scored, len(row)))
        if mode != "llama.cpp" or w.first_scored > w.start:  # llama.cpp writes BOS over the row's first token
            assert torch.equal(row[mine], targets[done : done + w.n_scored])
        done += w.n_scored
    assert done == len(positions) and positions.min() >= 0 and positions.max() < window


def groups_by_hand(values: np.ndarray, edges) -> list[np.ndarray]:
    """Each bin's members, by comparing with its bounds one token at a time: ``low <= v < high``, the last bin
    closed at its top; a float32 value as it is stored (0.9 in float32 is below 0.9)."""
    last = len(edges) - 2
    return [np.array([edges[i] <= float(v) < edges[i + 1] or (i == last and float(v) == edges[-1]) for v in values])
            for i in range(len(edges) - 1)]


def check_row(row: dict, chosen: np.ndarray, figures: dict[str, np.ndarray], windows: np.ndarray) -> None:
    """A row's figures against a computation by hand: the mean, and a 95% interval whose error is taken over
    windows (each window's sum of residuals from the mean), Student's t with one degree of freedom less than
    the windows (KL's on the log scale)."""
    from scipy import stats

    assert row["tokens"] == chosen.sum()
    for name, values in figures.items():
        picked = values[chosen]
        if not len(picked):
            assert row[name] is None and row[f"{name}_low"] is None
            continue
        mean = picked.mean()
        residuals = [float((picked[windows[chosen] == w] - mean).sum()) for w in sorted(set(windows[chosen]))]
        clusters = len(residuals)
        stderr = math.sqrt(clusters / (clusters - 1) * sum(r * r for r in residuals)) / len(picked)
        half = stats.t.ppf(0.975, clusters - 1) * stderr
        assert row[name] == pytest.approx(picked.mean(), rel=1e-12)
        # KL cannot be negative: its interval is taken on the log scale (delta method), the ΔNLL's as it is
        low, high = (mean * math.exp(-half / mean), mean * math.exp(half / mean)) if name == "kl" else (mean - half,
                                                                                                    mean + half)
        assert row[f"{name}_low"] == pytest.approx(low, rel=1e-9)
        assert row[f"{name}_high"] == pytest.approx(high, rel=1e-9)


def random_tokens(rng, n: int, window: int) -> dict:
    """Paired per-token arrays as an audit holds them, with confidences on every bin edge and at 1."""
    base = rng.gamma(2.0, 1.5, n).astype(np.float32)
    confidence = rng.random(n).astype(np.float32)
    confidence[: len(CONFIDENCE_EDGES)] = CONFIDENCE_EDGES
    figures = TokenFigures(kl=rng.gamma(0.5, 0.05, n), base_top_p=confidence, base_right=rng.random(n) < 0.4,
                           base_top=rng.integers(0, 5000, n).astype(np.int32),
                           top=rng.integers(0, 5000, n).astype(np.int32), top1=rng.random(n) < 0.9)
    return {"base_nll": base, "nll": (base + rng.normal(0.05, 0.3, n)).astype(np.float32), "figures": figures,
            "places": TokenPlaces(rng.integers(1, window, n), np.sort(rng.integers(0, 40, n)),
                                  rng.integers(0, 5000, n))}


def test_the_groups_figures_equal_a_direct_computation():
    """ΔNLL and KL by position, by confidence and by right or wrong, each with its interval over windows, against
    plain numpy; the tokens of every grouping add up to all of them, and the whole's ΔNLL is the mean difference."""
    rng = np.random.default_rng(0)
    window = 50  # 8 bins of 6.25 positions: whole-number edges that are not all equal apart
    tokens = random_tokens(rng, 3000, window)
    found = where_figures(**tokens, window=window)
    delta = tokens["nll"].astype(np.float64) - tokens["base_nll"]
    figures, windows = {"delta_nll": delta, "kl": tokens["figures"].kl}, tokens["places"].windows
    edges = [round(window * i / POSITION_BINS) for i in range(POSITION_BINS + 1)]
    assert [(row["low"], row["high"]) for row in found["by_position"]] == list(zip(edges, edges[1:]))
    for row, chosen in zip(found["by_position"], groups_by_hand(tokens["places"].positions, edges)):
        check_row(row, chosen, figures, windows)
    assert [row["low"] for row in found["by_confidence"]] == list(CONFIDENCE_EDGES[:-1])
    for row, chosen in zip(found["by_confidence"], groups_by_hand(tokens["figures"].base_top_p, CONFIDENCE_EDGES)):
        check_row(row, chosen, figures, windows)
    right = tokens["figures"].base_right
    assert [row["baseline"] for row in found["by_baseline"]] == ["right", "wrong"]
    for row, chosen in zip(found["by_baseline"], (right, ~right)):
        check_row(row, chosen, figures, windows)
    for grouping in ("by_position", "by_confidence", "by_baseline"):
        assert sum(row["tokens"] for row in found[grouping]) == found["tokens"] == len(delta)
    check_row(found["all"], np.ones(len(delta), bool), figures, windows)
    assert found["all"]["delta_nll"] == pytest.approx(tokens["nll"].astype(np.float64).mean()
                                                      - tokens["base_nll"].astype(np.float64).mean(), rel=1e-12)


def test_an_empty_bin_has_no_figures_and_a_lone_token_no_interval():
    rng = np.random.default_rng(1)
    tokens = random_tokens(rng, 200, 64)
    tokens["places"].positions[:] = 40  # bin 40-47 only
    tokens["places"].positions[0] = 3  # a lone token in bin 0-7
    found = where_figures(**tokens, window=64)
    counts = [row["tokens"] for row in found["by_position"]]
    assert counts == [1, 0, 0, 0, 0, 199, 0, 0]
    lone, empty = found["by_position"][0], found["by_position"][1]
    assert lone["delta_nll"] == pytest.approx(float(tokens["nll"][0]) - float(tokens["base_nll"][0]))
    assert lone["delta_nll_low"] is None and lone["kl_high"] is None
    assert empty["delta_nll"] is None and empty["kl"] is None


def test_the_top_tokens_are_those_of_largest_kl_largest_first():
    rng = np.random.default_rng(2)
    tokens = random_tokens(rng, 1000, 64)
    found = where_figures(**tokens, window=64)
    figures, places = tokens["figures"], tokens["places"]
    expected = np.argsort(figures.kl)[::-1][:TOP_TOKENS]  # KLs drawn from a continuous law: no ties
    assert [row["token"] for row in found["top_kl"]] == expected.tolist()
    assert [row["kl"] for row in found["top_kl"]] == sorted(figures.kl, reverse=True)[:TOP_TOKENS]
    for row in found["top_kl"]:
        i = row["token"]
        assert (row["window"], row["position"], row["target"], row["base_top"], row["top"]) == \
            (places.windows[i], places.positions[i], places.targets[i], figures.base_top[i], figures.top[i])
        assert row["delta_nll"] == pytest.approx(float(tokens["nll"][i]) - float(tokens["base_nll"][i]))


def test_without_kl_only_the_change_in_nll_by_position_is_found():
    """Divergence off: the variant has no KL, so no confidence, right or wrong, nor tokens of largest KL."""
    tokens = random_tokens(np.random.default_rng(3), 500, 64)
    tokens["figures"] = TokenFigures()
    found = where_figures(**tokens, window=64)
    assert set(found) == {"tokens", "interval", "all", "by_position"}
    assert all("kl" not in row for row in found["by_position"]) and found["all"]["delta_nll"] is not None


def test_a_stopped_variant_is_paired_with_the_baseline_s_tokens_of_its_windows(models, scored, tokenizer):
    """A sequential run that stopped holds a sample of windows: its figures pair its tokens with the baseline's of the
    same windows, and each listed token is the stream's token at its window and position, shown in its context."""
    _, variant = models
    settings, base_result, against = scored
    stream = settings.stream
    n = len(plan(stream, WINDOW, STRIDE))
    part = score_part(variant, stream, Windowing(WINDOW, STRIDE), 2,
                      options=ScoreOptions(reference=against, order=window_order(n, 5), stop_at=n // 2))
    stopped = combine([part], stream, "noisy", WINDOW, STRIDE)
    assert stopped.scored_windows is not None and stopped.n_tokens < base_result.n_tokens
    baseline = VariantResult("baseline", "baseline", "ok", result=base_result)
    found = where_of(VariantResult("noisy", "x", "ok", result=stopped), baseline, settings, tokenizer)
    base_sum = base_result.window_nll[stopped.scored_windows].sum()  # the baseline's NLL of those windows
    assert found["tokens"] == stopped.n_tokens
    assert found["all"]["delta_nll"] == pytest.approx((stopped.nll_sum - base_sum) / stopped.n_tokens, rel=1e-9)
    planned = plan(stream, WINDOW, STRIDE)
    for row in found["top_kl"]:
        assert row["window"] in stopped.scored_windows and row["kl"] == stopped.extra.kl[row["token"]]
        w = planned[row["window"]]
        place = w.start + row["position"] - len(stream.prefix)
        assert w.first_scored <= place < w.end and row["target"] == int(stream.ids[place])
        assert row["context"] == tokenizer.decode(stream.ids[max(w.start, place - CONTEXT_TOKENS) : place].tolist())
        assert row["target_text"] == tokenizer.decode([row["target"]])
        assert row["top_text"] == tokenizer.decode([row["top"]])
    past = len(tokenizer) + 5  # an id of a head padded wider than the vocabulary: no text has it
    stopped.extra.top[found["top_kl"][0]["token"]] = past
    again = where_of(VariantResult("noisy", "x", "ok", result=stopped), baseline, settings, tokenizer)
    assert again["top_kl"][0]["top_text"] == f"<id {past}>"
    unscored = VariantResult.failed("noisy", "x", "out of memory")
    assert where_of(unscored, baseline, settings, tokenizer) is None
