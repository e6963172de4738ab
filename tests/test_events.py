"""How an event-triggered audit names its checkpoint, and so which gate judges it (tasks.audit.events)."""

from __future__ import annotations

import json

import pytest

from tasks.audit.events import event_config, name_event_variant
from tasks.config import AuditConfig
from tasks.core.errors import InputError


def checkpoint(folder, **manifest):
    folder.mkdir(parents=True)
    if manifest:
        (folder / "ppl-audit.json").write_text(json.dumps(manifest))
    return str(folder)


@pytest.fixture
def config(tmp_path):
    return AuditConfig.model_validate({
        "name": "nightly", "baseline": {"path": "embedded", "dtype": "float32"}, "corpus": {"source": "embedded"},
        "variants": [{"name": "gptq-4bit", "method": "gptq", "bits": 4, "group_size": 32},
                     {"name": "awq-4bit", "method": "awq", "bits": 4, "group_size": 32},
                     {"name": "shipped", "method": "gptq", "path": str(tmp_path / "shipped"), "dtype": "bfloat16"}],
        "thresholds": {"max_ppl_increase_pct": 10,
                       "per_variant": {"gptq-4bit": {"max_ppl_increase_pct": 20}, "shipped": {"max_kld_mean": 0.1}}},
    })


def test_a_checkpoint_with_a_config_variant_s_settings_takes_its_name_and_its_gate(config, tmp_path):
    """The case found under serve: the audit's own cache folder, named gptq-4bit-<digest>."""
    path = checkpoint(tmp_path / "gptq-4bit-14968c37b68748e0", method="gptq", bits=4, group_size=32, sym=True)
    narrowed, why = event_config(config, path, "gptq")
    assert [v.name for v in narrowed.variants] == ["gptq-4bit"] and narrowed.variants[0].path == path
    assert "bits, group size and symmetry" in why
    assert narrowed.thresholds.for_variant("gptq-4bit").max_ppl_increase_pct == 20
    assert narrowed.variants[0].dtype == "auto"  # the config variant's, not a guess


def test_the_event_s_name_comes_first_then_path_then_settings_then_manifest_then_folder(config, tmp_path):
    settings = {"method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    path = checkpoint(tmp_path / "ckpt", **settings, name="from-manifest")
    assert name_event_variant(config, path, "gptq", "release-1")[0].name == "release-1"
    assert name_event_variant(config, path, "gptq")[0].name == "gptq-4bit"
    shipped = checkpoint(tmp_path / "shipped", **settings)
    spec, why = name_event_variant(config, shipped + "/", "gptq")
    assert (spec.name, spec.dtype, why) == ("shipped", "bfloat16", "the config's variant with this path")
    other = checkpoint(tmp_path / "g128", **{**settings, "group_size": 128}, name="from-manifest")
    assert name_event_variant(config, other, "gptq")[0].name == "from-manifest"
    assert name_event_variant(config, other, "awq")[0].name == "from-manifest"  # the method matters too
    bare = checkpoint(tmp_path / "gptq-4bit-g128")
    spec, why = name_event_variant(config, bare, "gptq")
    assert (spec.name, why) == ("gptq-4bit-g128", "its folder name (no event, config or manifest name)")


def test_two_matching_config_variants_lend_no_name_and_say_so(config, tmp_path):
    twin = {"name": "gptq-4bit-again", "method": "gptq", "bits": 4, "group_size": 32}
    doubled = AuditConfig.model_validate({**config.model_dump(), "variants": [*config.model_dump()["variants"], twin]})
    path = checkpoint(tmp_path / "ckpt", method="gptq", bits=4, group_size=32, sym=True)
    spec, why = name_event_variant(doubled, path, "gptq")
    assert spec.name == "ckpt" and "2 config variants have its settings" in why


def test_a_bad_event_name_is_one_line(config, tmp_path):
    path = checkpoint(tmp_path / "ckpt")
    with pytest.raises(InputError, match="quantization.completed event: name: 'no spaces please' is not a name: use letters"):
        event_config(config, path, "gptq", name="no spaces please")
    with pytest.raises(InputError, match="variant names must be unique: baseline repeats"):
        event_config(config, path, "gptq", name="baseline")


def test_an_event_without_a_method_reads_it_from_the_checkpoint(config, tiny_model_dir):
    """`notify --model DIR` for a float model, with no --method and no manifest, was audited as gptq and failed
    ("loaded with no quantized layer"): its method is read from the checkpoint, as a config's ``path``'s is."""
    from tasks.audit.checkpoints import prepare
    from tasks.config import BaselineSpec

    spec, _ = name_event_variant(config, str(tiny_model_dir))
    [variant] = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)), [spec]).variants
    assert (variant.problem, variant.spec.method) == ("", "baseline")
    assert variant.detected == "no quantization_config: a float model"
