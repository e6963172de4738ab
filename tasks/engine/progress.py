"""What a run scoring windows in a given order has done so far (``Progress``): what a sequential stop judges.

Plain Python at import (torch only for the type): below ``perplexity`` and ``scoring_options``, which both name it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PROGRESS_FIGURES = ("nll", "kl", "kl_reverse", "top1")  # the per-token figures a gate judges, summed by window


@dataclass
class Progress:
    """What a run scoring windows in a given order has done so far, for ``until`` to judge after each batch.

    Attributes:
        order: the plan's indices of the windows scored, in the order scored.
        sums: per-window float64 sums of each figure of ``PROGRESS_FIGURES`` (``nll``, and ``kl``, ``kl_reverse``,
            ``top1`` with a baseline), by window index; the windows not scored yet hold 0.
        tokens: ``[n_windows]`` tokens each window of the plan scores.
        batch_size: windows per forward pass.
    """

    order: list[int]
    sums: dict[str, torch.Tensor]
    tokens: torch.Tensor
    batch_size: int

    def add(self, windows: list[int], figures: Mapping[str, torch.Tensor]) -> None:
        """Windows scored, in this order: the one way a run's progress grows, after a batch here
        (``perplexity.score_windows``) as after a piece back from a cluster (``flows.runners``), so that a
        sequential stop judges the same sums wherever the windows were scored.

        Args:
            windows: the plan's indices of the windows, in the order scored.
            figures: per-token figures by name, the windows' tokens one window after another (``tokens`` of
                each); those of ``PROGRESS_FIGURES`` are summed per window in float64, the others are not judged.
        """
        import torch  # here, not at import: the modules that only name a Progress stay free of torch

        self.order += windows
        split = self.tokens[windows].tolist()
        for key, value in figures.items():
            if key not in PROGRESS_FIGURES:
                continue
            sums = self.sums.setdefault(key, torch.zeros(len(self.tokens), dtype=torch.float64))
            for w, part in zip(windows, value.split(split)):
                sums[w] = part.double().sum()  # as the engine sums a window's NLL (window_nll): the same bits
