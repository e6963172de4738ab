"""hqq: the baseline (or any float model given as path) quantized as it loads, with HQQ's own API on one device."""

from __future__ import annotations

from typing import ClassVar

from tasks.methods.method import Method
from tasks.methods.settings import Given, Grouping, MethodSettings

CALIBRATED_NOT = "hqq quantizes at load without calibration: give bits and group_size only"


class HqqSettings(MethodSettings, Grouping):
    """bits and group_size, with a path too (hqq quantizes whatever float model it loads)."""

    says: ClassVar[dict[str, str]] = {"sym": CALIBRATED_NOT, "calibration": CALIBRATED_NOT}

    def problem(self, given: Given) -> str | None:
        return self.group_size_problem(given)


class Hqq(Method):
    def group_size_problem(self, group_size: int) -> str | None:
        if group_size < 1 or group_size % 8:  # HQQ asserts it
            return f"hqq group_size {group_size} is not a positive multiple of 8 (HQQ's groups); use 64, say"
        return None


METHOD = Hqq("hqq", quantized_at_load=True, settings=HqqSettings, one_device=True, package=("hqq", "hqq==0.2.8.post1"),
             in_formats_extra=True)
