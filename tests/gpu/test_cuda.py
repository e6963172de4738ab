"""The CUDA-only paths of the engine, on a real GPU: skipped where none is visible (CI never has one).

Run them on a GPU machine with ``python -m pytest tests/gpu``. Each model here is built from a config
with seeded random weights, on the GPU, in bf16 (what ``dtype: auto`` gives there).
"""

from __future__ import annotations

import math

import pytest
import torch

from tasks.data.corpus import tokenize
from tasks.engine.memory import PeakMemory
from tasks.engine.perplexity import _chunk_rows, head_chunk_bytes, perplexity, score_windows
from tasks.engine.scoring_options import Feed, ScoreOptions, Windowing
from tasks.engine.stream import TokenStream
from tasks.engine.windows import plan_windows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda", 0)  # an index: the memory-fraction call needs one


def cuda_llama(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **shape):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    with torch.device(CUDA):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def bf16_model(tokenizer):
    return cuda_llama(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      initializer_range=0.1, tie_word_embeddings=False)


def llama_128k():
    """Llama-3's vocabulary (128,256) on a small body, as ``benchmarks/vocab_memory.py`` builds it."""
    return cuda_llama(vocab_size=128_256, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=False)


def random_stream(vocab: int, n: int) -> TokenStream:
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    return TokenStream(ids, (), "none", 0, 0, "random")


def test_bf16_result_does_not_depend_on_batch_size(bf16_model, tokenizer, text):
    """Batch 1, 4 and 16 (with a shorter, padded last window) give the same corpus NLL in bf16.

    Different batch shapes pick different matmul and attention kernels, so single tokens move by bf16
    rounding; the corpus figure, a float64 sum over thousands of tokens, must not move beyond that.
    """
    stream = tokenize(text, tokenizer, bos="stream", max_tokens=5000)
    results = {b: perplexity(bf16_model, stream, Windowing(window=256, stride=96), batch_size=b) for b in (1, 4, 16)}
    assert len({r.n_tokens for r in results.values()}) == 1
    assert results[1].device.startswith("cuda") and results[1].dtype == "bfloat16"
    for b in (4, 16):
        assert results[b].mean_nll == pytest.approx(results[1].mean_nll, rel=2e-3, abs=0), b
        token_gap = abs(torch.from_numpy(results[b].token_nll) - torch.from_numpy(results[1].token_nll))
        assert float(token_gap.mean()) < 0.02, b
    # and a float64 run of the same weights: bf16 is near it, and its error is the same at every batch size
    exact = perplexity(bf16_model.to(torch.float64), stream, Windowing(window=256, stride=96), batch_size=4)
    bf16_model.to(torch.bfloat16)
    assert results[1].mean_nll == pytest.approx(exact.mean_nll, rel=1e-2)


def test_head_chunks_bound_memory_at_a_128k_vocabulary():
    """Scoring 8 windows of 2048 needs the body's activations and one chunk of logits, never the full logits."""
    model = llama_128k()
    window, stride, batch = 2048, 1024, 8
    stream = random_stream(128_256, window + (batch - 1) * stride)
    inputs = torch.stack([stream.ids[k * stride : k * stride + window] for k in range(batch)]).to(CUDA)
    with PeakMemory(CUDA) as idle:
        pass
    with PeakMemory(CUDA) as body, torch.inference_mode():
        model.base_model(input_ids=inputs, use_cache=False)
    with PeakMemory(CUDA) as engine:
        perplexity(model, stream, Windowing(window, stride), batch_size=batch)
    body_growth, engine_growth = body.peak_bytes - idle.peak_bytes, engine.peak_bytes - idle.peak_bytes
    full_logits = batch * window * 128_256 * 4
    chunk = _chunk_rows(model.get_output_embeddings(), head_chunk_bytes(CUDA)) * 128_256 * 4  # float32-sized
    print(f"body {body_growth / 2**20:.0f} MiB, engine {engine_growth / 2**20:.0f} MiB, "
          f"full logits {full_logits / 2**20:.0f} MiB")
    assert engine_growth <= body_growth + chunk
    assert engine_growth < full_logits / 4


def test_out_of_memory_halves_the_batch_size(tmp_path, monkeypatch):
    """A batch that does not fit is halved until it does, with the same result as a batch that fits."""
    from tasks.audit.scoring import perplexity_with_backoff
    from tasks.config import EvaluationConfig
    from tasks.data.evaluation import Evaluation
    from tasks.engine.batching import auto_batch_size

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    # a wide MLP, so that a batch's activations, not the head's fixed chunk, decide what it needs: with the 128k
    # test model's (1408 wide) a batch of 2 needed nearly what one of 8 did, and a cap between them left a batch of 2
    # a few MiB short of the allocator's rounding (H200, 2026-11-27)
    model = cuda_llama(vocab_size=128_256, hidden_size=1024, intermediate_size=8192, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                       tie_word_embeddings=False)
    window, stride = 2048, 1024
    stream = random_stream(128_256, window + 15 * stride)
    reference = perplexity(model, stream, Windowing(window, stride), batch_size=2)
    torch.cuda.empty_cache()
    with PeakMemory(CUDA) as two:
        perplexity(model, stream, Windowing(window, stride), batch_size=2)
    with PeakMemory(CUDA) as sixteen:
        perplexity(model, stream, Windowing(window, stride), batch_size=16)
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(CUDA)
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # room halfway between what a batch of 2 and one of 16 need beside the weights: 16 cannot fit, 2 can
    room = (two.peak_bytes - held + sixteen.peak_bytes - held) / 2
    torch.cuda.set_per_process_memory_fraction((held + room) / total, CUDA)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            perplexity(model, stream, Windowing(window, stride), batch_size=16)
        torch.cuda.empty_cache()
        evaluation = Evaluation(stream, "", (0, len(stream.ids)), EvaluationConfig(window=window, stride=stride, batch_size=16))
        result = perplexity_with_backoff(model, evaluation, "random", progress=False)
        found = auto_batch_size(model, stream, window, stride)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
        torch.cuda.empty_cache()
    print(f"peaks above the weights: batch 2 {(two.peak_bytes - held) / 2**20:.0f} MiB, batch 16 "
          f"{(sixteen.peak_bytes - held) / 2**20:.0f} MiB; halved to {result.batch_size}, auto {found}")
    assert 2 <= result.batch_size < 16
    assert result.nll_sum == pytest.approx(reference.nll_sum, rel=1e-3)
    assert 2 <= found < 16


def test_copies_are_pinned_and_results_complete():
    """Inputs go host to device from pinned memory and results come back through pinned memory,
    asynchronously, and every scored token's result arrives (the one-batch lag loses none)."""
    from torch.profiler import ProfilerActivity, profile

    model = cuda_llama(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    stream = random_stream(1000, 3000)
    windows = plan_windows(len(stream.ids), 256, 128)
    score_windows(model, Feed(stream.ids, batch_size=2), windows[:2])  # warm-up: kernels, handles
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        scores = score_windows(model, Feed(stream.ids, batch_size=3), windows)
    names = [event.name for event in prof.events()]
    copies = [name for name in names if name.startswith("Memcpy")]
    assert any("Pinned -> Device" in name for name in copies), copies
    assert any("Device -> Pinned" in name for name in copies), copies
    assert not any("Pageable" in name for name in copies), sorted(set(copies))
    assert int(scores.window_tokens.sum()) == len(stream.ids) - 1
    assert torch.isfinite(scores.token_nll).all() and bool((scores.token_nll > 0).all())
    assert math.isclose(float(scores.window_nll.sum()), float(scores.token_nll.double().sum()), rel_tol=1e-6)
    plain = score_windows(model, Feed(stream.ids, batch_size=1), windows)
    assert float(plain.window_nll.sum()) == pytest.approx(float(scores.window_nll.sum()), rel=2e-3)


def test_fused_nll_equals_a_float64_computation_of_the_same_logits():
    """The compiled NLL on CUDA reads bf16 logits and must lose nothing beyond float32 rounding."""
    from tasks.engine.perplexity import _nll, token_stats

    vocab, width, rows = 128_256, 512, 1500  # more rows than one chunk: the last chunk has other rows
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False, device=CUDA, dtype=torch.bfloat16)
    hidden = torch.randn(rows, width, device=CUDA, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device=CUDA)
    got = token_stats(head, hidden, targets)["nll"].double()
    exact = _nll(head(hidden).double(), targets[:, None], None)
    assert float((got - exact).abs().max()) < 1e-5
    assert abs(float((got - exact).mean())) < 1e-6


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp8_e4m3", "bfloat16"])
def test_a_quantized_kv_cache_on_cuda_rounds_as_on_the_cpu_and_scores_near_it(bf16_model, tokenizer, text, dtype):
    """The cache's number formats give the same values on the GPU as on the CPU (the round trip is elementwise
    float32 arithmetic and casts), and a bf16 model scored with it on CUDA lands within bf16 noise of its CPU run."""
    from tasks.engine.kv_cache import KVCacheFormat

    form = KVCacheFormat(dtype)
    keys = torch.randn(2, 4, 33, 64, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(form.round_trip(keys.to(CUDA)).cpu(), form.round_trip(keys), rtol=0, atol=0)
    stream = tokenize(text, tokenizer, bos="stream", max_tokens=3000)
    try:
        on_gpu = perplexity(bf16_model, stream, Windowing(window=256, stride=96), batch_size=4,
                            options=ScoreOptions(kv_cache=form))
        on_cpu = perplexity(bf16_model.to("cpu", torch.float32), stream, Windowing(window=256, stride=96),
                            batch_size=4, options=ScoreOptions(kv_cache=form))
    finally:
        bf16_model.to(CUDA, torch.bfloat16)
    assert on_gpu.device.startswith("cuda") and on_gpu.mean_nll == pytest.approx(on_cpu.mean_nll, rel=1e-2)


@pytest.mark.parametrize("body", ["compile", "liger", "liger+compile"])
def test_a_faster_body_scores_as_the_eager_one_within_bf16_noise(tokenizer, text, body):
    """Compiled layers and liger's fused kernels change the order of bf16 roundings, nothing else: the corpus NLL
    stays within bf16 noise of the eager body's on the same weights (a fresh model each: liger patches in place)."""
    from tasks.engine.body import speed_up

    shape = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.1)
    stream = tokenize(text, tokenizer, bos="stream", max_tokens=4000)
    eager = perplexity(cuda_llama(**shape), stream, Windowing(window=256, stride=128), batch_size=8)
    model = cuda_llama(**shape)
    speed_up(model, body)
    fast = perplexity(model, stream, Windowing(window=256, stride=128), batch_size=8)
    assert fast.n_tokens == eager.n_tokens
    assert fast.mean_nll == pytest.approx(eager.mean_nll, rel=2e-3, abs=0)
    # single tokens move by bf16 rounding: 0.032-0.035 nats on average on an H200 (2026-11-26)
    token_gap = abs(torch.from_numpy(fast.token_nll) - torch.from_numpy(eager.token_nll))
    assert float(token_gap.mean()) < 0.06
    torch._dynamo.reset()
