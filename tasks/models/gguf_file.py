"""A GGUF file's header, read once and fast: its metadata and tensor table, and the transformers config they give.

gguf-py's reader (and transformers' GGUF loader, built on it) turns every metadata value into numpy views, the
vocabulary's strings one by one, and transformers decodes each again: ~5 s for SmolLM2's 49k tokens on this
project's machine, before a tensor is read. Here the header is read with ``struct`` from a memory map: a
vocabulary is kept as its count, and numbers as one array each. What it gives (the config,
tensor names, types and where their data lies) is checked against gguf-py and transformers in tests/test_gguf_file.py.
Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.errors import InputError, one_line
from tasks.core.files import once_per_file_state

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
LONG_ARRAY = 1024  # string arrays longer than this (a vocabulary, merges) are kept as their count


@dataclass(frozen=True)
class Strings:
    """A long array of strings, skipped, not decoded: how many."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy's order (GGUF lists the fastest-moving dimension first)
    type: int  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int
    n_elements: int

    @property
    def tensor_type(self):
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type)


@dataclass(frozen=True)
class Header:
    path: Path
    fields: dict[str, object]
    tensors: tuple[TensorInfo, ...]

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buffer, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def unpack(self, form: str):
        value = struct.unpack_from(form, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(form)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.offset + length > len(self.buffer):
            raise ValueError(f"a string of {length} bytes runs past the end")
        value = bytes(self.buffer[self.offset : self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return value

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.offset += 8 + struct.unpack_from("<Q", self.buffer, self.offset)[0]

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == STRING:
                if count > LONG_ARRAY:
                    self.skip_strings(count)
                    return Strings(count)
                return [self.string() for _ in range(count)]
            if item == ARRAY:
                return [self.value(ARRAY) for _ in range(count)]
            dtype = np.dtype(SCALARS[item])
            values = np.frombuffer(self.buffer, dtype, count, self.offset).copy()
            self.offset += count * dtype.itemsize
            return values
        return self.unpack(SCALARS[kind])


def check_magic(path: Path) -> None:
    """Refuse a ``.gguf`` path that is not a GGUF file, in one line, before anything parses it."""
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror}") from None
    if magic != b"GGUF":
        raise InputError(f"{path} is not a GGUF file (it does not start with GGUF); give a llama.cpp .gguf file")


@once_per_file_state(maxsize=8)
def read_header(path: Path) -> Header:
    """The metadata and tensor table of the GGUF file ``path`` (version 2 or 3), read once per state of the file.
    Raises ValueError, in words a user can act on, for a file that is not GGUF, is cut short or damaged."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        if mapped[:4] != b"GGUF":
            raise ValueError("it does not start with GGUF: give a llama.cpp .gguf file")
        version = struct.unpack_from("<I", mapped, 4)[0] if len(mapped) >= 8 else None
        if version not in (2, 3):
            raise ValueError(f"its GGUF version {version} is not 2 or 3: give a file a current llama.cpp wrote")
        cursor = _Cursor(mapped, 8)
        try:
            n_tensors, n_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
            if (n_tensors + n_fields) * 8 > len(mapped):  # each takes at least 8 bytes: a damaged count
                raise _damaged(f"{n_tensors} tensors and {n_fields} fields do not fit in {len(mapped)} bytes")
            fields = {}
            for _ in range(n_fields):
                key = cursor.string()
                fields[key] = cursor.value(cursor.unpack("<I"))
            table = []
            for _ in range(n_tensors):
                name = cursor.string()
                dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
                table.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        except _Damaged:
            raise
        except (struct.error, KeyError, ValueError) as error:  # past the end, a value type GGUF does not have
            raise _damaged(one_line(error)) from None
        alignment = int(fields.get("general.alignment", 32))
        start = -(-cursor.offset // alignment) * alignment
        size = len(mapped)
    tensors = []
    for name, dims, kind, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        tensor = TensorInfo(name, tuple(reversed(dims)), kind, start + offset, elements // block * block_bytes,
                            elements)
        if tensor.offset + tensor.n_bytes > size:
            raise _damaged(f"tensor {name} ends past the end of the file")
        tensors.append(tensor)
    return Header(path, fields, tuple(tensors))


class _Damaged(ValueError):
    pass


def _damaged(detail: str) -> ValueError:
    return _Damaged(f"it is cut short or damaged ({detail}): give the whole .gguf file llama.cpp wrote")


def tensor_data(header: Header, tensor: TensorInfo) -> np.ndarray:
    """The stored data of one tensor, memory-mapped, shaped as gguf-py's reader shapes it (what ``gguf.dequantize``
    takes): a float or integer tensor in its own type, a quantized one as rows of bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(tensor.type)
    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    raw = np.memmap(header.path, np.uint8, "r", tensor.offset, (tensor.n_bytes,))
    if kind in plain:
        return raw.view(plain[kind]).reshape(tensor.shape)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    return raw.reshape(*tensor.shape[:-1], tensor.shape[-1] // block * block_bytes)


@dataclass(frozen=True)
class HeaderConfig:
    """The transformers config a GGUF header gives: the model type it names (``model_type``) and the whole config, as
    ``from_dict`` takes it."""

    model_type: str
    values: dict


def header_config(header: Header) -> HeaderConfig | None:
    """The transformers config of the model the file holds, built as transformers' GGUF loader builds it
    (``load_gguf_checkpoint``: its name maps, defaults and tied head) for the architectures it maps by name alone;
    None for those it builds with code of its own (t5, stablelm, gemma3/4, lfm2, gpt-oss, minimax, MoE Qwens):
    their config is left to transformers."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = str(header.field("general.architecture"))
    name = str(header.field("general.name", ""))
    special = ("t5", "stablelm", "gemma3", "gemma4", "lfm2", "gpt-oss", "gpt_oss", "minimax", "qwen2moe", "qwen3moe")
    if any(word in architecture for word in special) or "umt5" in name.lower():
        return None
    updated = "mistral" if "llama" in architecture and "mistral" in name else architecture
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        return None
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors) or
              architecture in ("falcon", "bloom")}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
                                                       ).items():
        config.setdefault(key, value)
    renames = GGUF_CONFIG_MAPPING  # what GGUF_TO_TRANSFORMERS_MAPPING's "config" is
    for key, value in header.fields.items():
        prefix, _, config_key = key.replace(architecture, updated).partition(".")
        renamed = renames.get(prefix, {}).get(config_key)
        if renamed is None or renamed == -1 or isinstance(value, Strings):
            continue
        value = _plain(value)
        config[renamed] = value.replace(architecture, updated) if isinstance(value, str) else value
    tokens = header.field("tokenizer.ggml.tokens")
    if tokens is not None:  # its size, where no field says it
        config.setdefault("vocab_size", tokens.count if isinstance(tokens, Strings) else len(tokens))
    # its general.architecture, renamed model_type as the rest, is the architecture transformers loads
    return HeaderConfig(model_type=updated, values=config)


def _plain(value):
    """A value as transformers' loader gives it: a one-element array is its element, an array a list."""
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value
