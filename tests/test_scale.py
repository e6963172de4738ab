"""Long-corpus pieces: the token stream cached on disk, batch size auto, logits kept in bounded chunks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import tasks.data.corpus
import tasks.engine.batching
from tasks.data.corpus import cached_tokenize, tokenize
from tasks.engine.batching import auto_batch_size
from tasks.engine.perplexity import HEAD_CHUNK_BYTES, perplexity, score_windows, token_stats
from tasks.engine.scoring_options import Windowing
from tasks.engine.windows import plan


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    return tmp_path


def test_token_stream_is_cached_on_disk(cache, tokenizer, text, monkeypatch):
    first = cached_tokenize(text, tokenizer, max_tokens=900)
    assert len(list((cache / "tokens").glob("*.npz"))) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    real = tasks.data.corpus.tokenize
    monkeypatch.setattr(tasks.data.corpus, "tokenize", no_tokenizing)
    again = cached_tokenize(text, tokenizer, max_tokens=900)
    assert torch.equal(again.ids, first.ids)
    assert (again.n_bytes, again.n_words, again.prefix, again.bos_id) == (first.n_bytes, first.n_words, first.prefix, first.bos_id)
    monkeypatch.setattr(tasks.data.corpus, "tokenize", real)
    other = cached_tokenize(text, tokenizer, bos="none", max_tokens=900)  # other settings, other entry
    assert len(list((cache / "tokens").glob("*.npz"))) == 2 and len(other.ids) == 900


def test_batch_size_auto_is_searched_once_and_changes_nothing(cache, tiny_model64, tokenizer, text, monkeypatch):
    stream = tokenize(text, tokenizer, max_tokens=1200)
    measured = []

    def spy(model, feed, windows, *args):
        measured.append(feed.batch_size)
        return score_windows(model, feed, windows, *args)

    monkeypatch.setattr(tasks.engine.batching, "score_windows", spy)
    chosen = auto_batch_size(tiny_model64, stream, 64, 32)
    # one measurement per power of two up to the choice, and at most the one past it that did not pay
    limit = min(64, len(plan(stream, 64, 32)))
    doublings = [2**k for k in range(chosen.bit_length())]
    assert doublings[-1] == chosen, f"batch size {chosen} is not a power of two"
    assert measured == doublings + ([2 * chosen] if 2 * chosen <= limit else []), (chosen, measured)
    assert list(json.loads((cache / "batch_sizes.json").read_text())["sizes"].values()) == [chosen]
    monkeypatch.setattr(tasks.engine.batching, "score_windows", lambda *a, **k: pytest.fail("searched again"))
    assert auto_batch_size(tiny_model64, stream, 64, 32) == chosen
    assert perplexity(tiny_model64, stream, Windowing(64, 32), chosen).nll_sum == \
        pytest.approx(perplexity(tiny_model64, stream, Windowing(64, 32), 1).nll_sum, rel=1e-12)


def fake_device(monkeypatch, device: str, tokens_per_second: dict[int, float] | None = None,
                windows_that_fit: int | None = None) -> tuple[SimpleNamespace, list[int]]:
    """A model on ``device`` whose batch of ``b`` windows scores at ``tokens_per_second[b]`` on a clock of
    our own, and runs out of memory past ``windows_that_fit`` windows. Returns it and the sizes tried."""
    clock = SimpleNamespace(now=0.0)
    tried = []

    def score(model, feed, windows, *args):
        batch_size = feed.batch_size
        assert len(windows) == batch_size
        tried.append(batch_size)
        if windows_that_fit is not None and batch_size > windows_that_fit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        clock.now += sum(w.n_scored for w in windows) / (tokens_per_second or {}).get(batch_size, 1000.0)

    monkeypatch.setattr(tasks.engine.batching, "score_windows", score)
    monkeypatch.setattr(tasks.engine.batching, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    on_device = SimpleNamespace(weight=SimpleNamespace(device=torch.device(device)))  # where its input ids go
    model = SimpleNamespace(name_or_path=f"fake-{device}", dtype=torch.float32, device=torch.device(device),
                            get_input_embeddings=lambda: on_device)
    return model, tried


@pytest.mark.parametrize("tokens_per_second,expected", [
    ({1: 100, 2: 180, 4: 300, 8: 450, 16: 460, 32: 2000, 64: 4000}, 8),  # 16 gains 2%: later gains never looked at
    ({1: 100, 2: 104, 4: 300, 8: 600, 16: 1200, 32: 2400, 64: 4800}, 1),  # 4% is not worth a batch twice as big
    ({1: 100, 2: 200, 4: 150, 8: 900, 16: 900, 32: 900, 64: 900}, 2),  # slower at 4: stop there
    ({1: 100, 2: 110, 4: 121, 8: 133, 16: 147, 32: 162, 64: 178}, 64),  # each doubling gains 10%: up to the cap
], ids=["plateau-past-8", "flat-from-1", "slower-at-4", "gains-to-the-cap"])
def test_batch_size_auto_on_cpu_is_where_doubling_stops_paying_5_percent(cache, tokenizer, text, monkeypatch,
                                                                         tokens_per_second, expected):
    """CPU: the smallest power of two whose double runs less than 5% more tokens per second."""
    stream = tokenize(text, tokenizer, max_tokens=2500)
    assert len(plan(stream, 64, 32)) >= 64, "the stream should hold more windows than the cap"
    model, tried = fake_device(monkeypatch, "cpu", tokens_per_second)
    assert auto_batch_size(model, stream, 64, 32) == expected
    assert tried == [2**k for k in range(min(expected.bit_length() + 1, 7))]  # no measurement past the stop
    assert list(json.loads((cache / "batch_sizes.json").read_text())["sizes"].values()) == [expected]


@pytest.mark.parametrize("windows_that_fit", [1, 3, 8, 40, 1000])
@pytest.mark.parametrize("cap,max_tokens", [(64, 2500), (16, 2500), (64, 300)],
                         ids=["cap-64", "cap-16", "fewer-windows-than-the-cap"])
def test_batch_size_auto_on_cuda_is_the_largest_power_of_two_that_fits(cache, tokenizer, text, monkeypatch,
                                                                       windows_that_fit, cap, max_tokens):
    """CUDA: the largest power of two, up to the cap and the number of windows, that runs without running
    out of memory; a doubling that runs faster or slower changes nothing."""
    stream = tokenize(text, tokenizer, max_tokens=max_tokens)
    n_windows = len(plan(stream, 64, 32))
    speeds = {1: 1000, 2: 900, 4: 950, 8: 800, 16: 2000, 32: 700, 64: 600}  # no 5% rule on a GPU
    model, tried = fake_device(monkeypatch, "cuda", speeds, windows_that_fit=windows_that_fit)
    largest = max(2**k for k in range(7) if 2**k <= min(cap, n_windows, windows_that_fit))
    assert auto_batch_size(model, stream, 64, 32, cap=cap) == largest
    # every doubling up to it was run; the one past it (if the cap and the windows allow one) ran out of memory
    past = [2 * largest] if 2 * largest <= min(cap, n_windows) else []
    assert tried == [2**k for k in range(largest.bit_length())] + past


def test_batch_size_auto_differs_between_memory_budgets_and_devices(cache, tokenizer, text, monkeypatch):
    """The search is per model, window and device: a second budget is searched anew, not recalled."""
    stream = tokenize(text, tokenizer, max_tokens=2500)
    small, _ = fake_device(monkeypatch, "cuda", windows_that_fit=5)
    assert auto_batch_size(small, stream, 64, 32) == 4
    large, _ = fake_device(monkeypatch, "cuda:1", windows_that_fit=20)
    assert auto_batch_size(large, stream, 64, 32) == 16
    assert auto_batch_size(small, stream, 64, 32) == 4  # recalled: its own entry
    assert sorted(json.loads((cache / "batch_sizes.json").read_text())["sizes"].values()) == [4, 16]


def test_a_128k_vocabulary_never_gets_a_full_logits_tensor():
    """Batch 8 x window 2048 scores 8 * 1024 tokens; the head only ever sees chunks of 64 MiB of logits."""
    vocab, hidden, tokens = 128_256, 16, 8 * 1024
    head = torch.nn.Linear(hidden, vocab, bias=False)
    rows_seen = []
    head.register_forward_hook(lambda module, args, out: rows_seen.append(out.shape[0]))
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    nll = token_stats(head, states, targets).nll
    assert nll.shape == (tokens,) and bool(torch.isfinite(nll).all())
    assert max(rows_seen) * vocab * 4 <= HEAD_CHUNK_BYTES["cpu"] < tokens * vocab * 4
    assert sum(rows_seen) == tokens


def resident_for_a_moment(size: int, seconds: float = 0) -> None:
    """Make ``size`` bytes resident, then give them back to the system.

    Anonymous pages of their own, every one touched: memory from malloc (a tensor, a bytearray) may
    reuse what earlier tests freed but the allocator kept resident, and add nothing to the RSS.
    """
    import mmap
    import time

    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    time.sleep(seconds)
    block.close()


def test_peak_memory_catches_a_short_spike_and_nested_blocks_keep_theirs():
    from tasks.engine.memory import PeakMemory

    mib = 2**20
    with PeakMemory("cpu") as start:
        pass
    with PeakMemory("cpu") as outer:
        resident_for_a_moment(300 * mib)
        with PeakMemory("cpu") as inner:
            resident_for_a_moment(100 * mib)
    assert outer.peak_bytes - start.peak_bytes >= 290 * mib
    assert 90 * mib <= inner.peak_bytes - start.peak_bytes < 250 * mib


def test_peak_memory_samples_where_the_kernel_keeps_no_high_water_mark(monkeypatch, tmp_path):
    import tasks.engine.memory
    from tasks.engine.memory import PeakMemory

    monkeypatch.setattr(tasks.engine.memory, "_CLEAR_REFS", tmp_path / "absent" / "clear_refs")
    mib = 2**20
    with PeakMemory("cpu") as start:
        pass
    with PeakMemory("cpu") as held:
        resident_for_a_moment(200 * mib, seconds=0.05)  # held for many sampling intervals
    assert held._thread is not None
    assert held.peak_bytes - start.peak_bytes >= 190 * mib
