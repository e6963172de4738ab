"""Per-token divergence of a variant from its baseline, from log-probabilities over the vocabulary.

Two ways, same outputs:
- lockstep: both models run on the same batch; KL(base‖variant) is exact.
- top-k cache: the baseline's k most likely tokens and their log-probs are kept per scored token (k
  int32 ids + k float32 values, not the vocabulary); KL is then computed over k + 1 bins (those tokens
  and the rest). By the data-processing inequality that is a lower bound, and the gap is
  ``P_T · KL(p_T‖q_T)`` for the baseline's tail mass ``P_T``, which is at most
  ``P_T · [log(min(p_k, P_T) / P_T) + log(Q_T / min_{i∈T} q_i)]``: every baseline tail probability is
  at most its k-th largest one, and every variant tail probability at least its smallest. So
  ``kl_low ≤ KL ≤ kl_low + kl_bound``, per token, and we report both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopKCache:
    """The baseline's top-k per scored token, aligned with its ``token_nll``.

    Attributes:
        ids: ``[n, k]`` int32 token ids, most likely first.
        logp: ``[n, k]`` float32 log-probabilities of those tokens.
    """

    ids: torch.Tensor
    logp: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.logp.numel() * self.logp.element_size()


def top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[C, V]`` log-probs → ``([C, k]`` int32 ids, ``[C, k]`` float32 log-probs``)``."""
    values, ids = logp.topk(k, dim=-1)
    return ids.to(torch.int32), values.float()


def exact(logp_base: torch.Tensor, logp_variant: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(base‖variant) and top-1 agreement per row of ``[C, V]`` log-probs."""
    kl = (logp_base.exp() * (logp_base - logp_variant)).sum(-1).clamp_min(0)
    agree = logp_base.argmax(-1) == logp_variant.argmax(-1)
    return {"kl": kl.double(), "kl_bound": torch.zeros_like(kl, dtype=torch.float64), "top1": agree}


def from_top_k(ids: torch.Tensor, logp_base_top: torch.Tensor, logp_variant: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL lower bound, its error bound, and top-1 agreement from the baseline's top-k cache.

    Args:
        ids: ``[C, k]`` the baseline's top-k token ids.
        logp_base_top: ``[C, k]`` their baseline log-probs.
        logp_variant: ``[C, V]`` the variant's log-probs.
    """
    ids = ids.long()
    lp_b = logp_base_top.double()
    lv = logp_variant.double()
    lv_top = lv.gather(-1, ids)
    p_b = lp_b.exp()
    tail_b = (1 - p_b.sum(-1)).clamp_min(0)
    tail_v = (1 - lv_top.exp().sum(-1)).clamp_min(1e-300)
    head = (p_b * (lp_b - lv_top)).sum(-1)
    has_tail = tail_b > 0
    safe_tail_b = torch.where(has_tail, tail_b, torch.ones_like(tail_b))
    kl_low = head + torch.where(has_tail, tail_b * (safe_tail_b.log() - tail_v.log()), torch.zeros_like(head))
    min_tail_v = lv.scatter(-1, ids, float("inf")).min(-1).values  # log of the smallest tail probability
    p_k = p_b[:, -1]
    bound = tail_b * ((torch.minimum(p_k, tail_b).clamp_min(1e-300).log() - safe_tail_b.log())
                      + tail_v.log() - min_tail_v).clamp_min(0)
    agree = ids[:, 0] == lv.argmax(-1)
    return {"kl": kl_low.clamp_min(0), "kl_bound": bound, "top1": agree}
