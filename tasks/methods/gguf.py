"""gguf: a GGUF file (a .gguf path, or the embedded model's), or one llama.cpp's quantizer makes from the baseline's
(type, imatrix, tensor_types); dequantized in transformers, or run as it is in llama.cpp; tuned tensor by tensor."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from tasks.methods.method import Method, Tune
from tasks.methods.settings import Given, Keys, MethodSettings, Variant, first

IMATRIX_WITH_TYPE = "imatrix quantizes a GGUF file llama.cpp's quantizer makes: give it with method gguf and a type"
TENSOR_TYPES_WITH_TYPE = ("tensor_types sets some tensors' types in a GGUF file llama.cpp's quantizer makes: give it "
                          "with method gguf and a type")
IN_A_FOLDER = "gguf_file names a file in the folder given as path, with method gguf (or auto)"
TYPE_WITHOUT_PATH = ("type is the GGUF type llama.cpp's quantizer makes from the baseline: give it with method gguf "
                     "and no path")


class GgufFile(Keys):
    """A .gguf file in the folder given as path (gguf's, or one auto reads)."""

    gguf_file: str | None = None
    refusals: ClassVar[dict[str, str]] = {"gguf_file": IN_A_FOLDER}

    def gguf_file_problem(self, given: Given) -> str | None:
        return IN_A_FOLDER if self.gguf_file is not None and given.variant.path is None else None


class Quantizer(Keys):
    """What llama.cpp's quantizer makes a GGUF file from the baseline's with."""

    type: str | None = Field(None, pattern=r"^[A-Za-z0-9_]+$", description="method gguf without a path: the GGUF "
                             "type llama.cpp's quantizer makes from the baseline's GGUF file (Q4_K_M, Q8_0, F32, ...)")
    imatrix: bool = Field(False, description="with type: quantize with an importance matrix llama-imatrix computes "
                          "from the calibration text (calibration: as gptq's; the audit's unevaluated tokens unless given)")
    tensor_types: list[Annotated[str, Field(pattern=r"^[^=\s]+=[A-Za-z0-9_]+$")]] | None = Field(
        None, description="with type: llama-quantize --tensor-type entries (PATTERN=TYPE, the first whose pattern a "
        "tensor's name contains wins), a mixed-precision recipe as `ppl-audit tune` writes it")
    refusals: ClassVar[dict[str, str]] = {"type": TYPE_WITHOUT_PATH, "imatrix": IMATRIX_WITH_TYPE,
                                          "tensor_types": TENSOR_TYPES_WITH_TYPE}


class GgufSettings(MethodSettings, GgufFile, Quantizer):
    """A .gguf file as path, or type (with imatrix and tensor_types) for one made from the baseline's."""

    # with imatrix, calibration is the text its importance matrix is computed from
    taken_with: ClassVar[dict[str, str]] = {"calibration": "imatrix"}

    def problem(self, given: Given) -> str | None:
        path = given.variant.path
        return first(IMATRIX_WITH_TYPE if self.imatrix and self.type is None else None,
                     self.gguf_file_problem(given), _not_a_gguf_file(given.variant),
                     TENSOR_TYPES_WITH_TYPE if self.tensor_types is not None and self.type is None else None,
                     TYPE_WITHOUT_PATH if self.type is not None and path is not None else None,
                     "method gguf loads a .gguf file (path) or makes one from the baseline (type: Q4_K_M, ...)"
                     if path is None and self.type is None else None)


def _not_a_gguf_file(spec: Variant) -> str | None:
    if spec.path not in (None, "embedded") and spec.gguf_file is None and not spec.path.endswith(".gguf"):
        return (f"method gguf loads a .gguf file, and {spec.path} is not one: give the file as path, "
                "or its folder as path and the file's name as gguf_file")
    return None


class Gguf(Method):
    def made_here(self, spec: Variant) -> bool:
        return spec.type is not None


METHOD = Gguf("gguf", gguf=True, quantized_layers=False,  # dequantized as it loads
              settings=GgufSettings, package=("gguf", "gguf"), tune=Tune(recipe="tensor_types", gptqmodel=False))
