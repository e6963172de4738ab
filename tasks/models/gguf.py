"""llama.cpp's GGUF files: whether one holds every tensor its architecture needs, and how it stores them."""

from __future__ import annotations

import functools
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from tasks.core.errors import InputError, one_line
from tasks.core.files import once_per_file_state
from tasks.models.resolve import load_config


def check_gguf(path: Path) -> None:
    """Refuse a ``.gguf`` path that is not a GGUF file, or one without a tensor its architecture needs (a
    vocabulary-only file holds none), before its folder is handed to transformers: it would build the whole
    model and score the weights the file lacks at random."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror}") from None
    if magic != b"GGUF":
        raise InputError(f"{path} is not a GGUF file (it does not start with GGUF); give a llama.cpp .gguf file")
    try:
        metadata, names = read_gguf_metadata(str(path))  # the tensor table only: no tensor data is read
    except (ValueError, struct.error, MemoryError, OverflowError) as error:  # cut short, or absurd lengths
        raise InputError(f"cannot read {path}: {one_line(error)}; give a whole llama.cpp .gguf file") from None
    if not names:
        raise InputError(f"{path} holds no tensors, only metadata (a vocabulary file?); give the .gguf file "
                         "with the model's weights")
    architecture = metadata["general.architecture"]
    missing = sorted(_gguf_needs(path, architecture) - set(names))
    if missing:
        raise InputError(f"{path} lacks {len(missing)} tensor(s) its {architecture} model needs "
                         f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}): it would be scored with "
                         "random weights in their place; give the whole .gguf file llama.cpp wrote")

def _gguf_needs(path: Path, architecture: str) -> set[str]:
    """The GGUF names of the weights of the model ``path``'s config describes, named as transformers' GGUF
    loader names them (the model's own keys, not those only a submodule's name map adds: a model converted from
    a base model); a weight tied to another (an output head shared with the embeddings) is not stored, and one
    the name map does not know is left to the loader."""
    from transformers import AutoModelForCausalLM

    if _name_map(architecture, 1) is None:
        return set()  # transformers refuses it itself
    config = load_config(str(path))
    with torch.device("meta"):  # the skeleton only: no memory for its weights
        model = AutoModelForCausalLM.from_config(config)
    processor = _processor(architecture, config)
    name_map = _name_map(architecture, config.num_hidden_layers)
    wanted = model.state_dict().keys() - model.all_tied_weights_keys.keys()
    return {found for found, key in _gguf_names(model, processor, name_map, "").items() if key in wanted}


@functools.lru_cache(maxsize=8)
def _name_map(architecture: str, layers: int):
    """gguf-py's map of a model's tensor names to GGUF's (None for an architecture it does not know). It takes
    ~13 ms to build, and transformers' loader builds it again for each of a model's ~400 submodules."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    archs = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
    return get_tensor_name_map(archs[architecture], layers) if architecture in archs else None


def _processor(architecture: str, config):
    """transformers' tensor processor of the architecture: what undoes llama.cpp's changes to the tensors (the
    Q/K row permutation, experts stacked in one tensor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _gguf_names(model: torch.nn.Module, processor, name_map, prefix: str) -> dict[str, str]:
    """``{GGUF tensor name: the model's key}`` as transformers' ``get_gguf_hf_weights_map`` makes it: a module's
    own names first, then each submodule's that the module's did not give (a model converted from its base
    model names its tensors from the base)."""
    names: dict[str, str] = {}
    for key in model.state_dict():
        key = processor.preprocess_name(key)
        stem, suffix = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "")
        suffix = f".{suffix}" if suffix else ""
        found = name_map.get_name(stem)
        if found is None:
            processor.perform_fallback_tensor_mapping(names, suffix, prefix, key)
        else:
            names[found + suffix] = prefix + key
    for child_name, child in model.named_children():
        for found, key in _gguf_names(child, processor, name_map, f"{prefix}{child_name}.").items():
            names.setdefault(found, key)
    return names


def gguf_state_dict(path: Path, model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the GGUF file ``path``, dequantized to ``dtype`` and named as the keys of ``model`` (a
    skeleton of the model its config describes, on the meta device is enough).

    What transformers' GGUF loader does, from the file parsed once per process (it parses the file again for
    every load, ~3.5 s for SmolLM2) and with gguf-py's name map made once (it makes it again per submodule,
    ~5 s): a 94 MiB file loaded in ~2 s instead of ~9."""
    from gguf import dequantize

    reader = gguf_reader(path)
    architecture = str(reader.get_field("general.architecture").contents())
    processor = _processor(architecture, model.config)
    names = _gguf_names(model, processor, _name_map(architecture, model.config.num_hidden_layers), "")
    parsed: dict[str, dict] = {"tensors": {}}  # where a processor puts what it splits or stacks itself
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        found = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                  parsed_parameters=parsed)
        if found.name in names:
            parsed["tensors"][names[found.name]] = torch.from_numpy(np.array(found.weights)).to(dtype)
    return parsed["tensors"]

@once_per_file_state(maxsize=4)
def gguf_reader(path: Path):
    """gguf-py's reader of ``path`` (its tensors memory-mapped), made once per state of the file: it parses every
    metadata field, the whole vocabulary too, which takes seconds."""
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_facts(path: Path) -> dict:
    """A GGUF file's quantization: its file type as llama.cpp names it (``Q4_K_M``), the count of tensors of
    each type, and bits per weight over all its tensors (how llama.cpp reports a file's size)."""
    from gguf import LlamaFileType

    reader = gguf_reader(path)
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    stored = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    weights = sum(int(tensor.n_elements) for tensor in reader.tensors)
    field = reader.get_field("general.file_type")
    if field is not None:
        file_type = LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
    else:  # older files: the type most of the weights have
        file_type = max((n, name) for name, n in types.items() if name not in ("F32", "F16"))[1]
    return {"file_type": file_type, "tensor_types": dict(types.most_common()),
            "bits_per_weight": round(8 * stored / weights, 3), "label": f"gguf {file_type}"}
