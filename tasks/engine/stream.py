"""The token stream every model of an audit is scored on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.engine.settings import BosPolicy


@dataclass(frozen=True)
class TokenStream:
    """One corpus as one token stream, ready for the sliding window.

    Attributes:
        ids: ``[N]`` int64 token ids; starts with BOS under the ``stream`` policy.
        prefix: ids put before every window (BOS under the ``window`` policy, else empty).
        bos: the BOS policy that built it.
        n_bytes: UTF-8 bytes of the text whose tokens are scored.
        n_words: whitespace-separated words of that text.
        text_digest: sha256 of the corpus text.
        bos_id: the tokenizer's BOS id, if it has one.
        counted_for: the mode whose scored text ``n_bytes``/``n_words`` count: ``sliding`` scores the
            whole text; a chunk mode drops text, so its stream is counted again (``count_scored_text``).
    """

    ids: torch.Tensor
    prefix: tuple[int, ...]
    bos: BosPolicy
    n_bytes: int
    n_words: int
    text_digest: str
    bos_id: int | None = None
    counted_for: str = "sliding"

    @property
    def first_scored(self) -> int:
        """Stream position of the first scored token: every later token is scored too."""
        return 0 if self.prefix else 1
