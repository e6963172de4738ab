"""Pictures of an audit, for MLflow and the HTML report, in one colour scheme: a model's colour is its verdict.

First the chart a reviewer needs: ΔPPL % per variant with its paired 95% interval against the variant's own
gate limit; then PPL per model on a zero-based axis, size against quality (ΔPPL and KL against bits per
weight and MiB, the front drawn), ΔNLL per window and per-token KL divergence. Each variant's
own run has where in the text it loses (``where_chart``).

Figures are ``matplotlib.figure.Figure`` objects made without pyplot, so no backend is chosen for the whole
process (a worker's or a notebook's stays as it was) and nothing needs closing; ``MlflowClient.log_figure``
takes them, ``png`` renders one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from tasks.config import Gate
from tasks.record.entry_said import ModelSaid, RecordSaid, WhereGroup
from tasks.record.row import Interval, ModelRow
from tasks.record.verdict import gate_checks
from tasks.record.verdict_said import said as said_as

BASELINE_COLOUR, ERROR_COLOUR = "#1565c0", "#9e9e9e"  # the baseline's (its PPL line too); a model no verdict colours
FAIL_COLOUR = "#c62828"  # a failing verdict's, and a variant's line in diagnosis and tune charts
COLOURS = {"baseline": BASELINE_COLOUR, "pass": "#2e7d32", "fail": FAIL_COLOUR, "error": ERROR_COLOUR,
           "ungated": "#f9a825"}
LIMIT_COLOUR = "#212121"
DPI = 130  # with 11-inch figures: about 1400 pixels wide, legible when MLflow's viewer scales them down
WIDTH = 11
TEXT, SMALL, TITLE = 11, 10, 13  # points
LINE_STYLES = ("-", "--", ":", "-.")  # tells apart variants that share a verdict's colour


def said_of(record: dict | RecordSaid) -> RecordSaid:
    """A record as the charts and the report read it: read once, where a public function takes it as plain data
    (the charts and the report pass on what they read)."""
    return record if isinstance(record, RecordSaid) else RecordSaid.of_record(record)


def model_of(entry: dict | ModelSaid) -> ModelSaid:
    """A model's entry of a record, typed (``said_of``'s, for one entry)."""
    return entry if isinstance(entry, ModelSaid) else ModelSaid.alone(entry)


def verdict_of(entry: dict | ModelSaid) -> str:
    """A model's verdict as its colour and label say it: ``baseline``, ``pass``, ``fail`` or ``error``
    (a baseline that was not scored, or a variant that was not judged, is an error)."""
    model = model_of(entry)
    if model.role == "baseline":
        return "baseline" if model.status == "ok" else "error"
    return (model.verdict.status if model.verdict else None) or "error"


def gate_of(said: RecordSaid, name: str) -> Gate:
    """Variant ``name``'s gate (its own overrides, else the audit's). In an audit of several domains, the gate of the
    variant's worst domain: the one its figures at the top come from (a domain's config holds its own gate,
    ``per_corpus``)."""
    domain = next((model.domain for model in said.models if model.name == name), None)
    return said.domains.get(domain, said).thresholds.for_variant(name)


def ppl_limit(record: dict | RecordSaid, name: str) -> float | None:
    """The gate's ``max_ppl_increase_pct`` for variant ``name`` (``gate_of``), or None."""
    return gate_of(said_of(record), name).max_ppl_increase_pct


def gates_said(said: RecordSaid, model: ModelSaid) -> list[tuple[str, str, str]]:
    """``(gate's name, status, reason)`` of each limit of a scored variant's gate (``tasks.record.verdict``); none
    for the baseline, a model not scored, or a row that lacks a gated figure (its verdict's reason says why)."""
    if model.role != "variant" or not model.row.ok:
        return []
    return gate_checks(model.row, gate_of(said, model.name))


def verdict_label(said: RecordSaid, model: ModelSaid) -> str:
    """A model's verdict as a chart of one figure names it: with the gates it did not pass (``fail: top-1
    agreement``), so that a chart of ΔPPL or of KL does not read as if its own figure failed."""
    verdict = verdict_of(model)
    missed = [what for what, status, _ in gates_said(said, model) if status != "pass"]
    return f"{verdict}: {', '.join(missed)}" if missed and verdict != "pass" else verdict


def measured(value) -> bool:
    """A figure that was computed: a number, not None, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def charts(record: dict | RecordSaid, folder: Path) -> dict[str, Figure]:
    """Every chart of an audit by its artifact name, in reading order (the names sort in that order too).

    Args:
        record: the audit's record (``tasks.record.contents.audit_record``).
        folder: the record's folder, which holds the per-token Parquet files.
    """
    said = said_of(record)
    found = {"delta_ppl_pct.png": delta_ppl_chart(said), "ppl_by_model.png": ppl_chart(said)}
    costed = {"size_quality.png": size_quality_chart(said)} if _costed(said) else {}  # no sizes: nothing to draw
    return found | costed | {"token_kld_histogram.png": kld_histogram(said, folder),
                             "window_delta_nll.png": delta_nll_per_window(said, folder)}


def pictures(record: dict | RecordSaid, folder: Path) -> dict[str, bytes]:
    """Every chart of ``charts`` as PNG bytes, in the same order: drawn once for the audit's run and its report
    (drawing them is about a third of the CPU that recording an audit takes). An audit of several domains has
    ``delta_ppl_by_domain.png`` first, then each domain's charts under ``DOMAIN/``: each domain is its own token
    stream, so every chart of a one-corpus audit is drawn for each."""
    said = said_of(record)
    if not said.domains:  # one corpus: its charts are the audit's
        return {name: png(figure) for name, figure in charts(said, folder).items()}
    found = {"delta_ppl_by_domain.png": png(delta_ppl_by_domain_chart(said))}
    for domain, view in said.domains.items():
        found |= {f"{domain}/{name}": png(figure) for name, figure in charts(view, folder).items()}
    return found


def title_name(said: RecordSaid) -> str:
    """The audit's name as a chart's title says it: with the domain, for one domain's of an audit of several."""
    return f"{said.result.name} · {said.domain}" if said.domain else said.result.name


def _audit_said(said: RecordSaid) -> str:
    """The audit's verdict as a chart's title says it: ``PASS``, ``NO GATE``."""
    return said.result.verdict.said.upper()


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes, at its own resolution."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def delta_ppl_chart(record: dict | RecordSaid) -> Figure:
    """ΔPPL % of each variant against the baseline: a bar per variant, top to bottom in the config's order.

    A bar's colour is the variant's verdict; its whiskers span the paired 95% interval; a dashed tick marks the
    variant's own gate limit (``max_ppl_increase_pct``, which ``per_variant`` may change), or an arrow at the
    right edge when the limit lies far beyond every figure. Above each bar: the estimate, its interval and the
    limit; a variant without figures says why instead.
    Returns the figure.
    """
    said = said_of(record)
    variants = said.variants
    figure, axis = _rows_figure([model.name for model in variants])
    low, high = _delta_range(said, variants)
    shown = set()  # what the legend explains: only what the chart holds
    for y, model in enumerate(variants):
        _delta_slot(axis, y, said, model, (high, shown))
    handles = _verdict_handles(variants) + _delta_marks(shown)
    axis.axvline(0, color="black", linewidth=1)
    axis.set_xlim(low, high)
    axis.set_xlabel("ΔPPL % against the baseline (bar: estimate, whiskers: paired 95% interval)", fontsize=TEXT)
    return titled(figure, f"{title_name(said)}: ΔPPL % per variant · "
                          f"{_audit_said(said)}", handles)


def delta_ppl_by_domain_chart(said: RecordSaid) -> Figure:
    """ΔPPL % of each variant on each domain of an audit of several: a group per domain (its name in bold, its
    verdict), in it a slot per variant, top to bottom in the config's order, as ``delta_ppl_chart`` draws it but
    with no bar: a diamond for the estimate, whiskers for its paired 95% interval, coloured by the variant's verdict
    on that domain, and that domain's gate limit for the variant (``per_corpus`` may change it). Returns the figure.
    """
    views = list(said.domains.values())
    slots = []  # (domain's record, variant's entry there, or None for the domain's header)
    for view in views:
        slots += [(view, None)] + [(view, model) for model in view.variants]
    figure, axis = _rows_figure([view.domain if model is None else model.name for view, model in slots])
    ranges = [_delta_range(view, view.variants) for view in views]
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    shown = set()
    for y, (view, model) in enumerate(slots):
        if model is not None:
            _delta_slot(axis, y, view, model, (high, shown), bar=False)
            continue
        axis.get_yticklabels()[y].set_fontweight("bold")
        verdict = view.result.verdict.status
        axis.text(0.005, y, f"domain {view.domain}: {said_as(verdict).upper()}", transform=axis.get_yaxis_transform(),
                  va="center", fontsize=SMALL, fontweight="bold", color=COLOURS[verdict], parse_math=False)
        if y:  # a rule between domains
            axis.axhline(y - 0.55, color="#9e9e9e", linewidth=1)
    handles = _verdict_handles([model for _, model in slots if model is not None]) + _delta_marks(shown)
    axis.axvline(0, color="black", linewidth=1)
    axis.set_xlim(low, high)
    axis.set_xlabel("ΔPPL % against the baseline on the domain (diamond: estimate, whiskers: paired 95% interval)",
                    fontsize=TEXT)
    return titled(figure, f"{said.result.name}: ΔPPL % by domain · {_audit_said(said)}",
                  handles)


def _delta_slot(axis: Axes, y: int, said: RecordSaid, model: ModelSaid, drawn: tuple[float, set],
                bar: bool = True) -> None:
    """Slot ``y`` of a ΔPPL chart: ``model``'s estimate (a bar unless ``bar`` is false) and interval, its gate limit
    in ``said`` and a line of text above; ``drawn``: the axis's right end and the set of what the legend explains,
    added to."""
    high, shown = drawn
    pct, verdict, limit = model.row.figure("delta_ppl_pct"), verdict_of(model), ppl_limit(said, model.name)
    limit_text = _draw_limit(axis, y, limit, high, shown)
    if pct is None or not measured(pct.value):
        axis.plot(0, y + 0.2, marker="X", markersize=12, color=COLOURS[verdict], zorder=4)
        _note(axis, y, f"{verdict}: {_why(model)} · {limit_text}", verdict)
        return
    delta = pct.value
    interval = delta if pct.low is None else pct.low, delta if pct.high is None else pct.high
    if bar:
        axis.barh(y + 0.2, delta, height=0.4, color=COLOURS[verdict], zorder=2)
    axis.errorbar(delta, y + 0.2, xerr=[[delta - interval[0]], [interval[1] - delta]], fmt="D", markersize=7,
                  color=COLOURS[verdict], markeredgecolor="black", ecolor="black", capsize=6, linewidth=1.6,
                  zorder=3)  # the diamond shows an estimate too close to zero for its bar to be seen
    shown.add("interval")
    _note(axis, y, f"{delta:+z.2f}% [{interval[0]:+z.2f}, {interval[1]:+z.2f}]   "
                   f"{_delta_verdict(said, model, limit_text)}", verdict)


# a ΔPPL gate's status (``tasks.record.verdict``) as its slot says it
PPL_SAID = {"pass": "within", "fail": "breaks", "noise": "is inside the noise of", "unjudged": "cannot be judged against"}


def _delta_verdict(said: RecordSaid, model: ModelSaid, limit_text: str) -> str:
    """A ΔPPL slot's verdict: a pass with its limit; any other verdict with what its ΔPPL did against its limit and
    which other gate failed it (``fail: ΔPPL within the limit ≤ 2%; top-1 agreement 0.8700 […] breaks the limit ≥
    0.9``): "fail, limit ≤ 2%" beside a ΔPPL within 2% read as if the ΔPPL had failed."""
    verdict = verdict_of(model)
    if verdict in ("pass", "ungated"):
        return f"{verdict}, {limit_text}"
    checks = gates_said(said, model)
    ppl = next((status for what, status, _ in checks if what == "ΔPPL"), None)
    said = [limit_text if ppl is None else f"ΔPPL {PPL_SAID[ppl]} the {limit_text}"]
    others = [reason for what, status, reason in checks if what != "ΔPPL" and status != "pass"]
    if not others and ppl in (None, "pass"):  # not a gate's figure: what kept it from a verdict
        others = [_why(model)]
    return f"{verdict}: {'; '.join(said + others)}"


def _delta_marks(shown: set) -> list:
    """The legend's lines for what a ΔPPL chart drew (``shown``): the interval, the limit, a limit beyond the axis."""
    marks = {"interval": Line2D([], [], color="black", marker="D", markerfacecolor="white", markersize=7,
                                linewidth=1.6, label="estimate, paired 95% interval"),
             "limit": Line2D([], [], color=LIMIT_COLOUR, linestyle="--", linewidth=2.2,
                             label="gate limit (max ΔPPL %)"),
             "beyond": Line2D([], [], color=LIMIT_COLOUR, marker=">", linestyle="none", markersize=9,
                              label="gate limit beyond the axis")}
    return [line for key, line in marks.items() if key in shown]


def size_quality_chart(record: dict | RecordSaid) -> Figure:
    """What each variant costs against what it loses: ΔPPL % (whiskers: its paired 95% interval) and mean KL
    against bits per weight and against MiB in memory, a point per variant coloured by its verdict; a dominated
    variant hollow, the front (``tasks.record.dominance``) joined by a line. Returns the figure."""
    said = said_of(record)
    costed = _costed(said)
    points = [SizePoint(model.name, model.row.measured.bits_per_weight, model.row.measured.weight_mib,
                        *(_ends(model.row.figure(key)) for key in ("delta_ppl_pct", "kld_mean")),
                        COLOURS[verdict_of(model)], bool(model.row.dominated_by), kv=model.row.measured.kv_bytes_per_token)
              for model in costed]
    sizes = SIZES + (KV_SIZE,) * any(model.row.measured.kv_cache for model in costed)  # where a variant sets a cache
    return titled(size_quality_figure(points, sizes), f"{title_name(said)}: size against quality · "
                   f"{_audit_said(said)}", _verdict_handles(costed) + FRONT_HANDLES)


@dataclass
class SizePoint:
    """A variant on a size-against-quality chart: its costs, its ΔPPL % and mean KL each with its interval."""

    label: str
    bpw: float
    mib: float
    delta: tuple[float, float, float]  # estimate, low, high
    kld: tuple[float, float, float]
    colour: str
    dominated: bool
    past: bool = False  # of an earlier audit: drawn grey, behind
    kv: float = math.nan  # bytes a token's keys and values take in its cache


PAST_COLOUR = "#bdbdbd"
FRONT_COLOUR = "#757575"
FRONT_HANDLES = [Line2D([], [], color=FRONT_COLOUR, linewidth=1.2, label="front: none smaller is better"),
                 Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="none", markersize=9,
                        label="dominated: more bits, worse beyond noise")]
SIZES = (("bpw", "bits per weight of the quantized layers (scales and zeros included)"),
         ("mib", "MiB of weights in memory after load"))
KV_SIZE = ("kv", "bytes of keys and values per token (KV cache)")
QUALITIES = (("delta", "ΔPPL % against the baseline (95% interval)"), ("kld", "mean KL(baseline ‖ variant), nats/token"))


def size_quality_figure(points: list[SizePoint], sizes: tuple = SIZES) -> Figure:
    """ΔPPL % and mean KL (rows) against bits per weight and MiB (columns), untitled: a point per ``SizePoint``
    with its interval, dominated ones hollow, past ones (``points`` holds them first) grey and behind, the front of
    the undominated joined on the bits-per-weight side (what dominance is decided on). ``sizes``: the columns."""
    figure = Figure(figsize=(WIDTH * len(sizes) / 2, 8.6), dpi=DPI, layout="constrained")
    for axis, (size, size_label), (quality, quality_label) in zip(
            figure.subplots(2, len(sizes)).flat, [s for q in QUALITIES for s in sizes], [q for q in QUALITIES for _ in sizes]):
        shown, taken = [], set()
        for point in reversed(points):  # newest first: a past point where a newer one stands is not drawn again
            at = (repr(getattr(point, size)), repr(getattr(point, quality)[0]))
            if measured(getattr(point, size)) and measured(getattr(point, quality)[0]) and not (point.past and at in taken):
                shown.insert(0, point)
                taken.add(at)
        front = sorted((p for p in shown if not p.dominated), key=lambda p: getattr(p, size))
        if len(front) > 1 and size == "bpw":  # dominance is decided on bits per weight
            axis.plot([getattr(p, size) for p in front], [getattr(p, quality)[0] for p in front], color=FRONT_COLOUR,
                      linewidth=1.2, zorder=1)
        for point in shown:
            x, (y, low, high) = getattr(point, size), getattr(point, quality)
            colour = PAST_COLOUR if point.past else point.colour
            whiskers = [[y - low], [high - y]] if measured(low) else None
            axis.errorbar(x, y, yerr=whiskers, fmt="o", markersize=6 if point.past else 9, capsize=4, color=colour,
                          markerfacecolor="white" if point.dominated else colour, markeredgewidth=2,
                          zorder=2 if point.past else 3)
            axis.annotate(point.label, (x, y), textcoords="offset points", xytext=(7, 5), annotation_clip=False,
                          fontsize=SMALL - 1 if point.past else SMALL, color="#757575" if point.past else "black")
        axis.axhline(0, color="black", linewidth=0.8)
        axis.set_xlabel(size_label, fontsize=SMALL)
        axis.set_ylabel(quality_label, fontsize=SMALL)
        axis.grid(color="#e0e0e0", zorder=0)
        axis.tick_params(labelsize=SMALL)
        axis.margins(x=0.25, y=0.15)
    return figure


def _ends(figure: Interval | None) -> tuple[float, float, float]:
    """A figure's estimate, low and high end, NaN where not measured: a point of ``size_quality_figure``."""
    if figure is None:
        return math.nan, math.nan, math.nan
    return tuple(math.nan if end is None else end for end in (figure.value, figure.low, figure.high))


def _costed(said: RecordSaid) -> list[ModelSaid]:
    """The variants with both a cost (bits per weight) and a ΔPPL: the points of ``size_quality_chart``."""
    return [model for model in said.variants if model.row.measured is not None
            and measured(model.row.measured.bits_per_weight) and measured(model.row.delta_ppl_pct)]


def _draw_limit(axis, y: int, limit: float | None, high: float, shown: set) -> str:
    """Draw slot ``y``'s gate limit: a dashed tick across its bar, or an arrow at the right edge when the limit
    lies beyond the axis (``high``); adds what was drawn to ``shown`` and returns the limit in words."""
    if limit is None:
        return "no ΔPPL limit"
    if limit <= high:
        axis.vlines(limit, y, y + 0.42, colors=LIMIT_COLOUR, linestyles="--", linewidth=2.2, zorder=4)
        shown.add("limit")
        return f"limit ≤ {limit:g}%"
    axis.plot(0.99, y + 0.2, marker=">", markersize=11, color=LIMIT_COLOUR, zorder=4,
              transform=axis.get_yaxis_transform(), clip_on=False)
    shown.add("beyond")
    return f"limit ≤ {limit:g}% (beyond the axis →)"


def _delta_range(said: RecordSaid, variants: tuple[ModelSaid, ...]) -> tuple[float, float]:
    """The ΔPPL axis: zero, every estimate and interval, and the limits that leave the figures a fifth of
    the axis at least, with a margin on both sides."""
    pcts = [model.row.figure("delta_ppl_pct") for model in variants]
    figures = [0.0] + [end for pct in pcts if pct is not None for end in (pct.value, pct.low, pct.high) if measured(end)]
    low, high = min(figures), max(figures)
    width = (high - low) or 1.0
    limits = [x for x in (ppl_limit(said, model.name) for model in variants) if x is not None and x <= high + 4 * width]
    high = max([high, *limits])
    margin = 0.06 * (high - low or 1.0)
    return low - margin, high + margin


def ppl_chart(record: dict | RecordSaid) -> Figure:
    """Perplexity ± standard error of every model on a zero-based axis, coloured by verdict (baseline blue),
    each value written above its bar and the baseline's drawn across as a dashed line. Returns the figure."""
    said = said_of(record)
    models = said.models
    figure, axis = _rows_figure([model.name for model in models])
    top = 0.0
    base = None  # the baseline's perplexity, where it was measured
    for y, model in enumerate(models):
        ppl, verdict = _ppl(model.row), verdict_of(model)
        if ppl is None:
            axis.plot(0, y + 0.2, marker="X", markersize=12, color=COLOURS[verdict], zorder=4, clip_on=False)
            _note(axis, y, f"{verdict}: {_why(model)}", verdict)
            continue
        value, error = ppl
        base = value if base is None and model.role == "baseline" else base
        axis.barh(y + 0.2, value, height=0.4, color=COLOURS[verdict], zorder=2)
        axis.errorbar(value, y + 0.2, xerr=error, fmt="none", ecolor="black", capsize=6, linewidth=1.6, zorder=3)
        top = max(top, value + error)
        _note(axis, y, f"PPL {value:.4f} ± {error:.4f}   {verdict_label(said, model)}", verdict)
    handles = _verdict_handles(models)
    if base is not None:
        axis.axvline(base, color=BASELINE_COLOUR, linestyle="--", linewidth=1.4, zorder=1)
        handles.append(Line2D([], [], color=BASELINE_COLOUR, linestyle="--", label="baseline PPL"))
    axis.set_xlim(0, 1.1 * top or 1)  # zero-based: a bar's length is its perplexity
    axis.set_xlabel("perplexity (whiskers: ± 1 standard error)", fontsize=TEXT)
    return titled(figure, f"{title_name(said)}: perplexity per model", handles)


def _ppl(row: ModelRow) -> tuple[float, float] | None:
    """A model's perplexity and its standard error (0 where it has none); None where it was not measured."""
    if row.measured is None or not measured(row.measured.ppl):
        return None
    return row.measured.ppl, row.measured.ppl_stderr if measured(row.measured.ppl_stderr) else 0.0


def delta_nll_per_window(record: dict | RecordSaid, folder: Path) -> Figure:
    """Mean NLL per window of each scored variant minus the baseline's, window by window, coloured by verdict.
    Returns the figure."""
    said = said_of(record)
    figure = Figure(figsize=(WIDTH, 4.6), dpi=DPI, layout="constrained")
    axis = figure.add_subplot()
    base = next((model for model in said.models if model.role == "baseline" and model.arrays), None)
    if base is not None:
        reference = _window_nll(folder, base)
        for style, model in _scored_variants(said):
            change = _window_nll(folder, model) - reference
            axis.plot(change.index, change, color=COLOURS[verdict_of(model)], linestyle=style, linewidth=1.5,
                      label=_model_label(said, model))
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xlabel("window", fontsize=TEXT)
    axis.set_ylabel("ΔNLL against the baseline (nats/token)", fontsize=TEXT)
    axis.tick_params(labelsize=TEXT)
    return titled(figure, f"{title_name(said)}: change per window against the baseline",
                   axis.get_legend_handles_labels()[0])


def kld_histogram(record: dict | RecordSaid, folder: Path) -> Figure:
    """Distribution of per-token KL(baseline ‖ variant) on log axes, an outline per variant coloured by verdict.
    Returns the figure."""
    import numpy as np
    import pyarrow.parquet as pq

    said = said_of(record)
    figure = Figure(figsize=(WIDTH, 4.6), dpi=DPI, layout="constrained")
    axis = figure.add_subplot()
    for style, model in _scored_variants(said):
        table = pq.read_table(folder / model.arrays)
        if "kl" not in table.column_names:
            continue
        kl = np.clip(table.column("kl").to_numpy(), 1e-8, None)  # exact zeros cannot sit on a log axis
        axis.hist(kl, bins=np.logspace(-8, max(1, np.log10(kl.max()) + 0.1), 60), histtype="step", linewidth=1.6,
                  color=COLOURS[verdict_of(model)], linestyle=style, label=_model_label(said, model))
    axis.set_xscale("log")
    axis.set_xlabel("KL(baseline ‖ variant) per token (nats)", fontsize=TEXT)
    axis.set_ylabel("tokens", fontsize=TEXT)
    axis.tick_params(labelsize=TEXT)
    return titled(figure, f"{title_name(said)}: per-token KL divergence", axis.get_legend_handles_labels()[0])


def _rows_figure(names: list[str]) -> tuple[Figure, Axes]:
    """A figure with a horizontal slot per model (``names``), named on the left, the first on top: a line of text
    above a bar."""
    n = len(names)
    figure = Figure(figsize=(WIDTH, 1.8 + 0.85 * max(n, 1)), dpi=DPI, layout="constrained")
    axis = figure.add_subplot()
    axis.set_yticks(range(n), labels=names)
    axis.set_ylim(max(n, 1) - 0.45, -0.45)
    axis.tick_params(labelsize=TEXT)
    axis.grid(axis="x", color="#e0e0e0", zorder=0)
    return figure, axis


def _note(axis, y: int, text: str, verdict: str) -> None:
    """Text above slot ``y``'s bar, from the left edge of the plot, where no bar, whisker or limit reaches."""
    axis.text(0.005, y - 0.17, text, transform=axis.get_yaxis_transform(), va="center", fontsize=SMALL,
              color="#424242" if verdict == "error" else "black", zorder=5, parse_math=False)  # a path's "$" is text


def titled(figure: Figure, title: str, handles: list) -> Figure:
    """Figure title above, legend below, both outside the plot (which stays clear); returns the figure."""
    figure.suptitle(title, fontsize=TITLE)
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=SMALL,
                      frameon=False)
    return figure


def _verdict_handles(models: list[ModelSaid] | tuple[ModelSaid, ...]) -> list:
    """A legend patch per verdict among ``models``, in a fixed order."""
    present = {verdict_of(model) for model in models}
    return [Patch(color=COLOURS[v], label=said_as(v)) for v in COLOURS if v in present]


def _why(model: ModelSaid) -> str:
    """Why a model has no figures, cut to fit one line of a chart."""
    reason = (model.verdict.reason if model.verdict else None) or model.reason or "not scored"
    return reason if len(reason) <= 90 else reason[:89] + "…"


def _model_label(said: RecordSaid, model: ModelSaid) -> str:
    return f"{model.name} ({verdict_label(said, model)})"


def _scored_variants(said: RecordSaid) -> list[tuple[str, ModelSaid]]:
    """(line style, model) of every variant with per-token figures; styles tell apart variants of one colour."""
    scored = [model for model in said.variants if model.arrays]
    return [(LINE_STYLES[i % len(LINE_STYLES)], model) for i, model in enumerate(scored)]


def _window_nll(folder: Path, model: ModelSaid):
    """Mean NLL per window of one model (a pandas Series by window index)."""
    import pandas as pd
    import pyarrow.parquet as pq

    table = pq.read_table(folder / model.arrays, columns=["window", "nll"])
    return pd.Series(table.column("nll").to_numpy()).groupby(table.column("window").to_numpy()).mean()


def where_chart(entry: dict | ModelSaid, domain: str | None = None) -> Figure:
    """Where a variant loses (its entry's ``where``, ``tasks.record.where``): its ΔNLL (top) and KL (bottom) against
    the baseline by the token's position in its window (left) and by the baseline's top-1 probability (right); a bar
    per bin in the variant's verdict colour, whiskers its 95% interval (over windows), its tokens under it. A variant
    without KL has ΔNLL by position only. ``domain``: the text's, in an audit of several. Returns the figure."""
    model = model_of(entry)
    where, colour = model.where, COLOURS[verdict_of(model)]
    groups = (("position in the window (tokens of context)", where.by_position, position_label),
              ("baseline's top-1 probability", where.by_confidence or (), confidence_label))
    figures = ((lambda group: group.delta_nll, "ΔNLL (nats/token)"),
               (lambda group: group.kl, "KL(baseline ‖ variant) (nats/token)"))
    figure = Figure(figsize=(WIDTH, 7.6), dpi=DPI, layout="constrained")
    axes = figure.subplots(len(figures), len(groups), squeeze=False)
    for column, (title, rows, label) in enumerate(groups):
        ticks = [f"{label(row)}\n{row.tokens:,} tok" for row in rows]
        for line, (of, name) in enumerate(figures):
            axis = axes[line][column]
            _bins_axis(axis, [of(row) for row in rows], colour)
            axis.set_xticks(range(len(rows)), labels=ticks, fontsize=SMALL - 1 if len(rows) > 6 else SMALL)
            axis.set_ylabel(name, fontsize=SMALL)
            axis.set_xlabel(title, fontsize=SMALL)
    verdict = verdict_of(model)  # a verdict other than a pass with its reason: this chart's figures may not be why
    said = verdict if verdict in ("pass", "ungated") else f"{verdict}: {_why(model)}"
    handles = [Patch(color=colour, label=f"{model.name} ({said}): mean over the bin's tokens"),
               Line2D([], [], color="black", linewidth=1.6, label=where.interval)]
    on = f" on {domain}" if domain else ""
    return titled(figure, f"{model.name}: where in the text{on} it loses against the baseline", handles)


def position_label(group: WhereGroup) -> str:
    """A position bin of ``where`` as the positions it holds, first and last (here and in the report)."""
    return f"{group.low}–{group.high - 1}"


def confidence_label(group: WhereGroup) -> str:
    """A bin of the baseline's top-1 probability of ``where`` as its bounds (here and in the report)."""
    return f"{group.low:g}–{group.high:g}"


def _bins_axis(axis: Axes, figures: list[Interval], colour: str) -> None:
    """A bar per bin with its figure (ΔNLL or KL) and whiskers to its interval; a bin without tokens or without the
    figure is left empty, an axis without any says so."""
    shown = [(x, found) for x, found in enumerate(figures) if measured(found.value)]
    for x, found in shown:
        value = found.value
        low, high = (found.low, found.high) if measured(found.low) else (value, value)
        axis.bar(x, value, width=0.6, color=colour, zorder=2)
        axis.errorbar(x, value, yerr=[[value - low], [high - value]], fmt="none", ecolor="black", capsize=5,
                      linewidth=1.6, zorder=3)
    if not shown:
        axis.text(0.5, 0.5, "not measured", transform=axis.transAxes, ha="center", va="center", fontsize=TEXT,
                  color="#616161")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.grid(axis="y", color="#e0e0e0", zorder=0)
    axis.tick_params(labelsize=SMALL)
