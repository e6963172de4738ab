"""How an audit's token population (``tasks.audit.population``) is shown under its table."""

from __future__ import annotations

from tasks.record.reference_said import Population


def population_line(found: dict) -> str:
    """One line naming the population under a table."""
    said = Population.of_record(found)
    stride = f", stride {said.stride}" if said.mode == "sliding" else f" ({said.mode} chunks)"
    return (f"token population {said.digest}: {said.tokens:,} tokens of text {said.text[:12]}, "
            f"tokenizer {str(said.tokenizer)[:12]} ({said.tokenized_by}), window {said.window}{stride}, "
            f"BOS {said.bos}, max_tokens {said.max_tokens or 'all'}")
