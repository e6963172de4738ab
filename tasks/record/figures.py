"""The figures a gate judges, each declared once: what a comparison row calls it, the ``Gate`` limit that judges it,
how a verdict, a table and the model card write it. The gate (``tasks.record.verdict``), preflight, a sequential
run, the card and the report read them from here, so that a new gated figure is this line, its ``Gate`` field and
the code that measures it.

And the per-model figures every view shows beside them (``SHOWN``): a new one is its line here, its field in the
typed row (``tasks.record.row``) and the code that measures it; ``--stats full``, MLflow, the report and the card
read them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


Text = Callable[[float], str]  # a figure as a view writes it


def kl_text(value: float, sign: str = "") -> str:
    """A KL figure as every view gives it (the console, report.html, compare, the card, MLflow's description): four
    decimals, or two significant digits where those would show next to nothing (a float16 floor of a small model is
    ~1e-5, which four decimals print as 0.0000). ``sign``: ``+`` for a difference."""
    return f"{value:{sign}z.4f}" if abs(value) >= 0.001 or value == 0 else f"{value:{sign}.2g}"


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


@dataclass(frozen=True)
class Shown:
    """A per-model figure with its 95% interval that every view shows where it was measured: the record and
    ``--json`` (as every figure of a row), ``--stats full``, MLflow's metrics, the report and the card.

    Attributes:
        name: how a view names it ("confident flips").
        key: the comparison row's (``tasks.record.row.ModelRow.figure``), and MLflow's metric.
        shown: the figure as a view writes it; ``unit`` after it.
        about: one line on what it is, under the card's and the report's table of them.
    """

    name: str
    key: str
    shown: Text
    unit: str
    about: str

    def text(self, value: float, low: float | None, high: float | None) -> str:
        """The figure and its interval as every view writes them (the card's gated figures too): ``0.12% [0.05, 0.31]``."""
        bounds = f" [{self.shown(low)}, {self.shown(high)}]" if low is not None and high is not None else ""
        return f"{self.shown(value)}{self.unit}{bounds}"


SHOWN = (
    Shown("confident flips", "confident_flip_rate", fixed(".2f", 100), "%",
          "the share of tokens whose baseline was sure of its top token (probability ≥ 0.9) and whose variant put "
          "another first"),
)
