"""What a checkpoint is, read from its files: its method (``method: auto``), the package that method needs,
and the facts of its format that the table and the record show (a GGUF file's tensor types and bits per
weight, a compressed-tensors scheme and whether its activation quantization runs, HQQ's settings, the
bits and groups of a GPTQ/AWQ checkpoint)."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

import torch

from tasks.config import VariantSpec
from tasks.core.errors import InputError
from tasks.methods.registry import method_of
from tasks.engine.model_facts import input_device
from tasks.config_said import refusals
from tasks.models.formats_said import CompressedConfig, FormatLabel, GptqConfig, HqqMeta, QuantArgs
from tasks.models.gguf import gguf_facts
from tasks.models.resolve import Located

# quantization_config.quant_method in config.json -> our method (bitsandbytes: by its load_in_* flag)
QUANT_METHODS = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors", "fp8": "fp8",
                 "torchao": "torchao-int8"}
HQQ_DEFAULTS = (4, 64)  # bits, group size: HQQ's own defaults


def detect(model: Located) -> tuple[str, str]:
    """``(method, how it was found)`` of a checkpoint: a GGUF file, else its config's ``quantization_config``
    (none: a float model, method ``baseline``)."""
    source = model.source
    if source.endswith(".gguf"):
        return "gguf", "a GGUF file"
    settings = getattr(model.config, "quantization_config", None)
    if settings is None:
        return "baseline", "no quantization_config: a float model"
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    found = settings.get("quant_method")
    if found == "bitsandbytes":
        return ("bnb-int8" if settings.get("load_in_8bit") else "bnb-nf4"), "quantization_config: bitsandbytes"
    if found == "hqq":
        raise InputError(f"{source} is a saved HQQ checkpoint, which transformers 5.23 cannot load; give the float "
                         "model with method hqq (HQQ quantizes it as it loads, without calibration)")
    if found not in QUANT_METHODS:
        raise InputError(f"{source}: quantization_config.quant_method '{found}' is not one ppl-audit loads "
                         f"({', '.join(QUANT_METHODS)}, bitsandbytes, or a .gguf file)")
    return QUANT_METHODS[found], f"quantization_config: {found}"


def require(method: str, device_type: str) -> None:
    """Refuse a method whose package is not installed, in one line naming what to install, and one that
    cannot run on ``device_type``."""
    backend = method_of(method)
    if backend.gpu_only and device_type == "cpu":
        raise InputError(backend.gpu_only)
    if backend.package is None:
        return
    module, pip = backend.package
    try:
        import_package(module)
    except ImportError:
        extra = " (all formats: pip install 'ppl-audit[formats]')" if backend.in_formats_extra else ""
        raise InputError(f"method {method} needs the package {pip.split('==')[0]}: pip install '{pip}'{extra}") from None


# What tokenicer (which gptqmodel imports) does to the process as it is imported: logging.basicConfig(level=INFO),
# and HF_HOME with the Hub's, transformers' and remote code's caches pointed at /tmp/tokenicer_hf_home. The first
# put a line per HTTP request to Prefect on a Dask worker's console and Python's bare lines in an audit's log; the
# second sent every process started afterwards (local Dask workers) to an empty cache, where a Hub model was not.
HF_CACHES = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


def import_package(module: str) -> None:
    """Import a quantization package, leaving the root logger and the Hugging Face caches as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    caches = {name: os.environ.get(name) for name in HF_CACHES}
    try:
        importlib.import_module(module)
    finally:
        for handler in [handler for handler in root.handlers if handler not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
        for name, value in caches.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_kernel(method: str, kernel: str) -> None:
    """Refuse a ``kernel:`` that names none of gptqmodel's kernels for ``method`` (gptq or awq), before anything
    loads: gptqmodel would refuse it only once the checkpoint loads, after the baseline is scored."""
    from gptqmodel.utils.backend import BACKEND, normalize_backend

    other = {"gptq": "awq_", "awq": "gptq_"}[method]
    try:
        backend = normalize_backend(kernel, quant_method=method)
    except ValueError:
        backend = None
    if backend is None or backend.value.startswith(other):
        names = sorted(b.value.removeprefix(f"{method}_") for b in BACKEND if b.value.startswith(f"{method}_"))
        raise InputError(f"kernel {kernel!r} is not one of gptqmodel's kernels for {method}: use one of "
                         f"{', '.join(names)}, or leave kernel out for the one gptqmodel picks")


def distributions(method: str) -> tuple[str, ...]:
    """The packages whose versions a model loaded with ``method`` depends on (recorded in its facts)."""
    backend = method_of(method)
    found = (backend.package[1].split("==")[0],) if backend.package else ()
    return found + backend.also_versions


def ready(spec: VariantSpec, model) -> None:
    """Bring a loaded model into the state it scores in: its method's step (``READY``), where it has one."""
    step = READY.get(spec.method)
    if step is not None:
        step(spec, model)


def _decompress(spec: VariantSpec, model) -> None:
    """A compressed-tensors model decompresses its weights on its first forward, through a hook on its top
    module that the engine's calls of the base model would skip: it is decompressed here (its layers keep
    their scheme and quantize their inputs as they run)."""
    if hasattr(model, "ct_decompress_hook"):
        model.hf_quantizer.compressor.decompress_model(model)


def _quantize_hqq(spec: VariantSpec, model) -> None:
    """An hqq variant is quantized here with HQQ's own API: transformers 5.23 no longer quantizes HQQ at load
    (``HqqConfig`` raises NotImplementedError)."""
    from hqq.core.quantize import BaseQuantizeConfig
    from hqq.models.hf.base import AutoHQQHFModel

    group = spec.group_size or HQQ_DEFAULTS[1]
    head = model.get_output_embeddings()  # HQQ leaves the head as it is
    uneven = next((name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                   and module is not head and module.weight.numel() % group), None)
    if uneven is not None:  # HQQ asserts it, layer by layer, after quantizing the ones before
        raise InputError(f"{spec.name}: hqq group_size {group} does not divide the {model.get_submodule(uneven).weight.numel()} "
                         f"weights of {uneven}; use a group size that divides every layer's (64, say)")
    settings = BaseQuantizeConfig(nbits=spec.bits or HQQ_DEFAULTS[0], group_size=group)
    AutoHQQHFModel.quantize_model(model, quant_config=settings, compute_dtype=model.dtype, device=str(model.device))


def describe(spec: VariantSpec, source: str, model) -> dict:
    """The facts of a loaded model's format (its method's, ``DESCRIBE``; none for a float model or one quantized at
    load by bitsandbytes or torchao), with a short ``label`` for the table where the method name alone would hide
    what was loaded."""
    facts = DESCRIBE.get(spec.method)
    return facts(spec, source, model) if facts is not None else {}


def _settings(model) -> dict | None:
    """A loaded model's ``quantization_config`` as a dict (None: it has none)."""
    settings = getattr(model.config, "quantization_config", None)
    return settings if isinstance(settings, dict) or settings is None else settings.to_dict()


def _gguf_described(spec: VariantSpec, source: str, model) -> dict:
    facts = gguf_facts(Path(source))
    if spec.tensor_types:  # a recipe's: some tensors in other types than the file type's (``ppl-audit tune``)
        facts |= {"tensor_overrides": len(spec.tensor_types), "label": f"{FormatLabel.of_facts(facts).label} tuned"}
    return facts


def _hqq_described(spec: VariantSpec, source: str, model) -> dict:
    from hqq.core.quantize import HQQLinear

    meta = HqqMeta.of_json(next(m.meta for m in model.modules() if isinstance(m, HQQLinear)))
    return {"bits": meta.nbits, "group_size": meta.group_size, "axis": meta.axis, "packing": meta.packing,
            "backend": HQQLinear.backend.name, "label": f"hqq {meta.nbits}-bit g{meta.group_size}"}


def _compressed_described(spec: VariantSpec, source: str, model) -> dict:
    settings = _settings(model)
    return compressed_facts(CompressedConfig.of_json(settings), model) if settings else {}


def _gptqmodel_described(spec: VariantSpec, source: str, model) -> dict:
    """A gptq or awq checkpoint's bits and groups, from its config."""
    settings = _settings(model)
    if not settings:
        return {}
    config = GptqConfig.of_json(settings)
    facts = dict(config.shown)
    if config.overrides:  # a recipe's: some modules at other bits or group sizes (``ppl-audit tune``)
        facts |= {"module_overrides": config.overrides,
                  "label": f"{spec.method} {config.bits}-bit g{config.group_size} tuned"}
    return facts


def check_files(spec: VariantSpec, model: Located) -> None:
    """Refuse a checkpoint given as path that its method could not load right (``FILE_CHECKS``), before anything
    loads."""
    check = FILE_CHECKS.get(spec.method)
    if check is not None:
        check(model)


def _not_saved_hqq(model: Located) -> None:
    detect(model)  # a saved HQQ checkpoint is refused as auto refuses it


def _compressed_folder(model: Located) -> None:
    if Path(model.source).is_dir():
        check_compressed(model)


def _args_text(args: QuantArgs) -> str:
    """One quantization's numbers as text: ``int4 g32``, ``int8 per channel``, ``float8 per token, dynamic``."""
    grouping = f"g{args.group_size}" if args.group_size else f"per {args.strategy}"
    return f"{args.type}{args.num_bits} {grouping}" + (", dynamic" if args.dynamic else "")


def check_compressed(model: Located) -> None:
    """Refuse a compressed-tensors checkpoint whose ``quantization_config`` compressed-tensors would refuse or
    misread (an unknown type or format, no ``config_groups``), and one whose stored weights hold more bits than
    its config claims: its label (``W3A8``) would be read from a config that the tensors contradict."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    source, settings = model.source, model.config.quantization_config
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    try:
        QuantizationConfig.model_validate(settings)
    except ValidationError as error:
        refused = refusals(error)[0]
        where = ".".join(str(part) for part in refused.loc if "function-after" not in str(part))
        raise InputError(f"{source}: quantization_config.{where}: {refused.msg.removeprefix('Value error, ')}; "
                         "it is not a config compressed-tensors reads") from None
    config = CompressedConfig.of_json(settings)
    if not config.grouped:
        raise InputError(f"{source}: quantization_config has no config_groups: nothing in it is quantized")
    formats = [f.value for f in CompressionFormat]
    if config.format not in formats:
        raise InputError(f"{source}: quantization_config.format '{config.format}' is not a compressed-tensors "
                         f"format ({', '.join(formats)})")
    claimed = max(weights.num_bits for weights in config.weights)
    stored = _stored_bits(Path(source), config.format)
    if stored is not None and stored > claimed:
        raise InputError(f"{source}: its config claims {claimed}-bit weights, but its tensors hold {stored}-bit ones; "
                         "fix the checkpoint's quantization_config")


def _stored_bits(folder: Path, format_: str) -> int | None:
    """The bits a compressed checkpoint's first quantized weight really uses: from a packed weight's width
    (``pack-quantized``: 32-bit words over its ``weight_shape``), or an int8 weight's range (``int-quantized``)."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            names = set(handle.keys())
            for name in sorted(names):
                stem = name.rsplit(".", 1)[0]
                if format_ == "pack-quantized" and name.endswith(".weight_packed") and f"{stem}.weight_shape" in names:
                    columns = int(handle.get_tensor(f"{stem}.weight_shape")[1])
                    return round(handle.get_slice(name).get_shape()[1] * 32 / columns)
                if format_ == "int-quantized" and name.endswith(".weight") and f"{stem}.weight_scale" in names:
                    weight = handle.get_tensor(name)
                    if weight.dtype == torch.int8:
                        largest = int(max(weight.max(), -weight.min() - 1))
                        return max(1, largest.bit_length() + 1)
    return None


def compressed_facts(config: CompressedConfig, model) -> dict:
    """A compressed-tensors checkpoint's scheme and whether its activation quantization runs here: on CPU
    transformers decompresses the weights and each layer fake-quantizes its inputs in its forward, so a
    W8A8 figure is a W8A8 one; a model loaded dequantized would be weight-only, and the label says so."""
    weights, inputs = config.weights, config.inputs
    applied = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None
               and m.quantization_scheme.input_activations is not None and "forward" in vars(m)
               and getattr(m, "quantization_enabled", True)]  # the checks compressed-tensors' quantized_forward makes
    scheme = f"W{weights[0].num_bits if weights else 16}A{inputs[0].num_bits if inputs else 16}"
    if any(args.type == "float" for args in weights + inputs):
        scheme += "-FP8" if weights and weights[0].num_bits == 8 else "-FP"
    elif inputs:
        scheme += "-INT8" if inputs[0].num_bits == 8 else ""
    if not inputs:
        state = "none: a weight-only scheme"
    elif applied:
        state = (f"applied: {len(applied)} layers quantize their inputs in the forward"
                 + (" (emulated in floating point on CPU)" if input_device(model).type == "cpu" else ""))
    else:
        state = "NOT applied: this figure is weight-only"
    label = f"ct {scheme}" + (" W-only" if inputs and not applied else "")
    return {"scheme": scheme, "format": config.format, "weights": [_args_text(a) for a in weights],
            "activations": [_args_text(a) for a in inputs], "activation_quantization": state,
            "ignored": config.ignore or [], "label": label}


# What each method needs of torch and its package, by the method's name (its descriptor, tasks.methods, says the rest):
# the step that readies a loaded model, the facts of its format, the checks of its files
READY = {"compressed-tensors": _decompress, "hqq": _quantize_hqq}
DESCRIBE = {"gguf": _gguf_described, "hqq": _hqq_described, "compressed-tensors": _compressed_described,
            "gptq": _gptqmodel_described, "awq": _gptqmodel_described}
FILE_CHECKS = {"hqq": _not_saved_hqq, "compressed-tensors": _compressed_folder}
