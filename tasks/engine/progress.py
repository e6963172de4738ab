"""What a run scoring windows in a given order has done so far (``Progress``): what a sequential stop judges.

Plain Python at import (torch only for the type): below ``perplexity`` and ``scoring_options``, which both name it.
"""

from __future__ import annotations

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
