"""The descriptor of a quantization method: what ppl-audit does with it, and which of a variant's settings it takes."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.methods.settings import MethodSettings, Variant


@dataclass(frozen=True)
class Tune:
    """What ``ppl-audit tune`` does with a method: the spec field its recipe sets, and what makes the models."""

    recipe: str  # dynamic (gptqmodel's per-module overrides) or tensor_types (llama-quantize --tensor-type)
    gptqmodel: bool  # gptqmodel makes and loads each option's checkpoint; else llama.cpp's quantizer its file


@dataclass(frozen=True)
class Method:
    """One quantization method (``method:`` of a variant). The defaults are a checkpoint loaded as it is."""

    name: str
    quantized_here: bool = False  # made from the baseline here with gptqmodel when no path is given
    quantized_at_load: bool = False  # without a path: the baseline, quantized as it loads
    # the keys of a variant it takes beyond every variant's, and its rules (tasks.methods.settings; default: none)
    settings: type[MethodSettings] = MethodSettings
    kernel_group_sizes: tuple[int, ...] | None = None  # the group sizes its kernels run
    gptqmodel_kernels: bool = False  # loaded by gptqmodel, which picks the kernel (kernel:) that runs its layers
    gguf: bool = False  # a GGUF file: a .gguf path, or type (made by llama.cpp's quantizer), imatrix, tensor_types
    detected: bool = False  # what it is, read from the checkpoint's files (auto)
    float_model: bool = False  # a float model as it is (the baseline's method)
    needs_path: bool = False  # loads a checkpoint: nothing to make without one
    one_device: bool = False  # quantized through its own API on one device: no device_map
    quantized_layers: bool = True  # loads with quantized layers (a GGUF file is dequantized as it loads)
    package: tuple[str, str] | None = None  # the module it imports and what to pip install for it
    in_formats_extra: bool = False  # pyproject's `formats` extra installs its package
    also_versions: tuple[str, ...] = ()  # packages besides its own whose versions its loading depends on
    gpu_only: str | None = None  # why it cannot run on CPU
    saved_on_cpu: str | None = None  # why a saved checkpoint of it cannot load on CPU
    tune: Tune | None = None  # what ppl-audit tune may do with it (None: nothing)
    tune_refusal: str = ""  # said after tune's refusal of it, where there is more to say

    @property
    def takes_dynamic(self) -> bool:
        """dynamic: gptqmodel's per-module overrides, made here from the baseline (gptq)."""
        return "dynamic" in self.settings.model_fields

    def group_size_problem(self, group_size: int) -> str | None:
        """Why ``group_size`` cannot be run (None: it can): one its kernels do not take."""
        sizes = self.kernel_group_sizes
        if sizes is None or group_size in sizes:
            return None
        return (f"group_size {group_size} is not one {self.name} kernels support; use one of "
                f"{', '.join(map(str, sizes))} (-1: per channel)")

    def source_problem(self, spec: Variant) -> str | None:
        """Why there is nothing to load or make (None: there is)."""
        if self.needs_path and spec.path is None:
            return f"method {self.name} loads a checkpoint: give its path"
        return None

    def is_gguf(self, location: str | None) -> bool:
        """Whether a variant of this method at ``location`` is a GGUF file (what llama.cpp runs)."""
        if self.detected or self.float_model:  # the file's own format
            return (location or "").endswith(".gguf")
        return self.gguf

    def what(self, path: str | None) -> str:
        """The variant in a refusal: its path where the file says what it is, else the method and path."""
        if self.detected or self.float_model:
            return str(path)
        return f"{self.name} {path or ''}".strip()

    def made_here(self, spec: Variant) -> bool:
        """Whether the variant is made here from the baseline (a gptqmodel checkpoint, a GGUF file)."""
        return self.quantized_here and spec.path is None
