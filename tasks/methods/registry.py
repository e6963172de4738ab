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
from tasks.methods.gguf import GgufFile, Quantizer
from tasks.methods.gptq import Dynamic
from tasks.methods.gptqmodel import Kernel, Quantization
from tasks.methods.method import Method
from tasks.methods.runtimes import LLAMA_CPP, TRANSFORMERS, Runtime
from tasks.methods.settings import Given, Keys, Variant

# in the order the config's refusal of an unknown method lists them
METHODS: dict[str, Method] = {m.name: m for m in (auto.METHOD, baseline.METHOD, bnb_int8.METHOD, bnb_nf4.METHOD,
                                                  gptq.METHOD, awq.METHOD, torchao_int8.METHOD,
                                                  compressed_tensors.METHOD, gguf.METHOD, hqq.METHOD, fp8.METHOD)}
RUNTIMES: dict[str, Runtime] = {r.name: r for r in (TRANSFORMERS, LLAMA_CPP)}

QUANTIZED_BY_US = tuple(name for name, m in METHODS.items() if m.quantized_here)
QUANTIZED_AT_LOAD = tuple(name for name, m in METHODS.items() if m.quantized_at_load)
KERNEL_GROUP_SIZES = {name: m.kernel_group_sizes for name, m in METHODS.items() if m.kernel_group_sizes}


class MethodKeys(Kernel, Dynamic, Quantizer, GgufFile, Quantization):
    """Every key some method takes (each family's own, tasks.methods.settings), composed into tasks.config.VariantSpec:
    one base here per family. pydantic orders fields from the last base: bits, group_size, sym, calibration,
    gguf_file, type, imatrix, tensor_types, dynamic, kernel."""


# each key's words for a variant of a method that does not take it, in the order a variant giving several is told of
# them (MethodKeys')
REFUSALS = {key: family.refusals[key] for key in MethodKeys.model_fields
            for family in MethodKeys.__mro__ if issubclass(family, Keys) and key in family.refusals}


def method_of(name: str) -> Method:
    """The method named ``name`` (a validated spec's: a KeyError otherwise; ``find_method`` for a name not checked yet)."""
    return METHODS[name]


def find_method(name: str | None) -> Method | None:
    """The method named ``name``, or None where no method is."""
    return METHODS.get(name) if name is not None else None


def runtime_of(name: str) -> Runtime:
    return RUNTIMES[name]


def method_keys_given(spec: Variant) -> dict[str, object]:
    """The keys only some methods take that ``spec`` gives (other than their defaults), for its method's settings to
    validate: less any its method reads as part of another it is given with (``MethodSettings.taken_with``)."""
    given = {key: value for key, field in MethodKeys.model_fields.items()
             if (value := getattr(spec, key)) != field.default}
    taken_with = method_of(spec.method).settings.taken_with
    return {key: value for key, value in given.items() if not (key in taken_with and taken_with[key] in given)}


def validate_settings(spec: Variant) -> None:
    """Validate the method keys ``spec`` gives with its method's own settings (a pydantic ``ValidationError`` where
    they do not fit it: ``refusal_of`` words those it does not take)."""
    backend = method_of(spec.method)
    backend.settings.model_validate(method_keys_given(spec), context=Given(spec, backend))


def refusal_of(keys: list[str], method: str) -> str:
    """What a variant of ``method`` that gives ``keys``, which it does not take, is told: of the first (in
    ``REFUSALS``' order), in its method's own words where it has them, with the others said in the same words."""
    words = REFUSALS | method_of(method).settings.says
    ordered = [key for key in REFUSALS if key in keys]
    said = words[ordered[0]]
    alike = [key for key in REFUSALS if REFUSALS[key] == REFUSALS[ordered[0]]]  # bits, group_size, sym, calibration
    takers = [name for name, m in METHODS.items() if any(key in m.settings.model_fields for key in alike)]
    return said.format(keys=", ".join(key for key in ordered if words[key] == said), method=method,
                       takers=_listed(takers))


def _listed(names: list[str]) -> str:
    """``a, b and c``."""
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
