"""A tune's kept gains (``tasks.audit.recipe.measure``: ``<cache>/tune/gains-*.json``), written and read back: each
unit's ``Choice`` at each option as measured alone, one row a choice under ``choices``. This module alone knows the
rows' keys."""

from __future__ import annotations

from tasks.audit.recipe.choose import Choice


def rows_of(choices: list[Choice]) -> list[dict]:
    """The choices as the entry keeps them."""
    return [{"unit": c.unit, "option": c.option, "cost": c.cost, "gain": c.gain, "share": list(c.share)}
            for c in choices]


def choices_of(entry: dict) -> list[Choice]:
    """The choices an entry keeps (``rows_of``'s)."""
    return [Choice(c["unit"], c["option"], c["cost"], c["gain"], tuple(c["share"])) for c in entry["choices"]]
