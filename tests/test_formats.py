"""The checkpoints users ship: GGUF files, compressed-tensors, HQQ, and ``method: auto`` reading them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_compressed, make_text, one_line_error, rewrite_gguf, write_config

from tasks.audit import reference
from tasks.audit.checkpoints import prepare
from tasks.audit.scoring import baseline_outcome, variant_outcome
from tasks.config import BaselineSpec, EvaluationConfig, VariantSpec
from tasks.core.files import file_digest
from tasks.data.embedded import embedded_gguf, ensure_embedded_model
from tasks.data.evaluation import evaluation
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import Windowing
from tasks.models.formats import detect
from tasks.models.resolve import load_tokenizer, locate_model
from tasks.record.verdict import comparison_row

SETTINGS = EvaluationConfig(max_tokens=384, window=128, stride=64, batch_size=4)


@pytest.fixture(scope="module")
def embedded_audit():
    """The embedded baseline, scored on a short stream: what the GGUF variants are compared with."""
    tokens = evaluation(make_text(1500), load_tokenizer("embedded"), SETTINGS)
    lineup = prepare(BaselineSpec(name="baseline", path="embedded"), [])
    outcome = baseline_outcome(lineup.baseline, tokens)
    assert outcome.ok, outcome.reason
    return {"evaluation": tokens, "baseline": outcome}


def score_gguf(embedded_audit, spec: VariantSpec):
    lineup = prepare(BaselineSpec(name="baseline", path="embedded"), [spec])
    return variant_outcome(lineup.variants[0], lineup, embedded_audit["evaluation"],
                         against=embedded_audit["baseline"])


@pytest.mark.slow  # the embedded model's GGUF file
def test_the_embedded_gguf_file_scores_as_the_model_dequantized_from_it(embedded_audit):
    outcome = score_gguf(embedded_audit, VariantSpec(name="q4_1", method="gguf", path="embedded"))
    assert outcome.ok, outcome.reason
    base = embedded_audit["baseline"].result
    assert np.abs(outcome.result.token_nll - base.token_nll).max() < 1e-6
    facts = outcome.facts
    assert facts.quantization["file_type"] == "Q4_1" and facts.quantization["label"] == "gguf Q4_1"
    assert facts.quantization["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert facts.quantization["bits_per_weight"] == pytest.approx(5.744, abs=1e-3)
    assert facts.size_on_disk_bytes == embedded_gguf().stat().st_size
    assert outcome.result.extra["kl"].max() < 1e-6  # the same distribution at every token


@pytest.mark.slow  # the embedded model's GGUF file, loaded twice
def test_a_gguf_file_loads_as_transformers_loads_it_to_the_bit():
    """Our GGUF loader (the file parsed once, gguf-py's name map made once) against transformers' own: the same
    tensors under the same names, the tied head still tied."""
    from transformers import AutoModelForCausalLM

    from tasks.models.loading import load_model

    path = embedded_gguf()
    ours = load_model(str(path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    mine, want = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys()
    assert all(torch.equal(mine[key], want[key]) for key in want)
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight


@pytest.mark.slow  # the embedded model's GGUF file
def test_a_requantized_gguf_scores_as_its_dequantized_weights(embedded_audit, tmp_path):
    """Q8_0 written by gguf-py from the Q4_1 file's values; the expected model applies the same Q8_0
    round trip to the embedded float model's matrices (blocks run along rows, which llama.cpp's Q/K row
    permutation leaves whole), so it checks transformers' GGUF mapping and dequantization independently."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = rewrite_gguf(embedded_gguf(), tmp_path / "smollm2.Q8_0.gguf", "Q8_0")
    outcome = score_gguf(embedded_audit, VariantSpec(name="q8_0", path=str(path)))
    assert outcome.ok, outcome.reason
    assert outcome.method == "gguf" and outcome.facts.quantization["file_type"] == "Q8_0"
    assert outcome.facts.quantization["detected"] == "a GGUF file"
    expected = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=torch.float32).eval()
    with torch.no_grad():
        for weight in expected.parameters():
            if weight.ndim == 2:
                packed = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
                weight.copy_(torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)))
    stream = embedded_audit["evaluation"].stream
    want = perplexity(expected, stream, Windowing(SETTINGS.window, SETTINGS.stride), SETTINGS.batch_size)
    assert np.abs(outcome.result.token_nll - want.token_nll).max() < 1e-6
    assert outcome.result.ppl != embedded_audit["baseline"].result.ppl  # Q8_0 really moved the weights


@pytest.mark.slow  # the embedded model's GGUF file
def test_a_gguf_baseline_keeps_a_reference_and_gives_its_variants_kl(embedded_audit, tmp_path, monkeypatch):
    """llama.cpp's KLD workflow: GGUF against a GGUF baseline. The file is digested and its head read from its
    tensors (the tied token_embd.weight), so the reference is reused and KL is that against the same weights as
    a folder (the embedded model is this file dequantized)."""
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path / "references"))
    q8_0 = VariantSpec(name="q8_0", path=str(rewrite_gguf(embedded_gguf(), tmp_path / "smollm2.Q8_0.gguf", "Q8_0")))
    lineup = prepare(BaselineSpec(name="baseline", path=str(embedded_gguf())), [q8_0])
    scored = embedded_audit["evaluation"]
    baseline = baseline_outcome(lineup.baseline, scored)
    assert baseline.ok and baseline.reference.baseline == "scored" and baseline.reference.key, baseline.reference
    manifest = reference.Reference.open(Path(baseline.reference.path)).manifest.to_json()
    assert manifest["head"] | {"digest": ""} == {"name": "token_embd.weight", "stored": False, "digest": "",
                                                  "softcap": None}
    assert manifest["identity"]["model"] == file_digest(embedded_gguf())
    again = baseline_outcome(lineup.baseline, scored)
    assert again.reference.baseline == "reused" and again.reference.key == baseline.reference.key
    assert np.array_equal(again.result.token_nll, baseline.result.token_nll)
    variant = variant_outcome(lineup.variants[0], lineup, scored, against=again)
    assert variant.ok and variant.divergence.reference == baseline.reference.key, variant.reason
    against_folder = score_gguf(embedded_audit, q8_0)  # the same weights as a folder: the same KL
    assert np.abs(variant.result.extra["kl"] - against_folder.result.extra["kl"]).max() < 1e-6
    assert 1e-6 < variant.result.extra["kl"].mean()  # Q8_0 moved the weights: there is a divergence to measure
    row = comparison_row(variant, again, 64)
    assert row.divergences is not None and row.divergence_absent is None


def test_a_gguf_of_another_vocabulary_is_refused(embedded_audit, tmp_path):
    path = rewrite_gguf(embedded_gguf(), tmp_path / "other.gguf", tokens={1000: 1001, 1001: 1000})
    outcome = score_gguf(embedded_audit, VariantSpec(name="other", method="gguf", path=str(path)))
    assert not outcome.ok and "different tokenizer" in outcome.reason


def test_a_gguf_whose_tokenizer_cannot_be_built_fails_alone(tmp_path):
    """Renamed tokens that its merges still name: the tokenizers library raises a bare Exception."""
    path = rewrite_gguf(embedded_gguf(), tmp_path / "broken.gguf", tokens={1000: "ppl-audit"})
    lineup = prepare(BaselineSpec(name="baseline", path="embedded"),
                     [VariantSpec(name="broken", path=str(path)), VariantSpec(name="copy", method="baseline")])
    broken, copy = lineup.variants
    assert broken.problem.startswith(f"cannot load the tokenizer of {path}") and "\n" not in broken.problem
    assert copy.problem == ""


# The refusals below run ``ppl-audit run`` in-process (``one_line_error``: exit code 2, one line, no traceback), as
# test_flows' bad configs do: each once started a CLI process (~7 s here, most of it imports) for what the command's
# checks say before anything starts; the process's own way out (exit code, streams, no log) is test_cli's.
def test_a_file_that_is_not_gguf_is_one_line(capsys, tmp_path, trained_model_dir, corpus_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    config = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path, [{"name": "fake", "path": str(fake)}])
    assert "is not a GGUF file" in one_line_error(capsys, "run", str(config))


def test_method_auto_reads_a_float_folder_as_a_float_model(trained_model_dir):
    assert detect(locate_model(str(trained_model_dir)))[0] == "baseline"


def test_a_missing_package_is_refused_in_one_line_naming_it():
    """The package made unimportable in a fresh interpreter, as on a machine without it."""
    script = ("import sys; sys.modules['compressed_tensors'] = None\n"
              "from tasks.models.formats import require\n"
              "from tasks.core.errors import InputError\n"
              "try:\n    require('compressed-tensors', 'cpu')\nexcept InputError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "pip install 'compressed-tensors==0.20.0'" in done.stdout, done.stdout + done.stderr


@pytest.fixture(scope="module")
def small_audit(trained_model_dir):
    """The trained test Llama as the baseline, scored on 1,000 tokens."""
    tokens = evaluation(make_text(3000), load_tokenizer(str(trained_model_dir)),
                        EvaluationConfig(max_tokens=1000, window=64, stride=32, batch_size=8))
    lineup = prepare(BaselineSpec(name="baseline", path=str(trained_model_dir)), [])
    outcome = baseline_outcome(lineup.baseline, tokens)
    assert outcome.ok, outcome.reason
    return {"evaluation": tokens, "baseline": outcome, "path": str(trained_model_dir)}


def score_small(small_audit, spec: VariantSpec):
    lineup = prepare(BaselineSpec(name="baseline", path=small_audit["path"]), [spec])
    return variant_outcome(lineup.variants[0], lineup, small_audit["evaluation"], against=small_audit["baseline"])


# scheme -> (label, whether its activations are quantized); W4A16 moves PPL by 0.3%, the 8-bit ones by < 0.2%
COMPRESSED = {"W4A16": ("ct W4A16", False), "W8A8": ("ct W8A8-INT8", True), "FP8_DYNAMIC": ("ct W8A8-FP8", True)}


@pytest.mark.parametrize("scheme", list(COMPRESSED))
def test_compressed_tensors_checkpoints_load_by_themselves_and_score_near_float(small_audit, tmp_path, scheme):
    folder = make_compressed(small_audit["path"], tmp_path / scheme, scheme)
    outcome = score_small(small_audit, VariantSpec(name=scheme.lower(), path=str(folder)))
    assert outcome.ok, outcome.reason
    assert outcome.method == "compressed-tensors"
    base = small_audit["baseline"].result
    assert outcome.result.ppl != base.ppl and abs(outcome.result.ppl / base.ppl - 1) < 0.02
    facts = outcome.facts
    label, activations = COMPRESSED[scheme]
    assert facts.quantization["label"] == label
    assert facts.quantization["detected"] == "quantization_config: compressed-tensors"
    assert (facts.quantized_layers, facts.linear_layers) == (14, 15)  # every linear but lm_head
    assert set(facts.kernels.values()) == {"compressed-tensors Linear"} and "lm_head" not in facts.kernels
    said = facts.quantization["activation_quantization"]
    assert said.startswith("applied: 14 layers quantize their inputs") if activations else said.startswith("none")


def test_a_w8a8_figure_includes_its_activation_quantization(small_audit, tmp_path):
    """The same checkpoint with its layers' input quantization switched off scores differently: the
    W8A8 figure is not a weight-only one."""
    from tasks.models.variants import load_variant

    folder = make_compressed(small_audit["path"], tmp_path / "w8a8", "W8A8")
    outcome = score_small(small_audit, VariantSpec(name="w8a8", path=str(folder)))
    model, _ = load_variant(VariantSpec(name="w8a8", method="compressed-tensors", path=str(folder)), str(folder))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = False
    settings = small_audit["evaluation"].settings
    weight_only = perplexity(model, small_audit["evaluation"].stream, Windowing(settings.window, settings.stride),
                             settings.batch_size)
    assert np.abs(outcome.result.token_nll - weight_only.token_nll).max() > 1e-4


def test_hqq_quantizes_the_float_model_as_it_loads(small_audit):
    outcome = score_small(small_audit, VariantSpec(name="hqq3", method="hqq", bits=3, group_size=32))
    assert outcome.ok, outcome.reason
    base = small_audit["baseline"]
    assert outcome.result.ppl != base.result.ppl and abs(outcome.result.ppl / base.result.ppl - 1) < 0.1
    facts = outcome.facts
    assert facts.quantization["label"] == "hqq 3-bit g32" and facts.quantization["backend"] == "PYTORCH"
    assert set(facts.kernels.values()) == {"HQQLinear"} and len(facts.kernels) == 14
    assert facts.weight_memory_bytes < base.facts.weight_memory_bytes


def test_a_saved_hqq_checkpoint_is_refused_in_one_line(trained_model_dir, tmp_path):
    """transformers 5.23 cannot load one; the line says what to give instead."""
    import json
    import shutil

    from tasks.core.errors import InputError

    folder = shutil.copytree(trained_model_dir, tmp_path / "hqq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "quant_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="give the float model with method hqq"):
        detect(locate_model(str(folder)))


def test_hqq_group_sizes_that_do_not_divide_a_layer_fail_in_one_line(small_audit):
    """HQQ asserts it layer by layer (an AssertionError, after quantizing the layers before); 48 is a multiple of 8
    that divides none of the 128-wide model's layers."""
    outcome = score_small(small_audit, VariantSpec(name="hqq48", method="hqq", bits=4, group_size=48))
    assert not outcome.ok and outcome.reason.startswith("hqq48: hqq group_size 48 does not divide the ") and \
        outcome.reason.endswith("use a group size that divides every layer's (64, say)"), outcome.reason


def test_method_hqq_on_a_saved_hqq_checkpoint_is_refused_before_start(capsys, trained_model_dir, corpus_path, tmp_path):
    """Before, it ended in KeyError: 'quant_config' after Prefect and MLflow had started."""
    import json
    import shutil

    folder = shutil.copytree(trained_model_dir, tmp_path / "hqq")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "hqq"}}))
    path = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path,
                        [{"name": "saved", "method": "hqq", "path": str(folder)}])
    err = one_line_error(capsys, "run", str(path))
    assert "is a saved HQQ checkpoint" in err, err


def test_a_variant_with_a_path_and_no_method_is_read_from_its_checkpoint():
    assert VariantSpec(name="v", path="somewhere").method == "auto"
    assert VariantSpec(name="v").method == "baseline"  # the baseline's own files, as they are
    assert BaselineSpec(name="baseline", path="somewhere").method == "baseline"
    assert VariantSpec(name="v", path="dir", gguf_file="m.gguf").location == "dir/m.gguf"


@pytest.mark.parametrize("spec, says", [
    ({"method": "gguf"}, r"method gguf loads a .gguf file \(path\) or makes one from the baseline \(type: Q4_K_M"),
    ({"method": "compressed-tensors"}, "give its path"),
    ({"path": "dir", "method": "gptq", "gguf_file": "m.gguf"}, "gguf_file names a file in the folder"),
    ({"method": "hqq", "calibration": {"samples": 4}}, "hqq quantizes at load without calibration"),
    ({"method": "hqq", "group_size": 0}, "hqq group_size 0 is not a positive multiple of 8"),
    ({"method": "hqq", "group_size": 12}, "hqq group_size 12 is not a positive multiple of 8 .HQQ's groups.; use 64"),
    ({"method": "gguf", "path": "/models/llama"}, "method gguf loads a .gguf file, and /models/llama is not one"),
])
def test_format_settings_that_cannot_work_are_one_line(spec, says):
    from tasks.config import parse
    from tasks.core.errors import InputError

    with pytest.raises(InputError, match=says):
        parse(VariantSpec, {"name": "v", **spec}, "variant")


def test_an_audit_with_a_variant_whose_package_is_missing_stops_before_loading(tmp_path, trained_model_dir,
                                                                                corpus_path):
    config = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}, {"name": "h4", "method": "hqq"}])
    script = ("import sys; sys.modules['hqq'] = None\n"
              "from flows.cli import main\n"
              f"sys.exit(main(['run', {str(config)!r}], capture=True))\n")  # as the console script runs it
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "ppl-audit: error: h4: method hqq needs the package hqq: pip install 'hqq==0.2.8.post1' "
        "(all formats: pip install 'ppl-audit[formats]')"]


def test_a_transformers_fp8_checkpoint_on_cpu_is_refused_in_one_line():
    """transformers' own FP8 quantizer raises a RuntimeError without a GPU; the audit says what to do instead."""
    from tasks.core.errors import InputError
    from tasks.models.formats import require

    with pytest.raises(InputError, match="need a GPU; on CPU audit a compressed-tensors FP8 checkpoint"):
        require("fp8", "cpu")
    require("fp8", "cuda")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptqmodel_checkpoint_s_facts_are_its_settings_as_given(method):
    """The settings the facts show, in their order, those the config gives; a tune's ``dynamic`` counted, with its
    bits and group size in the label. Only the loaded model's config is read: it stands for the model."""
    from types import SimpleNamespace

    from tasks.models.formats import describe

    def facts(settings: dict) -> dict:
        model = SimpleNamespace(config=SimpleNamespace(quantization_config=settings))
        return describe(VariantSpec(name="q", method=method), "q", model)

    given = {"format": "gemm", "quant_method": method, "desc_act": False, "group_size": 128, "sym": True, "bits": 4}
    assert list(facts(given).items()) == [("bits", 4), ("group_size", 128), ("sym", True), ("desc_act", False),
                                          ("format", "gemm")]
    tuned = facts({"bits": 3, "group_size": 32, "dynamic": {"-:lm_head": {}, "+:.*mlp.*": {"bits": 8}}})
    assert list(tuned.items()) == [("bits", 3), ("group_size", 32), ("module_overrides", 2),
                                   ("label", f"{method} 3-bit g32 tuned")]
    assert facts({"group_size": 64, "dynamic": {}}) == {"group_size": 64} and facts({}) == {}


@pytest.fixture(scope="module")
def compressed(trained_model_dir, tmp_path_factory) -> dict[str, Path]:
    """W4A16 (pack-quantized: 4 bits in 32-bit words) and W8A8 (int-quantized: int8) checkpoints."""
    root = tmp_path_factory.mktemp("compressed")
    return {scheme: make_compressed(trained_model_dir, root / scheme, scheme) for scheme in ("W4A16", "W8A8")}


def edited(folder: Path, target: Path, change) -> Path:
    """A copy of a checkpoint whose config.json's quantization_config is ``change(it)``."""
    import json
    import shutil

    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = change(config["quantization_config"])
    (target / "config.json").write_text(json.dumps(config))
    return target


def _group(settings: dict, **weights) -> dict:
    group = settings["config_groups"]["group_0"]
    return settings | {"config_groups": {"group_0": group | {"weights": group["weights"] | weights}}}


@pytest.mark.parametrize("scheme,change,expected", [
    ("W8A8", lambda s: _group(s, num_bits=3), "its config claims 3-bit weights, but its tensors hold 8-bit ones"),
    ("W4A16", lambda s: _group(s, num_bits=2), "its config claims 2-bit weights, but its tensors hold 4-bit ones"),
    ("W8A8", lambda s: _group(s, type="bogus"), "quantization_config.config_groups.group_0.weights.type: 'bogus' is not"),
    ("W8A8", lambda s: s | {"config_groups": {}}, "quantization_config has no config_groups"),
    ("W8A8", lambda s: s | {"format": "bogus-format"}, "quantization_config.format 'bogus-format' is not a compressed-tensors format"),
], ids=["claims-3-bits-over-8", "claims-2-bits-over-4", "unknown-type", "no-groups", "unknown-format"])
def test_a_compressed_config_its_tensors_or_compressed_tensors_contradict_is_one_line(compressed, tmp_path, scheme,
                                                                                      change, expected):
    """Before, each was scored (the 3-bit claim labelled W3A8) or refused only after Prefect and MLflow started."""
    from tasks.core.errors import InputError
    from tasks.models.formats import check_compressed

    check_compressed(locate_model(str(compressed[scheme])))  # the checkpoint as written passes
    folder = edited(compressed[scheme], tmp_path / "edited", change)
    with pytest.raises(InputError) as refused:
        check_compressed(locate_model(str(folder)))
    assert expected in str(refused.value), refused.value


def test_an_audit_of_a_contradicted_compressed_checkpoint_stops_before_start(capsys, compressed, tmp_path,
                                                                            trained_model_dir, corpus_path):
    folder = edited(compressed["W8A8"], tmp_path / "w3", lambda s: _group(s, num_bits=3))
    path = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path, [{"name": "w3", "path": str(folder)}])
    err = one_line_error(capsys, "run", str(path))
    assert "claims 3-bit weights" in err, err


@pytest.mark.slow  # the embedded model's GGUF file
def test_a_gguf_of_another_model_is_refused_before_start(cli, tmp_path, corpus_path):
    """The tokenizer refusal was right, but came after Prefect and MLflow had started (an ERROR run left behind)."""
    other = rewrite_gguf(embedded_gguf(), tmp_path / "other.gguf", tokens={1000: 1001, 1001: 1000})
    path = write_config(tmp_path / "audit.yaml", ensure_embedded_model(), corpus_path, [{"name": "other", "path": str(other)}])
    code, out, err = cli("run", str(path))
    assert code == 2 and err.strip() == ("ppl-audit: error: variant 'other' has a different tokenizer from the baseline "
                                         "(vocab, merges or special tokens): token perplexities are not comparable; "
                                         "audit it against its own baseline"), err


@pytest.mark.parametrize("baseline,expected", [
    ("/dev/null", "ppl-audit: error: model folder /dev/null has no config.json"),  # not 'evaluation.model folder …'
])
def test_a_baseline_path_error_names_the_path_not_a_setting(capsys, tmp_path, corpus_path, baseline, expected):
    path = write_config(tmp_path / "audit.yaml", Path(baseline), corpus_path, [{"name": "x", "method": "bnb-int8"}])
    err = one_line_error(capsys, "run", str(path))
    assert err.startswith(expected), err


def test_a_variant_whose_positions_are_below_the_window_is_refused_before_start(capsys, tmp_path, trained_model_dir,
                                                                                corpus_path):
    import json
    import shutil

    short = shutil.copytree(trained_model_dir, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 32}))
    path = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path, [{"name": "short", "path": str(short)}])
    err = one_line_error(capsys, "run", str(path))
    assert err == "ppl-audit: error: evaluation.window 64 is longer than short's 32 positions; use 32 or less", err


@pytest.mark.slow  # the embedded model's GGUF file
def test_a_gguf_file_is_parsed_once_for_its_config_tokenizer_and_facts_until_it_changes(tmp_path, monkeypatch):
    """Reading a GGUF file's config or tokenizer parses all of its metadata, every vocabulary string (~4 s for
    SmolLM2 here), and an audit asks for them again and again (lineup, preflight, loading, the reference's head)."""
    import os
    import shutil
    import time

    import gguf

    from tasks.models import gguf_file
    from tasks.models.gguf import gguf_facts
    from tasks.models.resolve import load_config, load_tokenizer

    path = tmp_path / "copy.gguf"
    shutil.copy(embedded_gguf(), path)
    from transformers.integrations.gguf import reader

    parses = []  # the tokenizer's (transformers' metadata reader), ours (the header's: config, facts), gguf-py's
    metadata, header, parse = reader.read_gguf_metadata, gguf_file._Cursor.__init__, gguf.GGUFReader.__init__
    monkeypatch.setattr(reader, "read_gguf_metadata", lambda *args: parses.append(1) or metadata(*args))
    monkeypatch.setattr(gguf_file._Cursor, "__init__", lambda self, *args: parses.append(2) or header(self, *args))
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *args, **kw: parses.append(3) or parse(self, *args, **kw))
    first = [load_config(str(path)), load_tokenizer(str(path)), gguf_facts(path)]
    assert set(parses) == {1, 2}, "the counters count nothing, or gguf-py's reader parsed every string"
    once = len(parses)
    again = [load_config(str(path)), load_tokenizer(str(path)), gguf_facts(path)]
    assert len(parses) == once, "parsed again"
    assert again[0].to_dict() == first[0].to_dict() and again[0] is not first[0]  # copies: one changed changes no other
    assert again[1].get_vocab() == first[1].get_vocab() and again[1] is not first[1]
    assert again[2] == first[2]
    later = time.time_ns() + 10**9
    os.utime(path, ns=(later, later))  # as a file rewritten in place
    load_config(str(path))
    assert len(parses) > once, "a changed file is read again"
