"""Load the baseline and its quantized variants, with the facts of each load.

bitsandbytes (LLM.int8, NF4) and torchao (int8 weight-only) quantize at load through transformers, HQQ
through its own API right after loading; GPTQ and AWQ checkpoints load through transformers with
gptqmodel's kernels (optimum for GPTQ), compressed-tensors checkpoints with the compressed-tensors
package, GGUF files dequantized from gguf-py's reader of the file (``tasks.models.gguf``). The same code path runs on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tasks.config import VariantSpec
from tasks.core.errors import InputError
from tasks.core.versions import versions
from tasks.engine import kv_cache
from tasks.engine.kv_cache import KVCacheFormat
from tasks.models.cost import model_bits, quantized_bits, weight_bytes
from tasks.models.formats import describe, distributions, ready, require
from tasks.models.formats_said import GptqConfig
from tasks.models.gguf import gguf_file_facts
from tasks.models import kernel_start
from tasks.models.loading import WEIGHT_SUFFIXES, as_located, load_model
from tasks.models.quantize import load_per_module, per_module
from tasks.models.placement import check_ties, devices, forget_with, split_of
from tasks.models.resolve import Located, device_and_dtype, model_files


@dataclass
class VariantFacts:
    """What loading one variant took and what it is made of."""

    method: str
    source: str
    device: str
    dtype: str
    load_seconds: float
    size_on_disk_bytes: int
    weight_memory_bytes: int
    quantized_layers: int
    linear_layers: int
    backend: str
    versions: dict[str, str] = field(default_factory=dict)
    quantization: dict = field(default_factory=dict)  # the format's own facts (tasks.models.formats.describe)
    kernels: dict[str, str] = field(default_factory=dict)  # quantized layer -> the kernel class that runs it
    worker: str = ""  # where it was scored: a Dask worker's address, else host and process (tasks.audit.cluster)
    parity: dict = field(default_factory=dict)  # a split model's first windows against one device's (tasks.audit.scoring)
    # bits per weight (tasks.models.cost): of the quantized layers as shipped, of the model where none is; of the
    # whole model as loaded. NaN in a baseline reference stored before they were measured.
    bits_per_weight: float = math.nan
    model_bits_per_weight: float = math.nan
    # the key/value cache it was scored with (tasks.engine.kv_cache), "" for the model's own precision, and what a
    # token's keys and values take in it across all layers (on average over the audit's window, where a residual
    # keeps the newest ones in the model's precision)
    kv_cache: str = ""
    kv_bytes_per_token: float = math.nan
    body: str = "eager"  # how its decoder layers ran (tasks.engine.body): eager, compile, liger, liger+compile

    def summary(self) -> dict:
        return asdict(self)


def quantization_config(method: str, dtype: torch.dtype, kernel: str | None = None, config=None):
    """The transformers quantization config for methods quantized at load (``AT_LOAD``), or the loading settings
    that pick ``kernel`` for a gptq/awq checkpoint whose transformers config is ``config``; else None."""
    if kernel is not None:
        import transformers

        # transformers takes only the loading settings (the backend) from it; bits must still be the checkpoint's
        bits = GptqConfig.of_json(config.quantization_config).bits
        return getattr(transformers, KERNEL_CONFIGS[method])(bits=bits, backend=kernel)
    made = AT_LOAD.get(method)
    return made(dtype) if made is not None else None


def _bitsandbytes(**settings):
    from transformers import BitsAndBytesConfig

    # bitsandbytes warns on every int8 forward that it casts inputs; once is news, every call is noise
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    return BitsAndBytesConfig(**settings)


def _torchao_int8(dtype: torch.dtype):
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


# transformers' config of each method quantized at load, by the method's name (tasks.methods: quantized_at_load;
# hqq's is none: tasks.models.formats quantizes it once loaded)
AT_LOAD = {"bnb-int8": lambda dtype: _bitsandbytes(load_in_8bit=True),
           "bnb-nf4": lambda dtype: _bitsandbytes(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_compute_dtype=dtype),
           "torchao-int8": _torchao_int8}
KERNEL_CONFIGS = {"gptq": "GPTQConfig", "awq": "AwqConfig"}  # transformers' config that picks a gptqmodel kernel


def layer_census(model) -> tuple[int, dict[str, str]]:
    """``(all linear layers, {quantized layer: the kernel that runs it})`` of a loaded model: a kernel bug
    shows as bad scores from the layers one kernel runs (GPTQModel #1854), so each layer's is kept."""
    linear, kernels = 0, {}
    for layer, module in model.named_modules():
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        # gptqmodel's kernels (MarlinLinear, TritonV2Linear, AwqTorchLinear, ...) share its BaseQuantLinear
        is_linear = (isinstance(module, torch.nn.Linear) or name == "HQQLinear"
                     or any(base.__name__ == "BaseQuantLinear" for base in type(module).__mro__))
        if not is_linear:
            continue
        linear += 1
        scheme = getattr(module, "quantization_scheme", None)  # compressed-tensors' layers stay nn.Linear
        packed = hasattr(module, "qweight") or hasattr(module, "W_q")  # gptqmodel, HQQ: packed int weights
        subclass = weight is not None and type(weight).__name__ not in ("Parameter", "Tensor")
        # transformers' fine-grained FP8 layers (FP8Linear) keep a plain Parameter, of a float8 dtype
        fp8 = weight is not None and weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if scheme is not None:
            kernels[layer] = f"compressed-tensors {name}"
        elif packed or subclass or fp8 or name in ("Linear8bitLt", "Linear4bit"):
            kernels[layer] = type(weight).__name__ if subclass and name == "Linear" else name
    return linear, kernels


def size_on_disk(path: str) -> int:
    folder = Path(path)
    if folder.is_file():  # a GGUF file
        return folder.stat().st_size
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES)


def cache_format(spec: VariantSpec) -> KVCacheFormat | None:
    """The key/value cache ``spec`` is scored with (None: keys and values as computed): what the engine is given beside
    the loaded model at each forward pass (``tasks.engine.perplexity.score_part``'s ``kv_cache``), not kept on it."""
    return spec.kv_cache.format() if spec.kv_cache is not None else None


def load_variant(spec: VariantSpec, model: Located | str, window: int | None = None):
    """Load ``spec`` from ``model`` (its own files, a quantized folder, or the baseline to quantize at load: as an
    audit's lineup found it, or a name a tool or a test gives). ``window``: the audit's, over which a key/value
    cache with a residual is costed (``kv_bytes_per_token``).

    Returns:
        ``(model, VariantFacts)``: the model as loaded; the key/value cache it is scored with
        (``cache_format(spec)``) goes to the engine beside it.
    """
    found = as_located(model)
    if spec.runtime_backend.llama_cpp:
        return load_served(spec, found, window)
    source = found.source
    device, dtype = device_and_dtype(spec)
    require(spec.method, device.type)
    method = spec.backend
    if method.saved_on_cpu and spec.path is not None and device.type == "cpu":
        raise InputError(f"variant '{spec.name}': {method.saved_on_cpu}")
    config = quantization_config(spec.method, dtype, spec.kernel, found.config)
    extra = {"quantization_config": config} if config is not None else {}
    check_ties(spec, found.config)
    split = split_of(spec)
    started = time.perf_counter()
    with warnings.catch_warnings():
        if spec.kernel is not None:  # transformers warns that it takes only the backend from this config: the point
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        # gptqmodel picks and readies its kernel as the checkpoint loads
        with (kernel_start.said_as_the_kernel(spec.name, spec.method, spec.kernel, device.type)
              if method.gptqmodel_kernels else contextlib.nullcontext()):
            # a recipe's (made by gptqmodel's dynamic), or one given dynamic: {} to be loaded as a recipe is
            if method.takes_dynamic and (spec.dynamic is not None or per_module(found.config)):
                model = load_per_module(found, dtype, device)
            else:
                model = load_model(found, dtype, device, **extra, **(split.arguments() if split else {}))
    forget_with(model, split)
    ready(spec, model)
    weights = weight_bytes(model)  # as loaded: a kernel may repack its weights at its first forward, just below
    if method.gptqmodel_kernels:
        kernel_start.first_forward(model, spec.name, spec.method, spec.kernel)
    load_seconds = time.perf_counter() - started
    form = cache_format(spec)
    linear, kernels = layer_census(model)
    quantized, backend = len(kernels), ",".join(sorted(set(kernels.values()))) or "torch.nn.Linear"
    if method.quantized_layers and quantized == 0:  # a GGUF file is dequantized as it loads
        raise InputError(f"variant '{spec.name}' ({spec.method}) loaded with no quantized layer; check its path")
    whole = model_bits(model, list(kernels))
    facts = VariantFacts(
        method=spec.method, source=source, device=",".join(devices(model)) if split else str(device),
        dtype=str(dtype).removeprefix("torch."),
        load_seconds=load_seconds, size_on_disk_bytes=size_on_disk(str(model_files(source) or source)),
        weight_memory_bytes=weights, bits_per_weight=quantized_bits(model, spec, source, list(kernels))
        or whole, model_bits_per_weight=whole, quantized_layers=quantized,
        linear_layers=linear, backend=backend, versions=versions(*distributions(spec.method)),
        quantization=describe(spec, source, model), kernels=kernels,
        kv_cache=form.describe() if form is not None else "", kv_bytes_per_token=kv_cache.window_bytes_per_token(
            form, model.config.get_text_config(), torch.finfo(model.dtype).bits, window),
    )
    return model, facts


def load_served(spec: VariantSpec, model: Located, window: int | None):
    """``spec``'s GGUF file as llama.cpp runs it (``runtime: llama.cpp``), with a context of the audit's window:
    ``(LlamaCppModel, VariantFacts)``. Its figures are the file's (``gguf_file_facts``), its backend llama.cpp's."""
    from tasks.models import llama_cpp

    file = Path(model.source)
    if file.suffix != ".gguf" or not file.is_file():
        raise InputError(f"variant '{spec.name}': runtime llama.cpp runs a .gguf file, and {model.name} is not one")
    settings = spec.llama_cpp_settings
    started = time.perf_counter()
    served = llama_cpp.open_model(file, spec.name, settings, (window or 4096) + 1)  # + a BOS prefix
    facts = gguf_file_facts(file)
    said, loaded = served.facts, served.facts.loaded
    ran = llama_cpp.described(settings, said)  # what ran: flash attention as llama.cpp chose it, the GPU's layers
    bits = facts.bits_per_weight
    return served, VariantFacts(
        method=spec.method, source=model.source, device="cuda" if loaded.ran.gpu_layers else "cpu", dtype="gguf",
        load_seconds=time.perf_counter() - started, size_on_disk_bytes=file.stat().st_size,
        weight_memory_bytes=loaded.size, quantized_layers=sum(n for t, n in facts.tensor_types.items()
                                                              if t not in ("F32", "F16", "BF16")),
        linear_layers=0, backend=f"llama.cpp ({loaded.desc})",
        versions=versions("llama_cpp_python", "gguf"),
        quantization=facts.record() | {"runtime": "llama.cpp", "label": f"{facts.label} @llama.cpp",
                                       "llama_cpp": ran, "system_info": said.system_info},
        bits_per_weight=bits, model_bits_per_weight=bits,
        # the table labels a cache by its first word: "kv:q8_0/q8_0"
        kv_cache="" if (settings.type_k, settings.type_v) == ("f16", "f16") else f"{settings.type_k}/{settings.type_v} "
                                                                                 "(llama.cpp's K/V cache)",
    )


def check_same_tokenizer(name: str, baseline_digest: str, digest: str) -> None:
    """Refuse a variant whose tokenizer (``tokenizer_digest``) is not the baseline's."""
    if digest != baseline_digest:
        raise InputError(f"variant '{name}' has a different tokenizer from the baseline (vocab, merges or special "
                         "tokens): token perplexities are not comparable; audit it against its own baseline")
