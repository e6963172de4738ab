"""What scores a model (``runtime:`` of a variant): transformers in this process, or llama.cpp's own kernels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    name: str
    # llama.cpp's kernels and tokenizer run a GGUF file as it is served: its own settings (llama_cpp:), numerics
    # and stream; nothing of transformers' (diagnose's layer swaps, an emulated cache, the noise floor)
    llama_cpp: bool = False
    label: str = ""  # appended to its method in the table, where it is not transformers

    @property
    def in_transformers(self) -> bool:
        return not self.llama_cpp


TRANSFORMERS = Runtime("transformers")
LLAMA_CPP = Runtime("llama.cpp", llama_cpp=True, label=" @llama.cpp")
