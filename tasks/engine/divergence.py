"""Per-token divergence of a variant from its baseline, from both models' log-probabilities over the
whole vocabulary (the baseline's come from its stored final hidden states through its own LM head)."""

from __future__ import annotations

import torch


def exact(logp_base: torch.Tensor, logp_variant: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL in both directions, top-1 agreement and each model's most likely token per row of ``[C, V]`` log-probs.

    Returns:
        ``kl``: KL(base‖variant), as llama.cpp reports it; ``kl_reverse``: KL(variant‖base); ``top1``:
        whether both put the same token first; ``base_top`` and ``top``: the token each puts first (int32);
        ``base_top_p``: the baseline's probability of its own first (float32). KLs are float64 ``[C]``,
        clamped at 0 (rounding can leave a few ulps below it).
    """
    difference = logp_base - logp_variant
    forward = (logp_base.exp() * difference).sum(-1).clamp_min(0)
    reverse = -(logp_variant.exp() * difference).sum(-1)
    reverse = reverse.clamp_min(0)
    base_top_logp, base_top = logp_base.max(-1)  # the top token and its log-prob in the one pass argmax took
    top = logp_variant.argmax(-1)
    return {"kl": forward.double(), "kl_reverse": reverse.double(), "top1": base_top == top,
            "base_top": base_top.int(), "top": top.int(), "base_top_p": base_top_logp.exp().float()}
