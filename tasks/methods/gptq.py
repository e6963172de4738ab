"""gptq: made here from the baseline with gptqmodel (bits, group_size, sym, calibration; dynamic: per module), or a
GPTQ checkpoint loaded from its path; the method ppl-audit tune sets module by module."""

from __future__ import annotations

from typing import ClassVar

from tasks.methods import gptqmodel
from tasks.methods.method import Method, Tune
from tasks.methods.settings import Given, Keys, first

MADE_HERE_ONLY = ("dynamic overrides how gptqmodel quantizes some modules of a gptq variant made here from the "
                  "baseline: give it with method gptq and no path")


class Dynamic(Keys):
    """gptqmodel's per-module overrides of a gptq checkpoint made here; ``tasks.config.GptqDynamic`` checks its
    patterns and numbers (``VariantSpec`` declares it so)."""

    dynamic: dict[str, dict[str, int]] | None = None  # +:REGEX: {bits, group_size}, -:REGEX: {} (left unquantized)
    refusals: ClassVar[dict[str, str]] = {"dynamic": MADE_HERE_ONLY}


class GptqSettings(gptqmodel.GptqmodelSettings, Dynamic):
    """awq's settings, and dynamic: overrides of how some modules of one made here are quantized."""

    def problem(self, given: Given) -> str | None:
        made_here_only = MADE_HERE_ONLY if self.dynamic is not None and given.variant.path is not None else None
        return first(self.settings_problem(given), self.group_size_problem(given), made_here_only,
                     self.kernel_problem(given))


METHOD = Method(
    "gptq", quantized_here=True, settings=GptqSettings, gptqmodel_kernels=True, package=gptqmodel.PACKAGE,
    also_versions=("optimum",),
    # what gptqmodel 7.6.0's torch kernel (TorchLinear) takes: the kernel that runs on every device
    kernel_group_sizes=(-1, 16, 32, 64, 128, 256, 512, 1024),
    tune=Tune(recipe="dynamic", gptqmodel=True))
