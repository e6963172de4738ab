"""One model's windows scored in slices and merged: bit for bit the whole run, KL from each slice's part of the
stored reference included, in every mode; the slices' bounds fall on whole batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import perturbed, stored_reference

from tasks.data.corpus import tokenize
from tasks.engine.perplexity import combine, perplexity, score_part, shard_bounds
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.engine.windows import plan
from tasks.models.loading import load_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("n_windows, shards, batch", [(46, 3, 4), (46, 2, 1), (10, 4, 4), (5, 9, 1), (1, 3, 2),
                                                      (100, 7, 3)])
def test_shard_bounds_cover_every_window_once_on_whole_batches(n_windows, shards, batch):
    bounds = shard_bounds(n_windows, shards, batch)
    assert bounds[0][0] == 0 and bounds[-1][1] == n_windows
    assert all(a < b for a, b in bounds) and [b for _, b in bounds[:-1]] == [a for a, _ in bounds[1:]]
    assert all(a % batch == 0 for a, _ in bounds)
    assert len(bounds) == min(shards, -(-n_windows // batch))
    sizes = [b - a for a, b in bounds[:-1]]
    assert max(sizes, default=0) - min(sizes, default=0) <= batch  # as even as whole batches allow


def test_each_piece_names_its_task_and_its_row_of_where_it_ran():
    """What one scoring task scores says its task run's name (``score-<model>`` and this) and the row the record keeps
    of it; a whole model has none."""
    from tasks.audit.cluster import worker
    from tasks.audit.pieces import WHOLE, Sample, Windows

    assert (WHOLE.named(), WHOLE.row()) == ("", None)
    assert Windows(16, 32).named() == "-windows-16-31" and Windows(16, 32).bounds == (16, 32)
    assert Windows(16, 32).row().as_record() == {"windows": [16, 32], "worker": worker()}
    assert Sample((5, 2, 9)).named() == "-sample-of-3-from-window-5"
    assert Sample((5, 2, 9)).row().as_record() == {"sample": [5, 2, 9], "worker": worker()}


@pytest.mark.parametrize("mode, bos, shards", [("sliding", "none", 3), ("sliding", "window", 2), ("sliding", "stream", 5),
                                               ("gptq", "stream", 2), ("llama.cpp", "stream", 3)])
def test_shards_merged_equal_the_whole_run_bit_for_bit(tiny_model_dir, tokenizer, text, mode, bos, shards):
    base = load_model(str(tiny_model_dir), torch.float32, CPU)
    variant = perturbed(tiny_model_dir, torch.float32)
    stream = tokenize(text, tokenizer, bos=bos, max_tokens=1200)
    window, stride, batch = 64, 24, 3
    stored, _ = stored_reference(base, stream, window, stride, tiny_model_dir, f"shards-{mode}-{bos}", batch)
    stored = stored if mode == "sliding" else None  # the helper stores the sliding plan's states
    against = stored and stored.baseline(str(tiny_model_dir), CPU)
    whole = perplexity(variant, stream, Windowing(window, stride, mode=mode), batch, ScoreOptions(reference=against))
    bounds = shard_bounds(len(plan(stream, window, stride, mode)), shards, batch)
    assert len(bounds) == shards
    parts = [score_part(variant, stream, Windowing(window, stride, mode=mode), batch, windows,
                        ScoreOptions(reference=against))
             for windows in reversed(bounds)]  # in any order: combine puts them in window order
    merged = combine(parts, stream, whole.model, window, stride, mode)
    assert (merged.nll_sum, merged.ppl, merged.stderr, merged.n_tokens) == (whole.nll_sum, whole.ppl, whole.stderr,
                                                                           whole.n_tokens)
    assert np.array_equal(merged.token_nll, whole.token_nll) and np.array_equal(merged.window_nll, whole.window_nll)
    assert np.array_equal(merged.window_tokens, whole.window_tokens)
    divergence = ["base_right", "base_top", "base_top_p", "kl", "kl_reverse", "top", "top1"]
    assert sorted(merged.extra) == sorted(whole.extra) == (divergence if against else [])
    for key in merged.extra:
        assert np.array_equal(merged.extra[key], whole.extra[key]), key
    if against:
        assert float(np.mean(whole.extra["kl"])) > 1e-3  # a divergence was measured, not zeros


def test_parts_that_leave_a_gap_or_overlap_are_refused(tiny_model, tokenizer, text):
    stream = tokenize(text, tokenizer, max_tokens=400)
    part = {w: score_part(tiny_model, stream, Windowing(64, 32), 2, w) for w in [(0, 4), (4, 8), (6, 12)]}
    with pytest.raises(ValueError, match="do not cover"):
        combine([part[(0, 4)], part[(6, 12)]], stream, "m", 64, 32)
    with pytest.raises(ValueError, match="do not cover"):
        combine([part[(4, 8)]], stream, "m", 64, 32)
    with pytest.raises(ValueError, match="not a slice"):
        score_part(tiny_model, stream, Windowing(64, 32), 2, (3, 99))
