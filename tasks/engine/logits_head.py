"""The head of a model whose runtime gives its logits itself (``tasks.models.llama_cpp``): the engine's "hidden
states" of it are already logits, and its head passes them through. A baseline reference of such a model keeps those
logits as its states (``tasks.audit.reference``), so that every variant's KL is taken against the runtime's own."""

from __future__ import annotations

import torch


class LogitsHead(torch.nn.Module):
    """The identity over ``[..., vocabulary]`` logits."""

    def __init__(self, vocabulary: int):
        super().__init__()
        self.out_features = vocabulary

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
