"""gguf: a GGUF file (a .gguf path, or the embedded model's), or one llama.cpp's quantizer makes from the baseline's
(type, imatrix, tensor_types); dequantized in transformers, or run as it is in llama.cpp; tuned tensor by tensor."""

from tasks.methods.method import Method, Tune, Variant


class Gguf(Method):
    def path_problem(self, spec: Variant) -> str | None:
        if spec.path not in (None, "embedded") and spec.gguf_file is None and not spec.path.endswith(".gguf"):
            return (f"method gguf loads a .gguf file, and {spec.path} is not one: give the file as path, "
                    "or its folder as path and the file's name as gguf_file")
        return None

    def source_problem(self, spec: Variant) -> str | None:
        if spec.path is None and spec.type is None:
            return "method gguf loads a .gguf file (path) or makes one from the baseline (type: Q4_K_M, ...)"
        return None

    def made_here(self, spec: Variant) -> bool:
        return spec.type is not None


METHOD = Gguf("gguf", gguf=True, quantized_layers=False,  # dequantized as it loads
              package=("gguf", "gguf"), tune=Tune(recipe="tensor_types", gptqmodel=False))
