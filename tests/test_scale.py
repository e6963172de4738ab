"""Long-corpus pieces: the token stream cached on disk, batch size auto, logits kept in bounded chunks."""

from __future__ import annotations

import json

import pytest
import torch

import tasks.batching
import tasks.corpus
from tasks.batching import auto_batch_size
from tasks.corpus import cached_tokenize, tokenize
from tasks.perplexity import HEAD_CHUNK_BYTES, perplexity, token_stats


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    return tmp_path


def test_token_stream_is_cached_on_disk(cache, tokenizer, text, monkeypatch):
    first = cached_tokenize(text, tokenizer, max_tokens=900)
    assert len(list((cache / "tokens").glob("*.npz"))) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    real = tasks.corpus.tokenize
    monkeypatch.setattr(tasks.corpus, "tokenize", no_tokenizing)
    again = cached_tokenize(text, tokenizer, max_tokens=900)
    assert torch.equal(again.ids, first.ids)
    assert (again.n_bytes, again.n_words, again.prefix, again.bos_id) == (first.n_bytes, first.n_words, first.prefix, first.bos_id)
    monkeypatch.setattr(tasks.corpus, "tokenize", real)
    other = cached_tokenize(text, tokenizer, bos="none", max_tokens=900)  # other settings, other entry
    assert len(list((cache / "tokens").glob("*.npz"))) == 2 and len(other.ids) == 900


def test_batch_size_auto_is_searched_once_and_changes_nothing(cache, tiny_model64, tokenizer, text, monkeypatch):
    stream = tokenize(text, tokenizer, max_tokens=1200)
    chosen = auto_batch_size(tiny_model64, stream, 64, 32)
    assert chosen in (1, 2, 4, 8, 16, 32, 64)
    assert list(json.loads((cache / "batch_sizes.json").read_text()).values()) == [chosen]
    monkeypatch.setattr(tasks.batching, "score_windows", lambda *a, **k: pytest.fail("searched again"))
    assert auto_batch_size(tiny_model64, stream, 64, 32) == chosen
    assert perplexity(tiny_model64, stream, 64, 32, chosen).nll_sum == \
        pytest.approx(perplexity(tiny_model64, stream, 64, 32, 1).nll_sum, rel=1e-12)


def test_a_128k_vocabulary_never_gets_a_full_logits_tensor():
    """Batch 8 x window 2048 scores 8 * 1024 tokens; the head only ever sees chunks of 64 MiB of logits."""
    vocab, hidden, tokens = 128_256, 16, 8 * 1024
    head = torch.nn.Linear(hidden, vocab, bias=False)
    rows_seen = []
    head.register_forward_hook(lambda module, args, out: rows_seen.append(out.shape[0]))
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    nll = token_stats(head, states, targets)["nll"]
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
    from tasks.memory import PeakMemory

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
    import tasks.memory
    from tasks.memory import PeakMemory

    monkeypatch.setattr(tasks.memory, "_CLEAR_REFS", tmp_path / "absent" / "clear_refs")
    mib = 2**20
    with PeakMemory("cpu") as start:
        pass
    with PeakMemory("cpu") as held:
        resident_for_a_moment(200 * mib, seconds=0.05)  # held for many sampling intervals
    assert held._thread is not None
    assert held.peak_bytes - start.peak_bytes >= 190 * mib
