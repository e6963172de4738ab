"""Where in the text each variant of an audit loses against its baseline (``tasks.record.where``), its tokens of
largest KL with the text around them: a reviewer reads words, not token ids."""

from __future__ import annotations

import numpy as np

from tasks.data.evaluation import Evaluation
from tasks.engine.perplexity import scored_positions, scored_targets, token_slots
from tasks.engine.stream import TokenStream
from tasks.engine.token_figures import TokenFigures
from tasks.engine.windows import Window
from tasks.record.contents import token_windows
from tasks.record.results import VariantResult
from tasks.record.where import ListedToken, TokenPlaces, where_figures

CONTEXT_TOKENS = 12  # of the text before a listed token, inside its window: enough to read the phrase it ends


def where_of(outcome: VariantResult, baseline: VariantResult, evaluation_: Evaluation, tokenizer) -> dict | None:
    """``where_figures`` of a scored variant against the baseline's NLL of the same tokens (a stopped run's windows
    only), each listed token with its context and its target and top tokens decoded (``context``, ``target_text``,
    ``base_top_text``, ``top_text``); None when either model was not scored or they did not score the same tokens.

    Args:
        tokenizer: the one that made ``evaluation_``'s stream (the baseline's).
    """
    if not (outcome.ok and baseline.ok):
        return None
    result, base = outcome.result, baseline.result
    slots = slice(None) if result.scored_windows is None else token_slots(base.window_tokens, result.scored_windows)
    base_nll = base.token_nll[slots]
    if len(base_nll) != len(result.token_nll):
        return None
    return located(base_nll, result.token_nll, result.extra, slots, token_windows(result), evaluation_, tokenizer)


def located(base_nll: np.ndarray, nll: np.ndarray, figures: TokenFigures[np.ndarray], slots, windows: np.ndarray,
            evaluation_: Evaluation, tokenizer) -> dict:
    """``where_figures`` of paired per-token arrays that hold the tokens ``slots`` of the plan's token arrays (all
    of them: ``slice(None)``), of the windows ``windows`` (each token's), with the listed tokens decoded."""
    settings, stream = evaluation_.settings, evaluation_.stream
    plan_of = (stream, settings.window, settings.stride, settings.mode)
    places = TokenPlaces(scored_positions(*plan_of)[slots], windows, scored_targets(*plan_of).numpy()[slots])
    planned = evaluation_.windows
    return where_figures(base_nll, nll, figures, places, settings.window,
                         lambda top: _decoded(top, planned[top.window], stream, tokenizer))


def _decoded(top: ListedToken, window: Window, stream: TokenStream, tokenizer) -> dict[str, str]:
    """A listed token's context (the ``CONTEXT_TOKENS`` before it in its window) and its three tokens, as text."""
    place = window.start + top.position - len(stream.prefix)  # its place in the stream
    context = stream.ids[max(window.start, place - CONTEXT_TOKENS) : place].tolist()
    return {"context": tokenizer.decode(context)} | {f"{key}_text": _token_text(token, tokenizer) for key, token
                                                       in (("target", top.target), ("base_top", top.base_top),
                                                           ("top", top.top))}


def _token_text(token: int, tokenizer) -> str:
    """One token as text; an id past the tokenizer's, which a head padded wider than the vocabulary can put first,
    as its number (a slow tokenizer would raise on it, and lose the audit's record with it)."""
    return tokenizer.decode([token]) if token < len(tokenizer) else f"<id {token}>"
