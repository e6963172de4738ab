"""A model split over devices (``device_map``): on this CPU-only machine, over the CPU and the disk (accelerate
offloads the ``disk`` part and streams it in at each forward pass), which is the same code path as a map over
GPUs. The split is checked against one device on the first windows; a split that scores otherwise is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import build_llama, only, write_config

from flows.audit import audit
from tasks.config import VariantSpec, parse
from tasks.core.errors import InputError

pytestmark = pytest.mark.usefixtures("prefect_harness")
SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.norm": "disk", "lm_head": "cpu"}


EMBEDDINGS_ON_DISK = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu",
                      "model.norm": "cpu", "lm_head": "disk"}


@pytest.mark.parametrize("placement, placed", [
    ({"device_map": SPLIT}, "cpu,disk"),
    ({"device_map": "auto", "max_memory": {"cpu": "1MB"}}, "cpu,disk"),
    ({"device_map": EMBEDDINGS_ON_DISK}, "cpu,disk"),  # the model's first parameter waits on meta
    ({"device_map": "auto", "max_memory": {"cpu": "100KB"}}, "disk"),  # all of it streamed in from disk
], ids=["a map", "auto under max_memory", "embeddings offloaded", "all on disk"])
def test_a_split_model_scores_as_on_one_device_and_says_where_it_ran(tmp_path, trained_model_dir, corpus_path,
                                                                     placement, placed):
    variants = [{"name": "split", "path": str(trained_model_dir), **placement}]
    state = audit(config=str(write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True)
    assert state.is_completed(), state.message
    baseline, split = only(state.result()).results
    assert split.ok, split.reason
    assert split.facts.device == placed
    assert np.array_equal(split.result.token_nll, baseline.result.token_nll)  # the same model, split: the same bits
    parity = split.facts.parity
    assert parity["devices"] == placed.replace(",", ", ") and parity["tokens"] == 63 + 32  # the first two windows
    assert parity["max_abs_nll_difference"] == 0


def test_a_model_whose_weights_are_streamed_in_by_hooks_scores_the_same(trained_model_dir, corpus_path, tokenizer):
    """How the parity check's one-device copy computes on a GPU (``run_on``: accelerate's ``cpu_offload``, every
    weight on ``meta`` until its module runs), here streamed onto the CPU: the engine finds where the inputs go
    from the embeddings' hook, not ``model.device`` (``meta``)."""
    from accelerate import cpu_offload
    from transformers import AutoModelForCausalLM

    from tasks.config import EvaluationConfig
    from tasks.data.evaluation import evaluation
    from tasks.engine.perplexity import score_part
    from tasks.engine.scoring_options import Windowing

    scored = evaluation(corpus_path.read_text(), tokenizer, EvaluationConfig(window=64, stride=32, max_tokens=600))

    def token_nll(model):
        return score_part(model, scored.stream, Windowing(64, 32), batch_size=4).scores.token_nll

    streamed = cpu_offload(AutoModelForCausalLM.from_pretrained(trained_model_dir), torch.device("cpu"))
    assert streamed.device == torch.device("meta")
    assert torch.equal(token_nll(streamed), token_nll(AutoModelForCausalLM.from_pretrained(trained_model_dir)))


def test_a_split_that_scores_unlike_one_device_is_refused(trained_model_dir, corpus_path, tokenizer):
    """A split whose second device computes something else (its layer's output nudged by 1e-2, as a device with
    a broken kernel would): the check loads the checkpoint on one device, compares, and refuses in one line."""
    from tasks.audit.checkpoints import prepare
    from tasks.audit.scoring import check_parity
    from tasks.config import BaselineSpec, EvaluationConfig
    from tasks.data.evaluation import evaluation
    from tasks.models.variants import load_variant

    spec = VariantSpec(name="split", path=str(trained_model_dir), method="baseline", device_map=SPLIT)
    lineup = prepare(BaselineSpec(name="baseline", path=str(trained_model_dir)), [])
    scored = evaluation(corpus_path.read_text(), lineup.tokenizer,
                        EvaluationConfig(window=64, stride=32, batch_size=4, max_tokens=600))
    model, facts = load_variant(spec, str(trained_model_dir))
    assert check_parity(spec, str(trained_model_dir), model, facts, scored)["max_abs_nll_difference"] == 0
    model.model.layers[1].register_forward_hook(lambda module, inputs, output: output + 1e-2)  # layers.1 is on disk
    with pytest.raises(InputError) as refused:
        check_parity(spec, str(trained_model_dir), model, facts, scored)
    assert str(refused.value).startswith("split: split over cpu, disk it scores the first 95 tokens unlike one device "
                                         "(largest |ΔNLL| ")
    assert str(refused.value).endswith("float32 noise is 0.001, 1e-06): the split computes something else; check the "
                                       "device_map")


def test_a_map_that_puts_tied_embeddings_and_head_apart_is_one_line(tmp_path, tokenizer):
    """One tensor cannot sit on two devices; accelerate would fail at load or at the first forward pass."""
    from tasks.models.variants import load_variant

    build_llama(tmp_path, tokenizer, tie_word_embeddings=True)
    apart = {**SPLIT, "lm_head": "disk"}
    spec = VariantSpec(name="v", path=str(tmp_path), method="baseline", device_map=apart)
    with pytest.raises(InputError, match="^variant 'v': device_map puts model.embed_tokens on cpu and lm_head on "
                                         r"disk, but this model ties them \(one tensor\): give both the same device$"):
        load_variant(spec, str(tmp_path))
    together = spec.model_copy(update={"device_map": {**apart, "model.embed_tokens": "disk"}})
    model, facts = load_variant(together, str(tmp_path))
    assert facts.device == "cpu,disk"


@pytest.mark.parametrize("spec, says", [
    ({"max_memory": {"cpu": "1GB"}}, "max_memory bounds what device_map places on each device: give device_map too"),
    ({"device_map": "auto", "device": "cpu"}, "give device (one device) or device_map (a model split over several)"),
    ({"device_map": "balanced"}, "device_map"),
    ({"device_map": "auto", "method": "hqq"}, "hqq quantizes through its own API, on one device"),
])
def test_placement_settings_that_cannot_work_are_one_line(spec, says):
    with pytest.raises(InputError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse(VariantSpec, {"name": "v", **spec}, "variants[0]")
