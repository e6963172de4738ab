"""llama.cpp's GGUF files: whether one holds every tensor its architecture needs, and how it stores them."""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.core.errors import InputError, one_line
from tasks.models.gguf_blocks import DEQUANTIZE
from tasks.models.gguf_file import TensorInfo, check_magic, read_header, tensor_data


# values dequantized at once: enough that numpy or torch, not the interpreter, takes the time, few enough that a
# slice's temporaries stay in the processor's caches (Q4_K on 2 cores, 2026-11-26: 222 MB/s of file in slices of
# 1M values, 149 in slices of 16M)
SLICE_VALUES = 1 << 20


def check_gguf(path: Path, config) -> None:
    """Refuse a ``.gguf`` path that is not a GGUF file, or one without a tensor its architecture needs (a
    vocabulary-only file holds none; ``config``: the model the file describes), before its folder is handed to
    transformers: it would build the whole model and score the weights the file lacks at random."""
    check_magic(path)
    try:
        header = read_header(path)  # the tensor table only: no tensor data is read
    except (ValueError, OSError, MemoryError, OverflowError) as error:  # cut short, absurd lengths
        raise InputError(f"cannot read {path}: {one_line(error)}") from None
    names = [tensor.name for tensor in header.tensors]
    if not names:
        raise InputError(f"{path} holds no tensors, only metadata (a vocabulary file?); give the .gguf file "
                         "with the model's weights")
    architecture = str(header.field("general.architecture"))
    missing = sorted(_gguf_needs(config, architecture) - set(names))
    if missing:
        raise InputError(f"{path} lacks {len(missing)} tensor(s) its {architecture} model needs "
                         f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}): it would be scored with "
                         "random weights in their place; give the whole .gguf file llama.cpp wrote")

def _gguf_needs(config, architecture: str) -> set[str]:
    """The GGUF names of the weights of the model ``config`` describes, named as transformers' GGUF
    loader names them (the model's own keys, not those only a submodule's name map adds: a model converted from
    a base model); a weight tied to another (an output head shared with the embeddings) is not stored, and one
    the name map does not know is left to the loader."""
    from transformers import AutoModelForCausalLM

    if _name_map(architecture, 1) is None:
        return set()  # transformers refuses it itself
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

    What transformers' GGUF loader does, from the header read once per process (``tasks.models.gguf_file``) and
    gguf-py's name map made once, each tensor dequantized on every core and turned to ``dtype`` as soon as it is
    done: the same tensors to the bit (tests/test_formats.py, tests/test_gguf_file.py), at the speeds in
    docs/benchmarks.md#loading-a-gguf-file."""
    header = read_header(path)
    architecture = str(header.field("general.architecture"))
    processor = _processor(architecture, model.config)
    names = _gguf_names(model, processor, _name_map(architecture, model.config.num_hidden_layers), "")
    tensors: dict[str, torch.Tensor] = {}
    parsed = {"tensors": tensors}  # as transformers' processors take it: they put what they split or stack there
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for tensor in header.tensors:
            found = processor.process(weights=_dequantized(header, tensor, pool), name=tensor.name,
                                      tensor_key_mapping=names, parsed_parameters=parsed)
            if found.name in names:
                weights = np.asarray(found.weights)  # a float tensor stored as it is: a read-only view of the file
                weights = weights if weights.flags.writeable else weights.copy()
                tensors[names[found.name]] = torch.from_numpy(weights).to(dtype)
    return tensors


def _dequantized(header, tensor: TensorInfo, pool: ThreadPoolExecutor) -> np.ndarray:
    """One tensor dequantized to float32 as gguf-py dequantizes it, to the bit, in slices across ``pool``: the most
    shipped types in torch (``tasks.models.gguf_blocks``), the others with gguf-py's own per-type
    ``dequantize_blocks``. gguf-py's ``dequantize`` works through a tensor 16 rows at a time, and the interpreter's
    overhead on those small slices took most of the time (docs/benchmarks.md#loading-a-gguf-file)."""
    from gguf import GGML_QUANT_SIZES, dequantize
    from gguf.quants import _type_traits, quant_shape_from_byte_shape  # gguf-py's per-type dequantizers

    data = tensor_data(header, tensor)
    quant = _type_traits.get(tensor.tensor_type)
    if quant is None:  # stored as floats or integers
        return dequantize(data, tensor.tensor_type)
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = data.reshape(-1, size)
    # torch's allocator, not numpy's: numpy asks the kernel for huge pages on large arrays, and on this project's
    # machine writing 5 GiB of them took 5.5-11.9 s against 1.9-2.0 s (2026-11-26)
    out = torch.empty(len(blocks), block).numpy()
    step = max(1, SLICE_VALUES // block)
    fast = DEQUANTIZE.get(tensor.tensor_type.name)
    if fast is not None:
        with warnings.catch_warnings():  # the file's memory map is read-only; nothing writes to it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            source, target = torch.from_numpy(blocks), torch.from_numpy(out)

        def one(start: int) -> None:
            target[start : start + step] = fast(source[start : start + step])
    else:
        quant.init_grid()  # the IQ types' lookup grids

        def one(start: int) -> None:
            out[start : start + step] = quant.dequantize_blocks(blocks[start : start + step])

    list(pool.map(one, range(0, len(blocks), step)))
    return out.reshape(quant_shape_from_byte_shape(data.shape, tensor.tensor_type))


@dataclass(frozen=True)
class GgufFacts:
    """A GGUF file's quantization: its file type as llama.cpp names it (``Q4_K_M``), the count of tensors of each
    type (most first), bits per weight over all its tensors (how llama.cpp reports a file's size), and, where it was
    quantized with an importance matrix, over how many chunks of text (None: without one)."""

    file_type: str
    tensor_types: dict[str, int]
    bits_per_weight: float
    imatrix_chunks: int | None

    @property
    def label(self) -> str:
        """What the table calls it: ``gguf Q4_K_M``, ``gguf Q4_K_M imatrix``."""
        return f"gguf {self.file_type}" + (" imatrix" if self.imatrix_chunks is not None else "")

    def record(self) -> dict:
        """As the record and MLflow keep it (``imatrix_chunks`` only where there is one)."""
        chunks = {} if self.imatrix_chunks is None else {"imatrix_chunks": self.imatrix_chunks}
        return {"file_type": self.file_type, "tensor_types": dict(self.tensor_types),
                "bits_per_weight": self.bits_per_weight, "label": self.label} | chunks


def gguf_file_facts(path: Path) -> GgufFacts:
    """The quantization of the GGUF file ``path``, from its header."""
    from gguf import LlamaFileType

    header = read_header(path)
    types = Counter(tensor.tensor_type.name for tensor in header.tensors)
    stored = sum(tensor.n_bytes for tensor in header.tensors)
    weights = sum(tensor.n_elements for tensor in header.tensors)
    field = header.field("general.file_type")
    if field is not None:
        file_type = LlamaFileType(int(field)).name.removeprefix("MOSTLY_").removeprefix("ALL_")  # ALL_F32: F32
    else:  # older files: the type most of the weights have
        file_type = max((n, name) for name, n in types.items() if name not in ("F32", "F16"))[1]
    chunks = header.field("quantize.imatrix.chunks_count")  # llama-quantize writes what importance matrix it used
    return GgufFacts(file_type=file_type, tensor_types=dict(types.most_common()),
                     bits_per_weight=round(8 * stored / weights, 3),
                     imatrix_chunks=None if chunks is None else int(chunks))


def gguf_facts(path: Path) -> dict:
    """``gguf_file_facts`` as the record keeps them."""
    return gguf_file_facts(path).record()
