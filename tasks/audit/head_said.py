"""An LM head stored beside a baseline reference's states (``head.safetensors``, ``tasks.audit.reference.lm_head``):
its tensors by the names the file holds them under. This module alone reads and writes those names."""

from __future__ import annotations

from pathlib import Path

import torch


def save_stored_head(path: Path, tensors: list[torch.Tensor]) -> None:
    """Store a head's tensors (its weight, then its bias where it has one), on the host and contiguous."""
    from safetensors.torch import save_file

    save_file(dict(zip(("weight", "bias"), (t.cpu().contiguous() for t in tensors))), path)


def stored_head(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of a stored head (bias None: it has none)."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    return tensors["weight"], tensors.get("bias")
