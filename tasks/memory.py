"""Peak memory of a block of work: device allocations on CUDA, resident set size on CPU."""

from __future__ import annotations

import threading

import psutil
import torch


class PeakMemory:
    """Context manager; ``peak_bytes`` holds the peak after the block.

    On CUDA it is ``torch.cuda.max_memory_allocated`` over the block. On CPU a thread samples the
    process's resident set size every ``interval`` seconds (torch has no CPU allocator statistics), so
    a spike shorter than the interval can be missed; the whole process is counted, weights included.
    """

    def __init__(self, device: torch.device | str, interval: float = 0.002) -> None:
        self.device, self.interval, self.peak_bytes = torch.device(device), interval, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, psutil.Process().memory_info().rss)
