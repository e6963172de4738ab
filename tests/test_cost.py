"""What a variant costs: bits per weight of its quantized layers and of the whole model, against the values the
formats' layouts give by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.config import VariantSpec
from tasks.engine.layers import decoder_layers
from tasks.models.cost import quantized_bits
from tasks.models.loading import load_model
from tasks.models.variants import load_variant

CPU = torch.device("cpu")


def linear_shapes(folder) -> list[tuple[int, int]]:
    """``(in, out)`` of every linear layer of the decoder layers, read from the float model."""
    model = load_model(str(folder), torch.float32, CPU)
    return [(m.in_features, m.out_features) for layer in decoder_layers(model) for m in layer.modules()
            if isinstance(m, torch.nn.Linear)]


def bits_of(shapes, per_layer) -> float:
    """Bits per weight over the layers ``shapes`` whose stored bits ``per_layer(in, out)`` gives."""
    return sum(per_layer(i, o) for i, o in shapes) / sum(i * o for i, o in shapes)


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_a_float_model_costs_its_dtype_s_bits(trained_model_dir, dtype, bits):
    spec = VariantSpec(name="float", method="baseline", dtype=str(dtype).removeprefix("torch."))
    _, facts = load_variant(spec, str(trained_model_dir))
    assert facts.bits_per_weight == facts.model_bits_per_weight == bits


def test_nf4_costs_its_packed_values_absmax_and_code_table(trained_model_dir):
    """bitsandbytes NF4 as an audit loads it: 4 bits a weight, a float32 absmax per block of 64, the 16-value
    code table per layer."""
    _, facts = load_variant(VariantSpec(name="nf4", method="bnb-nf4"), str(trained_model_dir))
    want = bits_of(linear_shapes(trained_model_dir), lambda i, o: 4 * i * o + 32 * i * o / 64 + 32 * 16)
    assert facts.bits_per_weight == pytest.approx(want, rel=1e-12)
    assert 4.5 < facts.bits_per_weight < facts.model_bits_per_weight < 32  # float embeddings, norms and head


def test_nf4_with_double_quantization_costs_its_second_level(trained_model_dir):
    """Double quantization: the absmax of each block of 64 in 8 bits, a float32 absmax per 256 of those, its
    256-value code table and offset, and NF4's own 16-value table."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
    model = load_model(str(trained_model_dir), torch.float32, CPU, quantization_config=config)
    names = [name for name, m in model.named_modules() if type(m).__name__ == "Linear4bit"]

    def nested(i: int, o: int) -> float:
        blocks = i * o // 64
        return 4 * i * o + 8 * blocks + 32 * math.ceil(blocks / 256) + 32 * 256 + 32 + 32 * 16

    got = quantized_bits(model, VariantSpec(name="nf4", method="bnb-nf4"), str(trained_model_dir), names)
    assert got == pytest.approx(bits_of(linear_shapes(trained_model_dir), nested), rel=1e-12)


def test_int8_methods_cost_8_bits_and_their_row_scales(trained_model_dir):
    shapes = linear_shapes(trained_model_dir)
    _, llm_int8 = load_variant(VariantSpec(name="int8", method="bnb-int8"), str(trained_model_dir))
    assert llm_int8.bits_per_weight == pytest.approx(bits_of(shapes, lambda i, o: 8 * i * o + 32 * o), rel=1e-12)
    _, torchao = load_variant(VariantSpec(name="int8", method="torchao-int8"), str(trained_model_dir))
    # a float32 scale and an int8 zero point per output row
    assert torchao.bits_per_weight == pytest.approx(bits_of(shapes, lambda i, o: 8 * i * o + 40 * o), rel=1e-12)


def test_hqq_costs_its_packed_values_and_float_scales_and_zeros(trained_model_dir):
    _, facts = load_variant(VariantSpec(name="hqq", method="hqq", bits=4, group_size=32), str(trained_model_dir))
    want = bits_of(linear_shapes(trained_model_dir), lambda i, o: 4 * i * o + 2 * 32 * i * o / 32)
    assert facts.bits_per_weight == pytest.approx(want, rel=1e-12)


@pytest.mark.slow  # loads SmolLM2 from its GGUF file
def test_hqq_made_from_a_gguf_baseline_costs_hqq_s_bits_not_the_file_s():
    """A variant quantized as it loads from a GGUF baseline's dequantized weights: its bits are HQQ's layout, not
    the GGUF file's blocks, which the baseline's are (before 2026-11-26 both showed the file's 5.74)."""
    from tasks.data.embedded import embedded_gguf, ensure_embedded_model

    _, facts = load_variant(VariantSpec(name="hqq", method="hqq", bits=4, group_size=64), str(embedded_gguf()))
    want = bits_of(linear_shapes(ensure_embedded_model()), lambda i, o: 4 * i * o + 2 * 32 * i * o / 64)
    assert facts.bits_per_weight == pytest.approx(want, rel=1e-12)
    file = str(embedded_gguf())
    as_baseline = quantized_bits(None, VariantSpec(name="baseline"), file, [])
    as_gguf = quantized_bits(None, VariantSpec(name="g", method="gguf", path=file), file, [])
    assert as_baseline == as_gguf and 5 < as_gguf < 8.5  # Q4_1 blocks (5 bits) and one Q8_0 tensor (8.5)


def test_gguf_blocks_cost_their_type_s_bits(tmp_path):
    """Q4_0 (an f16 scale and 32 4-bit values: 18 bytes a block of 32), Q4_1 (and an f16 minimum: 20), Q8_0 (an
    f16 scale and 32 int8: 34); a float tensor (a norm) is not a quantized layer."""
    import gguf

    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    rng = np.random.default_rng(0)
    sizes = {"Q4_0": (64, 256), "Q4_1": (32, 512), "Q8_0": (96, 128)}
    for name, shape in sizes.items():
        kind = gguf.GGMLQuantizationType[name]
        writer.add_tensor(name.lower(), gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), kind),
                          raw_dtype=kind)
    writer.add_tensor("norm", rng.standard_normal(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    count = {name: shape[0] * shape[1] for name, shape in sizes.items()}
    want = (4.5 * count["Q4_0"] + 5.0 * count["Q4_1"] + 8.5 * count["Q8_0"]) / sum(count.values())
    assert quantized_bits(None, VariantSpec(name="g", method="gguf", path=str(path)), str(path), []) == \
        pytest.approx(want, rel=1e-12)


@pytest.mark.slow  # quantizes
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_cost_their_files_layout(trained_model_dir, corpus_path, tmp_path, monkeypatch,
                                                          method):
    """GPTQ 4-bit, group 32: int32 words of eight 4-bit values, an fp16 scale and a packed 4-bit zero per group and
    output, and GPTQ's int32 group index per input; AWQ the same without the group index. A ``kernel:`` that is
    none of gptqmodel's for the method is refused before anything loads."""
    from helpers import write_config

    from tasks.audit.plan import open_audit
    from tasks.core.errors import InputError
    from tasks.models.quantize import Scheme, draw_calibration, quantize
    from tasks.models.resolve import load_tokenizer, locate_model

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / method
    quantize(locate_model(str(trained_model_dir)), Scheme(method, 4, 32, True),
             draw_calibration(torch.randint(0, 300, (64 * 64,)), 8, 64, 0, "random", "none"), out,
             load_tokenizer(str(trained_model_dir)))
    _, facts = load_variant(VariantSpec(name=method, method=method, path=str(out)), str(out))
    index = 32 if method == "gptq" else 0
    want = bits_of(linear_shapes(trained_model_dir),
                   lambda i, o: 4 * i * o + 16 * (i // 32) * o + 4 * (i // 32) * o + index * i)
    assert facts.bits_per_weight == pytest.approx(want, rel=1e-12)
    # another of gptqmodel's kernels for the same checkpoint (`kernel:`): every layer runs it, at the same cost
    kernel, runs = {"gptq": ("torch", "TorchLinear"), "awq": ("torch_awq", "AwqTorchLinear")}[method]
    _, chosen = load_variant(VariantSpec(name=method, method=method, path=str(out), kernel=kernel), str(out))
    assert set(chosen.kernels.values()) == {runs} and len(chosen.kernels) == len(facts.kernels) > 0
    assert chosen.bits_per_weight == facts.bits_per_weight
    # a kernel that cannot start here fails with one line naming it and the kernel to give instead (issue #57)
    with pytest.raises(InputError, match=rf"^variant '{method}' \({method}\): kernel marlin could not start here "
                                         rf"\(.*CUDA.*\); give `kernel: {kernel}` on this variant"):
        load_variant(VariantSpec(name=method, method=method, path=str(out), kernel="marlin"), str(out))
    for wrong in ("nonsense", {"gptq": "awq_torch", "awq": "gptq_marlin"}[method]):
        config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path,
                              [{"name": "v", "method": method, "path": str(out), "kernel": wrong}])
        with pytest.raises(InputError, match=rf"^v: kernel '{wrong}' is not one of gptqmodel's kernels for {method}: "
                                             r"use one of .*\btorch\b.*, or leave kernel out"):
            open_audit(str(config))
