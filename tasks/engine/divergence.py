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


# llama-perplexity keeps each base log-prob in 16 bits over the 16 nats below the top (65,535 steps of its range)
LLAMA_PERPLEXITY_RANGE = 16.0
LLAMA_PERPLEXITY_STEPS = 65535


def as_llama_perplexity(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(base‖variant) per row of ``[C, V]`` float32 logits as llama-perplexity estimates it (tools/perplexity/
    perplexity.cpp, ``log_softmax`` with a ``--kl-divergence-base``), float64 ``[C]``: each base log-prob stored in 16
    bits between the top and 16 below it, those whose log-prob is not above -16 left out of the sum. It is 0.1-0.4%
    from ``exact``'s KL on the embedded model; a publisher's KLD table is this estimate, and can be set beside it."""
    top = base_logits.max(-1, keepdim=True).values
    floor = torch.maximum(base_logits.min(-1, keepdim=True).values, top - LLAMA_PERPLEXITY_RANGE)
    log_sum = torch.log(torch.exp(base_logits - top).double().sum(-1, keepdim=True)).float()
    scale = (top - floor) / LLAMA_PERPLEXITY_STEPS
    # llama.cpp's nearest_int rounds half to even, as torch.round does; a flat row (scale 0) stores zeros
    steps = torch.where(base_logits > floor, torch.round((base_logits - floor) * (1 / scale)), 0).where(scale > 0, 0)
    log_base = scale * steps + (floor - top - log_sum)
    variant_top = logits.max(-1, keepdim=True).values
    log_variant = logits - variant_top - torch.log(torch.exp(logits - variant_top).double().sum(-1, keepdim=True)).float()
    terms = torch.exp(log_base) * (log_base - log_variant)
    return terms.where(log_base > -LLAMA_PERPLEXITY_RANGE, 0).double().sum(-1)
