"""Every quantization method and runtime, by name: the one place a new one is added (beside its own module)."""

from __future__ import annotations

from tasks.methods import (
    auto,
    awq,
    baseline,
    bnb_int8,
    bnb_nf4,
    compressed_tensors,
    fp8,
    gguf,
    gptq,
    hqq,
    torchao_int8,
)
from tasks.methods.method import Method
from tasks.methods.runtimes import LLAMA_CPP, TRANSFORMERS, Runtime

# in the order the config's refusal of an unknown method lists them
METHODS: dict[str, Method] = {m.name: m for m in (auto.METHOD, baseline.METHOD, bnb_int8.METHOD, bnb_nf4.METHOD,
                                                  gptq.METHOD, awq.METHOD, torchao_int8.METHOD,
                                                  compressed_tensors.METHOD, gguf.METHOD, hqq.METHOD, fp8.METHOD)}
RUNTIMES: dict[str, Runtime] = {r.name: r for r in (TRANSFORMERS, LLAMA_CPP)}

QUANTIZED_BY_US = tuple(name for name, m in METHODS.items() if m.quantized_here)
QUANTIZED_AT_LOAD = tuple(name for name, m in METHODS.items() if m.quantized_at_load)
KERNEL_GROUP_SIZES = {name: m.kernel_group_sizes for name, m in METHODS.items() if m.kernel_group_sizes}
TAKE_SETTINGS = tuple(name for name, m in METHODS.items() if m.settings)  # gptq, awq and hqq


def method_of(name: str) -> Method:
    """The method named ``name`` (a validated spec's: a KeyError otherwise; ``find_method`` for a name not checked yet)."""
    return METHODS[name]


def find_method(name: str | None) -> Method | None:
    """The method named ``name``, or None where no method is."""
    return METHODS.get(name) if name is not None else None


def runtime_of(name: str) -> Runtime:
    return RUNTIMES[name]
