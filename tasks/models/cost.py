"""What a model costs in bytes: its weights as stored in memory or in its files, and bits per weight.

Bits per weight count every byte a quantized layer keeps for its weights (packed values, scales, zeros, group
index, a second level of quantization) over the weights it stands for (``in_features × out_features``); its bias
is not a weight's cost. A checkpoint's layers are costed from its files, as shipped (a GGUF or compressed-tensors
checkpoint loads dequantized, so memory would not say); a model quantized as it loads, from memory.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import torch

from tasks.config import VariantSpec
from tasks.engine.layers import decoder_layers
from tasks.models.gguf_file import read_header
from tasks.models.quantize import per_module

# bytes per element of the dtypes a safetensors header names
SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                     "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
# GGUF tensor types that hold plain floats: the rest are quantized blocks
GGUF_FLOATS = {"F64", "F32", "F16", "BF16"}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, looking inside quantized tensor subclasses (torchao) at their parts."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def _quantization_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized layer keeps outside its parameters and buffers: HQQ's scales and zeros (its
    ``meta``), bitsandbytes' absmax and code tables (NF4's ``quant_state``, nested when double-quantized) and
    LLM.int8's row scales (``SCB``)."""
    held = [t for t in getattr(module, "meta", {}).values() if torch.is_tensor(t)]
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    while state is not None:
        held += [t for t in vars(state).values() if torch.is_tensor(t)]
        state = getattr(state, "state2", None)
    scb = getattr(weight, "SCB", None)
    return held + ([scb] if torch.is_tensor(scb) else [])


def weight_bytes(model: torch.nn.Module) -> int:
    """Memory of a model's parameters and buffers as they are stored (quantized where they are), with the
    quantization state its layers keep beside them."""
    held = list(model.parameters()) + list(model.buffers())
    held += [t for module in model.modules() for t in _quantization_state(module)]
    return sum(tensor_bytes(t) for t in {id(t): t for t in held}.values())


def _weights(module: torch.nn.Module) -> int:
    return module.in_features * module.out_features


def _layer_bytes_in_memory(module: torch.nn.Module) -> int:
    """A quantized layer's bytes for its weights in memory: all it holds but its bias."""
    bias = getattr(module, "bias", None)
    return weight_bytes(module) - (tensor_bytes(bias) if torch.is_tensor(bias) else 0)


def _headers(source: str) -> dict[str, tuple[list[int], str]]:
    """``{tensor name: (shape, dtype)}`` of a folder's safetensors files, from their headers (no tensor is read)."""
    from safetensors import safe_open

    found = {}
    for file in Path(source).glob("*.safetensors"):
        with safe_open(str(file), "pt") as tensors:
            for name in tensors.keys():
                part = tensors.get_slice(name)
                found[name] = (list(part.get_shape()), part.get_dtype())
    return found


def checkpoint_tensor_bytes(source: str) -> dict[str, int]:
    """``{tensor name: bytes}`` of a folder's safetensors files; empty for weights in another form (a ``.bin``)."""
    return {name: math.prod(shape) * SAFETENSORS_BYTES[dtype] for name, (shape, dtype) in _headers(source).items()}


def tensor_shapes(source: str) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of a folder's safetensors files; empty for weights in another form (a ``.bin``)."""
    return {name: shape for name, (shape, _) in _headers(source).items()}


def _shipped(spec: VariantSpec, source: str) -> bool:
    """Whether the model's layers are costed from its files: a checkpoint on disk, not quantized as it loads."""
    return not spec.backend.quantized_at_load and Path(source).exists()


def decoder_layer_bytes(model, spec: VariantSpec, source: str) -> list[int]:
    """Bytes each decoder layer's weights take as the model is shipped: for a checkpoint, in its files; for a model
    quantized as it loads, in memory."""
    count = len(decoder_layers(model))
    if not _shipped(spec, source):
        return [weight_bytes(layer) for layer in decoder_layers(model)]
    sizes = Counter()
    if source.endswith(".gguf"):
        for tensor in read_header(Path(source)).tensors:
            if tensor.name.startswith("blk."):  # llama.cpp names a decoder layer's tensors blk.<layer>.<tensor>
                sizes[int(tensor.name.split(".")[1])] += int(tensor.n_bytes)
        return [sizes[i] for i in range(count)]
    for name, size in checkpoint_tensor_bytes(source).items():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        if layer:
            sizes[int(layer[1])] += size
    if not sizes:  # weights in another form (a .bin): as loaded
        return [weight_bytes(layer) for layer in decoder_layers(model)]
    return [sizes[i] for i in range(count)]


def quantized_bits(model, spec: VariantSpec, source: str, quantized: list[str]) -> float | None:
    """Effective bits per weight of the quantized layers (``quantized``: their names in ``model``); a GGUF
    file's from its tensor types (every tensor in quantized blocks), unless the model was quantized again as it
    loaded (then its own layers'); None where nothing is quantized."""
    if _shipped(spec, source) and source.endswith(".gguf"):
        tensors = read_header(Path(source)).tensors
        quantized = any(t.tensor_type.name not in GGUF_FLOATS for t in tensors)
        # a decoder layer's matrix a recipe left in floats (``ppl-audit tune``) is one of the weights it costs
        blocks = [t for t in tensors if t.tensor_type.name not in GGUF_FLOATS
                  or (quantized and t.name.startswith("blk.") and len(t.shape) == 2)]
        weights = sum(int(t.n_elements) for t in blocks)
        return 8 * sum(int(t.n_bytes) for t in blocks) / weights if weights else None
    if not quantized:
        return None
    modules = {name: model.get_submodule(name) for name in quantized}
    stored = checkpoint_tensor_bytes(source) if _shipped(spec, source) else {}
    if stored and per_module(model.config):  # a decoder layer's matrix a recipe left in floats is a weight it costs
        inside = {id(module) for layer in decoder_layers(model) for module in layer.modules()}
        modules |= {name: module for name, module in model.named_modules()
                    if type(module) is torch.nn.Linear and id(module) in inside}
    weights = sum(_weights(module) for module in modules.values())
    if stored:
        held = sum(size for name, size in stored.items()
                   if not name.endswith(".bias") and name.rsplit(".", 1)[0] in modules)
    else:
        held = sum(_layer_bytes_in_memory(module) for module in modules.values())
    return 8 * held / weights


def model_bits(model, quantized: list[str]) -> float:
    """Bits per weight of the whole model as loaded: all the memory its parameters and its quantized layers'
    state take, over the weights they stand for (a quantized layer's ``in × out`` and bias, every other
    parameter's own count; a tied weight once)."""
    layers = [model.get_submodule(name) for name in quantized]
    inside = {id(t) for module in layers for t in list(module.parameters()) + list(module.buffers())}
    rest = [p for p in model.parameters() if id(p) not in inside]
    held = sum(weight_bytes(module) for module in layers) + sum(tensor_bytes(p) for p in rest)
    count = sum(_weights(m) + (m.bias.numel() if torch.is_tensor(getattr(m, "bias", None)) else 0) for m in layers)
    return 8 * held / (count + sum(p.numel() for p in rest))
