"""A checkpoint whose tensors do not fill its model is refused in one line, never scored with random weights in
their place: a folder by its tensors' names and shapes, a GGUF file by its tensor list, before any model is built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import build_llama, make_text, rewrite_gguf
from safetensors.torch import load_file, save_file

from tasks.audit.checkpoints import prepare
from tasks.audit.scoring import baseline_outcome, variant_outcome
from tasks.config import BaselineSpec, EvaluationConfig, VariantSpec
from tasks.core.errors import InputError
from tasks.data.embedded import embedded_gguf
from tasks.data.evaluation import evaluation
from tasks.models.loading import check_checkpoint, load_model

RENAMED = ("its weights do not fit LlamaForCausalLM (21 missing: lm_head.weight, model.embed_tokens.weight, "
           "model.layers.0.input_layernorm.weight, …; 21 unexpected: foo.lm_head.weight, foo.model.embed_tokens.weight, "
           "foo.model.layers.0.input_layernorm.weight, …): it would be scored with random weights in their place; "
           "give the checkpoint as save_pretrained wrote it")
NO_TENSORS = "holds no tensors, only metadata (a vocabulary file?); give the .gguf file with the model's weights"
NO_BLOCK_0 = ("lacks 9 tensor(s) its llama model needs (blk.0.attn_k.weight, blk.0.attn_norm.weight, "
              "blk.0.attn_output.weight, …): it would be scored with random weights in their place")


def rewritten(source: Path, target: Path, change) -> Path:
    """A copy of a checkpoint folder whose tensors are ``change(tensors)``."""
    shutil.copytree(source, target)
    save_file(change(load_file(target / "model.safetensors")), target / "model.safetensors", metadata={"format": "pt"})
    return target


def renamed(source: Path, target: Path) -> Path:
    """Every tensor under another name: ``foo.model.layers.0…``."""
    return rewritten(source, target, lambda tensors: {f"foo.{name}": t for name, t in tensors.items()})


@pytest.mark.parametrize("kind,expected", [("folder", RENAMED),
                                           pytest.param("gguf", NO_TENSORS, marks=pytest.mark.slow)])  # 94 MiB rewritten
def test_ppl_refuses_a_checkpoint_whose_tensors_do_not_fill_its_model(cli, tmp_path, tiny_model_dir, corpus_path,
                                                                       kind, expected):
    if kind == "folder":
        model = renamed(tiny_model_dir, tmp_path / "renamed")
    else:
        model = rewrite_gguf(embedded_gguf(), tmp_path / "vocabulary.gguf", leave_out=("",))
    code, out, err = cli("ppl", "--model", str(model), "--corpus", str(corpus_path), "--window", "64")
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and f"{model}" in err and expected in err, err


def test_a_checkpoint_whose_weights_do_not_load_fails_alone(tmp_path, tokenizer, tiny_model_dir):
    """As a variant it fails and the others score; as the baseline it fails: either with the line, at load."""
    broken = str(renamed(tiny_model_dir, tmp_path / "renamed"))
    scored = evaluation(make_text(600), tokenizer, EvaluationConfig(max_tokens=300, window=64, stride=32, batch_size=8))
    lineup = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)),
                     [VariantSpec(name="renamed", path=broken), VariantSpec(name="copy", method="baseline")])
    outcomes = [variant_outcome(variant, lineup, scored) for variant in lineup.variants]
    assert [o.status for o in outcomes] == ["failed", "ok"]
    assert outcomes[0].reason == f"model {broken}: {RENAMED}, with the config.json of the model its tensors are for"
    lineup = prepare(BaselineSpec(name="baseline", path=broken), [])
    outcome = baseline_outcome(lineup.baseline, scored)
    assert not outcome.ok and RENAMED in outcome.reason


@pytest.mark.parametrize("leave_out,expected", [("", NO_TENSORS), ("blk.0.", NO_BLOCK_0)],
                         ids=["metadata-only", "without-block-0"])
def test_a_gguf_without_the_tensors_its_model_needs_is_refused_before_any_model_is_built(tmp_path, monkeypatch,
                                                                                        leave_out, expected):
    path = rewrite_gguf(embedded_gguf(), tmp_path / "partial.gguf", leave_out=(leave_out,))
    with pytest.raises(InputError) as refused:
        check_checkpoint(str(path))
    assert str(refused.value).startswith(f"{path} {expected}")
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *args, **kwargs: pytest.fail("a model was built for the file"))
    with pytest.raises(InputError) as refused_at_load:
        load_model(str(path), torch.float32, torch.device("cpu"))
    assert str(refused_at_load.value) == str(refused.value)


@pytest.mark.parametrize("change,expected", [
    (None, None),
    (lambda tensors: {name: t for name, t in tensors.items() if name != "lm_head.weight"}, "1 missing: lm_head.weight"),
    (lambda tensors: tensors | {"model.norm.weight": torch.ones(32)}, "1 of another shape: model.norm.weight"),
], ids=["tied-head", "headless", "another-shape"])
def test_a_folder_is_checked_by_the_names_and_shapes_transformers_loads(tmp_path, tokenizer, change, expected):
    """A head tied to the embeddings is not missing; a head left out is, and so is a tensor of another shape."""
    folder = tmp_path / "model"
    build_llama(folder, tokenizer, tie_word_embeddings=change is None)
    if change is None:
        check_checkpoint(str(folder))
        return
    rewritten(folder, tmp_path / "changed", change)
    with pytest.raises(InputError, match="its weights do not fit LlamaForCausalLM") as refused:
        check_checkpoint(str(tmp_path / "changed"))
    assert f"({expected}): it would be scored" in str(refused.value)
