"""auto: a checkpoint whose method is read from its files (tasks.models.formats.detect): the default with a path."""

from __future__ import annotations

from tasks.methods.gguf import GgufFile
from tasks.methods.gptqmodel import Kernel
from tasks.methods.method import Method
from tasks.methods.settings import Given, MethodSettings, first


class AutoSettings(MethodSettings, GgufFile, Kernel):
    """gguf_file: a GGUF file is read as one; kernel: a gptq or awq checkpoint is one of the two once read."""

    def problem(self, given: Given) -> str | None:
        return first(self.gguf_file_problem(given), super().problem(given), self.kernel_problem(given))


METHOD = Method("auto", detected=True, needs_path=True, settings=AutoSettings)
