"""What every model of an audit is scored on, and how: one token stream and the validated settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from tasks.config import EvaluationConfig
from tasks.core.errors import InputError
from tasks.data.corpus import cached_tokenize, default_bos
from tasks.engine.perplexity import count_scored_text
from tasks.engine.stream import TokenStream
from tasks.engine.windows import Window, chunk_limit, plan


@dataclass(frozen=True)
class Evaluation:
    """What is scored and how: the same for every model of an audit.

    Attributes:
        stream: the evaluated token stream.
        text: the whole corpus text (calibration may come from the part not evaluated).
        evaluated: ``[start, end)`` of the evaluated tokens in the corpus's BOS-free token stream.
        settings: window, stride, batch size, mode, divergence and top-k, validated.
        calibrated_on: in an audit of several corpora, the domain whose text not evaluated calibrates the gptq/awq
            variants made here (the first: one quantization for every domain); None: this one.
    """

    stream: TokenStream
    text: str
    evaluated: tuple[int, int]
    settings: EvaluationConfig
    calibrated_on: Evaluation | None = None
    # where the stream is llama.cpp's tokenization: how transformers' tokenizer of the same text parts from it
    # (``tasks.models.llama_cpp.stream_difference``), None where they agree or were not compared
    tokens_differ: dict | None = None
    tokenized_by: str = "transformers"  # what made the stream: transformers' tokenizer, or llama.cpp's of a file

    @cached_property
    def windows(self) -> list[Window]:
        """The windows every model is scored on (``tasks.engine.windows.plan`` of the stream and settings): planned
        once per domain, then carried."""
        return plan(self.stream, self.settings.window, self.settings.stride, self.settings.mode)

    @property
    def calibration(self) -> Evaluation:
        """The evaluation whose corpus calibrates the variants made here (``calibrated_on``, else this one)."""
        return self.calibrated_on or self

    def calibrating(self, first: Evaluation) -> Evaluation:
        """This domain's evaluation, its variants calibrated on ``first``'s corpus."""
        return replace(self, calibrated_on=first.calibration)


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


UNKNOWN_LIMIT = 0.01  # more of a text's tokens than this the tokenizer's unknown token: it cannot encode the text


def check_encodable(stream: TokenStream, tokenizer, where: str) -> None:
    """Refuse a text the tokenizer cannot encode: one whose tokens are more than ``UNKNOWN_LIMIT`` its unknown token
    (a script its vocabulary lacks, without byte fallback), whose perplexity would measure how often it guesses
    ``<unk>``. A byte-level tokenizer has no unknown token and encodes any text."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is None:
        return
    count = int((stream.ids == unknown).sum())
    if count > UNKNOWN_LIMIT * len(stream.ids):
        raise InputError(f"{where}: the baseline's tokenizer cannot encode this text: {count} of its {len(stream.ids)} "
                         f"tokens are its unknown token {tokenizer.unk_token!r}; remove the domain, or audit a model "
                         "whose vocabulary covers its script")
