"""Which tokens each forward pass holds and scores, and the settings that make a plan possible.

Plain Python (no torch): the validated config checks a window, a stride and chunks with the same
functions, and the same messages, as the engine does before it scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.core.errors import InputError
from tasks.engine.settings import MODES

if TYPE_CHECKING:  # a type only: the stream module imports torch, which the validated config need not load
    from tasks.engine.stream import TokenStream


@dataclass(frozen=True)
class Window:
    """Stream tokens ``[start, end)`` go through the model; tokens ``[first_scored, end)`` are scored."""

    index: int
    start: int
    end: int
    first_scored: int

    @property
    def n_scored(self) -> int:
        return self.end - self.first_scored


def check_window(window: int, positions: int | None = None, model: str = "the model") -> None:
    """A window holds a context and a scored token, and no more positions than the model was built for.

    Args:
        positions: the model's maximum positions (``tasks.engine.model_facts.max_positions``), if known.
        model: how the message names the model.
    """
    if window < 2:
        raise InputError(f"window {window} must hold at least 2 tokens (one context, one scored); use 512, say")
    if positions is not None and window > positions:
        raise InputError(f"window {window} is longer than {model}'s {positions} positions; use {positions} or less")


def check_stride(stride: int, window: int, prefix: int = 0) -> None:
    """A sliding window moves by at least one token and less than the stream tokens it holds
    (``window`` less a ``prefix`` of BOS that starts every window)."""
    capacity = window - prefix
    if not 1 <= stride < capacity:
        held = f"{capacity} (the window of {window} less the BOS it starts with)" if prefix else str(window)
        raise InputError(f"stride {stride} must be at least 1 and below {held}; lower the stride")


def chunk_limit(chunks: int | None, window: int, mode: str, max_tokens: int | None) -> int | None:
    """The stream length that ``chunks`` chunks of ``window`` tokens take (llama-perplexity's ``--chunks``):
    a BOS at the stream's start counts toward it, as it takes the first chunk's first slot."""
    if chunks is None:
        return max_tokens
    if mode == "sliding":
        raise InputError("chunks applies to modes gptq and llama.cpp; with the sliding window use max_tokens")
    if max_tokens is not None:
        raise InputError("give chunks or max_tokens, not both")
    if chunks < 1:
        raise InputError(f"chunks is {chunks}; give at least 1")
    return chunks * window


def check_plan(window: int, stride: int, mode: str, prefix: int = 0, positions: int | None = None) -> None:
    """A plan can be made in ``mode`` with this window, stride and BOS ``prefix`` (tokens before every
    window: 1 with the ``window`` BOS policy), for a model of ``positions`` positions if known; the chunk
    modes place their BOS themselves."""
    if mode not in MODES:
        raise InputError(f"unknown mode '{mode}'; use one of {', '.join(MODES)}")
    check_window(window, positions)
    if mode != "sliding":
        if prefix:
            raise InputError(f"mode {mode} does its own BOS handling; use bos stream or none with it")
        return
    check_stride(stride, window, prefix)


def check_settings(window: int, stride: int, batch_size: int | str, stream: TokenStream, positions: int | None,
                   mode: str = "sliding") -> None:
    """Refuse settings the engine cannot honour on ``stream`` with a model of ``positions`` positions
    (if known), before any forward pass."""
    if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
        raise InputError(f"batch size {batch_size} must be a whole number of at least 1, or auto")
    check_plan(window, stride, mode, len(stream.prefix), positions)


def plan_windows(n_tokens: int, window: int, stride: int, first_scored: int = 1) -> list[Window]:
    """Cover a stream of ``n_tokens`` with sliding windows.

    Args:
        n_tokens: stream length N.
        window: the most tokens one window holds (L).
        stride: how far each window's end moves (S, ``1 <= S < L``).
        first_scored: the first stream position to score: 1, or 0 when a prefix (BOS) precedes every
            window and so gives the first token a context.
    """
    check_stride(stride, window)
    windows: list[Window] = []
    scored_until = first_scored
    while scored_until < n_tokens:
        end = min(window + len(windows) * stride, n_tokens)
        windows.append(Window(len(windows), max(0, end - window), end, scored_until))
        scored_until = end
    return windows


def plan_chunks(n_tokens: int, window: int, mode: str) -> list[Window]:
    """Disjoint ``window``-token chunks of the published conventions; the tail that does not fill one is dropped.

    - ``gptq`` (the GPTQ/AWQ papers): every token of a chunk but its first is scored.
    - ``llama.cpp`` (``llama-perplexity``): only the second half of each chunk is scored (tokens
      ``window//2 + 1 .. window - 1``); the caller writes BOS over each chunk's first token.
    """
    chunks = n_tokens // window
    if chunks == 0:
        raise InputError(f"mode {mode} needs at least one full window: the stream has {n_tokens} tokens, the window "
                         f"{window}; lower --window or give more text")
    first = 1 if mode == "gptq" else window // 2 + 1
    return [Window(i, i * window, (i + 1) * window, i * window + first) for i in range(chunks)]


def plan(stream: TokenStream, window: int, stride: int, mode: str = "sliding") -> list[Window]:
    """The windows of a run in any mode."""
    if mode == "sliding":
        return plan_windows(len(stream.ids), window - len(stream.prefix), stride, stream.first_scored)
    return plan_chunks(len(stream.ids), window, mode)
