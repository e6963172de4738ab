"""The published conventions against straightforward re-implementations, and KL through the engine."""

from __future__ import annotations

import pytest
import torch
from helpers import scored_log_probs

from tasks.core.errors import InputError
from tasks.data.corpus import tokenize
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.engine.windows import plan


def gptq_reference(model, ids: torch.Tensor, window: int) -> tuple[float, int]:
    """The GPTQ/AWQ papers' evaluation: disjoint chunks, tail dropped, each chunk's first token unscored."""
    total, count = 0.0, 0
    for i in range(len(ids) // window):
        chunk = ids[i * window : (i + 1) * window][None]
        with torch.no_grad():
            logits = model(chunk).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum"))
        count += window - 1
    return total, count


def llama_cpp_reference(model, ids: torch.Tensor, n_ctx: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity: disjoint n_ctx chunks, BOS over each chunk's first token, second half scored."""
    total, count, first = 0.0, 0, n_ctx // 2
    for i in range(len(ids) // n_ctx):
        tokens = ids[i * n_ctx : (i + 1) * n_ctx].clone()
        if bos is not None:
            tokens[0] = bos
        with torch.no_grad():
            log_probs = torch.log_softmax(model(tokens[None]).logits[0].double(), -1)
        for j in range(first, n_ctx - 1):
            total -= float(log_probs[j, ids[i * n_ctx + j + 1]])
            count += 1
    return total, count


@pytest.mark.parametrize("window", [32, 50])
@pytest.mark.parametrize("bos", ["stream", "none"])
def test_gptq_mode_matches_its_reimplementation(tiny_model, tokenizer, text, window, bos):
    stream = tokenize(text, tokenizer, bos=bos, max_tokens=437)
    result = perplexity(tiny_model, stream, Windowing(window, stride=1, mode="gptq"), batch_size=3)
    reference, count = gptq_reference(tiny_model, stream.ids, window)
    assert result.n_tokens == count == (437 // window) * (window - 1)
    assert result.nll_sum == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("window", [32, 51])
@pytest.mark.parametrize("bos", ["stream", "none"])
def test_llama_cpp_mode_matches_its_reimplementation(tiny_model, tokenizer, text, window, bos):
    stream = tokenize(text, tokenizer, bos=bos, max_tokens=437)
    result = perplexity(tiny_model, stream, Windowing(window, stride=1, mode="llama.cpp"), batch_size=4)
    reference, count = llama_cpp_reference(tiny_model, stream.ids, window,
                                           tokenizer.bos_token_id if bos == "stream" else None)
    assert result.n_tokens == count == (437 // window) * (window - 1 - window // 2)
    assert result.nll_sum == pytest.approx(reference, rel=1e-6)


def test_modes_refuse_too_short_streams_and_per_window_bos(tiny_model, tokenizer, text):
    with pytest.raises(InputError, match="needs at least one full window"):
        perplexity(tiny_model, tokenize(text, tokenizer, max_tokens=20), Windowing(32, 16, mode="gptq"))
    with pytest.raises(InputError, match="does its own BOS handling"):
        perplexity(tiny_model, tokenize(text, tokenizer, bos="window", max_tokens=200),
                   Windowing(32, 16, mode="llama.cpp"))


def full_vocabulary_kl(base, variant, stream, windows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each window alone through both models: KL(base‖variant), KL(variant‖base) and same top token over
    the whole vocabulary at every scored position."""
    forward, reverse, top1 = [], [], []
    for _, lb, lv in scored_log_probs(base, variant, stream, windows):
        forward.append(float((lb.exp() * (lb - lv)).sum()))
        reverse.append(float((lv.exp() * (lv - lb)).sum()))
        top1.append(bool(lb.argmax() == lv.argmax()))
    return torch.tensor(forward, dtype=torch.float64), torch.tensor(reverse, dtype=torch.float64), torch.tensor(top1)


def test_engine_kl_from_a_stored_reference_against_a_full_vocabulary_reference(tiny_model_dir, tokenizer, text):
    """KL both ways and top-1 through the engine (the baseline's stored hidden states, its head read from
    its checkpoint, chunked) against both models' full logits, window by window, in float64."""
    from helpers import perturbed, stored_reference

    base = perturbed(tiny_model_dir, scale=0.0)
    variant = perturbed(tiny_model_dir)
    stream = tokenize(text, tokenizer, max_tokens=300)
    windows = plan(stream, 64, 24)
    forward, reverse, top1 = full_vocabulary_kl(base, variant, stream, windows)
    stored, _ = stored_reference(base, stream, 64, 24, tiny_model_dir, "modes", batch_size=5)
    against = stored.baseline(str(tiny_model_dir), torch.device("cpu"))

    itself = perplexity(base, stream, Windowing(64, 24), 3, ScoreOptions(reference=against)).extra
    assert float(itself["kl"].max()) < 1e-9 and float(itself["kl_reverse"].max()) < 1e-9 and itself["top1"].all()

    measured = perplexity(variant, stream, Windowing(64, 24), 2, ScoreOptions(reference=against)).extra
    torch.testing.assert_close(torch.from_numpy(measured["kl"]), forward, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.from_numpy(measured["kl_reverse"]), reverse, rtol=1e-5, atol=1e-7)
    assert (measured["top1"] == top1.numpy()).all()
    assert float(forward.mean()) > 1e-3  # the perturbation is really there


def test_a_long_stream_s_divergence_is_compiled_and_gives_the_float64_figures():
    """From a real model's long stream up the divergence kernel is compiled (a test model's short ones are measured
    eagerly, through every test above): chunk by chunk, it gives what both models' full log-softmax gives in
    float64."""
    from tasks.engine.perplexity import COMPILE_FROM_LOGITS, _divergence, divergence_kernel, token_stats
    from tasks.engine.baseline import BaselineBatch

    vocabulary, width, tokens = 8192, 32, 300
    assert divergence_kernel("cpu", COMPILE_FROM_LOGITS) is not _divergence
    assert divergence_kernel("cpu", COMPILE_FROM_LOGITS - 1) is _divergence
    generator = torch.Generator().manual_seed(0)
    base_head, head = (torch.nn.Linear(width, vocabulary, bias=False) for _ in range(2))
    with torch.no_grad():
        base_head.weight.copy_(torch.randn(vocabulary, width, generator=generator) / 4)
        head.weight.copy_(base_head.weight + torch.randn(vocabulary, width, generator=generator) / 40)
    hidden = torch.randn(tokens, width, generator=generator)
    targets = torch.randint(vocabulary, (tokens,), generator=generator)
    with torch.no_grad():
        measured = token_stats(head, hidden, targets, chunk_bytes=4 * vocabulary * 64,  # five chunks of rows
                               reference=BaselineBatch(base_head, hidden, None),
                               stream_tokens=COMPILE_FROM_LOGITS // vocabulary)  # these tokens of a long stream
        lb = torch.log_softmax(base_head(hidden).double(), -1)
        lv = torch.log_softmax(head(hidden).double(), -1)
    forward, reverse = (lb.exp() * (lb - lv)).sum(-1), (lv.exp() * (lv - lb)).sum(-1)
    # a token's KL sums 8192 float32 terms of log-probabilities near -9: a few 1e-7 each way
    torch.testing.assert_close(measured.kl.double(), forward, rtol=0, atol=5e-6)
    torch.testing.assert_close(measured.kl_reverse.double(), reverse, rtol=0, atol=5e-6)
    for figure, truth in ((measured.kl, forward), (measured.kl_reverse, reverse)):  # the corpus figure, as above
        assert float(figure.double().mean()) == pytest.approx(float(truth.mean()), rel=1e-5, abs=0)
    assert torch.equal(measured.top1, lb.argmax(-1) == lv.argmax(-1))
    assert float(forward.mean()) > 1e-3  # the heads really differ


def test_each_mode_defaults_to_its_own_bos_convention(tokenizer, tmp_path):
    """sliding: BOS when the tokenizer has one; gptq: the plain stream; llama.cpp: the add-BOS flag."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from tasks.data.corpus import default_bos

    assert tokenizer("a").input_ids[0] != tokenizer.bos_token_id  # this one adds no BOS by itself
    assert [default_bos(tokenizer, mode) for mode in ("sliding", "gptq", "llama.cpp")] == ["stream", "none", "none"]
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: the fixture is shared
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    adding = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert adding("a").input_ids[0] == adding.bos_token_id
    assert [default_bos(adding, mode) for mode in ("sliding", "gptq", "llama.cpp")] == ["stream", "none", "stream"]


def test_config_refuses_chunks_where_they_mean_nothing():
    from pydantic import ValidationError

    from tasks.config import EvaluationConfig

    assert EvaluationConfig(mode="llama.cpp", window=128, chunks=3).chunks == 3
    with pytest.raises(ValidationError, match="chunks applies to modes gptq and llama.cpp"):
        EvaluationConfig(chunks=3)
    with pytest.raises(ValidationError, match="give chunks or max_tokens, not both"):
        EvaluationConfig(mode="gptq", chunks=3, max_tokens=1000)
