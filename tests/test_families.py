"""Every architecture family of #69 scored by the engine as the model's own forward pass scores it (the brute force
of test_perplexity, to 1e-6), with and without a key/value cache setting; what the engine cannot score yet is refused
in one line before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from families import FAMILIES, HYBRIDS, build_family
from helpers import one_line_error
from test_perplexity import brute_force_nll_sum

from tasks.core.errors import InputError
from tasks.data.corpus import tokenize
from tasks.engine.kv_cache import KVCacheFormat
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing

WINDOW, STRIDE, BATCH = 64, 32, 3  # longer than the sliding layers' 32: a sliding layer sees less than a full one
UNCHANGED = KVCacheFormat("float32", residual=8)  # a float32 cache of a float32 model: nothing may move


@pytest.fixture(scope="module")
def stream(tokenizer, text):
    return tokenize(text, tokenizer, bos="none", max_tokens=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_scores_every_family_as_its_own_forward_pass_does(family, stream):
    """Before the fix a cache with a residual gave every layer one mask, the full layers' one: a sliding layer
    attended past its window (a tiny Gemma 2's loss moved by 6e-4, Mistral's by 3e-4)."""
    model = build_family(family)
    result = perplexity(model, stream, Windowing(WINDOW, STRIDE), BATCH)
    reference, count = brute_force_nll_sum(model, stream, WINDOW, STRIDE)
    assert result.n_tokens == count
    assert result.nll_sum == pytest.approx(reference, rel=1e-6)
    cached = ScoreOptions(kv_cache=UNCHANGED)
    if family in HYBRIDS:
        with pytest.raises(InputError, match=r"^kv_cache: its layers of type linear_attention keep no keys"):
            perplexity(model, stream, Windowing(WINDOW, STRIDE), BATCH, cached)
    else:
        assert perplexity(model, stream, Windowing(WINDOW, STRIDE), BATCH, cached).nll_sum == \
            pytest.approx(result.nll_sum, rel=1e-9)


def test_a_model_whose_head_scales_its_logits_is_refused_in_one_line(capsys, tmp_path, tokenizer, text):
    """Granite divides its logits by logits_scaling in its own forward; the engine, which takes the output
    embeddings as the head, would score another model (0.3% off with 2)."""
    folder = tmp_path / "granite"
    build_family("granitemoehybrid", folder, tokenizer, logits_scaling=2.0)
    (tmp_path / "corpus.txt").write_text(text)
    capsys.readouterr()  # the save's progress bar
    err = one_line_error(capsys, "ppl", "--model", str(folder), "--corpus", str(tmp_path / "corpus.txt"))
    assert err == (f"ppl-audit: error: {folder}: its config's logits_scaling 2.0 scales the logits its head gives, "
                   "which this audit's engine does not apply yet (its figures would be another model's); audit a "
                   "model whose logits_scaling is 1")


def test_a_cache_setting_on_a_hybrid_is_refused_in_one_line(capsys, tmp_path, tokenizer, text):
    folder = tmp_path / "qwen3_next"
    build_family("qwen3_next", folder, tokenizer)
    (tmp_path / "corpus.txt").write_text(text)
    capsys.readouterr()  # the save's progress bar
    err = one_line_error(capsys, "ppl", "--model", str(folder), "--corpus", str(tmp_path / "corpus.txt"),
                         "--variant", "{name: kv, path: " + str(folder) + ", kv_cache: {dtype: int8, group_size: 16}}")
    assert err == ("ppl-audit: error: kv: kv_cache: its layers of type linear_attention keep no keys and values of "
                   "their own (a recurrent state or chunked attention) that this cache could store; kv_cache is "
                   "measured on models whose layers all attend (full or sliding window): leave it out for this model")


@pytest.mark.slow  # gptqmodel quantizes in a process of its own
def test_a_quantizer_that_fails_on_a_family_fails_that_model_alone_in_one_line(tmp_path, tokenizer, text):
    """gptqmodel's AWQ does not know Gemma 3's rotary embedding; its worker thread ended the whole process with a
    traceback (os._exit), which in an audit took every other variant and the record with it. Run as users run it:
    a regression ends this command, not the tests."""
    folder = tmp_path / "gemma3"
    build_family("gemma3_text", folder, tokenizer)
    (tmp_path / "corpus.txt").write_text(text)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "ppl", "--model", str(folder), "--corpus",
                           str(tmp_path / "corpus.txt"), "--window", "64", "--max-tokens", "600", "--variant",
                           "{name: awq, method: awq, group_size: 32, calibration: {samples: 4, seq_len: 64}}"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PPL_AUDIT_HOME": str(tmp_path)})
    said = [line for line in done.stderr.splitlines() if line.startswith("ppl-audit")]
    assert done.returncode == 1 and said[0] == ("ppl-audit: failed: awq: TypeError: Gemma3RotaryEmbedding.forward() "
                                                "missing 1 required positional argument: 'layer_type'"), done.stderr[-3000:]
