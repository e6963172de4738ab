"""What a variant's divergence is measured against: the baseline as the engine reads it, a whole run's
(``Baseline``: its LM head and a source of its hidden states) and one batch's (``BaselineBatch``).

Below ``perplexity`` and ``scoring_options``, which both name it: neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tasks.core.errors import DamagedReference


@dataclass
class BaselineBatch:
    """The baseline's head and its final hidden states ``[T, H]`` for the batch a variant is scoring, with
    the NLL the baseline gave these tokens when it was scored (``nll``, ``[T]``; None: not checked)."""

    head: torch.nn.Module
    hidden: torch.Tensor
    softcap: float | None
    nll: torch.Tensor | None = None
    tolerance: float = 0.0
    source: str = "the baseline reference"
    llama_kld: bool = False  # also KL as llama-perplexity estimates it (``divergence.as_llama_perplexity``)

    def check(self, base_nll: torch.Tensor, start: int) -> None:
        """Refuse a reference whose head and hidden states do not give back its own NLL (rows ``start:``):
        damaged hidden states would give every variant a wrong KL, not an error."""
        if self.nll is None:
            return
        stored = self.nll[start : start + len(base_nll)].to(base_nll.device, base_nll.dtype)
        difference = (base_nll - stored).abs()
        worst = float(difference.max()) if len(difference) else 0.0
        if not worst <= self.tolerance:  # NaN too
            raise DamagedReference(f"{self.source} is damaged: its LM head on its hidden states gives NLLs up to "
                                   f"{worst:.3g} away from its stored ones (float noise is {self.tolerance:g}); "
                                   "the next audit scores the baseline again (`ppl-audit reference verify` checks "
                                   "every stored reference)")


@dataclass
class Baseline:
    """What a variant's divergence is measured against: the baseline's LM head and a source of its final
    hidden states at the scored positions (a stored reference, ``tasks.audit.reference``).

    Attributes:
        states: ``(slots, inputs) -> [T, H]``: the hidden states of the scored tokens ``slots`` (their
            places in the token arrays), given the batch's ``(input_ids, mask, row_index, columns)``.
        nll: ``slots -> [T]``: the NLL the baseline gave those tokens when it was scored, checked against
            what its head makes of ``states`` (within ``tolerance``); None: not checked.
        source: how a damaged one is named.
        llama_kld: also measure each token's KL as llama-perplexity estimates it (``kl_llama``, mode llama.cpp).
    """

    head: torch.nn.Module
    softcap: float | None
    states: Callable[[torch.Tensor, tuple], torch.Tensor]
    nll: Callable[[torch.Tensor], torch.Tensor] | None = None
    tolerance: float = 0.0
    source: str = "the baseline reference"
    llama_kld: bool = False
