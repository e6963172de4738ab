"""How an audit's token population (``tasks.audit.population``) is shown under its table."""

from __future__ import annotations


def population_line(found: dict) -> str:
    """One line naming the population under a table."""
    stride = f", stride {found['stride']}" if found["mode"] == "sliding" else f" ({found['mode']} chunks)"
    return (f"token population {found['digest']}: {found['tokens']:,} tokens of text {found['text'][:12]}, "
            f"tokenizer {str(found['tokenizer'])[:12]} ({found['tokenized_by']}), window {found['window']}{stride}, "
            f"BOS {found['bos']}, max_tokens {found['max_tokens'] or 'all'}")
