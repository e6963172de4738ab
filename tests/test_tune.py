"""``ppl-audit tune`` (#55): a mixed-precision recipe within a size budget, from measured gains, made by llama.cpp's
quantizer and audited beside the uniform variants; its exports read by the quantizers that take them."""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import json_line, one_line_error

from tasks.audit.recipe.choose import Choice, knapsack
from tasks.audit.recipe.sizes import Budget
from tasks.core.errors import InputError
from tasks.models import llama_cpp

PLANTED, SCALE, KEPT = 7, 100.0, 10


def test_the_knapsack_finds_the_best_assignment_a_brute_force_finds():
    """Exact where costs are whole quanta: the best sum of gains within the budget, at most one option a unit."""
    rng = random.Random(0)
    for _ in range(200):
        choices = [Choice(u, o, rng.randint(1, 9), rng.uniform(-0.1, 1), (0, 0, 0)) for u in range(5) for o in range(2)]
        budget = rng.randint(1, 25)
        found = knapsack(choices, budget, steps=budget)
        best = 0.0
        for picks in itertools.product(*[[None, 0, 1]] * 5):
            taken = [next(c for c in choices if c.unit == u and c.option == o) for u, o in enumerate(picks) if o is not None]
            if sum(c.cost for c in taken) <= budget:
                best = max(best, sum(max(c.gain, 0) for c in taken))
        assert sum(c.cost for c in found) <= budget and len({c.unit for c in found}) == len(found)
        assert sum(c.gain for c in found) == pytest.approx(best, abs=1e-12)


def test_a_budget_is_read_in_its_three_forms_and_refused_in_one_line_otherwise():
    assert Budget.parse("4.5bpw") == Budget(4.5, "bpw", False)
    assert Budget.parse("+0.25bpw") == Budget(0.25, "bpw", True)
    assert Budget.parse("120MiB") == Budget(120, "MiB", False) and str(Budget(8, "MiB", True)) == "+8MiB"
    for wrong in ("4.5", "+0.25 bits", "0bpw", "-1bpw"):
        with pytest.raises(InputError, match="--budget"):
            Budget.parse(wrong)


FOUND = {"variant": "q4", "file_type": "Q4_0", "group_size": 32, "tensor_types": [],
         "chosen": [{"layer": 1, "modules": ["mlp.down_proj"], "type": "Q8_0"},
                    {"layer": 0, "modules": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "type": "Q6_K"},
                    {"layer": 1, "modules": ["self_attn.o_proj"], "type": "F16"}]}


def test_gptqmodel_reads_the_recipe_s_dynamic_overrides_module_by_module():
    """gptqmodel's own resolver (``dynamic_get``, what its quantizer and loader ask) on every linear layer of a
    2-layer llama: the recipe's modules get 8 bits or are skipped, every other keeps the base's 4."""
    from gptqmodel.quantization.config import dynamic_get

    from tasks.record.tuning import gptqmodel_dynamic

    exported = json.loads(json.dumps(gptqmodel_dynamic(FOUND)))  # as the file holds it
    assert exported["bits"] == 4
    expected = {"model.layers.1.mlp.down_proj": 8, "model.layers.0.self_attn.q_proj": 8,
                "model.layers.0.self_attn.k_proj": 8, "model.layers.0.self_attn.v_proj": 8,
                "model.layers.1.self_attn.o_proj": False}
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                       "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{module}"
            said = dynamic_get(exported["dynamic"], name)
            if expected.get(name) is False:
                assert said is False, name
            else:
                assert dynamic_get(exported["dynamic"], name, "bits", exported["bits"]) == expected.get(name, 4), name


def test_compressed_tensors_applies_the_llm_compressor_recipe_module_by_module():
    """The recipe's config groups applied by compressed-tensors (what llm-compressor's modifiers do) to a 2-layer
    llama: the named modules take their group's bits over the Linear default, the unquantized are ignored."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.record.tuning import llm_compressor_recipe

    recipe = yaml.safe_load(yaml.safe_dump(llm_compressor_recipe(FOUND)))["quant_stage"]["quant_modifiers"]["GPTQModifier"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    apply_quantization_config(model, QuantizationConfig(config_groups=recipe["config_groups"], ignore=recipe["ignore"]))
    bits = {name: module.quantization_scheme.weights.num_bits for name, module in model.named_modules()
            if getattr(module, "quantization_scheme", None) is not None}
    more = {"model.layers.1.mlp.down_proj"} | {f"model.layers.0.self_attn.{m}_proj" for m in "qkv"}
    linear = {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert bits == {name: 8 if name in more else 4 for name in linear - {"model.layers.1.self_attn.o_proj"}}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The embedded model's first KEPT decoder layers, with layer PLANTED made fragile and nothing else changed: in
    its MLP, every 32nd intermediate channel's down-projection column is multiplied by SCALE and its up-projection
    row divided by it (the MLP computes the same: silu(gate)·up is linear in up). Every 32-weight block of that
    layer's down projection then holds one outlier, which a 4-bit block quantizer rounds the rest of the block to
    nothing for. A third of the layers: the tune scores each unit alone, so all 30 took ~3x the minutes (~134 s)."""
    from tasks.data.embedded import ensure_embedded_model

    return fragile(ensure_embedded_model(), tmp_path_factory.mktemp("planted") / "model", PLANTED, KEPT)


def fragile(source: Path, folder: Path, layer: int, layers: int | None = None) -> Path:
    """A copy of the model folder ``source`` in ``folder`` with decoder layer ``layer``'s MLP made fragile
    (``planted``); ``layers``: only the first that many decoder layers kept (None: all)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in source.glob("*.safetensors"):
        tensors = load_file(file)
        if layers is not None:
            tensors = {name: t for name, t in tensors.items() if not _beyond(name, layers)}
        down, up = f"model.layers.{layer}.mlp.down_proj.weight", f"model.layers.{layer}.mlp.up_proj.weight"
        if down in tensors:
            channels = slice(0, tensors[down].shape[1], 32)
            tensors[down][:, channels] *= SCALE
            tensors[up][channels, :] /= SCALE
        save_file(tensors, folder / file.name, metadata={"format": "pt"})
    if layers is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}, indent=2))
    return folder


def _beyond(name: str, layers: int) -> bool:
    """Whether the tensor ``name`` belongs to a decoder layer at or past ``layers``."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return found is not None and int(found[1]) >= layers


@pytest.mark.slow
def test_tune_gives_the_planted_fragile_module_more_precision_and_proves_it_better(cli, tmp_path, planted):
    """At a budget of 1.5 down projections in Q8_0 (each adds 4 bits to 1/KEPT of the layers' weights), module by
    module: the planted layer's down projection is chosen, the recipe as built holds it in Q8_0 and every other tensor
    as the uniform Q4_0, within the budget, and its audit proves it better than the uniform Q4_0 beyond the paired
    interval; the recipe is in MLflow under that audit."""
    assert llama_cpp.version(), "the llama.cpp runtime is not installed: run bash .ci/llama-cpp"
    config = {"name": "planted", "baseline": {"name": "baseline", "path": str(planted)},
              "corpus": {"source": "embedded"},
              "evaluation": {"window": 256, "stride": 128, "batch_size": 4, "max_tokens": 1024},
              "variants": [{"name": "q4", "method": "gguf", "type": "Q4_0"}],
              "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tune"}}
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = cli("tune", str(path), "--variant", "q4", "--budget", f"+{1.5 / KEPT:.2f}bpw", "--per", "module",
                         "--types", "Q8_0", "--set", "diagnosis.windows=4", "--json", timeout=1200)
    found = json_line(out, err)
    assert code == 0, out[-4000:] + err[-4000:]
    # the planted group wins back most alone, and is chosen (the budget may hold a smaller group beside it)
    assert max(found["every"], key=lambda row: row["gain"])["unit"] == f"{PLANTED}.down"
    assert f"{PLANTED}.down" in [row["unit"] for row in found["chosen"]], found["chosen"]
    assert found["final"]["share"][1] > 0  # what it wins back on the sample, beyond its interval
    built = found["built"]
    assert built["within"] and built["checked"] == built["tensors"] and built["bpw"] <= found["budget_bpw"]
    from tasks.models.gguf_file import read_header

    types = {t.name: t.tensor_type.name for t in read_header(Path(built["path"])).tensors}
    assert types[f"blk.{PLANTED}.ffn_down.weight"] == "Q8_0" and types[f"blk.{PLANTED + 1}.ffn_down.weight"] == "Q4_0"
    assert found["proven"]["uniform"] and found["verdicts"][0].startswith("proven better than uniform Q4_0")
    # the chart's figures of the audit, each model's own: the recipe's bpw as built, and its KL below the uniform's
    audited = found["audited"]
    assert audited["q4"]["bpw"] == found["variant_bpw"] and audited["q4-tuned"]["bpw"] == built["bpw"]
    assert 0 < audited["q4-tuned"]["kl"] < audited["q4"]["kl"]
    assert "q4-tuned" in out and "gguf Q4_0 tuned" in out  # the audit's table
    recipe = (Path(found["folder"]) / "llama-quantize-tensor-types.txt").read_text().splitlines()
    assert f"blk\\.{PLANTED}\\.(ffn_down)\\.weight=q8_0" in recipe and len(recipe) == len(found["chosen"])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=config["tracking"]["uri"])
    run = client.get_run(found["mlflow_run_id"])
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["ppl_audit.audit"] == "planted-tune"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "recipe")}
    assert artifacts == {"recipe/llama-quantize-tensor-types.txt", "recipe/gptqmodel-dynamic.json",
                         "recipe/llm-compressor-recipe.yaml"}
    assert np.isclose(run.data.metrics["kl"], found["final"]["kl"])


@pytest.mark.parametrize("args,expected", [
    (["--budget", "4.0bpw"], "--budget 4.0bpw: the variant itself takes 4.500bpw"),
    (["--budget", "9bpw"], "--budget 9bpw: more than the baseline itself takes (5.000bpw)"),
    (["--budget", "1e9MiB"], "--budget 1e9MiB: more than the baseline itself takes ("),
    (["--budget", "+0.1bpw", "--types", ""], "--types: an empty option;"),
    (["--budget", "+0.1"], "--budget '+0.1': give bits per weight"),
    (["--budget", "+0.1bpw", "--types", "Q9_9"], "--types Q9_9: Q9_9 is not a GGUF tensor type"),
    (["--budget", "+0.1bpw", "--variant", "nope"], "has no variant 'nope'; give one of q4, int8"),
    (["--budget", "+0.1bpw", "--variant", "int8"], "variant 'int8' is method torchao-int8: tune sets each module's precision"),
])
def test_bad_input_is_one_line_before_anything_loads(capsys, tmp_path, args, expected):
    config = {"name": "refused", "baseline": {"path": "embedded"}, "corpus": {"source": "embedded"},
              "evaluation": {"max_tokens": 512, "window": 256},
              "variants": [{"name": "q4", "method": "gguf", "type": "Q4_0"}, {"name": "int8", "method": "torchao-int8"}]}
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(config))
    variant = [] if "--variant" in args else ["--variant", "q4"]
    assert expected in one_line_error(capsys, "tune", str(path), *variant, *args)


@pytest.mark.parametrize("args,expected", [
    (["--budget", "4.0bpw"], "--budget 4.0bpw: the variant itself takes 4.358bpw"),
    (["--budget", "17bpw"], "--budget 17bpw: more than the baseline itself takes (16.000bpw)"),
    (["--budget", "+0.1bpw", "--types", "9bit"], "--types 9bit: gptq takes 2, 3, 4 or 8 bits"),
    (["--budget", "+0.1bpw", "--types", "8bit,q8"], "--types q8: a gptq option is 8bit"),
    (["--budget", "+0.1bpw", "--types", "g1024"], "--types 4bit-g1024: group size 1024 does not divide the input"),
    (["--budget", "+0.1bpw", "--variant", "a4"], "AWQ quantizes every module at one bit width and group size: its dynamic only skips modules"),
])
def test_bad_input_for_a_gptq_tune_is_one_line_before_anything_loads(capsys, tmp_path, args, expected):
    config = {"name": "refused", "baseline": {"path": "embedded"}, "corpus": {"source": "embedded"},
              "evaluation": {"max_tokens": 512, "window": 256},
              "variants": [{"name": "g4", "method": "gptq", "bits": 4, "group_size": 64},
                           {"name": "a4", "method": "awq", "bits": 4, "group_size": 64}]}
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(config))
    variant = [] if "--variant" in args else ["--variant", "g4"]
    assert expected in one_line_error(capsys, "tune", str(path), *variant, *args)


def test_tensor_types_are_refused_without_a_type_and_in_a_form_llama_quantize_does_not_read():
    from pydantic import ValidationError

    from tasks.config import VariantSpec

    assert VariantSpec(name="r", method="gguf", type="Q4_0", tensor_types=["blk\\.7\\.(ffn_down)\\.weight=q8_0"])
    with pytest.raises(ValidationError, match="tensor_types sets some tensors' types in a GGUF file"):
        VariantSpec(name="r", method="gguf", path="x.gguf", tensor_types=["blk\\.7=q8_0"])
    with pytest.raises(ValidationError, match="tensor_types"):
        VariantSpec(name="r", method="gguf", type="Q4_0", tensor_types=["blk.7 q8_0"])


def test_gains_measured_at_one_budget_are_kept_for_another_and_checked_when_read(capsys, monkeypatch, tmp_path):
    """A tune at a second budget on the same sample and options reads each unit's gains back instead of scoring them
    again; an entry changed after it was written is said in one line and measured again."""
    from tasks.audit.recipe.measure import _cached, _remember, _remembered

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    made_from = {"sample": "ab" * 32, "units": ["0", "1"], "options": ["m.Q8_0.x.gguf"]}
    choices = [Choice(0, 0, 1234, 0.01, (12.5, 10.0, 15.0)), Choice(1, 0, 1234, 0.002, (2.5, float("nan"), float("nan")))]
    assert _remembered(made_from) is None
    _remember(made_from, choices)
    back = _remembered(made_from)
    assert back[0] == choices[0] and back[1].gain == choices[1].gain and back[1].share[0] == 2.5
    assert _remembered(made_from | {"units": ["0", "2"]}) is None  # other units: not these gains
    path = _cached(made_from)
    path.write_text(path.read_text().replace("0.01", "0.5"))
    assert _remembered(made_from) is None
    said = capsys.readouterr().err
    assert "a tune's kept gains" in said and "was changed after it was written; they are measured again" in said


@pytest.mark.slow  # quantizes
def test_a_gptq_recipe_s_checkpoint_costs_loads_and_reads_back_as_its_options_say(trained_model_dir, tmp_path,
                                                                                  monkeypatch):
    """gptqmodel's ``dynamic`` with one module at 8 bits, one fused group at group size 16 and one group left
    unquantized: every matrix of the checkpoint holds what the recipe gave it (read from its tensors' shapes), takes
    the bytes ``Option.bytes`` costs it, and the checkpoint loads (gptqmodel's route: transformers cannot) with those
    bits per weight, the unquantized modules counted at their 16 bits."""
    from tasks.audit.recipe.gptq import Option, Shapes, held
    from tasks.config import VariantSpec
    from tasks.models.cost import checkpoint_tensor_bytes
    from tasks.models.quantize import Scheme, draw_calibration, quantize
    from tasks.models.resolve import load_tokenizer, locate_model
    from tasks.models.variants import load_variant

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    dynamic = {r"+:model\.layers\.1\.mlp\.(down_proj)$": {"bits": 8, "group_size": 32},
               r"+:model\.layers\.0\.self_attn\.(q_proj|k_proj|v_proj)$": {"bits": 4, "group_size": 16},
               r"-:model\.layers\.0\.mlp\.(gate_proj|up_proj)$": {}}
    out = tmp_path / "recipe"
    import torch

    quantize(locate_model(str(trained_model_dir)), Scheme("gptq", 4, 32, True, dynamic),
             draw_calibration(torch.randint(0, 300, (64 * 64,)), 8, 64, 0, "random", "none"), out,
             load_tokenizer(str(trained_model_dir)))
    shapes = Shapes.of(trained_model_dir)
    given = {"model.layers.1.mlp.down_proj": Option(8, 32), "model.layers.0.mlp.gate_proj": Option(None, 32),
             "model.layers.0.mlp.up_proj": Option(None, 32)} | {
        f"model.layers.0.self_attn.{m}_proj": Option(4, 16) for m in "qkv"}
    expected = {name: given.get(name, Option(4, 32)) for name in shapes.matrices}
    assert held(out, shapes) == {name: option.label for name, option in expected.items()}
    stored = checkpoint_tensor_bytes(str(out))
    for name, option in expected.items():
        assert sum(size for key, size in stored.items() if key.startswith(f"{name}.")) == \
            option.bytes(*shapes.matrices[name]), name
    model, facts = load_variant(VariantSpec(name="r", method="gptq", path=str(out)), str(out))
    weights = sum(out_ * in_ for out_, in_ in shapes.matrices.values())
    costed = sum(option.bytes(*shapes.matrices[name]) for name, option in expected.items())
    assert facts.bits_per_weight == pytest.approx(8 * costed / weights, rel=1e-12)
    assert facts.quantization["label"] == "gptq 4-bit g32 tuned" and facts.quantized_layers == len(expected) - 2
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear and model.dtype == torch.float32


@pytest.mark.slow  # quantizes four checkpoints of a small model, and runs an audit
def test_a_gptq_tune_gives_the_fragile_module_8_bits_through_gptqmodel_s_dynamic_and_proves_it(
        cli, cache, tmp_path, trained_model_dir, corpus_path):
    """The trained 2-layer llama with layer 1's MLP made fragile, its GPTQ 4-bit g32 tuned module by module with 8-bit
    options: layer 1's down projection wins back most and is chosen; the checkpoint gptqmodel makes from the recipe's
    ``dynamic`` holds it at 8 bits and every other matrix at 4, within the budget; the audit proves it better than the
    uniform 4-bit g32, and its files and MLflow run carry the overrides it was made with."""
    from helpers import write_config

    model = fragile(trained_model_dir, tmp_path / "fragile", 1)
    variant = {"name": "g4", "method": "gptq", "bits": 4, "group_size": 32,
               "calibration": {"samples": 8, "seq_len": 64, "seed": 0}}
    config = write_config(tmp_path / "tiny.yaml", model, corpus_path, [variant], name="fragile",
                          tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tune"})
    code, out, err = cli("tune", str(config), "--variant", "g4", "--budget", "+0.5bpw", "--per", "module",
                         "--types", "8bit", "--set", "diagnosis.windows=8", "--json", timeout=1200)
    found = json_line(out, err)
    assert code == 0, out[-4000:] + err[-4000:]
    assert max(found["every"], key=lambda row: row["gain"])["unit"] == "1.down"
    assert "1.down" in [row["unit"] for row in found["chosen"]], found["chosen"]
    built = found["built"]
    assert built["within"] and built["checked"] == built["tensors"] == 14 and built["bpw"] <= found["budget_bpw"]
    from tasks.audit.recipe.gptq import Shapes, held

    holds = held(Path(built["path"]), Shapes.of(model))
    assert holds["model.layers.1.mlp.down_proj"] == "8bit-g32" and holds["model.layers.0.mlp.down_proj"] == "4bit-g32"
    stored = json.loads((Path(built["path"]) / "config.json").read_text())["quantization_config"]["dynamic"]
    exported = json.loads((Path(found["folder"]) / "gptqmodel-dynamic.json").read_text())
    assert stored == exported["dynamic"] and exported["bits"] == 4 and exported["group_size"] == 32
    # the audit of the recipe: every model loaded as the recipe is (dynamic {}: by gptqmodel), the recipe's overrides
    audited = {v["name"]: v for v in yaml.safe_load((Path(found["folder"]) / "audit.yaml").read_text())["variants"]}
    assert audited["g4"]["dynamic"] == {} and audited["g4-tuned"]["dynamic"] == stored
    # beside it the uniform scheme next in size that this machine's kernels run: not 4-bit g16, which no CPU kernel
    # here runs (torch's int4 matmul takes groups of 32 to 256)
    beside = [name for name in audited if name.startswith("g4-as-")]
    assert len(beside) == 1 and beside[0] != "g4-as-4-bit-g16", beside
    assert audited[beside[0]] | {"name": "g4", "bits": 4, "group_size": 32} == audited["g4"]
    assert found["proven"]["uniform"] and found["verdicts"][0].startswith("proven better than uniform 4-bit g32")
    assert "g4-tuned" in out and "gptq 4-bit g32 tuned" in out
    assert not (Path(found["folder"]) / "llama-quantize-tensor-types.txt").exists()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    artifacts = {a.path for a in client.list_artifacts(found["mlflow_run_id"], "recipe")}
    assert artifacts == {"recipe/gptqmodel-dynamic.json", "recipe/llm-compressor-recipe.yaml"}


def test_dynamic_is_refused_but_on_a_gptq_variant_made_here_and_in_a_form_gptqmodel_does_not_read():
    from pydantic import ValidationError

    from tasks.config import VariantSpec

    good = {r"+:model\.layers\.7\.(mlp\.down_proj)$": {"bits": 8, "group_size": 64}, r"-:model\.layers\.0\.": {}}
    assert VariantSpec(name="r", method="gptq", bits=4, group_size=64, dynamic=good).dynamic == good
    for wrong in ({"method": "gptq", "path": "some/checkpoint"}, {"method": "awq"}, {"method": "gguf", "type": "Q4_0"}):
        with pytest.raises(ValidationError, match="dynamic overrides how gptqmodel quantizes some modules of a gptq"):
            VariantSpec(name="r", dynamic=good, **wrong)
    for wrong in ({"model.layers.7": {"bits": 8}}, {"+:x": {"desc_act": True}}):
        with pytest.raises(ValidationError, match="dynamic"):
            VariantSpec(name="r", method="gptq", dynamic=wrong)


def test_gptqmodel_s_cpu_int4_kernels_take_only_the_group_sizes_torch_s_matmul_takes():
    """What the tune's plan knows of gptqmodel's CPU kernels, checked against the code it stands for: gptqmodel picks
    a kernel on torch's int4 CPU matmul for 4-bit modules of these group sizes (and one group a row), and that
    matmul runs the group sizes ``INT4PACK_CPU_GROUPS`` and no other, though the kernels declare 16 too."""
    import torch
    from gptqmodel.utils.importer import select_quant_linear

    from tasks.models.quantize import INT4PACK_CPU_GROUPS, INT4PACK_CPU_KERNELS

    for group in (-1, 16, 32, 64, 128):
        chosen = select_quant_linear(4, group, False, True, "cpu", format="gptq", quant_method="gptq",
                                     pack_dtype=torch.int32)
        assert chosen.__name__ in INT4PACK_CPU_KERNELS, (group, chosen)
    out, inputs = 64, 512
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (out, inputs), dtype=torch.int32), 2)
    for group in (8, 16, 32, 64, 128, 256, 512):
        try:
            torch.ops.aten._weight_int4pack_mm_for_cpu(torch.randn(2, inputs, dtype=torch.bfloat16), packed, group,
                                                       torch.randn(inputs // group, out, 2, dtype=torch.bfloat16))
            runs = True
        except RuntimeError as error:
            assert "qGroupSize" in str(error)
            runs = False
        assert runs == (group in INT4PACK_CPU_GROUPS), group


def _tune_plan(tmp_path, variant: dict):
    """The audit a tune of ``variant`` (on the embedded model) opens, its variant alone: nothing measured."""
    from functools import partial

    from tasks.audit.plan import open_audit
    from tasks.audit.recipe.plan import alone

    config = {"name": "planned", "baseline": {"path": "embedded"}, "corpus": {"source": "embedded"},
              "evaluation": {"max_tokens": 512, "window": 256}, "variants": [variant]}
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(config))
    return open_audit(str(path), [], narrow=partial(alone, variant=variant["name"]))


@pytest.fixture(scope="module")
def gptq_g32_plan(tmp_path_factory):
    return _tune_plan(tmp_path_factory.mktemp("g32"), {"name": "g4", "method": "gptq", "bits": 4, "group_size": 32})


@pytest.fixture(scope="module")
def gguf_q4_plan(tmp_path_factory):
    return _tune_plan(tmp_path_factory.mktemp("q4"), {"name": "q4", "method": "gguf", "type": "Q4_0"})


def test_a_gptq_tune_s_default_options_are_ones_this_machine_s_kernels_run(gptq_g32_plan, capsys):
    """4-bit g32 on a CPU: half its group size (16) is no group size gptqmodel's CPU kernel for 4 bits can run (it
    failed the tune after its models were quantized, naming the variant): the plan leaves it out in one line that
    names the option and why; 8 bits and unquantized stay; every option left runs here."""
    from tasks.audit.recipe.plan import prepare_tune

    prepared = prepare_tune(gptq_g32_plan.lineup, "g4", Budget.parse("+0.5bpw"), "layer")
    assert prepared.types == ("8bit-g32", "bf16")
    [note] = capsys.readouterr().err.strip().splitlines()
    assert note.startswith("ppl-audit: note: tune leaves out option 4bit-g16 (half the variant's group size): ")
    assert "TorchAtenLinear" in note and "32, 64, 128 or 256" in note
    assert all(prepared.kernels.problem(option) is None for option in prepared.options)


@pytest.mark.parametrize("types,option", [(["g16"], "4bit-g16"), (["8bit", "4bit-g16"], "4bit-g16"),
                                          (["g-1"], "4bit-g-1")])
def test_a_gptq_option_no_kernel_here_runs_is_refused_naming_the_option(gptq_g32_plan, types, option):
    """Asked for by name, it is refused in one line naming it (not the variant), before anything is quantized. One
    group a row (-1) makes the embedded model's groups its widths, 576 and 1536: no group size that matmul takes."""
    from tasks.audit.recipe.plan import prepare_tune

    with pytest.raises(InputError) as refused:
        prepare_tune(gptq_g32_plan.lineup, "g4", Budget.parse("+0.5bpw"), "layer", types)
    said = str(refused.value)
    assert said.startswith(f"--types {option}: gptqmodel runs it on this CPU with ") and "'g4'" not in said
    assert "\n" not in said


@pytest.mark.parametrize("types", [[], [""], ["8bit", " "]])
def test_an_empty_types_request_is_refused_not_read_as_the_defaults(gptq_g32_plan, gguf_q4_plan, types):
    from tasks.audit.recipe.plan import prepare_tune

    for plan, variant in ((gptq_g32_plan, "g4"), (gguf_q4_plan, "q4")):
        with pytest.raises(InputError, match="--types: an empty option; give .* or leave --types out"):
            prepare_tune(plan.lineup, variant, Budget.parse("+0.5bpw"), "layer", types)


@pytest.mark.parametrize("per", ["layer", "module"])
def test_a_budget_that_buys_no_unit_is_refused_with_the_smallest_that_buys_one(gptq_g32_plan, gguf_q4_plan, per):
    """Below the cheapest step any unit can take (a fused group's, with --per module), a tune would measure for
    minutes and choose nothing: refused, saying the smallest budget that buys something, in the form given, which
    is then taken."""
    from tasks.audit.recipe.plan import prepare_tune

    for plan, variant in ((gptq_g32_plan, "g4"), (gguf_q4_plan, "q4")):
        for tiny in ("+0.0001bpw", "+0.001MiB"):
            with pytest.raises(InputError, match=f"--budget {re.escape(tiny)}: it buys no unit any option") as refused:
                prepare_tune(plan.lineup, variant, Budget.parse(tiny), per)
            smallest = re.search(r"the smallest budget that buys one is (?:at least )?(\S+?);", str(refused.value))
            assert smallest, refused.value
            smallest = smallest[1]
            assert smallest.startswith("+") and smallest.endswith(tiny[-3:]), smallest
            assert prepare_tune(plan.lineup, variant, Budget.parse(smallest), per).extra > 0


def test_a_budget_above_the_ceiling_is_named_as_such_not_malformed():
    assert Budget.parse("1e9MiB") == Budget(1e9, "MiB", False) and Budget.parse("+2.5E-1bpw").value == 0.25
    for wrong in ("1e9", "e9MiB", "1e9.5MiB", "nanbpw", "infMiB"):
        with pytest.raises(InputError, match="give bits per weight"):
            Budget.parse(wrong)
