"""GPTQ/AWQ of a base model whose tokenizer has no pad token (nor an eos token to stand in for one)."""

from __future__ import annotations

import json

import pytest
from helpers import build_llama, make_text

from tasks.audit.checkpoints import prepare
from tasks.audit.scoring import variant_outcome
from tasks.config import BaselineSpec, CalibrationConfig, EvaluationConfig, VariantSpec
from tasks.data.evaluation import evaluation
from tasks.models.resolve import load_tokenizer

pytestmark = pytest.mark.slow  # quick tier: pytest -m "not slow"


@pytest.fixture(scope="module")
def bos_only_dir(tokenizer, tmp_path_factory):
    """A Llama whose tokenizer has a BOS token only: no pad, no eos (AWQ's clip search wants 128 wide).

    ``</s>`` stays in the vocabulary as an ordinary token, so a pad token taken from it would come back
    from disk as an added special token: a tokenizer the audit refuses.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["added_tokens"] = [token for token in state["added_tokens"] if token["content"] == "<s>"]
    bos_only = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)), bos_token="<s>")
    assert (bos_only.pad_token, bos_only.eos_token) == (None, None)
    folder = tmp_path_factory.mktemp("bos-only-llama")
    build_llama(folder, bos_only, hidden_size=128, intermediate_size=256, initializer_range=0.02)
    return folder


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_tokenizer_without_pad_or_eos_quantizes_with_the_same_tokenizer(bos_only_dir, tmp_path, monkeypatch, method):
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    baseline = load_tokenizer(str(bos_only_dir))
    audit = evaluation(make_text(1500), baseline, EvaluationConfig(max_tokens=600, window=64, stride=32, batch_size=8))
    spec = VariantSpec(name=method, method=method, bits=4, group_size=32,
                       calibration=CalibrationConfig(samples=4, seq_len=64))
    lineup = prepare(BaselineSpec(name="baseline", path=str(bos_only_dir)), [spec])
    outcome = variant_outcome(lineup.variants[0], lineup, audit)
    assert outcome.ok, outcome.reason  # loaded and scored after passing check_same_tokenizer
    assert outcome.result.ppl > 1 and outcome.facts.quantized_layers == 14
    saved = load_tokenizer(outcome.facts.source)
    assert saved.pad_token is None and saved("<s> the house").input_ids == baseline("<s> the house").input_ids
