"""The engine against a brute-force reference, and its invariance to batching, order and padding."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tasks.core.errors import InputError, NumericalError
from tasks.data.corpus import tokenize
from tasks.engine.perplexity import perplexity, score_windows
from tasks.engine.scoring_options import Feed, Windowing
from tasks.engine.windows import plan_windows


def brute_force_nll_sum(model, stream, window: int, stride: int) -> tuple[float, int]:
    """Each window run alone, full-vocabulary log-softmax, one position at a time."""
    prefix = list(stream.prefix)
    ids = stream.ids.tolist()
    total, count = 0.0, 0
    first = 0 if prefix else 1
    end, k, scored_until = 0, 0, first
    while scored_until < len(ids):
        end = min(window - len(prefix) + k * stride, len(ids))
        start = max(0, end - (window - len(prefix)))
        row = prefix + ids[start:end]
        with torch.no_grad():
            logits = model(torch.tensor([row])).logits[0].double()
        log_probs = torch.log_softmax(logits, dim=-1)
        for position in range(scored_until, end):
            column = len(prefix) + position - start
            total -= float(log_probs[column - 1, ids[position]])
            count += 1
        scored_until, k = end, k + 1
    return total, count


@pytest.mark.parametrize("bos", ["none", "stream", "window"])
@pytest.mark.parametrize("window,stride,batch_size", [(64, 32, 3), (48, 1, 16), (32, 31, 2), (256, 100, 4)])
def test_matches_brute_force_reference(tiny_model, tokenizer, text, bos, window, stride, batch_size):
    stream = tokenize(text, tokenizer, bos=bos, max_tokens=300)
    stride = min(stride, window - len(stream.prefix) - 1)  # S = L - 1 where the BOS takes a slot
    result = perplexity(tiny_model, stream, Windowing(window, stride), batch_size)
    reference, count = brute_force_nll_sum(tiny_model, stream, window, stride)
    assert result.n_tokens == count
    assert result.nll_sum == pytest.approx(reference, rel=1e-6)
    assert result.ppl == pytest.approx(math.exp(reference / count), rel=1e-6)


@pytest.mark.parametrize("batch_size,shuffled", [(2, False), (3, False), (7, False), (1, True), (7, True)],
                         ids=["batch-2", "batch-3", "batch-7", "batch-1-shuffled", "batch-7-shuffled"])
def test_result_does_not_depend_on_batch_size_or_window_order(tiny_model64, tokenizer, text, batch_size, shuffled):
    stream = tokenize(text, tokenizer, max_tokens=1500)
    windows = plan_windows(len(stream.ids), 64, 24, stream.first_scored)
    reference = score_windows(tiny_model64, Feed(stream.ids, batch_size=1), windows)
    order = windows[:]
    if shuffled:
        random.Random(0).shuffle(order)
    scores = score_windows(tiny_model64, Feed(stream.ids, batch_size=batch_size), order)
    assert float(scores.window_nll.sum()) == pytest.approx(float(reference.window_nll.sum()), rel=1e-12)
    assert torch.equal(scores.window_tokens, reference.window_tokens)
    torch.testing.assert_close(scores.token_nll, reference.token_nll, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_length,batch_size", [(32, 1), (64, 3), (200, 2)])
def test_matches_lm_evaluation_harness_in_its_convention(tiny_model64, tokenizer, text, max_length, batch_size):
    """lm-eval's loglikelihood_rolling with max_length M is our ``bos: stream``, window M + 1, stride M."""
    from benchmarks.peers import lm_eval_rolling

    text = text[:6000]
    theirs, n_tokens = lm_eval_rolling(tiny_model64, tokenizer, text, max_length, batch_size)
    ours = perplexity(tiny_model64, tokenize(text, tokenizer, bos="stream"), Windowing(max_length + 1, max_length),
                      batch_size)
    assert ours.n_tokens == n_tokens
    assert ours.nll_sum == pytest.approx(theirs, rel=1e-9)


def test_mean_of_batch_means_drifts_with_batch_size_but_ours_does_not(tiny_model64, tokenizer, text):
    """The common bug: averaging per-batch mean NLL weighs a short last batch like a full one."""
    stream = tokenize(text, tokenizer, max_tokens=1000)
    windows = plan_windows(len(stream.ids), 64, 24, stream.first_scored)
    scores = score_windows(tiny_model64, Feed(stream.ids, batch_size=1), windows)
    ours, naive = set(), set()
    for batch_size in (1, 2, 3, 7):
        batch_means = []
        for b in range(0, len(windows), batch_size):
            nll = scores.window_nll[b : b + batch_size].sum()
            tokens = scores.window_tokens[b : b + batch_size].sum()
            batch_means.append(float(nll / tokens))
        naive.add(round(sum(batch_means) / len(batch_means), 9))
        result = perplexity(tiny_model64, stream, Windowing(64, 24), batch_size)
        ours.add(round(result.mean_nll, 9))
    assert len(naive) == 4, "the naive mean should differ for each batch size"
    assert len(ours) == 1


@pytest.mark.parametrize("n", [2, 3, 31, 32, 33, 97, 200])
@pytest.mark.parametrize("window,stride", [(32, 1), (32, 31), (32, 16), (16, 7)])
def test_scores_n_minus_one_tokens(tiny_model, tokenizer, text, n, window, stride):
    stream = tokenize(text, tokenizer, bos="none", max_tokens=n)
    assert len(stream.ids) == n
    result = perplexity(tiny_model, stream, Windowing(window, stride), batch_size=5)
    assert result.n_tokens == n - 1
    assert len(result.token_nll) == n - 1 and not any(math.isnan(x) for x in result.token_nll)


def test_stride_must_leave_room_for_the_window_bos(tiny_model, tokenizer, text):
    stream = tokenize(text, tokenizer, bos="window", max_tokens=100)
    with pytest.raises(InputError, match="below 31 .the window of 32 less the BOS"):
        perplexity(tiny_model, stream, Windowing(window=32, stride=31))


def test_window_longer_than_model_positions_is_refused(tiny_model, tokenizer, text):
    stream = tokenize(text, tokenizer, max_tokens=600)
    with pytest.raises(InputError, match="longer than the model's 256 positions"):
        perplexity(tiny_model, stream, Windowing(window=512, stride=256))


def test_nan_weights_raise_numerical_error(tiny_model_dir, tokenizer, text):
    from tasks.models.loading import load_model

    model = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="non-finite"):
        perplexity(model, tokenize(text, tokenizer, max_tokens=100), Windowing(32, 16))


def test_result_figures_are_consistent(tiny_model, tokenizer, text):
    stream = tokenize(text, tokenizer, max_tokens=400)
    result = perplexity(tiny_model, stream, Windowing(64, 32), batch_size=4)
    nll = torch.tensor(result.token_nll, dtype=torch.float64)
    assert result.mean_nll == pytest.approx(result.nll_sum / result.n_tokens)
    assert result.stderr == pytest.approx(float(nll.std() / math.sqrt(len(nll))), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(result.nll_sum / result.n_bytes / math.log(2))
    assert result.word_ppl == pytest.approx(math.exp(result.nll_sum / result.n_words))
    assert result.window_nll.sum() == pytest.approx(result.nll_sum)
    assert result.tokens_per_second > 0 and result.peak_memory_bytes > 0


def test_models_load_with_sdpa_attention(tiny_model, tokenizer, text, monkeypatch):
    """Fused scaled-dot-product attention (flash / memory-efficient kernels on a GPU), not the eager path:
    scoring a batch runs torch's ``scaled_dot_product_attention`` once in each layer."""
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def spy(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    stream = tokenize(text, tokenizer, max_tokens=200)
    windows = plan_windows(len(stream.ids), 64, 32, stream.first_scored)[:3]
    score_windows(tiny_model, Feed(stream.ids, batch_size=3), windows)  # one forward pass
    layers, heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_attention_heads
    assert len(calls) == layers, f"scaled_dot_product_attention ran {len(calls)} times in a {layers}-layer model"
    assert all(shape[:3] == (3, heads, 64) for shape in calls), calls  # [batch, heads, positions, head dim]


def test_a_run_nobody_waits_for_stops_after_the_batch_in_progress(tiny_model64, tokenizer, text):
    """What a cluster's task does once its audit stopped (tasks.audit.cluster.let_go): the engine asks between
    batches, and stops at the first answer; outside ``asking`` it never stops."""
    from tasks.core.errors import Abandoned
    from tasks.engine.abandon import asking

    stream = tokenize(text, tokenizer, max_tokens=1500)
    windows = plan_windows(len(stream.ids), 64, 24, stream.first_scored)
    asked = []

    def why() -> str | None:
        asked.append(True)
        return "nobody waits" if len(asked) == 3 else None

    with asking(why), pytest.raises(Abandoned, match="nobody waits"):
        score_windows(tiny_model64, Feed(stream.ids, batch_size=4), windows)
    assert len(asked) == 3 < len(windows) / 4
    assert len(score_windows(tiny_model64, Feed(stream.ids, batch_size=4), windows).window_nll) == len(windows)
