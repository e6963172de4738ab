"""What gptq and awq share: gptqmodel makes them here from the baseline and its kernels run them."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field

from tasks.methods.settings import NOT_QUANTIZED_HERE, Given, Grouping, Keys, MethodSettings, first

PACKAGE = ("gptqmodel", "gptqmodel==7.6.0")


class Quantization(Grouping):
    """What gptq and awq are quantized with when made here. ``calibration``: a ``tasks.config.CalibrationConfig``,
    a type of the layer above, which ``VariantSpec`` declares it as."""

    sym: bool | None = None
    calibration: BaseModel | None = None
    refusals: ClassVar[dict[str, str]] = {"sym": NOT_QUANTIZED_HERE, "calibration": NOT_QUANTIZED_HERE}


class Kernel(Keys):
    """gptqmodel's kernel for a gptq or awq checkpoint that is loaded (or one ``auto`` reads as one of them)."""

    kernel: str | None = Field(None, min_length=1, description="gptq/awq: the gptqmodel kernel that runs it (marlin, "
                               "triton, torch, exllama_v2, gemm, ...) instead of the one gptqmodel picks")
    refusals: ClassVar[dict[str, str]] = {
        "kernel": "kernel picks gptqmodel's kernel for a gptq or awq checkpoint, not for method {method}"}

    def kernel_problem(self, given: Given) -> str | None:
        if self.kernel is not None and given.variant.path is None:
            return "kernel applies to a gptq or awq checkpoint that is loaded: give its path"
        return None


class GptqmodelSettings(MethodSettings, Quantization, Kernel):
    """awq's (gptq's, with dynamic): made here with bits, group_size, sym and calibration, or a checkpoint loaded
    from its path with the kernel that runs it."""

    def problem(self, given: Given) -> str | None:
        return first(self.settings_problem(given), self.group_size_problem(given), self.kernel_problem(given))

    def settings_problem(self, given: Given) -> str | None:
        settings = [key for key in Quantization.model_fields if key in self.model_fields_set]  # bits first
        if settings and given.variant.path is not None:
            return f"give either path (a quantized checkpoint) or {', '.join(settings)}, not both"
        return None
