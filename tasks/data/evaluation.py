"""What every model of an audit is scored on, and how: one token stream and the validated settings."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.config import EvaluationConfig
from tasks.data.corpus import cached_tokenize, default_bos
from tasks.engine.perplexity import count_scored_text
from tasks.engine.stream import TokenStream
from tasks.engine.windows import chunk_limit


@dataclass(frozen=True)
class Evaluation:
    """What is scored and how: the same for every model of an audit.

    Attributes:
        stream: the evaluated token stream.
        text: the whole corpus text (calibration may come from the part not evaluated).
        evaluated: ``[start, end)`` of the evaluated tokens in the corpus's BOS-free token stream.
        settings: window, stride, batch size, mode, divergence and top-k, validated.
    """

    stream: TokenStream
    text: str
    evaluated: tuple[int, int]
    settings: EvaluationConfig


def evaluation(text: str, tokenizer, settings: EvaluationConfig, progress: bool = False) -> Evaluation:
    """Tokenize ``text`` once, as ``settings`` say: ``bos`` None takes the mode's own convention
    (``default_bos``), ``chunks`` limits a chunk mode to its first chunks."""
    max_tokens = chunk_limit(settings.chunks, settings.window, settings.mode, settings.max_tokens)
    stream = cached_tokenize(text, tokenizer, settings.bos or default_bos(tokenizer, settings.mode), max_tokens,
                             "tokenize" if progress else None)
    if settings.mode != "sliding":
        stream = count_scored_text(stream, tokenizer, settings.window, settings.mode)
    evaluated_text_tokens = len(stream.ids) - (1 if stream.bos == "stream" else 0)
    return Evaluation(stream, text, (0, evaluated_text_tokens), settings)
