"""A model split over devices (``device_map``): on this CPU-only machine, over the CPU and the disk (accelerate
offloads the ``disk`` part and streams it in at each forward pass), which is the same code path as a map over
GPUs. The split is checked against one device on the first windows; a split that scores otherwise is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flows.audit import audit
from helpers import perturbed, write_config
from tasks.config import VariantSpec, parse
from tasks.errors import InputError

pytestmark = pytest.mark.usefixtures("prefect_harness")
SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.norm": "disk", "lm_head": "cpu"}


@pytest.mark.parametrize("placement", [{"device_map": SPLIT}, {"device_map": "auto", "max_memory": {"cpu": "1MB"}}],
                         ids=["a map", "auto under max_memory"])
def test_a_split_model_scores_as_on_one_device_and_says_where_it_ran(tmp_path, trained_model_dir, corpus_path,
                                                                     placement):
    variants = [{"name": "split", "path": str(trained_model_dir), **placement}]
    state = audit(config=str(write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True)
    assert state.is_completed(), state.message
    baseline, split = state.result()["results"]
    assert split.ok, split.reason
    assert split.facts.device == "cpu,disk"
    assert np.array_equal(split.result.token_nll, baseline.result.token_nll)  # the same model, split: the same bits
    parity = split.facts.parity
    assert parity["devices"] == "cpu, disk" and parity["tokens"] == 63 + 32  # the first two windows
    assert parity["max_abs_nll_difference"] == 0


def test_a_split_that_scores_unlike_one_device_is_refused(tmp_path, trained_model_dir, corpus_path, tokenizer):
    """The one-device copy here is another model's (the checkpoint noised): what a split that computes something
    else looks like to the check. The variant fails with one line; the audit goes on."""
    from tasks.checkpoints import prepare
    from tasks.config import BaselineSpec, EvaluationConfig
    from tasks.evaluation import evaluation
    from tasks.scoring import check_parity
    from tasks.variants import load_variant

    other = tmp_path / "other"
    perturbed(trained_model_dir, torch.float32).save_pretrained(other)
    tokenizer.save_pretrained(other)
    spec = VariantSpec(name="split", path=str(trained_model_dir), method="baseline", device_map=SPLIT)
    lineup = prepare(BaselineSpec(name="baseline", path=str(trained_model_dir)), [])
    scored = evaluation(corpus_path.read_text(), lineup.tokenizer,
                        EvaluationConfig(window=64, stride=32, batch_size=4, max_tokens=600))
    model, facts = load_variant(spec, str(trained_model_dir))
    assert check_parity(spec, str(trained_model_dir), model, facts, scored)["max_abs_nll_difference"] == 0
    with pytest.raises(InputError) as refused:
        check_parity(spec, str(other), model, facts, scored)
    assert str(refused.value).startswith("split: split over cpu, disk it scores the first 95 tokens unlike one device "
                                         "(largest |ΔNLL| ")
    assert str(refused.value).endswith("float32 noise is 0.001, 1e-06): the split computes something else; check the "
                                       "device_map")


@pytest.mark.parametrize("spec, says", [
    ({"max_memory": {"cpu": "1GB"}}, "max_memory bounds what device_map places on each device: give device_map too"),
    ({"device_map": "auto", "device": "cpu"}, "give device (one device) or device_map (a model split over several)"),
    ({"device_map": "balanced"}, "device_map"),
    ({"device_map": "auto", "method": "hqq"}, "hqq quantizes through its own API, on one device"),
])
def test_placement_settings_that_cannot_work_are_one_line(spec, says):
    with pytest.raises(InputError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse(VariantSpec, {"name": "v", **spec}, "variants[0]")


def test_a_map_that_leaves_the_whole_model_on_disk_fails_its_variant_in_one_line(trained_model_dir):
    from tasks.variants import load_variant

    spec = VariantSpec(name="v", path=str(trained_model_dir), method="baseline", device_map="auto",
                       max_memory={"cpu": "100KB"})
    with pytest.raises(InputError, match="^variant 'v': device_map put the whole model on disk; give max_memory room"):
        load_variant(spec, str(trained_model_dir))
