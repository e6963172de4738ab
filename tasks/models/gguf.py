"""llama.cpp's GGUF files: whether one holds every tensor its architecture needs, and how it stores them."""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

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
    loader names them (the top level of ``get_gguf_hf_weights_map``; its pass over every submodule costs
    seconds and only adds names for models converted from a base model); a weight tied to another (an output
    head shared with the embeddings) is not stored, and one the name map does not know is left to the loader."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    archs = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
    if architecture not in archs:
        return set()  # transformers refuses it itself
    config = load_config(str(path))
    with torch.device("meta"):  # the skeleton only: no memory for its weights
        model = AutoModelForCausalLM.from_config(config)
    name_map = get_tensor_name_map(archs[architecture], config.num_hidden_layers)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    needs = set()
    for key in model.state_dict().keys() - model.all_tied_weights_keys.keys():
        stem, suffix = processor.preprocess_name(key), ""
        if stem.endswith((".weight", ".bias")):
            stem, suffix = stem.rsplit(".", 1)
            suffix = "." + suffix
        found = name_map.get_name(stem)
        if found is not None:
            needs.add(found + suffix)
    return needs

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
