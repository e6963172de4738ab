"""Peak memory of a block of work: device allocations on CUDA, resident set size on CPU."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import psutil
import torch

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
_active: list[PeakMemory] = []  # open blocks, outermost first: a nested block's reset must not lose their peaks


def _process_peak() -> int:
    """The process's peak RSS since the last reset (Linux ``VmHWM``)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text()).group(1)) * 1024


def _reset_process_peak() -> bool:
    """Start the process's high-water mark again from its current RSS; False where the kernel cannot."""
    try:
        _CLEAR_REFS.write_text("5")
        _process_peak()
    except (OSError, AttributeError):  # not Linux, or a sandbox without these /proc files
        return False
    return True


class PeakMemory:
    """Context manager; ``peak_bytes`` holds the peak after the block. Blocks may nest.

    On CUDA it is ``torch.cuda.max_memory_allocated`` over the block. On CPU it is the process's peak
    resident set size over the block, weights included: exact on Linux (the kernel's high-water mark,
    reset when the block starts), elsewhere sampled every ``interval`` seconds by a thread, which can
    miss a spike shorter than that and takes a little CPU time from the work it measures.
    """

    def __init__(self, device: torch.device | str, interval: float = 0.002) -> None:
        self.device, self.interval, self.peak_bytes = torch.device(device), interval, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _current_peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _process_peak() if self._thread is None else psutil.Process().memory_info().rss

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for outer in _active:
            if outer.device == self.device:
                outer.peak_bytes = max(outer.peak_bytes, outer._current_peak())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not _reset_process_peak():
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._current_peak())
        _active.remove(self)

