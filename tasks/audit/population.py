"""The name of an audit's token population: a digest of exactly which tokens were scored, and how.

Two tables of ΔPPL or KL can be set side by side only when they were measured on the same tokens with the same
windows: the same tokenizer and text, the same window, stride and BOS rule, the same token budget. The digest names
that, apart from the model (a baseline key, ``tasks.audit.reference.baseline_key``, adds the model's files and dtype):
printed under the table, recorded in MLflow, the report and the model card, and required to match where ``compare``
sets two audits side by side.
"""

from __future__ import annotations

import hashlib
import json

from tasks.audit.reference import stream_digest
from tasks.data.evaluation import Evaluation


def population(scored: Evaluation, tokenizer: str | None) -> dict:
    """``digest`` (16 hex digits) and the facts it digests: ``tokenizer`` (its digest, ``tokenizer_digest``) and what
    tokenized (``tokenized_by``: transformers, or llama.cpp's tokenizer of a file), ``text`` (the corpus's digest),
    ``stream`` (the scored ids, the prefix of every window, the BOS id: ``stream_digest``), ``mode``, ``window``,
    ``stride``, ``bos``, ``max_tokens``, ``chunks`` and the ``tokens`` scored."""
    settings, stream = scored.settings, scored.stream
    facts = {"tokenizer": tokenizer, "tokenized_by": scored.tokenized_by, "text": stream.text_digest,
             "stream": stream_digest(stream), "mode": settings.mode, "window": settings.window,
             "stride": settings.stride if settings.mode == "sliding" else settings.window, "bos": stream.bos,
             "max_tokens": settings.max_tokens, "chunks": settings.chunks, "tokens": int(stream.ids.numel())}
    return {"digest": hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]} | facts
