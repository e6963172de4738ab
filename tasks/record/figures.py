"""The figures a gate judges, each declared once: what a comparison row calls it, the ``Gate`` limit that judges it,
how a verdict, a table and the model card write it. The gate (``tasks.record.verdict``), preflight, a sequential
run, the card and the report read them from here, so that a new gated figure is this line, its ``Gate`` field and
the code that measures it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tasks.record.floor import kl_text

Text = Callable[[float], str]  # a figure as a view writes it


def fixed(form: str, scale: float = 1.0) -> Text:
    """A figure in the format spec ``form`` (the console's), after ``scale`` (100 for a percentage)."""
    return lambda value: format(scale * value, form)


@dataclass(frozen=True)
class Gated:
    """A figure a gate judges on the pessimistic end of its 95% interval (``key_low``, ``key_high`` in a row).

    Attributes:
        name: how a verdict names it ("ΔPPL").
        key: the comparison row's key.
        limit: the ``Gate``'s field that limits it.
        above: whether the limit is a maximum.
        said: the figure in a verdict's reason; ``unit`` after it.
        shown: the figure in a table and the card (the console's digits); ``shown_unit`` after it.
        header: the card's and the report's column; ``card``: the model index's metric type and what its name says.
        divergence: measured against the baseline's logits (KL and top-1): absent where divergence was not.
    """

    name: str
    key: str
    limit: str
    above: bool
    said: Text
    unit: str
    shown: Text
    shown_unit: str
    header: str
    card: tuple[str, str]
    divergence: bool


GATED = (
    Gated("ΔPPL", "delta_ppl_pct", "max_ppl_increase_pct", True, "{:+z.2f}".format, "%", fixed("+z.2f"), "",
          "ΔPPL % [95% CI]", ("delta_ppl_pct", "ΔPPL % against"), divergence=False),
    Gated("KLD mean", "kld_mean", "max_kld_mean", True, kl_text, "", kl_text, "", "KL [95% CI]",
          ("kl_divergence", "mean KL divergence from"), divergence=True),
    Gated("top-1 agreement", "top1_agreement", "min_top1_agreement", False, "{:.4f}".format, "", fixed(".1f", 100), "%",
          "top-1 [95% CI]", ("top1_agreement", "top-1 agreement % with"), divergence=True),
)
